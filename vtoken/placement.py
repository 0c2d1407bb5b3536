"""The planner's placement rule, written once so it can be run and proved.

Out of place, the ``k``-th live token of a plan's sources (logical order, from 0) goes to
destination ``k // S`` at offset ``k % S`` (:func:`place`). In place (:func:`holes`), the
``k``-th moved token takes the ``k``-th hole of the plan's fills, fill after fill, ascending
offset. :func:`place` uses only array ``+``/``-``, ``//``, ``%`` and an injected if-then-else,
so the same code runs on integers (the planner) and on Z3 terms (the proof in ``invariants/``).

Owns: nothing (pure functions).
May call: numpy only; never spec/, invariants/, fuzz/ or reports/ (the proof in invariants/ calls
it, not the other way round).
Costs: ``place`` O(candidate tokens) in numpy, ``holes`` O(fills x S), ``dest_count`` O(1).
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def place(live, S: int, ite: Callable = np.where, zero=0, one=1) -> tuple:
    """For each candidate token (logical order): ``(dest_index, offset)``, as two arrays.

    ``live``: 1-d flags (a dead candidate's entry is meaningless); ``dest_index`` indexes the
    plan's destinations; ``ite(flags, a, b)``: elementwise if-then-else (``np.where``, or the
    proof's symbolic one). O(candidates), vectorised.
    """
    inc = ite(live, one, zero)  # 1 for a live candidate, 0 for a dead one
    before = np.cumsum(inc) - inc  # live candidates before each: its rank among the live (k)
    return before // S, before % S


def dest_count(n_live: int, S: int) -> int:
    """ceil(n_live / S): destinations a plan needs for ``n_live`` tokens."""
    return -(-n_live // S)


def holes(occupied, fills) -> tuple:
    """The fill order of in-place compaction: ``(block, offset)`` arrays of every hole of
    ``fills``, in list order, ascending offset; ``occupied``: a ``(len(fills), S)`` bool array of
    the slots holding a live token. O(fills x S)."""
    occ = np.asarray(occupied, dtype=bool)
    row, offset = np.nonzero(~occ)  # row-major: fill order, then ascending offset
    return np.asarray(fills, dtype=np.int64)[row], offset.astype(np.int64)
