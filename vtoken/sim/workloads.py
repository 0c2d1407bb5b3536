"""Experiments on the ShareGPT-like and LongBench-like traces: waste (Fig. 1), retained
blocks (Fig. 7b) and the parameter sweeps (section 4.5): continuous batching of at most 16
running requests, memory unconstrained (same admissions in every system), every policy
evicting to ``ceil(keep * length)`` (default keep 0.5) from the prefill on; block statistics
sampled every ``sample_every`` steps and time-averaged.

Owns: nothing (each run's Replay lives in its task; writes only the result files).
May call: vtoken.sim (replay, schedule, attention, traces, parallel, stats, report, config), vtoken.planner,
numpy; never spec/, invariants/, fuzz/ or reports/.
Costs: one Replay per (workload, policy, seed, variant): minutes; quick seconds.
"""

from __future__ import annotations

import time

import numpy as np

from vtoken.planner import PlannerConfig

from . import report as rep
from .config import need_run_args
from .attention import AttentionModel
from .replay import Replay
from .parallel import default_jobs, run_tasks
from .schedule import cached_schedule, ratio_budget
from .stats import fmt, summary
from .traces import describe_workloads, make_trace

POLICY_NAMES = ("h2o", "scissorhands", "random")
WORKLOAD_NAMES = ("sharegpt", "longbench")
PAPER_WASTE = {"band": [0.56, 0.67], "random": {"sharegpt": 0.58, "longbench": 0.67}}
PAPER_RETAINED = [-0.272, -0.723]

# vToken in the unconstrained experiments: the paper's trigger (F > theta_F = 0.25) alone
# (low_watermark -1: no pressure branch; memory is never short here), with the earlier
# frontier planner's mechanics (B 128, headroom 48), so the figures stay comparable.
RETAINED_CFG = dict(theta_f=0.25, check_every=1, max_sources=128, headroom=48, low_watermark=-1)


def _setting(quick: bool) -> dict:
    if quick:
        return dict(n_requests=8, batch=4, scale=1 / 8, seeds=2, sample_every=4, window=8)
    return dict(n_requests=32, batch=16, scale=1.0, seeds=5, sample_every=8, window=16)


def _schedules(workload, seed, policy, keep, st):
    trace = make_trace(workload, st["n_requests"], seed, st["scale"])
    bud = ratio_budget(keep, min_keep=max(8, int(64 * st["scale"])))
    return [cached_schedule(r.prompt, r.output, policy, bud, seed, 1000 * seed + r.id, window=st["window"])
            for r in trace]


def _num_blocks(scheds, S, extra=256):
    return sum(-(-(s.prompt + s.output) // S) for s in scheds) + extra


def _metrics(rp: Replay, res: dict) -> dict:
    a = rp.sample_array()
    step, active, demand, nref, le_half, F, held, ideal = a.T if len(a) else [np.zeros(0)] * 8
    ok = nref > 0
    out = dict(
        frac_le_half=float(np.mean(le_half[ok] / nref[ok])) if ok.any() else None,
        F=float(np.mean(F[ok])) if ok.any() else None,
        retained_per_req=float(np.mean(held / np.maximum(active, 1))),
        ideal_per_req=float(np.mean(ideal / np.maximum(active, 1))),
        steps=res["steps"], wall_s=res["wall_s"], inflight_victims=res["inflight_victims"],
    )
    out["ratio_to_ideal"] = out["retained_per_req"] / max(out["ideal_per_req"], 1e-9)
    if "planner" in res:
        out.update(plans=res["planner"]["plans"], moves=res["planner"]["moves"],
                   blocks_freed=res["planner"]["blocks_freed"])
    return out


def _replay(scheds, mode, S, st, cfg=None) -> dict:
    rp = Replay(scheds, mode, S, _num_blocks(scheds, S), planner=PlannerConfig(**cfg) if cfg else None,
                latency=1, max_batch=st["batch"], sample_every=st["sample_every"])
    res = rp.run()
    assert res["feasible"], "unconstrained run preempted"
    return _metrics(rp, res)


# ------------------------------------------------------------------------- tasks
def _task_policy(workload, seed, policy, st, with_vtoken):
    t0 = time.perf_counter()
    scheds = _schedules(workload, seed, policy, 0.5, st)
    t1 = time.perf_counter()
    out = {"naive-evict": _replay(scheds, "naive-evict", 16, st)}
    if with_vtoken:
        out["vtoken"] = _replay(scheds, "vtoken", 16, st, RETAINED_CFG)
    out["schedule_s"], out["replay_s"] = t1 - t0, time.perf_counter() - t1
    return (workload, seed, policy), out


def _collect(results, keyfn):
    agg: dict = {}
    for key, out in results:
        agg.setdefault(keyfn(key), []).append(out)
    return agg


# ------------------------------------------------------------------------- waste
def run_waste(quick: bool = False, seeds: int | None = None, out=None, jobs: int | None = None,
              _results=None, progress=None) -> dict:
    """Fig. 1: blocks at <= 50% utilisation and F under Naive-Evict, per policy and workload."""
    need_run_args("run_waste", quick, seeds, jobs)
    st = _setting(quick)
    n_seeds = seeds or st["seeds"]
    jobs = jobs or default_jobs(quick)
    t0 = time.perf_counter()
    results = _results or run_tasks(_task_policy, [(w, s, p, st, False) for w in WORKLOAD_NAMES
                                                    for p in POLICY_NAMES for s in range(n_seeds)], jobs,
                                    progress=progress and (lambda d, n: progress("waste: traces", d, n)))
    agg = _collect(results, lambda k: (k[0], k[2]))
    table = {}
    for (w, p), outs in agg.items():
        ne = [o["naive-evict"] for o in outs]
        table.setdefault(w, {})[p] = dict(frac_le_half=summary([m["frac_le_half"] for m in ne]),
                                         F=summary([m["F"] for m in ne]))
    result = dict(experiment="waste", quick=quick, seeds=n_seeds, setting=st, keep=0.5,
                  workloads=describe_workloads(), attention=AttentionModel().describe(),
                  table=table, paper=PAPER_WASTE, wall_s=time.perf_counter() - t0)
    rows = []
    for w in WORKLOAD_NAMES:
        for p in POLICY_NAMES:
            c = table[w][p]
            rows.append([w, p, fmt(c["frac_le_half"], pct=True), fmt(c["F"], pct=True)])
    md = (f"# Waste under Naive-Evict (paper Fig. 1)\n\nEviction ratio 0.5 from the prefill on, batch "
          f"{st['batch']}, {st['n_requests']} requests per trace, block size 16, no reclamation (blocks left "
          f"with no live token are freed). Time-averaged over the run; median [min, max] over {n_seeds} seeds.\n\n"
          + rep.md_table(["workload", "policy", "blocks at <= 50% utilisation", "F (Eq. 1)"], rows)
          + f"\n\nPaper: 56-67% of blocks at <= 50% (Random worst: 58% ShareGPT, 67% LongBench).\n")
    fig = _plot_waste(table)
    result["files"] = rep.write(rep.out_dir(out), "waste", result, md + _method_md(quick), fig)
    return result


def _plot_waste(table):
    plt = rep.plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, key, title in zip(axes, ("frac_le_half", "F"), ("blocks at <= 50% utilisation", "waste ratio F")):
        x = np.arange(len(WORKLOAD_NAMES))
        for i, p in enumerate(POLICY_NAMES):
            med = [table[w][p][key]["median"] for w in WORKLOAD_NAMES]
            lo = [table[w][p][key]["median"] - table[w][p][key]["min"] for w in WORKLOAD_NAMES]
            hi = [table[w][p][key]["max"] - table[w][p][key]["median"] for w in WORKLOAD_NAMES]
            ax.bar(x + (i - 1) * 0.27, med, 0.27, yerr=[lo, hi], capsize=3, label=p)
        if key == "frac_le_half":
            ax.axhspan(0.56, 0.67, color="grey", alpha=0.15, label="paper band")
        ax.set_xticks(x, WORKLOAD_NAMES)
        ax.set_title(title)
        ax.set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    fig.suptitle("Naive-Evict waste (median, min-max over seeds)")
    return fig


# ------------------------------------------------------------------------- retained
def run_retained(quick: bool = False, seeds: int | None = None, out=None, jobs: int | None = None,
                 progress=None) -> dict:
    """Fig. 7b: retained blocks per request, Naive-Evict vs vToken, against the ideal packing."""
    need_run_args("run_retained", quick, seeds, jobs)
    st = _setting(quick)
    n_seeds = seeds or st["seeds"]
    jobs = jobs or default_jobs(quick)
    t0 = time.perf_counter()
    results = run_tasks(_task_policy, [(w, s, p, st, True) for w in WORKLOAD_NAMES
                                       for p in POLICY_NAMES for s in range(n_seeds)], jobs,
                        progress=progress and (lambda d, n: progress("retained: traces", d, n)))
    agg = _collect(results, lambda k: (k[0], k[2]))
    table = {}
    for (w, p), outs in agg.items():
        ne, vt = [o["naive-evict"] for o in outs], [o["vtoken"] for o in outs]
        table.setdefault(w, {})[p] = dict(
            **{"naive-evict": summary([m["retained_per_req"] for m in ne])},
            vtoken=summary([m["retained_per_req"] for m in vt]),
            ideal=summary([m["ideal_per_req"] for m in vt]),
            reduction=summary([v["retained_per_req"] / n["retained_per_req"] - 1 for n, v in zip(ne, vt)]),
            utilisation_gain=summary([(1 - v["F"]) / (1 - n["F"]) - 1 for n, v in zip(ne, vt)]),
            vtoken_ratio_to_ideal=summary([m["ratio_to_ideal"] for m in vt]),
            naive_ratio_to_ideal=summary([m["ratio_to_ideal"] for m in ne]),
            moves=summary([m["moves"] for m in vt]), plans=summary([m["plans"] for m in vt]),
        )
    reductions = [table[w][p]["reduction"]["median"] for w in table for p in table[w]]
    result = dict(experiment="retained", quick=quick, seeds=n_seeds, setting=st, keep=0.5, vtoken_planner=RETAINED_CFG,
                  table=table, reduction_range=[min(reductions), max(reductions)], paper=PAPER_RETAINED,
                  wall_s=time.perf_counter() - t0)
    rows = []
    for w in WORKLOAD_NAMES:
        for p in POLICY_NAMES:
            c = table[w][p]
            rows.append([w, p, fmt(c["naive-evict"]), fmt(c["vtoken"]), fmt(c["ideal"]),
                         fmt(c["reduction"], pct=True), fmt(c["utilisation_gain"], pct=True),
                         fmt(c["vtoken_ratio_to_ideal"], digits=2), fmt(c["moves"], digits=0)])
    md = (f"# Retained blocks per request (paper Fig. 7b)\n\nSame traces and the *same eviction decisions* "
          f"(precomputed per request) replayed through Naive-Evict and vToken. vToken planner: "
          f"`{RETAINED_CFG}` (the paper's trigger F > 0.25 alone; memory is unconstrained). "
          f"Ideal = sum over running requests of ceil(live / 16). Time-averaged blocks per running request; "
          f"median [min, max] over {n_seeds} seeds.\n\n"
          + rep.md_table(["workload", "policy", "Naive-Evict", "vToken", "ideal", "vToken vs Naive",
                          "utilisation gain", "vToken / ideal", "moves"], rows)
          + f"\n\nRange of median reductions: {min(reductions) * 100:.1f}% to {max(reductions) * 100:.1f}% "
            f"(paper: -27.2% to -72.3%; utilisation +21.9%).\n")
    fig = _plot_retained(table)
    result["files"] = rep.write(rep.out_dir(out), "retained", result, md + _method_md(quick), fig)
    result["_raw"] = results  # the Naive-Evict runs are waste's too (run_all hands them on); never written
    return result


def _plot_retained(table):
    plt = rep.plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, w in zip(axes, WORKLOAD_NAMES):
        x = np.arange(len(POLICY_NAMES))
        for i, (k, lab) in enumerate((("naive-evict", "Naive-Evict"), ("vtoken", "vToken"), ("ideal", "ideal packing"))):
            med = np.array([table[w][p][k]["median"] for p in POLICY_NAMES])
            lo = med - np.array([table[w][p][k]["min"] for p in POLICY_NAMES])
            hi = np.array([table[w][p][k]["max"] for p in POLICY_NAMES]) - med
            ax.bar(x + (i - 1) * 0.27, med, 0.27, yerr=[lo, hi], capsize=3, label=lab)
        for j, p in enumerate(POLICY_NAMES):
            r = table[w][p]["reduction"]["median"]
            ax.text(j, table[w][p]["naive-evict"]["median"] * 1.02, f"{r * 100:.0f}%", ha="center", fontsize=8)
        ax.set_xticks(x, POLICY_NAMES)
        ax.set_title(f"{w}: blocks per running request")
    axes[0].legend(fontsize=8)
    return fig


# ------------------------------------------------------------------------- sweeps
THETAS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.35, 0.5, 0.7, 0.9)
BLOCK_SIZES = (16, 32, 48)
EVICTION_RATIOS = (0.3, 0.4, 0.5, 0.6, 0.7)


def _task_sweep(seed, ratio, st, thetas, block_sizes):
    scheds = _schedules("longbench", seed, "h2o", 1 - ratio, st)
    out = {}
    base = dict(RETAINED_CFG)
    if abs(ratio - 0.5) < 1e-9:
        for th in thetas:
            out[("theta", th)] = _replay(scheds, "vtoken", 16, st, dict(base, theta_f=th))
        for S in block_sizes:
            out[("block", S, "vtoken")] = out[("theta", 0.25)] if S == 16 and 0.25 in thetas else \
                _replay(scheds, "vtoken", S, st, base)
            out[("block", S, "naive")] = _replay(scheds, "naive-evict", S, st)
    out[("ratio", ratio, "vtoken")] = _replay(scheds, "vtoken", 16, st, base)
    out[("ratio", ratio, "naive")] = _replay(scheds, "naive-evict", 16, st)
    return seed, out


def run_sweeps(quick: bool = False, seeds: int | None = None, out=None, jobs: int | None = None,
               progress=None) -> dict:
    """theta_F 0.05-0.9, block size 16/32/48, eviction ratio 0.3-0.7 (H2O, LongBench-like)."""
    need_run_args("run_sweeps", quick, seeds, jobs)
    st = _setting(quick)
    n_seeds = seeds or st["seeds"]
    jobs = jobs or default_jobs(quick)
    thetas = (0.05, 0.25, 0.9) if quick else THETAS
    bss = (16, 32) if quick else BLOCK_SIZES
    ratios = (0.3, 0.5, 0.7) if quick else EVICTION_RATIOS
    t0 = time.perf_counter()
    res = run_tasks(_task_sweep, [(s, r, st, thetas, bss) for s in range(n_seeds) for r in ratios], jobs,
                    progress=progress and (lambda d, n: progress("sweeps: traces", d, n)))
    per: dict = {}
    for _, o in res:
        for k, m in o.items():
            per.setdefault(k, []).append(m)

    def summ(k):
        ms = per[k]
        return dict(retained_per_req=summary([m["retained_per_req"] for m in ms]),
                    ratio_to_ideal=summary([m["ratio_to_ideal"] for m in ms]),
                    moves=summary([m.get("moves", 0) for m in ms]), plans=summary([m.get("plans", 0) for m in ms]),
                    F=summary([m["F"] for m in ms]))

    theta = {str(th): summ(("theta", th)) for th in thetas}
    block = {str(S): dict(vtoken=summ(("block", S, "vtoken")), **{"naive-evict": summ(("block", S, "naive"))}) for S in bss}
    ratio = {str(r): dict(vtoken=summ(("ratio", r, "vtoken")), **{"naive-evict": summ(("ratio", r, "naive"))}) for r in ratios}
    result = dict(experiment="sweeps", quick=quick, seeds=n_seeds, setting=st, policy="h2o", workload="longbench",
                  vtoken_planner=RETAINED_CFG, theta=theta, block_size=block, eviction_ratio=ratio,
                  wall_s=time.perf_counter() - t0)
    md = [f"# Sensitivity sweeps (paper section 4.5)\n\nH2O on the LongBench-like trace, vToken planner "
          f"`{RETAINED_CFG}` with one factor changed at a time (theta_F at block size 16 / eviction ratio 0.5; "
          f"block size at theta_F 0.25; eviction ratio at theta_F 0.25, block size 16). Retained = time-averaged "
          f"blocks per running request; moves and plans are totals per trace. Median [min, max] over {n_seeds} seeds.\n",
          "## theta_F (paper tried only 0.20-0.35)\n",
          rep.md_table(["theta_F", "retained blocks/req", "ratio to ideal", "F", "moves", "plans"],
                       [[th, fmt(v["retained_per_req"]), fmt(v["ratio_to_ideal"], digits=2), fmt(v["F"], pct=True),
                         fmt(v["moves"], digits=0), fmt(v["plans"], digits=0)] for th, v in theta.items()]),
          "\n## block size (retained memory in token slots = blocks x S)\n",
          rep.md_table(["S", "vToken blocks/req", "vToken slots/req", "vToken / ideal", "Naive blocks/req",
                        "Naive slots/req", "moves", "plans"],
                       [[S, fmt(v["vtoken"]["retained_per_req"]),
                         f"{v['vtoken']['retained_per_req']['median'] * int(S):.0f}",
                         fmt(v["vtoken"]["ratio_to_ideal"], digits=2), fmt(v["naive-evict"]["retained_per_req"]),
                         f"{v['naive-evict']['retained_per_req']['median'] * int(S):.0f}",
                         fmt(v["vtoken"]["moves"], digits=0), fmt(v["vtoken"]["plans"], digits=0)]
                        for S, v in block.items()]),
          "\n## eviction ratio\n",
          rep.md_table(["eviction ratio", "vToken blocks/req", "vToken / ideal", "Naive blocks/req", "Naive / ideal",
                        "vToken vs Naive", "moves", "plans"],
                       [[r, fmt(v["vtoken"]["retained_per_req"]), fmt(v["vtoken"]["ratio_to_ideal"], digits=2),
                         fmt(v["naive-evict"]["retained_per_req"]), fmt(v["naive-evict"]["ratio_to_ideal"], digits=2),
                         f"{(v['vtoken']['retained_per_req']['median'] / v['naive-evict']['retained_per_req']['median'] - 1) * 100:.1f}%",
                         fmt(v["vtoken"]["moves"], digits=0), fmt(v["vtoken"]["plans"], digits=0)]
                        for r, v in ratio.items()])]
    fig = _plot_sweeps(theta, block, ratio)
    result["files"] = rep.write(rep.out_dir(out), "sweeps", result, "\n".join(md) + _method_md(quick), fig)
    return result


def _plot_sweeps(theta, block, ratio):
    plt = rep.plt()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    ax = axes[0]
    th = [float(k) for k in theta]
    med = [v["ratio_to_ideal"]["median"] for v in theta.values()]
    err = [[v["ratio_to_ideal"]["median"] - v["ratio_to_ideal"]["min"] for v in theta.values()],
           [v["ratio_to_ideal"]["max"] - v["ratio_to_ideal"]["median"] for v in theta.values()]]
    ax.errorbar(th, med, yerr=err, marker="o", capsize=3, label="retained / ideal")
    ax.axvspan(0.2, 0.35, color="grey", alpha=0.15, label="paper's range")
    ax.set_xlabel("theta_F")
    ax.set_ylabel("retained / ideal")
    ax2 = ax.twinx()
    ax2.plot(th, [v["moves"]["median"] for v in theta.values()], "s--", color="C3", label="moves")
    ax2.set_ylabel("moves per trace", color="C3")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("theta_F")
    ax = axes[1]
    Ss = [int(k) for k in block]
    ax.plot(Ss, [v["vtoken"]["retained_per_req"]["median"] * S for S, v in zip(Ss, block.values())], "o-", label="vToken")
    ax.plot(Ss, [v["naive-evict"]["retained_per_req"]["median"] * S for S, v in zip(Ss, block.values())], "s-",
            label="Naive-Evict")
    ax.set_xlabel("block size S")
    ax.set_ylabel("retained token slots / request")
    ax.set_xticks(Ss)
    ax.legend(fontsize=8)
    ax.set_title("block size")
    ax = axes[2]
    rs = [float(k) for k in ratio]
    for k, lab, m in (("vtoken", "vToken", "o-"), ("naive-evict", "Naive-Evict", "s-")):
        ax.plot(rs, [v[k]["retained_per_req"]["median"] for v in ratio.values()], m, label=lab)
    ax.set_xlabel("eviction ratio")
    ax.set_ylabel("retained blocks / request")
    ax.legend(fontsize=8)
    ax.set_title("eviction ratio")
    fig.tight_layout()
    return fig


def _method_md(quick: bool) -> str:
    st = _setting(quick)
    return method_md(st["window"]) + (f"\n*Quick mode: lengths x{st['scale']}, {st['n_requests']} requests, "
                                      f"batch {st['batch']}, {st['seeds']} seeds.*\n" if quick else "")


def method_md(window: int) -> str:
    """The stated attention model and trace generators, for every report."""
    m = AttentionModel()
    w = describe_workloads()
    sg, lb = w["sharegpt"], w["longbench"]
    return (
        "\n## Method\n\n"
        "**Where the attention comes from.** No model weights can be downloaded here, so the attention that "
        "drives H2O and Scissorhands is a stated synthetic model (`vtoken/sim/attention.py`), seeded per "
        f"request: token i has intrinsic importance w_i = exp({m.sigma} z_i), z a unit-variance Gaussian "
        f"sequence smoothed with an exponential kernel (neighbour correlation {m.rho}) -- lognormal, heavy-tailed; "
        f"the first {m.n_sink} tokens are attention sinks (w x {m.sink_boost:g}). A query at position q gives "
        f"token i the weight w_i (1 + (q - i)/{m.tau:g})^-{m.alpha:g} (power-law recency), times a lognormal "
        f"noise factor (sigma {m.noise}) per token and observation window; every query spends one unit of "
        f"attention over the live tokens. Policies (the real `vtoken.policies` classes) observe once per window "
        f"of {window} decode steps (attention summed over the window's queries; the prefill is one observation) "
        "and choose that window's victims then, evicted step by step as the budget requires. Random uses no "
        "attention (seeded per request).\n\n"
        "**How the traces are made.** ShareGPT-like: input ~ lognormal(median "
        f"{sg['in_median']}, sigma {sg['in_sigma']}) clipped to {sg['in_clip']}, output ~ lognormal(median "
        f"{sg['out_median']}, sigma {sg['out_sigma']}) clipped to {sg['out_clip']}. LongBench-like: input ~ "
        f"lognormal(median {lb['in_median']}, sigma {lb['in_sigma']}) clipped to {lb['in_clip']}, output ~ "
        f"lognormal(median {lb['out_median']}, sigma {lb['out_sigma']}) clipped to {lb['out_clip']}. "
        "Token values are never needed, only lengths.\n\n"
        "**What runs.** The real `TokenTable`, `BlockAllocator` and `ReclamationManager` (no K/V bytes; "
        "`NullCopyEngine(latency=1)`: a plan launched at step t is applied and its sources freed at step t+2, "
        "never earlier). Naive-Evict = same evictions, no compaction (blocks left with no live token are freed "
        "in every variant). A victim in a source block of an in-flight plan is handed to the table right after "
        "that plan applies (`apply_moves` rejects moving a token that died mid-copy).\n"
    )
