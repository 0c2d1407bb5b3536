"""scripts/gpu_check.py on the CPU: the section runner and its JSON file (pass, fail, error,
time-out, out of budget, written after every section), and the dry run (every import the
GPU sections need, the gpu tests' collection, the wheels folder), so that a typo does not
waste a GPU session. The sections themselves run on a GPU (``bash scripts/gpu_check.sh``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_runner_records_every_outcome_and_keeps_the_file_current(gc, tmp_path):
    out = tmp_path / "r.json"
    r = gc.Runner(out, budget_s=30)
    seen = []

    def ok():
        return {"ok": True, "figure": 1.5}

    def failing():
        seen.append(json.loads(out.read_text())["order"])  # the file already holds the first section
        return {"ok": False, "why": "a figure out of bounds"}

    def raising():
        raise ValueError("boom")

    def slow():
        time.sleep(5)
        return {"ok": True}

    r.run("a", ok, 10)
    r.run("b", failing, 10)
    r.run("c", raising, 10)
    r.run("d", slow, 1)
    r.budget_s = 0  # nothing left
    r.run("e", ok, 10)
    rep = r.finish()
    d = json.loads(out.read_text())
    assert d == json.loads(json.dumps(rep, default=str))
    assert seen == [["a"]]
    assert d["schema"] == gc.SCHEMA and d["order"] == ["a", "b", "c", "d", "e"]
    s = d["sections"]
    assert s["a"]["status"] == "pass" and s["a"]["figures"] == {"figure": 1.5}
    assert s["b"]["status"] == "fail" and s["b"]["figures"]["why"]
    assert s["c"]["status"] == "error" and s["c"]["error"] == "ValueError: boom" and "raising" in s["c"]["traceback"]
    assert s["d"]["status"] == "error" and "timed out" in s["d"]["error"] and s["d"]["wall_s"] < 4
    assert s["e"]["status"] == "skipped" and "out of time" in s["e"]["reason"]
    assert d["ok"] is False
    assert all(x["status"] in gc.STATUSES for x in s.values())


def test_ok_only_when_every_section_that_ran_passed(gc, tmp_path):
    r = gc.Runner(tmp_path / "r.json", budget_s=30)
    r.run("a", lambda: {"x": 1}, 5)  # no "ok": a figure-only section passes
    r.record("b", "skipped", reason="needs a CUDA device")
    assert r.finish()["ok"] is True
    r.run("c", lambda: {"ok": False}, 5)
    assert r.finish()["ok"] is False


def test_every_section_is_planned_with_its_needs(gc):
    assert set(gc.ORDER) == set(gc.SECTIONS)
    assert sum(v[1] for k, v in gc.SECTIONS.items() if k.startswith("fuzz_")) >= 2 * 60 * gc.FUZZ_MINUTES
    for name, (fn, limit, cuda_only, smoke, needs) in gc.SECTIONS.items():
        assert callable(fn) and limit > 0 and needs, name
    assert gc.BUDGET_S <= 470 <= 8 * 60  # gpu_check.sh's timeout, within 8 minutes


def test_dry_run_checks_imports_collects_the_gpu_tests_and_writes_the_json(tmp_path):
    """The shell entry point in dry-run mode (sections whose CPU smokes are quick); the full
    dry run (every CPU smoke) is what the report quotes."""
    out = tmp_path / "dry.json"
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--only", "env,gpu_tests,i3,sync_debug,bandwidth",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    d = json.loads(out.read_text())
    assert json.loads(p.stdout.strip().splitlines()[-1]) == d
    s = d["sections"]
    assert d["dry_run"] is True
    assert s["dry_run_imports"]["status"] == "pass", s["dry_run_imports"]
    assert s["dry_run_collect_gpu_tests"]["status"] == "pass"
    assert s["dry_run_collect_gpu_tests"]["figures"]["collected"] >= 20
    assert s["env (cpu smoke)"]["figures"]["vtoken_from"] == str(ROOT / "vtoken")  # this checkout, not an install
    for name in ("env", "gpu_tests", "i3", "sync_debug", "bandwidth"):
        assert s[name]["status"] == "planned"
    wheels = s["dry_run_wheels"]
    assert (wheels["status"] == "pass") == bool(wheels["figures"]["wheels"])
    assert p.returncode == (0 if d["ok"] else 1)


def test_dry_run_names_a_missing_import(gc, monkeypatch):
    """What the dry run is for: a section that needs something absent is reported by name."""
    assert gc._check_need("vtoken.decode:NoSuchThing") == "vtoken.decode has no NoSuchThing"
    assert "ModuleNotFoundError" in gc._check_need("no_such_module_here")
    assert gc._check_need("tests/test_gpu.py") is None and gc._check_need("tests/nope.py")


def test_unknown_section_is_refused():
    p = subprocess.run([sys.executable, "scripts/gpu_check.py", "--only", "nope"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "unknown sections" in p.stderr


def test_i3_probe_takes_a_faulty_engine_with_its_name():
    """The probe never builds a faulty engine itself (invariants/ does not import fuzz/): a
    fault name without its engine, or an engine without its name, is refused before anything runs."""
    from vtoken.copy_engine import KVCopyEngine
    from vtoken.invariants.i3_probe import i3_probe
    from vtoken.kvcache import KVCache

    kv = KVCache(2, 8, 4, 1, 8)
    with pytest.raises(ValueError, match="engine_cls"):
        i3_probe(kv, fault="cuda_wait_dropped")
    with pytest.raises(ValueError, match="engine_cls"):
        i3_probe(kv, engine_cls=KVCopyEngine)
    with pytest.raises(ValueError, match="CUDA"):  # well-formed: refused only for the CPU cache
        i3_probe(kv)


def test_graph_i3_probe_refuses_a_cpu_cache():
    from vtoken.invariants.i3_probe import graph_i3_probe
    from vtoken.kvcache import KVCache

    with pytest.raises(ValueError, match="graph_i3_probe needs a CUDA cache"):
        graph_i3_probe(KVCache(2, 8, 4, 1, 8))
