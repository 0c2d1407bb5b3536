"""The planner's placement rule, written once so it can be run and proved.

Compaction packs the live tokens of a plan's source blocks into fresh destination blocks,
in logical order, filling each destination completely before the next: the ``k``-th live
token (counting in logical order from 0) goes to destination ``k // S`` at offset
``k % S``.

:func:`place` is written only with array ``+``/``-`` (a cumulative sum), ``//``, ``%`` and an
injected elementwise if-then-else, so the same code runs on integer arrays (the planner,
vectorised) and on object arrays of Z3 integer terms (the bounded proof in ``invariants/``):
the proof checks this function, not a transcription of it.

Owns: nothing (pure functions).
May call: numpy only; never spec/, invariants/, fuzz/ or reports/ (the proof in invariants/ calls
it, not the other way round).
In-place compaction (:func:`holes`) first fills the *holes* of the plan's fill blocks (slots
holding no live token), fill after fill, each in ascending offset; the ``k``-th moved token
takes the ``k``-th hole. Only tokens beyond the holes go to fresh destinations by ``place``.

Costs: ``place`` O(candidate tokens) in numpy, ``holes`` O(fills x S), ``dest_count`` O(1).
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def place(live, S: int, ite: Callable = np.where, zero=0, one=1) -> tuple:
    """For each candidate token (logical order): ``(dest_index, offset)``, as two arrays.

    ``live``: a 1-d array of flags, candidate ``i`` live or not; dead candidates get an
    entry too (it is meaningless and ignored). ``dest_index`` indexes the plan's destination
    list. ``ite(flags, a, b)`` is an elementwise if-then-else (``np.where`` on numbers; the
    proof passes a symbolic one and object arrays). O(candidates), vectorised.
    """
    inc = ite(live, one, zero)  # 1 for a live candidate, 0 for a dead one
    before = np.cumsum(inc) - inc  # live candidates before each: its rank among the live (k)
    return before // S, before % S


def dest_count(n_live: int, S: int) -> int:
    """ceil(n_live / S): destinations a plan needs for ``n_live`` tokens."""
    return -(-n_live // S)


def holes(occupied, fills) -> tuple:
    """The fill order of in-place compaction: ``(block, offset)`` arrays of every hole of
    ``fills``, fill after fill (in list order), ascending offset within a fill.

    ``occupied``: a ``(len(fills), S)`` bool array, row ``i`` the slots of ``fills[i]`` that
    hold a live token. The ``k``-th moved token (logical order) goes to the ``k``-th hole.
    O(fills x S).
    """
    occ = np.asarray(occupied, dtype=bool)
    row, offset = np.nonzero(~occ)  # row-major: fill order, then ascending offset
    return np.asarray(fills, dtype=np.int64)[row], offset.astype(np.int64)
