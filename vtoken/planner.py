"""The reclamation manager: stages 1-3 of the paper's backend (section 3.3) and the plan lifecycle.

Stage 1 (eligibility): the waste ratio F is read from the table's incremental totals
(O(1)); eligibility is checked every ``check_every`` scheduler steps.

Stage 2 (headroom-aware admission): ``headroom`` blocks are *reserved* in the allocator
(carved out of the same budget, never extra memory); reclamation is attempted when
F > ``theta_f`` and free blocks are at or below ``low_watermark``. ``backpressure`` tells
the scheduler to stop admitting new requests while the headroom is short.

Stage 3 (planning), per request: candidate sources are the request's blocks that are
private (referenced only by it), not its tail (the block holding its last position, which
is still being written), not in an in-flight plan and not full. Sorted by live count, the
best prefix (at most ``max_sources`` blocks) is taken: the one whose
``sources - ceil(T_live / S)`` reduction is largest; a plan is made only if it is positive
and only with the destinations the headroom can give (the set is shrunk otherwise, or the
plan is deferred). Destinations are filled completely, one after another, in logical
token order (``vtoken.placement.place``).

Lifecycle: ``planned -> copying -> completed -> applied`` (or ``aborted``). The copy engine
copies the K/V; only once its completion is observed are destination blocks handed to the
request, the table updated, and the source blocks freed -- never at planning time. Tokens
evicted while their copy was in flight are left dead where they were (a destination no
live token landed in goes back to the headroom); a plan one of whose sources became
shared meanwhile (a prefix-cache hit) is aborted, since shared blocks never move.

Ownership: the manager owns the headroom reservation and, once a plan is applied, frees
its sources (the request's references on them) to the allocator. The owner of a request's
other blocks (the scheduler) learns of every applied plan through ``on_applied`` so it can
put the null block where a source was and record the destinations as the request's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from . import faults
from .allocator import BlockAllocator
from .errors import PlanError
from .placement import dest_count, place
from .snapshot import SCHEMA, request_state
from .table import TokenTable

PLANNED, COPYING, COMPLETED, APPLIED, ABORTED = "planned", "copying", "completed", "applied", "aborted"


@dataclass
class PlannerConfig:
    theta_f: float = 0.25
    check_every: int = 1  # K: scheduler steps between eligibility checks
    max_sources: int = 8  # B: source blocks per plan
    headroom: int = 8  # blocks reserved for compaction destinations
    low_watermark: Optional[int] = None  # plan when free <= this; None: whenever F > theta_f
    max_plans_per_round: int = 1 << 30
    record_snapshots: bool = False


@dataclass
class Plan:
    id: int
    req_id: object
    sources: list  # blocks the plan empties (all of them: moved-out and all-dead ones)
    dests: list  # destination blocks, taken from the headroom
    moves: np.ndarray  # (k, 5): token, src_block, src_offset, dst_block, dst_offset
    state: str = PLANNED
    handle: object = None
    snapshot: Optional[dict] = None
    evicted_in_flight: list = field(default_factory=list)  # moved tokens that died while the copy flew

    @property
    def reduction(self) -> int:
        return len(self.sources) - len(self.dests)


class NullCopyEngine:
    """A copy engine without bytes (simulation, metadata fuzzing): a copy completes after
    ``latency`` polls. ``fail_next`` makes the next launched copy fail part-way."""

    def __init__(self, latency: int = 0):
        self.latency = latency
        self.fail_next = False

    def launch(self, plan: Plan):
        h = {"left": self.latency, "failed": self.fail_next}
        self.fail_next = False
        return h

    def poll(self, handle) -> str:
        if handle["failed"]:
            return "failed"
        if handle["left"] <= 0:
            return "done"
        handle["left"] -= 1
        return "pending"

    def wait(self, handle) -> str:
        handle["left"] = 0
        return self.poll(handle)


class ReclamationManager:
    def __init__(self, table: TokenTable, allocator: BlockAllocator, engine=None,
                 config: PlannerConfig | None = None, tail_of: Callable | None = None,
                 on_applied: Callable | None = None, clock: Callable | None = None):
        self.table, self.alloc = table, allocator
        self.engine = engine if engine is not None else NullCopyEngine()
        self.cfg = config or PlannerConfig()
        self.S = table.S
        self._tail_of = tail_of or self._default_tail
        self.on_applied = on_applied
        self._ids = itertools.count(1)
        self.in_flight: dict[int, Plan] = {}
        self._busy: dict[int, int] = {}  # block -> plan id, for blocks of in-flight plans
        self._busy_mask = np.zeros(table.num_blocks, dtype=bool)  # the same, as an array
        self._scratch = np.zeros(table.num_blocks, dtype=bool)  # all False between uses
        self.headroom: list[int] = []
        self._deferred: dict[int, list] = {}  # plan id -> blocks to free once its copy completes
        self.steps = 0
        self.stats = dict(plans=0, applied=0, aborted=0, deferred=0, moves=0, blocks_freed=0, rounds=0)
        self.history: list[Plan] = []  # applied/aborted plans with snapshots (when recorded)
        self._clock = clock or itertools.count().__next__
        self.refill_headroom()

    # ------------------------------------------------------------------ stage 1 and 2
    def refill_headroom(self) -> None:
        """Top the reservation up to ``headroom`` blocks from the free queue (as far as it goes)."""
        want = self.cfg.headroom - len(self.headroom)
        if want > 0:
            take = min(want, self.alloc.num_free)
            if take:
                self.headroom += self.alloc.reserve(take)

    @property
    def backpressure(self) -> bool:
        """True while the headroom is short: the scheduler should not admit new requests."""
        return len(self.headroom) < self.cfg.headroom

    def eligible(self) -> bool:
        if self.table.waste_ratio() <= self.cfg.theta_f:
            return False
        wm = self.cfg.low_watermark
        return wm is None or self.alloc.num_free <= wm

    def _default_tail(self, req_id) -> Optional[int]:
        n = self.table.length(req_id)
        if n == 0:
            return None
        return int(self.table._reqs[req_id].slot[n - 1]) // self.S

    # ------------------------------------------------------------------ stage 3
    def plan_request(self, req_id, max_dests: Optional[int] = None) -> Optional[Plan]:
        """Plan one request's compaction, or None when no positive reduction fits.

        At most ``max_dests`` destinations (default, and never more than, the headroom).
        Planning changes nothing; launch the plan at once or drop it (its destinations
        leave the headroom only at launch). The contract is ``vtoken.spec.planner``.
        """
        t = self.table
        r = t._reqs[req_id]
        S = self.S
        # never more destinations than the headroom holds (dests are taken from it)
        max_dests = len(self.headroom) if max_dests is None else min(int(max_dests), len(self.headroom))
        blocks = np.fromiter(r.blocks, dtype=np.int64, count=len(r.blocks))
        tail = self._tail_of(req_id)
        nb = t.n_b[blocks]
        ok = (t.refs[blocks] == 1) & (nb < S) & (blocks != (tail if tail is not None else -1))
        if faults.on("plan_moves_shared"):
            ok = (nb < S) & (blocks != (tail if tail is not None else -1))
        if faults.on("plan_moves_tail"):
            ok = (t.refs[blocks] == 1) & (nb < S)
        if self._busy and not faults.on("plan_overlaps_inflight"):
            ok &= ~self._busy_mask[blocks]
        cand, cnt = blocks[ok], nb[ok]
        if len(cand) == 0:
            return None
        order = np.lexsort((cand, cnt))  # fewest live first; block id breaks ties (deterministic)
        cand, cnt = cand[order][: self.cfg.max_sources], cnt[order][: self.cfg.max_sources]
        need = -(-np.cumsum(cnt) // S)  # destinations for each prefix
        red = np.arange(1, len(cand) + 1) - need
        worthwhile = red.max() > 0
        red[need > max_dests] = -1  # shrink to what the headroom can serve
        m = int(np.argmax(red)) + 1
        if red[m - 1] <= 0 and not faults.on("plan_nondecreasing"):
            if worthwhile:
                self.stats["deferred"] += 1  # worth doing, but the headroom is short
            return None
        sources = cand[:m]
        n_dest = int(need[m - 1])
        if faults.on("plan_nondecreasing"):
            n_dest = min(max(n_dest, m), max_dests)
            if n_dest == 0:
                return None
        dests = self.headroom[:n_dest]
        mark = self._scratch  # O(sources) to set and clear, not O(num_blocks) per plan
        mark[sources] = True
        sl, lv = r.slot[: r.n], r.live[: r.n]
        toks = np.flatnonzero(lv & mark[sl // S])  # logical order
        mark[sources] = False
        moves = np.empty((len(toks), 5), dtype=np.int64)
        moves[:, 0] = toks
        moves[:, 1] = sl[toks] // S
        moves[:, 2] = sl[toks] % S
        placed = place([True] * len(toks), S)
        moves[:, 3] = [dests[d] for d, _ in placed] if len(toks) else []
        moves[:, 4] = [o for _, o in placed] if len(toks) else []
        if faults.on("plan_dup_dst") and len(toks) > 1:
            moves[1, 3:] = moves[0, 3:]
        plan = Plan(next(self._ids), req_id, sorted(sources.tolist()), list(dests), moves)
        if self.cfg.record_snapshots:
            plan.snapshot = self._snapshot(plan, tail)
        return plan

    def _snapshot(self, plan: Plan, tail) -> dict:
        t = self.table
        shared = sorted(int(b) for b in t.blocks_of(plan.req_id) if t.refs[b] > 1)
        return {
            "schema": SCHEMA,
            "block_size": self.S,
            "plan": {"id": plan.id, "request": str(plan.req_id), "sources": list(plan.sources),
                     "dests": list(plan.dests), "moves": plan.moves.tolist()},
            "pre": {"requests": {str(plan.req_id): request_state(t, plan.req_id, tail)}},
            "post": None,
            "shared_blocks": shared,
            "headroom": list(self.headroom),
            "in_flight": [{"id": p.id, "request": str(p.req_id), "sources": list(p.sources), "dests": list(p.dests)}
                          for p in self.in_flight.values()],
            "schedule": [],
            "evicted_in_flight": [],  # filled by apply(): moved tokens evicted while the copy flew
        }

    def record(self, p: Plan, kind: str, **fields) -> None:
        """Append an event to the plan's snapshot schedule (when snapshots are recorded)."""
        if p.snapshot is not None:
            p.snapshot["schedule"].append({"t": self._clock(), "kind": kind, **fields})

    # ------------------------------------------------------------------ lifecycle
    def launch(self, plan: Plan) -> None:
        """planned -> copying: reserve the plan's blocks and issue the copy."""
        if plan.state != PLANNED:
            raise PlanError("bad_state", f"plan {plan.id} is {plan.state}, cannot launch")
        k = len(plan.dests)
        if self.headroom[:k] == plan.dests:  # the usual case: planned from the front just now
            del self.headroom[:k]
        else:
            taken = set(plan.dests)
            if not taken <= set(self.headroom):
                raise PlanError("stale_plan", f"plan {plan.id}: destinations {plan.dests} are no longer in the headroom")
            self.headroom = [b for b in self.headroom if b not in taken]
        for b in itertools.chain(plan.sources, plan.dests):
            self._busy[b] = plan.id
            self._busy_mask[b] = True
        plan.state = COPYING
        self.in_flight[plan.id] = plan
        self.stats["plans"] += 1
        if faults.on("free_sources_at_plan"):
            self._free_sources_now(plan)
        plan.handle = self.engine.launch(plan)
        self.record(plan, "launch", plan=plan.id)

    def _free_sources_now(self, plan: Plan) -> None:
        # planted bug: sources released at planning time, before the copy has completed
        self.alloc.free(plan.sources)
        self.record(plan, "free", blocks=list(plan.sources))
        plan.sources_freed_early = True

    def poll(self, force_sync: bool = False) -> list[Plan]:
        """Observe finished copies and apply them. Returns the plans that finished (either way)."""
        done = []
        for plan in list(self.in_flight.values()):
            status = self.engine.wait(plan.handle) if force_sync else self.engine.poll(plan.handle)
            if status == "pending" and faults.on("apply_before_complete"):
                status = "done"  # planted: the copy is taken as finished without its fence
            elif status == "pending":
                continue
            if status == "failed":
                self.abort(plan)
            else:
                plan.state = COMPLETED
                self.record(plan, "fence", plan=plan.id)
                self.apply(plan)
            done.append(plan)
        return done

    def apply(self, plan: Plan) -> None:
        """completed -> applied: destinations to the request, table updated, sources freed."""
        if plan.state != COMPLETED:
            raise PlanError("bad_state", f"plan {plan.id} is {plan.state}: apply only after the copy completed")
        shared = [b for b in plan.sources if self.table.refs[b] > 1]
        if shared and plan.id not in self._deferred and all(self.alloc.ref[b] >= self.table.refs[b] for b in shared):
            # A source became shared while the copy was in flight (a prefix-cache hit on it,
            # each sharer holding its own reference): shared blocks never move (I4), so the
            # plan is dropped as if its copy had failed, before any state is touched. (A
            # share without those references -- a block reused after an early free -- is
            # corruption, and is left to the table's own check to refuse.)
            self.abort(plan)
            return
        self._release(plan)
        if plan.id in self._deferred:  # the request finished while the copy was in flight
            self.alloc.unreserve(plan.dests)
            self.alloc.free(self._deferred.pop(plan.id))
            plan.state = ABORTED
            return
        if len(plan.moves):  # a token evicted while the copy was in flight stays dead where it was
            still = self.table._reqs[plan.req_id].live[plan.moves[:, 0]]
            if not still.all():
                plan.evicted_in_flight = plan.moves[~still, 0].tolist()
                if plan.snapshot is not None:  # the record says which tokens died in flight
                    plan.snapshot["evicted_in_flight"] = list(plan.evicted_in_flight)
                plan.moves = plan.moves[still]
        used = sorted({int(b) for b in plan.moves[:, 3]}) if len(plan.moves) else []
        self.alloc.take_reserved(used)
        unused = [b for b in plan.dests if b not in used]
        self.headroom += unused
        emptied = self.table.apply_moves(plan.req_id, plan.moves) if not faults.on("skip_apply") else []
        rest = sorted(set(plan.sources) - set(emptied))
        if rest:  # all-dead sources: nothing to move, the table just lets go of them
            emptied = sorted(emptied + self.table.release_empty_blocks(plan.req_id, rest))
        if emptied != plan.sources:
            raise PlanError("not_emptied", f"plan {plan.id}: sources {plan.sources} but the table emptied {emptied}")
        self.record(plan, "apply", plan=plan.id)
        if not getattr(plan, "sources_freed_early", False):
            self.alloc.free(plan.sources)
            self.record(plan, "free", blocks=list(plan.sources))
        plan.dests = used
        plan.state = APPLIED
        self.stats["applied"] += 1
        self.stats["moves"] += len(plan.moves)
        self.stats["blocks_freed"] += len(plan.sources) - len(used)
        if plan.snapshot is not None:
            plan.snapshot["dests_used"] = list(used)  # plan.dests stays as planned, matching plan.moves
            plan.snapshot["post"] = {"requests": {str(plan.req_id): request_state(self.table, plan.req_id, None)}}
            self.history.append(plan)
        if self.on_applied is not None:
            self.on_applied(plan)

    def abort(self, plan: Plan) -> None:
        """The copy failed part-way: nothing changes but the plan's end; destinations go back to the headroom."""
        self._release(plan)
        plan.state = ABORTED
        self.stats["aborted"] += 1
        if plan.id in self._deferred:
            self.alloc.unreserve(plan.dests)
            self.alloc.free(self._deferred.pop(plan.id))
            return
        if not faults.on("abort_leaks_dests"):
            self.headroom += plan.dests

    def _release(self, plan: Plan) -> None:
        del self.in_flight[plan.id]
        for b in itertools.chain(plan.sources, plan.dests):
            if self._busy.get(b) == plan.id:
                del self._busy[b]
                self._busy_mask[b] = False

    def finish_request(self, req_id, held_blocks) -> list[int]:
        """The request finished or was preempted: forget it and free the blocks it held.

        ``held_blocks`` are the blocks the caller holds a reference on for this request
        (its block list without null entries, plus applied destinations). Blocks that an
        in-flight copy still reads are freed only once that copy completes. Returns the
        blocks freed now.
        """
        if req_id in self.table:
            self.table.free_request(req_id)
        later = set()
        for plan in self.in_flight.values():
            if plan.req_id == req_id and not faults.on("finish_frees_inflight_sources"):
                self._deferred[plan.id] = [b for b in held_blocks if b in plan.sources]
                later |= set(self._deferred[plan.id])
        now = [b for b in held_blocks if b not in later]
        self.alloc.free(now)
        return now

    # ------------------------------------------------------------------ the step hook
    def plan_round(self, req_ids=None) -> list[Plan]:
        """Plan and launch for the requests with the most reclaimable blocks first."""
        t = self.table
        self.stats["rounds"] += 1
        reqs = list(t._reqs) if req_ids is None else list(req_ids)
        busy_reqs = {p.req_id for p in self.in_flight.values()}
        S = self.S
        scored = []
        for rid in reqs:
            r = t._reqs[rid]
            # Upper bound on the reduction (exact when every other block is eligible and
            # neither B nor the headroom binds): the tail stays, the rest packs into
            # ceil(live outside the tail / S) blocks. Requests at or below 0 cannot gain.
            tail = self._tail_of(rid)
            has_tail = tail is not None and tail in r.blocks
            in_tail = int(t.n_b[tail]) if has_tail else 0  # >= the request's own live tokens there
            gain = len(r.blocks) - int(has_tail) - -(-max(0, r.n_live - in_tail) // S)
            if gain > 0 and (rid not in busy_reqs or faults.on("plan_overlaps_inflight")):
                scored.append((-gain, len(scored), rid))
        scored.sort()
        launched = []
        for _, _, rid in scored:
            # An empty headroom does not end the round: all-dead blocks need no destination.
            if len(launched) >= self.cfg.max_plans_per_round:
                break
            plan = self.plan_request(rid)
            if plan is not None:
                self.launch(plan)
                launched.append(plan)
        return launched

    def step(self, force_sync: bool = False) -> list[Plan]:
        """Once per scheduler step, after the forward pass: finish copies, refill the
        headroom, and every ``check_every`` steps plan and launch new copies."""
        self.steps += 1
        self.poll(force_sync=force_sync)
        self.refill_headroom()
        launched = []
        if self.steps % self.cfg.check_every == 0 and self.eligible():
            launched = self.plan_round()
            if force_sync:
                self.poll(force_sync=True)
                self.refill_headroom()
        return launched
