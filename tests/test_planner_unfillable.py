"""In-place plans that never fill an ``unfillable`` block (one whose bytes a prefix-cache hash
describes): ``propose(..., unfillable=)`` obeys the reference contract (``fill_unfillable``)
and frees as many blocks as the best such plan (``spec.planner.best_reduction``); and the
shortfall (``in_place_deficit``) a driver skips a request by is never more than the evictions a
plan really needs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.invariants.plan_contract import view_of
from vtoken.errors import CallError
from vtoken.planner import in_place_deficit, propose, shortfalls, shortfalls_flat
from vtoken.spec.planner import best_reduction, plan_errors
from vtoken.table import TokenTable


def _table(S, nblocks, n, dead, seed):
    t = TokenTable(S, 64)
    t.sync_new_tokens("r", list(range(1, nblocks + 1)), n)
    rng = np.random.default_rng(seed)
    live = t.live_tokens("r")[:-1]
    if dead and len(live):
        t.evict_tokens("r", rng.choice(live, size=min(dead, len(live)), replace=False))
    return t


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(S=st.integers(2, 6), nblocks=st.integers(2, 9), fill=st.floats(0.3, 1.0), dead=st.integers(0, 40),
       seed=st.integers(0, 1000), B=st.integers(1, 8), h=st.integers(0, 4), data=st.data())
def test_in_place_with_unfillable_blocks_is_valid_and_best(S, nblocks, fill, dead, seed, B, h, data):
    """With ``h`` headroom blocks: what the fillable holes cannot take goes to whole fresh
    destinations, and the plan frees as many blocks as the reference's best mixed plan."""
    n = max(1, int(nblocks * S * fill))
    t = _table(S, nblocks, n, dead, seed)
    tail = t.tail_block("r")
    blocks = t.blocks_of("r")
    unfillable = data.draw(st.lists(st.sampled_from(blocks), unique=True), label="unfillable")
    head = list(range(nblocks + 1, nblocks + 1 + h))
    prop, _ = propose(t, "r", head, max_sources=B, tail=tail, in_place=True, unfillable=unfillable)
    view = view_of(t, "r", tail=tail, headroom=head, max_sources=B, in_place=True, unfillable=unfillable)
    best = best_reduction(view, h)
    if prop is None:
        assert best == 0, f"no plan, but one frees {best}: {view}"
        return
    plan = {"sources": prop.sources, "fills": prop.fills, "dests": prop.dests, "moves": prop.moves.tolist()}
    assert plan_errors(view, plan) == []
    assert not set(prop.fills) & set(unfillable)
    assert prop.reduction == best, (prop.reduction, best, plan, view)
    assert len(prop.dests) <= h and not (prop.dests and not set(prop.sources) & set(unfillable)), plan


def test_unfillable_blocks_emptied_into_a_destination_when_no_hole_takes_them():
    """Blocks 1 and 2 unfillable (live 1 and 2 of 4), no fillable block: without headroom no
    plan exists; with one headroom block both empty into it (two freed, one used: 1 block)."""
    t = TokenTable(4, 16)
    t.sync_new_tokens("r", [1, 2, 3], 9)
    t.evict_tokens("r", [0, 1, 2, 4, 5])  # live: block 1 {3}, block 2 {6, 7}, tail 3 {8}
    assert propose(t, "r", [], max_sources=4, tail=3, in_place=True, unfillable=[1, 2])[0] is None
    prop, _ = propose(t, "r", [9], max_sources=4, tail=3, in_place=True, unfillable=[1, 2])
    assert prop is not None and prop.sources == [1, 2] and prop.fills == [] and prop.dests == [9], prop
    assert prop.moves.tolist() == [[3, 1, 3, 9, 0], [6, 2, 2, 9, 1], [7, 2, 3, 9, 2]]


def test_the_reference_refuses_a_fill_of_an_unfillable_block():
    t = _table(4, 3, 12, 6, 0)
    prop, _ = propose(t, "r", [], max_sources=4, tail=t.tail_block("r"), in_place=True)
    assert prop is not None and prop.fills
    view = view_of(t, "r", tail=t.tail_block("r"), headroom=[], max_sources=4, in_place=True, unfillable=prop.fills)
    plan = {"sources": prop.sources, "fills": prop.fills, "dests": [], "moves": prop.moves.tolist()}
    assert any(e.startswith("fill_unfillable") for e in plan_errors(view, plan))


@pytest.mark.parametrize("seed", range(5))
def test_no_unfillable_block_plans_as_before(seed):
    t = _table(4, 8, 30, 14, seed)
    a, _ = propose(t, "r", [], max_sources=8, tail=t.tail_block("r"), in_place=True)
    b, _ = propose(t, "r", [], max_sources=8, tail=t.tail_block("r"), in_place=True, unfillable=[])
    assert (a is None) == (b is None) and (a is None or (a.sources, a.fills) == (b.sources, b.fills))


def test_an_unfillable_block_left_over_is_never_the_fill():
    """Blocks 1 and 2 unfillable (live 1 and 2), block 3 fillable (live 3, one hole): the one
    hole takes block 1's token; block 2, emptier than block 3, is still never filled."""
    t = TokenTable(4, 16)
    t.sync_new_tokens("r", [1, 2, 3, 4], 13)
    t.evict_tokens("r", [0, 1, 2, 4, 5, 8])  # live: block 1 {3}, block 2 {6, 7}, block 3 {9, 10, 11}, tail {12}
    prop, _ = propose(t, "r", [], max_sources=4, tail=4, in_place=True, unfillable=[1, 2])
    assert prop is not None and prop.sources == [1] and prop.fills == [3], prop
    assert prop.moves.tolist() == [[3, 1, 3, 3, 0]]


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(S=st.integers(2, 6), nblocks=st.integers(2, 9), fill=st.floats(0.3, 1.0), dead=st.integers(0, 40),
       seed=st.integers(0, 1000), B=st.integers(1, 8), h=st.integers(0, 3), keep=st.booleans(), data=st.data())
def test_no_plan_exists_before_the_shortfall_in_evictions(S, nblocks, fill, dead, seed, B, h, keep, data):
    """``in_place_deficit`` is 0 exactly when ``propose`` (in place, with or without unfillable
    blocks) finds a plan; when it is d > 0, no choice of fewer than d further evictions of the
    request's live tokens (the tail's included) lets ``propose`` find one: the adapter skips
    such a request until it evicted d tokens, so a larger figure would lose plans."""
    n = max(1, int(nblocks * S * fill))
    t = _table(S, nblocks, n, dead, seed)
    tail = t.tail_block("r")
    unfillable = data.draw(st.lists(st.sampled_from(t.blocks_of("r")), unique=True), label="unfillable") if keep else []
    head = list(range(nblocks + 1, nblocks + 1 + h))
    kw = dict(max_sources=B, tail=tail, unfillable=unfillable)
    d = in_place_deficit(t, "r", max_dests=h if keep else 0, **kw)
    prop, _ = propose(t, "r", head, in_place=True, **kw)
    assert (d == 0) == (prop is not None), (d, prop)
    if d <= 1:
        return
    live = t.live_tokens("r").tolist()
    k = data.draw(st.integers(1, min(d - 1, len(live))), label="evictions") if live else 0
    if k:
        t.evict_tokens("r", data.draw(st.lists(st.sampled_from(live), min_size=k, max_size=k, unique=True),
                                      label="evicted"))
    assert propose(t, "r", head, in_place=True, **kw)[0] is None, f"a plan after {k} < {d} evictions"
    assert in_place_deficit(t, "r", max_dests=h if keep else 0, **kw) >= d - k


def test_the_shortfall_counts_the_cheapest_source_against_the_fillable_holes():
    """S = 4: block 1 unfillable with 3 live, block 2 fillable with 2 live (2 holes), tail 3.
    Emptying 1 needs 3 holes, emptying 2 needs 4 (its own no longer count), and a destination
    never pays (two sources cost 7 slots, 2 holes + one block take 6): one eviction short."""
    t = TokenTable(4, 16)
    t.sync_new_tokens("r", [1, 2, 3], 9)
    t.evict_tokens("r", [0, 4, 5])  # block 1 {1, 2, 3}, block 2 {6, 7}, tail 3 {8}
    kw = dict(max_sources=4, tail=3, unfillable=[1])
    assert in_place_deficit(t, "r", max_dests=0, **kw) == 1 == in_place_deficit(t, "r", max_dests=1, **kw)
    assert propose(t, "r", [9], in_place=True, **kw)[0] is None
    t.evict_tokens("r", [6])  # a third hole in block 2
    assert in_place_deficit(t, "r", max_dests=0, **kw) == 0
    assert propose(t, "r", [], in_place=True, **kw)[0] is not None


def test_a_destination_lowers_the_shortfall_when_two_sources_share_it():
    """Blocks 1-3 unfillable with one live token each, no fillable hole: without a destination
    a plan waits for a block to die (one eviction); with one, all three empty into it now."""
    t = TokenTable(4, 16)
    t.sync_new_tokens("r", [1, 2, 3, 4], 13)
    t.evict_tokens("r", [0, 1, 2, 4, 5, 6, 8, 9, 10])  # live 3, 7, 11 and the tail's 12
    kw = dict(max_sources=4, tail=4, unfillable=[1, 2, 3])
    assert in_place_deficit(t, "r", max_dests=0, **kw) == 1
    assert in_place_deficit(t, "r", max_dests=1, **kw) == 0
    assert propose(t, "r", [9], in_place=True, **kw)[0].reduction == 2  # all three into one block
    t.evict_tokens("r", [3])  # block 1 all dead: a source that costs nothing
    assert in_place_deficit(t, "r", max_dests=0, **kw) == 0


_COUNTS = st.lists(st.integers(0, 6), max_size=6)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(reqs=st.lists(st.tuples(_COUNTS, _COUNTS, st.integers(-1, 3)), min_size=1, max_size=6),
       S=st.integers(1, 6), B=st.integers(1, 5))
def test_the_batched_shortfalls_are_each_requests_own(reqs, S, B):
    """``shortfalls`` of many requests (what a plan check re-checks at once) gives each the
    figure it has alone: no request's blocks, holes or destinations count for another (live
    counts above S included: never candidates), with and without destinations in the batch."""
    fill = [np.minimum(np.array(f, dtype=np.int64), S) for f, _, _ in reqs]
    unfill = [np.minimum(np.array(u, dtype=np.int64), S) for _, u, _ in reqs]
    dests = [d for _, _, d in reqs]
    alone = [int(shortfalls([f], [u], S, B, [d])[0]) for f, u, d in zip(fill, unfill, dests)]
    assert shortfalls(fill, unfill, S, B, dests).tolist() == alone
    no_dests = [int(shortfalls([f], [u], S, B, [0])[0]) for f, u in zip(fill, unfill)]
    assert shortfalls(fill, unfill, S, B, [0] * len(reqs)).tolist() == no_dests


def test_a_request_without_candidates_is_a_whole_block_short_and_bad_lengths_are_refused():
    assert shortfalls([np.array([4, 4])], [np.array([], dtype=np.int64)], 4, 2, [1]).tolist() == [4]
    assert shortfalls([], [], 4, 2, []).tolist() == []
    with pytest.raises(CallError, match="2 fillable, 1 unfillable"):
        shortfalls([np.array([1]), np.array([2])], [np.array([1])], 4, 2, [0, 0])
    for args in (([1, 2], [1], [0], [0]), ([1, 2], [1], [1, 1], [0]), ([1, 2, 3], [1], [1], [0])):
        with pytest.raises(CallError) as e:  # sizes that disagree: named, not a numpy broadcast error
            shortfalls_flat(np.array(args[0]), args[1], args[2], 4, 2, args[3])
        assert e.value.code == "bad_shape"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 8), max_size=6), st.lists(st.integers(0, 8), max_size=6), st.integers(1, 4))
def test_without_destinations_the_shortfall_is_the_two_figures_formula(fill, unfill, B):
    """``in_place_shortfall(least, holes)`` (what the adapter's skip records keep) is
    ``shortfall`` with no destination, for any live counts (S = 8), and both are the
    definition written out: the cheapest one source (an unfillable candidate costs its live
    tokens, a fillable one S) against the fillable holes; S with no candidate."""
    from vtoken.planner import in_place_shortfall, shortfall

    S = 8
    f, u = np.array(fill, dtype=np.int64), np.array(unfill, dtype=np.int64)
    least = min(int(u.min()), S) if len(u) else S
    holes = S * len(f) - int(f.sum())
    costs = [x for x in unfill if x < S] + [S for x in fill if x < S]
    want = max(min(costs) - holes, 0) if costs else S
    assert int(in_place_shortfall(least, holes, S)) == shortfall(f, u, S, B, 0) == want
