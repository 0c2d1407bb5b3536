"""Planner machine: the real ``TokenTable`` + ``BlockAllocator`` + ``ReclamationManager``
driven through a plan's whole lifecycle, every plan checked against ``vtoken.spec.planner``.

The machine plays the scheduler. It keeps, per request, the positional block list
(``pos``: token ``p`` was written to ``pos[p // S]``; a freed position holds the null
block) and its own model of the references the request holds (``held``): every block it
allocates for the request is handed to the manager (``hold``); a launched plan takes its
sources and fills over; an applied one gives its fills and used destinations back (sources
freed), an aborted one its sources and fills (``on_applied`` and the plan's end tell it). A
``SpecTokenTable`` is kept in step as an independent model of every token's location, so
each applied plan is also checked for conservation (I1) and unique mapping (I2).

Checks:

- every plan (from the ``plan`` rules and from ``step()`` rounds, through a wrapper around
  ``plan_request``): ``plan_errors(view, plan) == []`` and ``plan.reduction ==
  best_reduction(view, max_dests)``; ``None`` only when ``best_reduction`` is 0; planning
  changes nothing;
- after a planning round in ``step()``: no request without an in-flight plan is left with
  a positive ``best_reduction`` over the headroom that remains (the round's one allowed
  deferral: a request with a plan in flight waits for it);
- a plan is applied only after the copy engine reported its copy complete (I3);
- a copy failing part-way aborts: table and allocator exactly as before the plan,
  destinations back in the headroom; so does a plan one of whose sources became shared
  (a prefix-cache hit) while its copy was in flight; tokens evicted while their copy was
  in flight stay dead where they were, and the rest of the plan applies;
- a request finishing while its copy is in flight: what it holds is freed at once (exactly
  the machine's model of it), the plan's sources and fills only once the copy has ended;
- after every step: implementation and reference tables agree; I2 and block accounting
  (``invariants.table_checks``); headroom blocks RESERVED and owned by nobody; in-flight
  sources and fills still allocated and in-flight destinations still reserved (nothing freed or
  reused under a copy); allocator references equal exactly what the requests hold plus what
  the plans in flight took over (nothing leaked); the tail never moved;
- ``drain`` (the end of a batch, with requests still running or, at the end of every
  example, after every request finished): nothing in flight or deferred, the headroom
  given back, nothing reserved; at the end of the example also every block but the null
  block free and every launched plan ended once (the manager's ``stats`` against the
  machine's own count). A plan nobody polls again, a deferred free that never happens or
  a reservation kept past the batch is seen here.

The scheduler obligation the machine keeps (the manager's documented contract): a plan is
launched right after it is made, or dropped (headroom blocks are taken at launch, so two
unlaunched plans may name the same destinations).

Hard states are counted with ``event("hard: ...")`` (``--hypothesis-show-statistics``).

Owns: per example its TokenTable, BlockAllocator, ReclamationManager, SpecTokenTable and scheduler
record.
May call: vtoken.table, .allocator, .planner, vtoken.spec, invariants (table_checks, ownership),
fuzz.table_machine, fuzz.hard_states, hypothesis.
Costs: per step the spec comparison and checks, O(all tokens + pool), plus ``best_reduction`` per
plan.
"""

from __future__ import annotations

import sys
from collections import Counter

import hypothesis.strategies as st
from hypothesis import event, note
from hypothesis.stateful import initialize, invariant, precondition, rule

from vtoken.allocator import NULL_BLOCK, RESERVED, USED, BlockAllocator
from vtoken.fuzz.table_machine import (Touching, alloc_or_none, both, compare_parts, policy_victims, some_of,
                                       sync_both)
from vtoken.invariants.ownership import check_ownership
from vtoken.invariants.table_checks import check_block_accounting, check_unique_mapping
from vtoken.planner import ABORTED, APPLIED, COPYING, NullCopyEngine, PlannerConfig, ReclamationManager, reclaim_bound
from vtoken.spec import SpecTokenTable
from vtoken.spec.planner import best_reduction, plan_errors
from vtoken.table import TokenTable

from .hard_states import hard
from .step_draws import SwarmRules, pick, integer


def plan_as_data(plan) -> dict:
    return {"sources": [int(b) for b in plan.sources], "fills": [int(b) for b in getattr(plan, "fills", [])],
            "dests": [int(b) for b in plan.dests], "moves": [[int(x) for x in mv] for mv in plan.moves.tolist()]}


class _Flight:
    """The machine's own record of a launched plan (the plan object is mutated on apply)."""

    def __init__(self, plan):
        self.plan = plan
        self.rid = plan.req_id
        self.sources = [int(b) for b in plan.sources]
        self.dests = [int(b) for b in plan.dests]
        self.fills = [int(b) for b in getattr(plan, "fills", [])]  # the request's own blocks whose holes it writes
        self.moves = [[int(x) for x in mv] for mv in plan.moves.tolist()]


class RecordingEngine(NullCopyEngine):
    """``NullCopyEngine`` that remembers which copies it reported complete (I3: a plan may
    be applied only after its copy completed)."""

    def __init__(self, latency: int = 0):
        super().__init__(latency)
        # Keyed by id() but holding the handle itself: a handle kept alive keeps its id, so a
        # later handle can never reuse it (a bare id set made Hypothesis replays flaky).
        self.completed: dict[int, object] = {}

    def poll(self, handle) -> str:
        status = super().poll(handle)  # wait() polls too
        if status == "done":
            self.completed[id(handle)] = handle
        return status


class PlannerMachine(SwarmRules):
    """Stateful conformance test of the reclamation planner (see module docstring)."""

    ops = 0  # operations checked, summed over all runs in this process (campaign counter)
    FULL_EVERY = 8  # the whole table state and its checkers at least every 8th check, and at teardown

    @initialize(S=st.sampled_from([1, 2, 2, 4, 4]), nb=st.integers(6, 16), headroom=st.integers(0, 3),
                max_sources=st.integers(1, 4), latency=st.integers(0, 3), check_every=st.sampled_from([1, 1, 2]),
                in_place=st.booleans(), data=st.data())
    def setup(self, S, nb, headroom, max_sources, latency, check_every, in_place, data):
        self.S = S
        self.table = Touching(TokenTable(S, nb))  # the manager's calls are recorded too
        self.spec = SpecTokenTable(S, nb)
        self.alloc = BlockAllocator(nb)
        self.engine = RecordingEngine(latency=latency)
        # both compactions (in place: fills, the default; out of place: fresh headroom
        # destinations), so faults of either path are reachable
        self.cfg = PlannerConfig(theta_f=0.0, check_every=check_every, max_sources=max_sources,
                                 headroom=headroom, low_watermark=None, in_place=in_place)
        self.mgr = ReclamationManager(self.table, self.alloc, self.engine, self.cfg, on_applied=self._on_applied)
        # Every plan the manager makes, including inside step(), goes through the checks;
        # every launch is recorded before the copy is issued.
        self._plan_request = self.mgr.plan_request
        self._launch = self.mgr.launch
        self.mgr.plan_request = self._checked_plan_request
        self.mgr.launch = self._recorded_launch
        self.pos: dict[int, list[int]] = {}
        self.held: dict[int, list[int]] = {}  # the machine's model of what each request holds
        self.flying: dict[int, _Flight] = {}  # plan id -> record, until the plan is applied or aborted
        # blocks some plan wrote moved tokens into (fills): their bytes no longer match their
        # positions, so no prefix hit may land on them (vLLM drops their hash at launch) until
        # they are allocated afresh
        self.rewritten: set = set()
        self.next_id = 0
        self._checked = None  # what the last check saw (see consistent)
        self._checks = 0
        # the machine's own count of every launched plan and of how each ended (checked
        # against the manager's stats at the end of the example)
        self.launched = 0
        self.ended: Counter = Counter()
        note(f"S={S} num_blocks={nb} headroom={headroom} B={max_sources} latency={latency} K={check_every} "
             f"in_place={in_place}")
        # a few requests to start from, so most runs reach fragmentation and planning
        for _ in range(integer(data, 1, 2, "initial_requests")):
            self.add_request(integer(data, 2, 4, "nblocks"), data)

    # ------------------------------------------------------------------ helpers
    def rids(self):
        return sorted(self.pos)

    def _alloc(self, n):
        got = alloc_or_none(self.alloc, n)
        if got:
            self.rewritten.difference_update(got)  # fresh blocks: whatever was written there is gone
        return got

    def _give(self, rid, blocks):
        """``rid`` holds ``blocks`` (one reference each): in the manager and in the model."""
        self.mgr.hold(rid, blocks)
        self.held[rid] = self.held.get(rid, []) + list(blocks)

    def _sync(self, rid, total):
        PlannerMachine.ops += 1
        return sync_both(self.table, self.spec, rid, self.pos[rid], total)

    def _pick(self, data, prefer):
        """A request id; mostly among those ``prefer`` picks (when there are any),
        so the interesting states (reducible, copying) are reached often."""
        rids = self.rids()
        good = [r for r in rids if prefer(r)]
        if good and pick(data, [True, True, False], "prefer"):
            rids = good
        return pick(data, rids, "rid")

    def _reducible(self, rid):
        """Worth steering towards: the table's O(1) upper bound on what a plan could free is
        positive (a heuristic of where to look, never a check: every plan is still held to
        the contract's exact best)."""
        return reclaim_bound(self.table, rid, self._tail(rid)) > 0

    def _copying_plans(self):
        """Plans whose copy has not finished (``flying`` is reconciled only after a rule, and
        ``step()`` applies plans before it plans new ones)."""
        return [f for f in self.flying.values() if f.plan.state == COPYING]

    def _copying(self, rid):
        return any(f.rid == rid for f in self._copying_plans())

    def _tail(self, rid):
        n = len(self.spec.tokens[rid])
        return self.pos[rid][(n - 1) // self.S] if n else None

    def _view(self, rid) -> dict:
        blocks = sorted(self.spec.blocks[rid])
        return {
            "S": self.S, "num_blocks": self.table.num_blocks, "max_sources": self.cfg.max_sources,
            "tokens": [[t["block"], t["offset"], t["live"]] for t in self.spec.tokens[rid]],
            "blocks": blocks,
            "refs": {b: self.spec.refs(b) for b in blocks},
            "tail": self._tail(rid),
            "in_flight": sorted({b for f in self._copying_plans() for b in f.sources + f.dests + f.fills}),
            "headroom": list(self.mgr.headroom),
            "in_place": bool(getattr(self.cfg, "in_place", False)),
        }

    def _observable(self):
        return (self.table.export_state(), self.alloc.export_state(), list(self.mgr.headroom),
                sorted(self.mgr.in_flight))

    def _checked_plan_request(self, rid, max_dests=None):
        PlannerMachine.ops += 1
        view = self._view(rid)
        limit = len(view["headroom"]) if max_dests is None else min(max_dests, len(view["headroom"]))
        if self._copying(rid):
            hard("plan overlapping an in-flight one")
        if not view["headroom"]:
            hard("headroom exhausted")
        before = self._observable()
        plan = self._plan_request(rid, max_dests)
        assert self._observable() == before, "planning changed the table, the allocator or the headroom"
        best = best_reduction(view, limit)
        if best_reduction(view, 1 << 30) > best:
            event("plan shrunk or deferred by the headroom")
        if plan is None:
            assert best == 0, f"no plan, but a valid plan reduces by {best}: view={view} max_dests={limit}"
            return None
        data = plan_as_data(plan)
        errs = plan_errors(view, data)
        assert errs == [], f"plan breaks the contract: {errs}\n plan={data}\n view={view}"
        assert plan.reduction == best, f"plan reduces by {plan.reduction}, best is {best}: plan={data} view={view}"
        k = len(data["moves"])
        if k and k % self.S == 0:
            hard("block exactly full")  # the last destination is filled exactly
        if k > self.S:
            hard("token at a block boundary")  # the fill crosses into the next destination
        event(f"plan: {len(data['sources'])} sources -> {len(data['dests'])} dests")
        return plan

    def _recorded_launch(self, plan):
        # plans that ended inside this manager call (a step polls before it plans) give their
        # blocks back before this one takes any
        self._reconcile()
        f = self.flying[plan.id] = _Flight(plan)
        self.launched += 1
        self.rewritten.update(plan.fills)
        self._launch(plan)
        taken = f.sources + f.fills  # the plan holds them now
        left = list(self.held[f.rid])
        for b in taken:
            assert b in left, f"plan {plan.id} took block {b}, which request {f.rid} does not hold ({self.held[f.rid]})"
            left.remove(b)
        self.held[f.rid] = left
        self._reconcile()  # a copy refused at launch ends the plan at once

    def _on_applied(self, plan):
        """The scheduler's side of an applied plan, and the reference table kept in step."""
        f = self.flying[plan.id]
        rid = f.rid
        assert self.engine.completed.get(id(plan.handle)) is plan.handle, \
            f"plan {plan.id} applied before the engine reported its copy complete"
        live = set(self.spec.live_tokens(rid))
        moves = [mv for mv in f.moves if mv[0] in live]  # tokens evicted during the copy stay dead
        if len(moves) < len(f.moves):
            event("eviction during the copy")
        emptied = self.spec.apply_moves(rid, moves)
        self.spec.release_empty_blocks(rid, sorted(set(f.sources) - set(emptied)))
        used = [int(b) for b in plan.dests]
        assert set(used) <= set(f.dests), f"plan {plan.id} applied destinations {used} it was not given {f.dests}"
        into = {mv[3] for mv in moves} - set(f.fills)  # fills were the request's already
        assert set(used) == into, f"plan {plan.id}: destinations {used} but moves into {sorted(into)} (fills {f.fills})"
        src = set(f.sources)
        self.pos[rid] = [0 if b in src else b for b in self.pos[rid]]
        self.held[rid] = self.held[rid] + f.fills + used  # the sources were freed

    def _reconcile(self, drained: bool = False):
        """Forget plans that finished (applied or aborted), whoever polled them, counting
        how each ended. ``drained``: the manager just drained, so an aborted plan's
        destinations went back to the headroom and from there to the free queue."""
        for pid, f in list(self.flying.items()):
            if f.plan.state in (APPLIED, ABORTED):
                del self.flying[pid]
                orphan = getattr(f, "orphaned", False)  # the machine's own knowledge: its request left
                assert f.plan.orphaned == orphan, f"plan {pid}: orphaned {f.plan.orphaned}, but its request " \
                                                  f"{'left' if orphan else 'is still here'}"
                self.ended["applied" if f.plan.state == APPLIED else "orphaned" if orphan else "aborted"] += 1
                if f.plan.state == ABORTED and not orphan:  # the table kept: the request holds them again
                    self.held[f.rid] = self.held[f.rid] + f.sources + f.fills
                if f.plan.state == ABORTED:  # orphaned or not, unwritten destinations return to the headroom
                    # back in the headroom, unless a plan launched since (in flight, or applied at
                    # once under force_sync, not reconciled yet) took it again
                    taken = {b for g in self.flying.values() if g.plan is not f.plan for b in g.dests}
                    back = set(self.alloc.free_queue()) if drained else set(self.mgr.headroom)
                    for b in f.dests:
                        assert b in back or b in taken, \
                            f"aborted plan {pid}: destination {b} not back in the " \
                            f"{'free queue after the drain' if drained else 'headroom'}"

    # ------------------------------------------------------------------ rules: the workload
    # At most MAX_REQUESTS at once: the pool is small, and a few longer requests (several
    # private blocks besides the tail) are what compaction needs.
    MAX_REQUESTS = 3

    @precondition(lambda self: len(self.pos) < self.MAX_REQUESTS)
    @rule(nblocks=st.integers(1, 4), data=st.data())
    def add_request(self, nblocks, data):
        blocks = self._alloc(nblocks)
        if blocks is None:
            return
        rid = self.next_id
        self.next_id += 1
        self.pos[rid] = list(blocks)
        self._give(rid, blocks)
        cap = nblocks * self.S
        total = data.draw(st.one_of(st.just(cap), st.integers(max(0, cap - self.S), cap), st.integers(0, cap)),
                          label="total_len")
        err = self._sync(rid, total)
        assert err is None, err

    @precondition(lambda self: self.pos and len(self.pos) < self.MAX_REQUESTS)
    @rule(data=st.data())
    def add_shared_request(self, data):
        """A prefix-cache hit: share the parent's leading full blocks, then grow privately."""
        parent = pick(data, self.rids(), "parent")
        plen = len(self.spec.tokens[parent]) // self.S
        k = integer(data, 0, min(plen, 2), "shared_blocks")
        prefix = self.pos[parent][:k]
        if 0 in prefix:
            return  # a freed position: nothing to share
        if self.rewritten & set(prefix):
            # the scheduler's obligation: a fill, in flight or since, is never a prefix hit (its
            # holes hold other positions' tokens; vLLM drops its hash at launch), unlike a
            # source in flight, whose plan aborts
            event("prefix hit refused: a block a plan filled")
            return
        if {b for f in self._copying_plans() for b in f.sources} & set(prefix):
            event("hard: prefix hit on a block being compacted")  # its plan must abort on completion
        extra = self._alloc(integer(data, 0, 3, "private_blocks"))
        if extra is None:
            return
        self.alloc.incref(prefix)
        rid = self.next_id
        self.next_id += 1
        self.pos[rid] = prefix + extra
        self._give(rid, prefix + extra)
        # a prefix hit covers the shared blocks whole (only full blocks are cached)
        total = integer(data, k * self.S, (k + len(extra)) * self.S, "total_len")
        err = self._sync(rid, total)
        assert err is None, f"shared sync refused: {err}"
        if k:
            event("shared prefix")

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def grow(self, data):
        rid = self._pick(data, lambda r: len(self.spec.blocks[r]) >= 2)
        n = len(self.spec.tokens[rid])
        k = integer(data, 1, 2 * self.S, "new_tokens")
        need = -(-(n + k) // self.S) - len(self.pos[rid])
        if need > 0:
            blocks = self._alloc(need)
            if blocks is None:
                return
            self.pos[rid] += blocks
            self._give(rid, blocks)
        if n and n % self.S == 0:
            hard("token at a block boundary")  # the first new token opens a new block
        err = self._sync(rid, n + k)
        assert err is None, f"growth refused: {err}"

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def decode_step(self, data):
        """One decode step of every request, then the manager's step (what a scheduler does each
        step): each request grows by one token (a new block when its last one is full) and its
        policy may evict some of its older live tokens, copies in flight included; then
        ``mgr.step()``. Every operation is checked as it happens, the states once the step is done."""
        for rid in self.rids():
            n = len(self.spec.tokens[rid])
            if -(-(n + 1) // self.S) > len(self.pos[rid]):
                blocks = self._alloc(1)
                if blocks is None:
                    continue
                self.pos[rid] += blocks
                self._give(rid, blocks)
            err = self._sync(rid, n + 1)
            assert err is None, f"growth refused: {err}"
            ids = policy_victims(data, self.spec, rid)
            if ids:
                PlannerMachine.ops += 1
                _, _, err = both(lambda: self.table.evict_tokens(rid, ids), lambda: self.spec.evict_tokens(rid, ids))
                assert err is None, err
        self.step(False)

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def evict(self, data):
        rid = self._pick(data, lambda r: len(self.spec.blocks[r]) >= 3)
        live = self.spec.live_tokens(rid)
        if not live:
            return
        if data.draw(st.booleans(), label="scatter"):  # each live token dies with probability 1/2
            ids = [t for t, dies in zip(live, data.draw(st.lists(st.booleans(), min_size=len(live),
                                                                  max_size=len(live)), label="dies")) if dies]
            if not ids:
                return
        else:
            ids = some_of(data, live, 4, "victims")
        PlannerMachine.ops += 1
        _, _, err = both(lambda: self.table.evict_tokens(rid, ids), lambda: self.spec.evict_tokens(rid, ids))
        assert err is None, err

    def _moving_plans(self):
        return sorted((f for f in self._copying_plans() if f.rid in self.pos), key=lambda f: f.plan.id)

    @precondition(lambda self: self._moving_plans())
    @rule(data=st.data())
    def evict_moving(self, data):
        """A policy evicts tokens that an in-flight copy is moving."""
        f = pick(data, self._moving_plans(), "plan")
        moving = [mv[0] for mv in f.moves if self.spec.tokens[f.rid][mv[0]]["live"]]
        if not moving:
            return
        ids = some_of(data, moving, len(moving), "victims")
        PlannerMachine.ops += 1
        _, _, err = both(lambda: self.table.evict_tokens(f.rid, ids), lambda: self.spec.evict_tokens(f.rid, ids))
        assert err is None, err

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def fragment(self, data):
        """Heavy eviction that leaves the request's full blocks partly live (what a policy
        such as H2O does to old blocks): the states where plans need destinations."""
        rid = self._pick(data, lambda r: len(self.spec.blocks[r]) >= 3)
        by_block = {}
        for t, tok in enumerate(self.spec.tokens[rid]):
            if tok["live"]:
                by_block.setdefault(tok["block"], []).append(t)
        ids = []
        for b in sorted(by_block):
            toks = by_block[b]
            if len(toks) < self.S:
                continue  # already fragmented: leave it to the planner
            half = max(1, len(toks) // 2)  # mostly partly live; sometimes all dead
            keep = pick(data, [half, half, 1, 0], f"keep in {b}")
            ids += data.draw(st.permutations(toks), label=f"order in {b}")[keep:]
        if not ids:
            return
        victims = {rid: ids}
        if data.draw(st.booleans(), label="sharers too"):
            # the same policy evicts the same prefix positions in the requests sharing them,
            # so shared blocks get dead slots too (what a planner must still leave alone)
            mine = self.spec.blocks[rid]
            for other in self.rids():
                toks = self.spec.tokens[other]
                same = [t for t in ids if other != rid and t < len(toks) and toks[t]["live"]
                        and toks[t]["block"] in mine and self.spec.refs(toks[t]["block"]) > 1]
                if same:
                    victims[other] = same
                    event("shared slots evicted in every sharer")
        for r, vs in victims.items():
            PlannerMachine.ops += 1
            _, _, err = both(lambda: self.table.evict_tokens(r, vs), lambda: self.spec.evict_tokens(r, vs))
            assert err is None, err

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def finish(self, data):
        """The request finishes or is preempted, possibly while its copy is in flight."""
        rid = self._pick(data, self._copying)
        mine = [f for f in self.flying.values() if f.rid == rid and not getattr(f, "orphaned", False)]
        if mine:
            hard("finish while a copy is in flight")
        self._finish(rid, mine)
        del self.pos[rid], self.held[rid]

    def _finish(self, rid, mine):
        held = list(self.held[rid])
        PlannerMachine.ops += 1
        self.spec.free_request(rid)
        freed = self.mgr.finish_request(rid)
        for f in mine:  # the copy reads its sources and writes its fills: both freed at its end
            early = set(freed) & set(f.sources + f.fills)
            assert not early, f"finish freed {sorted(early)}, sources of plan {f.plan.id} still copying (or its fills)"
        assert sorted(freed) == sorted(held), f"finish of request {rid} freed {sorted(freed)}, it held {sorted(held)}"
        self.held[rid] = []
        for f in mine:
            f.orphaned = True

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def preempt_resume(self, data):
        """Preemption, then resume under the SAME request id: the table is reset and the
        request recomputed into fresh blocks, while the old incarnation's copy may still fly
        (and the new one may be preempted again before it lands)."""
        rid = self._pick(data, self._copying)
        mine = [f for f in self.flying.values() if f.rid == rid and f.plan.state == COPYING
                and not getattr(f, "orphaned", False)]
        if mine:
            hard("finish while a copy is in flight")
        if any(getattr(f, "orphaned", False) and f.rid == rid for f in self.flying.values()):
            event("hard: preempted again while an earlier incarnation's copy flies")
        n = len(self.spec.tokens[rid])
        self._finish(rid, mine)
        for f in mine:
            f.orphaned = True
        self.pos[rid], self.held[rid] = [], []
        need = -(-n // self.S)
        blocks = self._alloc(need) if need else []
        if blocks is None:  # no room to resume now: the request stays out
            del self.pos[rid], self.held[rid]
            return
        self.pos[rid] = list(blocks)
        self._give(rid, blocks)
        err = self._sync(rid, n)
        assert err is None, f"resume refused: {err}"

    # ------------------------------------------------------------------ rules: the planner
    @precondition(lambda self: self.pos)
    @rule(data=st.data(), launch=st.sampled_from([True, True, True, False]), limit=st.booleans())
    def plan(self, data, launch, limit):
        rid = self._pick(data, self._reducible)
        md = integer(data, 0, len(self.mgr.headroom) + 1, "max_dests") if limit else None
        plan = self.mgr.plan_request(rid, md)
        if plan is not None and launch:
            self.mgr.launch(plan)
        # else: a plan that is not launched is dropped; planning changed nothing

    @precondition(lambda self: self.flying)
    @rule()
    def poll(self):
        PlannerMachine.ops += 1
        self.mgr.poll()
        self._reconcile()

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def fail_copy(self, data):
        """A copy fails part-way: the plan aborts and nothing else changes."""
        rid = self._pick(data, self._reducible)
        before = self.table.export_state(), self.alloc.export_state(), sorted(self.mgr.headroom)
        plan = self.mgr.plan_request(rid)
        if plan is None:
            return
        hard("copy failing part-way")
        self.engine.fail_next = True
        self.mgr.launch(plan)
        PlannerMachine.ops += 1
        done = self.mgr.poll()
        assert plan in done and plan.state == ABORTED, f"failed copy ended {plan.state}"
        self._reconcile()
        if done == [plan]:
            after = self.table.export_state(), self.alloc.export_state(), sorted(self.mgr.headroom)
            assert after == before, f"an aborted plan changed state:\n before={before}\n after={after}"

    @precondition(lambda self: self.flying)
    @rule()
    def drain(self):
        """The end of a batch with requests still running (the manager stays usable: the
        next step refills the headroom): every plan in flight ends, the headroom is given back."""
        self._drain()

    def _drain(self):
        PlannerMachine.ops += 1
        ended = self.mgr.drain()
        ids = {p.id for p in ended}
        self._reconcile(drained=True)
        assert not self.flying, f"after drain, plans {sorted(self.flying)} still in flight (drain ended {sorted(ids)})"
        assert not self.mgr.in_flight, f"after drain, the manager has plans {sorted(self.mgr.in_flight)} in flight"
        assert not self.mgr.headroom and self.alloc.num_reserved == 0, \
            f"after drain, headroom {self.mgr.headroom} and reserved {self.alloc.export_state()['reserved']} " \
            f"not given back"

    @rule(force_sync=st.sampled_from([False, False, False, True]))
    def step(self, force_sync):
        PlannerMachine.ops += 1
        self.mgr.step(force_sync=force_sync)
        self._reconcile()
        ran = self.mgr.steps % self.cfg.check_every == 0 and self.spec.waste_ratio() > self.cfg.theta_f
        if force_sync or not ran:
            return
        left = len(self.mgr.headroom)
        busy = {f.rid for f in self.flying.values() if not getattr(f, "orphaned", False)}
        for rid in self.rids():
            if rid in busy:
                continue
            best = best_reduction(self._view(rid), left)
            assert best == 0, f"the planning round left request {rid} reducible by {best} (headroom {left})"

    # ------------------------------------------------------------------ the end of an example
    def teardown(self):
        """The end of a batch: every request finishes, the manager drains, nothing is left.

        Then nothing is in flight or deferred, the headroom is given back, every block but
        the null block is free (the machine holds nothing any more), the tables are empty,
        and every launched plan ended once: the manager's ``stats`` agree with the machine's
        own count (``plans == applied + aborted + orphaned``). Skipped when the example has
        already failed: Hypothesis calls teardown in a ``finally``, and the exception in
        flight is the one to report, not what it left behind.
        """
        if sys.exc_info()[1] is not None or not hasattr(self, "mgr"):  # a failure propagating, or no setup
            return
        self._reconcile()
        for rid in self.rids():
            mine = [f for f in self.flying.values() if f.rid == rid and not getattr(f, "orphaned", False)]
            self._finish(rid, mine)
            del self.pos[rid], self.held[rid]
        self._drain()
        self.consistent(full=True)
        a = self.alloc
        free = set(a.free_queue())
        left = {b: ("reserved" if a.state[b] == RESERVED else f"{int(a.ref[b])} reference(s)")
                for b in range(a.num_blocks) if b != NULL_BLOCK and b not in free}
        assert not left, f"after every request finished and the drain, blocks are not free: {left}"
        assert not self.table.export_state()["requests"], "after every request finished, the table has requests"
        st_ = self.mgr.stats
        ends = {k: st_[k] for k in ("applied", "aborted", "orphaned")}
        assert st_["plans"] == self.launched == sum(ends.values()) and ends == {k: self.ended[k] for k in ends}, \
            f"plans launched {self.launched} (stats {st_['plans']}) != ended {dict(self.ended)} (stats {ends})"
        if self.ended["orphaned"]:
            event("end of example: orphaned plans ended")

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self, full: bool = False):
        """The table against the spec, and the planner's ownership of every block. Costs what
        changed: with no table call, no allocator change and the same headroom, plans and
        flights since the last check the state is the one checked then; otherwise the
        requests the calls named (``Touching``: the machine's and the manager's calls) and
        every block are compared, and the whole state with its checkers every
        ``FULL_EVERY`` checks, after an unnamed call and at teardown. The ownership and
        headroom checks (O(blocks + plans)) run at every check."""
        if not hasattr(self, "mgr"):
            return
        a = self.alloc.export_state()
        seen = (self.table.calls, a, list(self.mgr.headroom), sorted(self.mgr.in_flight), sorted(self.flying))
        if seen == self._checked and not full:
            return
        self._checked = seen
        self._checks += 1
        rids, unnamed = self.table.take()
        full = full or unnamed or self._checks % self.FULL_EVERY == 0
        if full:
            si = self.table.export_state()
            ss = self.spec.export_state()
            assert si == ss, f"state differs:\n impl={si}\n spec={ss}"
            blocks = si["blocks"]
        else:
            blocks = compare_parts(self.table, self.spec, rids)[1]
        head = list(self.mgr.headroom)
        fly_src = {b for f in self.flying.values() for b in f.sources + f.fills}  # the request's blocks under a copy
        fly_dst = {b for f in self.flying.values() for b in f.dests}
        for f in self.flying.values():
            for b in f.sources + f.fills:
                assert self.alloc.state[b] == USED and self.alloc.ref[b] >= 1, \
                    f"source or fill {b} of in-flight plan {f.plan.id} was freed before its copy completed"
            for b in f.dests:
                assert self.alloc.state[b] == RESERVED and b not in head, \
                    f"destination {b} of in-flight plan {f.plan.id} is not reserved for it"
        assert len(set(head)) == len(head), f"headroom names a block twice: {head}"
        owned = {b for bl in self.held.values() for b in bl}
        for b in head:
            assert self.alloc.state[b] == RESERVED, f"headroom block {b} is not reserved"
            assert b not in owned and b not in blocks, f"headroom block {b} is also owned"
        assert set(a["reserved"]) == set(head) | fly_dst, \
            f"reserved {a['reserved']} != headroom {head} + in-flight destinations {sorted(fly_dst)}"
        owners = {f"request {r}": bl for r, bl in self.held.items()}
        owners["headroom"] = head
        for f in self.flying.values():
            owners[f"plan {f.plan.id} sources and fills"] = f.sources + f.fills
            owners[f"plan {f.plan.id} destinations"] = f.dests
        check_ownership(self.table.num_blocks, a["free_queue"], a["ref"], owners, reserved=a["reserved"],
                        reserving=["headroom"] + [f"plan {f.plan.id} destinations" for f in self.flying.values()])
        assert not fly_src & set(a["free_queue"])
        for rid in self.rids():
            n = self.table.length(rid)
            if n:
                assert int(self.table.slots(rid)[n - 1]) // self.S == self.pos[rid][(n - 1) // self.S], \
                    f"request {rid}: its last position moved out of the tail block"
        if full:
            check_unique_mapping(si)
            check_block_accounting(si, a)
        if self.alloc.num_free == 0:
            hard("allocator exhausted")


TestPlannerMachine = PlannerMachine.TestCase
