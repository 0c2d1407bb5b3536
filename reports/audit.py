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
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

# The checkout the invariants suite runs from (its tests/ folder); reports go elsewhere.
REPO = Path(__file__).resolve().parent.parent


@dataclass
class CheckResult:
    name: str
    passed: bool | None  # None: could not run (the detail says why)
    detail: str
    seconds: float = 0.0
    metrics: dict = field(default_factory=dict)
    figures: list = field(default_factory=list)  # (title, png bytes); inlined in the HTML
    measurement: bool = False  # a figure for the reader (timing), never part of the verdict

    def as_json(self) -> dict:
        d = asdict(self)
        d["figures"] = [t for t, _ in self.figures]
        return d


def vllm_version() -> str | None:
    try:
        import vllm  # noqa: F401
    except Exception:
        return None
    return getattr(sys.modules["vllm"], "__version__", "unknown")


# ---------------------------------------------------------------------------- checks
def check_vllm(ctx) -> CheckResult:
    ver = vllm_version()
    if ver is None:
        return CheckResult("vllm-contracts", None, "vLLM is not installed: its contracts were not checked "
                           "(make audit installs it with scripts/install_vllm.sh)")
    from vtoken.invariants.vllm_contracts import run_contracts
    from vtoken.vllm_adapter import VLLM_VERSION

    rows = run_contracts()
    bad = [r for r in rows if not r["passed"]]
    detail = f"vLLM {ver} (adapter pinned to {VLLM_VERSION}); {len(rows) - len(bad)}/{len(rows)} contracts hold"
    if bad:
        detail += "; broken: " + "; ".join(f"{r['name']}: {r['detail']}" for r in bad)
    return CheckResult("vllm-contracts", not bad and ver == VLLM_VERSION, detail,
                       metrics={"contracts": rows, "version": ver})


def _pytest(args, junit: Path, timeout: int) -> tuple[int, dict, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
    # derandomized Hypothesis and a fixed string-hash seed: the suite's verdict is a function of the code
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, PYTHONHASHSEED="0", VTOKEN_HYPOTHESIS_PROFILE="ci"))
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
    tail = "\n".join(p.stdout.strip().splitlines()[-3:])
    return p.returncode, {**counts, "failed": failed}, tail


def check_invariants(ctx) -> CheckResult:
    rc, counts, tail = _pytest(["-m", "invariants"], ctx["out"] / "invariants-junit.xml", timeout=900)
    n = counts["tests"]
    ok = rc == 0 and n > 0
    detail = f"pytest -m invariants: {n} tests, {counts['failures'] + counts['errors']} failed, {counts['skipped']} skipped"
    if counts["failed"]:
        detail += "; failing: " + ", ".join(counts["failed"][:5])
    if n == 0:
        detail += f" (no tests ran: {tail})"
    return CheckResult("invariants-suite", ok, detail, metrics=counts)


def check_fuzz(ctx) -> CheckResult:
    """A seeded campaign of a fixed number of examples per machine: the same work, hence the
    same verdict, for a given commit on any machine (a time box would not be)."""
    from vtoken.fuzz.campaign import run_campaign

    n = ctx["fuzz_examples"]
    summary = run_campaign(minutes=0, workers=1, seed=ctx["seed"], out=ctx["out"] / "fuzz", db=None,
                           progress=False, examples=n, batch=min(50, n))
    missing = dict(summary["machines_unavailable"])
    if vllm_version() is not None and "adapter" in missing:  # vLLM is here: the adapter machine must run
        return CheckResult("fuzz-campaign", False, f"the adapter machine cannot run: {missing['adapter']}",
                           metrics=summary)
    ok = summary["failures"] == 0 and summary["ops"] > 0
    detail = (f"{n} seeded examples per machine ({', '.join(summary['machines'])}; seed {ctx['seed']}): "
              f"{summary['ops']} conformance-checked operations in {summary['seconds']:.0f} s, "
              f"{summary['failures']} failures")
    if missing:
        detail += "; not run: " + "; ".join(f"{m} ({why})" for m, why in missing.items())
    return CheckResult("fuzz-campaign", ok, detail, metrics=summary)


def check_mutants(ctx) -> CheckResult:
    """The checkers measured on their own mutants (``vtoken check-mutants``): every violating
    snapshot rejected by Python and Z3, every valid one accepted."""
    from vtoken.invariants.mutants import ALL_PATHS, PathUnavailable, format_table, run

    paths = ALL_PATHS if vllm_version() is not None else tuple(p for p in ALL_PATHS if p != "adapter")
    try:
        res = run(paths, per_operator=60, seed=ctx["seed"], quick=ctx["quick"])
    except PathUnavailable as e:
        return CheckResult("checker-mutants", False, f"a path gave no snapshots: {e}")
    ok = bool(res["passed"])
    detail = (f"{res['rejected']}/{res['mutants']} mutants rejected by every checker over {res['operators']} "
              f"operators; {res['valid_accepted']}/{res['valid']} valid snapshots accepted (paths: {', '.join(paths)})")
    res["table"] = format_table(res)
    return CheckResult("checker-mutants", ok, detail, metrics=res)


def check_vllm_decode(ctx) -> CheckResult:
    if vllm_version() is None:
        return CheckResult("vllm-decode", None, "vLLM is not installed: the adapter decode was not run")
    from vtoken.reports.vllm_runs import audit_decode

    res = audit_decode(quick=ctx["quick"], seed=ctx["seed"], snapshot_dir=ctx["out"] / "snapshots")
    return CheckResult("vllm-decode", res["passed"], res["detail"], metrics=res, figures=res.pop("figures", []))


def check_sharing(ctx) -> CheckResult:
    if vllm_version() is None:
        return CheckResult("vllm-prefix-sharing", None, "vLLM is not installed: the sharing-degree run was not done")
    from vtoken.reports.vllm_runs import sharing_table

    res = sharing_table(quick=ctx["quick"], seed=ctx["seed"])
    return CheckResult("vllm-prefix-sharing", res["passed"], res["detail"], metrics=res, figures=res.pop("figures", []))


def check_waste(ctx) -> CheckResult:
    """Waste under Naive-Evict and retained blocks Naive-Evict vs vToken (quick simulation)."""
    from vtoken.cli.simulate import run_retained, run_waste

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
                       figures=figs)


def check_table_bench(ctx) -> CheckResult:
    from vtoken.cli.bench import bench_table

    res = bench_table(quick=True)
    # A timing: reported, never a verdict (a shared machine's noise must not flip an audit;
    # the target, 1.3, is checked where it belongs, in `vtoken bench table`).
    return CheckResult("table-step-cost", None,
                       f"host step cost at 16K vs 1K tracked tokens: x{res['history_ratio']:.2f} "
                       f"(the target is 1.3: it must not grow with history), {res['speedup_vs_spec']:.0f}x the "
                       f"reference model", metrics=res, measurement=True)


CHECKS = [check_vllm, check_invariants, check_fuzz, check_mutants, check_vllm_decode, check_sharing, check_waste,
          check_table_bench]


# ---------------------------------------------------------------------------- reports
def _fig_b64(png: bytes) -> str:
    return base64.b64encode(png).decode()


def compare(old: dict, new: dict) -> list[str]:
    """Lines saying what changed since a previous audit.json."""
    lines = []
    if old.get("vllm_version") != new.get("vllm_version"):
        lines.append(f"vLLM version: {old.get('vllm_version')} -> {new.get('vllm_version')}")
    oc = {c["name"]: c for c in old.get("checks", [])}
    for c in new["checks"]:
        o = oc.pop(c["name"], None)
        if o is None:
            lines.append(f"{c['name']}: new check ({'pass' if c['passed'] else 'FAIL' if c['passed'] is False else 'not run'})")
        elif o["passed"] != c["passed"]:
            lines.append(f"{c['name']}: {o['passed']} -> {c['passed']} ({c['detail']})")
    for name in oc:
        lines.append(f"{name}: no longer checked")
    if old.get("passed") != new.get("passed"):
        lines.append(f"overall: {old.get('passed')} -> {new.get('passed')}")
    return lines or ["nothing changed in the checks' outcomes"]


def write_reports(out: Path, report: dict, results: list[CheckResult], changes: list[str] | None) -> None:
    mark = {True: "PASS", False: "FAIL", None: "NOT RUN"}
    md = [f"# vtoken audit: {'PASSED' if report['passed'] else 'FAILED'}", "",
          f"- when: {report['timestamp']}", f"- vLLM: {report['vllm_version'] or 'not installed'}",
          f"- host: {report['host']}", ""]
    if report.get("interrupted"):
        md[-1:] = [f"- INTERRUPTED (Ctrl-C) in {report['interrupted']['in']}; not run: "
                   f"{', '.join(report['interrupted']['not_run'])}", ""]
    if changes is not None:
        md += ["## Changes since the previous audit", ""] + [f"- {c}" for c in changes] + [""]
    md += ["## Checks", "", "| check | result | seconds | detail |", "|---|---|---|---|"]
    def label(r):
        return "MEASURED" if r.measurement else mark[r.passed]

    for r in results:
        md.append(f"| {r.name} | {label(r)} | {r.seconds:.1f} | {r.detail.replace('|', '/')} |")
    for r in results:  # long tables a check carries (the checkers' mutation table)
        if r.metrics.get("table"):
            md += ["", f"### {r.name}", "", "```", r.metrics["table"], "```"]
    for r in results:
        for title, _ in r.figures:
            md.append(f"\n*Figure: {title} (inlined in audit.html)*")
    (out / "audit.md").write_text("\n".join(md) + "\n")
    rows = "".join(
        f"<tr class='{label(r).replace(' ', '-').lower()}'><td>{html.escape(r.name)}</td><td>{label(r)}</td>"
        f"<td>{r.seconds:.1f}</td><td>{html.escape(r.detail)}</td></tr>" for r in results)
    rows += "".join(f"<tr><td colspan='4'><b>{html.escape(r.name)}</b><pre>{html.escape(r.metrics['table'])}</pre></td></tr>"
                    for r in results if r.metrics.get("table"))
    figs = "".join(f"<figure><img src='data:image/png;base64,{_fig_b64(png)}' alt='{html.escape(t)}'>"
                   f"<figcaption>{html.escape(t)}</figcaption></figure>" for r in results for t, png in r.figures)
    chg = "" if changes is None else "<h2>Changes since the previous audit</h2><ul>" + "".join(
        f"<li>{html.escape(c)}</li>" for c in changes) + "</ul>"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>vtoken audit</title><style>
body{{font-family:sans-serif;max-width:1100px;margin:2em auto}} td,th{{border:1px solid #ccc;padding:4px 8px;vertical-align:top}}
table{{border-collapse:collapse}} .pass td:nth-child(2){{color:#080}} .fail td:nth-child(2){{color:#c00;font-weight:bold}}
.not-run td:nth-child(2){{color:#888}} img{{max-width:100%}} figure{{margin:1em 0}}</style></head><body>
<h1>vtoken audit: {'PASSED' if report['passed'] else 'FAILED'}</h1>
<p>{html.escape(report['timestamp'])} &middot; vLLM {html.escape(str(report['vllm_version'] or 'not installed'))} &middot; {html.escape(report['host'])}</p>
{chg}<h2>Checks</h2><table><tr><th>check</th><th>result</th><th>s</th><th>detail</th></tr>{rows}</table>
<h2>Plots</h2>{figs or '<p>none</p>'}</body></html>"""
    (out / "audit.html").write_text(page)
    (out / "audit.json").write_text(json.dumps(report, indent=1, default=str))


def run_audit(out_root: Path, quick: bool, seed: int, fuzz_examples: int, compare_to: str | None,
              only: list[str] | None = None) -> tuple[dict, Path]:
    ver = vllm_version()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = out_root / f"{stamp}-vllm-{ver or 'none'}"
    out.mkdir(parents=True, exist_ok=True)
    ctx = {"out": out, "quick": quick, "seed": seed, "fuzz_examples": fuzz_examples}
    checks = [c for c in CHECKS if not only or any(o in c.__name__ for o in only)]
    results = []
    interrupted = None  # Ctrl-C: the check it stopped in; the report holds the checks that finished
    for i, fn in enumerate(checks, 1):
        label = fn.__name__.removeprefix("check_")
        print(f"[{i}/{len(checks)}] {label} ...", flush=True)
        t0 = time.perf_counter()
        try:
            res = fn(ctx)
        except KeyboardInterrupt:
            interrupted = label
            break
        except Exception as e:  # a crashing check is a failed check, with its reason
            res = CheckResult(label, False, f"crashed: {type(e).__name__}: {e}",
                              metrics={"traceback": traceback.format_exc()})
        res.seconds = time.perf_counter() - t0
        if res.metrics.get("interrupted") is True:  # the fuzz campaign stops itself on Ctrl-C and says so
            interrupted = label
            break
        results.append(res)
        mark = "MEASURED" if res.measurement else {True: "PASS", False: "FAIL", None: "NOT RUN"}[res.passed]
        print(f"      {mark} ({res.seconds:.1f} s) {res.detail}", flush=True)
    verdict = [r for r in results if not r.measurement]
    ran = [r for r in verdict if r.passed is not None]
    report = {
        "passed": interrupted is None and bool(ran) and all(r.passed for r in ran) and len(ran) == len(verdict),
        "vllm_version": ver,
        "timestamp": stamp,
        "host": f"{platform.node()} {platform.machine()} python {platform.python_version()}",
        "checks": [r.as_json() for r in results],
    }
    if interrupted is not None:
        labels = [c.__name__.removeprefix("check_") for c in checks]
        report["interrupted"] = {"in": interrupted, "not_run": labels[labels.index(interrupted):]}
    changes = None
    if compare_to:
        changes = compare(json.loads(Path(compare_to).read_text()), report)
        report["changes"] = changes
    write_reports(out, report, results, changes)
    return report, out


def _audit_json_kind(obj) -> str | None:
    """What ``--compare`` needs of a previous report (see :func:`compare`), or None."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    checks = obj.get("checks")
    if not isinstance(checks, list):
        return "no 'checks' list"
    for c in checks:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or "passed" not in c:
            return "a check without 'name' and 'passed'"
    return None


def _check_name(value: str) -> str:
    names = [c.__name__.removeprefix("check_") for c in CHECKS]
    if not any(value in c.__name__ for c in CHECKS):
        raise argparse.ArgumentTypeError(f"{value!r} matches no check (checks: {', '.join(names)})")
    return value


def main_audit(argv) -> int:
    from vtoken.cli.args import existing_json_file, nonneg_int, positive_int, writable_dir

    ap = argparse.ArgumentParser(prog="vtoken audit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=writable_dir, default="reports",
                    help="folder for the report folder (default: ./reports of the directory you run in)")
    ap.add_argument("--compare", metavar="OLD/audit.json", type=existing_json_file("an audit.json", _audit_json_kind),
                    help="add what changed since a previous audit")
    ap.add_argument("--quick", action="store_true", help="smaller runs (smoke test of the audit itself)")
    ap.add_argument("--seed", type=nonneg_int, default=0)
    ap.add_argument("--fuzz-examples", type=positive_int, default=100,
                    help="seeded examples per fuzz machine (a fixed amount of work: one verdict per commit)")
    ap.add_argument("--only", nargs="*", type=_check_name, help="run only checks whose name contains one of these")
    a = ap.parse_args(argv)
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
        print(f"\naudit INTERRUPTED in {it['in']}: finished {len(report['checks'])} check(s) ({done}); "
              f"not run: {', '.join(it['not_run']) or 'none'}; partial report: {out}/audit.md, audit.html, audit.json",
              flush=True)
        return 130
    print(f"\naudit {'PASSED' if report['passed'] else 'FAILED'}: {out}/audit.md, audit.html, audit.json")
    for c in report["checks"]:
        if c["passed"] is None and not c.get("measurement"):
            print(f"  not run: {c['name']}: {c['detail']}")
    return 0 if report["passed"] else 1
