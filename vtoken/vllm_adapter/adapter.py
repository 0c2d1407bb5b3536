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
- this module: the orchestration (what each hook does, in which order), the release of
  all-dead blocks, and the request lifecycle (preemption, finish, close);
- ``vtoken.lifecycle`` (not the adapter's: every path's): the headroom's blocks, the blocks a
  request keeps outside its list (landed fills and destinations), the plans in flight and
  their ends, the one release of blocks (the worker runs its copy side);
- ``port``: vLLM's pool as the lifecycle's (fenced frees, headroom blocks);
- ``plans``: the translation of plans at vLLM's edge: proposals through ``vtoken.planner``
  (``should_reclaim``, ``reclaim_bound``, ``propose``) with vLLM's shared blocks excluded and
  checked against its counts, hashes dropped at launch, the worker's report ended in the
  lifecycle;
- ``headroom``: the reservation's policy: its size, its yield to growth, admission
  back-pressure;
- ``mirror``: each request's positional block list as the outputs sent it, and null
  substitution (a moved or released block's entry becomes ``null_block``, never popped);
- ``fence``: no plan source goes back to the pool before its step is processed and its
  copy reported done;
- ``prefix_hash``: sources and fills lose their hash at launch, released blocks keep it only with full
  context, hashes of blocks computed after a request's first eviction are dropped;
- ``checks``: the runtime checks against vLLM's pool (``ASSUMPTIONS`` in ``assumptions``);
- ``messages``: what rides on the outputs (``StepMeta``, the step's ``Plan`` records) and comes back
  (``WorkerReport``), and the ``Replica`` of the worker's token table the reports are replayed on
  (with reclamation off, or on while no request holds a dead token, up to ``MAX_LAG`` reports
  of pure decode growth are held back and replayed together; ``table`` is always caught up);
  ``driver``: the engine-core loop for tests and audits.

A step
------
*Before* ``schedule()``: the headroom is topped up to ``headroom`` blocks taken with
``BlockPool.get_new_blocks`` and held by the adapter (ref_cnt 1, in no request's list), so
``allocate_slots`` cannot see them; it yields to growth first (one free block kept per
running request and, when idle, for the next prompt: vLLM never preempts or stalls for a
block the headroom holds); the default's soft reservation holds nothing here: a plan draws its
destinations from vLLM's free blocks as it launches (``Headroom.draw``). While the headroom is short, requests that never ran sit out the
``schedule()`` call (admission back-pressure; they stay in vLLM's ``requests`` and waiting
queue between calls, so ``finish_requests`` and ``has_requests`` see them; not when nothing
else could run, so a pool too small for the headroom cannot deadlock).
``reset_prefix_cache()`` gives the headroom back first. *After* it: the output is mirrored; for a
non-empty step ``seq``, blocks whose tokens were all evicted are released (fenced at
``seq``), and compaction plans are made and ride on the output as ``sched_out.vtoken``. *After*
``update_from_output()`` (the clock has advanced, due deferred frees are drained): the
worker's report says which plans were applied, with which destinations, and which copies
completed; sources go back through the port's fenced free (at step ``seq``). *Before* a
request's blocks are freed (preemption, finish): its destinations go back at the fence of its
last scheduled step and its in-flight plans are orphaned (their blocks return when the worker
reports them).

The fence runs on ``fence.StepClock``: vLLM's ``sched_step_seq`` / ``processed_step_seq`` when
vLLM defers its own frees (``defer_block_free``, which vLLM sets for a KV-consumer connector
with overlapping batches), else the adapter's own counters, advanced by the hooks (after
``schedule()``, before ``update_from_output()``) as vLLM advances its own. The adapter never
switches vLLM's flag: vLLM frees its lists as it would without vtoken, and only the adapter's
own blocks (plan sources, released blocks, a finished request's destinations and fills) wait
for their fence in the port (``port.VllmPort``).

KV cache groups (``layout``): the token table mirrors the first group whose manager keeps
every block until the request ends (full attention); sliding-window, chunked-local, Mamba and
cross-attention groups stay vLLM's (it frees their out-of-window blocks itself), and the
checks see that none of their lists holds a block the adapter holds (``kv_groups``). A layout
with no such group runs with reclamation off. The worker reads a hybrid layout's window
through the sliding-window group's own blocks (``layout.WorkerLayout``).

Where vLLM's own tests see a difference (the audit's vllm-own-tests check, 0.33.0,
``tests/v1/core`` with the adapter attached and no eviction acting): while requests run, a
planner headroom (``planner_config.headroom``; none by default) is held: exact free-block counts
differ by it (tests that set one). The default's soft reservation for the destinations of
plans that keep hashed bytes (``keep_headroom``) is drawn at launch, only while a request holds an evicted
token: with nothing evicted it takes no block.

Prefix caching: shared-prefix blocks are never moved, filled or released (a candidate must
have ``ref_cnt == 1`` in vLLM's pool and be referenced by one request in the token table);
destinations and fills (whose hash is dropped at launch: their bytes change) never enter
a request's list again, so vLLM never hashes them.
Owns: the vLLM scheduler instance it drives (through ``hooks``), the token table the
worker writes, the rooms it builds (``lifecycle``: headroom, every applied destination and
fill, the plans in flight; ``reserve``, ``book``, ``mirror``, ``fence``, ``hashes``,
``checker``); vLLM owns the request lists.
May call: vLLM's scheduler and ``BlockPool`` (through the port: fenced frees, the free
count), ``vtoken.planner`` (through ``plans``), ``vtoken.table``, its rooms; never spec/,
invariants/, fuzz/ or reports/ (the toolkit attaches ``plan_hook``).
Costs: per step O(requests whose table or list changed + blocks released + plans), not
O(requests tracked); the runtime checks as stated in ``checks``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

from . import harness as _harness  # noqa: F401 - sets the CPU environment before vLLM
from ..errors import ConfigError, OrderError, TableError
from ..fields import need_instance
from .assumptions import ASSUMPTIONS, AdapterAssumptionError, check_supported_vllm
from .checks import RuntimeChecks
from .config import AdapterConfig
from .driver import AdapterDriver
from .fence import FenceLedger, StepClock
from .harness import VllmHarness
from .headroom import Headroom
from .hooks import scheduler_class
from .messages import MAX_LAG, Replica, StepMeta
from .mirror import BlockMirror
from .plans import PlanBook
from .port import VllmPort
from ..lifecycle import Lifecycle, all_dead
from .prefix_hash import PrefixHashRules
from ..planner import PlannerConfig
from ..table import TokenTable

_RUNNING = None  # vllm.v1.request.RequestStatus.RUNNING, bound at first use (vLLM loads lazily)
_NO_BLOCKS: dict = {}  # read-only stand-in for a request with no entry

__all__ = [
    "ASSUMPTIONS",
    "AdapterAssumptionError",
    "AdapterConfig",
    "AdapterDriver",
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
        config: an :class:`~.config.AdapterConfig` (every setting, validated when it was
            made); or, instead, its fields as keywords (``VTokenAdapter(num_blocks=64)``),
            which build one (``AdapterConfig.of``: ``planner_config`` may be a dict of
            ``PlannerConfig`` fields, as JSON settings give it). A bad or unknown field raises
            :class:`~vtoken.errors.ConfigError` naming it and its value before anything is
            built; a config and keywords together are refused (``inconsistent``: use
            ``dataclasses.replace``).
        scheduler: None (the adapter builds vLLM's scheduler from the config) or a vLLM
            ``Scheduler`` built elsewhere (``attach``): kept, its geometry read off it.

    Ownership: the lifecycle holds one reference on every headroom block, every applied
    destination and fill (``held``), and every block of a plan in flight (``plans``); vLLM
    holds the request lists. The worker is attached with ``attach_worker`` (the driver
    does it); the adapter calls it only to host-sync copies at idle (``drain_idle``).
    ``plan_hook``: a callable the toolkit attaches to check every proposal before launch.
    """

    def __init__(self, config: AdapterConfig | None = None, *, scheduler=None, **settings):
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.request import RequestStatus

        if config is not None and settings:
            raise ConfigError("inconsistent", f"VTokenAdapter: a config and the settings {sorted(settings)} "
                                              f"together; pass one (dataclasses.replace(config, ...))")
        need_instance("VTokenAdapter", "config", config, AdapterConfig, none_ok=True)
        need_instance("VTokenAdapter", "scheduler", scheduler, Scheduler, none_ok=True)
        # every field refused first; with a scheduler given, vLLM's configuration is its own
        config = config if config is not None else AdapterConfig.of(settings, attach=scheduler is not None)
        import vllm

        from . import SUPPORTED_VLLM

        check_supported_vllm(getattr(vllm, "__version__", None), SUPPORTED_VLLM)  # refused before anything is built
        global _RUNNING
        _RUNNING = RequestStatus.RUNNING
        sched, config = self._scheduler(config, scheduler)
        self.config = config
        sched.vtoken_adapter = self
        self.scheduler = sched
        self.S, self.N = config.block_size, config.num_blocks
        self.async_scheduling, self.prefix_caching = config.async_scheduling, config.prefix_caching
        # the KV cache group the token table mirrors (``layout``); with none (sliding window or
        # chunked-local only) nothing is reclaimed and the checks watch vLLM's lists
        self.group = self.harness.table_group
        self.groups = len(self.harness.managers)
        self.reclaim = config.reclaim and self.group is not None
        self.cfg = config.planner_config
        self.max_plans_per_step = config.max_plans_per_step
        self.checks = config.checks
        # the worker's table replayed (``messages.Replica``); pure decode growth may lag (up to MAX_LAG
        # reports; none with paranoid checks) while nothing decides on it (``_replay``)
        self.replica = Replica(TokenTable(self.S, self.N, device=config.table_device),
                               max_lag=0 if config.paranoid_checks else MAX_LAG)
        self._t = self.replica.table  # the rooms read it as it stands (a lag is growth only)
        if self.checks or self.reclaim:  # the checks and the plan gates look at the tables whose block
            self._t.reblocked = set()  # set changed, not at every eviction's
        if self.checks:  # the table checks look at the blocks a table gained, not at the whole table
            self._t.added = []
        self.worker = None
        self._counts = dict(released_empty=0, preemptions=0)  # the adapter's own events; each room counts its own
        self.pending_release: list[tuple[int, str, int]] = []  # (seq, req, block) until the worker applied it
        self._rooms(config)
        # per-step work follows what changed: the requests whose table or list changed since
        # they were last looked at
        self.release_todo: set = set()  # requests to look at for all-dead blocks
        self.tail_wait: dict[str, int] = {}  # request -> its all-dead tail block, kept until the tail moves
        self._arrival: dict[str, int] = {}  # request -> arrival order (deterministic iteration)
        self.requests: dict[str, Any] = {}  # every vLLM Request made (outputs stay readable)
        self.steps = 0  # non-empty steps scheduled
        self.worker_stats: dict = {}  # the worker's counters, as its last report gave them
        self.retained: list[tuple[int, int, int]] = []  # (seq, retained blocks, running requests)

    def _scheduler(self, c: AdapterConfig, scheduler):
        """vLLM's scheduler with the hooks (``hooks.scheduler_class``), built from ``c`` or
        the one given (kept; ``c``'s geometry replaced by what it was built with), and the
        harness around it. Refuses a KV layout the adapter does not support, at start."""
        from vllm.v1.structured_output import StructuredOutputManager

        if scheduler is not None:  # ``attach``: a scheduler built elsewhere, kept; its class gets the hooks
            self.harness = h = VllmHarness.around(scheduler)
            sched = scheduler
            if not hasattr(type(sched), "vtoken_adapter"):  # not a VToken<...> class yet
                sched.__class__ = scheduler_class(type(sched))
            c = replace(c, block_size=h.block_size, num_blocks=h.num_blocks, prefix_caching=h.prefix_caching,
                        async_scheduling=h.async_scheduling)
        else:
            self.harness = h = VllmHarness(block_size=c.block_size, num_blocks=c.num_blocks,
                                           prefix_caching=c.prefix_caching, max_num_seqs=c.max_num_seqs,
                                           max_num_batched_tokens=c.max_num_batched_tokens,
                                           max_model_len=c.max_model_len, async_scheduling=c.async_scheduling,
                                           kv_layout=c.kv_layout, sliding_window=c.sliding_window)
            cls = scheduler_class(type(h.scheduler))
            sched = cls(vllm_config=h.vllm_config, kv_cache_config=h.kv_cache_config, block_size=c.block_size,
                        log_stats=False, structured_output_manager=StructuredOutputManager(h.vllm_config))
        h.scheduler = sched  # the harness's accessors (pool, manager, make_request) now see ours
        return sched, c

    def _rooms(self, c: AdapterConfig) -> None:
        """Build the rooms, each given what it reads (none reads the adapter's attributes)."""
        # the lifecycle room (every path's): headroom, blocks held outside the lists (applied
        # destinations and fills), plans in flight; its frees go to vLLM at their fence
        # the fence's clock: vLLM's when its deferred frees run (a KV-consumer connector), else the adapter's
        self.clock = StepClock(self.harness)
        self.port = VllmPort(self.harness, self.clock, dict(deferred_free_calls=0))
        self.lifecycle = Lifecycle(self.port, self.N, exclusive_held=True)  # its own counts: plans, outcomes
        self.reserve = Headroom(self.harness, self.lifecycle, self.cfg.headroom if self.reclaim else 0,
                                c.headroom_pool_fraction, self.S,
                                dict(backpressure_steps=0, held_back_max=0, headroom_idle_returns=0,
                                     headroom_yielded=0), groups=self.groups,
                                frees_waiting=self.frees_waiting, soft=self._keep_headroom(c),
                                needed=lambda: self._t.num_dead_tokens > 0)
        self.mirror = BlockMirror(self.req_to_blocks, self.pool.null_block, self.pool.blocks,
                                  on_start=self._on_list_start, group=self.group,
                                  groups=self.groups)
        self.fence = FenceLedger(self.clock)
        self.hashes = PrefixHashRules(self.pool, self.manager, self.S,
                                      dict(hashes_kept=0, hashes_evicted=0, unfaithful_hashes_evicted=0,
                                           source_hashes_dropped=0), enabled=c.evict_unfaithful_hashes,
                                      changes=self.reclaim)
        self.checker = RuntimeChecks(harness=self.harness, table=self._t, lifecycle=self.lifecycle,
                                     mirror=self.mirror, fence=self.fence, pending_release=self.pending_release,
                                     current=self.current, full_every=c.check_full_every, paranoid=c.paranoid_checks,
                                     incremental=c.checks)
        self.book = PlanBook(self.lifecycle, harness=self.harness, table=self._t, cfg=self.cfg,
                             stats=dict(moves=0, sources_freed=0, dests_used=0, dests_returned=0, fills=0,
                                        shared_blocks_moved=0),
                             reserve=self.reserve, mirror=self.mirror, fence=self.fence, hashes=self.hashes,
                             checker=self.checker, requests=self, max_plans_per_step=self.max_plans_per_step,
                             checks=self.checks, keep_prefix_bytes=c.keep_prefix_bytes)

    def _keep_headroom(self, c: AdapterConfig) -> int:
        """The soft reservation's size (``AdapterConfig.keep_headroom``): only where in-place plans
        keep hashed bytes (its destinations serve only the hashed blocks' tokens:
        ``planner._in_place_keeping``); 0 otherwise. ``Headroom`` drops it where the planner
        reserves blocks itself."""
        return c.keep_headroom if self.reclaim and c.keep_prefix_bytes and self.cfg.in_place else 0

    @classmethod
    def attach(cls, scheduler, **settings) -> "VTokenAdapter":
        """The adapter over a scheduler built elsewhere (vLLM's engine core, vLLM's own test
        helpers): the instance is kept and its class becomes ``VToken<its class>``
        (``hooks.scheduler_class``; already such a class: kept as is); the geometry (block size,
        pool size, prefix caching, async) is read off it (``VllmHarness.around``);
        ``settings`` are the adapter's own (``reclaim``, ``planner_config``, ``checks``, ...);
        vLLM's configuration (``config.VLLM_FIELDS``) is the scheduler's, given here it is
        refused (``ConfigError``, ``unsupported``). Requests the caller adds with
        ``scheduler.add_request`` bypass ``add_request`` here."""
        return cls(scheduler=scheduler, **settings)

    # ------------------------------------------------------------------ accessors
    @property
    def pool(self):
        return self.harness.pool

    @property
    def manager(self):
        return self.harness.manager

    @property
    def req_to_blocks(self):
        return self.harness.req_to_blocks

    @property
    def headroom(self) -> list:
        """The reserved blocks, as vLLM's ``KVCacheBlock`` objects (the lifecycle keeps their ids)."""
        blocks = self.pool.blocks
        return [blocks[b] for b in self.lifecycle.headroom]

    @headroom.setter
    def headroom(self, blocks: list) -> None:
        """Replace the reservation (tests: blocks taken from vLLM's pool behind the hooks)."""
        self.lifecycle.headroom = [b.block_id for b in blocks]
        self.lifecycle.fresh = set(self.lifecycle.headroom)

    # the public counters, in the order they were always listed (readers print them)
    STATS_ORDER = ("plans", "applied", "aborted", "moves", "sources_freed", "dests_used", "dests_returned", "fills",
                   "released_empty", "hashes_kept", "hashes_evicted", "shared_blocks_moved", "backpressure_steps",
                   "held_back_max", "headroom_idle_returns", "orphaned_plans", "deferred_free_calls", "preemptions",
                   "headroom_yielded", "unfaithful_hashes_evicted", "source_hashes_dropped")

    @property
    def stats(self) -> dict:
        """Every room's counters in one new dict (read-only view: each room owns and counts its
        own events once; the lifecycle ``plans``/``applied``/``aborted``/``orphaned``, the port
        ``deferred_free_calls``, the headroom its yields and back-pressure, the prefix-hash
        rules their hashes, the plan book its moves and blocks, the adapter ``preemptions`` and
        ``released_empty``). ``orphaned_plans`` is the plans orphaned by their request's finish
        or preemption: read from the lifecycle (those ended as orphans plus those still flying),
        no longer counted a second time by the adapter. O(plans in flight)."""
        lc = self.lifecycle
        rooms = dict(lc.stats)
        for d in (self.port.stats, self.reserve.stats, self.hashes.stats, self.book.stats, self._counts):
            rooms.update(d)
        rooms["orphaned_plans"] = lc.stats["orphaned"] + sum(1 for p in lc.in_flight.values() if p.orphaned)
        out = {k: rooms.pop(k) for k in self.STATS_ORDER}
        out.update(rooms)  # the lazily counted ones (source_hashes_parked, ...) and ``orphaned``
        return out

    @property
    def held(self):
        """The blocks held for requests outside their lists (the lifecycle's: ``{request: {block id: None}}``)."""
        return self.lifecycle.held

    @property
    def plans(self) -> dict:
        """The plans in flight (the lifecycle's)."""
        return self.lifecycle.in_flight

    @property
    def busy(self) -> dict:
        return self.lifecycle.busy

    @property
    def history(self) -> list:
        """Snapshots of applied plans (``planner_config.record_snapshots``), in the order they landed."""
        return [p.snapshot for p in self.lifecycle.history]

    @property
    def plan_hook(self):
        """The toolkit's check of every proposal before launch (None: none); the plan book's."""
        return self.book.plan_hook

    @plan_hook.setter
    def plan_hook(self, hook) -> None:
        self.book.plan_hook = hook

    @property
    def kept_hashes(self) -> list:
        return self.hashes.kept

    def worker_layout(self):
        """vLLM's KV cache groups as the worker reads them (``layout.WorkerLayout``): the table's
        group and the sliding-window group, if any. ``ConfigError`` when no group holds a table."""
        from .layout import worker_layout

        return worker_layout(self.harness.managers)

    def frees_waiting(self) -> bool:
        """Do fenced frees wait for a step (vLLM's deferred frees or the adapter's)?"""
        return bool(self.scheduler.deferred_frees or self.port.deferred)

    def attach_worker(self, worker) -> None:
        """The worker the harness drives (``drain_idle`` host-syncs it), checked where the two
        meet (``ConfigError``, nothing attached): its token table is its own (the adapter's is a
        replica: one object for both is refused), of the adapter's geometry, and its
        ``layout`` is the adapter's ``worker_layout()`` (a worker that would read another group
        as the table's, or miss or invent a window group, is refused naming both layouts; so is
        any worker when no group can hold the table: a sliding-window-only layout)."""
        own = "VTokenAdapter.attach_worker"
        table = getattr(worker, "table", None)
        if table is self._t:
            raise ConfigError("inconsistent", f"{own}: the worker writes the adapter's own token "
                                              "table; give it a table of its own (the adapter keeps a replica)")
        geo = (getattr(table, "S", None), getattr(table, "num_blocks", None))
        if geo != (self.S, self.N):
            raise ConfigError("inconsistent", f"{own}: the worker's token table is block size {geo[0]} x {geo[1]} "
                                              f"blocks, the adapter's {self.S} x {self.N}")
        from .layout import describe

        lay, groups = getattr(worker, "layout", None), describe(self.harness.managers)
        if self.group is None:
            raise ConfigError("unsupported", f"{own}: the adapter's KV cache groups {groups} have none the token "
                                             f"table can mirror; a worker (layout {lay!r}) would read a sliding-window "
                                             f"group as the table's")
        want = self.worker_layout()
        if lay != want:
            raise ConfigError("inconsistent", f"{own}: the worker's layout {lay!r} is not the adapter's {want!r} "
                                              f"(KV cache groups {groups}); build it with layout=adapter.worker_layout()")
        self.worker = worker

    def _needs_steps(self) -> bool:
        """Plans in flight: their copies end only on steps to come (``hooks``: ``has_requests``)."""
        book = getattr(self, "book", None)  # None while the adapter is being built
        return bool(book is not None and book.plans)

    def block(self, block_id: int):
        return self.pool.blocks[block_id]

    def retained_now(self) -> int:
        """Blocks in use by requests: the pool's used blocks less the adapter's headroom
        (plan-held blocks waiting for their fence count: they are still allocated)."""
        return (self.N - 1) - self.pool.get_num_free_blocks() - len(self.reserve)

    def check_all(self) -> None:
        """Run every runtime check now (tests call this between steps)."""
        self._catch_up()
        self.checker.check_all()

    def has_work(self) -> bool:
        return bool(self.scheduler.has_requests())

    def output_tokens(self, req_id: str) -> list[int]:
        return list(self.requests[req_id].output_token_ids)

    # ------------------------------------------------------------------ requests
    def add_request(self, req_id: str, prompt_token_ids: Iterable[int], max_tokens: int = 16):
        """Make a vLLM ``Request`` and add it to the scheduler (vLLM owns it from here: it is
        in ``scheduler.requests``, counted by ``has_requests()``, abortable with
        ``finish_requests``). Admission back-pressure does not hold it outside vLLM: while
        the headroom is short, requests never scheduled yet sit out each ``schedule()`` call
        (``Headroom.withhold``) and are back in vLLM's waiting queue, in order, when it returns."""
        req = self.harness.make_request(req_id, prompt_token_ids, max_tokens=max_tokens)
        self.requests[req_id] = req
        self._arrival.setdefault(req_id, len(self._arrival))
        self.scheduler.add_request(req)
        return req

    def arrival(self, r: str) -> int:
        """``r``'s arrival order (a deterministic order for frees and plans)."""
        return self._arrival.get(r, 1 << 62)

    def running(self, r: str) -> bool:
        """Is ``r`` RUNNING in vLLM's scheduler (requests added there directly, as vLLM's engine
        does, included)?"""
        req = self.scheduler.requests.get(r)
        return req is not None and req.status == _RUNNING

    def current(self, r: str) -> bool:
        """Is ``r`` mirrored, in the table, and has the worker seen its incarnation's first step?"""
        return (r in self.mirror and r in self._t
                and self.mirror.incarnation.get(r, 0) <= self.clock.processed)

    def look_again(self, r: str) -> None:
        """Look at ``r`` for all-dead blocks at the next scheduled step."""
        self.release_todo.add(r)

    def accounted(self, r: str, b: int) -> str | None:
        """Where the adapter holds block ``b`` for ``r``: 'list', 'held' or None. O(1)."""
        if self.mirror.index(r, b) is not None:
            return "list"
        if b in self.held.get(r, _NO_BLOCKS):
            return "held"
        return None

    def detach_listed(self, r: str, block_ids) -> list[int]:
        """Take request ``r``'s list entries ``block_ids`` over (the lifecycle's ``detach`` for a
        plan's sources and fills): each entry becomes ``null_block`` (``mirror.detach_many``).
        Every block is checked to be in ``r``'s list before any entry changes (else
        ``table_in_step``, nothing changed). Returns their list indices, in the given order."""
        ids = [int(b) for b in block_ids]
        if len(set(ids)) != len(ids):
            raise AdapterAssumptionError("table_in_step", f"request {r!r}: blocks {ids} name one block twice")
        pos = self.mirror.pos.get(r, _NO_BLOCKS)
        missing = [b for b in ids if b not in pos]
        if missing:
            raise AdapterAssumptionError("table_in_step",
                                         f"request {r!r}: the table references block(s) {missing}, which the "
                                         f"scheduler side does not hold for it")
        blocks = self.pool.blocks
        return self.mirror.detach_many(r, [blocks[b] for b in ids]) if ids else []

    def _on_list_start(self, r: str, seq: int) -> None:
        """A request's block list (re)started (new or resumed): a new incarnation. A request
        vLLM's engine added directly gets its arrival order here."""
        self._arrival.setdefault(r, len(self._arrival))
        self.hashes.restart(r)

    # ------------------------------------------------------------------ hooks (``hooks``)
    def _before_reset_prefix_cache(self) -> None:
        """vLLM resets its prefix cache only when no block is in use: the headroom (never
        hashed, held only by the adapter) goes back to the pool first and is retaken at the
        next ``schedule()``. Blocks of plans in flight stay held until their copies report
        (a reset with a plan in flight fails, as it does with a request running)."""
        if self.reserve.give_back():
            self.reserve.stats["headroom_yielded"] += 1  # the headroom room counts its yields
        self.hashes.unpark_all()  # a reset clears every hash: a parked one must not come back after it

    def _before_schedule(self) -> None:
        self.reserve.before_schedule()

    def _restore_withheld(self) -> None:
        self.reserve.restore_withheld()

    def _take_changes(self) -> None:
        """Fold in what changed since the last hook (the worker's table mutations, new and
        grown lists): the requests to look at again, and what the checks must cover."""
        t = self._t
        tab, emptied, lists = t.take_changed(), t.take_emptied(), self.mirror.take_changed()
        reblocked = t.take_reblocked()
        if reblocked and self.reclaim:
            self.book.reblocked(reblocked)  # their skip records' versions moved
        if reblocked or lists:
            # the lists vLLM changed (a table's block set changing leaves vLLM's list as it was:
            # the list check compares vLLM's list with the mirror, never with the table); the
            # tables by what each gained (take_added): a table's blocks change only with its block
            # set (an eviction changes liveness), what the scheduler side holds for a request with
            # the adapter's own events (touch) or a list (re)started
            if lists:
                self.checker.touch_lists(lists)
            started = self.mirror.take_started()
            if started:
                self.checker.touch_tables(started)
            added = t.take_added()
            if added:
                self.checker.touch_added(added)
        if tab or lists:
            # a block becomes releasable when an eviction empties it, when a sharer leaves it
            # to one holder, or (below) when it stops being the tail; a request whose plan
            # lands or that had to wait is looked at again (look_again, release_todo)
            self.release_todo |= emptied
            for b in t.take_lone_dead():
                self.release_todo |= self.mirror.holders(b)
            self.book.stale_bounds |= tab | lists
        new = self.mirror.take_new_ids()
        if new and self.checks:
            self.checker.touch_entries(new)  # blocks vLLM put in a list: never one the adapter holds
        if self.tail_wait:  # O(requests whose all-dead tail was kept)
            for r, b in list(self.tail_wait.items()):
                if r not in t or t.tail_block(r) != b:
                    del self.tail_wait[r]
                    self.release_todo.add(r)

    def _after_schedule(self, sched_out) -> None:
        self._counts["preemptions"] += len(sched_out.preempted_req_ids or ())
        sched = self.scheduler
        self.clock.scheduled(sched_out)
        self.mirror.observe(sched_out, self.clock.seq)  # the clock already counted this step
        self._take_changes()
        if sched_out.total_num_scheduled_tokens <= 0:
            # plans in flight with nothing scheduled: the worker host-waits their copies now
            sched_out.vtoken = StepMeta(seq=0, reclaim=self.reclaim, drain=bool(self.book.plans))
            self.reserve.after_empty_step()
            if self.checks:
                self.checker.after_hook("after schedule (empty step)")
            return
        seq = self.clock.seq
        self.steps += 1
        meta = StepMeta(seq=seq, reclaim=self.reclaim)
        if sched.running:
            self.reserve.starved = False
        self.hashes.evict_unfaithful_grown(self.req_to_blocks)  # only requests that evicted have unfaithful blocks
        self._release_empty(meta)
        if self.reclaim:  # with reports held back the gate is decided on the worker's totals, caught up if it opens
            held = bool(self.replica.held)
            self.book.plan(meta, self.steps, totals=self.replica.totals if held else None,
                           catch_up=self._caught_up if held else None)
        sched_out.vtoken = meta
        if self.checks:
            self.checker.after_hook(f"after scheduling step {seq}")

    def _release_empty(self, meta: StepMeta) -> None:
        """Blocks whose tokens were all evicted: null-substituted and freed at fence ``seq``
        (Naive-Evict does this too; it needs no copy). Only requests whose table changed
        since they were last looked at (or that had to wait) are looked at."""
        t = self._t
        for r in sorted(self.release_todo, key=self.arrival):
            if r not in self.mirror or r not in t:
                self.release_todo.discard(r)  # gone: nothing to release
                continue
            if r in self.book.busy or not self.current(r) or not self.running(r):
                continue  # later: a plan flies, the worker has not seen this list yet, or it waits
            self.release_todo.discard(r)
            tail = t.tail_block(r)
            out = []
            dead = sorted(all_dead(t, r, t.block_array(r)))  # block order: a deterministic free order
            if tail in dead:
                self.tail_wait[r] = tail  # still written: looked at again when the tail moves
            for b in (b for b in dead if b != tail):
                blk = self.block(b)
                where = self.accounted(r, b)
                if where is None:
                    continue  # not ours (in flight or released already)
                if blk.ref_cnt != 1:  # shared in vLLM (a prefix hit not synced yet): look again next step
                    self.release_todo.add(r)
                    continue
                if where == "list":
                    i = self.mirror.detach(r, blk)
                else:
                    i = -1
                    self.lifecycle.held.take(r, [b])
                self.hashes.on_release(r, blk, i)
                out.append(b)
                self.pending_release.append((meta.seq, r, b))
                self.lifecycle.release([b], meta.seq)
            if out:
                meta.releases[r] = out
                self._counts["released_empty"] += len(out)
                self.checker.touch([r])

    def _on_request_free(self, request) -> None:
        """Preemption or finish: free the blocks held for the request with vLLM's fence for its
        list, orphan its in-flight plans (``Lifecycle.finish``), forget its mirror."""
        r = request.request_id
        self._catch_up()  # its held-back growth before its blocks change hands
        self.hashes.evict_unfaithful(r, self.req_to_blocks.get(r), upto=1 << 30)
        self.hashes.forget(r)
        fence = self.clock.seq if not self.clock.settled(request) else 0
        self.clock.forget(r)
        self.tail_wait.pop(r, None)
        self.checker.touch([r])
        # its held blocks go back at the fence of its list, its plans in flight become orphans
        self.lifecycle.finish(r, fence)
        self.book.forget(r)
        self.mirror.forget(r)

    def _before_update(self, sched_out, out=None) -> None:
        """A step's output is about to be processed: the clock advances, the adapter's
        deferred frees now due go back (where vLLM drains its own), and the worker's table
        changes are replayed on the replica (before vLLM frees the requests that finished)."""
        self.clock.processing(sched_out)
        self.port.drain()
        rep = getattr(out, "vtoken_report", None)
        if rep is not None:
            self._replay(rep)

    def _replay(self, rep) -> None:
        """The worker's table changes, on the replica (``messages.Replica``); a change the
        replica refuses means the two tables diverged (``table_in_step``). A report of decode
        growth, and of evictions that (the worker says, and the replay checks) left no block
        without a live token, may be held back and replayed with a later one, unless a request
        waits for its all-dead tail to move (``tail_wait``: a held growth could move it) or the
        report ends plans (their outcomes read the table). What else reads the table each step
        sees no difference: its all-dead blocks are the same, and the plan step decides its gate
        on the worker's totals and catches up when it opens (``PlanBook.plan``)."""
        free = not self.tail_wait and not rep.plans
        self._caught(self.replica.feed, rep.ops, free or not self.reclaim or not self._t.num_dead_tokens, free)
        self.worker_stats = dict(rep.stats)

    def _catch_up(self) -> None:
        """Replay what the replica held back (before a reader that decides reads it)."""
        if self.replica.held:
            self._caught(self.replica.catch_up)

    def _caught_up(self) -> None:
        """Catch up for the plan step, then fold in what the replayed reports changed (the
        requests whose bounds are stale, their skip records' versions), as the hook before it did."""
        self._catch_up()
        self._take_changes()

    @staticmethod
    def _caught(f, *args) -> None:
        try:
            f(*args)
        except (TableError, OrderError) as e:  # a refused change; a worker's word or total the replica contradicts
            if isinstance(e, OrderError) and e.code != "state_mismatch":
                raise
            raise AdapterAssumptionError("table_in_step", f"the worker's table change does not replay on the "
                                                          f"scheduler side's replica: {e}") from e

    @property
    def table(self) -> TokenTable:
        """The replica of the worker's token table, caught up (what the worker reported so far
        replayed: ``table_in_step`` if a held-back change does not replay). The object is the
        replica itself: kept across steps it may lag again (``_replay``); read it again."""
        self._catch_up()
        return self._t

    def _after_update(self, sched_out, out) -> None:
        rep = getattr(out, "vtoken_report", None)
        if rep is not None:
            self._absorb(rep)
        processed = self.clock.processed
        if self.pending_release:  # the checks hold the list itself: filtered in place
            self.pending_release[:] = [x for x in self.pending_release if x[0] > processed]
        meta = getattr(sched_out, "vtoken", None)
        if meta is not None and meta.seq:
            self.retained.append((meta.seq, self.retained_now(), len(self.scheduler.running)))
        self.reserve.after_update(plans_in_flight=bool(self.book.plans))
        self._take_changes()
        if self.checks:
            self.checker.after_hook(f"after processing step {meta.seq if meta else '?'}", table=True)

    def _absorb(self, rep) -> None:
        """The worker's report: full-context lengths for the prefix-hash rules (for requests
        whose current incarnation the worker has executed), then the finished plans."""
        processed = self.clock.processed  # the worker has executed up to here
        m = self.mirror
        self.hashes.absorb(rep.faithful, m.incarnation, processed)  # mirrored requests only: incarnation's keys
        self.book.absorb(rep.plans)

    # ------------------------------------------------------------------ driving
    def schedule(self):
        return self.scheduler.schedule()

    def update_from_output(self, sched_out, out):
        return self.scheduler.update_from_output(sched_out, out)

    def drain_idle(self) -> None:
        """At idle (nothing scheduled, nothing in flight): let the worker host-sync its
        copies and absorb the report, so copies that outlived their step are fenced too."""
        self._catch_up()
        if self.book.plans and self.worker is not None:
            rep = self.worker.synchronize()
            self._replay(rep)
            self._absorb(rep)
            if self.checks:
                self.checker.check_pool("after synchronize")
                self.checker.check_table()

    def close(self) -> dict:
        """Give the headroom back and check that every block returned (``all_returned``)."""
        sched = self.scheduler
        self._catch_up()
        if self.book.plans:
            self.drain_idle()
        if sched.has_requests():
            raise AdapterAssumptionError("all_returned", "close() with requests still pending")
        if self.checks:
            self.checker.check_pool("at close")
        self.reserve.give_back()
        free = self.pool.get_num_free_blocks()
        held = [b.block_id for b in self.pool.blocks if not b.is_null and b.ref_cnt != 0]
        left = {r: list(v) for r, v in self.held.items() if v}
        if free != self.N - 1 or held or left or self.frees_waiting() or self.book.plans or len(self.fence):
            raise AdapterAssumptionError(
                "all_returned", f"free count {free} (want {self.N - 1}); referenced blocks {held[:10]}; "
                f"adapter still holds {left}; deferred frees {len(sched.deferred_frees)} (vLLM's), "
                f"{len(self.port.deferred)} (the adapter's); "
                f"plans in flight {list(self.book.plans)}; fence ledger (plans) {sorted(self.fence.pending)}")
        return {"free": free, "N": self.N}
