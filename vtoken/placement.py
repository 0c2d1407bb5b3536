"""The planner's placement rule, written once so it can be run and proved.

Compaction packs the live tokens of a plan's source blocks into fresh destination blocks,
in logical order, filling each destination completely before the next: the ``k``-th live
token (counting in logical order from 0) goes to destination ``k // S`` at offset
``k % S``.

:func:`place` is written only with ``+``, ``//``, ``%`` and an injected if-then-else, so the
same code runs on Python ints (the planner) and on Z3 integer expressions (the bounded
proof in ``invariants/``): the proof checks this function, not a transcription of it.

Owns: nothing (pure functions).
May call: typing only; never spec/, invariants/, fuzz/ or reports/ (the proof in invariants/ calls
it, not the other way round).
Costs: ``place`` O(candidate tokens), ``dest_count`` O(1).
"""

from __future__ import annotations

from typing import Callable, Sequence


def _py_ite(c, a, b):
    return a if c else b


def place(live: Sequence, S: int, ite: Callable = _py_ite, zero=0, one=1) -> list[tuple]:
    """For each candidate token (logical order) return ``(dest_index, offset)``.

    ``live[i]`` says whether candidate ``i`` is live; dead candidates get an entry too (it
    is meaningless and ignored). ``dest_index`` indexes the plan's destination list.
    """
    out = []
    k = zero  # live tokens placed so far
    for flag in live:
        out.append((k // S, k % S))
        k = ite(flag, k + one, k)
    return out


def dest_count(n_live: int, S: int) -> int:
    """ceil(n_live / S): destinations a plan needs for ``n_live`` tokens."""
    return -(-n_live // S)
