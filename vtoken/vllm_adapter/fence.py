"""The fence ledger: no plan source goes back to the pool before its fence.

A plan rides on step ``seq``: that step's forward still reads its sources and the copy out
of them runs after it, so a source may return to the pool only when BOTH hold: step ``seq``
has been processed (``processed_step_seq >= seq``) and the worker reported the copy done.
:meth:`FenceLedger.check` verifies every closed entry once.
Owns: one entry per pending source (opened at launch, marked when the copy is reported,
closed when the adapter hands the block back), and the closed entries not yet checked.
May call: nothing but ``assumptions``.
Costs: O(sources of the plan) per operation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from .assumptions import AdapterAssumptionError


@dataclass(slots=True)
class FenceEntry:
    block: int
    plan: int
    req_id: str
    fence: int  # the plan's step seq
    copy_done: bool = False
    freed_at: Optional[int] = None  # processed_step_seq when it was handed back to the pool
    freed_copy_done: Optional[bool] = None


class FenceLedger:
    def __init__(self):
        self.pending: dict[int, FenceEntry] = {}  # source block id -> entry
        self.closed: deque = deque(maxlen=4096)  # handed back, not yet checked (kept for reports)

    def __len__(self) -> int:
        return len(self.pending)

    def open(self, plan) -> None:
        """The plan launched: each source is pending until its fence."""
        for b in plan.source_ids:
            self.pending[b] = FenceEntry(b, plan.id, plan.req_id, plan.seq)

    def copy_reported(self, plan, done: bool) -> None:
        for b in plan.source_ids:
            e = self.pending.get(b)
            if e is not None and e.plan == plan.id:
                e.copy_done = bool(done)

    def drop(self, plan) -> None:
        """The plan aborted: its sources are not handed back through the fence."""
        for b in plan.source_ids:
            self.pending.pop(b, None)

    def close(self, block: int, processed: int, copy_done: bool) -> None:
        """The adapter hands ``block`` back now (at processed step ``processed``)."""
        e = self.pending.pop(block, None)
        if e is not None:
            e.freed_at, e.freed_copy_done = processed, copy_done
            self.closed.append(e)

    def check(self) -> None:
        """Every source handed back since the last check was past its fence."""
        while self.closed:
            e = self.closed.popleft()
            if e.freed_at is None or e.freed_at < e.fence or not e.freed_copy_done:
                raise AdapterAssumptionError(
                    "fence", f"block {e.block} (source of plan {e.plan}, request {e.req_id!r}) freed at step "
                    f"{e.freed_at} (the last processed step), fence {e.fence}: step {e.fence} processed and the "
                    f"copy completed (copy completed: {'yes' if e.freed_copy_done else 'no'})")
