"""Soundness of the snapshot checkers (issue 11 item 1): each violation the issue saw
accepted is now rejected, by the plain-Python checker and by Z3 alike, and the two agree
on every snapshot (valid, violating, or corrupted at random).

Regression tests are named after what they reject; each starts from
``synthetic_snapshot(8, S=4)``, which passes clean (asserted), exactly as the issue did."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtoken.errors import SnapshotError
from vtoken.invariants import snapshot_checks, z3_checks
from vtoken.invariants.z3_checks import synthetic_snapshot

pytestmark = pytest.mark.invariants

CHECKERS = {"python": snapshot_checks.check_snapshot, "z3": z3_checks.check_snapshot}
S = 4


def base():
    snap = synthetic_snapshot(8, S=S)
    for name, check in CHECKERS.items():
        assert check(snap) == [], name
    return snap


def flagged(snap, **kw):
    """{checker: set of violated invariants}; both checkers must give the same set."""
    out = {name: {v.invariant for v in check(snap, **kw)} for name, check in CHECKERS.items()}
    assert out["python"] == out["z3"], out
    return out["python"]


def explained(snap, checker="python"):
    return " | ".join(str(v) for v in CHECKERS[checker](snap))


def R(snap):
    return snap["pre"]["requests"][snap["plan"]["request"]]


def P(snap):
    return snap["post"]["requests"][snap["plan"]["request"]]


# ------------------------------------------------------------------------------ (A), (B): lost tokens
def test_lost_moved_token_rejected():
    """(A) one moved token live before, dead in place after, not recorded as evicted: lost."""
    snap = base()
    t, sb, so, _db, _do = snap["plan"]["moves"][3]
    P(snap)["tokens"][t] = [sb, so, False]
    assert snap["evicted_in_flight"] == []
    assert "I1" in flagged(snap)
    for name in CHECKERS:
        assert f"token {t}" in explained(snap, name) and "LOST" in explained(snap, name)


def test_all_moved_tokens_lost_rejected():
    """(B) all eight moved tokens lost the same way."""
    snap = base()
    for t, sb, so, _db, _do in snap["plan"]["moves"]:
        P(snap)["tokens"][t] = [sb, so, False]
    assert "I1" in flagged(snap)
    vs = snapshot_checks.check_snapshot(snap)
    assert sum(v.rule == "arrival" for v in vs) == 8


def _unread(snap, t):
    """Drop token ``t`` from the reads after apply (an evicted token is not read any more)."""
    ev = snap["schedule"][-1]
    assert ev["kind"] == "read"
    k = ev["tokens"].index(t)
    del ev["tokens"][k], ev["slots"][k]


def test_recorded_eviction_in_flight_is_accepted():
    """The same dead-in-place token IS fine when the snapshot records it as evicted in flight."""
    snap = base()
    t, sb, so, _db, _do = snap["plan"]["moves"][3]
    P(snap)["tokens"][t] = [sb, so, False]
    snap["evicted_in_flight"] = [t]
    _unread(snap, t)
    assert flagged(snap) == set()
    # ... unless no eviction can have happened
    assert "I1" in flagged(snap, evictions_in_flight=False)


def test_resurrected_evicted_token_rejected():
    """A token recorded as evicted in flight must be dead at its pre slot after the plan."""
    snap = base()
    t, sb, so, _db, _do = snap["plan"]["moves"][3]
    snap["evicted_in_flight"] = [t]  # recorded evicted, yet live at its destination
    assert "I1" in flagged(snap)
    P(snap)["tokens"][t] = [sb, so, True]  # or live again where it was
    P(snap)["blocks"] = sorted(P(snap)["blocks"] + [sb])
    assert "I1" in flagged(snap) and "recorded as evicted" in explained(snap)


def test_evicted_in_flight_is_required_and_checked():
    snap = base()
    del snap["evicted_in_flight"]
    for check in CHECKERS.values():
        with pytest.raises(SnapshotError, match="evicted_in_flight"):
            check(snap)
    for bad, words in (([99], "outside"), ([True], "integer"), ([R(base())["length"] - 1], "not moved"),
                       ("3", "list")):
        snap = base()
        snap["evicted_in_flight"] = bad
        with pytest.raises(SnapshotError, match="evicted_in_flight") as e:
            snapshot_checks.check_snapshot(snap)
        assert words in str(e.value)
    snap = base()
    t = snap["plan"]["moves"][0][0]
    snap["evicted_in_flight"] = [t, t]
    with pytest.raises(SnapshotError, match="twice"):
        z3_checks.check_snapshot(snap)


# ------------------------------------------------------------------------------ (C): derived sharedness
def test_source_listed_by_another_request_is_shared():
    """(C) a source block also in another request's block list is shared, though
    shared_blocks omits it."""
    snap = base()
    b = snap["plan"]["sources"][0]
    toks = [list(tok) for tok in R(snap)["tokens"] if tok[2] and tok[0] == b]
    snap["pre"]["requests"]["r1"] = {"length": len(toks), "blocks": [b], "tail_block": None, "tokens": toks}
    assert snap["shared_blocks"] == []
    assert flagged(snap) == {"I4"}
    assert f"moves shared-prefix block {b}" in explained(snap, "z3")
    assert snapshot_checks.derived_shared(snap) == {b}


def test_destination_listed_by_another_request_is_rejected():
    snap = base()
    d = snap["plan"]["dests"][0]
    snap["pre"]["requests"]["r1"] = {"length": 0, "blocks": [d], "tail_block": None, "tokens": []}
    assert "I4" in flagged(snap)
    assert f"destination block {d} belongs to" in explained(snap)


# ------------------------------------------------------------------------------ (D): live token in a freed block
def test_live_token_in_freed_source_block_rejected():
    """(D) after the plan, a live token inside a source block the schedule frees."""
    snap = base()
    b = snap["plan"]["sources"][0]
    post = P(snap)
    free_offset = next(o for o in range(S) if [b, o, True] not in post["tokens"])
    post["tokens"].append([b, free_offset, True])  # a token added while the copy flew, in a freed block
    post["length"] += 1
    post["blocks"] = sorted(post["blocks"] + [b])
    assert flagged(snap) == {"I2"}
    assert "in a source block of the plan" in explained(snap, "z3")


def test_live_token_in_a_block_freed_then_reallocated_to_the_request_is_fine():
    snap = base()
    b = snap["plan"]["sources"][0]
    t_last = snap["schedule"][-1]["t"]
    snap["schedule"].append({"t": t_last + 1, "kind": "alloc", "request": snap["plan"]["request"], "blocks": [b]})
    assert flagged(snap) == set()  # nothing lives there yet; the rule only applies to live tokens
    snap2 = copy.deepcopy(snap)
    post = P(snap2)
    post["tokens"].append([b, 0, True])
    post["length"] += 1
    post["blocks"] = sorted(post["blocks"] + [b])
    assert flagged(snap2) == set()  # freed, then handed back to the request: it may write there


# ------------------------------------------------------------------------------ (E): duplicate plan ids
def test_in_flight_plan_with_the_plans_own_id_rejected():
    """(E) an in-flight plan overlapping the plan's blocks and carrying the same id."""
    snap = base()
    b = snap["plan"]["sources"][0]
    snap["in_flight"] = [{"id": snap["plan"]["id"], "request": "r0", "sources": [b], "dests": [90]}]
    assert flagged(snap) == {"I4"}
    assert "carries plan 1's own id" in explained(snap, "z3")
    # a duplicate id is rejected even when the in-flight plan shares no block
    snap["in_flight"] = [{"id": snap["plan"]["id"], "request": "r9", "sources": [91], "dests": [90]}]
    assert flagged(snap) == {"I4"}
    # and two in-flight plans with one id
    snap["in_flight"] = [{"id": 7, "request": "r9", "sources": [91], "dests": [90]},
                         {"id": 7, "request": "r8", "sources": [93], "dests": [92]}]
    assert flagged(snap) == {"I4"} and "two in-flight plans carry id 7" in explained(snap, "z3")


def test_in_flight_plan_of_another_request_sharing_a_source_rejected():
    snap = base()
    b = snap["plan"]["sources"][0]
    snap["in_flight"] = [{"id": 99, "request": "r9", "sources": [b], "dests": [90]}]
    assert flagged(snap) == {"I4"}


# ------------------------------------------------------------------------------ digests
def test_changed_kv_digest_rejected():
    snap = base()
    k = len(snap["plan"]["moves"])
    snap["plan"]["digests"] = {"method": "xxh3", "pre": list(range(1, k + 1)), "post": list(range(1, k + 1))}
    assert flagged(snap) == set()
    snap["plan"]["digests"]["post"][2] ^= 1 << 40
    assert flagged(snap) == {"I1"} and "digest changed" in explained(snap, "z3")
    snap["plan"]["digests"]["post"][2] = None  # unknown: not compared
    assert flagged(snap) == set()
    snap["plan"]["digests"]["post"] = [1]
    with pytest.raises(SnapshotError, match="plan.digests.post"):
        snapshot_checks.check_snapshot(snap)


# ------------------------------------------------------------------------------ in-place plans (plan.fills)
# synthetic_snapshot(8, S=4, in_place=True): sources 1-4 (tokens 0-15, live at offsets 0-1),
# fills 5-8 (tokens 16-31: live at offsets 0-1, dead at the holes 2-3), tail 9 (tokens 32-33),
# headroom [10, 11], no dests; move k sends token (4 * (k // 2) + k % 2) to fill 5 + k // 2,
# offset 2 + k % 2.
def base_in_place():
    snap = synthetic_snapshot(8, S=S, in_place=True)
    assert snap["plan"]["fills"] == [5, 6, 7, 8] and snap["plan"]["dests"] == [] and snap["dests_used"] == []
    assert snap["plan"]["moves"][0] == [0, 1, 0, 5, 2] and R(snap)["tokens"][16] == [5, 0, True]
    for name, check in CHECKERS.items():
        assert check(snap) == [], name
    return snap


def _after_launch(snap, *events):
    """Insert events right after the plan's launch, at its time (before the fence)."""
    sched = snap["schedule"]
    i = next(k for k, e in enumerate(sched) if e["kind"] == "launch")
    sched[i + 1:i + 1] = [dict(e, t=sched[i]["t"]) for e in events]
    return snap


def _reread(snap):
    """The read after apply follows the post slots (after a test moved a token elsewhere)."""
    last = snap["schedule"][-1]
    assert last["kind"] == "read"
    last["slots"] = [P(snap)["tokens"][t][0] * S + P(snap)["tokens"][t][1] for t in last["tokens"]]
    return snap


def test_in_place_snapshot_is_accepted_and_fills_absent_means_none():
    snap = base_in_place()
    # the reads while the copy flies include the fills' live tokens (offsets 0-1): not a race
    first = snap["schedule"][1]
    assert first["kind"] == "read" and 16 in first["tokens"] and first["slots"][first["tokens"].index(16)] == 5 * S
    # absent fills == []: the same moves then land in blocks listed nowhere (and not fresh)
    del snap["plan"]["fills"]
    assert "I4" in flagged(snap)
    assert "nor of its fills []" in explained(snap) and "not a fresh block" in explained(snap, "z3")
    # and an out-of-place plan saying "fills": [] is the out-of-place plan
    snap = base()
    snap["plan"]["fills"] = []
    assert flagged(snap) == set()


def test_move_into_an_occupied_slot_of_a_fill_rejected():
    """A move into a fill must land on a hole: (5, 0) holds token 16, live and unmoved."""
    snap = base_in_place()
    snap["plan"]["moves"][0][3:] = [5, 0]
    P(snap)["tokens"][0] = [5, 0, True]  # the table followed the move
    _reread(snap)  # and so did the read after apply
    assert flagged(snap) == {"I2"}
    for name in CHECKERS:
        assert "(block 5, offset 0)" in explained(snap, name) and "16" in explained(snap, name)
    # unapplied (post null): the same, from pre alone
    snap["post"] = None
    snap["dests_used"] = None
    assert flagged(snap) == {"I2"}


def test_two_moves_into_one_hole_rejected():
    snap = base_in_place()
    mv = snap["plan"]["moves"]
    mv[1][3:] = mv[0][3:]
    P(snap)["tokens"][mv[1][0]] = [mv[0][3], mv[0][4], True]
    _reread(snap)
    assert {"I2", "I4"} <= flagged(snap)
    assert "used twice (moves #0 and #1)" in explained(snap, "z3")


@pytest.mark.parametrize("how", ["shared_blocks", "another_request"])
def test_shared_fill_rejected(how):
    snap = base_in_place()
    if how == "shared_blocks":
        snap["shared_blocks"] = [6]
    else:  # another request lists block 6 (with the same tokens): shared, though shared_blocks omits it
        toks = [list(tok) for tok in R(snap)["tokens"] if tok[2] and tok[0] == 6]
        snap["pre"]["requests"]["x"] = {"length": len(toks), "blocks": [6], "tail_block": None, "tokens": toks}
    assert flagged(snap) == {"I4"}
    for name in CHECKERS:
        assert "fills shared-prefix block 6" in explained(snap, name)


def test_tail_fill_rejected():
    snap = base_in_place()
    R(snap)["tail_block"] = 7
    assert flagged(snap) == {"I4"}
    for name in CHECKERS:
        assert "fills the tail block 7" in explained(snap, name)


def test_fill_that_is_a_source_or_a_destination_rejected():
    snap = base_in_place()
    snap["plan"]["fills"].append(2)  # a source listed as a fill too
    assert flagged(snap) == {"I4"}
    for name in CHECKERS:
        assert "block 2 is both a source and a fill" in explained(snap, name)
    snap = base_in_place()
    snap["plan"]["sources"].append(5)  # a fill listed as a source: not emptied, and live there after
    assert "I4" in flagged(snap) and "both a source and a fill" in explained(snap, "z3")
    snap = base_in_place()
    snap["plan"]["dests"] = [5]
    snap["headroom"].append(5)
    assert "I4" in flagged(snap)
    for name in CHECKERS:
        assert "block 5 is both a fill and a destination" in explained(snap, name)


@pytest.mark.parametrize("role", ["sources", "dests", "fills"])
def test_fill_in_another_in_flight_plan_rejected(role):
    snap = base_in_place()
    entry = {"id": 9, "request": "x", "sources": [40], "dests": []}
    entry[role] = entry.get(role, []) + [6]  # (an entry without "fills" has none)
    snap["in_flight"] = [entry]
    assert flagged(snap) == {"I4"}
    for name in CHECKERS:
        assert "overlaps in-flight plan 9 (request 'x'): block 6" in explained(snap, name)


def test_in_flight_fills_are_in_flight():
    """Another plan's fills are busy like its sources: ours may not take one as a source."""
    snap = base_in_place()
    snap["in_flight"] = [{"id": 9, "request": "r0", "sources": [40], "dests": [], "fills": [3]}]
    assert flagged(snap) == {"I4"} and "block 3" in explained(snap, "z3")
    snap["in_flight"] = [{"id": 9, "request": "x", "sources": [40], "dests": [41], "fills": [42]}]
    assert flagged(snap) == set()  # apart: fine


@pytest.mark.parametrize("how", ["fresh", "another_request", "relabelled"])
def test_fill_not_the_requests_rejected(how):
    snap = base_in_place()
    plan = snap["plan"]
    if how == "relabelled":  # the moves into fill 8 go to block 40 instead, listed as the fill
        plan["fills"] = [5, 6, 7, 40]
        for mv in plan["moves"]:
            if mv[3] == 8:
                mv[3] = 40
                P(snap)["tokens"][mv[0]] = [40, mv[4], True]
        P(snap)["blocks"] = sorted(P(snap)["blocks"] + [40])
        _reread(snap)
    else:
        plan["fills"] = plan["fills"] + [40]
        if how == "another_request":
            snap["pre"]["requests"]["x"] = {"length": 0, "blocks": [40], "tail_block": None, "tokens": []}
    assert flagged(snap) == {"I4"}
    for name in CHECKERS:
        assert "fill block 40 is not a block of request 'r0'" in explained(snap, name)


@pytest.mark.parametrize("how", ["fill_unlisted", "fresh_block"])
def test_move_into_a_block_listed_nowhere_rejected(how):
    snap = base_in_place()
    plan = snap["plan"]
    if how == "fill_unlisted":
        plan["fills"] = [5, 6, 7]  # the moves into 8 now land in a block neither a dest nor a fill
        blk = 8
    else:
        plan["moves"][0][3:] = [40, 0]
        P(snap)["tokens"][0] = [40, 0, True]
        P(snap)["blocks"] = sorted(P(snap)["blocks"] + [40])
        _reread(snap)
        blk = 40
    assert "I4" in flagged(snap)
    for name in CHECKERS:
        words = f"to block {blk}, which is not one of the plan's destinations [] nor of its fills"
        assert words in explained(snap, name)


def test_duplicate_fill_rejected():
    snap = base_in_place()
    snap["plan"]["fills"] = [5, 6, 7, 8, 6]
    assert flagged(snap) == {"I4"}
    for name in CHECKERS:
        assert "plan.fills names block 6 twice" in explained(snap, name)


def test_fill_is_still_the_requests_after_the_plan():
    """An idle fill (nothing lands there) is no safety matter; a fill the request no longer
    holds after the plan is."""
    snap = base_in_place()
    R(snap)["blocks"] = sorted(R(snap)["blocks"] + [40])  # an empty private block of r0
    snap["plan"]["fills"] = snap["plan"]["fills"] + [40]
    assert flagged(snap) == {"I4"}  # post no longer lists it
    for name in CHECKERS:
        assert "fill block 40 is no longer a block of request 'r0' after the plan" in explained(snap, name)
    P(snap)["blocks"] = sorted(P(snap)["blocks"] + [40])
    assert flagged(snap) == set()
    snap["post"], snap["dests_used"] = None, None  # not applied: nothing to say yet
    assert flagged(snap) == set()


def test_dests_used_lists_fresh_destinations_only():
    snap = base_in_place()
    snap["dests_used"] = [5, 6, 7, 8]  # the fills stay the request's: not "used destinations"
    assert flagged(snap) == {"I4"}
    for name in CHECKERS:
        assert "dests_used" in explained(snap, name)


def test_read_of_a_fill_hole_before_the_fence_rejected():
    snap = _after_launch(base_in_place(), {"kind": "read", "request": "x", "tokens": [0], "slots": [5 * S + 2]})
    assert flagged(snap) == {"I3"}
    for name in CHECKERS:
        assert "fill hole slot(s) of plan 1" in explained(snap, name)
    # the request itself reading its moved token there before apply: early and stale
    snap = _after_launch(base_in_place(), {"kind": "read", "request": "r0", "tokens": [0], "slots": [5 * S + 2]})
    assert flagged(snap) == {"I3"}
    assert {v.rule for v in snapshot_checks.check_snapshot(snap)} == {"early", "stale_read"}
    # a hole no move targets is a hole too (the copy writes the fill's holes): 7 moves, 8 holes
    snap = synthetic_snapshot(7, S=S, in_place=True)
    assert snap["plan"]["fills"] == [5, 6, 7, 8] and [8, 3] not in [mv[3:] for mv in snap["plan"]["moves"]]
    assert flagged(snap) == set()
    _after_launch(snap, {"kind": "read", "request": "x", "tokens": [0], "slots": [8 * S + 3]})
    assert flagged(snap) == {"I3"}


def test_fill_events_after_the_fence_are_fine_and_before_it_are_races():
    snap = base_in_place()
    t = snap["schedule"][-1]["t"]
    snap["schedule"].append({"t": t + 1, "kind": "read", "request": "x", "tokens": [0], "slots": [5 * S + 2]})
    assert flagged(snap) == set()
    for evs, words in (([{"kind": "free", "blocks": [6]}], "fill block(s) [6] of plan 1 freed"),
                       ([{"kind": "alloc", "request": "x", "blocks": [6]}], "block(s) [6] of plan 1 handed to"),
                       ([{"kind": "write", "request": "x", "token": 0, "slot": 6 * S + 3}], "on a destination slot")):
        snap = _after_launch(base_in_place(), *evs)
        assert "I3" in flagged(snap), evs
        for name in CHECKERS:
            assert words in explained(snap, name), (name, explained(snap, name))
    snap = synthetic_snapshot(7, S=S, in_place=True)  # (8, 3): a hole no move targets
    _after_launch(snap, {"kind": "write", "request": "x", "token": 0, "slot": 8 * S + 3})
    assert flagged(snap) == {"I3", "I4"}  # a race, and x writes into a block it does not hold (I4 foreign_write)
    for name in CHECKERS:
        assert "on a hole of a fill of plan 1" in explained(snap, name)
    snap = _after_launch(base_in_place(), {"kind": "free", "blocks": [6]})
    assert flagged(snap) == {"I2", "I3", "I4"}  # a race; freed before apply; its live tokens dangle
    assert "fill block(s) [6] freed at" in explained(snap, "z3")


# ------------------------------------------------------------------------------ agreement, at random
_JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 40), st.integers(2 ** 31 - 2, 2 ** 31 + 2), st.text(max_size=3),
    st.floats(allow_nan=False, allow_infinity=False), st.lists(st.integers(0, 12), max_size=4),
)


def _paths(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield path + (k,)
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield path + (i,)
            yield from _paths(v, path + (i,))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_python_and_z3_agree_on_randomly_changed_snapshots(data):
    """Change one value anywhere in a valid snapshot (often to a nearby integer, which keeps
    it well-formed but may break an invariant): both checkers raise SnapshotError, or both
    return the same set of violated invariants, and every rule Z3 names Python names too."""
    which = data.draw(st.sampled_from(("base", "small", "in_place")))
    snap = {"base": base, "small": lambda: synthetic_snapshot(5, S=2), "in_place": base_in_place}[which]()
    paths = list(_paths(snap))
    path = data.draw(st.sampled_from(paths))
    node = snap
    for k in path[:-1]:
        node = node[k]
    old = node[path[-1]]
    if isinstance(old, int) and not isinstance(old, bool) and data.draw(st.booleans()):
        new = old + data.draw(st.integers(-2, 2))
    elif isinstance(old, bool):
        new = not old
    else:
        new = data.draw(_JUNK)
    node[path[-1]] = new
    res = {}
    for name, check in CHECKERS.items():
        try:
            vs = check(copy.deepcopy(snap))
            res[name] = ({v.invariant for v in vs}, {(v.invariant, v.rule) for v in vs})
        except SnapshotError as e:
            res[name] = ("malformed", e.code)
    if res["python"][0] == "malformed" or res["z3"][0] == "malformed":
        assert res["python"] == res["z3"], (path, new, res)
        return
    assert res["python"][0] == res["z3"][0], (path, new, res)
    assert res["z3"][1] <= res["python"][1], (path, new, res)


def test_python_checker_does_not_use_z3():
    """Independent implementations: the plain-Python checker imports no solver."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(snapshot_checks))
    names = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "z3" not in names and not any("z3" in (m or "") for m in mods)
