"""Scissorhands: evict tokens whose importance does not persist.

A token is important at a step if it got at least ``1/t`` of that step's attention (t =
tokens attended); its score is the fraction of the last ``history`` observed steps it was
present in where it was important. The lowest goes first; the most recent ``recent`` tokens
are protected.

Owns: per request a deque of the last ``history`` steps' ids and importance, dropped by ``forget``.
May call: numpy, collections, vtoken.policies.base; never spec/, invariants/, fuzz/ or reports/.
Costs: ``observe`` O(ids); ``keep_scores`` O(history x ids).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from vtoken.policies.base import Policy, protect_recent


class Scissorhands(Policy):
    name = "scissorhands"
    uses_attention = True

    def __init__(self, history: int = 32, recent: int = 16) -> None:
        self.history, self.recent = history, recent
        self._hist: dict = {}  # req_id -> deque of (ids, important) per step

    def observe(self, req_id, token_ids, attn) -> None:
        ids, a = np.asarray(token_ids, dtype=np.int64), np.asarray(attn, dtype=np.float64)
        imp = a >= a.sum() / max(ids.size, 1)
        self._hist.setdefault(req_id, deque(maxlen=self.history)).append((ids, imp))

    def forget(self, req_id) -> None:
        self._hist.pop(req_id, None)

    def keep_scores(self, req_id, live_ids, budget):
        hist = self._hist.get(req_id, ())
        size = max([int(live_ids.max())] + [int(i.max()) for i, _ in hist if i.size]) + 1
        hits, seen = np.zeros(size), np.zeros(size)
        for ids, imp in hist:
            hits[ids] += imp
            seen[ids] += 1
        score = hits[live_ids] / np.maximum(seen[live_ids], 1)
        return protect_recent(score, self.recent)
