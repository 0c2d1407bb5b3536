"""The adapter conformance machine (``fuzz/adapter_machine.py``) under the ci profile:
deterministic, bounded; and faults on the vLLM path must make it fail."""

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

pytestmark = [pytest.mark.invariants, pytest.mark.vllm]


def require_vllm():
    from vtoken.vllm_adapter import harness

    if harness.vllm_version() is None:
        pytest.fail("vLLM not installed: run scripts/install_vllm.sh", pytrace=False)


def test_adapter_machine_passes():
    require_vllm()
    from vtoken.fuzz.adapter_machine import AdapterMachine

    run_state_machine_as_test(AdapterMachine, settings=settings(settings(), max_examples=40, stateful_step_count=30))
