"""Field checks of the simulator's public objects (``Replay``, ``Schedule``, ``Request``,
``AttentionModel``, the trace, budget and schedule makers, the experiments' ``run_*``).

Each check returns the value (an integer or a number as a Python ``int`` / ``float``) or
raises :class:`~vtoken.errors.ConfigError` (``bad_type`` / ``out_of_range``, the codes of
``PlannerConfig``) naming ``Owner.field`` and the value. The owners call them first, before
they build anything. A bool is not a number here, nor a float an integer.

Owns: nothing (pure checks).
May call: numpy, math, vtoken.errors; never spec/, invariants/, fuzz/ or reports/.
Costs: O(1) per field.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import numpy as np

from vtoken.errors import ConfigError

__all__ = ["need_int", "need_number", "need_bool", "need_choice", "need_run_args"]


def _bad(code: str, owner: str, name: str, want: str, value) -> ConfigError:
    return ConfigError(code, f"{owner}.{name} must be {want}, got {value!r}")


def _is_bool(v) -> bool:
    return isinstance(v, (bool, np.bool_))


def need_int(owner: str, name: str, value, lo: Optional[int] = None, hi: Optional[int] = None,
             none_ok: bool = False) -> Optional[int]:
    """An integer in ``[lo, hi]`` (either end open when None); None too when ``none_ok``."""
    if value is None and none_ok:
        return None
    if lo is not None and hi is not None:
        rng = f"an integer in [{lo}, {hi}]"
    else:
        rng = "an integer" + (f" >= {lo}" if lo is not None else "") + (f" <= {hi}" if hi is not None else "")
    rng += " or None" if none_ok else ""
    if _is_bool(value) or not isinstance(value, (int, np.integer)):
        raise _bad("bad_type", owner, name, rng, value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _bad("out_of_range", owner, name, rng, value)
    return int(value)


def need_number(owner: str, name: str, value, lo: Optional[float] = None, hi: Optional[float] = None,
                lo_open: bool = False, hi_open: bool = False) -> float:
    """A finite number in the range (``lo_open`` / ``hi_open``: that end excluded)."""
    rng = "a finite number" + "".join(
        f" {op} {x:g}" for x, op in ((lo, ">" if lo_open else ">="), (hi, "<" if hi_open else "<=")) if x is not None)
    if _is_bool(value) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise _bad("bad_type", owner, name, rng, value)
    x = float(value)
    if (not math.isfinite(x) or (lo is not None and (x < lo or (lo_open and x == lo)))
            or (hi is not None and (x > hi or (hi_open and x == hi)))):
        raise _bad("out_of_range", owner, name, rng, value)
    return x


def need_bool(owner: str, name: str, value) -> bool:
    if not _is_bool(value):
        raise _bad("bad_type", owner, name, "True or False", value)
    return bool(value)


def need_choice(owner: str, name: str, value, choices: Iterable[str]) -> str:
    """One of ``choices`` (a name outside them is ``out_of_range``)."""
    choices = tuple(choices)
    if not isinstance(value, str):
        raise _bad("bad_type", owner, name, f"one of {', '.join(choices)}", value)
    if value not in choices:
        raise _bad("out_of_range", owner, name, f"one of {', '.join(choices)}", value)
    return value


def need_run_args(owner: str, quick, seeds, jobs) -> None:
    """The arguments every experiment (``run_waste`` ... ``run_all``) takes: ``quick`` a bool,
    ``seeds`` and ``jobs`` None (the experiment's default) or integers >= 1."""
    need_bool(owner, "quick", quick)
    need_int(owner, "seeds", seeds, 1, none_ok=True)
    need_int(owner, "jobs", jobs, 1, none_ok=True)
