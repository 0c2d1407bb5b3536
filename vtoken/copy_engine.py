"""The copy engine: stage 4 of the reclamation backend (paper section 3.3), with bytes.

``KVCopyEngine`` implements the planner's copy-engine protocol (``launch(plan) -> handle``,
``poll(handle)``, ``wait(handle)``; see ``vtoken.planner.NullCopyEngine``) over a
:class:`~vtoken.kvcache.KVCache` (``KVCache.copy_slots``).

CUDA ordering (I3). ``launch`` runs after the step's forward was issued on the compute
stream: (1) the relocation stream ``wait_stream``s the compute stream, so the copy reads
the sources after every K/V write issued so far; (2) it copies, then records an event;
(3) ``wait_before_attention()`` makes the compute stream ``wait_event`` on every pending
event (device side); (4) ``poll`` answers ``done`` only once ``event.query()`` does, so the
planner frees sources only after the copy out of them finished, and then makes the compute
stream wait on that (completed) event too, so the order the host saw is on the streams; (5) ``wait`` is a host
``event.synchronize()``. ``record_stream`` and the handle keep the index tensors alive
until the copy is seen done. CPU: the copy runs at ``launch``, or at the k-th ``poll`` of
its handle with ``lag=k`` (a late relocation stream, for tests). On CUDA ``lag=k`` fixes the
schedule the same way: the copy is issued at once, and ``poll`` says ``done`` at exactly its
k-th call (waiting on the host there if the device is not done yet), so a test sees the
same apply steps on both devices instead of steps that depend on the GPU's speed.

``fail_next_copy = True``: the next launch copies part of its moves and reports ``failed``.
Faulty engines are toolkit subclasses (``vtoken.fuzz.faulty_engines``) overriding the small
steps (``_copy``, ``_select``, ``_record_done``, ``poll``, ``wait_before_attention``).
``sentinel=True`` (a test mode): destinations are filled with ``finfo(dtype).max`` before
each copy and, on CUDA, the relocation stream is delayed, so a missing wait shows as
sentinels in attention's inputs.

Owns: the relocation stream and each pending copy's handle (index tensors, event) until seen done;
no blocks, no table state (which blocks it copies, and when they are freed, is the planner's).
May call: vtoken.kvcache, torch, numpy; never spec/, invariants/, fuzz/ or reports/ (the faulty
engines subclass it from there).
Costs: one batched gather/scatter over every layer per plan, O(moves) host work, no per-token loop;
``poll`` O(1), ``wait_before_attention`` O(pending copies).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from .kvcache import KVCache
from .errors import CallError, ConfigError

__all__ = ["KVCopyEngine", "CopyHandle", "checker_factory"]


def checker_factory(value, who: str):
    """Validate a relocation-checker hook: None / False (no checks) or a callable
    ``(kv, table, **kwargs) -> checker`` whose checker has ``wrap(engine)``; ``True`` is refused
    (the system never imports the toolkit's default)."""
    if value is None or value is False:
        return None
    if value is True or not callable(value):
        raise CallError("bad_type", f"{who}: check_relocations={value!r}: pass None or the checker factory, "
                         "e.g. vtoken.invariants.relocation_hash.RelocationChecker")
    return value

PENDING, DONE, FAILED = "pending", "done", "failed"


@dataclass
class CopyHandle:
    """One launched copy. ``status`` is the last status reported; the rest is bookkeeping."""

    id: int
    plan_id: int
    n_moves: int  # moves in the plan
    n_copied: int  # moves actually copied (fewer when the copy failed part-way)
    failed: bool
    status: str = PENDING
    event: object = None  # torch.cuda.Event (cuda)
    refs: tuple = ()  # tensors kept alive until the copy is observed done
    left: int = 0  # lag: polls before the copy runs (CPU) or is reported done (CUDA)
    deferred: Optional[tuple] = None  # CPU lag: (src, dst) still to copy
    timing: Optional[tuple] = None  # (start, end) timing events (cuda, ``timed=True``)
    meta: dict = field(default_factory=dict)


class KVCopyEngine:
    """Copies a plan's moves for all layers of ``kv``, on a relocation stream on CUDA.
    ``block_size``: the plans' ``S`` (the cache's); ``force_sync``: ``poll`` acts as ``wait``;
    ``lag``: copies are reported done at the ``lag``-th poll (CPU: run there); ``sentinel``, ``sleep_cycles``: the I3 test
    mode; ``timed`` (CUDA): timing events (``copy_ms``)."""

    def __init__(self, kv: KVCache, block_size: int, force_sync: bool = False, lag: int = 0,
                 sentinel: bool = False, sleep_cycles: int = 200_000_000, timed: bool = False):
        if int(block_size) != kv.block_size:
            raise ConfigError("inconsistent", f"block_size {block_size} != the cache's {kv.block_size}")
        self.kv = kv
        self.S = int(block_size)
        self.device = kv.device
        self.is_cuda = kv.device.type == "cuda"
        self.force_sync = force_sync
        self.lag = int(lag)
        self.sentinel = sentinel
        self.sleep_cycles = int(sleep_cycles)
        self.timed = timed
        self.fail_next_copy = False
        self.stream = torch.cuda.Stream(device=kv.device) if self.is_cuda else None
        if self.is_cuda:
            # the cache is read and written on the relocation stream too: should it ever be
            # freed, its memory must not be reused before that stream's queued work is done
            kv.kv.record_stream(self.stream)
        self._ids = itertools.count(1)
        self._pending: dict[int, CopyHandle] = {}  # launched, not yet observed done
        self.stats = dict(launched=0, done=0, failed=0, moves=0, bytes=0, host_syncs=0,
                          device_waits=0)

    # ------------------------------------------------------------------ helpers
    @property
    def sentinel_value(self) -> float:
        return float(torch.finfo(self.kv.dtype).max)

    def _slots(self, plan) -> tuple[np.ndarray, np.ndarray]:
        m = np.asarray(plan.moves, dtype=np.int64).reshape(-1, 5)
        S = self.S
        return m[:, 1] * S + m[:, 2], m[:, 3] * S + m[:, 4]

    def _select(self, n: int, failed: bool) -> np.ndarray:
        """Which of the plan's ``n`` moves are copied: all, or the first half of a failing copy."""
        keep = np.ones(n, dtype=bool)
        if failed:
            keep[n // 2:] = False  # part-way: the first half lands, the rest never does
        return keep

    def _copy(self, src_t: torch.Tensor, dst_t: torch.Tensor) -> None:
        """The batched gather/scatter of all layers (stream-agnostic: runs on the current one)."""
        flat = self.kv.flat
        if src_t.numel():
            # KVCache.copy_slots without its host-side validation (no sync on CUDA): the
            # planner's moves are validated by construction and by apply_moves.
            if self.kv.checked and not self.is_cuda:
                self.kv.copy_slots(src_t, dst_t)
            else:
                flat.index_copy_(2, dst_t, flat.index_select(2, src_t))

    # ------------------------------------------------------------------ protocol
    def launch(self, plan) -> CopyHandle:
        """Issue the copy of ``plan.moves`` (after the step's forward pass)."""
        src, dst = self._slots(plan)
        n = len(src)
        failed = bool(self.fail_next_copy)
        self.fail_next_copy = False
        keep = self._select(n, failed)
        src, dst = src[keep], dst[keep]
        h = CopyHandle(next(self._ids), getattr(plan, "id", -1), n, int(keep.sum()), failed)
        self.stats["launched"] += 1
        self.stats["moves"] += len(src)
        self.stats["bytes"] += len(src) * self.kv.bytes_per_token
        if self.is_cuda:
            self._launch_cuda(h, src, dst)
            h.left = self.lag
        else:
            if self.sentinel and len(dst):
                self.kv.fill_slots(torch.from_numpy(dst), self.sentinel_value)
            if self.lag > 0:
                h.left = self.lag
                h.deferred = (src, dst)
            else:
                self._copy(torch.from_numpy(src), torch.from_numpy(dst))
        self._pending[h.id] = h
        return h

    def _launch_cuda(self, h: CopyHandle, src: np.ndarray, dst: np.ndarray) -> None:
        dev = self.device
        compute = torch.cuda.current_stream(dev)
        side = self.stream
        # Index tensors: made on the compute stream (pinned host -> device, async).
        src_t = torch.from_numpy(src).pin_memory().to(dev, non_blocking=True)
        dst_t = torch.from_numpy(dst).pin_memory().to(dev, non_blocking=True)
        if self.sentinel and len(dst):
            self.kv.flat.index_fill_(2, dst_t, self.sentinel_value)  # compute stream, before the copy
        ev = torch.cuda.Event()
        side.wait_stream(compute)  # the copy sees the finished forward writes
        t0 = t1 = None
        with torch.cuda.stream(side):
            if self.sentinel and self.sleep_cycles > 0:
                torch.cuda._sleep(self.sleep_cycles)  # a late relocation stream
            if self.timed:
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record(side)
            self._copy(src_t, dst_t)
            if self.timed:
                t1.record(side)
            self._record_done(ev, compute, side)
        src_t.record_stream(side)
        dst_t.record_stream(side)
        h.event = ev
        h.refs = (src_t, dst_t)
        h.timing = (t0, t1) if self.timed else None

    def _record_done(self, ev, compute, side) -> None:
        """Record the copy's completion event: on the relocation stream, after the copy."""
        ev.record(side)

    def _finish(self, h: CopyHandle) -> str:
        self._pending.pop(h.id, None)
        h.refs = ()
        h.status = FAILED if h.failed else DONE
        self.stats["failed" if h.failed else "done"] += 1
        return h.status

    def _run_deferred(self, h: CopyHandle) -> None:
        if h.deferred is not None:
            src, dst = h.deferred
            h.deferred = None
            self._copy(torch.from_numpy(src), torch.from_numpy(dst))

    def poll(self, handle: CopyHandle) -> str:
        """Non-blocking: ``pending``, ``done`` or ``failed`` (this copy only)."""
        h = handle
        if h.status != PENDING:
            return h.status
        if self.force_sync:
            return self.wait(h)
        if self.is_cuda:
            if h.left > 0:  # lag: a fixed schedule, done at exactly the lag-th poll
                h.left -= 1
                if h.left > 0:
                    return PENDING
                if not h.event.query():
                    self.stats["host_syncs"] += 1
                    h.event.synchronize()
            elif not h.event.query():
                return PENDING
            # Done on the device. The host saw it, so later compute-stream work already runs
            # after the copy; the wait (on a completed event: free) says so on the streams too,
            # where a stream checker (CSAN) can see it, for the apply and the fills after it.
            torch.cuda.current_stream(self.device).wait_event(h.event)
            return self._finish(h)
        if h.deferred is not None:
            h.left -= 1
            if h.left > 0:
                return PENDING
            self._run_deferred(h)
        return self._finish(h)

    def wait(self, handle: CopyHandle) -> str:
        """Host wait for this copy (force-sync ablation): ``done`` or ``failed``."""
        h = handle
        if h.status != PENDING:
            return h.status
        self.stats["host_syncs"] += 1
        if self.is_cuda:
            h.event.synchronize()
        else:
            self._run_deferred(h)
        return self._finish(h)

    def wait_before_attention(self) -> list:
        """Make the compute stream wait (device side) for every copy not yet observed done; called
        before each step's attention. Returns the plan ids waited on. A no-op on the CPU."""
        if not self.is_cuda:
            return []
        compute = torch.cuda.current_stream(self.device)
        waited = []
        for h in self._pending.values():
            compute.wait_event(h.event)
            waited.append(h.plan_id)
            self.stats["device_waits"] += 1
        return waited

    def synchronize(self) -> None:
        """Wait (host) for every launched copy; for teardown and tests, never the hot path."""
        if self.is_cuda:
            self.stream.synchronize()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def copy_ms(self, handle: CopyHandle) -> Optional[float]:
        """Device time of a timed CUDA copy (after it is done), else None."""
        if handle.timing is None:
            return None
        t0, t1 = handle.timing
        t1.synchronize()
        return float(t0.elapsed_time(t1))

    # ------------------------------------------------------------------ sentinel check
    def contains_sentinel(self, slots: torch.Tensor) -> bool:
        """True when any layer's K or V at ``slots`` holds the sentinel (I3 test mode); reads on the
        compute stream, as attention would, and forces a host sync."""
        s = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        if s.numel() == 0:
            return False
        vals = self.kv.flat.index_select(2, s)
        return bool((vals == self.sentinel_value).any())
