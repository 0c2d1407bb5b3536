"""The audit's verdict, the contract matrix, ``--vllm`` / ``--matrix`` and the side
environments they build: rendering and command construction on synthetic audit.json data
(fast, nothing is built), plus one ``slow`` test that builds a real environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import vtoken.reports.audit as audit
import vtoken.reports.audit_matrix as audit_matrix
import vtoken.reports.vllm_envs as envs
from vtoken.cli.main import main
from vtoken.reports.verdict import CONTRACT_IMPACT, matrix, render_matrix_html, render_matrix_md, verdict

REPO = Path(__file__).resolve().parent.parent
NAMES = ["vllm_version", "null_block", "fence_step_seq", "reservation"]


def _report(version="0.33.0", broken=(), pin_ok=True, failed_checks=(), not_run=(), own=None, **extra):
    rows = []
    for n in NAMES:
        ok = (pin_ok if n == "vllm_version" else n not in broken)
        rows.append({"name": n, "passed": ok, "assumption": f"assumption of {n}",
                     "detail": "ok" if ok else f"assumption broken: {n} -- measured otherwise"})
    contracts_ok = all(r["passed"] for r in rows)
    checks = [{"name": "vllm-contracts", "passed": contracts_ok, "detail": "contracts", "metrics": {"contracts": rows}},
              {"name": "invariants-suite", "passed": True, "detail": "fine", "metrics": {}},
              {"name": "fuzz-campaign", "passed": "fuzz-campaign" not in failed_checks, "detail": "campaign",
               "metrics": {"machines": ["table", "adapter"], "ops_by_machine": {"table": 10, "adapter": 5},
                           "failure_reports": ([{"machine": "adapter"}] if "fuzz-campaign" in failed_checks else []),
                           "machines_unavailable": {}}},
              {"name": "vllm-decode", "passed": "vllm-decode" not in failed_checks, "detail": "decode", "metrics": {}},
              {"name": "vllm-own-tests", "passed": None if "vllm-own-tests" in not_run else True,
               "detail": "own tests", "metrics": own or {"shipped": {"passed": 3, "failed": 0, "not_applicable": 1},
                                                          "with_vtoken": {"passed": 3, "failed": 0,
                                                                          "not_applicable": 1},
                                                          "divergences": [],
                                                          "groups": {"test_prefix_caching.py": {"passed": 3}}}},
              {"name": "table-step-cost", "passed": None, "detail": "x1.1", "measurement": True, "metrics": {}}]
    r = {"passed": all(c["passed"] for c in checks if not c.get("measurement")), "vllm_version": version,
         "checks": checks, "invocation": {"python": "/envs/vllm-x/bin/python", "repo": "/work/main", "quick": False,
                                          "seed": 0, "fuzz_examples": 100}}
    r.update(extra)
    return r


# ---------------------------------------------------------------------------- verdict
def test_all_pass_is_safe():
    v = verdict(_report())
    assert v["safe"] is True and v["why"] == [] and v["broken_contracts"] == [] and v["failed_checks"] == []


def test_the_version_pin_alone_is_a_note_not_a_no():
    v = verdict(_report("0.32.0", pin_ok=False))
    assert v["safe"] is True
    assert v["pin"] and "0.33.0" in v["pin"]


def test_a_broken_contract_is_a_no_with_its_user_impact_and_a_command():
    r = _report("0.31.0", broken=("fence_step_seq",), pin_ok=False)
    v = verdict(r)
    assert v["safe"] is False
    assert [b["name"] for b in v["broken_contracts"]] == ["fence_step_seq"]
    assert v["broken_contracts"][0]["impact"] == CONTRACT_IMPACT["fence_step_seq"]
    (f,) = v["failed_checks"]
    assert f["name"] == "vllm-contracts"
    # the exact command: the audited environment's python, the contract by name; never the pin
    assert any("/envs/vllm-x/bin/python" in c and 'run_contract("fence_step_seq")' in c for c in f["repro"])
    assert not any("vllm_version" in c for c in f["repro"])
    assert f["repro"][-1].endswith("-m vtoken audit --only vllm-contracts")


def test_failed_checks_each_carry_a_reproducing_command():
    r = _report(failed_checks=("vllm-decode", "fuzz-campaign"))
    r["invocation"].update(quick=True, seed=3, fuzz_examples=20)
    v = verdict(r)
    assert v["safe"] is False
    by = {f["name"]: f for f in v["failed_checks"]}
    assert set(by) == {"vllm-decode", "fuzz-campaign"}
    cmd = by["vllm-decode"]["repro"][-1]
    assert cmd == ("cd /work/main && PYTHONHASHSEED=0 /envs/vllm-x/bin/python -m vtoken audit --only vllm-decode "
                   "--quick --seed 3 --fuzz-examples 20")


def test_repro_commands_on_an_unpinned_version_let_the_adapter_start():
    """The adapter refuses a version it is not pinned to unless VTOKEN_ALLOW_UNSUPPORTED_VLLM
    names it (the audit of a candidate sets it): a reproducing command must set it too."""
    r = _report("0.31.0", pin_ok=False, failed_checks=("vllm-decode",))
    r["checks"][0]["metrics"]["pinned"] = "0.33.0"
    (f,) = verdict(r)["failed_checks"]
    assert f["repro"][-1].startswith("cd /work/main && PYTHONHASHSEED=0 VTOKEN_ALLOW_UNSUPPORTED_VLLM=0.31.0 "
                                      "/envs/vllm-x/bin/python -m vtoken audit --only vllm-decode")
    ok = verdict(_report("0.33.0", failed_checks=("vllm-decode",)))["failed_checks"][0]["repro"][-1]
    assert "VTOKEN_ALLOW_UNSUPPORTED_VLLM" not in ok


def test_a_fuzz_failure_is_reproduced_by_its_replay_test():
    r = _report(failed_checks=("fuzz-campaign",))
    r["invocation"]["cwd"] = "/home/u"
    r["checks"][2]["metrics"]["failure_reports"] = [{"machine": "adapter", "files": "reports/a/fuzz/failures/adapter-w0-1"}]
    (f,) = verdict(r)["failed_checks"]
    assert f["repro"][0] == ("cd /home/u && PYTHONHASHSEED=0 /envs/vllm-x/bin/python -m pytest -p no:cacheprovider "
                             "reports/a/fuzz/failures/test_replay_adapter_w0_1.py")


def test_a_check_that_did_not_run_is_never_a_silent_yes():
    v = verdict(_report(not_run=("vllm-own-tests",)))
    assert v["safe"] is False
    assert any("not checked: vllm-own-tests" in w for w in v["why"])
    assert verdict(_report(version=None))["safe"] is False
    assert verdict(_report(interrupted={"in": "fuzz", "not_run": ["fuzz"]}))["safe"] is False
    assert verdict({"vllm_version": "0.33.0", "checks": []})["safe"] is False


def test_a_partial_audit_is_never_a_yes():
    r = _report()
    r["invocation"]["only"] = ["vllm-contracts"]
    v = verdict(r)
    assert v["safe"] is False and any("partial audit (--only vllm-contracts)" in w for w in v["why"])


def test_measurements_never_decide():
    r = _report()
    r["checks"][-1]["passed"] = False  # a timing, even a bad one
    assert verdict(r)["safe"] is True


# ---------------------------------------------------------------------------- the report files
def _fake_checks(monkeypatch, results):
    fns = []
    for name, passed, metrics in results:
        def fn(ctx, name=name, passed=passed, metrics=metrics):
            return audit.CheckResult(name, passed, f"{name} detail", metrics=metrics)
        fn.__name__ = "check_" + name.replace("-", "_")
        fns.append(fn)
    monkeypatch.setattr(audit, "CHECKS", fns)
    monkeypatch.setattr(audit, "vllm_version", lambda: "0.32.0")
    monkeypatch.setattr(audit, "vllm_installed", lambda: "0.32.0")


def test_report_opens_with_the_verdict(tmp_path, monkeypatch):
    rows = [{"name": "vllm_version", "passed": False, "detail": "found vllm 0.32.0"},
            {"name": "null_block", "passed": False, "detail": "assumption broken: block 0 -- handed out"},
            {"name": "reservation", "passed": True, "detail": "ok"}]
    _fake_checks(monkeypatch, [("vllm-contracts", False, {"contracts": rows}),
                               ("vllm-own-tests", True, {"shipped": {"passed": 2, "failed": 0, "not_applicable": 0},
                                                         "with_vtoken": {"passed": 2, "failed": 0,
                                                                         "not_applicable": 0},
                                                         "divergences": []})])
    report, out = audit.run_audit(tmp_path, quick=True, seed=0, fuzz_examples=5, compare_to=None)
    md = (out / "audit.md").read_text().splitlines()
    assert md[0] == "# vtoken audit of vLLM 0.32.0: safe to run vtoken on it: no"
    assert md[2].startswith("**vLLM audited: 0.32.0. Safe to run vtoken on it: NO.**")
    text = "\n".join(md)
    assert f"`null_block`: {CONTRACT_IMPACT['null_block']}" in text
    assert 'run_contract("null_block")' in text
    assert text.index("Broken contracts") < text.index("## Checks")
    page = (out / "audit.html").read_text()
    assert page.index("class='verdict unsafe'") < page.index("<h2>Checks</h2>")
    js = json.loads((out / "audit.json").read_text())
    assert js["safe"] is False and js["passed"] is False and js["vllm_version"] == "0.32.0"
    own = next(c for c in js["checks"] if c["name"] == "vllm-own-tests")
    assert own["metrics"]["shipped"]["passed"] == 2 and own["metrics"]["divergences"] == []
    assert js["invocation"]["python"] == sys.executable and js["seconds"] >= 0


def test_compare_names_the_contracts_and_verdict_that_changed():
    old = _report("0.32.0", pin_ok=False)
    old["safe"] = True
    new = _report("0.33.0", broken=("reservation",))
    new["safe"] = False
    new["checks"][4]["metrics"] = {"shipped": {"passed": 3, "failed": 1}, "with_vtoken": {"passed": 3, "failed": 1},
                                   "divergences": [{"test": "t::x", "kind": "fails-with-vtoken", "reason": "r"}]}
    lines = audit.compare(old, new)
    assert "vLLM version: 0.32.0 -> 0.33.0" in lines
    assert "safe to run vtoken: yes -> no" in lines
    assert "contract vllm_version: broken -> holds" in lines
    assert any(x.startswith("contract reservation: holds -> BROKEN") for x in lines)
    assert any("new divergence t::x (fails-with-vtoken)" in x for x in lines)
    assert audit.compare(old, old) == ["nothing changed in the checks' outcomes"]


def test_invariants_suite_that_does_not_finish_is_not_checked_not_failed(tmp_path, monkeypatch):
    def slow(args, junit, timeout):
        raise subprocess.TimeoutExpired(["pytest"], timeout)

    monkeypatch.setattr(audit, "_pytest", slow)
    r = audit.check_invariants({"out": tmp_path})
    assert r.passed is None and "did not finish in 900 s (load average" in r.detail


# ---------------------------------------------------------------------------- vllm-own-tests
def test_own_tests_missing_module_is_a_clear_not_run(tmp_path, monkeypatch):
    real = audit.importlib.import_module

    def imp(name, *a):
        if name == audit.OWN_TESTS_MODULE:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *a)

    monkeypatch.setattr(audit.importlib, "import_module", imp)
    r = audit.check_vllm_own_tests({"out": tmp_path})
    assert r.name == "vllm-own-tests" and r.passed is None
    assert r.detail.startswith("not run: module missing")


BUG = {"test": "tests/v1/core/test_a.py::t1", "kind": "bug", "cause": "churn", "reason": "r"}
INHERENT = {"test": "tests/v1/core/test_a.py::t2", "kind": "inherent", "cause": "headroom", "reason": "r"}


@pytest.mark.parametrize("div,shipped_failed,ok", [
    ([], 0, True),
    ([INHERENT], 0, True),  # vtoken changes what the test asserts by design: reported, not decisive
    ([], 1, True),  # fails without vtoken too: not vtoken's
    ([BUG], 0, False),
    ([INHERENT, dict(BUG, kind="new-kind")], 0, False),  # an unknown kind counts as a bug
])
def test_own_tests_result_decides_the_check(tmp_path, monkeypatch, div, shipped_failed, ok):
    calls = []

    def run(version=None, python=sys.executable, out_dir=None, with_vtoken=True, jobs=1):
        calls.append((version, python, out_dir, with_vtoken))
        return {"shipped": {"passed": 5, "failed": shipped_failed, "not_applicable": 2},
                "with_vtoken": {"passed": 5 - len(div), "failed": len(div) + shipped_failed, "not_applicable": 2},
                "divergences": div}

    monkeypatch.setitem(sys.modules, audit.OWN_TESTS_MODULE, types.SimpleNamespace(run=run))
    monkeypatch.setattr(audit, "vllm_version", lambda: "0.31.0")
    r = audit.check_vllm_own_tests({"out": tmp_path})
    assert r.passed is ok, r.detail
    assert calls == [("0.31.0", sys.executable, tmp_path / "vllm-own-tests", True)]
    assert r.metrics["shipped"]["passed"] == 5 and r.metrics["divergences"] == div
    if not ok:
        assert BUG["test"] in r.metrics["command"] and "--version 0.31.0" in r.metrics["command"]


def test_own_tests_groups_per_file(tmp_path, monkeypatch):
    xml = tmp_path / "with_vtoken.xml"
    xml.write_text("x")
    recs = {"tests/v1/core/test_a.py::t1": {"outcome": "failed"}, "tests/v1/core/test_a.py::t2": {"outcome": "failed"},
            "tests/v1/core/test_a.py::t3": {"outcome": "passed"}, "tests/v1/core/test_b.py::t4": {"outcome": "skipped"}}
    mod = types.SimpleNamespace(parse_junit=lambda text: recs)
    res = {"with_vtoken": {"junit": [str(xml)]}, "shipped": {"not_applicable_tests": [], "failed_tests": []}}
    g = audit._own_test_groups(mod, res, [BUG, INHERENT])
    assert g["tests/v1/core/test_a.py"] == {"passed": 1, "failed": 1, "not_applicable": 0, "bug": 1, "inherent": 1,
                                            "failed_as_shipped": 0}
    assert g["tests/v1/core/test_b.py"]["not_applicable"] == 1
    mx = matrix({"0.33.0": {"report": _report(own={"groups": g})}})
    cells = {r["name"]: r["cells"]["0.33.0"]["state"] for r in mx["rows"] if r["section"] == "vLLM test group"}
    assert cells == {"tests/v1/core/test_a.py": "FAIL", "tests/v1/core/test_b.py": "n/a"}


# ---------------------------------------------------------------------------- matrix
def _audits():
    return {
        "0.31.0": {"report": _report("0.31.0", broken=("fence_step_seq",), pin_ok=False), "env_seconds": 180.0,
                   "env_reused": False, "audit_seconds": 400.0, "dir": "/r/a"},
        "0.32.0": {"report": _report("0.32.0", pin_ok=False), "env_seconds": 170.0, "env_reused": True,
                   "audit_seconds": 390.0, "dir": "/r/b"},
        "0.18.0": {"report": None, "error": "environment for vLLM 0.18.0 not built: step 'vllm 0.18.0'"},
    }


def test_matrix_lays_every_contract_check_and_machine_out_per_version():
    mx = matrix(_audits())
    assert mx["versions"] == ["0.31.0", "0.32.0", "0.18.0"]
    rows = {(r["section"], r["name"]): r["cells"] for r in mx["rows"]}
    assert rows[("contract", "fence_step_seq")]["0.31.0"]["state"] == "FAIL"
    assert rows[("contract", "fence_step_seq")]["0.32.0"]["state"] == "pass"
    assert rows[("contract", "fence_step_seq")]["0.18.0"]["state"] == "not run"
    assert "0.18.0 not built" in rows[("contract", "fence_step_seq")]["0.18.0"]["detail"]
    assert rows[("fuzz machine", "adapter")]["0.32.0"]["state"] == "pass"
    assert rows[("vLLM test group", "test_prefix_caching.py")]["0.31.0"]["state"] == "pass"
    assert rows[("check", "table-step-cost")]["0.31.0"]["state"] == "measured"
    assert rows[("check", "vllm-contracts")]["0.32.0"]["state"] == "pin only"  # only the version differs
    assert rows[("check", "vllm-contracts")]["0.31.0"]["state"] == "FAIL"
    assert mx["safe_versions"] == ["0.32.0"]
    assert mx["summary"]["0.31.0"]["broken_contracts"] == ["fence_step_seq"]
    assert mx["summary"]["0.18.0"]["safe"] is False
    json.dumps(mx)


def test_matrix_renders_to_md_and_html():
    mx = matrix(_audits())
    md = render_matrix_md(mx)
    assert "Safe to run vtoken on: 0.32.0." in md
    assert "| 0.31.0 | NO | fence_step_seq | vllm-contracts | 180 | 400 |" in md
    assert "| 0.32.0 | YES | - | - | 170 (reused) | 390 |" in md
    assert "| contract | fence_step_seq | **FAIL** | pass | not run |" in md
    assert "0.31.0 / contract fence_step_seq (FAIL)" in md
    assert "| check | vllm-contracts | **FAIL** | FAIL (pin only) | not run |" in md
    page = render_matrix_html(mx)
    assert "<th>0.31.0</th><th>0.32.0</th><th>0.18.0</th>" in page and "class='fail'" in page


# ---------------------------------------------------------------------------- environments
def test_env_plan_commands(tmp_path):
    env = tmp_path / "envs" / "vllm-0.32.0"
    steps = envs.plan("0.32.0", env, python="/usr/bin/python3.11", repo=REPO)
    by = {s.label: s for s in steps}
    assert [s.label for s in steps] == ["venv", "torch", "vllm 0.32.0", "vtoken (editable)", "freeze",
                                        "vtoken requirements"]
    py = str(env / "bin" / "python")
    assert by["venv"].argv == ["/usr/bin/python3.11", "-m", "venv", str(env)]  # a fresh venv, nothing inherited
    assert by["torch"].argv == [py, "-m", "pip", "install", "--quiet", "torch==2.13.0"]
    assert by["vllm 0.32.0"].argv == ["bash", str(REPO / "scripts" / "install_vllm.sh"), py, "0.32.0"]
    assert by["vllm 0.32.0"].env == {"VTOKEN_WHEEL_DIR": str(tmp_path / "wheels")}
    assert by["vtoken (editable)"].argv == [py, "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(REPO)]
    assert by["freeze"].stdout == env / "vtoken-constraints.txt"
    req = by["vtoken requirements"].argv
    assert req[:6] == [py, "-m", "pip", "install", "--quiet", "-c"] and req[6] == str(env / "vtoken-constraints.txt")
    assert not any(a.startswith("torch") for a in req[7:])
    assert any(a.startswith("hypothesis") for a in req) and any(a.startswith("pytest-timeout") for a in req)
    assert not any("--system-site-packages" in a for s in steps for a in s.argv)
    assert "VTOKEN_WHEEL_DIR=" in by["vllm 0.32.0"].shell()
    with pytest.raises(ValueError):
        envs.plan("latest", env)


def test_env_dir_follows_the_cache_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("VTOKEN_ENV_CACHE", str(tmp_path / "c"))
    assert envs.env_dir("0.30.0") == tmp_path / "c" / "vllm-0.30.0"
    assert envs.env_info("0.30.0")["why"] == "not built"
    monkeypatch.delenv("VTOKEN_ENV_CACHE")
    assert envs.env_dir("0.30.0") == Path.home() / ".cache" / "vtoken" / "envs" / "vllm-0.30.0"


def test_ensure_env_builds_once_then_reuses(tmp_path, monkeypatch):
    """The build machinery with trivial steps: progress per step, the marker written last,
    reuse on the second call, a failing step named with its log."""
    def fake_plan(version, env, **kw):
        return [envs.Step("venv", [sys.executable, "-c", f"import os; os.makedirs({str(env / 'bin')!r})"]),
                envs.Step("link", ["ln", "-s", sys.executable, str(env / "bin" / "python")]),
                envs.Step("freeze", [sys.executable, "-c", "print('x==1')"], stdout=env / "c.txt")]

    monkeypatch.setattr(envs, "plan", fake_plan)
    monkeypatch.setattr(envs, "_probe", lambda py: {"vllm": "0.30.0", "torch": "2.13.0",
                                                    "vtoken": str(REPO / "vtoken")})
    lines = []
    info = envs.ensure_env("0.30.0", root=tmp_path, progress=lines.append)
    assert info["ready"] and info["reused"] is False
    assert any("[1/3] venv" in x for x in lines) and any("built in" in x for x in lines)
    assert (tmp_path / "vllm-0.30.0" / "c.txt").read_text() == "x==1\n"
    meta = json.loads((tmp_path / "vllm-0.30.0" / envs.MARKER).read_text())
    assert [s["step"] for s in meta["steps"]] == ["venv", "link", "freeze"]
    lines.clear()
    again = envs.ensure_env("0.30.0", root=tmp_path, progress=lines.append)
    assert again["reused"] is True and any("reusing" in x for x in lines)

    monkeypatch.setattr(envs, "plan", lambda version, env, **kw: [envs.Step("boom", ["false"])])
    with pytest.raises(envs.EnvBuildError, match="failed at step 'boom'.*log:"):
        envs.ensure_env("0.31.0", root=tmp_path, progress=lines.append)


def test_child_command_reruns_the_audit_in_the_env(tmp_path):
    argv = audit_matrix.child_argv("/e/bin/python", "0.31.0", out=tmp_path, quick=True, seed=2, fuzz_examples=7,
                                   only=["vllm-decode"], compare=str(tmp_path / "old.json"))
    assert argv == ["/e/bin/python", "-m", "vtoken", "audit", "--vllm", "0.31.0", "--out", str(tmp_path.resolve()),
                    "--seed", "2", "--fuzz-examples", "7", "--quick", "--only", "vllm-decode",
                    "--compare", str((tmp_path / "old.json").resolve())]


def test_vllm_flag_delegates_to_the_side_env(tmp_path, monkeypatch):
    seen = {}

    def fake(version, **kw):
        seen.update(kw, version=version)
        return {"error": None, "rc": 0}

    monkeypatch.setattr(audit_matrix, "installed_here", lambda: "0.33.0")
    monkeypatch.setattr(audit_matrix, "audit_in_env", fake)
    monkeypatch.delenv(audit.SIDE_ENV_VAR, raising=False)
    assert main(["audit", "--vllm", "0.31.0", "--out", str(tmp_path), "--quick", "--only", "vllm-decode"]) == 0
    assert seen["version"] == "0.31.0" and seen["quick"] is True and seen["only"] == ["vllm-decode"]


def test_a_side_env_holding_the_wrong_vllm_refuses(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(audit_matrix, "installed_here", lambda: "0.33.0")
    monkeypatch.setenv(audit.SIDE_ENV_VAR, "0.31.0")
    assert main(["audit", "--vllm", "0.31.0", "--out", str(tmp_path)]) == 2
    assert "holds 0.33.0" in capsys.readouterr().err


def test_matrix_flag_writes_the_matrix(tmp_path, monkeypatch):
    def fake(version, *, out, **kw):
        a = dict(_audits().get(version) or {"report": _report(version)})
        a.setdefault("error", None)
        return a

    monkeypatch.setattr(audit_matrix, "audit_in_env", fake)
    assert main(["audit", "--matrix", "0.31.0,0.32.0", "--out", str(tmp_path)]) == 0
    (folder,) = tmp_path.glob("*-matrix")
    mx = json.loads((folder / "matrix.json").read_text())
    assert mx["versions"] == ["0.31.0", "0.32.0"] and mx["safe_versions"] == ["0.32.0"]
    assert (folder / "matrix.md").exists() and (folder / "matrix.html").exists()


@pytest.mark.parametrize("argv,needle", [
    (["--vllm", "0.33"], "--vllm"), (["--matrix", ","], "--matrix"), (["--matrix", "0.30.0,x"], "--matrix"),
    (["--vllm", "0.30.0", "--matrix", "0.31.0"], "give one"), (["--rebuild-env"], "--rebuild-env"),
])
def test_bad_version_arguments(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(["audit", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_only_accepts_report_names():
    picked = [c for c in audit.CHECKS if audit._selected(c, ["vllm-contracts"])]
    assert picked == [audit.check_vllm]
    assert len([c for c in audit.CHECKS if audit._selected(c, ["vllm"])]) > 1  # a part of the name: as before


# ---------------------------------------------------------------------------- slow: a real env
@pytest.mark.slow
def test_real_side_env_audits_its_contracts(tmp_path):
    """Builds (or reuses) the vLLM 0.32.0 environment and audits its contracts there."""
    version = os.environ.get("VTOKEN_TEST_VLLM", "0.32.0")
    info = envs.ensure_env(version)
    assert info["ready"]
    p = subprocess.run([sys.executable, "-m", "vtoken", "audit", "--vllm", version, "--only", "vllm-contracts",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=1800)
    (folder,) = tmp_path.glob(f"*-vllm-{version}")
    js = json.loads((folder / "audit.json").read_text())
    assert js["vllm_version"] == version and js["environment"]["python"] == info["python"], p.stdout[-2000:]
    assert js["invocation"]["python"] == info["python"]


def test_the_report_names_the_code_it_audited(tmp_path, monkeypatch):
    """A verdict is a function of the code: the report carries the commit and whether the
    checkout differed from it; outside a git checkout it says so (commit null)."""
    got = audit.code_identity()
    head = subprocess.run(["git", "-C", str(audit.REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert got["commit"] == head.stdout.strip() and isinstance(got["dirty"], bool)
    monkeypatch.setattr(audit, "REPO", tmp_path)  # not a checkout
    assert audit.code_identity() == {"commit": None}


def test_the_adapter_bench_is_a_measurement_in_the_audit():
    """``adapter-step-cost`` is reported, never a verdict (timings must not flip an audit)."""
    assert audit.CHECK_NAMES[audit.check_adapter_bench] == "adapter-step-cost"
    assert audit.check_adapter_bench in audit.CHECKS
