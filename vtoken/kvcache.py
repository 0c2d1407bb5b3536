"""The physical paged KV cache: one tensor, addressed by token slots.

``kv`` has shape ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (dim 1:
0 is K, 1 is V), used through the flat view ``[num_layers, 2, num_blocks * block_size,
num_kv_heads, head_dim]``, where a token's *slot* is ``block * block_size + offset`` (paper
Eq. 2): one index op along dim 2 reaches every layer's K and V of a token.

``checked=True`` (default): every call checks that slots are 1-D int64 inside ``[0,
num_blocks * block_size)`` (negative ones included, which torch would wrap) and that no
write target is named twice; ``checked=False`` skips the host read-back this costs.

Owns: the K/V storage tensor only; which slots are live and who holds them is the table's and the
allocator's (freeing a block is a metadata act there); it never frees or zeroes on its own.
May call: torch, numpy, xxhash; never spec/, invariants/, fuzz/ or reports/.
Costs: one index op along the slot dimension per call, O(slots x layers x K/V bytes);
``checked=True`` reads the slots back to the host; ``slot_digests`` copies the bytes to the host.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash
from .errors import CallError, CallIndexError, CallTypeError, ConfigError

__all__ = ["KVCache"]


class KVCache:
    """Paged K/V storage for all layers, addressed by token slot: the geometry, ``dtype`` (K/V
    cast to it on write), ``device``, ``checked`` (validate slot arguments)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        checked: bool = True,
    ) -> None:
        for name, val in (("num_layers", num_layers), ("num_blocks", num_blocks),
                          ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                          ("head_dim", head_dim)):
            if int(val) <= 0:
                raise ConfigError("out_of_range", f"{name} must be positive, got {val}")
        self.num_layers = int(num_layers)
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.dtype = dtype
        self.device = torch.device(device)
        self.checked = checked
        # Zero-initialised so that an unwritten slot has defined bytes (hashes are stable).
        self.kv = torch.zeros(
            (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
             self.head_dim),
            dtype=dtype, device=self.device,
        )
        # A view, not a copy: writes through it land in ``kv``.
        self._flat = self.kv.view(self.num_layers, 2, self.num_slots, self.num_kv_heads,
                                  self.head_dim)

    # ------------------------------------------------------------------ geometry
    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers: ``2 * L * H * D * itemsize``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv.element_size()

    @property
    def flat(self) -> torch.Tensor:
        """The ``[L, 2, num_slots, H, D]`` view (shares storage with ``kv``)."""
        return self._flat

    def slots_of(self, block_ids: torch.Tensor | np.ndarray | list[int],
                 offsets: torch.Tensor | np.ndarray | list[int]) -> torch.Tensor:
        """``block * block_size + offset`` as an int64 tensor on this cache's device."""
        b = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        o = torch.as_tensor(offsets, dtype=torch.int64, device=self.device)
        return b * self.block_size + o

    # ------------------------------------------------------------------ checks
    def _slots(self, slots: torch.Tensor | np.ndarray | list[int], what: str,
               unique: bool = False) -> torch.Tensor:
        s = torch.as_tensor(slots, device=self.device)
        if s.dtype != torch.int64:
            if s.dtype.is_floating_point or s.dtype == torch.bool:
                raise CallTypeError("bad_type", f"{what}: slots must be integers, got {s.dtype}")
            s = s.to(torch.int64)
        if s.dim() != 1:
            raise CallError("bad_shape", f"{what}: slots must be 1-D, got shape {tuple(s.shape)}")
        if self.checked and s.numel():
            lo, hi = int(s.min()), int(s.max())
            if lo < 0 or hi >= self.num_slots:
                raise CallIndexError("out_of_range", f"{what}: slot out of range [0, {self.num_slots}): "
                                 f"min {lo}, max {hi}")
            if unique and s.numel() > 1 and torch.unique(s).numel() != s.numel():
                raise CallError("duplicate_slot", f"{what}: a destination slot is named twice")
        return s

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise CallIndexError("out_of_range", f"layer {layer} out of range [0, {self.num_layers})")

    # ------------------------------------------------------------------ per layer
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k[i]``, ``v[i]`` (each ``[n, H, D]``) at ``slots[i]`` of ``layer``. The slots are
        the caller's (allocated to the writing request) and distinct."""
        self._check_layer(layer)
        s = self._slots(slots, "write", unique=True)
        shape = (s.numel(), self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != shape or tuple(v.shape) != shape:
            raise CallError("bad_shape", f"write: k/v must be {shape}, got {tuple(k.shape)}, {tuple(v.shape)}")
        self._flat[layer, 0].index_copy_(0, s, k.to(self.dtype))
        self._flat[layer, 1].index_copy_(0, s, v.to(self.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` at ``slots``, in the given order, as new ``[n, H, D]`` tensors:
        exact bytes, so the result never depends on where the slots are."""
        self._check_layer(layer)
        s = self._slots(slots, "gather")
        return self._flat[layer, 0].index_select(0, s), self._flat[layer, 1].index_select(0, s)

    # ------------------------------------------------------------------ all layers
    def copy_slots(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy every layer's K and V from ``src_slots[i]`` to ``dst_slots[i]``, as a *parallel*
        copy (a destination that is also a source gets the old bytes). Destinations distinct;
        sources untouched (freeing them is the caller's, after the copy completed)."""
        src = self._slots(src_slots, "copy_slots src")
        dst = self._slots(dst_slots, "copy_slots dst", unique=True)
        if src.numel() != dst.numel():
            raise CallError("bad_shape", f"copy_slots: {src.numel()} sources but {dst.numel()} destinations")
        if src.numel() == 0:
            return
        moved = self._flat.index_select(2, src)  # [L, 2, n, H, D], a fresh tensor
        self._flat.index_copy_(2, dst, moved)

    def fill_slots(self, slots: torch.Tensor, value: float) -> None:
        """Set every layer's K and V at ``slots`` to ``value`` (sentinels in tests)."""
        s = self._slots(slots, "fill_slots")
        self._flat.index_fill_(2, s, value)

    def slot_bytes(self, slots: torch.Tensor) -> torch.Tensor:
        """Raw bytes of each token's K/V over all layers: uint8 ``[n, bytes_per_token]`` on this
        cache's device, row ``i`` in ``(layer, k/v, head, dim)`` order, reinterpreted, never
        converted (-0.0 and NaN payloads are distinguished)."""
        s = self._slots(slots, "slot_bytes")
        per_tok = self._flat.index_select(2, s).permute(2, 0, 1, 3, 4).contiguous()
        return per_tok.view(torch.uint8).reshape(s.numel(), self.bytes_per_token)

    def slot_digests(self, slots: torch.Tensor) -> np.ndarray:
        """xxh3-64 digest of each token's ``slot_bytes`` row: uint64 ``[n]`` (host side), for
        the hash-and-compare of I1."""
        rows = self.slot_bytes(slots).cpu().numpy()
        return np.fromiter((xxhash.xxh3_64_intdigest(r.tobytes()) for r in rows),
                           dtype=np.uint64, count=rows.shape[0])

    def __repr__(self) -> str:
        return (f"KVCache(L={self.num_layers}, blocks={self.num_blocks}, S={self.block_size}, "
                f"H={self.num_kv_heads}, D={self.head_dim}, dtype={self.dtype}, "
                f"device={self.device})")
