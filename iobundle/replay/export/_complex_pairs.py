"""Complex arithmetic traced on real (real, imaginary) pairs: the ``complex_as_real`` export patch.

Rotary embeddings written as a complex multiply (DeepSeek-V2, Llama 4, the Meta-style
``freqs_cis`` code) build complex frequencies (``torch.polar``, ``torch.complex``), view the
queries and keys as complex, multiply and ``view_as_real`` the product. Traced as written, this
fails twice: ``torch.polar`` ``copy_``-es into views of a complex tensor, whose overlap check makes
``torch.export`` add bounds such as ``length < 2`` (the program rejects the prefill, or batch 1);
and ONNX has no complex arithmetic (``No ONNX function found for aten.unsqueeze ...
complex-valued input``).

While tracing, the :class:`ComplexAsPairs` ``TorchFunctionMode`` keeps every complex value it
makes as a real ``(*shape, 2)`` tensor marked as a stand-in, and translates what the model does
with it: the constructors, the arithmetic (``mul``, ``add``, ``sub``, ``div``, ``neg``, ``conj``),
the shape ops (``unsqueeze``, ``view``/``reshape``, ``expand``, ``permute``, ``transpose``,
``flatten``, indexing, ``cat``/``stack``, ``select``, ``narrow``, ``split``, ``chunk``, ``unbind``),
the conversions, and what reads it (``view_as_real``, ``real``, ``imag``, ``abs``, ``angle``, and
``shape``, ``dtype``, ``dim()``, ``size()``, which report the complex tensor's). A complex tensor
not made by the mode (a complex buffer) becomes a pair when one of these ops meets it. Any other
op that receives a stand-in gets the complex tensor it stands for and runs as written: never a
wrong value, only the original trace. Differences are at float rounding level; every call is
checked against its recorded outputs afterwards (a model returning a complex value would return
the pair, and be refused). The mode is entered for every trace and listed on the export report
only when it translated something.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["ComplexAsPairs"]

logger = logging.getLogger(__name__)

_MARK = "_iobundle_complex_pair"
_COMPLEX_OF = {torch.float32: torch.complex64, torch.float64: torch.complex128, torch.float16: torch.complex32}
_REAL_OF = {c: r for r, c in _COMPLEX_OF.items()}


def _marked(pair: torch.Tensor) -> torch.Tensor:
    setattr(pair, _MARK, True)
    return pair


def _is_pair(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, _MARK, False) is True


def _is_complex_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not _is_pair(value) and value.dtype.is_complex


def _is_complex(value: Any) -> bool:
    return _is_pair(value) or _is_complex_tensor(value) or isinstance(value, complex)


def _pair(value: torch.Tensor) -> torch.Tensor:
    """A stand-in or a complex tensor as a real ``(*shape, 2)`` tensor."""
    return value if _is_pair(value) else torch.view_as_real(value)


def _rank(pair: torch.Tensor) -> int:
    return pair.dim() - 1


def _axis(dim: int, rank: int) -> int:
    """A (possibly negative) axis of a complex tensor of ``rank`` axes, as an axis of its pair."""
    return dim + rank if dim < 0 else dim


def _as_complex(value: torch.Tensor) -> torch.Tensor:
    """The complex tensor a stand-in stands for (a view of it when the pair's layout allows)."""
    from torch._prims_common import is_contiguous_or_false

    if not is_contiguous_or_false(value):
        value = value.clone(memory_format=torch.contiguous_format)
    return torch.view_as_complex(value)


def _unpaired(value: Any) -> Any:
    if _is_pair(value):
        return _as_complex(value)
    if isinstance(value, (list, tuple)) and any(_is_pair(v) for v in value):
        return type(value)(_unpaired(v) for v in value)
    return value


def _holds_pair(values: Sequence[Any]) -> bool:
    return any(_is_pair(v) or (isinstance(v, (list, tuple)) and any(_is_pair(x) for x in v)) for v in values)


# --------------------------------------------------------------------------- arithmetic


def _complex_tensor_first(a: Any, b: Any) -> tuple[torch.Tensor, Any]:
    return (a, b) if isinstance(a, torch.Tensor) and _is_complex(a) else (b, a)


def _times(a: Any, b: Any) -> torch.Tensor:
    """``a * b``, one of them a complex tensor (a stand-in or not); the other any operand of ``mul``."""
    a, b = _complex_tensor_first(a, b)  # the product commutes
    pa = _pair(a)
    if not _is_complex(b):  # complex times real: both parts scaled
        return pa * (b.unsqueeze(-1) if isinstance(b, torch.Tensor) else b)
    if isinstance(b, complex):
        re, im = b.real, b.imag
        return torch.stack([pa[..., 0] * re - pa[..., 1] * im, pa[..., 0] * im + pa[..., 1] * re], dim=-1)
    return _times_pairs(pa, _pair(b))


def _lifted(value: Any, like: torch.Tensor) -> torch.Tensor:
    """Any operand of a complex sum or quotient as a pair (a real one with a zero imaginary part)."""
    if isinstance(value, torch.Tensor):
        if _is_complex(value):
            return _pair(value)
        return torch.stack([value, torch.zeros_like(value)], dim=-1)
    number = complex(value)
    return torch.tensor([number.real, number.imag], dtype=like.dtype, device=like.device)


def _plus(a: Any, b: Any, sign: float) -> torch.Tensor:
    like = _pair(_complex_tensor_first(a, b)[0])
    return _lifted(a, like) + _lifted(b, like) if sign > 0 else _lifted(a, like) - _lifted(b, like)


def _over(a: Any, b: Any) -> torch.Tensor:
    like = _pair(_complex_tensor_first(a, b)[0])
    if not _is_complex(b):  # complex over real: both parts divided
        return _pair(a) / (b.unsqueeze(-1) if isinstance(b, torch.Tensor) else b)
    pa, pb = _lifted(a, like), _lifted(b, like)
    scale = pb[..., 0] * pb[..., 0] + pb[..., 1] * pb[..., 1]
    return _times_pairs(pa, torch.stack([pb[..., 0], -pb[..., 1]], dim=-1)) / scale.unsqueeze(-1)


def _times_pairs(pa: torch.Tensor, pb: torch.Tensor) -> torch.Tensor:
    ar, ai, br, bi = pa[..., 0], pa[..., 1], pb[..., 0], pb[..., 1]
    return torch.stack([ar * br - ai * bi, ar * bi + ai * br], dim=-1)


# --------------------------------------------------------------------------- translations

# Each translation takes the op's arguments (one of them complex) and returns the result with its
# complex tensors as pairs, or NotImplemented to let the op run on the complex tensors as written.
_Translation = Callable[..., Any]


def _polar(abs: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    return torch.stack([abs * torch.cos(angle), abs * torch.sin(angle)], dim=-1)


def _complex(real: torch.Tensor, imag: torch.Tensor) -> torch.Tensor:
    real, imag = torch.broadcast_tensors(real, imag)
    return torch.stack([real, imag], dim=-1)


def _view_as_complex(value: torch.Tensor) -> Any:
    if _is_complex(value):
        return NotImplemented
    return value.view(value.shape)  # a new view of the same pairs, marked by the caller


def _shape_args(sizes: tuple[Any, ...]) -> list[Any]:
    return list(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (list, tuple, torch.Size)) else list(sizes)


def _to(value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    pair = _pair(value)
    moved: list[Any] = []
    for arg in args:
        if isinstance(arg, torch.dtype):
            if arg not in _REAL_OF:
                return NotImplemented  # to a real dtype: drops the imaginary part
            arg = _REAL_OF[arg]
        elif isinstance(arg, torch.Tensor):
            if not _is_complex(arg):
                return NotImplemented
            arg = _pair(arg)
        moved.append(arg)
    dtype = kwargs.get("dtype")
    if dtype is not None:
        if dtype not in _REAL_OF:
            return NotImplemented
        kwargs = {**kwargs, "dtype": _REAL_OF[dtype]}
    return pair.to(*moved, **kwargs)


def _type_as(value: torch.Tensor, other: torch.Tensor) -> Any:
    return _pair(value).type_as(_pair(other)) if _is_complex(other) else NotImplemented


def _getitem(value: torch.Tensor, index: Any) -> Any:
    index = index if isinstance(index, tuple) else (index,)
    if any(_is_complex(i) for i in index):
        return NotImplemented
    if any(i is Ellipsis for i in index):
        index = (*index, slice(None))  # the pair axis stays after whatever the ellipsis covers
    return _pair(value)[index]


def _unsqueeze(value: torch.Tensor, dim: int) -> torch.Tensor:
    pair = _pair(value)
    return pair.unsqueeze(dim + _rank(pair) + 1 if dim < 0 else dim)


def _squeeze(value: torch.Tensor, dim: Any = None) -> Any:
    if dim is None:
        return NotImplemented  # which axes are 1 would be a guard on every dynamic size
    pair = _pair(value)
    dims = dim if isinstance(dim, (list, tuple)) else (dim,)
    return pair.squeeze(tuple(_axis(d, _rank(pair)) for d in dims))


def _reshaper(method: str) -> _Translation:
    def reshape(value: torch.Tensor, *sizes: Any) -> Any:
        if len(sizes) == 1 and isinstance(sizes[0], torch.dtype):
            return NotImplemented  # view(dtype): a reinterpretation of the bytes
        return getattr(_pair(value), method)(*_shape_args(sizes), 2)

    return reshape


def _expand(value: torch.Tensor, *sizes: Any) -> torch.Tensor:
    return _pair(value).expand(*_shape_args(sizes), 2)


def _expand_as(value: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    shape = _pair(other).shape[:-1] if _is_complex(other) else other.shape
    return _pair(value).expand(*shape, 2)


def _permute(value: torch.Tensor, *dims: Any) -> torch.Tensor:
    pair = _pair(value)
    rank = _rank(pair)
    return pair.permute(*[_axis(d, rank) for d in _shape_args(dims)], rank)


def _transpose(value: torch.Tensor, dim0: int, dim1: int) -> torch.Tensor:
    pair = _pair(value)
    return pair.transpose(_axis(dim0, _rank(pair)), _axis(dim1, _rank(pair)))


def _flatten(value: torch.Tensor, start_dim: int = 0, end_dim: int = -1) -> torch.Tensor:
    pair = _pair(value)
    rank = _rank(pair)
    return pair.flatten(_axis(start_dim, rank), _axis(end_dim, rank)) if rank else pair


def _on_axis(method: str) -> _Translation:
    """``select``, ``narrow``, ``split``, ``chunk``, ``unbind``: an op along one axis of the complex tensor."""
    position = {"select": 0, "narrow": 0, "unbind": 0, "split": 1, "chunk": 1}[method]

    def along(value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        pair = _pair(value)
        args_list = list(args)
        if "dim" in kwargs:
            kwargs = {**kwargs, "dim": _axis(kwargs["dim"], _rank(pair))}
        elif len(args_list) > position:
            args_list[position] = _axis(args_list[position], _rank(pair))
        elif method in ("select", "narrow"):
            return NotImplemented
        return getattr(pair, method)(*args_list, **kwargs)

    return along


def _joined(stack: bool) -> _Translation:
    def join(tensors: Sequence[Any], dim: int = 0) -> torch.Tensor:
        like = next(_pair(t) for t in tensors if _is_complex(t))
        pairs = [_lifted(t, like) for t in tensors]
        rank = _rank(pairs[0])
        axis = (dim + rank + 1 if dim < 0 else dim) if stack else _axis(dim, rank)
        return (torch.stack if stack else torch.cat)(pairs, dim=axis)

    return join


def _same(method: str) -> _Translation:
    """``clone``, ``contiguous``, ``detach``: the same op on the pair."""

    def same(value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return getattr(_pair(value), method)(*args, **kwargs)

    return same


def _conj(value: torch.Tensor) -> torch.Tensor:
    pair = _pair(value)
    return torch.stack([pair[..., 0], -pair[..., 1]], dim=-1)


def _binary(op: Callable[[Any, Any], torch.Tensor], *, swapped: bool = False) -> _Translation:
    def binary(a: Any, b: Any, **kwargs: Any) -> Any:
        if kwargs:  # alpha=, rounding_mode=, out=
            return NotImplemented
        return op(b, a) if swapped else op(a, b)

    return binary


# Ops whose result holds complex values: the result's tensors are marked as pairs.
_COMPLEX_RESULTS: dict[str, _Translation] = {
    "polar": _polar,
    "complex": _complex,
    "view_as_complex": _view_as_complex,
    "mul": _binary(_times),
    "multiply": _binary(_times),
    "__rmul__": _binary(_times, swapped=True),
    "add": _binary(lambda a, b: _plus(a, b, 1.0)),
    "__radd__": _binary(lambda a, b: _plus(a, b, 1.0), swapped=True),
    "sub": _binary(lambda a, b: _plus(a, b, -1.0)),
    "subtract": _binary(lambda a, b: _plus(a, b, -1.0)),
    "__rsub__": _binary(lambda a, b: _plus(a, b, -1.0), swapped=True),
    "div": _binary(_over),
    "divide": _binary(_over),
    "true_divide": _binary(_over),
    "__rdiv__": _binary(_over, swapped=True),
    "__rtruediv__": _binary(_over, swapped=True),
    "neg": lambda value: -_pair(value),
    "negative": lambda value: -_pair(value),
    "conj": _conj,
    "conj_physical": _conj,
    "resolve_conj": _same("clone"),
    "resolve_neg": _same("clone"),
    "to": _to,
    "type_as": _type_as,
    "clone": _same("clone"),
    "contiguous": _same("contiguous"),
    "detach": _same("detach"),
    "__getitem__": _getitem,
    "unsqueeze": _unsqueeze,
    "squeeze": _squeeze,
    "view": _reshaper("view"),
    "reshape": _reshaper("reshape"),
    "expand": _expand,
    "expand_as": _expand_as,
    "permute": _permute,
    "transpose": _transpose,
    "swapaxes": _transpose,
    "flatten": _flatten,
    "select": _on_axis("select"),
    "narrow": _on_axis("narrow"),
    "split": _on_axis("split"),
    "chunk": _on_axis("chunk"),
    "unbind": _on_axis("unbind"),
    "cat": _joined(stack=False),
    "concat": _joined(stack=False),
    "concatenate": _joined(stack=False),
    "stack": _joined(stack=True),
}

# Ops that read a complex value into a real one (or a shape, a dtype): the result is not a pair.
_REAL_RESULTS: dict[str, _Translation] = {
    "view_as_real": lambda value: _pair(value).view(_pair(value).shape),
    "real": lambda value: _pair(value)[..., 0],
    "imag": lambda value: _pair(value)[..., 1],
    "abs": lambda value: torch.sqrt(_pair(value).square().sum(dim=-1)),
    "angle": lambda value: torch.atan2(_pair(value)[..., 1], _pair(value)[..., 0]),
}

# What describes a stand-in: its complex tensor's shape and dtype (only stand-ins are answered).
_DESCRIPTIONS: dict[str, _Translation] = {
    "shape": lambda value: value.shape[:-1],
    "ndim": lambda value: value.dim() - 1,
    "dim": lambda value: value.dim() - 1,
    "size": lambda value, dim=None: value.shape[:-1] if dim is None else value.shape[_axis(dim, value.dim() - 1)],
    "numel": lambda value: value.numel() // 2,
    "__len__": lambda value: value.shape[0],
    "dtype": lambda value: _COMPLEX_OF.get(value.dtype, torch.complex64),
    "is_complex": lambda value: True,
    "is_floating_point": lambda value: False,
}


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property of the tensor (shape, dtype, real, ...)
        return str(getattr(getattr(func, "__self__", None), "__name__", ""))
    return str(name)


def _mark_all(result: Any) -> Any:
    if isinstance(result, torch.Tensor):
        return _marked(result)
    if isinstance(result, (list, tuple)):
        return type(result)(_mark_all(r) for r in result)
    return result


class ComplexAsPairs(torch.overrides.TorchFunctionMode):
    """Carries complex values as marked real pairs while tracing (see the module docstring).

    Attributes:
        used: The ops translated, by name, in the order first met (empty: the model computed
            nothing complex, and the export report does not list the patch).
    """

    def __init__(self) -> None:
        super().__init__()
        self.used: list[str] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = _op_name(func)
        if name in _DESCRIPTIONS:
            if args and _is_pair(args[0]):
                return _DESCRIPTIONS[name](*args, **kwargs)
            return func(*args, **kwargs)
        translation = _COMPLEX_RESULTS.get(name) or _REAL_RESULTS.get(name)
        if translation is not None and self._applies(name, args, kwargs):
            result = translation(*args, **kwargs)
            if result is not NotImplemented:
                if name not in self.used:
                    self.used.append(name)
                    logger.debug("complex %s traced on real pairs", name)
                return _mark_all(result) if name in _COMPLEX_RESULTS else result
        if _holds_pair(args) or _holds_pair(list(kwargs.values())):
            logger.debug("complex %s traced as written", name)
            args = tuple(_unpaired(a) for a in args)
            kwargs = {k: _unpaired(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    @staticmethod
    def _applies(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether ``name`` on these arguments is complex arithmetic the mode translates."""
        if name in ("polar", "complex", "view_as_complex"):
            return not _holds_pair(args) and not kwargs.get("out")
        values = [*args, *kwargs.values()]
        flat = [x for v in values for x in (v if isinstance(v, (list, tuple)) else (v,))]
        return any(isinstance(x, torch.Tensor) and _is_complex(x) for x in flat)
