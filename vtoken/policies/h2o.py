"""H2O (Heavy-Hitter Oracle): keep tokens with the largest accumulated attention.

A token's score is the sum of the attention it received over all observed steps; the lowest
goes first. The most recent ``recent`` tokens (or ``recent_ratio * budget`` when ``recent``
is None) are protected.

Owns: one accumulated-attention array per request, dropped by ``forget``.
May call: numpy, vtoken.policies.base; never spec/, invariants/, fuzz/ or reports/.
Costs: ``observe`` O(ids), amortised; ``keep_scores`` O(live ids).
"""

from __future__ import annotations

import numpy as np

from vtoken.policies.base import Policy, protect_recent


class H2O(Policy):
    name = "h2o"
    uses_attention = True

    def __init__(self, recent: int | None = None, recent_ratio: float = 0.5) -> None:
        self.recent, self.recent_ratio = recent, recent_ratio
        self._acc: dict = {}  # req_id -> float64 array indexed by logical token id

    def observe(self, req_id, token_ids, attn) -> None:
        ids = np.asarray(token_ids, dtype=np.int64)
        acc = self._acc.get(req_id, np.zeros(0))
        if ids.size and ids.max() >= acc.size:  # grow geometrically: amortised O(1)
            acc = np.concatenate([acc, np.zeros(max(int(ids.max()) + 1 - acc.size, acc.size))])
        acc[ids] += np.asarray(attn, dtype=np.float64)  # live ids are distinct
        self._acc[req_id] = acc

    def forget(self, req_id) -> None:
        self._acc.pop(req_id, None)

    def keep_scores(self, req_id, live_ids, budget):
        acc = self._acc.get(req_id, np.zeros(0))
        score = np.zeros(live_ids.size)
        known = live_ids < acc.size
        score[known] = acc[live_ids[known]]
        window = self.recent if self.recent is not None else int(budget * self.recent_ratio)
        return protect_recent(score, window)
