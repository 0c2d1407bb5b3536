"""What the scheduler side and the worker tell each other, step by step.

:class:`StepMeta` rides on a ``SchedulerOutput`` as
``sched_out.vtoken`` (the step's plans and releases, to execute after its forward);
:class:`AdapterPlan` is one compaction plan in vLLM's block objects; the worker answers with
a :class:`WorkerReport` on ``ModelRunnerOutput.vtoken_report`` (per finished plan a
:class:`PlanResult`, and each request's full-context length). No behaviour.
Owns: the plain records only (plan blocks belong to the adapter, see ``plans``).
May call: numpy.
Costs: none beyond building the records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np


@dataclass
class AdapterPlan:
    """One compaction plan as the scheduler side made it (vLLM ``KVCacheBlock`` objects).

    Ownership: from launch until the worker reports it, the adapter holds the plan's
    sources and fills (null-substituted out of the request's list or taken from its held
    destinations, one reference each) and its fresh destinations (taken from the headroom)."""

    id: int
    req_id: str
    seq: int  # the step that carries it (its fence)
    sources: list  # KVCacheBlock
    dests: list  # KVCacheBlock (from the headroom)
    moves: np.ndarray  # (k, 5): token, src_block, src_offset, dst_block, dst_offset
    fills: list = field(default_factory=list)  # KVCacheBlock: the request's blocks whose holes take tokens
    list_index: dict = field(default_factory=dict)  # source or fill block id -> its index in the request's list (-1: held)
    snapshot: Optional[dict] = None  # the plan snapshot (planner_config.record_snapshots)
    orphaned: bool = False  # the request was freed while the plan flew
    clock: Optional[Callable[[], int]] = None  # the adapter's logical clock (snapshot events)

    @property
    def source_ids(self) -> list[int]:
        return [b.block_id for b in self.sources]

    @property
    def dest_ids(self) -> list[int]:
        return [b.block_id for b in self.dests]

    @property
    def fill_ids(self) -> list[int]:
        return [b.block_id for b in self.fills]

    @property
    def blocks(self) -> list:
        """Every block the plan holds while it flies: sources, fills, fresh destinations."""
        return self.sources + self.fills + self.dests

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def record(self, kind: str, **fields) -> None:
        """Append an event to the plan's snapshot schedule (when a snapshot is recorded)."""
        if self.snapshot is not None and self.clock is not None:
            self.snapshot["schedule"].append({"t": self.clock(), "kind": kind, **fields})


@dataclass
class StepMeta:
    """What the adapter attaches to a ``SchedulerOutput`` (``sched_out.vtoken``)."""

    seq: int  # Scheduler.sched_step_seq of this step (0: an empty step, nothing attached)
    plans: list = field(default_factory=list)  # AdapterPlan, to copy after this step's forward
    releases: dict = field(default_factory=dict)  # req_id -> [block ids] released (all tokens dead)
    reclaim: bool = True


@dataclass
class PlanResult:
    status: str  # "applied" | "aborted"
    used_dests: list = field(default_factory=list)  # fresh destinations that received a token (not fills)
    moved: int = 0
    copy_done: bool = True  # the copy out of the sources has completed (or never ran)
    table_kept: bool = False  # aborted with the request still reading its sources
    shared_sources: list = field(default_factory=list)
    reason: str = ""


@dataclass
class WorkerReport:
    plans: dict = field(default_factory=dict)  # plan id -> PlanResult (plans finished now)
    faithful: dict = field(default_factory=dict)  # req -> leading tokens computed with full context
