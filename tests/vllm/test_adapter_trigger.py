"""The adapter plans on the shared trigger (``vtoken.planner.should_reclaim``) with its own
pool's free-block count, and starts from the shipped defaults (vLLM's real scheduler, CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from vtoken.vllm_adapter import harness
from vtoken.invariants.relocation_hash import RelocationChecker

pytestmark = pytest.mark.vllm


def test_adapter_plans_on_should_reclaim_with_its_pool(model, monkeypatch):
    if harness.vllm_version() is None:
        pytest.fail("vLLM not installed: run scripts/install_vllm.sh", pytrace=False)
    import vtoken.vllm_adapter.plans as plans_mod
    from vtoken.planner import PlannerConfig, should_reclaim
    from vtoken.vllm_adapter.adapter import AdapterDriver, VTokenAdapter, default_adapter_planner_config
    from vtoken.vllm_adapter.worker import VTokenWorker

    calls = []

    def spy(cfg, **kw):
        got = should_reclaim(cfg, **kw)
        calls.append((kw, got, ad.pool.get_num_free_blocks()))
        return got

    monkeypatch.setattr(plans_mod, "should_reclaim", spy)
    S, N = 4, 64
    cfg = default_adapter_planner_config(headroom=4)
    assert cfg == PlannerConfig(headroom=4)
    ad = VTokenAdapter(block_size=S, num_blocks=N, prefix_caching=False, async_scheduling=False, planner_config=cfg,
                       max_model_len=512)
    w = VTokenWorker(model, ad.table, N, S, check_relocations=RelocationChecker, policy="random", evict_ratio=0.5, seed=0, copy_lag=0)
    d = AdapterDriver(ad, w)
    rng = np.random.default_rng(0)
    for i in range(3):
        ad.add_request(f"q{i}", rng.integers(1, 500, size=20).tolist(), max_tokens=30)
    d.drain(max_steps=2000)
    ad.close()
    assert calls, "the adapter never asked the trigger"
    for kw, got, free in calls:
        assert kw["free_blocks"] == free and kw["block_size"] == S  # its own pool, read at the call
        assert got == should_reclaim(cfg, **kw)
    assert any(got for _, got, _ in calls) and ad.stats["plans"] > 0  # random 50% eviction: F > 0.25
