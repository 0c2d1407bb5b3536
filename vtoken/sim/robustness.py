"""Robustness of the shipped planner defaults: the capacity frontier over copy latency x
check interval, at both Llama-3.1-8B budgets and on the Qwen2.5-14B geometry.

The frontier trace (:mod:`vtoken.sim.frontier`), ``PlannerConfig()`` but ``check_every``, and
``NullCopyEngine(latency)``. Per cell and seed one run at C = ideal; where it fails, the
frontier is bisected below it and the cell says how far it fell and what was in flight.
``min_over_ideal``: the smallest frontier over cells and seeds / the ideal.

Owns: nothing (each cell's Replay lives in its task; writes only the result files).
May call: vtoken.sim (frontier, parallel, stats, report, config), vtoken.planner, numpy; never spec/,
invariants/, fuzz/ or reports/.
Costs: one frontier run per (budget, latency, interval, seed) cell, a search where it fails: hours;
quick minutes.
"""

from __future__ import annotations

import time

import numpy as np

from vtoken.planner import PlannerConfig

from . import report as rep
from .config import need_run_args
from .frontier import GEOMETRIES, _run, _search, _task_schedules, geometry_budgets, setting
from .parallel import default_jobs, run_tasks
from .stats import fmt, int_summary, summary

LATENCIES = (0, 1, 2, 3, 4)
INTERVALS = (1, 2, 3, 4)


def _cell(seed, label, nb, scheds, st, K, L, lo_hint):
    """One (budget, K, latency, seed): the frontier of the defaults, with what the run held."""
    cfg = dict(st["default"], check_every=K)
    per_req = -(-st["keep"] // st["S"])
    ideal = (nb - 1) // per_req
    t0 = time.perf_counter()
    lo, cache = _search(lambda c: _run(scheds, "vtoken", nb, c, st, cfg, latency=L, timeline=False), ideal, ideal,
                        lo_hint=lo_hint)
    at = cache[ideal]
    fr = cache.get(lo) if lo else None
    tr = (fr or at).get("traffic", {})
    return dict(seed=seed, budget=label, K=K, latency=L, frontier=lo, ideal=ideal, feasible_at_ideal=at["feasible"],
                preempted_at=at["preempted_at"], peak_info=at["peak_info"], traffic_at_ideal=at.get("traffic", {}),
                traffic=tr, runs=len(cache), wall_s=time.perf_counter() - t0)


def run_robustness(quick: bool = False, seeds: int | None = None, out=None, jobs: int | None = None,
                   latencies=None, intervals=None, progress=None) -> dict:
    """The grid (copy latencies 0-4 x check intervals 1-4; quick: 0, 4 x 1, 4); returns
    ``grid[budget]["K=k,latency=l"] = frontier summary`` and ``min_over_ideal``."""
    need_run_args("run_robustness", quick, seeds, jobs)
    st = setting(quick)
    latencies = tuple(latencies or st["robust_grid"][0])
    intervals = tuple(intervals or st["robust_grid"][1])
    n_seeds = seeds or st["robust_seeds"]
    jobs = jobs or default_jobs(quick)
    t0 = time.perf_counter()
    budgets = geometry_budgets(st)  # label -> (geometry, blocks)
    per_req = -(-st["keep"] // st["S"])
    ideal = {k: (nb - 1) // per_req for k, (_, nb) in budgets.items()}
    cmax = max(ideal.values())
    chunks = [list(range(i, min(cmax, i + 6))) for i in range(0, cmax, 6)]
    got = run_tasks(_task_schedules, [(s, ids, st) for s in range(n_seeds) for ids in chunks], jobs)
    scheds = {s: [] for s in range(n_seeds)}
    for s, lst in got:
        scheds[s].extend(lst)
    # Naive-Evict's frontier is a floor for the search below the ideal (it never interacts)
    naive = {k: max(1, (nb - 1) // st["full_blocks"]) for k, (_, nb) in budgets.items()}
    tasks = [(s, label, nb, scheds[s], st, K, L, naive[label]) for label, (_, nb) in budgets.items()
             for K in intervals for L in latencies for s in range(n_seeds)]
    tasks.sort(key=lambda a: -a[2])  # biggest budgets first: the workers stay busy to the end
    cells = run_tasks(_cell, tasks, jobs, progress=progress and (lambda d, n: progress("robustness: cells", d, n)))
    grid, worst = {}, {}
    for label, (geo, nb) in budgets.items():
        g = {}
        for K in intervals:
            for L in latencies:
                rs = [c for c in cells if c["budget"] == label and c["K"] == K and c["latency"] == L]
                fr = int_summary([c["frontier"] for c in rs])
                bpb = GEOMETRIES[geo]["kv_bytes_per_token"] * st["S"]
                infl = [c["peak_info"].get("inflight_sources", 0) + c["peak_info"].get("inflight_dests", 0) for c in rs]
                pk = [c["traffic_at_ideal"].get("peak_inflight_blocks", 0) for c in rs]
                cell = dict(frontier=fr, ideal=ideal[label], over_ideal=fr["min"] / ideal[label],
                            feasible_seeds=sum(c["feasible_at_ideal"] for c in rs), seeds=len(rs),
                            preempted_step=summary([c["preempted_at"]["step"] for c in rs if c["preempted_at"]]),
                            inflight_at_peak_blocks=summary(infl),
                            inflight_at_peak_mib=summary([x * bpb / 2 ** 20 for x in infl]),
                            peak_inflight_blocks=summary(pk),
                            peak_inflight_mib=summary([x * bpb / 2 ** 20 for x in pk]),
                            reserved_at_peak=summary([c["peak_info"].get("reserved", 0) for c in rs]),
                            fragmentation_at_peak=summary([c["peak_info"].get("fragmentation", 0) for c in rs]),
                            moved_over_bound=summary([_ratio(c["traffic"]) for c in rs]))
                g[f"K={K},latency={L}"] = cell
        grid[label] = g
        worst[label] = min(c["over_ideal"] for c in g.values())
    result = dict(experiment="robustness", quick=quick, seeds=n_seeds, budgets={k: nb for k, (_, nb) in budgets.items()},
                  geometry={k: geo for k, (geo, _) in budgets.items()}, ideal=ideal, latencies=list(latencies),
                  intervals=list(intervals), planner=dict(vars(PlannerConfig(**st["default"]))), grid=grid,
                  min_over_ideal_by_budget=worst,
                  min_over_ideal=min(worst.values()), wall_s=time.perf_counter() - t0)
    md = _markdown(result, st)
    fig = _plot(result)
    result["files"] = rep.write(rep.out_dir(out), "robustness", result, md, fig)
    return result


def _ratio(tr: dict):
    return tr["moved"] / tr["bound"] if tr.get("bound") else None


def _markdown(res, st) -> str:
    L = ["# Robustness of the planner defaults: copy latency x check interval\n",
         f"`PlannerConfig()` (`{ {k: v for k, v in res['planner'].items() if k != 'record_snapshots'} }`, only "
         f"`check_every` = K changed) on the frontier "
         f"trace, `NullCopyEngine(latency)`: a plan launched at step t frees its sources at step t + latency + 1. "
         f"Each cell: the frontier C (median [min, max] over {res['seeds']} seeds) against the ideal packing; one run "
         f"at C = ideal per seed (ideal + 1 is infeasible by the live tokens alone), a search below it where it "
         f"fails. `min_over_ideal` = {res['min_over_ideal']:.3f}.\n"]
    for label, g in res["grid"].items():
        lat = res["latencies"]
        L.append(f"## {res['geometry'][label]}, budget {res['budgets'][label]} blocks (`{label}`, ideal C = "
                 f"{res['ideal'][label]})\n")
        rows = []
        for K in res["intervals"]:
            row = [f"K = {K}"]
            for lt in lat:
                c = g[f"K={K},latency={lt}"]
                f = c["frontier"]
                row.append(f"{f['median']} [{f['min']}, {f['max']}]" + ("" if c["feasible_seeds"] == c["seeds"]
                                                                      else f" ({c['feasible_seeds']}/{c['seeds']} at ideal)"))
            rows.append(row)
        L.append(rep.md_table(["check interval \\ copy latency"] + [str(x) for x in lat], rows))
        rows = []
        for K in res["intervals"]:
            row = [f"K = {K}"]
            for lt in lat:
                c = g[f"K={K},latency={lt}"]
                row.append(f"{c['peak_inflight_blocks']['max']:.0f} ({c['peak_inflight_mib']['max']:.0f} MiB)")
            rows.append(row)
        L.append("\nMost blocks held by copies in flight at once (sources + destinations, max over seeds):\n")
        L.append(rep.md_table(["check interval \\ copy latency"] + [str(x) for x in lat], rows))
        bad = {k: c for k, c in g.items() if c["feasible_seeds"] < c["seeds"]}
        for k, c in bad.items():
            L.append(f"\n- {k}: C = ideal fails in {c['seeds'] - c['feasible_seeds']}/{c['seeds']} seeds "
                     f"(preempted at step {fmt(c['preempted_step'], digits=0)}); the frontier falls to "
                     f"{c['frontier']['min']} ({c['over_ideal']:.2f} of the ideal). At the peak, copies in flight held "
                     f"{fmt(c['inflight_at_peak_blocks'], digits=0)} blocks ({fmt(c['inflight_at_peak_mib'], digits=0)} "
                     f"MiB), reserved {fmt(c['reserved_at_peak'], digits=0)}, fragmentation "
                     f"{fmt(c['fragmentation_at_peak'], digits=0)}.")
        L.append("")
    return "\n".join(L)


def _plot(res):
    plt = rep.plt()
    labels = list(res["grid"])
    fig, axes = plt.subplots(1, len(labels), figsize=(4.6 * len(labels), 3.6), squeeze=False)
    for ax, label in zip(axes[0], labels):
        g = res["grid"][label]
        a = np.asarray([[g[f"K={K},latency={lt}"]["frontier"]["min"] / res["ideal"][label] for lt in res["latencies"]]
                        for K in res["intervals"]])
        im = ax.imshow(a, vmin=0.5, vmax=1.0, cmap="RdYlGn", origin="lower", aspect="auto")
        for i in range(a.shape[0]):
            for j in range(a.shape[1]):
                ax.text(j, i, f"{a[i, j]:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(res["latencies"])), res["latencies"])
        ax.set_yticks(range(len(res["intervals"])), res["intervals"])
        ax.set_xlabel("copy latency (steps)")
        ax.set_ylabel("check interval K")
        ax.set_title(f"{res['geometry'][label]} {label}: min C / ideal", fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    return fig
