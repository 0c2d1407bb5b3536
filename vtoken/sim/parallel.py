"""A tiny task runner: in-process for ``jobs == 1``, else a spawn-started process pool.

Spawn (not fork): the table keeps torch tensors and torch's thread pools do not survive a
fork reliably. Workers pin torch to one thread so two workers share two cores fairly.

Owns: one spawn process pool per size, reused, shut down at exit (``atexit``).
May call: concurrent.futures, multiprocessing, torch (thread count), vtoken.progress; never spec/, invariants/, fuzz/
or reports/.
Costs: a pool start costs seconds; then O(tasks) scheduling, the tasks' own cost.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
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


def run_tasks(fn: Callable, args: Iterable[tuple], jobs: int, progress: Callable | None = None) -> list:
    """``[fn(*a) for a in args]``, in ``jobs`` processes when ``jobs > 1`` (results in input order).

    ``progress(done, total)`` is called after each task finishes (in this process)."""
    args = list(args)
    if jobs <= 1 or len(args) <= 1:
        _init()
        out = []
        for a in args:
            out.append(fn(*a))
            if progress:
                progress(len(out), len(args))
        return out
    ex = _pool(jobs)
    futs = [ex.submit(fn, *a) for a in args]
    if progress:
        for i, _ in enumerate(as_completed(futs), 1):
            progress(i, len(futs))
    return [f.result() for f in futs]


class Progress:
    """A progress display on a stream: ``progress(label, done, total)`` moves one bar per
    phase (``label``; :func:`vtoken.progress.bar`: a terminal only), ``note(msg)`` prints a
    phase's result line with the time since the display started (always)."""

    def __init__(self, stream=None):
        import sys

        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self._bar = None
        self._label = None

    def __call__(self, label: str, done: int, total: int) -> None:
        from ..progress import bar

        if label != self._label or self._bar is None:
            self.close()
            self._bar, self._label = bar(total=total, desc=label, unit="run", stream=self.stream), label
        self._bar.n = done
        self._bar.refresh()
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar, self._label = None, None

    def note(self, msg: str) -> None:
        self.close()
        print(f"[{time.perf_counter() - self.t0:6.0f} s] {msg}", file=self.stream, flush=True)
