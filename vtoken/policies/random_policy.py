"""Random eviction: uniformly random victims among the non-recent tokens (the most recent
``recent`` are protected). Each request draws from its own generator seeded by ``(seed,
req_id)``, so its victims never depend on the other requests of a batch.

Owns: one seeded generator per request, dropped by ``forget``.
May call: numpy, zlib, vtoken.policies.base; never spec/, invariants/, fuzz/ or reports/.
Costs: ``keep_scores`` O(live ids).
"""

from __future__ import annotations

import zlib

import numpy as np

from vtoken.policies.base import Policy, protect_recent


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, seed: int = 0, recent: int = 8) -> None:
        self.seed, self.recent = seed, recent
        self._rngs: dict = {}

    def _rng(self, req_id) -> np.random.Generator:
        if req_id not in self._rngs:
            ok = isinstance(req_id, int) and not isinstance(req_id, bool) and req_id >= 0
            key = req_id if ok else zlib.crc32(repr(req_id).encode())  # stable across runs
            self._rngs[req_id] = np.random.default_rng([self.seed, key])
        return self._rngs[req_id]

    def forget(self, req_id) -> None:
        self._rngs.pop(req_id, None)

    def keep_scores(self, req_id, live_ids, budget):
        # Random keys: the lowest n_evict of n i.i.d. uniforms are a uniform random subset.
        return protect_recent(self._rng(req_id).random(live_ids.size), self.recent)
