"""The plan lifecycle: one record and one ledger, driven by every path.

``planned -> copying -> completed -> applied | aborted``, or ended as an *orphan* when its
request finished or was preempted while the copy flew. The decode engine and the simulator
drive it through :class:`~vtoken.planner.ReclamationManager`, the vLLM adapter through its
``PlanBook``; the planner machine checks the manager, so the bookkeeping it checks is this
module's on every path. Only what differs per path stays outside: where blocks come from
and go to (vtoken's allocator or vLLM's ``BlockPool``, reached through the one release
callable the ledger is given) and, in the adapter, vLLM's objects.

:class:`Plan` is the one plan record: block ids only (the adapter translates ids to vLLM's
``KVCacheBlock`` at vLLM's edge). :class:`PlanLedger` owns the plans in flight (by id, and
by request: a driver plans a request only while none of its plans flies, I4), the plan
ids, the snapshot clock, the history of recorded snapshots, and the outcome counts: every
opened plan is closed exactly once, as ``applied``, ``aborted`` or ``orphaned``, so once
nothing flies ``plans == applied + aborted + orphaned``. Every block a path frees (a plan's
sources, an all-dead block, an orphaned request's deferred blocks, a finished request's
blocks) goes through :meth:`PlanLedger.release`, the one place blocks return to a pool;
with reclamation off a path keeps a ledger with no plans for it.
Owns: the records and counts above; no block reference (the caller's rooms hold those).
May call: numpy (nothing of vtoken: every other module may import it).
Costs: O(1) per open, close and record; O(plans of the request) per orphan; ``release``
O(blocks) plus the pool's own free.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

PLANNED, COPYING, COMPLETED, APPLIED, ABORTED = "planned", "copying", "completed", "applied", "aborted"
OUTCOMES = ("applied", "aborted", "orphaned")


@dataclass
class Plan:
    """One compaction plan, from proposal to its end (block ids throughout).

    Ownership while it flies: the path's rooms hold one reference on each source and fill
    (taken over from the request) and on each destination (taken from the headroom); the
    plan itself owns none. ``seq`` is the scheduler step that carries it, its fence (0 where
    the copy is host-synced before apply, as in the decode engine)."""

    id: int
    req_id: object
    sources: list  # blocks the plan empties (all of them: moved-out and all-dead ones)
    dests: list  # fresh destination blocks, taken from the headroom
    moves: np.ndarray  # (k, 5): token, src_block, src_offset, dst_block, dst_offset
    fills: list = field(default_factory=list)  # the request's blocks whose holes take tokens (stay its own)
    state: str = PLANNED
    handle: object = None
    snapshot: Optional[dict] = None
    evicted_in_flight: list = field(default_factory=list)  # moved tokens that died while the copy flew
    orphaned: bool = False  # its request finished or was preempted while the copy flew
    seq: int = 0  # the step that carries it (its fence)
    list_index: dict = field(default_factory=dict)  # adapter: source or fill id -> its list index (-1: held)
    clock: Optional[Callable[[], int]] = field(default=None, repr=False)  # its ledger's clock (snapshot events)

    @property
    def reduction(self) -> int:
        return len(self.sources) - len(self.dests)

    @property
    def blocks(self) -> list:
        """Every block the copy touches (busy while it flies): sources, fills, dests."""
        return list(self.sources) + list(self.fills) + list(self.dests)

    def record(self, kind: str, **fields) -> None:
        """Append an event to the plan's snapshot schedule (when a snapshot is recorded)."""
        if self.snapshot is not None and self.clock is not None:
            self.snapshot["schedule"].append({"t": self.clock(), "kind": kind, **fields})


def all_dead(table, req_id, candidates, *, tail=None, busy=None) -> list[int]:
    """Of ``candidates`` (blocks of ``req_id``, in the order they would be freed), those
    reclamation may release now: no live token left (``n_b == 0``), referenced by ``req_id``
    alone (``refs == 1``: a shared block is never released, I4), not ``tail`` (the block being
    written), not ``busy`` (a bool mask over blocks: a source, fill or destination of a plan in
    flight, I3). The one rule of every path (decode engine, simulator, vLLM adapter); a path
    then keeps only the blocks it holds for the request. Order kept. O(len(candidates))."""
    b = np.asarray(candidates, dtype=np.int64).reshape(-1)
    if not len(b):
        return []
    ok = (table.n_b[b] == 0) & (table.refs[b] == 1)
    if tail is not None:
        ok &= b != int(tail)
    if busy is not None:
        ok &= ~busy[b]
    return b[ok].tolist()


def allocator_release(alloc) -> Callable:
    """The ledger's free over vtoken's ``BlockAllocator``: the fence is ignored (on these
    paths a plan ends only after its copy was host-observed complete)."""
    return lambda ids, fence: alloc.free(ids)


class PlanLedger:
    """The plans in flight and how each one ended (see the module docstring).

    Args:
        release: ``(block_ids, fence) -> None``, the path's free: vtoken's allocator (the
            fence ignored: those copies are host-synced before their plan ends) or vLLM's
            fenced ``_free_cow_retained_blocks``. The ledger calls it only from
            :meth:`release`.
        stats: the counters dict the outcome counts are kept in (the caller's ``stats``:
            ``plans``, ``applied``, ``aborted``, ``orphaned``).
        clock: the logical clock of snapshot events (default a counter from 0).
    """

    def __init__(self, release: Callable, stats: dict | None = None, clock: Callable | None = None):
        self._free = release
        self.stats = stats if stats is not None else {}
        for k in ("plans",) + OUTCOMES:
            self.stats.setdefault(k, 0)
        self.in_flight: dict[int, Plan] = {}
        self.busy: dict = {}  # request -> ids of its plans in flight (not orphaned)
        self.history: list = []  # ended plans whose snapshot the caller kept
        self._ids = itertools.count(1)
        self.clock = clock or itertools.count().__next__

    def new_plan(self, req_id, sources, dests, moves, fills=(), seq: int = 0) -> Plan:
        """A planned record with the next id, on this ledger's clock (nothing flies yet)."""
        return Plan(next(self._ids), req_id, [int(b) for b in sources], [int(b) for b in dests], moves,
                    [int(b) for b in fills], seq=int(seq), clock=self.clock)

    def open(self, plan: Plan) -> None:
        """planned -> copying: the plan flies. (Its blocks are disjoint from every other
        plan's in flight: the planner excludes them; the drivers' rooms assert it.)"""
        assert plan.state == PLANNED, f"plan {plan.id} opened in state {plan.state}"
        assert plan.id not in self.in_flight, f"plan {plan.id} opened twice"
        plan.state = COPYING
        self.in_flight[plan.id] = plan
        self.busy.setdefault(plan.req_id, set()).add(plan.id)
        self.stats["plans"] += 1

    def close(self, plan: Plan, outcome: str) -> str:
        """The plan ended: out of flight, counted once. ``outcome`` is ``applied`` or
        ``aborted``; an orphaned plan ends ``orphaned`` whatever its copy did. Returns the
        outcome counted."""
        assert outcome in ("applied", "aborted"), outcome
        assert self.in_flight.get(plan.id) is plan, f"plan {plan.id} closed but not in flight"
        del self.in_flight[plan.id]
        mine = self.busy.get(plan.req_id)
        if mine is not None and plan.id in mine:
            mine.discard(plan.id)
            if not mine:
                del self.busy[plan.req_id]
        if plan.orphaned:
            outcome = "orphaned"
        plan.state = APPLIED if outcome == "applied" else ABORTED
        self.stats[outcome] += 1
        return outcome

    def orphan(self, req_id) -> list[Plan]:
        """``req_id`` finished or was preempted: its plans in flight become orphans (a later
        incarnation of the same id is another request to them). Returns those newly orphaned."""
        out = [p for p in self.in_flight.values() if p.req_id == req_id and not p.orphaned]
        for p in out:
            p.orphaned = True
        self.busy.pop(req_id, None)
        return out

    def busy_requests(self) -> set:
        """Requests with a plan in flight (I4: at most one plan per request copies at a time)."""
        return set(self.busy)

    def release(self, block_ids, fence: int = 0, plan: Plan | None = None) -> None:
        """Hand blocks reclamation emptied or ended back to the path's pool, at ``fence``
        (``plan``: record the free in its snapshot). The one place reclamation frees."""
        ids = list(block_ids)
        if not ids:
            return
        if plan is not None:
            plan.record("free", blocks=[int(b) for b in ids])
        self._free(ids, fence)
