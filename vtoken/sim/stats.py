"""Median-and-spread summaries over seeds.

Owns: nothing (pure functions).
May call: numpy, statistics; never spec/, invariants/, fuzz/ or reports/.
Costs: O(values).
"""

from __future__ import annotations

import statistics
from typing import Sequence

import numpy as np


def summary(xs: Sequence[float]) -> dict:
    """median, min, max, q1, q3 and n of a list of per-seed values."""
    a = np.asarray([x for x in xs if x is not None], dtype=np.float64)
    if a.size == 0:
        return dict(median=None, min=None, max=None, q1=None, q3=None, n=0)
    return dict(median=float(np.median(a)), min=float(a.min()), max=float(a.max()),
                q1=float(np.percentile(a, 25)), q3=float(np.percentile(a, 75)), n=int(a.size))


def int_summary(xs: Sequence[int]) -> dict:
    """For integer outcomes (a concurrency): the lower median, so it is a value some seed got."""
    xs = [int(x) for x in xs]
    return dict(median=int(statistics.median_low(xs)), min=min(xs), max=max(xs), n=len(xs), per_seed=xs)


def fmt(s: dict, pct: bool = False, digits: int = 1) -> str:
    """'median [min, max]'."""
    if s.get("median") is None:
        return "n/a"
    k = 100.0 if pct else 1.0
    suf = "%" if pct else ""
    return f"{s['median'] * k:.{digits}f}{suf} [{s['min'] * k:.{digits}f}, {s['max'] * k:.{digits}f}]"
