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
    snap = base() if data.draw(st.booleans()) else synthetic_snapshot(5, S=2)
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
