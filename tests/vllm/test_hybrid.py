"""Hybrid KV layouts (issue 28): full attention + a sliding window over one pool, through the
real vLLM scheduler. The token table mirrors the full-attention group; vLLM frees the window's
blocks; the model's odd layers read the window group's blocks by position."""

from __future__ import annotations

import pytest

from vtoken.reports.vllm_runs import _one_thread, _prompt, _run

pytestmark = pytest.mark.vllm


def _decode(layout: str, reclaim: bool, **kw) -> dict:
    prompts = {f"r{i}": _prompt(3, i, 30 + 11 * i) for i in range(3)}
    nb = 12 + sum(-(-(len(p) + 20) // 16) + 1 for p in prompts.values()) + (12 if layout == "hybrid" else 0)
    with _one_thread():
        return _run(reclaim=reclaim, prompts=prompts, max_tokens=20, policy="random", seed=1, num_blocks=nb,
                    kv_layout=layout, **kw)


@pytest.mark.parametrize("lag", [0, 2])
def test_a_hybrid_decode_matches_naive_evict_token_for_token(lag):
    on, off = _decode("hybrid", True, copy_lag=lag), _decode("hybrid", False, copy_lag=lag)
    assert on["stats"]["applied"] > 0 and on["hash_checks"] > 0
    assert on["hash_failures"] == 0
    assert on["outputs"] == off["outputs"]
    assert on["retained_mean"] < off["retained_mean"]
    assert on["free_end"] == on["N"] - 1


def test_the_window_layers_matter():
    """The windowed layers read their own group: the same prompts decode differently when every
    layer attends over the full context (so a corrupted window would show in the outputs)."""
    assert _decode("hybrid", False)["outputs"] != _decode("full", False)["outputs"]


def test_a_window_block_vllm_freed_is_refused_by_the_worker():
    """The worker reads the window through vLLM's list and refuses a position whose block is
    null (vLLM must keep the window): a corrupted list is an error, not a silent misread."""
    from vtoken.errors import OrderError
    from vtoken.vllm_adapter.worker_core import WorkerRequest as _WorkerRequest

    from vtoken.reports.vllm_runs import _model
    from vtoken.vllm_adapter.adapter import VTokenAdapter
    from vtoken.vllm_adapter.worker import VTokenWorker

    ad = VTokenAdapter(kv_layout="hybrid", block_size=4, num_blocks=32)
    w = VTokenWorker(_model(), ad.table, 32, 4, layout=ad.worker_layout())
    req = _WorkerRequest(prompt=list(range(12)), outputs=[], blocks=[1, 2, 3], wblocks=[0, 5, 6])
    assert w._window_slots("a", req, 4, 12).tolist() == [20, 21, 22, 23, 24, 25, 26, 27]
    with pytest.raises(OrderError, match="sliding-window group holds no block"):
        w._window_slots("a", req, 3, 12)
    with pytest.raises(OrderError, match="sliding-window group holds no block"):
        w._window_slots("a", req, 8, 13)
