"""Field checks of configuration objects, one vocabulary for every constructor of the system.

Each ``need_*`` returns the value as a plain Python ``bool`` / ``int`` / ``float`` or raises
:class:`~vtoken.errors.ConfigError` (``bad_type`` or ``out_of_range``) with the message
``<Owner>.<field> must be <what>, got <value>``. A bool is not a number here, nor a float an
integer. Owners call them before they build anything.

Owns: nothing (pure checks).
May call: numpy, math, vtoken.errors; torch only for :func:`need_device`; never spec/,
invariants/, fuzz/ or reports/.
Costs: O(1) per field.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import numpy as np

from .errors import ConfigError

__all__ = ["is_bool", "is_int", "need_bool", "need_choice", "need_device", "need_instance", "need_int", "need_number",
           "refuse"]


def refuse(code: str, owner: str, name: str, want: str, value) -> None:
    """Raise the :class:`ConfigError` of a field: ``<owner>.<name> must be <want>, got <value>``."""
    raise ConfigError(code, f"{owner}.{name} must be {want}, got {value!r}")


def is_bool(v) -> bool:
    return isinstance(v, (bool, np.bool_))


def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not is_bool(v)


def need_int(owner: str, name: str, value, lo: Optional[int] = None, hi: Optional[int] = None,
             none_ok: bool = False) -> Optional[int]:
    """An integer in ``[lo, hi]`` (either end open when None); None too when ``none_ok``."""
    if value is None and none_ok:
        return None
    if lo is not None and hi is not None:
        want = f"an integer in [{lo}, {hi}]"
    else:
        want = "an integer" + (f" >= {lo}" if lo is not None else "") + (f" <= {hi}" if hi is not None else "")
    want += " or None" if none_ok else ""
    if not is_int(value):
        refuse("bad_type", owner, name, want, value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        refuse("out_of_range", owner, name, want, value)
    return int(value)


def need_number(owner: str, name: str, value, lo: Optional[float] = None, hi: Optional[float] = None,
                lo_open: bool = False, hi_open: bool = False) -> float:
    """A finite number in the range (``lo_open`` / ``hi_open``: that end excluded)."""
    if lo is not None and hi is not None:
        want = f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    else:
        want = "a finite number" + "".join(f" {op} {x:g}" for x, op in ((lo, ">" if lo_open else ">="),
                                                                       (hi, "<" if hi_open else "<="))
                                           if x is not None)
    if is_bool(value) or not isinstance(value, (int, float, np.integer, np.floating)):
        refuse("bad_type", owner, name, want, value)
    x = float(value)
    if (not math.isfinite(x) or (lo is not None and (x < lo or (lo_open and x == lo)))
            or (hi is not None and (x > hi or (hi_open and x == hi)))):
        refuse("out_of_range", owner, name, want, value)
    return x


def need_bool(owner: str, name: str, value, none_ok: bool = False) -> Optional[bool]:
    if value is None and none_ok:
        return None
    if not is_bool(value):
        refuse("bad_type", owner, name, "True or False" + (" or None" if none_ok else ""), value)
    return bool(value)


def need_choice(owner: str, name: str, value, choices: Iterable[str]) -> str:
    """One of ``choices`` (a name outside them is ``out_of_range``)."""
    choices = tuple(choices)
    want = f"one of {', '.join(choices)}"
    if not isinstance(value, str):
        refuse("bad_type", owner, name, want, value)
    if value not in choices:
        refuse("out_of_range", owner, name, want, value)
    return value


def need_instance(owner: str, name: str, value, types, none_ok: bool = False):
    """An instance of ``types`` (a class or a tuple of classes); None too when ``none_ok``."""
    if value is None and none_ok:
        return None
    if not isinstance(value, types):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        refuse("bad_type", owner, name, f"a {names}" + (" or None" if none_ok else ""), value)
    return value


def need_device(owner: str, name: str, device):
    """A ``str`` or ``torch.device`` naming a CPU or CUDA device, CUDA only where CUDA is
    available. Returns the ``torch.device``."""
    import torch

    want = "'cpu' or 'cuda' (a str or torch.device)"
    need_instance(owner, name, device, (str, torch.device))
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        refuse("out_of_range", owner, name, want, device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        refuse("out_of_range", owner, name, "a device this machine has (no CUDA device is available)", device)
    return dev
