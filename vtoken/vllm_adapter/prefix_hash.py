"""Prefix-hash hygiene: a block keeps its prefix-cache hash only while its bytes are what its
token ids promise; a hash is dropped only when the bytes change or the block is reused.

- a plan's fills lose their hash at launch (their holes take moved tokens: the bytes change);
  its sources' hashes are *parked* at launch (:meth:`PrefixHashRules.park`: out of vLLM's map,
  so no prefix hit lands on a block in flight) and put back when the plan ends
  (:meth:`PrefixHashRules.restore`) when they go back to the pool (the plan applied, or ended
  with its request gone): a copy only reads its sources, so their bytes are still what a fresh
  prefill writes, and a later request repeating the prompt hits them once they are free (until
  vLLM hands them out again, which drops the hash). Sources an aborted copy hands back to a
  request still running are held outside its list and carry no hash (:meth:`unpark`). Only a
  source computed with full context is parked; the others' hashes are dropped;
- a released block keeps its hash only if computed with full context (:meth:`on_release`);
- any block hashed after the request's first eviction is unfaithful (its tokens attended to
  fewer tokens than a fresh prefill): :meth:`evict_unfaithful` drops those once the worker
  reports the full-context length, and at preemption or finish.

Owns: per request the full-context length (``faithful``) and how far its list was scanned
(``scanned``); the record of kept hashes (``kept``); per plan in flight its sources' parked
hashes (``parked``); with ``changes`` (a reclaiming adapter: its plan book empties it), the requests
whose full-context length changed since the reader took them. The hashes themselves are vLLM's.
May call: ``BlockPool.evict_blocks``, ``_remove_cached_block_hashes`` / ``_insert_block_hash``
(parking; the contract ``hash_parking``) and the manager's cached-block counts only.
Costs: each positional block is scanned once per incarnation; per step O(requests that
evicted), an O(1) test each.
"""

from __future__ import annotations

import math
from typing import Optional


class PrefixHashRules:
    def __init__(self, pool, manager, block_size: int, stats: dict, enabled: bool = True, changes: bool = False):
        self.pool, self.manager, self.S = pool, manager, int(block_size)
        self.stats = stats  # this room's own counters (hashes_kept, hashes_evicted, ...), read by VTokenAdapter.stats
        self.enabled = enabled  # evict_unfaithful_hashes
        self.faithful: dict[str, int] = {}  # req -> tokens computed with full context (worker report)
        self.scanned: dict[str, int] = {}  # req -> positional index scanned for unfaithful hashes
        self.kept: list[tuple[int, str]] = []  # (block, why) hashes kept on released blocks
        self.parked: dict[int, list] = {}  # plan id -> [(source block id, its hashes, num_tokens)]
        # requests whose full-context length changed (``changes``; None: not kept): the plan book
        # empties it at each plan step, so only a reclaiming adapter keeps it (else it would only grow)
        self.changed: set | None = set() if changes else None
        # the last report absorbed whole (every request in it visible): an equal one changes nothing
        # until a list restarts or a request is forgotten (absorb)
        self._absorbed: dict | None = None

    def restart(self, r: str) -> None:
        """A new block list for ``r`` (new or resumed): nothing of it was scanned."""
        self.scanned.pop(r, None)
        self._absorbed = None  # its incarnation moved: which lengths are visible may change

    def forget(self, r: str) -> None:
        self._absorbed = None
        if self.faithful.pop(r, None) is not None and self.changed is not None:
            self.changed.add(r)
        self.scanned.pop(r, None)

    def absorb(self, reported: dict, started: dict, processed: int) -> None:
        """The worker's full-context lengths, for the requests whose current list started
        (``started``: request -> the step its incarnation began, the mirror's) at or before
        ``processed``: the worker has executed that incarnation. A report equal to the last one,
        all of which was visible, changes nothing while no list restarted and no request was
        forgotten since (``processed`` only grows): O(requests) compared in C, else in Python."""
        if reported == self._absorbed:
            return
        late = 1 << 62
        new = {r: v for r, v in reported.items() if started.get(r, late) <= processed}
        old = self.faithful
        if self.changed is not None and new != old:  # compared in C; the changes are rare (first evictions)
            self.changed.update(r for r in new.keys() | old.keys() if new.get(r) != old.get(r))
        self.faithful = new
        self._absorbed = dict(reported) if len(new) == len(reported) else None

    def is_faithful(self, r: str, index: int) -> bool:
        """Was positional block ``index`` of ``r`` computed with full context?"""
        return 0 <= index < self.faithful_blocks(r)

    def faithful_blocks(self, r: str) -> int | float:
        """How many leading positional blocks of ``r`` were computed with full context (its
        full-context length over S, rounded down; infinite before its first eviction)."""
        f = self.faithful.get(r)
        return math.inf if f is None else f // self.S

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
        """``blocks`` lose their hash for good (one ``evict_blocks`` call): a plan's fills, whose
        bytes change, and sources not computed with full context."""
        hashed = {blk.block_id for blk in blocks if blk.block_hash is not None}
        if hashed:
            self.pool.evict_blocks(hashed)
            self.stats["source_hashes_dropped"] += len(hashed)

    def park(self, plan_id: int, r: str, sources, fills, list_index: dict) -> list[int]:
        """Plan ``plan_id`` of ``r`` launches: its fills' hashes dropped, its sources' taken out
        of vLLM's map until :meth:`restore` (a faithful source: computed with full context, by
        its list index; the others dropped too). Returns the sources parked (their bytes must
        stay as they are: nobody may poison or overwrite them)."""
        drop, parked = list(fills), []
        for blk in sources:
            if blk.block_hash is None:
                continue
            if not self.is_faithful(r, list_index.get(blk.block_id, -1)):
                drop.append(blk)
                continue
            n = blk.block_hash_num_tokens
            hashes = self.pool._remove_cached_block_hashes(blk)
            if hashes:
                parked.append((blk.block_id, hashes, n))
        self.drop_sources(drop)
        if parked:
            self.parked[plan_id] = parked
            self.stats["source_hashes_parked"] = self.stats.get("source_hashes_parked", 0) + len(parked)
        return [b for b, _, _ in parked]

    def restore(self, plan_id: int) -> None:
        """Plan ``plan_id`` ended: its sources' parked hashes go back into vLLM's map (bytes
        unchanged). A parked block that carries a hash now was re-hashed while it flew
        (``prefix_hash``: raised by the caller's check before this)."""
        for b, hashes, n in self.parked.pop(plan_id, ()):
            blk = self.pool.blocks[b]
            for i, h in enumerate(hashes):
                self.pool._insert_block_hash(h, blk, n if i == 0 else None)
            self.stats["source_hashes_restored"] = self.stats.get("source_hashes_restored", 0) + 1

    def unpark(self, plan_id: int) -> None:
        """Plan ``plan_id`` ended with its sources back with its request, held outside its list
        (an aborted copy): their parked hashes are dropped (held blocks carry none)."""
        self.parked.pop(plan_id, None)

    def unpark_all(self) -> None:
        """vLLM reset its prefix cache: nothing parked goes back."""
        self.parked.clear()
