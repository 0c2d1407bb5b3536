"""Scheduler-side cost per step against concurrency (what the paper never measured past C = 48).

R requests (16, 64, 256, 1,024) of a 2,048-token prompt, half of it evicted at the prefill
(uniformly at random, the last 64 tokens kept), then decoding: each step every request
appends one token and evicts one older live token (so every request keeps fragmenting and
the planner keeps working). vToken with the paper's trigger (F > 0.25, no watermark).
After a warm-up, every step is timed by phase:

- ``sync``: block allocation for a full tail + ``sync_new_tokens`` (one token per request);
- ``evict``: ``evict_tokens`` for the step's victims, incl. the adapter's location lookup,
  deferral for in-flight sources and release of emptied blocks;
- ``plan``: ``ReclamationManager.step()`` (poll, apply, refill headroom, plan + launch);
- ``slot_map``: ``slot_mapping(req)`` for every request (Eq. 2; recomputed after eviction);
- ``flush``: ``table.flush()`` (one batched write of the step's updates to the lookup cache).

The policy's own scoring is not included (it is the policy's cost, not the substrate's).
Times are wall-clock on a shared machine: medians over seeds.

Owns: nothing (each measurement's Replay lives in its task).
May call: vtoken.sim (replay, schedule, parallel, stats, report, config), vtoken.planner, numpy; never
spec/, invariants/, fuzz/ or reports/.
Costs: per R a timed Replay: O(R) work per step by design (what it measures); minutes at R = 1,024.
"""

from __future__ import annotations

import time

import numpy as np

from vtoken.planner import PlannerConfig

from . import report as rep
from .config import need_run_args
from .replay import Replay
from .schedule import Schedule
from .stats import fmt, summary

PHASES = ("sync", "evict", "plan", "slot_map", "flush")
SIZES = (16, 64, 256, 1024)
CFG = dict(theta_f=0.25, check_every=1, max_sources=128, headroom=48, low_watermark=-1)  # the paper's trigger alone


def _setting(quick):
    if quick:
        return dict(prompt=128, warm=4, steps=6, seeds=2, recent=16)
    return dict(prompt=2048, warm=16, steps=48, seeds=5, recent=64)


def _schedules(R, st, seed):
    P, warm, steps, rec = st["prompt"], st["warm"], st["steps"], st["recent"]
    O = warm + steps + 2
    out = []
    rng = np.random.default_rng([seed, R, 5])
    for i in range(R):
        candidates = np.arange(P - rec)
        pre = np.sort(rng.choice(candidates, size=P // 2, replace=False))
        survivors = np.setdiff1d(candidates, pre)
        later = rng.permutation(survivors)[:O]
        counts = np.zeros(O + 1, dtype=np.int64)
        counts[0] = len(pre)
        counts[1:1 + len(later)] = 1
        offsets = np.zeros(O + 2, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        out.append(Schedule(P, O, np.concatenate([pre, later]).astype(np.int64), offsets, "random-uniform"))
    return out


def measure(R, st, seed) -> dict:
    scheds = _schedules(R, st, seed)
    nb = R * (-(-(st["prompt"] + st["warm"] + st["steps"] + 4) // 16)) + 256
    rp = Replay(scheds, "vtoken", 16, nb, planner=PlannerConfig(**CFG), latency=1, sample_every=0,
                flush_every=1, phase_timing=True, slot_mapping=True)
    for _ in range(st["warm"] + 1):  # prefill + warm-up
        rp.step()
    per = {p: [] for p in PHASES}
    tot = []
    for _ in range(st["steps"]):
        before = dict(rp.phase)
        t0 = time.perf_counter()
        rp.step()
        tot.append(time.perf_counter() - t0)
        for p in PHASES:
            per[p].append(rp.phase[p] - before[p])
    return dict(R=R, seed=seed, step_ms={p: 1e3 * float(np.mean(v)) for p, v in per.items()},
                total_ms=1e3 * float(np.mean(tot)), total_median_ms=1e3 * float(np.median(tot)),
                plans=rp.mgr.stats["plans"], moves=rp.mgr.stats["moves"])


def run_scaling(quick: bool = False, seeds: int | None = None, out=None, jobs: int | None = None,
                sizes=SIZES, progress=None) -> dict:
    """Per-step scheduler-side cost by phase at 16-1,024 requests; always sequential (timing)."""
    need_run_args("run_scaling", quick, seeds, jobs)
    st = _setting(quick)
    n_seeds = seeds or st["seeds"]
    t0 = time.perf_counter()
    from .parallel import _init

    _init()
    runs = []
    for s in range(n_seeds):
        for R in sizes:
            runs.append(measure(R, st, s))
            if progress:
                progress("scaling: sizes x seeds", len(runs), n_seeds * len(sizes))
    table = {}
    for R in sizes:
        rs = [r for r in runs if r["R"] == R]
        table[str(R)] = dict(total_ms=summary([r["total_ms"] for r in rs]),
                             per_request_us=summary([1e3 * r["total_ms"] / R for r in rs]),
                             phases={p: summary([r["step_ms"][p] for r in rs]) for p in PHASES},
                             phases_per_request_us={p: summary([1e3 * r["step_ms"][p] / R for r in rs]) for p in PHASES},
                             plans=summary([r["plans"] for r in rs]))
    ratio = None
    ratio_phase = {}
    if 64 in sizes and 1024 in sizes:
        per_seed = []
        for s in range(n_seeds):
            a = next(r for r in runs if r["R"] == 64 and r["seed"] == s)
            b = next(r for r in runs if r["R"] == 1024 and r["seed"] == s)
            per_seed.append((b["total_ms"] / 1024) / (a["total_ms"] / 64))
            for p in PHASES:
                if a["step_ms"][p] > 0:
                    ratio_phase.setdefault(p, []).append((b["step_ms"][p] / 1024) / (a["step_ms"][p] / 64))
        ratio = summary(per_seed)
        ratio_phase = {p: summary(v) for p, v in ratio_phase.items()}
    xs = np.log([float(R) for R in sizes])
    ys = np.log([table[str(R)]["total_ms"]["median"] for R in sizes])
    slope = float(np.polyfit(xs, ys, 1)[0]) if len(sizes) > 1 else None
    slope_hi = float(np.polyfit(xs[-2:], ys[-2:], 1)[0]) if len(sizes) > 1 else None
    result = dict(experiment="scaling", quick=quick, seeds=n_seeds, setting=st, planner=CFG, sizes=list(sizes),
                  table=table, per_request_ratio_1024_over_64=ratio, per_request_ratio_by_phase=ratio_phase,
                  loglog_slope=slope, loglog_slope_last_two=slope_hi, wall_s=time.perf_counter() - t0)
    rows = [[R, fmt(v["total_ms"], digits=2), fmt(v["per_request_us"], digits=1)]
            + [f"{v['phases'][p]['median']:.2f}" for p in PHASES] for R, v in table.items()]
    md = (f"# Scheduler-side cost per step against concurrency\n\n{__doc__.split(chr(10) * 2, 1)[1]}\n"
          f"Prompt {st['prompt']} tokens, {st['warm']} warm-up steps, {st['steps']} timed steps, {n_seeds} seeds; "
          f"planner `{CFG}`.\n\n"
          + rep.md_table(["requests", "step ms", "per request us"] + [f"{p} ms" for p in PHASES], rows)
          + (f"\n\nPer-request cost at 1,024 / per-request cost at 64: **{fmt(ratio, digits=2)}** "
             f"(1.0 = exactly linear; by phase: "
             + ", ".join(f"{p} {v['median']:.2f}" for p, v in ratio_phase.items()) + ")." if ratio else "")
          + f"\nLog-log slope of step cost against requests: {slope:.2f} overall, {slope_hi:.2f} between the "
            f"two largest sizes (1.0 = linear).\n")
    fig = _plot(table, sizes)
    result["files"] = rep.write(rep.out_dir(out), "scaling", result, md, fig)
    return result


def _plot(table, sizes):
    plt = rep.plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0]
    bottom = np.zeros(len(sizes))
    x = np.arange(len(sizes))
    for p in PHASES:
        v = np.array([table[str(R)]["phases"][p]["median"] for R in sizes])
        ax.bar(x, v, 0.6, bottom=bottom, label=p)
        bottom += v
    ax.set_xticks(x, [str(R) for R in sizes])
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("ms per step (log)")
    ax.legend(fontsize=8)
    ax.set_title("per-step cost by phase")
    ax = axes[1]
    for p in PHASES:
        ax.plot(sizes, [table[str(R)]["phases_per_request_us"][p]["median"] for R in sizes], "o-", label=p)
    ax.plot(sizes, [table[str(R)]["per_request_us"]["median"] for R in sizes], "ks-", label="total")
    ax.set_xscale("log")
    ax.set_xlabel("concurrent requests (log)")
    ax.set_ylabel("us per request per step")
    ax.legend(fontsize=8)
    ax.set_title("per-request cost (flat = linear scaling)")
    fig.tight_layout()
    return fig
