"""vtoken's scheduler inside vLLM's engine: ``LLM(scheduler_cls="vtoken.vllm_engine.scheduler.Scheduler")``.

vLLM's own ``Scheduler`` with the adapter's hooks (``vllm_adapter.hooks.scheduler_class``) and,
when ``additional_config["vtoken"]`` is set, a ``VTokenAdapter`` attached at construction in the
engine core's process: vLLM's block pool stays the allocator, the adapter's runtime checks run
at every hook, its plans ride to the workers on each ``SchedulerOutput`` and their outcomes
come back on the outputs (``vllm_adapter.messages``). Its token table is a replica of the
worker's, replayed from each report.

Counters: with ``stats_path`` set, the adapter's counters, the worker's (from its last report),
the retained-block samples, what the scheduler did (:class:`Observer`: requests running, their
peak before the first preemption, preemptions per request) and the vLLM version are written
there as one JSON object (atomically) every ``STATS_EVERY`` non-empty steps and when the engine
shuts down; at shutdown the adapter also checks that every block it held went back (``close``)
when nothing is left running, and records the verdict (``closed``: true, or the error). Without
vtoken's settings, ``additional_config={"vtoken_observe": {"stats_path": ...}}`` records the
observer's counters only: vLLM's scheduler unchanged, watched (the benchmark's plain mode).
Owns: the adapter it attaches (through the hooks).
May call: vLLM's scheduler, ``VTokenAdapter``, ``settings``.
Costs: the adapter's per step; the stats file O(counters) every ``STATS_EVERY`` steps.
"""

from __future__ import annotations

import json
import os

from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler

from ..vllm_adapter.hooks import scheduler_class
from .settings import EngineSettings

__all__ = ["Scheduler", "Observer", "STATS_EVERY", "OBSERVE_KEY", "stats_of"]

STATS_EVERY = 64
OBSERVE_KEY = "vtoken_observe"


class Observer:
    """What vLLM's scheduler did, step by step (read only): non-empty steps, requests running
    (the peak, and the peak before the first preemption), preemptions per request, blocks in
    use (the peak)."""

    def __init__(self):
        self.steps = self.peak_running = self.peak_before_preemption = self.preemptions = self.peak_used = 0
        self.preempted: dict = {}

    def scheduled(self, sched, sched_out) -> None:
        if sched_out.total_num_scheduled_tokens <= 0:
            return
        self.steps += 1
        n = len(sched.running)
        self.peak_running = max(self.peak_running, n)
        for r in sched_out.preempted_req_ids or ():
            self.preempted[r] = self.preempted.get(r, 0) + 1
            self.preemptions += 1
        if not self.preemptions:
            self.peak_before_preemption = self.peak_running
        pool = sched.kv_cache_manager.block_pool
        self.peak_used = max(self.peak_used, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())

    def to_dict(self) -> dict:
        return {"steps": self.steps, "peak_running": self.peak_running,
                "peak_running_before_preemption": self.peak_before_preemption, "preemptions": self.preemptions,
                "preempted": dict(self.preempted), "peak_used_blocks": self.peak_used}


def stats_of(ad) -> dict:
    """The adapter's part of the stats file (plain data)."""
    retained = [r for _, r, _ in ad.retained]
    return {"reclaim": bool(ad.reclaim), "steps": ad.steps,
            "adapter": dict(ad.stats), "worker": dict(ad.worker_stats), "block_size": ad.S, "num_blocks": ad.N,
            "retained_mean": (sum(retained) / len(retained)) if retained else 0.0,
            "retained_max": max(retained, default=0), "retained_samples": len(retained),
            "running_max": max((n for _, _, n in ad.retained), default=0), "plans_in_flight": len(ad.plans)}


class Scheduler(scheduler_class(_VllmScheduler)):
    """vLLM's scheduler; with vtoken's settings, the adapter attached (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.vtoken_settings = s = EngineSettings.from_vllm_config(self.vllm_config)
        self._vtoken_closed = None
        observe = ((getattr(self.vllm_config, "additional_config", None) or {}).get(OBSERVE_KEY) or {})
        self._stats_path = s.stats_path if s is not None else observe.get("stats_path")
        self.vtoken_observer = Observer() if (self._stats_path or s is not None) else None  # O(1) a step
        if s is None:
            return
        from ..vllm_adapter.adapter import VTokenAdapter

        VTokenAdapter.attach(self, **s.adapter_settings())

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        if self.vtoken_observer is not None:
            self.vtoken_observer.scheduled(self, out)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        out = super().update_from_output(scheduler_output, model_runner_output)
        obs = self.vtoken_observer
        if self._stats_path and obs is not None and scheduler_output.total_num_scheduled_tokens \
                and obs.steps % STATS_EVERY == 0:
            self._write_stats()
        return out

    def _write_stats(self) -> None:
        import vllm

        path = self._stats_path
        data = {"vllm_version": getattr(vllm, "__version__", None), "closed": self._vtoken_closed,
                "scheduler": self.vtoken_observer.to_dict()}
        if self.vtoken_adapter is not None:
            data.update(stats_of(self.vtoken_adapter))
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)

    def vtoken_close(self) -> None:
        """At the end: every block back (``VTokenAdapter.close``) when nothing runs; the verdict kept."""
        ad = self.vtoken_adapter
        if ad is None or self._vtoken_closed is not None:
            return
        if self.get_num_unfinished_requests() or self.has_finished_requests():
            self._vtoken_closed = "requests still pending at shutdown"
            return
        try:
            ad.close()
            self._vtoken_closed = True
        except AssertionError as e:
            self._vtoken_closed = str(e)

    def shutdown(self) -> None:
        if self.vtoken_adapter is not None:
            self.vtoken_close()
        if self._stats_path and self.vtoken_observer is not None:
            self._write_stats()
        super().shutdown()
