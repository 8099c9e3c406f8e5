"""The inference API shared by ``InputObserver`` (in memory) and ``Bundle`` (from disk)."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch

from iobundle.calls import RecordedCalls, TensorCollector, record_inputs, replace_tensors, tensor_keys
from iobundle.errors import AlignmentError
from iobundle.replay import _inference
from iobundle.replay._dims import StaticDimHint, static_dim_hints
from iobundle.replay._export import ExportReport, export_onnx, export_program
from iobundle.replay._info import ObservationInfo
from iobundle.replay._phases import ProgramSet, ProgramsMode, export_programs
from iobundle.replay._validate import check_discrepancies
from iobundle.schema import CallEntry, Node, TensorNode

if TYPE_CHECKING:
    import onnx

__all__ = ["RecordedCallsAPI"]


class RecordedCallsAPI:
    """Methods over a :class:`RecordedCalls`; subclasses provide ``_recorded()``."""

    def _recorded(self) -> RecordedCalls:
        raise NotImplementedError

    def num_obs(self) -> int:
        """Return the number of successfully recorded calls."""
        return len(self._recorded().ok_calls)

    @property
    def info(self) -> ObservationInfo:
        """Per-call records: ``len(info)``, ``info.inputs``, ``info.flat_outputs``, ``info.latencies``."""
        return ObservationInfo(self._recorded())

    def is_empty(self) -> bool:
        """Return True when no call was recorded successfully."""
        return self.num_obs() == 0

    def infer_dynamic_shapes(
        self,
        set_batch_dimension_for: Collection[int | str] | bool | None = None,
        *,
        dim_names: bool = False,
        dynamic: Mapping[int | str, Collection[int]] | None = None,
    ) -> tuple[Any, ...] | dict[str, Any]:
        """Infer ``dynamic_shapes`` for ``torch.export.export``.

        A dimension is ``Dim.DYNAMIC`` when its size differs across recorded calls.

        Args:
            set_batch_dimension_for: Inputs (names or positions) whose first dimension is dynamic
                even when every call used the same batch size; True for all inputs.
            dim_names: Name each dynamic dimension (``torch.export.Dim``) instead of ``Dim.DYNAMIC``.
            dynamic: Axes to make dynamic even if their size never varied, per input:
                ``{"input_ids": {1}, "cache": {2}}`` (every tensor of the input with that axis).

        Returns:
            A tuple for positional-only calls, otherwise a dict keyed by parameter name.

        Raises:
            AlignmentError: The recorded calls cannot be aligned (the message says why).
            DynamicShapeError: A tensor changes rank across calls, or ``dynamic`` names an unknown input or axis.

        Example:
            >>> observer.infer_dynamic_shapes(set_batch_dimension_for={"input_ids"})
            {'input_ids': {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}, ...}
        """
        return _inference.infer_dynamic_shapes(
            self._recorded(), set_batch_dimension_for, dim_names=dim_names, dynamic=dynamic
        )

    def static_dim_hints(
        self,
        set_batch_dimension_for: Collection[int | str] | bool | None = None,
        *,
        dynamic: Mapping[int | str, Collection[int]] | None = None,
    ) -> list[StaticDimHint]:
        """Axes that look like batch or sequence axes and are static only because no call varied them.

        Each hint names the axes and how to make them dynamic (``hint.message()``).
        See :func:`iobundle.replay._dims.static_dim_hints`.
        """
        return static_dim_hints(self._recorded(), set_batch_dimension_for, dynamic)

    def infer_arguments(
        self,
        index_or_args_or_kwargs: int | tuple[Any, ...] | dict[str, Any] | None = None,
        flat: bool = False,
        as_args_kwargs: bool = False,
    ) -> Any:
        """Infer the arguments to give ``torch.export.export``, absent inputs filled.

        An input absent from the chosen call becomes a tensor whose dynamic dimension is 0
        (or zeros when no dimension is dynamic), shaped like the calls that had it.

        Args:
            index_or_args_or_kwargs: A call index, or new positional (tuple) or keyword (dict)
                inputs to lay out like the recorded calls; by default the first call shaped like
                the one with the most tensors.
            flat: Return the flat list of tensors.
            as_args_kwargs: Always return ``(args, kwargs)``.

        Returns:
            A tuple (positional only), a dict (keywords), or ``(args, kwargs)``.

        Raises:
            AlignmentError: The index is out of range or the calls cannot be aligned.
        """
        rc = self._recorded()
        if index_or_args_or_kwargs is None or isinstance(index_or_args_or_kwargs, int):
            return _inference.infer_arguments(rc, index_or_args_or_kwargs, flat=flat, as_args_kwargs=as_args_kwargs)
        if isinstance(index_or_args_or_kwargs, tuple):
            args, kwargs = index_or_args_or_kwargs, {}
        elif isinstance(index_or_args_or_kwargs, dict):
            args, kwargs = (), index_or_args_or_kwargs
        else:
            raise AlignmentError(
                f"infer_arguments: expected an int, a tuple or a dict, got {type(index_or_args_or_kwargs).__name__}."
            )
        alignment = _inference.align_calls(rc)
        collector = TensorCollector(lambda t: t)
        call = record_inputs(rc, collector, args, kwargs, index=len(rc.calls), on_opaque=_refuse_opaque)
        prefix = "\x01"  # recorded keys never start with it
        extra = {prefix + k: t for k, t in collector.tensors.items()}
        slots = _inference.align_call(rc, alignment, _prefix_keys(call, prefix))
        return _inference.infer_arguments(
            rc, alignment=alignment, slots=slots, extra=extra, flat=flat, as_args_kwargs=as_args_kwargs
        )

    def remove_inputs(self, names: Collection[str] | str) -> None:
        """Remove inputs from every recorded call, as if they had never been passed.

        Raises:
            AlignmentError: A name is unknown, or removing it is impossible because of ``*args``
                (the message names the variadic parameter).
        """
        _inference.remove_inputs(self._recorded(), [names] if isinstance(names, str) else names)

    def export(
        self,
        model: torch.nn.Module,
        *,
        set_batch_dimension_for: Collection[int | str] | bool | None = None,
        strict: bool = False,
        check: bool = True,
        atol: float = 1e-4,
        rtol: float = 0.1,
        dynamic: Mapping[int | str, Collection[int]] | None = None,
    ) -> torch.export.ExportedProgram:
        """Export ``model`` with ``torch.export`` from the recorded calls and check it on every call.

        See :func:`iobundle.replay.export_program`.
        """
        return export_program(
            self._recorded(), model, set_batch_dimension_for=set_batch_dimension_for, strict=strict,
            check=check, atol=atol, rtol=rtol, dynamic=dynamic,
        )  # fmt: skip

    def export_programs(
        self,
        model: torch.nn.Module,
        *,
        programs: ProgramsMode = "auto",
        set_batch_dimension_for: Collection[int | str] | bool | None = None,
        dynamic: Mapping[int | str, Collection[int]] | None = None,
        strict: bool = False,
        check: bool = True,
        atol: float = 1e-4,
        rtol: float = 0.1,
    ) -> ProgramSet:
        """Export one program for every recorded call, or one per phase when one cannot serve them all.

        ``result.to_onnx(path)`` writes the ONNX file, or one per phase and their index.
        See :func:`iobundle.replay.export_programs`.
        """
        return export_programs(
            self._recorded(), model, programs=programs, set_batch_dimension_for=set_batch_dimension_for,
            dynamic=dynamic, strict=strict, check=check, atol=atol, rtol=rtol,
        )  # fmt: skip

    def export_report(self) -> ExportReport | None:
        """The per-call report of the last :meth:`export`, or None."""
        report: ExportReport | None = self._recorded().last_export_report
        return report

    def to_onnx(
        self,
        model: torch.nn.Module,
        path: str | os.PathLike[str],
        *,
        set_batch_dimension_for: Collection[int | str] | bool | None = None,
        strict: bool = False,
        check: bool = True,
        dynamic: Mapping[int | str, Collection[int]] | None = None,
        programs: ProgramsMode = "one",
    ) -> str:
        """Export ``model`` to an ONNX file at ``path`` (through ``torch.export``); return the path.

        With ``programs="auto"``, when one program cannot serve every call, one ONNX file per
        phase is written beside ``path`` with a program index, whose path is returned (see
        :meth:`export_programs`). See :func:`iobundle.replay.export_onnx`.
        """
        if programs != "one":
            return self.export_programs(
                model, programs=programs, set_batch_dimension_for=set_batch_dimension_for, dynamic=dynamic,
                strict=strict, check=check,
            ).to_onnx(path)  # fmt: skip
        return export_onnx(
            self._recorded(), model, path, set_batch_dimension_for=set_batch_dimension_for, strict=strict,
            check=check, dynamic=dynamic,
        )  # fmt: skip

    def check_discrepancies(
        self,
        onnx_model: str | os.PathLike[str] | onnx.ModelProto,
        atol: float = 1e-4,
        rtol: float = 0.1,
        hist: tuple[float, ...] = (0.1, 0.01),
        progress_bar: bool = False,
        include_io: bool = True,
        skip_none: bool = True,
    ) -> list[dict[str, Any]]:
        """Run ``onnx_model`` with onnxruntime on every recorded call and compare with the recorded outputs.

        See :func:`iobundle.replay.check_discrepancies`.
        """
        return check_discrepancies(
            self._recorded(), onnx_model, atol=atol, rtol=rtol, hist=hist, progress_bar=progress_bar,
            include_io=include_io, skip_none=skip_none,
        )  # fmt: skip


def _refuse_opaque(path: str, type_name: str, reason: str) -> None:
    raise AlignmentError(f"infer_arguments: input {path} is a {type_name}: {reason}.")


def _prefix_keys(call: CallEntry, prefix: str) -> CallEntry:
    def rename(node: Node) -> Node:
        return replace_tensors(node, (TensorNode(key=prefix + k) for k in tensor_keys(node)))

    return call.model_copy(
        update={"args": [rename(a) for a in call.args], "kwargs": {k: rename(v) for k, v in call.kwargs.items()}}
    )
