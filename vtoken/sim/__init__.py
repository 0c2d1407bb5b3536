"""The paper's experiments through the real TokenTable, BlockAllocator and ReclamationManager
(no K/V bytes), on generated traces. Each entry point returns a plain dict and writes
``<name>.md``, ``.json`` and ``.png`` under ``out`` (default ``reports/simulate-<timestamp>/``):
:func:`run_waste` (Fig. 1), :func:`run_retained` (Fig. 7b), :func:`run_frontier` (Fig.
9/10), :func:`run_sweeps` (section 4.5), :func:`run_scaling`, :func:`run_robustness` (not in
``run_all``: the long one), :func:`run_all`. Each takes ``quick``, ``seeds``, ``jobs`` and
``progress(label, done, total)``.

Owns: nothing (writes only the files of ``run_all`` under ``out``).
May call: vtoken.sim.*, json, subprocess (``git`` for the commit stamp); never spec/, invariants/,
fuzz/ or reports/.
Costs: the experiments' sum: seconds with ``quick=True``, hours for the full ``run_all``.
"""

from .config import need_run_args
from .frontier import run_frontier
from .robustness import run_robustness
from .scaling import run_scaling
from .workloads import run_retained, run_sweeps, run_waste

__all__ = ["run_waste", "run_retained", "run_frontier", "run_sweeps", "run_scaling", "run_robustness", "run_all",
           "EXPERIMENTS", "COMMANDS"]

# the figures of ``run_all``, in the order it runs them
EXPERIMENTS = {
    "waste": run_waste,
    "retained": run_retained,
    "frontier": run_frontier,
    "sweeps": run_sweeps,
    "scaling": run_scaling,
}
# every experiment ``vtoken simulate`` runs by name
COMMANDS = dict(EXPERIMENTS, robustness=run_robustness)


def run_all(quick: bool = False, seeds: int | None = None, out=None, jobs: int | None = None,
            progress=None) -> dict:
    """Every experiment of :data:`EXPERIMENTS` into one folder, plus ``README.md`` / ``all.json``
    with the timings (waste reuses the retained runs' Naive-Evict replays)."""
    need_run_args("run_all", quick, seeds, jobs)
    import json
    import time

    from . import report as rep

    d = rep.out_dir(out)
    t0 = time.perf_counter()
    results, timings = {}, {}
    order = ["retained", "waste"] + [k for k in EXPERIMENTS if k not in ("retained", "waste")]
    for name in order:
        t = time.perf_counter()
        kw = dict(quick=quick, seeds=seeds, out=d, jobs=jobs, progress=progress)
        if name == "waste":
            kw["_results"] = results["retained"].pop("_raw")
        results[name] = EXPERIMENTS[name](**kw)
        timings[name] = time.perf_counter() - t
        if progress:  # always shown: a phase line may have been throttled
            msg = f"{name} done in {timings[name]:.1f} s ({len(timings)}/{len(order)} experiments)"
            progress.note(msg) if hasattr(progress, "note") else progress(msg, len(timings), len(order))
    results["retained"].pop("_raw", None)
    total = time.perf_counter() - t0
    timings = {k: timings[k] for k in EXPERIMENTS}
    summary = dict(total_s=total, timings_s=timings, quick=quick, out=str(d), headline=headline(results),
                   code=code_state())
    lines = ["# vtoken simulate all\n", f"Total wall time: {total:.1f} s ({'quick' if quick else 'full'} mode).\n",
             f"Code: {summary['code']}\n",
             rep.md_table(["experiment", "seconds", "report"],
                          [[k, f"{v:.1f}", f"[{k}.md]({k}.md)"] for k, v in timings.items()]), "",
             "```json", json.dumps(summary["headline"], indent=1), "```"]
    with open(d / "README.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(d / "all.json", "w") as f:
        json.dump(rep._jsonable(summary), f, indent=1)
    summary["results"] = results
    return summary


def code_state() -> dict:
    """The commit the run used and whether the substrate files differed from it (others edit them)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "vtoken/table.py", "vtoken/planner.py",
                                "vtoken/allocator.py", "vtoken/policies"], cwd=root, capture_output=True, text=True,
                               timeout=10).stdout.split()
        return dict(head=head, modified=[x for x in dirty if x not in ("M", "??", "A", "D")])
    except Exception as e:  # noqa: BLE001
        return dict(error=str(e))


def headline(results: dict) -> dict:
    """The few numbers each experiment is about."""
    h = {}
    if "waste" in results:
        h["waste_frac_le_half"] = {w: {p: round(v["frac_le_half"]["median"], 3) for p, v in ps.items()}
                                   for w, ps in results["waste"]["table"].items()}
    if "retained" in results:
        h["retained_reduction_range"] = [round(x, 3) for x in results["retained"]["reduction_range"]]
    if "frontier" in results:
        h["frontier"] = results["frontier"]["frontier"]
        h["frontier_ideal"] = results["frontier"]["ideal"]
        h["frontier_moved_over_bound"] = {b: round(t["vtoken_default"]["moved_over_bound"]["median"], 2)
                                          for b, t in results["frontier"]["traffic"].items()
                                          if t.get("vtoken_default")}
    if "scaling" in results:
        r = results["scaling"]["per_request_ratio_1024_over_64"]
        h["scaling_per_request_ratio_1024_over_64"] = round(r["median"], 3) if r else None
    return h
