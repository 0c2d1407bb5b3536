"""The engine path's checks catch what they are for (controls): a relocation that goes wrong in
vLLM's own K/V tensors, and the engine conformance machine over vLLM's real engine.

Planted faults are patches in a shadow tree (``vtoken.fuzz.planted.shadow_for``); the engine
run imports the shadow's vtoken (``PYTHONPATH``), never a fault in the shipped code."""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from vtoken.errors import OrderError
from vtoken.vllm_engine.run import compare

SPEC = dict(requests=8, new_tokens=96, prompt_len=48, seed=0, settings={"policy": "h2o", "evict_ratio": 0.5})


def test_a_copy_that_skips_a_layer_of_vllms_cache_is_caught(engine_python, tmp_path):
    """engine_copy_skipped: hash-and-compare stops the run at the first relocation."""
    from vtoken.fuzz.planted import shadow_for
    from vtoken.fuzz.shadow import env_for

    sh = shadow_for(["engine_copy_skipped"], tmp_path / "shadow")
    env = {k: v for k, v in env_for(sh).items() if k in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    with pytest.raises(OrderError, match=r"(?s)vtoken.*relocation_mismatch"):
        compare(SPEC, python=engine_python, env=env)


def test_the_engine_machine_runs_clean(engine_python):
    """A derandomized run of the engine conformance machine: vtoken and Naive-Evict engines
    driven by the same adds, aborts and steps, checked after every step and compared at the end."""
    code = textwrap.dedent("""
        import os
        os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        from hypothesis import HealthCheck, settings
        from hypothesis.stateful import run_state_machine_as_test
        from vtoken.fuzz import engine_machine as m
        run_state_machine_as_test(m.EngineMachine, settings=settings(
            max_examples=8, stateful_step_count=15, deadline=None, database=None, derandomize=True,
            suppress_health_check=list(HealthCheck)))
        plans = sum(vt.engine_core.engine_core.scheduler.vtoken_adapter.stats["plans"] for vt, _ in m._ENGINES.values())
        print("PLANS", plans)
    """)
    p = subprocess.run([engine_python, "-c", code], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    plans = int(next(ln for ln in p.stdout.splitlines() if ln.startswith("PLANS")).split()[1])
    assert plans > 0, "the machine launched no plan: it checked nothing of reclamation"
