"""vtoken's worker inside vLLM's engine: ``LLM(worker_cls="vtoken.vllm_engine.worker.Worker")``.

:class:`Worker` is vLLM's platform worker (``CPUWorker`` on the CPU build) with vtoken's worker
half around vLLM's own forward. Per ``execute_model(scheduler_output)``:

1. before the forward, :class:`EngineSide` runs ``WorkerCore.begin`` (requests that left, copies
   seen done applied, releases, block lists) and, per scheduled request, ``WorkerCore.chunk``
   (eviction on a decode step, then the new tokens' slots) and publishes the chunks to the
   attention backend (``attention.STEP``);
2. vLLM's model runner runs its forward (vLLM's model, sampler, block tables): vtoken's
   backend writes each new token's K/V at its table slot and reads exactly the live slots;
3. after the forward: the attention statistics go to the policy, the step's plans are copied
   over vLLM's own K/V tensors (``kv.EngineKV``) and applied once seen done (stage 4, the
   lifecycle's copy side, hash-and-compare of every relocation when ``check_relocations``),
   and the worker's block-table rows follow the table (entries of released blocks and emptied
   sources become the null block, as on the scheduler side);
4. ``sample_tokens`` (or an output returned by ``execute_model`` directly) carries the
   :class:`~vtoken.vllm_adapter.messages.WorkerReport`, plain data, as ``vtoken_report``.

Without ``additional_config["vtoken"]`` the class is vLLM's worker unchanged.
Owns: its ``EngineSide`` (the ``WorkerCore``: its token table, copy engine, policy).
May call: vLLM's worker and model runner (``input_batch`` block-table rows), ``WorkerCore``,
``attention``, ``kv``, ``plugin``; the relocation checker only through the ``vtoken.hooks``
entry point (``plugin.load_hook``).
Costs: the core's per step, plus O(requests scheduled) to order the chunks and O(entries nulled)
for the rows.
"""

from __future__ import annotations

import copy

from vllm.platforms import current_platform

from ..errors import ConfigError, OrderError
from ..vllm_adapter.messages import LoggedTable, WorkerReport
from ..vllm_adapter.worker_core import WorkerCore
from . import plugin
from .attention import STEP
from .kv import EngineKV
from .settings import EngineSettings

if current_platform.device_type == "cpu":
    from vllm.v1.worker.cpu_worker import CPUWorker as _Base
else:  # pragma: no cover - a CUDA build of vLLM
    from vllm.v1.worker.gpu_worker import Worker as _Base

__all__ = ["Worker", "EngineSide"]


def policy_key(new_request):
    """The key a request's policy state lives under: its sampling seed when it has one (vLLM's
    engine ids carry a random suffix, so a seeded policy, Random, would draw differently in
    every run), else its id."""
    sp = new_request.sampling_params
    seed = getattr(sp, "seed", None)
    return ("seed", int(seed)) if seed is not None else new_request.req_id


class EngineSide:
    """The worker half over vLLM's model runner (see the module docstring)."""

    def __init__(self, runner, kv_cache_config, settings: EngineSettings):
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        groups = kv_cache_config.kv_cache_groups
        specs = [type(g.kv_cache_spec).__name__ for g in groups]
        if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
            raise ConfigError("unsupported", f"vtoken in vLLM's engine supports one full-attention KV cache group; "
                                             f"this model has {specs}")
        if not hasattr(getattr(runner, "input_batch", None), "block_table"):
            raise ConfigError("unsupported", f"vtoken in vLLM's engine needs the V1 model runner's input batch "
                                             f"({type(runner).__name__} has none)")
        self.runner, self.settings = runner, settings
        S, N = int(groups[0].kv_cache_spec.block_size), int(kv_cache_config.num_blocks)
        self.kv = EngineKV(list(runner.kv_caches))
        if (self.kv.block_size, self.kv.num_blocks) != (S, N):
            raise ConfigError("inconsistent", f"vLLM's KV cache is {self.kv.num_blocks} blocks of {self.kv.block_size}, "
                                              f"its config says {N} of {S}")
        checker = plugin.load_hook("relocation_checker") if settings.check_relocations else None
        self.core = WorkerCore(self.kv, LoggedTable(S, N), S, policy=settings.policy,
                               policy_kwargs=settings.policy_kwargs, evict_ratio=settings.evict_ratio,
                               seed=settings.seed, check_relocations=checker, snapshot_dir=settings.snapshot_dir,
                               copy_lag=settings.copy_lag, copy_engine_factory=None, layout=None,
                               budget=settings.budget, policy_key=policy_key)
        self.rep: WorkerReport | None = None
        self.chunks: dict = {}

    def before(self, sched_out) -> None:
        """Steps 1 (and the chunks of 2) of the module docstring."""
        self.rep = WorkerReport()
        starts = self.core.begin(sched_out, self.rep)
        self.chunks = self.core.chunks([(r, starts[r], int(k)) for r, k in sched_out.num_scheduled_tokens.items()])
        STEP.publish(self.runner, self.chunks)

    def after(self, sched_out) -> None:
        """Step 3: statistics to the policy, stage 4, the rows."""
        try:
            for r, ch in self.chunks.items():
                stats = STEP.stats.get(r)
                if stats is None:
                    raise OrderError("state_mismatch", f"vtoken worker: vLLM's forward ran no vtoken attention for "
                                                       f"request {r!r} (is vtoken's attention backend installed?)")
                self.core.observe(ch, stats.numpy())
        finally:
            STEP.clear()
        self.core.end(sched_out, self.rep)
        self._rows()
        if self.settings.checks:
            self._poison_sources()

    def _poison_sources(self) -> None:
        """Sources of the plans applied this step hold nothing anyone may read again (the table
        no longer maps them; they go back to vLLM's pool at their fence): their K/V becomes NaN,
        so a stale read (a slot mapping that missed the move) shows in the outputs, not only in
        a hash. The worker still holds them here: vLLM frees them after this step's report."""
        blocks = self.core.emptied_sources
        if not blocks:
            return
        import torch

        S = self.core.S
        slots = (torch.as_tensor(blocks, dtype=torch.int64)[:, None] * S + torch.arange(S)).reshape(-1)
        self.kv.fill_slots(slots, float("nan"))

    def _rows(self) -> None:
        """The runner's block-table rows follow the table: nulled list entries are nulled there."""
        batch = self.runner.input_batch
        table = batch.block_table[0].block_table.np
        for r, i in self.core.unlisted:
            row = batch.req_id_to_index.get(r)
            if row is not None:
                table[row, i] = 0

    def sampled(self, out) -> None:
        """The tokens vLLM sampled, for the requests whose chunk reached their last known token."""
        ids = getattr(out, "req_ids", None) or ()
        toks = getattr(out, "sampled_token_ids", None) or ()
        for r, t in zip(ids, toks):
            ch = self.chunks.get(r)
            if ch is not None and ch.last and len(t):
                self.core.sampled(r, int(t[-1]))

    def attach(self, out):
        """``out`` carrying this step's report (a copy when it is vLLM's shared empty output)."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        if out is None or self.rep is None:
            return out
        if out is EMPTY_MODEL_RUNNER_OUTPUT:
            out = copy.copy(out)
        out.vtoken_report, self.rep = self.rep, None
        return out


class Worker(_Base):
    """vLLM's worker with vtoken's worker half (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.vtoken_settings = EngineSettings.from_vllm_config(self.vllm_config)
        self.vtoken = None
        if self.vtoken_settings is not None:
            plugin.install()  # vtoken's attention for the model this process builds

    def initialize_from_config(self, kv_cache_config) -> None:
        super().initialize_from_config(kv_cache_config)
        if self.vtoken_settings is not None:
            self.vtoken = EngineSide(self.model_runner, kv_cache_config, self.vtoken_settings)

    def execute_model(self, scheduler_output):
        side = self.vtoken
        if side is None:
            return super().execute_model(scheduler_output)
        side.before(scheduler_output)
        try:
            out = super().execute_model(scheduler_output)
        except BaseException:
            STEP.clear()
            raise
        side.after(scheduler_output)
        return side.attach(out) if out is not None else None

    def sample_tokens(self, grammar_output):
        out = super().sample_tokens(grammar_output)
        side = self.vtoken
        if side is None:
            return out
        side.sampled(out)
        return side.attach(out)

    def vtoken_counters(self) -> dict:
        """The worker's counters (``LLM.collective_rpc("vtoken_counters")``)."""
        return self.vtoken.core.counters() if self.vtoken is not None else {}
