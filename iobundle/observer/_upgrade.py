"""``upgrade_bundle``: rewrite a bundle of an older format version in the newest one, beside it, and verify it."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from iobundle._progress import ProgressCallback
from iobundle._remote import clear_local_bundle, local_path, staged
from iobundle.capture import RecordedCalls, save_recorded_calls
from iobundle.errors import BundleWriteError, IntegrityError
from iobundle.replay import Bundle, load_bundle
from iobundle.schema import Manifest, write_manifest
from iobundle.travel import copy_model_files

__all__ = ["upgrade_bundle"]

logger = logging.getLogger(__name__)


def upgrade_bundle(
    bundle: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    on_progress: ProgressCallback | None = None,
) -> Manifest:
    """Write ``bundle`` (any format version, or a killed stream's journal) to ``output`` in the newest version.

    The calls, their tensors (read with every check, hashes included), the stored model, the
    producer and the redaction marker are kept; the tensors are laid out as this iobundle writes
    them (segments that are safetensors files). The result is verified (every file's size, hash
    and header) and each tensor compared, byte for byte, with the one read from ``bundle``.
    ``bundle`` is never changed.

    Raises:
        BundleWriteError: ``output`` is ``bundle``, inside it or holds it.
        BundleExistsError: ``output`` is not empty and ``overwrite`` is False.
        IntegrityError: The written bundle does not read back as ``bundle`` (the message names what
            differs); it is removed.
    """
    source, target = local_path(bundle), local_path(output)
    if source is not None and target is not None:
        a, b = Path(source).resolve(), Path(target).resolve()
        if a == b or a in b.parents or b in a.parents:
            raise BundleWriteError(
                f"Cannot upgrade '{bundle}' into '{output}': one is the other or inside it, and a bundle is never "
                "rewritten in place. Choose an output outside the bundle."
            )
    old = load_bundle(bundle)
    with contextlib.nullcontext(target) if target is not None else staged(str(output), overwrite=overwrite) as local:
        calls = RecordedCalls(
            signature=old.manifest.signature,
            calls=old.calls,
            store=_Tensors(old),
            value_if_missing=list(old.manifest.value_if_missing),
        )
        manifest = save_recorded_calls(calls, local, overwrite=overwrite, on_progress=on_progress)
        model = copy_model_files(old, local) if old.manifest.model is not None else None
        update = {"producer": old.manifest.producer, "model": model, "redacted": old.manifest.redacted}
        manifest = manifest.model_copy(update=update)
        write_manifest(local, manifest)
        new = load_bundle(local)
        problems = new.verify()
        problems += [
            f"tensor {k!r} differs from '{bundle}'"
            for k in old.manifest.tensors
            if not _same(old.tensor(k), new.tensor(k))
        ]
        if problems:
            if target is not None:  # never leave a bundle that does not read back as the old one
                clear_local_bundle(Path(local))
            raise IntegrityError(
                f"The upgrade of '{bundle}' into '{output}' does not read back: " + "; ".join(problems[:5])
            )
    logger.info("upgraded %s (format version %d) into %s", bundle, old.manifest.format_version, output)
    return manifest


class _Tensors:
    """The old bundle's tensors, each read (and checked) when the writer asks for it."""

    def __init__(self, bundle: Bundle) -> None:
        self.get = bundle.tensor

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.get(key).shape)

    def dtype(self, key: str) -> torch.dtype:
        return self.get(key).dtype


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same dtype, shape and bytes (``-0.0`` and NaN payloads count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
