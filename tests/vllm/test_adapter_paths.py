"""Adapter paths beyond the in-place defaults: the incremental check of fills, a fill taken by
another request while its copy flies, out-of-place plans (the reserved headroom and its
destinations), copies pending across preemption and resume, failed copies and copies
corrupted in flight. Each runs vLLM's REAL scheduler with this project's decoder as the
worker; the faulty copy engines are the toolkit's (``fuzz.faulty_engines``)."""

from __future__ import annotations

import numpy as np
import pytest

from vtoken.invariants.relocation_hash import RelocationChecker
from vtoken.vllm_adapter import harness

pytestmark = pytest.mark.vllm


def prompt(i: int, n: int, base: int = 0) -> list[int]:
    return np.random.default_rng([base, i, n]).integers(1, 500, size=n).tolist()


def make(model, *, S=4, N=64, H=0, in_place=True, caching=True, async_=False, lag=0, ratio=0.5, reclaim=True,
         batched=2048, engine=None, seed=0, **engine_kw):
    """An adapter, its worker and driver. ``engine``: a copy-engine class of the toolkit, built
    with ``engine_kw`` (``table=True`` hands it the worker's table)."""
    if harness.vllm_version() is None:
        pytest.fail("vLLM not installed: run scripts/install_vllm.sh", pytrace=False)
    from vtoken.vllm_adapter.adapter import AdapterDriver, VTokenAdapter, default_adapter_planner_config
    from vtoken.vllm_adapter.worker import VTokenWorker

    ad = VTokenAdapter(block_size=S, num_blocks=N, prefix_caching=caching, async_scheduling=async_, reclaim=reclaim,
                       planner_config=default_adapter_planner_config(headroom=H, in_place=in_place),
                       max_num_batched_tokens=batched, max_model_len=512, headroom_pool_fraction=4)
    factory = None
    if engine is not None:
        kw = dict(engine_kw)
        if kw.pop("table", False):
            kw["table"] = ad.table

        def factory(kv, block_size, **lag_kw):
            return engine(kv, block_size, **lag_kw, **kw)

    w = VTokenWorker(model, ad.table, N, S, check_relocations=RelocationChecker if reclaim else None,
                     policy="random", evict_ratio=ratio, seed=seed, copy_lag=lag, copy_engine_factory=factory)
    return ad, w, AdapterDriver(ad, w)


def steps_until(d, cond, limit=400):
    for _ in range(limit):
        d.step()
        if cond():
            return
    raise AssertionError("condition never reached")


def outputs(ad) -> dict:
    return {r: ad.output_tokens(r) for r in ad.requests}


# ---------------------------------------------------------------------------- the incremental check of fills
def test_a_fill_put_back_in_its_list_is_caught_by_the_incremental_check(model):
    """A plan's fill leaves the request's list at launch like its sources; put back at its
    index behind the adapter's back, the incremental check (no list touched, so no list scan)
    must see it: it compares every source AND fill of a plan in flight with vLLM's list at
    the index the plan took it from."""
    from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

    ad, w, d = make(model, lag=3)
    for i in range(3):
        ad.add_request(f"q{i}", prompt(i, 24 + 4 * i), max_tokens=40)

    def fill_in_flight():  # (plan, fill, the list index the mirror substituted it at)
        return next(((p, b, i) for p in ad.plans.values() if not p.orphaned for b in p.fills
                     for i, sub in ad.mirror.subst.get(p.req_id, {}).items() if sub == b.block_id), None)

    steps_until(d, lambda: fill_in_flight() is not None)
    plan, fill, i = fill_in_flight()
    lst = ad.req_to_blocks[plan.req_id]
    assert lst[i] is ad.pool.null_block
    ad.check.check_touched("before")  # what changed so far is checked (and consumed): nothing is touched now
    lst[i] = fill
    with pytest.raises(AdapterAssumptionError,
                       match=rf"\[null_substitution\]: probe: block {fill.block_id} \(a source or fill\) of plan "
                             rf"{plan.id} is still in request"):
        ad.check.check_touched("probe")


# ---------------------------------------------------------------------------- a shared fill at apply
@pytest.mark.parametrize("async_", [False, True])
def test_a_fill_taken_by_another_request_in_flight_is_refused_loudly(model, async_):
    """While its copy flies, a plan's fill becomes another request's alone in the token table
    (reference count 1, but not the plan's request's). Applying refuses it (``shared_fill``);
    the worker must name it as shared and the adapter raise ``shared_never_moved`` in that
    very step, not take the quiet 'aborted, table kept' path (which would hand the block
    back to the request while another one holds it)."""
    from vtoken.fuzz.faulty_engines import StealFillEngine
    from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

    ad, w, d = make(model, lag=2, async_=async_, engine=StealFillEngine, table=True)
    for i in range(3):
        ad.add_request(f"q{i}", prompt(i, 24 + 4 * i), max_tokens=40)
    eng = w.copy_engine
    with pytest.raises(AdapterAssumptionError, match=r"\[shared_never_moved\].*sources or fills \[\d+"):
        for _ in range(400):
            d.step()
            assert not eng.tampered, f"{eng.tampered}: the worker's refusal of a stolen fill was not raised"
    assert len(eng.tampered) == 1 and ad.stats["shared_blocks_moved"] >= 1
