"""Pausing Python's cyclic garbage collector while a bundle's manifest is built.

A 1000-call manifest is some 150,000 objects and no reference cycle. With the collector on, building
them sets off full collections, each of which walks every object of the process (100-250 ms apiece
on the benchmark machine, with torch loaded) and frees nothing. Reference counting still frees
objects while the collector is paused; its previous state is restored however the block ends.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused(*, promote: bool = False) -> Iterator[None]:
    """Keep the cyclic collector off inside the block (blocks nest).

    Args:
        promote: When the collector resumes, move what was built (and every other tracked object)
            straight to the oldest generation (``gc.freeze()`` then ``gc.unfreeze()``, two list
            splices), instead of letting the next young collection walk all of it once more. For
            objects that outlive the block (an opened bundle); skipped when the process froze
            objects itself (before a fork), or when an enclosing block paused the collector.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if promote and gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()
