"""A greedy decode engine over the paged decoder: Native, Naive-Evict and vToken (paper section 4).

``DecodeEngine`` owns one :class:`~vtoken.kvcache.KVCache`, one
:class:`~vtoken.table.TokenTable`, one :class:`~vtoken.allocator.BlockAllocator` and, in
``vtoken`` mode, a :class:`~vtoken.planner.ReclamationManager` driving a
:class:`~vtoken.copy_engine.KVCopyEngine`. It runs a batch of requests to completion, one
decode step for every active request at a time (Algorithm 1 of the paper):

1. eviction (not in ``native``): keep at most ``ceil((1 - evict_ratio) * length)`` live
   tokens, never the newest, using the policy with the attention statistics the model
   returned so far (``select_victims`` -> ``table.evict_tokens``); blocks left with no live
   token are released at once (both eviction modes do this, identically);
2. (``vtoken``) ``copy_engine.wait_before_attention()``: the device-side wait on copies
   not yet observed done;
3. per request: read slots = ``table.slot_mapping(r).clone()`` (Eq. 2) taken BEFORE the
   new token is synced; a block is allocated when the positional block list is full;
   ``sync_new_tokens`` gives the new token's write slot;
4. one ``decode_step`` for the batch, greedy next tokens, ``policy.observe``;
5. (``vtoken``) after the forward pass: ``manager.step()`` finishes copies (applying them:
   table updated, sources freed, ``on_applied`` puts the null block where a source was in
   the positional list and records the destinations as held) and plans/launches new ones;
6. finished requests give their blocks back (blocks an in-flight copy still uses are
   freed when the copy ends); after the last step ``run`` ends every copy still in flight
   (:meth:`DecodeEngine.drain`), so a finished batch holds no block.

``native`` keeps every token and computes slots straight from the positional block list
(no token table): the unmodified paged baseline. ``naive-evict`` and ``vtoken`` make the
same eviction decisions (one policy instance per run, per-request seeded state, same
statistics because the K/V bytes and their order are the same), so their greedy outputs
must be bitwise identical: the strongest end-to-end check of the relocation machinery.

Tokens evicted while their copy is in flight stay dead: the manager drops their moves
before the plan is applied (``apply_moves`` would otherwise refuse a dead token), and the
relocation checker is told about every eviction.

The graph path (``cuda_graph``; on by default on CUDA)
------------------------------------------------------
Step 4 runs :meth:`PagedDecoder.decode_static` over fixed-shape buffers instead of
:meth:`PagedDecoder.decode_step`. One :class:`StepGraph` per batch shape ``(B, T)`` (``B``
active requests, ``T`` read slots per row) owns the buffers; on CUDA it captures the step
once into a CUDA graph and replays it; on the CPU it runs the same function eagerly (the
CPU fallback, which the tests drive). The order within a step, the contract of the path:

1. ``copy_engine.wait_before_attention()`` (step 2 above): the compute stream waits, on
   the device, for every copy not yet observed done. The replay is issued later on that
   same stream, so it is ordered after the wait;
2. host-side hook: the slot buffer is written IN PLACE (the graph captured its address),
   every row in full on every step (:meth:`DecodeEngine._write_read_slots`): a request's
   read slots are not append-only, evictions compact them and applied moves change them;
   the per-row scalars (token, position, write slot, read count) go through one pinned
   staging buffer, copied without a host wait;
3. replay (CUDA) or the eager call (CPU), on the current stream;
4. the greedy tokens and the attention statistics come back through pinned buffers and
   one event: the only host wait of the step, and the host needs those tokens;
5. ``manager.step()``: relocation copies are launched OUTSIDE the graph on the relocation
   stream (which first waits for the compute stream, i.e. for the replay).

A replay that skipped step 1 or 2 would read stale K/V (bug class 10); the sentinel mode
of the copy engine with ``sentinel_check`` reads what the graph reads (the slot buffer
itself), and ``tests/test_gpu.py`` probes the ordering on a device. The greedy tokens of the
graph path equal the plain path's token for token (masked padding changes reductions in
the last bits, see ``decode_static``); ``naive-evict`` and ``vtoken`` on the same path stay
bitwise comparable.

Owns: its KVCache, TokenTable, BlockAllocator, manager, copy engine and StepGraphs. Every block
it allocates for a request is held by the lifecycle (``vtoken.lifecycle``; the manager's, or a
plan-less one without reclamation), which frees it; the positional lists only feed the table.
May call: vtoken.table, .allocator, .planner, .copy_engine, .model, .policies, .errors, torch,
numpy; never spec/, invariants/, fuzz/ or reports/ (a checker comes in as ``check_relocations``).
Costs: per step the model's forward plus O(active requests x read slots) host work (read slots,
eviction, ``manager.step``); one CUDA graph capture per batch shape.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from .allocator import NULL_BLOCK, BlockAllocator
from .decode_config import CHECK_METHODS, DecodeConfig, _bad, default_planner_config  # noqa: F401 - re-exported
from .errors import CallError, CallIndexError, OrderError, RelocationCheckError
from .model.decoder import DecodeItem, PagedDecoder, greedy
from .lifecycle import AllocatorPort, Lifecycle, all_dead
from .planner import MODES, ReclamationManager
from .policies import make_policy
from .table import TokenTable

__all__ = ["DecodeConfig", "DecodeEngine", "DecodeResult", "StepGraph", "default_planner_config",
           "full_retention_blocks", "make_prompts", "MODES", "CHECK_METHODS"]

def make_prompts(requests: int, prompt_tokens: int, vocab: int, seed: int) -> list[list[int]]:
    """``requests`` random prompts of ``prompt_tokens`` ids below ``vocab``: a function of ``seed``."""
    rng = np.random.default_rng([seed, 0x9E37])
    return rng.integers(0, vocab, size=(requests, prompt_tokens)).tolist()


def full_retention_blocks(prompt_lens: Sequence[int], new_tokens: Sequence[int] | int, block_size: int,
                          headroom: int = 0) -> int:
    """Blocks for every request to keep every token (plus the null block and the headroom)."""
    if isinstance(new_tokens, int):
        new_tokens = [new_tokens] * len(prompt_lens)
    return sum(-(-(p + n) // block_size) for p, n in zip(prompt_lens, new_tokens)) + headroom + 1


@dataclass
class _Req:
    id: object
    prompt_len: int
    max_new: int
    blocks: list  # positional block list (null where a source was reclaimed)
    out: list = field(default_factory=list)
    slots: Optional[torch.Tensor] = None  # native: slots by position
    n: int = 0  # tokens written (native)
    done: bool = False


@dataclass
class DecodeResult:
    mode: str
    policy: str
    evict_ratio: float
    block_size: int
    num_blocks: int
    device: str
    outputs: list  # generated tokens per request, in prompt order
    tokens_per_s: float
    decode_tokens_per_s: float
    wall_s: float
    steps: int
    step_ms_median: float
    step_ms_mean: float
    step_ms: list  # per decode step
    step_cpu_ms_median: float = 0.0  # process CPU time per step (less sensitive to other load)
    relocations: int = 0  # applied plans
    plans_launched: int = 0
    plans_aborted: int = 0  # copy failed (or a source became shared): nothing applied
    plans_orphaned: int = 0  # its request finished while the copy flew: nothing applied, blocks freed after
    moves: int = 0
    blocks_freed_by_compaction: int = 0
    hash_checks: int = 0  # comparisons passed
    hash_failures: int = 0
    relocation_events_checked: int = 0
    retained_blocks_end: int = 0  # blocks held by requests after the last step
    retained_blocks_peak: int = 0
    retained_blocks_mean: float = 0.0
    ideal_blocks_end: int = 0  # sum over requests of ceil(live / S)
    waste_ratio_end: float = 0.0
    waste_ratio_mean: float = 0.0
    empty_blocks_released: int = 0
    planner: Optional[dict] = None
    copy_stats: Optional[dict] = None
    failures: list = field(default_factory=list)
    prefill_fallback: Optional[str] = None  # CUDA: why prefill ran token by token (see _prefill)
    cuda_graph: bool = False  # the decode steps ran through StepGraph (captured on CUDA, eager on CPU)
    graph_captures: int = 0  # CUDA graphs captured (one per batch shape); 0 on the CPU
    graph_replays: int = 0  # steps run through the graph path (replays on CUDA, eager calls on CPU)

    def to_dict(self, with_outputs: bool = True, with_steps: bool = False) -> dict:
        d = asdict(self)
        if not with_outputs:
            d.pop("outputs")
        if not with_steps:
            d.pop("step_ms")
        return d


class StepGraph:
    """The decode step for one batch shape ``(B, T)``: fixed buffers, captured once on CUDA.

    Owns (allocates; they go when it is dropped): the static inputs ``inputs`` (int64
    ``[4, B]``: token, position, write slot, read count per row) and ``read_slots`` (int64
    ``[B, T]``, the slot buffer), a pinned host staging buffer for ``inputs``, pinned output
    buffers and an event; on CUDA also the captured graph, its capture stream and its
    private memory pool, which holds the output tensors. It does not own the model, the KV
    cache or the RoPE tables that ``fn`` reads: the caller keeps them alive and in place
    (a graph replays fixed addresses).

    ``fn(step_graph) -> (tokens [B] int64, stats [B, T + 1] float32)`` computes the step
    from the buffers without a host sync or a data-dependent shape.

    Protocol, once per step: write ``read_slots`` rows in place and call :meth:`stage`
    (the scalars), then :meth:`run`, then :meth:`fetch` (the outputs, on the host). On the
    CPU ``run`` calls ``fn`` eagerly. On CUDA the first ``run`` warms ``fn`` up on a side
    stream (running the staged step: its K/V writes put the same bytes where the replay
    will) and captures it; every ``run`` then replays it ON THE CURRENT STREAM, so the
    replay is ordered after everything issued there before it: the device-side wait on
    pending relocation copies and the staging copies. ``fetch`` is the step's one host
    wait (an event after the replay); ``stage`` refuses to overwrite the pinned staging
    buffer before the previous step's ``fetch`` (its copy might not have run yet).
    """

    def __init__(self, B: int, T: int, device, fn):
        self.B, self.T = int(B), int(T)
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.fn = fn
        self.inputs = torch.zeros((4, self.B), dtype=torch.int64, device=self.device)
        self.read_slots = torch.zeros((self.B, self.T), dtype=torch.int64, device=self.device)
        self._staging = torch.zeros((4, self.B), dtype=torch.int64, pin_memory=self.is_cuda)
        self.graph = None
        self.stream = None  # CUDA: the warm-up / capture stream
        self.out = None  # (tokens, stats) of the last run; on CUDA the graph's static outputs
        self.captures = 0
        self.runs = 0
        self._in_flight = False  # run() issued, fetch() not yet called
        self._host_tok = self._host_stats = self._done = None

    def stage(self, tokens: Sequence[int], positions: Sequence[int], write_slots: Sequence[int],
              num_read: Sequence[int]) -> None:
        """Write the rows' scalars into ``inputs`` in place (one copy, no host wait)."""
        if self._in_flight:
            raise OrderError("out_of_order", "StepGraph.stage before the previous step's fetch")
        st = self._staging.numpy()
        st[0], st[1], st[2], st[3] = tokens, positions, write_slots, num_read
        self.inputs.copy_(self._staging, non_blocking=self.is_cuda)

    def run(self):
        """Run the step: eagerly (CPU), or replay the graph on the current stream (CUDA)."""
        if not self.is_cuda:
            self.out = self.fn(self)
        else:
            if self.graph is None:
                self._capture()
            self.graph.replay()
        self.runs += 1
        self._in_flight = True
        return self.out

    def _capture(self) -> None:
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(cur)  # the warm-up reads the staged inputs and the waited-for copies
        with torch.cuda.stream(side):
            for _ in range(2):
                self.fn(self)
        cur.wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            self.out = self.fn(self)
        # the static outputs were made on the side stream: order the current stream's reads of
        # them (fetch) after it, so a stream checker (CSAN) sees the same order the replays keep
        cur.wait_stream(side)
        self.graph, self.stream = g, side
        self.captures += 1

    def fetch(self, stats: bool = True) -> tuple[list, Optional[np.ndarray]]:
        """The last run's greedy tokens (list) and, if asked, stats (a host copy ``[B, T + 1]``)."""
        tok, st = self.out
        self._in_flight = False
        if not self.is_cuda:
            return tok.tolist(), (st.numpy().copy() if stats else None)
        if self._done is None:
            self._host_tok = torch.empty(tok.shape, dtype=tok.dtype, pin_memory=True)
            self._host_stats = torch.empty(st.shape, dtype=st.dtype, pin_memory=True)
            self._done = torch.cuda.Event()
        self._host_tok.copy_(tok, non_blocking=True)
        if stats:
            self._host_stats.copy_(st, non_blocking=True)
        self._done.record()
        self._done.synchronize()  # the step's one host wait: the host needs the tokens
        return self._host_tok.tolist(), (self._host_stats.numpy().copy() if stats else None)


class DecodeEngine:
    """Greedy batched decoding in one of :data:`MODES` (see the module docstring).

    Args:
        model: a :class:`PagedDecoder` (moved to ``device`` by the caller or here).
        config: a :class:`~vtoken.decode_config.DecodeConfig` (every other setting, validated
            when it was made; its fields are documented there); or, instead, its fields as
            keywords (``DecodeEngine(model, mode="naive-evict")``), which build one. A bad
            field raises :class:`~vtoken.errors.ConfigError` (a ``ValueError``) naming it and
            its value before any cache, table or engine exists; a config and keywords
            together are refused (``inconsistent``: use ``dataclasses.replace``).

    The engine owns the relocation checker it builds (``self.checker``). In sentinel mode
    (``sentinel_check``) it also poisons the blocks it gives up (:meth:`_poison`).
    """

    def __init__(self, model: PagedDecoder, config: Optional[DecodeConfig] = None, **settings):
        # every argument checked before anything is built (ConfigError naming it and its value)
        if not isinstance(model, PagedDecoder):
            _bad("bad_type", "model", "a vtoken.model.decoder.PagedDecoder", type(model).__name__)
        if config is not None and settings:
            _bad("inconsistent", "config", f"alone (settings {sorted(settings)} given too; use "
                                           f"dataclasses.replace(config, ...))", config)
        if config is not None and not isinstance(config, DecodeConfig):
            _bad("bad_type", "config", "None or a vtoken.decode_config.DecodeConfig", config)
        c = self.config = config if config is not None else DecodeConfig(**settings)
        self.model = model
        self.mode, self.policy_name, self.evict_ratio = c.mode, c.policy, c.evict_ratio
        self.S, self.device, self.seed = c.block_size, c.device, c.seed
        self.check_relocations, self.cfg = c.check_relocations, c.planner_config
        self.force_sync, self.copy_kwargs, self.snapshot_dir = c.force_sync, c.copy_kwargs, c.snapshot_dir
        self.policy_kwargs, self.sentinel_check = c.policy_kwargs, c.sentinel_check
        self.check_method, self.full_bytes = c.check_method, c.full_bytes
        self.num_blocks, self.copy_engine_factory, self.cuda_graph = c.num_blocks, c.copy_engine_factory, c.cuda_graph
        self._ready = False
        if c.num_blocks is not None:
            self.setup(c.num_blocks)

    # ------------------------------------------------------------------ setup
    def setup(self, num_blocks: int) -> None:
        """Build the cache, table, allocator, policy and (vtoken) manager for ``num_blocks``."""
        self.num_blocks = int(num_blocks)
        if next(self.model.parameters()).device != self.device:
            self.model.to(self.device)
        on_cuda = self.device.type == "cuda"
        self.kv = self.model.make_kv_cache(self.num_blocks, self.S, device=self.device, checked=not on_cuda)
        self.alloc = BlockAllocator(self.num_blocks)
        self.table = TokenTable(self.S, self.num_blocks, device=self.device) if self.mode != "native" else None
        kw = dict(self.policy_kwargs)
        if self.policy_name == "random":
            kw.setdefault("seed", self.seed)
        self.policy = make_policy(self.policy_name, **kw) if self.mode != "native" else None
        self.copy_engine = None
        self.manager = None
        self.checker = None
        if self.mode == "vtoken":
            self.copy_engine = self.copy_engine_factory(self.kv, self.S, force_sync=self.force_sync, **self.copy_kwargs)
            eng = self.copy_engine
            if self.check_relocations:  # the toolkit's checker, handed in (the system never imports it)
                self.checker = self.check_relocations(self.kv, self.table, out_dir=self.snapshot_dir,
                                                      method=self.check_method, full_bytes=self.full_bytes)
                eng = self.checker.wrap(self.copy_engine)
            self.manager = ReclamationManager(self.table, self.alloc, eng, self.cfg, on_applied=self._on_applied,
                                              after_apply=self.checker.after_apply if self.checker else None)
        # the lifecycle holds every block of every request (without reclamation, one with no plans)
        self.lifecycle = self.manager.lifecycle if self.manager else Lifecycle(AllocatorPort(self.alloc),
                                                                              self.num_blocks)
        self._reqs: dict[object, _Req] = {}
        self._order: list = []
        self._recent: list = []  # plans finished by the last manager step (watched one more step)
        self.step_times: list[float] = []
        self.step_cpu: list[float] = []  # process CPU time per step (robust on a shared machine)
        self._retained: list[int] = []
        self._waste: list[float] = []
        self.empty_released = 0
        self._ideal_last = 0
        self.prefill_fallback = False
        self._graphs: dict[tuple[int, int], StepGraph] = {}  # (B, T) -> the step for that shape
        self._graph_T = 0  # read-slot capacity of the current graphs
        self._rope: Optional[tuple] = None  # device RoPE rows [0, T + 1) the graphs read
        self.graph_captures = 0
        self.graph_replays = 0
        self._ready = True

    # ------------------------------------------------------------------ blocks
    def _allocate(self, n: int, req_id) -> list[int]:
        if self.alloc.num_free < n and self.manager is not None:
            # out of free blocks: give back headroom rather than fail (the refill takes it again)
            self.manager.yield_headroom(n - self.alloc.num_free)
        blocks = self.alloc.allocate(n)
        self.lifecycle.hold(req_id, blocks)
        self._watch_alloc(req_id, blocks)
        return blocks

    def _drop_blocks(self, r: _Req, gone) -> None:
        """``gone`` (reclaimed sources / released empty blocks) leave the positional list (the
        table's sync reads only its tail; the lifecycle holds the references)."""
        gone = set(gone)
        r.blocks = [NULL_BLOCK if b in gone else b for b in r.blocks]

    def _on_applied(self, plan) -> None:
        r = self._reqs.get(plan.req_id)
        if r is not None:
            self._drop_blocks(r, plan.sources)
        self._poison(plan.sources)

    def _poison(self, blocks) -> None:
        """Sentinel mode (the copy engine's ``sentinel``): fill every slot of blocks the engine
        just gave up (an applied plan's sources, released empty blocks) with the sentinel.

        They hold no live token, so nothing may read them until they are written again; a
        stale read (a slot mapping or a graph slot buffer not updated after a move) then shows
        up as the sentinel in attention's inputs instead of as old, still-correct bytes. On
        CUDA the fill is issued on the compute stream after the copy out of them was observed
        done (``apply`` runs only then), so it never races the relocation stream."""
        eng = self.copy_engine
        if eng is None or not getattr(eng, "sentinel", False) or not len(blocks):
            return
        S = self.S
        b = np.asarray(sorted({int(x) for x in blocks}), dtype=np.int64)
        slots = (b[:, None] * S + np.arange(S, dtype=np.int64)[None, :]).reshape(-1)
        st = torch.from_numpy(slots)
        if self.device.type == "cuda":
            st = st.pin_memory().to(self.device, non_blocking=True)
        self.kv.flat.index_fill_(2, st, eng.sentinel_value)

    def _release_empty(self, r: _Req, victims: np.ndarray) -> None:
        """Give back blocks the eviction left without a live token (never one a copy uses)."""
        t = self.table
        mgr = self.manager
        cand = all_dead(t, r.id, np.unique(t.slots(r.id)[victims] // self.S), tail=t.tail_block(r.id),
                        busy=mgr.busy_mask if mgr is not None else None)
        if cand:
            freed = t.release_empty_blocks(r.id, cand)
            self.lifecycle.release_held(r.id, freed)
            self._drop_blocks(r, freed)
            self.empty_released += len(freed)
            self._poison(freed)

    # ------------------------------------------------------------------ event recording (snapshots)
    def _watched(self) -> list:
        if self.manager is None or not self.cfg.record_snapshots:
            return []
        plans = [p for p in self.manager.in_flight.values() if p.snapshot is not None]
        return plans + [p for p in self._recent if p.snapshot is not None]

    def _watch_alloc(self, req_id, blocks) -> None:
        for p in self._watched():
            hit = sorted(set(blocks) & set(p.blocks))
            if hit:
                self.manager.record(p, "alloc", request=str(req_id), blocks=hit)

    def _watch_rw(self, req_id, read_ids, read_slots, write_ids, write_slots) -> None:
        for p in self._watched():
            blk = np.asarray(sorted(set(p.blocks)), dtype=np.int64)
            if read_slots is not None and len(read_slots):
                m = np.isin(read_slots // self.S, blk)
                if m.any():
                    self.manager.record(p, "read", request=str(req_id), tokens=read_ids[m].tolist(),
                                        slots=read_slots[m].tolist())
            m = np.isin(write_slots // self.S, blk)
            for t, s in zip(write_ids[m].tolist(), write_slots[m].tolist()):
                self.manager.record(p, "write", request=str(req_id), token=int(t), slot=int(s))

    # ------------------------------------------------------------------ requests
    def admit(self, req_id, prompt_ids: Sequence[int], max_new_tokens: int, blocks: Optional[list] = None) -> None:
        """Prefill one request (its K/V written, its first token generated).

        ``blocks``: the positional block list to use (already allocated to the request, a
        test hook); by default ``ceil(len(prompt) / S)`` blocks are allocated.
        """
        if not self._ready:
            raise OrderError("not_set_up", "engine not set up: pass num_blocks or call setup()")
        if req_id in self._reqs:
            raise CallError("duplicate_request", f"request {req_id!r} already admitted")
        P = len(prompt_ids)
        if P == 0 or max_new_tokens < 1:
            raise CallError("bad_value", "need a non-empty prompt and max_new_tokens >= 1")
        S = self.S
        if blocks is not None:  # allocated by the caller: held from now on
            blocks = list(blocks)
            self.lifecycle.hold(req_id, blocks)
        else:
            blocks = self._allocate(-(-P // S), req_id)
        r = _Req(req_id, P, int(max_new_tokens), blocks)
        self._reqs[req_id] = r
        self._order.append(req_id)
        pos = np.arange(P, dtype=np.int64)
        if self.mode == "native":
            cap = P + max_new_tokens
            r.slots = torch.empty(cap, dtype=torch.int64, device=self.device)
            bl = np.asarray(blocks, dtype=np.int64)
            slots_np = bl[pos // S] * S + pos % S
            r.slots[:P] = torch.from_numpy(slots_np).to(self.device)
            r.n = P
        else:
            slots_np = self.table.sync_new_tokens(req_id, blocks, P)
            self.table.flush()
            self._watch_rw(req_id, None, None, pos, slots_np)
        if self.copy_engine is not None:
            self.copy_engine.wait_before_attention()
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.int64)
        logits, stats = self._prefill(ids, pos, slots_np)
        r.out.append(int(greedy(logits)))
        if self.policy is not None:
            self.policy.observe(req_id, pos, stats.numpy())
        if len(r.out) >= r.max_new:
            self.finish(req_id)

    def _prefill(self, ids: torch.Tensor, pos: np.ndarray, slots_np: np.ndarray):
        slots_t = torch.from_numpy(np.ascontiguousarray(slots_np)).to(self.device)
        try:
            return self.model.prefill(self.kv, ids, torch.from_numpy(pos), slots_t)
        except RuntimeError as e:
            # The decoder's causal mask is built on the host; on CUDA that fails until
            # decoder.py builds it on the scores' device. Prefill token by token instead
            # (same in every mode, so the outputs stay comparable).
            if self.device.type != "cuda":
                raise
            self.prefill_fallback = str(e).splitlines()[0][:200]
        acc = torch.zeros(len(pos), dtype=torch.float32)
        logits = None
        for i in range(len(pos)):
            lg, st = self.model.decode_step(self.kv, [DecodeItem(int(ids[i]), int(pos[i]), int(slots_np[i]),
                                                                 slots_t[:i])])
            acc[: i + 1] += st[0]
            logits = lg[0]
        return logits, acc

    def finish(self, req_id) -> None:
        """The request is done: forget it everywhere and give its blocks back."""
        r = self._reqs[req_id]
        if r.done:
            return
        r.done = True
        if self.manager is None:
            if self.table is not None:
                self.table.free_request(req_id)
            self.lifecycle.finish(req_id)
        else:
            if self.checker is not None:
                self.checker.forget_request(req_id)
            self.manager.finish_request(req_id)
        if self.policy is not None:
            self.policy.forget(req_id)

    @property
    def active(self) -> list:
        return [rid for rid in self._order if not self._reqs[rid].done]

    # ------------------------------------------------------------------ one step
    def _evict(self, r: _Req) -> None:
        t = self.table
        n = t.length(r.id)
        keep = max(1, math.ceil(n * (1.0 - self.evict_ratio) - 1e-9))
        if t.num_live(r.id) <= keep:
            return
        live = t.live_tokens(r.id)
        victims = self.policy.select_victims(r.id, live, keep)
        if len(victims) == 0:
            return
        t.evict_tokens(r.id, victims)
        if self.checker is not None:
            self.checker.note_evicted(r.id, victims)
        self._release_empty(r, victims)

    def step(self) -> None:
        """One decode step for every active request (see the module docstring)."""
        t0, c0 = time.perf_counter(), time.process_time()
        active = [self._reqs[rid] for rid in self.active]
        if not active:
            return
        if self.mode != "native" and self.evict_ratio > 0:
            for r in active:
                self._evict(r)
        if self.checker is not None:
            self.checker.settle()  # finished comparisons raise here (never a host wait)
        if self.copy_engine is not None:
            waited = self.copy_engine.wait_before_attention()
            for p in self._watched():
                if waited and p.id in waited:
                    self.manager.record(p, "fence", plan=p.id)
        observe = self.policy is not None and self.evict_ratio > 0
        items, live_ids = self._step_items(active, observe)
        if self.cuda_graph:
            toks, stats = self._graph_decode(active, items, observe)
        else:
            if self.sentinel_check and self.copy_engine is not None:
                for r, it in zip(active, items):
                    self._sentinel(r, it.read_slots)
            logits, stats = self.model.decode_step(self.kv, items)
            toks = greedy(logits).tolist()
        finished = []
        for i, r in enumerate(active):
            if observe:
                ids = np.append(live_ids[i], items[i].position)
                self.policy.observe(r.id, ids, stats[i].numpy())
            r.out.append(int(toks[i]))
            if len(r.out) >= r.max_new:
                finished.append(r.id)
        if self.manager is not None:
            before = dict(self.manager.in_flight)
            self.manager.step(force_sync=self.force_sync)
            self._recent = [p for pid, p in before.items() if pid not in self.manager.in_flight]
        self._measure()
        for rid in finished:
            self.finish(rid)
        self.step_times.append(time.perf_counter() - t0)
        self.step_cpu.append(time.process_time() - c0)

    def _step_items(self, active: list, observe: bool) -> tuple[list, list]:
        """The step's ``DecodeItem`` per request and, where the policy observes or snapshots
        are recorded, each request's live token ids. Read slots of every request first (Eq. 2,
        taken before the new tokens are synced; one flush of the step's queued table updates),
        then sync every new token."""
        S = self.S
        reads, live_ids, ns = [], [], []
        for r in active:
            if self.mode == "native":
                ns.append(r.n)
                reads.append(r.slots[: r.n])
            else:
                ns.append(self.table.length(r.id))
                reads.append(self.table.slot_mapping(r.id).clone())
                if observe or self.cfg.record_snapshots:
                    live_ids.append(self.table.live_tokens(r.id))
        items = []
        record = self.cfg.record_snapshots and self.manager is not None and (self.manager.in_flight or self._recent)
        for i, r in enumerate(active):
            n, read = ns[i], reads[i]
            if n // S >= len(r.blocks):
                r.blocks += self._allocate(1, r.id)
            if self.mode == "native":
                slot = r.blocks[n // S] * S + n % S
                r.slots[n] = slot
                r.n = n + 1
            else:
                slot = int(self.table.sync_new_tokens(r.id, r.blocks, n + 1)[0])
                if record:
                    self._watch_rw(r.id, live_ids[i], read.cpu().numpy(), np.array([n]), np.array([slot]))
            items.append(DecodeItem(r.out[-1], n, slot, read))
        if self.table is not None:
            self.table.flush()
        return items, live_ids

    def _sentinel(self, r: _Req, read_slots: torch.Tensor) -> None:
        if self.copy_engine.contains_sentinel(read_slots):
            raise RelocationCheckError(
                "i3_sentinel", f"request {r.id!r}: attention's inputs hold the copy sentinel "
                               f"(a moved entry read before its copy completed, or a stale slot)")

    # ------------------------------------------------------------------ the graph path
    def _graph_for(self, active: list, B: int) -> StepGraph:
        """The StepGraph of this batch shape; ``T`` covers every active request's whole length."""
        need = max(r.prompt_len + r.max_new for r in active)
        if need > self._graph_T:
            # round up so a later, slightly longer request reuses the shape; graphs of the old
            # T are dropped (their buffers and private pools go with them)
            self._graph_T = -(-need // 64) * 64
            self._graphs = {}
            self._rope = self.model.rope_tables(self._graph_T + 1, self.device)
        T = self._graph_T
        gs = self._graphs.get((B, T))
        if gs is None:
            gs = self._graphs[(B, T)] = StepGraph(B, T, self.device, self._graph_fn)
        return gs

    def _graph_fn(self, gs: StepGraph):
        """What the graph captures: ``decode_static`` over the buffers, then greedy."""
        tok, pos, wslot, nread = gs.inputs
        logits, stats = self.model.decode_static(self.kv, tok, pos, wslot, gs.read_slots, nread, self._rope)
        return greedy(logits), stats

    def _write_read_slots(self, gs: StepGraph, row: int, req: _Req, read: torch.Tensor) -> None:
        """Host-side hook of the graph path: row ``row`` of the slot buffer := ``read`` (this
        step's read slots of ``req``), in place, in full, every step. The buffer's address is
        what the graph captured; a row is not append-only (evictions compact the mapping,
        applied moves change slots), so writing only new tail entries would leave stale slots."""
        n = read.numel()
        if n:
            gs.read_slots[row, :n].copy_(read)

    def _check_items(self, items: list) -> None:
        """The host checks ``decode_step`` makes on a checked cache (the graph validates nothing)."""
        ws = [it.write_slot for it in items]
        if len(set(ws)) != len(ws):
            raise CallError("duplicate_slot", "decode_step: two requests share a write_slot")
        ns = self.kv.num_slots
        for it in items:
            rs = it.read_slots
            if not 0 <= it.write_slot < ns:
                raise CallIndexError("out_of_range", f"write slot {it.write_slot} out of range [0, {ns})")
            if rs.numel():
                if int(rs.min()) < 0 or int(rs.max()) >= ns:
                    raise CallIndexError("out_of_range", f"read slot out of range [0, {ns})")
                if bool((rs == it.write_slot).any()):
                    raise CallError("duplicate_slot", f"decode_step: write_slot {it.write_slot} is in read_slots")

    def _graph_decode(self, active: list, items: list, observe: bool):
        """Step 4 through the graph path: write the slot buffer, stage, run, fetch (see the
        module docstring). The device-side wait on pending copies was issued at step start."""
        B = len(items)
        gs = self._graph_for(active, B)
        ns = [int(it.read_slots.numel()) for it in items]
        # an internal invariant, not a caller's error: _graph_for sizes T to the longest request
        assert max(ns) <= gs.T and max(it.position for it in items) <= gs.T, \
            f"graph path: a request outgrew its shape (T={gs.T})"
        if self.kv.checked:
            self._check_items(items)
        for i, (r, it) in enumerate(zip(active, items)):
            self._write_read_slots(gs, i, r, it.read_slots)
        gs.stage([it.token_id for it in items], [it.position for it in items], [it.write_slot for it in items], ns)
        if self.sentinel_check and self.copy_engine is not None:
            for i, r in enumerate(active):
                self._sentinel(r, gs.read_slots[i, : ns[i]])  # what the graph will read
        c0 = gs.captures
        gs.run()
        self.graph_captures += gs.captures - c0
        self.graph_replays += 1
        toks, st = gs.fetch(stats=observe)
        stats = None
        if observe:
            stats = [torch.from_numpy(np.append(st[i, : ns[i]], st[i, gs.T])) for i in range(B)]
        return toks, stats

    def _measure(self) -> None:
        self._retained.append(self.alloc.num_used)
        self._ideal_last = self.ideal_blocks()
        if self.table is not None:
            self._waste.append(self.table.waste_ratio())
        else:
            toks = sum(r.n for r in self._reqs.values() if not r.done)
            nb = self.alloc.num_used
            self._waste.append(1.0 - toks / (nb * self.S) if nb else 0.0)

    def ideal_blocks(self) -> int:
        if self.table is None:
            return sum(-(-r.n // self.S) for r in self._reqs.values() if not r.done)
        return sum(-(-self.table.num_live(rid) // self.S) for rid in self.active)

    # ------------------------------------------------------------------ a whole batch
    def drain(self) -> None:
        """End the batch's copy lifecycle (``run`` calls it once every request finished).

        ``manager.drain()`` host-waits every plan still in flight (a copy launched in the
        last steps, whose request finished meanwhile, is polled by nobody else) and ends
        it: applied, aborted or, for a finished request, its deferred sources and fills
        freed; the headroom goes back to the pool. Then the copy engine is synchronized and
        the checker's pending comparisons are settled (a host wait: teardown, never a
        step). Afterwards, with every request finished, every block but the null block is
        free. Cost: one host wait per plan in flight.
        """
        if self.manager is not None:
            self.manager.drain()
        if self.copy_engine is not None:
            self.copy_engine.synchronize()
        if self.checker is not None:
            self.checker.settle(block=True)  # comparisons still waiting for device digests

    def run(self, prompts: Sequence[Sequence[int]], new_tokens: int | Sequence[int]) -> DecodeResult:
        """Decode every prompt greedily to ``new_tokens`` generated tokens; see :class:`DecodeResult`.

        Request ids are the prompts' indices. ``new_tokens`` counts generated tokens
        (the first comes from the prefill), per request or for all. Returns once every
        request finished and :meth:`drain` ended every plan: then every block but the null
        block is free and ``plans_launched == relocations + plans_aborted + plans_orphaned``.
        """
        news = [int(new_tokens)] * len(prompts) if isinstance(new_tokens, int) else [int(x) for x in new_tokens]
        if not self._ready:
            head = self.cfg.headroom if self.mode == "vtoken" else 0
            self.setup(full_retention_blocks([len(p) for p in prompts], news, self.S, head) + 2)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            self.admit(i, p, news[i])
        t_pre = time.perf_counter()
        while self.active:
            self.step()
        self.drain()
        wall = time.perf_counter() - t0
        dec = time.perf_counter() - t_pre
        outs = [self._reqs[i].out for i in range(len(prompts))]
        total = sum(len(o) for o in outs)
        dec_tokens = sum(max(0, len(o) - 1) for o in outs)
        st_ms = [s * 1e3 for s in self.step_times]
        res = DecodeResult(
            mode=self.mode, policy=self.policy_name if self.mode != "native" else "none",
            evict_ratio=self.evict_ratio if self.mode != "native" else 0.0, block_size=self.S,
            num_blocks=self.num_blocks, device=str(self.device), outputs=outs,
            tokens_per_s=total / wall if wall > 0 else 0.0,
            decode_tokens_per_s=dec_tokens / dec if dec > 0 else 0.0, wall_s=wall, steps=len(st_ms),
            step_ms_median=statistics.median(st_ms) if st_ms else 0.0,
            step_ms_mean=statistics.fmean(st_ms) if st_ms else 0.0, step_ms=st_ms,
            step_cpu_ms_median=statistics.median(self.step_cpu) * 1e3 if self.step_cpu else 0.0,
            retained_blocks_end=self._retained[-1] if self._retained else 0,
            retained_blocks_peak=max(self._retained) if self._retained else 0,
            retained_blocks_mean=statistics.fmean(self._retained) if self._retained else 0.0,
            ideal_blocks_end=self._ideal_last,
            waste_ratio_end=self._waste[-1] if self._waste else 0.0,
            waste_ratio_mean=statistics.fmean(self._waste) if self._waste else 0.0,
            empty_blocks_released=self.empty_released,
            prefill_fallback=self.prefill_fallback or None,
            cuda_graph=self.cuda_graph,
            graph_captures=self.graph_captures, graph_replays=self.graph_replays,
        )
        if self.manager is not None:
            st = self.manager.stats
            res.relocations, res.plans_launched, res.plans_aborted = st["applied"], st["plans"], st["aborted"]
            res.plans_orphaned = st["orphaned"]
            res.moves, res.blocks_freed_by_compaction = st["moves"], st["blocks_freed"]
            res.planner = {k: v for k, v in asdict(self.cfg).items()}
            res.copy_stats = dict(self.copy_engine.stats)
        if self.checker is not None:
            res.hash_checks, res.hash_failures = self.checker.passed, self.checker.failed
            res.relocation_events_checked = self.checker.events
            res.failures = list(self.checker.failures)
        return res
