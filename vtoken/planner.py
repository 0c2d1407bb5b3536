"""The reclamation manager: stages 1-3 of the paper's backend (section 3.3) and the plan lifecycle.

Stage 1 (eligibility): :func:`should_reclaim` every ``check_every`` scheduler steps, over the
table's waste ratio F (O(1)) and the free blocks (:class:`PlannerConfig`). Stage 2
(headroom-aware admission): ``headroom`` blocks are *reserved* in the allocator, out of the
same budget; ``backpressure`` stops admissions while it is short. Stage 3 (planning), per
request: :func:`propose` (in place by default, so the headroom is 0 by default).

Lifecycle: ``planned -> copying -> completed -> applied`` (or ``aborted``): destinations go to
the request, the table is updated and the sources freed only once the copy's completion is
observed (:class:`ReclamationManager`, :func:`apply_completed`).

Owns: the headroom reservation and the plans in flight (snapshots, history); it frees an applied
plan's sources; the scheduler owns the other blocks and learns of each plan via ``on_applied``.
May call: vtoken.table, .allocator, .placement, .snapshot, .errors, numpy; never spec/, invariants/,
fuzz/ or reports/.
Costs: trigger O(1); ``step`` polls O(plans in flight), a round scores O(requests), a plan O(blocks
+ length of its request), an apply O(moves); ``record_snapshots`` adds O(length) per plan.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from .allocator import BlockAllocator
from .errors import PlanError
from .fields import need_bool, need_int, need_number
# the lifecycle states and record, re-exported for the paths that drive the manager
from .lifecycle import ABORTED, APPLIED, COMPLETED, COPYING, PLANNED, Plan, PlanLedger, allocator_release  # noqa: F401
from .placement import holes, place
from .snapshot import SCHEMA, request_state
from .table import OWN_TAIL, TokenTable


# ====================================================================== the planner, as pure functions
# One implementation of stage 3 and of applying a completed plan, called by every driver:
# ReclamationManager (simulator, decode engine), the vLLM adapter (scheduler side) and its
# worker. None of them keeps a copy of these rules.

@dataclass
class Proposal:
    """A plan for one request, before launch: nothing has changed anywhere yet."""

    sources: list  # block ids the plan empties (moved-out and all-dead ones), sorted
    dests: list  # fresh destination block ids, a prefix of the headroom given to ``propose``
    moves: np.ndarray  # (k, 5) int64: token, src_block, src_offset, dst_block, dst_offset
    fills: list = field(default_factory=list)  # the request's own blocks whose holes take tokens, in fill order

    @property
    def reduction(self) -> int:
        return len(self.sources) - len(self.dests)


def reclaim_bound(table: TokenTable, req_id, tail=OWN_TAIL) -> int:
    """Upper bound on the blocks a plan for ``req_id`` can free (O(1); never undercounts):
    the tail stays, the rest packs into ``ceil(live outside the tail / S)`` blocks, exact when
    every other block is eligible and neither B nor the headroom binds. ``tail``: the block
    being written (None: none; default: the table's ``tail_block``)."""
    n_blocks, n_live, has_tail, in_tail = table.reclaim_inputs(req_id, tail)
    return int(_bound(n_blocks, n_live, int(has_tail), in_tail, table.S))


def reclaim_bounds(table: TokenTable, req_ids: Sequence) -> np.ndarray:
    """:func:`reclaim_bound` of each request with the table's own tail, as an int64 array in
    ``req_ids`` order (the same formula, vectorised; one table lookup per request)."""
    n_blocks, n_live, has_tail, in_tail = table.reclaim_inputs_many(req_ids)
    return _bound(n_blocks, n_live, has_tail, in_tail, table.S)


def _bound(n_blocks, n_live, has_tail, in_tail, S: int):
    """The tail stays, the rest packs into ``ceil(live outside the tail / S)`` blocks (ints or
    int arrays alike)."""
    return n_blocks - has_tail - -(-np.maximum(0, n_live - in_tail) // S)


def propose(table: TokenTable, req_id, headroom: Sequence[int], *, max_sources: int, tail: Optional[int],
            excluded: Optional[np.ndarray] = None, max_dests: Optional[int] = None,
            in_place: bool = True) -> tuple[Optional[Proposal], bool]:
    """Stage 3 for one request: the best plan, or ``None`` when no positive reduction fits.

    Candidates: the request's blocks that only it references (``refs == 1``), not its ``tail``,
    not full of live tokens, not ``excluded`` (a bool mask over all blocks, or block ids),
    sorted by live count, block id breaking ties. ``in_place`` (default): sources are the first
    ``m = min(B, floor(H / S))`` candidates, H the holes (slots without a live token) of all
    candidates; their live tokens go into the holes of the next candidates in order (the
    plan's ``fills``; :func:`vtoken.placement.holes`): no destination, exactly the live tokens
    of the freed blocks move, and no plan frees more. ``in_place=False`` (the paper's): the best
    prefix of at most ``max_sources`` candidates by ``sources - ceil(T_live / S)`` whose
    destinations fit in ``headroom`` (and ``max_dests``), packed into the first ``ceil(T_live /
    S)`` headroom blocks in logical order (:func:`vtoken.placement.place`).

    Returns ``(proposal, worthwhile)``: ``worthwhile`` says a positive reduction existed
    without the headroom limit (a ``None`` proposal with ``worthwhile`` is a deferral).
    Reads only; O(blocks of the request + its length x log B (+ fills x S)). The contract is
    ``vtoken.spec.planner.plan_errors`` / ``best_reduction``.
    """
    S = table.S
    limit = len(headroom) if max_dests is None else max(0, min(int(max_dests), len(headroom)))
    blocks = table.block_array(req_id)
    nb = table.n_b[blocks]
    ok = (table.refs[blocks] == 1) & (nb < S) & (blocks != (tail if tail is not None else -1))
    if excluded is not None and len(excluded):
        ex = np.asarray(excluded)
        ok &= ~ex[blocks] if ex.dtype == bool else ~np.isin(blocks, ex.astype(np.int64))
    candidates, live_counts = blocks[ok], nb[ok]
    if len(candidates) == 0:
        return None, False
    order = np.lexsort((candidates, live_counts))  # fewest live first; block id breaks ties
    candidates, live_counts = candidates[order], live_counts[order]
    fills: list = []
    dests: list = []
    if in_place:
        m = min(int(max_sources), int((S - live_counts).sum()) // S)
        if m <= 0:
            return None, False
        moved = int(live_counts[:m].sum())
        room = np.cumsum(S - live_counts[m:])  # holes of the first j fill candidates
        fills = candidates[m:m + (int(np.searchsorted(room, moved)) + 1 if moved else 0)].tolist()
        worthwhile = True
    else:
        candidates, live_counts = candidates[:max_sources], live_counts[:max_sources]
        need = -(-np.cumsum(live_counts) // S)  # destinations for each prefix
        reductions = np.arange(1, len(candidates) + 1) - need
        worthwhile = bool(reductions.max() > 0)
        reductions[need > limit] = -1  # shrink to what the headroom can serve
        m = int(np.argmax(reductions)) + 1
        if reductions[m - 1] <= 0:
            return None, worthwhile
        dests = [int(b) for b in headroom[: int(need[m - 1])]]
    sources = np.sort(candidates[:m])
    moves = _moves_of(table, req_id, sources, fills, dests, in_place)
    return Proposal(sources.tolist(), dests, moves, fills), worthwhile


def _moves_of(table: TokenTable, req_id, sources: np.ndarray, fills: list, dests: list, in_place: bool) -> np.ndarray:
    """The (k, 5) moves of a proposal: every live token of the sorted ``sources``, in logical
    order, into the holes of ``fills`` (in place) or packed into ``dests``."""
    S = table.S
    ids, slots = table.live_slots(req_id)
    blk = slots // S
    at = np.minimum(np.searchsorted(sources, blk), len(sources) - 1)  # sources is sorted: O(length log B)
    sel = sources[at] == blk
    toks, src = ids[sel], slots[sel]  # logical order
    moves = np.empty((len(toks), 5), dtype=np.int64)
    moves[:, 0] = toks
    moves[:, 1] = src // S
    moves[:, 2] = src % S
    if len(toks) and in_place:
        f = np.asarray(fills, dtype=np.int64)
        occupied = table.claims[f[:, None] * S + np.arange(S)] > 0
        hole_block, hole_offset = holes(occupied, f)
        moves[:, 3] = hole_block[:len(toks)]
        moves[:, 4] = hole_offset[:len(toks)]
    elif len(toks):
        dest_index, offset = place(np.ones(len(toks), dtype=bool), S)
        moves[:, 3] = np.asarray(dests, dtype=np.int64)[dest_index]
        moves[:, 4] = offset
    return moves


@dataclass
class Applied:
    """What :func:`apply_completed` did."""

    moves: np.ndarray  # the moves applied (their tokens were still live)
    evicted_in_flight: list  # moved tokens evicted while the copy flew: left dead where they were
    used_dests: list  # fresh destination blocks that received a token, sorted (the rest are unused; fills not listed)
    emptied: list  # the plan's sources, all now unreferenced by the request, sorted


def apply_completed(table: TokenTable, req_id, sources: Sequence[int], moves: np.ndarray,
                    fills: Sequence[int] = ()) -> Applied:
    """Apply a plan whose copy has completed: the table's part of ``completed -> applied``.

    Moves of tokens evicted in flight are dropped (they stay dead at their source), the rest go
    through ``TokenTable.apply_moves``, all-dead sources are released; the caller then frees the
    sources (one reference each) and hands ``used_dests`` to the request. Validated first,
    raising :class:`PlanError` with the table untouched: a source another request references
    (``shared_source``), one that would keep a live token (``not_emptied``), a fill no longer the
    request's alone (``shared_fill``: corruption, the copy already wrote it). O(moves + sources
    + fills).
    """
    m = np.asarray(moves, dtype=np.int64).reshape(-1, 5)
    srcs = sorted(int(b) for b in sources)
    evicted: list = []
    if len(m):
        still = table.are_live(req_id, m[:, 0])
        if not still.all():
            evicted = m[~still, 0].tolist()
            m = m[still]
    moved_from = Counter(m[:, 1].tolist()) if len(m) else Counter()
    for b in srcs:
        if table.block_refs(b) != 1 or not table.references(req_id, b):
            raise PlanError("shared_source", f"request {req_id!r}: source block {b} has {table.block_refs(b)} "
                                             f"referencing request(s); shared blocks never move")
        if table.block_live_count(b) != moved_from.get(b, 0):
            raise PlanError("not_emptied", f"request {req_id!r}: source block {b} holds {table.block_live_count(b)} "
                                           f"live token(s), the plan moves {moved_from.get(b, 0)} out of it")
    for b in fills:
        if table.block_refs(b) != 1 or not table.references(req_id, b):
            raise PlanError("shared_fill", f"request {req_id!r}: fill block {b} has {table.block_refs(b)} referencing "
                                           f"request(s) at apply (the request's: {table.references(req_id, b)}); a "
                                           f"block in flight is never shared or released")
    stray = set(moved_from) - set(srcs)
    if stray:
        raise PlanError("not_emptied", f"request {req_id!r}: moves out of blocks {sorted(stray)}, not sources")
    landed = np.unique(m[:, 3]).tolist() if len(m) else []
    used = [b for b in landed if not table.references(req_id, b)]  # fresh: not a fill (already the request's)
    emptied = table.apply_moves(req_id, m) if len(m) else []
    rest = sorted(set(srcs) - set(emptied))
    if rest:  # all-dead sources: nothing to move, the table just lets go of them
        emptied = sorted(list(emptied) + table.release_empty_blocks(req_id, rest))
    assert emptied == srcs, f"plan emptied {emptied}, sources {srcs}"  # guaranteed by the checks above
    return Applied(m, evicted, used, emptied)


def plan_snapshot(table: TokenTable, req_id, plan_id: int, proposal: Proposal, tail: Optional[int],
                  headroom: Sequence[int], in_flight: Sequence[dict]) -> dict:
    """The plan snapshot (``vtoken.snapshot`` schema) at planning time; O(length of the request).
    ``in_flight``: ``{"id", "request", "sources", "dests", "fills"}`` of every other plan copying;
    ``post`` stays null and ``evicted_in_flight`` empty until :func:`snapshot_applied`."""
    shared = sorted(int(b) for b in table.blocks_of(req_id) if table.block_refs(b) > 1)
    return {
        "schema": SCHEMA,
        "block_size": table.S,
        "plan": {"id": int(plan_id), "request": str(req_id), "sources": [int(b) for b in proposal.sources],
                 "dests": [int(b) for b in proposal.dests], "fills": [int(b) for b in proposal.fills],
                 "moves": proposal.moves.tolist()},
        "pre": {"requests": {str(req_id): request_state(table, req_id, tail)}},
        "post": None,
        "shared_blocks": shared,
        "headroom": [int(b) for b in headroom],
        "in_flight": [dict(p) for p in in_flight],
        "schedule": [],
        "evicted_in_flight": [],
    }


def snapshot_applied(snap: dict, table: TokenTable, req_id, applied: Applied) -> None:
    """Complete a snapshot once its plan applied: the one writer of ``evicted_in_flight``,
    ``dests_used`` and ``post`` (``post`` may be longer than ``pre``: tokens added in flight)."""
    key = str(req_id)
    snap["evicted_in_flight"] = [int(t) for t in applied.evicted_in_flight]
    snap["dests_used"] = [int(b) for b in applied.used_dests]
    snap["post"] = {"requests": {key: request_state(table, req_id, None)}}


# The three ways a KV manager can run, one spelling each (decode engine, simulator, reports):
# no eviction; eviction with whole-block frees only (the paper's Naive-Evict); vtoken's compaction.
MODES = ("native", "naive-evict", "vtoken")


@dataclass
class PlannerConfig:
    """The planner's settings. ``PlannerConfig()`` is THE shipped default: the manager, the
    decode engine and the vLLM adapter all start from it (no second set of defaults).

    When to plan is :func:`should_reclaim`: ``F > theta_f``, or ``F > 0`` with free blocks
    ``<= low_watermark`` (:func:`low_watermark`). Fields:

    * ``theta_f``: the waste-ratio gate (the paper's stage 1);
    * ``check_every`` (K): scheduler steps between eligibility checks;
    * ``max_sources`` (B): source blocks per plan (at most B S tokens in flight);
    * ``headroom``: blocks reserved for destinations (out-of-place plans only);
    * ``low_watermark``: None derives it, < 0 turns the pressure branch off; ``copy_steps``:
      the copy latency (steps) the derived watermark's reaction reserve covers;
    * ``max_plans_per_round``: plans launched per round at most;
    * ``record_snapshots``: keep each applied plan's snapshot in ``history``;
    * ``in_place``: fill the request's own holes (:func:`propose`); False: the paper's
      out-of-place compaction into headroom blocks.

    Why each default: docs/planner-defaults.md.
    """

    theta_f: float = 0.25
    check_every: int = 1  # K: scheduler steps between eligibility checks
    max_sources: int = 32  # B: source blocks per plan
    headroom: int = 0  # blocks reserved for compaction destinations (out-of-place plans only)
    low_watermark: Optional[int] = None  # None: derived (low_watermark()); < 0: no pressure branch
    copy_steps: int = 4  # copy latency (steps) the derived watermark's reaction reserve covers
    max_plans_per_round: int = 1 << 30
    record_snapshots: bool = False
    in_place: bool = True  # fill the request's own holes (no headroom needed); False: the paper's out-of-place

    def __post_init__(self) -> None:
        """Check every field at construction (``dataclasses.replace`` too), numpy scalars made
        Python ones; a bad field raises :class:`~vtoken.errors.ConfigError` (``bad_type`` /
        ``out_of_range``, :mod:`vtoken.fields`) and nothing is built. Ranges: ``theta_f`` finite <= 1;
        ``check_every``, ``max_sources``, ``max_plans_per_round`` >= 1; ``headroom``, ``copy_steps``
        >= 0; ``low_watermark`` None or an integer; ``record_snapshots``, ``in_place`` bools. O(1)."""
        own = "PlannerConfig"
        self.theta_f = need_number(own, "theta_f", self.theta_f, hi=1)
        for name, lo in (("check_every", 1), ("max_sources", 1), ("headroom", 0), ("copy_steps", 0),
                         ("max_plans_per_round", 1)):
            setattr(self, name, need_int(own, name, getattr(self, name), lo))
        self.low_watermark = need_int(own, "low_watermark", self.low_watermark, none_ok=True)
        for name in ("record_snapshots", "in_place"):
            setattr(self, name, need_bool(own, name, getattr(self, name)))


def trigger_inputs(table: TokenTable, free_blocks: int) -> dict:
    """The trigger's inputs, read off a table (O(requests)) and the pool's free-block count."""
    return dict(waste_ratio=table.waste_ratio(), free_blocks=int(free_blocks), ref_blocks=table.num_ref_blocks,
                num_requests=len(table.requests()), block_size=table.S)


def low_watermark(cfg: PlannerConfig, *, ref_blocks: int, num_requests: int, block_size: int) -> int:
    """Free blocks at or below which the pool is under pressure (:func:`should_reclaim`):
    ``cfg.low_watermark`` when set, else ``max(footprint, reserve)`` with footprint =
    ``ceil(ref_blocks / num_requests)`` (an average running request's blocks) and reserve =
    ``headroom + ceil(num_requests * (check_every + copy_steps + 1) / S)`` (the headroom's
    refill plus the requests' growth before a plan launched now frees anything). O(1)."""
    if cfg.low_watermark is not None:
        return int(cfg.low_watermark)
    n = max(1, int(num_requests))
    footprint = -(-int(ref_blocks) // n)
    reserve = cfg.headroom + -(-n * (cfg.check_every + cfg.copy_steps + 1) // int(block_size))
    return max(footprint, reserve)


def should_reclaim(cfg: PlannerConfig, *, waste_ratio: float, free_blocks: int, ref_blocks: int,
                   num_requests: int, block_size: int) -> bool:
    """The trigger (stage 1 and 2), the one every path calls: plan now? True when ``waste_ratio >
    cfg.theta_f``, or when ``waste_ratio > 0`` and ``free_blocks <= low_watermark(...)``. Pure;
    O(1). Inputs: :func:`trigger_inputs`."""
    if waste_ratio > cfg.theta_f:
        return True
    return waste_ratio > 0.0 and free_blocks <= low_watermark(cfg, ref_blocks=ref_blocks, num_requests=num_requests,
                                                             block_size=block_size)


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
    """Owner of the headroom and of every plan's lifecycle, over one table and allocator.

    It holds the headroom (RESERVED in the allocator) and an in-flight plan's destinations and
    fills (busy: no other plan, release or free touches them); an applied plan's sources it
    frees (the request's one reference on each), its used destinations become the request's
    (``on_applied`` tells the scheduler), unused ones go back to the headroom. Tokens evicted in
    flight stay dead where they were. A request gone in flight hands over its references on the
    plan's blocks (``finish_request``), freed when the copy ends.

    ``stats``: every launched plan ends exactly once, as ``applied``, ``aborted`` (copy failed,
    or a source became shared: table unchanged, shared blocks never move) or ``orphaned``
    (request gone in flight), so once nothing is in flight ``plans == applied + aborted +
    orphaned``. A plan ends only when :meth:`poll` or :meth:`drain` observes its copy's end.
    """

    def __init__(self, table: TokenTable, allocator: BlockAllocator, engine=None,
                 config: PlannerConfig | None = None, tail_of: Callable | None = None,
                 on_applied: Callable | None = None, clock: Callable | None = None):
        self.table, self.alloc = table, allocator
        self.engine = engine if engine is not None else NullCopyEngine()
        self.cfg = config or PlannerConfig()
        self.S = table.S
        self._tail_of = tail_of or table.tail_block
        self.on_applied = on_applied
        self.stats = dict(plans=0, applied=0, aborted=0, orphaned=0, deferred=0, moves=0, blocks_freed=0, rounds=0)
        # the lifecycle room: plans in flight, ids, outcomes, the one free of emptied blocks
        self.ledger = PlanLedger(allocator_release(allocator), self.stats, clock)
        self._busy_mask = np.zeros(table.num_blocks, dtype=bool)  # blocks of in-flight plans
        self.headroom: list[int] = []
        # plan id -> blocks to free once its copy completes: the references of every
        # finished incarnation of the plan's request on the plan's sources (a request id
        # may finish, resume and finish again while one copy flies: the lists accumulate)
        self._deferred: dict[int, list] = {}
        self.steps = 0
        self.refill_headroom()

    @property
    def in_flight(self) -> dict[int, Plan]:
        """The plans in flight, by id (the ledger's)."""
        return self.ledger.in_flight

    @property
    def history(self) -> list[Plan]:
        """Ended plans with snapshots (when recorded), in the order they ended."""
        return self.ledger.history

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
        """Should this step plan? :func:`should_reclaim` over the table and the free blocks."""
        return should_reclaim(self.cfg, **trigger_inputs(self.table, self.alloc.num_free))

    @property
    def busy_mask(self) -> np.ndarray:
        """Blocks of in-flight plans, as a bool mask over all blocks (read only: the manager's)."""
        return self._busy_mask

    def is_busy(self, block_id: int) -> bool:
        """Is the block a source or destination of an in-flight plan? (O(1))"""
        return bool(self._busy_mask[int(block_id)])

    def busy_requests(self) -> set:
        """Requests with a plan in flight (I4: at most one plan per request copies at a time)."""
        return self.ledger.busy_requests()

    # ------------------------------------------------------------------ stage 3
    def plan_request(self, req_id, max_dests: Optional[int] = None) -> Optional[Plan]:
        """Plan one request's compaction (:func:`propose` over the headroom, in-flight plans'
        blocks excluded, at most ``max_dests`` destinations), or None when no positive reduction
        fits. Changes nothing; launch the plan at once or drop it (its destinations leave the
        headroom only at launch)."""
        tail = self._tail_of(req_id)
        prop, worthwhile = propose(self.table, req_id, self.headroom, max_sources=self.cfg.max_sources, tail=tail,
                                   excluded=self._busy_mask if self.in_flight else None, max_dests=max_dests,
                                   in_place=self.cfg.in_place)
        if prop is None:
            if worthwhile:
                self.stats["deferred"] += 1  # worth doing, but the headroom is short
            return None
        plan = self.ledger.new_plan(req_id, prop.sources, prop.dests, prop.moves, prop.fills)
        if self.cfg.record_snapshots:
            plan.snapshot = plan_snapshot(
                self.table, req_id, plan.id, prop, tail, self.headroom,
                [{"id": p.id, "request": str(p.req_id), "sources": list(p.sources), "dests": list(p.dests),
                  "fills": list(p.fills)} for p in self.in_flight.values()])
        return plan

    def record(self, p: Plan, kind: str, **fields) -> None:
        """Append an event to the plan's snapshot schedule (when snapshots are recorded)."""
        p.record(kind, **fields)

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
        self._busy_mask[plan.blocks] = True
        self.ledger.open(plan)
        plan.handle = self.engine.launch(plan)
        plan.record("launch", plan=plan.id)

    def poll(self, force_sync: bool = False) -> list[Plan]:
        """Observe finished copies and apply them. Returns the plans that finished (either way)."""
        done = []
        for plan in list(self.in_flight.values()):
            status = self.engine.wait(plan.handle) if force_sync else self.engine.poll(plan.handle)
            if status == "pending":
                continue
            if status == "failed":
                self.abort(plan)
            else:
                plan.state = COMPLETED
                plan.record("fence", plan=plan.id)
                self.apply(plan)
            done.append(plan)
        return done

    def apply(self, plan: Plan) -> None:
        """completed -> applied: table updated (:func:`apply_completed`), sources freed,
        used destinations to the request, unused ones back to the headroom."""
        if plan.state != COMPLETED:
            raise PlanError("bad_state", f"plan {plan.id} is {plan.state}: apply only after the copy completed")
        if plan.id in self._deferred:  # the request finished while the copy was in flight
            self._end(plan, "aborted")
            self.alloc.unreserve(plan.dests)
            self.ledger.release(self._deferred.pop(plan.id))
            return
        t = self.table
        shared = [b for b in plan.sources if t.block_refs(b) > 1]
        if shared and all(self.alloc.ref[b] >= t.block_refs(b) for b in shared):
            # A source became shared while the copy was in flight (a prefix-cache hit on it,
            # each sharer holding its own reference): shared blocks never move (I4), so the
            # plan is dropped as if its copy had failed, before any state is touched. (A
            # share without those references -- a block reused after an early free -- is
            # corruption: apply_completed refuses it.)
            self.abort(plan)
            return
        res = apply_completed(t, plan.req_id, plan.sources, plan.moves, fills=plan.fills)
        plan.moves, plan.evicted_in_flight = res.moves, res.evicted_in_flight
        used = res.used_dests
        self.alloc.take_reserved(used)
        self.headroom += [b for b in plan.dests if b not in used]
        plan.record("apply", plan=plan.id)
        self.ledger.release(plan.sources, plan=plan)
        plan.dests = used
        self._end(plan, "applied")
        self.stats["moves"] += len(res.moves)
        self.stats["blocks_freed"] += len(plan.sources) - len(used)
        if plan.snapshot is not None:
            snapshot_applied(plan.snapshot, t, plan.req_id, res)
            self.history.append(plan)
        if self.on_applied is not None:
            self.on_applied(plan)

    def abort(self, plan: Plan) -> None:
        """The copy failed part-way: nothing changes but the plan's end; destinations go back
        to the headroom (its request gone, the plan ends as an orphan whatever the copy did:
        destinations to the free queue, the request's deferred blocks freed)."""
        self._end(plan, "aborted")
        if plan.id in self._deferred:
            self.alloc.unreserve(plan.dests)
            self.ledger.release(self._deferred.pop(plan.id))
            return
        self.headroom += plan.dests

    def drain(self) -> list[Plan]:
        """End of a batch: end every plan still in flight and give the headroom back.

        Each in-flight copy is host-waited (``engine.wait``), then handled as :meth:`poll` would
        (deferred sources and fills freed, ``on_applied`` run); then the headroom goes back to the
        free queue. Afterwards nothing is in flight, deferred or reserved; the manager stays usable.
        Every path that ends a batch must call it, or a plan launched in its last steps is never
        polled. Returns the plans ended; one host wait per plan.
        """
        done = self.poll(force_sync=True)
        if self.headroom:
            self.alloc.unreserve(self.headroom)
            self.headroom = []
        return done

    def _end(self, plan: Plan, outcome: str) -> None:
        """The plan's blocks stop being busy and the ledger counts its end (``outcome``, or
        orphaned: :meth:`PlanLedger.close`)."""
        self._busy_mask[plan.blocks] = False
        self.ledger.close(plan, outcome)

    def finish_request(self, req_id, held_blocks) -> list[int]:
        """The request finished or was preempted: forget it and free the blocks it held.

        ``held_blocks``: the blocks the caller holds a reference on for the request. Those that are
        sources or fills of its in-flight plan are taken over and freed once that copy completes;
        the plan is orphaned (a later incarnation of the id is another request). Returns the blocks
        freed now.
        """
        if req_id in self.table:
            self.table.free_request(req_id)
        later = set()
        for plan in self.in_flight.values():
            if plan.req_id == req_id and not plan.orphaned:
                mine = [b for b in held_blocks if b in plan.sources or b in plan.fills]  # the copy reads / writes them
                self._deferred.setdefault(plan.id, []).extend(mine)
                later |= set(mine)
        self.ledger.orphan(req_id)
        now = [b for b in held_blocks if b not in later]
        self.ledger.release(now)
        return now

    # ------------------------------------------------------------------ the step hook
    def plan_round(self, req_ids=None) -> list[Plan]:
        """Plan and launch for the requests with the most reclaimable blocks first."""
        t = self.table
        self.stats["rounds"] += 1
        reqs = t.requests() if req_ids is None else list(req_ids)
        busy = self.busy_requests()
        scored = []
        for rid in reqs:
            if rid in busy:
                continue
            gain = reclaim_bound(t, rid, self._tail_of(rid))
            if gain > 0:
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
