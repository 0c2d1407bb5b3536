"""The vToken adapter over vLLM's REAL scheduler and block pool (vLLM 0.33.0, CPU).

Every test drives ``vllm.v1.core.sched.scheduler.Scheduler`` (or ``AsyncScheduler``) with
the adapter's hooks and this project's decoder as the worker; nothing of vLLM is mocked.
Without vLLM these tests FAIL (they do not skip): install it with scripts/install_vllm.sh.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from vtoken.vllm_adapter import harness
from vtoken.vllm_adapter.config import AdapterConfig
from vtoken.invariants.relocation_hash import RelocationChecker

pytestmark = pytest.mark.vllm


def require_vllm() -> None:
    if harness.vllm_version() is None:
        pytest.fail("vLLM not installed: run scripts/install_vllm.sh", pytrace=False)


def prompt(i: int, n: int, base: int = 0) -> list[int]:
    rng = np.random.default_rng([base, i, n])
    return rng.integers(1, 500, size=n).tolist()


def make(model, *, S=8, N=48, H=4, caching=True, async_=False, lag=0, policy="random", ratio=0.5,
         reclaim=True, batched=2048, seed=0, vllm_clock=False, keep=False, soft=None):
    """An adapter, its worker and driver. ``vllm_clock``: vLLM's deferred frees are on (as a
    KV-consumer connector sets them) before the adapter attaches, so the fence runs on vLLM's
    counters; else on the adapter's own. ``keep``: ``keep_prefix_bytes``; ``soft``:
    ``keep_headroom`` (None: the adapter's default; it acts only with ``keep`` and ``H`` 0)."""
    from vtoken.vllm_adapter.adapter import AdapterDriver, VTokenAdapter, default_adapter_planner_config
    from vtoken.vllm_adapter.harness import VllmHarness
    from vtoken.vllm_adapter.worker import VTokenWorker

    own = dict(reclaim=reclaim, planner_config=default_adapter_planner_config(headroom=H), headroom_pool_fraction=4,
               keep_prefix_bytes=keep, **({} if soft is None else {"keep_headroom": soft}))
    vllm_side = dict(block_size=S, num_blocks=N, prefix_caching=caching, async_scheduling=async_,
                     max_num_batched_tokens=batched, max_model_len=512)
    if vllm_clock:
        h = VllmHarness(**vllm_side)
        h.scheduler.defer_block_free = True
        ad = VTokenAdapter.attach(h.scheduler, **own)
        assert not ad.clock.own
    else:
        ad = VTokenAdapter(**vllm_side, **own)
        assert ad.clock.own and not ad.scheduler.defer_block_free
    w = VTokenWorker(model, ad.table, N, S, check_relocations=RelocationChecker, policy=policy, evict_ratio=ratio, seed=seed, copy_lag=lag)
    return ad, w, AdapterDriver(ad, w)


def run_to_end(ad, d, max_steps=3000):
    n = d.drain(max_steps=max_steps)
    ad.close()
    return n


# ---------------------------------------------------------------------------- table in step
@pytest.mark.parametrize("async_", [False, True])
def test_table_in_step_new_grow_preempt_finish(model, async_):
    """New requests, growth (new_block_ids appended), preemption (table reset, then
    recomputed on resume) and finish, with reclamation on and a pool small enough to preempt."""
    S, N = 4, 22
    ad, w, d = make(model, S=S, N=N, H=2, async_=async_, ratio=0.3, caching=True, batched=64)
    for i in range(5):
        ad.add_request(f"q{i}", prompt(i, 9 + 3 * i), max_tokens=40)
    seen = dict(new=0, grow=0, preempted=0, resumed=0, finished=0)
    t = ad.table
    sched = ad.scheduler
    for _ in range(2000):
        if not ad.has_work():
            break
        so = ad.schedule()
        seen["new"] += len(so.scheduled_new_reqs)
        c = so.scheduled_cached_reqs
        seen["grow"] += sum(1 for nb in c.new_block_ids if nb and nb[0])
        seen["resumed"] += len(c.resumed_req_ids)
        preempted = set(so.preempted_req_ids or ())
        seen["preempted"] += len(preempted)
        d.in_flight.append(so)
        if len(d.in_flight) < d.depth and ad.has_work():
            continue
        so = d.in_flight.popleft()
        out = w.execute(so)
        # the worker dropped the tables of what this output says left
        for r in so.finished_req_ids:
            assert r not in w.table, f"finished {r} still in the table"
        for r in so.preempted_req_ids or ():
            if r not in so.num_scheduled_tokens:
                assert r not in w.table, f"preempted {r} still in the table"
        ad.update_from_output(so, out)
        # the scheduler side's replica replayed the worker's changes (what it held back too,
        # read through ad.table): the two tables are equal
        assert ad.table is t and t is not w.table and t.export_state() == w.table.export_state()
        ad.check_all()  # table_in_step, null substitution, reservation, fence, ownership
        if not d.in_flight:  # nothing ahead: the table equals what the scheduler computed
            for req in sched.running:
                assert req.request_id in t
                assert t.length(req.request_id) == req.num_computed_tokens, req.request_id
                listed = {b.block_id for b in ad.req_to_blocks[req.request_id] if not b.is_null}
                held = set(ad.held.get(req.request_id, ()))
                assert set(t.blocks_of(req.request_id)) <= listed | held
        seen["finished"] = sum(1 for r in ad.requests.values() if r.is_finished())
    while d.in_flight:
        d._finish_one()
    ad.drain_idle()
    ad.close()
    assert seen["new"] >= 5 and seen["grow"] > 0 and seen["finished"] == 5
    assert seen["preempted"] > 0 and seen["resumed"] > 0, seen
    assert not t.requests(), t.requests()
    assert ad.stats["applied"] > 0


# ---------------------------------------------------------------------------- relocation
def test_relocation_null_substitutes_sources_and_keeps_length(model):
    S = 8
    ad, w, d = make(model, S=S, N=64, H=4, ratio=0.5)
    for i in range(3):
        ad.add_request(f"q{i}", prompt(i, 40 + 5 * i), max_tokens=30)
    launched = []
    orig = ad.book.launch

    def spy(meta, r, p, *rest):
        orig(meta, r, p, *rest)
        launched.append(ad.plans[meta.plans[-1]["id"]])  # the lifecycle's record (meta carries a plain order)

    ad.book.launch = spy
    checked = 0
    while ad.has_work():
        d.step()
        for p in launched:
            r = p.req_id
            lst = ad.req_to_blocks.get(r)
            if lst is None or p.orphaned:
                continue
            req = ad.requests[r]
            assert len(lst) == math.ceil(req.num_computed_tokens / S) == len(ad.mirror[r])
            for b, i in p.list_index.items():
                if i >= 0:
                    assert lst[i] is ad.pool.null_block, f"{r}[{i}] is block {lst[i].block_id}, not null"
                    checked += 1
            if p.id in ad.plans:  # in flight: no source is in the list (once freed, a source may come back as new growth)
                assert all(not any(x is ad.block(s) for x in lst) for s in p.sources)
    ad.close()
    assert ad.stats["applied"] > 0 and checked > 0
    assert w.hash_checks >= 2 * ad.stats["applied"] and w.hash_failures == 0
    assert ad.stats["moves"] == w.stats["moves"] > 0


def test_outputs_equal_with_and_without_reclamation(model):
    outs = {}
    for reclaim in (True, False):
        ad, w, d = make(model, S=8, N=64, H=4, ratio=0.5, async_=True, policy="h2o", reclaim=reclaim)
        for i in range(3):
            ad.add_request(f"q{i}", prompt(i, 30 + 7 * i), max_tokens=24)
        run_to_end(ad, d)
        outs[reclaim] = {r: ad.output_tokens(r) for r in ad.requests}
        if reclaim:
            assert ad.stats["applied"] > 0 and w.hash_failures == 0
    assert outs[True] == outs[False]


# ---------------------------------------------------------------------------- the fence
@pytest.mark.parametrize("vllm_clock", [False, True])
@pytest.mark.parametrize("async_,lag", [(True, 0), (False, 3), (True, 2)])
def test_sources_freed_only_after_the_fence(model, async_, lag, vllm_clock):
    """A plan's sources stay referenced until its step was processed AND its copy completed
    (``copy_lag``: the copy completes on a later poll, i.e. a later step), on the adapter's
    clock and on vLLM's."""
    ad, w, d = make(model, S=8, N=64, H=4, ratio=0.5, async_=async_, lag=lag, vllm_clock=vllm_clock)
    for i in range(3):
        ad.add_request(f"q{i}", prompt(i, 40 + 5 * i), max_tokens=30)
    freed = []
    orig_close = ad.fence.close  # the fence ledger records each hand-back of a plan's sources

    def spy(plan, processed, copy_done):
        sched = ad.scheduler
        freed.append((plan.id, plan.seq, ad.clock.processed, copy_done, w.stats["steps"]))
        orig_close(plan, processed, copy_done)

    ad.fence.close = spy
    launched_at: dict = {}
    watch: dict = {}
    while ad.has_work():
        d.step()
        for pid, p in ad.plans.items():
            launched_at.setdefault(pid, w.stats["steps"])
            watch[pid] = [ad.block(b) for b in p.sources]
        for pid, srcs in watch.items():
            if pid in ad.plans:  # not reported yet: every source still held by the adapter
                assert all(b.ref_cnt >= 1 for b in srcs), [(b.block_id, b.ref_cnt) for b in srcs]
                free = {b.block_id for b in ad.pool.free_block_queue.get_all_free_blocks()}
                assert not free & {b.block_id for b in srcs}
    d.drain()
    ad.close()
    assert freed, "no plan was applied"
    for pid, seq, processed, done, wsteps in freed:
        assert processed >= seq and done, (pid, seq, processed, done)
        if lag and not async_:  # the copy completes on its lag-th poll: lag - 1 steps after launch
            assert wsteps - launched_at[pid] >= lag - 1, (pid, launched_at[pid], wsteps)


def test_fence_check_catches_a_free_behind_the_adapters_back(model):
    """The pool-level check does not trust the adapter's own bookkeeping: a source given
    back to the pool by anyone before its fence is reported as a broken fence."""
    from vtoken.vllm_adapter.adapter import AdapterAssumptionError

    ad, w, d = make(model, S=8, N=64, H=4, ratio=0.5, async_=True, lag=3)
    for i in range(3):
        ad.add_request(f"q{i}", prompt(i, 40 + 5 * i), max_tokens=30)
    for _ in range(300):
        d.step()
        if ad.plans:
            break
    plan = next(iter(ad.plans.values()))
    ad.pool.free_blocks([ad.block(plan.sources[0])])
    with pytest.raises(AdapterAssumptionError, match=r"\[fence\].*block \d+ \(source of plan"):
        ad.check_all()


# ---------------------------------------------------------------------------- prefix caching
def test_no_shared_block_moved_with_prefix_caching(model):
    S, degree = 8, 4
    ad, w, d = make(model, S=S, N=96, H=6, ratio=0.5, async_=True, caching=True)
    prefix = prompt(99, 8 * S)
    ad.add_request("s0", prefix + prompt(0, 8 * S), max_tokens=24)
    d.step()
    for i in range(1, degree):
        ad.add_request(f"s{i}", prefix + prompt(i, 8 * S), max_tokens=24)
    sources_at_plan = []
    orig = ad.book.launch

    def spy(meta, r, p, *rest):
        for b in p.sources:
            blk = ad.block(b)
            sources_at_plan.append((b, blk.ref_cnt, int(ad.table.block_refs(b))))
        orig(meta, r, p, *rest)

    ad.book.launch = spy
    shared_ids = None
    while ad.has_work():
        d.step()
        if shared_ids is None and all(r in ad.req_to_blocks for r in ("s0", "s1", f"s{degree - 1}")):
            shared_ids = [b.block_id for b in ad.req_to_blocks["s0"][:8]]
            for i in range(1, degree):
                assert [b.block_id for b in ad.req_to_blocks[f"s{i}"][:8]] == shared_ids
            assert all(ad.block(b).ref_cnt == degree for b in shared_ids)
        if shared_ids is not None and all(f"s{i}" in ad.req_to_blocks for i in range(degree)):
            for i in range(degree):  # the shared prefix is still in place in every list
                assert [b.block_id for b in ad.req_to_blocks[f"s{i}"][:8]] == shared_ids
    ad.close()
    assert shared_ids is not None and sources_at_plan, "no sharing or no plan"
    assert all(rc == 1 and tr == 1 for _, rc, tr in sources_at_plan), sources_at_plan
    assert ad.stats["shared_blocks_moved"] == 0 and w.hash_failures == 0
    assert w.stats["cached_tokens"] == (degree - 1) * 8 * S  # the prefix was a cache hit


def _block_digest(kv, block: int) -> int:
    import torch
    import xxhash

    S = kv.block_size
    slots = torch.arange(block * S, (block + 1) * S, dtype=torch.int64)
    return xxhash.xxh3_64_intdigest(kv.slot_bytes(slots).cpu().numpy().tobytes())


@pytest.mark.parametrize("async_", [False, True])
def test_prefix_hit_on_inflight_source_regression(model, async_):
    """The crash of issue 10: prefix caching on, a plan in flight (copy lag 3), a new request
    with the same prefix. Its sources' hashes were kept while the copy ran, vLLM handed them
    out as prefix hits (ref_cnt 2), and applying the plan then refused a shared block. The
    rule now: a plan's sources' hashes are parked at launch (back when the plan ends), so no
    hit can land on a source while its copy flies."""
    S = 4
    ad, w, d = make(model, S=S, N=64, H=4, ratio=0.5, async_=async_, lag=3, caching=True)
    pre = prompt(0, 24)
    ad.add_request("a", pre, max_tokens=40)
    for _ in range(200):
        d.step()
        if ad.plans:
            break
    plan = next(iter(ad.plans.values()))
    assert all(ad.block(b).block_hash is None for b in plan.sources), "a source in flight still carries a hash"
    hashed = ad.stats["source_hashes_dropped"] + ad.stats.get("source_hashes_parked", 0)
    assert hashed > 0, "the plan's sources were never hashed: not the case under test"
    ad.add_request("b", pre + [7, 8, 9], max_tokens=4)
    hits, flying = set(), set()
    orig = w.execute

    def spy(so):
        for dnew in so.scheduled_new_reqs:
            if dnew.req_id == "b":  # hits on blocks that are sources of a plan in flight right now
                hit = set(dnew.block_ids[0][: dnew.num_computed_tokens // S])
                now = {b for q in ad.plans.values() for b in q.sources}
                hits.update(hit)
                flying.update(hit & now)
        return orig(so)

    w.execute = spy
    run_to_end(ad, d)  # used to die in the worker with TableError [shared_block]
    assert not flying, f"prefix hit on in-flight sources {sorted(flying)}"
    assert ad.stats["shared_blocks_moved"] == 0 and w.hash_failures == 0


def test_prefix_hit_reads_the_bytes_its_hash_promises(model):
    """A later request with a's prompt hits a's prompt blocks and gets the bytes a's prefill
    wrote there (a keeps decoding and relocating around the shared blocks meanwhile)."""
    S = 8
    ad, w, d = make(model, S=S, N=64, H=4, ratio=0.5, async_=False, caching=True)
    p = prompt(5, 6 * S)
    ad.add_request("a", p, max_tokens=40)
    d.step()  # a's prefill: record its prompt blocks' bytes
    prompt_blocks = [b.block_id for b in ad.req_to_blocks["a"][:6]]
    want = {b: _block_digest(w.kv, b) for b in prompt_blocks}
    while ad.requests["a"].num_output_tokens < 2:
        d.step()
    ad.add_request("b", p + prompt(6, 5), max_tokens=4)
    hits = {}
    orig = w.execute

    def spy(so):
        for dnew in so.scheduled_new_reqs:
            if dnew.req_id == "b":
                k = dnew.num_computed_tokens // S
                hits.update({i: dnew.block_ids[0][i] for i in range(k)})
        return orig(so)

    w.execute = spy
    d.step()
    hit_digests = {i: _block_digest(w.kv, b) for i, b in hits.items()}
    run_to_end(ad, d)
    assert hits, "no prefix hit: not the case under test"
    for i, b in hits.items():
        assert b == prompt_blocks[i] and hit_digests[i] == want[b], f"hit block {b} at index {i} holds other bytes"


# ---------------------------------------------------------------------------- reservation
def test_headroom_is_reserved_and_backpressure_holds_new_requests(model):
    ad, w, d = make(model, S=8, N=56, H=4, ratio=0.5)  # the headroom may reach 55 // 8 = 6 blocks
    ad.add_request("a", prompt(0, 17), max_tokens=60)  # 3 blocks: room for 7 decode tokens
    d.step()
    assert len(ad.headroom) == 4 and all(b.ref_cnt == 1 and b.block_hash is None for b in ad.headroom)
    # the pool runs dry (someone else holds the rest) and the reservation grows: short headroom
    grabbed = ad.pool.get_new_blocks(ad.pool.get_num_free_blocks())
    ad.reserve.size = 6
    ad.add_request("b", prompt(1, 12), max_tokens=4)
    b = ad.scheduler.requests["b"]  # vLLM owns it at once: visible, counted, abortable
    for _ in range(3):
        d.step()
        assert b.num_computed_tokens == 0 and b not in ad.scheduler.running, "admitted while the headroom was short"
        assert b in list(ad.scheduler.waiting), "a withheld request is back in vLLM's queue between steps"
        assert all(not any(x is h for x in lst) for lst in ad.req_to_blocks.values() for h in ad.headroom)
    assert ad.stats["backpressure_steps"] >= 3
    ad.pool.free_blocks(grabbed)
    d.step()
    assert b.num_computed_tokens > 0 and len(ad.headroom) == 6
    run_to_end(ad, d)


def test_an_abort_reaches_a_request_held_back_by_backpressure(model):
    """vLLM's own finish_requests / has_requests see a back-pressured request (issue 13:
    an abort sent before admission was lost)."""
    from vllm.v1.request import RequestStatus

    ad, w, d = make(model, S=8, N=56, H=4, ratio=0.5)
    ad.add_request("a", prompt(0, 17), max_tokens=60)
    d.step()
    grabbed = ad.pool.get_new_blocks(ad.pool.get_num_free_blocks())
    ad.reserve.size = 6
    ad.add_request("b", prompt(1, 12), max_tokens=4)
    d.step()
    assert ad.stats["backpressure_steps"] >= 1 and ad.scheduler.get_num_unfinished_requests() == 2
    ad.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert "b" not in ad.scheduler.requests and ad.scheduler.get_num_unfinished_requests() == 1
    ad.pool.free_blocks(grabbed)
    run_to_end(ad, d)
    assert ad.requests["b"].status == RequestStatus.FINISHED_ABORTED


def test_the_soft_reservation_draws_at_launch_and_holds_nothing_across_steps(model):
    """``keep_headroom`` (the default with ``keep_prefix_bytes``, in-place plans and no planner
    headroom): plans draw their destinations from vLLM's free blocks at launch, so between steps
    the adapter holds no idle block (none is counted kept, none is kept from vLLM); with nothing
    evicted nothing may be drawn (vLLM's own tests see the whole pool); with evictions plans
    draw and use destinations, at most ``keep_headroom`` a step; no step is back-pressured."""
    for ratio in (0.0, 0.5):
        ad, w, d = make(model, S=8, N=120, H=0, ratio=ratio, keep=True)
        soft = AdapterConfig().keep_headroom
        assert (ad.reserve.size, ad.reserve.soft, ad.reserve.target()) == (0, soft, 0)
        for i in range(3):
            ad.add_request(f"q{i}", prompt(i, 30 + 9 * i), max_tokens=40)
        drawn = []
        for k in range(400):
            if not ad.has_work():
                break
            if k % 7 == 3:  # as a plan's unwritten destinations come back at its end (a token died in flight)
                ad.lifecycle.refill(2)
            d.step()
            assert not ad.headroom, "a soft reservation's block was held across steps"
            drawn.append(ad.reserve.drawn)
            if ad.table.num_dead_tokens:
                needed, ad.reserve.needed = ad.reserve.needed, lambda: False  # as when the last evicted token left
                assert ad.reserve.drawable() == 0
                ad.reserve.needed = needed
        run_to_end(ad, d)
        assert ad.stats["backpressure_steps"] == 0 and max(drawn) <= soft
        if ratio:
            assert max(drawn) > 0 and ad.stats["dests_used"] > 0, (drawn, ad.stats)
        else:
            assert max(drawn) == 0 and ad.stats["plans"] == 0


def test_the_soft_reservation_leaves_the_next_admission_its_prompt(model):
    """A soft reservation draws only what the running requests' next blocks and the waiting
    queue's next prompt leave (a planner reservation keeps that prompt's room only at idle and
    holds fresh admissions back while short): with the pool otherwise dry nothing may be drawn,
    and the request is admitted at the next step."""
    ad, w, d = make(model, S=8, N=64, H=0, ratio=0.5, keep=True)
    ad.add_request("a", prompt(0, 40), max_tokens=60)
    for _ in range(30):
        d.step()
        if ad.stats["dests_used"]:
            break
    assert ad.stats["dests_used"], "no destination drawn: not the case under test"
    spare = 3 + 1  # b's prompt (24 tokens) and a's next block
    grabbed = ad.pool.get_new_blocks(max(0, ad.pool.get_num_free_blocks() - spare))
    ad.add_request("b", prompt(1, 24), max_tokens=4)
    assert ad.table.num_dead_tokens and ad.reserve.drawable() == 0
    d.step()
    b = ad.scheduler.requests["b"]
    assert b.num_computed_tokens > 0 and b in ad.scheduler.running, "the soft reservation kept an admission out"
    assert ad.stats["backpressure_steps"] == 0
    ad.pool.free_blocks(grabbed)
    run_to_end(ad, d)


# ---------------------------------------------------------------------------- drain
@pytest.mark.parametrize("async_,caching,lag,vllm_clock", [(False, False, 0, False), (True, True, 0, False),
                                                           (True, True, 2, False), (False, True, 3, False),
                                                           (True, True, 2, True), (False, True, 0, True)])
def test_every_block_returned_after_drain(model, async_, caching, lag, vllm_clock):
    N = 30
    ad, w, d = make(model, S=4, N=N, H=3, ratio=0.5, async_=async_, caching=caching, lag=lag, batched=64,
                    vllm_clock=vllm_clock)
    for i in range(6):
        ad.add_request(f"q{i}", prompt(i, 6 + 4 * i, base=3), max_tokens=20 + 3 * i)
    d.drain()
    report = ad.close()
    assert report["free"] == N - 1 == ad.pool.get_num_free_blocks()
    assert all(b.ref_cnt == 0 for b in ad.pool.blocks if not b.is_null)
    assert not ad.frees_waiting() and not ad.plans and not ad.headroom
    assert not ad.table.requests()
    assert ad.stats["applied"] > 0 and w.hash_failures == 0


# ---------------------------------------------------------------------------- the audit pieces
def test_audit_decode_quick(model):
    from vtoken.reports.vllm_runs import audit_decode

    res = audit_decode(quick=True, seed=0)
    assert res["passed"], res["detail"]
    assert res["outputs_equal"] and res["relocations"] > 0
    assert res["hash_checks"] >= 2 * res["relocations"] and res["hash_failures"] == 0
    assert res["retained_blocks_on"] < res["retained_blocks_off"]
    assert res["figures"] and all(png[:4] == b"\x89PNG" for _, png in res["figures"])


def test_the_audits_decode_runs_retain_a_quarter_fewer_blocks_than_naive_evict(model):
    """Issue 38's bar, held: on the audit's full decode runs (two policies, copy lag, hybrid
    layout; prefix-cache bytes kept, the default) vtoken's mean retained blocks are at least 25%
    below Naive-Evict's (reclamation off). Seeded: the figure is a function of the code, so a
    change that gives the saving up fails here, not in a later audit."""
    from vtoken.reports.vllm_runs import audit_decode

    res = audit_decode(quick=False, seed=0)
    assert res["passed"], res["detail"]
    on, off = res["retained_blocks_on"], res["retained_blocks_off"]
    assert on <= 0.75 * off, f"retained blocks {off} (Naive-Evict) -> {on} (vtoken): {1 - on / off:.1%} fewer, want >= 25%"


def test_sharing_table_reduces_retained_blocks_at_every_degree(model):
    from vtoken.reports.vllm_runs import sharing_table

    res = sharing_table(quick=True, seed=0)
    assert res["passed"], res["detail"]
    assert [r["degree"] for r in res["rows"]] == [1, 2, 4, 8]
    for r in res["rows"]:
        assert r["retained_on"] < r["retained_off"], r
        assert r["reduction_pct"] > 0 and r["shared_blocks_moved"] == 0
        assert r["hash_checks"] > 0 and r["hash_failures"] == 0
    assert res["figures"][0][1][:4] == b"\x89PNG"


def test_check_assumptions_all_hold(model):
    from vtoken.vllm_adapter.adapter import ASSUMPTIONS
    from vtoken.reports.vllm_runs import check_assumptions

    rows = check_assumptions()
    assert {r["name"] for r in rows} == set(ASSUMPTIONS) - {"outputs_equal"}
    assert all(r["passed"] is True for r in rows), [r for r in rows if r["passed"] is not True]


def test_reset_prefix_cache_succeeds_when_idle(model):
    """vLLM's /reset_prefix_cache (and weight-sync flows) with the adapter attached: the
    headroom goes back first, so an idle scheduler resets; the reservation is retaken at the
    next step (issue 13: the reset never succeeded)."""
    ad, w, d = make(model, S=8, N=40, H=4, ratio=0.0)
    ad.add_request("a", prompt(0, 17), max_tokens=3)
    d.step()
    assert len(ad.headroom) == 4
    d.drain()  # idle: nothing reserved (vLLM's leak check sees the whole pool)
    assert not ad.headroom and not ad.scheduler.has_requests() and ad.pool.get_num_free_blocks() == ad.N - 1
    ad.headroom = ad.pool.get_new_blocks(4)  # as if idle had not returned it: the hook must
    assert ad.scheduler.reset_prefix_cache() is True
    assert not ad.headroom and ad.pool.get_num_free_blocks() == ad.N - 1
    assert len(ad.pool.cached_block_hash_to_block) == 0  # the prefix cache is empty
    ad.add_request("b", prompt(0, 17), max_tokens=3)
    d.step()
    assert len(ad.headroom) == 4
    run_to_end(ad, d)


def _spec(kind: str, S: int = 4):
    import torch
    import vllm.v1.kv_cache_interface as kvi

    geo = dict(block_size=S, num_kv_heads=1, head_size=1, dtype=torch.float32)
    extra = {"SlidingWindowSpec": dict(sliding_window=2 * S), "ChunkedLocalAttentionSpec": dict(attention_chunk_size=2 * S),
             "RSWASpec": dict(rswa_window=2 * S), "MLAAttentionSpec": {}, "FullAttentionSpec": {}}
    return getattr(kvi, kind)(**geo, **extra[kind])


@pytest.mark.parametrize("kinds, group", [
    (["FullAttentionSpec"], 0),
    (["MLAAttentionSpec"], 0),
    (["SlidingWindowSpec"], None),
    (["ChunkedLocalAttentionSpec"], None),
    (["RSWASpec"], None),  # a FullAttentionSpec subclass whose manager frees a middle gap itself
    (["FullAttentionSpec", "SlidingWindowSpec"], 0),
    (["SlidingWindowSpec", "FullAttentionSpec"], 1),
    (["ChunkedLocalAttentionSpec", "RSWASpec", "FullAttentionSpec"], 2),
])
def test_the_table_group_is_derived_from_the_managers_vllm_built(monkeypatch, kinds, group):
    """The token table mirrors the first group whose manager keeps every block until the
    request ends, derived from the manager's behaviour, not its spec's class name (RSWA
    subclasses FullAttentionSpec and frees blocks itself); with none, the adapter attaches
    and reclaims nothing, its checks covering every group."""
    import vtoken.vllm_adapter.harness as H
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from vtoken.vllm_adapter.adapter import VTokenAdapter, default_adapter_planner_config
    from vtoken.vllm_adapter.layout import table_group

    def cfg(block_size, num_blocks, *_):
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], _spec(k)) for i, k in enumerate(kinds)])

    monkeypatch.setattr(H, "_kv_cache_config", cfg)
    h = H.VllmHarness(block_size=4, num_blocks=48)
    assert table_group(h.managers) == group
    ad = VTokenAdapter.attach(h.scheduler, paranoid_checks=True, planner_config=default_adapter_planner_config(headroom=2))
    assert ad.group == group and ad.reclaim == (group is not None)
    for i in range(3):
        ad.add_request(f"r{i}", prompt(i, 9 + 4 * i), max_tokens=8)
    while ad.has_work():  # vLLM's own window frees run in the other groups; every check passes
        so = ad.schedule()
        ad.update_from_output(so, h.fake_output(so, set(so.num_scheduled_tokens)))
    assert ad.close()["free"] == 47


@pytest.mark.parametrize("async_", [False, True])
def test_the_adapters_clock_counts_as_vllms_would(async_):
    """vLLM's defer_block_free off (its default): the adapter keeps it off and counts steps
    itself, exactly as vLLM counts when it is on (a second scheduler with the flag on, driven
    alike, is the reference); a fenced free waits in the port until its step is processed."""
    from vtoken.vllm_adapter.adapter import VTokenAdapter
    from vtoken.vllm_adapter.harness import VllmHarness

    ad = VTokenAdapter(block_size=4, num_blocks=40, async_scheduling=async_, reclaim=False)
    ref = VllmHarness(block_size=4, num_blocks=40, async_scheduling=async_)
    ref.scheduler.defer_block_free = True
    assert ad.clock.own and not ad.scheduler.defer_block_free
    for h in (ad, ref):
        h.add_request("a", prompt(0, 9), max_tokens=6)
        h.add_request("b", prompt(1, 5), max_tokens=3)
    queue = []
    while ad.has_work() or queue:
        if ad.has_work():
            so, so_ref = ad.schedule(), ref.schedule()
            queue.append((so, so_ref, set(so.num_scheduled_tokens)))
        if len(queue) > int(async_) or not ad.has_work():
            so, so_ref, sampling = queue.pop(0)
            ad.update_from_output(so, ad.harness.fake_output(so, sampling))
            ref.finish(so_ref)
        assert (ad.clock.seq, ad.clock.processed) == (ref.scheduler.sched_step_seq, ref.scheduler.processed_step_seq)
    assert ad.clock.seq > 0 and not ad.clock.last  # every request's last step forgotten at its free
    # a fenced free: deferred until its step is processed, then drained by the hook
    blk = ad.pool.get_new_blocks(1)[0]
    ad.port.free([blk.block_id], ad.clock.processed + 1)
    assert blk.ref_cnt == 1 and ad.frees_waiting()
    ad.add_request("c", prompt(2, 5), max_tokens=1)
    so = ad.schedule()
    ad.update_from_output(so, ad.harness.fake_output(so, {"c"}))
    assert blk.ref_cnt == 0 and not ad.port.deferred


@pytest.mark.parametrize("what", ["headroom", "held"])
def test_a_held_block_in_a_sliding_window_list_is_caught(what):
    """Hybrid layout: a block the adapter holds (headroom, or a destination held for a
    request) that vLLM hands to the sliding-window group's list, after a free behind the
    adapter's back, is caught by the full scan, naming the group (``kv_groups``; counted over the
    table's group alone, ref_cnt 1 = the adapter's 1 looked right)."""
    from vtoken.vllm_adapter.adapter import AdapterAssumptionError, VTokenAdapter, default_adapter_planner_config

    ad = VTokenAdapter(kv_layout="hybrid", block_size=4, num_blocks=64,
                       planner_config=default_adapter_planner_config(headroom=3))
    ad.add_request("a", prompt(0, 13), max_tokens=8)
    so = ad.schedule()
    ad.update_from_output(so, ad.harness.fake_output(so, {"a"}))
    assert ad.group == 0 and len(ad.headroom) == 3
    pool = ad.pool
    if what == "headroom":
        victim = ad.headroom[0]
    else:
        victim = pool.blocks[ad.lifecycle.headroom[0]]
        ad.lifecycle.headroom.remove(victim.block_id)  # a destination the request keeps
        ad.lifecycle.hold("a", [victim.block_id])
    ad.check_all()  # consistent so far
    pool.free_blocks([victim])  # behind the adapter's back ...
    (again,) = pool.get_new_blocks(1)  # ... and handed out again, to the window group's list
    assert again is victim
    ad.harness.managers[1].req_to_blocks["a"].append(victim)
    with pytest.raises(AdapterAssumptionError, match=r"\[kv_groups\].*list of KV cache group 1"):
        ad.check_all()


@pytest.mark.parametrize("async_", [False, True])
def test_no_preemption_churn_on_a_tight_pool(model, async_):
    """One request of 80 + 40 tokens in 9 usable blocks of 16 (issue 13: 51 steps and 9
    preemptions with the adapter, 41 and 0 on vLLM): the headroom yields to the running
    request's growth and, when idle, to the next prompt, so the schedule is vLLM's own,
    step for step (the same driver with reclamation off is the reference: the async driver
    counts the pipeline's last step)."""
    from vtoken.vllm_adapter.harness import VllmHarness

    h = VllmHarness(block_size=16, num_blocks=10, prefix_caching=True, max_model_len=512, async_scheduling=async_)
    h.add_request("a", prompt(0, 80), max_tokens=40)
    assert h.drain() == 41
    runs = {}
    for reclaim in (False, True):
        ad, w, d = make(model, S=16, N=10, H=8, ratio=0.0, async_=async_, reclaim=reclaim)
        ad.add_request("a", prompt(0, 80), max_tokens=40)
        runs[reclaim] = (d.drain(), ad.stats["preemptions"], ad.output_tokens("a"))
        ad.close()
    assert runs[True][1] == 0, f"{runs[True][1]} preemptions (vLLM alone: none)"
    assert runs[True] == runs[False], f"steps / preemptions: {runs[True][:2]} with reclamation, {runs[False][:2]} without"


def test_the_headroom_is_capped_by_the_live_pool(model):
    """On a tight pool the reservation is a fraction of it (issue 13: on 5-10 block pools a
    full headroom starved vLLM's own schedule): 1/4 here (``make``), 1/16 by default."""
    from vtoken.vllm_adapter.adapter import VTokenAdapter

    ad, w, d = make(model, S=8, N=24, H=16, ratio=0.0)
    ad.add_request("a", prompt(0, 17), max_tokens=8)
    d.step()
    assert len(ad.headroom) == (24 - 1) // 4
    assert VTokenAdapter(block_size=8, num_blocks=16).reserve.target() == 0  # the default: none below 17 blocks
    with pytest.raises(ValueError, match="headroom_pool_fraction"):
        VTokenAdapter(block_size=8, num_blocks=16, headroom_pool_fraction=0)
    run_to_end(ad, d)


@pytest.mark.parametrize("async_", [False, True])
def test_reset_prefix_cache_with_running_requests(model, async_):
    """reset_prefix_cache(reset_running_requests=True) with a step in flight (vLLM's weight
    sync): vLLM preempts every running request and resets; the adapter's fence must not hold
    their blocks (issue 13: RuntimeError 'Failed to reset KV cache')."""
    ad, w, d = make(model, S=8, N=56, H=4, ratio=0.0, async_=async_)
    ad.add_request("a", prompt(0, 17), max_tokens=12)
    ad.add_request("b", prompt(1, 9), max_tokens=12)
    for _ in range(3):
        d.step()
    assert ad.scheduler.running
    assert ad.scheduler.reset_prefix_cache(reset_running_requests=True) is True
    assert ad.scheduler.defer_block_free is False  # vLLM's own flag: the adapter never switches it
    run_to_end(ad, d)
    assert len(ad.output_tokens("a")) == 12 and len(ad.output_tokens("b")) == 12


def test_an_unaudited_vllm_version_is_refused_at_start(monkeypatch):
    """The adapter starts only on a vLLM it was audited on (issue 13; SUPPORTED_VLLM: 0.32.0 and
    0.33.0), unless the audit of a candidate version names it in $VTOKEN_ALLOW_UNSUPPORTED_VLLM;
    refused before anything is built."""
    import vllm

    from vtoken.vllm_adapter import SUPPORTED_VLLM
    from vtoken.vllm_adapter.adapter import VTokenAdapter
    from vtoken.vllm_adapter.assumptions import ALLOW_ENV, AdapterAssumptionError

    assert SUPPORTED_VLLM == ("0.32.0", "0.33.0")
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    with pytest.raises(AdapterAssumptionError, match=r"\[vllm_version\].*0\.31\.0 is installed.*supports 0\.32\.0, 0\.33\.0"):
        VTokenAdapter(block_size=8, num_blocks=32)
    monkeypatch.setenv(ALLOW_ENV, "0.30.0")  # another version named: still refused
    with pytest.raises(AdapterAssumptionError, match=r"\[vllm_version\]"):
        VTokenAdapter(block_size=8, num_blocks=32)
    monkeypatch.setenv(ALLOW_ENV, "0.31.0")  # the audit of 0.31.0
    VTokenAdapter(block_size=8, num_blocks=32).close()
    monkeypatch.delenv(ALLOW_ENV)
    monkeypatch.setattr(vllm, "__version__", "0.32.0")  # supported: the CPU engine's version
    VTokenAdapter(block_size=8, num_blocks=32).close()


@pytest.mark.parametrize("async_", [False, True])
def test_in_place_plan_holds_its_fills_hashless_and_gives_them_back(model, async_):
    """In-place compaction (the default): a plan's fills (the request's blocks whose holes
    take the moved tokens) leave the request's list at launch like its sources, carry no
    prefix-cache hash, are never free while the copy flies, and come back to the request
    (``held``) when it reports; no headroom block is ever used."""
    S = 4
    ad, w, d = make(model, S=S, N=64, H=0, ratio=0.5, async_=async_, lag=3, caching=True)
    assert ad.cfg.in_place and ad.headroom == []
    for i in range(3):
        ad.add_request(f"q{i}", prompt(i, 24 + 4 * i), max_tokens=40)
    seen: dict = {}
    back = 0
    while ad.has_work():
        d.step()
        for pid, p in ad.plans.items():
            if p.fills and not p.orphaned:
                seen[pid] = p
        free = {b.block_id for b in ad.pool.free_block_queue.get_all_free_blocks()}
        for pid, p in list(seen.items()):
            if pid in ad.plans:
                lst = ad.req_to_blocks.get(p.req_id, [])
                for b in map(ad.block, p.fills):
                    assert b.block_hash is None and b.ref_cnt == 1 and b.block_id not in free, b
                    assert not any(x is b for x in lst), f"fill {b.block_id} still in {p.req_id}'s list"
            elif not p.orphaned and p.req_id in ad.mirror:
                held = set(ad.held.get(p.req_id, ()))
                back += all(b.block_id in held or b.ref_cnt == 0 for b in map(ad.block, p.fills))
                del seen[pid]
    ad.close()
    assert ad.stats["fills"] > 0 and back > 0, (ad.stats["fills"], back)
    assert ad.stats["dests_used"] == 0 and ad.stats["applied"] > 0
    assert w.hash_failures == 0 and w.hash_checks >= 2 * ad.stats["applied"]


def test_the_adapter_bench_breaks_the_step_down_into_its_parts():
    """``vtoken bench adapter --breakdown``: every part of an adapter step timed in a pass of
    its own: the replica's replay, the plan step (none with reclamation off), the checks and
    the rest of the hooks, each a non-negative share; the measured ratios are there as ever."""
    from vtoken.reports.bench_adapter import PHASES, RUN_PARTS, bench_adapter, breakdown_text, parts_text

    res = bench_adapter(quick=True, breakdown=True)
    b = res["breakdown_ms"]["8"]
    assert b["plain_step"] > 0 and set(res["ratio"]["8"]) >= {"off", "evict50"}
    for v in ("off", "evict50"):
        assert set(b[v]) == set(PHASES) and min(b[v].values()) >= 0, b
        assert b[v]["replay"] > 0 and b[v]["checks"] > 0, b
    assert b["off"]["plan"] == 0 < b["evict50"]["plan"], b  # reclamation off never plans
    assert "R=8 evict50 (ms/step" in breakdown_text(res, "8")
    # the whole run beside the window: every variant ran the same steps, prefill and the
    # requests' ends (10 decode steps + 48 tokens after them) included
    steps = res["run_steps"]["8"]
    assert len(set(steps.values())) == 1 and steps["plain"] > res["steps"] + 48, steps
    assert set(res["ratio_run"]["8"]) == set(res["ratio"]["8"]) and min(res["ratio_run"]["8"].values()) > 0
    # its three parts: the same steps in every variant, each part non-empty, a ratio for each
    d, e, n = res["parts_steps"]["8"]["plain"]
    assert 0 < d < e < n == steps["plain"] and all(x == [d, e, n] for x in res["parts_steps"]["8"].values()), res
    assert set(res["ratio_parts"]["8"]) == set(res["ratio"]["8"]), res["ratio_parts"]
    assert all(set(x) == set(RUN_PARTS) and min(x.values()) > 0 for x in res["ratio_parts"]["8"].values())
    assert f"(prefill steps 0-{d - 1}, decode {d}-{e - 1}, ends {e}-{n - 1}): off x" in parts_text(res, "8")


def test_the_adapter_benchs_parts_split_each_runs_total():
    """``_Run.parts``: the prefill ends where every request decodes, the decode part where a
    request first finishes (before it every request runs, from it on fewer), and the parts'
    times add up to the run's total; a run not driven to its end has no parts."""
    from vtoken.reports.bench_adapter import RUN_PARTS, _model, _prompts, _Run, _whole_runs

    R, model = 8, _model()
    prompts = _prompts(0, R, True)
    runs = [_Run(v, R, prompts, 12, 0, model) for v in ("plain", "off")]
    assert runs[0].parts() == {}
    runs[0].step(False)
    assert runs[0].parts() == {}  # not at its end
    runs = [_Run(v, R, prompts, 12, 0, model) for v in ("plain", "off")]
    counts = {id(run): [] for run in runs}
    for run in runs:  # the running count after each step
        step = run.step

        def counted(measure, run=run, step=step):
            more = step(measure)
            counts[id(run)].append(len(run.sched.running))
            return more

        run.step = counted
    _whole_runs(runs, R, 4)
    for run in runs:
        p, running = run.parts(), counts[id(run)]
        d, e, n = p["parts_steps"]
        assert n == len(run.run_times) == len(running) and 0 < d < e < n, p
        assert min(running[d:e]) == R > running[e], (d, e, running)
        assert set(p["parts_ms"]) == set(RUN_PARTS)
        assert sum(p["parts_ms"].values()) == pytest.approx(sum(run.run_times) * 1e3)


def test_the_adapter_bench_compares_two_trees_in_one_process():
    """``vtoken bench adapter --against REF``: commit REF's adapter runs beside this tree's in one
    process, as a package of its own (its absolute imports renamed, so none reaches this tree's
    modules), each variant's mean step over the same plain run's, per tree. A ref that names no
    commit is refused by name, with nothing loaded."""
    import subprocess
    import sys
    from pathlib import Path

    import vtoken
    from vtoken.reports.bench_adapter import _ABS_NAME, _IMPORT, against_text, bench_against

    root = Path(vtoken.__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    path_before = list(sys.path)
    with pytest.raises(ValueError, match=r"ref 'no-such-ref'.*no such commit"):
        bench_against("no-such-ref", quick=True)
    assert sys.path == path_before
    with pytest.raises(ValueError, match=r"--variants: \['plain'\]"):
        bench_against("HEAD", quick=True, variants=("plain",))

    res = bench_against("HEAD", quick=True, variants=("off",))
    assert res["commit"] == head and set(res["ratio_mean"]["8"]) == {"off@ref", "off@head"}
    assert all(x > 0 for xs in res["ratio_mean"]["8"].values() for x in xs) and res["head_over_ref"]["8"]["off"] > 0
    assert all(x > 0 for xs in res["ratio_run"]["8"].values() for x in xs) and res["run_head_over_ref"]["8"]["off"] > 0
    assert "whole run x" in against_text(res, "8")
    work = res["work"]["8"]  # what each run did: reclamation off plans nothing, and blocks stay in use
    assert set(work) == {"off@ref", "off@head"} and all(len(w) == 1 for w in work.values())
    assert all(w[0]["plans"] == w[0]["sources_freed"] == w[0]["moves"] == 0 < w[0]["retained_mean"]
               for w in work.values()), work
    pkg = f"vtoken_at_{head[:12]}"
    ref_table = sys.modules[f"{pkg}.table"]
    assert ref_table.TokenTable is not vtoken.TokenTable
    ref_root = Path(sys.modules[pkg].__file__).parent
    assert root not in ref_root.parents and sys.modules[f"{pkg}.vllm_adapter.adapter"].__file__.startswith(str(ref_root))
    for f in ref_root.rglob("*.py"):  # no absolute import of this tree's package is left in the copy
        text = f.read_text()
        assert not _IMPORT.search(text) and not _ABS_NAME.search(text), f
    assert against_text(res, "8").startswith(f"R=8: off x") and head[:12] in against_text(res, "8")


def test_the_adapter_benchs_keepoff_variant_turns_only_prefix_keeping_off():
    """``evict50_keepoff`` (``--against`` only): the ``evict50`` adapter with ``keep_prefix_bytes``
    off and every other setting as ``evict50``'s; ``evict50_noplan`` the same with reclamation off;
    the bench itself runs neither, and a name outside both lists is refused by name."""
    from vtoken.reports.bench_adapter import AGAINST_ONLY, VARIANTS, _model, _Run, bench_against

    assert "evict50_keepoff" in AGAINST_ONLY and not set(AGAINST_ONLY) & set(VARIANTS)
    prompts = [[1 + (i * 7 + j) % 60 for j in range(40)] for i in range(3)]
    model = _model()
    on, off = (_Run(v, 3, prompts, 8, 0, model) for v in ("evict50", "evict50_keepoff"))
    assert on.ad.config.keep_prefix_bytes is True and off.ad.config.keep_prefix_bytes is False
    assert {k: v for k, v in vars(on.ad.config).items() if k != "keep_prefix_bytes"} == \
        {k: v for k, v in vars(off.ad.config).items() if k != "keep_prefix_bytes"}
    assert on.w.evict_ratio == off.w.evict_ratio == 0.5
    noplan = _Run("evict50_noplan", 3, prompts, 8, 0, model)  # the floor: evictions, reclamation off
    assert "evict50_noplan" in AGAINST_ONLY and noplan.ad.reclaim is False and noplan.ad.checks is True
    assert noplan.w.evict_ratio == 0.5 and {k: v for k, v in vars(noplan.ad.config).items() if k != "reclaim"} == \
        {k: v for k, v in vars(on.ad.config).items() if k != "reclaim"}
    with pytest.raises(ValueError, match=r"--variants: \['evict50_keep'\]"):
        bench_against("HEAD", quick=True, variants=("evict50_keep",))
