"""Planted faults, switched on by name without editing code.

A fault is a deliberate bug compiled into the hot path behind a name. The toolkit's checks
are measured by how many of them they catch (``vtoken fuzz --planted``). Faults are off
unless named in the ``VTOKEN_FAULTS`` environment variable (comma separated) or enabled
with :func:`planted`. The check is one frozenset membership test.
"""

from __future__ import annotations

import contextlib
import os

_active: frozenset[str] = frozenset(
    f.strip() for f in os.environ.get("VTOKEN_FAULTS", "").split(",") if f.strip()
)


def on(name: str) -> bool:
    """True when fault ``name`` is planted."""
    return name in _active


def active() -> frozenset[str]:
    return _active


@contextlib.contextmanager
def planted(*names: str):
    """Plant faults for the duration of a ``with`` block (tests, the planted-bug runner)."""
    global _active
    old = _active
    _active = old | frozenset(names)
    try:
        yield
    finally:
        _active = old
