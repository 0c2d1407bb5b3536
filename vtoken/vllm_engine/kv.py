"""vLLM's own K/V tensors behind vtoken's ``KVCache`` interface, for the copy engine and the
relocation checks: nothing is copied, every read and write lands in the engine's tensors.

vLLM allocates one ``[blocks, heads, block_size, 2 * head_size]`` view per attention layer
(``model_runner.kv_caches``); with vtoken's backend (``attention.LAYOUT``) each is viewed as
token rows ``[slots, heads, 2 * head_size]`` (K then V). :class:`EngineKV` presents them as
``KVCache`` does, slot ``= block * block_size + offset`` and ``flat`` indexed ``[layer, k|v,
slot, head, dim]``: ``index_select`` / ``index_copy_`` / ``index_fill_`` along the slot
dimension run once per layer on the rows.
Owns: nothing (views of vLLM's tensors; vLLM frees them).
May call: torch, ``vtoken.kvcache``.
Costs: as ``KVCache``, one index op per layer instead of one over all layers.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..kvcache import KVCache
from .token_attention import token_rows

__all__ = ["EngineKV"]


class _Layers:
    """``[L, 2, slots, H, D]`` over per-layer token rows ``[slots, H, 2D]`` (the ops vtoken uses)."""

    def __init__(self, rows: list, head_dim: int):
        self.rows, self.D = rows, int(head_dim)
        slots, h, _ = rows[0].shape
        self.shape = torch.Size((len(rows), 2, slots, h, self.D))

    def _split(self, x: torch.Tensor) -> torch.Tensor:  # [n, H, 2D] -> [2, n, H, D]
        n, h, _ = x.shape
        return x.view(n, h, 2, self.D).permute(2, 0, 1, 3)

    def index_select(self, dim: int, idx: torch.Tensor) -> torch.Tensor:
        assert dim == 2, "slots are dimension 2"
        return torch.stack([self._split(r.index_select(0, idx)) for r in self.rows])

    def index_copy_(self, dim: int, idx: torch.Tensor, src: torch.Tensor) -> None:
        assert dim == 2, "slots are dimension 2"
        n = idx.numel()
        for li, r in enumerate(self.rows):
            r.index_copy_(0, idx, src[li].permute(1, 2, 0, 3).reshape(n, r.shape[1], 2 * self.D).to(r.dtype))

    def index_fill_(self, dim: int, idx: torch.Tensor, value) -> None:
        assert dim == 2, "slots are dimension 2"
        for r in self.rows:
            r.index_fill_(0, idx, value)

    def __getitem__(self, key):
        """``[layer]``, ``[layer, k|v]`` or ``[layer, k|v, slots]``: views of the rows."""
        key = key if isinstance(key, tuple) else (key,)
        r = self.rows[key[0]]
        if len(key) == 1:
            return self._split(r)
        part = r[..., key[1] * self.D:(key[1] + 1) * self.D]  # [slots, H, D]
        return part if len(key) == 2 else part[key[2:]]


class EngineKV(KVCache):
    """A ``KVCache`` over vLLM's per-layer caches (``layers``: in layer order, each
    ``[blocks, heads, block_size, 2 * head_size]``). ``checked``: validate slot arguments as
    ``KVCache`` does."""

    def __init__(self, layers: list, checked: bool = True):  # noqa: super().__init__ would allocate a cache
        if not layers:
            raise ConfigError("unsupported", "EngineKV: the engine has no attention layer's KV cache")
        shapes = {(tuple(t.shape), t.dtype, t.device) for t in layers}
        if len(shapes) != 1:
            raise ConfigError("unsupported", f"EngineKV: layers of different KV geometry {sorted(map(str, shapes))}")
        b, h, n, c = layers[0].shape
        if c % 2:
            raise ConfigError("unsupported", f"EngineKV: a row of {c} values is not K then V of one size")
        self.num_layers, self.num_blocks, self.block_size = len(layers), int(b), int(n)
        self.num_kv_heads, self.head_dim = int(h), int(c) // 2
        self.dtype, self.device, self.checked = layers[0].dtype, layers[0].device, checked
        self.layers = list(layers)
        self.kv = layers[0]  # a tensor of the shared storage (the copy engine records its stream on it)
        self._flat = _Layers([token_rows(t) for t in layers], self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.layers[0].element_size()

    def __repr__(self) -> str:
        return (f"EngineKV(L={self.num_layers}, blocks={self.num_blocks}, S={self.block_size}, "
                f"H={self.num_kv_heads}, D={self.head_dim}, dtype={self.dtype}, device={self.device})")
