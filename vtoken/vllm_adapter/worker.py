"""The worker side of the vLLM adapter: this project's decoder fed by vLLM's scheduler outputs.

``VTokenWorker.execute(scheduler_output)`` plays vLLM's model runner for
``adapter.VTokenAdapter``, running :class:`~vtoken.model.PagedDecoder` over a real
:class:`~vtoken.kvcache.KVCache`. Per output, in order:

1. finished / preempted requests: their table entry is reset (``free_request``);
2. pre-attention: ``KVCopyEngine.wait_before_attention()``, completed earlier copies applied;
3. the scheduler side's releases leave the table (``release_empty_blocks``);
4. block lists (new, appended, replaced on resume) give the new tokens' slots
   (``sync_new_tokens``); a prefix-cache hit is synced without compute;
5. compute, in the output's request order: a decode step evicts first (keeping ``ceil((1 -
   evict_ratio) * n)`` tokens, never the newest), reads the live tokens through
   ``slot_mapping`` and writes the new token's K/V; a prefill chunk attends causally over the
   live tokens before it plus itself; a request whose chunk reaches its last known token
   samples one token (greedy);
6. stage 4: the step's plans (``sched_out.vtoken.plans``) are copied after the forward and
   applied once seen done: the lifecycle's copy side (``vtoken.lifecycle.Copies``, the one the
   decode engine's manager runs too); tokens evicted meanwhile stay dead.

It returns a ``ModelRunnerOutput`` with the sampled tokens and a :class:`WorkerReport` as
``vtoken_report``. With the same evictions, runs with and without reclamation give the same
tokens.

Owns: the K/V cache (``KVCache``), the copy engine and the copy side (``Copies``: the plans
received and not yet reported), per request the full-context length; it writes the token
table the adapter reads.
May call: ``vtoken.table``, ``vtoken.lifecycle`` (``Copies``), ``vtoken.copy_engine``,
``vtoken.model``, ``vtoken.policies``, torch; vLLM's output types; the relocation checker
only as a factory the toolkit passes in (``check_relocations``).
Costs: a step is the decoder's forward over the scheduled tokens plus O(moves) per plan
applied; the per-request work is for scheduled requests only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..copy_engine import KVCopyEngine, checker_factory
from .messages import WorkerReport
from ..errors import OrderError
from ..fields import need_choice, need_device, need_instance, need_int, need_number, refuse
from ..model.decoder import DecodeItem, PagedDecoder, Windowed, _Group, greedy
from ..lifecycle import Copies
from ..policies import make_policy
from ..table import TokenTable
from .layout import WorkerLayout

__all__ = ["VTokenWorker", "WorkerReport", "check_worker_config"]


def check_worker_config(*, model, table, num_blocks, block_size, policy, policy_kwargs, evict_ratio, seed,
                        check_relocations, snapshot_dir, copy_lag, device, copy_engine_factory,
                        layout=None) -> dict:
    """Every field of ``VTokenWorker``'s configuration, checked before anything is built
    (ConfigError naming the field and value): ``model`` a ``PagedDecoder``; ``table`` a
    ``TokenTable`` of ``block_size`` x ``num_blocks``; ``policy`` a registered name,
    ``policy_kwargs`` a dict or None; ``evict_ratio`` in [0, 1); ``seed``, ``copy_lag`` >= 0;
    ``device`` a torch device; ``snapshot_dir`` a path or None; ``copy_engine_factory`` callable
    or None; ``check_relocations`` per ``copy_engine.checker_factory``; ``layout`` a
    ``WorkerLayout`` or None (a windowed layout needs a model of 2 layers or more). Returns plain numbers."""
    import os

    from ..policies import POLICIES

    own = "VTokenWorker"
    need_instance(own, "model", model, PagedDecoder)
    need_instance(own, "table", table, TokenTable)
    out = dict(num_blocks=need_int(own, "num_blocks", num_blocks, 2),
               block_size=need_int(own, "block_size", block_size, 1))
    for name, want in (("num_blocks", table.num_blocks), ("block_size", table.S)):
        if out[name] != want:
            refuse("out_of_range", own, name, f"the table's ({want})", out[name])
    need_choice(own, "policy", policy, POLICIES)
    need_instance(own, "policy_kwargs", policy_kwargs, dict, none_ok=True)
    out["evict_ratio"] = need_number(own, "evict_ratio", evict_ratio, 0, 1, hi_open=True)
    out["seed"] = need_int(own, "seed", seed, 0)
    out["copy_lag"] = need_int(own, "copy_lag", copy_lag, 0)
    need_device(own, "device", device)
    need_instance(own, "snapshot_dir", snapshot_dir, (str, os.PathLike), none_ok=True)
    if copy_engine_factory is not None and not callable(copy_engine_factory):
        refuse("bad_type", own, "copy_engine_factory", "a callable or None", copy_engine_factory)
    checker_factory(check_relocations, own)
    need_instance(own, "layout", layout, WorkerLayout, none_ok=True)
    if layout is not None and layout.window_group is not None and not layout.window_layers(model.config.num_layers):
        refuse("out_of_range", own, "layout", "a model of 2 layers or more for a sliding-window group", layout)
    return out


@dataclass
class _WorkerRequest:
    prompt: list
    outputs: list
    blocks: list  # positional block ids (append-only, replaced on resume)
    evicting: bool = False
    wblocks: list = None  # the sliding-window group's positional block ids (a hybrid layout)

    @property
    def tokens(self) -> list:
        return self.prompt + self.outputs


class VTokenWorker:
    """Executes the adapter's ``SchedulerOutput``s with a real decoder and K/V cache.

    Args:
        model: the ``PagedDecoder`` (its config fixes the K/V geometry).
        table: the adapter's ``TokenTable`` (the worker is its only writer).
        num_blocks, block_size: vLLM's pool geometry (block ids index the cache directly).
        policy, policy_kwargs, evict_ratio, seed: eviction (``vtoken.policies``).
        check_relocations: None, or the relocation checker's factory ``(kv, table, out_dir=)
            -> checker``; the worker owns the checker it builds.
        snapshot_dir: where a failing relocation's snapshot goes.
        copy_lag: a copy completes on its ``copy_lag``-th poll (``KVCopyEngine(lag=...)``).
        copy_engine_factory: ``(kv, block_size, lag=...) -> engine`` (default :class:`KVCopyEngine`).
        layout: vLLM's KV cache groups as the worker reads them (``layout.WorkerLayout``; None:
            one full-attention group). With a sliding-window group, the model's windowed layers
            write and read that group's blocks by position, the last ``window`` tokens.
    Arguments are checked first (:func:`check_worker_config`).
    """

    def __init__(self, model: PagedDecoder, table: TokenTable, num_blocks: int, block_size: int, *,
                 policy: str = "h2o", policy_kwargs: dict | None = None, evict_ratio: float = 0.5,
                 seed: int = 0, check_relocations=None, snapshot_dir=None, copy_lag: int = 0,
                 device: str = "cpu", copy_engine_factory=None, layout: WorkerLayout | None = None):
        c = check_worker_config(model=model, table=table, num_blocks=num_blocks, block_size=block_size, policy=policy,
                                policy_kwargs=policy_kwargs, evict_ratio=evict_ratio, seed=seed,
                                check_relocations=check_relocations, snapshot_dir=snapshot_dir, copy_lag=copy_lag,
                                device=device, copy_engine_factory=copy_engine_factory, layout=layout)
        self.layout = layout if layout is not None else WorkerLayout()
        self.window_layers = self.layout.window_layers(model.config.num_layers)
        num_blocks, block_size, evict_ratio, seed, copy_lag = (c[k] for k in ("num_blocks", "block_size", "evict_ratio",
                                                                              "seed", "copy_lag"))
        self.model = model
        self.table = table
        self.S = int(block_size)
        self.kv = model.make_kv_cache(num_blocks, block_size, device=device)
        self.copy_engine = (copy_engine_factory or KVCopyEngine)(self.kv, self.S, lag=copy_lag)
        self.checker = None
        engine = self.copy_engine
        if check_relocations:  # the toolkit's checker, handed in (the system never imports it)
            self.checker = check_relocations(self.kv, table, out_dir=snapshot_dir)
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
        self.reqs: dict[str, _WorkerRequest] = {}
        self.faithful: dict[str, int] = {}
        self.stats = dict(steps=0, prefill_tokens=0, cached_tokens=0, decode_tokens=0, evicted=0,
                          relocations=0, moves=0, aborted=0, releases=0)

    # ------------------------------------------------------------------ helpers
    @property
    def hash_checks(self) -> int:
        return self.checker.passed if self.checker is not None else 0

    @property
    def hash_failures(self) -> int:
        return self.checker.failed if self.checker is not None else 0

    def _drop(self, r: str, forget: bool) -> None:
        if r in self.table:
            self.table.free_request(r)
        self.copies.forget(r)  # its copies in flight end aborted (a resumed incarnation is another request)
        self.policy.forget(r)
        if self.checker is not None:
            self.checker.forget_request(r)
        self.faithful.pop(r, None)
        w = self.reqs.get(r)
        if w is not None:
            w.evicting = False
            w.blocks = []
        if forget:
            self.reqs.pop(r, None)

    # ------------------------------------------------------------------ the step
    def execute(self, sched_out):
        """Run one ``SchedulerOutput``; returns a ``ModelRunnerOutput`` (with ``vtoken_report``)."""
        from vllm.v1.outputs import ModelRunnerOutput

        meta = getattr(sched_out, "vtoken", None)
        rep = WorkerReport()
        t = self.table
        self.stats["steps"] += 1
        # 1. requests that left
        for r in sched_out.finished_req_ids:
            self._drop(r, forget=True)
        for r in sched_out.preempted_req_ids or ():
            self._drop(r, forget=False)
        # 2. pre-attention hook: device wait on copies not yet observed done; apply finished ones
        self.engine.wait_before_attention()
        self._poll(rep, force=False)
        # 3. releases
        if meta is not None:
            for r, blocks in meta.releases.items():
                if r in t:
                    t.release_empty_blocks(r, blocks)
                    self.stats["releases"] += len(blocks)
        # 4. block lists (and token ids of new / resumed requests)
        starts: dict[str, int] = {}
        g, wg = self.layout.table, self.layout.window_group
        for d in sched_out.scheduled_new_reqs:
            self.reqs[d.req_id] = _WorkerRequest(list(d.prompt_token_ids), [], list(d.block_ids[g]),
                                                 wblocks=list(d.block_ids[wg]) if wg is not None else None)
            starts[d.req_id] = d.num_computed_tokens
        c = sched_out.scheduled_cached_reqs
        for i, r in enumerate(c.req_ids):
            w = self.reqs[r]
            nb = c.new_block_ids[i]
            ids = list(nb[g]) if nb else []
            wids = list(nb[wg]) if nb and wg is not None else []
            n_out = c.num_output_tokens[i]
            if r in c.resumed_req_ids:
                if r in t:
                    self._drop(r, forget=False)
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
        # 5. compute, in the output's request order
        sampled: dict[str, list[int]] = {}
        for r, k in sched_out.num_scheduled_tokens.items():
            tok = self._run_request(r, starts[r], int(k), rep)
            sampled[r] = [tok] if tok is not None else []
        t.flush()
        # 6. stage 4: this step's plans, after the forward
        if meta is not None:
            for ap in meta.plans:
                self._launch(ap, rep)
        rep.faithful = dict(self.faithful)
        ids = list(sched_out.num_scheduled_tokens)
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[sampled[r] for r in ids])
        out.vtoken_report = rep
        return out

    def _run_request(self, r: str, start: int, k: int, rep: WorkerReport) -> Optional[int]:
        t = self.table
        w = self.reqs[r]
        toks = w.tokens
        if r not in t:
            t.sync_new_tokens(r, w.blocks, 0)  # creates the (empty) entry
        n = t.length(r)
        if n < start:  # a prefix-cache hit: these tokens' K/V is in cached blocks already
            t.sync_new_tokens(r, w.blocks, start)
            self.stats["cached_tokens"] += start - n
            n = start
        if n != start:
            raise OrderError("state_mismatch", f"worker: request {r!r} has {n} tokens in its table, the scheduler says the "
                               f"chunk starts at {start}")
        if start + k > len(toks):
            raise OrderError("state_mismatch", f"worker: request {r!r}: chunk [{start}, {start + k}) beyond its "
                               f"{len(toks)} known tokens")
        decode = k == 1 and start >= len(w.prompt) and start > 0
        if decode and self.evict_ratio > 0:
            self._evict(r, n)
        read = t.slot_mapping(r).clone()
        live_before = t.live_tokens(r)
        write = t.sync_new_tokens(r, w.blocks, start + k)
        t.flush()
        model, kv = self.model, self.kv
        if decode and w.wblocks is None:
            logits, stats = model.decode_step(kv, [DecodeItem(int(toks[start]), start, int(write[0]), read)])
            lg, st = logits[0], stats[0]
            self.stats["decode_tokens"] += 1
        else:  # a prefill chunk, or any chunk of a hybrid model (its windowed layers read their own group)
            ids = torch.as_tensor(toks[start:start + k], dtype=torch.int64)
            pos = torch.arange(start, start + k, dtype=torch.int64)
            ws = torch.from_numpy(np.ascontiguousarray(write)).to(kv.device)
            keys = torch.cat([read.to(kv.device), ws])
            windowed = self._windowed(r, w, start, k) if w.wblocks is not None else None
            with torch.inference_mode():
                logits, stats = model._forward(kv, ids, pos, ws, [_Group(0, k, keys, True)], slice(k - 1, k),
                                               windowed=windowed)
            lg, st = logits[0], stats[0]
            self.stats["decode_tokens" if decode else "prefill_tokens"] += k
        obs_ids = np.concatenate([live_before, np.arange(start, start + k, dtype=np.int64)])
        self.policy.observe(r, obs_ids, st.numpy())
        if start + k >= len(toks):
            nxt = int(greedy(lg))
            w.outputs.append(nxt)
            return nxt
        return None

    def _window_slots(self, r: str, w: _WorkerRequest, lo: int, hi: int) -> torch.Tensor:
        """The sliding-window group's slots of positions ``[lo, hi)``, by position through its
        block list. A position whose block vLLM already freed (null) is refused: vLLM must keep
        the window (``OrderError``, nothing computed)."""
        S = self.S
        pos = np.arange(lo, hi, dtype=np.int64)
        idx = pos // S
        blocks = np.asarray(w.wblocks, dtype=np.int64)
        if len(idx) and (idx[-1] >= len(blocks) or (blocks[idx] == 0).any()):
            raise OrderError("state_mismatch", f"worker: request {r!r}: the sliding-window group holds no block for "
                             f"some position of [{lo}, {hi}) (its blocks {w.wblocks})")
        return torch.from_numpy(blocks[idx] * S + pos % S).to(self.kv.device)

    def _windowed(self, r: str, w: _WorkerRequest, start: int, k: int) -> Windowed:
        """The windowed layers of a hybrid model for the chunk ``[start, start + k)``: they write
        the chunk and attend over the last ``window`` positions of the sliding-window group."""
        win = self.layout.window
        lo = max(0, start - win + 1)
        keys = self._window_slots(r, w, lo, start + k)
        return Windowed(self.window_layers, keys[start - lo:], [_Group(0, k, keys, True, win)])

    def _evict(self, r: str, n: int) -> None:
        t = self.table
        keep = max(1, math.ceil(n * (1.0 - self.evict_ratio) - 1e-9))
        if t.num_live(r) <= keep:
            return
        victims = self.policy.select_victims(r, t.live_tokens(r), keep)
        if len(victims) == 0:
            return
        self.evict_tokens(r, victims)

    def evict_tokens(self, r: str, token_ids) -> None:
        """Evict tokens of ``r`` (metadata only, between or inside steps): the one way tokens die
        in the worker's table. Records the request's full-context length and tells the relocation
        checker. ``TableError`` (table unchanged) for ids not live in ``r``."""
        t = self.table
        ids = np.asarray(token_ids, dtype=np.int64) if not isinstance(token_ids, np.ndarray) else token_ids
        n = t.length(r)
        t.evict_tokens(r, ids)
        if r not in self.faithful:
            self.faithful[r] = n  # tokens [0, n) were computed before any eviction
        self.stats["evicted"] += len(ids)
        if self.checker is not None:
            self.checker.note_evicted(r, ids)

    # ------------------------------------------------------------------ relocation (stage 4)
    def _launch(self, plan, rep: WorkerReport) -> None:
        """Issue the plan's copy (the copy side refuses it at once when its request is gone or a
        block is shared) and poll it once."""
        now = self.copies.launch(plan)
        if now is not None:
            self._report(plan, now, rep)
        else:
            self._poll(rep, force=False, only=(plan.id,))

    def _poll(self, rep: WorkerReport, force: bool, only=None) -> None:
        for plan, out in self.copies.poll(force=force, only=only):
            self._report(plan, out, rep)

    def _report(self, plan, out, rep: WorkerReport) -> None:
        rep.plans[plan.id] = out
        if out.status == "applied":
            self.stats["relocations"] += 1
            self.stats["moves"] += out.moved
        else:
            self.stats["aborted"] += 1

    def synchronize(self) -> WorkerReport:
        """Host-wait every copy still in flight and apply it (idle / teardown)."""
        rep = WorkerReport()
        self._poll(rep, force=True)
        if hasattr(self.copy_engine, "synchronize"):
            self.copy_engine.synchronize()
        rep.faithful = dict(self.faithful)
        return rep
