"""What the scheduler side and the worker tell each other, step by step: :class:`StepMeta`
on ``sched_out.vtoken`` (the step's plans, :class:`vtoken.lifecycle.Plan` records, and its
releases, to execute after its forward); the worker's :class:`WorkerReport` on
``ModelRunnerOutput.vtoken_report`` (a ``vtoken.lifecycle.Outcome`` per finished plan, each request's
full-context length). No behaviour.
Owns: the plain records only (plan blocks belong to the adapter, see ``plans``).
May call: nothing.
Costs: none beyond building the records.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepMeta:
    """What the adapter attaches to a ``SchedulerOutput`` (``sched_out.vtoken``)."""

    seq: int  # the fence clock's seq of this step (fence.StepClock; 0: an empty step, nothing attached)
    plans: list = field(default_factory=list)  # lifecycle.Plan, to copy after this step's forward
    releases: dict = field(default_factory=dict)  # req_id -> [block ids] released (all tokens dead)
    reclaim: bool = True


@dataclass
class WorkerReport:
    plans: dict = field(default_factory=dict)  # plan id -> vtoken.lifecycle.Outcome (plans finished now)
    faithful: dict = field(default_factory=dict)  # req -> leading tokens computed with full context
