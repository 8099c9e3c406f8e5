"""``python -m iobundle``: the ``iobundle`` command."""

from __future__ import annotations

from iobundle.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
