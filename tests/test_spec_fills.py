"""The reference planner contract's in-place rules (``vtoken.spec.planner``: ``fills``, the
holes of the request's own private blocks; the view's ``in_place`` mode; ``best_reduction``
in place).

Each rule is broken by a hand-made plan on one hand-made view, and the codes reported are
exactly the ones expected (where breaking a rule necessarily breaks another, both are
listed). Random small views then check ``best_reduction`` against the closed forms and
that a plan built by the placement rule at the optimum is valid.
"""

import random

import pytest

from vtoken.spec.planner import best_reduction, eligible_sources, holes_in, live_in, plan_errors

pytestmark = pytest.mark.invariants


def _view(in_place=True):
    # S = 4; token ids by block, in this order:
    #   9  (shared, refs 2)  tokens 0-3    live . x x x   one hole (offset 0), but shared
    #   3  (private)         tokens 4-7    live . x x .   2 live: tokens 5 (3,1), 6 (3,2)
    #   4  (private)         tokens 8-11   live x x x .   1 hole: offset 3
    #   5  (private)         tokens 12-15  live x . x .   2 live: 12 (5,0), 14 (5,2); holes 1, 3
    #   7  (private)         tokens 16-19  live . . . .   all dead
    #   10 (in flight)       tokens 20-23  live x . . .
    #   11 (excluded)        tokens 24-27  live x . . .
    #   6  (the tail)        tokens 28-31  live x x . x   a hole at 2, but the tail
    masks = [(9, "-xxx"), (3, "-xx-"), (4, "xxx-"), (5, "x-x-"), (7, "----"), (10, "x---"), (11, "x---"),
             (6, "xx-x")]
    toks = [[b, o, c == "x"] for b, m in masks for o, c in enumerate(m)]
    v = {"S": 4, "num_blocks": 16, "max_sources": 4, "tokens": toks, "blocks": [3, 4, 5, 6, 7, 9, 10, 11],
         "refs": {3: 1, 4: 1, 5: 1, 6: 1, 7: 1, 9: 2, 10: 1, 11: 1}, "tail": 6, "in_flight": [10, 12],
         "headroom": [1, 2], "excluded": [11]}
    if in_place is not None:
        v["in_place"] = in_place
    return v


# a valid in-place plan: block 3's two live tokens into the holes of 4 (offset 3), then of 5 (offset 1)
GOOD = {"sources": [3], "fills": [4, 5], "dests": [], "moves": [[5, 3, 1, 4, 3], [6, 3, 2, 5, 1]]}
# a valid mixed plan: 3 and 5 emptied, the one hole of 4 first, then a fresh destination
MIXED = {"sources": [3, 5], "fills": [4], "dests": [1],
         "moves": [[5, 3, 1, 4, 3], [6, 3, 2, 1, 0], [12, 5, 0, 1, 1], [14, 5, 2, 1, 2]]}
# the paper's out-of-place plan: valid in either mode (in place allows fills, it does not require them)
OUT = {"sources": [3, 5], "dests": [1], "moves": [[5, 3, 1, 1, 0], [6, 3, 2, 1, 1], [12, 5, 0, 1, 2], [14, 5, 2, 1, 3]]}


def codes(view, plan):
    return {e.split(":")[0] for e in plan_errors(view, plan)}


def test_valid_plans_are_accepted():
    v = _view()
    assert plan_errors(v, GOOD) == []
    assert plan_errors(v, MIXED) == []
    assert plan_errors(v, OUT) == []
    assert plan_errors(_view(in_place=False), OUT) == []
    assert plan_errors(_view(in_place=None), OUT) == []
    # the all-dead block freed alongside, no move for it
    assert plan_errors(v, dict(GOOD, sources=[3, 7])) == []
    assert plan_errors(v, {"sources": [7], "fills": [], "dests": [], "moves": []}) == []


@pytest.mark.parametrize("in_place", [False, None])
def test_fills_are_refused_out_of_place(in_place):
    v = _view(in_place=in_place)  # None: the key absent, which means out of place
    assert codes(v, GOOD) == {"fill_not_allowed"}
    assert codes(v, MIXED) == {"fill_not_allowed"}
    assert codes(v, dict(OUT, fills=[])) == set()  # an empty fills list is no fill


def _with(base, **kw):
    p = {k: [list(m) for m in v] if k == "moves" else list(v) for k, v in base.items()}
    p.update(kw)
    return p


CASES = [
    # -- eligibility of a fill (the second move lands on the named fill's first hole)
    ("duplicate_fill", _with(GOOD, fills=[4, 5, 5]), {"duplicate_fill"}),
    ("fill_not_owned", _with(GOOD, fills=[4, 13], moves=[[5, 3, 1, 4, 3], [6, 3, 2, 13, 0]]), {"fill_not_owned"}),
    ("fill_shared", _with(GOOD, fills=[4, 9], moves=[[5, 3, 1, 4, 3], [6, 3, 2, 9, 0]]), {"fill_shared"}),
    ("fill_tail", _with(GOOD, fills=[4, 6], moves=[[5, 3, 1, 4, 3], [6, 3, 2, 6, 2]]), {"fill_tail"}),
    ("fill_in_flight", _with(GOOD, fills=[4, 10], moves=[[5, 3, 1, 4, 3], [6, 3, 2, 10, 1]]), {"fill_in_flight"}),
    ("fill_excluded", _with(GOOD, fills=[4, 11], moves=[[5, 3, 1, 4, 3], [6, 3, 2, 11, 1]]), {"fill_excluded"}),
    ("fill_is_source", _with(GOOD, fills=[3], moves=[[5, 3, 1, 3, 0], [6, 3, 2, 3, 3]]), {"fill_is_source"}),
    # a block cannot be both the request's (a fill) and a fresh headroom block: block 1 is the
    # headroom's, so it is not owned; its 4 holes then need no destination at all
    ("fill_is_dest", _with(MIXED, fills=[4, 1], moves=[[5, 3, 1, 4, 3], [6, 3, 2, 1, 0], [12, 5, 0, 1, 1],
                                                       [14, 5, 2, 1, 2]]),
     {"fill_is_dest", "fill_not_owned", "dest_count"}),
    ("null_fill", _with(GOOD, fills=[4, 0], moves=[[5, 3, 1, 4, 3], [6, 3, 2, 0, 0]]), {"null_fill"}),
    # -- slots: every target of the placement is a hole, so an occupied slot is out of order too
    ("slot_occupied", _with(GOOD, moves=[[5, 3, 1, 4, 3], [6, 3, 2, 5, 0]]), {"slot_occupied", "fill_order"}),
    ("move_to_unlisted_dest", _with(GOOD, fills=[4]), {"move_to_unlisted_dest", "fill_order", "dest_count"}),
    ("duplicate_slot", _with(GOOD, moves=[[5, 3, 1, 4, 3], [6, 3, 2, 4, 3]]),
     {"duplicate_slot", "fill_order", "fill_count"}),  # (4, 3) twice: out of order, and 5 left idle
    # -- placement: holes ascending, fill after fill in the listed order, then whole destinations
    ("fill_order", _with(GOOD, moves=[[5, 3, 1, 4, 3], [6, 3, 2, 5, 3]]), {"fill_order"}),  # skips hole (5, 1)
    ("fill_order", _with(GOOD, fills=[5, 4]), {"fill_order"}),  # 5's holes come first now
    ("fill_order", _with(GOOD, moves=[[5, 3, 1, 5, 1], [6, 3, 2, 4, 3]]), {"fill_order"}),  # not logical order
    ("fill_order", _with(MIXED, moves=[[5, 3, 1, 1, 0], [6, 3, 2, 4, 3], [12, 5, 0, 1, 1], [14, 5, 2, 1, 2]]),
     {"fill_order"}),  # a destination before the fill's hole
    ("fill_count", _with(GOOD, fills=[5, 4], moves=[[5, 3, 1, 5, 1], [6, 3, 2, 5, 3]]), {"fill_count"}),
    ("dest_count", _with(GOOD, sources=[3, 7], dests=[1]), {"dest_count"}),  # the holes sufficed
    ("dest_count", _with(MIXED, sources=[3, 5, 7], dests=[]), {"dest_count", "move_to_unlisted_dest", "fill_order"}),
    ("dest_count", _with(MIXED, sources=[3, 5, 7], dests=[1, 2]), {"dest_count"}),
    ("not_reducing", _with(GOOD, sources=[7], fills=[], moves=[], dests=[1]), {"not_reducing", "dest_count"}),
    # -- the old rules still hold with fills
    ("source_not_emptied", _with(GOOD, fills=[4], moves=[[5, 3, 1, 4, 3]]), {"source_not_emptied"}),
    ("move_not_from_source", _with(GOOD, moves=GOOD["moves"] + [[12, 5, 0, 5, 3]]), {"move_not_from_source"}),
]


@pytest.mark.parametrize("code,plan,want", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_rule_is_named(code, plan, want):
    assert code in want
    assert codes(_view(), plan) == want, plan_errors(_view(), plan)


def test_holes_are_the_slots_without_a_live_token():
    v = _view()
    assert [holes_in(v, b) for b in (3, 4, 5, 7, 9)] == [[0, 3], [3], [1, 3], [0, 1, 2, 3], [0]]
    assert eligible_sources(v) == [3, 4, 5, 7]  # not the tail 6, shared 9, in-flight 10, excluded 11


def test_best_reduction_in_place_on_the_worked_view():
    v = _view()
    # eligible 3, 4, 5, 7 hold 2 + 1 + 2 + 4 = 9 holes: floor(9 / 4) = 2 blocks, no destination
    for md in range(4):
        assert best_reduction(v, md) == 2
    assert plan_errors(v, _with(GOOD, sources=[3, 7])) == []  # the plan reaching it
    v["max_sources"] = 1
    assert best_reduction(v, 0) == 1
    out = _view(in_place=False)
    # out of place: 7 is free with no destination; 3 + 5 (4 live) need one more
    assert [best_reduction(out, md) for md in range(3)] == [1, 2, 2]


# ------------------------------------------------------------------ random small views
def random_view(rng: random.Random) -> dict:
    S = rng.choice([1, 2, 3, 4])
    nb = rng.randint(1, 7)
    blocks = rng.sample(range(1, 20), nb)
    toks, refs = [], {}
    for b in blocks:
        p = rng.random()
        toks += [[b, o, rng.random() < p] for o in range(S)]
        refs[b] = 1 if rng.random() < 0.8 else 2
    tail = rng.choice(blocks + [None])
    others = [b for b in blocks if b != tail]
    in_flight = [b for b in others if rng.random() < 0.1] + [21]
    excluded = [b for b in others if rng.random() < 0.1]
    return {"S": S, "num_blocks": 30, "max_sources": rng.randint(1, 4), "tokens": toks, "blocks": sorted(blocks),
            "refs": refs, "tail": tail, "in_flight": in_flight, "headroom": [22, 23, 24, 25], "excluded": excluded,
            "in_place": True}


def build_plan(view, sources, fills, n_dests=None):
    """The plan the placement rule gives for these sources and fills (destinations from the
    headroom, as many as the rule needs unless ``n_dests`` says)."""
    S, toks = view["S"], view["tokens"]
    moved = [t for t, (b, _, live) in enumerate(toks) if live and b in sources]
    targets = [(b, o) for b in fills for o in holes_in(view, b)]
    n_holes = len(targets)
    need = -(-max(0, len(moved) - n_holes) // S) if n_dests is None else n_dests
    dests = view["headroom"][:need]
    targets += [(d, o) for d in dests for o in range(S)]
    moves = [[t, toks[t][0], toks[t][1], *targets[k]] for k, t in enumerate(moved)]
    return {"sources": sorted(sources), "fills": list(fills), "dests": dests, "moves": moves}


def test_best_reduction_in_place_is_the_closed_form_and_is_reached():
    rng = random.Random(20261201)
    for _ in range(400):
        v = random_view(rng)
        S, B = v["S"], v["max_sources"]
        E = eligible_sources(v)
        H = sum(S - live_in(v, b) for b in E)
        closed = min(B, H // S)
        for md in range(4):
            assert best_reduction(v, md) == closed, (v, md)
        if closed == 0:
            continue
        # the optimum with no destination: the fewest-live blocks as sources, the next as fills
        order = sorted(E, key=lambda b: (live_in(v, b), b))
        src, rest = order[:closed], [b for b in order[closed:] if holes_in(v, b)]
        T = sum(live_in(v, b) for b in src)
        fills, room = [], 0
        for b in rest:
            if room >= T:
                break
            fills.append(b)
            room += len(holes_in(v, b))
        plan = build_plan(v, src, fills)
        assert plan["dests"] == [] and plan_errors(v, plan) == [], (v, plan, plan_errors(v, plan))
        assert len(plan["sources"]) - len(plan["dests"]) == best_reduction(v, 0)
        assert codes(dict(v, in_place=False), plan) <= {"fill_not_allowed"}


def test_random_valid_plans_never_beat_best_reduction():
    """Any source set, with the rule's fills and destinations, is valid (when it reduces)
    and reduces by at most ``best_reduction``; the out-of-place brute force agrees with
    the fewest-live prefix rule."""
    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        v = random_view(rng)
        S, B = v["S"], v["max_sources"]
        E = eligible_sources(v)
        if not E:
            continue
        src = rng.sample(E, rng.randint(1, min(B, len(E))))
        rest = [b for b in E if b not in src and holes_in(v, b)]
        rng.shuffle(rest)
        T = sum(live_in(v, b) for b in src)
        fills, room = [], 0
        for b in rest:
            if room >= T:
                break
            fills.append(b)
            room += len(holes_in(v, b))
        plan = build_plan(v, src, fills)
        red = len(plan["sources"]) - len(plan["dests"])
        errs = codes(v, plan)
        if red > 0:
            assert errs == set(), (v, plan, plan_errors(v, plan))
            assert red <= best_reduction(v, len(plan["dests"]))
            checked += 1
        else:
            assert errs == {"not_reducing"}
        # out of place: the brute force equals the best fewest-live prefix
        out = dict(v, in_place=False)
        lives = sorted(live_in(v, b) for b in E)[:B]
        for md in range(4):
            want = max([0] + [k - -(-sum(lives[:k]) // S) for k in range(1, len(lives) + 1)
                              if -(-sum(lives[:k]) // S) <= md])
            assert best_reduction(out, md) == want
    assert checked > 50


# ------------------------------------------------------------------ the callers' plumbing
class InPlacePlanner:
    """A planner written from the contract alone: the fewest-live blocks as sources, the
    next ones as fills, no destination (the protocol machine gives it in-place views)."""

    OPTIMAL = True
    in_place = True

    def propose(self, view, max_dests):
        assert view["in_place"] is True
        S, E = view["S"], eligible_sources(view)
        m = min(view["max_sources"], sum(S - live_in(view, b) for b in E) // S)
        if m == 0:
            return None
        order = sorted(E, key=lambda b: (live_in(view, b), b))
        T = sum(live_in(view, b) for b in order[:m])
        fills, room = [], 0
        for b in order[m:]:
            if room >= T:
                break
            if holes_in(view, b):
                fills.append(b)
                room += len(holes_in(view, b))
        return build_plan(view, order[:m], fills)


def test_the_protocol_machine_checks_an_in_place_planner():
    from hypothesis import settings
    from hypothesis.stateful import run_state_machine_as_test

    from vtoken.fuzz.protocol import planner_machine_for

    run_state_machine_as_test(planner_machine_for(InPlacePlanner), settings=settings(max_examples=40, deadline=None))


def test_check_proposal_passes_fills_and_the_mode():
    from types import SimpleNamespace

    import numpy as np

    from vtoken import TokenTable
    from vtoken.invariants.plan_contract import check_proposal
    from vtoken.invariants.table_checks import InvariantViolation

    t = TokenTable(4, 16)
    t.sync_new_tokens("r", [2, 3, 4], 12)
    t.evict_tokens("r", [0, 1, 2, 7])  # block 2: one live (token 3 at offset 3); block 3: a hole at 3; 4 the tail
    moves = np.array([[3, 2, 3, 3, 3]], dtype=np.int64)
    p = SimpleNamespace(sources=[2], fills=[3], dests=[], moves=moves, reduction=1)
    kw = dict(table=t, req_id="r", proposal=p, tail=4, headroom=[1], max_sources=4)
    v = check_proposal(**kw, in_place=True)
    assert v["in_place"] is True
    with pytest.raises(InvariantViolation, match="fill_not_allowed"):
        check_proposal(**kw)  # the default is the out-of-place contract
    with pytest.raises(InvariantViolation, match="fill_in_flight"):
        check_proposal(**kw, in_place=True, in_flight=[3])  # another plan's fill
    old = SimpleNamespace(sources=[2], dests=[1], moves=np.array([[3, 2, 3, 1, 0]], dtype=np.int64), reduction=0)
    with pytest.raises(InvariantViolation, match="not_reducing"):
        check_proposal(**dict(kw, proposal=old))  # a proposal with no fills attribute still reads
