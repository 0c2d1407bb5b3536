"""``vtoken bench table|planner|decode|adapter|engine``: the command. The measurements live in
:mod:`vtoken.reports.bench` (table, planner), :func:`vtoken.cli.decode.bench_decode`,
:mod:`vtoken.reports.bench_adapter` and :mod:`vtoken.reports.bench_engine` (capacity in vLLM's
real engine, run in the engine environment); each prints figures and, as its last line, one
JSON object.

Owns: nothing.
May call: vtoken.reports.bench, .bench_adapter, .bench_engine, .decode, .engine (the engine's
interpreter), vtoken.argtypes, argparse, json.
Costs: those of the benchmark run.
"""

from __future__ import annotations

import json

from ..reports.bench import bench_planner, bench_table


def main_bench(argv) -> int:
    import argparse
    import importlib.util

    from ..argtypes import nonneg_int, positive_int

    ap = argparse.ArgumentParser(prog="vtoken bench")
    ap.add_argument("what", choices=sorted(BENCHES))
    ap.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    ap.add_argument("--seed", type=nonneg_int, default=0)
    ap.add_argument("--profile", action="store_true", help="adapter: add the cProfile top-10 of evict50 at the largest R")
    ap.add_argument("--breakdown", action="store_true", help="adapter: add a pass timing each part of the adapter's step")
    ap.add_argument("--repeats", type=positive_int, default=None,
                    help="adapter: the whole measurement N times, ratio = the median of the N ratios (default 1)")
    ap.add_argument("--against", metavar="REF", default=None,
                    help="adapter: compare this tree's adapter with commit REF's, in one process")
    ap.add_argument("--variants", default=None, help="adapter --against: comma-separated variants (default off,evict50)")
    ap.add_argument("--R", default=None, action="append", dest="Rs",
                    help="adapter --against: a number of running requests (repeatable; default 64)")
    ap.add_argument("--checks", action="store_true", help="engine: the runtime checks and hash-and-compare on")
    ap.add_argument("--json", action="store_true", help="(the last stdout line is one JSON object either way)")
    a = ap.parse_args(argv)
    if a.checks and a.what != "engine":
        ap.error("argument --checks: only with engine")
    if a.profile and a.what != "adapter":
        ap.error("argument --profile: only with adapter")
    if a.breakdown and a.what != "adapter":
        ap.error("argument --breakdown: only with adapter")
    if a.repeats is not None and a.what != "adapter":
        ap.error("argument --repeats: only with adapter")
    for flag, v in (("--against", a.against), ("--variants", a.variants), ("--R", a.Rs)):
        if v is not None and a.what != "adapter":
            ap.error(f"argument {flag}: only with adapter")
    if a.what == "adapter" and importlib.util.find_spec("vllm") is None:
        ap.error("argument what: adapter needs vLLM installed (make vllm)")
    if a.what == "engine":  # vLLM's real engine: in the engine environment, a process per mode
        from ..reports.bench_engine import bench_engine, table
        from .engine import engine_python

        kw = dict(seed=a.seed, checks=a.checks)
        if a.quick:
            kw.update(requests=8, new_tokens=96, num_blocks=24)
        res = bench_engine(python=engine_python(), **kw)
        print(table(res), flush=True)
        print(json.dumps(res, sort_keys=True))
        return 0
    if a.what == "adapter":  # prints its own table, then the JSON line
        from .bench_adapter import main as bench_adapter_main

        return bench_adapter_main((["--quick"] if a.quick else []) + ["--seed", str(a.seed)] +
                                  (["--profile"] if a.profile else []) + (["--breakdown"] if a.breakdown else []) +
                                  (["--repeats", str(a.repeats)] if a.repeats is not None else []) +
                                  (["--against", a.against] if a.against is not None else []) +
                                  (["--variants", a.variants] if a.variants is not None else []) +
                                  [x for R in a.Rs or () for x in ("--R", R)])
    res = BENCHES[a.what](seed=a.seed, quick=a.quick)
    print(json.dumps(res, sort_keys=True))
    return 0


BENCHES = {"table": bench_table, "planner": bench_planner, "engine": None}  # engine: handled in main_bench


def _bench_decode(seed=0, quick=False):
    from .decode import bench_decode

    return bench_decode(quick=quick, seed=seed)


BENCHES["decode"] = _bench_decode


def _bench_adapter(seed=0, quick=False):
    from ..reports.bench_adapter import bench_adapter

    return bench_adapter(seed=seed, quick=quick)


BENCHES["adapter"] = _bench_adapter
