"""Gaps in the snapshot checkers found from outside: violations both checkers accepted (and
one valid schedule both rejected). Each test feeds both checkers (plain Python and Z3) the
violating snapshot and asserts each rejects it with the right invariant and rule, and that
the valid variant next to it is accepted.

Every snapshot starts from ``synthetic_snapshot(8, S=4)`` (out of place: sources 1-4,
destinations 6 and 7, tail 5) or its in-place form (sources 1-4, fills 5-8 whose offsets 2
and 3 are holes, tail 9 holding tokens 32 and 33, so the next token goes to (9, 2)); both
pass clean (asserted)."""

from __future__ import annotations

import pytest

from vtoken.invariants import snapshot_checks, z3_checks
from vtoken.invariants.z3_checks import synthetic_snapshot

pytestmark = pytest.mark.invariants

CHECKERS = {"python": snapshot_checks.check_snapshot, "z3": z3_checks.check_snapshot}
S = 4


def base(in_place: bool = False) -> dict:
    snap = synthetic_snapshot(8, S=S, in_place=in_place)
    assert verdict(snap) == set()
    return snap


def verdict(snap) -> set:
    """The violated invariants; both checkers must name the same ones, and every rule Z3
    names Python names too."""
    res = {name: check(snap) for name, check in CHECKERS.items()}
    inv = {name: {v.invariant for v in vs} for name, vs in res.items()}
    assert inv["python"] == inv["z3"], {name: [str(v) for v in vs] for name, vs in res.items()}
    assert {(v.invariant, v.rule) for v in res["z3"]} <= {(v.invariant, v.rule) for v in res["python"]}
    return inv["python"]


def rejected_by(snap, invariant: str, rule: str, words: str = "") -> None:
    """Both checkers report ``rule`` of ``invariant`` (with ``words`` in its explanation)."""
    assert invariant in verdict(snap)
    for name, check in CHECKERS.items():
        vs = [v for v in check(snap) if (v.invariant, v.rule) == (invariant, rule)]
        assert vs, (name, [str(v) for v in check(snap)])
        assert any(words in v.explanation for v in vs), (name, [str(v) for v in vs])


def R(snap):
    return snap["pre"]["requests"]["r0"]


def P(snap):
    return snap["post"]["requests"]["r0"]


def read_event(snap, index: int) -> dict:
    return snap["schedule"][index]


# ------------------------------------------------------------------ the tail, derived from the tokens
def _fill_the_next_slot(tail_block) -> dict:
    """The in-place plan also fills its tail 9 at (9, 2), where the next token will be
    written (move #7 retargeted there); ``tail_block`` recorded as given."""
    snap = base(in_place=True)
    R(snap)["tail_block"] = tail_block
    plan = snap["plan"]
    plan["fills"] = plan["fills"] + [9]
    t = plan["moves"][7][0]
    plan["moves"][7][3:] = [9, 2]
    P(snap)["tokens"][t] = [9, 2, True]
    last = read_event(snap, -1)
    last["slots"][last["tokens"].index(t)] = 9 * S + 2
    return snap


def test_tail_is_derived_from_the_tokens_when_tail_block_is_null():
    snap = base(in_place=True)
    R(snap)["tail_block"] = None  # not recorded: derivable (token 33, the last position, is in block 9)
    assert verdict(snap) == set()
    rejected_by(_fill_the_next_slot(None), "I4", "blocks", "fills the tail block 9")


def test_tail_block_naming_a_block_of_no_request_is_flagged_and_the_real_tail_kept():
    snap = _fill_the_next_slot(999)
    rejected_by(snap, "I4", "tail_block", "tail_block 999")
    rejected_by(snap, "I4", "blocks", "fills the tail block 9")
    snap = base(in_place=True)
    R(snap)["tail_block"] = 999  # no fill of the tail: still a wrong record
    assert verdict(snap) == {"I4"}
    rejected_by(snap, "I4", "tail_block", "token 33, the last position, is in block 9")


# ------------------------------------------------------------------ every launch counts
def _after_the_plan(snap, *events) -> dict:
    t = snap["schedule"][-1]["t"]
    snap["schedule"] += [dict(ev, t=t + 1 + k) for k, ev in enumerate(events)]
    return snap


def test_second_launch_after_the_source_was_freed_reallocated_and_rewritten_rejected():
    reuse = ({"kind": "alloc", "request": "x", "blocks": [1]}, {"kind": "write", "request": "x", "token": 0, "slot": 4})
    assert verdict(_after_the_plan(base(), *reuse)) == set()  # source 1 reused after the copy: fine
    snap = _after_the_plan(base(), *reuse, {"kind": "launch", "plan": 1})  # ... then the copy issued again
    rejected_by(snap, "I3", "early", "freed")
    rejected_by(snap, "I3", "early", "handed to request 'x'")
    rejected_by(snap, "I3", "early", "new token 0 written at (block 1, offset 0), in a source block")
    # fenced again after the second launch, the reuse still came before it
    snap = _after_the_plan(base(), *reuse, {"kind": "launch", "plan": 1}, {"kind": "fence", "plan": 1})
    rejected_by(snap, "I3", "early", "new token 0 written")


# ------------------------------------------------------------------ every request's post counts
def test_another_requests_live_token_on_a_fill_slot_after_the_plan_rejected():
    snap = base(in_place=True)
    snap["post"]["requests"]["x"] = {"length": 1, "blocks": [20], "tail_block": None, "tokens": [[20, 0, True]]}
    assert verdict(snap) == set()  # its own block
    moved_to = snap["plan"]["moves"][0][3:]  # token 0 lands on (5, 2), a hole of fill 5
    snap["post"]["requests"]["x"] = {"length": 1, "blocks": [5], "tail_block": None, "tokens": [[*moved_to, True]]}
    rejected_by(snap, "I2", "post_unique", "live token 0 of request 'x'")


def test_a_prefix_hit_on_a_block_outside_the_plan_while_it_flew_is_sharing_not_an_alias():
    snap = base(in_place=True)
    toks = [tok for tok in P(snap)["tokens"] if tok[0] == 9]  # the tail's two tokens, the same prefix
    snap["post"]["requests"]["x"] = {"length": 2, "blocks": [9], "tail_block": None, "tokens": toks}
    assert verdict(snap) == set()


# ------------------------------------------------------------------ reads of dead tokens
def test_read_of_an_evicted_in_flight_token_at_its_old_slot_after_apply_rejected():
    snap = base()
    t, sb, so = snap["plan"]["moves"][0][:3]  # token 0 from (1, 0), evicted while the copy flew
    snap["evicted_in_flight"] = [t]
    P(snap)["tokens"][t] = [sb, so, False]
    last = read_event(snap, -1)  # after apply (and the free of block 1)
    k = last["tokens"].index(t)
    del last["tokens"][k], last["slots"][k]
    assert verdict(snap) == set()
    last["tokens"].append(t)
    last["slots"].append(sb * S + so)
    rejected_by(snap, "I3", "stale_read", "evicted while the copy flew")


def test_read_of_a_dead_token_at_a_fill_hole_after_the_fence_rejected():
    snap = base(in_place=True)
    assert R(snap)["tokens"][16] == [5, 0, True] and R(snap)["tokens"][18] == [5, 2, False]
    fence = next(i for i, ev in enumerate(snap["schedule"]) if ev["kind"] == "fence")
    t = snap["schedule"][fence]["t"]
    snap["schedule"].insert(fence + 1, {"t": t, "kind": "read", "request": "r0", "tokens": [16], "slots": [5 * S]})
    assert verdict(snap) == set()  # a live token of the fill, where it is
    snap["schedule"][fence + 1].update(tokens=[18], slots=[5 * S + 2])  # dead token 18 at its hole (5, 2)
    rejected_by(snap, "I3", "dead_read", "token 18, dead before the plan")
    snap = _after_the_plan(base(in_place=True), {"kind": "read", "request": "r0", "tokens": [18], "slots": [22]})
    rejected_by(snap, "I3", "dead_read", "token 18")


# ------------------------------------------------------------------ one plan per request in flight
def test_two_plans_in_flight_for_one_request_rejected():
    snap = base()
    snap["in_flight"] = [{"id": 2, "request": "r0", "sources": [40], "dests": [41]}]
    assert verdict(snap) == set()  # an orphan of an earlier r0: none of its blocks is r0's
    snap["in_flight"] = [{"id": 2, "request": "r0", "sources": [5], "dests": [41]}]  # r0's block 5
    rejected_by(snap, "I4", "one_plan", "in-flight plan 2 copies blocks of request 'r0' while plan 1")


def test_two_in_flight_plans_of_another_request_rejected():
    snap = base()
    snap["pre"]["requests"]["x"] = {"length": 2, "blocks": [20, 21], "tail_block": 21,
                                   "tokens": [[20, 0, True], [21, 0, True]]}
    snap["in_flight"] = [{"id": 2, "request": "x", "sources": [20], "dests": [41]}]
    assert verdict(snap) == set()
    snap["in_flight"].append({"id": 3, "request": "x", "sources": [21], "dests": [42]})
    rejected_by(snap, "I4", "one_plan", "in-flight plan 3 copies blocks of request 'x'")


# ------------------------------------------------------------------ the headroom holds free blocks
@pytest.mark.parametrize("block, words", [(5, "a fill of plan 1"), (1, "a source of plan 1"),
                                          (9, "a block of request 'r0'")])
def test_a_fill_or_source_listed_in_the_headroom_rejected(block, words):
    snap = base(in_place=True)
    snap["headroom"] = snap["headroom"] + [block]
    assert verdict(snap) == {"I4"}
    rejected_by(snap, "I4", "headroom", words)


def test_an_in_flight_plans_block_listed_in_the_headroom_rejected():
    snap = base(in_place=True)
    snap["in_flight"] = [{"id": 2, "request": "x", "sources": [40], "dests": [41]}]
    assert verdict(snap) == set()
    snap["headroom"] = snap["headroom"] + [41]
    rejected_by(snap, "I4", "headroom", "a block of in-flight plan 2")


# ------------------------------------------------------------------ equal clock values: list order
def test_events_after_the_fence_carrying_its_clock_value_are_after_it():
    snap = base()
    sched = snap["schedule"]
    fence = next(i for i, ev in enumerate(sched) if ev["kind"] == "fence")
    w = sched[fence]["t"]
    for ev in sched[fence:]:  # apply, free and the read of the destinations at the fence's own time
        ev["t"] = w
    assert verdict(snap) == set()
    # the same read placed before the fence, at the same time: the copy may still be running
    snap = base()
    sched = snap["schedule"]
    dst_read = dict(sched[-1], t=w, request="x")
    sched.insert(fence, dst_read)
    rejected_by(snap, "I3", "early", "attention reads destination slot(s)")


# ------------------------------------------------------------------ a write onto a live token's slot
def test_a_write_onto_a_live_slot_of_the_request_rejected():
    """Found while adding the operators: another request's new token written after the fence
    onto a fill's live slot (not a hole, so no race with the copy) overwrote a live token of
    the request unseen; so did the request's own next token written onto a moved token."""
    snap = base(in_place=True)
    assert R(snap)["tokens"][16] == [5, 0, True]
    _after_the_plan(snap, {"kind": "write", "request": "x", "token": 0, "slot": 5 * S})
    rejected_by(snap, "I2", "overwrite", "where live token 16 of request 'r0' is")
    moved = base(in_place=True)  # after apply, token 0 lives at (5, 2), a hole before the plan
    _after_the_plan(moved, {"kind": "write", "request": "r0", "token": 34, "slot": 5 * S + 2})
    rejected_by(moved, "I2", "overwrite", "where live token 0 of request 'r0' is")
    # a block freed and handed to another request first is that request's to write
    ok = _after_the_plan(base(), {"kind": "alloc", "request": "x", "blocks": [1]},
                         {"kind": "write", "request": "x", "token": 0, "slot": 4})
    assert verdict(ok) == set()
