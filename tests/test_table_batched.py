"""``TokenTable.sync_one_each`` / ``evict_one_each`` (a decode step's growth and evictions in one
call each) do exactly what the single calls do one by one, refuse what they refuse, and change
nothing when they refuse."""

from __future__ import annotations

import numpy as np
import pytest

from vtoken.errors import TableError
from vtoken.table import TokenTable


def _pair(seed: int, R: int = 6, S: int = 4, device="cpu"):
    """Two equal tables with R requests of random lengths (request r owns blocks 10r+1..);
    the second's read-side cache on ``device`` (None: none, reads from the host)."""
    rng = np.random.default_rng(seed)
    a, b = TokenTable(S, 128), TokenTable(S, 128, device=device)
    lists = {}
    for i in range(R):
        r = f"r{i}"
        lists[r] = list(range(10 * i + 1, 10 * i + 10))
        n = int(rng.integers(1, 20))
        for t in (a, b):
            t.sync_new_tokens(r, lists[r], n)
    shared = [1, 2]  # r5 shares r0's first two blocks (a prefix hit): its first 8 tokens there
    for t in (a, b):
        t.free_request("r5")
        t.sync_new_tokens("r5", shared + [60, 61, 62], 8)
    lists["r5"] = shared + [60, 61, 62]
    return a, b, lists, rng


def _rows_agree(t):
    """The batched per-request reads (the planner's ``reclaim_inputs_many``, ``dead_counts``)
    equal the one-request reads they batch."""
    rids = t.requests()
    many = t.reclaim_inputs_many(rids)
    for i, r in enumerate(rids):
        assert tuple(int(col[i]) for col in many) == tuple(int(x) for x in t.reclaim_inputs(r)), r
    assert t.dead_counts(rids).tolist() == [t.length(r) - t.num_live(r) for r in rids]


def _same(a, b):
    _rows_agree(a), _rows_agree(b)
    assert a.export_state() == b.export_state()
    rids = a.requests()  # the per-request counts (lengths, live tokens, blocks) besides the arrays
    assert [tuple(map(int, x)) for x in zip(*a.reclaim_inputs_many(rids))] == \
        [tuple(map(int, x)) for x in zip(*b.reclaim_inputs_many(rids))]
    assert a.dead_counts(rids).tolist() == b.dead_counts(rids).tolist() and a.num_dead_tokens == b.num_dead_tokens
    assert [a.num_live(r) for r in rids] == [b.num_live(r) for r in rids]
    assert a.take_changed() == b.take_changed() and a.take_emptied() == b.take_emptied()
    assert a.waste_ratio() == b.waste_ratio() and a.num_live_slots == b.num_live_slots


@pytest.mark.parametrize("device", ["cpu", None])
@pytest.mark.parametrize("seed", range(8))
def test_batched_growth_and_evictions_equal_the_single_calls(seed, device):
    """``device=None``: the replica's host-only table (no read-side cache) answers reads the same."""
    a, b, lists, rng = _pair(seed, device=device)
    for _ in range(30):
        reqs = [r for r in lists if rng.random() < 0.7]
        victims = []
        for r in reqs:
            live = a.live_tokens(r)
            if len(live) > 1 and rng.random() < 0.6:
                victims.append((r, int(rng.choice(live[:-1]))))
        for r, x in victims:
            a.evict_tokens(r, [x])
        b.evict_one_each([r for r, _ in victims], [x for _, x in victims])
        _same(a, b)
        grow = [r for r in reqs if (a.length(r) + 1) <= len(lists[r]) * a.S]
        want = [a.sync_new_tokens(r, lists[r], a.length(r) + 1)[0] for r in grow]
        got = b.sync_one_each(grow, [lists[r][b.length(r) // b.S] for r in grow])
        assert got.tolist() == want
        _same(a, b)
    a.flush(), b.flush()
    for r in lists:  # the read path (the device mirror, or the host arrays) agrees too
        assert a.slot_mapping(r).tolist() == b.slot_mapping(r).tolist()
        assert [x.tolist() for x in a.read_view(r)] == [x.tolist() for x in b.read_view(r)]


@pytest.mark.parametrize("case", ["twice", "null", "range", "conflict", "unknown"])
def test_a_refused_batched_growth_changes_nothing(case):
    _, t, lists, _ = _pair(0)
    before = t.export_state()
    reqs = ["r0", "r1"]
    blocks = [lists[r][t.length(r) // t.S] for r in reqs]
    if case == "twice":
        reqs, blocks = ["r0", "r0"], [blocks[0]] * 2
    elif case == "null":
        blocks[1] = 0
    elif case == "range":
        blocks[1] = 999
    elif case == "conflict":
        blocks[1] = lists["r0"][0]  # another request's block: its slot is held
    else:
        reqs = ["r0", "nobody"]
    code = {"twice": "slot_conflict", "null": "null_block", "range": "block_out_of_range", "conflict": "slot_conflict",
            "unknown": "unknown_request"}[case]
    with pytest.raises(TableError, match=code):
        t.sync_one_each(reqs, blocks)
    assert t.export_state() == before


@pytest.mark.parametrize("case", ["dead", "unknown_token", "twice"])
def test_a_refused_batched_eviction_changes_nothing(case):
    _, t, _, _ = _pair(1)
    t.evict_tokens("r1", [0])
    before = t.export_state()
    reqs, toks = ["r0", "r1"], [0, 0 if case == "dead" else 1]
    if case == "unknown_token":
        toks[1] = 10_000
    if case == "twice":
        reqs = ["r0", "r0"]
    with pytest.raises(TableError, match={"dead": "dead_token", "unknown_token": "unknown_token",
                                          "twice": "duplicate_token"}[case]):
        t.evict_one_each(reqs, toks)
    assert t.export_state() == before


@pytest.mark.parametrize("device", ["cpu", None])
def test_one_shared_slot_evicted_by_both_sharers_in_one_step(device):
    """Two requests sharing a prefix block evict the same shared token in one batch (the slot's
    claims go 2 -> 0): counted once, and the block emptied for whoever left it empty, as one
    by one."""
    a, b = TokenTable(4, 16), TokenTable(4, 16, device=device)
    for t in (a, b):
        t.sync_new_tokens("x", [1, 2], 6)
        t.sync_new_tokens("y", [1, 3], 6)  # y's first 4 tokens are x's (block 1 shared)
        for r in ("x", "y"):
            t.evict_tokens(r, [0, 1, 2])
    a.evict_tokens("x", [3])
    a.evict_tokens("y", [3])
    b.evict_one_each(["x", "y"], [3, 3])
    _same(a, b)
    assert a.export_state()["blocks"][1]["live"] == 0


@pytest.mark.parametrize("seed", range(6))
def test_batched_growth_after_releases_and_frees(seed):
    """A request whose tail block was released (all its tokens evicted), or whose row is reused
    after a free: the batched growth's shortcut (the block of its previous token is one it
    holds) must not believe a block it gave up; the batched reads agree throughout."""
    a, b, lists, rng = _pair(seed)
    for step in range(40):
        for r in a.requests():
            dead = a.releasable_blocks(r).tolist()
            if dead and rng.random() < 0.5:
                for t in (a, b):
                    t.release_empty_blocks(r, dead)
        _same(a, b)
        if step % 7 == 3:  # a request leaves and a new one takes its row
            gone = sorted(a.requests())[int(rng.integers(0, len(a.requests())))]
            for t in (a, b):
                t.free_request(gone)
            lists[gone] = list(range(70 + step % 5 * 10, 80 + step % 5 * 10))
            n = int(rng.integers(1, 9))
            for t in (a, b):
                t.sync_new_tokens(gone, lists[gone], n)
            _same(a, b)
        reqs = [r for r in lists if rng.random() < 0.7]
        victims = [(r, int(x)) for r in reqs for x in a.live_tokens(r)[:int(rng.integers(0, 5))]]
        for r, x in victims:
            a.evict_tokens(r, [x])
            b.evict_tokens(r, [x])
        grow = [r for r in reqs if a.length(r) + 1 <= len(lists[r]) * a.S]
        want = [a.sync_new_tokens(r, lists[r], a.length(r) + 1)[0] for r in grow]
        got = b.sync_one_each(grow, [lists[r][b.length(r) // b.S] for r in grow])
        assert got.tolist() == want
        _same(a, b)


def test_the_block_set_version_changes_exactly_when_the_block_set_does():
    """``block_versions`` (what the adapter's plan skip compares): the same while a request only
    grows inside its blocks or evicts; one more per block referenced or released (the skip reads
    "one more and one block more" as "one block added"); another after a freed row is reused."""
    t = TokenTable(4, 64)
    t.sync_new_tokens("a", [1, 2, 3], 2)
    t.sync_new_tokens("b", [5, 6], 1)
    v = t.block_versions(["a", "b"]).tolist()
    t.sync_one_each(["a", "b"], [1, 5])  # inside block 1 and block 5
    t.evict_one_each(["a", "b"], [0, 0])
    assert t.block_versions(["a", "b"]).tolist() == v
    t.sync_new_tokens("a", [1, 2, 3], 5)  # token 4 opens block 2
    assert t.block_versions(["a"])[0] == v[0] + 1 and t.block_versions(["b"])[0] == v[1]
    t.sync_new_tokens("a", [1, 2, 3, 4, 8], 16)  # blocks 3 and 4 opened by one sync
    assert t.block_versions(["a"])[0] == v[0] + 3
    v_b = t.block_versions(["b"])[0]
    t.evict_tokens("b", [1])
    t.release_empty_blocks("b", [5])  # b's only block, all dead
    assert t.block_versions(["b"])[0] == v_b + 1
    old = {int(x) for x in t.block_versions(["b"])}
    t.free_request("b")
    t.sync_new_tokens("c", [7], 1)  # takes b's row
    assert int(t.block_versions(["c"])[0]) not in old
    with pytest.raises(TableError) as e:
        t.block_versions(["b"])
    assert e.value.code == "unknown_request"


def test_present_keeps_the_ids_in_the_table_in_order_and_names_an_unhashable_one():
    t = TokenTable(4, 16)
    t.sync_new_tokens("a", [1], 2)
    t.sync_new_tokens("c", [2], 1)
    assert t.present(["c", "b", "a", "c"]) == ["c", "a", "c"] and t.present(set()) == []
    with pytest.raises(TableError) as e:
        t.present(["a", ["x"]])
    assert e.value.code == "bad_request_id"


def test_the_drops_log_names_every_fall_of_a_blocks_live_count():
    """``TokenTable.drops`` (opt-in): after evictions by every path (one each, several, one at a
    time), a move and a free, the blocks it logged, counted, are exactly how far each block's
    live count fell; off (None) by default, so nothing piles up for a table nobody reads."""
    from collections import Counter

    t = TokenTable(4, 32)
    assert t.drops is None
    t.sync_new_tokens("a", [1, 2, 3], 10)
    t.sync_new_tokens("b", [5, 6], 6)
    t.drops = []
    before = t.n_b.copy()
    t.evict_one_each(["a", "b"], [0, 4])  # blocks 1 and 6
    t.evict_tokens("a", [1, 5])  # blocks 1 and 2
    t.evict_tokens("b", [0])  # one id: the scalar path (block 5)
    t.apply_moves("a", [[9, 3, 1, 1, 0]])  # token 9 out of block 3 into block 1's hole
    t.free_request("b")
    drops = Counter(np.hstack(t.drops).tolist())
    rose = {1: 1}  # the moved token's landing: the only rise
    fell = {b: int(before[b] - t.n_b[b]) + rose.get(b, 0) for b in range(32)}
    assert drops == Counter({b: n for b, n in fell.items() if n})
    assert drops[1] == 2 and drops[3] == 1 and drops[5] == 4 and drops[6] == 2  # b freed with 4 live


def test_the_reblocked_log_names_the_requests_whose_block_set_changed():
    """``TokenTable.reblocked`` (opt-in): growth that opens a block, a move out of a block, a
    release and a free are logged; growth inside a block and evictions (liveness only) are
    not; off (None) by default, so nothing piles up for a table nobody reads."""
    t = TokenTable(4, 32)
    assert t.reblocked is None and t.take_reblocked() == set()
    t.sync_new_tokens("a", [1, 2, 3], 6)
    t.sync_new_tokens("b", [5, 6], 6)
    t.sync_new_tokens("c", [7], 2)
    assert t.take_reblocked() == set()  # off: nothing kept
    t.reblocked = set()
    t.sync_one_each(["a", "b", "c"], [2, 6, 7])  # tokens 6, 6 and 2: inside blocks they hold
    t.evict_one_each(["a", "b"], [0, 1])
    t.evict_tokens("c", [0])
    assert t.take_reblocked() == set()
    t.sync_one_each(["a", "b"], [2, 6])  # token 7 of a, 7 of b: still inside
    t.sync_one_each(["a"], [3])  # token 8 of a opens block 3
    assert t.take_reblocked() == {"a"} and t.take_reblocked() == set()
    t.evict_tokens("b", [0, 2, 3])  # block 5 all dead
    assert t.take_reblocked() == set()
    t.release_empty_blocks("b", [5])
    t.apply_moves("a", [[8, 3, 0, 1, 0]])  # a's only token in block 3 into block 1's hole: 3 left
    assert t.take_reblocked() == {"a", "b"}
    t.free_request("c")
    assert t.take_reblocked() == {"c"}


@pytest.mark.parametrize("seed", range(4))
def test_the_dead_token_total_is_each_requests_length_less_its_live_tokens(seed):
    """``num_dead_tokens`` (O(1), kept at each eviction path and at a free) equals the sum over
    the requests in the table of length - live tokens, through evictions one at a time, in
    lists, one each, refused calls (nothing counted) and frees."""
    rng = np.random.default_rng(seed)
    t = TokenTable(4, 256)
    lists = {f"r{i}": list(range(20 * i + 1, 20 * i + 20)) for i in range(5)}
    for r, lst in lists.items():
        t.sync_new_tokens(r, lst, int(rng.integers(4, 40)))

    def total():
        return sum(t.length(r) - t.num_live(r) for r in t.requests())

    for step in range(60):
        reqs = t.requests()
        pick = reqs[int(rng.integers(len(reqs)))]
        live = t.live_tokens(pick).tolist()
        kind = step % 5
        if kind == 0 and len(live) > 1:
            t.evict_token(pick, live[0])
        elif kind == 1 and len(live) > 3:
            t.evict_tokens(pick, live[1:3])
        elif kind == 2:
            each = [r for r in reqs if t.num_live(r) > 1]
            t.evict_one_each(each, [int(t.live_tokens(r)[0]) for r in each])
        elif kind == 3:
            with pytest.raises(TableError):
                t.evict_tokens(pick, [t.length(pick) + 5])
        elif len(reqs) > 1:
            t.free_request(pick)
            t.sync_new_tokens(pick, lists[pick], int(rng.integers(4, 40)))
        assert t.num_dead_tokens == total()
    assert total() > 0


def _plans(t, rng, reqs: list) -> list:
    """One proposal's moves per request of ``reqs`` that has one (in place, or out of place into
    fresh blocks of 64..127, two per request, distinct), blocks shared in the table excluded
    (the planner's rule)."""
    from vtoken.planner import propose

    fresh = [b for b in range(64, t.num_blocks) if t.refs[b] == 0]
    items = []
    for i, r in enumerate(reqs):
        shared = [b for b in t.block_array(r).tolist() if t.refs[b] > 1]
        p, _ = propose(t, r, fresh[2 * i:2 * i + 2], max_sources=int(rng.integers(1, 5)),
                       tail=t.tail_block(r), excluded=np.array(shared, dtype=np.int64), in_place=bool(rng.random() < 0.5))
        if p is not None and len(p.moves):
            items.append((r, p.moves))
    return items


@pytest.mark.parametrize("device", ["cpu", None])
@pytest.mark.parametrize("seed", range(8))
def test_batched_moves_equal_the_single_calls(seed, device):
    """``apply_moves_each`` (the replica replays a report's plans so) does what ``apply_moves``
    does request after request: the same emptied sources, the same state, logs and reads."""
    a, b, lists, rng = _pair(seed, device=device)
    for r in lists:  # long enough for plans with several sources
        for t in (a, b):
            t.sync_new_tokens(r, lists[r], max(t.length(r), len(lists[r]) * t.S - 6))
    applied = 0
    for _ in range(12):
        for r in lists:
            live = a.live_tokens(r)
            if len(live) > 1:
                dead = [int(x) for x in live[:-1] if rng.random() < 0.3]
                for t in (a, b):
                    t.evict_tokens(r, dead)
        items = _plans(a, rng, [r for r in lists if rng.random() < 0.8])
        want = [a.apply_moves(r, m) for r, m in items]
        assert b.apply_moves_each(items) == want
        applied += len(items) > 1
        _same(a, b)
        for r in lists:  # the read path (a device mirror recomputes what a move made stale)
            assert a.slot_mapping(r).tolist() == b.slot_mapping(r).tolist(), r
        for r in lists:  # the blocks a plan emptied go back (the caller frees them): its own tail grows
            if a.length(r) + 1 <= len(lists[r]) * a.S and a.tail_block(r) in a.block_array(r).tolist():
                for t in (a, b):
                    t.sync_new_tokens(r, lists[r], t.length(r) + 1)
        _same(a, b)
    assert applied >= 2, applied  # the workload exercises batches of several requests


def _moves_pair(seed: int = 3):
    """A table with evictions and two requests' valid proposals (r1 and r2 out of place, into
    their fresh blocks 100.. and 104..), for the refusals below."""
    from vtoken.planner import propose

    _, t, lists, rng = _pair(seed)
    for r in ("r1", "r2"):
        t.sync_new_tokens(r, lists[r], 24)
        t.evict_tokens(r, list(range(0, 24, 2)))
    items = []
    for i, r in enumerate(("r1", "r2")):
        p, _ = propose(t, r, list(range(100 + 4 * i, 104 + 4 * i)), max_sources=4, tail=t.tail_block(r),
                       in_place=False)
        items.append((r, np.array(p.moves, dtype=np.int64)))
    return t, items


@pytest.mark.parametrize("case", ["twice", "second_bad", "fresh_twice", "emptied_reused", "unknown"])
def test_a_refused_batch_of_moves_changes_nothing(case):
    """Refused as a whole, naming the request and the move's index in its own list: a request
    named twice, a bad move in the second request's list, one fresh block named by two requests
    (foreign for the second, as one after the other), a block the first request empties named as
    the second's destination (refused in a batch: its blocks go back after the call), an unknown
    request."""
    t, items = _moves_pair()
    (r1, m1), (r2, m2) = items
    before = t.export_state()
    code, where = {"twice": ("duplicate_token", "'r1' named twice"), "second_bad": ("dead_token", "'r2': move #1 "),
                   "fresh_twice": ("foreign_block", "'r2': move #0 "), "emptied_reused": ("foreign_block", "'r2': move #0 "),
                   "unknown": ("unknown_request", "'nobody'")}[case]
    if case == "twice":
        items = [(r1, m1), (r1, m1[:1])]
    elif case == "second_bad":
        m2 = m2.copy()
        m2[1, 0] = 0  # an evicted token
        items = [(r1, m1), (r2, m2)]
    elif case == "fresh_twice":
        m2 = m2.copy()
        m2[:, 3] = m1[0, 3]  # r1's first fresh destination block
        m2[:, 4] = np.arange(len(m2)) % t.S
        items = [(r1, m1), (r2, m2[:1])]
    elif case == "emptied_reused":
        src = int(m1[0, 1])  # a source of r1's plan, emptied by it
        m2 = m2[:1].copy()
        m2[0, 3], m2[0, 4] = src, 0
        items = [(r1, m1), (r2, m2)]
    else:
        items = [(r1, m1), ("nobody", m2)]
    with pytest.raises(TableError, match=where) as e:
        t.apply_moves_each(items)
    assert e.value.code == code
    assert t.export_state() == before
    if case == "emptied_reused":  # one after the other it is accepted: the block was free again
        assert t.apply_moves(r1, m1) and t.apply_moves(r2, m2) == []


def _batch_or_calls(t, batch, calls) -> list:
    """How the replica replays a batch (``messages.replay``): ``batch()``, or the ``calls`` one
    by one when it says None (not one batch). A batch that says None or raises has changed
    nothing; one that answers did all of it."""
    before = t.export_state()
    try:
        out = batch()
    except TableError:
        assert t.export_state() == before, "a refused batch changed the table"
        raise
    if out is None:
        assert t.export_state() == before, "a batch that was not one changed the table"
        out = [c() for c in calls]
    return out


def _as_the_calls(a, b, batch, calls_on, how, norm=lambda x: x) -> None:
    """The calls one by one on ``a`` (``calls_on(a)``), the batch as the replica replays it on
    ``b`` (:func:`_batch_or_calls`): the same results (``norm`` of each), or the same error."""
    try:
        want = [c() for c in calls_on(a)]
    except TableError as err_a:
        with pytest.raises(TableError) as err_b:
            _batch_or_calls(b, batch, calls_on(b))
        assert (err_b.value.code, str(err_b.value)) == (err_a.code, str(err_a)), how
        return
    got = _batch_or_calls(b, batch, calls_on(b))
    assert [norm(x) for x in got] == [norm(x) for x in want], how


def _steps(a, lists, rng, reqs, k, how):
    """``k`` decode steps' blocks for ``reqs`` (one int64 array a step), from their positional
    lists, then bent as ``how`` asks: ``foreign`` (a request names another's block at a later
    step), ``back`` (one returns to a block it left), ``two`` (one opens two fresh blocks),
    ``fresh_shared`` (two requests name one fresh block at two steps), ``held`` (one names the
    block of a request not grown), ``null`` / ``range`` (a bad block at the last step), ``lists``
    (Python lists, not arrays)."""
    S = a.S
    steps = [np.array([lists[r][(a.length(r) + j) // S] for r in reqs], dtype=np.int64) for j in range(k)]
    i = int(rng.integers(len(reqs)))
    if how == "foreign" and len(reqs) > 1:
        steps[-1][i] = steps[0][(i + 1) % len(reqs)]
    elif how == "back" and k >= 3:
        steps[1][i], steps[2][i] = 99, steps[0][i]
    elif how == "two" and k >= 2:
        steps[0][i], steps[1][i] = 100, 101
    elif how == "fresh_shared" and len(reqs) > 1 and k >= 2:  # one fresh block, two requests, two steps
        steps[0][i], steps[1][(i + 1) % len(reqs)] = 100, 100
    elif how == "held":  # the block of a request the steps do not grow: its slot is held
        out = [r for r in lists if r not in reqs]
        if out:
            steps[-1][i] = lists[out[0]][0]
    elif how == "null":
        steps[-1][i] = 0
    elif how == "range":
        steps[-1][i] = 10 ** 6
    if how == "lists":
        steps = [x.tolist() for x in steps]
    return steps


@pytest.mark.parametrize("device", ["cpu", None])
@pytest.mark.parametrize("seed", range(8))  # _pair's seeds (r5's shared prefix needs r0's tokens)
def test_several_steps_of_growth_equal_the_calls_one_by_one(seed, device):
    """``sync_steps_each`` (the replica's held-back decode steps in one call) leaves the state,
    the logs and the reads the ``sync_one_each`` calls leave on its array path; every case it
    does not take as one batch (a block two requests name, one a request comes back to, two
    fresh blocks, more steps than S, lists, a bad block) it declines with None, changing
    nothing, and the calls the replica then makes (``messages.replay``) raise where they would
    (``_batch_or_calls``)."""
    a, b, lists, rng = _pair(seed, device=device)
    for t in (a, b):
        t.added, t.reblocked = [], set()
    hows = ["plain"] * 6 + ["foreign", "back", "two", "fresh_shared", "held", "null", "range", "lists"]
    for rnd in range(24):
        reqs = [r for r in lists if rng.random() < 0.7]
        victims = [(r, int(rng.choice(a.live_tokens(r)[:-1]))) for r in reqs
                   if len(a.live_tokens(r)) > 1 and rng.random() < 0.3]
        for t in (a, b):  # evictions between: runs whose blocks were emptied, tails dead
            for r, x in victims:
                t.evict_tokens(r, [x])
        k = int(rng.choice([2, 3, 4, 4, 5]))  # S = 4: 5 steps go one by one
        reqs = [r for r in reqs if a.length(r) + k <= len(lists[r]) * a.S]
        if not reqs:
            continue
        how = hows[(seed + rnd) % len(hows)]
        steps = _steps(a, lists, rng, reqs, k, how)
        _as_the_calls(a, b, lambda: b.sync_steps_each(reqs, steps),
                      lambda t: [lambda x=x: t.sync_one_each(reqs, x) for x in steps], how, np.ndarray.tolist)
        _same(a, b)
        assert a.take_added() == b.take_added() and a.take_reblocked() == b.take_reblocked(), how
    a.flush(), b.flush()
    for r in lists:
        assert a.slot_mapping(r).tolist() == b.slot_mapping(r).tolist()
        assert [x.tolist() for x in a.read_view(r)] == [x.tolist() for x in b.read_view(r)]


def test_several_steps_of_growth_take_the_array_path_for_decode_growth(monkeypatch):
    """Positional decode growth (each request's next tokens in its list's blocks, a fresh block
    opened on the way) is validated and applied without the one-by-one calls."""
    _, t, lists, _ = _pair(1)
    calls = []
    real = TokenTable.sync_one_each
    monkeypatch.setattr(TokenTable, "sync_one_each", lambda self, *a: calls.append(a) or real(self, *a))
    reqs = [r for r in lists if t.length(r) + 4 <= len(lists[r]) * t.S]
    blocks = [t.num_blocks_of(r) for r in reqs]
    got = t.sync_steps_each(reqs, [np.array([lists[r][(t.length(r) + j) // t.S] for r in reqs], dtype=np.int64)
                                   for j in range(4)])
    assert calls == [] and len(got) == 4 and len(reqs) >= 3
    assert [t.num_blocks_of(r) for r in reqs] == [x + 1 for x in blocks]  # S = 4 steps: each opened one block


def _chunks(t, rng, how: str) -> list:
    """A prefill step's chunks for ``t``: new requests' prompts and more of the running ones'
    (``(req_id, block_ids, total_len)``), each in blocks of its own, then bent as ``how`` asks:
    ``shared`` (a new request's prompt in another's blocks: a prefix hit, its tokens placed),
    ``twice`` (two chunks name one fresh block), ``same`` (one request twice), ``one`` (a chunk
    of one token), ``null`` / ``conflict`` (a bad block in the last chunk), ``unknown`` (a
    request id the table refuses), ``segment`` (a list only from the chunk's first entry on)."""
    S = t.S
    free = iter(b for b in range(1, t.num_blocks) if t.refs[b] == 0)
    items = []
    for r in t.requests()[: int(rng.integers(0, 3))]:  # more of a running prompt
        n = t.length(r)
        total = n + int(rng.integers(2, 3 * S))
        lst = [-1] * (n // S) + ([int(t.tail_block(r))] if n % S else [])  # its tail keeps its entry
        lst += [next(free) for _ in range(-(-total // S) - len(lst))]
        items.append((r, lst, total))
    for _ in range(int(rng.integers(2, 5))):  # new prompts
        total = int(rng.integers(2, 4 * S))
        items.append((f"p{rng.integers(1 << 30)}", [next(free) for _ in range(-(-total // S))], total))
    last = items[-1]
    if how == "shared":  # a new request whose first blocks are an existing request's full ones
        donor = next((r for r in t.requests() if t.length(r) >= 2 * S), None)
        if donor is not None:
            sl = t.slots(donor)  # its first two entries' blocks
            items.append(("hit", [int(sl[0]) // S, int(sl[S]) // S, next(free)], 2 * S + 1))
    elif how == "twice":
        items.append(("twin", [last[1][0]] + [next(free)], S + 1))
    elif how == "same":
        items.append((last[0], last[1] + [next(free)], last[2] + S))
    elif how == "one":
        items.append(("single", [next(free)], 1))
    elif how == "null":
        items[-1] = (last[0], last[1][:-1] + [0], last[2])
    elif how == "conflict":
        held = next((r for r in t.requests() if t.length(r) >= S), None)
        if held is not None:
            items[-1] = (last[0], [int(t.block_array(held)[0])] + last[1][1:], last[2])
    elif how == "unknown":
        items.insert(1, ([1], [next(free)], 2))
    elif how == "segment":
        from vtoken.vllm_adapter.messages import _Segment
        r, lst, total = items[0]
        j0 = t.length(r) // S if r in t else 0
        items[0] = (r, _Segment(j0, lst[j0:]) if j0 else lst, total)
    return items


@pytest.mark.parametrize("device", ["cpu", None])
@pytest.mark.parametrize("seed", range(8))
def test_a_prefill_steps_chunks_equal_the_calls_one_by_one(seed, device):
    """``sync_new_tokens_each`` (a prefill step's prompt chunks in one call, as the replica
    replays them) leaves the state, the logs and the reads the ``sync_new_tokens`` calls leave;
    what it does not take as one batch (a prefix hit, a block two chunks name, a request
    twice, a one-token chunk, a null or held block, a bad id) it declines with None, changing
    nothing, and the calls then raise where they would (``_batch_or_calls``)."""
    rng = np.random.default_rng(seed)
    S = 4
    a, b = TokenTable(S, 400), TokenTable(S, 400, device=device)
    for t in (a, b):
        t.added, t.reblocked = [], set()
    hows = ["plain"] * 4 + ["shared", "twice", "same", "one", "null", "conflict", "unknown", "segment"]
    for rnd in range(10):
        how = hows[(seed + rnd) % len(hows)]
        items = _chunks(a, np.random.default_rng([seed, rnd]), how)
        assert items == _chunks(b, np.random.default_rng([seed, rnd]), how)
        _as_the_calls(a, b, lambda: b.sync_new_tokens_each(items),
                      lambda t: [lambda x=x: t.sync_new_tokens(*x) for x in items], how, np.ndarray.tolist)
        _same(a, b)
        assert a.take_added() == b.take_added() and a.take_reblocked() == b.take_reblocked(), how
        for r in a.requests()[:: max(1, len(a.requests()) // 3)]:  # some finish: their blocks come back
            if rng.random() < 0.3:
                assert a.free_request(r) == b.free_request(r)
        for r in a.requests():  # and some tokens die
            if a.num_live(r) > 1 and rng.random() < 0.3:
                x = int(rng.choice(a.live_tokens(r)))
                a.evict_tokens(r, [x]), b.evict_tokens(r, [x])
    a.flush(), b.flush()
    for r in a.requests():
        assert a.slot_mapping(r).tolist() == b.slot_mapping(r).tolist()


def test_a_prefill_steps_chunks_take_the_array_path(monkeypatch):
    """New prompts and more of running ones, each in blocks of its own: one ``_sync_many``
    over every chunk, never the single calls."""
    t = TokenTable(4, 200)
    t.sync_new_tokens("old", [5, 6], 6)
    calls = []
    monkeypatch.setattr(TokenTable, "sync_new_tokens", lambda self, *a: calls.append(a))
    got = t.sync_new_tokens_each([("old", [5, 6, 7], 11), ("n1", [10, 11], 8), ("n2", [12], 3)])
    assert calls == [] and [len(x) for x in got] == [5, 8, 3]
    assert t.length("old") == 11 and t.blocks_of("old") == [5, 6, 7] and t.blocks_of("n1") == [10, 11]
    assert got[0].tolist() == [6 * 4 + 2, 6 * 4 + 3, 7 * 4, 7 * 4 + 1, 7 * 4 + 2]


def _drops(t) -> list:
    out = sorted(int(b) for x in t.drops for b in np.atleast_1d(x))
    t.drops = []
    return out


@pytest.mark.parametrize("device", ["cpu", None])
@pytest.mark.parametrize("seed", range(8))
def test_the_requests_a_step_finished_freed_in_one_call_equal_the_calls(seed, device):
    """``free_requests`` (the requests a step finished, as the replica replays them) leaves the
    state, the logs (changed, reblocked, drops, lone-dead) and the results the ``free_request``
    calls leave on its array path (no block shared); what it does not take as one batch (a
    shared prefix, a request twice, an unknown one) it declines with None, changing nothing,
    and the calls then raise where they would (``_batch_or_calls``)."""
    a, b, lists, rng = _pair(seed, device=device)
    for t in (a, b):
        t.reblocked, t.drops = set(), []
    for r in lists:  # some dead tokens: their slots unclaimed, the counts to give back differ
        live = a.live_tokens(r)
        if len(live) > 2:
            x = [int(v) for v in rng.choice(live, size=2, replace=False)]
            a.evict_tokens(r, x), b.evict_tokens(r, x)
    _drops(a), _drops(b)
    hows = ["alone", "alone", "shared", "twice", "unknown"]
    for how in (hows[seed % len(hows)], "alone", "any"):
        present = a.requests()
        alone = [r for r in present if r not in ("r0", "r5")]  # r0 and r5 share blocks 1, 2
        if how == "alone":
            ids = alone[:3]
        elif how == "shared":
            ids = [r for r in ("r0", "r5", "r2") if r in present]
        elif how == "twice":
            ids = alone[:2] + alone[:1]
        elif how == "unknown":
            ids = present[:2] + ["nobody"] + present[2:3]
        else:
            ids = list(present)
        _as_the_calls(a, b, lambda: b.free_requests(ids), lambda t: [lambda x=x: t.free_request(x) for x in ids], how)
        _same(a, b)
        assert a.take_reblocked() == b.take_reblocked() and a.take_lone_dead() == b.take_lone_dead(), how
        assert _drops(a) == _drops(b), how
        assert a.num_ref_blocks == b.num_ref_blocks and (a.refs == b.refs).all() and (a.placed == b.placed).all()
    for i, r in enumerate(["n0", "n1"]):  # the freed rows and blocks are reused alike
        for t in (a, b):
            t.sync_new_tokens(r, [70 + 2 * i, 71 + 2 * i], 5)
    _same(a, b)


def test_the_requests_a_step_finished_take_the_array_path(monkeypatch):
    _, t, lists, _ = _pair(2)
    calls = []
    monkeypatch.setattr(TokenTable, "free_request", lambda self, r: calls.append(r))
    got = t.free_requests(["r1", "r2", "r3"])
    assert calls == [] and all(got) and all(r not in t for r in ("r1", "r2", "r3"))
    assert all(t.refs[b] == 0 for bl in got for b in bl) and t.num_ref_blocks == len(set().union(
        *(t.blocks_of(r) for r in t.requests())))
