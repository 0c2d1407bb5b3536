"""What a person acts on: the verdict of one audit, and the contract matrix over versions.

``verdict(report)`` turns an ``audit.json`` dict into ``{"safe", "why", "pin",
"broken_contracts", "failed_checks", "not_run"}``: *safe to run vtoken on this vLLM* is yes
only when vLLM imports, every behavioural contract holds, every check that decides ran and
passed (a check that could not run makes it no, never a silent yes), and the audit was not
interrupted. The version pin (contract ``vllm_version``: the adapter was written against
0.33.0) is stated beside the verdict, not folded into it: on another version the behaviour
is what tells whether vtoken is safe there.

Each broken contract comes with what breaks for a user (:data:`CONTRACT_IMPACT`), each
failed check with the exact command that reproduces it (:func:`repro_commands`).

``matrix(audits)`` lays every contract, check, fuzz machine and vLLM test group out per
version (pass / FAIL / n/a / not run); ``render_matrix_md`` / ``render_matrix_html`` write it.
Pure functions of the JSON: no vLLM, no torch.

Owns: nothing (pure functions of the JSON).
May call: html, json, os, shlex; no vLLM, no torch.
Costs: O(report size).
"""

from __future__ import annotations

import html
import json
import os
import shlex
from typing import Optional

PIN = "vllm_version"
OWN_TESTS = "vllm-own-tests"

# contract name -> what breaks for someone running vtoken when it does not hold
CONTRACT_IMPACT = {
    "vllm_version": "vtoken was written and tested against vLLM 0.33.0 only; on this version only what this "
                    "audit measured vouches for it",
    "symbols_block_pool": "the adapter cannot take headroom blocks, free relocated sources or drop stale hashes: "
                          "it fails at start or at the first relocation",
    "symbols_kv_cache_block": "the adapter cannot read block ids, ref counts or hashes: its mirror of vLLM's block "
                              "lists and its shared-block guard stop working",
    "symbols_kv_cache_manager": "the adapter cannot reach the block pool or the per-request block lists: it cannot "
                                "start",
    "symbols_single_type_manager": "the adapter cannot see or edit req_to_blocks: null substitution and release "
                                   "cannot work, it cannot start",
    "symbols_scheduler": "the adapter's scheduler subclass cannot be plugged in (scheduler_cls) or hook "
                         "schedule/update_from_output: vtoken never runs",
    "symbols_scheduler_output": "the worker side cannot rebuild block tables or apply copies from SchedulerOutput: "
                                "relocated tokens would be read at the wrong slots (wrong outputs)",
    "null_block": "null substitution could hand out or double-free block 0: pool corruption, another request's "
                  "KV overwritten",
    "get_new_blocks_order": "headroom reservation may take the wrong or a partial set of blocks when the pool is "
                            "short: a relocation can lose its destination",
    "free_blocks_unhashed": "released blocks do not come back to the pool as the adapter expects: lost capacity, "
                            "or a block reused while it is still being copied",
    "free_blocks_hashed": "a prefix-cache hit can land on a released block whose hash is stale: a later request is "
                          "served the wrong KV",
    "shared_prefix_refcount": "the adapter may move or release a block another request shares: that request reads "
                              "the wrong KV (silently wrong outputs)",
    "writability": "the adapter may write into a shared or prefix-cached block: another request's (or a future "
                   "cache hit's) KV is corrupted",
    "reservation": "headroom blocks can be handed to a request while the adapter copies into them: two writers on "
                   "one block (corrupt KV)",
    "null_substitution": "released slots are refilled or regrown: block-list positions shift and tokens are read "
                         "from the wrong blocks (wrong outputs)",
    "pop_regrows": "vLLM no longer sizes block lists by length: the reasoning behind the adapter's list edits is "
                   "unverified on this version",
    "new_block_ids_append_only": "the worker's block tables drift from the scheduler's: after a relocation the "
                                 "model reads stale slots (wrong outputs)",
    "preempt_and_finish_free_all": "after preemption or finish the token table keeps stale entries or blocks leak: "
                                   "pool exhaustion, or wrong KV after a resume",
    "async_two_steps_in_flight": "the fence's step accounting is off: a relocation's source can be freed while a "
                                 "step in flight still reads it (use after free of KV)",
    "fence_step_seq": "a relocation's sources can return to the pool before the copy and the last step reading "
                      "them finished: use after free of KV blocks",
}

CHECK_IMPACT = {
    "vllm-contracts": "the adapter's assumptions about vLLM do not hold (see the broken contracts)",
    "invariants-suite": "vtoken's own invariants fail: the token table, planner or checkers are wrong",
    "fuzz-campaign": "the model-based fuzz campaign found a divergence from the reference model",
    "checker-mutants": "the checkers miss violations (or reject valid states): a passing audit proves less",
    "vllm-decode": "a decode through the adapter differs from reclamation off, or a relocation failed its hash "
                   "check: users get different or corrupt outputs",
    "vllm-prefix-sharing": "with shared prefixes the adapter moved a shared block, failed a hash check or saved "
                           "nothing",
    "vllm-prefix-equality": "with prefix caching, outputs differ from Naive-Evict for requests computed alike, or a "
                            "prefix hit served K/V a fresh prefill does not write (prefix-cache poisoning)",
    "vllm-own-tests": "vLLM's own tests of the scheduler and block pool fail, or behave differently with vtoken "
                      "plugged in",
    "vllm-engine": "in vLLM's real engine (its model runner, sampler and block tables) vtoken's outputs differ from "
                   "Naive-Evict's, a relocation failed its hash check, or blocks were not given back",
    "waste-and-retained": "the simulation shows no reclamation benefit",
}

MARK = {True: "pass", False: "FAIL", None: "not run"}


def _q(s) -> str:
    return shlex.quote(str(s))


ALLOW_ENV = "VTOKEN_ALLOW_UNSUPPORTED_VLLM"  # the adapter runs on a version it was not pinned to only with it


def _supported(report: dict) -> list:
    """The vLLM versions vtoken supported when the report was made (older reports: the one pin)."""
    for c in report.get("checks", []):
        m = c.get("metrics") or {}
        if c.get("name") == "vllm-contracts" and (m.get("supported") or m.get("pinned")):
            return list(m.get("supported") or [m["pinned"]])
    from vtoken.vllm_adapter import SUPPORTED_VLLM

    return list(SUPPORTED_VLLM)


def env_prefix(report: dict) -> str:
    """The environment a reproducing command needs: the fixed hash seed, and for a version
    the adapter is not pinned to, the variable that lets it start there (as the audit did)."""
    ver = report.get("vllm_version")
    allow = f" {ALLOW_ENV}={_q(ver)}" if ver and ver not in _supported(report) else ""
    return "PYTHONHASHSEED=0" + allow


def audit_command(report: dict, only: Optional[str] = None, *, user_level: bool = False) -> str:
    """The command that reruns this audit (or one check of it) exactly: same interpreter,
    seed, fuzz examples and quick flag; ``user_level`` gives the ``vtoken audit --vllm``
    form (builds or reuses the side environment)."""
    inv = report.get("invocation") or {}
    parts = []
    if not user_level:
        parts += ["cd", _q(inv.get("repo", ".")), "&&", env_prefix(report), _q(inv.get("python", "python")), "-m",
                  "vtoken", "audit"]
    else:
        parts += ["vtoken", "audit"]
        if report.get("vllm_version"):
            parts += ["--vllm", _q(report["vllm_version"])]
    if only:
        parts += ["--only", _q(only)]
    if inv.get("quick"):
        parts.append("--quick")
    if inv.get("seed", 0):
        parts += ["--seed", str(inv["seed"])]
    if inv.get("fuzz_examples") not in (None, 100):
        parts += ["--fuzz-examples", str(inv["fuzz_examples"])]
    return " ".join(parts)


def _contract_command(report: dict, name: str) -> str:
    inv = report.get("invocation") or {}
    code = (f"from vtoken.invariants.vllm_contracts import run_contract; r = run_contract({json.dumps(name)}); "
            'print(r["passed"], r["detail"])')
    return f"cd {_q(inv.get('repo', '.'))} && {env_prefix(report)} {_q(inv.get('python', 'python'))} -c {_q(code)}"


def repro_commands(report: dict, check: dict) -> list[str]:
    """Commands that reproduce one failed check (most specific first)."""
    inv = report.get("invocation") or {}
    name = check["name"]
    m = check.get("metrics") or {}
    cmds = []
    if name == "vllm-contracts":
        cmds += [_contract_command(report, r["name"]) for r in m.get("contracts", []) if not r.get("passed")
                 and r.get("name") != PIN]
    elif name == "invariants-suite" and m.get("failed"):
        # junit names: classname "tests.test_x" (or "tests.test_x.Class") and the test name
        sel = " or ".join(t.split("::")[-1].split("[")[0] for t in m["failed"][:5])
        cmds.append(f"cd {_q(inv.get('repo', '.'))} && {env_prefix(report)} VTOKEN_HYPOTHESIS_PROFILE=ci "
                    f"{_q(inv.get('python', 'python'))} -m pytest -m invariants -k {_q(sel)}")
    elif name == "fuzz-campaign" and m.get("failure_reports"):
        # each failure wrote a replay test beside its report: fuzz/failures/<machine>-w<k>-<n>.txt
        for f in m["failure_reports"][:3]:
            stem = str(f.get("files") or "")
            if stem:
                d, base = os.path.split(stem)
                replay = os.path.join(d, "test_replay_" + base.replace("-", "_") + ".py")
                cmds.append(f"cd {_q(inv.get('cwd', inv.get('repo', '.')))} && {env_prefix(report)} "
                            f"{_q(inv.get('python', 'python'))} -m pytest -p no:cacheprovider {_q(replay)}")
    elif name == OWN_TESTS and m.get("command"):
        cmd = str(m["command"])
        if " && " in cmd and ALLOW_ENV not in cmd and env_prefix(report) != "PYTHONHASHSEED=0":
            head, tail = cmd.split(" && ", 1)
            cmd = f"{head} && {env_prefix(report)} {tail}"
        cmds.append(cmd)
    cmds.append(audit_command(report, only=name))
    return cmds


def _clip(text: str, n: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."


def _contract_rows(report: dict) -> Optional[list]:
    for c in report.get("checks", []):
        if c["name"] == "vllm-contracts":
            return (c.get("metrics") or {}).get("contracts")
    return None


def _relied(b: dict) -> str:
    """`` (relied on by MODULES)`` for a broken contract's line: the adapter code an upgrade
    must re-read; empty for reports written before contracts named it."""
    return f" (relied on by {b['relied_on_by']})" if b.get("relied_on_by") else ""


def verdict(report: dict) -> dict:
    """See the module docstring."""
    checks = [c for c in report.get("checks", []) if not c.get("measurement")]
    rows = _contract_rows(report)
    pin_row = next((r for r in rows or [] if r["name"] == PIN), None)
    broken = [{"name": r["name"], "impact": CONTRACT_IMPACT.get(r["name"], r.get("assumption", "")),
               "detail": r.get("detail", ""), "relied_on_by": r.get("relied_on_by", "")}
              for r in rows or [] if not r.get("passed") and r["name"] != PIN]
    failed, not_run = [], []
    for c in checks:
        if c["name"] == "vllm-contracts":
            # the pin alone does not fail the verdict; a broken behaviour or a crash does
            if c["passed"] is False and (broken or rows is None):
                failed.append(c)
            elif c["passed"] is None:
                not_run.append(c)
            continue
        if c["passed"] is False:
            failed.append(c)
        elif c["passed"] is None:
            not_run.append(c)
    why = []
    if report.get("vllm_version") is None:
        why.append("vLLM is not installed or does not import")
    if report.get("interrupted"):
        why.append(f"the audit was interrupted in {report['interrupted'].get('in')}")
    if not checks:
        why.append("no check ran")
    only = (report.get("invocation") or {}).get("only")
    if only:  # a partial audit never says yes: what was left out was not checked
        why.append(f"partial audit (--only {' '.join(only)}): the other checks did not run")
    if broken:
        why.append(f"{len(broken)} contract(s) broken")
    other = [c for c in failed if c["name"] != "vllm-contracts" or not broken]
    if other:
        why.append("failed: " + ", ".join(c["name"] for c in other))
    if not_run:
        why.append("not checked: " + ", ".join(c["name"] for c in not_run))
    pin = None
    if pin_row is not None and not pin_row.get("passed"):
        pin = (f"vtoken's adapter was audited on vLLM {', '.join(_supported(report))} and this is "
               f"{report.get('vllm_version')} (contract vllm_version); the verdict rests on the behaviour measured "
               f"here, every other contract and check")
    return {
        "safe": not why,
        "why": why,
        "pin": pin,
        "broken_contracts": broken,
        "failed_checks": [{"name": c["name"], "detail": c.get("detail", ""),
                           "impact": CHECK_IMPACT.get(c["name"], ""), "repro": repro_commands(report, c)}
                          for c in failed],
        "not_run": [{"name": c["name"], "detail": c.get("detail", "")} for c in not_run],
    }


def verdict_md(report: dict, v: dict) -> list[str]:
    ver = report.get("vllm_version") or "not installed"
    out = [f"**vLLM audited: {ver}. Safe to run vtoken on it: {'YES' if v['safe'] else 'NO'}.**", ""]
    if v["why"]:
        out += [f"Why not: {'; '.join(v['why'])}.", ""]
    if v["pin"]:
        out += [f"Note: {v['pin']}.", ""]
    if v["broken_contracts"]:
        out += ["Broken contracts (what breaks for a user):", ""]
        out += [f"- `{b['name']}`{_relied(b)}: {b['impact']}" for b in v["broken_contracts"]]
        out.append("")
    if v["failed_checks"]:
        out += ["Failed checks, each with the command that reproduces it:", ""]
        for f in v["failed_checks"]:
            out.append(f"- **{f['name']}**: {_clip(f['detail'])}" + (f" (for a user: {f['impact']})"
                                                                      if f["impact"] else ""))
            out += [f"  - `{cmd}`" for cmd in f["repro"]]
        out.append("")
    if v["not_run"]:
        out += ["Not checked (the verdict cannot be yes while these did not run):", ""]
        out += [f"- {n['name']}: {n['detail']}" for n in v["not_run"]]
        out.append("")
    return out


def verdict_html(report: dict, v: dict) -> str:
    e = html.escape
    ver = e(str(report.get("vllm_version") or "not installed"))
    cls = "safe" if v["safe"] else "unsafe"
    parts = [f"<div class='verdict {cls}'><p class='big'>vLLM audited: <b>{ver}</b> &middot; safe to run vtoken on "
             f"it: <b>{'YES' if v['safe'] else 'NO'}</b></p>"]
    if v["why"]:
        parts.append(f"<p>Why not: {e('; '.join(v['why']))}.</p>")
    if v["pin"]:
        parts.append(f"<p class='note'>Note: {e(v['pin'])}.</p>")
    if v["broken_contracts"]:
        parts.append("<p>Broken contracts (what breaks for a user):</p><ul>" + "".join(
            f"<li><code>{e(b['name'])}</code>{e(_relied(b))}: {e(b['impact'])}</li>" for b in v["broken_contracts"])
            + "</ul>")
    if v["failed_checks"]:
        parts.append("<p>Failed checks, each with the command that reproduces it:</p><ul>" + "".join(
            f"<li><b>{e(f['name'])}</b>: {e(_clip(f['detail']))}"
            + (f" <i>(for a user: {e(f['impact'])})</i>" if f["impact"] else "") + "<ul>"
            + "".join(f"<li><code>{e(c)}</code></li>" for c in f["repro"]) + "</ul></li>"
            for f in v["failed_checks"]) + "</ul>")
    if v["not_run"]:
        parts.append("<p>Not checked (the verdict cannot be yes while these did not run):</p><ul>" + "".join(
            f"<li>{e(n['name'])}: {e(n['detail'])}</li>" for n in v["not_run"]) + "</ul>")
    parts.append("</div>")
    return "".join(parts)


# ---------------------------------------------------------------------------- matrix
def _cell(passed, detail: str = "") -> dict:
    if passed is True:
        return {"state": "pass", "detail": detail}
    if passed is False:
        return {"state": "FAIL", "detail": detail}
    if passed == "n/a":
        return {"state": "n/a", "detail": detail}
    return {"state": "not run", "detail": detail}


def _rows_for(report: Optional[dict], error: Optional[str]) -> dict:
    """(section, row name) -> cell, for one version's audit (or its failure to run)."""
    cells: dict = {}
    if report is None:
        return cells
    for c in report.get("checks", []):
        rows = (c.get("metrics") or {}).get("contracts") if c["name"] == "vllm-contracts" else None
        if c.get("measurement"):
            cells[("check", c["name"])] = {"state": "measured", "detail": c.get("detail", "")}
        elif c["passed"] is False and rows and all(r["name"] == PIN for r in rows if not r.get("passed")):
            cells[("check", c["name"])] = {"state": "pin only", "detail": c.get("detail", "")}
        else:
            cells[("check", c["name"])] = _cell(c["passed"], c.get("detail", ""))
        m = c.get("metrics") or {}
        if c["name"] == "vllm-contracts":
            for r in m.get("contracts", []) or []:
                cells[("contract", r["name"])] = _cell(bool(r.get("passed")), r.get("detail", ""))
        if c["name"] == "fuzz-campaign":
            failed = {f.get("machine") for f in m.get("failure_reports", []) or []}
            for name in m.get("machines", []) or []:
                ops = (m.get("ops_by_machine") or {}).get(name, 0)
                cells[("fuzz machine", name)] = _cell(name not in failed and ops > 0, f"{ops} operations")
            for name, why in (m.get("machines_unavailable") or {}).items():
                cells[("fuzz machine", name)] = _cell(None, str(why))
        if c["name"] == OWN_TESTS:
            for g, n in (m.get("groups") or {}).items():
                if isinstance(n, dict):
                    bug, p, na = n.get("bug", n.get("failed", 0)), n.get("passed", 0), n.get("not_applicable", 0)
                    state = False if bug else (True if p or n.get("inherent") else "n/a")
                    cells[("vLLM test group", g)] = _cell(
                        state, f"with vtoken: {p} passed, {bug} bug divergence(s), {n.get('inherent', 0)} inherent, "
                               f"{n.get('failed_as_shipped', 0)} fail as shipped too, {na} n/a")
    return cells


def matrix(audits: dict) -> dict:
    """``audits``: version -> {"report": audit.json dict or None, "error": str or None,
    "env_seconds", "audit_seconds", "env_reused", "dir"}. Returns the matrix as JSON."""
    versions = list(audits)
    per = {v: _rows_for(a.get("report"), a.get("error")) for v, a in audits.items()}
    order: list = []
    for section in ("contract", "check", "fuzz machine", "vLLM test group"):
        seen = []
        for v in versions:
            for (s, n) in per[v]:
                if s == section and n not in seen:
                    seen.append(n)
        order += [(section, n) for n in seen]
    rows = []
    for (s, n) in order:
        cells = {}
        for v in versions:
            a = audits[v]
            if (s, n) in per[v]:
                cells[v] = per[v][(s, n)]
            elif a.get("report") is None:
                cells[v] = {"state": "not run", "detail": a.get("error") or "the audit did not run"}
            else:
                cells[v] = {"state": "not run", "detail": "not in this version's audit"}
        rows.append({"section": s, "name": n, "cells": cells})
    summary = {}
    for v in versions:
        a = audits[v]
        rep = a.get("report")
        vd = verdict(rep) if rep is not None else {"safe": False, "why": [a.get("error") or "the audit did not run"],
                                                  "broken_contracts": [], "failed_checks": [], "pin": None,
                                                  "not_run": []}
        summary[v] = {
            "safe": vd["safe"], "why": vd["why"], "passed": rep.get("passed") if rep else False,
            "broken_contracts": [b["name"] for b in vd["broken_contracts"]],
            "failed_checks": [f["name"] for f in vd["failed_checks"]],
            "env_seconds": a.get("env_seconds"), "env_reused": a.get("env_reused"),
            "audit_seconds": a.get("audit_seconds"), "dir": a.get("dir"), "error": a.get("error"),
        }
    supported = [v for v in versions if summary[v]["safe"]]
    return {"versions": versions, "rows": rows, "summary": summary, "safe_versions": supported}


def _short(state: str) -> str:
    return {"pass": "pass", "FAIL": "**FAIL**", "n/a": "n/a", "not run": "not run", "measured": "measured",
            "pin only": "FAIL (pin only)"}[state]


def _names(names: list, n: int = 4) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "") if names else "-"


def render_matrix_md(mx: dict, title: str = "vtoken contract matrix") -> str:
    vs = mx["versions"]
    out = [f"# {title}", ""]
    safe = mx["safe_versions"]
    out += [f"Safe to run vtoken on: {', '.join(safe) if safe else 'none of the versions audited'}.", ""]
    out += ["| vLLM | safe | broken contracts | failed checks | env build s | audit s |",
            "|---|---|---|---|---|---|"]
    for v in vs:
        s = mx["summary"][v]
        env = ("this env" if s["error"] is None else "") if s["env_seconds"] is None else \
            f"{s['env_seconds']:.0f}" + (" (reused)" if s["env_reused"] else "")
        aud = "" if s["audit_seconds"] is None else f"{s['audit_seconds']:.0f}"
        out.append(f"| {v} | {'YES' if s['safe'] else 'NO'} | {_names(s['broken_contracts'])} | "
                   f"{_names(s['failed_checks'])} | {env} | {aud} |")
    out.append("")
    for v in vs:
        if not mx["summary"][v]["safe"]:
            out.append(f"- {v}: not safe: {'; '.join(mx['summary'][v]['why'])}")
    out += ["", "A contract row is the contract's own check; `FAIL (pin only)` on vllm-contracts: every behavioural "
                "contract holds, only the version differs from the one the adapter was written against."]
    out += ["", "| section | name | " + " | ".join(vs) + " |", "|---|---|" + "---|" * len(vs)]
    for r in mx["rows"]:
        out.append(f"| {r['section']} | {r['name']} | " + " | ".join(_short(r["cells"][v]["state"]) for v in vs) + " |")
    fails = [(r, v) for r in mx["rows"] for v in vs if r["cells"][v]["state"] in ("FAIL", "not run")
             and not (r["section"] == "vLLM test group" and mx["summary"][v]["error"] is None
                      and r["cells"][v]["detail"] == "not in this version's audit")]
    if fails:
        out += ["", "## Why each cell failed or did not run", ""]
        for r, v in fails:
            out.append(f"- {v} / {r['section']} {r['name']} ({r['cells'][v]['state']}): "
                       f"{r['cells'][v]['detail'][:400].replace(chr(10), ' ')}")
    return "\n".join(out) + "\n"


def render_matrix_html(mx: dict, title: str = "vtoken contract matrix") -> str:
    e = html.escape
    vs = mx["versions"]
    safe = mx["safe_versions"]
    head = "".join(f"<th>{e(v)}</th>" for v in vs)
    def secs(x, reused=False):
        return "" if x is None else f"{x:.0f}" + (" (reused)" if reused else "")

    summ = "".join(
        f"<tr><td>{e(v)}</td><td class='{'pass' if s['safe'] else 'fail'}'>{'YES' if s['safe'] else 'NO'}</td>"
        f"<td>{e(_names(s['broken_contracts']))}</td><td>{e(_names(s['failed_checks']))}</td>"
        f"<td>{secs(s['env_seconds'], s['env_reused']) or ('this env' if s['error'] is None else '')}</td>"
        f"<td>{secs(s['audit_seconds'])}</td>"
        f"<td>{e('; '.join(s['why']))}</td></tr>"
        for v, s in mx["summary"].items())
    cls = {"pass": "pass", "FAIL": "fail", "n/a": "na", "not run": "na", "measured": "na", "pin only": "na"}
    body = "".join(
        f"<tr><td>{e(r['section'])}</td><td>{e(r['name'])}</td>" + "".join(
            f"<td class='{cls[r['cells'][v]['state']]}' title='{e(r['cells'][v]['detail'][:600])}'>"
            f"{e(r['cells'][v]['state'])}</td>" for v in vs) + "</tr>" for r in mx["rows"])
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{e(title)}</title><style>
body{{font-family:sans-serif;max-width:1200px;margin:2em auto}} td,th{{border:1px solid #ccc;padding:3px 8px;vertical-align:top}}
table{{border-collapse:collapse;margin-bottom:1.5em}} .pass{{color:#080}} .fail{{color:#c00;font-weight:bold;background:#fee}}
.na{{color:#888}}</style></head><body>
<h1>{e(title)}</h1>
<p><b>Safe to run vtoken on: {e(', '.join(safe) if safe else 'none of the versions audited')}</b></p>
<table><tr><th>vLLM</th><th>safe</th><th>broken contracts</th><th>failed checks</th><th>env build s</th><th>audit s</th><th>why not</th></tr>{summ}</table>
<table><tr><th>section</th><th>name</th>{head}</tr>{body}</table>
<p>Hover a cell for its detail; matrix.md lists why each failed cell failed.</p></body></html>"""
