"""KVCache: layout, bitwise write/gather/copy round-trips, parallel-copy semantics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken.kvcache import KVCache

L, NB, S, H, D = 3, 6, 4, 2, 5


def make(dtype=torch.float32, seed=0) -> KVCache:
    kv = KVCache(L, NB, S, H, D, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    kv.kv.copy_(torch.randn(kv.kv.shape, generator=g).to(dtype))
    return kv


def test_layout_and_slot_formula():
    kv = KVCache(L, NB, S, H, D)
    assert kv.kv.shape == (L, 2, NB, S, H, D)
    assert kv.num_slots == NB * S
    assert kv.bytes_per_token == 2 * L * H * D * 4
    k = torch.randn(1, H, D)
    v = torch.randn(1, H, D)
    block, offset = 4, 3
    kv.write(1, kv.slots_of([block], [offset]), k, v)
    assert torch.equal(kv.kv[1, 0, block, offset], k[0])
    assert torch.equal(kv.kv[1, 1, block, offset], v[0])
    assert kv.kv[0].abs().sum() == 0 and kv.kv[2].abs().sum() == 0  # other layers untouched
    assert kv.flat.data_ptr() == kv.kv.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_gather_roundtrip_bitwise(dtype):
    kv = KVCache(L, NB, S, H, D, dtype=dtype)
    slots = torch.tensor([17, 3, 22, 0, 9])
    k = torch.randn(5, H, D).to(dtype)
    v = torch.randn(5, H, D).to(dtype)
    k[0, 0, 0] = -0.0  # sign of zero must survive
    kv.write(2, slots, k, v)
    gk, gv = kv.gather(2, slots)
    assert torch.equal(gk.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(gv.view(torch.uint8), v.view(torch.uint8))
    order = torch.tensor([3, 0, 4])  # gather returns the requested order
    gk2, _ = kv.gather(2, slots[order])
    assert torch.equal(gk2, k[order])
    gk2.fill_(7)  # a copy, not a view
    assert torch.equal(kv.gather(2, slots)[0], k)


def test_copy_slots_all_layers_and_sources_kept():
    kv = make()
    before = kv.kv.clone()
    src, dst = torch.tensor([1, 5, 9]), torch.tensor([20, 21, 22])
    kv.copy_slots(src, dst)
    assert torch.equal(kv.slot_bytes(dst), kv.slot_bytes(src))
    f0 = before.view(L, 2, NB * S, H, D)
    assert torch.equal(kv.flat[:, :, dst], f0[:, :, src])
    assert torch.equal(kv.flat[:, :, src], f0[:, :, src])
    untouched = [i for i in range(NB * S) if i not in (20, 21, 22)]
    assert torch.equal(kv.flat[:, :, untouched], f0[:, :, untouched])


@pytest.mark.parametrize("src,dst", [
    ([0, 1, 2], [1, 2, 3]),      # shift forward: a naive loop would smear slot 0
    ([1, 2, 3], [0, 1, 2]),      # shift backward
    ([4, 7], [7, 4]),            # swap
    ([5, 5, 5], [10, 11, 12]),   # one source fanned out
])
def test_copy_slots_overlap_is_parallel(src, dst):
    kv = make(seed=1)
    ref = kv.flat.clone()
    ref[:, :, dst] = kv.flat[:, :, src].clone()
    kv.copy_slots(torch.tensor(src), torch.tensor(dst))
    assert torch.equal(kv.flat, ref)


def test_slot_errors():
    kv = make()
    with pytest.raises(ValueError):
        kv.copy_slots(torch.tensor([1, 2]), torch.tensor([3, 3]))
    with pytest.raises(ValueError):
        kv.copy_slots(torch.tensor([1, 2]), torch.tensor([3]))
    with pytest.raises(IndexError):
        kv.gather(0, torch.tensor([-1]))  # torch would wrap this to the last slot
    with pytest.raises(IndexError):
        kv.gather(0, torch.tensor([NB * S]))
    with pytest.raises(IndexError):
        kv.write(L, torch.tensor([0]), torch.zeros(1, H, D), torch.zeros(1, H, D))
    with pytest.raises(ValueError):
        kv.write(0, torch.tensor([0, 0]), torch.zeros(2, H, D), torch.zeros(2, H, D))
    with pytest.raises(ValueError):
        kv.write(0, torch.tensor([0]), torch.zeros(2, H, D), torch.zeros(2, H, D))
    with pytest.raises(TypeError):
        kv.gather(0, torch.tensor([0.0]))
    before = kv.kv.clone()
    with pytest.raises(IndexError):
        kv.copy_slots(torch.tensor([0, 1]), torch.tensor([2, NB * S]))
    assert torch.equal(kv.kv, before)  # a rejected call changes nothing
    kv.copy_slots(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))


def test_slot_bytes_and_digests():
    kv = make(dtype=torch.bfloat16)
    slots = torch.tensor([2, 11, 23])
    b = kv.slot_bytes(slots)
    assert b.dtype == torch.uint8 and b.shape == (3, kv.bytes_per_token)
    # row order is (layer, k/v, head, dim)
    assert torch.equal(b[1].view(torch.bfloat16).view(L, 2, H, D), kv.flat[:, :, 11])
    d = kv.slot_digests(slots)
    assert d.dtype == np.uint64 and len(set(d.tolist())) == 3
    kv.copy_slots(slots, torch.tensor([0, 1, 3]))
    assert np.array_equal(kv.slot_digests(torch.tensor([0, 1, 3])), d)
    # -0.0 and 0.0 compare equal as floats but must hash differently
    kv.fill_slots(torch.tensor([5]), 0.0)
    kv.fill_slots(torch.tensor([6]), -0.0)
    assert torch.equal(kv.flat[:, :, 5], kv.flat[:, :, 6])
    d56 = kv.slot_digests(torch.tensor([5, 6]))
    assert d56[0] != d56[1]


def test_fill_slots():
    kv = make()
    kv.fill_slots(torch.tensor([3, 8]), 123.0)
    assert bool((kv.flat[:, :, [3, 8]] == 123.0).all())
    assert not bool((kv.flat[:, :, 4] == 123.0).any())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, NB * S - 1), min_size=0, max_size=8),
                          st.randoms(use_true_random=False)), max_size=6))
def test_copy_sequences_match_numpy_reference(ops):
    kv = make(seed=2)
    ref = kv.flat.numpy().copy()
    for srcs, rnd in ops:
        dst = rnd.sample(range(NB * S), len(srcs))
        kv.copy_slots(torch.tensor(srcs, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64))
        ref[:, :, dst] = ref[:, :, srcs].copy()
    assert np.array_equal(kv.flat.numpy().view(np.uint32), ref.view(np.uint32))
