"""Planted adapter faults: each makes the audit runs fail with a detail naming the broken
assumption, and the runtime checks that catch them do not depend on the fault flags
(the same violations, made by hand, are caught too)."""

from __future__ import annotations

import numpy as np
import pytest

from vtoken.fuzz.patches import Patch
from vtoken.fuzz.patches import planted as planted_patches
from vtoken.fuzz.planted import planted
from vtoken.vllm_adapter import harness
from vtoken.invariants.relocation_hash import RelocationChecker

pytestmark = pytest.mark.vllm

# fault -> (check name, the assumption's words, a detail pattern)
PLANTED = {
    "adapter_free_before_fence": ("fence", "sources freed only after the fence",
                                  r"block \d+ \(source of plan \d+ \(request '[^']+', fence \d+\)\) has ref_cnt 0.*"
                                  r"freed before its fence"),
    "adapter_stale_prefix_hash": ("prefix_hash", "no relocated block keeps a stale prefix-cache hash",
                                  r"block \d+ \((destination|fill) of (in-flight plan \d+ \()?request '[^']+'\)+ carries a "
                                  r"prefix-cache hash"),
    "adapter_pop_not_null": ("null_substitution", "null-substituted in req_to_blocks, list length kept",
                             r"block list has \d+ entries, the scheduler outputs gave it \d+"),
    # vLLM hands the block out (in a list), or a plan takes it as a destination first (ref_cnt 0)
    "adapter_headroom_to_allocate": ("reservation", "never handed to allocate_slots",
                                     r"headroom block \d+ (is in request '[^']+''s block list|as a destination, but "
                                     r"vLLM's pool counts it ref_cnt 0)"),
}


def require_vllm() -> None:
    if harness.vllm_version() is None:
        pytest.fail("vLLM not installed: run scripts/install_vllm.sh", pytrace=False)


def assert_names(detail: str, check: str, words: str, pattern: str) -> None:
    assert detail.startswith("assumption broken: "), detail
    assert f"[{check}]" in detail and words in detail, detail
    import re

    assert re.search(pattern, detail), detail


@pytest.mark.parametrize("fault", list(PLANTED))
def test_planted_fault_fails_audit_decode(fault):
    require_vllm()
    from vtoken.reports.vllm_runs import audit_decode

    check, words, pattern = PLANTED[fault]
    with planted(fault):
        res = audit_decode(quick=True, seed=0)
    assert res["passed"] is False
    assert_names(res["detail"], check, words, pattern)


@pytest.mark.parametrize("fault", list(PLANTED))
def test_planted_fault_fails_sharing_table(fault):
    require_vllm()
    from vtoken.reports.vllm_runs import sharing_table

    check, words, pattern = PLANTED[fault]
    with planted(fault):
        res = sharing_table(quick=True, seed=0)
    assert res["passed"] is False
    assert_names(res["detail"], check, words, pattern)


@pytest.mark.parametrize("fault", list(PLANTED))
def test_planted_fault_is_reported_by_check_assumptions(fault):
    require_vllm()
    from vtoken.reports.vllm_runs import check_assumptions

    check, words, pattern = PLANTED[fault]
    with planted(fault):
        rows = {r["name"]: r for r in check_assumptions()}
    assert rows[check]["passed"] is False
    assert_names(rows[check]["detail"], check, words, pattern)
    assert all(r["passed"] is not True for r in rows.values())  # nothing claims to hold past the break


def test_corrupted_copy_fails_hash_and_compare():
    """A relocation that flips a byte (the copy engine's planted fault) is caught by the
    hash-and-compare the worker runs on every relocation."""
    require_vllm()
    from vtoken.reports.vllm_runs import audit_decode

    flip = Patch("vtoken/copy_engine.py", "KVCopyEngine._copy",
                 "                flat.index_copy_(2, dst_t, flat.index_select(2, src_t))\n",
                 "                flat.index_copy_(2, dst_t, flat.index_select(2, src_t))\n"
                 "            flat[-1, 0, int(dst_t[0])].view(torch.uint8).view(-1)[:1] ^= 0xFF\n")
    with planted_patches([flip]):
        res = audit_decode(quick=True, seed=0)
    assert res["passed"] is False
    assert "[hash_and_compare]" in res["detail"] and "relocation_mismatch" in res["detail"], res["detail"]


# ---------------------------------------------------------------------------- the checks are real
def _adapter(model, **kw):
    from vtoken.vllm_adapter.adapter import AdapterDriver, VTokenAdapter, default_adapter_planner_config
    from vtoken.vllm_adapter.worker import VTokenWorker

    S, N = 8, 64
    ad = VTokenAdapter(block_size=S, num_blocks=N, prefix_caching=True, async_scheduling=kw.get("async_", True),
                       planner_config=default_adapter_planner_config(headroom=4), max_model_len=512)
    w = VTokenWorker(model, ad.table, N, S, check_relocations=RelocationChecker, policy="random", evict_ratio=0.5, seed=0, copy_lag=kw.get("lag", 0))
    d = AdapterDriver(ad, w)
    for i in range(3):
        rng = np.random.default_rng([i])
        ad.add_request(f"q{i}", rng.integers(1, 500, size=40 + 5 * i).tolist(), max_tokens=30)
    return ad, w, d


def _until(d, cond, n=300):
    for _ in range(n):
        d.step()
        if cond():
            return
    raise AssertionError("condition never reached")


def test_headroom_block_in_a_request_list_is_caught(model):
    from vtoken.vllm_adapter.adapter import AdapterAssumptionError

    ad, w, d = _adapter(model)
    d.step()
    r = next(iter(ad.req_to_blocks))
    ad.req_to_blocks[r].append(ad.headroom[0])  # as if allocate_slots had handed it out
    with pytest.raises(AdapterAssumptionError, match=r"\[reservation\].*headroom block \d+ is in request"):
        ad.check_all()


def test_popped_list_entry_is_caught(model):
    from vtoken.vllm_adapter.adapter import AdapterAssumptionError

    ad, w, d = _adapter(model)
    d.step()
    r = next(iter(ad.req_to_blocks))
    ad.req_to_blocks[r].pop(0)
    with pytest.raises(AdapterAssumptionError, match=r"\[null_substitution\].*entries, the scheduler outputs"):
        ad.check_all()


def test_hashed_destination_is_caught(model):
    from vtoken.vllm_adapter.adapter import AdapterAssumptionError

    ad, w, d = _adapter(model)
    _until(d, lambda: any(ad.held.values()))
    r, dests = next((r, v) for r, v in ad.held.items() if v)
    hashed = next(b for lst in ad.req_to_blocks.values() for b in lst if b.block_hash is not None)
    ad.pool.move_block_hashes(hashed, ad.block(next(iter(dests))))
    with pytest.raises(AdapterAssumptionError, match=r"\[prefix_hash\].*destination of request"):
        ad.check_all()


def test_source_freed_through_vllms_deferred_path_too_early_is_caught(model):
    """Even through vLLM's own fenced path, a fence too early (the plan's step not yet
    processed, the copy still running) is a broken fence."""
    from vtoken.vllm_adapter.adapter import AdapterAssumptionError

    ad, w, d = _adapter(model, lag=3)
    _until(d, lambda: bool(ad.plans))
    plan = next(iter(ad.plans.values()))
    from vtoken.lifecycle import Outcome

    with pytest.raises(AdapterAssumptionError, match=r"\[fence\].*freed at step \d+ .*fence \d+.*copy completed: no"):
        ad.book.absorb({plan.id: Outcome("applied", copy_done=False)})  # a report before the copy is done


def test_shared_source_at_copy_time_is_caught(model):
    """A plan whose source became shared before its copy (the worker sees another request
    referencing it) is refused by the worker and raised as a block found shared at its end
    (``PlanError[shared_source]``, ``vtoken.planner.shared_at_end``)."""
    from vtoken.errors import PlanError

    ad, w, d = _adapter(model, async_=False)
    orig = ad.book.launch
    state = {}

    def spy(meta, r, p, *rest):
        orig(meta, r, p, *rest)
        plan = meta.plans[-1]
        if not state:  # make another request reference the first source in the worker's token table
            other = next(x for x in w.table.requests() if x != r)
            src = plan["sources"][0]
            t = w.table
            t._ref_block(t._reqs[other], src)
            state["done"] = (other, src)

    ad.book.launch = spy
    # one error for a source found shared at a copy's end on every path (issue 39): was
    # AdapterAssumptionError [shared_never_moved]
    with pytest.raises(PlanError, match=r"\[shared_source\].*referenced by another request"):
        for _ in range(300):
            d.step()
