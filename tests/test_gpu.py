"""The CUDA path: relocation stream, events and the device-side wait (I3), CUDA graph replay
with the slot buffer updated in place, the ordering faults caught by the sentinel test,
and a decode on the device that equals Naive-Evict's; the engine's graph path (StepGraph)
against the eager path token for token, its replay ordering probed with the catalogue's
graph_replay_on_capture_stream, the decode loop and the fingerprint checks under
``torch.cuda.set_sync_debug_mode("error")``. Needs a CUDA device."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False here); "
                              "run scripts/gpu_check.sh on a GPU machine"),
]

from vtoken.copy_engine import KVCopyEngine  # noqa: E402
from vtoken.fuzz.faulty_engines import factory  # noqa: E402
from vtoken.invariants.i3_probe import ProbePlan as _ProbePlan  # noqa: E402
from vtoken.invariants.i3_probe import i3_probe  # noqa: E402
from vtoken.kvcache import KVCache  # noqa: E402
from vtoken.invariants.relocation_hash import RelocationChecker

SLEEP = 400_000_000  # cycles: ~0.2 s at 2 GHz, far longer than anything the host does meanwhile


def cuda_cache(nb=64, S=16, L=2, H=2, D=64, dtype=torch.float16):
    kv = KVCache(L, nb, S, H, D, dtype=dtype, device="cuda", checked=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    kv.kv.copy_(torch.randn(kv.kv.shape, generator=g, device="cuda").to(dtype))
    torch.cuda.synchronize()
    return kv


def probe_plan(S=16, n=40, src_block=3, dst_block=20):
    tok = np.arange(n, dtype=np.int64)
    moves = np.stack([tok, src_block + tok // S, tok % S, dst_block + tok // S, tok % S], axis=1)
    src = torch.from_numpy(moves[:, 1] * S + moves[:, 2]).cuda()
    dst = torch.from_numpy(moves[:, 3] * S + moves[:, 4]).cuda()
    return _ProbePlan(7, moves), src, dst


def test_stream_event_wait_no_host_block():
    kv = cuda_cache()
    plan, src, dst = probe_plan()
    want = kv.flat.index_select(2, src).clone()
    eng = KVCopyEngine(kv, 16, sentinel=True, sleep_cycles=SLEEP)
    h = eng.launch(plan)
    assert eng.poll(h) == "pending", "the relocation stream is asleep: the copy cannot be done yet"
    t0 = time.perf_counter()
    waited = eng.wait_before_attention()
    host_ms = (time.perf_counter() - t0) * 1e3
    assert waited == [7]
    got = kv.flat.index_select(2, dst)  # compute stream, after the device-side wait
    assert torch.equal(got, want)
    assert host_ms < 20, f"wait_before_attention blocked the host for {host_ms:.1f} ms"
    torch.cuda.synchronize()
    assert eng.poll(h) == "done" and eng.pending == 0
    assert eng.wait_before_attention() == []  # nothing left to wait for


def test_poll_is_nonblocking_and_wait_is_host_sync():
    kv = cuda_cache()
    plan, src, dst = probe_plan()
    want = kv.flat.index_select(2, src).clone()
    eng = KVCopyEngine(kv, 16, sentinel=True, sleep_cycles=SLEEP)
    h = eng.launch(plan)
    t0 = time.perf_counter()
    assert eng.poll(h) == "pending"
    assert (time.perf_counter() - t0) < 0.02
    assert eng.wait(h) == "done" and eng.stats["host_syncs"] == 1
    assert torch.equal(kv.flat.index_select(2, dst), want)


def test_failed_copy_and_faulty_bytes_on_cuda():
    kv = cuda_cache()
    plan, src, dst = probe_plan()
    want = kv.flat.index_select(2, src).clone()
    eng = KVCopyEngine(kv, 16)
    eng.fail_next_copy = True
    h = eng.launch(plan)
    assert eng.wait(h) == "failed"
    got = kv.flat.index_select(2, dst)
    assert torch.equal(got[:, :, :20], want[:, :, :20]) and not torch.equal(got, want)
    for fault in ("copy_flip_byte", "copy_skip_move"):
        kv = cuda_cache()
        want = kv.flat.index_select(2, src).clone()
        h = factory(fault)(kv, 16).launch(plan)
        torch.cuda.synchronize()
        bad = (kv.flat.index_select(2, dst) != want).flatten(3).any(-1).any(0).any(0)  # per move
        assert int(bad.sum()) == 1, fault


def test_timed_copy_reports_device_time():
    kv = cuda_cache(nb=256)
    plan, _, _ = probe_plan(n=1024, src_block=2, dst_block=100)
    eng = KVCopyEngine(kv, 16, timed=True)
    h = eng.launch(plan)
    eng.wait(h)
    ms = eng.copy_ms(h)
    assert ms is not None and ms > 0


def test_graph_replay_with_slot_buffer_updated_in_place():
    """A captured gather over a persistent slot buffer: update the buffer in place, replay, and
    the graph reads the new slots -- including destinations of a relocation that ran on the
    relocation stream outside the graph, ordered by the event wait before the replay."""
    kv = cuda_cache()
    n = 32
    slots = torch.zeros(n, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            out = kv.flat.index_select(2, slots)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = kv.flat.index_select(2, slots)
    rng = np.random.default_rng(0)
    for _ in range(3):
        new = torch.from_numpy(rng.choice(kv.num_slots, size=n, replace=False)).cuda()
        slots.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, kv.flat.index_select(2, new))
    # relocation outside the graph, then replay over the destinations
    plan, src, dst = probe_plan(n=n)
    want = kv.flat.index_select(2, src).clone()
    eng = KVCopyEngine(kv, 16, sentinel=True, sleep_cycles=SLEEP)
    eng.launch(plan)
    slots.copy_(dst)
    eng.wait_before_attention()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("scenario", ["wait", "poll"])
def test_i3_probe_clean(scenario):
    r = i3_probe(cuda_cache(), scenario=scenario, sleep_cycles=SLEEP)
    assert not r["sentinel_seen"] and r["bytes_equal"], r
    if scenario == "poll":
        assert r["first_poll"] == "pending", r


@pytest.mark.parametrize("fault,scenario", [("cuda_wait_dropped", "wait"),
                                            ("cuda_event_wrong_stream", "wait"),
                                            ("cuda_event_wrong_stream", "poll"),
                                            ("cuda_release_before_event", "poll")])
def test_ordering_faults_caught_by_sentinel(fault, scenario):
    r = i3_probe(cuda_cache(), scenario=scenario, fault=fault, engine_cls=factory(fault), sleep_cycles=SLEEP)
    assert r["sentinel_seen"] and not r["bytes_equal"], r


def test_fingerprint_same_on_cuda_and_cpu():
    from vtoken.invariants.relocation_hash import device_fingerprint, token_layer_digests

    kv = cuda_cache()
    cpu = KVCache(kv.num_layers, kv.num_blocks, kv.block_size, kv.num_kv_heads, kv.head_dim, dtype=kv.dtype)
    cpu.kv.copy_(kv.kv.cpu())
    s = torch.arange(16, 80)
    assert torch.equal(device_fingerprint(kv, s.cuda()).cpu(), device_fingerprint(cpu, s))
    assert np.array_equal(token_layer_digests(kv, s), token_layer_digests(cpu, s))


def _engine_run(mode, policy="random", cls=None, new_tokens=32, **kw):
    from vtoken.decode import DecodeEngine
    from vtoken.model import PagedDecoder
    from vtoken.decode import make_prompts
    from vtoken.planner import PlannerConfig

    model = PagedDecoder()
    prompts = make_prompts(4, 32, model.config.vocab_size, seed=1)
    cfg = PlannerConfig(theta_f=0.1, check_every=1, max_sources=8, headroom=8)
    eng = (cls or DecodeEngine)(model, mode=mode, policy=policy, evict_ratio=0.5, block_size=4, device="cuda",
                                planner_config=cfg, **kw)
    return eng, eng.run(prompts, new_tokens)


def test_engine_on_cuda_equals_naive_with_checks():
    _, ref = _engine_run("naive-evict")
    eng, res = _engine_run("vtoken", check_relocations=RelocationChecker)
    assert res.relocations > 0 and res.hash_failures == 0 and res.hash_checks == 2 * res.relocations
    assert eng.checker.method == "fingerprint"
    assert res.outputs == ref.outputs
    # the sentinel mode with the attention-input check: no sentinel ever reaches attention
    _, res2 = _engine_run("vtoken", copy_kwargs={"sentinel": True, "sleep_cycles": 50_000_000},
                          sentinel_check=True, check_relocations=RelocationChecker)
    assert res2.outputs == ref.outputs and res2.hash_failures == 0
    # full-bytes audit mode
    eng3, res3 = _engine_run("vtoken", check_relocations=RelocationChecker, full_bytes=True)
    assert eng3.checker.method == "xxh3" and res3.hash_failures == 0


@pytest.mark.parametrize("names", [("cuda_event_wrong_stream",),
                                   ("cuda_wait_dropped", "cuda_release_before_event")])
def test_engine_ordering_faults_caught(names):
    """In the engine, a copy is applied only once poll says done AND the next step's attention
    waits (device side) on every copy not yet observed done: two independent guards. A fault
    that defeats both (an event on the wrong stream; a dropped wait together with an early
    release) lets attention or the checker read destinations before the copy landed: the
    sentinel check (I3) or hash-and-compare catch it."""
    from vtoken.errors import RelocationCheckError

    eng = factory(*names)
    with pytest.raises(RelocationCheckError) as ei:
        _engine_run("vtoken", copy_kwargs={"sentinel": True, "sleep_cycles": 2_000_000_000},
                    sentinel_check=True, copy_engine_factory=eng)
    assert ei.value.code == "i3_sentinel"
    with pytest.raises(RelocationCheckError) as ei:
        _engine_run("vtoken", copy_kwargs={"sentinel": True, "sleep_cycles": 2_000_000_000},
                    check_relocations=RelocationChecker, copy_engine_factory=eng)
    assert ei.value.code == "relocation_mismatch"


@pytest.mark.parametrize("fault", ["cuda_wait_dropped", "cuda_release_before_event"])
def test_engine_single_ordering_fault_is_masked_by_the_other_guard(fault):
    """Defence in depth: either guard alone keeps attention correct in this engine (the probe's
    scenarios are what catch each fault on its own)."""
    _, ref = _engine_run("naive-evict")
    _, res = _engine_run("vtoken", copy_kwargs={"sentinel": True, "sleep_cycles": 50_000_000},
                         sentinel_check=True, check_relocations=RelocationChecker, copy_engine_factory=factory(fault))
    assert res.outputs == ref.outputs and res.hash_failures == 0


# ---------------------------------------------------------------------------- the engine's graph path
def graph_probe(patches=()) -> dict:
    """invariants.i3_probe.graph_i3_probe, with ``patches`` (a planted fault) swapped in."""
    from vtoken.fuzz.patches import planted
    from vtoken.invariants.i3_probe import graph_i3_probe

    with planted(list(patches)):
        return graph_i3_probe(cuda_cache(), sleep_cycles=SLEEP)


def test_graph_probe_clean():
    r = graph_probe()
    assert not r["sentinel_seen"] and r["bytes_equal"], r


def test_graph_replay_on_capture_stream_caught_by_the_probe():
    from vtoken.fuzz.catalogue import BY_NAME

    r = graph_probe(BY_NAME["graph_replay_on_capture_stream"].patches)
    assert r["sentinel_seen"] and not r["bytes_equal"], r


def test_graph_replay_equals_eager_with_relocations():
    _, eager = _engine_run("vtoken", cuda_graph=False, check_relocations=RelocationChecker)
    eng, g = _engine_run("vtoken", cuda_graph=True, check_relocations=RelocationChecker)
    assert g.cuda_graph and g.graph_captures >= 1 and g.graph_replays == g.steps
    assert g.relocations > 0 and g.hash_failures == 0 and g.hash_checks == 2 * g.relocations + g.plans_aborted
    assert g.outputs == eager.outputs, "graph replay tokens differ from the eager path's"
    _, naive = _engine_run("naive-evict", cuda_graph=True)
    assert naive.outputs == g.outputs
    # sentinel mode, a late relocation stream, every replay's slot buffer checked
    _, s = _engine_run("vtoken", cuda_graph=True, copy_kwargs={"sentinel": True, "sleep_cycles": 50_000_000},
                       sentinel_check=True, check_relocations=RelocationChecker)
    assert s.outputs == eager.outputs and s.hash_failures == 0


def test_lag_reports_done_at_exactly_the_lagth_poll_on_cuda():
    """``lag`` on CUDA: the copy runs at once, ``poll`` says done at its lag-th call (a host
    wait there if needed, counted), whatever the device's speed."""
    kv = KVCache(2, 16, 4, 2, 16, dtype=torch.float16, device="cuda", checked=False)
    kv.kv.normal_()
    want = kv.flat.index_select(2, torch.arange(4, device="cuda")).clone()
    eng = KVCopyEngine(kv, 4, lag=3, sentinel=True, sleep_cycles=SLEEP)
    h = eng.launch(_ProbePlan(1, np.array([(o, 0, o, 5, o) for o in range(4)], dtype=np.int64)))
    assert [eng.poll(h) for _ in range(2)] == ["pending", "pending"]
    assert eng.poll(h) == "done" and eng.stats["host_syncs"] == 1  # the sleeping copy was not done yet
    assert torch.equal(kv.flat.index_select(2, torch.arange(20, 24, device="cuda")), want)


def _append_only_run(cls=None, mode="vtoken", **kw):
    """The CPU test's scenario (tests/test_graph_path.py: S = 16, 24 blocks, requests that
    finish at different steps, copies reported done at their second poll) on CUDA.

    The fault shows only when a move is applied at a step without an eviction (an eviction
    rewrites the row in full), and at evict_ratio 0.5 every other step evicts. Applies timed
    by the GPU land on either kind (an H200 put all seven of a run on eviction steps); the
    copy engine's ``lag`` fixes them at the second poll on both devices."""
    from vtoken.decode import DecodeEngine, make_prompts
    from vtoken.model import PagedDecoder
    from vtoken.planner import PlannerConfig

    model = PagedDecoder()
    prompts = make_prompts(4, 32, model.config.vocab_size, seed=3)
    if mode == "vtoken":
        kw["planner_config"] = PlannerConfig(theta_f=0.1, check_every=1, max_sources=8, headroom=8,
                                             low_watermark=None)
    eng = (cls or DecodeEngine)(model, mode=mode, policy="random", evict_ratio=0.5, block_size=16, num_blocks=24,
                                seed=0, device="cuda", **kw)
    return eng.run(prompts, [48, 35, 43, 27])


def test_append_only_slot_buffer_caught_on_cuda():
    from vtoken.errors import RelocationCheckError
    from vtoken.fuzz.faulty_engines import DECODE_ENGINES

    bad = DECODE_ENGINES["graph_slot_buffer_append_only"]
    copy = {"sentinel": True, "sleep_cycles": 50_000_000, "lag": 2}
    # the fault takes effect in this scenario: without the check the poisoned reads change tokens
    ref = _append_only_run(mode="naive-evict")
    res = _append_only_run(bad, cuda_graph=True, copy_kwargs=copy)
    assert res.relocations > 0 and res.outputs != ref.outputs
    with pytest.raises(RelocationCheckError) as ei:
        _append_only_run(bad, cuda_graph=True, copy_kwargs=copy, sentinel_check=True)
    assert ei.value.code == "i3_sentinel"
    # control: the shipped engine passes the same sentinel run
    ok = _append_only_run(cuda_graph=True, copy_kwargs=copy, sentinel_check=True, check_relocations=RelocationChecker)
    assert ok.outputs == ref.outputs and ok.hash_failures == 0 and ok.relocations > 0


def _sync_debug(fn):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_graph_decode_loop_has_no_hidden_host_sync():
    """Relocations on, the decode steps under set_sync_debug_mode("error"): the only host wait
    is the step's event for the sampled tokens (StepGraph.fetch)."""
    from vtoken.decode import make_prompts
    from vtoken.decode import DecodeEngine, full_retention_blocks
    from vtoken.model import PagedDecoder
    from vtoken.planner import PlannerConfig

    model = PagedDecoder()
    prompts = make_prompts(4, 32, model.config.vocab_size, seed=2)
    cfg = PlannerConfig(theta_f=0.1, check_every=1, max_sources=8, headroom=8)
    eng = DecodeEngine(model, mode="vtoken", policy="h2o", evict_ratio=0.5, block_size=4, device="cuda",
                       planner_config=cfg)
    eng.setup(full_retention_blocks([32] * 4, 40, 4, 8) + 2)
    for i, p in enumerate(prompts):
        eng.admit(i, p, 40)  # prefill is not the decode loop
    eng.step()  # the first step captures the graph of this batch shape (once; torch.cuda.graph syncs)

    def loop():
        while eng.active:
            eng.step()

    _sync_debug(loop)
    eng.copy_engine.synchronize()
    assert eng.manager.stats["applied"] > 0 and eng.graph_replays > 0


def _cuda_rig(method, sample=0):
    from vtoken.allocator import BlockAllocator
    from vtoken.invariants.relocation_hash import RelocationChecker
    from vtoken.planner import PlannerConfig, ReclamationManager
    from vtoken.table import TokenTable

    kv = cuda_cache(nb=48, S=4, L=3, H=2, D=8)
    t, a = TokenTable(4, 48, device="cuda"), BlockAllocator(48)
    chk = RelocationChecker(kv, t, method=method, sample=sample)
    cfg = PlannerConfig(theta_f=0.05, check_every=1, max_sources=8, headroom=6, record_snapshots=True)
    mgr = ReclamationManager(t, a, chk.wrap(KVCopyEngine(kv, 4)), cfg, on_applied=chk.after_apply)
    rng = np.random.default_rng(0)
    for r in range(2):
        blocks = a.allocate(8)
        t.sync_new_tokens(r, blocks, 30)
        mgr.hold(r, blocks)  # the manager holds every block allocated for a request
        t.evict_tokens(r, np.sort(rng.choice(29, size=17, replace=False)))
    t.flush()
    return kv, chk, mgr


def test_fingerprint_checks_never_wait_on_the_host():
    kv, chk, mgr = _cuda_rig("fingerprint", sample=0)

    def steps():
        for _ in range(4):
            mgr.step()

    _sync_debug(steps)
    chk.settle(block=True)
    assert chk.failed == 0 and chk.passed >= 2
    assert set(chk.host_bytes) <= {"slots", "fingerprints"}, chk.host_bytes  # never the K/V
    # control: host digests (xxh3) do wait, and the debug mode says so
    kv, chk, mgr = _cuda_rig("xxh3")
    with pytest.raises(RuntimeError, match="synchroniz"):
        _sync_debug(steps)


def test_planted_gpu_faults_are_caught_through_the_runner():
    """``vtoken fuzz --planted`` on a CUDA machine runs the CUDA-only faults (each in its
    shadow tree, the I3 probes as detector) instead of leaving them out."""
    from vtoken.fuzz.catalogue import CATALOGUE
    from vtoken.fuzz.planted import run_all

    gpu = [f.name for f in CATALOGUE if f.cuda_only]
    s = run_all(gpu, runs=2, progress=False)
    assert s["gpu_faults_not_run"] == [] and s["planted"] == len(gpu), s
    assert s["min_rate"] == 1.0, [(r["fault"], r.get("rate"), [x.get("error") for x in r["runs"]]) for r in s["results"]]


def test_engine_attention_compute_on_cuda_equals_cpu():
    """vtoken's attention in vLLM's engine is plain torch (``token_attention.attend_rows``): on the
    device it computes what it computes on the CPU (float32: to rounding), and its writes land."""
    from vtoken.vllm_engine.token_attention import attend_rows, token_rows

    g = torch.Generator().manual_seed(0)
    cpu = torch.randn(32, 16, 2, 128, generator=g).permute(0, 2, 1, 3)  # vLLM's [B, H, N, 2D], LBNHC strides
    q, k, v = torch.randn(4, 4, 64, generator=g), torch.randn(4, 2, 64, generator=g), torch.randn(4, 2, 64, generator=g)
    groups = [("a", 0, 3, torch.tensor([5, 77, 300, 40, 41, 42])), ("b", 3, 4, torch.tensor([9, 10, 43]))]
    write = torch.tensor([40, 41, 42, 43])
    outs = {}
    for dev in ("cpu", "cuda"):
        cache = cpu.to(dev)
        out, stats = torch.zeros(4, 4, 64, device=dev), {}
        attend_rows(token_rows(cache), q.to(dev), k.to(dev), v.to(dev), write.to(dev), groups, 0.125, out, stats)
        outs[dev] = (out.cpu(), stats, cache.cpu())
    assert torch.allclose(outs["cpu"][0], outs["cuda"][0], atol=1e-5)
    assert all(torch.allclose(outs["cpu"][1][r], outs["cuda"][1][r], atol=1e-5) for r in ("a", "b"))
    assert torch.equal(outs["cpu"][2], outs["cuda"][2])  # the same K/V written at the same slots
