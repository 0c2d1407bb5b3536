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


def _run(model, full_every, paranoid, ratio=0.0):
    from vtoken.vllm_adapter.adapter import AdapterDriver, VTokenAdapter, default_adapter_planner_config
    from vtoken.vllm_adapter.worker import VTokenWorker

    S, N = 8, 96
    ad = VTokenAdapter(block_size=S, num_blocks=N, prefix_caching=True, async_scheduling=False,
                       planner_config=default_adapter_planner_config(headroom=4), max_model_len=512,
                       check_full_every=full_every, paranoid_checks=paranoid)
    w = VTokenWorker(model, ad.table, N, S, check_relocations=RelocationChecker, policy="random", evict_ratio=ratio, seed=0)
    d = AdapterDriver(ad, w)
    for i in range(3):
        ad.add_request(f"q{i}", np.random.default_rng([i]).integers(1, 500, size=40).tolist(), max_tokens=60)
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

    start = ad.check.hooks
    for _ in range(limit):
        try:
            d.step()
        except AdapterAssumptionError as e:
            return ad.check.hooks - start, e
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
    ad.reserve.put(got)
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
    assert ad.check.hooks >= 40 and ad.check.full_scans <= ad.check.hooks // 16 + 1
