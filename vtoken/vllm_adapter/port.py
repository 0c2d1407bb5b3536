"""vLLM's block pool as the lifecycle's pool (``vtoken.lifecycle``): the one place the adapter's
blocks go back to vLLM.

Owns: the adapter's deferred frees when the fence runs on its own clock (``fence.StepClock``:
``(fence step, block ids)``, drained as steps are processed); nothing else (it forwards to
vLLM's pool and scheduler, read through the harness each time: vLLM's tests swap the manager
after construction).
May call: vLLM's ``BlockPool`` (``get_new_blocks``, ``free_blocks``, the free count) and
``Scheduler._free_cow_retained_blocks`` (vLLM's clock).
Costs: O(blocks given) per call plus vLLM's own; O(entries due) per drain.
"""

from __future__ import annotations

from collections import Counter, deque


class VllmPort:
    """The pool a :class:`~vtoken.lifecycle.Lifecycle` frees to and reserves from, over
    ``harness`` (whose ``scheduler`` and ``pool`` are the adapter's) and the fence's ``clock``;
    ``stats``: this room's own counters (``deferred_free_calls``; ``VTokenAdapter.stats`` reads them). Called by the lifecycle only,
    and :meth:`drain` by the adapter's hook after a step is processed."""

    def __init__(self, harness, clock, stats: dict):
        self.harness, self.clock, self.stats = harness, clock, stats
        self.deferred: deque = deque()  # (fence step, block ids): the clock's own mode only

    def free(self, ids: list, fence: int) -> None:
        """A fenced free: at once when step ``fence`` was processed, else deferred to it (a block
        a step in flight may still read). vLLM's clock: vLLM's own ``_free_cow_retained_blocks``;
        the adapter's: this port's queue."""
        blocks = self.harness.pool.blocks
        self.stats["deferred_free_calls"] += 1
        if not self.clock.own:
            self.harness.scheduler._free_cow_retained_blocks([blocks[b] for b in ids], fence)
        elif fence <= self.clock.processed:
            self.harness.pool.free_blocks([blocks[b] for b in ids])
        else:
            self.deferred.append((fence, list(ids)))

    def drain(self) -> None:
        """Free the deferred blocks whose fence step has been processed (fences are queued in
        step order but for a request's fence, which may trail: every due entry is freed)."""
        if not self.deferred:
            return
        processed, blocks = self.clock.processed, self.harness.pool.blocks
        due = [ids for f, ids in self.deferred if f <= processed]
        if due:
            self.deferred = deque((f, ids) for f, ids in self.deferred if f > processed)
            for ids in due:
                self.harness.pool.free_blocks([blocks[b] for b in ids])

    def deferred_counts(self) -> Counter:
        """References each block keeps in this port's deferred frees (empty when none wait)."""
        return Counter(b for _, ids in self.deferred for b in ids)

    def reserve(self, n: int) -> list:
        """``n`` free blocks for the headroom (ref_cnt 1, in no request's list, never hashed);
        the caller asks only for what is free."""
        return [b.block_id for b in self.harness.pool.get_new_blocks(int(n))] if n > 0 else []

    def unreserve(self, ids: list) -> None:
        """Headroom blocks back to vLLM's free queue now: never written, never read by a step
        (no fence)."""
        blocks = self.harness.pool.blocks
        self.harness.pool.free_blocks([blocks[b] for b in ids])

    def adopt(self, ids: list) -> None:
        """A written destination already carries its one reference (the adapter's): nothing to do."""

    def num_free(self) -> int:
        return self.harness.pool.get_num_free_blocks()
