"""``vtoken bench adapter``: the command (arguments, the printed table, the JSON line); the
measurement is :mod:`vtoken.reports.bench_adapter`.

Owns: nothing.
May call: vtoken.reports.bench_adapter, vtoken.argtypes, argparse, json.
Costs: those of the measurement (about 2 minutes a repeat; ``--against`` about 1 minute a
repeat and R = 64, 4 at R = 256).
"""

from __future__ import annotations

import json

from ..reports.bench_adapter import (AGAINST_VARIANTS, against_text, bench_adapter, bench_against, breakdown_text,
                                     parts_text, ratio_text)
from ..reports import bench_adapter as _measurement


def _variants(text: str) -> tuple:
    """``--variants``: comma-separated names of ``AGAINST_VARIANTS`` (adapter variants, not ``plain``)."""
    import argparse

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [v for v in names if v not in AGAINST_VARIANTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(bad) or 'none given'}: each must be one of "
                                         f"{', '.join(AGAINST_VARIANTS)}")
    return names


def main(argv=None) -> int:
    import argparse

    from ..argtypes import nonneg_int, positive_int

    ap = argparse.ArgumentParser(prog="vtoken bench adapter", description=_measurement.__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    ap.add_argument("--seed", type=nonneg_int, default=0)
    ap.add_argument("--profile", action="store_true", help="add the cProfile top-10 of evict50 at the largest R")
    ap.add_argument("--breakdown", action="store_true",
                    help="add a pass that times each part of the adapter's step (replay, plan, checks, other)")
    ap.add_argument("--repeats", type=positive_int, default=None,
                    help="the whole measurement N times; ratio = the median of the N ratios (default 1; "
                         "--against: 3)")
    ap.add_argument("--against", metavar="REF", default=None,
                    help="compare this tree's adapter with commit REF's, in one process (mean step over plain's)")
    ap.add_argument("--variants", type=_variants, default=None,
                    help="--against: comma-separated adapter variants (default off,evict50)")
    ap.add_argument("--R", type=positive_int, action="append", default=None, dest="Rs",
                    help="--against: a number of running requests (repeatable; default 64)")
    ap.add_argument("--json", action="store_true", help="(the last line is JSON either way)")
    a = ap.parse_args(argv)
    if a.against is None:
        for flag, v in (("--variants", a.variants), ("--R", a.Rs)):
            if v is not None:
                ap.error(f"argument {flag}: only with --against")
    else:
        for flag, v in (("--profile", a.profile), ("--breakdown", a.breakdown)):
            if v:
                ap.error(f"argument {flag}: not with --against")
        try:
            res = bench_against(a.against, seed=a.seed, quick=a.quick, Rs=tuple(a.Rs or (64,)),
                                repeats=a.repeats or 3, variants=a.variants or ("off", "evict50"))
        except ValueError as e:  # the ref (the variants were checked by their type above)
            ap.error(f"argument --against: {e}")
        for R in res["head_over_ref"]:
            print(against_text(res, R))
        print(json.dumps(res, sort_keys=True))
        return 0
    res = bench_adapter(seed=a.seed, quick=a.quick, profile_evict=a.profile, repeats=a.repeats or 1,
                        breakdown=a.breakdown)
    for R in res["ratio"]:
        print(f"R={R}: plain {res['median_ms'][R]['plain']:.2f} ms/step; " + ratio_text(res, R))
        print(f"R={R}, from mean step costs: " + ratio_text(res, R, "ratio_mean"))
        print(f"R={R}, over the whole run ({res['run_steps'][R]['plain']} steps, prefill and ends included): "
              + ratio_text(res, R, "ratio_run"))
        print(parts_text(res, R))
        if a.breakdown:
            print(breakdown_text(res, R))
    for line in res.get("profile_top10", []):
        print(line)
    print(json.dumps(res, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
