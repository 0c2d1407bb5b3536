"""vtoken's settings inside vLLM's engine (``vtoken.vllm_engine.settings``): every key checked
before an engine is built, with one line naming the key; JSON in, JSON out."""

from __future__ import annotations

import json

import pytest

from vtoken.errors import ConfigError
from vtoken.vllm_engine import SCHEDULER_CLS, WORKER_CLS, engine_args
from vtoken.vllm_engine.settings import EngineSettings


def test_defaults_and_the_engine_arguments():
    s = EngineSettings()
    assert (s.policy, s.evict_ratio, s.budget, s.reclaim, s.checks, s.check_relocations) == ("h2o", 0.5, None, True,
                                                                                             True, True)
    kw = engine_args(policy="random", evict_ratio=0.25, planner={"in_place": False, "headroom": 8})
    assert kw["scheduler_cls"] == SCHEDULER_CLS and kw["worker_cls"] == WORKER_CLS
    back = EngineSettings.of(json.loads(json.dumps(kw["additional_config"]["vtoken"])))  # as vLLM carries it
    assert back == EngineSettings(policy="random", evict_ratio=0.25, planner={"in_place": False, "headroom": 8})
    assert back.planner_config().headroom == 8 and not back.planner_config().in_place


def test_the_engine_defaults_are_the_adapters():
    """The settings vtoken takes inside vLLM's engine and the adapter's own config name the same
    knobs: their defaults agree, so the engine runs what the adapter's tests and benches measured
    (a default changed in one of them alone would not be)."""
    from vtoken.vllm_adapter.config import AdapterConfig

    s, a = EngineSettings(), AdapterConfig()
    shared = ("reclaim", "checks", "max_plans_per_step", "check_full_every", "paranoid_checks", "keep_prefix_bytes",
              "keep_headroom", "headroom_pool_fraction")
    assert {k: getattr(s, k) for k in shared} == {k: getattr(a, k) for k in shared}


def test_a_budget_instead_of_a_ratio():
    s = EngineSettings.of({"budget": 64})
    assert s.budget == 64 and s.evict_ratio == 0.0
    assert EngineSettings.of(s.to_dict()) == s  # round trip through JSON values
    with pytest.raises(ConfigError, match=r"vtoken\.budget must be given without evict_ratio"):
        EngineSettings.of({"budget": 64, "evict_ratio": 0.5})


@pytest.mark.parametrize("bad, match", [
    ({"policy": "lru"}, r"vtoken\.policy must be one of"),
    ({"evict_ratio": 1.0}, r"vtoken\.evict_ratio"),
    ({"evict_ratio": "half"}, r"vtoken\.evict_ratio"),
    ({"budget": 0}, r"vtoken\.budget"),
    ({"copy_lag": -1}, r"vtoken\.copy_lag"),
    ({"checks": "yes"}, r"vtoken\.checks"),
    ({"planner": {"headroom": -1}}, r"vtoken\.planner\.headroom must be an integer >= 0, got -1"),
    ({"planner": {"headrom": 4}}, r"vtoken\.planner must be a dict of PlannerConfig's fields .*not headrom"),
    ({"planner": [1]}, r"vtoken\.planner"),
    ({"polcy": "h2o"}, r"unknown setting\(s\) \['polcy'\]"),
    ("{not json", r"must be a JSON object"),
    ([1, 2], r"must be a JSON object"),
])
def test_every_bad_setting_is_refused_in_one_line(bad, match):
    with pytest.raises(ConfigError, match=match) as e:
        EngineSettings.of(bad)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=match):
        engine_args(**bad) if isinstance(bad, dict) else EngineSettings.of(bad)


def test_vtoken_is_off_without_its_key():
    class Cfg:
        additional_config = {"other": 1}

    assert EngineSettings.from_vllm_config(Cfg()) is None
    Cfg.additional_config = {"vtoken": {"policy": "streaming"}}
    assert EngineSettings.from_vllm_config(Cfg()).policy == "streaming"
