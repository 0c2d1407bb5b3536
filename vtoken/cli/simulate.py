"""``vtoken simulate EXPERIMENT [--seeds N] [--json] [--out DIR] [--quick] [--jobs N]``.

Runs the paper's experiments through the real token table, planner and allocator (see
:mod:`vtoken.sim`). EXPERIMENT is one of ``waste``, ``retained``, ``frontier``, ``sweeps``,
``scaling``, ``robustness`` or ``all`` (every figure but robustness). Each writes
``EXPERIMENT.md``, ``.json`` and ``.png`` into ``--out`` (default
``reports/simulate-<timestamp>/``). Progress goes to stderr. With ``--json`` the last line
printed is one JSON object (for ``frontier``: ``{"frontier": {"5427": {"native": C,
"naive-evict": C, "vtoken": C, "vtoken_default": C}, "11519": {...}, "qwen-3438": {...}},
"ideal": {...}, "traffic": {...}, ...}``; for ``robustness``: ``{"grid": {budget: {"K=k,latency=l":
{"frontier": {median, min, max}, "ideal": C, ...}}}, "min_over_ideal": x, ...}``).

Owns: nothing (writes only the experiment files under ``--out``).
May call: vtoken.sim (the experiments, ``report``, ``parallel.Progress``), .args, argparse, json.
Costs: the experiment's: seconds with ``--quick``, minutes to hours for the full figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..sim import COMMANDS, run_all
from ..sim.parallel import Progress
from ..sim.report import _jsonable
from ..argtypes import positive_int, writable_dir

__all__ = ["main_simulate", "run_waste", "run_retained", "run_frontier", "run_sweeps", "run_scaling",
           "run_robustness", "run_all"]

from ..sim import run_frontier, run_retained, run_robustness, run_scaling, run_sweeps, run_waste  # noqa: E402


def _mmm(s: dict) -> dict:
    return {k: s[k] for k in ("median", "min", "max")}


def _line(name: str, res: dict) -> dict:
    """The JSON object printed last: the experiment's headline numbers (never the raw runs)."""
    base = dict(experiment=name, quick=res.get("quick"), seeds=res.get("seeds"), wall_s=res.get("wall_s"),
                files=res.get("files"))
    if name == "frontier":
        base.update(frontier=res["frontier"], ideal=res["ideal"], paper=res["paper"], budgets=res["budgets"],
                    spread={b: {m: _mmm(v) for m, v in d.items()} for b, d in res["spread"].items()},
                    traffic={b: {m: {k: _mmm(v) for k, v in t.items()} for m, t in d.items() if t}
                             for b, d in res["traffic"].items()},
                    planner_defaults=res["planner"]["default"])
    elif name == "robustness":
        base.update(grid={b: {k: dict(frontier=_mmm(c["frontier"]), ideal=c["ideal"], over_ideal=c["over_ideal"],
                                      feasible_seeds=c["feasible_seeds"], seeds=c["seeds"],
                                      peak_inflight_mib=_mmm(c["peak_inflight_mib"]),
                                      moved_over_bound=_mmm(c["moved_over_bound"]))
                              for k, c in g.items()} for b, g in res["grid"].items()},
                    min_over_ideal=res["min_over_ideal"], min_over_ideal_by_budget=res["min_over_ideal_by_budget"],
                    ideal=res["ideal"], budgets=res["budgets"], geometry=res["geometry"],
                    latencies=res["latencies"], intervals=res["intervals"], planner=res["planner"])
    elif name == "waste":
        base.update(table=res["table"], paper=res["paper"])
    elif name == "retained":
        base.update(reduction_range=res["reduction_range"], paper=res["paper"],
                    reduction={w: {p: v["reduction"] for p, v in ps.items()} for w, ps in res["table"].items()})
    elif name == "sweeps":
        base.update(theta={k: v["ratio_to_ideal"] for k, v in res["theta"].items()})
    elif name == "scaling":
        base.update(per_request_ratio_1024_over_64=res["per_request_ratio_1024_over_64"],
                    loglog_slope=res["loglog_slope"])
    return base


def main_simulate(argv) -> int:
    ap = argparse.ArgumentParser(prog="vtoken simulate", description=__doc__.split("\n\n")[1])
    ap.add_argument("experiment", choices=sorted(COMMANDS) + ["all"])
    ap.add_argument("--seeds", type=positive_int, default=None,
                    help="seeds per figure (default 5, robustness 2; quick 2, robustness 1)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--out", type=writable_dir, default=None, help="output folder (default reports/simulate-<timestamp>)")
    ap.add_argument("--quick", action="store_true", help="small, fast settings (tests, smoke runs)")
    ap.add_argument("--jobs", type=positive_int, default=None, help="worker processes (default 2; quick 1)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if a.json else (lambda m: print(m, flush=True))
    progress = Progress(sys.stderr)
    if a.experiment == "all":
        res = run_all(quick=a.quick, seeds=a.seeds, out=a.out, jobs=a.jobs, progress=progress)
        line = dict(experiment="all", quick=a.quick, total_s=res["total_s"], timings_s=res["timings_s"],
                    out=res["out"], headline=res["headline"])
    else:
        res = COMMANDS[a.experiment](quick=a.quick, seeds=a.seeds, out=a.out, jobs=a.jobs, progress=progress)
        line = _line(a.experiment, res)
        log(f"{a.experiment}: {time.perf_counter() - t0:.1f} s -> {res['files']['md']}")
        if not a.json:
            with open(res["files"]["md"]) as f:
                print(f.read().split("\n## Method")[0])
    if a.json:
        print(json.dumps(_jsonable(line), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main_simulate(sys.argv[1:]))
