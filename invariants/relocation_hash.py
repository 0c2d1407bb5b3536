"""Hash-and-compare around every relocation event: I1 (token conservation) and I2 (the
read path points at the moves' destinations), checked online, byte-exact.

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
not: nobody else may write a reserved destination block), every live slot of EVERY request
inside the destination blocks, every live slot of every request right next to a move's
destination (one slot before or after it: where an off-by-one in the scatter lands), and
the moves' source slots. When the copy reports done, each guarded slot must hold the same
bytes -- a live slot only while the same token of the same request still holds it (a slot
that changed hands meanwhile was written legitimately), and never a slot another plan's
copy writes. A difference raises ``guard_overwritten`` naming the slot and its owner. When
the plan is applied, no request other than the plan's may hold a live token in a
destination block (``foreign_token``). The cost is one scan of every request's slots per
plan: a check mode, not the serving path.

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

Methods
-------
``xxh3`` (the CPU default, and ``full_bytes=True`` anywhere): the bytes go to the host and
each (token, layer) is digested with xxh3-64. ``fingerprint`` (the CUDA default): a device
fingerprint (:func:`device_fingerprint`: the bytes as int32 words, each mixed with a
multiply-xorshift bijection and summed with per-word position weights, two 32-bit sums per
token and layer, in one pass) so only 16 bytes per token and layer cross to the host, plus
an xxh3 spot check of ``sample`` tokens per comparison. The fingerprint is exact integer
arithmetic, so it runs (and is tested) on the CPU too, and gives the same values on CUDA.

Hooking it in without touching the planner: :meth:`RelocationChecker.wrap` returns a copy
engine that calls :meth:`before_copy` in ``launch`` and :meth:`after_copy` when ``poll`` /
``wait`` first report a final status; the planner's ``on_applied`` callback calls
:meth:`after_apply`.
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

__all__ = ["RelocationChecker", "CheckedCopyEngine", "token_layer_digests", "device_fingerprint",
           "request_digest"]

_M32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------- digests
def _token_layer_bytes(kv, slots: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, L, 2*H*D*itemsize]``: per token and layer its K then V bytes (on kv's device)."""
    s = torch.as_tensor(slots, dtype=torch.int64, device=kv.device)
    x = kv.flat.index_select(2, s).permute(2, 0, 1, 3, 4).contiguous()  # [n, L, 2, H, D]
    return x.view(torch.uint8).reshape(s.numel(), kv.num_layers, -1)


def token_layer_digests(kv, slots) -> np.ndarray:
    """xxh3-64 of each token's K/V bytes in each layer: uint64 ``[n, L]`` (host)."""
    rows = _token_layer_bytes(kv, slots).cpu().numpy()
    n, L, _ = rows.shape
    flat = rows.reshape(n * L, -1)
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
        w = _WEIGHTS[key] = (torch.from_numpy(a[0]).to(device), torch.from_numpy(a[1]).to(device))
    return w


def _mul32(v: torch.Tensor, c: int) -> torch.Tensor:
    """``(v * c) mod 2**32`` for ``0 <= v < 2**32`` in int64 without overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (v * lo + (((v * hi) & 0xFFFF) << 16)) & _M32


def device_fingerprint(kv, slots) -> torch.Tensor:
    """Per token and layer, two 32-bit sums over the K/V bytes: int64 ``[n, L, 2]`` on kv's device.

    The bytes are reinterpreted as int32 words ``w_j`` (zero-padded to a multiple of 4
    bytes), mixed with the lowbias32 multiply-xorshift (a bijection on 32-bit words), and
    combined as ``sum_j mix(w_j) * a_j mod 2**32`` for two sets of odd position weights
    ``a_j``. Any single changed word changes both sums; swapping words changes them too.
    """
    b = _token_layer_bytes(kv, slots)  # [n, L, B]
    n, L, B = b.shape
    if B % 4:
        b = torch.nn.functional.pad(b, (0, 4 - B % 4))
    w = b.view(torch.int32).to(torch.int64) & _M32  # [n, L, W]
    v = w ^ (w >> 16)
    v = _mul32(v, 0x7FEB352D)
    v = v ^ (v >> 15)
    v = _mul32(v, 0x846CA68B)
    v = v ^ (v >> 16)
    a1, a2 = _weights(v.shape[-1], v.device)
    s1 = ((v * a1) & _M32).sum(dim=-1) & _M32
    s2 = ((v * a2) & _M32).sum(dim=-1) & _M32
    return torch.stack([s1, s2], dim=-1)


def _fp_digests(kv, slots) -> np.ndarray:
    fp = device_fingerprint(kv, slots).cpu().numpy().astype(np.uint64)  # [n, L, 2]
    return (fp[..., 0] << np.uint64(32)) | fp[..., 1]


def request_digest(ids: np.ndarray, per_token_layer: np.ndarray) -> int:
    """xxh3-64 of the ordered live ids and their per-(token, layer) digests."""
    h = xxhash.xxh3_64()
    h.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(per_token_layer, dtype=np.uint64).tobytes())
    return h.intdigest()


def _combine(per_layer: np.ndarray) -> int:
    """One 64-bit digest of a token's per-layer digests (the snapshot's ``plan.digests``)."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(per_layer, dtype=np.uint64).tobytes())


# ---------------------------------------------------------------------------- checker
@dataclass
class _Pre:
    plan_id: int
    req_id: object
    n: int  # request length at launch
    ids: np.ndarray  # live ids at launch, logical order
    slots: np.ndarray  # their pre-move slots
    dig: np.ndarray  # [len(ids), L] uint64
    sample_idx: np.ndarray  # rows spot-checked with xxh3 (fingerprint method)
    sample_dig: Optional[np.ndarray]
    req_digest: int
    evicted: set = field(default_factory=set)
    copy_checked: bool = False
    dst_blocks: tuple = ()  # the plan's destination blocks
    guard_slots: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    guard_owner: list = field(default_factory=list)  # per guarded slot: (request, token) live there, or None
    guard_dig: Optional[np.ndarray] = None  # [len(guard_slots), L]


class RelocationChecker:
    """Online hash-and-compare for one engine (one KV cache, one token table).

    Args:
        kv, table: what the plans move.
        out_dir: where failing plans' snapshots are written (None: nowhere).
        full_bytes: bring every byte to the host and xxh3 it, even on CUDA (audits).
        method: ``"xxh3"`` or ``"fingerprint"``; default: xxh3 on CPU (or with full_bytes),
            fingerprint on CUDA.
        sample: tokens spot-checked with xxh3 per comparison under ``fingerprint``.
        raise_on_failure: raise :class:`RelocationCheckError` (default) or only count.
    """

    def __init__(self, kv, table, out_dir=None, full_bytes: bool = False,
                 method: Optional[str] = None, sample: int = 8, raise_on_failure: bool = True):
        self.kv, self.table = kv, table
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.full_bytes = full_bytes
        if method is None:
            method = "xxh3" if (full_bytes or kv.device.type != "cuda") else "fingerprint"
        if method not in ("xxh3", "fingerprint"):
            raise ValueError(f"method {method!r}")
        self.method = method
        self.sample = int(sample)
        self.raise_on_failure = raise_on_failure
        self.S = table.S
        self._pre: dict[int, _Pre] = {}
        self.passed = 0
        self.failed = 0
        self.failures: list[dict] = []
        self.events = 0  # relocation events seen (plans launched)
        self.guarded = 0  # slots guarded (hashed before and compared after a copy), in all
        self._dst_slots: dict[int, set] = {}  # plan id -> destination slots its copy writes (in flight)

    # ------------------------------------------------------------------ digests
    def _digests(self, slots: np.ndarray) -> np.ndarray:
        st = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64))
        if self.method == "xxh3":
            return token_layer_digests(self.kv, st)
        return _fp_digests(self.kv, st.to(self.kv.device))

    def _sample_digests(self, slots: np.ndarray) -> Optional[np.ndarray]:
        if self.method == "xxh3" or len(slots) == 0:
            return None
        return token_layer_digests(self.kv, torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)))

    def _read_path(self, req_id) -> tuple[np.ndarray, np.ndarray]:
        """(live ids, their slots from the device read path), logical order."""
        ids = self.table.live_tokens(req_id)
        slots = self.table.slot_mapping(req_id).cpu().numpy().copy()
        return ids, slots

    # ------------------------------------------------------------------ events
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

    def before_copy(self, plan) -> None:
        """At launch, before the copy is issued: hash through the pre-move slots."""
        self.events += 1
        ids, slots = self._read_path(plan.req_id)
        if len(ids) != len(slots):
            self._fail(plan, "token_set_changed", f"read path has {len(slots)} slots for {len(ids)} live tokens",
                       token=None, layer=None)
            return
        dig = self._digests(slots)
        if self.method == "fingerprint" and len(ids):
            rng = np.random.default_rng(int(plan.id))
            k = min(self.sample, len(ids))
            moved_rows = np.searchsorted(ids, np.asarray(plan.moves, dtype=np.int64).reshape(-1, 5)[:, 0])
            pool = np.unique(np.concatenate([rng.choice(len(ids), size=k, replace=False),
                                             moved_rows[:max(1, k // 2)]]))
            sample_idx = np.sort(pool)
            sample_dig = self._sample_digests(slots[sample_idx])
        else:
            sample_idx, sample_dig = np.empty(0, dtype=np.int64), None
        pre = _Pre(plan.id, plan.req_id, self.table.length(plan.req_id), ids, slots, dig,
                   sample_idx, sample_dig, request_digest(ids, dig))
        self._guard_before(plan, pre)
        self._pre[plan.id] = pre
        self._snapshot_digests(plan, pre)

    def after_copy(self, plan, status: str) -> None:
        """The copy engine reported a final status (before apply / abort)."""
        self._dst_slots.pop(plan.id, None)  # the copy is over: it writes nothing more
        p = self._pre.get(plan.id)
        if p is None:
            return
        if status == "failed":
            # aborted: the table is unchanged, the read path must give the launch hash
            del self._pre[plan.id]
            if self._compare_read_path(plan, p, expect_dests=False):
                self.passed += 1
            return
        m = np.asarray(plan.moves, dtype=np.int64).reshape(-1, 5)
        p.copy_checked = True
        if len(m) == 0:
            self._compare_guard(plan, p)
            return
        rows = np.searchsorted(p.ids, m[:, 0])
        known = (rows < len(p.ids))
        known[known] = p.ids[rows[known]] == m[known, 0]
        if not known.all():
            t = int(m[int(np.argmin(known)), 0])
            self._fail(plan, "token_set_changed", f"moved token {t} was not live at launch", token=t, layer=None)
            return
        dst = m[:, 3] * self.S + m[:, 4]
        got = self._digests(dst)
        self._snapshot_digests(plan, p, post=got)
        # the moved tokens first (the copy's own output), then what it must not have touched
        if self._compare_rows(plan, p, m[:, 0], rows, got, dst, what="copy") and self._compare_guard(plan, p):
            self.passed += 1

    def after_apply(self, plan) -> None:
        """The plan was applied: hash again through the post-move read path."""
        p = self._pre.pop(plan.id, None)
        self._dst_slots.pop(plan.id, None)
        if p is None:
            return
        if not self._no_foreign_tokens(plan, p):
            return
        if self._compare_read_path(plan, p, expect_dests=True):
            self.passed += 1

    # ------------------------------------------------------------------ hash scope
    def _live_owners(self) -> dict:
        """slot -> (request, token) for every live token of every request (public API only)."""
        owners = {}
        for rid in self.table.requests():
            sl, lv = self.table.slots(rid), self.table.live_mask(rid)
            ids = np.flatnonzero(lv)
            for t, s in zip(ids.tolist(), sl[ids].tolist()):
                owners[int(s)] = (rid, int(t))
        return owners

    def _guard_before(self, plan, p: _Pre) -> None:
        """Record the slots the copy must not write and their bytes (see the module docstring);
        fail when a live token of any request already sits in a destination block."""
        S = self.S
        m = np.asarray(plan.moves, dtype=np.int64).reshape(-1, 5)
        dst = m[:, 3] * S + m[:, 4]
        dst_blocks = sorted({int(b) for b in plan.dests} | set(m[:, 3].tolist()))
        p.dst_blocks = tuple(dst_blocks)
        writes = set(dst.tolist())
        self._dst_slots[plan.id] = writes
        nslots = int(self.kv.num_slots)
        owners = self._live_owners()
        blocks = set(dst_blocks)
        for s, (rid, t) in owners.items():  # destinations are fresh headroom blocks: nobody's yet
            if s // S in blocks:
                self._fail(plan, "foreign_token",
                           f"at launch, request {rid!r} token {t} is live at slot {s} in destination block {s // S} "
                           f"of plan {plan.id}: the copy would overwrite or alias it", token=t, layer=None)
                break
        guard = {}  # slot -> owner (None: must not change whatever holds it)
        for b in dst_blocks:  # reserved for this plan: nobody else writes them
            for s in range(b * S, min((b + 1) * S, nslots)):
                if s not in writes:
                    guard[s] = owners.get(s)
        for s in writes:  # live neighbours of every destination (off-by-one writes land there)
            for x in (s - 1, s + 1):
                if 0 <= x < nslots and x not in writes and x in owners:
                    guard.setdefault(x, owners[x])
        for s in (m[:, 1] * S + m[:, 2]).tolist():  # the sources: read, never written
            if s not in writes and s in owners:
                guard.setdefault(int(s), owners[s])
        p.guard_slots = np.fromiter(sorted(guard), dtype=np.int64, count=len(guard))
        p.guard_owner = [guard[int(s)] for s in p.guard_slots]
        p.guard_dig = self._digests(p.guard_slots) if len(guard) else None
        self.guarded += len(guard)

    def _compare_guard(self, plan, p: _Pre) -> bool:
        if p.guard_dig is None:
            return True
        owners = self._live_owners()
        others = set().union(*[w for pid, w in self._dst_slots.items() if pid != plan.id]) if self._dst_slots else set()
        blocks = set(p.dst_blocks)
        keep = []
        for k, (s, own) in enumerate(zip(p.guard_slots.tolist(), p.guard_owner)):
            if s in others:
                continue  # another plan's copy writes it
            if own is None:  # a free slot of a reserved destination block: nothing may write it
                if s // self.S in blocks and s not in owners:
                    keep.append(k)
            elif owners.get(s) == own:  # the same token still holds it
                keep.append(k)
        if not keep:
            return True
        keep = np.asarray(keep, dtype=np.int64)
        got = self._digests(p.guard_slots[keep])
        bad = (got != p.guard_dig[keep]).any(axis=1)
        if not bad.any():
            return True
        i = int(keep[int(np.argmax(bad))])
        s = int(p.guard_slots[i])
        own = p.guard_owner[i]
        layer = int(np.argmax(got[int(np.argmax(bad))] != p.guard_dig[i]))
        whose = (f"live token {own[1]} of request {own[0]!r}" if own is not None
                 else f"a free slot of destination block {s // self.S}")
        self._fail(plan, "guard_overwritten",
                   f"slot {s} (block {s // self.S} offset {s % self.S}), which no move of the plan writes, changed "
                   f"while its copy was in flight: {whose} (layer {layer}); a write past a destination, or into "
                   f"a block the copy uses", token=own[1] if own else None, layer=layer)
        return False

    def _no_foreign_tokens(self, plan, p: _Pre) -> bool:
        """After apply: no request but the plan's holds a live token in a destination block."""
        blocks = np.asarray(p.dst_blocks, dtype=np.int64)
        if not len(blocks):
            return True
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
    def _compare_read_path(self, plan, p: _Pre, expect_dests: bool) -> bool:
        ids_all, slots_all = self._read_path(p.req_id)
        if len(ids_all) != len(slots_all):
            self._fail(plan, "token_set_changed",
                       f"read path has {len(slots_all)} slots for {len(ids_all)} live tokens", token=None, layer=None)
            return False
        old = ids_all < p.n  # tokens synced after the launch are not part of the event
        ids, slots = ids_all[old], slots_all[old]
        expect = p.ids
        if p.evicted:
            expect = p.ids[~np.isin(p.ids, np.fromiter(p.evicted, dtype=np.int64, count=len(p.evicted)))]
        if len(ids) != len(expect) or not np.array_equal(ids, expect):
            diff = _first_diff(ids, expect)
            self._fail(plan, "token_set_changed",
                       f"live ids through the read path differ from the launch set (less evictions): "
                       f"first difference at token {diff}", token=diff, layer=None)
            return False
        rows = np.searchsorted(p.ids, ids)
        if expect_dests:
            m = np.asarray(plan.moves, dtype=np.int64).reshape(-1, 5)
            if len(m):
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
                    return False
        got = self._digests(slots)
        want_req = p.req_digest if not p.evicted else request_digest(expect, p.dig[rows])
        if request_digest(ids, got) == want_req and self.method == "xxh3":
            return True  # the ordered hash agrees
        return self._compare_rows(plan, p, ids, rows, got, slots, what="read path")

    def _compare_rows(self, plan, p: _Pre, toks, rows, got, slots, what: str) -> bool:
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
        if p.sample_dig is not None and len(p.sample_idx):
            # xxh3 spot check of the sampled rows that take part in this comparison
            pos = {int(r): j for j, r in enumerate(np.asarray(rows).tolist())}
            pick = [(pos[int(r)], k) for k, r in enumerate(p.sample_idx.tolist()) if int(r) in pos]
            if pick:
                js = np.array([a for a, _ in pick])
                ks = np.array([b for _, b in pick])
                host = token_layer_digests(self.kv, torch.from_numpy(np.ascontiguousarray(slots[js], dtype=np.int64)))
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
        if self.raise_on_failure:
            raise RelocationCheckError(code, msg)

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
                     "dests": list(plan.dests), "moves": np.asarray(plan.moves).tolist()},
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

    def __getattr__(self, name):  # wait_before_attention, fail_next_copy, stats, ...
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in ("inner", "checker", "_plans"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)
