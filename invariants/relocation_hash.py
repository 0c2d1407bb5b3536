"""Hash-and-compare around every relocation event: I1 (token conservation) and I2 (the
read path points at the moves' destinations), checked online, byte-exact.

What this cannot see: anything between relocation events (it compares at launch, at copy
done and at apply; a read of the wrong bytes between them that leaves them right again is
missed); slots outside its guard (``guard="local"``: a write onto another request's token
away from the plan's blocks; a KV cache group the token table does not mirror whose reads
the worker did not hand it with :meth:`RelocationChecker.guard_outside`, and any slot of
such a group no step reads next: an out-of-window position; a guarded slot that stopped being
read before the copy was seen done, its owner gone or its window moved on, is not compared,
so bytes corrupted at launch and read by the steps in between go unseen); a fingerprint collision (bound in
:func:`device_fingerprint`) or, with ``sample=0``, an xxh3 spot check; block ownership and
the pool (who holds a block: ``ownership`` and the snapshot checkers); plans whose copy
it was not wrapped around.

What is compared
----------------
At launch, before the copy is issued, :meth:`RelocationChecker.before_copy` hashes the
request's *ordered* live token ids and, per token and per layer, the K and V bytes, read
through the request's pre-move slots (``TokenTable.slot_mapping``: the read path attention
uses). Then:

1. when the copy engine reports the copy ``done`` (before the planner applies it),
   :meth:`after_copy` hashes the bytes at each move's destination slot and compares them
   with the moved token's pre-move hash: the copy itself (a flipped byte, a skipped move,
   a source overwritten before the copy ran, a destination read before the copy landed);
2. when the plan is applied, :meth:`after_apply` hashes again through the post-move slots
   (the read path again): the same ordered ids (less the tokens the engine evicted while
   the copy was in flight, which it reports with :meth:`note_evicted`), the same bytes per
   token and layer, and every moved token's read slot equal to its move's destination (a
   stale slot mapping still points at the source, whose bytes may not have changed yet);
3. when a copy ``failed`` (the plan is aborted, the table unchanged), the read path must
   still give the pre-launch hash.

Hash scope (what else the copy must not touch): at launch the checker also records the
*guard* of the plan, read through the table's public API (``requests()``, ``slots()``,
``live_mask()``): every slot of the plan's destination blocks that no move writes (free or
not: nobody else may write a reserved destination block) and every live slot of EVERY
request that no move writes -- the plan's own request, its fills and sources, and every
bystander, however far from the destinations (a scatter through a wrong or stale index
lands anywhere). ``guard="local"`` narrows it to the destination blocks, the live slots
right next to a destination (where an off-by-one lands) and the sources: cheaper, and
blind to a write onto another request's token further away. Slots the worker reads outside
the token table join the live slots when the worker hands them over
(:meth:`RelocationChecker.guard_outside`: every KV cache group it reads that the table does
not mirror; the vLLM adapter's worker core hands its sliding-window group's next-step window,
``WorkerCore.window_reads``): each is owned by its request's position while the worker still
reads it there, and none may lie in a destination block or fill. When the copy reports done,
each guarded slot must hold the same bytes -- a live slot only while the same token of the
same incarnation of the same request still holds it (a slot that changed hands meanwhile
was written legitimately), and never a slot another plan's copy writes. A difference
raises ``guard_overwritten`` naming the slot and its owner. When the plan is applied, no
request other than the plan's may hold a live token in a destination block
(``foreign_token``).

Digests in the snapshot: for a plan carrying a snapshot, the checker fills
``plan.digests`` (``vtoken.snapshot``): per move, the xxh3-64 of the moved token's
per-layer digests at its source at launch (``pre``) and at its destination when the copy
is done (``post``), with ``method``. The snapshot checkers then compare them (I1).

Bytes are reinterpreted, never converted (``view(torch.uint8)`` / ``int32``): -0.0 vs 0.0
and NaN payloads differ. A mismatch raises :class:`vtoken.errors.RelocationCheckError`
(code ``relocation_mismatch``, ``token_set_changed``, ``stale_slot``, ``guard_overwritten`` or
``foreign_token``) naming the request,
the first differing token in logical order, the layer and the plan id, after writing the
plan's snapshot (``vtoken.snapshot.save``) and a ``.failure.json`` beside it to ``out_dir``.
The error carries what was found as ``.violations``, the checkers' one result shape: one
:class:`~vtoken.invariants.violation.Violation` (invariant ``relocation``, ``rule`` the code,
``model`` the failure record); the checker keeps every one it found in its own
``violations`` list too (all of them where ``raise_on_failure=False`` only counts).

Methods
-------
``xxh3`` (the CPU default, and ``full_bytes=True`` anywhere): the bytes go to the host and
each (token, layer) is digested with xxh3-64 (on CUDA that is a blocking copy of every
hashed token's K/V: the audit mode and the baseline of the overhead figure).
``fingerprint`` (the CUDA default): :func:`device_fingerprint` on the device, so only 16
bytes per token and layer (:data:`FINGERPRINT_BYTES`) cross to the host, plus the read
path's slots (8 bytes per token, metadata) and, for the xxh3 spot check, the K/V bytes of
at most ``sample`` tokens per comparison (``sample=0``: none). The fingerprint is exact
integer arithmetic, so it runs (and is tested) on the CPU too, and gives the same values
on CUDA. Its collision bound is in :func:`device_fingerprint`'s docstring.

No host wait (fingerprint method)
--------------------------------
Every device-side digest is issued on the current (compute) stream and copied to pinned
host memory with ``non_blocking=True``, followed by an event; the host comparison runs
later, once that event has completed (:meth:`RelocationChecker.settle`, called at the start
of every checker hook, by :meth:`CheckedCopyEngine.wait_before_attention` and, blocking, by
:meth:`CheckedCopyEngine.synchronize` / the engine at the end of a run). So a check never
makes the host wait, neither for the compute stream (which may itself wait on pending
copies) nor for a copy's event: the launch digests are issued before the copy (the
relocation stream then waits for them), and the destination digests only after the copy
engine's ``poll`` observed the copy's event complete. A failure is raised by whichever of
those calls settles it (at the latest at the end of the run), naming the plan as before.
On the CPU every digest is ready at once, so failures are raised inside the hook that
found them. ``host_bytes`` counts what crossed to the host, by kind.

Hooking it in without touching the planner: :meth:`RelocationChecker.wrap` returns a copy
engine that calls :meth:`before_copy` in ``launch`` and :meth:`after_copy` when ``poll`` /
``wait`` first report a final status; the planner's ``on_applied`` callback calls
:meth:`after_apply`.

Owns: per plan in flight its pre-copy digests and guard; the pending host fetches (pinned buffers,
events); failure snapshots it writes to ``out_dir``; the outside readers it was handed.
May call: vtoken.snapshot, vtoken.errors, invariants.violation, the table's and KV cache's public API,
torch, numpy, xxhash.
Costs: per plan O(live tokens of every request x layers) digests, twice (launch and copy
done: the guard), plus O(total length) vectorized scans of every request's slots; with
``guard_outside`` readers, each reader called three times per plan (launch, copy done,
apply) and O(slots read outside the table x layers) more digests, twice (a hybrid layout:
requests x (window - 1)); with ``guard="local"`` O(request length x layers). A check mode,
not the serving path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import xxhash

from vtoken.errors import RelocationCheckError
from vtoken.snapshot import save as save_snapshot

from .violation import Violation

__all__ = ["RelocationChecker", "CheckedCopyEngine", "token_layer_digests", "device_fingerprint",
           "request_digest", "FINGERPRINT_BYTES"]

_M32 = 0xFFFFFFFF
# owner keys of the guard: ``code << 32 | token``; a slot read outside the token table also
# carries _OUTSIDE and its reader's index (``guard_outside``) in the bits below it
_OUTSIDE = 1 << 31
_GROUP_SHIFT = 27
_TOKEN = (1 << _GROUP_SHIFT) - 1  # token ids and positions below 2**27 (134M)


# ---------------------------------------------------------------------------- digests
def _token_layer_bytes(kv, slots: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, L, 2*H*D*itemsize]``: per token and layer its K then V bytes (on kv's device)."""
    s = torch.as_tensor(slots, dtype=torch.int64, device=kv.device)
    x = kv.flat.index_select(2, s).permute(2, 0, 1, 3, 4).contiguous()  # [n, L, 2, H, D]
    row = x.shape[2] * x.shape[3] * x.shape[4] * x.element_size()  # explicit: n may be 0 (all evicted)
    return x.view(torch.uint8).reshape(s.numel(), kv.num_layers, row)


def token_layer_digests(kv, slots) -> np.ndarray:
    """xxh3-64 of each token's K/V bytes in each layer: uint64 ``[n, L]`` (host)."""
    rows = _token_layer_bytes(kv, slots).cpu().numpy()
    n, L, row = rows.shape
    flat = rows.reshape(n * L, row)
    out = np.fromiter((xxhash.xxh3_64_intdigest(r.tobytes()) for r in flat), dtype=np.uint64,
                      count=n * L)
    return out.reshape(n, L)


_WEIGHTS: dict = {}


def _weights(nwords: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sets of odd 31-bit per-word-position weights (fixed, deterministic)."""
    key = (nwords, str(device))
    w = _WEIGHTS.get(key)
    if w is None:
        g = np.random.default_rng(0x5EED)
        a = (g.integers(0, 1 << 30, size=(2, nwords), dtype=np.int64) << 1) | 1
        w = _WEIGHTS[key] = (_to_device(a[0], device), _to_device(a[1], device))
    return w


def _mul32(v: torch.Tensor, c: int) -> torch.Tensor:
    """``(v * c) mod 2**32`` for ``0 <= v < 2**32`` in int64 without overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (v * lo + (((v * hi) & 0xFFFF) << 16)) & _M32


def _mix32(w: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 holding ``[0, 2**32)``: xorshift 16, * 0x7FEB352D, xorshift 15,
    * 0x846CA68B, xorshift 16 (mod 2**32). Each step is invertible (a right xorshift by
    k >= 1 and a multiplication by an odd constant mod 2**32), so it is a bijection."""
    v = w ^ (w >> 16)
    v = _mul32(v, 0x7FEB352D)
    v = v ^ (v >> 15)
    v = _mul32(v, 0x846CA68B)
    return v ^ (v >> 16)


def _weighted_sums(v: torch.Tensor, a1: torch.Tensor, a2: torch.Tensor) -> torch.Tensor:
    """``(sum_j v_j * a1_j, sum_j v_j * a2_j) mod 2**32`` over the last dim: int64 ``[..., 2]``.

    Exact in int64: each product is reduced to 32 bits first and a row has far fewer than
    2**31 words, so the sums cannot overflow before the final reduction."""
    s1 = ((v * a1) & _M32).sum(dim=-1) & _M32
    s2 = ((v * a2) & _M32).sum(dim=-1) & _M32
    return torch.stack([s1, s2], dim=-1)


FINGERPRINT_BYTES = 16  # per token and layer on the host: two sums, carried as int64


def device_fingerprint(kv, slots) -> torch.Tensor:
    """Per token and layer, two 32-bit sums over the K/V bytes: int64 ``[n, L, 2]`` on kv's device.

    The bytes of a (token, layer) row (its K then V, ``2 * H * D * itemsize`` bytes) are
    reinterpreted as int32 words ``w_j`` (zero-padded to a multiple of 4 bytes), mixed with
    the lowbias32 multiply-xorshift ``mix`` (a bijection on 32-bit words) and combined as
    ``F_k = sum_j mix(w_j) * a_kj mod 2**32`` for two fixed sets of odd position weights
    ``a_kj = 2 x_kj + 1``, ``x_kj`` drawn uniformly from ``[0, 2**30)`` (seeded, independent).

    Collision bound. A change of the row to ``w'`` touching the set ``J`` of words gives
    ``d_j = mix(w'_j) - mix(w_j) mod 2**32``, nonzero for ``j`` in ``J`` (``mix`` is a
    bijection), and changes ``F_k`` by ``sum_{j in J} d_j a_kj mod 2**32``. Then:

    1. ``|J| = 1``: always detected, by both sums: ``d * a`` is nonzero mod 2**32 for odd
       ``a``. This covers every single-bit flip, any change inside one fp32 value, or inside
       one word-aligned pair of bf16/fp16 values, of one token in one layer (the 384-flip
       sweep of ``tests/test_relocation_hash.py`` exercises exactly this case).
    2. ``|J| >= 2``, the change made independently of the weights (a fault does not know
       them): with ``v`` the least 2-adic valuation of the ``d_j`` (``0 <= v <= 31``), over
       the weights' draw ``Pr[F_k unchanged] <= max(2**-30, 2**(v - 31))``: fix every
       weight but one of valuation ``v``; then ``2**(v+1) u x = c mod 2**32`` (``u`` odd)
       fixes ``x`` modulo ``2**(31 - v)``, which at most ``max(1, 2**(v-1))`` of the
       ``2**30`` values of ``x`` meet. The two sums have independent weights: both stay
       unchanged with probability at most the square, ``2**-60`` for ``v <= 1``. ``mix``
       spreads a structured change (a flipped high bit in many words) over the whole
       word, so its ``d_j`` are not multiples of a large power of two by construction.
    3. It is no MAC: a change built knowing the weights can collide (two words whose mixed
       values both move by ``2**31`` cancel, since ``a_j + a_k`` is even). Behind it stand
       the xxh3 spot check of a sample of tokens, the ``full_bytes`` / ``xxh3`` mode and
       the token-id and slot checks, which are exact.

    The same integers on every device (exact arithmetic): CPU and CUDA agree bit for bit.
    """
    b = _token_layer_bytes(kv, slots)  # [n, L, B]
    n, L, B = b.shape
    if B % 4:
        b = torch.nn.functional.pad(b, (0, 4 - B % 4))
    w = b.view(torch.int32).to(torch.int64) & _M32  # [n, L, W]
    v = _mix32(w)
    a1, a2 = _weights(v.shape[-1], v.device)
    return _weighted_sums(v, a1, a2)


def _fp_u64(fp: np.ndarray) -> np.ndarray:
    """``[n, L, 2]`` fingerprint sums -> one uint64 per (token, layer)."""
    fp = np.asarray(fp).astype(np.uint64)
    return (fp[..., 0] << np.uint64(32)) | fp[..., 1]


def _rows_xxh3(rows: np.ndarray) -> np.ndarray:
    """xxh3-64 of each ``[L, B]`` row of uint8 ``[n, L, B]`` (host): uint64 ``[n, L]``."""
    n, L = rows.shape[:2]
    flat = rows.reshape(n * L, -1)
    return np.fromiter((xxhash.xxh3_64_intdigest(r.tobytes()) for r in flat), dtype=np.uint64,
                       count=n * L).reshape(n, L)


def request_digest(ids: np.ndarray, per_token_layer: np.ndarray) -> int:
    """xxh3-64 of the ordered live ids and their per-(token, layer) digests."""
    h = xxhash.xxh3_64()
    h.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(per_token_layer, dtype=np.uint64).tobytes())
    return h.intdigest()


def _combine(per_layer: np.ndarray) -> int:
    """One 64-bit digest of a token's per-layer digests (the snapshot's ``plan.digests``)."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(per_layer, dtype=np.uint64).tobytes())


# ---------------------------------------------------------------------------- host transfers
class _Fetch:
    """Device tensors on their way to the host, without a host wait.

    On CUDA each tensor is copied into pinned host memory (owned by this object) with
    ``non_blocking=True`` on the current stream, then an event is recorded: :meth:`ready`
    asks the event (never waits), :meth:`get` returns numpy arrays (waiting only when
    ``block``). Host arrays (numpy) pass through; CPU tensors are there already: ready at
    once. ``counts`` (kind -> bytes) records what crossed."""

    def __init__(self, items, counts: dict):
        self.event = None
        self.host = []
        for kind, x in items:
            if isinstance(x, torch.Tensor):
                if x.device.type == "cuda":
                    h = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                    h.copy_(x, non_blocking=True)
                    counts[kind] = counts.get(kind, 0) + x.numel() * x.element_size()
                    x = h
                    if self.event is None:
                        self.event = torch.cuda.Event()
                self.host.append(x)
            else:
                self.host.append(x)
        if self.event is not None:
            self.event.record()

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def get(self, block: bool = False) -> list:
        if self.event is not None and not self.event.query():
            if not block:
                raise RuntimeError("_Fetch.get before the copy completed")
            self.event.synchronize()
        return [x.numpy() if isinstance(x, torch.Tensor) else x for x in self.host]


def _to_device(a: np.ndarray, device) -> torch.Tensor:
    """A host index array on ``device`` without a host wait (pinned, non-blocking on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


# ---------------------------------------------------------------------------- checker
@dataclass
class _Pre:
    plan_id: int
    req_id: object
    n: int  # request length at launch
    ids: np.ndarray  # live ids at launch, logical order
    slots: Optional[np.ndarray] = None  # their pre-move slots (host; filled when fetched)
    dig: Optional[np.ndarray] = None  # [len(ids), L] uint64 (filled when fetched)
    sample_idx: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # spot-checked rows
    sample_dig: Optional[np.ndarray] = None  # their xxh3 digests (fingerprint method)
    req_digest: Optional[int] = None
    evicted: set = field(default_factory=set)
    copy_checked: bool = False
    dst_blocks: tuple = ()  # the plan's destination blocks
    guard_slots: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    guard_owner: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # per guarded slot: owner key, -1 free
    guard_dig: Optional[np.ndarray] = None  # [len(guard_slots), L]


class RelocationChecker:
    """Online hash-and-compare for one engine (one KV cache, one token table).

    Args:
        kv, table: what the plans move.
        out_dir: where failing plans' snapshots are written (None: nowhere).
        full_bytes: bring every byte to the host and xxh3 it, even on CUDA (audits).
        method: ``"xxh3"`` or ``"fingerprint"``; default: xxh3 on CPU (or with full_bytes),
            fingerprint on CUDA.
        sample: tokens spot-checked with xxh3 per comparison under ``fingerprint`` (their
            K/V bytes cross to the host; 0: only fingerprints and slots do).
        raise_on_failure: raise :class:`RelocationCheckError` (default) or only count.
        guard: the hash scope (module docstring): ``"live"`` (default) every live slot of
            every request that no move writes, plus the destination blocks; ``"local"`` only
            the destination blocks, the destinations' live neighbours and the sources (cheaper,
            blind to a write that lands on another request's token further away).

    Comparisons under ``fingerprint`` on CUDA complete asynchronously (module docstring):
    ``passed`` / ``failed`` are final after :meth:`settle` with ``block=True``.
    """

    def __init__(self, kv, table, out_dir=None, full_bytes: bool = False,
                 method: Optional[str] = None, sample: int = 8, raise_on_failure: bool = True,
                 guard: str = "live"):
        self.kv, self.table = kv, table
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.full_bytes = full_bytes
        if method is None:
            method = "xxh3" if (full_bytes or kv.device.type != "cuda") else "fingerprint"
        if method not in ("xxh3", "fingerprint"):
            raise ValueError(f"method {method!r}")
        self.method = method
        if guard not in ("live", "local"):
            raise ValueError(f"guard {guard!r}: 'live' (every live slot of every request) or 'local'")
        self.guard = guard
        self.sample = int(sample)
        self.raise_on_failure = raise_on_failure
        self.S = table.S
        self.device = kv.device
        self._pre: dict[int, _Pre] = {}
        self.passed = 0
        self.failed = 0
        self.failures: list[dict] = []
        self.violations: list[Violation] = []  # the failures as the checkers' one result shape
        self.events = 0  # relocation events seen (plans launched)
        self.guarded = 0  # slots guarded (hashed before and compared after a copy), in all
        self._dst_slots: dict[int, np.ndarray] = {}  # plan id -> destination slots its copy writes (in flight)
        self._codes: dict = {}  # request id -> owner code of its current incarnation (guard keys)
        self._names: list = []  # owner code -> request id
        self._queue: list = []  # (fetch, callback): comparisons waiting for their device digests
        self._outside: list = []  # (reads, name): slots a worker reads outside the table (guard_outside)
        self.host_bytes: dict[str, int] = {}  # kind -> bytes copied device -> host (CUDA)

    # ------------------------------------------------------------------ deferred comparisons
    def _later(self, items: list, fn) -> None:
        """Run ``fn(*host arrays)`` once ``items`` ((kind, tensor | array) pairs) are on the
        host: now if they are and nothing is queued before them (order is kept), else at
        the next :meth:`settle` that finds them ready."""
        f = _Fetch(items, self.host_bytes)
        if not self._queue and f.ready():
            fn(*f.get())
        else:
            self._queue.append((f, fn))

    def settle(self, block: bool = False) -> None:
        """Finish the queued comparisons whose digests reached the host, in issue order;
        ``block``: wait for the rest too (a host wait: teardown and tests, never a step)."""
        while self._queue:
            f, fn = self._queue[0]
            if not block and not f.ready():
                return
            self._queue.pop(0)
            fn(*f.get(block=True))

    @property
    def pending(self) -> int:
        """Comparisons issued whose digests have not reached the host yet."""
        return len(self._queue)

    def _dig_item(self, slots) -> tuple:
        """What to fetch for the per-(token, layer) digests of ``slots`` (a device tensor or
        host array): device fingerprints, or (xxh3) host digests, computed now."""
        if self.method == "xxh3":
            s = slots.cpu().numpy() if isinstance(slots, torch.Tensor) else np.asarray(slots, dtype=np.int64)
            self.host_bytes["kv"] = self.host_bytes.get("kv", 0) + len(s) * self.kv.bytes_per_token
            return ("digests", token_layer_digests(self.kv, torch.from_numpy(np.ascontiguousarray(s, dtype=np.int64))))
        st = slots if isinstance(slots, torch.Tensor) else _to_device(slots, self.device)
        return ("fingerprints", device_fingerprint(self.kv, st))

    @staticmethod
    def _digests_of(x: np.ndarray) -> np.ndarray:
        return x if x.dtype == np.uint64 else _fp_u64(x)

    def _sample_item(self, slots_dev: torch.Tensor, idx: np.ndarray) -> tuple:
        """The K/V bytes of ``slots_dev[idx]`` for the xxh3 spot check (fingerprint method)."""
        if self.method == "xxh3" or not len(idx):
            return ("kv_sample", np.zeros((0, self.kv.num_layers, 0), dtype=np.uint8))
        sel = slots_dev.index_select(0, _to_device(idx, self.device))
        return ("kv_sample", _token_layer_bytes(self.kv, sel))

    # ------------------------------------------------------------------ events
    def guard_outside(self, reads, name: str) -> None:
        """Guard slots the worker reads outside the token table too (a KV cache group the
        table does not mirror, e.g. a hybrid layout's sliding window): ``reads()`` returns, when
        called, ``[(request, positions, slots)]``: the slots the worker's next step reads of
        that group for each request in the table, the ``positions`` they hold. They join the
        live index (the guard, the launch-time and after-apply ``foreign_token`` checks) as
        live slots of their request's incarnation: a slot must keep its bytes while the same
        position of the same request is still read there. ``name`` names the group in errors."""
        self._outside.append((reads, str(name)))

    def note_evicted(self, req_id, token_ids) -> None:
        """The engine evicted these tokens of ``req_id`` (legitimately) while a copy may fly."""
        if not self._pre:
            return
        ids = [int(t) for t in token_ids]
        for p in self._pre.values():
            if p.req_id == req_id:
                p.evicted.update(ids)

    def forget_request(self, req_id) -> None:
        """The request finished: its plans in flight will never be applied (the planner
        defers their frees); drop their launch records."""
        for pid in [pid for pid, p in self._pre.items() if p.req_id == req_id]:
            del self._pre[pid]
            # its copy may still write its destinations: they stay excluded from other guards
        self._codes.pop(req_id, None)  # a later request with this id is another owner

    def before_copy(self, plan) -> None:
        """At launch, before the copy is issued: hash through the pre-move slots."""
        self.settle()
        self.events += 1
        ids = self.table.live_tokens(plan.req_id)
        sm = self.table.slot_mapping(plan.req_id)  # the device read path
        if len(ids) != sm.numel():
            self._fail(plan, "token_set_changed", f"read path has {sm.numel()} slots for {len(ids)} live tokens",
                       token=None, layer=None)
            return
        sample_idx = np.empty(0, dtype=np.int64)
        if self.method == "fingerprint" and len(ids) and self.sample > 0:
            # at most `sample` tokens: up to half of them moved ones, the rest at random
            rng = np.random.default_rng(int(plan.id))
            k = min(self.sample, len(ids))
            moved_rows = np.searchsorted(ids, np.asarray(plan.moves, dtype=np.int64).reshape(-1, 5)[:, 0])
            moved = np.unique(moved_rows[moved_rows < len(ids)])[:max(1, k // 2)]
            rest = rng.permutation(np.setdiff1d(np.arange(len(ids)), moved))[:k - len(moved)]
            sample_idx = np.sort(np.concatenate([moved, rest]).astype(np.int64))
        pre = _Pre(plan.id, plan.req_id, self.table.length(plan.req_id), ids, sample_idx=sample_idx)
        self._guard_before(plan, pre)
        self._pre[plan.id] = pre
        g = pre.guard_slots
        items = [("slots", sm.clone()), self._dig_item(sm), self._dig_item(g) if len(g) else ("digests", None),
                 self._sample_item(sm, sample_idx)]

        def done(slots, dig, gdig, sample_bytes):
            pre.slots, pre.dig = np.asarray(slots).copy(), self._digests_of(dig)
            pre.req_digest = request_digest(ids, pre.dig)
            pre.guard_dig = self._digests_of(gdig) if gdig is not None else None
            pre.sample_dig = _rows_xxh3(sample_bytes) if len(sample_idx) else None
            self._snapshot_digests(plan, pre)

        self._later(items, done)

    def after_copy(self, plan, status: str) -> None:
        """The copy engine reported a final status (before apply / abort)."""
        self._dst_slots.pop(plan.id, None)  # the copy is over: it writes nothing more
        self.settle()
        p = self._pre.get(plan.id)
        if p is None:
            return
        if status == "failed":
            # aborted: the table is unchanged, the read path must give the launch hash
            del self._pre[plan.id]
            self._check_read_path(plan, p, expect_dests=False)
            return
        m = np.asarray(plan.moves, dtype=np.int64).reshape(-1, 5)
        p.copy_checked = True
        guard = self._guard_item(plan, p)
        if len(m) == 0:
            self._later([guard[1]], lambda gdig: self._compare_guard(plan, p, guard[0], gdig))
            return
        rows = np.searchsorted(p.ids, m[:, 0])
        known = (rows < len(p.ids))
        known[known] = p.ids[rows[known]] == m[known, 0]
        if not known.all():
            t = int(m[int(np.argmin(known)), 0])
            self._fail(plan, "token_set_changed", f"moved token {t} was not live at launch", token=t, layer=None)
            return
        dst = m[:, 3] * self.S + m[:, 4]
        dst_dev = _to_device(dst, self.device) if self.method == "fingerprint" else dst
        js, ks = self._sample_pick(p, rows)
        items = [self._dig_item(dst_dev), self._sample_item(dst_dev, js) if len(js) else ("kv_sample", None),
                 guard[1]]

        def done(got, sample_bytes, gdig):
            got = self._digests_of(got)
            self._snapshot_digests(plan, p, post=got)
            # the moved tokens first (the copy's own output), then what it must not have touched
            if self._compare_rows(plan, p, m[:, 0], rows, got, dst, "copy", js, ks, sample_bytes) and \
                    self._compare_guard(plan, p, guard[0], gdig):
                self.passed += 1

        self._later(items, done)

    def after_apply(self, plan) -> None:
        """The plan was applied: hash again through the post-move read path."""
        self.settle()
        p = self._pre.pop(plan.id, None)
        self._dst_slots.pop(plan.id, None)
        if p is None:
            return
        if not self._no_foreign_tokens(plan, p):
            return
        self._check_read_path(plan, p, expect_dests=True)

    # ------------------------------------------------------------------ hash scope
    def _code(self, rid) -> int:
        """A small integer naming this incarnation of request ``rid`` (a new one after
        :meth:`forget_request`: a request id that finishes and comes back is another request)."""
        c = self._codes.get(rid)
        if c is None:
            c = self._codes[rid] = len(self._names)
            self._names.append(rid)
        return c

    def _owner(self, key: int):
        """(request, token or position) of an owner key (``code << 32 | [_OUTSIDE |] token``);
        None for -1."""
        return None if key < 0 else (self._names[key >> 32], key & _TOKEN)

    def _whose(self, key: int) -> str:
        """What an owner key names, for errors: a live token, or a position read outside the table."""
        rid, t = self._owner(key)
        if key & _OUTSIDE:
            name = self._outside[(key >> _GROUP_SHIFT) & 0xF][1] if self._outside else "a group outside the table"
            return f"position {t} of request {rid!r} in {name} (read outside the token table)"
        return f"live token {t} of request {rid!r}"

    def _live_index(self) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, keys)`` of every live token of every request, requests in the table's
        order, tokens in logical order; ``key = code << 32 | token`` names the owner
        (:meth:`_code`); then the slots each :meth:`guard_outside` reader reads, keyed
        ``code << 32 | _OUTSIDE | group << _GROUP_SHIFT | position``. Public table API only;
        O(total length + outside reads), no per-token Python."""
        sl, ky = [], []
        for rid in self.table.requests():
            s, lv = self.table.slots(rid), self.table.live_mask(rid)
            ids = np.flatnonzero(lv)
            sl.append(s[ids].astype(np.int64, copy=False))
            ky.append(ids.astype(np.int64) | (self._code(rid) << 32))
        for g, (reads, _) in enumerate(self._outside):
            for rid, pos, slots in reads():
                sl.append(np.asarray(slots, dtype=np.int64).reshape(-1))
                ky.append(np.asarray(pos, dtype=np.int64).reshape(-1) | (self._code(rid) << 32) | _OUTSIDE
                          | (g << _GROUP_SHIFT))
        if not sl:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        return np.concatenate(sl), np.concatenate(ky)

    @staticmethod
    def _keys_at(index: tuple, slots: np.ndarray) -> np.ndarray:
        """The owner key of each of ``slots`` in a live index (-1: no live token there)."""
        ls, lk = index
        out = np.full(len(slots), -1, dtype=np.int64)
        if not len(ls) or not len(slots):
            return out
        order = np.argsort(ls, kind="stable")
        ss = ls[order]
        pos = np.minimum(np.searchsorted(ss, slots), len(ss) - 1)
        hit = ss[pos] == slots
        out[hit] = lk[order[pos[hit]]]
        return out

    def _guard_before(self, plan, p: _Pre) -> None:
        """Record the slots the copy must not write (see the module docstring); their bytes are
        hashed with the launch digests. Fail when a live token of any request already sits in
        a destination block (a fill's live tokens excepted, unless a move writes them)."""
        S = self.S
        m = np.asarray(plan.moves, dtype=np.int64).reshape(-1, 5)
        dst = m[:, 3] * S + m[:, 4]
        dst_blocks = np.asarray(sorted({int(b) for b in plan.dests} | set(m[:, 3].tolist())), dtype=np.int64)
        p.dst_blocks = tuple(dst_blocks.tolist())
        self._dst_slots[plan.id] = dst.copy()
        nslots = int(self.kv.num_slots)
        live = self._live_index()
        ls, lk = live
        fills = np.asarray(sorted({int(b) for b in getattr(plan, "fills", ())}), dtype=np.int64)
        written = np.isin(ls, dst)
        in_fill = np.isin(ls // S, fills)
        outside = (lk & _OUTSIDE) != 0  # a slot of another KV cache group: in no block the copy writes
        bad = np.isin(ls // S, dst_blocks) & (~in_fill | written) | (outside & in_fill)
        if bad.any():  # fresh destinations are nobody's yet; a fill's holes are nobody's
            i = int(np.argmax(bad))
            rid, t = self._owner(int(lk[i]))
            s = int(ls[i])
            what = (f"{self._whose(int(lk[i]))} is at slot {s} in block {s // S}, a destination or fill"
                    if outside[i] else f"request {rid!r} token {t} is live at slot {s} in destination block {s // S}")
            self._fail(plan, "foreign_token", f"at launch, {what} of plan {plan.id}: the copy would overwrite or "
                                              f"alias it", token=t, layer=None)
        # every slot of the destination blocks (reserved for this plan: nobody else writes them)
        cand = [(dst_blocks[:, None] * S + np.arange(S, dtype=np.int64)[None, :]).reshape(-1)]
        if self.guard == "live":  # every live token of every request
            cand.append(ls)
        else:  # "local": live neighbours of each destination (off-by-one writes) and the sources
            near = np.concatenate([dst - 1, dst + 1, m[:, 1] * S + m[:, 2]])
            cand.append(ls[np.isin(ls, near)])
        g = np.unique(np.concatenate(cand))
        g = g[(g >= 0) & (g < nslots) & ~np.isin(g, dst)]
        p.guard_slots = g
        p.guard_owner = self._keys_at(live, g)
        self.guarded += len(g)

    def _guard_item(self, plan, p: _Pre) -> tuple:
        """When the copy reports done: which guarded slots still must hold their launch bytes
        (decided now, on the host), and the fetch item of their digests."""
        g = p.guard_slots
        if not len(g):
            return np.empty(0, dtype=np.int64), ("digests", None)
        cur = self._keys_at(self._live_index(), g)
        others = [w for pid, w in self._dst_slots.items() if pid != plan.id]
        free = p.guard_owner < 0  # a free slot of a reserved destination block: nothing may write it
        ok = np.where(free, cur < 0, cur == p.guard_owner)  # a live slot: while the same token holds it
        if others:
            ok &= ~np.isin(g, np.concatenate(others))  # another plan's copy writes it
        keep = np.flatnonzero(ok).astype(np.int64)
        if not len(keep):
            return keep, ("digests", None)
        return keep, self._dig_item(g[keep])

    def _compare_guard(self, plan, p: _Pre, keep: np.ndarray, got) -> bool:
        if p.guard_dig is None or not len(keep) or got is None:
            return True
        got = self._digests_of(got)
        bad = (got != p.guard_dig[keep]).any(axis=1)
        if not bad.any():
            return True
        i = int(keep[int(np.argmax(bad))])
        s = int(p.guard_slots[i])
        key = int(p.guard_owner[i])
        own = self._owner(key)
        layer = int(np.argmax(got[int(np.argmax(bad))] != p.guard_dig[i]))
        whose = self._whose(key) if own is not None else f"a free slot of destination block {s // self.S}"
        self._fail(plan, "guard_overwritten",
                   f"slot {s} (block {s // self.S} offset {s % self.S}), which no move of the plan writes, changed "
                   f"while its copy was in flight: {whose} (layer {layer}); a write past a destination, or into "
                   f"a block the copy uses or another request's live token", token=own[1] if own else None,
                   layer=layer)
        return False

    def _no_foreign_tokens(self, plan, p: _Pre) -> bool:
        """After apply: no request but the plan's holds a live token in a destination block, and
        no slot read outside the table (``guard_outside``) lies in one."""
        blocks = np.asarray(p.dst_blocks, dtype=np.int64)
        if not len(blocks):
            return True
        ls, lk = self._live_index() if self._outside else (np.empty(0, dtype=np.int64),) * 2
        hit = np.flatnonzero(((lk & _OUTSIDE) != 0) & np.isin(ls // self.S, blocks))
        if len(hit):
            s = int(ls[hit[0]])
            self._fail(plan, "foreign_token", f"{self._whose(int(lk[hit[0]]))} is at slot {s} in destination block "
                                              f"{s // self.S} of plan {plan.id}", token=None, layer=None)
            return False
        for rid in self.table.requests():
            if rid == p.req_id:
                continue
            sl, lv = self.table.slots(rid), self.table.live_mask(rid)
            hit = np.flatnonzero(lv & np.isin(sl // self.S, blocks))
            if len(hit):
                t = int(hit[0])
                self._fail(plan, "foreign_token",
                           f"request {rid!r} token {t} is live at slot {int(sl[t])} in destination block "
                           f"{int(sl[t]) // self.S} of plan {plan.id} (request {p.req_id!r})", token=t, layer=None)
                return False
        return True

    def _snapshot_digests(self, plan, p: _Pre, post: Optional[np.ndarray] = None) -> None:
        """Fill ``plan.digests`` of the plan's snapshot (pre at launch, post when the copy is
        done), aligned with the SNAPSHOT's moves by token: a planned move the copy does not
        carry (its token died before launch) gets ``null``, never a neighbour's digest."""
        snap = getattr(plan, "snapshot", None)
        if not isinstance(snap, dict) or not isinstance(snap.get("plan"), dict):
            return
        planned = [mv[0] for mv in snap["plan"].get("moves", [])]
        m = np.asarray(plan.moves, dtype=np.int64).reshape(-1, 5)
        if post is None:
            rows = np.searchsorted(p.ids, m[:, 0]) if len(m) else np.zeros(0, dtype=np.int64)
            by_tok = {}
            for t, r in zip(m[:, 0].tolist(), rows.tolist()):
                if r < len(p.ids) and int(p.ids[r]) == t:
                    by_tok[t] = _combine(p.dig[r])
            snap["plan"]["digests"] = {"method": self.method, "pre": [by_tok.get(t) for t in planned],
                                       "post": [None] * len(planned)}
        else:
            dg = snap["plan"].get("digests")
            if isinstance(dg, dict) and len(dg.get("post", ())) == len(planned):
                by_tok = {t: _combine(row) for t, row in zip(m[:, 0].tolist(), post)}
                dg["post"] = [by_tok.get(t) for t in planned]

    # ------------------------------------------------------------------ comparisons
    def _sample_pick(self, p: _Pre, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions in ``rows``, positions in ``p.sample_idx``) of the spot-checked rows
        that take part in a comparison over ``rows``."""
        if not len(p.sample_idx):
            e = np.empty(0, dtype=np.int64)
            return e, e
        pos = {int(r): j for j, r in enumerate(np.asarray(rows).tolist())}
        pick = [(pos[int(r)], k) for k, r in enumerate(p.sample_idx.tolist()) if int(r) in pos]
        return (np.array([a for a, _ in pick], dtype=np.int64), np.array([b for _, b in pick], dtype=np.int64))

    def _check_read_path(self, plan, p: _Pre, expect_dests: bool) -> None:
        """The request's read path against the launch hash: token ids now (host), slots and
        bytes when their digests arrive; counts one pass."""
        ids_all = self.table.live_tokens(p.req_id)
        sm = self.table.slot_mapping(p.req_id)
        if len(ids_all) != sm.numel():
            self._fail(plan, "token_set_changed",
                       f"read path has {sm.numel()} slots for {len(ids_all)} live tokens", token=None, layer=None)
            return
        old = ids_all < p.n  # tokens synced after the launch are not part of the event
        ids = ids_all[old]
        expect = p.ids
        evicted = set(p.evicted)
        if evicted:
            expect = p.ids[~np.isin(p.ids, np.fromiter(evicted, dtype=np.int64, count=len(evicted)))]
        if len(ids) != len(expect) or not np.array_equal(ids, expect):
            diff = _first_diff(ids, expect)
            self._fail(plan, "token_set_changed",
                       f"live ids through the read path differ from the launch set (less evictions): "
                       f"first difference at token {diff}", token=diff, layer=None)
            return
        rows = np.searchsorted(p.ids, ids)
        sel = sm if bool(old.all()) else sm.index_select(0, _to_device(np.flatnonzero(old), self.device))
        js, ks = self._sample_pick(p, rows)
        m = np.asarray(plan.moves, dtype=np.int64).reshape(-1, 5)
        items = [("slots", sel.clone()), self._dig_item(sel),
                 self._sample_item(sel, js) if len(js) else ("kv_sample", None)]

        def done(slots, got, sample_bytes):
            got = self._digests_of(got)
            if expect_dests and len(m):
                mv_pos = np.searchsorted(ids, m[:, 0])
                ok = mv_pos < len(ids)
                ok[ok] = ids[mv_pos[ok]] == m[ok, 0]  # moved tokens still live
                want = m[:, 3] * self.S + m[:, 4]
                stale = ok.copy()
                stale[ok] = slots[mv_pos[ok]] != want[ok]
                if stale.any():
                    i = int(np.argmax(stale))
                    t = int(m[i, 0])
                    self._fail(plan, "stale_slot",
                               f"token {t}: the read path gives slot {int(slots[mv_pos[i]])}, the move put it at "
                               f"{int(want[i])} (block {int(m[i, 3])} offset {int(m[i, 4])})", token=t, layer=None)
                    return
            want_req = p.req_digest if not evicted else request_digest(expect, p.dig[rows])
            if self.method == "xxh3" and request_digest(ids, got) == want_req:
                self.passed += 1  # the ordered hash agrees
                return
            if self._compare_rows(plan, p, ids, rows, got, slots, "read path", js, ks, sample_bytes):
                self.passed += 1

        self._later(items, done)

    def _compare_rows(self, plan, p: _Pre, toks, rows, got, slots, what: str, js=None, ks=None,
                      sample_bytes=None) -> bool:
        want = p.dig[rows]
        bad = want != got  # [k, L]
        if bad.any():
            i = int(np.argmax(bad.any(axis=1)))
            layer = int(np.argmax(bad[i]))
            t = int(toks[i])
            self._fail(plan, "relocation_mismatch",
                       f"{what}: token {t} layer {layer} K/V bytes at slot {int(slots[i])} differ from the launch "
                       f"hash (pre-move slot {int(p.slots[rows[i]])})", token=t, layer=layer)
            return False
        if p.sample_dig is not None and js is not None and len(js) and sample_bytes is not None:
            # xxh3 spot check of the sampled rows that take part in this comparison
            host = _rows_xxh3(sample_bytes)
            badx = host != p.sample_dig[ks]
            if badx.any():
                i = int(np.argmax(badx.any(axis=1)))
                layer = int(np.argmax(badx[i]))
                t = int(toks[js[i]])
                self._fail(plan, "relocation_mismatch",
                           f"{what}: token {t} layer {layer}: xxh3 spot check differs (fingerprint agreed)",
                           token=t, layer=layer)
                return False
        return True

    def _fail(self, plan, code: str, detail: str, token, layer) -> None:
        self.failed += 1
        info = {"code": code, "plan": int(plan.id), "request": str(plan.req_id), "token": token,
                "layer": layer, "detail": detail}
        path = None
        if self.out_dir is not None:
            snap = getattr(plan, "snapshot", None)
            if snap is None:
                snap = _minimal_snapshot(plan, self.S)
            path = save_snapshot(snap, self.out_dir / f"plan-{plan.id}.json")
            (self.out_dir / f"plan-{plan.id}.failure.json").write_text(json.dumps(info, indent=1))
            info["snapshot"] = str(path)
        self.failures.append(info)
        msg = (f"plan {plan.id}, request {plan.req_id!r}: first differing token {token}, layer {layer}: {detail}"
               + (f" (snapshot {path})" if path else ""))
        found = Violation("relocation", msg, dict(info), code)
        self.violations.append(found)
        if self.raise_on_failure:
            raise RelocationCheckError(code, msg, violations=[found])

    # ------------------------------------------------------------------ wiring
    def wrap(self, engine) -> "CheckedCopyEngine":
        return CheckedCopyEngine(engine, self)

    @property
    def in_flight(self) -> int:
        return len(self._pre)


def _first_diff(a: np.ndarray, b: np.ndarray):
    n = min(len(a), len(b))
    ne = np.flatnonzero(a[:n] != b[:n])
    if len(ne):
        i = int(ne[0])
        return int(min(a[i], b[i]))
    if len(a) != len(b):
        return int((a if len(a) > len(b) else b)[n])
    return None


def _minimal_snapshot(plan, S: int) -> dict:
    from vtoken.snapshot import SCHEMA

    return {"schema": SCHEMA, "block_size": S,
            "plan": {"id": int(plan.id), "request": str(plan.req_id), "sources": list(plan.sources),
                     "dests": list(plan.dests), "fills": list(getattr(plan, "fills", ())),
                     "moves": np.asarray(plan.moves).tolist()},
            "pre": {"requests": {}}, "post": None, "shared_blocks": [], "headroom": [], "in_flight": [],
            "schedule": [], "evicted_in_flight": []}


class CheckedCopyEngine:
    """A copy engine that runs the checker around an inner one (same protocol, same extras)."""

    def __init__(self, inner, checker: RelocationChecker):
        self.inner, self.checker = inner, checker
        self._plans: dict[int, object] = {}  # id(handle) -> plan

    def launch(self, plan):
        self.checker.before_copy(plan)
        h = self.inner.launch(plan)
        self._plans[id(h)] = (h, plan)
        return h

    def _seen(self, handle, status: str) -> str:
        if status != "pending":
            entry = self._plans.pop(id(handle), None)
            if entry is not None:
                self.checker.after_copy(entry[1], status)
        return status

    def poll(self, handle) -> str:
        return self._seen(handle, self.inner.poll(handle))

    def wait(self, handle) -> str:
        return self._seen(handle, self.inner.wait(handle))

    def wait_before_attention(self):
        self.checker.settle()  # comparisons whose digests arrived (no host wait)
        return self.inner.wait_before_attention()

    def synchronize(self):
        self.inner.synchronize()
        self.checker.settle(block=True)

    def __getattr__(self, name):  # fail_next_copy, stats, ...
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in ("inner", "checker", "_plans"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)
