"""The one set of planner defaults (``PlannerConfig()``) every path starts from: the decode
engine's and the vLLM adapter's wrappers return it. (The trigger rule's own tests are in
``tests/test_planner.py``, where the mutation campaign runs them.)"""

import pytest

from vtoken.planner import PlannerConfig

pytestmark = pytest.mark.invariants


def test_one_set_of_defaults_for_every_path():
    """The decode engine's and the vLLM adapter's defaults are PlannerConfig()'s."""
    from vtoken.decode import default_planner_config

    assert default_planner_config() == PlannerConfig()
    assert default_planner_config(record_snapshots=True, headroom=8) == PlannerConfig(record_snapshots=True, headroom=8)
    adapter = pytest.importorskip("vtoken.vllm_adapter.adapter")
    assert adapter.default_adapter_planner_config() == PlannerConfig()
    assert adapter.default_adapter_planner_config(headroom=4) == PlannerConfig(headroom=4)
