"""vtoken's scheduler inside vLLM's engine: ``LLM(scheduler_cls="vtoken.vllm_engine.scheduler.Scheduler")``.

vLLM's own ``Scheduler`` with the adapter's hooks (``vllm_adapter.hooks.scheduler_class``) and,
when ``additional_config["vtoken"]`` is set, a ``VTokenAdapter`` attached at construction in the
engine core's process: vLLM's block pool stays the allocator, the adapter's runtime checks run
at every hook, its plans ride to the workers on each ``SchedulerOutput`` and their outcomes
come back on the outputs (``vllm_adapter.messages``). Its token table is a replica of the
worker's, replayed from each report.

Counters: with ``stats_path`` set, the adapter's counters, the worker's (from its last report),
the retained-block samples and the vLLM version are written there as one JSON object
(atomically) every ``STATS_EVERY`` non-empty steps and when the engine shuts down; at shutdown
the adapter also checks that every block it held went back (``close``) when nothing is left
running, and records the verdict (``closed``: true, or the error).
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

__all__ = ["Scheduler", "STATS_EVERY", "stats_of"]

STATS_EVERY = 64


def stats_of(ad) -> dict:
    """What the stats file holds (plain data)."""
    import vllm

    retained = [r for _, r, _ in ad.retained]
    return {"vllm_version": getattr(vllm, "__version__", None), "reclaim": bool(ad.reclaim), "steps": ad.steps,
            "adapter": dict(ad.stats), "worker": dict(ad.worker_stats), "block_size": ad.S, "num_blocks": ad.N,
            "retained_mean": (sum(retained) / len(retained)) if retained else 0.0,
            "retained_max": max(retained, default=0), "retained_samples": len(retained),
            "running_max": max((n for _, _, n in ad.retained), default=0), "plans_in_flight": len(ad.plans)}


class Scheduler(scheduler_class(_VllmScheduler)):
    """vLLM's scheduler; with vtoken's settings, the adapter attached (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.vtoken_settings = EngineSettings.from_vllm_config(self.vllm_config)
        self._vtoken_closed = None
        if self.vtoken_settings is None:
            return
        from ..vllm_adapter.adapter import VTokenAdapter

        VTokenAdapter.attach(self, **self.vtoken_settings.adapter_settings())

    def update_from_output(self, scheduler_output, model_runner_output):
        out = super().update_from_output(scheduler_output, model_runner_output)
        ad = self.vtoken_adapter
        if ad is not None and self.vtoken_settings.stats_path and scheduler_output.total_num_scheduled_tokens \
                and ad.steps % STATS_EVERY == 0:
            self._write_stats()
        return out

    def _write_stats(self) -> None:
        path = self.vtoken_settings.stats_path
        data = dict(stats_of(self.vtoken_adapter), closed=self._vtoken_closed)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)

    def vtoken_close(self) -> None:
        """At the end: every block back (``VTokenAdapter.close``) when nothing runs; the verdict kept."""
        ad = self.vtoken_adapter
        if ad is None or self._vtoken_closed is not None:
            return
        if self.has_unfinished_requests() or self.has_finished_requests():
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
            if self.vtoken_settings.stats_path:
                self._write_stats()
        super().shutdown()
