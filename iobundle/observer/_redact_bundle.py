"""``redact_bundle``: read a bundle (replay), replace its inputs by synthetic ones, write it (capture)."""

from __future__ import annotations

import contextlib
import logging
import os

from iobundle._progress import ProgressCallback
from iobundle._remote import local_path, staged
from iobundle.capture import save_recorded_calls
from iobundle.replay import Bundle, load_bundle
from iobundle.schema import Manifest, Redaction, write_manifest
from iobundle.travel import copy_model_files, redact_calls

__all__ = ["redact_bundle"]

logger = logging.getLogger(__name__)


def redact_bundle(
    bundle: Bundle | str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    keep_outputs: bool = False,
    keep_model: bool = False,
    seed: int = 0,
    overwrite: bool = False,
    on_progress: ProgressCallback | None = None,
) -> Manifest:
    """Write a copy of ``bundle`` to ``output`` whose recorded inputs are synthetic: for bug reports.

    Every input tensor becomes one of the same dtype and shape (integers within the observed
    range, so token ids stay valid; masks stay masks; increasing positions still increase; see
    :mod:`iobundle.replay`'s ``redact_calls``). The recorded outputs and the stored model are
    dropped unless ``keep_outputs`` / ``keep_model``. The manifest's ``redacted`` field says so.
    ``iobundle export`` works from the result (without recorded outputs it checks the exported
    program against the eager model); ``iobundle validate`` says there is nothing to compare
    against when the outputs were dropped.

    Args:
        bundle: The bundle (directory, packed file or URL), or one already loaded.
        output: The new bundle directory (or URL, with fsspec).
        keep_outputs: Keep the recorded outputs (they are the model's, computed on the real inputs).
        keep_model: Keep the model's config and weights stored in the bundle.
        seed: Seed of the synthetic values (the same seed gives the same bundle).
        overwrite: Replace what ``output`` holds.
        on_progress: Called with a :class:`~iobundle.replay.ProgressEvent` per call, for the
            synthetic inputs (task ``"redact"``), then for the writing (task ``"write"``).

    Returns:
        The manifest written.

    Raises:
        BundleExistsError: ``output`` is not empty and ``overwrite`` is False.
        ModelLoadError: ``keep_model`` but the bundle stores no model.

    Example:
        >>> redact_bundle("run.iobundle", "bug-report.iobundle").redacted
        Redaction(outputs_kept=False, model_kept=False, seed=0)
    """
    source = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    rc = redact_calls(source, keep_outputs=keep_outputs, seed=seed, on_progress=on_progress)
    target = local_path(output)
    with contextlib.nullcontext(target) if target is not None else staged(str(output), overwrite=overwrite) as local:
        manifest = save_recorded_calls(rc, local, overwrite=overwrite, on_progress=on_progress)
        model = copy_model_files(source, local) if keep_model else None
        marker = Redaction(outputs_kept=keep_outputs, model_kept=model is not None, seed=seed)
        manifest = manifest.model_copy(update={"model": model, "redacted": marker})
        write_manifest(local, manifest)
    logger.info("redacted %d calls of %s into %s", len(manifest.calls), source.path, output)
    return manifest
