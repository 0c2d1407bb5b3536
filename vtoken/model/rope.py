"""Rotary position embedding with a bit-stable cos/sin table.

RoPE is applied to K once, at write time, with the token's original position, so relocation
moves bytes only. The table is filled entry by entry with scalar ``math.cos``/``math.sin``
(one rounding to the table dtype): a position's cos/sin are the same bytes however the
table grew (torch's vectorised kernels may round differently from their scalar tail).
Applying it uses only mul/add/sub. Convention: Hugging Face Llama "rotate_half".

Owns: its cos/sin tables, grown on demand.
May call: math, torch; never spec/, invariants/, fuzz/ or reports/.
Costs: ``ensure`` O(new positions x head_dim) scalar libm calls; ``lookup``/``apply_rope`` O(tokens
x head_dim).
"""

from __future__ import annotations

import math

import torch
from ..errors import CallError, ConfigError

__all__ = ["RopeTable", "apply_rope"]


class RopeTable:
    """cos/sin of ``position * inv_freq`` for positions ``[0, capacity)``, grown on demand;
    one decoder's, read-only to callers."""

    _GROW = 1024  # grow in whole chunks so growth is rare

    def __init__(self, head_dim: int, theta: float, capacity: int,
                 dtype: torch.dtype = torch.float32) -> None:
        if head_dim % 2:
            raise ConfigError("unsupported", "head_dim must be even")
        self.head_dim = head_dim
        self.dtype = dtype
        half = head_dim // 2
        self.inv_freq = [float(theta) ** (-(2.0 * i) / head_dim) for i in range(half)]
        self.cos = torch.empty((0, half), dtype=dtype)
        self.sin = torch.empty((0, half), dtype=dtype)
        self.ensure(capacity)

    @property
    def capacity(self) -> int:
        return self.cos.shape[0]

    def ensure(self, n: int) -> None:
        """Make positions ``[0, n)`` available (appends rows; old rows are untouched)."""
        old = self.capacity
        if n <= old:
            return
        new = max(n, old + self._GROW)
        ang = [[p * f for f in self.inv_freq] for p in range(old, new)]
        cos = torch.tensor([[math.cos(a) for a in row] for row in ang], dtype=torch.float64)
        sin = torch.tensor([[math.sin(a) for a in row] for row in ang], dtype=torch.float64)
        self.cos = torch.cat([self.cos, cos.to(self.dtype)])
        self.sin = torch.cat([self.sin, sin.to(self.dtype)])

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows ``[n, head_dim // 2]`` for int64 ``positions`` ``[n]``."""
        if positions.numel():
            lo, hi = int(positions.min()), int(positions.max())
            if lo < 0:
                raise CallError("bad_value", f"negative position {lo}")
            self.ensure(hi + 1)
        p = positions.cpu()
        return self.cos.index_select(0, p), self.sin.index_select(0, p)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[n, heads, head_dim]`` by per-row ``cos``/``sin`` ``[n, head_dim/2]``
    into a new tensor (``x`` unchanged)."""
    half = x.shape[-1] // 2
    c = cos.to(device=x.device, dtype=x.dtype).unsqueeze(1)  # broadcast over heads
    s = sin.to(device=x.device, dtype=x.dtype).unsqueeze(1)
    x1, x2 = x[..., :half], x[..., half:]
    # Separate mul and sub/add kernels: no fused multiply-add, so each element is the
    # same correctly rounded value whatever the batch shape.
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
