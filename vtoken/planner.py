"""The planner: stages 1-3 of the paper's backend (section 3.3), and the manager that drives
the plan lifecycle in one process.

Stage 1 (eligibility): :func:`should_reclaim` every ``check_every`` scheduler steps, over the
table's waste ratio F (O(1)) and the free blocks (:class:`PlannerConfig`). Stage 2
(headroom-aware admission): ``headroom`` blocks are *reserved* in the allocator, out of the
same budget; ``backpressure`` stops admissions while it is short. Stage 3 (planning), per
request: :func:`propose` (in place by default, so the headroom is 0 by default).

A plan's life after that is :mod:`vtoken.lifecycle`'s on every path;
:class:`ReclamationManager` runs its block side and copy side together (decode engine,
simulator, planner machine), the vLLM adapter the same two split between scheduler and worker.
Owns: the pure functions own nothing; the manager owns its lifecycle (headroom, holdings, plans
in flight) and its copies.
May call: vtoken.table, .allocator, .placement, .snapshot, .lifecycle, .errors, numpy; never spec/,
invariants/, fuzz/ or reports/.
Costs: trigger O(1); ``step`` polls O(plans in flight), a round scores O(requests), a plan O(blocks
+ length of its request), an apply O(moves); ``record_snapshots`` adds O(length) per plan.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from .allocator import BlockAllocator
from .errors import CallError, PlanError
from .fields import need_bool, need_int, need_number
# the lifecycle's states, re-exported for the paths that drive the manager
from .lifecycle import ABORTED, APPLIED, COMPLETED, COPYING, PLANNED, AllocatorPort, Copies, Lifecycle, Outcome, Plan  # noqa: F401
from .placement import holes, place
from .snapshot import SCHEMA, request_state
from .table import OWN_TAIL, TokenTable, waste_ratio_of


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
            in_place: bool = True, unfillable: Optional[Sequence[int]] = None) -> tuple[Optional[Proposal], bool]:
    """Stage 3 for one request: the best plan, or ``None`` when no positive reduction fits.

    Candidates: the request's blocks that only it references (``refs == 1``), not its ``tail``,
    not full of live tokens, not ``excluded`` (a bool mask over all blocks, or block ids),
    sorted by live count, block id breaking ties. ``in_place`` (default): sources are the first
    ``m = min(B, floor(H / S))`` candidates, H the holes (slots without a live token) of all
    candidates; their live tokens go into the holes of the next candidates in order (the
    plan's ``fills``; :func:`vtoken.placement.holes`): no destination, exactly the live tokens
    of the freed blocks move, and no plan frees more. ``unfillable`` (block ids): candidates a
    plan may empty but never fill (their bytes must stay: a prefix-cache hash describes them);
    then only the others' holes H(F) take tokens, an unfillable source costs its live tokens of
    them and a fillable one all S of its slots; what the holes cannot take goes to whole fresh
    ``headroom`` destinations (after the holes), as in the best such plan (:func:`_in_place_keeping`).
    ``in_place=False`` (the paper's): the best prefix of at most ``max_sources`` candidates by
    ``sources - ceil(T_live / S)`` whose destinations fit in ``headroom`` (and ``max_dests``),
    packed into the first ``ceil(T_live / S)`` headroom blocks in logical order (``place``).

    Returns ``(proposal, worthwhile)``: ``worthwhile``: a positive reduction existed without
    the headroom limit (a ``None`` proposal with it is a deferral).
    Reads only; O(blocks of the request + its length x log B (+ fills x S)). The contract is
    ``vtoken.spec.planner.plan_errors`` / ``best_reduction``.
    """
    S = table.S
    limit = len(headroom) if max_dests is None else max(0, min(int(max_dests), len(headroom)))
    blocks = eligible_blocks(table, req_id, tail, excluded)
    nb = table.n_b[blocks]
    candidates, live_counts = blocks[nb < S], nb[nb < S]
    order = np.lexsort((candidates, live_counts))  # fewest live first; block id breaks ties
    candidates, live_counts = candidates[order], live_counts[order]
    if len(candidates) == 0:
        return None, False
    fills: list = []
    dests: list = []
    if in_place and unfillable is not None and len(unfillable):
        picked, worthwhile = _in_place_keeping(candidates, live_counts, S, int(max_sources), unfillable, limit)
        if picked is None:
            return None, worthwhile
        sources, fills, n_dests = picked
        dests = [int(b) for b in headroom[:n_dests]]
        moves = _moves_of(table, req_id, sources, fills, dests)
        return Proposal(sources.tolist(), dests, moves, fills), True
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
    moves = _moves_of(table, req_id, sources, fills, dests)
    return Proposal(sources.tolist(), dests, moves, fills), worthwhile


def _in_place_keeping(candidates: np.ndarray, live_counts: np.ndarray, S: int, B: int, unfillable: np.ndarray,
                      max_dests: int):
    """In-place sources and fills when ``unfillable`` candidates may be emptied but not filled
    (``candidates`` by live count), with at most ``max_dests`` fresh destinations (the headroom)
    taking what the fillable holes cannot: ``((sorted sources, fills, destinations needed) or
    None, worthwhile)``. A source set X moves T(X) tokens into H(F \\ X), the holes of the
    fillable candidates it leaves, then into ceil(max(0, T(X) - H(F \\ X)) / S) destinations;
    with cost c = live count for an unfillable source and S for a fillable one (its live tokens
    plus the holes it no longer offers), T(X) - H(F \\ X) = c(X) - H(F): for each size k the
    cheapest k candidates are best, and the best k frees the most (the fewest sources among
    equals). An emptied unfillable block keeps its bytes and its hash; a destination's bytes
    are new. ``worthwhile``: a reduction existed without the destination limit."""
    keep = _member(candidates, unfillable)
    cost, budget = _source_costs(live_counts, keep, S)
    order = np.lexsort((candidates, cost))  # the cheapest first, block id breaking ties
    c = np.cumsum(cost[order])[:min(B, len(candidates))]
    need = -(-np.maximum(0, c - budget) // S)  # destinations for the cheapest k = 1.. sources
    reduction = np.arange(1, len(c) + 1) - need
    worthwhile = bool(len(c) and reduction.max() > 0)
    reduction[need > max(0, int(max_dests))] = -1
    m = int(np.argmax(reduction)) + 1 if len(c) else 0
    if m <= 0 or reduction[m - 1] <= 0:
        return None, worthwhile
    chosen = np.zeros(len(candidates), dtype=bool)
    chosen[order[:m]] = True
    moved = int(live_counts[chosen].sum())
    free = ~chosen & ~keep  # fills: fillable candidates not emptied, by live count
    room = np.cumsum(S - live_counts[free])
    fills = candidates[free][:int(np.searchsorted(room, moved)) + 1 if moved else 0].tolist()
    return (np.sort(candidates[chosen]), fills, int(need[m - 1])), worthwhile


def eligible_blocks(table: TokenTable, req_id, tail, excluded) -> np.ndarray:
    """The blocks of ``req_id`` a plan may take, full or not: only it references them, not
    ``tail``, not ``excluded`` (a bool mask over all blocks, or block ids). O(blocks of the request)."""
    blocks = table.block_array(req_id)
    ok = (table.refs[blocks] == 1) & (blocks != (tail if tail is not None else -1))
    if excluded is not None and len(excluded):
        ex = np.asarray(excluded)
        ok &= ~ex[blocks] if ex.dtype == bool else ~_member(blocks, ex)
    return blocks[ok]


def _member(blocks: np.ndarray, ids) -> np.ndarray:
    """``np.isin(blocks, ids)`` for block ids ``blocks`` (>= 0), through a mask over ids up to
    the largest of ``blocks`` (np.isin sorts: several times dearer on a request's few blocks);
    ids outside that range match nothing. O(len(blocks) + len(ids) + max block id)."""
    if not len(blocks):
        return np.zeros(0, dtype=bool)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    size = int(blocks.max()) + 1
    mask = np.zeros(size, dtype=bool)
    mask[ids[(ids >= 0) & (ids < size)]] = True
    return mask[blocks]


def _source_costs(live_counts: np.ndarray, keep: np.ndarray, S: int) -> tuple[np.ndarray, int]:
    """What emptying each candidate costs the fillable holes (its live tokens when unfillable,
    ``keep``; S when fillable: its live tokens plus the holes it no longer offers) and those holes H(F)."""
    return np.where(keep, live_counts, S), int((S - live_counts[~keep]).sum())


def split_eligible(table: TokenTable, req_id, *, tail: Optional[int], excluded=None,
                   unfillable: Optional[Sequence[int]] = None) -> tuple[np.ndarray, np.ndarray]:
    """The :func:`eligible_blocks` of ``req_id`` (full ones included) a plan may fill, and those
    it may only empty (``unfillable``). O(blocks of the request)."""
    blocks = eligible_blocks(table, req_id, tail, excluded)
    kept = _member(blocks, unfillable if unfillable is not None else [])
    return blocks[~kept], blocks[kept]


def in_place_deficit(table: TokenTable, req_id, *, max_sources: int, tail: Optional[int],
                     excluded: Optional[np.ndarray] = None, unfillable: Optional[Sequence[int]] = None,
                     max_dests: int = 0) -> int:
    """The evictions of ``req_id``'s tokens needed, at least, before :func:`propose` in place
    with these arguments can return a plan (0: it may now): :func:`shortfall` of its eligible
    blocks' live counts. O(blocks of the request)."""
    fill, unfill = split_eligible(table, req_id, tail=tail, excluded=excluded, unfillable=unfillable)
    return shortfall(table.n_b[fill], table.n_b[unfill], table.S, max_sources, max_dests)


def shortfall(fillable: np.ndarray, unfillable: np.ndarray, S: int, max_sources: int, max_dests: int = 0) -> int:
    """From the live counts of the eligible blocks a plan may fill and of those it may only
    empty (full ones included: no candidates), the evictions needed, at least, before an
    in-place plan exists. In place a plan exists iff the candidates' holes H reach S; keeping
    unfillable blocks, iff for some k the cheapest k sources cost at most H(F) + S x min(k - 1,
    ``max_dests``) (:func:`_source_costs`). An eviction empties one slot of the request: one
    fillable hole more, or one live token less in an unfillable candidate (a block it makes a
    candidate included), so it lowers every such shortfall by one at most, and growth writes
    only the tail. A driver that saw no plan may skip the request until that many evictions
    happened, while its blocks (the set, its tail), their prefix-cache hashes and sharing and
    the headroom stay as they were: a block gaining a hash never lowers the shortfall, one
    losing it or ceasing to be shared may. :func:`shortfalls` of one request. O(blocks log blocks)."""
    return int(shortfalls([fillable], [unfillable], S, max_sources, [max_dests])[0])


def shortfalls(fillable: Sequence[np.ndarray], unfillable: Sequence[np.ndarray], S: int, max_sources: int,
               max_dests: Sequence[int]) -> np.ndarray:
    """:func:`shortfall` of many requests at once (request i: ``fillable[i]``, ``unfillable[i]``,
    ``max_dests[i]``): :func:`shortfalls_flat` of their live counts laid end to end."""
    n = len(fillable)
    if len(unfillable) != n or len(max_dests) != n:
        raise CallError("bad_shape", f"shortfalls: {n} fillable, {len(unfillable)} unfillable, "
                                     f"{len(max_dests)} max_dests")
    parts = [np.asarray(x, dtype=np.int64).reshape(-1) for pair in zip(unfillable, fillable) for x in pair]
    live = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return shortfalls_flat(live, [len(u) for u in parts[0::2]], [len(f) for f in parts[1::2]], S, max_sources,
                           max_dests)


def in_place_shortfall(least, holes, S: int):
    """:func:`shortfall` without destinations, from two figures: ``least`` the smallest live
    count of the unfillable candidates (S when there is none) and ``holes`` H(F) the holes of
    the fillable blocks: min(least, S) - H(F), at least 0 (the cheapest one source decides).
    Ints or int arrays alike (a driver keeping the two figures up to date tests it without
    the blocks; ``shortfalls_flat`` computes them)."""
    if type(least) is int and type(holes) is int:  # one record's figures: no numpy scalar round trip
        return max(min(least, S) - holes, 0)
    return np.maximum(np.minimum(least, S) - holes, 0)


def shortfalls_flat(live: np.ndarray, n_unfill: Sequence[int], n_fill: Sequence[int], S: int, max_sources: int,
                    max_dests: Sequence[int]) -> np.ndarray:
    """:func:`shortfall` of many requests in one pass of array operations, as an int64 array:
    ``live`` holds request 0's ``n_unfill[0]`` unfillable then ``n_fill[0]`` fillable live
    counts, then request 1's, and so on. Per request, min over k = 1..min(B, candidates) of
    C_k - H(F) - S x min(k - 1, dests), C_k the cheapest k costs (:func:`_source_costs`), at
    least 0; S for a request without candidates. What a plan check costs for every skipped
    request whose evictions reached its shortfall: O(their blocks log)."""
    nu, nf = np.asarray(n_unfill, dtype=np.int64), np.asarray(n_fill, dtype=np.int64)
    n = len(nu)
    dests = np.maximum(np.asarray(max_dests, dtype=np.int64), 0)
    size = nu + nf if len(nf) == n else None
    if size is None or len(dests) != n or len(live) != int(size.sum()):
        raise CallError("bad_shape", f"shortfalls_flat: {len(live)} live counts for {n} unfillable sizes, "
                                     f"{len(nf)} fillable sizes, {len(dests)} max_dests")
    if not dests.any():
        # no destination: the cheapest one source decides (k sources cost more): an unfillable
        # candidate's live count or S (a fillable one), against H(F) = S nf - its live tokens
        # (a full block has no hole); no candidate at all is S with H(F) = 0
        end = np.cumsum(size)
        u0, f0 = end - size, end - nf
        cum = np.concatenate(([0], np.cumsum(live)))
        budget = S * nf - (cum[end] - cum[f0])
        runs = np.empty(2 * n, dtype=np.int64)
        runs[0::2], runs[1::2] = u0, f0
        least = np.minimum.reduceat(np.append(live, S), runs)[0::2]  # an empty run reads the next entry: masked
        return in_place_shortfall(np.where(nu > 0, least, S), budget, S)
    seg = np.repeat(np.arange(n), size)  # each block's request
    keep = np.arange(len(seg)) - np.repeat(np.cumsum(size) - size, size) < nu[seg]
    cand = live < S  # full blocks are no candidates
    seg, keep, live = seg[cand], keep[cand], live[cand]
    cost, _ = _source_costs(live, keep, S)
    budget = np.bincount(seg[~keep], weights=S - live[~keep], minlength=n).astype(np.int64)
    out = np.full(n, S, dtype=np.int64)  # no candidate: a whole block's evictions
    order = np.lexsort((cost, seg))  # by request, the cheapest first
    seg, cost = seg[order], cost[order]
    count = np.bincount(seg, minlength=n)
    start = np.cumsum(count) - count
    k = np.arange(len(seg)) - start[seg]  # k - 1: the cost's rank in its request
    total = np.cumsum(cost)
    c = total - (total - cost)[start[seg]]  # C_k: the request's cheapest k costs
    val = c - budget[seg] - S * np.minimum(k, dests[seg])
    val[k >= int(max_sources)] = np.iinfo(np.int64).max  # at most B sources
    has = count > 0
    out[has] = np.minimum.reduceat(val, start[has])
    return np.maximum(out, 0)


def _moves_of(table: TokenTable, req_id, sources: np.ndarray, fills: list, dests: list) -> np.ndarray:
    """The (k, 5) moves of a proposal: every live token of the sorted ``sources``, in logical
    order, into the holes of ``fills`` (in place), then packed into whole ``dests`` (the
    reference's one placement rule; an out-of-place plan has no fills)."""
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
    n = 0
    if len(toks) and len(fills):
        f = np.asarray(fills, dtype=np.int64)
        occupied = table.claims[f[:, None] * S + np.arange(S)] > 0
        hole_block, hole_offset = holes(occupied, f)
        n = min(len(hole_block), len(toks))
        moves[:n, 3] = hole_block[:n]
        moves[:n, 4] = hole_offset[:n]
    if n < len(toks):
        dest_index, offset = place(np.ones(len(toks) - n, dtype=bool), S)
        moves[n:, 3] = np.asarray(dests, dtype=np.int64)[dest_index]
        moves[n:, 4] = offset
    return moves


def rank_key(gain: int, arrival, req_id) -> tuple:
    """Stage 3's one order of requests, as a sort key: the largest reclaim bound ``gain`` first,
    the earlier ``arrival`` breaking ties (then the request id). Every driver ranks with it
    (``ReclamationManager.plan_round``: arrival is the table's order; the adapter's
    ``PlanBook.plan``: vLLM's arrival order, the key cached with the bound). O(1)."""
    return (-int(gain), arrival, req_id)


def ranked(keys: Iterable[tuple]) -> Iterator:
    """The requests of ``keys`` (:func:`rank_key` tuples) in stage 3's order, the one ranking
    every driver plans in, yielded as the caller reads them: the keys are copied into a heap
    now (the caller may change what it took them from while it reads), and each request read
    costs one pop. A driver stops after a few plans a step, so a step pays O(k + read x log k)
    for k keys, not a sort of every key. Changes nothing."""
    heap = list(keys)
    heapq.heapify(heap)
    return _popped(heap)


def _popped(heap: list) -> Iterator:
    """The requests of a heap of :func:`rank_key` tuples, smallest key first (keys are distinct:
    each names its request)."""
    while heap:
        yield heapq.heappop(heap)[2]


def in_flight_payload(plans: Iterable[Plan]) -> list[dict]:
    """A plan snapshot's ``in_flight`` entries: ``{"id", "request", "sources", "dests",
    "fills"}`` of each plan of ``plans`` (the other plans copying), in their order, as plain
    data (fresh lists). The one builder of that payload (:func:`plan_snapshot` calls it on
    every path). O(blocks of those plans)."""
    return [{"id": p.id, "request": str(p.req_id), "sources": list(p.sources), "dests": list(p.dests),
             "fills": list(p.fills)} for p in plans]


def shared_at_end(plan: Plan, blocks) -> PlanError:
    """The one error for blocks of ``plan`` found shared, or no longer its request's alone, when
    its copy ends (shared blocks never move): ``PlanError`` ``shared_fill`` when one of
    ``blocks`` is a fill (the copy already wrote it), else ``shared_source``. Returned for the
    caller to raise: ``ReclamationManager`` (the blocks no sharer's own reference explains) and
    the adapter's ``PlanBook.absorb`` (any: the adapter parks a source's prefix-cache hash in
    flight, so no hit explains one). O(blocks + fills)."""
    bad = [int(b) for b in blocks]
    code = "shared_fill" if set(bad) & set(plan.fills) else "shared_source"
    return PlanError(code, f"plan {plan.id} of request {plan.req_id!r}: sources or fills {bad} are shared or not "
                           f"the request's alone at the end of its copy (referenced by another request without a "
                           f"reference of its own, or no longer by it: a block in flight was freed and handed out "
                           f"again)")


def plan_snapshot(table: TokenTable, req_id, plan_id: int, proposal: Proposal, tail: Optional[int],
                  headroom: Sequence[int], in_flight: Iterable[Plan]) -> dict:
    """The plan snapshot (``vtoken.snapshot`` schema) at planning time; O(length of the request
    + blocks of the plans in flight). ``in_flight``: every other plan copying (their entries
    built by :func:`in_flight_payload`); ``post`` stays null and ``evicted_in_flight`` empty
    until :func:`snapshot_applied`."""
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
        "in_flight": in_flight_payload(in_flight),
        "schedule": [],
        "evicted_in_flight": [],
    }


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


def trigger_inputs(table: TokenTable, free_blocks: int, totals: Optional[tuple] = None) -> dict:
    """The trigger's inputs, read off a table (O(requests)) and the pool's free-block count.
    ``totals``: ``(live slots, referenced blocks)`` to use instead of the table's (a table a
    few growth and eviction steps ahead of it: its request set the same)."""
    live, ref = (table.num_live_slots, table.num_ref_blocks) if totals is None else (int(totals[0]), int(totals[1]))
    return dict(waste_ratio=waste_ratio_of(live, ref, table.S), free_blocks=int(free_blocks), ref_blocks=ref,
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
    """Stages 1-3 and the in-process drive of the lifecycle: the decode engine, the simulator
    and the planner machine run reclamation through it.

    It keeps the lifecycle's two sides in one process: the block side
    (:class:`~vtoken.lifecycle.Lifecycle` over the allocator: the headroom, the blocks held for
    requests, the plans in flight and their ends) and the copy side
    (:class:`~vtoken.lifecycle.Copies`: the copy engine's copies, applied to the table once
    observed done); the vLLM adapter runs the same two, split between scheduler and worker.

    Ownership: the driver holds nothing itself. Every block it allocates for a request is
    handed over with :meth:`hold`; :meth:`finish_request` releases what the request still holds
    (a plan in flight keeps its sources and fills until it ends). An applied plan's sources are
    freed, its fills and used destinations stay the request's (``on_applied`` tells the
    driver), unused destinations go back to the headroom; tokens evicted in flight stay dead.

    ``stats``: every launched plan ends exactly once, as ``applied``, ``aborted`` (copy failed,
    or a source became shared: table unchanged, shared blocks never move) or ``orphaned``
    (request gone in flight), so once nothing is in flight ``plans == applied + aborted +
    orphaned``. A plan ends only when :meth:`poll` or :meth:`drain` observes its copy's end.
    """

    def __init__(self, table: TokenTable, allocator: BlockAllocator, engine=None,
                 config: PlannerConfig | None = None, tail_of: Callable | None = None,
                 on_applied: Callable | None = None, clock: Callable | None = None,
                 after_apply: Callable | None = None):
        self.table, self.alloc = table, allocator
        self.engine = engine if engine is not None else NullCopyEngine()
        self.cfg = config or PlannerConfig()
        self.S = table.S
        self._tail_of = tail_of or table.tail_block
        self.on_applied = on_applied
        self.stats = dict(plans=0, applied=0, aborted=0, orphaned=0, deferred=0, moves=0, blocks_freed=0, rounds=0)
        self.lifecycle = Lifecycle(AllocatorPort(allocator), table.num_blocks, self.stats, clock)
        self.copies = Copies(table, self.engine, after_apply)
        self.steps = 0
        self.refill_headroom()

    @property
    def in_flight(self) -> dict[int, Plan]:
        """The plans in flight, by id (the lifecycle's)."""
        return self.lifecycle.in_flight

    @property
    def history(self) -> list[Plan]:
        """Ended plans with snapshots (when recorded), in the order they ended."""
        return self.lifecycle.history

    @property
    def headroom(self) -> list[int]:
        """The reserved destinations (the lifecycle's list: read it, change it through the manager)."""
        return self.lifecycle.headroom

    # ------------------------------------------------------------------ stage 1 and 2
    def refill_headroom(self) -> None:
        """Top the reservation up to ``headroom`` blocks from the free queue (as far as it goes)."""
        self.lifecycle.refill(self.cfg.headroom)

    def yield_headroom(self, n: int) -> int:
        """Give up to ``n`` headroom blocks back to the free queue (a request needs them now; the
        next refill takes them again). Returns how many."""
        return len(self.lifecycle.give_back(n))

    @property
    def backpressure(self) -> bool:
        """True while the headroom is short: the scheduler should not admit new requests."""
        return len(self.headroom) < self.cfg.headroom

    def eligible(self) -> bool:
        """Should this step plan? :func:`should_reclaim` over the table and the free blocks."""
        return should_reclaim(self.cfg, **trigger_inputs(self.table, self.alloc.num_free))

    @property
    def busy_mask(self) -> np.ndarray:
        """Blocks of in-flight plans, as a bool mask over all blocks (read only: the lifecycle's)."""
        return self.lifecycle.busy_mask

    def is_busy(self, block_id: int) -> bool:
        """Is the block a source, fill or destination of an in-flight plan? (O(1))"""
        return self.lifecycle.is_busy(block_id)

    def busy_requests(self) -> set:
        """Requests with a plan in flight (I4: at most one plan per request copies at a time)."""
        return self.lifecycle.busy_requests()

    def hold(self, req_id, block_ids) -> None:
        """The driver allocated ``block_ids`` for ``req_id`` (one reference each): held from now on."""
        self.lifecycle.hold(req_id, block_ids)

    def release_empty(self, req_id, block_ids) -> None:
        """``req_id``'s all-dead blocks ``block_ids`` (released from its table already): freed now."""
        self.lifecycle.release_held(req_id, block_ids)

    # ------------------------------------------------------------------ stage 3
    def plan_request(self, req_id, max_dests: Optional[int] = None) -> Optional[Plan]:
        """Plan one request's compaction (:func:`propose` over the headroom, in-flight plans'
        blocks excluded, at most ``max_dests`` destinations), or None when no positive reduction
        fits. Changes nothing; launch the plan at once or drop it (its destinations leave the
        headroom only at launch)."""
        tail = self._tail_of(req_id)
        prop, worthwhile = propose(self.table, req_id, self.headroom, max_sources=self.cfg.max_sources, tail=tail,
                                   excluded=self.busy_mask if self.in_flight else None, max_dests=max_dests,
                                   in_place=self.cfg.in_place)
        if prop is None:
            if worthwhile:
                self.stats["deferred"] += 1  # worth doing, but the headroom is short
            return None
        plan = self.lifecycle.new_plan(req_id, prop.sources, prop.dests, prop.moves, prop.fills)
        if self.cfg.record_snapshots:
            plan.snapshot = plan_snapshot(
                self.table, req_id, plan.id, prop, tail, self.headroom, self.in_flight.values())
        return plan

    def record(self, p: Plan, kind: str, **fields) -> None:
        """Append an event to the plan's snapshot schedule (when snapshots are recorded)."""
        p.record(kind, **fields)

    # ------------------------------------------------------------------ lifecycle
    def launch(self, plan: Plan) -> None:
        """planned -> copying: the lifecycle takes the plan's blocks (:meth:`Lifecycle.launch`)
        and the copy is issued; a copy refused at once ends the plan now."""
        self.lifecycle.launch(plan)
        now = self.copies.launch(plan)
        if now is not None:
            self._end(plan, now)

    def poll(self, force_sync: bool = False) -> list[Plan]:
        """Observe finished copies and end their plans. Returns the plans that finished (either way)."""
        done = []
        for plan, outcome in self.copies.poll(force=force_sync):
            self._end(plan, outcome)
            done.append(plan)
        return done

    def _end(self, plan: Plan, outcome: Outcome) -> None:
        """End the plan on the block side (:meth:`Lifecycle.end`) and tell the driver.

        A source that became shared in flight ends the plan aborted when each sharer holds its
        own reference (a prefix-cache hit on it); a shared fill, or a share without those
        references (a block reused after an early free), is corruption: :func:`shared_at_end`, the
        one error every path raises for it."""
        t = self.table
        bad = [b for b in outcome.shared_sources if b not in plan.sources or not t.references(plan.req_id, b)
               or self.alloc.ref[b] < t.block_refs(b)]
        if bad:
            raise shared_at_end(plan, bad)
        sources = len(plan.sources)
        if self.lifecycle.end(plan, outcome) != "applied":
            return
        self.stats["moves"] += outcome.moved
        self.stats["blocks_freed"] += sources - len(plan.dests)
        if plan.snapshot is not None:
            self.history.append(plan)
        if self.on_applied is not None:
            self.on_applied(plan)

    def drain(self) -> list[Plan]:
        """End of a batch: end every plan still in flight and give the headroom back.

        Each in-flight copy is host-waited (``engine.wait``), then handled as :meth:`poll` would
        (an orphan's sources and fills freed, ``on_applied`` run); then the headroom goes back to
        the free queue. Afterwards nothing is in flight or reserved; the manager stays usable.
        Every path that ends a batch must call it, or a plan launched in its last steps is never
        polled. Returns the plans ended; one host wait per plan.
        """
        done = self.poll(force_sync=True)
        self.lifecycle.give_back()
        return done

    def finish_request(self, req_id) -> list[int]:
        """The request finished or was preempted: forget it and free the blocks it holds.

        Its plans in flight become orphans: their copies end aborted (the table is not touched:
        the request is gone from it) and their sources and fills are freed then. Returns the
        blocks freed now.
        """
        if req_id in self.table:
            self.table.free_request(req_id)
        self.copies.forget(req_id)
        return self.lifecycle.finish(req_id)

    # ------------------------------------------------------------------ the step hook
    def plan_round(self, req_ids=None) -> list[Plan]:
        """Plan and launch for the requests with the most reclaimable blocks first, in stage 3's
        one order (:func:`ranked`: the table's order, or ``req_ids``', breaks ties), at most
        ``max_plans_per_round`` plans."""
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
                scored.append(rank_key(gain, len(scored), rid))
        launched = []
        for rid in ranked(scored):
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
