"""The trigger rule (``vtoken.planner.should_reclaim`` / ``low_watermark``), the one every
path calls: the manager's ``eligible()``, the vLLM adapter's ``_plan``; and the one set of
defaults (``PlannerConfig()``) every path starts from."""

import pytest

from vtoken import BlockAllocator, TokenTable
from vtoken.planner import NullCopyEngine, PlannerConfig, ReclamationManager, low_watermark, should_reclaim, trigger_inputs

pytestmark = pytest.mark.invariants


def inputs(**kw):
    base = dict(waste_ratio=0.01, free_blocks=100, ref_blocks=1000, num_requests=10, block_size=16)
    base.update(kw)
    return base


def test_derived_watermark_is_the_larger_of_footprint_and_reserve():
    cfg = PlannerConfig()  # headroom 64, check_every 1, copy_steps 4
    # footprint ceil(1000 / 10) = 100; reserve 64 + ceil(10 * 6 / 16) = 68
    assert low_watermark(cfg, ref_blocks=1000, num_requests=10, block_size=16) == 100
    assert low_watermark(cfg, ref_blocks=1001, num_requests=10, block_size=16) == 101  # ceil
    # small requests: the reserve rules; ceil(200 * 6 / 16) = 75, + 64
    assert low_watermark(cfg, ref_blocks=400, num_requests=200, block_size=16) == 139
    assert low_watermark(cfg, ref_blocks=400, num_requests=199, block_size=16) == 64 + 75  # ceil(1194 / 16) = 75
    assert low_watermark(cfg, ref_blocks=400, num_requests=190, block_size=16) == 64 + 72  # 1140 / 16 = 71.25
    # check interval and copy latency widen the reserve
    k4 = PlannerConfig(check_every=4, copy_steps=0)
    assert low_watermark(k4, ref_blocks=0, num_requests=16, block_size=16) == 64 + 5
    # no request: the headroom plus one step of one request
    assert low_watermark(cfg, ref_blocks=0, num_requests=0, block_size=16) == 64 + 1
    # an explicit watermark wins, whatever the pool
    assert low_watermark(PlannerConfig(low_watermark=7), ref_blocks=10 ** 6, num_requests=1, block_size=16) == 7


def test_should_reclaim_rule_and_its_boundaries():
    cfg = PlannerConfig()  # theta_f 0.25, derived watermark (100 for inputs())
    assert not should_reclaim(cfg, **inputs(free_blocks=101))  # not short, under the gate
    assert should_reclaim(cfg, **inputs(free_blocks=100))  # at the watermark: short
    assert should_reclaim(cfg, **inputs(free_blocks=0))
    assert not should_reclaim(cfg, **inputs(free_blocks=0, waste_ratio=0.0))  # nothing to reclaim
    assert not should_reclaim(cfg, **inputs(free_blocks=10 ** 6, waste_ratio=0.25))  # F == theta_f: not over
    assert should_reclaim(cfg, **inputs(free_blocks=10 ** 6, waste_ratio=0.2501))  # the gate, no pressure
    off = PlannerConfig(low_watermark=-1)  # the paper's trigger alone
    assert not should_reclaim(off, **inputs(free_blocks=0))
    assert should_reclaim(off, **inputs(free_blocks=0, waste_ratio=0.3))
    # theta_f < 0 plans even with no waste (the small-scope enumerations use it)
    assert should_reclaim(PlannerConfig(theta_f=-1.0), **inputs(waste_ratio=0.0, free_blocks=10 ** 6))


def test_trigger_inputs_read_the_table():
    S = 4
    t, a = TokenTable(S, 32), BlockAllocator(32)
    b = a.allocate(3)
    t.sync_new_tokens("a", b, 12)
    t.evict_tokens("a", [0, 1, 2])
    b2 = a.allocate(2)
    t.sync_new_tokens("b", b2, 8)
    got = trigger_inputs(t, a.num_free)
    assert got == dict(waste_ratio=pytest.approx(3 / 20), free_blocks=26, ref_blocks=5, num_requests=2, block_size=S)


def test_manager_eligible_is_should_reclaim(monkeypatch):
    """``ReclamationManager.eligible`` is the shared rule over its table and free blocks."""
    import vtoken.planner as planner

    seen = []
    real = planner.should_reclaim

    def spy(cfg, **kw):
        seen.append(kw)
        return real(cfg, **kw)

    monkeypatch.setattr(planner, "should_reclaim", spy)
    t, a = TokenTable(4, 32), BlockAllocator(32)
    mgr = ReclamationManager(t, a, NullCopyEngine(0), PlannerConfig(headroom=2))
    b = a.allocate(3)
    t.sync_new_tokens("a", b, 12)
    t.evict_tokens("a", [0, 1, 2, 4, 5, 6])
    assert mgr.eligible()  # F = 0.5 > 0.25
    assert seen[-1] == trigger_inputs(t, a.num_free)
    mgr.step()
    assert len(seen) == 2


def test_one_set_of_defaults_for_every_path():
    """The decode engine's and the vLLM adapter's defaults are PlannerConfig()'s."""
    from vtoken.engine import default_planner_config

    assert default_planner_config() == PlannerConfig()
    assert default_planner_config(record_snapshots=True, headroom=8) == PlannerConfig(record_snapshots=True, headroom=8)
    adapter = pytest.importorskip("vtoken.vllm_adapter.adapter")
    assert adapter.default_adapter_planner_config() == PlannerConfig()
    assert adapter.default_adapter_planner_config(headroom=4) == PlannerConfig(headroom=4)
