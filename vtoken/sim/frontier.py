"""The capacity frontier (paper Fig. 9 and 10).

Setting: Llama-3.1-8B geometry (128 KiB of K/V per token, 2 MiB per block of 16), 12,288-token
outputs, 4,032-token prompts (1,020 blocks fully retained), H2O keeping 8,192 tokens (ideal
footprint 512 blocks; recent window 4,096); all C requests admitted at step 0. A budget of
N blocks has N - 1 usable (block 0 is null). The Qwen2.5-14B row: the same trace on that
model's budget (:func:`kv_budget`).

C is **feasible** when every request completes without preemption; the frontier is the
largest feasible C, at most the ideal ``floor((N - 1) / 512)``. Native and Naive-Evict: one
unconstrained run gives every C's peak demand, confirmed by constrained runs at C and C + 1.
vToken: constrained runs from the ideal down (bisection when it fails); ``vtoken_default``
is ``PlannerConfig()``, ``vtoken`` the hand-tuned comparison point. ``traffic``: per plan,
tokens moved and blocks freed against the lower bound (the live tokens of that many of its
emptiest sources). Normalised demand = peak (used + reserved) / usable blocks.

Owns: nothing (each run's Replay lives in its task; writes only the result files).
May call: vtoken.sim (replay, schedule, parallel, stats, traces, workloads, report, config), vtoken.planner,
numpy; never spec/, invariants/, fuzz/ or reports/.
Costs: one Replay of 16K steps per (C, budget, seed) point, bisection for vToken: minutes to hours;
quick seconds.
"""

from __future__ import annotations

import time

import numpy as np

from vtoken.planner import PlannerConfig

from . import report as rep
from .config import need_run_args
from .replay import Replay
from .parallel import default_jobs, run_tasks
from .schedule import cached_schedule, fixed_budget
from .stats import fmt, int_summary, summary
from .traces import frontier_request_shape
from .workloads import method_md

BUDGETS = (5427, 11519)
QWEN = "qwen-3438"  # the Qwen2.5-14B budget's label (blocks: kv_budget("Qwen2.5-14B", 0.50))
GEOMETRIES = {
    # params: what the weights take (bf16/fp16, 2 bytes each); kv_bytes_per_token = 2 (K, V) x layers x kv heads x head dim x 2
    "Llama-3.1-8B": dict(layers=32, kv_heads=8, head_dim=128, dtype="fp16", params=8.03e9,
                         kv_bytes_per_token=2 * 32 * 8 * 128 * 2),
    "Qwen2.5-14B": dict(layers=48, kv_heads=8, head_dim=128, dtype="bf16", params=14.7e9,
                        kv_bytes_per_token=2 * 48 * 8 * 128 * 2),
}
GEOMETRY = dict(model="Llama-3.1-8B", **{k: v for k, v in GEOMETRIES["Llama-3.1-8B"].items() if k != "params"})
PAPER = {"5427": {"native": 5, "naive-evict": 5, "vtoken": 8}, "11519": {"native": 11, "naive-evict": 11, "vtoken": 22},
         # the paper: Native and Naive-Evict fail at C = 4, vToken feasible through C = 6 (fails at C = 8)
         QWEN: {"native": "<4", "naive-evict": "<4", "vtoken": 6}}


def kv_budget(model: str, gpu_mem_util: float, block_size: int = 16) -> int:
    """KV blocks vLLM gives ``model`` on the paper's H100 at ``gpu_mem_util``:
    ``util x M - weights - other``, with M = 79.3 GiB and other = 2.2 GiB solved from the
    paper's two Llama-3.1-8B budgets (5,427 blocks at 0.35, 11,519 at 0.50) and ``other``
    assumed the same for every model (Qwen2.5-14B at 0.50: 3,438 blocks of 3 MiB)."""
    llama = GEOMETRIES["Llama-3.1-8B"]
    blk_l = llama["kv_bytes_per_token"] * block_size
    M = (11519 - 5427) * blk_l / 0.15
    other = 0.35 * M - 5427 * blk_l - 2 * llama["params"]
    g = GEOMETRIES[model]
    return int((gpu_mem_util * M - 2 * g["params"] - other) // (g["kv_bytes_per_token"] * block_size))


# The hand-tuned comparison point (the "vtoken" column), out of place: reclaim only when free
# blocks fall to 48 (theta_F = 1.0: the F gate never opens on its own), big plans, 48 headroom,
# 2 plans per round.
TUNED = dict(theta_f=1.0, check_every=1, max_sources=128, headroom=48, low_watermark=48, max_plans_per_round=2,
             in_place=False)
# The shipped defaults: PlannerConfig() as it is.
DEFAULT: dict = {}
# One factor at a time away from the shipped defaults, at the large budget and C = ideal
# (copy latency and check interval: the robustness experiment).
ABLATIONS = [
    ("paper trigger: F > 0.25 only (no watermark)", dict(low_watermark=-1), 1),
    ("fixed watermark 16", dict(low_watermark=16), 1),
    ("out of place, headroom 64 (the paper's compaction)", dict(in_place=False, headroom=64), 1),
    ("out of place, headroom 16", dict(in_place=False, headroom=16), 1),
    ("max_sources 16", dict(max_sources=16), 1), ("max_sources 8", dict(max_sources=8), 1),
]


def setting(quick: bool) -> dict:
    if quick:  # 1/16 of the paper's scale: 64-block requests, 32-block ideal, budgets / 16, headroom / 16
        return dict(S=16, full_blocks=64, output=768, keep=512,
                    budgets={"5427": 340, "11519": 720, QWEN: kv_budget("Qwen2.5-14B", 0.5) // 16},
                    geometry={"5427": "Llama-3.1-8B", "11519": "Llama-3.1-8B", QWEN: "Qwen2.5-14B"},
                    window=8, seeds=2, robust_seeds=1, robust_grid=((0, 4), (1, 4)), scale=1 / 16, tuned=dict(TUNED, headroom=8, low_watermark=24),
                    default=dict(headroom=PlannerConfig().headroom // 16), curve={"5427": [], "11519": [8], QWEN: []},
                    ablations=ABLATIONS[2:3], ablation_seeds=1, curve_seeds=1)
    return dict(S=16, full_blocks=1020, output=12288, keep=8192,
                budgets={"5427": 5427, "11519": 11519, QWEN: kv_budget("Qwen2.5-14B", 0.5)},
                geometry={"5427": "Llama-3.1-8B", "11519": "Llama-3.1-8B", QWEN: "Qwen2.5-14B"},
                window=16, seeds=5, robust_seeds=2, robust_grid=((0, 1, 2, 3, 4), (1, 2, 3, 4)), scale=1.0, tuned=dict(TUNED), default=dict(DEFAULT),
                curve={"5427": [4, 8], "11519": [8, 16], QWEN: [2, 4]}, ablations=ABLATIONS, ablation_seeds=2,
                curve_seeds=2)


def geometry_budgets(st) -> dict:
    """label -> (model, blocks) of the setting's budgets."""
    return {k: (st["geometry"][k], nb) for k, nb in st["budgets"].items()}


def _ideal(st, nb):
    return (nb - 1) // -(-st["keep"] // st["S"])


# ------------------------------------------------------------------------- tasks
def _task_schedules(seed, ids, st):
    P, O = frontier_request_shape(st["full_blocks"], st["S"], st["output"])
    return seed, [cached_schedule(P, O, "h2o", fixed_budget(st["keep"]), seed, 10_000 + i, window=st["window"],
                                recent=st["keep"] // 2) for i in ids]


def _compact(res: dict) -> dict:
    keep = ("feasible", "preempted_at", "peak_demand", "peak_norm", "peak_info", "wall_s", "inflight_victims",
            "steps", "usable")
    out = {k: res[k] for k in keep}
    for k in ("planner", "traffic"):
        if k in res:
            out[k] = res[k]
    return out


def _run(scheds, mode, nb, C, st, cfg=None, latency=1, timeline=True):
    rp = Replay(scheds[:C], mode, st["S"], nb, planner=PlannerConfig(**cfg) if cfg is not None else None,
                latency=latency, sample_every=0, flush_every=1024, timeline=timeline, timeline_every=32)
    out = _compact(rp.run())
    out["C"] = C
    if timeline:
        out["timeline"] = rp.demand_tl
    return out


def _task_unconstrained(seed, mode, scheds, st):
    """Per-C peak demand of a non-interacting system from one run of all requests."""
    C = len(scheds)
    rp = Replay(scheds, mode, st["S"], C * st["full_blocks"] + 2, sample_every=0, flush_every=1024,
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


def _task_budget(seed, label, nb, scheds, st, predicted: dict):
    """The frontier searches for one (seed, budget)."""
    t0 = time.perf_counter()
    cmax = len(scheds)
    out = {"seed": seed, "budget": label}
    # native / naive: confirm the unconstrained prediction at C and C + 1
    for mode in ("native", "naive-evict"):
        C = predicted[mode]
        lo, cache = _search(lambda c: _run(scheds, mode, nb, c, st, timeline=False), C, cmax)
        out[mode] = dict(frontier=lo, predicted=C, runs=cache)
    ideal = _ideal(st, nb)
    for name, cfg in (("vtoken_default", st["default"]), ("vtoken", st["tuned"])):
        # from the ideal down (ideal + 1 is infeasible by the live tokens alone)
        lo, cache = _search(lambda c: _run(scheds, "vtoken", nb, c, st, cfg, timeline=name == "vtoken_default"),
                            ideal, min(cmax, ideal), lo_hint=max(out["naive-evict"]["frontier"], 1))
        for c, r in cache.items():  # keep one demand timeline: the defaults' at the frontier, for the plot
            if c != lo:
                r.pop("timeline", None)
        out[name] = dict(frontier=lo, runs=cache)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _task_curve(seed, label, nb, scheds, st, C):
    """One point of the defaults' demand curve below the frontier (paper Fig. 10)."""
    return seed, label, C, _run(scheds, "vtoken", nb, C, st, st["default"], timeline=False)


def _task_ablation(seed, label, nb, scheds, st, name, over, latency, C):
    cfg = dict(st["default"], **over)
    r = _run(scheds, "vtoken", nb, C, st, cfg, latency=latency, timeline=False)
    return seed, name, r


def _dispatch(kind, a):
    return {"budget": _task_budget, "curve": _task_curve, "ablation": _task_ablation}[kind](*a)


def traffic_summary(runs: list) -> dict:
    """Copy traffic over runs (one per seed): tokens moved per block freed against the lower
    bound, and against the live tokens of all of each plan's sources (1.0 unless a moved token
    died in flight)."""
    trs = [r["traffic"] for r in runs if r.get("traffic") and r["traffic"].get("freed")]
    if not trs:
        return {}
    return dict(moved_over_bound=summary([t["moved"] / max(t["bound"], 1) for t in trs]),
                moved_over_source_live=summary([t["moved"] / max(t["source_live"], 1) for t in trs]),
                moved_per_block_freed=summary([t["moved"] / t["freed"] for t in trs]),
                bound_per_block_freed=summary([t["bound"] / t["freed"] for t in trs]),
                source_fill=summary([t["source_live"] / max(t["sources"], 1) for t in trs]),
                plans=summary([t["plans"] for t in trs]), moved=summary([t["moved"] for t in trs]),
                blocks_freed=summary([t["freed"] for t in trs]),
                peak_inflight_blocks=summary([t["peak_inflight_blocks"] for t in trs]))


# ------------------------------------------------------------------------- the experiment
def run_frontier(budgets=None, quick: bool = False, seeds: int | None = None, out=None, jobs: int | None = None,
                 ablations: bool = True, progress=None) -> dict:
    """Find the highest feasible concurrency per system and budget; returns the result dict
    (``frontier[budget] = {native, naive-evict, vtoken, vtoken_default}``, medians over seeds)."""
    need_run_args("run_frontier", quick, seeds, jobs)
    st = setting(quick)
    n_seeds = seeds or st["seeds"]
    jobs = jobs or default_jobs(quick)
    blist = {str(b): st["budgets"][str(b)] for b in (budgets or st["budgets"])}
    t0 = time.perf_counter()
    ideal = {k: _ideal(st, nb) for k, nb in blist.items()}
    cmax = max(ideal.values()) + 1
    per_req = -(-st["keep"] // st["S"])

    scheds = _schedules(st, n_seeds, cmax, jobs, progress)
    t_sched = time.perf_counter() - t0
    peaks = _unconstrained(scheds, st, n_seeds, jobs, progress)
    budget_res, abl_res, curve_res, big = _constrained(blist, ideal, scheds, peaks, st, n_seeds, jobs,
                                                       ablations, progress)

    frontier, spread, detail, traffic = _aggregate(blist, budget_res, per_req)
    curves = _curves(blist, budget_res, curve_res, peaks, n_seeds, st)
    abl_table = _ablation_table(abl_res)
    paper = {k: PAPER.get(k) for k in blist}
    result = dict(experiment="frontier", quick=quick, seeds=n_seeds, budgets=blist, frontier=frontier,
                  ideal=ideal, paper=paper, spread=spread, detail=detail, curves=curves, traffic=traffic,
                  geometry_of={k: st["geometry"][k] for k in blist}, geometries=GEOMETRIES,
                  planner=dict(default=dict(vars(PlannerConfig(**st["default"]))), tuned=dict(st["tuned"])),
                  ablations=dict(budget=big, C=ideal[big] if big else None, seeds=min(n_seeds, st["ablation_seeds"]),
                                 table=abl_table),
                  setting={k: v for k, v in st.items() if k not in ("ablations",)}, geometry=GEOMETRY,
                  copy_engine="NullCopyEngine(latency=1): sources freed two scheduler steps after the plan, never before the copy",
                  schedule_s=t_sched, wall_s=time.perf_counter() - t0)
    fig = _plot(result, budget_res, peaks, st)
    md = _markdown(result, st)
    result["files"] = rep.write(rep.out_dir(out), "frontier", result, md, fig)
    return result


def _schedules(st, n_seeds, cmax, jobs, progress) -> dict:
    """Policy schedules for requests ``0..cmax-1`` of every seed, in parallel chunks: ``{seed: [schedule]}``."""
    chunks = [list(range(i, min(cmax, i + 6))) for i in range(0, cmax, 6)]
    got = run_tasks(_task_schedules, [(s, ids, st) for s in range(n_seeds) for ids in chunks], jobs,
                    progress=progress and (lambda d, n: progress("frontier: schedules", d, n)))
    scheds = {s: [] for s in range(n_seeds)}
    for s, lst in got:
        scheds[s].extend(lst)
    return scheds


def _unconstrained(scheds, st, n_seeds, jobs, progress) -> dict:
    """Unconstrained demand curves of the non-interacting systems: ``{(seed, mode): result}``."""
    unc = run_tasks(_task_unconstrained, [(s, m, scheds[s], st) for s in range(n_seeds)
                                          for m in ("native", "naive-evict")], jobs,
                    progress=progress and (lambda d, n: progress("frontier: unconstrained", d, n)))
    return {(s, m): d for s, m, d in unc}


def _constrained(blist, ideal, scheds, peaks, st, n_seeds, jobs, ablations, progress) -> tuple:
    """Constrained runs in one batch (frontier searches, the defaults' demand curve, the ablations);
    returns ``(budget_res, abl_res, curve_res, big)`` with ``big`` the ablations' budget or None."""
    tasks = []
    for s in range(n_seeds):
        for label, nb in blist.items():
            pred = {m: int(np.sum(np.asarray(peaks[(s, m)]["peaks"]) <= nb - 1)) for m in ("native", "naive-evict")}
            tasks.append((s, label, nb, scheds[s], st, pred))
    ctasks = [(s, label, nb, scheds[s], st, c) for s in range(min(n_seeds, st["curve_seeds"])) for label, nb in blist.items()
              for c in st["curve"].get(label, []) if c < ideal[label]]
    atasks = []
    big = max(blist, key=lambda k: blist[k]) if blist else None
    if ablations and big is not None:
        atasks = [(s, big, blist[big], scheds[s], st, name, over, lat, ideal[big])
                  for s in range(min(n_seeds, st["ablation_seeds"])) for name, over, lat in st["ablations"]]
    # one batch, biggest first, so the two workers stay busy to the end
    tasks.sort(key=lambda a: -a[2])
    jobs_all = [("budget", a) for a in tasks] + [("ablation", a) for a in atasks] + [("curve", a) for a in ctasks]
    mixed = run_tasks(_dispatch, jobs_all, jobs, progress=progress and (lambda d, n: progress("frontier: runs", d, n)))
    budget_res = mixed[:len(tasks)]
    abl_res = mixed[len(tasks):len(tasks) + len(atasks)]
    curve_res = mixed[len(tasks) + len(atasks):]
    return budget_res, abl_res, curve_res, big


def _aggregate(blist, budget_res, per_req) -> tuple:
    """Per budget: frontier medians, their spread, the peak detail and the copy traffic over seeds;
    returns ``(frontier, spread, detail, traffic)``."""
    frontier, spread, detail, traffic = {}, {}, {}, {}
    for label in blist:
        rs = [r for r in budget_res if r["budget"] == label]
        frontier[label], spread[label], detail[label] = {}, {}, {}
        for sysname in ("native", "naive-evict", "vtoken", "vtoken_default"):
            summ = int_summary([r[sysname]["frontier"] for r in rs])
            spread[label][sysname] = summ
            frontier[label][sysname] = summ["median"]
        for sysname in ("vtoken_default", "vtoken"):
            at = [r[sysname]["runs"][r[sysname]["frontier"]] for r in rs if r[sysname]["frontier"] in r[sysname]["runs"]]
            detail[label][f"{sysname}_at_frontier"] = _peak_summary(at, per_req)
            fails = [r[sysname]["runs"].get(r[sysname]["frontier"] + 1) for r in rs]
            fails = [f for f in fails if f]
            detail[label][f"{sysname}_first_infeasible"] = dict(
                _peak_summary(fails, per_req),
                preempted_step=summary([f["preempted_at"]["step"] for f in fails if f.get("preempted_at")]),
                why="the live tokens alone exceed the budget (not run)" if not fails else "the planner could not keep up")
            traffic[label] = traffic.get(label, {})
            traffic[label][sysname] = traffic_summary(at)
        detail[label]["predicted"] = {m: [r[m]["predicted"] for r in rs] for m in ("native", "naive-evict")}
        detail[label]["confirmed"] = {m: all(r[m]["predicted"] == r[m]["frontier"] for r in rs)
                                      for m in ("native", "naive-evict")}
    return frontier, spread, detail, traffic


def _ablation_table(abl_res) -> dict:
    """Per ablation name: feasible seeds and the summaries of its runs over seeds."""
    abl = {}
    for s, name, r in abl_res:
        abl.setdefault(name, []).append(r)
    return {name: dict(feasible_seeds=sum(r["feasible"] for r in rs), seeds=len(rs),
                       preempted_step=summary([r["preempted_at"]["step"] for r in rs if r["preempted_at"]]),
                       peak_norm=summary([r["peak_norm"] for r in rs]),
                       moves=summary([r["planner"]["moves"] for r in rs]),
                       plans=summary([r["planner"]["plans"] for r in rs]),
                       deferred=summary([r["planner"]["deferred"] for r in rs]))
            for name, rs in abl.items()}


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


def _curves(blist, budget_res, curve_res, peaks, n_seeds, st) -> dict:
    out = {}
    for label, nb in blist.items():
        usable = nb - 1
        cur = {}
        for m in ("native", "naive-evict"):
            arr = np.asarray([peaks[(s, m)]["peaks"] for s in range(n_seeds)], dtype=np.float64) / usable
            cur[m] = {str(c + 1): summary(arr[:, c]) for c in range(arr.shape[1])}
        vt: dict = {}
        for r in budget_res:
            if r["budget"] != label:
                continue
            for c, run in r["vtoken_default"]["runs"].items():
                vt.setdefault(int(c), []).append(run)
        for _, lab, c, run in curve_res:
            if lab == label:
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
        for m, lab, mk in (("native", "Native", "s-"), ("naive-evict", "Naive-Evict", "^-")):
            cs = [int(c) for c in cur[m]]
            med = [cur[m][str(c)]["median"] for c in cs]
            ax.plot(cs, med, mk, ms=4, label=f"{lab} (C={result['frontier'][label][m]})")
            ax.fill_between(cs, [cur[m][str(c)]["min"] for c in cs], [cur[m][str(c)]["max"] for c in cs], alpha=0.2)
        vt = cur["vtoken"]
        cs = [int(c) for c in vt]
        ax.plot(cs, [vt[str(c)]["peak_norm"]["median"] for c in cs], "o-", color="C3",
                label=f"vToken, defaults (C={result['frontier'][label]['vtoken_default']})")
        bad = [c for c in cs if vt[str(c)]["feasible"] < vt[str(c)]["n"]]
        ax.plot(bad, [vt[str(c)]["peak_norm"]["median"] for c in bad], "x", color="k", ms=10, mew=2,
                label="infeasible (preempted)")
        cs_all = np.arange(1, max(int(c) for c in cur["native"]) + 1)
        ax.plot(cs_all, cs_all * per_req / usable, ":", color="grey", label=f"ideal packing (C={result['ideal'][label]})")
        pv = (result["paper"].get(label) or {}).get("vtoken")
        if isinstance(pv, int):
            ax.plot([pv], [1.0], "*", color="C2", ms=14, label=f"paper's vToken (C={pv})")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylim(0, 2.2)
        ax.set_xlabel("concurrency C")
        ax.set_ylabel("peak blocks / budget")
        ax.set_title(f"{result['geometry_of'][label]}, budget {label}"
                     + (f" (simulated {result['budgets'][label]})" if st["scale"] != 1 else ""), fontsize=9)
        ax.legend(fontsize=7)
        # timeline at vToken's frontier, seed 0
        ax = axes[1][j]
        r0 = next((r for r in budget_res if r["budget"] == label and r["seed"] == 0), None)
        if r0 is not None:
            C = r0["vtoken_default"]["frontier"]
            run = r0["vtoken_default"]["runs"].get(C, {})
            if "timeline" in run:
                tl = np.asarray(run["timeline"])[:-2]  # the last samples are after the requests finished
                ax.plot(tl[:, 0], tl[:, 1] / usable, color="C3", label=f"vToken (defaults), C={C}")
            for m, lab in (("native", "Native"), ("naive-evict", "Naive-Evict")):
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
    """The frontier report in markdown, section by section."""
    L = _md_intro(res, st) + _md_frontier(res, st) + _md_traffic(res) + _md_peak(res) + _md_ablations(res)
    L += _md_curves(res)
    L.append(method_md(st["window"]))
    return "\n".join(L)


def _md_intro(res, st) -> list:
    """The title, the setting paragraph and, in quick mode, the scale note."""
    P, O = frontier_request_shape(st["full_blocks"], st["S"], st["output"])
    L = []
    L.append("# Capacity frontier (paper Fig. 9 and 10)\n")
    L.append(f"Llama-3.1-8B geometry (32 layers, 8 KV heads, head dim 128, fp16: "
             f"{GEOMETRY['kv_bytes_per_token'] // 1024} KiB/token), block size {st['S']}, prompt {P} + output {O} "
             f"tokens (fully retained: {st['full_blocks']} blocks), H2O keep budget {st['keep']} tokens "
             f"(ideal packed footprint {-(-st['keep'] // st['S'])} blocks, recent window {st['keep'] // 2}). All C "
             f"requests start together. Feasible = no request ever finds no free block. Median [min, max] over "
             f"{res['seeds']} seeds. The {QWEN} row is Qwen2.5-14B (48 layers, 8 KV heads, head dim 128: "
             f"{GEOMETRIES['Qwen2.5-14B']['kv_bytes_per_token'] // 1024} KiB/token) on its budget at gpu_mem_util "
             f"0.50 ({kv_budget('Qwen2.5-14B', 0.5)} blocks, `vtoken.sim.frontier.kv_budget`), the same trace.\n")
    if st["scale"] != 1:
        L.append(f"*Quick mode: 1/16 scale; budgets simulated as {res['budgets']}; the defaults' headroom / 16 "
                 f"({st['default']}).*\n")
    return L


def _md_frontier(res, st) -> list:
    """The frontier table per budget and the shipped defaults' paragraph."""
    dflt = res["planner"]["default"]
    L = []
    rows = []
    for label in res["budgets"]:
        sp = res["spread"][label]
        pp = res["paper"].get(label) or {}

        def cell(m):
            return f"{sp[m]['median']} [{sp[m]['min']}, {sp[m]['max']}]"
        rows.append([f"{label} ({res['geometry_of'][label]})"]
                    + [f"{cell(m)} (paper {pp.get(m, '-')})" for m in ("native", "naive-evict")]
                    + [cell("vtoken"), f"**{cell('vtoken_default')}**", pp.get("vtoken", "-"), res["ideal"][label]])
    L.append(rep.md_table(["budget", "Native", "Naive-Evict", "vToken (earlier tuned point)",
                           "vToken (shipped defaults)", "paper's vToken", "ideal"], rows))
    L.append(f"\nShipped defaults: `PlannerConfig()` = `{ {k: v for k, v in dflt.items() if k != 'record_snapshots'} }` "
             f"(trigger `vtoken.planner.should_reclaim`: F > theta_F, or any waste once free blocks are at or below "
             f"the derived watermark). Earlier tuned point: `{st['tuned']}`. Copy engine: {res['copy_engine']}.\n")
    return L


def _md_traffic(res) -> list:
    """The copy-traffic section at the frontier."""
    L = []
    L.append("## Copy traffic at the frontier (shipped defaults)\n")
    L.append("Per plan the lower bound of the work is the live tokens of the blocks it frees: for a plan with s "
             "sources and d fresh destinations, the live tokens of its s - d emptiest sources. The shipped defaults "
             "compact in place (the sources' live tokens go into holes of the request's other blocks: d = 0, moved "
             "= the bound); out-of-place compaction (the tuned point, the paper's) also moves the tokens of the d "
             "fullest sources, so a plan over sources filled to f of S moves at least 1 / (1 - f) times the bound. "
             "Every moved token is a live token of a source the plan frees (moved / source live).\n")
    rows = []
    for label in res["budgets"]:
        for sysname, name in (("vtoken_default", "defaults"), ("vtoken", "tuned")):
            t = res["traffic"][label].get(sysname) or {}
            if not t:
                continue
            rows.append([label, name, fmt(t["moved_over_bound"], digits=2), fmt(t["moved_per_block_freed"]),
                         fmt(t["bound_per_block_freed"]), fmt(t["source_fill"]), fmt(t["moved_over_source_live"], digits=3),
                         fmt(t["plans"], digits=0), fmt(t["moved"], digits=0), fmt(t["blocks_freed"], digits=0)])
    L.append(rep.md_table(["budget", "planner", "moved / bound", "tokens moved per block freed", "bound per block freed",
                           "mean live tokens per source", "moved / source live", "plans", "tokens moved",
                           "blocks freed"], rows))
    return L


def _md_peak(res) -> list:
    """What the peak is made of, and why the first infeasible C fails."""
    L = []
    L.append("\n## What the peak is made of (shipped defaults, at the frontier)\n")
    rows = []
    for label in res["budgets"]:
        d = res["detail"][label]["vtoken_default_at_frontier"]
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
    L.append("\nUnder pressure the planner reclaims every wasted block it can, so at the frontier the peak is the "
             "live tokens plus the reserved headroom (topped up again while copies fly), the in-flight copies' "
             "sources and the partial tails.\n")
    for label in res["budgets"]:
        for sysname, name in (("vtoken_default", "the shipped defaults"), ("vtoken", "the earlier tuned point")):
            f1 = res["detail"][label][f"{sysname}_first_infeasible"]
            C = res["spread"][label][sysname]["min"]
            L.append(f"- budget {label}, {name}: C = {C + 1} fails because {f1['why']}"
                     + (f" (preempted at step {fmt(f1['preempted_step'], digits=0)})." if f1.get("preempted_step", {})
                        .get("median") is not None else "."))
    L.append("")
    return L


def _md_ablations(res) -> list:
    """The one-factor ablation table, or nothing when no ablations ran."""
    L = []
    ab = res["ablations"]
    if ab["table"]:
        L.append(f"## One factor at a time away from the defaults (budget {ab['budget']}, C = {ab['C']}, "
                 f"{ab['seeds']} seed(s); copy latency and check interval: `vtoken simulate robustness`)\n")
        rows = [[name, f"{v['feasible_seeds']}/{v['seeds']}", fmt(v["preempted_step"], digits=0),
                 fmt(v["moves"], digits=0), fmt(v["plans"], digits=0), fmt(v["deferred"], digits=0)]
                for name, v in ab["table"].items()]
        L.append(rep.md_table(["change from the defaults", "feasible seeds", "preempted at step", "moves", "plans",
                               "plans deferred (headroom short)"], rows))
        L.append("")
    return L


def _md_curves(res) -> list:
    """Normalised demand against concurrency, one table per budget."""
    L = []
    L.append("## Normalised demand against concurrency\n")
    for label in res["budgets"]:
        cur = res["curves"][label]
        rows = []
        for c, v in cur["vtoken"].items():
            rows.append([c, fmt(cur["native"].get(c, {"median": None}), pct=True) if c in cur["native"] else "-",
                         fmt(cur["naive-evict"][c], pct=True) if c in cur["naive-evict"] else "-",
                         fmt(v["peak_norm"], pct=True), f"{v['feasible']}/{v['n']}"])
        L.append(f"Budget {label} (Native / Naive-Evict: unconstrained need; vToken, defaults: constrained run):\n")
        L.append(rep.md_table(["C", "Native", "Naive-Evict", "vToken", "vToken feasible seeds"], rows))
        L.append("")
    return L
