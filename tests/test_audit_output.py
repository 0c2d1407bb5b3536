"""What ``vtoken audit`` prints and where the rest goes: one terminal line per check, every
other line a check makes (vLLM's warnings through logging, C-level writes to descriptors 1
and 2, a subprocess's output, prints, a crash's traceback) in ``logs/<check>.log`` of the
report folder and summarised in the report; every timing and figure labelled with the vLLM
it measured; the adapter timing in its quick mode."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys

import pytest

import vtoken.reports.audit as audit
from vtoken.cli.main import main
from vtoken.reports.audit_console import Console, captured, log_summary

WARNING = "Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'."


def check_noisy(ctx):
    for name in ("vtoken-test.configured", "vtoken-test.bare"):  # (see the loggers fixture)
        for _ in range(20):
            logging.getLogger(name).warning(WARNING)
    print("a print of the check's own")
    os.write(1, b"CPU backend prefers block_size is multiples of 32 (fd 1)\n")
    os.write(2, b"C code on fd 2\n")
    subprocess.run([sys.executable, "-c", "print('a child process speaks')"], check=True)
    ctx["note"]("progress: half way")
    return audit.CheckResult("noisy", True, "fine " + "and long " * 40,
                             figures=[("retained blocks", b"\x89PNG-not-really")])


def check_crashing(ctx):
    print("about to crash")
    raise RuntimeError("boom")


def check_timing(ctx):
    return audit.CheckResult("timing", None, "x1.05", measurement=True, measured_on="no vLLM: the table alone",
                             figures=[("step cost", b"\x89PNG")])


@pytest.fixture
def loggers():
    """vLLM's two ways of logging: a handler made at import on the process's stdout (vLLM's
    own configuration), and none at all (``VLLM_CONFIGURE_LOGGING=0``: logging's last resort,
    which writes to whatever ``sys.stderr`` is when it speaks; pytest's log capture stands in
    for the last resort, so a handler of the same behaviour does). Both apart from pytest's."""

    class LastResort(logging.StreamHandler):
        stream = property(lambda self: sys.stderr, lambda self, value: None)

    configured, bare = logging.getLogger("vtoken-test.configured"), logging.getLogger("vtoken-test.bare")
    handlers = {configured: logging.StreamHandler(open(1, "w", closefd=False, buffering=1)), bare: LastResort()}
    for lg, h in handlers.items():
        lg.addHandler(h)
        lg.propagate = False
    yield
    for lg, h in handlers.items():
        lg.removeHandler(h)


@pytest.fixture
def fake_audit(monkeypatch, loggers):
    monkeypatch.setattr(audit, "CHECKS", [check_noisy, check_crashing, check_timing])
    monkeypatch.setattr(audit, "vllm_version", lambda: "0.32.0")
    monkeypatch.setattr(audit, "vllm_installed", lambda: "0.32.0")


def test_one_terminal_line_per_check_and_everything_else_in_the_logs(fake_audit, tmp_path, capfd):
    rc = main(["audit", "--out", str(tmp_path)])
    std = capfd.readouterr()
    lines = std.out.splitlines()
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert rc == 1 and std.err == ""
    assert lines[0] == f"vtoken audit of vLLM 0.32.0: 3 check(s); report and logs: {folder}"
    assert lines[1].startswith("[1/3] noisy") and " PASS " in lines[1] and len(lines[1]) < 170
    assert lines[2].startswith("[2/3] crashing") and " FAIL " in lines[2] and "RuntimeError: boom" in lines[2]
    assert lines[3].startswith("[3/3] timing") and " MEASURED " in lines[3]
    assert lines[4].startswith("audit FAILED in ") and f"{folder}/logs/" in lines[4]
    assert lines[5].startswith("vLLM 0.32.0: safe to run vtoken on it: no") and len(lines) == 6
    noisy = (folder / "logs" / "noisy.log").read_text()
    for said in (WARNING, "a print of the check's own", "(fd 1)", "C code on fd 2", "a child process speaks",
                 "progress: half way"):
        assert said in noisy and said not in std.out + std.err
    assert noisy.count(WARNING) == 40
    crash = (folder / "logs" / "crashing.log").read_text()
    assert "about to crash" in crash and "Traceback" in crash and "RuntimeError: boom" in crash
    checks = {c["name"]: c for c in json.loads((folder / "audit.json").read_text())["checks"]}
    assert checks["noisy"]["log"]["path"] == "logs/noisy.log" and checks["noisy"]["log"]["repeated"][0] == [WARNING, 40]
    assert "logs/noisy.log" in (folder / "audit.md").read_text() and "logs/noisy.log" in (folder / "audit.html").read_text()


def test_every_figure_and_check_names_what_it_measured(fake_audit, tmp_path, capfd):
    """Unlabelled, a check ran against the audited vLLM; a check that says otherwise keeps its label."""
    report, folder = audit.run_audit(tmp_path, quick=True, seed=0, fuzz_examples=5, compare_to=None)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["noisy"]["measured_on"] == "vLLM 0.32.0"
    assert checks["noisy"]["figures"] == ["retained blocks (vLLM 0.32.0)"]
    assert checks["timing"]["figures"] == ["step cost (no vLLM: the table alone)"]
    md = (folder / "audit.md").read_text()
    assert "| timing | MEASURED | " in md and "| no vLLM: the table alone |" in md


def _fake_bench(calls):
    def bench_adapter(seed=0, quick=False, Rs=(64, 256), steps=50, profile_evict=False, repeats=1):
        calls.append(dict(quick=quick, Rs=tuple(Rs), steps=steps, repeats=repeats))
        rs = (8,) if quick else Rs
        ratio = {str(R): {"off": 1.05, "defaults": 1.1} for R in rs}
        return {"ratio": ratio, "ratio_mean": ratio, "R": list(rs), "steps": 10 if quick else steps,
                "repeats": repeats}
    return bench_adapter


@pytest.mark.parametrize("quick", [False, True])
def test_the_adapter_timing_is_quick_and_names_the_vllm_it_measured(monkeypatch, quick):
    """``make audit VLLM=0.32.0`` times against plain vLLM 0.32.0 and says so; the audit runs
    the quick timing (one repeat at R = 64), the full benchmark stays in ``vtoken bench adapter``."""
    import vtoken.reports.bench_adapter as bench_adapter

    calls = []
    monkeypatch.setattr(audit, "vllm_version", lambda: "0.32.0")
    monkeypatch.setattr(bench_adapter, "bench_adapter", _fake_bench(calls))
    res = audit.check_adapter_bench({"quick": quick, "seed": 0})
    assert "x plain vLLM 0.32.0" in res.detail and "0.33.0" not in res.detail
    assert res.metrics["vllm_version"] == "0.32.0" and res.measurement
    expect = dict(quick=True, Rs=(64, 256), steps=50, repeats=1) if quick else \
        dict(quick=False, Rs=(64,), steps=audit.ADAPTER_TIMING["steps"], repeats=1)
    assert calls == [expect]
    assert "vtoken bench adapter --repeats 3" in res.detail


def test_the_console_rewrites_its_line_in_place_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    c = Console(out)
    c.begin(2, 12, "fuzz-campaign")
    with captured_nothing():
        c.note("3 of 5 machines")
    c.end("PASS", 12.3, "fine")
    text = out.getvalue()
    assert text.count("\n") == 1 and "\r\x1b[K[ 2/12] fuzz-campaign" in text and "3 of 5 machines" in text
    assert text.rstrip("\n").rsplit("\r\x1b[K", 1)[-1].startswith("[ 2/12] fuzz-campaign") and "PASS" in text

    pipe = io.StringIO()  # off a terminal: the line's start, then its end; no notes, no escapes
    c = Console(pipe)
    c.begin(2, 12, "fuzz-campaign")
    with captured_nothing():
        c.note("3 of 5 machines")
    c.end("PASS", 12.3, "fine")
    assert pipe.getvalue() == "[ 2/12] fuzz-campaign          PASS       12.3 s  fine\n"


class captured_nothing:
    """``note`` prints into the check's log: here, into nothing."""

    def __enter__(self):
        self.old, sys.stdout = sys.stdout, io.StringIO()

    def __exit__(self, *a):
        sys.stdout = self.old


def test_captured_restores_the_descriptors_on_ctrl_c(tmp_path, capfd):
    log = tmp_path / "x.log"
    with pytest.raises(KeyboardInterrupt):
        with captured(log):
            os.write(1, b"inside\n")
            raise KeyboardInterrupt
    os.write(1, b"outside\n")
    print("printed outside")
    out = capfd.readouterr().out
    assert "inside" in log.read_text() and "inside" not in out and "outside" in out and "printed outside" in out


def test_log_summary_counts_a_warning_once_whatever_its_prefix(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("".join(f"WARNING 12-05 06:33:{i:02d} [cpu.py:314] {WARNING}\n" for i in range(30))
                   + f"(EngineCore pid=7) {WARNING}\nother\nother\nonce\n")
    s = log_summary(log)
    assert s["lines"] == 34 and s["repeated"] == [[WARNING, 31], ["other", 2]]


# ---------------------------------------------------------------------------- checks run beside the others
def test_a_started_pytest_run_is_collected_with_its_counts_and_progress(tmp_path):
    """What the invariants suite's background run does, on a tiny suite: started with its
    output in a log, collected later with junit counts and progress notes."""
    t = tmp_path / "test_tiny.py"
    t.write_text("def test_ok():\n    pass\n\ndef test_bad():\n    assert 0\n")
    junit, log = tmp_path / "j.xml", tmp_path / "logs" / "tiny.log"
    run = audit._pytest_start([str(t)], junit, log)
    notes = []
    rc, counts, tail = audit._pytest_collect(run, junit, timeout=300, note=notes.append)
    # the junit class name carries the file's path from pytest's rootdir (which depends on where the checkout is)
    assert rc == 1 and counts["tests"] == 2 and counts["failures"] == 1 and len(counts["failed"]) == 1
    assert counts["failed"][0].split(".")[-1] == "test_tiny::test_bad", counts["failed"]
    assert notes and notes[-1].startswith(f"pytest {t}: 100% after ") and "1 failed, 1 passed" in tail
    assert "test_bad" in log.read_text()


def test_a_started_run_past_its_timeout_is_killed(tmp_path):
    t = tmp_path / "test_slow.py"
    t.write_text("import time\n\ndef test_slow():\n    time.sleep(600)\n")
    run = audit._pytest_start([str(t)], tmp_path / "j.xml", tmp_path / "slow.log")
    with pytest.raises(subprocess.TimeoutExpired):
        audit._pytest_collect(run, tmp_path / "j.xml", timeout=3)
    assert run["proc"].poll() is not None


def test_runs_started_with_the_audit_run_beside_its_checks_and_none_outlives_ctrl_c(tmp_path, monkeypatch, capfd):
    """A check's ``start`` is called before the first check runs; Ctrl-C in an earlier check
    leaves no started process behind."""
    started = []

    def check_first(ctx):
        assert started and started[0]["proc"].poll() is None  # already running beside this check
        raise KeyboardInterrupt

    def check_beside(ctx):
        raise AssertionError("not reached")

    def start(ctx):
        started.append({"proc": subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])})
        return started[-1]

    check_beside.start = start
    monkeypatch.setattr(audit, "CHECKS", [check_first, check_beside])
    monkeypatch.setattr(audit, "vllm_version", lambda: None)
    monkeypatch.setattr(audit, "vllm_installed", lambda: None)
    report, _ = audit.run_audit(tmp_path, quick=True, seed=0, fuzz_examples=5, compare_to=None)
    assert report["interrupted"]["in"] == "first" and started[0]["proc"].poll() is not None
    assert "INTERRUPTED" in capfd.readouterr().out.splitlines()[1]
