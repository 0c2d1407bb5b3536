"""The Policy API: the only surface an eviction policy sees.

A policy works on logical token ids of one request at a time and never learns about blocks,
slots or reclamation. The engine calls ``observe(req_id, token_ids, attn)`` after every step
(live ids in logical order, the new token last; attention as ``PagedDecoder`` stats), then
``select_victims(req_id, live_ids, budget)`` and evicts what comes back, and
``forget(req_id)`` when the request finishes.

``select_victims`` returns a sorted int64 array of distinct ids of ``live_ids`` leaving at
most ``budget``, never the newest (``live_ids[-1]``), empty when ``len(live_ids) <= budget``;
deterministic. ``budget < 1`` with tokens present is an error.

A subclass implements ``keep_scores`` (higher = keep longer; ``inf`` = protected): the
lowest finite scores go first, ties to the older token; protected tokens only when the
budget cannot be met otherwise, oldest first.

Owns: nothing itself; a subclass owns its per-request state, dropped by ``forget``.
May call: numpy, abc; never spec/, invariants/, fuzz/ or reports/.
Costs: ``select_victims`` O(n log n) for n live ids, plus the subclass's ``keep_scores``.
"""

from __future__ import annotations

import abc

from typing import Hashable

import numpy as np
from ..errors import CallError

__all__ = ["Policy", "protect_recent"]


def protect_recent(score: np.ndarray, recent: int) -> np.ndarray:
    """A float64 copy of ``score`` with the last ``recent`` entries set to ``inf``."""
    out = np.array(score, dtype=np.float64, copy=True)
    if recent > 0:
        out[-recent:] = np.inf
    return out


class Policy(abc.ABC):
    """Base class; see the module docstring for the contract. A policy implements ``keep_scores``."""

    name = "base"
    #: Whether ``observe`` reads attention. A driver that has to synthesize attention (the
    #: simulator) feeds it only to policies that say True, so a new attention-based policy
    #: declares it here rather than being listed by name somewhere else.
    uses_attention: bool = False

    def observe(self, req_id: Hashable, token_ids: np.ndarray, attn: np.ndarray) -> None:
        """Record one step's attention; ``token_ids`` and ``attn`` have equal length."""

    def forget(self, req_id: Hashable) -> None:
        """Drop all state kept for ``req_id`` (unknown ids are ignored)."""

    @abc.abstractmethod
    def keep_scores(self, req_id: Hashable, live_ids: np.ndarray, budget: int) -> np.ndarray:
        """Keep-priority per live token (same length as ``live_ids``)."""

    def select_victims(self, req_id: Hashable, live_ids: np.ndarray, budget: int) -> np.ndarray:
        ids = np.asarray(live_ids, dtype=np.int64)
        if ids.ndim != 1:
            raise CallError("bad_shape", f"live_ids must be 1-D, got shape {ids.shape}")
        n_evict = ids.size - int(budget)
        if n_evict <= 0:
            return np.empty(0, dtype=np.int64)
        if budget < 1:
            raise CallError("bad_value", f"budget {budget} < 1: the newest token must survive")
        score = np.asarray(self.keep_scores(req_id, ids, int(budget)), dtype=np.float64)
        if score.shape != ids.shape:
            raise CallError("bad_shape", f"{self.name}: keep_scores gave {score.shape}, want {ids.shape}")
        score = np.where(np.isnan(score), -np.inf, score)
        # The newest token is never a candidate; lexsort: by score, then logical order.
        order = np.lexsort((np.arange(ids.size - 1), score[:-1]))
        return np.sort(ids[order[:n_evict]])
