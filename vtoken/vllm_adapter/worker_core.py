"""The worker's half of the adapter, whatever runs the forward: the one implementation the
harness's decoder (``worker.VTokenWorker``) and vLLM's own model runner (``vtoken.vllm_engine``)
both drive.

Per ``SchedulerOutput``, in order:

1. :meth:`WorkerCore.begin`: a step carrying fewer KV cache groups than the worker's layout
   reads is refused first (``ConfigError``, nothing changed); finished and preempted requests
   leave the table (``free_request``); the pre-attention hook (``KVCopyEngine.wait_before_attention``) and
   the copies seen done applied (all of them, host-waited, when the step says ``drain``); the
   scheduler side's releases leave the table; the block lists (new, appended, replaced on
   resume) recorded. Returns where each scheduled request's chunk starts.
2. :meth:`WorkerCore.chunk`, per scheduled request: a decode step evicts first (keeping
   ``ceil((1 - evict_ratio) * n)`` tokens, or ``budget`` when one is set, never the newest), then the chunk's tokens get their
   slots (``sync_new_tokens``; a prefix-cache hit is synced without compute). Returns a
   :class:`Chunk`: the slots to read (the live tokens, logical order) and to write.
3. the caller computes (its own attention reads exactly ``read`` then the chunk, writes
   ``write``) and hands each chunk's attention statistics to :meth:`observe` (the policy's).
4. :meth:`WorkerCore.end`: stage 4, the step's plans (``messages.plan_order``) copied after the forward
   and applied once seen done (the lifecycle's copy side, ``vtoken.lifecycle.Copies``, the one
   the decode engine's manager runs too); tokens evicted meanwhile stay dead. The report
   carries each finished plan's ``Outcome``, the full-context lengths, the worker's counters
   and its table's changes (``messages.LoggedTable``): the scheduler side replays them on its
   replica.

Owns: its token table (a ``LoggedTable``: the worker is its only writer), the copy engine
and the copy side (the plans received and not yet reported, as plans of its own), the
relocation checker it builds (with a sliding-window group, handed the window's next-step reads,
``window_reads``, to guard: every KV cache group the worker reads is guarded), the policy, per request its positional block lists, known token
ids and full-context length. The K/V storage is the caller's (``kv``, a ``KVCache`` or a view
with its interface).
May call: ``vtoken.table``, ``vtoken.lifecycle`` (``Copies``), ``vtoken.copy_engine``,
``vtoken.policies``, numpy, torch; the relocation checker only as a factory the toolkit
passes in (``check_relocations``).
Costs: per step O(requests scheduled + requests that left + blocks released) plus the
policy's and the table's cost per scheduled chunk, plus O(moves) per plan applied; with the
checker and a window group, O(requests x window) per checker call of ``window_reads``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from ..copy_engine import KVCopyEngine
from ..errors import CallError, OrderError
from ..fields import refuse
from ..lifecycle import Copies, Plan
from ..policies import make_policy
from .layout import WorkerLayout
from .messages import WorkerReport

__all__ = ["WorkerCore", "Chunk", "WorkerRequest"]


@dataclass
class WorkerRequest:
    prompt: list
    outputs: list
    blocks: list  # positional block ids (append-only, replaced on resume)
    wblocks: Optional[list] = None  # the sliding-window group's positional block ids (a hybrid layout)

    @property
    def tokens(self) -> list:
        return self.prompt + self.outputs


@dataclass
class Chunk:
    """One scheduled request's work this step: tokens ``[start, start + k)``; ``read`` the
    slots of its live tokens before the chunk (logical order, a tensor on the table's
    device), ``write`` the chunk's slots (position order); ``obs_ids`` the token ids the
    attention statistics cover (``read``'s tokens, then the chunk's); ``decode``: one new
    token after the prompt; ``last``: the chunk reaches the last known token (one is sampled)."""

    req_id: str
    start: int
    k: int
    decode: bool
    last: bool
    read: torch.Tensor
    write: np.ndarray
    obs_ids: np.ndarray = field(repr=False)


class WorkerCore:
    """The worker's half (see the module docstring). Arguments are the worker's, checked by
    its caller (``worker.check_worker_config``)."""

    def __init__(self, kv, table, block_size: int, *, policy: str, policy_kwargs: dict | None, evict_ratio: float,
                 seed: int, check_relocations, snapshot_dir, copy_lag: int, copy_engine_factory,
                 layout: WorkerLayout | None, budget: int | None = None, policy_key=None):
        self.layout = layout if layout is not None else WorkerLayout()
        self.table, self.kv, self.S = table, kv, int(block_size)
        self.copy_engine = (copy_engine_factory or KVCopyEngine)(kv, self.S, lag=copy_lag)
        self.checker = None
        engine = self.copy_engine
        if check_relocations:  # the toolkit's checker, handed in (the system never imports it)
            self.checker = check_relocations(kv, table, out_dir=snapshot_dir)
            if self.layout.window_group is not None:  # the window's slots are guarded too
                self._guard_window(self.checker)
            engine = self.checker.wrap(self.copy_engine)
        self.engine = engine
        # the copy side of every plan's life; the relocation checker re-hashes each applied plan
        self.copies = Copies(table, engine, after_apply=self.checker.after_apply if self.checker else None)
        kw = dict(policy_kwargs or {})
        if policy == "random":
            kw.setdefault("seed", seed)
        self.policy_name = policy
        self.policy = make_policy(policy, **kw)
        self.evict_ratio = float(evict_ratio)
        self.budget = None if budget is None else int(budget)  # tokens kept per request (instead of the ratio)
        self.reqs: dict[str, WorkerRequest] = {}
        # the id a request's policy state is kept under: its own, or ``policy_key(new request data)``
        # (vLLM's engine gives requests ids with a random suffix: a seeded policy keys on something stable)
        self.policy_key = policy_key
        self.pkey: dict[str, object] = {}
        self.faithful: dict[str, int] = {}
        self.unlisted: list = []  # (request, list index) nulled since the runner last took them
        self.emptied_sources: list = []  # sources of plans applied this step whose bytes nobody reads again
        self._keep: dict[int, set] = {}  # plan id -> its sources whose prefix-cache hash comes back
        self._clock = itertools.count()  # the worker's own clock for the events of snapshots it completes
        self.stats = dict(steps=0, prefill_tokens=0, cached_tokens=0, decode_tokens=0, evicted=0,
                          relocations=0, moves=0, aborted=0, releases=0)

    # ------------------------------------------------------------------ KV cache groups outside the table
    def _guard_window(self, checker) -> None:
        """Hand the checker the sliding-window slots this worker reads (``guard_outside``): a
        copy must not write them either. A checker that cannot guard them is refused
        (``CallError``): its hash-and-compare would be blind to the window."""
        guard = getattr(checker, "guard_outside", None)
        if not callable(guard):
            raise CallError("bad_type", f"the relocation checker {type(checker).__name__} has no guard_outside(reads, "
                                        f"name): with a sliding-window group it would not guard the window's slots")
        guard(self.window_reads, f"the sliding-window group (KV cache group {self.layout.window_group})")

    def window_start(self, start: int) -> int:
        """The first position a chunk starting at ``start`` reads in the sliding-window group
        (its windowed layers attend over the last ``window`` positions, the chunk's own included)."""
        return max(0, int(start) - self.layout.window + 1)

    def window_reads(self) -> list:
        """What the next step reads of the sliding-window group, outside the token table:
        ``[(request, positions, slots)]`` per request in the table, the positions
        ``[window_start(n), n)`` (``n``: its length, where its next chunk starts) through its
        window block list, those whose entry is null (vLLM freed the block) left out. Empty
        without a window group. O(requests x window)."""
        if self.layout.window_group is None:
            return []
        S, t, out = self.S, self.table, []
        for r in t.requests():
            w = self.reqs.get(r)
            if w is None or not w.wblocks:
                continue
            n = t.length(r)
            pos = np.arange(self.window_start(n), n, dtype=np.int64)
            pos = pos[pos // S < len(w.wblocks)]
            b = np.asarray(w.wblocks, dtype=np.int64)[pos // S]
            out.append((r, pos[b != 0], b[b != 0] * S + pos[b != 0] % S))
        return out

    # ------------------------------------------------------------------ counters
    @property
    def hash_checks(self) -> int:
        return self.checker.passed if self.checker is not None else 0

    @property
    def hash_failures(self) -> int:
        return self.checker.failed if self.checker is not None else 0

    def counters(self) -> dict:
        """The worker's counters so far, plain (what rides on every report)."""
        return dict(self.stats, hash_checks=self.hash_checks, hash_failures=self.hash_failures)

    # ------------------------------------------------------------------ 1. before the forward
    def drop(self, r: str, forget: bool) -> None:
        """``r`` left (finished: ``forget``; preempted or resumed: its record stays): its table
        entry goes, its copies in flight end aborted, the policy forgets it."""
        if r in self.table:
            self.table.free_request(r)
        self.copies.forget(r)  # its copies in flight end aborted (a resumed incarnation is another request)
        self.policy.forget(self.pkey.get(r, r))
        if self.checker is not None:
            self.checker.forget_request(r)
        self.faithful.pop(r, None)
        w = self.reqs.get(r)
        if w is not None:
            w.blocks = []
        if forget:
            self.reqs.pop(r, None)
            self.pkey.pop(r, None)

    def begin(self, sched_out, rep: WorkerReport) -> dict[str, int]:
        """Steps 1-4 of the module docstring; returns ``{request: its chunk's start}``."""
        self._check_groups(sched_out)
        meta = getattr(sched_out, "vtoken", None)
        t = self.table
        self.stats["steps"] += 1
        self.unlisted, self.emptied_sources = [], []  # a runner following them took the last step's at its end
        for r in sched_out.finished_req_ids:
            self.drop(r, forget=True)
        for r in sched_out.preempted_req_ids or ():
            self.drop(r, forget=False)
        # pre-attention hook: device wait on copies not yet observed done; apply finished ones
        self.engine.wait_before_attention()
        self.poll(rep, force=bool(meta is not None and meta.drain))
        if meta is not None:
            for r, blocks in meta.releases.items():
                if r in t:
                    t.release_empty_blocks(r, blocks)
                    self._unlist(r, blocks)
                    self.stats["releases"] += len(blocks)
        return self._lists(sched_out)

    def _check_groups(self, sched_out) -> None:
        """Refuse (``ConfigError``, before anything changes) a step whose block lists carry fewer
        KV cache groups than the layout reads: a worker of another layout would fail mid-step or
        read another group's blocks. O(requests scheduled)."""
        need = self.layout.groups_needed()
        lists = [d.block_ids for d in sched_out.scheduled_new_reqs]
        lists += [nb for nb in sched_out.scheduled_cached_reqs.new_block_ids if nb]
        short = next((ids for ids in lists if len(ids) < need), None)
        if short is not None:
            refuse("inconsistent", "VTokenWorker", "layout", f"a layout of the {len(short)} KV cache group(s) "
                                                             f"vLLM's step carries", self.layout)

    def _unlist(self, r: str, blocks) -> None:
        """Blocks ``r`` no longer has in its list (released, or a plan's emptied sources): their
        entries become the null block 0, as the scheduler side's list did (never popped: the
        list stays positional). Recorded in ``unlisted`` for a runner whose own block-table
        rows must follow (``vtoken.vllm_engine``). O(the request's blocks) per block."""
        w = self.reqs.get(r)
        if w is None:
            return
        for b in blocks:
            try:
                i = w.blocks.index(int(b))
            except ValueError:
                continue  # not in its list (a destination it held outside it)
            w.blocks[i] = 0
            self.unlisted.append((r, i))

    def _lists(self, sched_out) -> dict[str, int]:
        """Block lists (and token ids of new / resumed requests) as the output sends them."""
        t, starts = self.table, {}
        g, wg = self.layout.table, self.layout.window_group
        for d in sched_out.scheduled_new_reqs:
            self.reqs[d.req_id] = WorkerRequest(list(d.prompt_token_ids or ()), [], list(d.block_ids[g]),
                                                wblocks=list(d.block_ids[wg]) if wg is not None else None)
            starts[d.req_id] = d.num_computed_tokens
            if self.policy_key is not None:
                self.pkey[d.req_id] = self.policy_key(d)
        c = sched_out.scheduled_cached_reqs
        for i, r in enumerate(c.req_ids):
            w = self.reqs[r]
            nb = c.new_block_ids[i]
            ids = list(nb[g]) if nb else []
            wids = list(nb[wg]) if nb and wg is not None else []
            n_out = c.num_output_tokens[i]
            if r in c.resumed_req_ids:
                if r in t:
                    self.drop(r, forget=False)
                w.blocks = ids
                w.wblocks = wids if wg is not None else None
                if n_out > 0 and r in c.all_token_ids:
                    w.outputs = list(c.all_token_ids[r][-n_out:])
            else:
                w.blocks += ids
                if wg is not None:
                    w.wblocks += wids
                if n_out < len(w.outputs):
                    del w.outputs[n_out:]
            starts[r] = c.num_computed_tokens[i]
        return starts

    def chunk(self, r: str, start: int, k: int, known: int | None = None) -> Chunk:
        """:meth:`chunks` for one request."""
        return self.chunks([(r, start, k)], None if known is None else {r: known})[r]

    def chunks(self, items: list, known: dict | None = None) -> dict[str, Chunk]:
        """Step 2 for the scheduled requests ``items`` (``(request, start, k)``: tokens ``[start,
        start + k)``), in two passes: each request's entry, prefix-cache hit and decode-step
        eviction, then their reads and growth. Requests are independent, so this is the same as
        one request after the other; it lets a decode step's one-token evictions and one-token
        growths go to the table as one call each (``evict_one_each``, ``sync_one_each``: the
        scheduler side's replica replays them so too). ``known``: per request how many of its
        tokens the caller knows (default: its prompt and outputs recorded here); a chunk beyond
        them, or a table that disagrees with ``start``, is refused (``OrderError``). A prefix-cache
        hit after the first request may land on blocks an earlier request of the same step writes
        (vLLM caches a block when it schedules the tokens that fill it): then one request after
        the other, in the scheduler's order, so those tokens are placed before the hit."""
        t = self.table
        if len(items) > 1 and any((t.length(r) if r in t else 0) < start for r, start, _ in items[1:]):
            out: dict[str, Chunk] = {}
            for item in items:
                out.update(self.chunks([item], known))
            return out
        one_victim, decode = [], {}
        for r, start, k in items:
            n = self._entry(r, start)
            w = self.reqs[r]
            limit = len(w.prompt) + len(w.outputs) if known is None or r not in known else int(known[r])
            if start + k > limit:
                raise OrderError("state_mismatch", f"worker: request {r!r}: chunk [{start}, {start + k}) beyond its "
                                                   f"{limit} known tokens")
            decode[r] = (k == 1 and start >= len(w.prompt) and start > 0, start + k >= limit)
            if decode[r][0] and (self.evict_ratio > 0 or self.budget is not None):
                victims = self._victims(r, n)
                if len(victims) == 1:
                    one_victim.append((r, int(victims[0])))
                elif len(victims):
                    self.evict_tokens(r, victims)
        if one_victim:
            self._evict_one_each(one_victim)
        reads = {r: (t.slot_mapping(r).clone(), t.live_tokens(r)) for r, _, _ in items}
        ones = [(r, start) for r, start, k in items if k == 1 and start < len(self.reqs[r].blocks) * self.S]
        targets = [self.reqs[r].blocks[start // self.S] for r, start in ones]
        if len(set(targets)) != len(targets):  # a block named twice (never a decode step's): one by one
            ones, targets = [], []
        writes = dict(zip((r for r, _ in ones), t.sync_one_each([r for r, _ in ones], targets))) if ones else {}
        out = {}
        for r, start, k in items:
            write = np.array([writes[r]]) if r in writes else t.sync_new_tokens(r, self.reqs[r].blocks, start + k)
            is_decode, last = decode[r]
            self.stats["decode_tokens" if is_decode else "prefill_tokens"] += k
            read, live_before = reads[r]
            obs = np.concatenate([live_before, np.arange(start, start + k, dtype=np.int64)])
            out[r] = Chunk(r, int(start), int(k), is_decode, last, read, write, obs)
        t.flush()
        return out

    def _entry(self, r: str, start: int) -> int:
        """``r``'s table entry made (empty) and its prefix-cache hit synced; its length, which
        must be ``start``."""
        t, w = self.table, self.reqs[r]
        if r not in t:
            t.sync_new_tokens(r, w.blocks, 0)  # creates the (empty) entry
        n = t.length(r)
        if n < start:  # a prefix-cache hit: these tokens' K/V is in cached blocks already
            t.sync_new_tokens(r, w.blocks, start)
            self.stats["cached_tokens"] += start - n
            n = start
        if n != start:
            raise OrderError("state_mismatch", f"worker: request {r!r} has {n} tokens in its table, the scheduler says "
                                               f"the chunk starts at {start}")
        return n

    def observe(self, chunk: Chunk, stats) -> None:
        """Step 3's end: the chunk's attention statistics (one per ``obs_ids``) to the policy."""
        r = chunk.req_id
        self.policy.observe(self.pkey.get(r, r), chunk.obs_ids, np.asarray(stats))

    def sampled(self, r: str, token: int) -> None:
        """The token sampled for ``r`` at its last chunk (its outputs, for resumes and bounds)."""
        self.reqs[r].outputs.append(int(token))

    def _victims(self, r: str, n: int) -> np.ndarray:
        """The tokens ``r`` evicts at a decode step of length ``n`` (the policy's choice, keeping
        ``budget`` or ``ceil((1 - evict_ratio) * n)``, never the newest)."""
        t = self.table
        keep = self.budget if self.budget is not None else max(1, math.ceil(n * (1.0 - self.evict_ratio) - 1e-9))
        if t.num_live(r) <= keep:
            return np.empty(0, dtype=np.int64)
        return self.policy.select_victims(self.pkey.get(r, r), t.live_tokens(r), keep)

    def _evict_one_each(self, pairs: list) -> None:
        """One token each of distinct requests, in one table call (``evict_tokens``' bookkeeping per request)."""
        t = self.table
        lengths = [t.length(r) for r, _ in pairs]
        t.evict_one_each([r for r, _ in pairs], [x for _, x in pairs])
        for (r, x), n in zip(pairs, lengths):
            self._evicted(r, n, np.array([x], dtype=np.int64))

    def evict_tokens(self, r: str, token_ids) -> None:
        """Evict tokens of ``r`` (metadata only, between or inside steps): the one way tokens die
        in the worker's table. Records the request's full-context length and tells the relocation
        checker. ``TableError`` (table unchanged) for ids not live in ``r``."""
        t = self.table
        ids = np.asarray(token_ids, dtype=np.int64) if not isinstance(token_ids, np.ndarray) else token_ids
        n = t.length(r)
        t.evict_tokens(r, ids)
        self._evicted(r, n, ids)

    def _evicted(self, r: str, n: int, ids: np.ndarray) -> None:
        """``ids`` of ``r`` (of length ``n``) died: its full-context length, the counters, the checker."""
        if r not in self.faithful:
            self.faithful[r] = n  # tokens [0, n) were computed before any eviction
        self.stats["evicted"] += len(ids)
        if self.checker is not None:
            self.checker.note_evicted(r, ids)

    # ------------------------------------------------------------------ 4. after the forward
    def end(self, sched_out, rep: WorkerReport) -> WorkerReport:
        """Stage 4 (this step's plans, after the forward) and the report's plain parts."""
        self.table.flush()
        meta = getattr(sched_out, "vtoken", None)
        if meta is not None:
            for order in meta.plans:
                self.launch(order, rep)
        return self.finish_report(rep)

    def finish_report(self, rep: WorkerReport) -> WorkerReport:
        rep.faithful = dict(self.faithful)
        rep.ops = self.table.take_ops()
        rep.stats = self.counters()
        # the scheduler side consumes these on its replica; the worker's own would only grow
        self.table.take_changed(), self.table.take_emptied(), self.table.take_lone_dead()
        return rep

    def launch(self, order, rep: WorkerReport) -> None:
        """Issue a plan's copy (the copy side refuses it at once when its request is gone or a
        block is shared) and poll it once. The plan is the worker's own record of the order."""
        plan = Plan(order["id"], order["req_id"], list(order["sources"]), list(order["dests"]),
                    np.asarray(order["moves"], dtype=np.int64).reshape(-1, 5), list(order["fills"]), seq=order["seq"],
                    snapshot=order["snapshot"], clock=self._clock.__next__)
        self._keep[plan.id] = set(order.get("keep", ()))  # sources whose hash comes back: never poisoned
        now = self.copies.launch(plan)
        if now is not None:
            self._report(plan, now, rep)
        else:
            self.poll(rep, force=False, only=(plan.id,))

    def poll(self, rep: WorkerReport, force: bool, only=None) -> None:
        for plan, out in self.copies.poll(force=force, only=only):
            self._report(plan, out, rep)

    def _report(self, plan: Plan, out, rep: WorkerReport) -> None:
        out.snapshot = plan.snapshot  # completed here (digests, events, post): the scheduler side merges it
        rep.plans[plan.id] = out
        keep = self._keep.pop(plan.id, ())
        if out.status == "applied":
            self._unlist(plan.req_id, plan.sources)
            self.emptied_sources += [b for b in plan.sources if b not in keep]
            self.stats["relocations"] += 1
            self.stats["moves"] += out.moved
        else:
            self.stats["aborted"] += 1

    def synchronize(self) -> WorkerReport:
        """Host-wait every copy still in flight and apply it (idle / teardown)."""
        rep = WorkerReport()
        self.poll(rep, force=True)
        if hasattr(self.copy_engine, "synchronize"):
            self.copy_engine.synchronize()
        return self.finish_report(rep)
