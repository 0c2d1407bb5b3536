"""The adapter's and its worker's configuration: every field refused at construction, before
anything is built, with a ``ConfigError`` naming the field and the value."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vtoken.errors import ConfigError
from vtoken.vllm_adapter import harness

pytestmark = pytest.mark.vllm

ADAPTER_BAD = [
    ("block_size", 0, "out_of_range"), ("block_size", 8.0, "bad_type"), ("block_size", True, "bad_type"),
    ("block_size", 1 << 20, "out_of_range"),
    ("num_blocks", 1, "out_of_range"), ("num_blocks", "64", "bad_type"),
    ("max_num_seqs", 0, "out_of_range"), ("max_num_batched_tokens", -1, "out_of_range"),
    ("max_model_len", None, "bad_type"),
    ("max_plans_per_step", 0, "out_of_range"), ("max_plans_per_step", 2.5, "bad_type"),
    ("check_full_every", 0, "out_of_range"), ("check_full_every", False, "bad_type"),
    ("headroom_pool_fraction", 0, "out_of_range"),
    ("keep_headroom", -1, "out_of_range"), ("keep_headroom", 4.0, "bad_type"), ("keep_headroom", True, "bad_type"),
    ("prefix_caching", 1, "bad_type"), ("async_scheduling", "yes", "bad_type"), ("reclaim", None, "bad_type"),
    ("checks", 0, "bad_type"), ("evict_unfaithful_hashes", "no", "bad_type"), ("paranoid_checks", 1.0, "bad_type"),
    ("planner_config", {"headrom": 4}, "unsupported"), ("planner_config", [4], "bad_type"),
    ("scheduler", object(), "bad_type"),
    ("max_num_batched_tokens", 8, "inconsistent"),  # below max_num_seqs (16): vLLM refuses it (test_config_meet)
    ("sliding_window", 32, "inconsistent"), ("sliding_window", 0, "out_of_range"), ("kv_layout", "mamba", "out_of_range"),
    ("table_device", "nonsense", "out_of_range"), ("table_device", 0, "bad_type"),
]


def _require_vllm():
    if harness.vllm_version() is None:
        pytest.fail("vLLM not installed: run scripts/install_vllm.sh", pytrace=False)


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test if the adapter builds anything (vLLM's scheduler, the token table)."""
    import vtoken.vllm_adapter.adapter as adapter_mod

    def built(*a, **kw):
        raise AssertionError("built before the configuration was checked")

    monkeypatch.setattr(adapter_mod, "VllmHarness", built)
    monkeypatch.setattr(adapter_mod, "TokenTable", built)


@pytest.mark.parametrize("field,value,code", ADAPTER_BAD, ids=[f"{f}={v!r}" for f, v, _ in ADAPTER_BAD])
def test_a_bad_adapter_field_is_refused_before_anything_is_built(nothing_built, field, value, code):
    _require_vllm()
    from vtoken.vllm_adapter.adapter import VTokenAdapter

    with pytest.raises(ConfigError) as e:
        VTokenAdapter(**{"block_size": 8, "num_blocks": 32, field: value})
    assert e.value.code == code
    assert f"VTokenAdapter.{field} must be" in str(e.value) and f"got {value!r}" in str(e.value), str(e.value)


def test_a_bad_planner_field_is_refused_by_the_planner_config():
    """The planner's fields are PlannerConfig's own (checked when it is made, never twice)."""
    from vtoken.vllm_adapter.adapter import default_adapter_planner_config

    with pytest.raises(ConfigError, match=r"PlannerConfig\.headroom must be"):
        default_adapter_planner_config(headroom=-1)


def test_good_adapter_fields_are_taken_as_plain_values():
    """numpy scalars are numbers too: taken, as plain Python values."""
    _require_vllm()
    from vtoken.vllm_adapter.adapter import VTokenAdapter

    ad = VTokenAdapter(block_size=np.int64(8), num_blocks=np.int32(32), max_plans_per_step=np.int64(2),
                       check_full_every=np.int16(3), checks=np.bool_(True))
    assert (ad.S, ad.N, ad.max_plans_per_step, ad.checker.full_every) == (8, 32, 2, 3)
    assert all(type(x) is int for x in (ad.S, ad.N, ad.max_plans_per_step, ad.checker.full_every))
    ad.close()


# ---------------------------------------------------------------------------- the worker
def _worker_bad(table, model):
    return [
        ("num_blocks", 31, "out_of_range"), ("num_blocks", 32.0, "bad_type"),
        ("block_size", 4, "out_of_range"), ("block_size", "8", "bad_type"),
        ("policy", "nope", "out_of_range"), ("policy", None, "bad_type"),
        ("policy_kwargs", [("seed", 1)], "bad_type"),
        ("evict_ratio", 1.0, "out_of_range"), ("evict_ratio", -0.1, "out_of_range"),
        ("evict_ratio", math.nan, "out_of_range"), ("evict_ratio", True, "bad_type"), ("evict_ratio", "0.5", "bad_type"),
        ("seed", -1, "out_of_range"), ("seed", 1.5, "bad_type"),
        ("copy_lag", -1, "out_of_range"), ("copy_lag", 2.0, "bad_type"),
        ("device", "nonsense", "out_of_range"), ("device", 3, "bad_type"),
        ("snapshot_dir", 3, "bad_type"), ("copy_engine_factory", 5, "bad_type"),
        ("model", None, "bad_type"), ("table", None, "bad_type"),
    ]


WORKER_FIELDS = [f"{f}={v!r}" for f, v, _ in _worker_bad(None, None)]


@pytest.mark.parametrize("case", range(len(WORKER_FIELDS)), ids=WORKER_FIELDS)
def test_a_bad_worker_field_is_refused_before_anything_is_built(model, monkeypatch, case):
    from vtoken.table import TokenTable
    from vtoken.vllm_adapter.worker import VTokenWorker

    table = TokenTable(8, 32)
    field, value, code = _worker_bad(table, model)[case]

    def built(*a, **kw):
        raise AssertionError("built before the configuration was checked")

    monkeypatch.setattr(type(model), "make_kv_cache", built)
    kw = dict(model=model, table=table, num_blocks=32, block_size=8)
    kw[field] = value
    with pytest.raises(ConfigError) as e:
        VTokenWorker(kw.pop("model"), kw.pop("table"), kw.pop("num_blocks"), kw.pop("block_size"), **kw)
    assert e.value.code == code
    assert f"VTokenWorker.{field} must be" in str(e.value) and f"got {value!r}" in str(e.value), str(e.value)


def test_a_worker_with_check_relocations_true_is_refused(model):
    """``True`` cannot name the toolkit's checker (the system never imports it)."""
    from vtoken.table import TokenTable
    from vtoken.vllm_adapter.worker import VTokenWorker

    with pytest.raises(ValueError, match="check_relocations=True"):
        VTokenWorker(model, TokenTable(8, 32), 32, 8, check_relocations=True)


# ---------------------------------------------------------------------------- the config object
def test_the_config_object_is_validated_when_made_and_builds_the_same_adapter():
    _require_vllm()
    from vtoken.planner import PlannerConfig
    from vtoken.vllm_adapter.adapter import VTokenAdapter
    from vtoken.vllm_adapter.config import AdapterConfig

    with pytest.raises(ConfigError, match=r"VTokenAdapter\.num_blocks must be"):
        AdapterConfig(num_blocks=1)  # refused with no adapter in sight
    c = AdapterConfig(block_size=8, num_blocks=48, max_plans_per_step=2, planner_config=PlannerConfig(headroom=3))
    a, b = VTokenAdapter(c), VTokenAdapter(block_size=8, num_blocks=48, max_plans_per_step=2,
                                           planner_config=PlannerConfig(headroom=3))
    assert a.config == b.config == c
    assert (a.S, a.N, a.max_plans_per_step, a.cfg.headroom) == (b.S, b.N, b.max_plans_per_step, 3) == (8, 48, 2, 3)
    assert AdapterConfig().planner_config == PlannerConfig()  # None: the shipped defaults


def test_a_config_and_settings_together_are_refused(nothing_built):
    _require_vllm()
    from vtoken.vllm_adapter.adapter import VTokenAdapter
    from vtoken.vllm_adapter.config import AdapterConfig

    with pytest.raises(ConfigError) as e:
        VTokenAdapter(AdapterConfig(), num_blocks=32)
    assert e.value.code == "inconsistent" and "num_blocks" in str(e.value)
    with pytest.raises(ConfigError, match=r"VTokenAdapter\.config must be"):
        VTokenAdapter({"num_blocks": 32})


def test_attach_records_the_geometry_of_the_scheduler_it_was_given():
    _require_vllm()
    from vtoken.vllm_adapter.adapter import VTokenAdapter

    built = VTokenAdapter(block_size=8, num_blocks=40, prefix_caching=False)
    other = VTokenAdapter.attach(built.harness.scheduler)  # the settings' defaults say 16 / 128 / caching on
    assert (other.config.block_size, other.config.num_blocks, other.config.prefix_caching) == (8, 40, False)
