"""The worker side of the vLLM adapter: this project's decoder fed by vLLM's scheduler outputs.

``VTokenWorker.execute(scheduler_output)`` plays vLLM's model runner for
``adapter.VTokenAdapter``, running :class:`~vtoken.model.PagedDecoder` over a real
:class:`~vtoken.kvcache.KVCache`. The step is :class:`~.worker_core.WorkerCore`'s (the one
vLLM's own model runner drives too, ``vtoken.vllm_engine``): requests that left, copies seen
done, releases and block lists first (``begin``); then, in the output's request order, each
request's chunk (a decode step evicts first, then its tokens get their slots), computed here
(a decode reads the live tokens through ``slot_mapping`` and writes the new token's K/V; a
prefill chunk attends causally over the live tokens before it plus itself; a request whose
chunk reaches its last known token samples one token, greedy) and its attention statistics
handed to the policy; then stage 4, the step's plans copied after the forward (``end``).

It returns a ``ModelRunnerOutput`` with the sampled tokens and a :class:`WorkerReport` as
``vtoken_report`` (plain data: outcomes, full-context lengths, counters, the table's changes).
With the same evictions, runs with and without reclamation give the same tokens.

Owns: the K/V cache (``KVCache``) and its ``WorkerCore`` (its own token table, the copy
engine and copy side, the policy).
May call: ``vtoken.model``, ``WorkerCore``, torch; vLLM's output types; the relocation checker
only as a factory the toolkit passes in (``check_relocations``).
Costs: a step is the decoder's forward over the scheduled tokens plus the core's cost.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..copy_engine import checker_factory
from ..errors import OrderError
from ..fields import need_choice, need_device, need_instance, need_int, need_number, refuse
from ..model.decoder import DecodeItem, PagedDecoder, Windowed, _Group, greedy
from ..table import TokenTable
from .layout import WorkerLayout
from .messages import LoggedTable, WorkerReport
from .worker_core import WorkerCore

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


class VTokenWorker:
    """Executes the adapter's ``SchedulerOutput``s with a real decoder and K/V cache.

    Args:
        model: the ``PagedDecoder`` (its config fixes the K/V geometry).
        table: the worker's own token table (a ``messages.LoggedTable``, or a plain
            ``TokenTable`` whose geometry it takes: the worker then makes its own). The adapter
            keeps a replica, kept equal by replaying the worker's reported changes; the two are
            never one object (``AdapterDriver`` refuses that).
        num_blocks, block_size: vLLM's pool geometry (block ids index the cache directly).
        policy, policy_kwargs, evict_ratio, seed: eviction (``vtoken.policies``).
        check_relocations: None, or the relocation checker's factory ``(kv, table, out_dir=)
            -> checker``; the worker owns the checker it builds. With a sliding-window group
            the checker must also take ``guard_outside(reads, name)`` (the window's slots the
            next step reads, ``WorkerCore.window_reads``), else ``CallError``.
        snapshot_dir: where a failing relocation's snapshot goes.
        copy_lag: a copy completes on its ``copy_lag``-th poll (``KVCopyEngine(lag=...)``).
        copy_engine_factory: ``(kv, block_size, lag=...) -> engine`` (default :class:`KVCopyEngine`).
        layout: vLLM's KV cache groups as the worker reads them (``layout.WorkerLayout``; None:
            one full-attention group). With a sliding-window group, the model's windowed layers
            write and read that group's blocks by position, the last ``window`` tokens.
    Arguments are checked first (:func:`check_worker_config`). The table bookkeeping, eviction
    and the copy side are :class:`~.worker_core.WorkerCore`'s (shared with vLLM's engine path);
    this class computes with the decoder.
    """

    def __init__(self, model: PagedDecoder, table: TokenTable, num_blocks: int, block_size: int, *,
                 policy: str = "h2o", policy_kwargs: dict | None = None, evict_ratio: float = 0.5,
                 seed: int = 0, check_relocations=None, snapshot_dir=None, copy_lag: int = 0,
                 device: str = "cpu", copy_engine_factory=None, layout: WorkerLayout | None = None):
        c = check_worker_config(model=model, table=table, num_blocks=num_blocks, block_size=block_size, policy=policy,
                                policy_kwargs=policy_kwargs, evict_ratio=evict_ratio, seed=seed,
                                check_relocations=check_relocations, snapshot_dir=snapshot_dir, copy_lag=copy_lag,
                                device=device, copy_engine_factory=copy_engine_factory, layout=layout)
        if not isinstance(table, LoggedTable):  # its own table, of the same geometry
            table = LoggedTable(table.S, table.num_blocks, device=table.device)
        self.model = model
        self.S = c["block_size"]
        self.kv = model.make_kv_cache(c["num_blocks"], self.S, device=device)
        self.core = WorkerCore(self.kv, table, self.S, policy=policy, policy_kwargs=policy_kwargs,
                               evict_ratio=c["evict_ratio"], seed=c["seed"], check_relocations=check_relocations,
                               snapshot_dir=snapshot_dir, copy_lag=c["copy_lag"],
                               copy_engine_factory=copy_engine_factory, layout=layout)
        self.layout = self.core.layout
        self._chunks: dict = {}  # this step's chunks, computed before its forward (``WorkerCore.chunks``)
        self.window_layers = self.layout.window_layers(model.config.num_layers)

    # the core's rooms, read by tests and the toolkit
    table = property(lambda self: self.core.table)
    copy_engine = property(lambda self: self.core.copy_engine)
    engine = property(lambda self: self.core.engine)
    checker = property(lambda self: self.core.checker)
    copies = property(lambda self: self.core.copies)
    policy = property(lambda self: self.core.policy)
    reqs = property(lambda self: self.core.reqs)
    faithful = property(lambda self: self.core.faithful)
    stats = property(lambda self: self.core.stats)
    evict_ratio = property(lambda self: self.core.evict_ratio)
    hash_checks = property(lambda self: self.core.hash_checks)
    hash_failures = property(lambda self: self.core.hash_failures)

    def evict_tokens(self, r: str, token_ids) -> None:
        """Evict tokens of ``r`` between or inside steps (``WorkerCore.evict_tokens``)."""
        self.core.evict_tokens(r, token_ids)

    # ------------------------------------------------------------------ the step
    def execute(self, sched_out):
        """Run one ``SchedulerOutput``; returns a ``ModelRunnerOutput`` (with ``vtoken_report``)."""
        from vllm.v1.outputs import ModelRunnerOutput

        rep = WorkerReport()
        starts = self.core.begin(sched_out, rep)
        # every request's chunk first (one table call for the step's one-token evictions and growths)
        self._chunks = self.core.chunks([(r, starts[r], int(k)) for r, k in sched_out.num_scheduled_tokens.items()])
        sampled: dict[str, list[int]] = {}
        for r, k in sched_out.num_scheduled_tokens.items():  # compute, in the output's request order
            tok = self._run_request(r, starts[r], int(k), rep)
            sampled[r] = [tok] if tok is not None else []
        self.core.end(sched_out, rep)
        ids = list(sched_out.num_scheduled_tokens)
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[sampled[r] for r in ids])
        out.vtoken_report = rep
        return out

    def _run_request(self, r: str, start: int, k: int, rep: WorkerReport) -> Optional[int]:
        ch = self._chunks.pop(r, None) or self.core.chunk(r, start, k)
        w = self.reqs[r]
        toks = w.tokens
        model, kv = self.model, self.kv
        if ch.decode and w.wblocks is None:
            logits, stats = model.decode_step(kv, [DecodeItem(int(toks[start]), start, int(ch.write[0]), ch.read)])
        else:  # a prefill chunk, or any chunk of a hybrid model (its windowed layers read their own group)
            ids = torch.as_tensor(toks[start:start + k], dtype=torch.int64)
            pos = torch.arange(start, start + k, dtype=torch.int64)
            ws = torch.from_numpy(np.ascontiguousarray(ch.write)).to(kv.device)
            keys = torch.cat([ch.read.to(kv.device), ws])
            windowed = self._windowed(r, w, start, k) if w.wblocks is not None else None
            with torch.inference_mode():
                logits, stats = model._forward(kv, ids, pos, ws, [_Group(0, k, keys, True)], slice(k - 1, k),
                                               windowed=windowed)
        self.core.observe(ch, stats[0].numpy())
        if ch.last:
            nxt = int(greedy(logits[0]))
            self.core.sampled(r, nxt)
            return nxt
        return None

    def _window_slots(self, r: str, w, lo: int, hi: int) -> torch.Tensor:
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

    def _windowed(self, r: str, w, start: int, k: int) -> Windowed:
        """The windowed layers of a hybrid model for the chunk ``[start, start + k)``: they write
        the chunk and attend over the last ``window`` positions of the sliding-window group."""
        lo = self.core.window_start(start)  # one rule with what the relocation checker guards
        keys = self._window_slots(r, w, lo, start + k)
        return Windowed(self.window_layers, keys[start - lo:], [_Group(0, k, keys, True, self.layout.window)])

    def synchronize(self) -> WorkerReport:
        """Host-wait every copy still in flight and apply it (idle / teardown)."""
        return self.core.synchronize()
