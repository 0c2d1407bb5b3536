"""The vToken adapter for vLLM 0.33.0: token-level reclamation over vLLM's REAL scheduler.

``VTokenAdapter`` drives ``vllm.v1.core.sched.scheduler.Scheduler`` (or its
``AsyncScheduler``) with its own ``KVCacheManager`` / ``BlockPool``: vLLM's pool is the
allocator, nothing of vLLM is mocked. The worker (``worker.VTokenWorker``: this project's
``PagedDecoder`` over a real ``KVCache``) executes the ``SchedulerOutput``s and returns real
``ModelRunnerOutput``s. Paper sections 3.3-3.5 and 4.6.

The rooms of the adapter
------------------------
- ``hooks``: the scheduler subclass and its three hooks (before/after ``schedule()``, after
  ``update_from_output()``, before ``_free_request_blocks()``), which call the methods here;
- this module: the orchestration and the ownership of blocks (the headroom, applied
  destinations, plans in flight) and the planning through ``vtoken.planner``
  (``should_reclaim``, ``reclaim_bound``, ``propose``: the planner every path runs; the worker
  applies with ``apply_completed``);
- ``mirror``: each request's positional block list as the outputs sent it, and null
  substitution (a moved or released block's entry becomes ``null_block``, never popped);
- ``fence``: no plan source goes back to the pool before its step is processed and its
  copy reported done;
- ``prefix_hash``: sources lose their hash at launch, released blocks keep it only with full
  context, hashes of blocks computed after a request's first eviction are dropped;
- ``checks``: the runtime checks against vLLM's pool (``ASSUMPTIONS`` in ``assumptions``);
- ``messages``: what rides on the outputs (``StepMeta``, ``AdapterPlan``) and comes back
  (``WorkerReport``); ``driver``: the engine-core loop for tests and audits.

A step
------
*Before* ``schedule()``: the headroom is topped up to ``headroom`` blocks taken with
``BlockPool.get_new_blocks`` and held by the adapter (ref_cnt 1, in no request's list), so
``allocate_slots`` cannot see them; it yields to growth first (one free block kept per
running request and, when idle, for the next prompt: vLLM never preempts or stalls for a
block the headroom holds). While the headroom is short, requests that never ran sit out the
``schedule()`` call (admission back-pressure; they stay in vLLM's ``requests`` and waiting
queue between calls, so ``finish_requests`` and ``has_requests`` see them; not when nothing
else could run, so a pool too small for the headroom cannot deadlock).
``reset_prefix_cache()`` gives the headroom back first. *After* it: the output is mirrored; for a
non-empty step ``seq``, blocks whose tokens were all evicted are released (fenced at
``seq``), and compaction plans are made and ride on the output as ``so.vtoken``. *After*
``update_from_output()`` (vLLM has advanced ``processed_step_seq`` and drained
``deferred_frees``): the worker's report says which plans were applied, with which
destinations, and which copies completed; sources go back through vLLM's own fenced path
(``_free_cow_retained_blocks(sources, seq)``). *Before* a request's blocks are freed
(preemption, finish): its destinations go back with vLLM's fence for its list and its
in-flight plans are orphaned (their blocks return when the worker reports them).

The adapter sets ``Scheduler.defer_block_free = True`` (the switch vLLM sets for a
KV-consumer connector with overlapping batches), so ``sched_step_seq`` /
``processed_step_seq`` / ``deferred_frees`` run.

Where vLLM's own tests see a difference (the audit's vllm-own-tests check, 0.33.0,
``tests/v1/core`` with the adapter attached and no eviction acting: 1034 of the 1074 that
pass as shipped still pass; the 40 divergences left are inherent to the design):

- KV layouts other than one full-attention pool (sliding-window, chunked-local, cross-
  attention, hybrid groups; 33 tests) are refused at start: ``[single_full_attention_pool]``;
- ``defer_block_free`` is forced on (the fence the relocation protocol needs): vLLM's tests
  of its own gate, and async preemption of a request with output in flight (vLLM frees at
  once, the fence waits one step), see the fence (5 tests);
- while requests run, the headroom is held: exact free-block counts differ by it (2 tests).

Prefix caching: shared-prefix blocks are never moved or released (a candidate must have
``ref_cnt == 1`` in vLLM's pool and be referenced by one request in the token table);
destinations never enter a request's list, so vLLM never hashes them.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable

import numpy as np

from . import harness as _harness  # noqa: F401 - sets the CPU environment before vLLM
from .assumptions import ASSUMPTIONS, AdapterAssumptionError, check_supported_kv_config, check_supported_vllm
from .checks import RuntimeChecks
from .driver import AdapterDriver
from .fence import FenceLedger
from .harness import VllmHarness
from .hooks import scheduler_class
from .messages import AdapterPlan, StepMeta
from .mirror import BlockMirror
from .prefix_hash import PrefixHashRules
from ..planner import PlannerConfig, Proposal, plan_snapshot, propose, reclaim_bound, should_reclaim, trigger_inputs
from ..table import TokenTable

_RUNNING = _WAITING = None  # vllm.v1.request.RequestStatus members, bound at first use (vLLM loads lazily)

__all__ = [
    "ASSUMPTIONS",
    "AdapterAssumptionError",
    "AdapterDriver",
    "AdapterPlan",
    "StepMeta",
    "VTokenAdapter",
    "default_adapter_planner_config",
    "scheduler_class",
]


def default_adapter_planner_config(**kw) -> PlannerConfig:
    """``PlannerConfig(**kw)``: the adapter runs the shipped planner defaults (no adapter-only
    configuration; kept as a name so callers can override fields, e.g. ``headroom``)."""
    return PlannerConfig(**kw)


class VTokenAdapter:
    """A real vLLM scheduler with token-level reclamation (see the module docstring).

    Args:
        block_size, num_blocks, prefix_caching, async_scheduling, max_num_seqs,
        max_num_batched_tokens, max_model_len: the vLLM configuration (``VllmHarness``).
        reclaim: plan compactions (False: Naive-Evict, same eviction decisions, no headroom).
        planner_config: ``PlannerConfig`` (its ``headroom`` is the reservation size).
        max_plans_per_step: plans launched per scheduler step at most.
        checks: run the runtime assumption checks at every hook (``checks.RuntimeChecks``):
            incremental (what changed), with a full scan every ``check_full_every`` hooks,
            at idle, and at every hook with ``paranoid_checks`` (campaigns).
        evict_unfaithful_hashes: drop the prefix-cache hash of blocks computed after the
            request's first eviction (``prefix_hash``).
        headroom_pool_fraction: the headroom is at most 1/this of the live pool (default 16:
            no headroom below 17 blocks, where vLLM's own schedule needs every block).

    Ownership: the adapter holds one reference on every headroom block, every applied
    destination (``held``), and every block of a plan in flight (``plans``); vLLM holds the
    request lists. The worker is attached with ``attach_worker`` (the driver does it); the
    adapter calls it only to host-sync copies at idle (``drain_idle``). ``plan_hook``: a
    callable the toolkit attaches to check every proposal before launch.
    """

    def __init__(self, *, block_size: int = 16, num_blocks: int = 128, prefix_caching: bool = True,
                 async_scheduling: bool = True, max_num_seqs: int = 16, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 1024, reclaim: bool = True, planner_config: PlannerConfig | None = None,
                 max_plans_per_step: int = 4, checks: bool = True, table_device: str = "cpu",
                 evict_unfaithful_hashes: bool = True, check_full_every: int = 64, paranoid_checks: bool = False,
                 scheduler=None, headroom_pool_fraction: int = 16):
        from vllm.v1.request import RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager

        if int(headroom_pool_fraction) < 1:  # refused before anything is built
            raise ValueError(f"headroom_pool_fraction={headroom_pool_fraction!r}: must be >= 1")
        import vllm

        from . import VLLM_VERSION

        check_supported_vllm(getattr(vllm, "__version__", None), VLLM_VERSION)  # refused before anything is built
        global _RUNNING, _WAITING
        _RUNNING, _WAITING = RequestStatus.RUNNING, RequestStatus.WAITING

        if scheduler is not None:  # ``attach``: a scheduler built elsewhere, kept; its class gets the hooks
            self.h = VllmHarness.around(scheduler)
            check_supported_kv_config(self.h.kv_cache_config)  # refused at start, never mid-run
            sched = scheduler
            if not hasattr(type(sched), "vtoken_adapter"):  # not a VToken<...> class yet
                sched.__class__ = scheduler_class(type(sched))
            block_size, num_blocks = self.h.block_size, self.h.num_blocks
            prefix_caching, async_scheduling = self.h.prefix_caching, self.h.async_scheduling
        else:
            self.h = VllmHarness(block_size=block_size, num_blocks=num_blocks, prefix_caching=prefix_caching,
                                 max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                 max_model_len=max_model_len, async_scheduling=async_scheduling)
            check_supported_kv_config(self.h.kv_cache_config)  # refused at start, never mid-run
            cls = scheduler_class(type(self.h.scheduler))
            sched = cls(vllm_config=self.h.vllm_config, kv_cache_config=self.h.kv_cache_config,
                        block_size=block_size, log_stats=False,
                        structured_output_manager=StructuredOutputManager(self.h.vllm_config))
        self.h.scheduler = sched  # the harness's accessors (pool, manager, make_request) now see ours
        sched.defer_block_free = True  # run sched_step_seq / processed_step_seq / deferred_frees
        sched.vtoken_adapter = self
        self.scheduler = sched
        self.S, self.N = int(block_size), int(num_blocks)
        self.async_scheduling, self.prefix_caching = async_scheduling, prefix_caching
        self.reclaim = bool(reclaim)
        self.cfg = planner_config or default_adapter_planner_config()
        self.H = int(self.cfg.headroom) if self.reclaim else 0
        self.headroom_pool_fraction = int(headroom_pool_fraction)
        self.max_plans_per_step = int(max_plans_per_step)
        self.checks = checks
        self.table = TokenTable(self.S, self.N, device=table_device)
        self.worker = None
        self.stats = dict(plans=0, applied=0, aborted=0, moves=0, sources_freed=0, dests_used=0,
                          dests_returned=0, released_empty=0, hashes_kept=0, hashes_evicted=0,
                          shared_blocks_moved=0, backpressure_steps=0, held_back_max=0, headroom_idle_returns=0,
                          orphaned_plans=0, deferred_free_calls=0, preemptions=0, headroom_yielded=0,
                          unfaithful_hashes_evicted=0, source_hashes_dropped=0)
        # blocks the adapter holds (one reference each)
        self.headroom: list = []  # KVCacheBlock, ref_cnt 1, in no request's list
        self.held: dict[str, list] = {}  # req -> applied destination blocks
        self.plans: dict[int, AdapterPlan] = {}  # in flight (not yet reported by the worker)
        self.busy: dict[str, int] = {}  # req -> its plan in flight (one per request: I4)
        self.pending_release: list[tuple[int, str, int]] = []  # (seq, req, block) until the worker applied it
        self.gone_fence: dict[str, int] = {}  # freed request -> fence for leftovers of its plans
        # the rooms
        self.mirror = BlockMirror(self.req_to_blocks, self.pool.null_block, on_start=self._on_list_start)
        self.fence = FenceLedger()
        self.hashes = PrefixHashRules(self.pool, self.manager, self.S, self.stats, enabled=evict_unfaithful_hashes)
        self.check = RuntimeChecks(self, full_every=check_full_every, paranoid=paranoid_checks)
        # per-step work follows what changed: requests whose table or list changed since
        # they were last looked at, and the cached positive reclaim bounds
        self._release_todo: set = set()  # requests to look at for all-dead blocks
        self._stale_bounds: set = set()  # requests whose reclaim bound must be recomputed
        self._bound: dict[str, int] = {}  # request -> positive reclaim bound (cached)
        self._arrival: dict[str, int] = {}  # request -> arrival order (deterministic iteration)
        self.history: list[dict] = []  # snapshots of applied plans (planner_config.record_snapshots)
        self.plan_hook = None
        self._withheld: list = []  # fresh requests sitting out the current schedule() (back-pressure)
        self.requests: dict[str, Any] = {}  # every vLLM Request made (outputs stay readable)
        self._ids = itertools.count(1)
        self._clock = itertools.count().__next__  # snapshot event times
        self.steps = 0  # non-empty steps scheduled
        self.retained: list[tuple[int, int, int]] = []  # (seq, retained blocks, running requests)
        self._starved = False

    @classmethod
    def attach(cls, scheduler, **settings) -> "VTokenAdapter":
        """The adapter over a scheduler built elsewhere (vLLM's engine core, vLLM's own test
        helpers): the instance is kept and its class becomes ``VToken<its class>``
        (``hooks.scheduler_class``; already such a class: kept as is); the geometry (block size,
        pool size, prefix caching, async) is read off it (``VllmHarness.around``);
        ``settings`` are the adapter's own (``reclaim``, ``planner_config``, ``checks``, ...).
        Requests the caller adds with ``scheduler.add_request`` bypass ``add_request`` here."""
        return cls(scheduler=scheduler, **settings)

    # ------------------------------------------------------------------ accessors
    @property
    def pool(self):
        return self.h.pool

    @property
    def manager(self):
        return self.h.manager

    @property
    def req_to_blocks(self):
        return self.h.req_to_blocks

    @property
    def kept_hashes(self) -> list:
        return self.hashes.kept

    def attach_worker(self, worker) -> None:
        self.worker = worker

    def block(self, block_id: int):
        return self.pool.blocks[block_id]

    def retained_now(self) -> int:
        """Blocks in use by requests: the pool's used blocks less the adapter's headroom
        (plan-held blocks waiting for their fence count: they are still allocated)."""
        return (self.N - 1) - self.pool.get_num_free_blocks() - len(self.headroom)

    def check_all(self) -> None:
        """Run every runtime check now (tests call this between steps)."""
        self.check.check_all()

    # ------------------------------------------------------------------ requests
    def add_request(self, req_id: str, prompt_token_ids: Iterable[int], max_tokens: int = 16):
        """Make a vLLM ``Request`` and add it to the scheduler (vLLM owns it from here: it is
        in ``scheduler.requests``, counted by ``has_requests()``, abortable with
        ``finish_requests``). Admission back-pressure does not hold it outside vLLM: while
        the headroom is short, requests never scheduled yet sit out each ``schedule()`` call
        (``_withhold``) and are back in vLLM's waiting queue, in order, when it returns."""
        req = self.h.make_request(req_id, prompt_token_ids, max_tokens=max_tokens)
        self.requests[req_id] = req
        self._arrival.setdefault(req_id, len(self._arrival))
        self.scheduler.add_request(req)
        return req

    def _withhold(self) -> None:
        """Admission back-pressure, inside one ``schedule()``: while the headroom is short,
        the waiting requests that never ran (they hold no block) are taken out of vLLM's
        waiting queue, unless nothing else could run (progress first). O(waiting), only
        while the headroom is short."""
        sched = self.scheduler
        if not self._backpressure() or not len(sched.waiting):
            return
        fresh = [q for q in sched.waiting if q.status == _WAITING]  # preempted ones are PREEMPTED
        if not fresh or (not sched.running and len(fresh) == len(sched.waiting)):
            return  # nothing held back, or holding back would leave nothing to run
        sched.waiting.remove_requests(fresh)
        self._withheld = fresh
        self.stats["backpressure_steps"] += 1
        self.stats["held_back_max"] = max(self.stats["held_back_max"], len(fresh))

    def _restore_withheld(self) -> None:
        """Put the withheld requests back at the tail of vLLM's waiting queue, in their order
        (they were its tail: fresh requests queue behind preempted ones). Runs even when
        ``schedule()`` raised (the hook's ``finally``)."""
        if self._withheld:
            for q in self._withheld:
                self.scheduler.waiting.add_request(q)
            self._withheld = []

    def _target(self) -> int:
        """The headroom's size now: ``H``, capped at 1/``headroom_pool_fraction`` of the live
        pool (vLLM's tests swap the manager after construction, so the pool is read each
        time): on a tight pool a full headroom would starve vLLM's own schedule (issue 13: 21
        of vLLM's tests on pools of 5-10 blocks). O(1)."""
        return min(self.H, (self.pool.num_gpu_blocks - 1) // self.headroom_pool_fraction) if self.reclaim else 0

    def _backpressure(self) -> bool:
        return self.reclaim and len(self.headroom) < self._target()

    def has_work(self) -> bool:
        return bool(self.scheduler.has_requests())

    def output_tokens(self, req_id: str) -> list[int]:
        return list(self.requests[req_id].output_token_ids)

    def _on_list_start(self, r: str, seq: int) -> None:
        """A request's block list (re)started (new or resumed): a new incarnation."""
        self.held.setdefault(r, [])
        self.gone_fence.pop(r, None)
        self.hashes.restart(r)

    def _accounted(self, r: str, b: int) -> str | None:
        """Where the adapter holds block ``b`` for ``r``: 'list', 'held' or None."""
        if self.mirror.index(r, b) is not None:
            return "list"
        if any(x.block_id == b for x in self.held.get(r, ())):
            return "held"
        return None

    def _detach(self, r: str, blk) -> int:
        """Take request ``r``'s reference on ``blk`` over: null-substitute its positional
        entry (``mirror.detach``) or drop it from the held destinations. Returns the index
        (-1 for a held destination)."""
        if self.mirror.index(r, blk.block_id) is not None:
            return self.mirror.detach(r, blk)
        held = self.held.get(r, [])
        for j, x in enumerate(held):
            if x is blk:
                held.pop(j)
                return -1
        raise AdapterAssumptionError("table_in_step",
                                     f"request {r!r}: the table references block {blk.block_id}, which the "
                                     f"scheduler side does not hold for it")

    def _current(self, r: str) -> bool:
        """Is ``r`` mirrored, in the table, and has the worker seen its incarnation's first step?"""
        return (r in self.mirror and r in self.table
                and self.mirror.incarnation.get(r, 0) <= self.scheduler.processed_step_seq)

    def _before_reset_prefix_cache(self) -> None:
        """vLLM resets its prefix cache only when no block is in use: the headroom (never
        hashed, held only by the adapter) goes back to the pool first and is retaken at the
        next ``schedule()``. Blocks of plans in flight stay held until their copies report
        (a reset with a plan in flight fails, as it does with a request running)."""
        if self.headroom:
            self.pool.free_blocks(self.headroom)
            self.headroom = []
            self.stats["headroom_yielded"] += 1

    # ------------------------------------------------------------------ hook: before schedule
    def _before_schedule(self) -> None:
        if self.reclaim:
            # the reservation yields to growth: keep one free block per running request (a
            # decode step needs at most one each) and, when idle, the next admission's prompt, so vLLM
            # never preempts or stalls a request for want of a block the headroom holds
            # (issue 13: preemption churn on tight pools). O(1).
            sched = self.scheduler
            free, reserve = self.pool.get_num_free_blocks(), len(sched.running)
            if not sched.running and len(sched.waiting):  # idle: the next admission's prompt first
                head = sched.waiting.peek_request()
                reserve += -(-(head.num_tokens - head.num_computed_tokens) // self.S)
            if free < reserve and self.headroom:
                give = self.headroom[-min(reserve - free, len(self.headroom)):]
                del self.headroom[-len(give):]
                self.pool.free_blocks(give)
                self.stats["headroom_yielded"] += 1
            elif not self._starved and sched.get_num_unfinished_requests():  # nothing reserved while idle
                take = min(self._target() - len(self.headroom), free - reserve)
                if take > 0:
                    self.headroom += self.pool.get_new_blocks(take)
        self._withhold()

    # ------------------------------------------------------------------ hook: after schedule
    def _take_changes(self) -> None:
        """Fold in what changed since the last hook (the worker's table mutations, new and
        grown lists): the requests to look at again, and what the checks must cover."""
        tab, emptied, lists = self.table.take_changed(), self.table.take_emptied(), self.mirror.take_changed()
        if tab or lists:
            # a block becomes releasable when an eviction empties it, or when it stops
            # being the tail (the list grew); plans re-add their request when they land
            self._release_todo |= emptied | lists
            for b in self.table.take_lone_dead():  # a sharer left: the holder may release it now
                self._release_todo |= self.mirror.holders(b)
            self._stale_bounds |= tab | lists
            self.check.touch(lists)  # ownership changes with lists and the adapter's own events

    def _after_schedule(self, so) -> None:
        self.stats["preemptions"] += len(so.preempted_req_ids or ())
        sched = self.scheduler
        self.mirror.observe(so, sched.sched_step_seq)  # schedule() already counted this step
        self._take_changes()
        if so.total_num_scheduled_tokens <= 0:
            so.vtoken = StepMeta(seq=0, reclaim=self.reclaim)
            if self.headroom and not sched.running and len(sched.waiting) and not sched.deferred_frees:
                # nothing runs and nothing could be admitted: the reservation must not block
                # progress (the pool is too small for a request plus the headroom)
                self.pool.free_blocks(self.headroom)
                self.headroom = []
                self._starved = True
                self.stats["headroom_yielded"] += 1
            if self.checks:
                self.check.after_hook("after schedule (empty step)")
            return
        seq = sched.sched_step_seq
        self.steps += 1
        meta = StepMeta(seq=seq, reclaim=self.reclaim)
        if sched.running:
            self._starved = False
        for r in list(self.hashes.faithful):  # only requests that evicted have unfaithful blocks
            self.hashes.evict_unfaithful(r, self.req_to_blocks.get(r))
        self._release_empty(meta)
        if self.reclaim:
            self._plan(meta)
        so.vtoken = meta
        if self.checks:
            self.check.after_hook(f"after scheduling step {seq}")

    def _running(self, r: str) -> bool:
        req = self.requests.get(r)
        return req is not None and req.status == _RUNNING

    def _ordered(self, reqs) -> list:
        """Requests in arrival order (a deterministic order for frees and plans)."""
        return sorted(reqs, key=lambda r: self._arrival.get(r, 1 << 62))

    def _release_empty(self, meta: StepMeta) -> None:
        """Blocks whose tokens were all evicted: null-substituted and freed at fence ``seq``
        (Naive-Evict does this too; it needs no copy). Only requests whose table changed
        since they were last looked at (or that had to wait) are looked at."""
        t = self.table
        for r in self._ordered(self._release_todo):
            if r not in self.mirror or r not in t:
                self._release_todo.discard(r)  # gone: nothing to release
                continue
            if r in self.busy or not self._current(r) or not self._running(r):
                continue  # later: a plan flies, the worker has not seen this list yet, or it waits
            self._release_todo.discard(r)
            tail = t.tail_block(r)
            out = []
            for b in sorted(t.releasable_blocks(r).tolist()):  # block order: a deterministic free order
                blk = self.block(b)
                if b == tail or self._accounted(r, b) is None:
                    continue  # still written (a list growth brings it back), or not ours
                if blk.ref_cnt != 1:  # shared in vLLM (a prefix hit not synced yet): look again next step
                    self._release_todo.add(r)
                    continue
                self.hashes.on_release(r, blk, self._detach(r, blk))
                out.append(b)
                self.pending_release.append((meta.seq, r, b))
                self.scheduler._free_cow_retained_blocks([blk], meta.seq)
                self.stats["deferred_free_calls"] += 1
            if out:
                meta.releases[r] = out
                self.stats["released_empty"] += len(out)
                self.check.touch([r])

    def _plan(self, meta: StepMeta) -> None:
        """Stages 1-3: eligibility (``planner.should_reclaim`` every ``check_every`` steps),
        requests by their reclaimable-block bound (``planner.reclaim_bound``, recomputed only
        for requests whose table changed, cached while positive), then one plan per request
        (``planner.propose``, the planner every path runs), with the blocks vLLM shares or
        the scheduler side does not hold for the request excluded."""
        t, cfg = self.table, self.cfg
        if not self.headroom or self.steps % cfg.check_every or \
                not should_reclaim(cfg, **trigger_inputs(t, self.pool.get_num_free_blocks())):
            return
        for r in self._stale_bounds:
            gain = reclaim_bound(t, r, t.tail_block(r)) if r in t else 0
            if gain > 0:
                self._bound[r] = gain
            else:
                self._bound.pop(r, None)
        self._stale_bounds = set()
        scored = sorted((-g, self._arrival.get(r, 1 << 62), r) for r, g in self._bound.items()
                        if r not in self.busy and self._current(r) and self._running(r))
        for _, _, r in scored:
            if len(meta.plans) >= self.max_plans_per_step or not self.headroom:
                break
            blocks = t.block_array(r).tolist()
            exclude = np.asarray([b for b in blocks if self.block(b).ref_cnt != 1 or self._accounted(r, b) is None],
                                 dtype=np.int64)
            tail = t.tail_block(r)
            head = [b.block_id for b in self.headroom]
            p, _ = propose(t, r, head, max_sources=cfg.max_sources, tail=tail, excluded=exclude)
            if p is None:
                continue
            if self.plan_hook is not None:  # the toolkit's contract check (spec.planner), when attached
                flying = [b for q in self.plans.values() for b in q.source_ids + q.dest_ids]
                try:
                    self.plan_hook(table=t, req_id=r, proposal=p, tail=tail, headroom=head, excluded=exclude.tolist(),
                                   max_sources=cfg.max_sources, in_flight=flying)
                except AssertionError as e:
                    raise AdapterAssumptionError("plan_contract", f"step {meta.seq}: {e}") from e
            self._launch(meta, r, p, tail, head)

    def _launch(self, meta: StepMeta, r: str, p: Proposal, tail, head: list[int]) -> None:
        """Take the proposal's destinations from the headroom, null-substitute its sources in
        the request's list, drop the sources' prefix-cache hashes (``prefix_hash``: no hit
        may land on a block in flight), open their fence entries, and ride on step ``seq``."""
        taken = set(p.dests)
        by_id = {b.block_id: b for b in self.headroom}
        dests = [by_id[d] for d in p.dests]
        self.headroom = [b for b in self.headroom if b.block_id not in taken]
        sources = [self.block(b) for b in p.sources]
        for blk in sources:
            if blk.ref_cnt != 1 or self.table.refs[blk.block_id] != 1:
                self.stats["shared_blocks_moved"] += 1
                raise AdapterAssumptionError(
                    "shared_never_moved", f"plan for request {r!r} takes block {blk.block_id} as a source "
                    f"(vLLM ref_cnt {blk.ref_cnt}, table refs {int(self.table.refs[blk.block_id])}) at step {meta.seq}")
        plan = AdapterPlan(id=next(self._ids), req_id=r, seq=meta.seq, sources=sources, dests=dests,
                           moves=np.asarray(p.moves, dtype=np.int64).reshape(-1, 5), clock=self._clock)
        if self.cfg.record_snapshots:
            plan.snapshot = plan_snapshot(
                self.table, r, plan.id, p, tail, head,
                [{"id": q.id, "request": str(q.req_id), "sources": q.source_ids, "dests": q.dest_ids}
                 for q in self.plans.values()])
        for blk in sources:
            self.hashes.drop_source(blk)
            plan.source_index[blk.block_id] = self._detach(r, blk)
        self.fence.open(plan)
        self.check.touch([r])
        self.plans[plan.id] = plan
        self.busy[r] = plan.id
        meta.plans.append(plan)
        self.stats["plans"] += 1

    # ------------------------------------------------------------------ hook: request freed
    def _on_request_free(self, request) -> None:
        """Preemption or finish: free the request's destinations with vLLM's fence for its
        list, orphan its in-flight plans, forget its mirror."""
        r = request.request_id
        sched = self.scheduler
        self.hashes.evict_unfaithful(r, self.req_to_blocks.get(r), upto=1 << 30)
        self.hashes.forget(r)
        fence = sched.sched_step_seq if not sched._request_blocks_can_be_freed(request) else 0
        dests = self.held.pop(r, [])
        self.check.touch([r])
        if dests:
            self._free_blocks(dests, fence)
        for p in self.plans.values():
            if p.req_id == r and not p.orphaned:
                p.orphaned = True
                self.stats["orphaned_plans"] += 1
        self.busy.pop(r, None)
        self.gone_fence[r] = fence
        self.mirror.forget(r)
        self._bound.pop(r, None)

    def _free_blocks(self, blocks: list, fence: int) -> None:
        """Return blocks the adapter holds, through vLLM's own fenced path."""
        if blocks:
            self.scheduler._free_cow_retained_blocks(list(blocks), fence)
            self.stats["deferred_free_calls"] += 1

    # ------------------------------------------------------------------ hook: after update
    def _after_update(self, so, out) -> None:
        rep = getattr(out, "vtoken_report", None)
        if rep is not None:
            self._absorb(rep)
        processed = self.scheduler.processed_step_seq
        self.pending_release = [x for x in self.pending_release if x[0] > processed]
        meta = getattr(so, "vtoken", None)
        if meta is not None and meta.seq:
            self.retained.append((meta.seq, self.retained_now(), len(self.scheduler.running)))
        sched = self.scheduler
        if self.headroom and not self.plans and not sched.running and not sched.deferred_frees:
            # nothing runs: nothing to reclaim for, so nothing reserved (vLLM's leak checks
            # and free counts see the whole pool once its own deferred frees drained);
            # retaken at the next schedule() with work
            self.pool.free_blocks(self.headroom)
            self.headroom = []
            self.stats["headroom_idle_returns"] += 1
        self._take_changes()
        if self.checks:
            self.check.after_hook(f"after processing step {meta.seq if meta else '?'}", table=True)

    def _absorb(self, rep) -> None:
        """The worker's report: per finished plan, destinations to the request (or back to
        the headroom), sources back through the fence; full-context lengths for the hashes."""
        processed = self.scheduler.processed_step_seq  # the worker has executed up to here
        m = self.mirror
        self.hashes.absorb(rep.faithful, lambda r: r in m and m.incarnation.get(r, 1 << 62) <= processed)
        for pid, res in rep.plans.items():
            plan = self.plans.pop(pid, None)
            if plan is None:
                raise AdapterAssumptionError("ownership", f"the worker reported plan {pid}, which is not in flight")
            if self.busy.get(plan.req_id) == pid:
                self.busy.pop(plan.req_id)
            if res.shared_sources:
                self.stats["shared_blocks_moved"] += len(res.shared_sources)
                raise AdapterAssumptionError(
                    "shared_never_moved", f"plan {pid} of request {plan.req_id!r}: sources "
                    f"{res.shared_sources} are referenced by another request at copy time")
            self.fence.copy_reported(plan, res.copy_done)
            self.check.touch([plan.req_id])
            self._release_todo.add(plan.req_id)  # it may release again now that no plan flies
            alive = not plan.orphaned and plan.req_id in m
            if res.status == "applied":
                used_ids = set(res.used_dests)
                used = [d for d in plan.dests if d.block_id in used_ids]
                unused = [d for d in plan.dests if d.block_id not in used_ids]
                self.headroom += unused  # never written: straight back to the reservation
                self.stats["dests_returned"] += len(unused)
                self.stats["dests_used"] += len(used)
                self.stats["applied"] += 1
                self.stats["moves"] += int(res.moved)
                if alive:
                    self.held.setdefault(plan.req_id, []).extend(used)
                else:
                    self._free_blocks(used, self.gone_fence.get(plan.req_id, 0))
                self._free_sources(plan, copy_done=res.copy_done)
                if plan.snapshot is not None and plan.snapshot["post"] is not None:
                    self.history.append(plan.snapshot)  # completed by the worker (snapshot_applied)
            else:  # aborted: nothing moved (or the request is gone)
                self.stats["aborted"] += 1
                self.headroom += plan.dests
                self.fence.drop(plan)
                if alive and res.table_kept:
                    self.held.setdefault(plan.req_id, []).extend(plan.sources)  # still read by the request
                else:
                    self._free_blocks(plan.sources, max(plan.seq, self.gone_fence.get(plan.req_id, 0)))

    def _free_sources(self, plan: AdapterPlan, copy_done: bool) -> None:
        """Hand a plan's sources back to the pool at their fence: vLLM's
        ``_free_cow_retained_blocks(sources, plan.seq)`` frees them at once when step
        ``plan.seq`` has been processed, else defers them to it. A source carries no
        prefix-cache hash (dropped at launch, and vLLM never hashes a block outside a
        request's list): one that does was re-hashed under the adapter (``prefix_hash``)."""
        processed = self.scheduler.processed_step_seq
        for blk in plan.sources:
            if blk.block_hash is not None:
                raise AdapterAssumptionError(
                    "prefix_hash", f"source block {blk.block_id} of plan {plan.id} (request {plan.req_id!r}) carries "
                    f"a prefix-cache hash at its free: its hash was dropped at launch, so it was re-hashed while in "
                    f"flight")
            self.fence.close(blk.block_id, processed, copy_done)
        plan.record("free", blocks=plan.source_ids)
        self.stats["sources_freed"] += len(plan.sources)
        self.scheduler._free_cow_retained_blocks(list(plan.sources), plan.seq)
        self.stats["deferred_free_calls"] += 1
        if self.checks:
            self.fence.check()

    # ------------------------------------------------------------------ driving
    def schedule(self):
        return self.scheduler.schedule()

    def update_from_output(self, so, out):
        return self.scheduler.update_from_output(so, out)

    def drain_idle(self) -> None:
        """At idle (nothing scheduled, nothing in flight): let the worker host-sync its
        copies and absorb the report, so copies that outlived their step are fenced too."""
        if self.plans and self.worker is not None:
            self._absorb(self.worker.synchronize())
            if self.checks:
                self.check.check_pool("after synchronize")
                self.check.check_table()

    def close(self) -> dict:
        """Give the headroom back and check that every block returned (``all_returned``)."""
        sched = self.scheduler
        if self.plans:
            self.drain_idle()
        if sched.has_requests():
            raise AdapterAssumptionError("all_returned", "close() with requests still pending")
        if self.checks:
            self.check.check_pool("at close")
        if self.headroom:
            self.pool.free_blocks(self.headroom)
            self.headroom = []
        free = self.pool.get_num_free_blocks()
        held = [b.block_id for b in self.pool.blocks if not b.is_null and b.ref_cnt != 0]
        left = {r: [b.block_id for b in v] for r, v in self.held.items() if v}
        if free != self.N - 1 or held or left or sched.deferred_frees or self.plans or len(self.fence):
            raise AdapterAssumptionError(
                "all_returned", f"free count {free} (want {self.N - 1}); referenced blocks {held[:10]}; "
                f"adapter still holds {left}; deferred_frees {len(sched.deferred_frees)}; "
                f"plans in flight {list(self.plans)}; fence ledger {sorted(self.fence.pending)}")
        return {"free": free, "N": self.N}
