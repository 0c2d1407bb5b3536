"""The vToken adapter for vLLM 0.33.0: token-level reclamation over vLLM's REAL scheduler.

``VTokenAdapter`` drives ``vllm.v1.core.sched.scheduler.Scheduler`` (or its
``AsyncScheduler``) with its own ``KVCacheManager`` / ``BlockPool``: vLLM's pool is the
allocator, nothing of vLLM is mocked. The worker side (``worker.VTokenWorker``: this
project's ``PagedDecoder`` over a real ``KVCache``) executes the ``SchedulerOutput``s and
returns real ``ModelRunnerOutput``s. Paper sections 3.3-3.5 and 4.6.

Where each hook sits
--------------------
The scheduler is a subclass of vLLM's own class (``scheduler_class(base)``), built from the
harness's configs, with three overrides that only call out to the adapter around vLLM's code:

``schedule()``
    *before*: the reservation hook. The headroom is topped up to ``headroom`` blocks taken
    with ``BlockPool.get_new_blocks`` and held by the adapter (ref_cnt 1, in no request's
    block list), so ``allocate_slots`` cannot see them. Admission back-pressure: new
    requests are held in the adapter's own queue (``add_request``) and handed to
    ``Scheduler.add_request`` only while the headroom is full (or when the scheduler is
    idle, so a pool too small for the headroom cannot deadlock); preempted requests stay in
    vLLM's waiting queue untouched.
    *after*: the scheduler's output is mirrored (positional block ids per request:
    ``scheduled_new_reqs.block_ids``, ``scheduled_cached_reqs.new_block_ids`` appended,
    replaced for ``resumed_req_ids``); then, for a non-empty step with sequence number
    ``seq`` (``Scheduler.sched_step_seq``): blocks whose tokens were all evicted are
    released, and compaction plans are made over the token table (stage 3: the rule of
    ``ReclamationManager.plan_request`` with an explicit exclusion set, destinations placed
    by ``vtoken.placement.place``, taken from the adapter's headroom).
    A moved or released block's entry in ``req_to_blocks`` becomes ``null_block`` (list
    length kept, never popped). The step's plans and releases ride on the output as
    ``so.vtoken`` (a :class:`StepMeta`); the worker executes them in step order.
``update_from_output()``
    *after* vLLM's own processing (which advances ``processed_step_seq`` and drains
    ``deferred_frees``): the worker's report (``ModelRunnerOutput.vtoken_report``) says
    which plans were applied, with which destinations, and which copies completed.
``_free_request_blocks()`` (preemption and finish)
    *before* vLLM frees the request's list: the request's destination blocks (which are not
    in ``req_to_blocks``) are freed with the same fence vLLM uses for the list, and its
    in-flight plans are orphaned (their blocks are freed when the worker reports them). The
    worker resets the request's token table when it executes the output that carries the
    preemption / finish (``preempted_req_ids`` / ``finished_req_ids``).

The fence
---------
The adapter sets ``Scheduler.defer_block_free = True`` (the switch vLLM itself sets for a
KV-consumer connector with overlapping batches), so ``sched_step_seq`` /
``processed_step_seq`` run and a finished or preempted request's blocks return to the pool
only once every step that may still write them has been processed. A plan made after
``schedule()`` returned rides on step ``seq``; that step's forward still reads the sources,
the copy runs after it (stage 4), and later steps read the destinations. A plan's source
blocks are therefore freed only when BOTH hold: ``processed_step_seq >= seq`` (every step
that reads them is done) and the worker reported the copy completed (on CUDA a copy may
outlive its step: the report comes with a later step, or from ``synchronize`` at idle).
They are then handed to vLLM's ``_free_cow_retained_blocks(blocks, seq)``, the path vLLM
uses for copy-on-write retentions. Released empty blocks (no copy) go through the same call
with fence ``seq``: vLLM defers them to ``deferred_frees`` and frees them at
``update_from_output`` of step ``seq``. A fence ledger records, per source block, its fence
and when it was freed; it is checked every hook.

Prefix caching
--------------
Shared-prefix blocks are never moved or released: a candidate must have ``ref_cnt == 1`` in
vLLM's pool (a request that got a prefix hit but whose tokens the worker has not synced yet
still counts) and be referenced by one request in the token table. Destinations hold
tokens of mixed positions: they never enter ``req_to_blocks``, so vLLM never hashes them,
and the checks require ``block_hash is None`` on every destination and headroom block. A
plan's sources lose their prefix-cache hash when the plan launches (``_launch``): a block
in flight must never be handed out as a prefix-cache hit, since a hit makes it shared and
shared blocks never move (the rule that closes the in-flight prefix-hit race: with the
hash gone, ``find_longest_cache_hit`` cannot return it). A released block (all its tokens
evicted, no copy) keeps its hash only if it was computed with full context (it lies before
the request's first eviction: a token computed after an eviction attended to fewer tokens
than a fresh prefill would, so its K/V is not what the token ids promise); its bytes are
never written again before it is freed. Otherwise ``BlockPool.evict_blocks`` drops the
hash before the block is freed. The same reasoning applies to any block vLLM hashes after a
request's first eviction, moved or not: with ``evict_unfaithful_hashes`` (default) the
adapter drops those hashes as soon as it learns the request's full-context length from the
worker, and when the request is preempted or finishes (a window of about one step remains
in which another request with the very same token ids could hit such a block).

Runtime checks
--------------
Every hook checks the adapter's assumptions against the pool, not against the adapter's
intentions (``ASSUMPTIONS``; ``check_all()`` runs them on demand). A broken one raises
:class:`AdapterAssumptionError` whose message starts ``assumption broken: <statement> [<name>]``:

- ``fence``: the fence ledger (every freed source: freed at processed step >= its fence,
  copy completed) and the pool's reference count of every source still held by a plan
  (it must equal the adapter's reference plus the request lists' and deferred frees');
- ``reservation``: every headroom block has ref_cnt 1, no hash, and is in no request list;
- ``null_substitution``: every request's ``req_to_blocks`` equals, entry for entry, the
  block ids its scheduler outputs gave it, with ``null_block`` exactly where the adapter
  substituted (same length);
- ``prefix_hash``: no destination (held or in flight) carries a hash or a cache entry, and
  no source carries one when it is freed (dropped at launch);
- ``shared_never_moved``: at plan time (vLLM ref_cnt and table refs) and at copy time
  (the worker refuses a source another request references);
- ``table_in_step``: the token table references, per live request, only blocks the
  scheduler side holds for it (list, destinations, in-flight plan, pending release);
- ``ownership``: the reference count of every other block the adapter holds;
- ``all_returned``: ``close()`` finds the pool at N-1 free blocks, nothing referenced;
- ``plan_contract``: with a ``plan_hook`` attached (the toolkit attaches
  ``spec.planner``'s contract), every proposal is checked before launch.

Planning and applying are ``vtoken.planner``'s ``propose`` / ``reclaim_bound`` (here) and
``apply_completed`` (in the worker): the same functions every other path runs.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import numpy as np

from . import harness as _harness  # noqa: F401 - sets the CPU environment before vLLM
from .harness import VllmHarness
from ..planner import PlannerConfig, Proposal, plan_snapshot, propose, reclaim_bound, should_reclaim, trigger_inputs
from ..table import TokenTable

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

# name -> the assumption, as a report states it.
ASSUMPTIONS: dict[str, str] = {
    "fence": "sources freed only after the fence (their copy completed and the step that "
             "carried the plan processed)",
    "prefix_hash": "no relocated block keeps a stale prefix-cache hash (destinations are "
                   "never hashed; sources lose their hash at launch; a released block keeps it "
                   "only if it was computed with full context)",
    "null_substitution": "moved or released blocks are null-substituted in req_to_blocks, "
                         "list length kept (never popped)",
    "reservation": "headroom blocks are held with ref_cnt 1, unhashed, and never handed to "
                   "allocate_slots (in no request's block list)",
    "shared_never_moved": "shared-prefix blocks are never moved",
    "table_in_step": "the token table is in step with the scheduler's block lists",
    "ownership": "every reference the adapter holds is accounted for in the pool",
    "all_returned": "every block returns to the pool after drain (free count N-1)",
    "plan_contract": "every plan satisfies the planner contract (vtoken.spec.planner) and is optimal",
    "hash_and_compare": "every relocation preserves the ordered live token ids and their K/V "
                        "bytes (hash-and-compare)",
    "outputs_equal": "reclamation does not change the output (same eviction decisions, "
                     "token for token)",
}


class AdapterAssumptionError(AssertionError):
    """A runtime check of the adapter failed; ``check`` is the assumption's name."""

    def __init__(self, check: str, detail: str):
        self.check = check
        self.detail = detail
        super().__init__(f"assumption broken: {ASSUMPTIONS.get(check, check)} [{check}]: {detail}")


def default_adapter_planner_config(**kw) -> PlannerConfig:
    """``PlannerConfig(**kw)``: the adapter runs the shipped planner defaults (no adapter-only
    configuration; kept as a name so callers can override fields, e.g. ``headroom``)."""
    return PlannerConfig(**kw)


# ------------------------------------------------------------------------ data passed to the worker
@dataclass
class AdapterPlan:
    """One compaction plan as the scheduler side made it (block ids)."""

    id: int
    req_id: str
    seq: int  # the step that carries it (its fence)
    sources: list  # KVCacheBlock
    dests: list  # KVCacheBlock (from the headroom)
    moves: np.ndarray  # (k, 5): token, src_block, src_offset, dst_block, dst_offset
    source_index: dict = field(default_factory=dict)  # source block id -> positional index (or -1: a held dest)
    snapshot: Optional[dict] = None  # the plan snapshot (planner_config.record_snapshots)
    orphaned: bool = False  # the request was freed while the plan flew

    @property
    def source_ids(self) -> list[int]:
        return [b.block_id for b in self.sources]

    @property
    def dest_ids(self) -> list[int]:
        return [b.block_id for b in self.dests]


@dataclass
class StepMeta:
    """What the adapter attaches to a ``SchedulerOutput`` (``so.vtoken``)."""

    seq: int  # Scheduler.sched_step_seq of this step (0: an empty step, nothing attached)
    plans: list = field(default_factory=list)  # AdapterPlan, to copy after this step's forward
    releases: dict = field(default_factory=dict)  # req_id -> [block ids] released (all tokens dead)
    reclaim: bool = True


@dataclass
class _FenceEntry:
    block: int
    plan: int
    req_id: str
    fence: int  # the plan's step seq
    copy_done: bool = False
    freed_at: Optional[int] = None  # processed_step_seq when it was handed back to the pool
    freed_copy_done: Optional[bool] = None


def scheduler_class(base: type) -> type:
    """A subclass of vLLM's ``base`` scheduler class with the adapter's three hooks."""

    class VTokenScheduler(base):  # type: ignore[misc, valid-type]
        vtoken_adapter: "VTokenAdapter | None" = None

        def schedule(self, *args, **kwargs):
            ad = self.vtoken_adapter
            if ad is not None:
                ad._before_schedule()
            so = super().schedule(*args, **kwargs)
            if ad is not None:
                ad._after_schedule(so)
            return so

        def update_from_output(self, scheduler_output, model_runner_output):
            result = super().update_from_output(scheduler_output, model_runner_output)
            ad = self.vtoken_adapter
            if ad is not None:
                ad._after_update(scheduler_output, model_runner_output)
            return result

        def _free_request_blocks(self, request):
            ad = self.vtoken_adapter
            if ad is not None:
                ad._on_request_free(request)
            return super()._free_request_blocks(request)

    VTokenScheduler.__name__ = VTokenScheduler.__qualname__ = f"VToken{base.__name__}"
    return VTokenScheduler


# ------------------------------------------------------------------------ the adapter
class VTokenAdapter:
    """A real vLLM scheduler with token-level reclamation (see the module docstring).

    Args:
        block_size, num_blocks, prefix_caching, async_scheduling, max_num_seqs,
        max_num_batched_tokens, max_model_len: the vLLM configuration (``VllmHarness``).
        reclaim: plan compactions (False: Naive-Evict, same eviction decisions, no headroom).
        planner_config: ``PlannerConfig`` (its ``headroom`` is the reservation size).
        max_plans_per_step: plans launched per scheduler step at most.
        checks: run the runtime assumption checks at every hook (O(blocks) per step).
        evict_unfaithful_hashes: drop the prefix-cache hash of blocks computed after the
            request's first eviction (see the module docstring).

    The worker (``worker.VTokenWorker``) is attached with ``attach_worker`` (the driver does
    it); the adapter calls it only to host-sync copies at idle (``drain_idle``).
    """

    def __init__(self, *, block_size: int = 16, num_blocks: int = 128, prefix_caching: bool = True,
                 async_scheduling: bool = True, max_num_seqs: int = 16, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 1024, reclaim: bool = True, planner_config: PlannerConfig | None = None,
                 max_plans_per_step: int = 4, checks: bool = True, table_device: str = "cpu",
                 evict_unfaithful_hashes: bool = True):
        from vllm.v1.structured_output import StructuredOutputManager

        self.h = VllmHarness(block_size=block_size, num_blocks=num_blocks, prefix_caching=prefix_caching,
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, async_scheduling=async_scheduling)
        base = type(self.h.scheduler)
        cls = scheduler_class(base)
        sched = cls(vllm_config=self.h.vllm_config, kv_cache_config=self.h.kv_cache_config,
                    block_size=block_size, log_stats=False,
                    structured_output_manager=StructuredOutputManager(self.h.vllm_config))
        self.h.scheduler = sched  # the harness's accessors (pool, manager, make_request) now see ours
        sched.defer_block_free = True  # run sched_step_seq / processed_step_seq / deferred_frees
        sched.vtoken_adapter = self
        self.scheduler = sched
        self.S = int(block_size)
        self.N = int(num_blocks)
        self.async_scheduling = async_scheduling
        self.prefix_caching = prefix_caching
        self.reclaim = bool(reclaim)
        self.cfg = planner_config or default_adapter_planner_config()
        self.H = int(self.cfg.headroom) if self.reclaim else 0
        self.max_plans_per_step = int(max_plans_per_step)
        self.checks = checks
        self.evict_unfaithful_hashes = evict_unfaithful_hashes
        self.table = TokenTable(self.S, self.N, device=table_device)
        self.worker = None
        # scheduler-side state
        self.headroom: list = []  # KVCacheBlock, ref_cnt 1, held by the adapter
        self.held: dict[str, list] = {}  # req -> applied destination blocks (adapter holds the ref)
        self.mirror: dict[str, list[int]] = {}  # req -> positional block ids as the outputs gave them
        self.pos_of: dict[str, dict[int, int]] = {}  # req -> block id -> index (not substituted)
        self.subst: dict[str, dict[int, int]] = {}  # req -> index -> block id substituted by null
        self.incarnation: dict[str, int] = {}  # req -> seq of the output that (re)started its block list
        self.plans: dict[int, AdapterPlan] = {}  # in flight (not yet reported)
        self.busy: dict[str, int] = {}  # req -> plan id in flight (one per request: I4)
        self.ledger: dict[int, _FenceEntry] = {}  # source block id -> entry (pending ones)
        self.ledger_done: deque = deque(maxlen=4096)  # freed entries (checked once, kept for reports)
        self.pending_release: list[tuple[int, str, int]] = []  # (seq, req, block) until the worker applied it
        self.gone_fence: dict[str, int] = {}  # freed request -> fence for leftovers of its plans
        self.faithful: dict[str, int] = {}  # req -> tokens computed with full context (worker report)
        self.kept_hashes: list[tuple[int, str]] = []  # (block, why) hashes kept on freed (released) blocks
        self.history: list[dict] = []  # snapshots of applied plans (planner_config.record_snapshots)
        self.plan_hook = None  # called with every proposal before launch (the toolkit's contract check)
        self.waiting_new: deque = deque()  # requests held back by admission back-pressure
        self.requests: dict[str, Any] = {}  # every vLLM Request made (outputs stay readable)
        self._ids = itertools.count(1)
        self.steps = 0  # non-empty steps scheduled
        self.retained: list[tuple[int, int, int]] = []  # (seq, retained blocks, running requests)
        self.stats = dict(plans=0, applied=0, aborted=0, moves=0, sources_freed=0, dests_used=0,
                          dests_returned=0, released_empty=0, hashes_kept=0, hashes_evicted=0,
                          shared_blocks_moved=0, backpressure_steps=0, held_back_max=0,
                          orphaned_plans=0, deferred_free_calls=0, preemptions=0, headroom_yielded=0,
                          unfaithful_hashes_evicted=0, source_hashes_dropped=0)
        self._starved = False
        self._hash_scan: dict[str, int] = {}  # req -> positional index scanned for unfaithful hashes

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

    def attach_worker(self, worker) -> None:
        self.worker = worker

    def block(self, block_id: int):
        return self.pool.blocks[block_id]

    def retained_now(self) -> int:
        """Blocks in use by requests: the pool's used blocks less the adapter's headroom
        (plan-held blocks waiting for their fence count: they are still allocated)."""
        return (self.N - 1) - self.pool.get_num_free_blocks() - len(self.headroom)

    # ------------------------------------------------------------------ requests
    def add_request(self, req_id: str, prompt_token_ids: Iterable[int], max_tokens: int = 16):
        """Make a vLLM ``Request``; it goes to the scheduler now, or waits while the
        headroom is short (admission back-pressure)."""
        req = self.h.make_request(req_id, prompt_token_ids, max_tokens=max_tokens)
        self.requests[req_id] = req
        if self.waiting_new or self._backpressure():
            self.waiting_new.append(req)
            self.stats["held_back_max"] = max(self.stats["held_back_max"], len(self.waiting_new))
        else:
            self.scheduler.add_request(req)
        return req

    def _backpressure(self) -> bool:
        return self.reclaim and len(self.headroom) < self.H

    def _scheduler_idle(self) -> bool:
        s = self.scheduler
        return not s.running and len(s.waiting) == 0

    def has_work(self) -> bool:
        return bool(self.waiting_new) or bool(self.scheduler.has_requests())

    def output_tokens(self, req_id: str) -> list[int]:
        return list(self.requests[req_id].output_token_ids)

    # ------------------------------------------------------------------ hook: before schedule
    def _before_schedule(self) -> None:
        if self.reclaim and not self._starved:
            want = self.H - len(self.headroom)
            take = min(want, self.pool.get_num_free_blocks())
            if take > 0:
                self.headroom += self.pool.get_new_blocks(take)
        if self.waiting_new:
            if not self._backpressure() or self._scheduler_idle():
                while self.waiting_new:
                    self.scheduler.add_request(self.waiting_new.popleft())
            else:
                self.stats["backpressure_steps"] += 1

    # ------------------------------------------------------------------ hook: after schedule
    def _after_schedule(self, so) -> None:
        self.stats["preemptions"] += len(so.preempted_req_ids or ())
        self._mirror_output(so)
        sched = self.scheduler
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
                self._check_pool("after schedule (empty step)")
            return
        seq = sched.sched_step_seq
        self.steps += 1
        meta = StepMeta(seq=seq, reclaim=self.reclaim)
        running = [r.request_id for r in sched.running]
        if sched.running:
            self._starved = False
        if self.evict_unfaithful_hashes:
            for r in running:
                self._evict_unfaithful(r)
        self._release_empty(meta, running)
        if self.reclaim:
            self._plan(meta, running)
        so.vtoken = meta
        if self.checks:
            self._check_pool(f"after scheduling step {seq}")

    def _mirror_output(self, so) -> None:
        """Keep the positional block ids per request exactly as the outputs send them."""
        seq_next = self.scheduler.sched_step_seq  # schedule() already counted this step
        for d in so.scheduled_new_reqs:
            self._set_mirror(d.req_id, list(d.block_ids[0]), seq_next)
        c = so.scheduled_cached_reqs
        for r, nb in zip(c.req_ids, c.new_block_ids):
            ids = list(nb[0]) if nb else []
            if r in c.resumed_req_ids:
                self._set_mirror(r, ids, seq_next)
            else:
                m = self.mirror.setdefault(r, [])
                pos = self.pos_of.setdefault(r, {})
                for b in ids:
                    pos[b] = len(m)
                    m.append(b)

    def _set_mirror(self, r: str, ids: list[int], seq: int) -> None:
        self.mirror[r] = ids
        self.pos_of[r] = {b: i for i, b in enumerate(ids)}
        self.subst[r] = {}
        self.held.setdefault(r, [])
        self.incarnation[r] = seq
        self.gone_fence.pop(r, None)
        self._hash_scan.pop(r, None)

    def _tail_block(self, r: str) -> Optional[int]:
        """The block holding the request's newest token (still being written; never evicted)."""
        n = self.table.length(r)
        if n == 0:
            return None
        return self.table.location(r, n - 1)[0]

    def _accounted(self, r: str, b: int) -> str | None:
        """Where the adapter holds block ``b`` for ``r``: 'list', 'held' or None."""
        if b in self.pos_of.get(r, {}):
            return "list"
        if any(x.block_id == b for x in self.held.get(r, ())):
            return "held"
        return None

    def _detach(self, r: str, blk) -> int:
        """Take request ``r``'s reference on ``blk`` over: null-substitute its positional
        entry (list length kept) or drop it from the held destinations. Returns the index
        (-1 for a held destination)."""
        b = blk.block_id
        pos = self.pos_of.get(r, {})
        if b in pos:
            lst = self.req_to_blocks.get(r)
            m = self.mirror.get(r, [])
            if lst is not None and len(lst) != len(m):
                raise AdapterAssumptionError(
                    "null_substitution", f"request {r!r}'s block list has {len(lst)} entries, the scheduler "
                    f"outputs gave it {len(m)} (an entry was popped instead of null-substituted)")
            i = pos.pop(b)
            if lst is None or i >= len(lst) or lst[i] is not blk:
                got = None if lst is None or i >= len(lst) else lst[i].block_id
                raise AdapterAssumptionError(
                    "table_in_step", f"request {r!r}: block {b} expected at req_to_blocks index {i}, found {got}")
            lst[i] = self.pool.null_block
            self.subst.setdefault(r, {})[i] = b
            return i
        held = self.held.get(r, [])
        for j, x in enumerate(held):
            if x is blk:
                held.pop(j)
                return -1
        raise AdapterAssumptionError("table_in_step",
                                     f"request {r!r}: the table references block {b}, which the scheduler "
                                     f"side does not hold for it")

    def _evict_unfaithful(self, r: str, upto: Optional[int] = None) -> None:
        """Drop the prefix-cache hash of ``r``'s blocks computed after its first eviction
        (vLLM hashes every full block by its token ids; K/V computed with evicted context is
        not what those ids promise). Only private blocks (ref_cnt 1); scanned once each."""
        f = self.faithful.get(r)
        lst = self.req_to_blocks.get(r)
        if f is None or not lst:
            return
        end = len(lst) if upto is None else min(upto, len(lst))
        if upto is None:
            end = min(end, self.manager.num_cached_block.get(r, 0))
        start = max(self._hash_scan.get(r, 0), f // self.S)
        for i in range(start, end):
            blk = lst[i]
            if not blk.is_null and blk.block_hash is not None and blk.ref_cnt == 1:
                self.pool.evict_blocks({blk.block_id})
                self.stats["unfaithful_hashes_evicted"] += 1
        self._hash_scan[r] = max(start, end)

    def _faithful(self, r: str, index: int) -> bool:
        """Was positional block ``index`` of ``r`` computed with full context?"""
        if index < 0:
            return False
        return (index + 1) * self.S <= self.faithful.get(r, math.inf)

    def _release_empty(self, meta: StepMeta, running: list[str]) -> None:
        """Blocks whose tokens were all evicted: null-substituted and freed at fence ``seq``
        (Naive-Evict does this too; it needs no copy)."""
        t = self.table
        for r in running:
            if r not in t or r in self.busy or r not in self.mirror:
                continue
            if self.incarnation.get(r, 0) > self.scheduler.processed_step_seq:
                continue  # the worker has not seen this incarnation's first step yet
            tail = self._tail_block(r)
            cands = [b for b in t.blocks_of(r) if b != tail and t.n_b[b] == 0 and t.refs[b] == 1]
            out = []
            for b in cands:
                blk = self.block(b)
                if blk.ref_cnt != 1 or self._accounted(r, b) is None:
                    continue  # shared in vLLM (a prefix hit not synced yet) or not ours to free
                i = self._detach(r, blk)
                if blk.block_hash is not None and not self._faithful(r, i):
                    self.pool.evict_blocks({b})
                    self.stats["hashes_evicted"] += 1
                elif blk.block_hash is not None:
                    self.stats["hashes_kept"] += 1
                    self.kept_hashes.append((b, "released empty, bytes untouched, full context"))
                out.append(b)
                self.pending_release.append((meta.seq, r, b))
                self.scheduler._free_cow_retained_blocks([blk], meta.seq)
                self.stats["deferred_free_calls"] += 1
            if out:
                meta.releases[r] = out
                self.stats["released_empty"] += len(out)

    def _plan(self, meta: StepMeta, running: list[str]) -> None:
        """Stages 1-3: eligibility (``planner.should_reclaim`` every ``check_every`` steps),
        requests by their reclaimable-block bound (``planner.reclaim_bound``), then one plan
        per request (``planner.propose``, the planner every path runs), with the blocks vLLM
        shares or the scheduler side does not hold for the request excluded."""
        t, cfg = self.table, self.cfg
        if not self.headroom or self.steps % cfg.check_every or not should_reclaim(cfg, **trigger_inputs(t, self.pool.get_num_free_blocks())):
            return
        processed = self.scheduler.processed_step_seq
        scored = []
        for r in running:
            if r not in t or r in self.busy or r not in self.mirror:
                continue
            if self.incarnation.get(r, 0) > processed:
                continue
            gain = reclaim_bound(t, r, t.tail_block(r))
            if gain > 0:
                scored.append((-gain, len(scored), r))
        scored.sort()
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
        the request's list, drop the sources' prefix-cache hashes, and ride it on step ``seq``.

        Why the hashes go now: a source keeps its bytes until it is freed, so while its copy
        flies vLLM could hand it to a new request as a prefix-cache hit (``touch``: ref_cnt
        2); the worker would sync that request onto it and the plan would then have to move
        a shared block. With no hash, no hit can land on a block in flight. The cost is at
        most one recomputed block per source for a later request with the same prefix.
        """
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
                           moves=np.asarray(p.moves, dtype=np.int64).reshape(-1, 5))
        if self.cfg.record_snapshots:
            plan.snapshot = plan_snapshot(
                self.table, r, plan.id, p, tail, head,
                [{"id": q.id, "request": str(q.req_id), "sources": q.source_ids, "dests": q.dest_ids}
                 for q in self.plans.values()])
        for blk in sources:
            if blk.block_hash is not None:
                self.pool.evict_blocks({blk.block_id})
                self.stats["source_hashes_dropped"] += 1
            plan.source_index[blk.block_id] = self._detach(r, blk)
            self.ledger[blk.block_id] = _FenceEntry(blk.block_id, plan.id, r, meta.seq)
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
        if self.evict_unfaithful_hashes:
            self._evict_unfaithful(r, upto=1 << 30)
        self.faithful.pop(r, None)
        fence = sched.sched_step_seq if not sched._request_blocks_can_be_freed(request) else 0
        dests = self.held.pop(r, [])
        if dests:
            self._free_blocks(dests, fence)
        for p in self.plans.values():
            if p.req_id == r and not p.orphaned:
                p.orphaned = True
                self.stats["orphaned_plans"] += 1
        self.busy.pop(r, None)
        self.gone_fence[r] = fence
        self.mirror.pop(r, None)
        self.pos_of.pop(r, None)
        self.subst.pop(r, None)
        self.incarnation.pop(r, None)

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
        if self.checks:
            self._check_pool(f"after processing step {meta.seq if meta else '?'}")
            self._check_table()

    def _absorb(self, rep) -> None:
        processed = self.scheduler.processed_step_seq  # the worker has executed up to here
        self.faithful = {r: v for r, v in rep.faithful.items()
                         if r in self.mirror and self.incarnation.get(r, 1 << 62) <= processed}
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
            for blk in plan.sources:
                e = self.ledger.get(blk.block_id)
                if e is not None and e.plan == pid:
                    e.copy_done = bool(res.copy_done)
            alive = not plan.orphaned and plan.req_id in self.mirror
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
                for blk in plan.sources:
                    self.ledger.pop(blk.block_id, None)
                if alive and res.table_kept:
                    self.held.setdefault(plan.req_id, []).extend(plan.sources)  # still read by the request
                else:
                    self._free_blocks(plan.sources, max(plan.seq, self.gone_fence.get(plan.req_id, 0)))

    def _free_sources(self, plan: AdapterPlan, copy_done: bool) -> None:
        """Hand a plan's sources back to the pool at their fence (see the module docstring):
        ``_free_cow_retained_blocks(sources, plan.seq)`` frees them at once when step
        ``plan.seq`` has been processed, else defers them to it. A source carries no
        prefix-cache hash (dropped at launch, and vLLM never hashes a block outside a
        request's list): one that does was re-hashed under the adapter (``prefix_hash``)."""
        processed = self.scheduler.processed_step_seq
        for blk in plan.sources:
            b = blk.block_id
            if blk.block_hash is not None:
                raise AdapterAssumptionError(
                    "prefix_hash", f"source block {b} of plan {plan.id} (request {plan.req_id!r}) carries a "
                    f"prefix-cache hash at its free: its hash was dropped at launch, so it was re-hashed while in flight")
            e = self.ledger.pop(b, None)
            if e is not None:
                e.freed_at = processed
                e.freed_copy_done = copy_done
                self.ledger_done.append(e)
        self.stats["sources_freed"] += len(plan.sources)
        self.scheduler._free_cow_retained_blocks(list(plan.sources), plan.seq)
        self.stats["deferred_free_calls"] += 1
        if self.checks:
            self._check_fence_ledger()

    # ------------------------------------------------------------------ driving
    def schedule(self):
        return self.scheduler.schedule()

    def update_from_output(self, so, out):
        return self.scheduler.update_from_output(so, out)

    def drain_idle(self) -> None:
        """At idle (nothing scheduled, nothing in flight): let the worker host-sync its
        copies and absorb the report, so copies that outlived their step are fenced too."""
        if self.plans and self.worker is not None:
            rep = self.worker.synchronize()
            self._absorb(rep)
            if self.checks:
                self._check_pool("after synchronize")

    def close(self) -> dict:
        """Give the headroom back and check that every block returned (``all_returned``)."""
        sched = self.scheduler
        if self.plans:
            self.drain_idle()
        if sched.has_requests() or self.waiting_new:
            raise AdapterAssumptionError("all_returned", "close() with requests still pending")
        if self.headroom:
            self.pool.free_blocks(self.headroom)
            self.headroom = []
        free = self.pool.get_num_free_blocks()
        held = [b.block_id for b in self.pool.blocks if not b.is_null and b.ref_cnt != 0]
        left = {r: [b.block_id for b in v] for r, v in self.held.items() if v}
        if free != self.N - 1 or held or left or sched.deferred_frees or self.plans or self.ledger:
            raise AdapterAssumptionError(
                "all_returned", f"free count {free} (want {self.N - 1}); referenced blocks {held[:10]}; "
                f"adapter still holds {left}; deferred_frees {len(sched.deferred_frees)}; "
                f"plans in flight {list(self.plans)}; fence ledger {sorted(self.ledger)}")
        return {"free": free, "N": self.N}

    # ------------------------------------------------------------------ checks
    def _holders(self) -> Counter:
        """References on each block from request lists and vLLM's deferred frees."""
        c: Counter = Counter()
        for lst in self.req_to_blocks.values():
            for b in lst:
                if not b.is_null:
                    c[b.block_id] += 1
        for _, blocks in self.scheduler.deferred_frees:
            for b in blocks:
                if not b.is_null:
                    c[b.block_id] += 1
        return c

    def _check_fence_ledger(self) -> None:
        while self.ledger_done:
            e = self.ledger_done.popleft()
            if e.freed_at is None or e.freed_at < e.fence or not e.freed_copy_done:
                raise AdapterAssumptionError(
                    "fence", f"block {e.block} (source of plan {e.plan}, request {e.req_id!r}) freed at step "
                    f"{e.freed_at} (the last processed step), fence {e.fence}: step {e.fence} processed and the "
                    f"copy completed (copy completed: {'yes' if e.freed_copy_done else 'no'})")

    def _check_pool(self, where: str) -> None:
        """Reservation, ownership, fence and prefix-hash checks against the pool itself."""
        self._check_fence_ledger()
        holders = self._holders()
        mine: Counter = Counter()
        kind: dict[int, str] = {}
        for b in self.headroom:
            mine[b.block_id] += 1
            kind[b.block_id] = "headroom"
        for r, v in self.held.items():
            for b in v:
                mine[b.block_id] += 1
                kind[b.block_id] = f"destination of request {r!r}"
        for p in self.plans.values():
            for b in p.sources:
                mine[b.block_id] += 1
                kind[b.block_id] = f"source of plan {p.id} (request {p.req_id!r}, fence {p.seq})"
            for b in p.dests:
                mine[b.block_id] += 1
                kind[b.block_id] = f"destination of in-flight plan {p.id} (request {p.req_id!r})"
        in_lists = {}
        for r, lst in self.req_to_blocks.items():
            for b in lst:
                if not b.is_null:
                    in_lists.setdefault(b.block_id, r)
        for b in self.headroom:
            bid = b.block_id
            if bid in in_lists:
                raise AdapterAssumptionError(
                    "reservation", f"{where}: headroom block {bid} is in request {in_lists[bid]!r}'s block list "
                    f"(ref_cnt {b.ref_cnt})")
            if b.ref_cnt != 1 or b.block_hash is not None:
                raise AdapterAssumptionError(
                    "reservation", f"{where}: headroom block {bid} has ref_cnt {b.ref_cnt} (want 1), "
                    f"hash {'set' if b.block_hash is not None else 'none'}")
        for bid, n in mine.items():
            blk = self.block(bid)
            want = n + holders.get(bid, 0)
            k = kind[bid]
            if blk.ref_cnt != want:
                check = "fence" if k.startswith("source") else "ownership"
                raise AdapterAssumptionError(
                    check, f"{where}: block {bid} ({k}) has ref_cnt {blk.ref_cnt}, but the adapter holds {n} and "
                    f"request lists / deferred frees hold {holders.get(bid, 0)}: it was returned to the pool "
                    f"while still held (freed before its fence)")
            if "destination" in k and (blk.block_hash is not None or bid in self.pool.cached_block_hashes_by_block):
                raise AdapterAssumptionError(
                    "prefix_hash", f"{where}: block {bid} ({k}) carries a prefix-cache hash "
                    f"({blk.block_hash!r}) although it holds relocated tokens of mixed positions")
        for p in self.plans.values():
            own = self.req_to_blocks.get(p.req_id, []) if not p.orphaned else []
            for b in p.sources:
                if any(x is b for x in own):
                    raise AdapterAssumptionError(
                        "null_substitution", f"{where}: source block {b.block_id} of plan {p.id} is still in "
                        f"request {p.req_id!r}'s block list")
        self._check_lists(where)

    def _check_lists(self, where: str) -> None:
        """Every request's ``req_to_blocks`` list equals the outputs' mirror, with null
        exactly where the adapter substituted: same length, same order."""
        null = self.pool.null_block
        for r, m in self.mirror.items():
            lst = self.req_to_blocks.get(r)
            if lst is None:
                continue
            if len(lst) != len(m):
                raise AdapterAssumptionError(
                    "null_substitution", f"{where}: request {r!r}'s block list has {len(lst)} entries, the scheduler "
                    f"outputs gave it {len(m)} (an entry was popped instead of null-substituted, or the list "
                    f"re-grew): {[b.block_id for b in lst]} vs {m}")
            sub = self.subst.get(r, {})
            for i, (blk, bid) in enumerate(zip(lst, m)):
                if i in sub:
                    if blk is not null:
                        raise AdapterAssumptionError(
                            "null_substitution", f"{where}: request {r!r} index {i}: block {blk.block_id} where "
                            f"null_block was substituted for block {sub[i]}")
                elif blk.block_id != bid:
                    raise AdapterAssumptionError(
                        "null_substitution", f"{where}: request {r!r} index {i}: req_to_blocks has block "
                        f"{blk.block_id}, the outputs gave {bid}")

    def _check_table(self) -> None:
        """Every block the token table references for a live request is one the scheduler
        side holds for it (its list, its destinations, an in-flight plan, a pending release)."""
        t = self.table
        processed = self.scheduler.processed_step_seq
        pend: dict[str, set] = {}
        for _, r, b in self.pending_release:
            pend.setdefault(r, set()).add(b)
        inflight: dict[str, set] = {}
        for p in self.plans.values():
            inflight.setdefault(p.req_id, set()).update(p.source_ids + p.dest_ids)
        for r in self.mirror:
            if r not in t or self.incarnation.get(r, 0) > processed:
                continue
            ok = set(self.pos_of.get(r, {})) | {b.block_id for b in self.held.get(r, ())} | \
                pend.get(r, set()) | inflight.get(r, set())
            extra = [b for b in t.blocks_of(r) if b not in ok]
            if extra:
                raise AdapterAssumptionError(
                    "table_in_step", f"request {r!r}: the token table references blocks {extra} that the scheduler "
                    f"side does not hold for it (step {processed})")

    def check_all(self) -> None:
        """Run every runtime check now (tests call this between steps)."""
        self._check_pool("check_all")
        self._check_table()


# ------------------------------------------------------------------------ a driver
class AdapterDriver:
    """Runs an adapter and its worker the way vLLM's engine core does: with async
    scheduling a second step is scheduled before the first step's output is processed
    (two in flight), outputs are applied in FIFO order; the worker executes a step when its
    output is needed (so the scheduler always plans from a table one step stale, the
    adversarial interleaving for the fence)."""

    def __init__(self, adapter: VTokenAdapter, worker):
        self.ad = adapter
        self.worker = worker
        adapter.attach_worker(worker)
        self.in_flight: deque = deque()
        self.depth = 2 if adapter.async_scheduling else 1
        self.steps = 0

    def step(self) -> None:
        so = self.ad.schedule()
        self.in_flight.append(so)
        self.steps += 1
        if len(self.in_flight) >= self.depth or not self.ad.has_work():
            self._finish_one()

    def _finish_one(self) -> None:
        so = self.in_flight.popleft()
        out = self.worker.execute(so)
        self.ad.update_from_output(so, out)

    def drain(self, max_steps: int = 20000) -> int:
        n = 0
        while self.ad.has_work():
            if n >= max_steps:
                raise RuntimeError(f"requests still pending after {max_steps} steps")
            self.step()
            n += 1
        while self.in_flight:
            self._finish_one()
        self.ad.drain_idle()
        return n
