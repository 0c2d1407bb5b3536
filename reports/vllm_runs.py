"""Audit runs through the vLLM adapter (``vtoken audit``: checks ``vllm-decode``,
``vllm-prefix-sharing`` and ``vllm-prefix-equality``).

``audit_decode(quick, seed, snapshot_dir)``
    A greedy decode through the REAL vLLM scheduler (async scheduling, prefix caching on)
    with the adapter, every relocation hash-and-compared, and the same decode with
    reclamation switched off (Naive-Evict: same eviction decisions, no plans, no headroom):
    the outputs must be equal token for token. Non-quick mode also runs a second policy and
    a variant whose copies complete steps late (``copy_lag``: the fence must wait for them).
``sharing_table(quick, seed)``
    Paper section 4.6: a shared prefix of 8 blocks plus a private suffix per request, at
    sharing degrees 1, 2, 4, 8, prefix caching on. The adapter must reduce retained blocks
    against reclamation off, move no shared block, and pass every hash check.
``prefix_equality(quick, seed)`` (the check's body lives in ``fuzz/vllm_prefix.py``, with the
    decode runs ``_run`` every audit run here shares; re-exported)
    The outputs guarantee under prefix caching (:func:`outputs_guarantee`): later requests
    repeat an earlier request's whole sequence, a prompt and a prefix; reclamation on and
    off, caching off and on. Equal outputs for every request computed alike (caching off:
    all of them), both runs' prefix-cache hit rates, and every prefix hit's K/V against the
    same tokens computed with caching off (:func:`served_from_cache_mismatch`).
``check_assumptions()``
    One short run that exercises relocation, prefix sharing, preemption and late copies,
    reporting each runtime assumption of the adapter by name (``adapter.ASSUMPTIONS``).

A broken assumption makes ``passed`` False and the ``detail`` start with
``assumption broken: <statement> [<name>]``. Nothing here raises for a failed check.

Owns: nothing beyond one run's harness, adapter and worker, dropped when it returns.
May call: vllm, vtoken.vllm_adapter, vtoken.model, fuzz (vllm_prefix: the runs and the
prefix-equality check), invariants (relocation_hash, plan_contract), torch, matplotlib.
Costs: a few CPU decodes through the real vLLM scheduler (more, and a late-copy variant, when not
quick).
"""

from __future__ import annotations

import io
import time

from vtoken.vllm_adapter import harness as _harness  # noqa: F401 - CPU environment before vLLM
from vtoken.vllm_adapter.adapter import ASSUMPTIONS, AdapterAssumptionError
# the decode runs and the prefix-equality check live with the checks (fuzz/vllm_prefix.py); re-exported
from vtoken.fuzz.vllm_prefix import (  # noqa: F401
    _broken, _model, _one_thread, _prompt, _run, outputs_guarantee, prefix_equality, served_from_cache_mismatch)

__all__ = ["audit_decode", "check_assumptions", "outputs_guarantee", "prefix_equality", "sharing_table"]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _retained_figure(title: str, on: list, off: list) -> bytes:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    ax.plot([x[0] for x in off], [x[1] for x in off], label="reclamation off (Naive-Evict)", color="tab:blue")
    ax.plot([x[0] for x in on], [x[1] for x in on], label="vToken adapter", color="tab:red")
    ax.set_xlabel("scheduler step (sched_step_seq)")
    ax.set_ylabel("retained blocks")
    ax.set_title(title)
    ax.legend()
    return _png(fig)



# ---------------------------------------------------------------------------- audit_decode
def _decode_row(policy: str, lag: int, layout: str, eq: bool, on: dict, off: dict, nb: int) -> dict:
    """One row of :func:`audit_decode`'s ``runs``: a variant's reclamation-on run beside its off run."""
    return {
        "policy": policy, "copy_lag": lag, "kv_layout": layout, "outputs_equal": eq,
        "retained_mean_on": round(on["retained_mean"], 2),
        "retained_mean_off": round(off["retained_mean"], 2),
        "retained_peak_on": on["retained_peak"], "retained_peak_off": off["retained_peak"],
        "relocations": on["stats"]["applied"], "moves": on["stats"]["moves"],
        "sources_freed": on["stats"]["sources_freed"], "hashes_kept": on["stats"]["hashes_kept"],
        "hashes_evicted": on["stats"]["hashes_evicted"], "hash_checks": on["hash_checks"],
        "steps": on["steps"], "wall_s_on": round(on["wall_s"], 2), "wall_s_off": round(off["wall_s"], 2),
        "num_blocks": nb,
    }


def audit_decode(quick: bool = True, seed: int = 0, snapshot_dir=None) -> dict:
    """Decode through the adapter with hash-and-compare, against reclamation off; see the
    module docstring. Never raises."""
    t0 = time.perf_counter()
    res = dict(passed=False, detail="", relocations=0, hash_checks=0, hash_failures=0, outputs_equal=False,
               retained_blocks_on=0.0, retained_blocks_off=0.0, figures=[], runs=[])
    nreq, new = (4, 24) if quick else (6, 64)
    prompts = {f"r{i}": _prompt(seed, i, 40 + 13 * i) for i in range(nreq)}
    # (policy, copy lag, KV layout): a hybrid layout (full attention + sliding window) in every audit
    variants = [("random", 0, "full"), ("random", 0, "hybrid")] if quick else \
        [("random", 0, "full"), ("h2o", 0, "full"), ("random", 2, "full"), ("h2o", 0, "hybrid"), ("random", 2, "hybrid")]
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        res["detail"] = f"vLLM not installed ({exc}): run scripts/install_vllm.sh"
        return res
    figures, lines = [], []
    ok_all = True
    offs: dict = {}
    try:
        with _one_thread():
            for policy, lag, layout in variants:
                nb = 2 + 8 + sum(-(-(len(p) + new) // 16) + 1 for p in prompts.values())
                nb += 4 * nreq if layout == "hybrid" else 0  # the window's blocks (two, and two being freed)
                kw = dict(prompts=prompts, max_tokens=new, policy=policy, seed=seed, num_blocks=nb, copy_lag=lag,
                          kv_layout=layout)
                on = _run(reclaim=True, snapshot_dir=snapshot_dir, **kw)
                if (policy, layout) not in offs:  # reclamation off has no copies: the lag does not matter
                    offs[policy, layout] = _run(reclaim=False, **kw)
                off = offs[policy, layout]
                eq = on["outputs"] == off["outputs"]
                if not eq:
                    bad = next(r for r in prompts if on["outputs"][r] != off["outputs"][r])
                    a, b = on["outputs"][bad], off["outputs"][bad]
                    i = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
                    lines.append(f"assumption broken: {ASSUMPTIONS['outputs_equal']} [outputs_equal]: "
                                 f"{policy} lag {lag} {layout}: request {bad!r} differs at output token {i}")
                ok = eq and on["hash_failures"] == 0 and on["stats"]["applied"] > 0 and \
                    on["retained_mean"] < off["retained_mean"]
                if on["stats"]["applied"] == 0:
                    lines.append(f"{policy} lag {lag} {layout}: no relocation happened (the audit is too weak)")
                ok_all &= ok
                res["relocations"] += on["stats"]["applied"]
                res["hash_checks"] += on["hash_checks"]
                res["hash_failures"] += on["hash_failures"]
                res["outputs_equal"] = eq if len(res["runs"]) == 0 else (res["outputs_equal"] and eq)
                res["runs"].append(_decode_row(policy, lag, layout, eq, on, off, nb))
                figures.append((f"retained blocks, {policy} eviction 50%, copy lag {lag}, {layout} KV layout",
                                _retained_figure(f"{policy}, evict 50%, {nreq} requests, {new} new tokens"
                                                 f"{', copies late by ' + str(lag) + ' polls' if lag else ''}",
                                                 on["retained"], off["retained"])))
    except Exception as exc:  # noqa: BLE001 - a broken assumption or a crash is a failed audit
        res["detail"] = _broken(exc)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        res["figures"] = figures
        return res
    runs = res["runs"]
    res["retained_blocks_on"] = round(sum(r["retained_mean_on"] for r in runs) / len(runs), 2)
    res["retained_blocks_off"] = round(sum(r["retained_mean_off"] for r in runs) / len(runs), 2)
    res["passed"] = bool(ok_all)
    summary = "; ".join(f"{r['policy']}{' lag ' + str(r['copy_lag']) if r['copy_lag'] else ''} {r['kv_layout']}: "
                        f"{r['relocations']} relocations, {r['hash_checks']} hash checks, retained "
                        f"{r['retained_mean_off']} -> {r['retained_mean_on']} blocks (mean), outputs "
                        f"{'equal' if r['outputs_equal'] else 'DIFFER'}" for r in runs)
    res["detail"] = ("; ".join(lines) + "; " if lines else "") + summary
    res["figures"] = figures
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


# ---------------------------------------------------------------------------- sharing_table
def _sharing_figures(rows: list) -> list:
    """:func:`sharing_table`'s bar chart of retained blocks by degree (``[]`` when it cannot be
    drawn: figures are optional)."""
    try:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        xs = list(range(len(rows)))
        ax.bar([x - 0.2 for x in xs], [r["retained_off"] for r in rows], 0.4, label="reclamation off")
        ax.bar([x + 0.2 for x in xs], [r["retained_on"] for r in rows], 0.4, label="vToken adapter",
               color="tab:red")
        ax.set_xticks(xs, [f"degree {r['degree']}" for r in rows])
        ax.set_ylabel("retained blocks")
        ax.set_title("shared prefix (8 blocks) + private suffixes, prefix caching on")
        ax.legend()
        return [("retained blocks by sharing degree", _png(fig))]
    except Exception:  # noqa: BLE001 - figures are optional
        return []


def sharing_table(quick: bool = True, seed: int = 0) -> dict:
    """Paper 4.6 at sharing degrees 1, 2, 4, 8 (see the module docstring). Never raises."""
    t0 = time.perf_counter()
    res = dict(passed=False, detail="", rows=[], figures=[])
    S = 8 if quick else 16
    prefix_blocks, suffix_blocks = 8, 8
    new = 24 if quick else 48
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        res["detail"] = f"vLLM not installed ({exc}): run scripts/install_vllm.sh"
        return res
    problems = []
    try:
        with _one_thread():
            for degree in (1, 2, 4, 8):
                prefix = _prompt(seed, 1000, prefix_blocks * S)
                reqs = {f"s{i}": prefix + _prompt(seed, i, suffix_blocks * S) for i in range(degree)}
                first = {"s0": reqs["s0"]}
                late = {r: p for r, p in reqs.items() if r != "s0"}
                per = suffix_blocks + -(-new // S) + 1
                nb = 2 + 8 + prefix_blocks + degree * per
                kw = dict(prompts=first, late=late, max_tokens=new, policy="random", seed=seed, num_blocks=nb,
                          block_size=S, max_num_batched_tokens=max(2048, degree * suffix_blocks * S + 64))
                on = _run(reclaim=True, **kw)
                off = _run(reclaim=False, **kw)
                r_on, r_off = on["retained_all_running"], off["retained_all_running"]
                red = 100.0 * (r_off - r_on) / r_off if r_off else 0.0
                moved = on["stats"]["shared_blocks_moved"]
                row = {"degree": degree, "retained_off": r_off, "retained_on": r_on,
                       "reduction_pct": round(red, 1), "shared_blocks_moved": moved,
                       "hash_checks": on["hash_checks"], "hash_failures": on["hash_failures"],
                       "relocations": on["stats"]["applied"], "outputs_equal": on["outputs"] == off["outputs"],
                       "prefix_cached_tokens": on["worker"]["cached_tokens"],
                       "retained_mean_off": round(off["retained_mean"], 1),
                       "retained_mean_on": round(on["retained_mean"], 1)}
                res["rows"].append(row)
                if not r_on < r_off:
                    problems.append(f"degree {degree}: retained {r_off} -> {r_on}, no reduction")
                if moved or on["hash_failures"]:
                    problems.append(f"degree {degree}: {moved} shared blocks moved, {on['hash_failures']} hash failures")
                if degree > 1 and on["worker"]["cached_tokens"] < (degree - 1) * prefix_blocks * S:
                    problems.append(f"degree {degree}: prefix not shared ({on['worker']['cached_tokens']} cached "
                                    f"tokens, want {(degree - 1) * prefix_blocks * S})")
                if not row["outputs_equal"]:
                    problems.append(f"assumption broken: {ASSUMPTIONS['outputs_equal']} [outputs_equal]: "
                                    f"degree {degree}")
    except Exception as exc:  # noqa: BLE001
        res["detail"] = _broken(exc)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        return res
    res["passed"] = not problems
    table = ", ".join(f"d={r['degree']}: {r['retained_off']}->{r['retained_on']} (-{r['reduction_pct']}%)"
                      for r in res["rows"])
    res["detail"] = ("; ".join(problems) + "; " if problems else "") + \
        f"retained blocks off->on with all requests running, block size {S}, prefix {prefix_blocks} blocks " \
        f"shared, suffix {suffix_blocks} blocks private, random eviction 50%: {table}; shared blocks moved: " \
        f"{sum(r['shared_blocks_moved'] for r in res['rows'])}; hash checks " \
        f"{sum(r['hash_checks'] for r in res['rows'])}, failures {sum(r['hash_failures'] for r in res['rows'])}"
    res["figures"] = _sharing_figures(res["rows"])
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


# ---------------------------------------------------------------------------- check_assumptions
def check_assumptions() -> list[dict]:
    """Each runtime assumption of the adapter, checked on one short run (prefix sharing,
    relocation, preemption under a small pool, copies completing late, async scheduling).
    Returns ``[{"name", "passed", "detail"}]``; ``passed`` is None for a check the run
    could not reach because an earlier one broke. Never raises."""
    names = [n for n in ASSUMPTIONS if n != "outputs_equal"]
    out = {n: {"name": n, "passed": True, "detail": f"held: {ASSUMPTIONS[n]}"} for n in names}
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return [{"name": n, "passed": False, "detail": f"vLLM not installed ({exc})"} for n in names]
    info = ""
    try:
        with _one_thread():
            S = 8
            prefix = _prompt(7, 500, 4 * S)
            first = {"a0": prefix + _prompt(7, 0, 3 * S + 3)}
            late = {f"a{i}": (prefix if i < 3 else []) + _prompt(7, i, 3 * S + 2 * i) for i in range(1, 6)}
            run = _run(reclaim=True, prompts=first, late=late, max_tokens=40, policy="random", seed=7,
                       num_blocks=44, block_size=S, copy_lag=1, headroom=4)
            st = run["stats"]
            info = (f"{st['applied']} relocations, {run['hash_checks']} hash checks, {st['sources_freed']} sources "
                    f"freed at their fence, {st['released_empty']} empty blocks released, "
                    f"{run['worker']['cached_tokens']} prefix-cached tokens, hashes kept {st['hashes_kept']} / "
                    f"evicted {st['hashes_evicted']}, {st['orphaned_plans']} orphaned plans, "
                    f"{st['preemptions']} preemptions")
            if st["applied"] == 0:
                out["fence"].update(passed=False, detail="no relocation happened: the fence was not exercised")
            if run["hash_failures"]:
                out["hash_and_compare"].update(passed=False, detail=f"{run['hash_failures']} hash failures")
            if run["free_end"] != run["N"] - 1:
                out["all_returned"].update(passed=False, detail=f"free {run['free_end']} != {run['N'] - 1}")
    except AdapterAssumptionError as exc:
        for n in names:
            if n == exc.check:
                out[n].update(passed=False, detail=str(exc))
            else:
                out[n].update(passed=None, detail=f"not evaluated to the end: the run stopped at [{exc.check}]")
        return [out[n] for n in names]
    except Exception as exc:  # noqa: BLE001
        detail = _broken(exc)
        name = "hash_and_compare" if "[hash_and_compare]" in detail else None
        for n in names:
            if n == name:
                out[n].update(passed=False, detail=detail)
            else:
                out[n].update(passed=None if name else False,
                              detail=detail if not name else "not evaluated: the run stopped")
        return [out[n] for n in names]
    for n in names:
        if out[n]["passed"]:
            out[n]["detail"] += f" ({info})"
    return [out[n] for n in names]
