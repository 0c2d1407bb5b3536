"""Exhaustive small-scope checking of the real planner against the Z3 invariant checks.

What this cannot see: states beyond its bound (``max_S``, ``max_requests``, ``max_blocks``);
real copies and their timing (``NullCopyEngine``: a copy is done at the next poll, so an
early read or free of a real engine is ``i3_probe``'s and the fuzzers'); the vLLM adapter's
paths; and whatever the Z3 snapshot checker cannot see (its "What this cannot see").

Every state up to a bound is built with the real ``TokenTable``, ``BlockAllocator`` and
``ReclamationManager`` (``record_snapshots=True``, ``NullCopyEngine``): a block size
``S <= max_S``, up to ``max_requests`` requests holding up to ``max_blocks`` blocks in all,
every length and every liveness pattern, and -- for the requests after the first -- with
or without a shared prefix (the first block of request 0, when it is full). For each state
the planner plans and launches (the copies stay in flight for one poll), plans again while
they are in flight, completes and applies them, then plans and applies a third round on
the compacted state. Each plan's snapshot is checked with :func:`check_snapshot` right
after launch (``post`` null, with an attention read through the table's slot mapping
recorded while the copy is in flight) and again after apply (``post`` filled, with a read
after apply); a plan the lifecycle refuses at launch is checked too. The table and allocator
are also checked with the plain-Python checkers (``table_checks``) while the copies are in
flight (after each planning round) and after each apply. A snapshot identical to one
already checked in the run (the same pickle) takes that one's verdict: most states differ
only where no plan looks, so their snapshots repeat.

Symmetry reductions (each obviously sound):

1. Block ids are never enumerated: blocks are handed out by the allocator in its canonical
   order. The checks are invariant under renaming blocks, so other labelings add nothing.
2. Requests after the first are enumerated as a multiset (their specs in non-decreasing
   order). The headroom is sized so a round never runs short (a round needs fewer
   destinations than it has sources, at most ``max_blocks``); then planning one request
   never depends on another except through the block ids it receives, i.e. a relabeling
   (1). Request 0 is kept apart because it owns the shared prefix.
3. A request's block count is determined by its length (``ceil(L / S)`` blocks, the tail
   partially filled or full): lengths, not block lists, are enumerated.

Nothing else is reduced: every liveness pattern of every token is enumerated.

Results: :func:`check_state` returns ``(snapshots checked, findings as text)`` and
:func:`run_small_scope` a dict (its JSON); each also has a ``violations`` view, what was
found as :class:`~vtoken.invariants.violation.Violation` (the checkers' own, with
``model["where"]`` the step; the real code raising on a state is invariant ``small_scope``,
rule ``raised``).

Owns: nothing beyond each enumerated state's table, allocator and manager.
May call: vtoken.table, .allocator, .planner, .errors, invariants.z3_checks, invariants.table_checks,
invariants.violation; vtoken.argtypes (the command line's argument checks).
Costs: every state up to the bound (exponential in it: all liveness patterns), a Z3 check per
snapshot.
"""

from __future__ import annotations

import itertools
import pickle
import time
from typing import Callable, Iterator

from vtoken.allocator import BlockAllocator
from vtoken.errors import PlanError
from vtoken.planner import NullCopyEngine, PlannerConfig, ReclamationManager
from vtoken.table import TokenTable

from .table_checks import InvariantViolation, check_block_accounting, check_unique_mapping
from .violation import Found, Violation
from .z3_checks import check_snapshot

DEFAULT_BOUND = dict(max_S=2, max_blocks=3, max_requests=3)  # 14982 states, ~7 s of CPU


def _request_specs(S: int, max_blocks: int, can_share: bool) -> Iterator[tuple]:
    """(length, live bits, shares_prefix) for one request using at most ``max_blocks`` new blocks."""
    for L in range(1, (max_blocks + (1 if can_share else 0)) * S + 1):
        nb = -(-L // S)
        for share in ((False, True) if can_share else (False,)):
            new_blocks = nb - 1 if share else nb
            if new_blocks > max_blocks or (share and nb < 1):
                continue
            for bits in itertools.product((False, True), repeat=L):
                yield (L, bits, share)


def _new_blocks(S: int, spec) -> int:
    L, _bits, share = spec
    return -(-L // S) - (1 if share else 0)


def enumerate_states(max_S: int, max_blocks: int, max_requests: int) -> Iterator[tuple]:
    """Every ``(S, [spec, ...])`` within the bound, after the symmetry reductions."""
    for S in range(1, max_S + 1):
        for R in range(1, max_requests + 1):
            for first in _request_specs(S, max_blocks, can_share=False):
                left = max_blocks - _new_blocks(S, first)
                full_prefix = first[0] >= S
                yield from _rest(S, [first], R - 1, left, full_prefix, None)


def _rest(S, specs, k, left, full_prefix, prev) -> Iterator[tuple]:
    if k == 0:
        yield (S, list(specs))
        return
    for spec in _request_specs(S, left + (1 if full_prefix else 0), can_share=full_prefix):
        nbn = _new_blocks(S, spec)
        if nbn > left or nbn < 0:
            continue
        if prev is not None and spec < prev:  # multiset: non-decreasing specs
            continue
        specs.append(spec)
        yield from _rest(S, specs, k - 1, left - nbn, full_prefix, spec)
        specs.pop()


def build_state(S: int, specs: list, max_blocks: int, in_place: bool = True):
    """The real table, allocator and manager for one enumerated state, and each request's
    positional block list (the scheduler's view). ``in_place``: the planner's compaction
    (``PlannerConfig.in_place``: into the request's own holes, or out of place into the
    headroom)."""
    headroom = max_blocks + 1
    nblocks = 1 + max_blocks + headroom + len(specs) + 1  # + room for each request to grow a block
    table, alloc = TokenTable(S, nblocks), BlockAllocator(nblocks)
    positions = {}
    prefix = None
    for r, (L, bits, share) in enumerate(specs):
        nb = -(-L // S)
        if share:
            alloc.incref([prefix])
            blocks = [prefix] + alloc.allocate(nb - 1)
        else:
            blocks = alloc.allocate(nb)
        if r == 0:
            prefix = blocks[0]
        table.sync_new_tokens(r, blocks, L)
        positions[r] = list(blocks)
        dead = [i for i, b in enumerate(bits) if not b]
        if dead:
            table.evict_tokens(r, dead)
    cfg = PlannerConfig(theta_f=-1.0, headroom=headroom, record_snapshots=True, in_place=in_place)
    mgr = ReclamationManager(table, alloc, engine=NullCopyEngine(0), config=cfg)
    for r, blocks in positions.items():  # the manager holds each request's references (a sharer's prefix too)
        mgr.hold(r, blocks)
    return table, alloc, mgr, positions


def _churn(mgr, positions, plans) -> None:
    """While the copies are in flight: a policy evicts the last token each plan moves, and
    each request with a plan in flight grows by one token (into its tail block, or a new one,
    handed to the manager to hold)."""
    table, alloc = mgr.table, mgr.alloc
    for p in plans:
        rid = p.req_id
        if len(p.moves):
            table.evict_tokens(rid, [int(p.moves[-1][0])])
        n = table.length(rid)
        pos = positions[rid]
        grown = alloc.allocate(1) if n // table.S >= len(pos) else []
        pos += grown
        table.sync_new_tokens(rid, pos, n + 1)
        mgr.hold(rid, grown)


def _read(mgr, plan) -> None:
    """Record an attention read of the plan's request through the table's slot mapping."""
    t = mgr.table
    rid = plan.req_id
    if rid in t:
        mgr.record(plan, "read", request=str(rid), tokens=[int(x) for x in t.live_tokens(rid)],
                   slots=[int(x) for x in t.slot_mapping(rid).tolist()])


class StateResult(tuple):
    """:func:`check_state`'s ``(snapshots checked, findings as text)`` (unpacks as before), with
    ``violations``: the findings as :class:`Violation`."""

    def __new__(cls, checked: int, violations: list[Violation]):
        self = super().__new__(cls, (checked, [_line(v) for v in violations]))
        self.violations = list(violations)
        return self

    def __getnewargs__(self):  # pickle and copy build it from its two parts, as above
        return self[0], self.violations


def _at(v: Violation, where: str) -> Violation:
    """``v`` found at ``where`` (a plan and its round, ``table``, a step of the run)."""
    return Violation(v.invariant, v.explanation, {**v.model, "where": where}, v.rule)


def _raised(e: Exception, where: str) -> Violation:
    """The real code raised on a state the enumerator thinks valid."""
    return Violation("small_scope", f"{type(e).__name__}: {e}", {"where": where}, "raised")


def _line(v: Violation) -> str:
    return f"{v.model['where']}: {v.explanation if v.rule == 'raised' else v}"


def check_state(S: int, specs: list, max_blocks: int, churn: bool = False,
                in_place: bool = True, memo: dict | None = None) -> StateResult:
    """Plan, launch, apply; check every snapshot. Returns (snapshots checked, violations)
    (:class:`StateResult`: the violations as text, and as ``.violations``). ``memo``: the
    verdicts so far, by snapshot pickle (the caller's, across states): an identical snapshot
    takes its verdict, still counted as checked (at bound (2, 3, 2), 628 distinct of 3712).

    Round 1 plans and launches (the copy engine needs one poll to finish, so the plans are
    in flight); a second planning pass runs while they are (it should plan nothing on those
    requests); with ``churn``, tokens are evicted and added meanwhile (:func:`_churn`);
    then the copies complete and are applied; round 3 plans again on the compacted state
    and applies at once.
    """
    found: list[Violation] = []
    checked = 0

    def verdict(snap) -> list[Violation]:  # the same types, keys and values: the same verdict
        if memo is None:
            return check_snapshot(snap)
        key = pickle.dumps(snap, protocol=pickle.HIGHEST_PROTOCOL)
        return list(memo[key] if key in memo else memo.setdefault(key, tuple(check_snapshot(snap))))
    try:
        table, alloc, mgr, positions = build_state(S, specs, max_blocks, in_place)
    except Exception as e:  # the table/allocator refused a state the enumerator thinks valid
        return StateResult(0, [_raised(e, "build")])
    mgr.engine.latency = 1
    everything = []
    launch = mgr.launch

    def checked_launch(p):  # a plan the lifecycle refuses never flies: its snapshot is checked here
        nonlocal checked
        try:
            launch(p)
        except PlanError:
            checked += 1
            found.extend(_at(v, f"plan {p.id} (refused at launch)") for v in verdict(p.snapshot))
            raise

    mgr.launch = checked_launch  # plan_round launches through it

    def plan(tag):
        nonlocal checked
        launched = mgr.plan_round()
        for p in launched:
            _read(mgr, p)
            checked += 1
            found.extend(_at(v, f"plan {p.id} ({tag}, in flight)") for v in verdict(p.snapshot))
        everything.extend(launched)
        # while the copies fly: every block the table references is still allocated (no early free)
        check_block_accounting(table.export_state(), alloc.export_state())
        return launched

    def complete(plans, tag):
        nonlocal checked
        mgr.poll(force_sync=True)
        for p in plans:
            if p.snapshot is not None and p.snapshot.get("post") is not None:
                _read(mgr, p)
                checked += 1
                found.extend(_at(v, f"plan {p.id} ({tag}, applied)") for v in verdict(p.snapshot))
        st = table.export_state()
        check_unique_mapping(st)
        check_block_accounting(st, alloc.export_state())
        mgr.refill_headroom()

    _rounds(mgr, positions, churn, plan, complete, found)
    return StateResult(checked, found)


def _rounds(mgr, positions, churn: bool, plan: Callable, complete: Callable, found: list) -> None:
    """The three rounds of :func:`check_state` (``plan(tag)`` and ``complete(plans, tag)`` its
    closures); what the real code raises is recorded in ``found`` with the step it was in."""
    step = "plan_round"
    try:
        first = plan("round 1")
        if first:
            if churn:
                step = "eviction and growth while in flight"
                _churn(mgr, positions, first)
            step = "plan_round while in flight"
            second = plan("round 2")
            step = "apply"
            complete(first + second, "rounds 1-2")
            mgr.engine.latency = 0
            step = "plan_round"
            third = plan("round 3")
            if third:
                step = "apply"
                complete(third, "round 3")
    except InvariantViolation as e:
        found.append(_at(e.violations[0], "table"))
    except Exception as e:  # the real code raised: the state or the plan was bad
        found.append(_raised(e, step))


def run_small_scope(max_S: int = DEFAULT_BOUND["max_S"], max_blocks: int = DEFAULT_BOUND["max_blocks"],
                    max_requests: int = DEFAULT_BOUND["max_requests"], time_budget_s: float = 60.0,
                    churn: bool = True, modes=(True, False), workers: int = 1) -> dict:
    """Check every state within the bound (or as many as ``time_budget_s`` allows).

    Every state is run once per compaction mode in ``modes`` (``in_place`` True: the
    default, into the request's own holes; False: out of place, into the headroom). With
    ``churn`` every run that makes a plan is repeated with evictions and growth while its
    copies are in flight (``plans`` counts the snapshots of all runs).

    ``workers`` > 1 splits the states over that many processes (state ``i`` to process
    ``i % workers``; each keeps the budget); the result is the same as with one, but for
    ``seconds`` (the wall clock of the whole run).

    Returns ``states`` (states built), ``plans`` (snapshots checked), ``violations`` (count),
    ``examples`` (the first few in enumeration order, as text), ``seconds`` and
    ``bound_reached`` (True when every state within the bound was checked): a
    :class:`~vtoken.invariants.violation.Found` dict, whose ``.violations`` attribute (not
    the count under the key) lists every finding as a :class:`Violation`, in enumeration order.
    """
    if int(workers) < 1:
        raise ValueError(f"workers={workers!r}: must be >= 1")
    args = (max_S, max_blocks, max_requests, time_budget_s, churn, tuple(modes))
    t0 = time.perf_counter()
    if workers == 1:
        parts = [_run_part(*args, 0, 1)]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn: a fork of a process that has run torch's thread pool can hang
        with ProcessPoolExecutor(int(workers), mp_context=multiprocessing.get_context("spawn")) as ex:
            parts = list(ex.map(_run_part, *zip(*[args + (k, int(workers)) for k in range(int(workers))])))
    pairs = sorted(((f, v) for part in parts for f, v in zip(part["found"], part["found_v"])), key=lambda x: x[0])
    found = [f for f, _v in pairs]
    return Found({"states": sum(p["states"] for p in parts), "plans": sum(p["plans"] for p in parts),
                  "violations": len(found), "examples": [f for _i, f in found[:10]],
                  "seconds": time.perf_counter() - t0, "bound_reached": all(p["reached"] for p in parts),
                  "bound": {"max_S": max_S, "max_blocks": max_blocks, "max_requests": max_requests}},
                 [v for _f, v in pairs])


def _run_part(max_S, max_blocks, max_requests, time_budget_s, churn, modes, part: int, parts: int) -> dict:
    """The states ``i`` with ``i % parts == part`` (see :func:`run_small_scope`)."""
    t0 = time.perf_counter()
    states = plans = 0
    violations: list[tuple[int, str]] = []
    found_v: list[Violation] = []  # the same findings as Violations, in the same order
    reached = True
    memo: dict = {}  # snapshot -> its verdict (check_state), for this part's states
    for i, (S, specs) in enumerate(enumerate_states(max_S, max_blocks, max_requests)):
        if i % parts != part:
            continue
        if time.perf_counter() - t0 > time_budget_s:
            reached = False
            break
        states += 1
        n, found = 0, []
        for in_place in modes:
            tag = "in place" if in_place else "out of place"
            r1 = check_state(S, specs, max_blocks, in_place=in_place, memo=memo)
            n, found = n + r1[0], found + [(f"({tag}) {f}", v, tag) for f, v in zip(r1[1], r1.violations)]
            if churn and r1[0]:
                r2 = check_state(S, specs, max_blocks, churn=True, in_place=in_place, memo=memo)
                n, found = n + r2[0], found + [(f"({tag}, churn) {f}", v, f"{tag}, churn")
                                               for f, v in zip(r2[1], r2.violations)]
        plans += n
        for f, v, mode in found:
            where = [(L, ''.join('1' if b else '0' for b in bits), sh) for L, bits, sh in specs]
            violations.append((i, f"S={S} specs={where}: {f}"))
            found_v.append(Violation(v.invariant, v.explanation, {**v.model, "state": f"S={S} specs={where}",
                                                                  "mode": mode}, v.rule))
    return {"states": states, "plans": plans, "found": violations, "found_v": found_v, "reached": reached}


def count_states(max_S: int, max_blocks: int, max_requests: int) -> int:
    return sum(1 for _ in enumerate_states(max_S, max_blocks, max_requests))


def main(argv=None) -> int:
    """``python -m vtoken.invariants.small_scope [max_S [max_blocks [max_requests [budget_s]]]]``:
    prints :func:`run_small_scope`'s result as JSON. A bound that is not an integer >= 1, or a
    budget that is not a number > 0, is refused in argparse's one line (exit 2) before any
    state is built."""
    import argparse
    import json

    from vtoken.argtypes import positive_float, positive_int

    ap = argparse.ArgumentParser(prog="python -m vtoken.invariants.small_scope", description=__doc__.split("\n")[0])
    for name in ("max_S", "max_blocks", "max_requests"):
        ap.add_argument(name, nargs="?", type=positive_int, default=DEFAULT_BOUND[name],
                        help=f"default {DEFAULT_BOUND[name]}")
    ap.add_argument("budget_s", nargs="?", type=positive_float, default=60.0, help="seconds (default 60)")
    a = ap.parse_args(argv)
    print(json.dumps(run_small_scope(a.max_S, a.max_blocks, a.max_requests, a.budget_s), indent=1))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
