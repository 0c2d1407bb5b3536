"""No host sync on the table's device side (issue 15 item 1, the table part).

On CUDA a shape that depends on device data (boolean-mask indexing, ``nonzero``,
``.item()``) makes the host wait for the device, and a copy from pageable host memory is
synchronous. The table's device work (the lookup cache's flush, ``read_view``,
``slot_mapping``) must have none: every index and size comes from the host's own arrays,
and uploads are staged in pinned memory with ``non_blocking=True`` on CUDA.

Checked here without a GPU, three ways, over one workload that reaches every device path
(batch and one-token growth, segment growth, evictions, moves, releases, freed segments,
a dirty rebuild, the append path and the cache's own growth of the slot mapping):

1. every aten op the workload dispatches is recorded; none is data-dependent;
2. the same workload on the ``meta`` device, which has no data: any data-dependent shape
   or host read raises there;
3. with the pool's CUDA staging switched on (on ``meta``), every upload is a pinned tensor
   copied with ``non_blocking=True``; on CPU the plain path (a zero-copy view) is kept.

On a GPU (``-m gpu``) the workload runs under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vtoken import TokenTable

S = 4
NB = 64

aten = torch.ops.aten
# Ops whose output shape or host result depends on device data: each is a device-to-host sync on CUDA.
DATA_DEPENDENT = {
    aten.nonzero.default, aten.nonzero.out, aten.argwhere.default, aten.masked_select.default,
    aten.masked_select.out, aten.masked_scatter.default, aten._local_scalar_dense.default, aten.item.default,
    aten.is_nonzero.default, aten.equal.default, aten._unique.default, aten._unique2.default,
    aten.unique_dim.default, aten.unique_consecutive.default, aten.allclose.default,
}
INDEXING = {aten.index.Tensor, aten.index.Tensor_out, aten.index_put_.default, aten.index_put.default,
            aten._index_put_impl_.default}


class DataDependentOps(TorchDispatchMode):
    """Records every op that would make the host wait on CUDA: the ops above, and indexing
    with a boolean (or uint8) mask, whose result size is the mask's count."""

    def __init__(self):
        super().__init__()
        self.bad: list[str] = []
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.add(str(func))
        if func in DATA_DEPENDENT:
            self.bad.append(str(func))
        elif func in INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
                self.bad.append(f"{func} with a boolean mask")
        return func(*args, **kwargs)


def workload(t: TokenTable, check=None) -> None:
    """Every device path of the table, with a slot mapping read after each structural change."""
    def read(rid):
        m = t.slot_mapping(rid)
        t.read_view(rid)
        if check is not None:
            check(t, rid, m)

    a = list(range(1, 9))  # "a"'s positional block list, as a scheduler holds it
    t.sync_new_tokens("a", a, 10)  # batch growth
    read("a")
    t.sync_new_tokens("a", a, 11)  # one token: the append path of the mapping
    read("a")
    t.evict_tokens("a", [1, 4, 7])  # batch eviction: dirty mapping, rebuilt
    read("a")
    t.evict_tokens("a", [0])  # one-token eviction
    read("a")
    t.sync_new_tokens("b", [50, 51], 5)
    t.flush()  # an explicit flush of queued writes of two requests
    read("b")
    # tokens 2 and 3 (block 1) move into fresh block 20: block 1 empties and is freed
    assert t.apply_moves("a", [(2, 1, 2, 20, 0), (3, 1, 3, 20, 1)]) == [1]
    read("a")
    t.evict_tokens("a", [5, 6])  # block 2 (tokens 4..7) now holds no live token
    assert t.release_empty_blocks("a", [2]) == [2]
    a[0] = a[1] = 0  # freed positions hold the null block
    read("a")
    a += list(range(21, 48))
    t.sync_new_tokens("a", a, 100)  # segment growth (64 -> 128 entries): a device copy
    read("a")
    for n in range(101, 140):  # the mapping's own buffer grows on the append path
        t.sync_new_tokens("a", a, n)
    read("a")
    t.free_request("b")  # a released segment
    t.sync_new_tokens("c", [60], 3)  # reuses it
    read("c")
    t.evict_tokens("c", np.array([1], dtype=np.int64))
    read("c")


def _host_mapping(t, rid):
    ids = t.live_tokens(rid)
    return t.slots(rid)[ids].tolist()


def test_no_data_dependent_op_on_the_device_side():
    t = TokenTable(S, NB)
    seen = []

    def check(t, rid, m):
        seen.append(rid)
        assert m.tolist() == _host_mapping(t, rid)  # (tolist here is the test's own read)

    mode = DataDependentOps()
    with mode:
        workload(t)
    assert not mode.bad, f"data-dependent ops on the table's device side: {sorted(set(mode.bad))}"
    assert "aten.index_select.out" in mode.ops  # the dirty rebuild is a gather with host-built indices
    workload(TokenTable(S, NB), check)  # and the same workload gives the right mappings
    assert len(seen) == 11


def test_the_workload_runs_on_a_device_without_data():
    """``meta`` tensors have shapes and no values: a mask index, ``nonzero`` or ``.item()``
    on the device side raises there."""
    t = TokenTable(S, NB, device="meta")
    lens = []
    workload(t, lambda t, rid, m: lens.append((len(m), t.num_live(rid))))
    assert all(a == b for a, b in lens), lens  # every mapping's length came from the host
    assert t.slot_mapping("a").device.type == "meta"


def test_cuda_staging_is_pinned_and_non_blocking(monkeypatch):
    """With the pool's CUDA staging on (here on ``meta``: this machine has no pinned
    allocator), every host-to-device upload is a pinned tensor copied with non_blocking."""
    pinned, uploads = set(), []
    to = torch.Tensor.to

    def fake_pin(self):  # records which host tensors were pinned
        pinned.add(id(self))
        return self

    def recording_to(self, *a, **k):
        out = to(self, *a, **k)
        if self.device.type == "cpu" and out.device.type != "cpu":
            uploads.append((id(self) in pinned, k.get("non_blocking", False)))
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    t = TokenTable(S, NB, device="meta")
    t._pool.pinned = True  # what a CUDA table sets by itself
    workload(t)
    assert len(uploads) >= 10, uploads
    assert all(p and nb for p, nb in uploads), f"uploads not pinned / blocking: {uploads}"


def test_cpu_keeps_the_plain_path(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    t = TokenTable(S, NB)
    assert not t._pool.pinned
    workload(t)
    assert not calls


@pytest.mark.gpu
def test_no_host_sync_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    t = TokenTable(S, NB, device="cuda")
    assert t._pool.pinned
    t.sync_new_tokens("warm", [63], 1)  # first use: CUDA context, allocator, pinned pool
    t.slot_mapping("warm")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        workload(t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for rid in ("a", "c"):
        assert t.slot_mapping(rid).cpu().tolist() == _host_mapping(t, rid)
