"""The I3 probe: one sentinel copy on a late relocation stream, read the way attention reads.

What this cannot see: anything but the copy engine's ordering on a CUDA device (no probe
on the CPU); only its own sentinel plan, on a cache it overwrites -- not a live decode's
plans, not the planner's choices, not block ownership; an ordering bug that the delay
(``sleep_cycles``) does not expose.

Toolkit code (it checks the copy engine; the engine does not carry it). CUDA only.

Each probe returns its result dict (``sentinel_seen``, ``bytes_equal``, timings) with a
``violations`` view (:func:`probe_violations`: rule ``sentinel_read`` or ``bytes_differ``,
invariant I3; ``[]``: the read saw the copied bytes).

Owns: one copy engine per probe; the caller's KVCache, whose first 2n blocks' slots it overwrites.
May call: vtoken.kvcache, vtoken.copy_engine, invariants.violation, torch, numpy; never fuzz/ (a faulty engine comes in as
``engine_cls``).
Costs: one sentinel copy of n tokens on a relocation stream delayed by ``sleep_cycles``; a poll loop
bounded by ``timeout_s``.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import torch

from vtoken.copy_engine import PENDING, KVCopyEngine
from vtoken.kvcache import KVCache

from .violation import Found, Violation


class ProbePlan:
    def __init__(self, pid: int, moves: np.ndarray):
        self.id, self.moves, self.req_id = pid, moves, "probe"


def probe_violations(result: dict) -> list[Violation]:
    """What a probe's ``result`` shows (``[]``: nothing): the sentinel read where the copied
    bytes should be (``sentinel_read``), the bytes read not the bytes copied (``bytes_differ``)."""
    out = []
    if result.get("sentinel_seen"):
        out.append(Violation("I3", f"{result.get('scenario')} probe: the read saw the copy sentinel (a destination read "
                                   f"before its copy landed)", dict(result), "sentinel_read"))
    if not result.get("bytes_equal", True):
        out.append(Violation("I3", f"{result.get('scenario')} probe: the bytes read are not the bytes copied",
                             dict(result), "bytes_differ"))
    return out


def _probe_moves(kv: KVCache, n: int, who: str):
    """``n`` tokens moved from the blocks right past the null block to the blocks after them:
    ``(moves, source slots, destination slots)``, the slots on the cache's (CUDA) device."""
    if kv.device.type != "cuda":
        raise ValueError(f"{who} needs a CUDA cache")
    S = kv.block_size
    nblk = -(-n // S)
    if 1 + 2 * nblk > kv.num_blocks:
        raise ValueError(f"{who}: cache too small for the probe")
    tok = np.arange(n, dtype=np.int64)
    src_b, dst_b = 1 + tok // S, 1 + nblk + tok // S
    moves = np.stack([tok, src_b, tok % S, dst_b, tok % S], axis=1)
    return (moves, torch.from_numpy(src_b * S + tok % S).to(kv.device),
            torch.from_numpy(dst_b * S + tok % S).to(kv.device))


def i3_probe(kv: KVCache, scenario: str = "wait", fault: Optional[str] = None, n: int = 64,
             sleep_cycles: int = 400_000_000, timeout_s: float = 20.0, engine_cls=None) -> dict:
    """Check I3 directly on a CUDA cache: one sentinel copy on a late relocation stream, then
    its destinations read on the compute stream the way attention reads them.

    ``scenario``: ``"wait"`` reads right after :meth:`KVCopyEngine.wait_before_attention`
    (the device-side dependency must hold the read back); ``"poll"`` reads as soon as
    ``poll`` reports done, without a wait (a copy reported done must have landed).
    ``engine_cls``: the copy engine class to probe (default :class:`KVCopyEngine`; the
    toolkit's faulty engines, ``vtoken.fuzz.faulty_engines.factory(name)``, come in here);
    ``fault``: its name, for the result (required with another engine, refused without
    one). The first ``2n`` blocks'
    worth of slots past the null block are used (sources, then destinations); their
    contents are overwritten. Returns ``sentinel_seen`` (an I3 violation), ``bytes_equal``,
    ``first_poll`` and the host time of the wait call (it must not block); ``.violations``:
    :func:`probe_violations` of it.
    """
    if (fault is None) != (engine_cls is None):
        raise ValueError("i3_probe: give a faulty engine as engine_cls together with its name as fault "
                         f"(got fault={fault!r}, engine_cls={engine_cls!r})")
    S = kv.block_size
    moves, src, dst = _probe_moves(kv, n, "i3_probe")
    g = torch.Generator(device=kv.device).manual_seed(1234)
    vals = torch.randn((kv.num_layers, 2, n, kv.num_kv_heads, kv.head_dim), generator=g, device=kv.device)
    kv.flat.index_copy_(2, src, vals.to(kv.dtype))
    want = kv.flat.index_select(2, src).clone()
    torch.cuda.synchronize(kv.device)
    eng = (engine_cls or KVCopyEngine)(kv, S, sentinel=True, sleep_cycles=sleep_cycles)
    out = {"scenario": scenario, "fault": fault}
    h = eng.launch(ProbePlan(1, moves))
    out["first_poll"] = eng.poll(h) if scenario == "poll" else None
    if scenario == "wait":
        t0 = time.perf_counter()
        eng.wait_before_attention()
        out["host_wait_ms"] = (time.perf_counter() - t0) * 1e3
    else:
        t0 = time.perf_counter()
        status = out["first_poll"]
        while status == PENDING and time.perf_counter() - t0 < timeout_s:
            status = eng.poll(h)
        out["poll_status"] = status
        out["host_poll_ms"] = (time.perf_counter() - t0) * 1e3
    got = kv.flat.index_select(2, dst)  # the compute stream, as attention would read
    seen = (got == eng.sentinel_value).any()
    equal = torch.equal(got, want)
    out["sentinel_seen"] = bool(seen)
    out["bytes_equal"] = bool(equal)
    eng.synchronize()
    return Found(out, probe_violations(out))


def graph_i3_probe(kv: KVCache, n: int = 32, sleep_cycles: int = 400_000_000) -> dict:
    """I3 through a :class:`~vtoken.decode.StepGraph`: a captured gather over the slot buffer,
    then a sentinel copy on a late relocation stream, the slot buffer pointed at its
    destinations (the host-side hook, landed), the device-side wait, and a replay. The
    replay must read the copied bytes: ``sentinel_seen`` (or ``bytes_equal`` False) is an
    I3 violation of the graph path (a replay not ordered after the wait, e.g. the catalogue's
    ``graph_replay_on_capture_stream``, applied to the tree this runs from).

    Uses (overwrites) the first ``2 * ceil(n / S)`` blocks past the null block of ``kv``.
    The result dict's ``.violations``: :func:`probe_violations` of it.
    """
    from vtoken.decode import StepGraph  # the graph path's own class, as the decode engine builds it

    S = kv.block_size
    moves, src, dst = _probe_moves(kv, n, "graph_i3_probe")
    want = kv.flat.index_select(2, src).clone()
    gs = StepGraph(1, n, kv.device, lambda g: (kv.flat.index_select(2, g.read_slots[0]), None))
    gs.read_slots[0].copy_(src)
    first = gs.run()[0]  # warm-up, capture, replay
    torch.cuda.synchronize(kv.device)
    if gs.captures != 1 or not torch.equal(first, want):
        raise RuntimeError(f"graph_i3_probe: the capture itself is wrong (captures {gs.captures})")
    eng = KVCopyEngine(kv, S, sentinel=True, sleep_cycles=sleep_cycles)
    eng.launch(ProbePlan(1, moves))
    gs.read_slots[0].copy_(dst)  # the host-side hook: the slot buffer, in place
    torch.cuda.current_stream(kv.device).synchronize()  # the update landed; the relocation stream still sleeps
    eng.wait_before_attention()
    out = gs.run()[0]
    torch.cuda.synchronize(kv.device)
    res = {"scenario": "graph", "sentinel_seen": bool((out == eng.sentinel_value).any()),
           "bytes_equal": bool(torch.equal(out, want))}
    return Found(res, probe_violations(res))
