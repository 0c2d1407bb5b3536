"""The fence: the step clock it runs on, and the ledger that no plan source goes back to the
pool before its fence.

A plan rides on step ``seq``: a source may return to the pool only when step ``seq`` has been
processed (``clock.processed >= seq``) AND the worker reported the copy done.
:meth:`FenceLedger.check` verifies every closed entry once.

The clock (:class:`StepClock`) is vLLM's own (``sched_step_seq`` / ``processed_step_seq``) when
vLLM runs its deferred frees (``defer_block_free``: a KV-consumer connector with overlapping
batches sets it), else the adapter's, advanced by the hooks as vLLM advances its own (non-empty
steps only). The adapter never switches vLLM's flag: vLLM frees its lists as it would without
vtoken, and only the adapter's own blocks (plan sources, released blocks, a finished request's
destinations and fills) wait for their fence (``port.VllmPort``).
Owns: the clock's counters (its own mode) and each request's last scheduled step; one ledger
entry per plan whose sources are pending (opened at launch, closed with the copy's state when
the adapter hands the sources back), and the closed entries not yet checked.
May call: nothing but ``assumptions`` and the scheduler it is given (read only).
Costs: O(1) per operation; O(requests scheduled) per step for the clock's own mode.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from .assumptions import AdapterAssumptionError


class StepClock:
    """The steps the fence counts over ``harness.scheduler`` (read each time): ``seq``, the last
    non-empty step scheduled; ``processed``, the last whose output was processed. ``own``: the
    adapter's counters (vLLM's ``defer_block_free`` was off when the adapter attached), else
    vLLM's. The hooks call :meth:`scheduled` after ``schedule()`` and :meth:`processing` before
    ``update_from_output()``; the adapter alone advances its own counters."""

    def __init__(self, harness):
        self.harness = harness
        self.own = not harness.scheduler.defer_block_free
        self._seq = self._processed = 0
        self.last: dict = {}  # request -> the last step that scheduled it (own mode)

    @property
    def seq(self) -> int:
        return self._seq if self.own else self.harness.scheduler.sched_step_seq

    @property
    def processed(self) -> int:
        return self._processed if self.own else self.harness.scheduler.processed_step_seq

    def scheduled(self, sched_out) -> None:
        """A step was scheduled: a non-empty one counts, and it is each scheduled request's last."""
        if self.own and sched_out.total_num_scheduled_tokens > 0:
            self._seq += 1
            self.last.update(dict.fromkeys(sched_out.num_scheduled_tokens, self._seq))  # in C, not per request

    def processing(self, sched_out) -> None:
        """A step's output is about to be processed (outputs come in the order steps were scheduled)."""
        if self.own and sched_out.total_num_scheduled_tokens > 0:
            self._processed += 1

    def settled(self, request) -> bool:
        """Has every step that scheduled ``request`` been processed (its blocks free at once)?"""
        if self.own:
            return self.last.get(request.request_id, 0) <= self._processed
        return self.harness.scheduler._request_blocks_can_be_freed(request)

    def forget(self, r: str) -> None:
        self.last.pop(r, None)


@dataclass(slots=True)
class FenceEntry:
    plan: int
    req_id: str
    fence: int  # the plan's step seq
    sources: list  # the plan's source block ids
    freed_at: Optional[int] = None  # processed_step_seq when its sources were handed back to the pool
    freed_copy_done: Optional[bool] = None


class FenceLedger:
    """The fence's ledger over ``clock`` (the :class:`StepClock` the adapter's hooks advance)."""

    def __init__(self, clock: StepClock):
        self.clock = clock
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
