"""StreamingLLM: keep the first ``sink`` tokens and the most recent ``budget - sink``,
evicting the oldest middle token first. Attention is not used.

Owns: nothing per request (the ``sink`` count only).
May call: numpy, vtoken.policies.base; never spec/, invariants/, fuzz/ or reports/.
Costs: ``keep_scores`` O(live ids).
"""

from __future__ import annotations

import numpy as np

from vtoken.policies.base import Policy


class StreamingLLM(Policy):
    name = "streaming"

    def __init__(self, sink: int = 4) -> None:
        self.sink = sink

    def keep_scores(self, req_id, live_ids, budget):
        score = np.arange(live_ids.size, dtype=np.float64)  # older = lower = evicted first
        score[live_ids < self.sink] = np.inf
        return score
