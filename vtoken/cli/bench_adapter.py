"""``vtoken bench adapter``: the command (arguments, the printed table, the JSON line); the
measurement is :mod:`vtoken.reports.bench_adapter`.

Owns: nothing.
May call: vtoken.reports.bench_adapter, vtoken.argtypes, argparse, json.
Costs: those of the measurement (about 2 minutes a repeat).
"""

from __future__ import annotations

import json

from ..reports.bench_adapter import bench_adapter, breakdown_text, ratio_text
from ..reports import bench_adapter as _measurement


def main(argv=None) -> int:
    import argparse

    from ..argtypes import nonneg_int, positive_int

    ap = argparse.ArgumentParser(prog="vtoken bench adapter", description=_measurement.__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    ap.add_argument("--seed", type=nonneg_int, default=0)
    ap.add_argument("--profile", action="store_true", help="add the cProfile top-10 of evict50 at the largest R")
    ap.add_argument("--breakdown", action="store_true",
                    help="add a pass that times each part of the adapter's step (replay, plan, checks, other)")
    ap.add_argument("--repeats", type=positive_int, default=1,
                    help="the whole measurement N times; ratio = the median of the N ratios")
    ap.add_argument("--json", action="store_true", help="(the last line is JSON either way)")
    a = ap.parse_args(argv)
    res = bench_adapter(seed=a.seed, quick=a.quick, profile_evict=a.profile, repeats=a.repeats, breakdown=a.breakdown)
    for R in res["ratio"]:
        print(f"R={R}: plain {res['median_ms'][R]['plain']:.2f} ms/step; " + ratio_text(res, R))
        print(f"R={R}, from mean step costs: " + ratio_text(res, R, "ratio_mean"))
        if a.breakdown:
            print(breakdown_text(res, R))
    for line in res.get("profile_top10", []):
        print(line)
    print(json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
