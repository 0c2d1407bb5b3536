"""The plan book: the adapter's compaction plans at vLLM's edge, from proposal to the
worker's report.

A plan's life is :class:`vtoken.lifecycle.Lifecycle`'s, the one the decode engine and the
simulator drive through ``ReclamationManager`` and the planner machine checks: the
headroom, the blocks held for requests, the plans in flight (one per request, I4), their
ends and the one release of blocks (through the adapter's ``VllmPort``: vLLM's fenced free).
What stays here is the translation to vLLM: which blocks vLLM shares or the scheduler side
does not hold (excluded from planning), the proposal checked against vLLM's own reference
counts, prefix-cache hashes dropped, the fence ledger that verifies each source's free, and
the worker's report turned into the lifecycle's ends.
Owns: the cached positive reclaim bounds, the requests whose bound is stale, and the requests
an in-place proposal found no plan for, with what must change before one can (``no_plan``:
without it a request whose bound counts blocks no plan may fill, hashed ones kept with
``keep_prefix_bytes``, was proposed for again at every plan check) and which of those the
next plan check must test (``events``, ``counted``: the others' gates cannot have opened); the
blocks are the lifecycle's.
May call: what it is given (the lifecycle, the token table, the rooms ``reserve``, ``mirror``,
``fence``, ``hashes``, ``checker``; vLLM's pool and scheduler through the harness; the request
side's five questions, :class:`RequestSide`), :mod:`vtoken.planner` (``should_reclaim``,
``reclaim_bounds``, ``propose``) and the toolkit's ``plan_hook`` when one is attached. It never
reads the adapter's attributes.
Costs: per planning step O(requests whose table changed + requests with a positive bound),
plus the planner's own cost per proposal, made only for requests not skipped in ``no_plan``;
per report O(blocks of the reported plans).
"""

from __future__ import annotations

import copy
import heapq
from typing import Optional, Protocol

import numpy as np

from .assumptions import AdapterAssumptionError
from .messages import StepMeta, plan_order
from ..errors import PlanError
from ..lifecycle import Lifecycle, Outcome, Plan
from ..planner import Proposal, in_place_shortfall, plan_snapshot, propose, rank_key, ranked, reclaim_bounds, \
    shared_at_end, shortfalls_flat, should_reclaim, split_eligible, trigger_inputs

# a request skipped after an in-place proposal found no plan is looked at again after this many
# plan checks when it shares a block (a sharer leaving makes the block eligible: no event of the
# request's own says so), and after SAFETY_CHECKS in any case
RETRY_CHECKS = 16
SAFETY_CHECKS = 256


_NEVER = 1 << 62  # a watched record's evictions due: its thresholds decide (PlanBook._watch)
_NO_POS: dict = {}  # read-only stand-in for a request with no list entry or held block


class _Gates:
    """The numbers of every skip record (:class:`_Skip`) in one int64 array, a row per record
    (rows reused), so a plan check tests every waiting request's record at once
    (``PlanBook._still_skipped``) instead of one Python visit each. Columns: its evictions when
    a plan may first exist, block-set version, look-again check, headroom size, full-context
    length (-1: none), and for a watched record (no destination: ``PlanBook._watch``) the holes
    of its fillable blocks and the least live count of its unfillable ones (at most S), kept
    up to date from the table's drops, so ``min(least, S) - holes`` never exceeds its shortfall."""

    DEAD_BY, VERSION, DUE, HEAD, FAITHFUL, HOLES, LEAST = range(7)

    def __init__(self):
        self.a = np.zeros((64, 7), dtype=np.int64)
        self.free = list(range(63, -1, -1))

    def take(self) -> int:
        if not self.free:  # double: rows [n, 2n) free
            n = len(self.a)
            self.a = np.concatenate([self.a, np.zeros_like(self.a)])
            self.free = list(range(2 * n - 1, n - 1, -1))
        return self.free.pop()

    def give(self, row: int) -> None:
        self.free.append(row)


def _gate(col: int, doc: str):
    def get(self):
        return self.gates.a.item(self.row, col)

    def put(self, v) -> None:
        self.gates.a[self.row, col] = v

    return property(get, put, doc=doc)


class _Skip:
    """A request an in-place proposal found no plan for (``PlanBook._no_plan``): what it was
    then, and what must change before a plan may exist. Its numbers live in row ``row`` of the
    book's :class:`_Gates` (given back when the record is dropped: ``PlanBook._unskip``)."""

    __slots__ = ("gates", "row", "req", "blocks", "tail", "fill", "unfill", "dests", "watched")

    def __init__(self, gates: _Gates, req: str, *, tail: Optional[int], head: int, fill: list,
                 unfill: list, dests: int):
        self.gates, self.row, self.req = gates, gates.take(), req
        self.blocks: set = set()  # its block set
        self.tail = tail
        # lists of block ids: a moved-on tail is appended in O(1) (``PlanBook._tail_moved``)
        self.fill = fill  # its eligible blocks a plan may fill
        self.unfill = unfill  # those it may only empty
        self.dests = dests  # destinations a plan may take
        self.watched = False  # its blocks' live counts followed (PlanBook._watch), not its evictions counted
        self.gates.a[self.row] = 0
        self.head = head
        self.faithful = None
        self.holes, self.least = -_NEVER, 0  # not watched: the estimate never reads 0

    dead_by = _gate(_Gates.DEAD_BY, "Its evicted tokens when a plan may first exist (the shortfall reached).")
    version = _gate(_Gates.VERSION, "Its block-set version (``TokenTable.block_versions``).")
    due = _gate(_Gates.DUE, "The plan check to look again by.")
    head = _gate(_Gates.HEAD, "The headroom's size.")
    holes = _gate(_Gates.HOLES, "Watched: the holes of its fillable blocks, H(F).")
    least = _gate(_Gates.LEAST, "Watched: the least live count of its unfillable blocks (S: none below S).")

    @property
    def faithful(self) -> Optional[int]:
        """Its full-context length (which hashed blocks are unfillable), None before one."""
        v = self.gates.a.item(self.row, _Gates.FAITHFUL)
        return None if v < 0 else v

    @faithful.setter
    def faithful(self, v: Optional[int]) -> None:
        self.gates.a[self.row, _Gates.FAITHFUL] = -1 if v is None else v


del _gate


def merge_snapshot(plan: Plan, done: dict) -> None:
    """Fold the worker's completed copy of ``plan``'s snapshot into the plan's own: the
    digests it took, the events it recorded (re-timed, in their order, on this side's clock:
    they happened after everything recorded before the plan left), and what apply wrote
    (``evicted_in_flight``, ``dests_used``, ``post``)."""
    snap = plan.snapshot
    digests = done.get("plan", {}).get("digests")
    if digests is not None:
        snap["plan"]["digests"] = digests
    for ev in done.get("schedule", [])[len(snap["schedule"]):]:
        plan.record(ev["kind"], **{k: v for k, v in ev.items() if k not in ("t", "kind")})
    for key in ("evicted_in_flight", "dests_used", "post"):
        if key in done:
            snap[key] = done[key]


class RequestSide(Protocol):
    """What the plan book asks of the adapter about requests (the adapter implements it)."""

    def arrival(self, r: str) -> int: ...  # a deterministic order

    def current(self, r: str) -> bool: ...  # mirrored, in the table, its incarnation seen by the worker

    def running(self, r: str) -> bool: ...  # vLLM's status RUNNING

    def look_again(self, r: str) -> None: ...  # look for all-dead blocks at the next step

    def detach_listed(self, r: str, block_ids) -> list[int]: ...  # take r's list entries over (their indices)


class PlanBook:
    """The adapter's plans (see the module docstring).

    Args:
        lifecycle: the lifecycle room (``Lifecycle``: headroom, held blocks, plans in flight,
            their ends, the one release).
        harness: the ``VllmHarness`` (vLLM's pool and scheduler, read each time: vLLM's tests
            swap the manager after construction).
        table, cfg, stats: the token table the worker writes, the ``PlannerConfig``, the
            adapter's counters.
        reserve, mirror, fence, hashes: the adapter's rooms; checker: its runtime checks.
        requests: the request side (:class:`RequestSide`).
        max_plans_per_step: plans launched per step at most; checks: run the fence check
            at each source free; keep_prefix_bytes: in-place plans never fill a block whose
            prefix-cache hash describes its bytes (``AdapterConfig.keep_prefix_bytes``).
    """

    def __init__(self, lifecycle: Lifecycle, *, harness, table, cfg, stats: dict, reserve, mirror, fence, hashes,
                 checker, requests: RequestSide, max_plans_per_step: int, checks: bool,
                 keep_prefix_bytes: bool = False):
        self.lifecycle, self.harness, self.table, self.cfg, self.stats = lifecycle, harness, table, cfg, stats
        self.reserve, self.mirror, self.fence, self.hashes = reserve, mirror, fence, hashes
        self.checker, self.requests = checker, requests
        self.max_plans_per_step, self.checks = int(max_plans_per_step), bool(checks)
        self.keep_prefix_bytes = bool(keep_prefix_bytes)  # never fill a block its prefix-cache hash describes
        self.plan_hook = None  # the toolkit's contract check, attached through the adapter
        self.stale_bounds: set = set()  # requests whose reclaim bound must be recomputed
        self.bound: dict[str, tuple] = {}  # request -> (-its positive reclaim bound, arrival, request), cached
        self.no_plan: dict[str, _Skip] = {}  # requests skipped until a plan may exist (_no_plan; dropped by _unskip)
        self.gates = _Gates()  # the numbers of the records in no_plan
        # block -> the watched record's row it is a fillable (1) or unfillable (2) block of; 0: none
        self.role = np.zeros(table.num_blocks, dtype=np.int8)
        self.owner = np.zeros(table.num_blocks, dtype=np.int64)
        self.due: list = []  # heap of (look-again step, request's order, request) of ``no_plan``
        # the headroom's size at the end of the last plan check: every record made then was made
        # with at least as many (a check's launches only take blocks out of it)
        self.head_seen = 0
        # the records a plan check must test (_still_skipped): the others' gates cannot have opened
        self.events: set = set()  # block set or full-context length changed since the last check
        self.counted: set = set()  # not watched: their evictions are counted (dead_by)
        self.by_row: dict[int, str] = {}  # gate row -> the request whose record holds it
        # deferred records whose gate passed every test but the headroom's at this round's start
        # (their request's table does not change within the round): skipped at their turn unless
        # the headroom left then is larger than the one they were made with
        self.still_at_turn: set = set()

    @property
    def plans(self) -> dict[int, Plan]:
        """The plans in flight (not yet reported by the worker), by id."""
        return self.lifecycle.in_flight

    @property
    def busy(self) -> dict:
        """Request -> the ids of its plans in flight (one at most here: a busy request is not planned, I4)."""
        return self.lifecycle.busy

    def plan(self, meta: StepMeta, steps: int, totals: Optional[tuple] = None, catch_up=None) -> None:
        """Stages 1-3: eligibility (``should_reclaim`` every ``check_every`` steps), requests
        by their reclaimable-block bound (recomputed only for requests whose table changed,
        cached while positive), then one plan per request (``propose``), with the blocks vLLM
        shares or the scheduler side does not hold for the request excluded. A proposal's
        destinations are the headroom's blocks, then what the soft reservation may still draw
        (:meth:`_destinations`), drawn from vLLM's pool only for a plan that uses them. ``steps``:
        the adapter's non-empty steps so far (the ``check_every`` clock). ``totals``: the table
        lags the worker's (``messages.Replica``): the gate is decided on these totals of the
        worker's, and only if it opens is the table caught up (``catch_up()``) and read."""
        t, cfg = self.table, self.cfg
        self._take_drops()
        if totals is not None:
            if self._closed(steps, totals):
                return
            catch_up()
            self._take_drops()  # the caught-up reports' drops
        if self.hashes.changed:  # full-context lengths changed (kept with reclamation): their gates are tested
            self.events |= self.hashes.changed & self.no_plan.keys()
            self.hashes.changed.clear()
        if self._closed(steps):
            return
        need_head = not cfg.in_place  # in-place plans fill the request's own holes: no headroom needed
        bound, no_plan = self.bound, self.no_plan
        self._refresh_bounds(steps)
        busy, current, running = self.busy, self.requests.current, self.requests.running
        # stage 3's one order (planner.ranked: largest bound first, arrival breaks ties); the
        # eligibility tests run only on the requests reached before the step's plans or the headroom run out
        for r in ranked(bound.values()):
            if len(meta.plans) >= self.max_plans_per_step or (need_head and not self.reserve):
                break
            if r in busy or not current(r) or not running(r):
                continue
            if r in no_plan:  # deferred: its gate tested with the headroom the plans before it left
                if self._head_size() > no_plan[r].head:
                    self._unskip(r)  # more destinations than it was made with: looked at as any request
                elif r in self.still_at_turn:
                    del bound[r]  # all but the headroom tested at the round's start: still skipped
                    continue
                elif self._still_skipped([r], steps, every=True):
                    del bound[r]
                    continue
            blocks = t.block_array(r).tolist()
            exclude, keep = self._excluded_and_unfillable(r, blocks, cfg.in_place and self.keep_prefix_bytes)
            tail = t.tail_block(r)
            head = self._destinations()
            # proposed for at once: a failing proposal costs less than the shortfall that would
            # predict it (planner.shortfall's contract: in place, positive means propose finds
            # nothing), and most requests reached here have a plan
            p, _ = propose(t, r, head, max_sources=cfg.max_sources, tail=tail, excluded=exclude, in_place=cfg.in_place,
                           unfillable=keep)
            if p is None:
                if cfg.in_place:  # out of the ranking until its table changes enough (or it is due)
                    self._no_plan(r, steps, tail, exclude, keep, len(head))
                continue
            if len(p.dests) and p.dests[-1] >= t.num_blocks:  # placeholders: drawn from vLLM's pool now
                p = self._draw(p)
            head = list(self.lifecycle.headroom)  # the destinations that exist (none drawn but the plan's)
            if self.plan_hook is not None:  # the toolkit's contract check (spec.planner), when attached
                flying = [b for q in self.plans.values() for b in q.blocks]
                try:  # an in-place plan uses no destination (its view has no headroom) unless it keeps hashed bytes
                    self.plan_hook(table=t, req_id=r, proposal=p, tail=tail, headroom=head if keep or not cfg.in_place else [],
                                   excluded=exclude.tolist(), max_sources=cfg.max_sources, in_flight=flying,
                                   in_place=cfg.in_place, unfillable=keep)
                except AssertionError as e:
                    raise AdapterAssumptionError("plan_contract", f"step {meta.seq}: {e}") from e
            self.launch(meta, r, p, tail, head)
        self.head_seen = self._head_size()

    def _closed(self, steps: int, totals: Optional[tuple] = None) -> bool:
        """Is the gate closed this step: no headroom an out-of-place plan needs, not a
        ``check_every`` step, or ``should_reclaim`` says no (on the table, or on ``totals``)? O(1)."""
        cfg = self.cfg
        return (not cfg.in_place and not self.reserve) or bool(steps % cfg.check_every) or not should_reclaim(
            cfg, **trigger_inputs(self.table, self.harness.pool.get_num_free_blocks(), totals))

    def _refresh_bounds(self, steps: int) -> None:
        """Stage 2 for the requests whose bound is stale (their table changed, or their skip
        record was woken): gone ones forgotten, skipped ones left out of the ranking, the others'
        bounds recomputed (``reclaim_bounds``: the table's tails, the blocks being written).
        O(stale requests) plus the gates' tests (:meth:`_still_skipped`)."""
        t, bound, arrival, no_plan = self.table, self.bound, self.requests.arrival, self.no_plan
        self._wake(steps)
        stale = t.present(self.stale_bounds)
        for r in self.stale_bounds.difference(stale):  # gone from the table
            bound.pop(r, None)
            self._unskip(r)
        waiting = [r for r in stale if r in no_plan]
        self.still_at_turn = set()
        # deferred: gates that failed only because the headroom grew; tested again at their turn
        skipped = self._still_skipped(waiting, steps, defer=True) if waiting else ()
        # a skipped request has no bound (``_no_plan`` took it out, only the plan loop puts one back)
        for r in skipped:
            bound.pop(r, None)  # one left by a round that stopped before a deferred record's turn
        looked = [r for r in stale if r not in skipped] if skipped else stale
        for r, gain in zip(looked, reclaim_bounds(t, looked).tolist()):
            if gain > 0:
                bound[r] = rank_key(gain, arrival(r), r)  # stage 3's sort key, kept with the bound
            else:
                bound.pop(r, None)  # no plan can exist
        self.stale_bounds = set()

    def _head_size(self) -> int:
        """The destinations a plan may take now: the headroom's blocks and what the soft
        reservation may still draw (``Headroom.drawable``). O(1)."""
        return len(self.lifecycle.headroom) + self.reserve.drawable()

    def _destinations(self) -> list:
        """The destinations a proposal may use, in order: the headroom's blocks, then one
        placeholder id (``num_blocks`` on, never a block) per block the soft reservation may
        still draw; a proposal that uses placeholders draws real blocks for them at launch
        (:meth:`_draw`). O(destinations)."""
        head, extra = list(self.lifecycle.headroom), self.reserve.drawable()
        if extra:
            nb = self.table.num_blocks
            head += range(nb, nb + extra)
        return head

    def _draw(self, p: Proposal) -> Proposal:
        """``p`` with its placeholder destinations (:meth:`_destinations`: the ids ``num_blocks``,
        ``num_blocks + 1``, ... after the headroom's blocks, in order) replaced by blocks drawn
        from vLLM's free queue now (``Headroom.draw``: appended to the headroom, so the plan's
        destinations are its front as the launch expects), in its destinations and moves.
        O(the plan's moves)."""
        nb = self.table.num_blocks
        k = sum(1 for d in p.dests if d >= nb)
        got = np.asarray(self.reserve.draw(k), dtype=np.int64)
        moves = p.moves.copy()
        at = moves[:, 3] >= nb
        moves[at, 3] = got[moves[at, 3] - nb]
        return Proposal(p.sources, [d if d < nb else int(got[d - nb]) for d in p.dests], moves, p.fills)

    def _no_plan(self, r: str, steps: int, tail, exclude, keep: list, head: int) -> None:
        """An in-place proposal for ``r`` found no plan: skip ``r`` until it evicted as many
        tokens as its shortfall (``planner.shortfall``: a plan needs at least that many, at least
        one), then re-check the shortfall on the same eligible blocks (their live counts now) and
        propose only when it is 0. Look again at once when what else lowers the shortfall
        changed: its block set (a moved-on tail is added to the blocks kept here), the headroom
        grew, its full-context length (which of its hashed blocks are unfillable) changed; after
        ``RETRY_CHECKS`` plan checks when it shares a block, ``SAFETY_CHECKS`` otherwise. A
        block gaining a hash never lowers the shortfall; one losing its hash while its request
        runs is unfaithful already (or a reset, with no request running). O(blocks of r)."""
        t, cfg = self.table, self.cfg
        fill, unfill = split_eligible(t, r, tail=tail, excluded=exclude, unfillable=keep)
        dests = head if keep else 0
        counts = None
        if dests > 0:
            need = self._shortfalls([(unfill, fill, dests)])[0]
        else:  # no destination: the shortfall is the watched estimate itself (planner.shortfalls_flat)
            counts = self._counts(fill, unfill)
            need = int(in_place_shortfall(*counts, t.S))
        blocks = t.block_array(r)
        shares = len(exclude) > 0 or bool((t.refs[blocks] > 1).any())
        due = steps + (RETRY_CHECKS if shares else SAFETY_CHECKS) * cfg.check_every
        self._unskip(r)
        skip = self.no_plan[r] = _Skip(self.gates, r, tail=tail, head=head, fill=fill.tolist(),
                                       unfill=unfill.tolist(), dests=dests)
        self.by_row[skip.row] = r
        self.counted.add(r)  # until watched
        skip.due, skip.version, skip.blocks = due, int(t.block_versions([r])[0]), set(blocks.tolist())
        skip.faithful = self.hashes.faithful.get(r)
        skip.dead_by = int(t.dead_counts([r])[0]) + max(1, need)
        if need > 0:
            self._watch(skip, counts)
        heapq.heappush(self.due, (due, self.requests.arrival(r), r))
        del self.bound[r]  # out of the ranking: back when its table changed enough (or it is due)

    def _wake(self, steps: int) -> None:
        """Skipped requests (``no_plan``) whose look-again step came, or all of them when the
        headroom grew past what one was skipped with, are looked at again (``stale_bounds``);
        the others wait for a change of their own table. O(requests woken + log)."""
        due, no_plan = self.due, self.no_plan
        while due and due[0][0] <= steps:
            when, _, r = heapq.heappop(due)
            skip = no_plan.get(r)
            if skip is not None and skip.due == when:
                self._unskip(r)
                self.stale_bounds.add(r)
        head = self._head_size()
        if head > self.head_seen:
            grown = [r for r, sk in no_plan.items() if head > sk.head]
            self.stale_bounds.update(grown)
            self.events.update(grown)

    def reblocked(self, requests: set) -> None:
        """``requests``' table block sets changed (the table's ``reblocked`` log, fed by the
        adapter at each hook): a skip record of theirs is tested at the next plan check (its
        version moved). O(given)."""
        if self.no_plan:
            self.events |= requests & self.no_plan.keys()

    def _shortfalls(self, kept: list) -> list:
        """``planner.shortfalls_flat`` of each ``(unfillable, fillable, destinations)`` of
        ``kept`` (a skip record's blocks), with their live counts now, all at once. O(their blocks)."""
        t = self.table
        ids = np.concatenate([np.asarray(x, dtype=np.int64) for u, f, _ in kept for x in (u, f)])
        return shortfalls_flat(t.n_b[ids], [len(u) for u, _, _ in kept], [len(f) for _, f, _ in kept], t.S,
                               self.cfg.max_sources, [d for _, _, d in kept]).tolist()

    def _counts(self, fill: np.ndarray, unfill: np.ndarray) -> tuple[int, int]:
        """``(least, holes)``: the smallest live count of the unfillable blocks (S when none) and
        the fillable blocks' holes H(F), from the table's live counts now."""
        n_b, S = self.table.n_b, self.table.S
        return (min(int(n_b[unfill].min()), S) if len(unfill) else S), S * len(fill) - int(n_b[fill].sum())

    def _watch(self, skip: _Skip, counts: Optional[tuple] = None) -> None:
        """Without destinations the shortfall is min(least, S) - H(F) (``planner.in_place_shortfall``):
        least the smallest live count of the unfillable blocks, H(F) the fillable blocks' holes.
        Live counts only fall while the block set stays (growth writes the tail, outside both),
        so the record keeps the two figures and the table's drops update them
        (``_take_drops``): one hole more per live slot a fillable block loses, the least
        lowered to an unfillable block's count. Its shortfall is re-checked when that estimate
        reaches 0, not after each eviction of the request (most land in the tail or in
        unfillable blocks above the least). With destinations its evictions are counted
        (``dead_by``). O(its blocks)."""
        if skip.dests > 0:
            return
        self._unwatch(skip)
        skip.least, skip.holes = counts if counts is not None else self._counts(skip.fill, skip.unfill)
        self.role[skip.fill], self.role[skip.unfill] = 1, 2
        self.owner[skip.fill], self.owner[skip.unfill] = skip.row, skip.row
        skip.watched, skip.dead_by = True, _NEVER
        self.counted.discard(skip.req)

    def _unwatch(self, skip: _Skip) -> None:
        """Forget the blocks ``skip`` follows (not those a later record follows: a block that
        changed hands). O(its blocks)."""
        if skip.watched:
            b = np.array(skip.fill + skip.unfill, dtype=np.int64)
            self.role[b[self.owner[b] == skip.row]] = 0
            skip.watched = False

    def _take_drops(self) -> None:
        """Apply the table's drops since the last plan check to the watched records: a drop in a
        fillable block is a hole more, in an unfillable one a least count no larger than its
        count now. A block whose record is gone updates what holds its row now: that lowers an
        estimate, never raises one (a re-check more, never a plan lost). O(drops)."""
        t = self.table
        if t.drops is None:
            t.drops = []  # from the first plan check on (without reclamation nobody empties it)
            return
        if not t.drops:
            return
        ev = np.hstack(t.drops)
        t.drops.clear()
        role, a = self.role[ev], self.gates.a
        f = ev[role == 1]
        if len(f):
            np.add.at(a[:, _Gates.HOLES], self.owner[f], 1)
        u = ev[role == 2]
        if len(u):
            np.minimum.at(a[:, _Gates.LEAST], self.owner[u], t.n_b[u].astype(np.int64))

    def _unskip(self, r: str) -> None:
        """Drop ``r``'s skip record, if any (its blocks unwatched, its gate row given back)."""
        skip = self.no_plan.pop(r, None)
        if skip is not None:
            self._unwatch(skip)
            self.gates.give(skip.row)
            del self.by_row[skip.row]
            self.counted.discard(r)
            self.events.discard(r)

    def _to_test(self, waiting: list) -> tuple[set, list]:
        """``waiting``'s records split into those that stay skipped untested and those whose gate
        may have opened (:meth:`_still_skipped`): an event since their last test, evictions
        counted, or a watched estimate at most 0 (one pass over the gate rows)."""
        a, maybe, by_row = self.gates.a, self.events | self.counted, self.by_row
        for i in np.flatnonzero(in_place_shortfall(a[:, _Gates.LEAST], a[:, _Gates.HOLES], self.table.S) <= 0).tolist():
            r = by_row.get(i)  # a free row's numbers are stale: no record, nothing to test
            if r is not None:
                maybe.add(r)
        still = set(waiting)
        return still, list(still & maybe)

    def _still_skipped(self, waiting: list, steps: int, defer: bool = False, every: bool = False) -> set:
        """The requests of ``waiting`` (skipped, and changed since) still skipped (``_no_plan``);
        the others are forgotten (one whose shortfall was re-checked now as 0 gets a bound and is
        proposed for). Each stays skipped while nothing but its live counts changed (its
        look-again step not come, the headroom no larger, its full-context length and block set
        as they were, or only its tail moved on: ``_tail_moved``) and its shortfall cannot be 0
        yet (watched: its estimate above 0; else fewer evictions than the shortfall).

        Only the records whose gate may have opened are tested: those whose block set or
        full-context length changed, or that the headroom's growth woke, since they were last
        tested (``events``: the table's ``reblocked`` log, the prefix-hash rules' ``changed``),
        the watched ones whose estimate is at most 0 (read off every gate row at once) and the
        ones whose evictions are counted (``counted``); every other record passes each test of
        the gate by construction and stays skipped untested. The tested ones are tested on their
        gate rows, with the evictions and block-set versions read off the table at once; the
        shortfalls of those that pass no test are re-checked together
        (``planner.shortfalls_flat``). O(waiting) set work, O(gate rows) in one array operation,
        O(tested), plus O(eligible blocks) of the re-checked.

        ``defer``: a record whose gate failed only because the headroom is larger than it was
        made with is deferred, neither skipped nor dropped: it keeps its record, gets a bound,
        and the plan loop decides at its turn, with the headroom the plans ranked before it left
        (the round's first plans usually take the destinations that woke it): skipped if every
        other test passed now (``still_at_turn``) and that headroom is no larger, else tested
        again (``every``: each of ``waiting``, no scan). So it is not remade (an O(blocks)
        eligibility pass) at every check."""
        t, no_plan, G = self.table, self.no_plan, _Gates
        a = self.gates.a
        still, tested = (set(), list(waiting)) if every else self._to_test(waiting)
        if not tested:
            return still
        still.difference_update(tested)
        self.events.difference_update(tested)  # an untested record's event waits for its next change
        # the tested are few (an event each): one table read for all, then a Python pass over
        # their gate rows (each array operation costs more than a record's scalar reads)
        dead_l, ver_l = t.dead_counts(tested).tolist(), t.block_versions(tested).tolist()
        head, faithful, get, S = self._head_size(), self.hashes.faithful, a.item, t.S
        recheck = []
        for r, dead, ver in zip(tested, dead_l, ver_l):
            skip = no_plan[r]
            row = skip.row
            ok = steps < get(row, G.DUE) and faithful.get(r, -1) == get(row, G.FAITHFUL)
            grown = ok and head > get(row, G.HEAD)  # deferred, or (not deferring) a gate opened
            ok = ok and (defer or not grown)
            stays = self.still_at_turn if grown else still  # deferred: skipped unless the headroom is larger at its turn
            same = ok and ver == get(row, G.VERSION)
            if same and dead < get(row, G.DEAD_BY) and in_place_shortfall(get(row, G.LEAST), get(row, G.HOLES), S) > 0:
                stays.add(r)  # nothing but its live counts changed, and not enough
            elif not ok or not (same or self._tail_moved(r, skip, ver)):
                self._unskip(r)
            elif not same and skip.watched and in_place_shortfall(skip.least, skip.holes, S) > 0:
                stays.add(r)  # only its tail moved on, and its estimate stays above 0
            elif not grown:  # (grown: re-checked at its turn, against the headroom then)
                recheck.append((r, dead, skip))  # its estimate reached 0, or its evictions the shortfall
        if recheck:
            for (r, d, skip), need in zip(recheck, self._shortfalls([(x[2].unfill, x[2].fill, x[2].dests)
                                                                     for x in recheck])):
                if need > 0:
                    skip.dead_by = d + need
                    self._watch(skip)
                    still.add(r)
                else:
                    self._unskip(r)
        return still

    def _tail_moved(self, r: str, skip: _Skip, ver: int) -> bool:
        """Did ``r``'s block set change only by a new tail (the decode step that filled the old
        one)? Then the old tail joins the eligible blocks in ``skip`` (when a plan may take it:
        only ``r`` holds it, in its list), unfillable when its hash describes its bytes. A
        watched record follows it too (its holes or its least count taken in); an unwatched
        one's shortfall is re-checked now (its evictions count from here). The version moves by
        one per block referenced or released (``TokenTable.block_versions``): one step on and
        one block more is one block added, and a block new to the set that holds the last
        token is the one. O(1), but the append."""
        t = self.table
        tail, new = skip.tail, t.tail_block(r)
        if tail is None or new == tail or new in skip.blocks or ver != skip.version + 1 or \
                t.num_blocks_of(r) != len(skip.blocks) + 1:
            return False
        i, blk = self.mirror.index(r, tail), self.harness.pool.blocks[tail]
        if i is not None and blk.ref_cnt == 1 and t.refs.item(tail) == 1:
            live = t.n_b.item(tail)
            if blk.block_hash is not None and self.hashes.is_faithful(r, i):
                skip.unfill.append(tail)
                role, skip.least = 2, min(skip.least, live)
            else:
                skip.fill.append(tail)
                role, skip.holes = 1, skip.holes + t.S - live
            if skip.watched:
                self.role[tail], self.owner[tail] = role, skip.row
        skip.blocks.add(new)
        skip.version, skip.tail = ver, new
        if not skip.watched:
            skip.dead_by = 0
        return True

    def _excluded_and_unfillable(self, r: str, blocks: list, unfillable: bool) -> tuple[np.ndarray, list]:
        """Of ``r``'s ``blocks`` (in their order), in one pass: those no plan may touch (shared in
        vLLM, ``ref_cnt != 1``, or not held for ``r`` by the scheduler side: neither in its list
        nor among its held blocks), as an int64 array; and, with ``unfillable``, those a plan may
        empty but never fill: whose prefix-cache hash describes their bytes (a list position
        computed with full context), since filling their holes would change what a later
        request repeating the prefix hits. O(blocks of the request)."""
        pool_blocks, pos = self.harness.pool.blocks, self.mirror.pos.get(r, _NO_POS)
        not_ours = self.table.blocks_outside(r, pos, self.lifecycle.held.get(r, _NO_POS))
        k = self.hashes.faithful_blocks(r) if unfillable else 0
        exclude, keep = [], []
        for b in blocks:
            blk = pool_blocks[b]
            if blk.ref_cnt != 1 or b in not_ours:
                exclude.append(b)
            if k and blk.block_hash is not None and 0 <= pos.get(b, -1) < k:
                keep.append(b)
        return np.asarray(exclude, dtype=np.int64), keep

    def launch(self, meta: StepMeta, r: str, p: Proposal, tail, head: list[int]) -> None:
        """Refuse a proposal vLLM's pool contradicts (a source or fill shared there, a destination
        not held once by the adapter: ``reservation``), then hand
        it to the lifecycle: the destinations leave the headroom, the sources and fills are
        taken over from the request (null-substituted in its list through
        :meth:`RequestSide.detach_listed`, or out of its held blocks; ``plan.list_index``
        records where, -1 for a held block: the incremental check compares them all with
        vLLM's list while the plan flies). Then their prefix-cache hashes are dropped (no hit
        may land on a block in flight, and a fill's bytes change), the sources open their
        fence entries and the plan rides on step ``meta.seq``."""
        pool_blocks = self.harness.pool.blocks
        sources = [pool_blocks[b] for b in p.sources]
        fills = [pool_blocks[b] for b in p.fills]
        table_refs = self.table.refs[np.asarray(p.sources + p.fills, dtype=np.int64)].tolist()
        for k, (blk, refs) in enumerate(zip(sources + fills, table_refs)):  # refused before anything changes hands
            if blk.ref_cnt != 1 or refs != 1:
                self.stats["shared_blocks_moved"] += 1
                raise AdapterAssumptionError(
                    "shared_never_moved", f"plan for request {r!r} takes block {blk.block_id} as a "
                    f"{'source' if k < len(sources) else 'fill'} (vLLM ref_cnt {blk.ref_cnt}, table refs "
                    f"{int(self.table.refs[blk.block_id])}) at step {meta.seq}")
        for b in p.dests:  # a reserved block is held once, by the adapter: never handed out, never hashed
            blk = pool_blocks[b]
            if blk.ref_cnt != 1 or blk.block_hash is not None:
                raise AdapterAssumptionError(
                    "reservation", f"plan for request {r!r} takes headroom block {b} as a destination, but vLLM's "
                    f"pool counts it ref_cnt {blk.ref_cnt}{' and hashed' if blk.block_hash is not None else ''} "
                    f"at step {meta.seq}")
        plan = self.lifecycle.new_plan(r, p.sources, p.dests, p.moves, p.fills, seq=meta.seq)
        if self.cfg.record_snapshots:
            plan.snapshot = plan_snapshot(self.table, r, plan.id, p, tail, head, self.plans.values())
        try:
            self.lifecycle.launch(plan, detach=self.requests.detach_listed)
        except PlanError as e:  # a block the scheduler side does not hold for r: refused, nothing changed
            raise AdapterAssumptionError("table_in_step", f"step {meta.seq}: {e}") from e
        keep = self.hashes.park(plan.id, r, sources, fills, plan.list_index)
        self.fence.open(plan)
        self.checker.touch([r])
        # to the worker as plain data; a snapshot goes as a copy the worker completes and sends back
        order = plan_order(plan, copy.deepcopy(plan.snapshot) if plan.snapshot is not None else None, keep=keep)
        meta.plans.append(order)

    def forget(self, r: str) -> None:
        """``r``'s list was freed (preemption, finish; its plans were orphaned by the
        lifecycle): its bound is forgotten."""
        self.bound.pop(r, None)
        self._unskip(r)

    def absorb(self, reported: dict) -> None:
        """The worker's report (plan id -> :class:`~vtoken.lifecycle.Outcome`), per finished
        plan: vLLM's side checked (no source or fill was shared: :func:`~vtoken.planner.shared_at_end`,
        the error every path raises for it; no source was hashed in flight), then the lifecycle ends the plan (:meth:`Lifecycle.end`: destinations and
        fills to the request or back to the headroom, sources back through vLLM's fenced free
        at the plan's step), and the fence ledger records and checks each free."""
        stats = self.stats
        for pid, res in reported.items():
            plan = self.plans.get(pid)
            if plan is None:
                raise AdapterAssumptionError("ownership", f"the worker reported plan {pid}, which is not in flight")
            if res.shared_sources:  # no prefix hit explains one (hashes parked in flight): corruption
                stats["shared_blocks_moved"] += len(res.shared_sources)
                raise shared_at_end(plan, res.shared_sources)
            self.checker.touch([plan.req_id])
            self.requests.look_again(plan.req_id)  # it may release again now that no plan flies
            if res.status == "applied":
                self._applied(plan, res)
            else:  # aborted: nothing moved (or the request is gone); the sources' bytes as they were
                if res.table_kept and not plan.orphaned:
                    self.hashes.unpark(plan.id)  # back to the request, held outside its list: held blocks carry none
                else:
                    self.hashes.restore(plan.id)  # freed: a later request may hit them
                self.fence.drop(plan)
                self.lifecycle.end(plan, res)

    def _applied(self, plan: Plan, res: Outcome) -> None:
        """An applied plan's end: a source carries no prefix-cache hash (dropped at launch, and
        vLLM never hashes a block outside a request's list: one that does was re-hashed under
        the adapter, ``prefix_hash``); the sources go back at the plan's fence
        (the port's fenced free: at once when step ``plan.seq`` has been processed, else deferred
        to it), recorded in the fence ledger."""
        blocks, stats = self.harness.pool.blocks, self.stats
        for b in plan.sources:
            if blocks[b].block_hash is not None:
                raise AdapterAssumptionError(
                    "prefix_hash", f"source block {b} of plan {plan.id} (request {plan.req_id!r}) carries "
                    f"a prefix-cache hash at its end: its hash was parked or dropped at launch, so it was re-hashed "
                    f"while in flight")
        self.hashes.restore(plan.id)  # the copy only read them: a later request may hit them once free
        used = len(set(res.used_dests) & set(plan.dests))
        stats["dests_returned"] += len(plan.dests) - used
        stats["dests_used"] += used
        stats["fills"] += len(plan.fills)
        stats["moves"] += int(res.moved)
        stats["sources_freed"] += len(plan.sources)
        self.fence.close(plan, self.fence.clock.processed, res.copy_done)
        if plan.snapshot is not None and res.snapshot is not None:
            merge_snapshot(plan, res.snapshot)
        self.lifecycle.end(plan, res)
        if plan.snapshot is not None and plan.snapshot["post"] is not None:
            self.lifecycle.history.append(plan)  # its snapshot completed by the copy side (snapshot_applied)
        if self.checks:
            self.fence.check()
