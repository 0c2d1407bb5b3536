"""Adapter machine: the real vLLM 0.33.0 scheduler with ``VTokenAdapter`` and its worker, fuzzed.

The machine plays the engine core and the API server around the REAL ``Scheduler`` (or
``AsyncScheduler``): requests arrive (fresh, or sharing a prefix with an earlier one, so
that prefix-cache hits land near blocks a copy is moving), steps run (``AdapterDriver``:
two outputs in flight with async scheduling), a policy evicts tokens (the worker's random
policy, plus random ids the machine picks), requests are aborted, blocks are grabbed from
the pool to force preemption and resume (also of the request whose copy flies, so that
the copy outlives both), requests stop at their next token while their plan flies (an EOS:
vLLM finishes them while processing a step's output, the next step, scheduled with async
scheduling, still computing them; aimed at a plan that lands on that very step), copies run
0-10 steps late. Nothing of vLLM is mocked. Each example draws vLLM's KV layout
(one full-attention group, or a hybrid one: full attention and a sliding window of two
blocks, the model's second layer reading the window through its own group) and the fence's
clock (the adapter's own, as vLLM runs by default, or vLLM's deferred frees, as a KV-consumer
connector sets them); its hard states are counted per configuration too.

The worker's copy engine is drawn per example (``fuzz.faulty_engines.ADAPTER_ENGINES``): the
shipped one; one failing every k-th copy part-way (the aborted path: every check below must
stay green); or one planting a fault at the poll that completes a copy, a byte flipped in a
fill's live token or a moved entry (the worker's hash-and-compare must raise in that call)
or a fill made another request's (the adapter must raise ``PlanError[shared_fill]``, the one
error for a block found shared at a copy's end: ``vtoken.planner.shared_at_end``). A planted
fault caught ends the example; one not caught in its call fails it.

A second adapter runs in lockstep with reclamation off (Naive-Evict: the same requests at
the same steps, the same evictions at the same request lengths) as the output oracle.

Checked after every step, against the pool itself (not the adapter's bookkeeping):

- the ownership ledger (``invariants.ownership``): every block of vLLM's pool is free, or
  referenced exactly once per holder among the request lists of every KV cache group, the
  headroom, the held destinations, the in-flight plans (sources and destinations), vLLM's
  and the adapter's deferred frees and the machine's own grabs; nothing else;
- fences: every block that returns to the free queue while it is a plan's source does so
  only after the step carrying the plan was processed AND the worker reported the copy
  done, and a block that left a request only after the last step that scheduled it was
  processed (on vLLM's clock every such block; on the adapter's, those its port frees:
  vLLM frees its lists at once then); the machine watches every free of the pool; no
  headroom block, destination or in-flight source carries a prefix-cache hash;
- the fence from the worker's side: every block a step's forward reads or writes for a
  request (its live slots, its chunk, a hybrid layout's window) is one the scheduler side
  still holds for it (its lists in every group, its held blocks, its plans in flight), one
  waiting in a deferred free, or one vLLM itself let go of: never one the adapter already
  returned to the pool (a step scheduled before that free reads it after);
- poison on return: every block back in vLLM's pool has its K/V poisoned (NaN), at once or,
  for vLLM's own frees of a request that left, before the first step scheduled after the free
  (the steps scheduled before may still read it: their output is discarded); a cached free
  block when the pool hands it out again. A step reading a poisoned slot fails at the read
  (``_Run._check_poison_reads``); a copy reading one fails hash-and-compare; a computation
  with one fails output equality (``_Run._poison_freed``);
- the runtime checks, probed at every hook: what the adapter changed since the last hook
  (a block newly held for a request, a block new in the headroom, a list it
  null-substituted) is corrupted once, and the hook's incremental check alone must report
  it there (undone before the real hook runs);
- the worker's block lists against vLLM's, group by group (the window a hybrid model
  reads is the sliding-window group's);
- every plan's recorded list indices (``Plan.list_index``) against where the machine
  last saw its sources and fills; a probe puts a fill of a plan in flight back in its list
  and the adapter's incremental check alone must see it;
- every proposal against ``spec.planner`` (rules and optimality, through the adapter's
  ``plan_hook``), every applied plan's snapshot through I1-I4 in plain Python and in Z3,
  hash-and-compare of every relocation (the worker's ``RelocationChecker``), and the
  adapter's own runtime checks;
- at the end: everything drained, every block back in the pool (both adapters), and every
  request whose computation history is the same in both runs (same chunks, same
  evictions, no preemption) produced the same tokens. Histories differ legitimately when
  reclamation changes preemption (a preempted request is recomputed with full context);
  those requests are counted, not compared.

Hard states counted (``vtoken fuzz --machines adapter``): a prefix request aimed at a block
an in-flight copy is moving out of, preemption with a plan in flight, finish mid-copy,
resume with a replaced block list, a plan and growth in one step, a copy pending across
preempt and resume, a copy failed in the adapter (aborted, table kept).

Owns: two adapters with their workers and vLLM schedulers (one machine instance each
example), the machine's grabbed blocks, its record of plans (where their blocks were taken
from), reports and fence breaches, who held each block in every group's lists and what vLLM
freed of them, and what the runtime checks' hooks had seen (for the probes).
May call: the system (``vtoken.vllm_adapter``, ``vtoken.table``), the checkers
(``invariants``: ownership, relocation hash, plan contract, snapshots, Z3) and vLLM.
Costs: per step the full ownership ledger and the readable blocks, O(pool), plus per hook up
to three incremental checks (the probes) plus Z3 on each applied plan's snapshot: a campaign tool (about 200-250 operations per second here), not a CI gate.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import numpy as np
from hypothesis import event, note
from hypothesis.stateful import initialize, invariant, precondition, rule

from vtoken.vllm_adapter import harness  # noqa: F401 - the CPU environment before vLLM loads

from . import hard_states
from .step_draws import SwarmRules, pick, integer
from .hard_states import hard, note_snapshot
from vtoken.invariants.relocation_hash import RelocationChecker

_MODEL: dict = {}  # layer count -> the decoder


def _model(layers: int = 1):
    """One tiny seeded decoder per layer count for every example (bitwise stable with one torch
    thread): one layer, or two for a hybrid layout (its second layer reads the sliding window)."""
    if layers not in _MODEL:
        import torch

        from vtoken.model import DecoderConfig, PagedDecoder

        torch.set_num_threads(1)
        torch.manual_seed(0)
        _MODEL[layers] = PagedDecoder(DecoderConfig(num_layers=layers, hidden_size=32, num_heads=2, num_kv_heads=1,
                                                    head_dim=16, intermediate_size=64, vocab_size=64))
    return _MODEL[layers]


class _Run:
    """One adapter + worker + driver, and what the machine observes of it."""

    def __init__(self, *, reclaim: bool, S, N, H, B, async_, caching, lag, ratio, budget, checks: bool,
                 in_place: bool = True, engine: str | None = None, fail_every: int = 3, layout: str = "full",
                 vllm_clock: bool = False, poison: bool = True, keep: bool = False):
        from vtoken.invariants.plan_contract import check_proposal
        from vtoken.vllm_adapter.adapter import AdapterDriver, VTokenAdapter, default_adapter_planner_config
        from vtoken.vllm_adapter.harness import VllmHarness
        from vtoken.vllm_adapter.messages import LoggedTable
        from vtoken.vllm_adapter.worker import VTokenWorker

        from .faulty_engines import ADAPTER_ENGINES

        own = dict(reclaim=reclaim, checks=checks,
                   planner_config=default_adapter_planner_config(headroom=H, max_sources=B, record_snapshots=reclaim,
                                                                 in_place=in_place),
                   # pools of 16-48 blocks: the shipped cap (1/16) would leave no headroom at
                   # all; 1/4 keeps reclamation under test on them
                   headroom_pool_fraction=4, keep_prefix_bytes=keep)
        vllm_side = dict(block_size=S, num_blocks=N, prefix_caching=caching, async_scheduling=async_, max_model_len=512,
                         max_num_batched_tokens=budget, max_num_seqs=8, kv_layout=layout)
        if vllm_clock:  # vLLM runs its own deferred frees (a KV-consumer connector's setting): its clock
            h = VllmHarness(**vllm_side)
            h.scheduler.defer_block_free = True
            self.ad = VTokenAdapter.attach(h.scheduler, **own)
        else:  # vLLM's default: the adapter keeps its own clock and fences only its own frees
            self.ad = VTokenAdapter(**vllm_side, **own)
        factory = None
        self.engine = engine  # an adapter-side engine of fuzz.faulty_engines, or None (the shipped one)
        wt = LoggedTable(S, N)  # the worker's own table (the adapter keeps a replica of it)
        if engine is not None:
            cls = ADAPTER_ENGINES[engine]
            kw = {"fail_every": fail_every} if engine == "copy_fails" else {"table": wt}

            def factory(kv, block_size, **lag_kw):
                return cls(kv, block_size, **lag_kw, **kw)

        self.w = VTokenWorker(_model(2 if layout == "hybrid" else 1), wt, N, S, policy="random", evict_ratio=ratio, seed=0,
                              check_relocations=RelocationChecker if reclaim else None, copy_lag=lag,
                              copy_engine_factory=factory, layout=self.ad.worker_layout())
        self.d = AdapterDriver(self.ad, self.w)
        if reclaim:
            self.ad.plan_hook = check_proposal
        self.S, self.N = S, N
        self.poison = bool(poison)  # freed blocks' K/V poisoned (see _poison_freed)
        self._init_ledger()
        self._instrument()
        self._instrument_reads()
        if checks and reclaim:
            self._instrument_hooks()

    def _init_ledger(self) -> None:
        """The machine's own record of the run (what it saw, what it holds, what it checked)."""
        self.history: dict[str, list] = {}  # req -> computations and evictions, in order
        self.preempted: set = set()
        self.grabbed: list = []  # blocks the machine holds (pool pressure)
        self.reports: dict[int, bool] = {}  # plan id -> copy reported done by the worker
        self.status: dict[int, str] = {}  # plan id -> the worker's verdict (applied / aborted)
        self.halted: str | None = None  # the fault the engine plants was caught (what, and the error)
        self.tampered_seen = 0  # the engine's tamperings already accounted for
        self.plans: dict[int, tuple] = {}  # plan id -> (seq, source ids), every plan ever launched
        self.source_of: dict[int, int] = {}  # block -> plan id, while the block is a pending source
        self.holder_of: dict[int, str] = {}  # block -> the request holding it now (list or destination)
        self.list_pos: dict[tuple, int] = {}  # (request, block) -> its index in the request's list, as last seen
        self.taken_at: dict[int, dict] = {}  # plan id -> {source or fill: the list index it was taken from, or -1}
        self.leaving: dict[int, tuple] = {}  # block -> (request, fence): left a request, not yet back in the pool
        self.last_sched: dict[str, int] = {}  # request -> the last step that scheduled it
        self.fence_errors: list = []
        self.steps = 0
        self.in_port = 0  # > 0 while the adapter's port frees (its own blocks: fenced on either clock)
        self.group_holder: dict[int, set] = {}  # block -> requests whose list of any KV cache group held it (last seen)
        self.group_holding: dict[int, set] = {}  # block -> (group, request) pairs holding it (last seen)
        self.vllm_released: dict[str, set] = {}  # request -> blocks vLLM itself freed from its lists (this incarnation)
        self.may_read: dict[str, set] = {}  # request -> the blocks a step may read for it now (see _check_reads)
        self.executing = 0  # the step the worker executes now
        self.held_seen: set = set()  # (request, block) held at the last runtime-check hook
        self.headroom_seen: set = set()  # headroom blocks at the last runtime-check hook
        self.subst_seen: set = set()  # (request, list index) null-substituted at the last runtime-check hook
        self.probes = 0  # hooks whose incremental check was probed
        self.reads_checked = 0  # chunks whose reads were checked (a dead spy shows as 0)
        self.poison_due: dict[int, int] = {}  # block -> the step before whose execution it is poisoned
        self.poisoned: dict[int, str] = {}  # block -> when and why it was last poisoned (for errors)
        self.poisoned_blocks = 0  # blocks poisoned so far (a dead hook shows as 0)
        self.vllm_freeing = None  # the request whose lists vLLM frees now (finish, preemption)
        self.scheduling = None  # the step ``schedule()`` is scheduling, while it runs

    def _instrument(self):
        ad, w = self.ad, self.w
        run_request, execute, synchronize = w._run_request, w.execute, w.synchronize
        schedule, update, pool = ad.scheduler.schedule, ad.scheduler.update_from_output, ad.pool
        free_blocks = pool.free_blocks

        def run_request_spy(r, start, k, rep):
            self.history.setdefault(r, []).append(("run", int(start), int(k), w.table.length(r) if r in w.table else 0))
            ch = w._chunks.get(r)
            if ch is not None:  # as the request computes: a prefix hit on a block an earlier request of
                self._check_poison_reads(r, ch.read.cpu().numpy())  # the step writes reads it written
            return run_request(r, start, k, rep)

        def note_report(rep):
            for pid, res in rep.plans.items():
                self.reports[pid] = bool(res.copy_done)
                self.status[pid] = res.status
                if res.status == "aborted" and res.table_kept and not res.shared_sources:
                    hard("copy failed in the adapter")
            return rep

        def execute_spy(so):
            meta = getattr(so, "vtoken", None)
            self.executing = meta.seq if meta is not None else 0
            if so.total_num_scheduled_tokens > 0:
                self._poison_due(self.executing)
            self.may_read = self._readable()
            out = execute(so)
            note_report(out.vtoken_report)
            return out

        def synchronize_spy():
            self._poison_due(ad.clock.seq)  # at idle: those due by a step already executed
            return note_report(synchronize())

        def schedule_spy(*a, **kw):
            # the step being scheduled is the one after the last scheduled (vLLM's own clock
            # may count it already while it allocates, the adapter's only at its hook)
            self.scheduling = ad.clock.seq + 1
            try:
                so = schedule(*a, **kw)
            finally:
                self.scheduling = None
            self._observe_output(so)
            self._observe_holders()
            self._check_prompt_release(so)
            return so

        def update_spy(so, out):
            result = update(so, out)
            self._observe_holders()
            return result

        def free_spy(blocks):
            blocks = list(blocks)
            processed = ad.clock.processed
            free_blocks(blocks)
            if not self.in_port:  # vLLM's own frees of its lists (the adapter's go through its port)
                for b in blocks:
                    for r in self.group_holder.get(b.block_id, ()):
                        self.vllm_released.setdefault(r, set()).add(b.block_id)
            self._freed(blocks, processed)
            self._poison_freed(blocks)

        self._instrument_finish()
        w._run_request, w.execute, w.synchronize = run_request_spy, execute_spy, synchronize_spy
        ad.scheduler.schedule = schedule_spy
        ad.scheduler.update_from_output = update_spy
        pool.free_blocks = free_spy
        self._instrument_poison()

    def _instrument_finish(self) -> None:
        """Refuse a request's finish or preemption while a plan of its own (not orphaned) flies."""
        ad = self.ad
        on_free = ad._on_request_free

        def on_free_spy(request):
            r = request.request_id
            if any(p.req_id == r and not p.orphaned for p in ad.plans.values()):
                hard("finish mid-copy" if request.is_finished() else "preemption with a plan in flight")
            return on_free(request)

        ad._on_request_free = on_free_spy

    def _instrument_poison(self):
        """What the fences and the poison need to know besides the frees (:meth:`_freed`,
        :meth:`_poison_freed`): the adapter's port freeing, blocks the pool hands out fresh, and
        when vLLM frees the lists of a request that left."""
        ad = self.ad
        pool = ad.pool

        def in_port(fn):  # the adapter's own frees (fenced on either clock)
            def call(*a, **kw):
                self.in_port += 1
                try:
                    return fn(*a, **kw)
                finally:
                    self.in_port -= 1
            return call

        ad.port.free, ad.port.drain = in_port(ad.port.free), in_port(ad.port.drain)
        get_new_blocks = pool.get_new_blocks

        def get_new_spy(n):
            out = get_new_blocks(n)
            if self.poison:  # handed out fresh: the old bytes (a cached block's too) are nobody's now
                for b in out:
                    self._poison_later(b.block_id, self._next_step(), "handed out again by the pool")
            return out

        pool.get_new_blocks = get_new_spy
        free_request_blocks = ad.scheduler._free_request_blocks  # the hooks' (the adapter's, then vLLM's)

        def free_request_spy(request):
            self.vllm_freeing = request.request_id  # vLLM frees the lists of a request that left
            try:
                return free_request_blocks(request)
            finally:
                self.vllm_freeing = None

        ad.scheduler._free_request_blocks = free_request_spy

    def _freed(self, blocks, processed: int) -> None:
        """Blocks just returned to the pool (at processed step ``processed``): a block that left
        a request waits for the last step that scheduled it (all of them on vLLM's clock, its
        deferred frees; on the adapter's, vLLM frees its lists at once, as without vtoken, and
        only the adapter's own frees, through its port, are fenced); a plan's source waits for
        its step and its copy's report."""
        fenced = not self.ad.clock.own or self.in_port
        for b in blocks:
            if b.ref_cnt != 0:
                continue
            left = self.leaving.pop(b.block_id, None)
            if left is None and b.block_id in self.holder_of:  # it left its request within this very call
                r = self.holder_of.pop(b.block_id)
                left = (r, self.last_sched.get(r, 0))
            if fenced and left is not None and left[1] > processed:
                self.fence_errors.append(
                    f"block {b.block_id} of request {left[0]!r} returned to the pool at processed step {processed}, "
                    f"but step {left[1]}, the last that scheduled the request while it held the block (and may "
                    f"read it), is not processed yet")
            pid = self.source_of.get(b.block_id)
            if pid is None:
                continue
            seq, _ = self.plans[pid]
            del self.source_of[b.block_id]
            if processed < seq or not self.reports.get(pid):
                self.fence_errors.append(
                    f"block {b.block_id}, source of plan {pid} (step {seq}), returned to the pool at processed "
                    f"step {processed} with its copy {'reported done' if self.reports.get(pid) else 'not reported done'}")

    # ---------------------------------------------------------------- freed blocks poisoned
    def _left_in_worker(self, bid: int) -> list:
        """The requests the worker's table still maps to ``bid`` when every one of them has left
        vLLM (finished or aborted) and every step that scheduled it is processed (its fence
        passed: no step reads the block for it any more); else []. The worker learns they left
        at the next step: until then its table, and the relocation checker's guard, name their
        slots, and poison there would read as another plan's copy overwriting them."""
        t = self.w.table
        if not t.block_refs(bid):
            return []
        mapped = [r for r in t.requests() if t.references(r, bid)]
        reqs, processed = self.ad.scheduler.requests, self.ad.clock.processed
        gone = all((reqs.get(r) is None or reqs[r].is_finished()) and self.last_sched.get(r, 0) <= processed
                   for r in mapped)
        return mapped if gone else []

    def _poison_freed(self, blocks) -> None:
        """Races made visible: a block back in the pool (ref_cnt 0) has its K/V poisoned (NaN in
        every slot, layer, K and V), so a read of a freed or reused block fails hash-and-compare
        (a copy reading a freed source writes NaN to its destination) or output equality, and is
        named at once by :meth:`_check_poison_reads`. When it is poisoned is the worker model's
        knowledge of which steps may still read it:

        - at once, when the free is fenced (vLLM's clock: every free waits for its step; the
          adapter's clock: the adapter's port frees its own blocks at their fence), and when it
          is neither vLLM freeing a request that left nor a block of vLLM's own sliding-window
          group (a block freed behind the fence, the machine's grabs, headroom given back):
          no step may read it any more, unless an earlier due is pending (a block a request
          that left gave back, handed out and returned before its due step: the steps before
          that one may still read it);
        - before the first step scheduled after the free executes, for vLLM's own frees of the
          lists of requests that left (finished or preempted; on the adapter's clock vLLM frees
          them at once and the step in flight still computes them, their output discarded, as
          without vtoken; on either clock the worker learns they left only at that step, its
          table and the relocation checker's guard naming their slots until then) and, on the
          adapter's clock, of its sliding-window group, and for a free at its fence of a block
          the worker's table still maps only for requests that left (the adapter's release of
          a finished request's held destinations: the worker's table and the relocation
          checker's guard name those slots until it learns, :meth:`_left_in_worker`): the
          steps scheduled before may read it;
        - never while it carries a prefix-cache hash (a cached free block: a later request's
          prefix hit reads exactly those bytes); such a block is poisoned when the pool hands it
          out again (``get_new_blocks``), before the step that allocated it executes.
        """
        if not self.poison:
            return
        ad = self.ad
        fenced = not ad.clock.own or self.in_port
        for b in blocks:
            if b.ref_cnt != 0 or b.is_null or b.block_hash is not None:
                continue
            bid = b.block_id
            holders = self.group_holding.get(bid, ())
            # vLLM freeing a request that left: the worker learns it at the next step (its table,
            # and the relocation checker's guard, name those slots until then), on either clock
            vllms = self.vllm_freeing or (not fenced and any(g != ad.group for g, _ in holders))
            left = [] if vllms else self._left_in_worker(bid)
            if vllms or left:
                nxt = self._next_step()
                who = f"by vLLM from {sorted(r for _, r in holders)}'s lists" if vllms else \
                    f"while the worker still maps {sorted(left)}, which left"
                self._poison_later(bid, nxt, f"freed {who} (steps before {nxt} may read it)")
            elif bid in self.poison_due:
                # still readable by the steps scheduled before its earlier due step (a block a request
                # that left gave back, grabbed and released again): poisoned when that step executes
                continue
            else:
                self._poison_now(bid, f"returned to the pool at processed step {ad.clock.processed} "
                                      f"(step {ad.clock.seq} scheduled)")

    def _next_step(self) -> int:
        """The first step scheduled after now: the one being scheduled, or the next one."""
        return self.scheduling if self.scheduling is not None else self.ad.clock.seq + 1

    def _poison_later(self, bid: int, step: int, why: str) -> None:
        """Poison ``bid`` before step ``step`` executes (the earliest due time wins)."""
        if bid not in self.poison_due or self.poison_due[bid] > step:
            self.poison_due[bid] = step
            self.poisoned[bid] = why

    def _poison_now(self, bid: int, why: str) -> None:
        import torch

        S = self.S
        self.w.kv.fill_slots(torch.arange(bid * S, (bid + 1) * S, dtype=torch.int64), float("nan"))
        self.poisoned[bid] = why
        self.poisoned_blocks += 1

    def _poison_due(self, step) -> None:
        """Poison the blocks due before step ``step`` executes (None: all of them)."""
        due = [b for b, s in self.poison_due.items() if step is None or s <= step]
        for b in due:
            del self.poison_due[b]
            self._poison_now(b, self.poisoned.get(b, "freed"))

    def _check_poison_reads(self, r, slots) -> None:
        """No slot a step reads for ``r`` (its live tokens) holds poison: a poisoned slot was
        returned to the pool (or handed out again) and never written since."""
        import torch

        if not self.poison or not len(slots):
            return
        s = torch.as_tensor(np.asarray(slots, dtype=np.int64).reshape(-1))
        # the layers that read through the token table (a hybrid model's windowed layers read
        # their own group: their rows of the table's blocks are never written)
        layers = [i for i in range(self.w.kv.num_layers) if i not in self.w.window_layers]
        x = self.w.kv.flat[layers].index_select(2, s)  # [layers, 2, n, H, D]
        bad = torch.isnan(x).flatten(start_dim=3).any(dim=-1).any(dim=0).any(dim=0)
        if bool(bad.any()):
            slot = int(s[int(torch.argmax(bad.to(torch.int8)))])
            b = slot // self.S
            raise AssertionError(
                f"step {self.executing} reads poisoned slot {slot} (block {b}) for request {r!r}: block {b} was "
                f"{self.poisoned.get(b, 'poisoned')} and not written since (a read of a freed or reused block)")

    def _observe_holders(self):
        """Who holds each block now (request lists and destinations). A block that left a
        request must not return to the pool before the last step that scheduled the request
        while it held the block is processed (vLLM's own rule for a request's blocks)."""
        ad = self.ad
        now: dict[int, str] = {}
        pos = self.list_pos = {}
        for r, lst in ad.req_to_blocks.items():
            for i, b in enumerate(lst):
                if not b.is_null:
                    now[b.block_id] = r
                    pos[(r, b.block_id)] = i
        for r, v in ad.held.items():
            for b in v:  # v: {block id: None}
                now[b] = r
        for b, r in self.holder_of.items():
            if b not in now and ad.pool.blocks[b].ref_cnt > 0:
                self.leaving[b] = (r, self.last_sched.get(r, 0))
        for b in now:
            self.leaving.pop(b, None)
        self.holder_of = now
        gh: dict[int, set] = {}
        gg: dict[int, set] = {}
        for g, r, lst in ad.harness.all_lists():
            for b in lst:
                if not b.is_null:
                    gh.setdefault(b.block_id, set()).add(r)
                    gg.setdefault(b.block_id, set()).add((g, r))
        self.group_holder = gh
        self.group_holding = gg  # block -> (group, request) pairs holding it (last seen)

    def _observe_output(self, so):
        ad = self.ad
        self.steps += 1
        if so.total_num_scheduled_tokens > 0:
            for r in so.num_scheduled_tokens:
                self.last_sched[r] = ad.clock.seq
        for r in so.preempted_req_ids or ():
            self.preempted.add(r)
        c = so.scheduled_cached_reqs
        for r in [d.req_id for d in so.scheduled_new_reqs] + list(c.resumed_req_ids or ()):
            self.vllm_released.pop(r, None)  # a new incarnation: the worker reads nothing of the last one
        if c.resumed_req_ids:
            hard("resume with a replaced block list")
            if any(p.req_id in c.resumed_req_ids and p.orphaned for p in ad.plans.values()):
                hard("copy pending across preempt and resume")
        meta = getattr(so, "vtoken", None)
        if meta is not None:
            g = ad.group
            grown = {r for r, nb in zip(c.req_ids, c.new_block_ids) if nb and nb[g]}
            for order in meta.plans:
                p = ad.plans[order["id"]]  # the lifecycle's record of the plain order the step carries
                # where each source and fill was (the lists as last observed: a plan takes
                # no block that entered a list in this step): its index, or -1 (held)
                taken = {b: self.list_pos.get((p.req_id, b), -1) for b in p.sources + p.fills}
                assert dict(p.list_index) == taken, (
                    f"plan {p.id} of {p.req_id!r} records its blocks at list indices {dict(p.list_index)}; they "
                    f"were at {taken} (-1: held)")
                self.taken_at[p.id] = taken
                self.plans[p.id] = (p.seq, list(p.sources))
                for b in p.sources:
                    self.source_of[b] = p.id
                if p.req_id in grown:
                    hard("plan and growth in one step")

    # ---------------------------------------------------------------- what a step reads
    def _instrument_reads(self):
        """Every block the worker's forward reads or writes for a request (its live slots, the
        chunk's, a hybrid layout's window) is checked as it is read (:meth:`_check_reads`)."""
        w = self.w
        # ``chunks`` is the one the step calls (``chunk`` goes through it): a spy on ``chunk``
        # alone saw nothing once the worker batched its chunks (a check that went dead unseen)
        chunks, window_slots = w.core.chunks, w._window_slots

        def chunks_spy(items, known=None):
            out = chunks(items, known)
            self.reads_checked += len(out)
            for r, ch in out.items():
                self._check_reads(r, np.concatenate([ch.read.cpu().numpy(), np.asarray(ch.write)]), "its chunk")
            return out

        def window_spy(r, wr, lo, hi):
            slots = window_slots(r, wr, lo, hi)
            self._check_reads(r, slots.cpu().numpy(), "its sliding window")
            return slots

        w.core.chunks, w._window_slots = chunks_spy, window_spy

    def _readable(self) -> dict:
        """Request -> the blocks a step executed now may read for it: those the scheduler side
        holds for it (its lists in every KV cache group, its held destinations and fills, every
        block of its plans in flight, orphaned ones included), every block waiting in a deferred
        free (vLLM's or the adapter's port's, their fence not processed yet), and what vLLM itself
        freed from its lists (vLLM's own decision, as without vtoken). O(pool) per step."""
        ad = self.ad
        out: dict[str, set] = {}
        for _, r, lst in ad.harness.all_lists():
            out.setdefault(r, set()).update(b.block_id for b in lst if not b.is_null)
        for r, v in ad.held.items():
            out.setdefault(r, set()).update(v)
        for p in ad.plans.values():
            out.setdefault(p.req_id, set()).update(p.blocks)
        for r, v in self.vllm_released.items():
            out.setdefault(r, set()).update(v)
        deferred = {b for _, ids in ad.port.deferred for b in ids}
        deferred |= {b.block_id for _, blocks in ad.scheduler.deferred_frees for b in blocks if not b.is_null}
        out[None] = deferred
        return out

    def _check_reads(self, r, slots, what: str) -> None:
        """The fence from the worker's side: a block a step reads for ``r`` is still held for
        ``r`` (:meth:`_readable`), never one the adapter already returned to the pool (an early
        free that only a later step, scheduled before the free and executed after it, reads:
        around a request that left while its plan flew)."""
        blocks = set((np.asarray(slots, dtype=np.int64).reshape(-1) // self.S).tolist())
        bad = sorted(blocks - self.may_read.get(r, set()) - self.may_read.get(None, set()))
        assert not bad, (
            f"step {self.executing} reads blocks {bad} for request {r!r} ({what}), which the scheduler side no "
            f"longer holds for it (not in its lists, held for it, in a plan of it in flight, nor in a deferred "
            f"free): the adapter returned them to the pool (processed step {self.ad.clock.processed}) before a "
            f"step that reads them was processed")

    # ---------------------------------------------------------------- the runtime checks, probed
    def _instrument_hooks(self):
        """Before each runtime-check hook the checks are probed (:meth:`_probes`): what the
        adapter changed since the last hook is corrupted, one thing of each kind, and the hook's
        incremental check (its touched sets as the adapter left them) must report it at this
        hook (the checks' contract: a violation is caught on the hook it happens when it touches
        what changed). Each corruption is undone and the check's inputs restored before the real
        hook runs."""
        chk = self.ad.checker
        after_hook = chk.after_hook

        def hook_spy(where, table=False):
            for what, key, corrupt in self._probes():
                self._probe(where, what, key, corrupt)
            out = after_hook(where, table=table)
            lc, m = self.ad.lifecycle, self.ad.mirror
            self.held_seen = {(r, b) for r, v in lc.held.items() for b in v}
            self.headroom_seen = set(lc.headroom)
            self.subst_seen = {(r, i) for r, sub in m.subst.items() for i in sub}
            return out

        chk.after_hook = hook_spy

    def _probes(self) -> list:
        """``(what, text the error must name, corrupt)`` per kind of change since the last hook:
        a block newly held for a request (a landed plan's fills and destinations) and a block new
        in the headroom get a stray reference; a request whose list the adapter null-substituted
        (a plan's launch, a release) gets one of its other entries nulled behind its back.
        ``corrupt()`` does it and returns the undo."""
        ad = self.ad
        lc, m, pool = ad.lifecycle, ad.mirror, ad.pool
        out = []

        def stray_ref(b):
            def corrupt():
                pool.blocks[b].ref_cnt += 1
                return lambda: setattr(pool.blocks[b], "ref_cnt", pool.blocks[b].ref_cnt - 1)
            return corrupt

        held = sorted((r, b) for r, v in lc.held.items() for b in v if (r, b) not in self.held_seen)
        if held:
            out.append((f"block {held[0][1]}, newly held for request {held[0][0]!r},", f"block {held[0][1]} ",
                        stray_ref(held[0][1])))
        head = sorted(b for b in lc.headroom if b not in self.headroom_seen)
        if head:
            out.append((f"block {head[0]}, new in the headroom,", f"block {head[0]} ", stray_ref(head[0])))
        subst = sorted({r for r, sub in m.subst.items() for i in sub if (r, i) not in self.subst_seen and r in m})
        for r in subst:
            lst, sub = ad.req_to_blocks.get(r), m.subst[r]
            j = next((i for i, b in enumerate(lst or ()) if i not in sub and not b.is_null), None)
            if j is not None:
                def corrupt(lst=lst, j=j):
                    blk, lst[j] = lst[j], pool.null_block
                    return lambda: lst.__setitem__(j, blk)
                out.append((f"request {r!r}'s list (null-substituted by the adapter), entry {j} nulled,",
                            f"request {r!r} index {j}:", corrupt))
                break
        return out

    def _probe(self, where: str, what: str, key: str, corrupt) -> None:
        """One probe of :meth:`_instrument_hooks`: ``corrupt()``, the incremental check, undo."""
        from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

        ad = self.ad
        lc, chk = ad.lifecycle, ad.checker
        saved = set(chk.touched_requests), set(chk.touched_lists), list(chk.new_entries), set(lc.fresh)
        closed = list(ad.fence.closed)  # the probe's fence check consumes them: put back after
        undo = corrupt()
        err = None
        try:
            chk.check_touched(f"probe before {where}")
        except AdapterAssumptionError as e:
            err = e
        finally:
            undo()
            chk.touched_requests, chk.touched_lists, chk.new_entries, lc.fresh = saved
            ad.fence.closed.clear()
            ad.fence.closed.extend(closed)
        if err is not None and key not in str(err):
            raise err  # a violation of its own, not the probe's
        assert err is not None, (
            f"{where}: {what} and the hook's incremental check did not see it: it would be reported only at a "
            f"later full scan")
        self.probes += 1
        event("runtime check probed at its hook")

    # ---------------------------------------------------------------- operations
    def add(self, rid, prompt, max_tokens):
        self.ad.add_request(rid, prompt, max_tokens=max_tokens)

    def stop_next(self, rid) -> bool:
        """``rid`` stops at its next sampled token (every token a stop token, as an EOS would):
        vLLM finishes it while processing that step's output, after the next step (async
        scheduling) was scheduled with it. The stop enters the request's history where it
        falls among its runs: a request the other run had scheduled further (vtoken's headroom
        and fences may admit it later) stops at another token and is not comparable."""
        self.history.setdefault(rid, []).append(("stop",))
        req = self.ad.scheduler.requests.get(rid)
        if req is None or req.is_finished():
            return False
        req.sampling_params.stop_token_ids = list(range(64))  # the machine model's whole vocabulary
        return True

    def step(self):
        self._guarded(self.d.step)

    def _guarded(self, fn):
        """Run ``fn`` (driver steps). With a tampering engine (``corrupt_in_flight``,
        ``steal_fill``) every tampering must be caught in the call it happens in: by the
        worker's hash-and-compare (``RelocationCheckError``) or as a block found shared at the
        copy's end (``PlanError`` ``shared_fill`` or ``shared_source``); then the run halts (its state is the fault's). An error with
        no tampering in the call, or a tampered plan reported without the error, fails."""
        from vtoken.errors import PlanError, RelocationCheckError
        from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

        tampering = self.engine in ("corrupt_in_flight", "steal_fill")
        eng = self.w.copy_engine
        n0 = len(eng.tampered) if tampering else 0
        try:
            fn()
        except (RelocationCheckError, AdapterAssumptionError, PlanError) as e:
            if not tampering or len(eng.tampered) == n0:
                raise
            if self.engine == "corrupt_in_flight" and not isinstance(e, RelocationCheckError) or \
                    self.engine == "steal_fill" and not (isinstance(e, PlanError) and
                                                         e.code in ("shared_fill", "shared_source")):
                raise
            self.halted = f"{eng.tampered[-1]}: caught: {str(e)[:160]}"
            return
        if tampering:
            for pid, what in eng.tampered[self.tampered_seen:]:
                st = self.status.get(pid)
                assert st != "applied" if self.engine == "corrupt_in_flight" else st is None, (
                    f"plan {pid}: {what} while its copy flew, and the worker reported it {st!r} without "
                    f"{'hash-and-compare failing' if self.engine == 'corrupt_in_flight' else 'shared_fill'}")
            self.tampered_seen = len(eng.tampered)

    def evict(self, rid, ids, at_len):
        """Evict ``ids`` of ``rid`` if its table is at ``at_len`` (the same point in both runs)."""
        t = self.w.table
        if rid not in t or t.length(rid) != at_len:
            return False
        live = set(t.live_tokens(rid).tolist())
        ids = [i for i in ids if i in live]
        if not ids:
            return False
        self.w.evict_tokens(rid, ids)
        self.history.setdefault(rid, []).append(("evict", int(at_len), tuple(ids)))
        return True

    def abort(self, rid):
        from vllm.v1.request import RequestStatus

        ad = self.ad
        if rid not in ad.scheduler.requests:
            return False
        ad.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        self.history.setdefault(rid, []).append(("abort",))
        return True

    def grab(self, k):
        pool = self.ad.pool
        k = min(k, pool.get_num_free_blocks())
        if k > 0:
            self.grabbed += pool.get_new_blocks(k)

    def release(self):
        if self.grabbed:
            self.ad.pool.free_blocks(self.grabbed)
            self.grabbed = []

    def drain(self, max_steps=4000):
        self.release()
        self._guarded(lambda: self.d.drain(max_steps=max_steps))

    # ---------------------------------------------------------------- checks
    def _check_prompt_release(self, so):
        """After a schedule hook that scheduled work (an empty step frees nothing): no request the adapter could release for (running, no plan
        in flight, its list seen by the worker) keeps an all-dead block other than its tail
        (the adapter's per-step work follows what changed; this is what it must not miss)."""
        ad = self.ad
        if not ad.checks or so.total_num_scheduled_tokens <= 0:
            return
        t = ad.table
        for req in ad.scheduler.running:
            r = req.request_id
            if r in ad.busy or r not in t or r not in ad.mirror or not ad.current(r):
                continue
            tail = t.tail_block(r)
            left = [b for b in t.releasable_blocks(r).tolist()
                    if b != tail and ad.block(b).ref_cnt == 1 and ad.accounted(r, b) is not None]
            assert not left, (f"request {r!r}: all-dead blocks {sorted(left)} not released at step "
                              f"{ad.clock.seq} (queued for release: {r in ad.release_todo}, "
                              f"status {req.status}, table refs {[int(t.block_refs(b)) for b in left]})")

    def check_ledger(self):
        """Every reference in vLLM's pool has exactly one owner (see the module docstring)."""
        from vtoken.invariants.ownership import check_ownership

        ad = self.ad
        pool = ad.pool
        owners: dict[str, list] = {}
        for g, r, lst in ad.harness.all_lists():  # every KV cache group's (the others' are vLLM's)
            owners[f"list of {r!r} (group {g})"] = [b.block_id for b in lst if not b.is_null]
        owners["headroom"] = [b.block_id for b in ad.headroom]
        for r, v in ad.held.items():
            owners[f"destinations of {r!r}"] = list(v)
        for p in ad.plans.values():
            owners[f"plan {p.id}"] = p.blocks
        for i, (seq, blocks) in enumerate(ad.scheduler.deferred_frees):
            owners[f"deferred free #{i} (fence {seq})"] = [b.block_id for b in blocks if not b.is_null]
        for i, (seq, ids) in enumerate(ad.port.deferred):
            owners[f"the adapter's deferred free #{i} (fence {seq})"] = list(ids)
        owners["machine (pool pressure)"] = [b.block_id for b in self.grabbed]
        refs = {b.block_id: b.ref_cnt for b in pool.blocks if not b.is_null and b.ref_cnt}
        free = [b.block_id for b in pool.blocks if not b.is_null and b.ref_cnt == 0]
        assert len(free) == pool.get_num_free_blocks(), \
            f"{len(free)} blocks have ref_cnt 0 but the pool counts {pool.get_num_free_blocks()} free"
        check_ownership(self.N, free, refs, owners)
        assert not self.fence_errors, "fence broken: " + "; ".join(self.fence_errors[:3])
        for b in ad.headroom:
            assert b.block_hash is None, f"headroom block {b.block_id} carries a prefix-cache hash"
        for v in ad.held.values():
            for b in map(ad.block, v):
                assert b.block_hash is None, f"destination block {b.block_id} carries a prefix-cache hash"
        for p in ad.plans.values():
            for b in p.blocks:
                assert ad.block(b).block_hash is None, f"block {b} of in-flight plan {p.id} carries a prefix-cache hash"

    def check_worker_lists(self):
        """The block lists the worker reads are vLLM's, group by group (the table's, and a
        hybrid layout's sliding-window group): every entry vLLM still holds (not null) at an
        index the worker knows is the same block. Requests whose current list the worker has
        not seen yet (``current``) are skipped."""
        ad, w = self.ad, self.w
        lay = w.layout
        groups = [(lay.table, "blocks")] + ([(lay.window_group, "wblocks")] if lay.window_group is not None else [])
        managers = ad.harness.managers
        for r, wr in w.reqs.items():
            if not ad.current(r):
                continue
            for g, attr in groups:
                theirs = managers[g].req_to_blocks.get(r)
                for i, (mine, blk) in enumerate(zip(getattr(wr, attr) or (), theirs or ())):
                    assert blk.is_null or mine == blk.block_id, (
                        f"request {r!r}: the worker reads block {mine} at index {i} of KV cache group {g}, vLLM's "
                        f"list holds {blk.block_id} there")

    def check_snapshots(self, done: int) -> int:
        from vtoken.invariants.snapshot_checks import check_snapshot as py_check
        from vtoken.invariants.z3_checks import check_snapshot as z3_check

        hist = self.ad.history
        for snap in hist[done:]:
            note_snapshot(snap)  # a failing campaign writes the last snapshot next to its report
            for name, check in (("Python", py_check), ("Z3", z3_check)):
                vs = check(snap)
                assert not vs, f"{name} I1-I4 on plan {snap['plan']['id']}: {[str(v) for v in vs][:3]}"
        return len(hist)


# the copy engine of the run with reclamation (``fuzz.faulty_engines.ADAPTER_ENGINES``), by
# weight: the shipped one; copies failing now and then; a planted fault (each ends its example
# at the first completed copy, so those examples are short and cost few operations)
ENGINE_DRAWS = (None, None, None, "copy_fails", "copy_fails", "corrupt_in_flight", "steal_fill", "corrupt_in_flight",
                "steal_fill")


class AdapterMachine(SwarmRules):
    """Stateful conformance test of the vLLM adapter (see the module docstring)."""

    ops = 0  # operations checked, summed over all runs in this process (campaign counter)

    @initialize(S=st.sampled_from([4, 4, 8]), N=st.integers(16, 48), H=st.integers(1, 4), B=st.integers(1, 8),
                async_=st.booleans(), caching=st.sampled_from([True, True, False]),
                lag=st.sampled_from([0, 1, 2, 3, 4, 0, 1, 2, 6, 7, 8, 9, 10]),
                ratio=st.sampled_from([0.3, 0.5, 0.6]), budget=st.sampled_from([2048, 2048, 64]),
                in_place=st.booleans(), engine=st.sampled_from(ENGINE_DRAWS), fail_every=st.integers(2, 4),
                layout=st.sampled_from(["full", "full", "hybrid"]), vllm_clock=st.booleans(), keep=st.booleans())
    def setup(self, S, N, H, B, async_, caching, lag, ratio, budget, in_place, engine, fail_every, layout, vllm_clock,
              keep):
        # both compactions: in place (the default: fills, no destination) and out of place
        # (the paper's: fresh headroom destinations), so faults of either path are reachable;
        # copies up to 10 steps late (in pools of 16-48 blocks, so a copy outlives its
        # request's preemption and resume); and the copy engine the worker gets: the shipped
        # one, one whose copies fail now and then (the aborted path), or one planting a
        # fault every check must catch (a byte flipped in flight, a fill stolen)
        in_place = in_place or engine == "steal_fill"  # a fill to steal
        # keep_prefix_bytes (in place, with caching): hashed blocks emptied, never filled, into
        # the other blocks' holes and then headroom destinations (plans with fills and dests)
        keep = keep and in_place and caching
        # and the KV layout (one full-attention group, or full attention + a sliding window of two
        # blocks) and the fence's clock (the adapter's, as vLLM runs by default, or vLLM's)
        kw = dict(S=S, N=N, H=H, B=B, async_=async_, caching=caching, lag=lag, ratio=ratio, budget=budget,
                  in_place=in_place, layout=layout, vllm_clock=vllm_clock, keep=keep)
        note(f"adapter machine: {kw}, engine {engine}" + (f" (every {fail_every})" if engine == "copy_fails" else ""))
        config = f"{layout} KV layout, {'vLLM' if vllm_clock else 'adapter'} clock"
        event(config)
        hard_states.tag(config)  # the campaign counts each hard state per configuration too
        self.S, self.N, self.H = S, N, H
        # a prefill (a request's first, or its recompute after preemption) writes every position
        # in both groups of a hybrid layout: twice the blocks until vLLM frees the window's
        self.groups = 2 if layout == "hybrid" else 1
        self.vt = _Run(reclaim=True, checks=True, engine=engine, fail_every=fail_every, **kw)
        self.ref = _Run(reclaim=False, checks=True, **kw)
        self.halted = None
        self.stopping: set = set()  # requests told to stop at their next token
        self.prompts: dict[str, list] = {}
        self.next_id = 0
        self.snapshots_done = 0
        self.rng_tokens = 64

    # ---------------------------------------------------------------- helpers
    def _both(self, fn):
        """``fn`` on the run with reclamation, then on the reference; nothing once the run
        halted (the fault its engine planted was caught: the example is over)."""
        if self.halted:
            return None, None
        AdapterMachine.ops += 1
        a = fn(self.vt)
        if self.vt.halted:
            self.halted = self.vt.halted
            note(f"halted: {self.halted}")
            event(f"engine fault caught ({self.vt.engine})")
            return a, None
        return a, fn(self.ref)

    def _live_requests(self):
        return sorted(r for r in self.prompts if r in self.vt.ad.scheduler.requests)

    # ---------------------------------------------------------------- rules
    @precondition(lambda self: len(self._live_requests()) < 6)
    @rule(n=st.integers(1, 40), max_tokens=st.integers(1, 24), data=st.data())
    def add_request(self, n, max_tokens, data):
        prompt = data.draw(st.lists(st.integers(1, self.rng_tokens - 1), min_size=n, max_size=n), label="prompt")
        self._add(prompt, max_tokens)

    def _moving(self) -> dict:
        """parent -> the lowest positional index of a leading full block one of its plans in
        flight is moving (the prefixes a new request can share with a moving block)."""
        ad = self.vt.ad
        lowest = {}
        for p in ad.plans.values():
            idx = [i for i in p.list_index.values() if 0 <= i < len(self.prompts.get(p.req_id, ())) // self.S]
            if p.req_id in self.prompts and not p.orphaned and idx:
                lowest[p.req_id] = min(idx + [lowest.get(p.req_id, 1 << 30)])
        return lowest

    @precondition(lambda self: any(len(p) >= self.S for p in self.prompts.values()) and len(self._live_requests()) < 6)
    @rule(data=st.data(), max_tokens=st.integers(1, 16))
    def add_prefix_request(self, data, max_tokens):
        """A prompt sharing whole leading blocks with an earlier one (a prefix-cache hit when
        they are still cached), preferring a parent whose plan is moving one of them."""
        lowest = self._moving()
        aim = bool(lowest) and pick(data, [True, True, False], "aim at a moving block")
        self._add_prefix(data, max_tokens, lowest if aim else None)

    @precondition(lambda self: len(self._live_requests()) < 6 and self._moving())
    @rule(data=st.data(), max_tokens=st.integers(1, 16))
    def add_prefix_on_a_moving_block(self, data, max_tokens):
        """The hard case on its own rule (enabled only while a copy moves a leading block, so
        the machine takes it as often as any other rule then): a prefix over a moving block."""
        self._add_prefix(data, max_tokens, self._moving())

    def _add_prefix(self, data, max_tokens, lowest):
        cands = sorted(r for r, p in self.prompts.items() if len(p) >= self.S)
        parent = pick(data, sorted(lowest) if lowest else cands, "parent")
        pp = self.prompts[parent]
        k = integer(data, lowest[parent] + 1 if lowest else 1, len(pp) // self.S, "shared blocks")
        for p in self.vt.ad.plans.values():
            if p.req_id == parent and not p.orphaned and any(0 <= i < k for i in p.list_index.values()):
                hard("prefix hit on an in-flight source")
        tail = data.draw(st.lists(st.integers(1, self.rng_tokens - 1), min_size=1, max_size=6), label="suffix")
        self._add(pp[: k * self.S] + tail, max_tokens)
        event("prefix request")

    def _add(self, prompt, max_tokens):
        # a request that can never fit the pool (with the headroom taken) would livelock
        # vLLM itself: keep every request feasible alone
        if -(-(len(prompt) + max_tokens) // self.S) * self.groups > self.N - 2 - self.H:
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.prompts[rid] = list(prompt)
        self._both(lambda run: run.add(rid, prompt, max_tokens))

    @rule(k=st.integers(1, 3))
    def step(self, k):
        for _ in range(k):
            self._both(lambda run: run.step())
            self._check()

    @precondition(lambda self: self._live_requests())
    @rule(data=st.data())
    def evict_random(self, data):
        """The machine as a policy: random live ids of a request die (never its newest token)."""
        t = self.vt.w.table
        rids = [r for r in self._live_requests() if r in t and t.length(r) >= 2]
        if not rids:
            return
        rid = pick(data, rids, "rid")
        n = t.length(rid)
        live = [i for i in t.live_tokens(rid).tolist() if i < n - 1]
        if not live:
            return
        ids = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1, max_size=min(8, len(live))),
                        label="victims")
        done, _ = self._both(lambda run: run.evict(rid, ids, n))
        if done:
            event("machine eviction")

    @precondition(lambda self: self._live_requests())
    @rule(data=st.data())
    def abort(self, data):
        """An abort from the API server, mostly of a request holding relocated blocks (its
        destinations must go back at vLLM's fence, like its list)."""
        live = self._live_requests()
        holding = [r for r in live if self.vt.ad.held.get(r)]
        if holding and pick(data, [True, True, False], "one holding destinations"):
            live = holding
        rid = pick(data, live, "rid")
        self._both(lambda run: run.abort(rid))

    @rule(k=st.integers(1, 16))
    def grab_blocks(self, k):
        """Pool pressure: someone else takes free blocks (forcing preemption)."""
        self._both(lambda run: run.grab(k))

    @rule()
    def release_blocks(self):
        self._both(lambda run: run.release())

    @precondition(lambda self: self._live_requests())
    @rule(k=st.integers(2, 64), n=st.integers(1, 5), m=st.integers(1, 5), wait_for_plan=st.booleans())
    def pressure_episode(self, k, n, m, wait_for_plan):
        """Pressure, then relief, in one rule (uniform rule choice rarely strings these
        together): optionally a few steps until a plan is in flight, then blocks taken from
        the pool before each of ``n`` steps (all of them for a large ``k``; running requests are preempted
        when they cannot grow), blocks given back, ``m`` steps (they resume with new lists)."""
        for _ in range(4 if wait_for_plan else 0):
            if self.vt.ad.plans:
                break
            self.step(1)
        for _ in range(n):
            # taken again before every step: the headroom yields blocks to growing requests,
            # and the pressure must take those too for vLLM to preempt
            self._both(lambda run: run.grab(k))
            self.step(1)
        self._both(lambda run: run.release())
        for _ in range(m):
            self.step(1)

    @precondition(lambda self: any(not p.orphaned for p in self.vt.ad.plans.values()))
    @rule(m=st.integers(1, 3))
    def preempt_mid_copy(self, m):
        """The hard case on its own rule (enabled only while a plan is in flight): the whole
        pool taken before every step until a request with a plan in flight is preempted (it
        needs a block within S steps) or its plans have landed, then relief and ``m`` steps."""
        self._pressure_while_flying(m)

    @precondition(lambda self: self._live_requests() and not self.vt.ad.plans)
    @rule(m=st.integers(1, 3), wait=st.integers(1, 6))
    def plan_then_preempt(self, m, wait):
        """The same hard case reached from a quiet state (a plan is in flight between rules
        only with a copy lag or async scheduling, so ``preempt_mid_copy`` is rarely enabled):
        up to ``wait`` steps until a plan launches, then the pressure of ``preempt_mid_copy``."""
        self._step_until(lambda: bool(self.vt.ad.plans), wait)
        self._pressure_while_flying(m)

    def _step_until(self, done, most: int) -> None:
        """Up to ``most`` steps, stopping after the first at which ``done()`` holds."""
        for _ in range(most):
            self.step(1)
            if done():
                break

    def _pressure_while_flying(self, m):
        ad = self.vt.ad
        for _ in range(self.S + 1):
            flying = {p.req_id for p in ad.plans.values() if not p.orphaned}
            if not flying or not any(q.request_id in flying for q in ad.scheduler.running):
                break
            self._both(lambda run: run.grab(self.N))
            self.step(1)
        self._both(lambda run: run.release())
        for _ in range(m):
            self.step(1)

    def _last_running_flying(self):
        """The last running request (the one vLLM preempts first) when a plan of it flies."""
        ad = self.vt.ad
        run = ad.scheduler.running
        r = run[-1].request_id if run else None
        return r if r is not None and any(p.req_id == r and not p.orphaned for p in ad.plans.values()) else None

    @precondition(lambda self: not self.halted and self._last_running_flying() is not None)
    @rule(m=st.integers(0, 2))
    def preempt_and_resume_mid_copy(self, m):
        """A copy outliving its request's preemption AND resume (common with copies 6-10
        steps late): the whole pool taken before every step until the last running request,
        whose plan flies, is preempted; relief; steps until it resumes, then ``m`` more."""
        self._preempt_and_resume(self._last_running_flying(), m)

    @precondition(lambda self: not self.halted and self._live_requests() and self._last_running_flying() is None)
    @rule(m=st.integers(0, 2), wait=st.integers(1, 8))
    def plan_then_preempt_and_resume(self, m, wait):
        """The same case reached from a state where the last running request has no plan in
        flight (``preempt_and_resume_mid_copy`` is enabled only between the rules of a run
        whose copies lag, and only while the last running request's plan flies): up to
        ``wait`` steps until one launches, then its preemption and resume while the copy flies."""
        self._step_until(lambda: self.halted or self._last_running_flying() is not None, wait)
        r = None if self.halted else self._last_running_flying()
        if r is not None:
            event("plan of the last running request reached for preempt and resume")
            self._preempt_and_resume(r, m)

    def _preempt_and_resume(self, r, m):
        """Preempt ``r`` (the whole pool taken before each step, at most S + 1 steps), relief,
        up to 4 steps until it resumes, then ``m`` steps."""
        ad = self.vt.ad
        for _ in range(self.S + 1):
            if self.halted or all(q.request_id != r for q in ad.scheduler.running):
                break
            self._both(lambda run: run.grab(self.N))
            self.step(1)
        self._both(lambda run: run.release())
        for _ in range(4):
            self.step(1)
            if self.halted or any(q.request_id == r for q in ad.scheduler.running):
                break
        for _ in range(m):
            self.step(1)

    def _stoppable(self) -> list:
        """Running requests with a plan in flight (not orphaned), not yet told to stop."""
        ad = self.vt.ad
        running = {q.request_id for q in ad.scheduler.running}
        return sorted({p.req_id for p in ad.plans.values() if not p.orphaned and p.req_id in running} - self.stopping)

    def _lands_next(self) -> list:
        """Of :meth:`_stoppable`, those the step in flight (scheduled, not executed: async
        scheduling) computes AND whose plan its output reports (the copy's last poll is in that
        step): stopped at that step's token, the request leaves while the step after it, already
        scheduled, still reads its blocks, and its plan ends in the same processing."""
        run = self.vt
        if not run.d.in_flight:
            return []
        nxt = run.d.in_flight[0]
        meta = getattr(nxt, "vtoken", None)
        pending = run.w.copies.pending
        out = set()
        for p in run.ad.plans.values():
            if p.orphaned or p.req_id not in nxt.num_scheduled_tokens:
                continue
            if p.id in pending:  # launched: lands at its next poll (CPU copies: a lag count down)
                h = pending[p.id][1]
                lands = h.deferred is None or h.left <= 1
            else:  # rides on a step not executed yet: launched and polled at its end
                lands = meta is not None and p.seq == meta.seq and run.w.copy_engine.lag <= 1
            if lands:
                out.add(p.req_id)
        return sorted(out & set(self._stoppable()))

    @precondition(lambda self: not self.halted and self._stoppable())
    @rule(data=st.data(), m=st.integers(1, 3))
    def stop_mid_copy(self, data, m):
        """A request whose plan flies stops at its next sampled token (an EOS: vLLM finishes it while
        processing that step's output, and with async scheduling the next step, already scheduled,
        still computes it): the orphan's blocks must wait for that step (the worker's reads are
        checked against what the scheduler side still holds), then ``m`` steps."""
        self._stop(data, m)

    @precondition(lambda self: not self.halted and self.vt.d.depth > 1 and self._live_requests())
    @rule(data=st.data(), wait=st.integers(4, 32), m=st.integers(1, 3))
    def plan_then_stop(self, data, wait, m):
        """The narrow case driven (async scheduling: plans fly between rules only briefly, and
        land on one step): up to ``wait`` steps until a plan lands on the step in flight
        (:meth:`_lands_next`), then :meth:`stop_mid_copy`'s stop."""
        for _ in range(wait):
            if self.halted or self._lands_next():
                break
            self.step(1)
        if not self.halted and self._stoppable():
            self._stop(data, m)

    def _stop(self, data, m: int) -> None:
        now = self._lands_next()
        rid = pick(data, now if now and pick(data, [True, True, False], "one whose plan lands next") else
                   self._stoppable(), "rid")
        self.stopping.add(rid)
        done, _ = self._both(lambda run: run.stop_next(rid))
        if done:
            event("request stopped mid-copy")
        for _ in range(m):
            self.step(1)

    @precondition(lambda self: any(self.vt.ad.held.get(r) for r in self._live_requests()))
    @rule(data=st.data())
    def abort_mid_pipeline(self, data):
        """Abort a request that holds relocated blocks right after a step was scheduled (with
        async scheduling that step is still in flight: everything it holds must wait for it)."""
        rid = pick(data, [r for r in self._live_requests() if self.vt.ad.held.get(r)], "rid")
        self.step(1)
        self._both(lambda run: run.abort(rid))

    def _fill_out_of_its_list(self):
        """(plan, fill, index): a fill of a plan in flight that was at ``index`` of its
        request's list when the plan took it (as the machine saw the list), or None."""
        ad = self.vt.ad
        for p in ad.plans.values():
            lst = ad.req_to_blocks.get(p.req_id)
            if p.orphaned or not p.fills or lst is None:
                continue
            at = self.vt.taken_at.get(p.id, {})
            for b in p.fills:
                i = at.get(b, -1)
                if 0 <= i < len(lst) and lst[i].is_null:
                    return p, ad.block(b), i
        return None

    @precondition(lambda self: not self.halted and self._fill_out_of_its_list() is not None)
    @rule()
    def probe_a_fill_put_back(self):
        """The checks checked: a fill of a plan in flight put back at its index in vLLM's list
        (behind the adapter's back) must be seen by the incremental check alone (nothing else
        touched, so no list is scanned); then the entry is restored and what the probe
        consumed given back."""
        from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

        ad = self.vt.ad
        p, fill, i = self._fill_out_of_its_list()
        chk, lst = ad.checker, ad.req_to_blocks[p.req_id]
        saved = chk.touched_requests, chk.touched_lists, chk.new_entries, ad.lifecycle.fresh
        chk.touched_requests, chk.touched_lists, chk.new_entries, ad.lifecycle.fresh = set(), set(), [], set()
        lst[i] = fill
        err = None
        try:
            chk.check_touched("machine probe")
        except AdapterAssumptionError as e:
            err = e
        finally:
            lst[i] = ad.pool.null_block
            chk.touched_requests, chk.touched_lists, chk.new_entries, ad.lifecycle.fresh = saved
        assert err is not None and err.check == "null_substitution" and \
            f"block {fill.block_id} (a source or fill) of plan {p.id} is still in" in err.detail, \
            f"fill {fill.block_id} of plan {p.id} put back at index {i} of {p.req_id!r}'s list: {err or 'not caught'}"
        event("probe: a fill put back in its list caught")

    # ---------------------------------------------------------------- checks
    def _check(self):
        if self.halted:
            return
        for run in (self.vt, self.ref):
            run.check_ledger()
            run.check_worker_lists()
            # the runtime checks' incremental view (a cache of the full scan) must never
            # disagree with the full scan: a false alarm is a bug in the checks
            assert not run.ad.checker.false_alarms, f"incremental runtime check false alarm: {run.ad.checker.false_alarms[0]}"
        self.snapshots_done = self.vt.check_snapshots(self.snapshots_done)

    @invariant()
    def ledger(self):
        if hasattr(self, "vt"):
            self._check()

    def teardown(self):
        if not hasattr(self, "vt") or self.halted:
            return
        for run in (self.vt, self.ref):
            run.drain()
            if run.halted:  # the engine's fault, caught while draining
                return
            run.check_ledger()
            run.ad.close()  # all_returned: every block back in the pool
        self.vt.check_snapshots(self.snapshots_done)
        compared = 0
        for rid in self.prompts:
            hv, hr = self.vt.history.get(rid), self.ref.history.get(rid)
            if hv != hr or rid in self.vt.preempted or rid in self.ref.preempted:
                event("request not comparable (its history differs between the runs)")
                continue
            a, b = self.vt.ad.output_tokens(rid), self.ref.ad.output_tokens(rid)
            assert a == b, f"request {rid!r}: outputs differ from Naive-Evict's with the same history: {a} vs {b}"
            compared += 1
        event(f"requests compared with naive-evict: {min(compared, 3)}{'+' if compared > 3 else ''}")
        if self.vt.ad.stats["applied"]:
            event("plans applied")


TestAdapterMachine = AdapterMachine.TestCase
