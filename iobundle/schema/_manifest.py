"""Pydantic models of ``manifest.json``, the bundle format. JSON only: no torch here.

A tree is JSON a person can read: every node is an object with a ``kind``::

    {"kind": "tensor", "key": "t0"}                      a tensor, stored under key t0
    {"kind": "none"}                                     None
    {"kind": "const", "value": 3}                        an int, float, bool or str
    {"kind": "list", "items": [...]}                     also "tuple"
    {"kind": "dict", "keys": ["a", 1], "items": [...]}
    {"kind": "node", "type": "transformers.DynamicCache", "version": 1,
     "context": ..., "items": [...]}                     a registered class, by stable name
    {"kind": "opaque", "type": "mymodule.Thing"}         a value that could not be recorded

Format version 2 (written since iobundle 0.2) adds, and version 1 never holds:

- ``TensorEntry.extends``: the tensor is stored as its new part only, the positions past those of
  the tensor it extends (``{"key": ..., "dim": ...}``) along one dimension; the file holds the
  new part, ``shape`` stays the full shape;
- ``FileEntry.hash`` + ``FileEntry.digest``: the integrity hash names its algorithm per file
  (``"xxh3-128"`` as written, ``"sha256"`` read too) instead of ``sha256``;
- a streamed bundle carries ``journal.jsonl`` until its writer finishes (see :mod:`iobundle.schema._journal`).

Format version 3 stores the same content compactly: call structures written once, a tensor table
per file, the hash algorithm named once (see :mod:`iobundle.schema._compact`). Format version 4
has the layout of version 3 and adds segment files: files without a
header that many calls append their small tensors to, each call's bytes one range with its own
digest (``FileEntry.ranges``, ``TensorEntry.offset``). Format version 5
has the layout of version 4 and adds ``CallEntry.autocast``: the ``torch.autocast`` state the
observed call ran under (absent: not under autocast, as every call of versions 1 to 4). In format
version 6 (what iobundle writes now) a segment is a safetensors file: its first range starts past
its header region (see :mod:`iobundle.calls._segments`). These
models are the in-memory manifest of every version, and the file layout of versions 1 and 2.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Final, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_serializer,
    model_validator,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "SUPPORTED_FORMAT_VERSIONS",
    "HASH_ALGORITHMS",
    "DTYPE_ITEMSIZES",
    "AutocastEntry",
    "CallEntry",
    "Extension",
    "ConstNode",
    "DictNode",
    "FileEntry",
    "ListNode",
    "Manifest",
    "MissingValueEntry",
    "MergedAdapter",
    "ModelEntry",
    "Node",
    "NoneNode",
    "ObjectNode",
    "OpaqueNode",
    "ParameterEntry",
    "Producer",
    "Redaction",
    "SegmentRange",
    "SignatureEntry",
    "TensorEntry",
    "TensorNode",
    "TupleNode",
]

FORMAT: Final = "iobundle"
FORMAT_VERSION: Final = 6
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3, 4, 5, 6)

HASH_ALGORITHMS = {"sha256": 64, "xxh3-128": 32}
"""Integrity hashes a format-2 file entry may name, with the length of their hex digest."""
HashAlgorithm = Literal["sha256", "xxh3-128"]

Scalar = Union[StrictBool, StrictInt, StrictFloat, StrictStr]
DTYPE_ITEMSIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8,
    "F16": 2, "BF16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1, "C64": 8, "C128": 16,
}  # fmt: skip
"""Each safetensors dtype name a bundle may hold, with its bytes per element: the one table of them.

Sizes are checked against it without torch (a segment's ranges, a tensor file's offsets);
:mod:`iobundle.calls` maps these names to torch dtypes.
"""
DTYPES = tuple(DTYPE_ITEMSIZES)
DType = Literal[DTYPES]  # type: ignore[valid-type]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")


class _OmitsUnset(_Model):
    """Fields that only format version 2 holds are left out of the JSON while they are None,
    so a version-1 manifest dumps as it was read."""

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        data = handler(self)
        for name in self.OMIT_NONE:
            if data.get(name, 0) is None:
                del data[name]
        return data


class TensorNode(_Model):
    kind: Literal["tensor"] = "tensor"
    key: str


class NoneNode(_Model):
    kind: Literal["none"] = "none"


class ConstNode(_Model):
    kind: Literal["const"] = "const"
    value: Scalar


class ListNode(_Model):
    kind: Literal["list"] = "list"
    items: list[Node]


class TupleNode(_Model):
    kind: Literal["tuple"] = "tuple"
    items: list[Node]


class DictNode(_Model):
    kind: Literal["dict"] = "dict"
    keys: list[Union[StrictStr, StrictInt]]
    items: list[Node]


class ObjectNode(_Model):
    """An instance of a registered class (a transformers cache, a user pytree class)."""

    kind: Literal["node"] = "node"
    type: str
    version: int
    context: JsonValue = None
    items: list[Node]


class OpaqueNode(_Model):
    """A value iobundle could not record (the observed program was not disturbed)."""

    kind: Literal["opaque"] = "opaque"
    type: str
    reason: str = ""


Node = Annotated[
    Union[TensorNode, NoneNode, ConstNode, ListNode, TupleNode, DictNode, ObjectNode, OpaqueNode],
    Field(discriminator="kind"),
]
for _model in (ListNode, TupleNode, DictNode, ObjectNode):
    _model.model_rebuild()


class Extension(_Model):
    """The tensor a stored tensor extends (format version 2): ``key``'s positions come first along ``dim``.

    The tensor's file holds only the positions past those of ``key`` along ``dim``; reading it
    concatenates ``key`` (itself possibly an extension) and that new part.
    """

    key: str
    dim: Annotated[StrictInt, Field(ge=0)]


class TensorEntry(_OmitsUnset):
    """Where one tensor lives: its file, its key inside that file, dtype and shape.

    ``shape`` is always the whole tensor's. With ``extends`` (format version 2) the file holds the
    new part only: ``shape`` with ``shape[extends.dim]`` less the extended tensor's. With ``offset``
    (format version 4) the file is a segment (see :class:`FileEntry`) and the stored bytes start at
    that byte; ``name`` is then the key.
    """

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"extends", "offset"})

    file: str
    name: str
    dtype: DType
    shape: list[Annotated[StrictInt, Field(ge=0)]]
    device: str = "cpu"
    extends: Extension | None = None
    offset: Annotated[StrictInt, Field(ge=0)] | None = None


SegmentRange = tuple[
    Annotated[StrictInt, Field(ge=0)], Annotated[StrictInt, Field(ge=0)], Annotated[StrictInt, Field(ge=0)], str
]
"""``(call, start, length, digest)``: the bytes a segment holds for call index ``call``, with their digest."""


class FileEntry(_OmitsUnset):
    """A file of the bundle, with its size and hash checked before use.

    Format version 1 records ``sha256``; version 2 records ``hash`` (the algorithm) and ``digest``.
    A segment (format version 4) records ``hash`` and ``ranges`` instead of ``digest``: the file is
    the bytes of its ranges back to back (after its header region in version 6), each range with its own digest; ``size`` is
    where the last range ends (bytes past it, a call a killed writer was appending, are no part of
    the bundle).
    """

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"sha256", "hash", "digest", "ranges"})

    size: Annotated[StrictInt, Field(ge=0)]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    hash: HashAlgorithm | None = None
    digest: Annotated[str, Field(pattern=r"^[0-9a-f]{32,64}$")] | None = None
    ranges: list[SegmentRange] | None = None

    @model_validator(mode="after")
    def _one_hash(self) -> FileEntry:
        if self.ranges is not None:
            if self.hash is None or self.sha256 is not None or self.digest is not None:
                raise ValueError("a segment (ranges) gives hash and a digest per range, not sha256 or digest")
        elif self.sha256 is not None:
            if self.hash is not None or self.digest is not None:
                raise ValueError("give either sha256 (format version 1) or hash and digest (version 2), not both")
        elif self.hash is None or self.digest is None:
            raise ValueError("a file needs sha256 (format version 1) or hash and digest (version 2)")
        elif len(self.digest) != HASH_ALGORITHMS[self.hash]:
            raise ValueError(
                f"a {self.hash} digest has {HASH_ALGORITHMS[self.hash]} hex digits, not {len(self.digest)}"
            )
        return self

    @property
    def algorithm(self) -> str:
        """The hash algorithm of :attr:`hexdigest`."""
        return "sha256" if self.sha256 is not None else str(self.hash)

    @property
    def hexdigest(self) -> str:
        """The recorded digest, whichever format version wrote it."""
        return self.sha256 if self.sha256 is not None else str(self.digest)


def duplicate_call_index(index: int, first: int) -> str:
    """The problem of a call whose ``index`` is already the index of ``calls[first]`` (every format version)."""
    return (
        f"{index} is also the index of calls[{first}]; each recorded call has its own index "
        "(its tensor file and every converted file are named after it). The file is corrupt or hostile"
    )


AUTOCAST_DTYPES = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")
"""The dtypes an :class:`AutocastEntry` may name (those ``torch.autocast`` takes on some device type)."""


class AutocastEntry(_Model):
    """``torch.autocast`` on one device type at a recorded call (format version 5).

    Capture lists, for a call made while autocast was enabled on some device type, each device
    type whose autocast is enabled, and ``"cpu"`` (enabled or not: whether CPU operations were
    autocast too). Replay runs the eager model and traces the program under the same autocast.

    Attributes:
        device_type: The device type, as ``torch.autocast`` names it (``"cuda"``, ``"cpu"``, ``"xpu"``).
        dtype: The lower-precision dtype autocast ran its eligible operations in (``"BF16"``, ``"F16"``).
        enabled: ``torch.is_autocast_enabled(device_type)`` at the call.
    """

    device_type: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")]
    dtype: Literal[AUTOCAST_DTYPES]  # type: ignore[valid-type]
    enabled: StrictBool


class CallEntry(_OmitsUnset):
    """One recorded call of the observed method.

    ``autocast`` (format version 5) is the ``torch.autocast`` state the call ran under, one entry per
    device type (see :class:`AutocastEntry`); None (left out of the JSON) when autocast was enabled
    on no device type, and for every call of format versions 1 to 4.

    ``state`` is the state the call found and left on the observed module tree (tensors the model
    keeps between calls, not passed in or out): ``{"in": {path: tensor}, "out": {path: tensor}}``,
    paths as ``model.layers.0.h``; None (left out) for a model without such state. Replay loads
    ``in`` into the module before the call and compares ``out`` with what it leaves.
    """

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"autocast", "state"})

    index: Annotated[StrictInt, Field(ge=0)]
    status: Literal["ok", "failed", "incomplete"] = "ok"
    error: str | None = None
    args: list[Node]
    kwargs: dict[str, Node]
    cst_kwargs: dict[str, Scalar] = Field(default_factory=dict)
    filled: list[Union[StrictStr, StrictInt]] = Field(default_factory=list)
    outputs: Node | None = None
    latency: float | None = None
    autocast: list[AutocastEntry] | None = None
    state: Node | None = None


class ParameterEntry(_Model):
    name: str
    kind: Literal["POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY", "VAR_KEYWORD"]
    has_default: bool = False
    default: JsonValue = None


class SignatureEntry(_Model):
    """The observed method: its name and its parameters (defaults kept when JSON-able)."""

    method: str
    qualname: str = ""
    parameters: list[ParameterEntry]


class Producer(_Model):
    iobundle: str
    torch: str
    python: str
    transformers: str | None = None
    devices: list[str] = Field(default_factory=list)


class MissingValueEntry(_Model):
    """A placeholder given by ``value_if_missing`` for an argument (by name or position)."""

    key: Union[StrictStr, StrictInt]
    value: Node


class MergedAdapter(_Model):
    """A peft adapter merged into the stored weights (``ModelEntry.merged_adapters``).

    Attributes:
        name: The adapter's name (``"default"``).
        method: The peft method (``"lora"``), or the wrapper's class for trained copies of modules.
        ranks: The adapter's ranks, one per distinct value over its layers (empty for methods without one).
    """

    name: Annotated[str, Field(max_length=200)]
    method: Annotated[str, Field(max_length=200)]
    ranks: list[int] = Field(default_factory=list)


class ModelEntry(_OmitsUnset):
    """The model stored in a self-contained bundle (``observer.save(path, include_model=...)``).

    Only transformers and diffusers classes are stored, by class name: a loader rebuilds them from
    ``config_file`` (``config.to_dict()``, or a diffusers config's public keys, as JSON), only for classes
    transformers registers in its auto-model mappings (or diffusers ``ModelMixin`` classes of the
    ``diffusers`` package) and only when the config selects no code, and loads ``weights_file``
    (safetensors). Nothing named here is ever imported.

    Attributes:
        library: The library that defines ``class_name``.
        class_name: The model class, e.g. ``"LlamaForCausalLM"``.
        config_file: Bundle member holding the config as JSON.
        weights_file: Bundle member holding the weights (safetensors, tied weights stored once).
        submodule: Dotted path of the observed module inside the model (``"model.layers.0.self_attn"``);
            empty when the model itself was observed.
        attn_implementation: The attention implementation the model ran with (``"sdpa"``, ``"eager"``).
        files: Size and sha256 of ``config_file`` and ``weights_file``, checked before use.
        merged_adapters: The peft adapters (LoRA and the like) merged into the weights, which are stored
            under ``class_name``'s own names; left out when none were.
    """

    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"merged_adapters"})

    library: Literal["transformers", "diffusers"] = "transformers"
    class_name: Annotated[str, Field(min_length=1, max_length=200)]
    config_file: str = "model/config.json"
    weights_file: str = "model/weights.safetensors"
    submodule: Annotated[str, Field(pattern=r"^([A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*)?$", max_length=1000)] = ""
    attn_implementation: str | None = None
    files: dict[str, FileEntry]
    merged_adapters: list[MergedAdapter] | None = None


class Redaction(_Model):
    """Marks a bundle written by ``iobundle redact``: its recorded input tensors are synthetic.

    Synthetic values have the dtype and shape of the recorded ones; integers stay within the
    observed range, two-valued tensors (masks) keep their two values, and rows that increased
    (positions) still do; a tensor of one value gets other values. Scalar constants and the
    structure are kept as recorded.

    Attributes:
        outputs_kept: The recorded outputs were kept (``--keep-outputs``); otherwise there are none.
        model_kept: The stored model (config and weights) was kept (``--keep-model``).
        seed: The seed of the synthetic values.
    """

    outputs_kept: bool = False
    model_kept: bool = False
    seed: StrictInt = 0


class Manifest(_Model):
    """The whole of ``manifest.json``, in memory: the same for every format version.

    Versions 1 and 2 are this model's JSON; versions 3 and 4 are :class:`iobundle.schema.CompactManifest`,
    read into and written from this model.
    """

    format: Literal["iobundle"] = FORMAT
    format_version: Literal[1, 2, 3, 4, 5, 6] = FORMAT_VERSION
    producer: Producer
    signature: SignatureEntry
    value_if_missing: list[MissingValueEntry] = Field(default_factory=list)
    calls: list[CallEntry]
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    model: ModelEntry | None = None
    redacted: Redaction | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_redaction(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Only redacted bundles carry the field: every other manifest stays readable by iobundle
        # versions that predate it (extra="forbid" would refuse even "redacted": null).
        data: dict[str, Any] = handler(self)
        if data.get("redacted", 0) is None:
            del data["redacted"]
        return data
