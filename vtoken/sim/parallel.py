"""A tiny task runner: in-process for ``jobs == 1``, else a spawn-started process pool.

Spawn (not fork): the table keeps torch tensors and torch's thread pools do not survive a
fork reliably. Workers pin torch to one thread so two workers share two cores fairly.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable


def default_jobs(quick: bool) -> int:
    return 1 if quick else max(1, min(2, os.cpu_count() or 1))


def _init() -> None:
    try:
        import torch

        torch.set_num_threads(1)
    except Exception:  # noqa: BLE001
        pass


_POOL: dict = {}


def _pool(jobs: int) -> ProcessPoolExecutor:
    """One spawn pool per size, reused across experiments (a spawn start costs seconds)."""
    ex = _POOL.get(jobs)
    if ex is None:
        ex = _POOL[jobs] = ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"),
                                               initializer=_init)
    return ex


def shutdown() -> None:
    for ex in _POOL.values():
        ex.shutdown(wait=True, cancel_futures=True)
    _POOL.clear()


atexit.register(shutdown)


def run_tasks(fn: Callable, args: Iterable[tuple], jobs: int) -> list:
    """``[fn(*a) for a in args]``, in ``jobs`` processes when ``jobs > 1`` (results in input order)."""
    args = list(args)
    if jobs <= 1 or len(args) <= 1:
        _init()
        return [fn(*a) for a in args]
    ex = _pool(jobs)
    futs = [ex.submit(fn, *a) for a in args]
    return [f.result() for f in futs]
