"""vtoken's attention backend inside vLLM's model: token-level reads through the token table.

vLLM's kernels read positions ``0..seq_len-1`` through the block table and return no attention
weights, so evicted tokens cannot be skipped through their inputs. This backend replaces them
for the engines vtoken runs in (selected per process by ``plugin.install``): per attention layer
it writes the step's new K/V at the slots the worker's token table chose and reads exactly the
live slots of each request (then the chunk itself, causally): ``token_attention.attend_rows``,
with the decoder's own attention (plain torch: the same code on CPU and CUDA). The
probability each key received is summed over the layers into the step's statistics, which the
worker hands to the eviction policy (H2O, Scissorhands).

The KV layout is plain: vLLM's logical ``[blocks, heads, block_size, 2 * head_size]`` per layer
with the ``LBNHC`` stride order, so a token's K and V of one layer are one contiguous row of the
view ``[blocks * block_size, heads, 2 * head_size]`` (K first): a token move is a row copy.

What crosses from the worker to the backend is :data:`STEP` (same process: the worker publishes
each scheduled request's :class:`~vtoken.vllm_adapter.worker_core.Chunk` before vLLM's forward).
The metadata builder orders them as vLLM's batch does (``input_batch.req_ids``) and checks that
vLLM's own slot mapping (positional, through the worker's block-table rows) names the slots the
token table chose: a row that disagrees with the table is refused (``OrderError``).
Owns: :data:`STEP`'s per-step contents (published by the worker, cleared after the forward).
May call: torch, ``token_attention``, vLLM's attention interfaces.
Costs: per layer O(keys read) gathers and the attention itself per request; the builder
O(requests + new tokens) per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, AttentionType
from vllm.v1.kv_cache_layout import KVCacheLayout

from ..errors import ConfigError, OrderError
from .token_attention import attend_rows, token_rows

__all__ = ["STEP", "StepPlan", "VTokenAttentionBackend", "LAYOUT", "token_rows"]  # token_rows: token_attention's

LAYOUT = KVCacheLayout.LBNHC  # a token's K|V of one layer is one contiguous row


@dataclass
class StepPlan:
    """The worker's plan of the step for the backend (one per worker process)."""

    chunks: dict = field(default_factory=dict)  # req_id -> Chunk (read slots, write slots, ...)
    runner: object = None  # the model runner: its input_batch gives vLLM's request order
    stats: dict = field(default_factory=dict)  # req_id -> float32 [keys], summed over layers
    active: bool = False

    def publish(self, runner, chunks: dict) -> None:
        self.runner, self.chunks, self.stats, self.active = runner, chunks, {}, True

    def clear(self) -> None:
        self.chunks, self.active = {}, False


STEP = StepPlan()


@dataclass
class VTokenAttentionMetadata:
    num_actual_tokens: int
    rows: Optional[list] = None  # per request in batch order: (req_id, q_lo, q_hi, key slots); None: a dummy run
    write_slots: Optional[torch.Tensor] = None  # [num_actual_tokens]


class VTokenMetadataBuilder(AttentionMetadataBuilder[VTokenAttentionMetadata]):
    reorder_batch_threshold = None  # vLLM's batch order is kept

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        cam = common_attn_metadata
        n = int(cam.num_actual_tokens)
        if not STEP.active:  # a profiling or warm-up run: nothing of any request is read or written
            return VTokenAttentionMetadata(n)
        req_ids = STEP.runner.input_batch.req_ids[:cam.num_reqs]
        qsl = cam.query_start_loc_cpu.tolist()
        rows, writes = [], []
        for i, r in enumerate(req_ids):
            ch = STEP.chunks.get(r)
            lo, hi = qsl[i], qsl[i + 1]
            if ch is None or hi - lo != ch.k:
                raise OrderError("state_mismatch", f"vtoken attention: request {r!r} has {hi - lo} query tokens in "
                                                   f"vLLM's batch, the worker prepared {ch.k if ch else 'none'}")
            w = torch.from_numpy(ch.write)
            rows.append((r, lo, hi, torch.cat([ch.read.cpu(), w])))
            writes.append(w)
        write = torch.cat(writes) if writes else torch.empty(0, dtype=torch.int64)
        vllm_slots = cam.slot_mapping[:n].to("cpu", torch.int64)
        if not torch.equal(vllm_slots, write):
            bad = int((vllm_slots != write).nonzero()[0])
            raise OrderError("state_mismatch", f"vtoken attention: new token #{bad} of the step goes to slot "
                                               f"{int(write[bad])} in the token table, vLLM's block table says "
                                               f"{int(vllm_slots[bad])} (a worker block-table row differs from the "
                                               f"table)")
        return VTokenAttentionMetadata(n, rows, write.to(self.device))


class VTokenAttentionImpl(AttentionImpl):
    """Writes the step's K/V through the token table's slots, reads each request's live slots."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto", logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name=None, **extra):
        unsupported = [name for name, bad in (
            ("alibi_slopes", alibi_slopes is not None), ("sliding_window", sliding_window is not None),
            ("logits_soft_cap", bool(logits_soft_cap)), ("attn_type", attn_type != AttentionType.DECODER),
            ("kv_sharing_target_layer_name", kv_sharing_target_layer_name is not None),
            ("kv_cache_dtype", kv_cache_dtype not in ("auto", None)),
            ("sinks", extra.get("sinks") is not None)) if bad]
        if unsupported:
            raise ConfigError("unsupported", f"vtoken attention supports decoder full attention only; this layer "
                                             f"sets {unsupported}")
        self.num_heads, self.head_size, self.scale = int(num_heads), int(head_size), float(scale)
        self.num_kv_heads = int(num_kv_heads or num_heads)
        self._rows: dict = {}  # data_ptr of a layer's cache -> its token-row view

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        md = attn_metadata
        if md is None or md.rows is None:  # warm-up / profiling: nothing read or written
            return output
        n = md.num_actual_tokens
        rows = self._rows.get(kv_cache.data_ptr())
        if rows is None:
            rows = self._rows[kv_cache.data_ptr()] = token_rows(kv_cache)
        attend_rows(rows, query[:n], key[:n], value[:n], md.write_slots, md.rows, self.scale, output, STEP.stats)
        return output


class VTokenAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update = True
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return VTokenAttentionImpl

    @staticmethod
    def get_builder_cls():
        return VTokenMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (LAYOUT,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False
