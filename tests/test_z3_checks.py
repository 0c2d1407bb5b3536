"""The Z3 invariant checks (``vtoken.invariants.z3_checks``): real planner snapshots pass,
hand-made bad snapshots and planted planner faults are caught with the right invariant,
malformed snapshots raise SnapshotError naming the field, and the check scales."""

import contextlib
import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtoken.allocator import BlockAllocator
from vtoken.errors import AllocatorError, PlanError, SnapshotError, TableError
from vtoken.invariants.z3_checks import (
    Violation,
    check_and_explain,
    check_snapshot,
    synthetic_snapshot,
)
from vtoken.planner import NullCopyEngine, PlannerConfig, ReclamationManager
from vtoken.table import TokenTable

pytestmark = pytest.mark.invariants

S = 4


@contextlib.contextmanager
def planted(name):
    """A planted fault of the catalogue, swapped into the live modules for a ``with`` block."""
    from vtoken.fuzz.catalogue import CATALOGUE
    from vtoken.fuzz.patches import planted as swap

    fault = next(f for f in CATALOGUE if f.name == name)
    assert fault.patches, f"{name} is not a patch fault"
    with swap(fault.patches):
        yield


# ------------------------------------------------------------------------------ scenarios
def _manager(t, a, latency=0, headroom=4, in_place=False):
    """The scenarios below pin out-of-place layouts (fresh destinations from the headroom);
    ``in_place=True`` (the shipped default) fills the request's own holes instead."""
    cfg = PlannerConfig(record_snapshots=True, headroom=headroom, theta_f=0.0, in_place=in_place)
    return ReclamationManager(t, a, engine=NullCopyEngine(latency), config=cfg)


def fragmented(latency=0, headroom=4, in_place=False):
    """Request 'a': blocks 1..4 (4 = tail); live counts 1, 2, 2, 2 after eviction."""
    t, a = TokenTable(S, 32), BlockAllocator(32)
    blocks = a.allocate(4)
    t.sync_new_tokens("a", blocks, 14)
    t.evict_tokens("a", [0, 1, 2, 4, 5, 8, 9])
    m = _manager(t, a, latency, headroom, in_place)
    m.hold("a", blocks)  # the manager holds every block allocated for a request
    return t, a, m


def shared_prefix():
    """'a' and 'b' share block 1 (a full prefix, mostly evicted in both); 'a' owns 2..4."""
    t, a = TokenTable(S, 32), BlockAllocator(32)
    pre = a.allocate(1)
    blocks_a = pre + a.allocate(3)
    t.sync_new_tokens("a", blocks_a, 14)
    a.incref(pre)
    blocks_b = pre + a.allocate(1)
    t.sync_new_tokens("b", blocks_b, 6)
    t.evict_tokens("a", [0, 1, 2, 5, 6, 9, 10])
    t.evict_tokens("b", [0, 1, 2])
    m = _manager(t, a)
    m.hold("a", blocks_a)  # each holder holds its reference on the shared prefix block
    m.hold("b", blocks_b)
    return t, a, m


def reads(mgr, plan):
    """An attention read of the plan's request through the table's slot mapping."""
    rid = plan.req_id
    mgr.record(plan, "read", request=str(rid), tokens=mgr.table.live_tokens(rid).tolist(),
               slots=mgr.table.slot_mapping(rid).tolist())


def applied_snapshot():
    """A real, valid, applied snapshot with reads before the fence and after apply."""
    t, a, m = fragmented(latency=1)
    p = m.plan_request("a")
    m.launch(p)
    reads(m, p)  # while the copy runs: pre slots (the sources), which is fine
    m.poll()  # pending
    m.poll()  # done: fence, apply, free
    reads(m, p)  # after apply: destination slots
    assert p.state == "applied"
    return copy.deepcopy(p.snapshot)


def planned_snapshot():
    t, a, m = fragmented()
    return copy.deepcopy(m.plan_request("a").snapshot)


def kinds(vs):
    return {v.invariant for v in vs}


def expl(vs, inv):
    return " | ".join(v.explanation for v in vs if v.invariant == inv)


# ------------------------------------------------------------------------------ valid snapshots pass
def test_real_planner_snapshots_pass_every_stage():
    t, a, m = fragmented(latency=1)
    p = m.plan_request("a")
    assert check_snapshot(p.snapshot) == []  # planned, nothing scheduled yet
    m.launch(p)
    reads(m, p)
    assert check_snapshot(p.snapshot) == []  # in flight
    m.poll(force_sync=True)
    reads(m, p)
    assert p.snapshot["post"] is not None
    assert check_snapshot(p.snapshot) == []  # applied


def test_real_planner_with_shared_prefix_and_two_requests_passes():
    t, a, m = shared_prefix()
    launched = m.plan_round()
    assert launched
    shared_prefix_block = 1
    for p in launched:
        assert shared_prefix_block not in p.sources
        assert check_snapshot(p.snapshot) == []
    m.poll(force_sync=True)
    for p in launched:
        reads(m, p)
        assert check_snapshot(p.snapshot) == []


def test_real_planner_settling_many_requests_passes():
    t, a = TokenTable(S, 128), BlockAllocator(128)
    import numpy as np

    rng = np.random.default_rng(0)
    blocks = {}
    for r in range(6):
        blocks[r] = a.allocate(5)
        t.sync_new_tokens(r, blocks[r], 19)
        t.evict_tokens(r, sorted(rng.choice(18, size=9, replace=False).tolist()))
    m = _manager(t, a, latency=1, headroom=8)
    for r, b in blocks.items():
        m.hold(r, b)
    checked = 0
    for _ in range(8):
        for p in m.step():
            assert check_snapshot(p.snapshot) == [], check_and_explain(p.snapshot)
            checked += 1
    m.poll(force_sync=True)
    for p in m.history:
        assert check_snapshot(p.snapshot) == [], check_and_explain(p.snapshot)
    assert checked >= 3 and m.history


def test_eviction_and_growth_while_the_copy_is_in_flight_pass():
    t, a, m = fragmented(latency=1)
    p = m.plan_request("a")
    m.launch(p)
    moved = [mv[0] for mv in p.snapshot["plan"]["moves"]]
    t.evict_tokens("a", [moved[-1], 13])  # a token being moved, and one in the tail
    tail = sorted(t.blocks_of("a"))[-1]
    grown = a.allocate(1)
    t.sync_new_tokens("a", [1, 2, 3, tail] + grown, 17)  # the request grows meanwhile
    m.hold("a", grown)
    m.poll(force_sync=True)
    # plan.moves keeps the planned moves; the one whose token died in flight is not applied
    assert p.state == "applied" and len(p.moves) == len(moved) and m.stats["moves"] == len(moved) - 1
    assert p.evicted_in_flight == [moved[-1]]
    post = p.snapshot["post"]["requests"]["a"]
    assert post["length"] == 17 > p.snapshot["pre"]["requests"]["a"]["length"]
    reads(m, p)
    assert check_snapshot(p.snapshot) == [], check_and_explain(p.snapshot)
    assert "evicted while the copy was in flight" in check_and_explain(p.snapshot)
    strict = check_snapshot(p.snapshot, evictions_in_flight=False)
    assert kinds(strict) == {"I1"} and f"token {moved[-1]} is dropped" in expl(strict, "I1")


def test_real_in_place_planner_snapshots_pass_every_stage():
    """The shipped default: the plan moves block 1's live token into a hole of block 2 (its
    fill), no destination. (Needs the planner's snapshot writer to record ``plan.fills``.)"""
    t, a, m = fragmented(latency=1, in_place=True)
    p = m.plan_request("a")
    snap = p.snapshot
    assert snap["plan"]["fills"] == [2] and snap["plan"]["dests"] == [] and snap["plan"]["sources"] == [1]
    assert check_snapshot(snap) == [], check_and_explain(snap)
    m.launch(p)
    reads(m, p)  # while the copy flies: the fill's live tokens are read where they are
    assert check_snapshot(snap) == [], check_and_explain(snap)
    m.poll(force_sync=True)
    reads(m, p)
    assert snap["post"] is not None and snap["dests_used"] == []
    assert check_snapshot(snap) == [], check_and_explain(snap)
    assert "fills [2]" in check_and_explain(snap)


def test_in_place_synthetic_snapshot_passes_and_a_hole_read_is_a_race():
    snap = synthetic_snapshot(8, S=S, in_place=True)
    assert check_snapshot(snap) == [] and "fills [5, 6, 7, 8]" in check_and_explain(snap)
    tok, _sb, _so, fb, fo = snap["plan"]["moves"][0]
    _insert_before_fence(snap, {"kind": "read", "request": "z", "tokens": [tok], "slots": [fb * S + fo]})
    vs = check_snapshot(snap, ("I3",))
    v = next(v for v in vs if "fill hole slot" in v.explanation)
    assert v.model["c"] > v.model["t"]  # Z3's completion time: after the read
    assert f"token {tok} at (block {fb}, offset {fo})" in v.explanation


def test_z3_check_scales_to_4096_moves_in_place():
    snap = synthetic_snapshot(4096, in_place=True)
    assert len(snap["plan"]["moves"]) == 4096 and len(snap["plan"]["fills"]) == 512
    assert check_snapshot(snap) == []
    mv = snap["plan"]["moves"]
    mv[4000][3:] = [mv[17][3], 0]  # into a live slot of a fill (offset 0 of every fill is live)
    vs = check_snapshot(snap)
    assert kinds(vs) >= {"I2"} and "occupied slot" in expl(vs, "I2") and "move #4000" in expl(vs, "I2")


def test_check_and_explain_reports_each_invariant():
    rep = check_and_explain(applied_snapshot())
    for inv in ("I1: ok", "I2: ok", "I3: ok", "I4: ok"):
        assert inv in rep
    bad = applied_snapshot()
    bad["shared_blocks"] = [bad["plan"]["sources"][0]]
    rep = check_and_explain(bad)
    assert "I4: 1 violation(s)" in rep and "shared-prefix" in rep
    assert check_and_explain({"schema": "nope"}).startswith("malformed snapshot")


def test_z3_check_scales_to_4096_moves():
    snap = synthetic_snapshot(4096)
    assert len(snap["plan"]["moves"]) == 4096
    assert check_snapshot(snap) == []
    # Its time is a benchmark figure (`vtoken bench planner`, key z3_s), not a unit-test assertion.


def test_large_bad_snapshot_is_caught_fast():
    snap = synthetic_snapshot(4096)
    mv = snap["plan"]["moves"]
    mv[4000][3:] = mv[17][3:]  # two moves share a destination slot
    vs = check_snapshot(snap)
    assert "I2" in kinds(vs) and "moves #17" in expl(vs, "I2") and "#4000" in expl(vs, "I2")


# ------------------------------------------------------------------------------ I1 / I2
def test_move_into_occupied_slot_is_i2():
    snap = planned_snapshot()
    # token 10 is live and not moved (block 3, offset 2): send the first move there
    assert snap["pre"]["requests"]["a"]["tokens"][10] == [3, 2, True]
    snap["plan"]["moves"][0][3:] = [3, 2]
    vs = check_snapshot(snap, ("I2",))
    assert kinds(vs) == {"I2"}
    e = expl(vs, "I2")
    assert "occupied slot (block 3, offset 2)" in e and "live token 10" in e and "move #0" in e


def test_two_tokens_at_one_post_slot_is_i2_and_i1():
    snap = applied_snapshot()
    post = snap["post"]["requests"]["a"]["tokens"]
    mv = snap["plan"]["moves"]
    post[mv[1][0]][:2] = post[mv[0][0]][:2]  # token of move 1 lands where token of move 0 is
    vs = check_snapshot(snap)
    assert "I2" in kinds(vs) and "I1" in kinds(vs)
    assert f"live tokens {mv[0][0]} and {mv[1][0]}" in expl(vs, "I2")
    assert f"move #1: token {mv[1][0]} ends at" in expl(vs, "I1")


def test_dropped_token_is_i1():
    snap = applied_snapshot()
    t = snap["plan"]["moves"][1][0]
    snap["post"]["requests"]["a"]["tokens"][t][2] = False  # a moved token arrives dead
    vs = check_snapshot(snap)
    assert kinds(vs) == {"I1"}
    assert f"move #1: token {t} is dropped: LOST" in expl(vs, "I1")
    assert vs[0].model["i"] == 1


def test_dropped_unmoved_token_is_i1_when_no_eviction_can_have_happened():
    snap = applied_snapshot()
    snap["post"]["requests"]["a"]["tokens"][10][2] = False  # an unmoved live token disappears in place
    # the schema records no evictions: in place, that may be a policy's eviction during the copy
    assert check_snapshot(snap) == []
    vs = check_snapshot(snap, evictions_in_flight=False)
    assert kinds(vs) == {"I1"}
    assert "live token 10" in expl(vs, "I1") and "dropped" in expl(vs, "I1")
    assert vs[0].model["j"] == 10
    # dead somewhere else than where it was: dropped either way
    snap["post"]["requests"]["a"]["tokens"][10][1] = 0
    assert "not where it was" in expl(check_snapshot(snap), "I1")


def test_renamed_token_is_i1():
    snap = applied_snapshot()
    post = snap["post"]["requests"]["a"]["tokens"]
    t0 = snap["plan"]["moves"][0][0]  # the first moved token
    dead = next(i for i, tok in enumerate(snap["pre"]["requests"]["a"]["tokens"]) if not tok[2])
    post[dead] = [post[t0][0], post[t0][1], True]  # its K/V now claimed by another id
    post[t0][2] = False
    vs = check_snapshot(snap)
    e = expl(vs, "I1")
    assert f"token {t0} is dropped" in e and f"token {dead}" in e and "becomes live" in e


def test_move_from_wrong_source_is_i1_and_i4():
    snap = planned_snapshot()
    snap["plan"]["moves"][1][2] = (snap["plan"]["moves"][1][2] + 1) % S
    vs = check_snapshot(snap)
    assert {"I1", "I4"} <= kinds(vs)
    assert "not at the move's source" in expl(vs, "I1")
    assert vs[0].model["i"] == 1


def test_token_moved_twice_is_i1():
    snap = planned_snapshot()
    mv = snap["plan"]["moves"]
    mv[2][0:3] = mv[0][0:3]
    vs = check_snapshot(snap, ("I1",))
    assert f"token {mv[0][0]} is moved twice (moves #0 and #2)" in expl(vs, "I1")


# ------------------------------------------------------------------------------ I3
def _insert_before_fence(snap, *events):
    """Insert events right after the plan's launch (times renumbered, order kept)."""
    sched = snap["schedule"]
    i = next(k for k, e in enumerate(sched) if e["kind"] == "launch") + 1
    sched[i:i] = [dict(e) for e in events]
    for t, e in enumerate(sched):
        e["t"] = t
    return snap


def test_read_of_destination_before_fence_is_i3():
    snap = applied_snapshot()
    tok, _sb, _so, db, do = snap["plan"]["moves"][0]
    _insert_before_fence(snap, {"kind": "read", "request": "a", "tokens": [tok], "slots": [db * S + do]})
    vs = check_snapshot(snap, ("I3",))
    e = expl(vs, "I3")
    assert "reads destination slot" in e and f"token {tok} at (block {db}, offset {do})" in e
    v = next(v for v in vs if "reads destination" in v.explanation)
    assert v.model["c"] > v.model["t"]  # Z3's completion time: after the read
    # the same read also uses the destination before apply: a stale (early) slot mapping
    assert "stale slot mapping" in e


def test_source_freed_before_fence_is_i3():
    snap = applied_snapshot()
    src = snap["plan"]["sources"]
    _insert_before_fence(snap, {"kind": "free", "blocks": list(src)})
    vs = check_snapshot(snap)
    assert f"source block(s) {src} of plan 1 freed" in expl(vs, "I3")
    assert "before plan 1 is applied" in expl(vs, "I4")


def test_source_reallocated_and_written_before_fence_is_i3():
    snap = applied_snapshot()
    b = snap["plan"]["sources"][0]
    _insert_before_fence(snap, {"kind": "free", "blocks": [b]}, {"kind": "alloc", "request": "z", "blocks": [b]},
                         {"kind": "write", "request": "z", "token": 0, "slot": b * S})
    vs = check_snapshot(snap, ("I3",))
    e = expl(vs, "I3")
    assert "freed" in e and f"block(s) [{b}] of plan 1 handed to request 'z'" in e
    assert f"new token 0 written at (block {b}, offset 0), in a source block" in e


def test_events_after_the_fence_are_safe():
    snap = applied_snapshot()
    b = snap["plan"]["sources"][0]
    t = snap["schedule"][-1]["t"]
    snap["schedule"] += [{"t": t + 1, "kind": "alloc", "request": "z", "blocks": [b]},
                         {"t": t + 2, "kind": "write", "request": "z", "token": 0, "slot": b * S}]
    assert check_snapshot(snap) == []


def test_read_without_a_fence_is_i3_even_after_apply():
    snap = applied_snapshot()
    snap["schedule"] = [e for e in snap["schedule"] if e["kind"] != "fence"]
    vs = check_snapshot(snap, ("I3",))
    assert "reads destination slot" in expl(vs, "I3") and "no fence before" in expl(vs, "I3")


def test_stale_slot_after_apply_is_i3():
    snap = applied_snapshot()
    last = snap["schedule"][-1]
    assert last["kind"] == "read"
    tok, sb, so, _db, _do = snap["plan"]["moves"][0]
    last["slots"][last["tokens"].index(tok)] = sb * S + so  # still reading the old slot
    vs = check_snapshot(snap, ("I3",))
    assert f"for token {tok}, expected" in expl(vs, "I3") and "after apply" in expl(vs, "I3")


def test_planted_stale_slot_after_move_is_caught_by_read_consistency():
    with planted("stale_slot_after_move"):
        snap = applied_snapshot()
    vs = check_snapshot(snap)
    assert kinds(vs) == {"I3"} and "stale slot mapping" in expl(vs, "I3")


# ------------------------------------------------------------------------------ I4 (hand-made)
def test_shared_prefix_source_is_i4():
    snap = planned_snapshot()
    snap["shared_blocks"] = [snap["plan"]["sources"][1]]
    vs = check_snapshot(snap)
    assert kinds(vs) == {"I4"} and f"moves shared-prefix block {snap['plan']['sources'][1]}" in expl(vs, "I4")


def test_tail_block_source_is_i4():
    snap = planned_snapshot()
    snap["pre"]["requests"]["a"]["tail_block"] = snap["plan"]["sources"][0]
    vs = check_snapshot(snap)
    assert kinds(vs) == {"I4"} and "moves the tail block" in expl(vs, "I4")


def test_nondecreasing_plan_is_i4():
    snap = planned_snapshot()
    spare = [b for b in snap["headroom"] if b not in snap["plan"]["dests"]]
    snap["plan"]["dests"] += spare[:1]  # as many destinations as sources
    vs = check_snapshot(snap)
    assert kinds(vs) == {"I4"} and "does not reduce the block count" in expl(vs, "I4")


def test_destination_slot_used_twice_is_i4_and_i2():
    snap = planned_snapshot()
    mv = snap["plan"]["moves"]
    mv[2][3:] = mv[1][3:]
    vs = check_snapshot(snap)
    assert "used twice (moves #1 and #2)" in expl(vs, "I4")
    assert "share destination slot" in expl(vs, "I2")


def test_overlap_with_in_flight_plan_is_i4():
    snap = planned_snapshot()
    b = snap["plan"]["sources"][0]
    snap["in_flight"] = [{"id": 99, "request": "a", "sources": [b], "dests": [30]}]
    vs = check_snapshot(snap)
    assert kinds(vs) == {"I4"} and f"overlaps in-flight plan 99 (request 'a'): block {b}" in expl(vs, "I4")
    # another request's in-flight plan on other blocks is fine
    snap["in_flight"] = [{"id": 99, "request": "b", "sources": [b + 20], "dests": [30]}]
    assert check_snapshot(snap) == []


def test_destination_outside_headroom_and_unemptied_source_are_i4():
    snap = planned_snapshot()
    snap["headroom"] = [b for b in snap["headroom"] if b not in snap["plan"]["dests"]]
    del snap["plan"]["moves"][-1]
    vs = check_snapshot(snap)
    e = expl(vs, "I4")
    assert "is not in the headroom" in e and "is not moved: the source is not emptied" in e


# ------------------------------------------------------------------------------ planted planner faults
def _plan_with(fault):
    """The faulty planner's plan, launched; returns (manager, plan)."""
    with planted(fault):
        if fault == "plan_moves_shared":
            t, a, m = shared_prefix()
        elif fault == "plan_overlaps_inflight":
            t, a, m = fragmented(latency=5, headroom=8)
            m.launch(m.plan_request("a"))  # still copying when the next plan is made
        else:
            t, a, m = fragmented()
        p = m.plan_request("a")
        assert p is not None, f"{fault}: the faulty planner made no plan"
        at_plan = check_snapshot(p.snapshot)  # post is null: before launch, before apply
        try:
            m.launch(p)
        except PlanError as e:  # the lifecycle refuses, at launch, a plan overlapping one in flight
            assert fault == "plan_overlaps_inflight" and e.code == "overlap", e
        at_launch = check_snapshot(p.snapshot)  # still before apply
        try:
            m.poll(force_sync=True)
        except (TableError, PlanError, AllocatorError):
            pass  # the table may reject the plan at apply; the checks already flagged it
    return p, at_plan, at_launch


PLANNER_FAULTS = {
    # fault: (invariant that must flag it before apply, words in the explanation, flagged at plan time)
    "plan_moves_shared": ("I4", "moves shared-prefix block", True),
    "plan_moves_tail": ("I4", "moves the tail block", True),
    "plan_nondecreasing": ("I4", "does not reduce the block count", True),
    "plan_dup_dst": ("I4", "used twice", True),
    # (free_sources_at_plan is not here: the catalogue's patch frees the sources at launch
    # without recording a free event, so no snapshot shows it; the planner machine catches it
    # from the allocator's state.)
    "plan_overlaps_inflight": ("I4", "overlaps in-flight plan", True),
}


@pytest.mark.parametrize("fault", sorted(PLANNER_FAULTS))
def test_planted_planner_fault_is_flagged_before_apply(fault):
    inv, words, at_plan_time = PLANNER_FAULTS[fault]
    p, at_plan, at_launch = _plan_with(fault)
    assert inv in kinds(at_launch) and words in expl(at_launch, inv), [str(v) for v in at_launch]
    if at_plan_time:
        assert inv in kinds(at_plan) and words in expl(at_plan, inv)
    if fault == "plan_dup_dst":
        assert "share destination slot" in expl(at_launch, "I2")


@pytest.mark.parametrize("fault", sorted(PLANNER_FAULTS))
def test_same_scenario_without_the_fault_passes(fault):
    if fault == "plan_moves_shared":
        t, a, m = shared_prefix()
    elif fault == "plan_overlaps_inflight":
        t, a, m = fragmented(latency=5, headroom=8)
        m.launch(m.plan_request("a"))
    else:
        t, a, m = fragmented()
    p = m.plan_request("a")
    if p is None:  # the correct planner declines (overlap: the request's blocks are all busy)
        assert fault == "plan_overlaps_inflight"
        return
    assert check_snapshot(p.snapshot) == []
    m.launch(p)
    m.poll(force_sync=True)
    assert check_snapshot(p.snapshot) == []


# ------------------------------------------------------------------------------ malformed snapshots
def _base():
    return applied_snapshot()


@pytest.mark.parametrize("mutate,field", [
    (lambda s: s.update(schema="vtoken.plan-snapshot/0"), "schema"),
    (lambda s: s.pop("schema"), "schema"),
    (lambda s: s["pre"]["requests"]["a"]["tokens"].__setitem__(3, [0, 3, True]), "null block"),
    (lambda s: s["pre"]["requests"]["a"]["tokens"].pop(), "length"),
    (lambda s: s["post"]["requests"]["a"].__setitem__("length", 99), "length"),
    (lambda s: s.update(block_size="4"), "block_size"),
    (lambda s: s["plan"]["moves"].__setitem__(0, [1, 2, "x", 4, 5]), "plan.moves[0]"),
    (lambda s: s["plan"]["moves"].__setitem__(0, [1, 2, 3]), "plan.moves[0]"),
    (lambda s: s["plan"]["moves"][0].__setitem__(4, S), "plan.moves[0]"),
    (lambda s: s["plan"].__setitem__("request", ["a"]), "plan.request"),
    (lambda s: s["plan"].__setitem__("sources", "1,2"), "plan.sources"),
    (lambda s: s.pop("headroom"), "headroom"),
    (lambda s: s["schedule"][2].pop("plan"), "schedule[2].plan"),
    (lambda s: s["schedule"][-1].pop("request"), "schedule[5].request"),
    (lambda s: s["schedule"].__setitem__(0, "launch"), "schedule[0]"),
    (lambda s: s["in_flight"].append({"id": 2, "request": "a", "sources": [1]}), "in_flight[0].dests"),
    (lambda s: s["post"]["requests"].__setitem__("b", s["post"]["requests"].pop("a")), "post.requests"),
    (lambda s: s["pre"]["requests"]["a"]["tokens"].__setitem__(3, [1, 3, "yes"]), "tokens[3]"),
])
def test_malformed_snapshot_raises_snapshot_error_naming_the_field(mutate, field):
    snap = _base()
    mutate(snap)
    with pytest.raises(SnapshotError) as e:
        check_snapshot(snap)
    assert field in str(e.value)


def test_unknown_check_name_is_rejected():
    with pytest.raises(ValueError):
        check_snapshot(_base(), ("I5",))


_JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-3, 40) | st.text(max_size=3),
                        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=3),
                        max_leaves=8)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_random_corruption_never_crashes_with_a_python_error(data):
    """Replace one value anywhere in a valid snapshot by junk: the checks either answer
    (a list of violations) or raise SnapshotError -- never KeyError, TypeError, ..."""
    snap = _base()
    paths = []

    def walk(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                paths.append(path + [k])
                walk(v, path + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                paths.append(path + [i])
                walk(v, path + [i])

    walk(snap, [])
    path = data.draw(st.sampled_from(paths))
    junk = data.draw(_JSONISH)
    node = snap
    for k in path[:-1]:
        node = node[k]
    if data.draw(st.booleans()) and isinstance(node, dict):
        del node[path[-1]]
    else:
        node[path[-1]] = junk
    try:
        out = check_snapshot(snap)
    except SnapshotError:
        return
    assert isinstance(out, list) and all(isinstance(v, Violation) for v in out)


def test_null_block_is_a_second_line_in_i2():
    """validate() rejects a destination or a live token in the null block; the I2 questions
    still cover them (one indexed "slot below S" question per group)."""
    from vtoken.invariants.z3_checks import _Ask, _check_i2, load_checked

    d = load_checked(applied_snapshot())
    d.dst_slot[0] = 2  # as if move #0 went to (block 0, offset 2)
    d.post_slot[3] = 1  # and token 3 ended at (block 0, offset 1)
    with _Ask() as ask:
        e = " | ".join(v.explanation for v in _check_i2(d, ask))
    assert "move #0 (token 3) is in the null block 0" in e
    assert "after the plan, live token 3 is in the null block 0" in e


def test_snapshot_checked_right_after_plan_request_has_no_schedule_yet():
    snap = planned_snapshot()
    assert snap["post"] is None and snap["schedule"] == []
    assert check_snapshot(snap) == []
    assert "post-state checks skipped" in check_and_explain(snap)
