"""vtoken's attention in vLLM's engine, its torch part (``vtoken.vllm_engine.token_attention``)
and vLLM's K/V tensors as a ``KVCache`` (``vtoken.vllm_engine.kv``), on the CPU without vLLM's
engine: where the K/V sit never changes what attention computes, and every copy and digest
reaches the tensors vLLM allocated."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtoken.errors import ConfigError
from vtoken.vllm_engine.kv import EngineKV
from vtoken.vllm_engine.token_attention import attend_rows, token_rows


def lbnhc(blocks=16, heads=2, S=8, D=16, layers=2, dtype=torch.float32, seed=0):
    """Per-layer caches shaped as vLLM's (logical [B, H, N, 2D]) with the LBNHC strides."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, S, heads, 2 * D, generator=g, dtype=torch.float32).to(dtype).permute(0, 2, 1, 3)
            for _ in range(layers)]


def _step(rows, keys_of, q, k, v, write):
    out = torch.zeros_like(q)
    stats: dict = {}
    attend_rows(rows, q, k, v, write, keys_of, 0.25, out, stats)
    return out, stats


def test_placement_never_changes_the_result():
    """The same live K/V at other slots (a relocation) gives bitwise the same output and statistics."""
    (cache,) = lbnhc(layers=1)
    rows = token_rows(cache)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 2, 16, generator=g) for _ in range(3))
    live = torch.tensor([9, 2, 30, 17, 5])  # a request's live tokens, logical order
    moved = torch.tensor([40, 41, 42, 43, 44])  # the same tokens after a compaction
    rows[moved] = rows[live]
    w1, w2 = torch.tensor([60, 61, 62]), torch.tensor([70, 71, 72])
    a = _step(rows, [("r", 0, 3, torch.cat([live, w1]))], q, k, v, w1)
    b = _step(rows, [("r", 0, 3, torch.cat([moved, w2]))], q, k, v, w2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1]["r"], b[1]["r"])
    rows[live[2]] = float("nan")  # a poisoned source: the moved read never sees it
    assert torch.equal(_step(rows, [("r", 0, 3, torch.cat([moved, w2]))], q, k, v, w2)[0], b[0])
    assert torch.isnan(_step(rows, [("r", 0, 3, torch.cat([live, w1]))], q, k, v, w1)[0]).any()


def test_the_new_tokens_are_written_at_their_slots_and_read_causally():
    (cache,) = lbnhc(layers=1)
    rows = token_rows(cache)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 16, generator=g) for _ in range(3))
    w = torch.tensor([11, 12])
    out, stats = _step(rows, [("a", 0, 1, w[:1]), ("b", 1, 2, w[1:])], q, k, v, w)
    assert torch.equal(rows[11], torch.cat([k[0], v[0]], dim=-1)) and torch.equal(rows[12], torch.cat([k[1], v[1]], -1))
    assert torch.allclose(out[0], v[0].repeat_interleave(1, 0))  # one key: all the weight on it
    assert stats["a"].tolist() == [1.0] and stats["b"].tolist() == [1.0]


def test_engine_kv_is_vllms_tensors():
    layers = lbnhc()
    kv = EngineKV(layers)
    assert (kv.num_layers, kv.num_blocks, kv.block_size, kv.num_kv_heads, kv.head_dim) == (2, 16, 8, 2, 16)
    src, dst = torch.tensor([3, 9]), torch.tensor([100, 101])
    before = kv.slot_digests(src)
    kv.copy_slots(src, dst)
    assert np.array_equal(kv.slot_digests(dst), before)
    for t in layers:  # landed in vLLM's own per-layer tensors, K and V of every head
        assert torch.equal(t[100 // 8, :, 100 % 8], t[3 // 8, :, 3 % 8])
    k, v = kv.gather(1, torch.tensor([101]))
    assert torch.equal(k[0], layers[1][101 // 8, :, 101 % 8, :16]) and torch.equal(v[0], layers[1][101 // 8, :, 101 % 8, 16:])
    kv.fill_slots(torch.tensor([5]), 0.0)
    assert all(float(t[0, :, 5].abs().sum()) == 0.0 for t in layers)


def test_a_layout_whose_tokens_are_not_rows_is_refused():
    cache = torch.zeros(4, 2, 8, 32)  # [B, H, N, C] contiguous (LBHNC): a token's heads are apart
    with pytest.raises(ConfigError, match="LBNHC"):
        token_rows(cache)
    with pytest.raises(ConfigError, match="LBNHC"):
        EngineKV([cache])
