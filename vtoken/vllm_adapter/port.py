"""vLLM's block pool as the lifecycle's pool (``vtoken.lifecycle``): the one place the adapter's
blocks go back to vLLM.

Owns: nothing (it forwards to vLLM's pool and scheduler, read through the harness each time:
vLLM's tests swap the manager after construction).
May call: vLLM's ``BlockPool`` (``get_new_blocks``, ``free_blocks``, the free count) and
``Scheduler._free_cow_retained_blocks``.
Costs: O(blocks given) per call plus vLLM's own.
"""

from __future__ import annotations


class VllmPort:
    """The pool a :class:`~vtoken.lifecycle.Lifecycle` frees to and reserves from, over
    ``harness`` (whose ``scheduler`` and ``pool`` are the adapter's); ``stats``: the adapter's
    counters (``deferred_free_calls``). Called by the lifecycle only."""

    def __init__(self, harness, stats: dict):
        self.harness, self.stats = harness, stats

    def free(self, ids: list, fence: int) -> None:
        """vLLM's own fenced free, ``_free_cow_retained_blocks``: at once when step ``fence``
        was processed, else deferred to it (a block a step in flight may still read)."""
        blocks = self.harness.pool.blocks
        self.harness.scheduler._free_cow_retained_blocks([blocks[b] for b in ids], fence)
        self.stats["deferred_free_calls"] += 1

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
