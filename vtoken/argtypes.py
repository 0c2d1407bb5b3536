"""Argument checks shared by every ``vtoken`` command (argparse ``type=`` functions), the
system's (``vtoken/cli/``) and the toolkit's (``fuzz``, ``audit``, the pytest plugins').

Each returns the converted value or raises :class:`argparse.ArgumentTypeError` saying what is
wrong (argparse then exits 2 before the command runs). An output folder is checked for being
creatable and writable, a ``redis://`` URL for its syntax (and the ``redis`` package), a JSON
input for its kind; checks over several arguments go after ``parse_args`` (``ap.error``).

Owns: nothing (pure ``type=`` checks: nothing created, written or connected).
May call: argparse, json, os, pathlib, urllib.parse, importlib.util; torch only for ``device``; no
vtoken module.
Costs: O(1) per argument; a JSON input O(file size).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional
from urllib.parse import urlsplit

__all__ = ["positive_int", "nonneg_int", "int_in", "positive_float", "fraction_in", "percent", "writable_dir",
           "existing_dir", "existing_json_file", "json_object", "redis_url", "example_db", "comma_choices",
           "repeated", "device"]

Bad = argparse.ArgumentTypeError


def _int(value: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise Bad(f"expected an integer, got {value!r}") from None


def _float(value: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise Bad(f"expected a number, got {value!r}") from None
    if not math.isfinite(x):
        raise Bad(f"expected a finite number, got {value!r}")
    return x


def positive_int(value: str) -> int:
    """An integer >= 1."""
    n = _int(value)
    if n < 1:
        raise Bad(f"must be an integer >= 1, got {value!r}")
    return n


def nonneg_int(value: str) -> int:
    """An integer >= 0 (seeds, counts that may be zero)."""
    n = _int(value)
    if n < 0:
        raise Bad(f"must be an integer >= 0, got {value!r}")
    return n


def int_in(lo: int, hi: int, why: str = "") -> Callable[[str], int]:
    """An integer in ``[lo, hi]``; ``why`` says where the upper limit comes from."""
    def check(value: str) -> int:
        n = _int(value)
        if not lo <= n <= hi:
            raise Bad(f"must be an integer in [{lo}, {hi}]{' (' + why + ')' if why else ''}, got {value!r}")
        return n

    check.__name__ = f"integer in [{lo}, {hi}]"
    return check


def positive_float(value: str) -> float:
    """A finite number > 0 (durations)."""
    x = _float(value)
    if x <= 0:
        raise Bad(f"must be a number > 0, got {value!r}")
    return x


def fraction_in(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = True) -> Callable[[str], float]:
    """A finite number in ``[lo, hi)`` (``lo_open`` / ``hi_open`` say which ends are excluded)."""
    rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def check(value: str) -> float:
        x = _float(value)
        if (x < lo or (lo_open and x == lo)) or (x > hi or (hi_open and x == hi)):
            raise Bad(f"must be in {rng}, got {value!r}")
        return x

    check.__name__ = f"fraction in {rng}"
    return check


percent = fraction_in(0, 100, hi_open=False)


def writable_dir(value: str) -> str:
    """An output folder: a writable directory, or a path whose nearest existing parent is a
    writable directory (the command creates it later; nothing is created here)."""
    if not value:
        raise Bad("expected a folder, got ''")
    p = Path(value).expanduser()
    if p.exists() and not p.is_dir():
        raise Bad(f"{value!r} exists and is not a folder")
    q = p if p.exists() else p.absolute()
    while not q.exists():
        q = q.parent
    if not q.is_dir():
        raise Bad(f"{value!r} cannot be created: {str(q)!r} is not a folder")
    if not os.access(q, os.W_OK | os.X_OK):
        raise Bad(f"{value!r} is not writable ({str(q)!r} is not writable)")
    return value


def existing_dir(value: str) -> str:
    """A folder that exists."""
    if not Path(value).expanduser().is_dir():
        raise Bad(f"no such folder: {value!r}")
    return value


def existing_json_file(kind: str, check: Optional[Callable[[Any], Optional[str]]] = None) -> Callable[[str], str]:
    """A readable JSON file of a given ``kind``: ``check(obj)`` returns None when ``obj`` is
    one, else what is wrong with it. The path is returned (the command reads it when it
    needs it)."""

    def load(value: str) -> str:
        p = Path(value).expanduser()
        if not p.exists():
            raise Bad(f"no such file: {value!r}")
        if not p.is_file():
            raise Bad(f"{value!r} is not a file")
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise Bad(f"cannot read {value!r}: {e}") from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise Bad(f"{value!r} is not JSON ({e})") from None
        except (ValueError, RecursionError) as e:  # an integer of more digits than Python parses; nesting too deep
            raise Bad(f"{value!r} is not JSON vtoken reads ({type(e).__name__}: {str(e)[:200]})") from None
        why = check(obj) if check is not None else None
        if why:
            raise Bad(f"{value!r} is not {kind}: {why}")
        return value

    load.__name__ = kind
    return load


def json_object(value: str) -> dict:
    """An inline JSON object with string keys (keyword arguments, e.g. ``'{"reclaim": false}'``);
    returns the dict. ``''`` is ``{}``."""
    if not value.strip():
        return {}
    try:
        obj = json.loads(value)
    except (json.JSONDecodeError, ValueError, RecursionError) as e:
        raise Bad(f"{value[:80]!r} is not JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(obj, dict):
        raise Bad(f"expected a JSON object of keyword arguments, got {type(obj).__name__} {value[:80]!r}")
    bad = [k for k in obj if not k.isidentifier()]
    if bad:
        raise Bad(f"{bad[0]!r} is not a keyword argument name")
    return obj


def redis_url(value: str) -> str:
    """``redis://host[:port][/db]``, and the ``redis`` package installed (nothing connects)."""
    try:
        u = urlsplit(value)
        port = u.port  # raises on a port that is not a number in 0-65535
    except ValueError as e:
        raise Bad(f"{value!r} is not a redis://host:port URL ({e})") from None
    if u.scheme != "redis":
        raise Bad(f"{value!r} is not a redis://host:port URL")
    if not u.hostname:
        raise Bad(f"{value!r}: no host (expected redis://host:port)")
    if port == 0:
        raise Bad(f"{value!r}: port 0")
    db = u.path.lstrip("/")
    if db and not db.isdigit():
        raise Bad(f"{value!r}: the database after the port must be a number, got {db!r}")
    if importlib.util.find_spec("redis") is None:
        raise Bad(f"{value!r}: the redis package is not installed (pip install 'vtoken[redis]')")
    return value


def example_db(value: str) -> str:
    """A Hypothesis example database: ``redis://host:port[/db]`` or a folder (see
    :func:`redis_url`, :func:`writable_dir`)."""
    if "://" in value:
        return redis_url(value)
    return writable_dir(value)


def comma_choices(choices: Iterable[str], *, special: Iterable[str] = ()) -> Callable[[str], str]:
    """A comma-separated, non-empty subset of ``choices``, each name once (or one of
    ``special`` alone, e.g. ``all``). The string is returned unchanged."""
    choices, special = sorted(choices), tuple(special)

    def check(value: str) -> str:
        if value in special:
            return value
        names = [n.strip() for n in value.split(",") if n.strip()]
        if not names:
            raise Bad(f"expected a comma-separated list of {', '.join(choices)}, got {value!r}")
        bad = [n for n in names if n not in choices]
        if bad:
            alts = list(special) + choices
            more = f", ... ({len(alts)} in all)" if len(alts) > 12 else ""
            raise Bad(f"unknown {', '.join(map(repr, bad))} (choose from {', '.join(alts[:12])}{more})")
        twice = repeated(names)
        if twice:
            raise Bad(f"{', '.join(map(repr, twice))} given twice in {value!r}")
        return value

    check.__name__ = "comma-separated list"
    return check


def repeated(names: Iterable) -> list:
    """The names given more than once, in first-seen order (for ``nargs`` lists, checked
    after ``parse_args``: ``ap.error(f"argument --x: {n!r} given twice")``)."""
    seen, twice = set(), []
    for n in names:
        if n in seen and n not in twice:
            twice.append(n)
        seen.add(n)
    return twice


def device(value: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``; a CUDA device must be there (torch is imported only
    for a CUDA device)."""
    if value == "cpu":
        return value
    if value != "cuda" and not (value.startswith("cuda:") and value[5:].isdigit()):
        raise Bad(f"expected cpu, cuda or cuda:N, got {value!r}")
    import torch

    if not torch.cuda.is_available():
        raise Bad(f"{value!r} requested but torch.cuda is not available")
    if ":" in value and int(value[5:]) >= torch.cuda.device_count():
        raise Bad(f"{value!r}: only {torch.cuda.device_count()} CUDA device(s)")
    return value
