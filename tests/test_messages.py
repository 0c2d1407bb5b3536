"""What crosses between the adapter's scheduler side and its worker is plain data, and the
scheduler side's token table stays the worker's replica (``vllm_adapter.messages``)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from vtoken.errors import OrderError, TableError
from vtoken.table import TokenTable
from vtoken.vllm_adapter.messages import LoggedTable, Replica, StepMeta, WorkerReport, plan_order, replay


def _drive(t: TokenTable, rng: np.random.Generator, state: dict, steps: int = 300) -> None:
    """Random growth, evictions, compaction moves, releases and frees on ``t`` (S = 4); ``state``
    keeps the free blocks and the positional lists across calls."""
    S = t.S
    free = state.setdefault("free", list(range(1, t.num_blocks)))
    lists: dict = state.setdefault("lists", {})
    for _ in range(steps):
        op = rng.integers(0, 6)
        live = [r for r in lists if r in t]
        if op <= 1 or not live:  # a new request or growth
            r = f"r{rng.integers(0, 6)}"
            lst = lists.setdefault(r, [])
            n = t.length(r) if r in t else 0
            k = int(rng.integers(1, 7))
            while len(lst) * S < n + k and free:
                lst.append(free.pop(0))
            if len(lst) * S >= n + k:
                t.sync_new_tokens(r, lst, n + k)
        elif op == 2:
            r = live[rng.integers(0, len(live))]
            ids = t.live_tokens(r)
            if len(ids) > 1:
                t.evict_tokens(r, rng.choice(ids[:-1], size=min(3, len(ids) - 1), replace=False))
        elif op == 3:  # move a live token of a non-tail block into a fresh block
            r = live[rng.integers(0, len(live))]
            ids, slots = t.live_slots(r)
            tail = t.tail_block(r)
            cand = [(i, s) for i, s in zip(ids.tolist(), slots.tolist()) if s // S != tail]
            if cand and free:
                i, s = cand[0]
                d = free.pop(0)
                t.apply_moves(r, [[i, s // S, s % S, d, 0]])  # d is held outside the positional list
        elif op == 4:
            r = live[rng.integers(0, len(live))]
            dead = [b for b in t.releasable_blocks(r).tolist() if b != t.tail_block(r)]
            if dead:
                t.release_empty_blocks(r, dead[:1])
        else:
            r = live[rng.integers(0, len(live))]
            free.extend(t.free_request(r))
            del lists[r]


@pytest.mark.parametrize("seed", range(5))
def test_replaying_the_log_gives_the_same_table(seed):
    """The replica replays every logged change of the worker's table and ends equal, step by
    step; the log crosses a process boundary as it would (pickled)."""
    w, rep = LoggedTable(4, 64), TokenTable(4, 64)
    rng, state = np.random.default_rng(seed), {}
    for _ in range(10):
        _drive(w, rng, state, steps=30)
        replay(rep, pickle.loads(pickle.dumps(w.take_ops())))
        assert rep.export_state() == w.export_state()
    assert w.take_ops() == []


def test_a_refused_change_is_not_logged():
    w = LoggedTable(4, 16)
    w.sync_new_tokens("a", [1, 2], 6)
    w.take_ops()
    with pytest.raises(TableError):
        w.evict_tokens("a", [99])
    with pytest.raises(TableError):
        w.sync_new_tokens("b", [0], 1)  # the null block
    assert w.take_ops() == []


def test_a_replica_that_diverged_refuses_the_replay():
    """A change the replica cannot make (it diverged) raises the table's own error."""
    w, rep = LoggedTable(4, 16), TokenTable(4, 16)
    w.sync_new_tokens("a", [1, 2], 6)
    replay(rep, w.take_ops())
    rep.evict_tokens("a", [0])  # the replica changed behind the log
    w.evict_tokens("a", [0])
    with pytest.raises(TableError, match="dead_token"):
        replay(rep, w.take_ops())


def test_a_logged_sync_carries_only_the_entries_it_read():
    """A decode step's sync logs one block-list entry, not the request's whole list."""
    w = LoggedTable(4, 64)
    blocks = list(range(1, 41))
    w.sync_new_tokens("a", blocks, 150)
    w.take_ops()
    w.sync_new_tokens("a", blocks, 151)
    op, totals = w.take_ops()  # the log ends with the table's totals
    assert op[0] == "sync" and op[3] == 37 and op[4] == [38]
    assert totals == ("totals", w.num_live_slots, w.num_ref_blocks) == ("totals", 151, 38)
    rep = LoggedTable(4, 64)
    rep.sync_new_tokens("a", blocks, 150)
    replay(rep, [op])
    assert rep.length("a") == 151 and rep.export_request("a") == w.export_request("a")


def test_the_messages_are_plain_data():
    """A step's meta and the worker's report pickle round-trip to equal values (no live object)."""
    from vtoken.lifecycle import Outcome, Plan

    plan = Plan(7, "a", [3], [9], np.array([[0, 3, 1, 9, 0]]), fills=[4], seq=2)
    meta = StepMeta(seq=2, plans=[plan_order(plan, {"schedule": []})], releases={"a": [5]}, drain=True)
    back = pickle.loads(pickle.dumps(meta))
    assert back.plans[0]["id"] == 7 and back.plans[0]["moves"].tolist() == [[0, 3, 1, 9, 0]]
    assert back.plans[0]["fills"] == [4] and back.releases == {"a": [5]} and back.drain
    assert not any(isinstance(v, Plan) for v in back.plans[0].values())
    rep = WorkerReport(plans={7: Outcome("applied", used_dests=[9], moved=1)}, faithful={"a": 4},
                       ops=[("evict", "a", np.array([1]))], stats={"steps": 1})
    r2 = pickle.loads(pickle.dumps(rep))
    assert r2.plans[7].status == "applied" and r2.faithful == {"a": 4} and r2.stats == {"steps": 1}


def test_the_driver_refuses_a_worker_writing_the_adapters_own_table():
    pytest.importorskip("vllm", reason="needs vLLM (make vllm)")
    from vtoken.errors import ConfigError
    from vtoken.model import DecoderConfig, PagedDecoder
    from vtoken.vllm_adapter.adapter import AdapterDriver, VTokenAdapter
    from vtoken.vllm_adapter.worker import VTokenWorker

    ad = VTokenAdapter(block_size=4, num_blocks=32, reclaim=False)
    w = VTokenWorker(PagedDecoder(DecoderConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                                                intermediate_size=64, vocab_size=64)), ad.table, 32, 4)
    assert w.table is not ad.table  # given the adapter's table, the worker made its own
    w.core.table = ad.table
    with pytest.raises(ConfigError, match="own token table"):
        AdapterDriver(ad, w)


# ---------------------------------------------------------------------------- the replica's lag
def _growth_step(w: LoggedTable, lists: dict) -> list:
    """One decode step's growth on the worker's table (every request one token), its ops."""
    reqs = sorted(lists)
    w.sync_one_each(reqs, [lists[r][w.length(r) // w.S] for r in reqs])
    return w.take_ops()


def _two_requests(max_lag: int):
    from vtoken.vllm_adapter.messages import Replica

    w, rep = LoggedTable(4, 64, device=None), Replica(TokenTable(4, 64, device=None), max_lag=max_lag)
    lists = {"a": list(range(1, 16)), "b": list(range(16, 31))}
    for r, lst in lists.items():
        w.sync_new_tokens(r, lst, 3)
    rep.feed(w.take_ops())
    return w, rep, lists


def test_the_replica_holds_back_pure_growth_and_replays_it_first_in_order():
    """Reports of decode growth only are held (at most ``max_lag``); a full batch, any other op
    (an eviction here) or ``catch_up`` replays them first, oldest first: the replica then
    equals the worker's table, and while it lags it is the worker's table of an earlier step."""
    w, rep, lists = _two_requests(max_lag=3)
    states = [w.export_state()]
    for _ in range(3):
        rep.feed(_growth_step(w, lists))
        states.append(w.export_state())
    assert len(rep.held) == 3 and rep.table.export_state() == states[0]  # growth only: held back
    rep.feed(_growth_step(w, lists))  # a fourth: the batch is full, all four replayed
    assert not rep.held and rep.table.export_state() == w.export_state() and rep.held_max == 3
    rep.feed(_growth_step(w, lists))
    w.evict_tokens("a", [0])
    rep.feed(w.take_ops())  # an eviction: the held growth first, then it
    assert not rep.held and rep.table.export_state() == w.export_state()
    rep.feed(_growth_step(w, lists))
    rep.catch_up()
    assert not rep.held and rep.table.export_state() == w.export_state()
    rep.feed(_growth_step(w, lists), hold=False)  # its owner forbids holding: replayed at once
    assert not rep.held and rep.table.export_state() == w.export_state()


def test_the_replica_knows_which_requests_hold_a_dead_token():
    """``Replica.evicted``: a request is in it from the first replayed report that evicts one of
    its tokens (one at a time or a decode step's one each) until its ``free``; a report that
    evicts is never held, so what is held never changes it."""
    w, rep, lists = _two_requests(max_lag=3)
    rep.feed(_growth_step(w, lists))
    assert rep.held and rep.evicted == set()
    w.evict_one_each(["a"], [0])
    rep.feed(w.take_ops())
    assert not rep.held and rep.evicted == {"a"}
    rep.feed(_growth_step(w, lists))  # growth: held (the owner's rule decides, here its default)
    assert rep.held and rep.evicted == {"a"}
    w.evict_tokens("b", [1, 2])
    w.free_request("a")
    rep.feed(w.take_ops())
    assert not rep.held and rep.evicted == {"b"} and rep.table.export_state() == w.export_state()
    w.sync_new_tokens("a", lists["a"], 2)  # a new incarnation: no dead token
    w.free_request("b")
    rep.feed(w.take_ops())
    assert rep.evicted == set() and rep.table.export_state() == w.export_state()


def test_a_replica_with_no_lag_replays_every_report_at_once():
    w, rep, lists = _two_requests(max_lag=0)
    for _ in range(3):
        rep.feed(_growth_step(w, lists))
        assert not rep.held and rep.table.export_state() == w.export_state()
    assert rep.held_max == 0


def test_a_held_back_change_the_replica_refuses_raises_at_its_replay():
    """A divergence in held-back growth is not lost: the replay that runs it raises the
    table's error (``catch_up``, or the next report that is not growth)."""
    w, rep, lists = _two_requests(max_lag=8)
    ops = _growth_step(w, lists)
    bad = [("sync1", ops[0][1], [ops[0][2][1], ops[0][2][1]])]  # both requests' tokens in one block
    rep.feed(bad)
    assert rep.held == [bad]
    with pytest.raises(TableError, match="slot_conflict|named twice"):
        rep.catch_up()


def test_a_logged_eviction_says_whether_it_emptied_a_block_and_the_replay_checks_it():
    """Each logged eviction carries ``emptied`` (it left a block of the worker's table with no
    live token: ``TokenTable.emptied_count`` moved), the log ends with the table's totals, and
    the replay checks both on the replica: a word false either way, or false totals, is
    ``state_mismatch``; the true log replays to the worker's table."""
    w = LoggedTable(4, 16)
    w.sync_new_tokens("a", [1, 2], 6)
    w.sync_new_tokens("b", [3], 2)
    first = w.take_ops()
    w.evict_tokens("a", [0, 1, 2])  # block 1 keeps token 3: none emptied
    w.evict_one_each(["a", "b"], [3, 0])  # a's block 1 empties; b's block 3 keeps token 1
    ops = w.take_ops()
    assert [op[0] for op in ops] == ["evict", "evict1", "totals"]
    assert ops[0][3] is False and ops[1][3] is True
    assert ops[2] == ("totals", w.num_live_slots, w.num_ref_blocks) == ("totals", 3, 3)  # emptied, still referenced

    def replica():
        t = TokenTable(4, 16)
        replay(t, first)
        return t

    for k, said in ((0, True), (1, False)):  # each word turned round
        bad = list(ops)
        bad[k] = bad[k][:3] + (said,)
        with pytest.raises(OrderError, match="state_mismatch.*emptied"):
            replay(replica(), bad)
    with pytest.raises(OrderError, match="state_mismatch.*diverged"):
        replay(replica(), ops[:2] + [("totals", 3, 4)])
    t = replica()
    replay(t, ops)
    assert t.export_state() == w.export_state() and t.emptied_count == w.emptied_count == 1


def test_the_replica_holds_back_evictions_that_emptied_no_block_when_asked():
    """``Replica.feed(ops, hold, evictions)``: a report of growth and evictions that emptied no
    block is held back only with ``evictions``; one whose eviction emptied a block is replayed at
    once, with what was held before it, in order; ``catch_up`` checks the worker's totals of the
    last report held (a false one raises there)."""
    w = LoggedTable(4, 32)
    reps = {ev: Replica(TokenTable(4, 32), max_lag=4) for ev in (False, True)}

    def feed(ops):
        for ev, rp in reps.items():
            rp.feed(ops, hold=True, evictions=ev)

    w.sync_new_tokens("a", [1, 2, 3], 7)
    w.sync_new_tokens("b", [4, 5], 5)
    feed(w.take_ops())  # new requests: replayed
    w.sync_one_each(["a", "b"], [2, 5])  # a's token 7 at block 2 offset 3, b's token 5 at block 5 offset 1
    w.evict_one_each(["b"], [0])  # block 4 keeps tokens 1-3
    step = w.take_ops()
    assert step[1][3] is False
    feed(step)
    assert not reps[False].held and reps[False].table.export_state() == w.export_state()
    assert len(reps[True].held) == 1 and reps[True].held_evictions == 1 and reps[True].totals == step[-1][1:]
    assert reps[True].table.export_state() != w.export_state()
    w.evict_tokens("a", [0, 1, 2, 3])  # block 1 empties: never held
    step = w.take_ops()
    assert step[0][3] is True
    feed(step)
    for rp in reps.values():
        assert not rp.held and rp.table.export_state() == w.export_state()
    w.sync_one_each(["a", "b"], [3, 5])  # growth only: held by both
    step = w.take_ops()
    feed(step[:-1] + [("totals", step[-1][1] + 1, step[-1][2])])  # a worker's false total
    for rp in reps.values():
        assert len(rp.held) == 1
        with pytest.raises(OrderError, match="state_mismatch"):
            rp.catch_up()
