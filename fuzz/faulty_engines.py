"""Faulty copy engines: the planted copy and CUDA-ordering bugs, as subclasses in the toolkit.

Each class is :class:`vtoken.copy_engine.KVCopyEngine` with one of its small steps
overridden to do the wrong thing; the shipped engine carries no fault code. The system
takes an engine factory (``DecodeEngine(copy_engine_factory=...)``,
``VTokenWorker(copy_engine_factory=...)``), so a check can run the shipped paths with one of
these in place. ``ENGINES`` maps the catalogue's names to the classes.

- ``copy_flip_byte``: one byte of one moved entry flips (last layer, K) -- I1;
- ``copy_skip_move``: one move of each plan is not copied -- I1;
- ``copy_write_past_dst``: the scatter's off-by-one: each moved entry is written one slot
  past its destination -- I1 (the moved bytes are not where the table says) and I2 (a
  neighbour's bytes overwritten);
- ``cuda_wait_dropped``: ``wait_before_attention`` does nothing -- I3 (CUDA only);
- ``cuda_event_wrong_stream``: the completion event is recorded on the compute stream, so
  it completes without the copy -- I3 (CUDA only);
- ``cuda_release_before_event``: ``poll`` reports done without asking the device (on the
  CPU with ``lag``: before the deferred copy ran; it still runs when its lag expires) -- I3.

Faulty decode engines (``DECODE_ENGINES``): :class:`vtoken.decode.DecodeEngine` with one
host-side hook of its graph path overridden (bug class 10, a replay that skips a host-side
hook and reads stale KV):

- ``graph_slot_buffer_append_only``: the graph path's slot buffer is treated as
  append-only: a row is rewritten in full only when the request's eviction count changed
  (or the row changed hands), otherwise only its new tail entries are written, so after an
  applied move the replay still reads the moved tokens' source slots. Hash-and-compare
  does not see it (the table's read path is right); the sentinel check, which reads the
  slot buffer itself, and the output comparison do. Runs on the CPU (the graph path's
  eager fallback) and on CUDA.

Owns: what their parent engines own, plus the handles reported done before their copy ran
(``ReleaseBeforeEventEngine``) and the rows written (``AppendOnlySlotBufferEngine``).
May call: vtoken.copy_engine, vtoken.decode, torch, numpy.
Costs: the parent engine's cost; the faults add O(moves) or O(rows) at most.
"""

from __future__ import annotations

import numpy as np
import torch

from vtoken.copy_engine import KVCopyEngine
from vtoken.decode import DecodeEngine

__all__ = ["ENGINES", "FlipByteEngine", "SkipMoveEngine", "WritePastDestinationEngine", "DroppedWaitEngine",
           "WrongStreamEventEngine", "ReleaseBeforeEventEngine", "factory", "DECODE_ENGINES",
           "AppendOnlySlotBufferEngine"]


class FlipByteEngine(KVCopyEngine):
    def _copy(self, src_t, dst_t):
        super()._copy(src_t, dst_t)
        if dst_t.numel():
            slot = int(dst_t[dst_t.numel() // 2])
            entry = self.kv.flat[self.kv.num_layers - 1, 0, slot]  # [H, D], contiguous
            entry.view(torch.uint8).view(-1)[:1] ^= 0xFF


class SkipMoveEngine(KVCopyEngine):
    def _select(self, n, failed):
        keep = super()._select(n, failed)
        if n:
            keep[n // 2] = False
        return keep


class WritePastDestinationEngine(KVCopyEngine):
    """The scatter's off-by-one: every moved entry lands one slot past its destination (the
    last one overwrites whatever follows the plan's slots)."""

    def _copy(self, src_t, dst_t):
        if dst_t.numel():
            past = (dst_t + 1).clamp(max=self.kv.flat.shape[2] - 1)
            super()._copy(src_t, past)


class DroppedWaitEngine(KVCopyEngine):
    def wait_before_attention(self):
        return []


class WrongStreamEventEngine(KVCopyEngine):
    def _record_done(self, ev, compute, side):
        ev.record(compute)


class ReleaseBeforeEventEngine(KVCopyEngine):
    """Reports a copy done at its first poll; on the CPU with ``lag`` the deferred copy
    still runs when its lag expires (counted down at each ``wait_before_attention``)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._orphans = {}

    def poll(self, handle):
        h = handle
        if h.status != "pending" or self.force_sync:
            return super().poll(h)
        if not self.is_cuda and h.deferred is not None and h.left > 0:
            self._orphans[h.id] = h
        return self._finish(h)

    def wait_before_attention(self):
        for hid, h in list(self._orphans.items()):
            h.left -= 1
            if h.left <= 0:
                self._run_deferred(h)
                del self._orphans[hid]
        return super().wait_before_attention()

    def wait(self, handle):
        self._orphans.pop(handle.id, None)
        return super().wait(handle)

    def synchronize(self):
        super().synchronize()
        for h in list(self._orphans.values()):
            self._run_deferred(h)
        self._orphans.clear()


ENGINES = {
    "copy_flip_byte": FlipByteEngine,
    "copy_skip_move": SkipMoveEngine,
    "copy_write_past_dst": WritePastDestinationEngine,
    "cuda_wait_dropped": DroppedWaitEngine,
    "cuda_event_wrong_stream": WrongStreamEventEngine,
    "cuda_release_before_event": ReleaseBeforeEventEngine,
}
CUDA_ONLY = ("cuda_wait_dropped", "cuda_event_wrong_stream")


def factory(*names: str | None):
    """An engine factory (``(kv, block_size, **kw) -> engine``) for catalogue names: the
    shipped engine for none (or ``None``), one faulty class, or several combined (their
    overrides compose: e.g. a dropped wait together with an early release)."""
    names = [n for n in names if n is not None]
    if not names:
        return KVCopyEngine
    bad = [n for n in names if n not in ENGINES]
    if bad:
        raise ValueError(f"unknown faulty engine(s) {bad}; choose from {sorted(ENGINES)}")
    if len(names) == 1:
        return ENGINES[names[0]]
    return type("+".join(names), tuple(ENGINES[n] for n in names), {})


# ---------------------------------------------------------------------------------- decode engines
class AppendOnlySlotBufferEngine(DecodeEngine):
    """The graph path's slot buffer updated as if it were append-only (see the module docstring)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._rows: dict = {}  # (id(step graph), row) -> (request, read count, evicted count) last written

    def _write_read_slots(self, gs, row, req, read):
        n = read.numel()
        evicted = self.table.length(req.id) - self.table.num_live(req.id) if self.table is not None else 0
        key = (id(gs), row)
        last = self._rows.get(key)
        if last is None or last[0] != req.id or last[2] != evicted or n < last[1]:
            super()._write_read_slots(gs, row, req, read)
        elif n > last[1]:
            gs.read_slots[row, last[1]:n].copy_(read[last[1]:])  # the new tail only
        self._rows[key] = (req.id, n, evicted)


DECODE_ENGINES = {
    "graph_slot_buffer_append_only": AppendOnlySlotBufferEngine,
}
