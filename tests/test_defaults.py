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


# Every field, each bad value: (field, value, code). A bool is not a number, a float not an integer.
BAD_FIELDS = [
    ("theta_f", float("nan"), "out_of_range"), ("theta_f", float("inf"), "out_of_range"),
    ("theta_f", 1.5, "out_of_range"), ("theta_f", "0.25", "bad_type"), ("theta_f", None, "bad_type"),
    ("theta_f", True, "bad_type"),
    ("check_every", 0, "out_of_range"), ("check_every", -1, "out_of_range"), ("check_every", 1.0, "bad_type"),
    ("check_every", True, "bad_type"), ("check_every", None, "bad_type"),
    ("max_sources", 0, "out_of_range"), ("max_sources", 2.5, "bad_type"), ("max_sources", False, "bad_type"),
    ("headroom", -1, "out_of_range"), ("headroom", "8", "bad_type"), ("headroom", None, "bad_type"),
    ("low_watermark", 1.5, "bad_type"), ("low_watermark", True, "bad_type"), ("low_watermark", "16", "bad_type"),
    ("copy_steps", -1, "out_of_range"), ("copy_steps", 4.0, "bad_type"),
    ("max_plans_per_round", 0, "out_of_range"), ("max_plans_per_round", None, "bad_type"),
    ("record_snapshots", 1, "bad_type"), ("record_snapshots", None, "bad_type"), ("record_snapshots", "yes", "bad_type"),
    ("in_place", 0, "bad_type"), ("in_place", "False", "bad_type"),
]


@pytest.mark.parametrize("field,value,code", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v, _ in BAD_FIELDS])
def test_every_field_validated_at_construction(field, value, code):
    """A bad field is refused when the config is built (directly or by dataclasses.replace),
    naming the field and the value, not later as a division by zero or a silent no-op."""
    from dataclasses import replace

    from vtoken.errors import CONFIG_CODES, ConfigError

    assert code in CONFIG_CODES
    for build in (lambda: PlannerConfig(**{field: value}), lambda: replace(PlannerConfig(), **{field: value})):
        with pytest.raises(ConfigError) as e:
            build()
        assert isinstance(e.value, ValueError) and e.value.code == code
        assert f"PlannerConfig.{field} must be" in str(e.value) and f"got {value!r}" in str(e.value), str(e.value)


def test_check_every_zero_no_longer_reaches_the_manager():
    """The finding: check_every=0 was accepted and divided by zero at the first step."""
    from vtoken.allocator import BlockAllocator
    from vtoken.planner import NullCopyEngine, ReclamationManager
    from vtoken.table import TokenTable

    with pytest.raises(ValueError, match=r"check_every must be an integer >= 1, got 0"):
        ReclamationManager(TokenTable(4, 8), BlockAllocator(8), NullCopyEngine(0), PlannerConfig(check_every=0)).step()


def test_good_values_accepted_and_numpy_scalars_normalised():
    import json

    import numpy as np

    ok = [dict(theta_f=0), dict(theta_f=1.0), dict(theta_f=-1.0), dict(low_watermark=-1), dict(low_watermark=0),
          dict(headroom=0, copy_steps=0, check_every=1, max_sources=1, max_plans_per_round=1),
          dict(record_snapshots=True, in_place=False)]
    for kw in ok:
        PlannerConfig(**kw)
    c = PlannerConfig(theta_f=np.float32(0.5), check_every=np.int64(2), max_sources=np.int32(4), headroom=np.uint8(3),
                      low_watermark=np.int64(-1), in_place=np.bool_(False))
    assert json.dumps(vars(c))  # Python scalars: a config is reported as JSON
    assert type(c.check_every) is int and type(c.theta_f) is float and c.in_place is False
