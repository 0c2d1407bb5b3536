"""``audit.html``: the audit report as one self-contained page (plots inlined), readable at
1400 px wide with nothing running off the right edge.

Layout, top to bottom: the verdict (``verdict.verdict_html``), the audit's identity, changes
since a previous audit, the checks table, the long tables a check carries, the figures, the
logs. The checks table has a fixed layout at the page's width (check, result, seconds, what
it ran against, detail): a detail longer than :data:`SHORT` characters shows its first
clause and folds the whole text into a ``<details>`` under it, and every cell breaks long
words (paths, test ids). Long tables (the checkers' mutation table) are printed in full in
folded ``<details>`` of their own, scrolled within the page. Figures sit in a grid, each in
a column of its own, scaled to it, captioned with the vLLM (or the simulator) they measured.
``tests/test_audit_html.py`` renders a page in headless Chromium at 1400 px and measures it.

Owns: nothing (pure functions of the report).
May call: base64, html; vtoken.reports.verdict, vtoken.reports.audit_console (clip).
Costs: O(report size).
"""

from __future__ import annotations

import base64
import html

SHORT = 240  # a detail up to this long is shown whole; a longer one is folded
MAX_WIDTH = 1340  # px: the page's column, under a 1400 px window with its scrollbar

CSS = f"""
*{{box-sizing:border-box}}
body{{font-family:sans-serif;max-width:{MAX_WIDTH}px;margin:1.5em auto;padding:0 1em;line-height:1.35;
overflow-wrap:anywhere}}
td,th{{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left;overflow-wrap:anywhere}}
table{{border-collapse:collapse}} table.checks{{width:100%;table-layout:fixed}}
table.checks col.name{{width:13em}} table.checks col.result{{width:8.5em}} table.checks col.secs{{width:5em}}
table.checks col.on{{width:12em}}
.pass td.result{{color:#080}} .fail td.result{{color:#c00;font-weight:bold}} .not-run td.result{{color:#888}}
.measured td.result{{color:#046}}
details>summary{{cursor:pointer;color:#046}} details .full{{margin:.3em 0;white-space:pre-wrap}}
pre{{overflow-x:auto;max-width:100%;background:#f8f8f8;padding:.5em;font-size:12px}}
.figs{{display:grid;grid-template-columns:repeat(auto-fill,minmax(380px,1fr));gap:1em}}
figure{{margin:0;min-width:0}} figure img{{width:100%;height:auto;display:block;border:1px solid #eee}}
figcaption{{font-size:.9em;color:#333;overflow-wrap:anywhere}}
.verdict{{border:3px solid;padding:.5em 1em;margin:1em 0;overflow-wrap:anywhere}}
.verdict.safe{{border-color:#080;background:#efe}} .verdict.unsafe{{border-color:#c00;background:#fee}}
.verdict .big{{font-size:1.4em}} code{{background:#f4f4f4;word-break:break-all}} .meta{{overflow-wrap:anywhere}}
.log{{font-size:.9em;color:#555}}
"""


def _e(x) -> str:
    return html.escape(str(x))


def _fig_b64(png: bytes) -> str:
    return base64.b64encode(png).decode()


def folded(text: str, short: int = SHORT) -> str:
    """``text`` as HTML: whole when short, else its opening (to the first ``; `` within
    ``short`` characters, or cut there) and the whole text folded under it."""
    text = str(text)
    if len(text) <= short:
        return _e(text)
    cut = text.rfind("; ", 0, short)
    head = text[:cut] if cut > short // 3 else text[:short - 3].rstrip() + "..."
    return (f"{_e(head)}<details><summary>whole detail ({len(text)} characters)</summary>"
            f"<div class='full'>{_e(text)}</div></details>")


def _log_cell(r) -> str:
    log = r.log or {}
    if not log.get("path"):
        return ""
    rep = "; ".join(f"&ldquo;{_e(t[:120])}&rdquo; &times;{c}" for t, c in log.get("repeated", [])[:1])
    return (f"<div class='log'>log: <a href='{_e(log['path'])}'>{_e(log['path'])}</a> ({log.get('lines', 0)} lines"
            + (f"; most repeated: {rep}" if rep else "") + ")</div>")


def checks_table(results, label) -> str:
    """The checks table; ``label(r)`` is a result's outcome (PASS, FAIL (pin only), ...)."""
    rows = "".join(
        f"<tr class='{label(r).split(' (')[0].replace(' ', '-').lower()}'><td>{_e(r.name)}</td>"
        f"<td class='result'>{_e(label(r))}</td><td>{r.seconds:.1f}</td><td>{_e(r.measured_on or '')}</td>"
        f"<td>{folded(r.detail)}{_log_cell(r)}</td></tr>" for r in results)
    return ("<table class='checks'><colgroup><col class='name'><col class='result'><col class='secs'>"
            "<col class='on'><col class='detail'></colgroup>"
            "<tr><th>check</th><th>result</th><th>s</th><th>measured on</th><th>detail</th></tr>"
            f"{rows}</table>")


def figures_html(results) -> str:
    """Every figure of every check in a grid, each in a column of its own, captioned."""
    figs = "".join(f"<figure><img src='data:image/png;base64,{_fig_b64(png)}' alt='{_e(t)}'>"
                   f"<figcaption>{_e(r.name)}: {_e(t)}</figcaption></figure>"
                   for r in results for t, png in r.figures)
    return f"<div class='figs'>{figs}</div>" if figs else "<p>none</p>"


def page(report: dict, results, changes, label) -> str:
    """The whole ``audit.html`` (see the module docstring)."""
    from vtoken.reports.verdict import verdict, verdict_html

    v = report.get("verdict") or verdict(report)
    ver = report["vllm_version"] or "not installed"
    env = report.get("environment")
    meta = [f"every check passed: {'yes' if report['passed'] else 'no'}", _e(report["timestamp"]),
            f"vLLM {_e(ver)}", _e(report["host"])]
    if env:
        meta.append(f"side environment {_e(env.get('env'))} ({'reused' if env.get('reused') else 'built'})")
    if report.get("seconds") is not None:
        meta.append(f"audit took {report['seconds']:.0f} s")
    code = report.get("code") or {}
    meta.append(f"code {_e(code.get('commit') or 'not a git checkout')}" + (" (with uncommitted changes)"
                                                                               if code.get("dirty") else ""))
    chg = "" if changes is None else "<h2>Changes since the previous audit</h2><ul>" + "".join(
        f"<li>{_e(c)}</li>" for c in changes) + "</ul>"
    if report.get("interrupted"):
        chg = (f"<p><b>INTERRUPTED</b> (Ctrl-C) in {_e(report['interrupted']['in'])}; not run: "
               f"{_e(', '.join(report['interrupted']['not_run']))}</p>") + chg
    tables = "".join(f"<details><summary>{_e(r.name)}: its table ({len(r.metrics['table'].splitlines())} lines)"
                     f"</summary><pre>{_e(r.metrics['table'])}</pre></details>"
                     for r in results if r.metrics.get("table"))
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>vtoken audit of vLLM {_e(ver)}</title>
<style>{CSS}</style></head><body>
<h1>vtoken audit of vLLM {_e(ver)}: safe to run vtoken on it: {'yes' if v['safe'] else 'no'}</h1>
{verdict_html(report, v)}
<p class='meta'>{' &middot; '.join(meta)}</p>
{chg}<h2>Checks</h2>{checks_table(results, label)}
{'<h2>Tables</h2>' + tables if tables else ''}
<h2>Figures</h2>{figures_html(results)}
<p class='log'>Every check's own output (vLLM's warnings, its subprocesses, pytest) is in <code>logs/</code>
beside this page, one file per check.</p></body></html>"""
