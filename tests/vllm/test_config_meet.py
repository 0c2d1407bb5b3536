"""Configurations checked where they meet (issue 40, item 5): a worker's KV layout against its
adapter's at attach; every combination vLLM's own configuration refuses refused first, by field
(each one shown here to be refused by vLLM itself, each accepted boundary accepted by it); the
layout's and the harness's fields at construction; settings given as JSON, nested planner
settings included, reaching the adapter through every text entry point."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vtoken.errors import ConfigError
from vtoken.vllm_adapter import harness

pytestmark = pytest.mark.vllm


def _require_vllm():
    if harness.vllm_version() is None:
        pytest.fail("vLLM not installed: run scripts/install_vllm.sh", pytrace=False)


# ---------------------------------------------------------------------------- finding 4: the worker's layout
def _worker(model, ad, **kw):
    from vtoken.table import TokenTable
    from vtoken.vllm_adapter.worker import VTokenWorker

    return VTokenWorker(model, TokenTable(ad.S, ad.N), ad.N, ad.S, **kw)


def test_a_worker_without_the_hybrid_layout_is_refused_at_attach(model):
    """It attached silently and ran every layer over the full-attention group: the outputs were
    the full-attention model's."""
    _require_vllm()
    from vtoken.vllm_adapter.adapter import VTokenAdapter
    from vtoken.vllm_adapter.driver import AdapterDriver

    ad = VTokenAdapter(kv_layout="hybrid", block_size=4, num_blocks=32)
    w = _worker(model, ad)  # no layout=: one full-attention group
    with pytest.raises(ConfigError) as e:
        AdapterDriver(ad, w)
    msg = str(e.value)
    assert e.value.code == "inconsistent" and "\n" not in msg
    assert f"the worker's layout {w.layout!r} is not the adapter's {ad.worker_layout()!r}" in msg, msg
    assert ad.worker is None  # nothing attached
    ok = _worker(model, ad, layout=ad.worker_layout())
    ad.attach_worker(ok)
    assert ad.worker is ok


def test_a_worker_under_a_sliding_window_adapter_is_refused_at_attach(model):
    """It finished silently or failed mid-run with TableError[slot_conflict]: the worker read the
    sliding-window group, whose blocks vLLM frees, as the token table's."""
    _require_vllm()
    from vtoken.vllm_adapter.adapter import VTokenAdapter

    ad = VTokenAdapter(kv_layout="sliding", block_size=4, num_blocks=32)
    with pytest.raises(ConfigError) as e:
        ad.attach_worker(_worker(model, ad))
    assert e.value.code == "unsupported" and "SlidingWindowManager" in str(e.value)
    assert "WorkerLayout(table=0, window_group=None, window=0)" in str(e.value)
    assert ad.worker is None


def test_a_worker_of_another_geometry_is_refused_at_attach(model):
    _require_vllm()
    from vtoken.table import TokenTable
    from vtoken.vllm_adapter.adapter import VTokenAdapter
    from vtoken.vllm_adapter.worker import VTokenWorker

    ad = VTokenAdapter(block_size=4, num_blocks=32)
    with pytest.raises(ConfigError, match=r"block size 8 x 32 blocks, the adapter's 4 x 32"):
        ad.attach_worker(VTokenWorker(model, TokenTable(8, 32), 32, 8))


# ---------------------------------------------------------------------------- finding 5: the layout's fields
@pytest.mark.parametrize("kw, field, code", [
    (dict(window_group=1, window=0), "window", "out_of_range"),
    (dict(window_group=1, window=-3), "window", "out_of_range"),
    (dict(table=-1), "table", "out_of_range"),
    (dict(table=1.0), "table", "bad_type"),
    (dict(window_group="1", window=8), "window_group", "bad_type"),
    (dict(window_group=-1, window=8), "window_group", "out_of_range"),
    (dict(table=0, window_group=0, window=8), "window_group", "inconsistent"),
    (dict(window=8), "window", "inconsistent"),
])
def test_a_bad_worker_layout_is_refused_at_construction(kw, field, code):
    """A hand-made ``WorkerLayout(window=0)`` failed mid-step (``CallError``)."""
    from vtoken.vllm_adapter.layout import WorkerLayout

    with pytest.raises(ConfigError) as e:
        WorkerLayout(**kw)
    assert e.value.code == code and f"WorkerLayout.{field} must be" in str(e.value), str(e.value)


def test_a_good_worker_layout_is_kept_as_plain_ints():
    import numpy as np

    from vtoken.vllm_adapter.layout import WorkerLayout

    lay = WorkerLayout(np.int64(0), np.int32(1), np.int64(1))
    assert (lay.table, lay.window_group, lay.window) == (0, 1, 1) and type(lay.window_group) is int
    assert WorkerLayout() == WorkerLayout(0, None, 0) and lay.groups_needed() == 2


def test_a_layout_naming_a_group_the_step_lacks_is_refused_before_the_step_changes_anything(model):
    """A group index out of range failed mid-step with ``IndexError``; now ``ConfigError`` at
    the step's start, the worker unchanged (a worker never attached: the engine path's too)."""
    _require_vllm()
    from vtoken.vllm_adapter.adapter import VTokenAdapter
    from vtoken.vllm_adapter.layout import WorkerLayout

    ad = VTokenAdapter(block_size=4, num_blocks=32, async_scheduling=False)
    w = _worker(model, ad, layout=WorkerLayout(0, 3, 8))
    ad.add_request("a", list(range(10)), max_tokens=2)
    so = ad.schedule()
    with pytest.raises(ConfigError) as e:
        w.execute(so)
    assert e.value.code == "inconsistent" and "VTokenWorker.layout must be a layout of the 1 KV cache group" \
        in str(e.value)
    assert w.reqs == {} and w.stats["steps"] == 0 and "a" not in w.table


# ---------------------------------------------------------------------------- finding 5: what vLLM refuses
# (max_num_seqs, max_num_batched_tokens, max_model_len, chunked prefill): each refused by vLLM's own
# SchedulerConfig or accepted by it (the boundaries)
VLLM_CASES = [
    (16, 8, 1024, True), (16, 15, 1024, True), (16, 16, 1024, True), (1, 1, 1024, True), (16, 2048, 1024, True),
    (16, 16, 1024, False), (16, 1023, 1024, False), (16, 1024, 1024, False), (8, 4096, 4096, False),
]


def _vllm_refuses(seqs, batched, model_len, chunked) -> bool:
    """Does vLLM 0.33.0's own ``SchedulerConfig`` refuse these values (its pydantic error)?"""
    from vllm.config import SchedulerConfig

    try:
        SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=batched, max_model_len=model_len,
                        is_encoder_decoder=False, enable_chunked_prefill=chunked)
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError (a ValueError)
        assert "max_num_batched_tokens" in str(e), e
        return True
    return False


@pytest.mark.parametrize("seqs, batched, model_len, chunked", VLLM_CASES,
                         ids=[f"seqs{a}-batched{b}-len{c}-chunked{d}" for a, b, c, d in VLLM_CASES])
def test_the_harness_refuses_exactly_what_vllm_refuses(seqs, batched, model_len, chunked):
    """``VllmHarness(max_num_batched_tokens=8, max_num_seqs=16)`` raised vLLM's raw pydantic
    ``ValidationError``: now a ``ConfigError`` naming the field, for each combination vLLM refuses,
    and the harness builds for each it accepts."""
    _require_vllm()
    refused = _vllm_refuses(seqs, batched, model_len, chunked)
    assert refused == (batched < seqs or (not chunked and batched < model_len))  # the rule derived from vLLM
    kw = dict(max_num_seqs=seqs, max_num_batched_tokens=batched, max_model_len=model_len,
              enable_chunked_prefill=chunked, num_blocks=16)
    if refused:
        with pytest.raises(ConfigError) as e:
            harness.VllmHarness(**kw)
        assert e.value.code == "inconsistent"
        assert f"VllmHarness.max_num_batched_tokens must be at least" in str(e.value)
        assert f"got {batched}" in str(e.value)
    else:
        h = harness.VllmHarness(**kw)
        assert h.vllm_config.scheduler_config.max_num_batched_tokens == batched


@pytest.mark.parametrize("seqs, batched", [(16, 8), (16, 15), (16, 16), (1, 1)])
def test_adapter_config_refuses_exactly_what_vllm_refuses(seqs, batched):
    """``AdapterConfig(max_num_batched_tokens=8, max_num_seqs=16)`` was accepted and the adapter
    then failed with vLLM's raw ``ValidationError``. The adapter always runs chunked prefill, so
    only the token budget's floor applies."""
    _require_vllm()
    from vtoken.vllm_adapter.adapter import VTokenAdapter
    from vtoken.vllm_adapter.config import AdapterConfig

    kw = dict(max_num_seqs=seqs, max_num_batched_tokens=batched)
    if _vllm_refuses(seqs, batched, 1024, True):
        with pytest.raises(ConfigError) as e:
            AdapterConfig(**kw)
        assert e.value.code == "inconsistent" and "\n" not in str(e.value)
        assert str(e.value).startswith(f"[inconsistent] VTokenAdapter.max_num_batched_tokens must be at least "
                                       f"max_num_seqs ({seqs})") and str(e.value).endswith(f"got {batched}")
    else:
        ad = VTokenAdapter(block_size=8, num_blocks=32, **kw)  # vLLM builds its scheduler from it
        assert ad.scheduler.scheduler_config.max_num_batched_tokens == batched


@pytest.mark.parametrize("window, code", [(0, "out_of_range"), (-3, "out_of_range"), ("x", "bad_type"),
                                          (1.5, "bad_type"), (True, "bad_type")])
def test_the_harness_refuses_a_bad_sliding_window_at_construction(window, code):
    """``VllmHarness(sliding_window=0 or -3)`` was accepted (vLLM reads a window of 0 as no window
    at all) and ``'x'`` raised a bare ``ValueError``."""
    _require_vllm()
    with pytest.raises(ConfigError) as e:
        harness.VllmHarness(kv_layout="hybrid", sliding_window=window)
    assert e.value.code == code and f"VllmHarness.sliding_window must be" in str(e.value)
    assert f"got {window!r}" in str(e.value)


@pytest.mark.parametrize("kw, field, code", [
    (dict(kv_layout="full", sliding_window=32), "sliding_window", "inconsistent"),
    (dict(kv_layout="mamba"), "kv_layout", "out_of_range"),
    (dict(block_size=0), "block_size", "out_of_range"),
    (dict(num_blocks=8.0), "num_blocks", "bad_type"),
    (dict(max_model_len=None), "max_model_len", "bad_type"),
    (dict(prefix_caching="yes"), "prefix_caching", "bad_type"),
    (dict(enable_chunked_prefill=1), "enable_chunked_prefill", "bad_type"),
])
def test_the_harness_refuses_every_bad_field_before_building(kw, field, code, monkeypatch):
    _require_vllm()

    def built(**_):
        raise AssertionError("built before the fields were checked")

    monkeypatch.setattr(harness, "_vllm_config", built)
    with pytest.raises(ConfigError) as e:
        harness.VllmHarness(**kw)
    assert e.value.code == code and f"VllmHarness.{field} must be" in str(e.value), str(e.value)


def test_the_smallest_sliding_window_is_accepted():
    _require_vllm()
    h = harness.VllmHarness(kv_layout="hybrid", sliding_window=1, block_size=4, num_blocks=16)
    assert [int(getattr(m, "sliding_window", 0)) for m in h.managers] == [0, 1]


# ---------------------------------------------------------------------------- finding 5: settings as JSON
SETTINGS = '{"planner_config": {"headroom": 64, "in_place": false}}'


def test_json_settings_with_nested_planner_settings_build_the_adapter():
    """``--adapter-settings '{"planner_config": {...}}'`` failed every scheduler-building test
    with ``ConfigError[bad_type] VTokenAdapter.planner_config must be a PlannerConfig``."""
    _require_vllm()
    from vtoken.planner import PlannerConfig
    from vtoken.vllm_adapter.adapter import VTokenAdapter
    from vtoken.vllm_adapter.config import AdapterConfig, adapter_settings

    assert AdapterConfig.of(SETTINGS).planner_config == PlannerConfig(headroom=64, in_place=False)
    h = harness.VllmHarness(block_size=8, num_blocks=32)
    ad = VTokenAdapter.attach(h.scheduler, **adapter_settings(SETTINGS, attach=True))
    assert (ad.cfg.headroom, ad.cfg.in_place) == (64, False)


@pytest.mark.parametrize("value, code, where", [
    ('{"planner_config": {"headrom": 4}}', "unsupported", "VTokenAdapter.planner_config must be a dict of "
                                                          "PlannerConfig's fields"),
    ('{"planner_config": {"headroom": -1}}', "out_of_range", "VTokenAdapter.planner_config.headroom must be"),
    ('{"planner_config": 4}', "bad_type", "VTokenAdapter.planner_config must be"),
    ('{"reclam": false}', "unsupported", "VTokenAdapter.settings must be AdapterConfig's fields only"),
    ('{"block_size": 8}', "unsupported", "VTokenAdapter.block_size must be left to the scheduler"),
    ('{"max_num_seqs": 4096}', "unsupported", "VTokenAdapter.max_num_seqs must be left to the scheduler"),
    ("[1]", "bad_type", "VTokenAdapter.settings must be a JSON object"),
    ("{bad", "bad_type", "VTokenAdapter.settings must be a JSON object"),
])
def test_bad_json_settings_are_refused_by_field(value, code, where):
    from vtoken.vllm_adapter.config import adapter_settings

    with pytest.raises(ConfigError) as e:
        adapter_settings(value, attach=True)
    assert e.value.code == code and where in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_keywords_to_attach_that_are_the_schedulers_are_refused():
    """``attach`` read vLLM's configuration off the scheduler and silently dropped a given one."""
    _require_vllm()
    from vtoken.vllm_adapter.adapter import VTokenAdapter

    h = harness.VllmHarness(block_size=8, num_blocks=32)
    with pytest.raises(ConfigError, match=r"VTokenAdapter\.block_size must be left to the scheduler"):
        VTokenAdapter.attach(h.scheduler, block_size=16)


PLANNER_JSON = [{"headroom": 64, "in_place": False}, {}, {"theta_f": 0.5, "low_watermark": -1},
                {"headrom": 1}, {"headroom": -1}, {"in_place": "no"}, {"theta_f": True}, [1], "x"]


@pytest.mark.parametrize("planner", PLANNER_JSON, ids=[repr(p) for p in PLANNER_JSON])
def test_the_adapter_and_the_engine_take_one_planner_json_shape(planner):
    """The engine's ``additional_config["vtoken"]["planner"]`` and the adapter's
    ``planner_config``: one parser, so the same object gives the same config or the same refusal."""
    from vtoken.vllm_adapter.config import AdapterConfig
    from vtoken.vllm_engine.settings import EngineSettings

    def outcome(build, prefix):
        try:
            return ("ok", build())
        except ConfigError as e:
            assert prefix in str(e), str(e)
            return (e.code, str(e).split(prefix, 1)[1])

    a = outcome(lambda: AdapterConfig.of({"planner_config": planner}).planner_config, "VTokenAdapter.planner_config")
    b = outcome(lambda: EngineSettings.of({"planner": planner}).planner_config(), "vtoken.planner")
    # a JSON object: the same config or the same refusal word for word; else the same code (the
    # engine's settings are JSON only, the adapter's may also be a PlannerConfig)
    assert a == b if isinstance(planner, dict) else a[0] == b[0] == "bad_type"


# ---------------------------------------------------------------------------- the text entry points
def _pytest_with_plugin(tmp_path, settings: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_x.py").write_text(
        "from vtoken.vllm_adapter.harness import VllmHarness\n\n\n"
        "def test_x():\n"
        "    ad = VllmHarness(block_size=8, num_blocks=32).scheduler.vtoken_adapter\n"
        "    assert (ad.cfg.headroom, ad.cfg.in_place) == (64, False)\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "vtoken.reports.vllm_tests_plugin", "-p",
                           "no:cacheprovider", "-q", "--vtoken-adapter-settings", settings, "test_x.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)


def test_the_own_tests_plugin_takes_nested_planner_settings(tmp_path):
    """``--vtoken-adapter-settings`` with a nested planner object reaches every attached adapter
    (it failed every scheduler-building test with ConfigError[bad_type])."""
    _require_vllm()
    p = _pytest_with_plugin(tmp_path, SETTINGS)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]


@pytest.mark.parametrize("settings, where", [('{"planner_config": {"headrom": 1}}', "VTokenAdapter.planner_config"),
                                             ('{"block_size": 8}', "VTokenAdapter.block_size")])
def test_the_own_tests_plugin_refuses_bad_settings_as_a_usage_error(tmp_path, settings, where):
    _require_vllm()
    p = _pytest_with_plugin(tmp_path, settings)
    out = p.stdout + p.stderr
    assert p.returncode == 4 and "Traceback" not in out, out[-3000:]
    assert "error: argument --vtoken-adapter-settings: " in out and where in out, out[-3000:]


def test_own_tests_refuses_bad_adapter_settings_before_running(capsys):
    """``--adapter-settings`` is checked by the chosen interpreter's vtoken (this process never
    imports vLLM): a refusal is argparse's usage error naming the option, nothing fetched."""
    _require_vllm()
    from vtoken.reports import vllm_own_tests as own

    with pytest.raises(SystemExit) as e:
        own.main(["--python", sys.executable, "--adapter-settings", '{"planner_config": {"headroom": -1}}'])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "argument --adapter-settings: [out_of_range] VTokenAdapter.planner_config.headroom must be" in err, err
    probe, _ = own.preflight(sys.executable, None, True, {"planner_config": {"headroom": 64, "in_place": False}})
    assert probe["settings_error"] is None
