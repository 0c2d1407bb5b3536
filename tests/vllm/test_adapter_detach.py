"""Taking a plan's sources and fills over in one batch (``Lifecycle.launch`` with the adapter's
``detach_listed``, over ``BlockMirror.detach_many``): every block is checked before any entry
changes, so a refused batch leaves vLLM's list, the mirror, the held blocks and the headroom
as they were."""

from __future__ import annotations

import numpy as np
import pytest

from vtoken.invariants.relocation_hash import RelocationChecker

pytestmark = pytest.mark.vllm


def _adapter(model):
    from vtoken.vllm_adapter.adapter import AdapterDriver, VTokenAdapter, default_adapter_planner_config
    from vtoken.vllm_adapter.worker import VTokenWorker

    S, N = 8, 64
    ad = VTokenAdapter(block_size=S, num_blocks=N, prefix_caching=True, async_scheduling=False, reclaim=False,
                       planner_config=default_adapter_planner_config(headroom=4), max_model_len=512)
    w = VTokenWorker(model, ad.table, N, S, check_relocations=RelocationChecker, policy="random", evict_ratio=0.0, seed=0)
    d = AdapterDriver(ad, w)
    ad.add_request("q0", np.random.default_rng([0]).integers(1, 500, size=40).tolist(), max_tokens=8)
    for _ in range(2):
        d.step()
    return ad


def _state(ad, r):
    return ([b.block_id for b in ad.req_to_blocks[r]], list(ad.mirror[r]), dict(ad.mirror.pos[r]),
            dict(ad.mirror.subst.get(r, {})), list(ad.held.get(r, {})), list(ad.lifecycle.headroom),
            sorted(ad.plans), ad.lifecycle.busy_mask.nonzero()[0].tolist())


def _plan(ad, r, sources):
    return ad.lifecycle.new_plan(r, [b.block_id for b in sources], [], np.zeros((0, 5), dtype=np.int64))


def test_a_batch_with_a_block_not_held_changes_nothing(model):
    from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

    ad = _adapter(model)
    lst = ad.req_to_blocks["q0"]
    stranger = next(b for b in ad.pool.blocks if not b.is_null and b.ref_cnt == 0)
    before = _state(ad, "q0")
    with pytest.raises(AdapterAssumptionError) as e:
        ad.lifecycle.launch(_plan(ad, "q0", [lst[0], lst[1], stranger]), detach=ad.detach_listed)
    assert e.value.check == "table_in_step" and str(stranger.block_id) in str(e.value)
    assert _state(ad, "q0") == before


def test_a_batch_naming_one_entry_twice_changes_nothing(model):
    from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

    ad = _adapter(model)
    lst = ad.req_to_blocks["q0"]
    before = _state(ad, "q0")
    with pytest.raises(AdapterAssumptionError) as e:
        ad.mirror.detach_many("q0", [lst[1], lst[1]])
    assert e.value.check == "null_substitution"
    assert _state(ad, "q0") == before


def test_a_batch_naming_a_held_block_twice_changes_nothing(model):
    from vtoken.errors import PlanError

    ad = _adapter(model)
    held = ad.pool.get_new_blocks(1)[0]
    ad.held.add("q0", [held.block_id])
    before = _state(ad, "q0")
    with pytest.raises(PlanError) as e:
        ad.lifecycle.launch(_plan(ad, "q0", [held, held]), detach=ad.detach_listed)
    assert e.value.code == "overlap" and "twice" in str(e.value)
    assert _state(ad, "q0") == before
    ad.held.take("q0", [held.block_id])  # the test's hold taken back
    ad.pool.free_blocks([held])


def test_a_mixed_batch_substitutes_listed_blocks_and_takes_held_ones(model):
    from vtoken.lifecycle import Outcome

    ad = _adapter(model)
    lst = ad.req_to_blocks["q0"]
    a, b = lst[0], lst[2]
    held = ad.pool.get_new_blocks(1)[0]  # stands for a destination the request was handed
    ad.held.add("q0", [held.block_id])
    plan = _plan(ad, "q0", [b, held, a])
    ad.lifecycle.launch(plan, detach=ad.detach_listed)
    assert plan.list_index == {held.block_id: -1, b.block_id: 2, a.block_id: 0}
    assert lst[0] is ad.pool.null_block and lst[2] is ad.pool.null_block and len(lst) == len(ad.mirror["q0"])
    assert ad.mirror.subst["q0"] == {0: a.block_id, 2: b.block_id}
    assert "q0" not in ad.held and ad.mirror.index("q0", a.block_id) is None
    ad.mirror.check_lists("test")  # the substituted list still agrees with its mirror
    ad.lifecycle.finish("q0")  # hand the references back so the pool balances: the plan, an orphan,
    ad.lifecycle.end(plan, Outcome("aborted"))  # releases its blocks at its end
    assert all(blk.ref_cnt == 0 for blk in (a, b, held))


def test_holding_a_block_twice_is_refused_and_changes_nothing(model):
    from vtoken.errors import PlanError

    ad = _adapter(model)
    held = [b.block_id for b in ad.pool.get_new_blocks(2)]
    ad.held.add("q0", held[:1])
    before = _state(ad, "q0")
    for r, again in (("q0", [held[0]]), ("q0", [held[1], held[1]]), ("q0", [held[1], held[0]]), ("q1", [held[0]])):
        with pytest.raises(PlanError) as e:
            ad.held.add(r, again)
        assert e.value.code == "ownership" and "held twice" in str(e.value)
        assert _state(ad, "q0") == before
    ad.held.take("q0", held[:1])
    ad.pool.free_blocks([ad.block(b) for b in held])
