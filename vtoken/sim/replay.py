"""The replay engine: eviction schedules through the real TokenTable, BlockAllocator and
ReclamationManager, with no K/V bytes.

One scheduler step, per running request in admission order: (1) growth: a new block when
the last one is full (none free = **preemption**: the run is infeasible), then
``sync_new_tokens``; (2) the step's victims evicted, a block left with no live token
released at once; (3) a finished request frees what it holds (blocks of an in-flight copy
when it ends; ``run`` drains the manager, so a completed run holds no block). Then, for
vToken, ``ReclamationManager.step()`` with ``NullCopyEngine(latency)`` (``latency = 1``: a
plan launched at step ``t`` applies at ``t + 2``).

A victim in a source of an in-flight plan is *deferred*: the table learns of it right after
the plan applies (``defer_inflight_victims=False`` evicts at once, safe only with a planner
that drops dead moves). Blocks of in-flight plans are freed only by their plan. Demand is
``used + reserved`` blocks.

Owns: a run's TokenTable, BlockAllocator, ReclamationManager (or, without reclamation, a
plan-less lifecycle: either holds every block of every request) and the timelines.
May call: vtoken.table, .allocator, .planner, .errors, vtoken.sim.schedule, .config, numpy; never spec/,
invariants/, fuzz/ or reports/.
Costs: per step O(running requests + victims + new blocks) plus ``manager.step``; samples
O(requests).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from vtoken.allocator import BlockAllocator
from vtoken.errors import ConfigError
from vtoken.lifecycle import AllocatorPort, Lifecycle, all_dead
from vtoken.planner import MODES, NullCopyEngine, PlannerConfig, ReclamationManager
from vtoken.table import MAX_BLOCK_SIZE, MAX_BLOCKS, MAX_SLOTS, TokenTable

from .config import need_bool, need_choice, need_int
from .schedule import Schedule



@dataclass
class _R:
    id: int
    sched: Schedule
    s: int = 0  # next local step
    n: int = 0
    pos: list = field(default_factory=list)  # positional block list (null entries never read)
    deferred: list = field(default_factory=list)
    start: int = 0
    peak_held: int = 0


class Preempted(Exception):
    pass


def _chunks(P: int):
    """Prefill sync lengths that double from 64."""
    n = 0
    while n < P:
        n = min(P, max(64, 2 * n))
        yield n


class Replay:
    """One replay of ``schedules`` (:class:`Schedule`, admission order) in ``mode`` (``native`` |
    ``naive-evict`` | ``vtoken``) over ``num_blocks`` blocks of ``block_size`` slots (null block
    included). ``planner``: default ``PlannerConfig()``; ``latency``: copy polls before a plan
    completes; ``max_batch``: running requests at most; ``sample_every`` / ``flush_every``: steps
    between block samples / table flushes (0: never); ``timeline_every`` >= 1; the rest are
    switches. Every argument is checked (ConfigError naming ``Replay.<field>``) before the
    table, allocator and manager are built."""

    def __init__(self, schedules: list[Schedule], mode: str, block_size: int, num_blocks: int,
                 planner: PlannerConfig | None = None, latency: int = 1, max_batch: int | None = None,
                 sample_every: int = 16, flush_every: int = 64, stop_on_preempt: bool = True,
                 timeline: bool = False, phase_timing: bool = False, slot_mapping: bool = False,
                 force_sync: bool = False, req_timeline: bool = False, timeline_every: int = 1,
                 defer_inflight_victims: bool = True):
        self._check_args(locals())
        self.mode, self.S, self.num_blocks = mode, int(block_size), int(num_blocks)
        self.table = TokenTable(self.S, self.num_blocks)
        self.alloc = BlockAllocator(self.num_blocks)
        self.queue = list(enumerate(schedules))
        self.max_batch = max_batch or len(schedules)
        self.sample_every, self.flush_every = int(sample_every), int(flush_every)
        self.stop_on_preempt = bool(stop_on_preempt)
        self.timeline = bool(timeline)
        self.timeline_every = int(timeline_every)
        self.req_tl: list | None = [] if req_timeline else None
        self.phase_timing, self.want_slot_mapping = bool(phase_timing), bool(slot_mapping)
        self.force_sync = bool(force_sync)
        self.active: list[_R] = []
        self.mgr = None
        if mode == "vtoken":
            self.mgr = ReclamationManager(self.table, self.alloc, NullCopyEngine(latency), planner or PlannerConfig())
        # the lifecycle holds every block of every request (without reclamation, one with no plans);
        # its busy mask: blocks of in-flight plans, whose victims wait (defer_inflight_victims)
        self.lifecycle = self.mgr.lifecycle if self.mgr else Lifecycle(AllocatorPort(self.alloc), self.num_blocks)
        self.busy_mask = self.lifecycle.busy_mask
        self.reqs: dict[int, _R] = {}
        self.evicts = mode != "native"
        self.defer = bool(defer_inflight_victims)
        self.step_no = 0
        self.preempted_at = None
        self.inflight_victims = 0  # victims that sat in a source block of an in-flight plan
        self.finished = 0
        self.usable = self.num_blocks - 1
        # metrics
        self.peak = -1
        self.peak_info: dict = {}
        self.samples: list = []
        self.demand_tl: list = []
        self.phase = dict(sync=0.0, evict=0.0, plan=0.0, slot_map=0.0, flush=0.0)
        self.phase_steps = 0
        self.traffic = dict(plans=0, moved=0, freed=0, bound=0, source_live=0, sources=0, dests=0,
                            peak_inflight_blocks=0, peak_inflight_dests=0)

    @staticmethod
    def _check_args(a: dict) -> None:
        """The constructor's arguments (``locals()``), each against its range; O(schedules)."""
        o = "Replay"
        sch = a["schedules"]
        if not isinstance(sch, (list, tuple)) or not all(isinstance(x, Schedule) for x in sch):
            raise ConfigError("bad_type", f"{o}.schedules must be a list of Schedule, got {type(sch).__name__}")
        if not sch:
            raise ConfigError("out_of_range", f"{o}.schedules must be a non-empty list of Schedule, got []")
        need_choice(o, "mode", a["mode"], MODES)
        S = need_int(o, "block_size", a["block_size"], 1, MAX_BLOCK_SIZE)
        nb = need_int(o, "num_blocks", a["num_blocks"], 2, MAX_BLOCKS)
        if S * nb > MAX_SLOTS:
            raise ConfigError("out_of_range", f"{o}.num_blocks must be at most {MAX_SLOTS // S} (the token table's "
                                              f"{MAX_SLOTS} slots over block_size {S}), got {nb!r}")
        if a["planner"] is not None and not isinstance(a["planner"], PlannerConfig):
            raise ConfigError("bad_type", f"{o}.planner must be a PlannerConfig or None, got {a['planner']!r}")
        need_int(o, "latency", a["latency"], 0)
        need_int(o, "max_batch", a["max_batch"], 1, none_ok=True)
        need_int(o, "sample_every", a["sample_every"], 0)
        need_int(o, "flush_every", a["flush_every"], 0)
        need_int(o, "timeline_every", a["timeline_every"], 1)
        for name in ("stop_on_preempt", "timeline", "phase_timing", "slot_mapping", "force_sync", "req_timeline",
                     "defer_inflight_victims"):
            need_bool(o, name, a[name])

    # -------------------------------------------------------------- planner hooks
    def _count_plan(self, p) -> None:
        """Copy traffic of a plan at launch: tokens moved, blocks it frees (sources - dests), and
        its lower bound (the live tokens of that many of its emptiest sources)."""
        freed = len(p.sources) - len(p.dests)
        nb = np.sort(self.table.n_b[np.asarray(p.sources, dtype=np.int64)])
        tr = self.traffic
        tr["plans"] += 1
        tr["moved"] += len(p.moves)
        tr["freed"] += freed
        tr["source_live"] += int(nb.sum())
        tr["bound"] += int(nb[:max(freed, 0)].sum())
        tr["sources"] += len(p.sources)
        tr["dests"] += len(p.dests)

    # -------------------------------------------------------------- helpers
    def _alloc1(self, r: _R) -> int:
        if self.alloc.num_free == 0:
            raise Preempted(r.id)
        b = self.alloc.allocate(1)[0]
        self.lifecycle.hold(r.id, [b])
        r.pos.append(b)
        return b

    def _release_if_empty(self, r: _R, blocks) -> None:
        t = self.table
        tail = r.pos[-1] if r.pos else None
        mine = self.lifecycle.held.get(r.id, ())
        for b in all_dead(t, r.id, blocks, tail=tail, busy=self.busy_mask if self.lifecycle.in_flight else None):
            if b in mine:
                t.release_empty_blocks(r.id, [b])
                self.lifecycle.release_held(r.id, [b])

    def _evict(self, r: _R, v: np.ndarray) -> None:
        t = self.table
        if r.deferred:
            v = np.concatenate([np.asarray(r.deferred, dtype=np.int64), v])
            r.deferred = []
        if len(v) == 0:
            return
        if len(v) <= 4:
            ok, blocks = [], []
            for x in v.tolist():
                b = t.location(r.id, x)[0]
                if self.busy_mask[b]:
                    self.inflight_victims += 1
                if self.defer and self.busy_mask[b]:
                    r.deferred.append(x)
                else:
                    ok.append(x)
                    blocks.append(b)
            if not ok:
                return
            t.evict_tokens(r.id, ok if len(ok) == 1 else np.asarray(ok, dtype=np.int64))
            self._release_if_empty(r, blocks)
            return
        blk = t.slots(r.id)[v] // self.S
        if self.lifecycle.in_flight:
            bz = self.busy_mask[blk]
            self.inflight_victims += int(bz.sum())
            if self.defer and bz.any():
                r.deferred.extend(v[bz].tolist())
                v, blk = v[~bz], blk[~bz]
        if len(v):
            t.evict_tokens(r.id, v)
            self._release_if_empty(r, np.unique(blk).tolist())

    def _admit(self) -> None:
        while self.queue and len(self.active) < self.max_batch:
            if self.mgr is not None and self.mgr.backpressure and self.active:
                break
            i, sch = self.queue[0]
            need = -(-sch.prompt // self.S)
            if need > self.alloc.num_free:
                if self.active:
                    break  # wait for memory (continuous batching)
                raise Preempted(i)
            self.queue.pop(0)
            r = _R(i, sch, start=self.step_no)
            self.reqs[i] = r
            self.active.append(r)

    def _prefill(self, r: _R) -> None:
        P = r.sched.prompt
        blocks = self.alloc.allocate(-(-P // self.S))
        r.pos = list(blocks)
        self.lifecycle.hold(r.id, blocks)
        for n in _chunks(P):
            self.table.sync_new_tokens(r.id, r.pos, n)
        r.n = P

    def _finish(self, r: _R) -> None:
        if self.mgr is not None:
            self.mgr.finish_request(r.id)
        else:
            self.table.free_request(r.id)
            self.lifecycle.finish(r.id)
        self.finished += 1

    # -------------------------------------------------------------- the step
    def step(self) -> None:
        self._admit()
        S, t, pt = self.S, self.table, self.phase_timing
        clock = time.perf_counter
        done = []
        t_sync = t_ev = 0.0
        for r in self.active:
            sch = r.sched
            s = r.s
            c0 = clock() if pt else 0.0
            if s == 0:
                self._prefill(r)
            else:
                n = r.n
                if n % S == 0:
                    self._alloc1(r)
                t.sync_new_tokens(r.id, r.pos, n + 1)
                r.n = n + 1
            c1 = clock() if pt else 0.0
            o0, o1 = sch.offsets[s], sch.offsets[s + 1]
            if (o1 > o0 or r.deferred) and self.evicts:
                self._evict(r, sch.victims[o0:o1])
            if pt:
                c2 = clock()
                t_sync += c1 - c0
                t_ev += c2 - c1
            r.s = s + 1
            if r.s > sch.output:
                done.append(r)
        if self.want_slot_mapping:
            c0 = clock()
            for r in self.active:
                t.slot_mapping(r.id)
            self.phase["slot_map"] += clock() - c0
        self._observe_peak()
        for r in done:
            self._finish(r)
            self.active.remove(r)
        if self.mgr is not None:
            self._step_manager(clock, pt)
        if pt:
            self.phase["sync"] += t_sync
            self.phase["evict"] += t_ev
        if self.want_slot_mapping or (self.flush_every and self.step_no % self.flush_every == 0):
            c0 = clock() if pt else 0.0
            t.flush()
            if pt:
                self.phase["flush"] += clock() - c0
        if pt:
            self.phase_steps += 1
        if self.sample_every and self.step_no % self.sample_every == 0 and self.active:
            self._sample()
        self.step_no += 1

    def _step_manager(self, clock, pt: bool) -> None:
        """The reclamation manager's part of a step: its plans ended and launched, the
        in-flight traffic peak, the deferred evictions retried, the peak observed again."""
        c0 = clock() if pt else 0.0
        flying = self.mgr.in_flight  # the live dict: after the step, the plans still flying
        for p in self.mgr.step(force_sync=self.force_sync):
            if p.id in flying:  # counted while it flies (a plan applied within the step is not)
                self._count_plan(p)
        fl_src = fl_dst = 0
        for p in flying.values():
            fl_src += len(p.sources)
            fl_dst += len(p.dests)
        if fl_src + fl_dst > self.traffic["peak_inflight_blocks"]:
            self.traffic["peak_inflight_blocks"] = fl_src + fl_dst
            self.traffic["peak_inflight_dests"] = fl_dst
        if pt:
            self.phase["plan"] += clock() - c0
        if self.defer and (flying or any(r.deferred for r in self.active)):
            for r in self.active:
                if r.deferred:
                    self._evict(r, np.empty(0, dtype=np.int64))
        self._observe_peak()

    # -------------------------------------------------------------- metrics
    def _held(self, rid) -> int:
        """Blocks request ``rid`` references: held for it, plus the sources and fills its plan
        in flight took over (still its tokens until the plan applies)."""
        lc = self.lifecycle
        n = len(lc.held.get(rid, ()))
        for pid in lc.busy.get(rid, ()):
            p = lc.in_flight[pid]
            n += len(p.sources) + len(p.fills)
        return n

    def demand(self) -> int:
        return self.usable - self.alloc.num_free

    def _observe_peak(self) -> None:
        d = self.demand()
        if self.step_no % self.timeline_every == 0:
            if self.timeline:
                self.demand_tl.append((self.step_no, d))
            if self.req_tl is not None:
                self.req_tl.append([self._held(r.id) for r in self.active])
        if d > self.peak:
            self.peak = d
            self.peak_info = self._breakdown()

    def _breakdown(self) -> dict:
        t, S = self.table, self.S
        ideal = 0
        partial_tails = 0
        held = 0
        for r in self.active:
            if r.id not in t:
                continue
            nl = t.num_live(r.id)
            ideal += -(-nl // S)
            held += self._held(r.id)
            if r.n % S:
                partial_tails += 1
        reserved = self.alloc.num_reserved
        inflight_src = sum(len(p.sources) for p in self.mgr.in_flight.values()) if self.mgr else 0
        inflight_dst = sum(len(p.dests) for p in self.mgr.in_flight.values()) if self.mgr else 0
        return dict(step=self.step_no, demand=self.demand(), used=self.alloc.num_used, reserved=reserved,
                    headroom_idle=len(self.mgr.headroom) if self.mgr else 0,
                    inflight_sources=inflight_src, inflight_dests=inflight_dst,
                    held=held, ideal_packed=ideal, partial_tails=partial_tails,
                    fragmentation=held - ideal, active=len(self.active),
                    live_tokens=int(t.num_live_slots))

    def _sample(self) -> None:
        t, S = self.table, self.S
        ref = t.refs > 0
        nref = int(np.count_nonzero(ref))
        le_half = int(np.count_nonzero(ref & (t.n_b <= S // 2)))
        held = sum(self._held(r.id) for r in self.active)
        ideal = sum(-(-t.num_live(r.id) // S) for r in self.active if r.id in t)
        self.samples.append((self.step_no, len(self.active), self.demand(), nref, le_half,
                             t.waste_ratio(), held, ideal))

    # -------------------------------------------------------------- run
    def run(self, max_steps: int | None = None) -> dict:
        t0 = time.perf_counter()
        feasible = True
        try:
            while self.queue or self.active:
                self.step()
                if max_steps is not None and self.step_no >= max_steps:
                    break
            if self.mgr is not None and not self.queue and not self.active:
                self.mgr.drain()  # copies of the last steps: their requests finished, nobody polls them again
        except Preempted as e:
            feasible = False
            self.preempted_at = dict(step=self.step_no, request=int(e.args[0]))
            if not self.stop_on_preempt:
                raise
        wall = time.perf_counter() - t0
        out = dict(mode=self.mode, feasible=feasible, preempted_at=self.preempted_at, steps=self.step_no,
                   finished=self.finished, peak_demand=self.peak, usable=self.usable,
                   peak_norm=self.peak / self.usable, peak_info=self.peak_info, wall_s=wall,
                   inflight_victims=self.inflight_victims)
        if self.mgr is not None:
            out["planner"] = dict(self.mgr.stats)
            out["traffic"] = dict(self.traffic)
        return out

    def sample_array(self) -> np.ndarray:
        """Columns: step, active, demand, ref_blocks, ref_blocks_le_half, F, held, ideal."""
        return np.asarray(self.samples, dtype=np.float64).reshape(-1, 8)


def replay(schedules, mode, block_size, num_blocks, **kw) -> tuple[dict, Replay]:
    rp = Replay(schedules, mode, block_size, num_blocks, **kw)
    return rp.run(), rp


def ideal_blocks(live: int, S: int) -> int:
    return math.ceil(live / S)
