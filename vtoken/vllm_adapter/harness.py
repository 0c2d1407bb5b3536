"""A real vLLM scheduler on CPU, for contract tests and adapter experiments.

``VllmHarness`` builds vLLM's own ``Scheduler`` (or ``AsyncScheduler``) with a real
``KVCacheManager`` / ``BlockPool``; nothing is mocked. The model is a folder with only a
``config.json`` (``tiny_model/``), the tokenizer is skipped, and the worker is replaced by
fake ``ModelRunnerOutput``s sampling one token per request whose chunk reached the end of
its prompt. Import it before vLLM (:func:`ensure_cpu_env`). Written against vLLM 0.33.0.
``h.step()`` schedules, fakes the output and applies it; ``h.drain()`` runs every request
to its end; with ``async_scheduling=True``, ``h.schedule()`` / ``h.finish(so)`` keep steps
in flight (outputs applied in FIFO order).

Owns: the vLLM configuration objects and the scheduler it builds (the adapter replaces
the scheduler with its own subclass), the fake worker's queue of outputs in flight.
May call: vLLM (``Scheduler``, ``AsyncScheduler``, ``KVCacheManager``), torch (CUDA probe),
the environment (sets ``HF_HUB_OFFLINE``, ``VLLM_TARGET_DEVICE`` when unset).
Costs: building a scheduler is vLLM's cost (about a second); a step is vLLM's step.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # pragma: no cover
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

TINY_MODEL_DIR = Path(__file__).resolve().parent / "tiny_model"
from . import VLLM_VERSION  # noqa: E402,F401 - one definition (the package's)
from ..errors import OrderError  # noqa: E402
from . import layout  # noqa: E402
from .layout import KV_LAYOUTS  # noqa: E402


def ensure_cpu_env() -> None:
    """Set the environment the harness needs, never overriding a caller's value:
    ``HF_HUB_OFFLINE=1``, and ``VLLM_TARGET_DEVICE=cpu`` only when torch sees no CUDA device.
    vLLM resolves its platform once per process, so this runs (at this module's import) before
    vLLM is first imported."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if "VLLM_TARGET_DEVICE" not in os.environ:
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except Exception:  # noqa: BLE001
            has_cuda = False
        if not has_cuda:
            os.environ["VLLM_TARGET_DEVICE"] = "cpu"


ensure_cpu_env()


def vllm_version() -> str | None:
    """vLLM's version, or None when vLLM cannot be imported."""
    ensure_cpu_env()
    try:
        import vllm
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return None
    return getattr(vllm, "__version__", None)


_HASH_READY = False


def _init_hashing() -> Any:
    """vLLM's block hasher needs its global NONE_HASH seeded once per process."""
    global _HASH_READY
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    if not _HASH_READY:
        init_none_hash(sha256)
        _HASH_READY = True
    return sha256


def _vllm_config(
    *,
    block_size: int,
    num_blocks: int,
    prefix_caching: bool,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    async_scheduling: bool,
    enable_chunked_prefill: bool,
) -> Any:
    """Build the VllmConfig for the tiny model with ``num_blocks`` GPU blocks and the asked
    async-scheduling flag; a platform-detection RuntimeError gets the import-order hint."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    model_config = ModelConfig(
        model=str(TINY_MODEL_DIR),
        dtype="float16",
        seed=42,
        skip_tokenizer_init=True,  # the folder holds only config.json
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=enable_chunked_prefill,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=block_size, enable_prefix_caching=prefix_caching
    )
    try:
        vllm_config = VllmConfig(
            model_config=model_config,
            scheduler_config=scheduler_config,
            cache_config=cache_config,
        )
    except RuntimeError as exc:
        if "infer device type" not in str(exc):
            raise
        raise OrderError(
            "not_set_up",
            f"{exc} -- vLLM picked its platform before VLLM_TARGET_DEVICE=cpu was set: "
            "import vtoken.vllm_adapter.harness before vllm, or export "
            "VLLM_TARGET_DEVICE=cpu"
        ) from exc
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    # vLLM's CPU platform switches async scheduling off (vllm/platforms/cpu.py,
    # check_and_update_config); put back what was asked, as on a GPU.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    return vllm_config


def _kv_cache_config(block_size: int, num_blocks: int, kv_layout: str = "full", sliding_window: int = 0) -> Any:
    """The groups of ``kv_layout`` (``KV_LAYOUTS``) over one pool of ``num_blocks`` blocks:
    a full-attention group, and for ``hybrid`` / ``sliding`` a sliding-window group of window
    ``sliding_window`` tokens (vLLM frees its out-of-window blocks); tensors not allocated."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    geo = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    specs = {"full": lambda: FullAttentionSpec(**geo),
             "sliding": lambda: SlidingWindowSpec(**geo, sliding_window=sliding_window)}
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"{kind}{i}"], specs[kind]())
                         for i, kind in enumerate(KV_LAYOUTS[kv_layout])],
    )


def _check_harness(**kw) -> dict:
    """``VllmHarness``'s fields, checked before anything is built (``ConfigError`` naming
    ``VllmHarness.<field>`` and the value); returns them as plain values. Integers >= 1 (vLLM's
    ``Field(ge=1)`` / ``gt=0`` and its pool's ``num_gpu_blocks > 0``), switches bools,
    ``kv_layout`` and ``sliding_window`` as ``config.check_window``, and the combinations vLLM's
    ``SchedulerConfig`` refuses (``config.check_vllm_limits``). O(1)."""
    from ..fields import need_bool, need_int
    from .config import check_vllm_limits, check_window

    own, out = "VllmHarness", dict(kw)
    for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        out[name] = need_int(own, name, kw[name], 1)
    for name in ("prefix_caching", "async_scheduling", "enable_chunked_prefill", "log_stats"):
        out[name] = need_bool(own, name, kw[name])
    out["sliding_window"] = check_window(own, kw["kv_layout"], kw["sliding_window"])
    check_vllm_limits(own, max_num_seqs=out["max_num_seqs"], max_num_batched_tokens=out["max_num_batched_tokens"],
                      max_model_len=out["max_model_len"], chunked_prefill=out["enable_chunked_prefill"])
    return out


class VllmHarness:
    """One real vLLM scheduler + KV-cache manager over the groups of ``kv_layout`` (default one
    full-attention group; ``hybrid``: full attention + a sliding window of ``sliding_window``
    tokens, default two blocks). ``table_group``: the group the token table mirrors
    (``layout.table_group``; None when no group qualifies). Every field is checked before
    anything is built (``_check_harness``: ``ConfigError`` naming ``VllmHarness.<field>``; what
    vLLM's own configuration refuses is refused there first)."""

    def __init__(
        self,
        *,
        block_size: int = 16,
        num_blocks: int = 64,
        prefix_caching: bool = True,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 256,
        max_model_len: int = 1024,
        async_scheduling: bool = False,
        enable_chunked_prefill: bool = True,
        log_stats: bool = False,
        kv_layout: str = "full",
        sliding_window: int | None = None,
    ) -> None:
        c = _check_harness(block_size=block_size, num_blocks=num_blocks, prefix_caching=prefix_caching,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           max_model_len=max_model_len, async_scheduling=async_scheduling,
                           enable_chunked_prefill=enable_chunked_prefill, log_stats=log_stats, kv_layout=kv_layout,
                           sliding_window=sliding_window)
        ensure_cpu_env()
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        block_size, num_blocks = c["block_size"], c["num_blocks"]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = c["prefix_caching"]
        self.async_scheduling = async_scheduling = c["async_scheduling"]

        self.vllm_config = _vllm_config(**{k: c[k] for k in (
            "block_size", "num_blocks", "prefix_caching", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
            "async_scheduling", "enable_chunked_prefill")})
        self.sliding_window = c["sliding_window"] if c["sliding_window"] is not None else 2 * block_size
        self.kv_cache_config = _kv_cache_config(block_size, num_blocks, kv_layout, self.sliding_window)
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = cls(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            block_size=block_size,
            log_stats=c["log_stats"],
            structured_output_manager=StructuredOutputManager(self.vllm_config),
        )
        self._hash_fn = _init_hashing()
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher

        self._block_hasher = (
            get_request_block_hasher(block_size, self._hash_fn) if self.prefix_caching else None
        )
        # Steps scheduled but whose fake worker output is not applied yet (FIFO), each
        # with the ids of the requests that sample a token in it.
        self._in_flight: deque[tuple[SchedulerOutput, set[str]]] = deque()
        self.steps_scheduled = 0
        self.steps_finished = 0

    @classmethod
    def around(cls, scheduler) -> "VllmHarness":
        """A harness over a scheduler built elsewhere (vLLM's engine core or test helpers): the same
        accessors and ``make_request``, the geometry read off the scheduler, nothing rebuilt."""
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        h = cls.__new__(cls)
        h.scheduler = scheduler
        h.vllm_config = scheduler.vllm_config
        h.kv_cache_config = scheduler.kv_cache_config
        g = h.table_group  # the token table's block size is its group's (groups may differ)
        h.block_size = int(h.managers[g].block_size if g is not None else scheduler.block_size)
        h.num_blocks = int(scheduler.kv_cache_config.num_blocks)
        h.prefix_caching = bool(scheduler.cache_config.enable_prefix_caching)
        h.async_scheduling = isinstance(scheduler, AsyncScheduler)
        h._hash_fn = _init_hashing()
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher

        h._block_hasher = get_request_block_hasher(h.block_size, h._hash_fn) if h.prefix_caching else None
        h._in_flight = deque()
        h.steps_scheduled = h.steps_finished = 0
        return h

    # ----------------------------------------------------------------- accessors
    @property
    def kv_cache_manager(self):
        """``vllm.v1.core.kv_cache_manager.KVCacheManager``."""
        return self.scheduler.kv_cache_manager

    @property
    def pool(self):
        """``vllm.v1.core.block_pool.BlockPool``."""
        return self.scheduler.kv_cache_manager.block_pool

    block_pool = pool

    @property
    def managers(self) -> list:
        """Every KV cache group's ``SingleTypeKVCacheManager``, in vLLM's group order."""
        return list(self.scheduler.kv_cache_manager.coordinator.single_type_managers)

    @property
    def table_group(self):
        """The index of the group the token table mirrors (``layout.table_group``), or None.
        Derived once per scheduler's KV cache coordinator (its groups are fixed when it is
        built): ``req_to_blocks`` reads it on every hook."""
        coord = self.scheduler.kv_cache_manager.coordinator
        cached = getattr(self, "_table_group", None)
        if cached is None or cached[0] is not coord:
            cached = self._table_group = (coord, layout.table_group(list(coord.single_type_managers)))
        return cached[1]

    @property
    def manager(self):
        """The ``SingleTypeKVCacheManager`` of the token table's group (``table_group``); with
        no such group, the first group's (nothing is mirrored then)."""
        g = self.table_group
        return self.managers[0 if g is None else g]

    @property
    def req_to_blocks(self):
        """Live ``req_id -> list[KVCacheBlock]`` of the manager (mutating it is visible)."""
        return self.manager.req_to_blocks

    def all_lists(self):
        """``(group, request, block list)`` over every group's live lists (vLLM's own)."""
        for g, m in enumerate(self.managers):
            for r, lst in m.req_to_blocks.items():
                yield g, r, lst

    @property
    def num_cached_block(self):
        """Live ``req_id -> number of prefix-cached (hashed) blocks``."""
        return self.manager.num_cached_block

    def blocks(self, req_id: str) -> list:
        """The request's live block list (empty when it holds none)."""
        return self.manager.req_to_blocks.get(req_id, [])

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.blocks(req_id)]

    def free_count(self) -> int:
        return self.pool.get_num_free_blocks()

    def free_queue_ids(self) -> list[int]:
        """Block ids in the pool's free queue, head (next handed out) first."""
        return [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]

    def request(self, req_id: str):
        return self.scheduler.requests.get(req_id)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    # ------------------------------------------------------------------ requests
    def make_request(
        self,
        req_id: str,
        prompt_token_ids: Iterable[int],
        *,
        max_tokens: int = 16,
        priority: int = 0,
    ) -> "Request":
        """A vLLM ``Request`` (with the block hasher when prefix caching is on)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(ignore_eos=True, max_tokens=max_tokens)
        return Request(
            request_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            pooling_params=None,
            priority=priority,
            block_hasher=self._block_hasher,
        )

    def add_request(self, req_id: str, prompt_token_ids: Iterable[int], **kw) -> "Request":
        req = self.make_request(req_id, prompt_token_ids, **kw)
        self.scheduler.add_request(req)
        return req

    def has_requests(self) -> bool:
        return bool(self.scheduler.has_requests())

    # --------------------------------------------------------------------- steps
    def schedule(self) -> "SchedulerOutput":
        """``Scheduler.schedule()``; the step stays in flight until ``finish``."""
        sched_out = self.scheduler.schedule()
        sampling: set[str] = set()
        for req_id in sched_out.num_scheduled_tokens:
            req = self.scheduler.requests[req_id]
            is_chunk = getattr(req, "is_prefill_chunk", None)
            if is_chunk is None:
                is_chunk = req.num_computed_tokens < req.num_tokens + getattr(
                    req, "num_output_placeholders", 0
                )
            if not is_chunk:
                sampling.add(req_id)
        self._in_flight.append((sched_out, sampling))
        self.steps_scheduled += 1
        return sched_out

    def fake_output(self, sched_out: "SchedulerOutput", sampling: set[str], token: int = 7):
        """The ``ModelRunnerOutput`` a worker would return for ``sched_out``."""
        from vllm.v1.outputs import ModelRunnerOutput

        ids = list(sched_out.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[token] if r in sampling else [] for r in ids],
        )

    def finish(self, sched_out: "SchedulerOutput | None" = None, token: int = 7):
        """Apply the fake worker output of the oldest in-flight step (which must be
        ``sched_out`` when given) through ``Scheduler.update_from_output``."""
        if not self._in_flight:
            raise OrderError("out_of_order", "finish() with no step in flight")
        oldest, sampling = self._in_flight.popleft()
        if sched_out is not None and sched_out is not oldest:
            raise OrderError("out_of_order", "steps must be finished in the order they were scheduled")
        result = self.scheduler.update_from_output(
            oldest, self.fake_output(oldest, sampling, token)
        )
        self.steps_finished += 1
        return result

    def step(self) -> "SchedulerOutput":
        """Schedule one step and apply its output at once (no step left in flight)."""
        sched_out = self.schedule()
        while self._in_flight:
            self.finish()
        return sched_out

    def drain(self, max_steps: int = 10_000) -> int:
        """Step until no request is left; returns the number of steps taken."""
        n = 0
        while self._in_flight:
            self.finish()
        while self.has_requests():
            if n >= max_steps:
                raise OrderError("did_not_finish", f"requests still pending after {max_steps} steps")
            self.step()
            n += 1
        return n
