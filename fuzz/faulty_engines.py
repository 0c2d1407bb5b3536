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
  CPU with ``lag``: before the deferred copy ran; it still runs when its lag expires) -- I3;
- ``copy_write_bystander``: a stale index buffer: each copy also scatters one moved entry
  through the destination index of an earlier, finished copy of ANOTHER request, onto a
  slot that copy filled -- usually a live token of that bystander, far from this plan's
  own blocks (never within one slot of them) -- I1/I2 of the bystander; the moved tokens
  themselves land correctly.

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

Adapter-side engines (``ADAPTER_ENGINES``; the adapter machine draws them, the vLLM tests
build the worker with them through ``VTokenWorker(copy_engine_factory=...)``):

- ``copy_fails``: every k-th copy fails part-way (the shipped engine's own failure mode): not
  a fault but an environment; the adapter's aborted path (sources and fills back to the
  request, table kept; destinations back to the headroom) must keep every check green;
- ``corrupt_in_flight``: at the poll that completes a copy, a byte of a fill's live token or
  of a moved entry flips: the worker's hash-and-compare must raise;
- ``steal_fill``: at that poll a fill becomes another request's alone in the token table:
  the worker must refuse it and the adapter raise ``PlanError[shared_fill]`` (``shared_at_end``);
- ``copy_write_window`` (a hybrid layout): each copy also scatters one moved entry onto
  another running request's newest sliding-window slot, a slot the token table does not map
  (the window group is vLLM's, read by position): hash-and-compare must raise
  ``guard_overwritten`` when the copy reports done (its guard covers the window's slots).

Owns: what their parent engines own, plus the handles reported done before their copy ran
(``ReleaseBeforeEventEngine``) and the rows written (``AppendOnlySlotBufferEngine``); the
adapter-side ones the plans of copies not yet done and a record of what they did (``tampered``,
``failed_plans``); the table they are handed stays the worker's.
May call: vtoken.copy_engine, vtoken.decode, torch, numpy.
Costs: the parent engine's cost; the faults add O(moves) or O(rows), the adapter-side ones
O(request length) per completed copy, at most.
"""

from __future__ import annotations

import abc

import numpy as np
import torch

from vtoken.copy_engine import KVCopyEngine
from vtoken.decode import DecodeEngine

__all__ = ["ENGINES", "FlipByteEngine", "SkipMoveEngine", "WritePastDestinationEngine", "DroppedWaitEngine",
           "WrongStreamEventEngine", "ReleaseBeforeEventEngine", "BystanderWriteEngine", "factory", "DECODE_ENGINES",
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


class BystanderWriteEngine(KVCopyEngine):
    """A stale index buffer (see the module docstring): one extra (source, target) pair per
    copy, the target the last destination slot of the latest earlier copy of another
    request that is done, skipped when it lies in or next to one of this plan's blocks."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._done_dsts: list = []  # (request, destination slots) of earlier copies, oldest first
        self._launched: list = []  # (request, destination slots, handle) not yet seen done
        self.targets: list = []  # (plan id, bystander request, slot) of every extra write issued

    def _target(self, plan, src, dst):
        S = self.S
        m = np.asarray(plan.moves, dtype=np.int64).reshape(-1, 5)
        near = set((np.concatenate([m[:, 1], m[:, 3]]) if len(m) else np.empty(0, dtype=np.int64)).tolist())
        near |= {int(b) for b in list(plan.sources) + list(plan.fills) + list(plan.dests)}
        for rid, slots in reversed(self._done_dsts):
            if rid == plan.req_id or not len(slots):
                continue
            t = int(slots[-1])
            if all(abs(t // S - b) > 1 for b in near):  # not in, nor next to, a block this copy uses
                self.targets.append((getattr(plan, "id", -1), rid, t))
                return t
        return None

    def _slots(self, plan):
        src, dst = super()._slots(plan)
        for entry in list(self._launched):
            if entry[2].status != "pending":
                self._launched.remove(entry)
                self._done_dsts.append(entry[:2])
        t = self._target(plan, src, dst) if len(src) else None
        self._pending_dst = dst.copy()
        if t is None:
            return src, dst
        return np.append(src, src[0]), np.append(dst, t)

    def launch(self, plan):
        h = super().launch(plan)
        self._launched.append((plan.req_id, self._pending_dst, h))
        return h


ENGINES = {
    "copy_flip_byte": FlipByteEngine,
    "copy_skip_move": SkipMoveEngine,
    "copy_write_past_dst": WritePastDestinationEngine,
    "cuda_wait_dropped": DroppedWaitEngine,
    "cuda_event_wrong_stream": WrongStreamEventEngine,
    "cuda_release_before_event": ReleaseBeforeEventEngine,
    "copy_write_bystander": BystanderWriteEngine,
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


# ---------------------------------------------------------------------------------- adapter-side engines
class _PlanTracking(KVCopyEngine, metaclass=abc.ABCMeta):
    """Remembers each handle's plan until its copy is over, and calls :meth:`_at_done` at the
    ``poll`` that finds the copy complete, before ``done`` goes back to the caller (the
    relocation checker that wraps the engine, then the worker, see it after this). A
    ``wait`` (a host sync at idle) finishes the copy untouched. ``table``: the worker's
    token table (where the plan's request's live tokens are)."""

    def __init__(self, *a, table, **kw):
        super().__init__(*a, **kw)
        self.table = table
        self._plans: dict = {}  # handle id -> the plan (the worker's copy of the lifecycle.Plan: block ids)
        self.tampered: list = []  # (plan id, what was done): every tampering, in order

    def launch(self, plan):
        h = super().launch(plan)
        self._plans[h.id] = plan
        return h

    def poll(self, handle):
        pending = handle.status == "pending"
        status = super().poll(handle)
        if status != "pending":
            plan = self._plans.pop(handle.id, None)
            if pending and status == "done" and plan is not None:
                self._at_done(plan)
        return status

    def wait(self, handle):
        self._plans.pop(handle.id, None)
        return super().wait(handle)

    @abc.abstractmethod
    def _at_done(self, plan) -> None:
        """Tamper with the completed copy of ``plan`` (what the fault is)."""


class FailingCopyEngine(KVCopyEngine):
    """Every ``fail_every``-th launched copy fails part-way (the shipped engine's own failure:
    the first half of its moves lands, it reports ``failed``): an environment the adapter
    must survive. The worker aborts such a plan with the table kept; the adapter gives the
    sources and fills back to the request and the destinations back to the headroom."""

    def __init__(self, *a, fail_every: int = 3, **kw):
        super().__init__(*a, **kw)
        if int(fail_every) < 1:
            raise ValueError(f"fail_every={fail_every!r}: must be >= 1")
        self.fail_every = int(fail_every)
        self._launches = 0
        self.failed_plans: list = []  # plan ids whose copy was made to fail

    def launch(self, plan):
        self._launches += 1
        if self._launches % self.fail_every == 0:
            self.fail_next_copy = True
            self.failed_plans.append(getattr(plan, "id", -1))
        return super().launch(plan)


class InFlightCorruptionEngine(_PlanTracking):
    """A fault: at the poll that completes a copy, one byte of the plan's request's K/V flips
    (last layer, K), alternately a live token in one of the plan's fills (a slot the copy
    must not touch) and a moved entry at its destination (what the copy wrote). Either way
    the relocation checker the worker wraps its engine with must raise: the flipped token
    is live and read after the plan applies."""

    def _at_done(self, plan) -> None:
        t, S = self.table, self.S
        r = plan.req_id
        targets = []
        if r in t and plan.fills:
            ids, slots = t.live_slots(r)
            in_fill = np.isin(slots // S, np.asarray(plan.fills, dtype=np.int64))
            if in_fill.any():
                targets.append(("live token of a fill", int(slots[np.argmax(in_fill)])))
        m = np.asarray(plan.moves, dtype=np.int64).reshape(-1, 5)
        if len(m):
            mid = m[len(m) // 2]
            targets.append(("moved entry at its destination", int(mid[3] * S + mid[4])))
        if not targets:
            return
        what, slot = targets[len(self.tampered) % len(targets)]
        self.kv.flat[self.kv.num_layers - 1, 0, slot].view(torch.uint8).view(-1)[:1] ^= 0xFF
        self.tampered.append((plan.id, f"{what} (slot {slot})"))


class StealFillEngine(_PlanTracking):
    """A fault: at the poll that completes a copy, the plan's first fill becomes another
    request's in the token table (the request's live tokens there die, the request lets go
    of the block, an intruder request writes a token into it): a block held by another
    request alone, so its reference count is 1. Applying the plan must refuse the fill
    (``shared_fill``) and the adapter must raise it (``PlanError[shared_fill]``), never take the
    quiet "aborted, table kept" path."""

    INTRUDER = "intruder (StealFillEngine)"

    def _at_done(self, plan) -> None:
        t, S = self.table, self.S
        r = plan.req_id
        if r not in t or not plan.fills or self.INTRUDER in t:
            return
        f = int(plan.fills[0])
        if not t.references(r, f) or t.block_refs(f) != 1:
            return
        ids, slots = t.live_slots(r)
        mine = ids[slots // S == f]
        if len(mine):
            t.evict_tokens(r, mine)
        t.release_empty_blocks(r, [f])
        t.sync_new_tokens(self.INTRUDER, [f], 0)
        t.sync_new_tokens(self.INTRUDER, [f], 1)
        self.tampered.append((plan.id, f"fill {f} taken by {self.INTRUDER!r}"))


class WindowWriteEngine(KVCopyEngine):
    """A fault (a hybrid layout): each copy also scatters its first moved entry onto the newest
    sliding-window slot of another request the worker runs (its last computed position, through
    its window group's block list), which the next step's windowed layers read. The moved tokens
    themselves land correctly and the token table maps no window slot, so a guard over the table
    alone passes. ``table``: the worker's token table; ``reqs``: the worker's request records
    (``WorkerCore.reqs``, with ``wblocks``), given once the worker exists (until then nothing
    extra is written); ``targets``: (plan id, request, slot) of every extra write."""

    def __init__(self, *a, table, **kw):
        super().__init__(*a, **kw)
        self.table = table
        self.reqs: dict | None = None
        self.targets: list = []

    def _target(self, plan):
        t, S = self.table, self.S
        for r in sorted(self.reqs or ()):
            w = self.reqs[r]
            if r == plan.req_id or r not in t or not w.wblocks or t.length(r) < 1:
                continue
            p = t.length(r) - 1
            if p // S < len(w.wblocks) and w.wblocks[p // S] != 0:
                return r, int(w.wblocks[p // S]) * S + p % S
        return None

    def _slots(self, plan):
        src, dst = super()._slots(plan)
        hit = self._target(plan) if len(src) else None
        if hit is None:
            return src, dst
        self.targets.append((getattr(plan, "id", -1), hit[0], hit[1]))
        return np.append(src, src[0]), np.append(dst, hit[1])


ADAPTER_ENGINES = {
    "copy_fails": FailingCopyEngine,
    "corrupt_in_flight": InFlightCorruptionEngine,
    "steal_fill": StealFillEngine,
    "copy_write_window": WindowWriteEngine,
}
__all__ += ["ADAPTER_ENGINES", "FailingCopyEngine", "InFlightCorruptionEngine", "StealFillEngine", "WindowWriteEngine"]
