"""The fence ledger: no plan source goes back to the pool before its fence.

A plan rides on step ``seq``: a source may return to the pool only when step ``seq`` has been
processed (``processed_step_seq >= seq``) AND the worker reported the copy done.
:meth:`FenceLedger.check` verifies every closed entry once.
Owns: one entry per plan whose sources are pending (opened at launch, closed with the copy's
state when the adapter hands the sources back), and the closed entries not yet checked.
May call: nothing but ``assumptions``.
Costs: O(1) per operation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from .assumptions import AdapterAssumptionError


@dataclass(slots=True)
class FenceEntry:
    plan: int
    req_id: str
    fence: int  # the plan's step seq
    sources: list  # the plan's source block ids
    freed_at: Optional[int] = None  # processed_step_seq when its sources were handed back to the pool
    freed_copy_done: Optional[bool] = None


class FenceLedger:
    def __init__(self):
        self.pending: dict[int, FenceEntry] = {}  # plan id -> the entry of its sources
        self.closed: deque = deque(maxlen=4096)  # handed back, not yet checked (kept for reports)

    def __len__(self) -> int:
        """Plans whose sources are pending."""
        return len(self.pending)

    def open(self, plan) -> None:
        """The plan launched: its sources are pending until their fence."""
        self.pending[plan.id] = FenceEntry(plan.id, plan.req_id, plan.seq, list(plan.sources))

    def drop(self, plan) -> None:
        """The plan aborted: its sources are not handed back through the fence."""
        self.pending.pop(plan.id, None)

    def close(self, plan, processed: int, copy_done: bool) -> None:
        """The adapter hands the plan's sources back now (at processed step ``processed``)."""
        e = self.pending.pop(plan.id, None)
        if e is not None:
            e.freed_at, e.freed_copy_done = processed, copy_done
            self.closed.append(e)

    def check(self) -> None:
        """Every plan whose sources were handed back since the last check was past its fence."""
        while self.closed:
            e = self.closed.popleft()
            if e.freed_at is None or e.freed_at < e.fence or not e.freed_copy_done:
                raise AdapterAssumptionError(
                    "fence", f"blocks {e.sources} (sources of plan {e.plan}, request {e.req_id!r}) freed at step "
                    f"{e.freed_at} (the last processed step), fence {e.fence}: step {e.fence} processed and the "
                    f"copy completed (copy completed: {'yes' if e.freed_copy_done else 'no'})")
