"""Request traces: lengths only, drawn (seeded) from stated distributions.

- ShareGPT-like: input ~ lognormal(median 1,500, sigma 1.0) clipped to [64, 16,384]; output
  ~ lognormal(median 350, sigma 0.8) clipped to [16, 2,048].
- LongBench-like: input ~ lognormal(median 8,000, sigma 0.45) clipped to [1,024, 16,384];
  output ~ lognormal(median 128, sigma 0.7) clipped to [16, 512].
- Capacity frontier: every request 4,032 prompt and 12,288 output tokens.

Owns: nothing (pure functions of a seed).
May call: numpy, dataclasses, vtoken.sim.config; never spec/, invariants/, fuzz/ or reports/.
Costs: O(requests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import need_choice, need_int, need_number
from ..errors import CallError

WORKLOADS = {
    # name: (input median, input sigma, input clip, output median, output sigma, output clip)
    "sharegpt": dict(in_median=1500, in_sigma=1.0, in_clip=(64, 16384),
                     out_median=350, out_sigma=0.8, out_clip=(16, 2048)),
    "longbench": dict(in_median=8000, in_sigma=0.45, in_clip=(1024, 16384),
                      out_median=128, out_sigma=0.7, out_clip=(16, 512)),
}


@dataclass(frozen=True)
class Request:
    id: int
    prompt: int
    output: int

    def __post_init__(self) -> None:
        """``id`` an integer >= 0, ``prompt`` >= 1, ``output`` >= 0 (ConfigError naming the field)."""
        for name, lo in (("id", 0), ("prompt", 1), ("output", 0)):
            need_int("Request", name, getattr(self, name), lo)

    @property
    def total(self) -> int:
        return self.prompt + self.output


def _draw(rng, median, sigma, clip, n, scale=1.0):
    x = rng.lognormal(np.log(median * scale), sigma, size=n)
    lo, hi = clip
    return np.clip(np.round(x), max(1, int(lo * scale)), max(2, int(hi * scale))).astype(int)


def make_trace(workload: str, n: int, seed: int, scale: float = 1.0) -> list[Request]:
    """``n`` requests of a workload; ``scale`` shrinks every length (quick mode). ``workload`` a
    name of ``WORKLOADS``, ``n`` an integer >= 1, ``seed`` >= 0, ``scale`` a finite number > 0
    (ConfigError naming the argument otherwise)."""
    need_choice("make_trace", "workload", workload, WORKLOADS)
    need_int("make_trace", "n", n, 1)
    need_int("make_trace", "seed", seed, 0)
    need_number("make_trace", "scale", scale, 0, lo_open=True)
    p = WORKLOADS[workload]
    rng = np.random.default_rng([seed, 7, sum(map(ord, workload))])
    ins = _draw(rng, p["in_median"], p["in_sigma"], p["in_clip"], n, scale)
    outs = _draw(rng, p["out_median"], p["out_sigma"], p["out_clip"], n, scale)
    return [Request(i, int(a), int(b)) for i, (a, b) in enumerate(zip(ins, outs))]


def describe_workloads() -> dict:
    return {k: {kk: list(v) if isinstance(v, tuple) else v for kk, v in d.items()} for k, d in WORKLOADS.items()}


def frontier_request_shape(full_blocks: int = 1020, block_size: int = 16, output: int = 12288) -> tuple[int, int]:
    """(prompt, output) such that a fully retained request needs exactly ``full_blocks`` blocks."""
    prompt = full_blocks * block_size - output
    if prompt <= 0:
        raise CallError("bad_value", "output longer than the full footprint")
    return prompt, output
