"""The engine-core loop around an adapter and its worker (tests, audits, benchmarks).

``AdapterDriver`` runs them as vLLM's engine core does: with async scheduling a second step
is scheduled before the first's output is processed; outputs apply in FIFO order; the worker
executes a step when its output is needed, so the scheduler plans from a table one step stale.
What crosses between the two is what crosses between vLLM's engine processes: with ``wire``
(the default) the worker gets a pickled copy of each ``SchedulerOutput`` and the adapter a
pickled copy of each ``ModelRunnerOutput``, so no live object is shared (``messages``).
Owns: the queue of outputs in flight (at most two with async scheduling).
May call: the adapter's ``schedule`` / ``update_from_output`` / ``drain_idle`` and the
worker's ``execute``.
Costs: O(1) per step beyond the calls it makes.
"""

from __future__ import annotations

import pickle
from collections import deque
from ..errors import OrderError


def _wire(obj):
    """``obj`` as the other process would receive it (vLLM pickles both messages)."""
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class AdapterDriver:
    def __init__(self, adapter, worker, wire: bool = True):
        self.ad = adapter
        self.worker = worker
        self.wire = bool(wire)
        adapter.attach_worker(worker)
        self.in_flight: deque = deque()
        self.depth = 2 if adapter.async_scheduling else 1
        self.steps = 0

    def step(self) -> None:
        sched_out = self.ad.schedule()
        self.in_flight.append(sched_out)
        self.steps += 1
        if len(self.in_flight) >= self.depth or not self.ad.has_work():
            self._finish_one()

    def _finish_one(self) -> None:
        sched_out = self.in_flight.popleft()
        out = self.worker.execute(_wire(sched_out) if self.wire else sched_out)
        self.ad.update_from_output(sched_out, _wire(out) if self.wire else out)

    def drain(self, max_steps: int = 20000) -> int:
        n = 0
        while self.ad.has_work():
            if n >= max_steps:
                raise OrderError("did_not_finish", f"requests still pending after {max_steps} steps")
            self.step()
            n += 1
        while self.in_flight:
            self._finish_one()
        self.ad.drain_idle()
        return n
