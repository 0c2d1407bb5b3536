"""Prefix-hash hygiene: a block keeps its prefix-cache hash only while its bytes are what its
token ids promise.

- a plan's sources and fills lose their hash at launch and are never hashed again
  (:meth:`PrefixHashRules.drop_sources`): a block in flight must never become a prefix hit;
- a released block keeps its hash only if computed with full context (:meth:`on_release`);
- any block hashed after the request's first eviction is unfaithful (its tokens attended to
  fewer tokens than a fresh prefill): :meth:`evict_unfaithful` drops those once the worker
  reports the full-context length, and at preemption or finish.

Owns: per request the full-context length (``faithful``) and how far its list was scanned
(``scanned``); the record of kept hashes (``kept``). The hashes themselves are vLLM's.
May call: ``BlockPool.evict_blocks`` and the manager's cached-block counts only.
Costs: each positional block is scanned once per incarnation; per step O(requests that
evicted), an O(1) test each.
"""

from __future__ import annotations

import math
from typing import Optional


class PrefixHashRules:
    def __init__(self, pool, manager, block_size: int, stats: dict, enabled: bool = True):
        self.pool, self.manager, self.S = pool, manager, int(block_size)
        self.stats = stats  # the adapter's counters (hashes_kept, hashes_evicted, ...)
        self.enabled = enabled  # evict_unfaithful_hashes
        self.faithful: dict[str, int] = {}  # req -> tokens computed with full context (worker report)
        self.scanned: dict[str, int] = {}  # req -> positional index scanned for unfaithful hashes
        self.kept: list[tuple[int, str]] = []  # (block, why) hashes kept on released blocks

    def restart(self, r: str) -> None:
        """A new block list for ``r`` (new or resumed): nothing of it was scanned."""
        self.scanned.pop(r, None)

    def forget(self, r: str) -> None:
        self.faithful.pop(r, None)
        self.scanned.pop(r, None)

    def absorb(self, reported: dict, started: dict, processed: int) -> None:
        """The worker's full-context lengths, for the requests whose current list started
        (``started``: request -> the step its incarnation began, the mirror's) at or before
        ``processed``: the worker has executed that incarnation."""
        late = 1 << 62
        self.faithful = {r: v for r, v in reported.items() if started.get(r, late) <= processed}

    def is_faithful(self, r: str, index: int) -> bool:
        """Was positional block ``index`` of ``r`` computed with full context?"""
        if index < 0:
            return False
        return (index + 1) * self.S <= self.faithful.get(r, math.inf)

    def evict_unfaithful_grown(self, req_to_blocks) -> None:
        """``evict_unfaithful`` for every request that evicted and whose cached block count
        passed what was scanned (the others have nothing new to scan). O(requests that
        evicted), each an O(1) test."""
        if not self.enabled:
            return
        cached, scanned = self.manager.num_cached_block, self.scanned
        for r in self.faithful:
            if cached.get(r, 0) > scanned.get(r, 0):
                self.evict_unfaithful(r, req_to_blocks.get(r))

    def evict_unfaithful(self, r: str, lst, upto: Optional[int] = None) -> None:
        """Drop the hash of ``r``'s private blocks computed after its first eviction; each
        positional block scanned once (up to vLLM's cached count, or ``upto`` at the end)."""
        f = self.faithful.get(r)
        if not self.enabled or f is None or not lst:
            return
        end = len(lst) if upto is None else min(upto, len(lst))
        if upto is None:
            end = min(end, self.manager.num_cached_block.get(r, 0))
        start = max(self.scanned.get(r, 0), f // self.S)
        drop = {blk.block_id for blk in lst[start:end]
                if not blk.is_null and blk.block_hash is not None and blk.ref_cnt == 1}
        if drop:  # one call for the request's scan
            self.pool.evict_blocks(drop)
            self.stats["unfaithful_hashes_evicted"] += len(drop)
        self.scanned[r] = max(start, end)

    def on_release(self, r: str, blk, index: int) -> None:
        """A block of ``r`` at ``index`` released with all its tokens dead: keep its hash
        only if it was computed with full context."""
        if blk.block_hash is None:
            return
        if self.is_faithful(r, index):
            self.stats["hashes_kept"] += 1
            self.kept.append((blk.block_id, "released empty, bytes untouched, full context"))
        else:
            self.pool.evict_blocks({blk.block_id})
            self.stats["hashes_evicted"] += 1

    def drop_sources(self, blocks) -> None:
        """A plan launches with ``blocks`` as its sources and fills: no prefix hit may land on
        one in flight, and a fill's bytes change (one ``evict_blocks`` call for the plan)."""
        hashed = {blk.block_id for blk in blocks if blk.block_hash is not None}
        if hashed:
            self.pool.evict_blocks(hashed)
            self.stats["source_hashes_dropped"] += len(hashed)
