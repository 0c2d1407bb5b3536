"""The capacity frontier (paper Fig. 9 and 10).

Setting: Llama-3.1-8B geometry (32 layers, 8 KV heads, head dim 128, fp16: 128 KiB of K/V
per token, 2 MiB per block of 16), block size 16, 12K (12,288-token) outputs, prompts of
4,032 tokens so that a fully retained request needs exactly 1,020 blocks, H2O with a keep
budget of 8,192 tokens (ideal packed footprint 512 blocks; recent window 4,096). All C
requests are admitted at step 0 and decode in lockstep (the worst case for a shared peak).
A budget of N blocks has N - 1 usable ones (block 0 is the null block, as in vLLM).

A concurrency C is **feasible** when every request completes without preemption: a
request that needs a block when none is free is preempted and the run is infeasible.
The frontier is the largest feasible C (searched upward from the ideal if feasible there,
else by bisection; feasibility is assumed monotone in C).

- **Native** and **Naive-Evict** requests do not interact, so one unconstrained run of
  C_max requests gives every C's peak demand (prefix sums of per-request block counts);
  the predicted frontier is then confirmed by budget-constrained runs at C and C + 1.
- **vToken** requests interact (shared headroom, planner order), so every point is a
  budget-constrained run. Headroom is reserved out of the same budget.

Normalised demand = peak (used + reserved) blocks / usable blocks.
"""

from __future__ import annotations

import time

import numpy as np

from vtoken.planner import PlannerConfig

from . import report as rep
from .engine import Replay
from .parallel import default_jobs, run_tasks
from .schedule import fixed_budget, make_schedule
from .stats import fmt, int_summary, summary
from .traces import frontier_request_shape
from .workloads import method_md

PAPER = {"5427": {"native": 5, "naive_evict": 5, "vtoken": 8}, "11519": {"native": 11, "naive_evict": 11, "vtoken": 22}}
BUDGETS = (5427, 11519)
GEOMETRY = dict(model="Llama-3.1-8B", layers=32, kv_heads=8, head_dim=128, dtype="fp16",
                kv_bytes_per_token=2 * 32 * 8 * 128 * 2)

# The tuned vToken: reclaim when free blocks fall to the low watermark (no F gate: at the
# ideal packing F must stay below ~2%), big plans, a 48-block headroom, check every step.
TUNED = dict(theta_f=0.0, check_every=1, max_sources=128, headroom=48, low_watermark=48, max_plans_per_round=2)
# The planner module's defaults with the paper's theta_F = 0.25.
DEFAULT = dict(theta_f=0.25, check_every=1, max_sources=8, headroom=8, low_watermark=None)
# One factor at a time away from TUNED, at the large budget and C = ideal.
ABLATIONS = [
    ("check_every=2", dict(check_every=2), 1), ("check_every=4", dict(check_every=4), 1),
    ("copy latency 2", {}, 2),
    ("headroom=16", dict(headroom=16), 1), ("headroom=8", dict(headroom=8), 1),
    ("max_sources=8", dict(max_sources=8), 1), ("theta_F=0.25", dict(theta_f=0.25), 1),
    ("low_watermark=16", dict(low_watermark=16), 1), ("no watermark (eager)", dict(low_watermark=None), 1),
]


def setting(quick: bool) -> dict:
    if quick:  # 1/16 of the paper's scale: 64-block requests, 32-block ideal, budgets / 16
        return dict(S=16, full_blocks=64, output=768, keep=512, budgets={"5427": 340, "11519": 720},
                    window=8, seeds=2, scale=1 / 16, tuned=dict(TUNED, headroom=8, low_watermark=24),
                    default=dict(DEFAULT), curve={"5427": [], "11519": [8]}, ablations=ABLATIONS[1:2])
    return dict(S=16, full_blocks=1020, output=12288, keep=8192, budgets={str(b): b for b in BUDGETS},
                window=16, seeds=5, scale=1.0, tuned=dict(TUNED), default=dict(DEFAULT),
                curve={"5427": [4, 8], "11519": [8, 16]}, ablations=ABLATIONS)


def _ideal(st, nb):
    return (nb - 1) // -(-st["keep"] // st["S"])


# ------------------------------------------------------------------------- tasks
def _task_schedules(seed, ids, st):
    P, O = frontier_request_shape(st["full_blocks"], st["S"], st["output"])
    return seed, [make_schedule(P, O, "h2o", fixed_budget(st["keep"]), seed, 10_000 + i, window=st["window"],
                                recent=st["keep"] // 2) for i in ids]


def _compact(res: dict) -> dict:
    keep = ("feasible", "preempted_at", "peak_demand", "peak_norm", "peak_info", "wall_s", "inflight_victims",
            "steps", "usable")
    out = {k: res[k] for k in keep}
    if "planner" in res:
        out["planner"] = res["planner"]
    return out


def _run(scheds, mode, nb, C, st, cfg=None, latency=1, timeline=True):
    rp = Replay(scheds[:C], mode, st["S"], nb, planner=PlannerConfig(**cfg) if cfg else None, latency=latency,
                sample_every=0, flush_every=64, timeline=timeline, timeline_every=32)
    out = _compact(rp.run())
    out["C"] = C
    if timeline:
        out["timeline"] = rp.demand_tl
    return out


def _task_unconstrained(seed, mode, scheds, st):
    """Per-C peak demand of a non-interacting system from one run of all requests."""
    C = len(scheds)
    rp = Replay(scheds, mode, st["S"], C * st["full_blocks"] + 2, sample_every=0, flush_every=64,
                req_timeline=True)
    res = rp.run()
    tl = np.asarray([row for row in rp.req_tl if len(row) == C], dtype=np.int64)
    pref = np.cumsum(tl, axis=1)  # [t, C-1]: demand of the first C requests
    peaks = pref.max(axis=0)
    # demand over time of the first C requests, downsampled, for the timeline plot
    return seed, mode, dict(peaks=peaks.tolist(), wall_s=res["wall_s"], prefix_timeline=pref[::32].tolist())


def _search(run, start: int, cmax: int, lo_hint: int = 0) -> tuple[int, dict]:
    """Largest feasible C in [0, cmax]: try ``start``, walk up while feasible, else bisect
    below it (from ``lo_hint`` when that is feasible). ``run(C)`` -> result dict (cached)."""
    cache: dict = {}

    def ok(C):
        if C <= 0:
            return True
        if C not in cache:
            cache[C] = run(C)
        return cache[C]["feasible"]

    start = max(1, min(start, cmax))
    if ok(start):
        lo = start
        while lo < cmax and ok(lo + 1):
            lo += 1
        return lo, cache
    lo, hi = 0, start
    if 0 < lo_hint < start:
        if ok(lo_hint):
            lo = lo_hint
        else:
            hi = lo_hint
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, cache


def _task_budget(seed, label, nb, scheds, st, predicted: dict, curve: list):
    """All constrained runs for one (seed, budget)."""
    t0 = time.perf_counter()
    cmax = len(scheds)
    out = {"seed": seed, "budget": label}
    # native / naive: confirm the unconstrained prediction at C and C + 1
    for mode in ("native", "naive_evict"):
        C = predicted[mode]
        lo, cache = _search(lambda c: _run(scheds, mode, nb, c, st), C, cmax)
        out[mode] = dict(frontier=lo, predicted=C, runs={c: {k: v for k, v in r.items() if k != "timeline"}
                                                         for c, r in cache.items()})
    ideal = _ideal(st, nb)
    per_req = -(-st["keep"] // st["S"])
    for name, cfg in (("vtoken", st["tuned"]), ("vtoken_default", st["default"])):
        # first guess: the ideal; with an F > theta_F gate, requests settle near per_req / (1 - theta_F)
        start = ideal if cfg["theta_f"] <= 0.05 else max(1, int((nb - 1) * (1 - cfg["theta_f"]) // per_req))
        lo, cache = _search(lambda c: _run(scheds, "vtoken", nb, c, st, cfg), start, cmax,
                            lo_hint=max(out["naive_evict"]["frontier"], 1))
        if name == "vtoken":
            for c in curve:
                if c not in cache and c <= cmax:
                    cache[c] = _run(scheds, "vtoken", nb, c, st, cfg)
        for c, r in cache.items():  # keep one demand timeline: at the frontier, for the plot
            if c != lo or name != "vtoken":
                r.pop("timeline", None)
        out[name] = dict(frontier=lo, runs=cache)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _dispatch(kind, a):
    return _task_budget(*a) if kind == "budget" else _task_ablation(*a)


def _task_ablation(seed, label, nb, scheds, st, name, over, latency, C):
    cfg = dict(st["tuned"], **over)
    r = _run(scheds, "vtoken", nb, C, st, cfg, latency=latency, timeline=False)
    return seed, name, r


# ------------------------------------------------------------------------- the experiment
def run_frontier(budgets=None, quick: bool = False, seeds: int | None = None, out=None, jobs: int | None = None,
                 ablations: bool = True) -> dict:
    """Find the highest feasible concurrency per system and budget; returns the result dict
    (``frontier[budget] = {native, naive_evict, vtoken}``, medians over seeds)."""
    st = setting(quick)
    n_seeds = seeds or st["seeds"]
    jobs = jobs or default_jobs(quick)
    blist = {str(b): st["budgets"].get(str(b), int(b)) for b in (budgets or BUDGETS)}
    t0 = time.perf_counter()
    ideal = {k: _ideal(st, nb) for k, nb in blist.items()}
    cmax = max(ideal.values()) + 1
    per_req = -(-st["keep"] // st["S"])

    # 1. schedules (policy decisions), in parallel chunks
    chunks = [list(range(i, min(cmax, i + 6))) for i in range(0, cmax, 6)]
    got = run_tasks(_task_schedules, [(s, ids, st) for s in range(n_seeds) for ids in chunks], jobs)
    scheds = {s: [] for s in range(n_seeds)}
    for s, lst in got:
        scheds[s].extend(lst)
    t_sched = time.perf_counter() - t0

    # 2. unconstrained curves for the non-interacting systems
    unc = run_tasks(_task_unconstrained, [(s, m, scheds[s], st) for s in range(n_seeds)
                                          for m in ("native", "naive_evict")], jobs)
    peaks = {(s, m): d for s, m, d in unc}

    # 3. constrained runs: frontier searches (+ vToken curve points), and the ablations
    tasks = []
    for s in range(n_seeds):
        for label, nb in blist.items():
            pred = {m: int(np.sum(np.asarray(peaks[(s, m)]["peaks"]) <= nb - 1)) for m in ("native", "naive_evict")}
            tasks.append((s, label, nb, scheds[s], st, pred, st["curve"].get(label, [])))
    atasks = []
    if ablations:
        big = max(blist, key=lambda k: blist[k])
        atasks = [(s, big, blist[big], scheds[s], st, name, over, lat, ideal[big])
                  for s in range(n_seeds) for name, over, lat in st["ablations"]]
    # one batch, biggest budgets first, so the two workers stay busy to the end
    tasks.sort(key=lambda a: -a[2])
    mixed = run_tasks(_dispatch, [("budget", a) for a in tasks] + [("ablation", a) for a in atasks], jobs)
    budget_res = mixed[:len(tasks)]
    abl_res = mixed[len(tasks):]

    # 4. aggregate
    frontier, spread, detail = {}, {}, {}
    for label in blist:
        rs = [r for r in budget_res if r["budget"] == label]
        frontier[label], spread[label], detail[label] = {}, {}, {}
        for sysname in ("native", "naive_evict", "vtoken", "vtoken_default"):
            summ = int_summary([r[sysname]["frontier"] for r in rs])
            spread[label][sysname] = summ
            if sysname != "vtoken_default":
                frontier[label][sysname] = summ["median"]
        # peak decomposition of vToken at its frontier (per seed)
        pk = []
        for r in rs:
            c = r["vtoken"]["frontier"]
            if c in r["vtoken"]["runs"]:
                pk.append(r["vtoken"]["runs"][c])
        detail[label]["vtoken_at_frontier"] = _peak_summary(pk, per_req)
        fails = [r["vtoken"]["runs"].get(r["vtoken"]["frontier"] + 1) for r in rs]
        detail[label]["vtoken_first_infeasible"] = dict(
            preempted_step=summary([f["preempted_at"]["step"] for f in fails if f and f.get("preempted_at")]),
            why="the live tokens alone exceed the budget" if (r["vtoken"]["frontier"] + 1) * per_req > blist[label] - 1
            else "planner could not keep up")
        dfl = [r["vtoken_default"]["runs"].get(r["vtoken_default"]["frontier"] + 1) for r in rs]
        detail[label]["vtoken_default_first_infeasible"] = _peak_summary([f for f in dfl if f], per_req)
        detail[label]["predicted"] = {m: [r[m]["predicted"] for r in rs] for m in ("native", "naive_evict")}
        detail[label]["confirmed"] = {m: all(r[m]["predicted"] == r[m]["frontier"] for r in rs)
                                      for m in ("native", "naive_evict")}
    curves = _curves(blist, budget_res, peaks, n_seeds, st)
    abl = {}
    for s, name, r in abl_res:
        abl.setdefault(name, []).append(r)
    abl_table = {name: dict(feasible_seeds=sum(r["feasible"] for r in rs), seeds=len(rs),
                            preempted_step=summary([r["preempted_at"]["step"] for r in rs if r["preempted_at"]]),
                            peak_norm=summary([r["peak_norm"] for r in rs]),
                            moves=summary([r["planner"]["moves"] for r in rs]),
                            plans=summary([r["planner"]["plans"] for r in rs]),
                            deferred=summary([r["planner"]["deferred"] for r in rs]))
                 for name, rs in abl.items()}
    paper = {k: PAPER.get(k) for k in blist}
    result = dict(experiment="frontier", quick=quick, seeds=n_seeds, budgets=blist, frontier=frontier,
                  ideal=ideal, paper=paper, spread=spread, detail=detail, curves=curves,
                  ablations=dict(budget=max(blist, key=lambda k: blist[k]) if blist else None,
                                 C=ideal[max(blist, key=lambda k: blist[k])] if blist else None, table=abl_table),
                  setting={k: v for k, v in st.items() if k not in ("ablations",)}, geometry=GEOMETRY,
                  copy_engine="NullCopyEngine(latency=1): sources freed two scheduler steps after the plan, never before the copy",
                  schedule_s=t_sched, wall_s=time.perf_counter() - t0)
    fig = _plot(result, budget_res, peaks, st)
    md = _markdown(result, st)
    result["files"] = rep.write(rep.out_dir(out), "frontier", result, md, fig)
    return result


def _peak_summary(runs, per_req) -> dict:
    if not runs:
        return {}
    keys = ("demand", "used", "reserved", "headroom_idle", "inflight_sources", "inflight_dests", "ideal_packed",
            "fragmentation", "partial_tails", "step")
    out = {k: summary([r["peak_info"].get(k, 0) for r in runs]) for k in keys}
    out["peak_norm"] = summary([r["peak_norm"] for r in runs])
    out["moves"] = summary([r.get("planner", {}).get("moves", 0) for r in runs])
    out["plans"] = summary([r.get("planner", {}).get("plans", 0) for r in runs])
    out["deferred_plans"] = summary([r.get("planner", {}).get("deferred", 0) for r in runs])
    out["inflight_victims"] = summary([r["inflight_victims"] for r in runs])
    out["feasible"] = [r["feasible"] for r in runs]
    out["C"] = [r["C"] for r in runs]
    return out


def _curves(blist, budget_res, peaks, n_seeds, st) -> dict:
    out = {}
    for label, nb in blist.items():
        usable = nb - 1
        cur = {}
        for m in ("native", "naive_evict"):
            arr = np.asarray([peaks[(s, m)]["peaks"] for s in range(n_seeds)], dtype=np.float64) / usable
            cur[m] = {str(c + 1): summary(arr[:, c]) for c in range(arr.shape[1])}
        vt: dict = {}
        for r in budget_res:
            if r["budget"] != label:
                continue
            for c, run in r["vtoken"]["runs"].items():
                vt.setdefault(int(c), []).append(run)
        cur["vtoken"] = {str(c): dict(peak_norm=summary([x["peak_norm"] for x in rs]),
                                      feasible=sum(x["feasible"] for x in rs), n=len(rs))
                         for c, rs in sorted(vt.items())}
        out[label] = cur
    return out


def _plot(result, budget_res, peaks, st):
    plt = rep.plt()
    labels = list(result["budgets"])
    fig, axes = plt.subplots(2, len(labels), figsize=(6.2 * len(labels), 8), squeeze=False)
    per_req = -(-st["keep"] // st["S"])
    for j, label in enumerate(labels):
        usable = result["budgets"][label] - 1
        ax = axes[0][j]
        cur = result["curves"][label]
        for m, lab, mk in (("native", "Native", "s-"), ("naive_evict", "Naive-Evict", "^-")):
            cs = [int(c) for c in cur[m]]
            med = [cur[m][str(c)]["median"] for c in cs]
            ax.plot(cs, med, mk, ms=4, label=f"{lab} (C={result['frontier'][label][m]})")
            ax.fill_between(cs, [cur[m][str(c)]["min"] for c in cs], [cur[m][str(c)]["max"] for c in cs], alpha=0.2)
        vt = cur["vtoken"]
        cs = [int(c) for c in vt]
        ax.plot(cs, [vt[str(c)]["peak_norm"]["median"] for c in cs], "o-", color="C3",
                label=f"vToken (C={result['frontier'][label]['vtoken']})")
        bad = [c for c in cs if vt[str(c)]["feasible"] < vt[str(c)]["n"]]
        ax.plot(bad, [vt[str(c)]["peak_norm"]["median"] for c in bad], "x", color="k", ms=10, mew=2,
                label="infeasible (preempted)")
        cs_all = np.arange(1, max(int(c) for c in cur["native"]) + 1)
        ax.plot(cs_all, cs_all * per_req / usable, ":", color="grey", label=f"ideal packing (C={result['ideal'][label]})")
        pv = (result["paper"].get(label) or {}).get("vtoken")
        if pv:
            ax.plot([pv], [1.0], "*", color="C2", ms=14, label=f"paper's vToken (C={pv})")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylim(0, 2.2)
        ax.set_xlabel("concurrency C")
        ax.set_ylabel("peak blocks / budget")
        ax.set_title(f"budget {label} blocks" + (f" (simulated {result['budgets'][label]})" if st["scale"] != 1 else ""))
        ax.legend(fontsize=7)
        # timeline at vToken's frontier, seed 0
        ax = axes[1][j]
        r0 = next((r for r in budget_res if r["budget"] == label and r["seed"] == 0), None)
        if r0 is not None:
            C = r0["vtoken"]["frontier"]
            run = r0["vtoken"]["runs"].get(C, {})
            if "timeline" in run:
                tl = np.asarray(run["timeline"])[:-2]  # the last samples are after the requests finished
                ax.plot(tl[:, 0], tl[:, 1] / usable, color="C3", label=f"vToken, C={C}")
            for m, lab in (("native", "Native"), ("naive_evict", "Naive-Evict")):
                pt = np.asarray(peaks[(0, m)]["prefix_timeline"])
                if C >= 1 and pt.size:
                    ax.plot(np.arange(len(pt)) * 32, pt[:, C - 1] / usable, label=f"{lab}, C={C} (unconstrained)")
            P, _ = frontier_request_shape(st["full_blocks"], st["S"], st["output"])
            steps = np.arange(0, st["output"] + 1, 16)
            ax.plot(steps, C * np.ceil(np.minimum(P + steps, st["keep"]) / st["S"]) / usable, ":", color="grey",
                    label="ideal packing (live tokens)")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xlabel("decode step")
            ax.set_ylabel("blocks in use / budget")
            ax.set_title(f"demand over time at C={C} (seed 0)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _markdown(res, st) -> str:
    P, O = frontier_request_shape(st["full_blocks"], st["S"], st["output"])
    L = []
    L.append("# Capacity frontier (paper Fig. 9 and 10)\n")
    L.append(f"Llama-3.1-8B geometry (32 layers, 8 KV heads, head dim 128, fp16: "
             f"{GEOMETRY['kv_bytes_per_token'] // 1024} KiB/token), block size {st['S']}, prompt {P} + output {O} "
             f"tokens (fully retained: {st['full_blocks']} blocks), H2O keep budget {st['keep']} tokens "
             f"(ideal packed footprint {-(-st['keep'] // st['S'])} blocks, recent window {st['keep'] // 2}). All C "
             f"requests start together. Feasible = no request ever finds no free block. Median [min, max] over "
             f"{res['seeds']} seeds.\n")
    if st["scale"] != 1:
        L.append(f"*Quick mode: 1/16 scale; budgets simulated as {res['budgets']}.*\n")
    rows = []
    for label in res["budgets"]:
        sp = res["spread"][label]
        pp = res["paper"].get(label) or {}
        rows.append([label] + [f"{sp[m]['median']} [{sp[m]['min']}, {sp[m]['max']}] (paper {pp.get(m, '-')})"
                               for m in ("native", "naive_evict", "vtoken")]
                    + [f"{sp['vtoken_default']['median']} [{sp['vtoken_default']['min']}, {sp['vtoken_default']['max']}]",
                       res["ideal"][label]])
    L.append(rep.md_table(["budget", "Native", "Naive-Evict", "vToken (tuned)", "vToken (planner defaults)", "ideal"], rows))
    L.append(f"\nvToken (tuned) planner: `{st['tuned']}`; planner defaults: `{st['default']}` "
             f"(theta_F = 0.25, B = 8, headroom 8, no watermark). Copy engine: {res['copy_engine']}.\n")
    L.append("## What the peak is made of (vToken tuned, at its frontier)\n")
    rows = []
    for label in res["budgets"]:
        d = res["detail"][label]["vtoken_at_frontier"]
        if not d:
            continue
        rows.append([label, fmt(d["demand"], digits=0), fmt(d["ideal_packed"], digits=0),
                     fmt(d["fragmentation"], digits=0), fmt(d["reserved"], digits=0),
                     fmt(d["inflight_sources"], digits=0), fmt(d["partial_tails"], digits=0),
                     fmt(d["peak_norm"], pct=True), fmt(d["moves"], digits=0), fmt(d["plans"], digits=0),
                     fmt(d["inflight_victims"], digits=0)])
    L.append(rep.md_table(["budget", "peak demand", "ideal packed (live)", "fragmentation (held - ideal)",
                           "reserved (headroom + in-flight dests)", "in-flight sources", "partial tails",
                           "peak / budget", "moves", "plans", "victims deferred (in a copying source)"], rows))
    L.append("\nThe lazy planner lets demand rise to the watermark and then reclaims just enough, so at the "
             "frontier the peak sits at the budget: the slack above the ideal is spent on fragmentation between "
             "plans, the reserved headroom and in-flight copies (sources still held until their copy lands).\n")
    for label in res["budgets"]:
        d = res["detail"][label].get("vtoken_default_first_infeasible") or {}
        if d:
            L.append(f"- budget {label}: vToken with the planner defaults fails at C = {d['C']} with fragmentation "
                     f"{fmt(d['fragmentation'], digits=0)} blocks held above the ideal "
                     f"({d['fragmentation']['median'] / max(d['demand']['median'], 1) * 100:.0f}% of the budget): "
                     f"the F > theta_F gate never lets F fall below ~theta_F, so each request holds ~1/(1 - theta_F) "
                     f"of its packed footprint.")
    for label in res["budgets"]:
        f1 = res["detail"][label]["vtoken_first_infeasible"]
        L.append(f"- budget {label}: vToken at C+1 fails because {f1['why']} "
                 f"(preempted at step {fmt(f1['preempted_step'], digits=0)}).")
    L.append("")
    ab = res["ablations"]
    if ab["table"]:
        L.append(f"## What holds vToken back: one factor at a time (budget {ab['budget']}, C = {ab['C']})\n")
        rows = [[name, f"{v['feasible_seeds']}/{v['seeds']}", fmt(v["preempted_step"], digits=0),
                 fmt(v["moves"], digits=0), fmt(v["plans"], digits=0), fmt(v["deferred"], digits=0)]
                for name, v in ab["table"].items()]
        L.append(rep.md_table(["change from tuned", "feasible seeds", "preempted at step", "moves", "plans",
                               "plans deferred (headroom short)"], rows))
        L.append("")
    L.append("## Normalised demand against concurrency\n")
    for label in res["budgets"]:
        cur = res["curves"][label]
        rows = []
        for c, v in cur["vtoken"].items():
            rows.append([c, fmt(cur["native"].get(c, {"median": None}), pct=True) if c in cur["native"] else "-",
                         fmt(cur["naive_evict"][c], pct=True) if c in cur["naive_evict"] else "-",
                         fmt(v["peak_norm"], pct=True), f"{v['feasible']}/{v['n']}"])
        L.append(f"Budget {label} (Native / Naive-Evict: unconstrained need; vToken: constrained run):\n")
        L.append(rep.md_table(["C", "Native", "Naive-Evict", "vToken", "vToken feasible seeds"], rows))
        L.append("")
    L.append(method_md(st["window"]))
    return "\n".join(L)
