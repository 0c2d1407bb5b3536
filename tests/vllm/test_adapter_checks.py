"""The adapter's runtime checks cost what changed: incremental on every hook, a full scan
every ``check_full_every`` hooks (and at idle), every hook with ``paranoid_checks``. A
corruption only the full scan can see (an untouched request's block list changed behind the
adapter's back) is caught within ``check_full_every`` hooks in the default mode, at once in
paranoid mode; and a corruption of what changed is caught on the hook it happens."""

from __future__ import annotations

import numpy as np
import pytest
from vtoken.invariants.relocation_hash import RelocationChecker

pytestmark = pytest.mark.vllm


def _run(model, full_every=64, paranoid=False, ratio=0.0, headroom=4, reclaim=True, requests=3, vocab=500,
         max_tokens=60):
    """``requests`` decoding (40-token prompts) after 3 steps. ``headroom``: on top of the planner
    defaults (None: the shipped defaults, in place, but no reservation at all: the adapter's soft
    one, ``keep_headroom``, off, so these scenarios' blocks change hands only as they plan)."""
    from vtoken.vllm_adapter.adapter import AdapterDriver, VTokenAdapter, default_adapter_planner_config
    from vtoken.vllm_adapter.worker import VTokenWorker

    S, N = 8, 96
    cfg = None if headroom is None else default_adapter_planner_config(headroom=headroom)
    ad = VTokenAdapter(block_size=S, num_blocks=N, prefix_caching=True, async_scheduling=False, planner_config=cfg,
                       max_model_len=512, check_full_every=full_every, paranoid_checks=paranoid, reclaim=reclaim,
                       keep_headroom=0)
    w = VTokenWorker(model, ad.table, N, S, check_relocations=RelocationChecker, policy="random", evict_ratio=ratio, seed=0)
    d = AdapterDriver(ad, w)
    for i in range(requests):
        ad.add_request(f"q{i}", np.random.default_rng([i]).integers(1, vocab, size=40).tolist(), max_tokens=max_tokens)
    for _ in range(3):
        d.step()
    return ad, d


def _swap_an_untouched_entry(ad):
    """Put another block object at index 0 of q0's list (same refs, wrong block): only a scan
    of that list sees it, and no event touches q0 while it decodes inside its tail block."""
    lst = ad.req_to_blocks["q0"]
    other = next(b for b in ad.pool.blocks if not b.is_null and b.ref_cnt == 0)
    lst[0] = other


def _hooks_until_caught(d, ad, limit):
    from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

    start = ad.checker.hooks
    for _ in range(limit):
        try:
            d.step()
        except AdapterAssumptionError as e:
            return ad.checker.hooks - start, e
    return None, None


def test_default_mode_catches_a_full_scan_only_fault_within_k_hooks(model):
    K = 8
    ad, d = _run(model, K, False)
    _swap_an_untouched_entry(ad)
    hooks, e = _hooks_until_caught(d, ad, 2 * K)
    assert e is not None, f"not caught in {2 * K} steps"
    assert "[null_substitution]" in str(e) and "q0" in str(e)
    assert hooks <= K, f"caught after {hooks} hooks, the full scan runs every {K}"


def test_paranoid_mode_catches_it_at_the_next_hook(model):
    ad, d = _run(model, 64, True)
    _swap_an_untouched_entry(ad)
    hooks, e = _hooks_until_caught(d, ad, 4)
    assert e is not None and "[null_substitution]" in str(e)
    assert hooks == 1


def test_a_headroom_block_freed_behind_the_adapters_back_is_caught_within_k_hooks(model):
    """No adapter event touched it: the incremental check looks at the blocks new to the
    headroom, the full scan at all of them, so it is caught within ``check_full_every`` hooks
    (and at the next hook in paranoid mode)."""
    K = 8
    ad, d = _run(model, K, False)
    ad.pool.free_blocks([ad.headroom[0]])
    hooks, e = _hooks_until_caught(d, ad, 2 * K)
    assert e is not None and "[reservation]" in str(e), f"not caught in {2 * K} steps"
    assert hooks <= K, f"caught after {hooks} hooks, the full scan runs every {K}"
    ad, d = _run(model, 64, True)
    ad.pool.free_blocks([ad.headroom[0]])
    hooks, e = _hooks_until_caught(d, ad, 4)
    assert e is not None and "[reservation]" in str(e) and hooks == 1


def test_a_corruption_of_what_changed_is_caught_on_its_hook(model):
    """A block that enters the headroom while vLLM still counts it free (the planted
    ``adapter_headroom_to_allocate`` shape, here by hand) is caught on the next hook even
    with the full scan far away."""
    ad, d = _run(model, 1 << 20, False)
    got = ad.pool.get_new_blocks(1)
    ad.headroom = ad.headroom + got  # enters the headroom (as new: the incremental check looks at it)
    ad.lifecycle.fresh = {got[0].block_id}
    ad.pool.free_blocks(got)
    hooks, e = _hooks_until_caught(d, ad, 4)
    assert e is not None and "[reservation]" in str(e) and hooks == 1


def test_incremental_mode_scans_less_than_the_pool(model):
    """The default mode runs full scans only every K hooks: the count is the proof of cost."""
    ad, d = _run(model, 16, False, ratio=0.5)
    for _ in range(40):
        if not ad.has_work():
            break
        d.step()
    assert ad.checker.hooks >= 40 and ad.checker.full_scans <= ad.checker.hooks // 16 + 1

# ---------------------------------------------------------------- what the per-step work looks at
# An all-dead tail block stays (it is still written) and is released once the tail moves to
# a new block, with no other event on the request (``tail_wait``): the per-step work does not
# re-scan every growing request for all-dead blocks. A grown list is checked as a list and a
# table, not its holdings; a held block freed behind the adapter's back is still caught: when
# vLLM hands it out, on the hook of the next adapter event on its request, and within
# ``check_full_every`` hooks by the full scan otherwise.


def test_an_all_dead_tail_is_released_once_the_tail_moves(model):
    ad, d = _run(model, headroom=None, reclaim=False, requests=1)
    r, S = "q0", ad.S
    while ad.table.length(r) % S:  # until the tail block is full (ad.table: caught up at each read)
        d.step()
    t = ad.table
    n = t.length(r)
    tail = t.tail_block(r)
    d.worker.evict_tokens(r, list(range(n - S, n)))  # every token of the tail block dies (the worker's table)
    assert tail in d.worker.table.releasable_blocks(r).tolist()
    released = ad.stats["released_empty"]
    d.step()  # scheduled while the block is still the tail: kept; the token goes into a new block
    assert tail in t.blocks_of(r) and t.tail_block(r) != tail and ad.stats["released_empty"] == released
    assert r in ad.release_todo and r not in ad.tail_wait, "the moved tail puts the request up for a look"
    d.step()
    assert tail not in t.blocks_of(r) and ad.block(tail).ref_cnt == 0, "not released after the tail moved"
    assert ad.stats["released_empty"] == released + 1
    ad.check_all()


def _holding(model, full_every, **kw):
    """A run at the shipped defaults with 50% eviction, stepped until a request not in a plan
    holds blocks: (adapter, driver, that request)."""
    ad, d = _run(model, full_every, ratio=0.5, headroom=None, **kw)
    for _ in range(200):
        if any(ad.held.get(r) for r in ad.req_to_blocks if r not in ad.busy):
            break
        d.step()
    r = next(r for r in ad.req_to_blocks if ad.held.get(r) and r not in ad.busy)
    return ad, d, r


def test_a_held_block_freed_behind_the_adapters_back_is_caught_within_k_hooks(model):
    K = 8
    ad, d, r = _holding(model, K)
    blk = ad.block(next(iter(ad.held[r])))
    ad.pool.free_blocks([blk])  # vLLM's pool now counts it free; the adapter still holds it
    hooks, e = _hooks_until_caught(d, ad, 2 * K)
    assert e is not None, f"not caught in {2 * K} steps"
    assert e.check == "ownership" and f"block {blk.block_id}" in str(e), e
    assert hooks <= K, f"caught after {hooks} hooks, the full scan runs every {K}"


def test_an_adapter_event_on_the_request_checks_its_holdings_on_that_hook(model):
    ad, d, r = _holding(model, 1 << 20)  # no full scan in reach
    blk = ad.block(next(iter(ad.held[r])))
    ad.pool.free_blocks([blk])
    ad.checker.touch([r])  # what the adapter's own events on r do (launch, report, release, free)
    with pytest.raises(Exception) as e:
        ad.checker.after_hook("test")
    assert getattr(e.value, "check", None) == "ownership" and f"block {blk.block_id}" in str(e.value)


def test_a_block_entering_a_list_while_the_adapter_holds_it_is_caught_on_that_hook(model):
    """The entries vLLM put in lists are checked against every adapter holding (held blocks
    by their index, plans in flight, headroom): the block's own request need not be touched."""
    from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

    ad, d, r = _holding(model, 1 << 20)
    blk = ad.block(next(iter(ad.held[r])))
    ad.checker.touch_entries([("q9", blk.block_id)])  # as if vLLM had allocated it to q9
    with pytest.raises(AdapterAssumptionError) as e:
        ad.checker.check_touched("test")  # the incremental check alone (after_hook confirms with a full scan)
    assert e.value.check == "ownership" and f"block {blk.block_id}" in str(e.value) and "'q9'" in str(e.value)


def test_a_held_block_vllm_hands_out_again_is_caught_when_it_is_handed_out(model):
    """Freed behind the adapter's back, then allocated by vLLM to a growing list: caught on
    the hook of that allocation, with no full scan in reach and before the worker writes it."""
    from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

    ad, d, r = _holding(model, 1 << 20, vocab=63, max_tokens=200)
    blk = ad.block(next(iter(ad.held[r])))
    ad.pool.free_blocks([blk])
    for _ in range(100):
        try:
            d.step()
        except AdapterAssumptionError as e:
            # the incremental check saw it enter a list; the full scan it triggers names the verdict
            assert e.check == "ownership" and f"block {blk.block_id}" in str(e), e
            assert "entered request" in str(e.__context__), "the incremental check caught it as it was handed out"
            return
    raise AssertionError("never caught")


# ---------------------------------------------------------------------------- the replica's lag
def test_with_reclamation_off_the_replica_lags_by_growth_only_and_catches_up(model):
    """Reclamation off, no eviction: the replica holds back up to ``MAX_LAG`` reports of decode
    growth while every hook's checks run on it (they pass: its blocks are a subset of the
    lists); ``ad.table`` is caught up and equals the worker's table at every step; with
    ``paranoid_checks`` nothing is held."""
    from vtoken.vllm_adapter.messages import MAX_LAG

    for paranoid, want in ((False, MAX_LAG), (True, 0)):
        ad, d = _run(model, reclaim=False, paranoid=paranoid, max_tokens=40)
        held = 0
        while ad.has_work():
            d.step()
            held = max(held, len(ad.replica.held))
            assert ad.replica.held or ad._t.export_state() == d.worker.table.export_state()
        d.drain()
        assert ad.replica.held_max == want and held == want
        assert ad.table.export_state() == d.worker.table.export_state() and not ad.replica.held
        ad.close()


def test_with_reclamation_on_held_back_reports_change_no_plan_or_release(model):
    """Reclamation on (the shipped defaults): reports of decode growth, and from the first
    report that evicts (eviction switched on mid-run, at a ratio that evicts every few steps)
    of growth and evictions that emptied no block, are held back (``MAX_LAG`` at most); never
    one whose eviction emptied a block (a release would wait); and the plans and releases, step
    by step, are those of a replica that never lags (``paranoid_checks``: no lag)."""
    from vtoken.vllm_adapter.messages import MAX_LAG

    logs = {}
    for paranoid in (False, True):
        ad, d = _run(model, reclaim=True, headroom=None, paranoid=paranoid, max_tokens=60)
        log, schedule, rp = [], ad.schedule, ad.replica
        feed = rp.feed

        def spy():
            so = schedule()
            m = so.vtoken
            log.append((m.seq, [(p["req_id"], p["sources"], p["fills"], p["dests"], p["moves"].tolist())
                                for p in m.plans], {r: list(b) for r, b in m.releases.items()}))
            return so

        def fed(ops, hold=True, evictions=False):
            n = len(rp.held)
            feed(ops, hold, evictions)
            if len(rp.held) > n:  # held back: growth, and evictions that emptied no block
                assert all(op[0] in ("sync1", "totals") or (op[0] in ("evict", "evict1") and not op[3]) for op in ops), ops

        ad.schedule, rp.feed = spy, fed
        while ad.has_work():
            if d.steps == 12:
                d.worker.core.evict_ratio = 0.3  # keeps ceil(0.7 n): one eviction every few steps
            d.step()
        d.drain()
        assert ad.table.export_state() == d.worker.table.export_state() and not rp.held
        assert rp.held_max == (0 if paranoid else MAX_LAG) and ad.stats["applied"] > 0
        assert (rp.held_evictions == 0) == paranoid, rp.held_evictions  # evictions were held back
        assert any(plans for _, plans, _ in log)
        logs[paranoid] = log
        ad.close()
    assert logs[False] == logs[True]


def test_a_divergence_in_held_back_growth_is_caught_within_the_lag(model):
    """The worker reports growth the replica cannot replay (a token in a block its list does
    not hold): held back, it is still caught (``table_in_step``) at the latest when the batch
    is full, ``MAX_LAG`` steps on."""
    from vtoken.vllm_adapter.assumptions import AdapterAssumptionError
    from vtoken.vllm_adapter.messages import MAX_LAG

    ad, d = _run(model, reclaim=False, max_tokens=40)
    execute = d.worker.execute
    state = {"done": False}

    def lying(so):  # one report: request q0's growth lands in the null block
        out = execute(so)
        ops = out.vtoken_report.ops
        if not state["done"] and ops and all(op[0] in ("sync1", "totals") for op in ops):
            reqs, blocks = ops[0][1], list(ops[0][2])
            blocks[reqs.index("q0")] = 0
            ops[0] = ("sync1", reqs, blocks)
            state["done"] = True
        return out

    d.worker.execute = lying
    steps = 0
    with pytest.raises(AdapterAssumptionError, match="table_in_step") as e:
        while steps <= MAX_LAG + 1:
            d.step()
            steps += 1
    assert state["done"] and steps <= MAX_LAG and "null" in str(e.value)


def test_a_table_that_takes_a_block_its_list_does_not_hold_is_caught_on_that_hook(model):
    """The worker reports growth into a block that is not in the request's list (and its list
    did not change that step): the replica replays it, and the incremental check of that
    very hook sees the table reference a block the scheduler side does not hold for the
    request (the tables whose block set changed are checked, not only the lists vLLM grew)."""
    from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

    ad, d = _run(model, reclaim=True, max_tokens=40)
    d.worker.evict_tokens("q0", [0])  # a dead token (the plan gate reads the table)
    ad.replica.max_lag = 0  # each report replayed at once: the lie reaches the table on that hook
    execute = d.worker.execute
    state = {"done": False}

    def lying(so):
        out = execute(so)
        ops = out.vtoken_report.ops
        for k, op in enumerate(ops):
            if state["done"] or op[0] != "sync1" or "q0" not in op[1]:
                continue
            i = op[1].index("q0")
            listed = {b.block_id for b in ad.req_to_blocks["q0"]}
            if op[2][i] not in ad.mirror.changed and ad._t.length("q0") % ad.S:  # inside its tail, no new block
                stray = next(b.block_id for b in ad.pool.blocks if not b.is_null and b.ref_cnt == 0
                             and b.block_id not in listed and ad._t.block_refs(b.block_id) == 0)
                blocks = np.array(op[2]).copy()
                blocks[i] = stray
                ops[k] = ("sync1", op[1], blocks)
                # the totals of a worker table that took the stray block (else they give the lie away first)
                ops[-1] = ("totals", ops[-1][1], ops[-1][2] + 1)
                state["done"] = True
        return out

    d.worker.execute = lying
    full = ad.checker.full_scans
    with pytest.raises(AdapterAssumptionError, match="table_in_step") as e:
        for _ in range(20):
            d.step()
    assert state["done"] and "does not hold" in str(e.value)
    assert ad.checker.full_scans == full  # the incremental check saw it, not a full scan


def evicting_run(model, max_tokens: int, **settings):
    """An adapter (``settings``: its own, e.g. ``checks``, ``reclaim``), a worker evicting half of
    each request at random and a driver, with three 40-token requests added."""
    from vtoken.vllm_adapter.adapter import AdapterDriver, VTokenAdapter
    from vtoken.vllm_adapter.worker import VTokenWorker

    S, N = 8, 96
    ad = VTokenAdapter(block_size=S, num_blocks=N, prefix_caching=True, async_scheduling=False, max_model_len=512,
                       **settings)
    w = VTokenWorker(model, ad.table, N, S, policy="random", evict_ratio=0.5, seed=0)
    d = AdapterDriver(ad, w)
    for i in range(3):
        ad.add_request(f"q{i}", np.random.default_rng([i]).integers(1, 500, size=40).tolist(), max_tokens=max_tokens)
    return ad, w, d


def test_with_checks_off_nothing_touched_is_kept(model):
    """``checks=False``: no hook runs the checks, so the checker keeps none of what the hooks
    report touched (with eviction and plans: releases, launches, reports); before, those sets
    grew with every request served. ``check_all`` still scans."""
    ad, w, d = evicting_run(model, max_tokens=60, checks=False)
    steps = 0
    while ad.has_work():
        d.step()
        steps += 1
        c = ad.checker
        assert not (c.touched_requests or c.touched_lists or c.new_entries), f"step {steps}"
    assert ad.stats["released_empty"] + ad.stats["applied"] > 0  # events that touch requests happened
    d.drain()
    ad.check_all()
    ad.close()
