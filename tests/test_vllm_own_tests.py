"""vLLM's own tests with vtoken in place (``vtoken.reports.vllm_own_tests``): the junit
parsing, the not-applicable and divergence classification, the extraction of the tests from
an sdist and the plugin's attach point, on small synthetic inputs (no download, no vLLM
run); one ``slow`` test runs the real thing on two of vLLM's test files."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from vtoken.reports import vllm_own_tests as vot
from vtoken.reports import vllm_tests_plugin as plugin

pytestmark = pytest.mark.vllm

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="2" skipped="2" tests="8">
 <testcase classname="tests.v1.core.test_a" name="test_ok" file="tests/v1/core/test_a.py" line="3">
  <properties><property name="nodeid" value="tests/v1/core/test_a.py::test_ok"/>
   <property name="vtoken_adapters" value="1"/></properties></testcase>
 <testcase classname="tests.v1.core.test_a" name="test_bad[1-True]" file="tests/v1/core/test_a.py" line="9">
  <failure message="AssertionError: assert 3 == 5">def test_bad():
&gt;       assert free == 5
E       AssertionError: assert 3 == 5
E        +  where 3 = get_num_free_blocks()</failure></testcase>
 <testcase classname="tests.v1.core.test_a.TestK" name="test_m" file="tests/v1/core/test_a.py" line="20"/>
 <testcase classname="tests.v1.core.test_a" name="test_skip" file="tests/v1/core/test_a.py" line="30">
  <skipped type="pytest.skip" message="needs CUDA">skip</skipped></testcase>
 <testcase classname="tests.v1.core.test_a" name="test_xf" file="tests/v1/core/test_a.py" line="33">
  <skipped type="pytest.xfail" message="known"/></testcase>
 <testcase classname="tests.v1.core.test_a" name="test_td" file="tests/v1/core/test_a.py" line="40"/>
 <testcase classname="tests.v1.core.test_a" name="test_td" file="tests/v1/core/test_a.py" line="40">
  <error message="failed on teardown with &quot;RuntimeError: x&quot;">E   RuntimeError: x</error></testcase>
 <testcase classname="" name="tests.v1.core.test_broken">
  <error message="collection failure">ImportError: No module named 'anthropic'</error></testcase>
</testsuite></testsuites>
"""


def rec(outcome="failed", message="", text=""):
    return {"outcome": outcome, "message": message, "text": text, "properties": {}}


# ---------------------------------------------------------------------------- junit
def test_parse_junit_outcomes_ids_and_properties():
    r = vot.parse_junit(JUNIT)
    assert r["tests/v1/core/test_a.py::test_ok"]["outcome"] == "passed"
    assert r["tests/v1/core/test_a.py::test_ok"]["properties"]["vtoken_adapters"] == "1"
    bad = r["tests/v1/core/test_a.py::test_bad[1-True]"]  # rebuilt from file + name (no nodeid property)
    assert bad["outcome"] == "failed" and bad["message"] == "AssertionError: assert 3 == 5"
    assert vot.error_line(bad) == "AssertionError: assert 3 == 5"
    assert r["tests/v1/core/test_a.py::TestK::test_m"]["outcome"] == "passed"  # class part from classname
    assert r["tests/v1/core/test_a.py::test_skip"]["outcome"] == "skipped"
    assert r["tests/v1/core/test_a.py::test_xf"]["outcome"] == "passed"  # an xfail behaved as expected
    assert r["tests/v1/core/test_a.py::test_td"]["outcome"] == "error"  # the teardown error wins
    assert r["tests/v1/core/test_broken.py"]["outcome"] == "error"  # a collection error, by file
    assert len(r) == 7


def test_summarize_counts_every_test_and_lists_the_not_applicable():
    s = vot.summarize(vot.parse_junit(JUNIT))
    assert (s["passed"], s["failed"], s["not_applicable"]) == (3, 2, 2)
    why = {d["test"]: d["reason"] for d in s["not_applicable_tests"]}
    assert why == {"tests/v1/core/test_a.py::test_skip": "skipped: needs CUDA",
                   "tests/v1/core/test_broken.py": "needs the Python package anthropic (not installed in this "
                                                  "environment)"}
    assert {d["test"] for d in s["failed_tests"]} == {"tests/v1/core/test_a.py::test_bad[1-True]",
                                                      "tests/v1/core/test_a.py::test_td"}


# ---------------------------------------------------------------------------- not applicable
@pytest.mark.parametrize("r, reason", [
    (rec(message="pydantic ValidationError", text="E Value error, Invalid repository ID or local directory "
                                                  "specified: 'llava-hf/llava-1.5-7b-hf'."),
     "needs the HF hub: model llava-hf/llava-1.5-7b-hf is not available offline"),
    (rec(message="LocalEntryNotFoundError: outgoing traffic has been disabled",
         text="repo_id = 'Qwen/Qwen3-0.6B', repo_type = 'model'"),
     "needs the HF hub: model Qwen/Qwen3-0.6B is not available offline"),
    (rec(message="RuntimeError: Found no NVIDIA driver on your system"), "needs a GPU (CUDA)"),
    (rec(outcome="error", message="collection failure", text="ModuleNotFoundError: No module named 'openai'"),
     "needs the Python package openai (not installed in this environment)"),
    (rec(outcome="skipped", message="need --optional option to run"), "skipped: need --optional option to run"),
    # really failed: an assertion, or a module of vLLM / the tests / vtoken missing (an API moved)
    (rec(message="AssertionError: assert 3 == 5"), None),
    (rec(message="ModuleNotFoundError: No module named 'vllm.v1.core.sched.newname'"), None),
    (rec(message="ModuleNotFoundError: No module named 'tests.v1.core.utils2'"), None),
    (rec(message="ModuleNotFoundError: No module named 'vtoken'"), None),
    (rec(outcome="passed"), None),
])
def test_not_applicable_reasons(r, reason):
    assert vot.not_applicable_reason(r) == reason


# ---------------------------------------------------------------------------- divergences
HELD = {"vtoken_stats": '{"deferred_free_calls": 3, "headroom_target": 4}'}  # the adapter kept blocks


@pytest.mark.parametrize("test, error, cause, kind", [
    ("t.py::test_hybrid", "AdapterAssumptionError: assumption broken: ... [kv_groups]: block 7 (headroom) is in "
                          "request 'r''s list of KV cache group 1", "kv_groups", "bug"),
    ("t.py::test_x", "E   RuntimeError: Failed to reset KV cache even when all the running requests are "
                     "preempted", "reset_prefix_cache_blocked", "bug"),
    ("t.py::test_reset_prefix_cache_twice", "E   assert False", "reset_prefix_cache_blocked", "bug"),
    ("tests/v1/core/test_scheduler.py::test_preempt_during_execution", "E   assert 2 == 1",
     "fence_defers_vllm_frees", "bug"),
    ("tests/v1/core/test_priority_preemption_bug.py::test_priority_scheduler_preempt_skipped_request",
     "AssertionError: Bug present: Request C was silently skipped", "tight_pool_headroom", "bug"),
    ("t.py::test_d", ">       assert pool.get_num_free_blocks() == num_free_initially\nE       assert 9935 == 9999",
     "headroom_held_at_idle", "bug"),
    ("t.py::test_e", ">       assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 9999 - 8\n"
                     "E       assert 9927 == 9991", "headroom_in_free_counts", "inherent"),
    ("t.py::test_abort", "E   assert scheduler.has_requests()", "backpressure_hides_requests", "bug"),
])
def test_divergence_rules_classify_by_cause(test, error, cause, kind):
    r = rec(message=error.splitlines()[0], text=error)
    r["properties"] = dict(HELD)
    d = vot.classify_divergence(test, r)
    assert (d["cause"], d["kind"], d["test"]) == (cause, kind, test)
    assert d["reason"] == next(r["reason"] for r in vot.DIVERGENCE_RULES if r["cause"] == cause)


def test_a_starved_headroom_in_the_plugin_stats_is_a_tight_pool():
    r = rec(message="assert 0 == 1")
    r["properties"] = {"vtoken_adapters": "1",
                       "vtoken_stats": '{"backpressure_steps": 0, "headroom_yielded": 2, "preemptions": 0}'}
    assert vot.classify_divergence("t.py::test_new", r)["cause"] == "tight_pool_headroom"
    r["properties"]["vtoken_stats"] = '{"backpressure_steps": 0, "headroom_yielded": 0, "preemptions": 0}'
    assert vot.classify_divergence("t.py::test_new", r)["cause"] == "unclassified"


CONFIG_ERROR = ("vtoken.errors.ConfigError: [bad_type] VTokenAdapter.planner_config must be a PlannerConfig or "
                "None, got {'headroom': 64, 'in_place': False}")


@pytest.mark.parametrize("test", [
    "tests/v1/core/test_priority_preemption_bug.py::test_priority_scheduler_preempt_skipped_request",
    "tests/v1/core/test_scheduler.py::test_preempt_during_execution",
    "tests/v1/core/test_scheduler.py::test_reset_prefix_cache_twice",
    "tests/v1/core/test_scheduler.py::test_kv_connector_unable_to_allocate[1]",
])
def test_a_vtoken_error_is_filed_by_what_failed_not_by_the_tests_name(test):
    """With ``--adapter-settings '{"planner_config": {...}}'`` every scheduler-building test failed
    with ConfigError[bad_type], and the rules filed most of them under causes matched by the test's
    name (tight_pool_headroom, fence_defers_vllm_frees, ...)."""
    r = rec(message=CONFIG_ERROR, text="    def test():\n>       scheduler = create_scheduler()\nE   " + CONFIG_ERROR)
    r["properties"] = dict(HELD)  # even with the adapter holding blocks: the failure decides
    d = vot.classify_divergence(test, r)
    assert (d["cause"], d["kind"], d["failure"]) == ("vtoken_error:ConfigError[bad_type]", "bug",
                                                     "ConfigError[bad_type]")
    assert d["reason"].startswith("vtoken raised ConfigError[bad_type]") and "planner_config" in d["reason"]


@pytest.mark.parametrize("r, failure", [
    (rec(message="assert 3 == 5"), "AssertionError"),
    (rec(message="AssertionError: Bug present"), "AssertionError"),
    (rec(message=CONFIG_ERROR), "ConfigError[bad_type]"),
    (rec(message="vtoken.vllm_adapter.assumptions.AdapterAssumptionError: assumption broken: a block the adapter "
                 "holds [kv_groups]: block 7"), "AdapterAssumptionError[kv_groups]"),
    (rec(message="vtoken.errors.OrderError: [not_set_up] x"), "OrderError[not_set_up]"),
    (rec(message="pydantic_core._pydantic_core.ValidationError: 1 validation error for SchedulerConfig"),
     "ValidationError"),
    (rec(message='failed on teardown with "RuntimeError: x"'), "RuntimeError"),
    (rec(message="KeyError: '[x] y'"), "KeyError"),  # a code only on vtoken's errors
    (rec(message="", text="x = 1\nE   ZeroDivisionError: boom\nE   RuntimeError: during handling"),
     "RuntimeError"),  # the last exception of the traceback
    (rec(message="whatever"), "unknown"),
])
def test_failure_of_reads_the_exception_a_test_raised(r, failure):
    assert vot.failure_of(r) == failure


def test_the_vtoken_error_names_are_vtokens():
    from vtoken import errors
    from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

    ours = {c.__name__ for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.VTokenError)}
    assert set(vot.VTOKEN_ERRORS) == ours | {AdapterAssumptionError.__name__}


def test_an_unknown_divergence_is_an_unclassified_bug():
    d = vot.classify_divergence("t.py::test_x", rec(message="boom", text="x = 1\nE   ZeroDivisionError: boom\n"))
    assert d["kind"] == "bug" and d["cause"] == "unclassified"
    assert d["reason"] == "unclassified: ZeroDivisionError: boom"


def test_rules_are_data_and_a_test_pattern_must_match_too():
    rules = [{"cause": "c1", "kind": "inherent", "reason": "r1", "test": r"::test_only_me$", "error": r"boom"},
             {"cause": "c2", "kind": "bug", "reason": "r2", "error": r"boom"}]
    assert vot.classify_divergence("a.py::test_only_me", rec(message="boom"), rules)["cause"] == "c1"
    assert vot.classify_divergence("a.py::test_other", rec(message="boom"), rules)["cause"] == "c2"
    for r in vot.DIVERGENCE_RULES + vot.NOT_APPLICABLE_RULES:
        assert set(r) <= {"cause", "kind", "reason", "test", "error", "props", "failure"}
        assert "error" in r or "props" in r or "failure" in r
        assert r.get("kind", "bug") in ("bug", "inherent")
    for r in vot.DIVERGENCE_RULES:  # a test's name narrows a rule, never decides it: what failed does
        assert "failure" in r, r["cause"]
        assert "test" not in r or "error" in r or "props" in r, r["cause"]


def test_compare_finds_divergences_and_groups_them():
    shipped = {"a": rec("passed"), "b": rec("passed"), "c": rec("failed", "E   AssertionError: free count 9 != 10"), "d": rec("passed"),
               "e": rec("failed", "Invalid repository ID or local directory specified: 'x/y'"), "f": rec("passed")}
    vt = {"a": rec("passed"), "b": rec("failed", "E   assert scheduler.has_requests()"),
          "c": rec("passed"), "d": rec("failed", "whatever"), "e": rec("passed")}  # f is missing
    r = vot.compare(shipped, vt)
    assert [d["test"] for d in r["divergences"]] == ["b", "d", "f"]
    assert r["causes"]["backpressure_hides_requests"]["tests"] == ["b"]
    assert r["causes"]["unclassified"]["tests"] == ["d", "f"]
    assert r["vtoken_only_passes"] == ["c"]  # e was not applicable as shipped: not counted


# ---------------------------------------------------------------------------- the tree
def _tarball(tmp_path: Path) -> Path:
    files = {
        "tests/__init__.py": "",
        "tests/conftest.py": "import transformers  # vLLM's heavy root conftest\n",
        "tests/utils.py": "import openai\n",
        "tests/v1/__init__.py": "",
        "tests/v1/core/__init__.py": "",
        "tests/v1/core/utils.py": "from tests.v1.helpers.kv import MockKVConfig\n",
        "tests/v1/core/test_a.py": "from .utils import x\nfrom tests.v1.core.utils import create_scheduler\n",
        "tests/v1/core/sub/test_b.py": "import tests.utils\n",
        "tests/v1/helpers/__init__.py": "",
        "tests/v1/helpers/conftest.py": "",
        "tests/v1/helpers/kv.py": "from tests.v1.helpers import other\n",
        "tests/v1/helpers/other.py": "",
        "tests/v1/helpers/unused.py": "",
        "tests/v1/engine/test_engine.py": "",
        "vllm/__init__.py": "",
    }
    path = tmp_path / "vllm-9.9.9.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo("vllm-9.9.9/" + name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_extract_takes_tests_v1_core_and_what_it_imports_only(tmp_path):
    tree = tmp_path / "tree"
    got = vot.extract_tests(_tarball(tmp_path), tree)
    assert got == ["tests/__init__.py", "tests/utils.py", "tests/v1/__init__.py", "tests/v1/core/__init__.py",
                   "tests/v1/core/sub/test_b.py", "tests/v1/core/test_a.py", "tests/v1/core/utils.py",
                   "tests/v1/helpers/__init__.py", "tests/v1/helpers/kv.py", "tests/v1/helpers/other.py"]
    assert (tree / "tests" / "conftest.py").read_text() == vot.CONFTEST  # ours, not vLLM's
    assert (tree / "pytest.ini").exists() and not (tree / "tests/v1/helpers/conftest.py").exists()


def test_stand_in_configs_make_an_offline_hf_cache(tmp_path):
    import json

    models = vot.write_stand_ins(tmp_path, {"org/m": {"model_type": "opt"}})
    snap = tmp_path / "hub" / "models--org--m" / "snapshots" / ("0" * 40) / "config.json"
    assert models == ["org/m"] and json.loads(snap.read_text()) == {"model_type": "opt"}
    assert (tmp_path / "hub" / "models--org--m" / "refs" / "main").read_text() == "0" * 40


def test_shards_deal_files_by_size(tmp_path):
    d = tmp_path / "tests" / "v1" / "core"
    d.mkdir(parents=True)
    for name, size in [("test_big.py", 900), ("test_mid.py", 500), ("test_s1.py", 300), ("test_s2.py", 200)]:
        (d / name).write_text("#" * size)
    shards = vot._shards(tmp_path, ["tests/v1/core"], 2)
    assert sorted(map(sorted, shards)) == [["tests/v1/core/test_big.py"],
                                           ["tests/v1/core/test_mid.py", "tests/v1/core/test_s1.py",
                                            "tests/v1/core/test_s2.py"]]
    assert vot._shards(tmp_path, ["tests/v1/core/test_s1.py::test_x"], 4) == [["tests/v1/core/test_s1.py::test_x"]]


# ---------------------------------------------------------------------------- the plugin
def test_the_plugin_attaches_once_when_the_outermost_init_returns(monkeypatch):
    seen = []
    monkeypatch.setattr(plugin, "attach", lambda s: seen.append((type(s).__name__, dict(vars(s)))))

    class Base:
        def __init__(self, n):
            self.n = n

    class Async(Base):
        def __init__(self, n):
            super().__init__(n)
            self.extra = True  # set after the base's __init__: attach must see it

    class Plain(Async):  # no __init__ of its own
        pass

    for c in (Base, Async):
        plugin._wrap(c)
    plugin._wrap(Base)  # idempotent
    Base(1)
    Async(2)
    Plain(3)
    assert seen == [("Base", {"n": 1}), ("Async", {"n": 2, "extra": True}), ("Plain", {"n": 3, "extra": True})]


def test_the_system_does_not_import_the_plugin_or_the_runner():
    root = Path(__file__).resolve().parent.parent
    for p in (root / "vtoken").rglob("*.py"):
        text = p.read_text()
        assert "vllm_tests_plugin" not in text and "vllm_own_tests" not in text, p


# ---------------------------------------------------------------------------- the real thing
@pytest.mark.slow
def test_real_run_on_two_vllm_test_files(tmp_path):
    """vLLM's own tests of two files, as shipped and with vtoken in place (downloads vLLM's
    sdist on first use; about a minute on two cores)."""
    from vtoken.vllm_adapter import harness

    if harness.vllm_version() is None:
        pytest.fail("vLLM not installed: run scripts/install_vllm.sh", pytrace=False)
    files = ["tests/v1/core/test_priority_preemption_bug.py", "tests/v1/core/test_kv_sharing.py"]
    r = vot.run(harness.vllm_version().split("+")[0], out_dir=tmp_path, targets=files, log=lambda s: None)
    for k in ("shipped", "with_vtoken"):
        s = r[k]
        assert s["passed"] + s["failed"] + s["not_applicable"] >= 2, s
    assert r["shipped"]["failed"] == 0, r["shipped"]["failed_tests"]
    assert r["with_vtoken"]["adapters_attached"] >= 1  # vtoken was in place
    assert (tmp_path / "vllm_own_tests.json").exists() and (tmp_path / "shipped.xml").exists()
    for d in r["divergences"]:  # each one classified, with a reason
        assert d["kind"] in ("bug", "inherent") and d["reason"]


def test_a_relative_out_dir_is_made_absolute(tmp_path, monkeypatch):
    """The audit passes a relative reports/<ts>/vllm-own-tests; pytest runs in the extracted
    tree, so the junit path must be absolute (it was not: 'no junit results')."""
    import inspect

    from vtoken.reports import vllm_own_tests

    src = inspect.getsource(vllm_own_tests.run)
    assert ".resolve()" in src.split("out_dir.mkdir")[0]
