"""One file's tensor table of a compact manifest, checked a column at a time.

The reader of :mod:`iobundle.schema._compact` checks the rows one by one and names the first bad
one; on a bundle of thousands of tensors that walk costs more than parsing the JSON. :func:`bulk_rows`
checks the same rules on whole columns (types, dtypes, ranks, element counts, the segment's ranges)
with set, map and accumulate, which run in C, and walks only the extensions. It returns None as soon
as a row is not of the plain kinds or a rule fails: the row-by-row reader then runs and says what
is wrong. It never accepts what that reader refuses.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any

from iobundle.schema._deferred import TensorInfo
from iobundle.schema._manifest import DTYPE_ITEMSIZES, DTYPES

__all__ = ["bulk_rows"]

_DTYPES = frozenset(DTYPES)
_LIST, _INT, _STR = frozenset({list}), frozenset({int}), frozenset({str})
_LENGTHS = frozenset({2, 3, 4})
_OPTION_FIELDS = frozenset({"device", "name"})
_row = tuple.__new__  # TensorInfo's own constructor is Python code: one call per row costs more than the checks


def bulk_rows(
    name: str,
    rows: dict[str, Any],
    tensors: dict[str, TensorInfo],
    ranges: list[tuple[int, int, int, str]] | None,
    size: int,
    *,
    max_rank: int,
    max_elements: int,
) -> tuple[list[tuple[str, TensorInfo]], int] | None:
    """The rows of file ``name`` (``{key: [dtype, shape, extends?, options?]}``) and how many extend another.

    ``tensors`` holds the rows of the files before it. ``ranges`` and ``size`` are the file's, checked;
    a segment's rows get their offsets. A tensor must fit in a safetensors file's ``size``. The chain
    of extensions is not measured here: the caller counts them (no chain is longer than their number).

    Returns:
        ``([(key, row), ...], extensions)``, or None when a row breaks a rule or is not plain.
    """
    keys, values = list(rows), list(rows.values())
    if not values:
        return ([], 0) if ranges is None or size == 0 else None
    if set(map(type, values)) != _LIST or not (lengths := set(map(len, values))) <= _LENGTHS:
        return None
    if not tensors.keys().isdisjoint(keys):
        return None
    dtypes, shapes = [v[0] for v in values], [v[1] for v in values]
    try:
        if not set(dtypes) <= _DTYPES or set(map(type, shapes)) != _LIST:
            return None
    except TypeError:  # an unhashable dtype
        return None
    dims = list(map(tuple, shapes))
    flat = list(itertools.chain.from_iterable(dims))
    if flat and (not set(map(type, flat)) <= _INT or min(flat) < 0):  # not bool: True == 1
        return None
    if max(map(len, dims)) > max_rank:
        return None
    counts = list(map(math.prod, dims))
    if max(counts) > max_elements:
        return None
    if 0 in counts and max(math.prod(d or 1 for d in s) for s, c in zip(dims, counts) if not c) > max_elements:
        return None
    extends: list[tuple[str, int] | None] = [None] * len(values)
    stored = counts
    at = [i for i, v in enumerate(values) if len(v) > 2 and v[2] is not None]  # the extensions
    if at:
        exts = [values[i][2] for i in at]
        if set(map(type, exts)) != _LIST or set(map(len, exts)) != {2}:
            return None
        bases, along = [e[0] for e in exts], [e[1] for e in exts]
        if set(map(type, bases)) != _STR or set(map(type, along)) != _INT or min(along) < 0:
            return None
        earlier = list(map(dict(zip(keys, range(len(keys)))).get, bases))  # a base in this file: its row
        if None in earlier:  # or in a file before
            if not all(map(tensors.__contains__, (b for b, j in zip(bases, earlier) if j is None))):
                return None
            before = [(dtypes[j], dims[j]) if j is not None else tensors[b][2:4] for b, j in zip(bases, earlier)]
            earlier = [-1 if j is None else j for j in earlier]
        else:
            before = list(zip(map(dtypes.__getitem__, earlier), map(dims.__getitem__, earlier)))
        if not all(map(operator.lt, earlier, at)):  # listed after it, or itself
            return None
        grows = list(map(dims.__getitem__, at))
        if [b[0] for b in before] != list(map(dtypes.__getitem__, at)):
            return None
        had = [b[1] for b in before]
        if list(map(len, had)) != list(map(len, grows)) or not all(map(operator.lt, along, map(len, grows))):
            return None
        # the other dimensions equal, this one at least as long as the base's
        if [h[:d] + h[d + 1 :] for h, d in zip(had, along)] != [s[:d] + s[d + 1 :] for s, d in zip(grows, along)]:
            return None
        grown = [s[d] - h[d] for s, h, d in zip(grows, had, along)]
        if min(grown) < 0:
            return None
        stored = list(counts)
        for i, b, s, d, g in zip(at, bases, grows, along, grown):
            extends[i] = (b, d)
            if stored[i]:  # stored: the part past the base along d
                stored[i] = stored[i] // s[d] * g
    devices: Any = itertools.repeat("cpu")
    names: list[str] = keys
    if 4 in lengths:
        options = [v[3] if len(v) == 4 else None for v in values]
        given = [o for o in options if o is not None]
        if set(map(type, given)) - {dict} or not all(o.keys() <= _OPTION_FIELDS for o in given):
            return None
        devices = ["cpu" if o is None else o.get("device", "cpu") for o in options]
        names = [k if o is None else o.get("name", k) for k, o in zip(keys, options)]
        if not set(map(type, devices)) | set(map(type, names)) <= _STR or (ranges is not None and names != keys):
            return None
    nbytes = list(map(operator.mul, stored, [DTYPE_ITEMSIZES[d] for d in dtypes]))
    offsets: Any = itertools.repeat(None)
    if ranges is None:
        if max(nbytes) > size:
            return None
    else:  # the tensors lie back to back over the ranges, none across the end of one
        offsets = list(itertools.accumulate(nbytes, initial=0))
        starts = {o for o, n in zip(offsets, nbytes) if n}
        if offsets.pop() != size or not {s + n for _, s, n, _ in ranges if 0 < s + n < size} <= starts:
            return None
    columns = zip(itertools.repeat(name), names, dtypes, dims, devices, extends, offsets)
    return list(zip(keys, map(_row, itertools.repeat(TensorInfo), columns))), len(values) - extends.count(None)
