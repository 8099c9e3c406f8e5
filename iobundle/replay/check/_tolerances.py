"""How outputs are compared: tolerances by dtype and per output, the statistic that decides, and the
:class:`Tolerances` the public functions build from their keywords (``atol=``, ``output_atol=``, ...).

Loads neither torch nor numpy: the public face uses them at class definition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from iobundle._units import format_calls
from iobundle.calls import path_matches, replay_autocast
from iobundle.errors import ToleranceError
from iobundle.schema import CallEntry

__all__ = [
    "DTYPE_TOLERANCES",
    "ERROR_STATS",
    "Tolerances",
    "check_error_stat_name",
]

ERROR_STATS = ("max", "mean", "median", "quantile")
"""The statistics ``check_error_stat`` accepts. ``max`` is element-wise: every element within
``atol`` or within ``rtol`` of the expected value (the strictest, and the default). The others
pass an output when that statistic of its absolute errors is within ``atol`` or that statistic
of its relative errors is within ``rtol``."""


def check_error_stat_name(name: str, quantile: float) -> None:
    """Refuse an unknown statistic or a quantile outside [0, 1].

    Raises:
        ToleranceError: ``name`` is not one of :data:`ERROR_STATS`, or ``quantile`` is out of range.
    """
    if name not in ERROR_STATS:
        raise ToleranceError(f"check_error_stat={name!r}: use one of {', '.join(ERROR_STATS)}.")
    if not 0.0 <= quantile <= 1.0:
        raise ToleranceError(f"error_quantile={quantile!r}: give a quantile between 0 and 1 (e.g. 0.99).")


DTYPE_TOLERANCES: Mapping[str, tuple[float, float]] = {
    "float16": (5e-3, 0.1),
    "bfloat16": (2e-2, 0.1),
}
"""Default ``(atol, rtol)`` of an output by the dtype it was recorded in, where it differs from float32's.

=========  ======  =====  ==========================================
dtype      atol    rtol   why
=========  ======  =====  ==========================================
float32    1e-4    0.1    :attr:`Tolerances.atol` / ``rtol`` (also float64, integers)
float16    5e-3    0.1    10 bits of mantissa (eps 9.8e-4)
bfloat16   2e-2    0.1    7 bits of mantissa (eps 7.8e-3)
=========  ======  =====  ==========================================

An element passes when within ``atol`` or within ``rtol`` of the expected value. A program that
computes in another order, or in float32 (``validate`` on a CPU without half kernels), differs
from the recorded half-precision run by a few units of the last place of each intermediate: on
2-layer models up to 2e-3 in float16 and 1.7e-2 in bfloat16 (encoder states), 2.5 to 5 times
below these values. A per-output tolerance (``--atol NAME=VALUE``, ``--atol '*=VALUE'`` for every
output) beats this table.

Calls recorded under ``torch.autocast`` (the manifest's ``autocast``, format version 5) ran their
eligible operations in the autocast dtype whatever the dtype of their outputs: a float32 logits or
key tensor holds bfloat16 precision. Their float32 and float64 outputs take the autocast dtype's
row, call by call (:meth:`Tolerances.for_call`): in a bundle whose calls were recorded some under
autocast and some without, a call without keeps float32's row.
"""


@dataclass(frozen=True)
class Tolerances:
    """How outputs are compared: tolerances by dtype and per output, and the statistic that decides.

    The one comparison value of validate, run, diff and the export check. An output's tolerances
    are, first found: a per-output override for one of its names (its path in the output tree,
    e.g. ``logits`` or ``past_key_values[0]``, or its ONNX name; an exact name wins over a
    pattern, among patterns the first one given), the :data:`DTYPE_TOLERANCES` entry of the dtype
    it was recorded in (``by_dtype``), else ``atol`` / ``rtol``. Brackets in a pattern are the
    path's own, and an index may be written as a dotted part too (``past_key_values.0``,
    ``past_key_values.*``; see ``iobundle.calls.path_matches``).

    Example:
        >>> tol = Tolerances(atol=1e-4, per_output_atol={"logits": 1e-3, "past_key_values.*": 1e-5})
        >>> tol.for_output("logits")
        (0.001, 0.1)
        >>> Tolerances().for_output("logits", dtype="bfloat16")
        (0.02, 0.1)
    """

    atol: float = 1e-4
    rtol: float = 0.1
    per_output_atol: Mapping[str, float] = field(default_factory=dict)
    per_output_rtol: Mapping[str, float] = field(default_factory=dict)
    check_error_stat: str = "max"
    """``max`` (every element within tolerance), ``mean``, ``median`` or ``quantile`` (see :data:`ERROR_STATS`)."""
    error_quantile: float = 0.99
    """The quantile of ``check_error_stat="quantile"`` (and of ``quantile_abs``)."""
    quantiles: bool = False
    """Select the median and ``error_quantile`` of each output's errors (``median_abs``, ``quantile_abs``,
    ``median_rel``, ``quantile_rel``) even when ``check_error_stat`` does not need them; else they are None.
    On request because the selection needs every error at once: on large outputs it costs more than the rest
    of the comparison (reports written by the CLI request them)."""
    by_dtype: Mapping[str, tuple[float, float]] = field(default_factory=lambda: dict(DTYPE_TOLERANCES))
    autocast: str | None = None
    """The ``torch.autocast`` dtype of the call these tolerances decide (:meth:`for_call`), else None."""
    autocast_calls: tuple[tuple[int, str | None], ...] = ()
    """Each compared call's index and ``torch.autocast`` dtype (None: recorded without), for reports (:meth:`for_calls`)."""

    def under_autocast(self, dtype: str) -> Tolerances:
        """These tolerances for a call recorded under ``torch.autocast`` in ``dtype`` (``"bfloat16"``).

        Float32 and float64 outputs take ``dtype``'s row of ``by_dtype``: autocast ran the operations
        that made them in ``dtype``. Per-output overrides still win.
        """
        row = self.by_dtype.get(dtype)
        if row is None:
            return self
        return replace(self, by_dtype={**self.by_dtype, "float32": row, "float64": row}, autocast=dtype)

    def for_call(self, call: CallEntry) -> Tolerances:
        """These tolerances for ``call``, by its own ``torch.autocast`` state: :meth:`under_autocast` if it had one.

        The one place the autocast rule is applied: validate, run, diff and the export check call
        it for each call they compare, so a bundle whose calls alternate autocast on and off
        decides each call by its own state.
        """
        state = replay_autocast(call.autocast)
        return self if state is None else self.under_autocast(state.dtype_name)

    def for_calls(self, calls: Iterable[CallEntry]) -> Tolerances:
        """These tolerances as a report of ``calls`` describes them: which calls were recorded under autocast.

        Comparing still goes call by call (:meth:`for_call`); this value only names, in
        :meth:`describe`, the calls whose float32 outputs took an autocast dtype's row.
        """
        states = []
        for call in calls:
            state = replay_autocast(call.autocast)
            states.append((call.index, None if state is None else state.dtype_name))
        return replace(self, autocast_calls=tuple(states))

    @classmethod
    def build(
        cls,
        atol: float = 1e-4,
        rtol: float = 0.1,
        output_atol: Mapping[str, float] | None = None,
        output_rtol: Mapping[str, float] | None = None,
        check_error_stat: str = "max",
        error_quantile: float = 0.99,
    ) -> Tolerances:
        """The value from the keyword arguments the public functions take, checked.

        Raises:
            ToleranceError: ``check_error_stat`` is unknown or ``error_quantile`` is outside [0, 1].
        """
        check_error_stat_name(check_error_stat, error_quantile)
        return cls(
            atol=atol, rtol=rtol, per_output_atol=dict(output_atol or {}), per_output_rtol=dict(output_rtol or {}),
            check_error_stat=check_error_stat, error_quantile=error_quantile,
        )  # fmt: skip

    @property
    def per_output(self) -> bool:
        """Whether outputs must be decided one by one (overrides, or a statistic other than ``max``)."""
        return bool(self.per_output_atol or self.per_output_rtol) or self.check_error_stat != "max"

    @staticmethod
    def _lookup(table: Mapping[str, float], names: Iterable[str], default: float) -> float:
        names = [n for n in names if n]
        for name in names:
            if name in table:
                return table[name]
        for pattern, value in table.items():
            if any(path_matches(pattern, name) for name in names):
                return value
        return default

    def for_dtype(self, dtype: str | None) -> tuple[float, float]:
        """``(atol, rtol)`` of an output of ``dtype`` (``bfloat16``, ``torch.float16``...) with no override."""
        name = str(dtype).replace("torch.", "") if dtype is not None else ""
        return self.by_dtype.get(name, (self.atol, self.rtol))

    def for_output(self, *names: str, dtype: str | None = None) -> tuple[float, float]:
        """``(atol, rtol)`` for the output known under ``names``, recorded in ``dtype``."""
        atol, rtol = self.for_dtype(dtype)
        return self._lookup(self.per_output_atol, names, atol), self._lookup(self.per_output_rtol, names, rtol)

    def unused(self, names: Iterable[Sequence[str]]) -> list[str]:
        """The per-output keys that match none of the outputs (each given as its names)."""
        all_names = [n for group in names for n in group if n]
        keys = list(dict.fromkeys([*self.per_output_atol, *self.per_output_rtol]))
        return [k for k in keys if not any(path_matches(k, n) for n in all_names)]

    def describe(self, dtypes: Iterable[str] = ()) -> str:
        """``atol=0.0001 rtol=0.1`` plus the table rows of ``dtypes`` and the overrides.

        E.g. ``atol=0.0001 rtol=0.1 (bfloat16: atol=0.02 rtol=0.1; logits: atol=0.001)``. Calls
        recorded under ``torch.autocast`` (:meth:`for_calls`) are named, with the row their float32
        outputs took.
        """
        text = f"atol={self.atol:g} rtol={self.rtol:g}"
        under = self._autocast_dtypes()
        every = self.autocast or (next(iter(under)) if len(under) == 1 and self._all_under() else None)
        table = self.under_autocast(every).by_dtype if every is not None else self.by_dtype
        seen = dict.fromkeys(str(d).replace("torch.", "") for d in dtypes)
        extra = [f"{d}: atol={table[d][0]:g} rtol={table[d][1]:g}" for d in seen if d in table]
        overrides = [f"{k}: atol={v:g}" for k, v in self.per_output_atol.items()]
        overrides += [f"{k}: rtol={v:g}" for k, v in self.per_output_rtol.items()]
        if overrides:
            extra.append(", ".join(overrides))
        if every is not None:  # every call (or the one these tolerances decide)
            extra.insert(0, f"recorded under torch.autocast({every}): float32 outputs take its row")
        elif under:
            for dtype, indices in reversed(under.items()):
                row = self.by_dtype.get(dtype, (self.atol, self.rtol))
                calls = format_calls(indices)
                extra.insert(
                    0, f"{calls} recorded under torch.autocast({dtype}): their float32 outputs take its row "
                    f"(atol={row[0]:g} rtol={row[1]:g}), the calls recorded without float32's",
                )  # fmt: skip
        return text + (f" ({'; '.join(extra)})" if extra else "")

    def _autocast_dtypes(self) -> dict[str, list[int]]:
        """The calls of :meth:`for_calls` recorded under autocast, by autocast dtype."""
        under: dict[str, list[int]] = {}
        for index, dtype in self.autocast_calls:
            if dtype is not None:
                under.setdefault(dtype, []).append(index)
        return under

    def _all_under(self) -> bool:
        return bool(self.autocast_calls) and all(dtype is not None for _, dtype in self.autocast_calls)
