"""The inference API shared by ``InputObserver`` (in memory) and ``Bundle`` (from disk)."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from iobundle._lazy import lazy_module
from iobundle._progress import ProgressCallback
from iobundle.calls import RecordedCalls, TensorCollector, record_inputs, replace_tensors, tensor_keys
from iobundle.errors import AlignmentError, ExportError, InputSelectionError
from iobundle.replay import infer
from iobundle.replay.infer import DimNamesSpec, GroupShapes, InputCandidate, ObservationInfo, StaticDimHint
from iobundle.schema import CallEntry, Node, TensorNode

if TYPE_CHECKING:
    import onnx
    import torch

    from iobundle.replay import check, export
    from iobundle.replay.check import Tolerances, ValidationReport
    from iobundle.replay.export import ExportReport, ExportResult, ProgramSet, ProgramsMode
else:  # exporting and checking need torch (and onnx): opening a bundle does not
    torch = lazy_module("torch", globals())
    check = lazy_module("iobundle.replay.check", globals())
    export = lazy_module("iobundle.replay.export", globals())

__all__ = ["RecordedCallsAPI", "recorded_calls"]

R = TypeVar("R", bound="ExportResult | ProgramSet")


class RecordedCallsAPI:
    """Methods over a :class:`RecordedCalls`; subclasses provide ``_recorded()``."""

    _export_report: ExportReport | None = None

    def _keep_report(self, run: Callable[[], R]) -> R:
        """``run()``, an export whose report (the raised error's on failure) :meth:`export_report` then returns."""
        try:
            result = run()
        except ExportError as exc:
            self._export_report = exc.report
            raise
        if recorded_calls(self, replayed=True) is not self._recorded():
            from iobundle.replay._module_state import state_note

            note = state_note(self._recorded())
            for program in getattr(result, "programs", [result]):  # a ProgramSet merges its programs' reports
                program.report.options += [note] * (note not in program.report.options)
        self._export_report = result.report
        return result

    def _recorded(self) -> RecordedCalls:
        raise NotImplementedError

    def _replayed(self, model: torch.nn.Module | None = None) -> tuple[RecordedCalls, Any]:
        """The calls to export, validate or re-run, and ``model`` to run them: with module state, in its explicit form."""
        rc, replayed = self._recorded(), recorded_calls(self, replayed=True)
        if replayed is rc or model is None:
            return replayed, model
        from iobundle.replay._module_state import WithModuleState

        return replayed, WithModuleState(model, rc)

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
        dim_names: DimNamesSpec = False,
        *,
        dynamic: Mapping[int | str, Collection[int]] | None = None,
    ) -> tuple[Any, ...] | dict[str, Any]:
        """Infer ``dynamic_shapes`` for ``torch.export.export``.

        A dimension is ``Dim.DYNAMIC`` when its size differs across recorded calls.

        With ``dim_names=True`` each dynamic dimension is a name (a string) instead: dimensions
        whose sizes are equal in every recorded call share one name, and well-known inputs get
        conventional names (``batch_size``, ``sequence_length``, ``past_sequence_length`` for the
        key and value cache of every layer, ``total_sequence_length`` for an attention mask, ...),
        recognised from the recorded structure (a transformers cache under any argument name).
        A dict gives names explicitly, by input name or position (``{"input_ids": {0: "batch"}}``;
        a list of dicts for the tensors of a nested input); the dimensions it leaves out are named
        ``<input>_dim_<d>``, and a dimension it names becomes dynamic. ``torch.onnx.export`` takes
        the result as is; :meth:`export` and :meth:`to_onnx` accept the same ``dim_names`` and turn
        each name into one shared ``torch.export.Dim``.

        Args:
            set_batch_dimension_for: Inputs (names or positions) whose batch axis is dynamic
                even when every call used the same batch size; True for all inputs. The batch
                axis is found from the sizes, not assumed to be 0 (:meth:`infer_batch_axes`).
            dim_names: False (``Dim.DYNAMIC``), True (derived names) or a dict of explicit names.
            dynamic: Axes to make dynamic even if their size never varied, per input:
                ``{"input_ids": {1}, "cache": {2}}`` (every tensor of the input with that axis).

        Returns:
            A tuple for positional-only calls, otherwise a dict keyed by parameter name.

        Raises:
            AlignmentError: The recorded calls cannot be aligned (the message says why).
            DynamicShapeError: A tensor changes rank across calls, or ``dynamic`` names an unknown input or axis.
            InputSelectionError: ``dim_names`` names an unknown input or dimension.

        Example:
            >>> observer.infer_dynamic_shapes(set_batch_dimension_for={"input_ids"})
            {'input_ids': {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}, ...}
            >>> observer.infer_dynamic_shapes(set_batch_dimension_for=True, dim_names=True)
            {'input_ids': {0: 'batch_size', 1: 'sequence_length'}, ...}
        """
        return infer.to_torch_dims(self.infer_dynamic_spec(set_batch_dimension_for, dim_names, dynamic=dynamic))

    def infer_dynamic_spec(
        self,
        set_batch_dimension_for: Collection[int | str] | bool | None = None,
        dim_names: DimNamesSpec = False,
        *,
        dynamic: Mapping[int | str, Collection[int]] | None = None,
    ) -> tuple[Any, ...] | dict[str, Any]:
        """Infer the dynamic shapes as :meth:`infer_dynamic_shapes` does, as plain data: no torch needed.

        Each dynamic dimension is :data:`iobundle.replay.DYNAMIC` (iobundle's marker, where
        :meth:`infer_dynamic_shapes` gives ``torch.export.Dim.DYNAMIC``) or, with ``dim_names``,
        its name. Inferring from a bundle this way reads the manifest only (``iobundle shapes``,
        ``iobundle inspect``). The arguments are those of :meth:`infer_dynamic_shapes`.

        Raises:
            AlignmentError: The recorded calls cannot be aligned (the message says why).
            DynamicShapeError: A tensor changes rank across calls, or ``dynamic`` names an unknown input or axis.
            InputSelectionError: ``dim_names`` names an unknown input or dimension.

        Example:
            >>> bundle.infer_dynamic_spec()
            {'input_ids': {1: DYNAMIC}, ...}
        """
        return infer.infer_dynamic_shapes(
            self._recorded(), set_batch_dimension_for, dim_names=dim_names, dynamic=dynamic
        )

    def infer_group_shapes(
        self,
        set_batch_dimension_for: Collection[int | str] | bool | None = None,
        dim_names: DimNamesSpec = False,
        *,
        dynamic: Mapping[int | str, Collection[int]] | None = None,
    ) -> list[GroupShapes]:
        """The dynamic shapes of each group of calls passing the same keyword names, when no call passes them all.

        Such calls (a cross-attention VLM's prefill passes ``pixel_values``, its decode calls the
        image states instead) have no single ``dynamic_shapes``, so :meth:`infer_dynamic_spec`
        refuses them; :meth:`export_programs` exports one program per group. Each
        :class:`~iobundle.replay.infer.GroupShapes` names its calls and keywords
        (``group.describe()``) and holds the shapes inferred from its calls alone, as plain data
        (no torch needed), with the batch axes taken when ``set_batch_dimension_for`` is given. An
        empty list when the calls align on one layout. The arguments are those of
        :meth:`infer_dynamic_shapes`; a name only other groups pass is left out of a group's.

        Raises:
            AlignmentError: The calls cannot be aligned, and not because they pass different keyword names.
            DynamicShapeError: A tensor changes rank across a group's calls, or ``dynamic`` names an unknown axis.
            InputSelectionError: ``dim_names`` names an unknown input or dimension.

        Example:
            >>> {g.group.calls: g.dynamic_shapes for g in bundle.infer_group_shapes()}
            {(0,): {'x': {}, 'image': {}}, (1, 2): {'x': {0: DYNAMIC}, 'states': {0: DYNAMIC}}}
        """
        return infer.infer_group_shapes(self._recorded(), set_batch_dimension_for, dim_names=dim_names, dynamic=dynamic)

    def static_dim_hints(
        self,
        set_batch_dimension_for: Collection[int | str] | bool | None = None,
        *,
        dynamic: Mapping[int | str, Collection[int]] | None = None,
    ) -> list[StaticDimHint]:
        """Axes that look like batch or sequence axes and are static only because no call varied them.

        Each hint names the axes and how to make them dynamic (``hint.message()``).
        See :func:`iobundle.replay.infer.static_dim_hints`; like :meth:`infer_dynamic_spec`, it needs no torch.
        """
        return infer.static_dim_hints(self._recorded(), set_batch_dimension_for, dynamic)

    def infer_batch_axes(
        self, set_batch_dimension_for: Collection[int | str] | bool | None = True
    ) -> list[infer.BatchAxis]:
        """The batch axis ``set_batch_dimension_for`` makes dynamic in each tensor it selects, and why.

        One :class:`~iobundle.replay.infer.BatchAxis` per tensor of the selected inputs (every
        input for True), in flattening order; ``axis`` is None for a tensor without a batch axis
        (left alone). The rule is in :mod:`iobundle.replay.infer._batch`: the axis whose size is
        the batch of ``input_ids`` (or of the first input) in every call.

        Example:
            >>> {a.label: a.axis for a in bundle.infer_batch_axes()}
            {'input_ids': 0, 'position_ids': 1, 'extra': None}
        """
        rc = self._recorded()
        found = infer.batch_axes(rc, infer.align_calls(rc), set_batch_dimension_for)
        return [axis for axis in found if axis is not None]

    def infer_arguments(
        self,
        index_or_args_or_kwargs: int | tuple[Any, ...] | dict[str, Any] | InputCandidate | None = None,
        flat: bool = False,
        as_args_kwargs: bool = False,
    ) -> Any:
        """Infer the arguments to give ``torch.export.export``, absent inputs filled.

        An input absent from the chosen call becomes a tensor whose dynamic dimension is 0
        (or zeros when no dimension is dynamic), shaped like the calls that had it.

        Args:
            index_or_args_or_kwargs: A call index, or new positional (tuple) or keyword (dict)
                inputs to lay out like the recorded calls, or an :class:`InputCandidate` (one of
                ``info.inputs``, or built from values); by default the first call shaped like the
                one with the most tensors.
            flat: Return the flat list of tensors.
            as_args_kwargs: Always return ``(args, kwargs)``.

        Returns:
            A tuple (positional only), a dict (keywords), or ``(args, kwargs)``.

        Raises:
            AlignmentError: The index is out of range or the calls cannot be aligned (a ``RuntimeError``).
            InputSelectionError: ``index_or_args_or_kwargs`` has an unexpected type (a ``ValueError``).
        """
        rc = self._recorded()
        if isinstance(index_or_args_or_kwargs, InputCandidate) and index_or_args_or_kwargs.call is not None:
            index_or_args_or_kwargs = _candidate_index(rc, index_or_args_or_kwargs)
        if index_or_args_or_kwargs is None or isinstance(index_or_args_or_kwargs, int):
            return infer.infer_arguments(rc, index_or_args_or_kwargs, flat=flat, as_args_kwargs=as_args_kwargs)
        if isinstance(index_or_args_or_kwargs, tuple):
            args, kwargs = index_or_args_or_kwargs, {}
        elif isinstance(index_or_args_or_kwargs, dict):
            args, kwargs = (), index_or_args_or_kwargs
        elif isinstance(index_or_args_or_kwargs, InputCandidate):
            candidate = index_or_args_or_kwargs
            args, kwargs = candidate.args, {**candidate.kwargs, **candidate.cst_kwargs}
        else:
            raise InputSelectionError(
                f"Unexpected type {type(index_or_args_or_kwargs).__name__} for index_or_args_or_kwargs of "
                "infer_arguments; pass a call index (int), positional inputs (tuple), keyword inputs (dict) or "
                "an InputCandidate."
            )
        alignment = infer.align_calls(rc)
        collector = TensorCollector(lambda t: t)
        call = record_inputs(rc, collector, args, kwargs, index=len(rc.calls), on_opaque=_refuse_opaque)
        prefix = "\x01"  # recorded keys never start with it
        extra = {prefix + k: t for k, t in collector.tensors.items()}
        slots = infer.align_call(rc, alignment, _prefix_keys(call, prefix))
        return infer.infer_arguments(
            rc, alignment=alignment, slots=slots, extra=extra, flat=flat, as_args_kwargs=as_args_kwargs
        )

    def remove_inputs(self, names: Collection[str | int] | str | int) -> int:
        """Remove inputs (by name, or by position in the signature) from every recorded call, as if never passed.

        Returns:
            How many inputs were removed, summed over the calls (0 when the inputs are parameters
            no call passed, or names that are neither parameters nor recorded inputs: a
            ``UserWarning`` names those, as yobx HEAD returns 0 for them).

        Raises:
            InputSelectionError: A position outside the signature, an item neither a name nor a
                position, or a removal impossible because of ``*args`` (the message names the variadic
                parameter); a ``ValueError`` and an ``AlignmentError``.
        """
        rc = self._recorded()
        selected = [names] if isinstance(names, (str, int)) else list(names)
        as_names = []
        for item in selected:
            if isinstance(item, bool) or not isinstance(item, (str, int)):
                raise InputSelectionError(
                    f"remove_inputs: unexpected type {type(item).__name__} for {item!r}; give names or positions."
                )
            if isinstance(item, int):
                if not 0 <= item < len(rc.names):
                    raise InputSelectionError(
                        f"remove_inputs: position {item} is outside the signature of {rc.signature.qualname} "
                        f"({rc.names})."
                    )
                item = rc.names[item]
            as_names.append(item)
        return infer.remove_inputs(rc, as_names)

    def export(
        self, model: torch.nn.Module, *, set_batch_dimension_for: Collection[int | str] | bool | None = None,
        strict: bool = False, check: bool = True, dim_names: DimNamesSpec = False,
        on_progress: ProgressCallback | None = None, dynamic: Mapping[int | str, Collection[int]] | None = None,
        atol: float = 1e-4, rtol: float = 0.1, output_atol: Mapping[str, float] | None = None,
        output_rtol: Mapping[str, float] | None = None, tolerances: Tolerances | None = None,
    ) -> ExportResult:  # fmt: skip
        """Export ``model`` with ``torch.export`` from the recorded calls and check it on every call.

        Returns the program (``result.program``) and its report (``result.report``).
        ``dim_names`` (see :meth:`infer_dynamic_shapes`) turns each name into one shared
        ``torch.export.Dim``. See :func:`iobundle.replay.export_program`.
        """
        from iobundle.replay.check import Tolerances

        tolerances = tolerances or Tolerances.build(atol, rtol, output_atol, output_rtol)
        return self._keep_report(
            lambda: export.export_program(
                *self._replayed(model), set_batch_dimension_for=set_batch_dimension_for, strict=strict,
                check=check, dim_names=dim_names, on_progress=on_progress, dynamic=dynamic, tolerances=tolerances,
            )
        )  # fmt: skip

    def export_programs(
        self, model: torch.nn.Module, *, programs: ProgramsMode = "auto",
        set_batch_dimension_for: Collection[int | str] | bool | None = None,
        dynamic: Mapping[int | str, Collection[int]] | None = None, strict: bool = False, check: bool = True,
        dim_names: DimNamesSpec = False, on_progress: ProgressCallback | None = None,
        atol: float = 1e-4, rtol: float = 0.1, output_atol: Mapping[str, float] | None = None,
        output_rtol: Mapping[str, float] | None = None, tolerances: Tolerances | None = None,
    ) -> ProgramSet:  # fmt: skip
        """Export one program for every recorded call, or one per phase when one cannot serve them all.

        ``result.to_onnx(path)`` writes the ONNX file, or one per phase and their index.
        ``output_atol``/``output_rtol`` give per-output tolerances of the check, as ``validate`` takes them;
        ``tolerances`` gives the whole comparison as one value instead.
        See :func:`iobundle.replay.export_programs`.
        """
        from iobundle.replay.check import Tolerances

        tolerances = tolerances or Tolerances.build(atol, rtol, output_atol, output_rtol)
        return self._keep_report(
            lambda: export.export_programs(
                *self._replayed(model), programs=programs, set_batch_dimension_for=set_batch_dimension_for,
                dynamic=dynamic, strict=strict, check=check, dim_names=dim_names, on_progress=on_progress,
                tolerances=tolerances,
            )
        )  # fmt: skip

    def export_report(self) -> ExportReport | None:
        """The per-call report of the last :meth:`export` (or :meth:`export_programs`, :meth:`to_onnx`), or None."""
        return self._export_report

    def to_onnx(
        self, model: torch.nn.Module, path: str | os.PathLike[str], *,
        set_batch_dimension_for: Collection[int | str] | bool | None = None, strict: bool = False, check: bool = True,
        dim_names: DimNamesSpec = False, on_progress: ProgressCallback | None = None,
        dynamic: Mapping[int | str, Collection[int]] | None = None, programs: ProgramsMode = "one",
        atol: float = 1e-4, rtol: float = 0.1, output_atol: Mapping[str, float] | None = None,
        output_rtol: Mapping[str, float] | None = None, tolerances: Tolerances | None = None,
    ) -> str:  # fmt: skip
        """Export ``model`` to an ONNX file at ``path`` (through ``torch.export``); return the path.

        With ``dim_names`` (see :meth:`infer_dynamic_shapes`) the graph's symbolic dimensions bear
        the names. With ``programs="auto"``, when one program cannot serve every call, one ONNX
        file per phase is written beside ``path`` with a program index, whose path is returned
        (see :meth:`export_programs`). The tolerance keywords of the check are those of
        :meth:`export_programs`, or one ``tolerances`` value. See :func:`iobundle.replay.export_onnx`.

        .. versionchanged:: 0.2
            ``output_atol``, ``output_rtol`` and ``tolerances``.
        """
        from iobundle.replay.check import Tolerances

        tolerances = tolerances or Tolerances.build(atol, rtol, output_atol, output_rtol)
        if programs != "one":
            return self.export_programs(
                model, programs=programs, set_batch_dimension_for=set_batch_dimension_for, dynamic=dynamic,
                strict=strict, check=check, dim_names=dim_names, on_progress=on_progress, tolerances=tolerances,
            ).to_onnx(path)  # fmt: skip
        result = self.export(
            model, set_batch_dimension_for=set_batch_dimension_for, strict=strict, check=check,
            dim_names=dim_names, on_progress=on_progress, dynamic=dynamic, tolerances=tolerances,
        )  # fmt: skip
        return export.save_onnx(
            self._replayed()[0], result, path, on_progress=on_progress
        )  # its report: ``result.report``

    def check_discrepancies(
        self, onnx_model: str | os.PathLike[str] | onnx.ModelProto | torch.onnx.ONNXProgram, atol: float = 1e-4,
        rtol: float = 0.1, hist: tuple[float, ...] = (0.1, 0.01), progress_bar: bool = False, include_io: bool = True,
        skip_none: bool = True, *, on_progress: ProgressCallback | None = None,
        output_atol: Mapping[str, float] | None = None, output_rtol: Mapping[str, float] | None = None,
        check_error_stat: str = "max", error_quantile: float = 0.99, tolerances: Tolerances | None = None,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """Run ``onnx_model`` with onnxruntime on every recorded call and compare with the recorded outputs.

        ``onnx_model`` is a path, an ``onnx.ModelProto`` or a ``torch.onnx.ONNXProgram``. The
        tolerance and statistic keywords build one :class:`~iobundle.replay.Tolerances`, or give
        it as ``tolerances``.

        See :func:`iobundle.replay.check_discrepancies` (per-output tolerances, error statistics, progress).
        """
        tolerances = tolerances or check.Tolerances.build(
            atol, rtol, output_atol, output_rtol, check_error_stat, error_quantile
        )
        return check.check_discrepancies(
            self._replayed()[0], onnx_model, hist=hist, progress_bar=progress_bar, include_io=include_io,
            skip_none=skip_none, on_progress=on_progress, tolerances=tolerances,
        )  # fmt: skip

    def validate(
        self, onnx_model: str | os.PathLike[str] | onnx.ModelProto, *, on_progress: ProgressCallback | None = None,
        atol: float = 1e-4, rtol: float = 0.1, output_atol: Mapping[str, float] | None = None,
        output_rtol: Mapping[str, float] | None = None, check_error_stat: str = "max", error_quantile: float = 0.99,
        tolerances: Tolerances | None = None,
    ) -> ValidationReport:  # fmt: skip
        """Validate ``onnx_model`` on every recorded call, output by output; see :func:`iobundle.replay.validate_onnx`.

        .. versionadded:: 0.2
        """
        tolerances = tolerances or check.Tolerances.build(
            atol, rtol, output_atol, output_rtol, check_error_stat, error_quantile
        )
        return check.validate_onnx(self._replayed()[0], onnx_model, on_progress=on_progress, tolerances=tolerances)

    def rerun(
        self, model: torch.nn.Module, *, device: str | torch.device | None = None,
        on_progress: ProgressCallback | None = None,
        atol: float = 1e-4, rtol: float = 0.1, output_atol: Mapping[str, float] | None = None,
        output_rtol: Mapping[str, float] | None = None, check_error_stat: str = "max", error_quantile: float = 0.99,
        tolerances: Tolerances | None = None,
    ) -> ValidationReport:  # fmt: skip
        """Re-run the eager ``model`` on every recorded call's inputs; see :func:`iobundle.replay.rerun_model`.

        .. versionadded:: 0.2
        """
        tolerances = tolerances or check.Tolerances.build(
            atol, rtol, output_atol, output_rtol, check_error_stat, error_quantile
        )
        return check.rerun_model(*self._replayed(model), device=device, on_progress=on_progress, tolerances=tolerances)


def recorded_calls(source: RecordedCallsAPI | RecordedCalls, *, replayed: bool = False) -> RecordedCalls:
    """The recorded calls of a ``Bundle`` or an ``InputObserver`` (or the calls themselves).

    With ``replayed``, as export and validation take them: module state as the input ``module_state``
    and an output (see :mod:`iobundle.replay._module_state`).
    """
    rc = source if isinstance(source, RecordedCalls) else source._recorded()
    if replayed and any(call.state is not None for call in rc.calls):
        from iobundle.replay._module_state import explicit_state

        return explicit_state(rc)
    return rc


def _candidate_index(rc: RecordedCalls, candidate: InputCandidate) -> int:
    """The position among the successful calls of ``rc`` of a recorded candidate."""
    call = candidate.call
    if call is not None and candidate._rc is rc:
        for i, c in enumerate(rc.ok_calls):
            if c.index == call.index:
                return i
    raise InputSelectionError(
        f"infer_arguments: the InputCandidate of call {call.index if call else '?'} is not a successful call of "
        "these recorded calls; pass one of this observer's info.inputs, or the inputs as a tuple or a dict."
    )


def _refuse_opaque(path: str, type_name: str, reason: str) -> None:
    raise AlignmentError(f"infer_arguments: input {path} is a {type_name}: {reason}.")


def _prefix_keys(call: CallEntry, prefix: str) -> CallEntry:
    def rename(node: Node) -> Node:
        return replace_tensors(node, (TensorNode(key=prefix + k) for k in tensor_keys(node)))

    return call.model_copy(
        update={"args": [rename(a) for a in call.args], "kwargs": {k: rename(v) for k, v in call.kwargs.items()}}
    )
