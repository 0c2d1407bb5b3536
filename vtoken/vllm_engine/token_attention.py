"""The compute of vtoken's attention backend, plain torch (no vLLM): the same code on CPU and
CUDA (``tests/test_gpu.py`` checks it there when a device is lent).

A layer's cache is viewed as token rows ``[slots, heads, 2 * head_size]`` (K then V;
:func:`token_rows`). :func:`attend_rows` writes the step's new K/V at their slots, then, per
request, gathers the K/V of exactly the slots it reads (its live tokens in logical order, then
its chunk's) and attends with :func:`vtoken.model.decoder.attend`, the decoder's own attention.
Owns: nothing (the caller's tensors).
May call: torch, vtoken.model.decoder, vtoken.errors.
Costs: per request O(keys read x heads x head size) for the gather and the attention.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..model.decoder import attend

__all__ = ["token_rows", "attend_rows"]


def token_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The ``[blocks * block_size, heads, 2 * head_size]`` view of one layer's cache (logical
    ``[blocks, heads, block_size, 2 * head_size]``, physically block, token, head: vLLM's LBNHC
    layout); a view, so writes land in the cache; refused (``ConfigError``) when it would be a copy."""
    b, h, n, c = kv_cache.shape
    try:
        return kv_cache.permute(0, 2, 1, 3).view(b * n, h, c)
    except RuntimeError:
        raise ConfigError("unsupported", f"vtoken's attention needs the KV cache's tokens contiguous per block (the "
                                         f"LBNHC layout): strides {kv_cache.stride()} for shape "
                                         f"{tuple(kv_cache.shape)}") from None


def attend_rows(rows: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                write_slots: torch.Tensor, groups: list, scale: float, output: torch.Tensor, stats: dict) -> None:
    """One layer of the step. ``query`` ``[n, Hq, D]``, ``key`` / ``value`` ``[n, Hkv, D]`` (the step's
    new tokens in batch order, written first at ``write_slots``); ``groups``: per request ``(req,
    lo, hi, key_slots)``, its queries ``[lo, hi)`` attending causally over ``key_slots`` (the
    chunk's own slots last); ``output[lo:hi]`` ``[.., Hq, D]`` receives the result and
    ``stats[req]`` accumulates the probability each key received (float32, on the host)."""
    d = query.shape[-1]
    rows.index_copy_(0, write_slots, torch.cat([key, value], dim=-1).to(rows.dtype))
    for r, lo, hi, keys in groups:
        kv = rows.index_select(0, keys.to(rows.device))
        o, stat = attend(query[lo:hi], kv[..., :d].to(query.dtype), kv[..., d:].to(query.dtype), scale, True)
        output[lo:hi] = o.view(hi - lo, query.shape[1], d).to(output.dtype)
        s = stat.float().cpu()
        acc = stats.get(r)
        stats[r] = s if acc is None else acc + s
