"""Ownership across the whole snapshot (issue 40, item 1): who holds each block -- a
request's list, a plan in flight as source / fill / destination, the plan along its
schedule -- derived by both checkers from the snapshot alone, and every block held twice or
written by a request that does not hold it rejected, across requests and orphans, before
and after apply. Each test feeds both checkers (plain Python and Z3) a hand-made violating
snapshot that both accepted before the rules existed, asserts both reject it naming the
rule, and that the valid snapshot next to it is accepted.

Every snapshot starts from ``synthetic_snapshot(8, S=4)`` (out of place: sources 1-4,
destinations 6 and 7, tail 5 with live tokens 16 and 17; schedule launch, read, fence,
apply, free of the sources, read) or its in-place form (fills 5-8, tail 9), or from
:func:`live_block_4`, the out-of-place plan without source 4 (block 4: a live block of the
request outside the plan, not its tail). Each passes clean (asserted). Also here: each
checker module states its reach (issue 40, item 6)."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtoken.invariants import snapshot_checks, z3_checks
from vtoken.invariants.z3_checks import synthetic_snapshot

pytestmark = pytest.mark.invariants

CHECKERS = {"python": snapshot_checks.check_snapshot, "z3": z3_checks.check_snapshot}
S = 4
ROOT = Path(__file__).resolve().parents[1]


def verdict(snap) -> set:
    """The violated invariants; both checkers must name the same ones, and every rule Z3
    names Python names too."""
    res = {name: check(snap) for name, check in CHECKERS.items()}
    inv = {name: {v.invariant for v in vs} for name, vs in res.items()}
    assert inv["python"] == inv["z3"], {name: [str(v) for v in vs] for name, vs in res.items()}
    assert {(v.invariant, v.rule) for v in res["z3"]} <= {(v.invariant, v.rule) for v in res["python"]}
    return inv["python"]


def rejected_by(snap, rule: str, *words: str) -> None:
    """Both checkers report I4 ``rule``, with each of ``words`` in one explanation."""
    assert "I4" in verdict(snap)
    for name, check in CHECKERS.items():
        vs = [v for v in check(snap) if (v.invariant, v.rule) == ("I4", rule)]
        assert vs, (name, [str(v) for v in check(snap)])
        assert any(all(w in v.explanation for w in words) for v in vs), (name, [str(v) for v in vs])


def accepted(snap) -> dict:
    assert verdict(snap) == set()
    return snap


def base(in_place: bool = False) -> dict:
    return accepted(synthetic_snapshot(8, S=S, in_place=in_place))


def R(snap):
    return snap["pre"]["requests"]["r0"]


def P(snap):
    return snap["post"]["requests"]["r0"]


def live_block_4() -> dict:
    """The out-of-place plan without source 4: block 4 keeps its live tokens 12 and 13, a live
    block of the request that is neither the tail nor a block of the plan."""
    snap = base()
    plan = snap["plan"]
    for t, sb, so, _db, _do in [mv for mv in plan["moves"] if mv[1] == 4]:
        P(snap)["tokens"][t] = [sb, so, True]
    plan["moves"] = [mv for mv in plan["moves"] if mv[1] != 4]
    plan["sources"] = [1, 2, 3]
    P(snap)["blocks"] = sorted(set(P(snap)["blocks"]) | {4})
    for ev in snap["schedule"]:
        if ev["kind"] == "free":
            ev["blocks"] = [1, 2, 3]
    last = snap["schedule"][-1]
    last["slots"] = [P(snap)["tokens"][t][0] * S + P(snap)["tokens"][t][1] for t in last["tokens"]]
    assert R(snap)["tokens"][12][:2] == [4, 0] and R(snap)["tokens"][12][2]
    return accepted(snap)


def in_flight(snap, *entries) -> dict:
    snap["in_flight"] = snap["in_flight"] + [dict(e) for e in entries]
    return snap


def with_request(snap, name: str, blocks: list, where: str = "pre") -> dict:
    """Request ``name`` in ``pre`` (or ``post``) holding ``blocks``, one live token at offset 0 of each."""
    snap[where]["requests"][name] = {"length": len(blocks), "blocks": list(blocks), "tail_block": None,
                                     "tokens": [[b, 0, True] for b in blocks]}
    return snap


def after_fence(snap, *events) -> dict:
    """``events`` right after the plan's fence, at its time: the copy is done, the plan not applied yet."""
    sched = snap["schedule"]
    f = next(i for i, ev in enumerate(sched) if ev["kind"] == "fence")
    sched[f + 1:f + 1] = [dict(ev, t=sched[f]["t"]) for ev in events]
    return snap


def at_end(snap, *events) -> dict:
    t = snap["schedule"][-1]["t"]
    snap["schedule"] += [dict(ev, t=t + 1 + k) for k, ev in enumerate(events)]
    return snap


# ------------------------------------------------------------------ an in-flight plan's destination
@pytest.mark.parametrize("block, what", [(4, "a live block of the request"), (5, "the request's tail")])
def test_an_in_flight_destination_on_a_block_of_the_request_rejected(block, what):
    """Another request's plan in flight copies into a block the request reads: its copy
    writes over live tokens (a block of the request outside the plan, or its tail)."""
    accepted(in_flight(live_block_4(), {"id": 2, "request": "x", "sources": [40], "dests": [41]}))
    snap = in_flight(live_block_4(), {"id": 2, "request": "x", "sources": [40], "dests": [block]})
    rejected_by(snap, "in_flight_dest", f"in-flight plan 2 (request 'x') copies into block {block}",
                "request 'r0' holds")


def test_an_in_flight_destination_on_a_third_requests_block_rejected():
    snap = with_request(base(), "y", [20])
    accepted(in_flight(copy.deepcopy(snap), {"id": 2, "request": "x", "sources": [40], "dests": [41]}))
    in_flight(snap, {"id": 2, "request": "x", "sources": [40], "dests": [20]})
    rejected_by(snap, "in_flight_dest", "copies into block 20", "request 'y' holds")


# ------------------------------------------------------------------ an in-flight plan's source or fill
@pytest.mark.parametrize("role", ["sources", "fills"])
def test_an_in_flight_source_or_fill_on_a_block_of_another_request_rejected(role):
    """Request x's plan in flight takes block 4 of r0 as a source (or fill): its apply frees
    (or its copy writes into) a block r0 still reads."""
    snap = with_request(live_block_4(), "x", [20, 21])
    accepted(in_flight(copy.deepcopy(snap), {"id": 2, "request": "x", "sources": [20], "dests": [41], "fills": [21]}))
    entry = {"id": 2, "request": "x", "sources": [20], "dests": [41], "fills": []}
    entry[role] = [4]
    rejected_by(in_flight(snap, entry), "in_flight_source", f"holds block 4 as a {role[:-1]}", "request 'r0' holds")


@pytest.mark.parametrize("role", ["sources", "fills"])
def test_an_orphan_holding_a_block_of_the_request_rejected(role):
    """A plan orphaned when its request left keeps its sources and fills until its copy ends:
    if the request now holds one, the block was freed early and reused -- it is in two places."""
    accepted(in_flight(live_block_4(), {"id": 2, "request": "gone", "sources": [40], "dests": [41]}))
    entry = {"id": 2, "request": "gone", "sources": [40], "dests": [41], "fills": []}
    entry[role] = entry[role] + [4]
    rejected_by(in_flight(live_block_4(), entry), "in_flight_source", "orphan of a request that left",
                f"holds block 4 as a {role[:-1]}", "request 'r0' holds")


def test_the_plans_own_request_holding_its_source_is_one_plan_not_ownership():
    """r0's own second plan in flight is [one_plan]'s (unchanged); not an ownership finding."""
    snap = in_flight(live_block_4(), {"id": 2, "request": "r0", "sources": [4], "dests": [41]})
    assert verdict(snap) == {"I4"}
    for check in CHECKERS.values():
        assert {v.rule for v in check(snap)} == {"one_plan"}


# ------------------------------------------------------------------ two in-flight plans, one block
@pytest.mark.parametrize("a, b, words", [
    ({"sources": [40], "dests": [41]}, {"sources": [42], "dests": [41]}, "in-flight plans 2 (a dest) and 3 (a dest)"),
    ({"sources": [40], "dests": [41]}, {"sources": [40], "dests": [43]}, "in-flight plans 2 (a source) and 3 (a source)"),
    ({"sources": [40], "dests": [40]}, None, "in-flight plan 2 as both a source and a dest"),
])
def test_a_block_held_by_two_in_flight_plans_rejected(a, b, words):
    ok = in_flight(base(), {"id": 2, "request": "x", **a} if b is not None else {"id": 2, "request": "x",
                                                                                "sources": [40], "dests": [41]})
    accepted(ok)
    entries = [{"id": 2, "request": "x", **a}] + ([{"id": 3, "request": "y", **b}] if b is not None else [])
    rejected_by(in_flight(base(), *entries), "plans_overlap", "block", words)


# ------------------------------------------------------------------ after apply: a block of the plan handed over
def test_a_fill_handed_to_another_request_without_a_free_rejected():
    """After apply the fill is the request's again; another request listing it in ``post``
    (with or without an alloc in the schedule, never a free) holds it a second time."""
    snap = with_request(base(in_place=True), "x", [5], where="post")
    snap["post"]["requests"]["x"].update(length=0, tokens=[])  # no token of x even collides
    rejected_by(snap, "handed_over", "request 'x' lists block 5 (fill of plan 1)", "held twice")
    rejected_by(at_end(snap, {"kind": "alloc", "request": "x", "blocks": [5]}), "handed_over", "lists block 5")


def test_a_used_destination_handed_to_another_request_without_a_free_rejected():
    snap = with_request(base(), "x", [6], where="post")
    snap["post"]["requests"]["x"].update(length=0, tokens=[])
    rejected_by(snap, "handed_over", "request 'x' lists block 6 (destination of plan 1)")


def test_blocks_the_plan_let_go_of_may_go_to_another_request():
    """A source freed after apply, then allocated to x; an unused destination (back in the
    headroom at apply) allocated to x: x lists them after the plan. Fine."""
    snap = with_request(base(), "x", [1], where="post")
    accepted(at_end(snap, {"kind": "alloc", "request": "x", "blocks": [1]}))
    snap = base()
    snap["plan"]["dests"] = [6, 7, 8]  # 8 listed, no move lands there: unused
    accepted(snap)
    with_request(snap, "x", [8], where="post")
    rejected_by(copy.deepcopy(snap), "handed_over", "lists block 8")  # no alloc to x: never handed to it
    accepted(at_end(snap, {"kind": "alloc", "request": "x", "blocks": [8]}))


# ------------------------------------------------------------------ along the schedule, while the plan holds a block
@pytest.mark.parametrize("block, role", [(1, "source"), (6, "destination")])
def test_a_block_the_plan_holds_handed_out_after_the_fence_rejected(block, role):
    """The copy is done (fenced) but the plan has not let go: a source until its free, a
    destination until apply. Handing it to a request (or freeing a destination) then gives
    one block two holders."""
    snap = after_fence(base(), {"kind": "alloc", "request": "x", "blocks": [block]})
    rejected_by(snap, "handed_over", f"block {block}, a {role} plan 1 still holds, is handed to request 'x'")
    if role == "destination":
        rejected_by(after_fence(base(), {"kind": "free", "blocks": [6]}), "handed_over", "is freed")
    accepted(at_end(base(), {"kind": "alloc", "request": "x", "blocks": [1]}))  # after its free: fine


@pytest.mark.parametrize("writer, block, slot", [("x", 1, 1 * S + 3), ("r0", 6, 6 * S + 0)])
def test_a_write_into_a_block_the_plan_holds_by_a_request_not_holding_it_rejected(writer, block, slot):
    """After the fence, before the plan lets go: x writes into source 1 (at a dead slot: no live
    token overwritten), r0 writes into destination 6 (not its block until apply)."""
    rejected_by(after_fence(base(), {"kind": "write", "request": writer, "token": 0, "slot": slot}),
                "foreign_write", f"written at t=3 (schedule[3]) into block {block}")
    # r0 writing its own tail, and x writing into source 1 once freed and allocated to it: fine
    accepted(after_fence(base(), {"kind": "write", "request": "r0", "token": 18, "slot": 5 * S + 2}))
    accepted(at_end(base(), {"kind": "alloc", "request": "x", "blocks": [1]},
                    {"kind": "write", "request": "x", "token": 0, "slot": slot if block == 1 else 1 * S}))


# ------------------------------------------------------------------ the two checkers agree, rule by rule
OWNERSHIP = {"in_flight_dest", "in_flight_source", "plans_overlap", "handed_over", "foreign_write"}
_BLOCK = st.sampled_from([1, 2, 4, 5, 6, 7, 8, 9, 40, 41])
_NAME = st.sampled_from(["r0", "x", "gone"])
_WRITE = st.builds(lambda r, b, o: {"kind": "write", "request": r, "token": 0, "slot": b * S + o}, _NAME, _BLOCK,
                   st.integers(0, S - 1))
_EVENT = st.one_of(
    st.builds(lambda r, bs: {"kind": "alloc", "request": r, "blocks": bs}, _NAME, st.lists(_BLOCK, min_size=1, max_size=2)),
    st.builds(lambda bs: {"kind": "free", "blocks": bs}, st.lists(_BLOCK, min_size=1, max_size=2)),
    _WRITE, _WRITE,  # writes twice as likely: a write is one block, an alloc or free up to two
)
_ENTRY = st.fixed_dictionaries({"request": _NAME, "sources": st.lists(_BLOCK, max_size=2),
                                "dests": st.lists(_BLOCK, max_size=2), "fills": st.lists(_BLOCK, max_size=1)})


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(in_place=st.booleans(), entries=st.lists(_ENTRY, max_size=3),
       events=st.lists(st.tuples(st.integers(0, 8), _EVENT), max_size=4),
       listed=st.lists(_BLOCK, max_size=2), third=st.booleans())
def test_both_checkers_name_the_same_ownership_rules(in_place, entries, events, listed, third):
    """Random in-flight plans (the request's own, another's, an orphan's), allocs, frees and
    writes anywhere in the schedule, and another request listing blocks after the plan: the
    two checkers name the same ownership rules on every one (not only the same invariants)."""
    snap = synthetic_snapshot(8, S=S, in_place=in_place)
    if third:
        with_request(snap, "y", [41])
    in_flight(snap, *[dict(e, id=10 + k) for k, e in enumerate(entries)])
    sched = snap["schedule"]
    for pos, ev in sorted(events, key=lambda x: -x[0]):
        pos = min(pos, len(sched))
        sched.insert(pos, dict(ev, t=sched[pos - 1]["t"] if pos else 0))
    if listed:
        snap["post"]["requests"]["x"] = {"length": 0, "blocks": sorted(set(listed)), "tail_block": None, "tokens": []}
    got = {name: {v.rule for v in check(snap) if v.rule in OWNERSHIP} for name, check in CHECKERS.items()}
    assert got["python"] == got["z3"], got


# ------------------------------------------------------------------ each checker states its reach (item 6)
INVARIANT_MODULES = sorted(p for p in (ROOT / "invariants").glob("*.py"))


@pytest.mark.parametrize("path", INVARIANT_MODULES, ids=lambda p: p.name)
def test_every_checker_module_says_what_it_cannot_see(path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    head = doc.split("\n\n")
    assert any(part.startswith("What this cannot see") for part in head[:3]), \
        f"{path.name}: no 'What this cannot see' section among the first paragraphs of its docstring"
    section = doc[doc.index("What this cannot see"):]
    assert len(section.split("\n\n")[1] if section.count("\n\n") else section) > 60, path.name


def test_the_architecture_page_lists_every_checkers_reach():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert "## What the checkers cannot see" in text
    section = text.split("## What the checkers cannot see", 1)[1].split("\n## ", 1)[0]
    for path in INVARIANT_MODULES:
        if path.name != "__init__.py":
            assert f"`{path.name}`" in section, path.name
