"""Issue 40, item 2: hash-and-compare guards every KV cache group the worker reads.

A hybrid layout's sliding-window group is vLLM's: the token table does not map it, the
windowed layers read it by position. A copy that also writes one moved entry onto another
running request's newest window slot (``fuzz.faulty_engines.WindowWriteEngine``) changes that
request's outputs; the relocation checker must raise ``guard_overwritten`` when the copy
reports done, on the copy's own poll, whatever the copy's lag.
"""

from __future__ import annotations

import pytest

from vtoken.errors import RelocationCheckError
from vtoken.fuzz.faulty_engines import WindowWriteEngine
from vtoken.invariants.relocation_hash import RelocationChecker
from vtoken.reports.vllm_runs import _model, _one_thread, _prompt

pytestmark = pytest.mark.vllm

PROMPTS = {f"r{i}": _prompt(3, i, 30 + 11 * i) for i in range(3)}


def _decode(*, reclaim: bool, engine=None, checks: bool = True, lag: int = 0) -> dict:
    """One hybrid decode through the real vLLM scheduler (full attention + a window of two
    blocks), the worker's copy engine ``engine`` (None: the shipped one)."""
    from vtoken.vllm_adapter.adapter import AdapterDriver, VTokenAdapter, default_adapter_planner_config
    from vtoken.vllm_adapter.messages import LoggedTable
    from vtoken.vllm_adapter.worker import VTokenWorker

    nb = 24 + sum(-(-(len(p) + 20) // 16) + 1 for p in PROMPTS.values())
    ad = VTokenAdapter(block_size=16, num_blocks=nb, reclaim=reclaim, kv_layout="hybrid",
                       planner_config=default_adapter_planner_config(headroom=8))
    w_table = LoggedTable(16, nb)  # the worker's own table (the fault reads it)
    factory = None
    if engine is not None:
        def factory(kv, block_size, **kw):
            return engine(kv, block_size, table=w_table, **kw)
    w = VTokenWorker(_model(), w_table, nb, 16, policy="random", evict_ratio=0.5, seed=1,
                     check_relocations=RelocationChecker if (reclaim and checks) else None, copy_lag=lag,
                     copy_engine_factory=factory, layout=ad.worker_layout())
    if engine is not None:
        w.copy_engine.reqs = w.reqs  # the fault reads the worker's window lists
    d = AdapterDriver(ad, w)
    for r, p in PROMPTS.items():
        ad.add_request(r, p, max_tokens=20)
    with _one_thread():
        d.drain()
    ad.close()
    return {"outputs": {r: ad.output_tokens(r) for r in PROMPTS}, "applied": ad.stats["applied"],
            "hash_checks": w.hash_checks, "targets": list(getattr(w.copy_engine, "targets", ()))}


@pytest.fixture(scope="module")
def naive():
    return _decode(reclaim=False)["outputs"]


def test_the_window_write_is_a_real_fault(naive):
    """Unchecked, the extra write changes another request's outputs (the window is read)."""
    run = _decode(reclaim=True, engine=WindowWriteEngine, checks=False)
    assert run["applied"] > 0 and run["targets"]
    assert run["outputs"] != naive


@pytest.mark.parametrize("lag", [0, 2])
def test_hash_and_compare_catches_a_write_onto_a_window_slot(lag):
    """The finding reproduced: before the guard reached the window group, this run passed every
    hash check. Now the first extra write raises ``guard_overwritten`` naming the window slot."""
    with pytest.raises(RelocationCheckError) as e:
        _decode(reclaim=True, engine=WindowWriteEngine, lag=lag)
    assert e.value.code == "guard_overwritten"
    assert "sliding-window" in str(e.value)


def test_the_shipped_engine_passes_the_window_guard(naive):
    """No false alarm: a hybrid decode with the shipped engine passes every hash check, window
    slots guarded, and matches Naive-Evict token for token."""
    run = _decode(reclaim=True, lag=2)
    assert run["applied"] > 0 and run["hash_checks"] > 0
    assert run["outputs"] == naive
