"""Exhaustive small-scope checking of the real planner (``vtoken.invariants.small_scope``)."""

import contextlib
import itertools

import pytest

from vtoken.fuzz.planted import planted
from vtoken.invariants.small_scope import (
    DEFAULT_BOUND,
    build_state,
    check_state,
    count_states,
    enumerate_states,
    run_small_scope,
)

pytestmark = pytest.mark.invariants


def test_default_bound_is_exhaustive_and_clean():
    # ~7 s of CPU per process; the wall-clock budget is generous because the machine may be shared
    r = run_small_scope(**DEFAULT_BOUND, time_budget_s=300, workers=2)
    assert r["bound_reached"], r
    assert r["states"] == count_states(**DEFAULT_BOUND)
    assert r["violations"] == 0, r["examples"]
    assert r["plans"] > 3000  # the bound is big enough to make (and check) many plans


def test_workers_split_the_states_and_give_the_same_result():
    one = run_small_scope(2, 2, 2, time_budget_s=300)
    two = run_small_scope(2, 2, 2, time_budget_s=300, workers=2)
    assert one["bound_reached"] and two["bound_reached"]
    assert (two["states"], two["plans"], two["violations"]) == (one["states"], one["plans"], one["violations"])
    assert one["states"] == count_states(2, 2, 2)
    with pytest.raises(ValueError, match="workers"):
        run_small_scope(2, 2, 2, workers=0)


def test_enumeration_covers_lengths_patterns_and_sharing():
    states = list(enumerate_states(2, 2, 2))
    assert len(states) == count_states(2, 2, 2)
    one = [specs for S, specs in states if S == 2 and len(specs) == 1]
    # one request, S=2, up to 2 blocks: lengths 1..4, every pattern: 2 + 4 + 8 + 16
    assert len(one) == 30
    assert any(spec[2] for S, specs in states for spec in specs[1:])  # shared prefixes occur
    # multiset symmetry: requests after the first come in non-decreasing order
    assert all(specs[1:] == sorted(specs[1:]) for _S, specs in states)


def test_churn_evicts_and_grows_while_a_copy_is_in_flight():
    spec = [(6, (False, True, False, True, True, True), False)]  # S=2: blocks 1 live, 1 live, tail
    n, found = check_state(2, spec, 3, churn=True)
    assert found == [] and n >= 2
    table, alloc, mgr, positions = build_state(2, spec, 3, in_place=False)
    mgr.engine.latency = 1
    (p,) = mgr.plan_round()
    assert p.moves[:, 0].tolist() == [1, 3]  # out of place: both one-live blocks into one fresh block
    n, found = check_state(2, spec, 3, churn=True, in_place=False)
    assert found == [] and n >= 2
    table, alloc, mgr, positions = build_state(2, spec, 3)
    (p,) = mgr.plan_round()
    # in place: the first one-live block's token goes into the hole of the second
    assert p.sources == [positions[0][0]] and p.fills == [positions[0][1]] and p.moves[:, 0].tolist() == [1]


@pytest.mark.parametrize("fault,bound", [(None, (2, 2, 2)), ("plan_dup_dst", (2, 3, 1)),
                                         ("plan_moves_tail", (2, 2, 2))])
def test_a_repeated_snapshot_keeps_the_verdict_of_its_own_check(fault, bound):
    """The run checks a snapshot identical to one it checked before by that one's verdict:
    every state gives the same findings, word for word, as when each snapshot is checked
    afresh (with planted planner faults: the findings repeat where the snapshots do)."""
    memo: dict = {}
    checked = found = 0
    with planted(fault) if fault else contextlib.nullcontext():
        for S, specs in enumerate_states(*bound):
            for in_place, churn in itertools.product((True, False), (False, True)):
                fresh = check_state(S, specs, bound[1], churn=churn, in_place=in_place)
                again = check_state(S, specs, bound[1], churn=churn, in_place=in_place, memo=memo)
                assert (fresh[0], fresh[1]) == (again[0], again[1]), (S, specs)
                checked, found = checked + fresh[0], found + len(fresh[1])
    assert len(memo) < checked / 2  # snapshots did repeat
    assert (found > 0) == (fault is not None)


@pytest.mark.parametrize("fault,bound,words", [
    ("plan_moves_shared", (2, 2, 2), "I4: plan 1 moves shared-prefix block"),
    ("plan_moves_tail", (2, 2, 2), "moves the tail block"),
    ("plan_nondecreasing", (2, 2, 2), "does not reduce the block count"),
    ("plan_dup_dst", (2, 3, 1), "share destination slot"),
    # the catalogue's patch frees the sources to the pool at launch without a snapshot event:
    # the in-flight accounting check finds it (a source the table reads is free)
    ("free_sources_at_plan", (2, 2, 2), "is referenced by the table but free in the allocator"),
    ("plan_overlaps_inflight", (2, 2, 2), "overlaps in-flight plan"),
])
def test_planted_planner_faults_are_found(fault, bound, words):
    with planted(fault):
        r = run_small_scope(*bound, time_budget_s=60)
    assert r["violations"] > 0
    assert any(words in e for e in r["examples"]), r["examples"]


@pytest.mark.slow
@pytest.mark.parametrize("bound", [(2, 4, 2), (3, 3, 2)])
def test_larger_bounds(bound):
    r = run_small_scope(*bound, time_budget_s=900, workers=2)
    assert r["bound_reached"] and r["violations"] == 0, r
