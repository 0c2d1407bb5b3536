"""A second token table, written from the reference model's contract (``vtoken/spec``), not
from ``vtoken/table.py``: the proof that the toolkit checks code vtoken did not write.

Plain Python lists, arranged differently from both the spec (dicts of token records) and
vtoken (numpy arrays with incremental counts): per request three parallel lists (block,
offset, live) indexed by token id, and per slot ``block * S + offset`` two flat lists over
the whole pool: how many requests hold a live token there (``claims``) and which token id
was last placed there while the block was referenced (``placed``, -1 for none). Block
reference counts are a flat list too. Every operation validates its whole input first
(types, then each item in input order, checks in the order the spec lists) and raises
:class:`AltError` with the spec's code, changing nothing.

``LeakyAltTable`` is the planted-bug variant: ``free_request`` forgets to drop its reference
on blocks another request shares (a ref-count leak, bug class 4). The conformance machine
must catch it and name the operation.
"""

from __future__ import annotations

import numbers

NULL = 0


class AltError(Exception):
    def __init__(self, code: str, msg: str = ""):
        super().__init__(f"{code}: {msg}")
        self.code = code


def _int_ok(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _listlike(xs) -> bool:
    if isinstance(xs, (str, bytes, bytearray, memoryview)):
        return False
    if getattr(xs, "ndim", 1) != 1:
        return False
    kind = getattr(getattr(xs, "dtype", None), "kind", "O")
    return kind in "iuO"


def _int_list(xs, code="not_integer") -> list:
    if not _listlike(xs):
        raise AltError(code, "not a list of integers")
    try:
        out = list(xs)
    except TypeError:
        raise AltError(code, "not a list of integers") from None
    for x in out:
        if not _int_ok(x):
            raise AltError(code, "a non-integer in the list")
    return [int(x) for x in out]


def _one_int(x) -> int:
    if not _int_ok(x):
        raise AltError("not_integer", "not an integer")
    return int(x)


class _R:
    __slots__ = ("blk", "off", "live", "owned")

    def __init__(self):
        self.blk: list = []
        self.off: list = []
        self.live: list = []
        self.owned: list = []  # blocks referenced, in first-reference order (a list: no sets here)


class AltTable:
    def __init__(self, block_size: int, num_blocks: int):
        self.S = int(block_size)
        self.num_blocks = int(num_blocks)
        self.reqs: dict = {}
        n = self.num_blocks * self.S
        self.claims = [0] * n
        self.placed = [-1] * n
        self.refcnt = [0] * self.num_blocks

    # -------------------------------------------------------------- helpers
    @staticmethod
    def _hashable(req):
        try:
            hash(req)
        except TypeError:
            raise AltError("bad_request_id", "unhashable request id") from None

    def _get(self, req) -> _R:
        self._hashable(req)
        r = self.reqs.get(req)
        if r is None:
            raise AltError("unknown_request", repr(req))
        return r

    def _ref(self, r: _R, b: int):
        if b not in r.owned:
            r.owned.append(b)
            self.refcnt[b] += 1

    def _unref(self, r: _R, b: int):
        r.owned.remove(b)
        self.refcnt[b] -= 1
        if self.refcnt[b] == 0:
            for s in range(b * self.S, (b + 1) * self.S):
                self.placed[s] = -1

    def _live_in(self, b: int) -> int:
        return sum(1 for s in range(b * self.S, (b + 1) * self.S) if self.claims[s] > 0)

    # -------------------------------------------------------------- operations
    def sync_new_tokens(self, req, block_ids, total_len):
        self._hashable(req)
        r = self.reqs.get(req)
        n = len(r.blk) if r else 0
        owned = r.owned if r else []
        total = _one_int(total_len)
        if not (isinstance(block_ids, (list, tuple, range)) or getattr(block_ids, "ndim", None) == 1):
            raise AltError("not_integer", "block_ids")
        if total < n:
            raise AltError("length_decrease")
        if len(block_ids) * self.S < total:
            raise AltError("blocks_short")
        if total > n:
            for j in range(n // self.S, (total - 1) // self.S + 1):
                if not _int_ok(block_ids[j]):
                    raise AltError("not_integer", "a block id")
        slots = []
        for p in range(n, total):
            b, o = int(block_ids[p // self.S]), p % self.S
            if b < 0 or b >= self.num_blocks:
                raise AltError("block_out_of_range")
            if b == NULL:
                raise AltError("null_block")
            s = b * self.S + o
            others = self.refcnt[b] - (1 if b in owned else 0)
            ok = self.placed[s] == p if others > 0 else self.placed[s] == -1
            if not ok or s in slots:
                raise AltError("slot_conflict")
            slots.append(s)
        if r is None:
            r = self.reqs[req] = _R()
        for i, s in enumerate(slots):
            b = s // self.S
            r.blk.append(b)
            r.off.append(s % self.S)
            r.live.append(True)
            self._ref(r, b)
            self.placed[s] = n + i
            self.claims[s] += 1
        return slots

    def evict_tokens(self, req, ids):
        r = self._get(req)
        ids = _int_list(ids)
        seen = []
        for t in ids:
            if t < 0 or t >= len(r.blk):
                raise AltError("unknown_token")
            if not r.live[t]:
                raise AltError("dead_token")
            if t in seen:
                raise AltError("duplicate_token")
            seen.append(t)
        for t in ids:
            r.live[t] = False
            self.claims[r.blk[t] * self.S + r.off[t]] -= 1

    def evict_token(self, req, t):
        self._get(req)
        self.evict_tokens(req, [_one_int(t)])

    def apply_moves(self, req, moves):
        r = self._get(req)
        S = self.S
        if isinstance(moves, (str, bytes, bytearray, memoryview)) or getattr(moves, "ndim", 2) == 0 or \
                getattr(getattr(moves, "dtype", None), "kind", "O") not in "iuO":
            raise AltError("bad_move")
        try:
            rows = list(moves)
        except TypeError:
            raise AltError("bad_move") from None
        for mv in rows:
            if not (isinstance(mv, (list, tuple)) or getattr(mv, "ndim", None) == 1) or len(mv) != 5:
                raise AltError("bad_move")
        for mv in rows:
            for x in mv:
                if not _int_ok(x):
                    raise AltError("bad_move")
        rows = [[int(x) for x in mv] for mv in rows]
        live_slots = [r.blk[t] * S + r.off[t] for t in range(len(r.blk)) if r.live[t]]
        toks_seen, dst_seen = [], []
        for t, sb, so, db, do in rows:
            if t < 0 or t >= len(r.blk):
                raise AltError("unknown_token")
            if not r.live[t]:
                raise AltError("dead_token")
            if t in toks_seen:
                raise AltError("duplicate_token")
            if (sb, so) != (r.blk[t], r.off[t]):
                raise AltError("wrong_source")
            if self.refcnt[sb] > 1:
                raise AltError("shared_block")
            if db < 0 or db >= self.num_blocks:
                raise AltError("block_out_of_range")
            if do < 0 or do >= S:
                raise AltError("bad_offset")
            if db == NULL:
                raise AltError("null_block")
            mine = db in r.owned
            if mine and self.refcnt[db] > 1:
                raise AltError("shared_block")
            if not mine and self.refcnt[db] > 0:
                raise AltError("foreign_block")
            if db * S + do in live_slots:
                raise AltError("slot_occupied")
            if (db, do) in dst_seen:
                raise AltError("duplicate_destination")
            toks_seen.append(t)
            dst_seen.append((db, do))
        sources = []
        for t, sb, so, db, do in rows:
            if sb not in sources:
                sources.append(sb)
            self.claims[sb * S + so] -= 1
            self.claims[db * S + do] += 1
            r.blk[t], r.off[t] = db, do
            self.placed[db * S + do] = t
            self._ref(r, db)
        emptied = sorted(b for b in sources
                         if not any(r.live[t] and r.blk[t] == b for t in range(len(r.blk))))
        for b in emptied:
            self._unref(r, b)
        return emptied

    def release_empty_blocks(self, req, block_ids):
        r = self._get(req)
        bl = _int_list(block_ids)
        seen = []
        for b in bl:
            if b < 0 or b >= self.num_blocks:
                raise AltError("block_out_of_range")
            if b not in r.owned:
                raise AltError("foreign_block")
            if self.refcnt[b] > 1:
                raise AltError("shared_block")
            if any(r.live[t] and r.blk[t] == b for t in range(len(r.blk))):
                raise AltError("block_not_empty")
            if b in seen:
                raise AltError("duplicate_block")
            seen.append(b)
        for b in bl:
            self._unref(r, b)
        return sorted(bl)

    def free_request(self, req):
        r = self._get(req)
        for t in range(len(r.blk)):
            if r.live[t]:
                self.claims[r.blk[t] * self.S + r.off[t]] -= 1
        blocks = sorted(r.owned)
        for b in blocks:
            self._unref(r, b)
        del self.reqs[req]
        return blocks

    # -------------------------------------------------------------- observations
    def length(self, req) -> int:
        return len(self._get(req).blk)

    def blocks_of(self, req) -> list:
        return sorted(self._get(req).owned)

    def live_tokens(self, req) -> list:
        r = self._get(req)
        return [t for t in range(len(r.blk)) if r.live[t]]

    def location(self, req, t):
        r = self._get(req)
        t = _one_int(t)
        if t < 0 or t >= len(r.blk):
            raise AltError("unknown_token")
        if not r.live[t]:
            raise AltError("dead_token")
        return r.blk[t], r.off[t]

    def slot_mapping(self, req) -> list:
        r = self._get(req)
        return [r.blk[t] * self.S + r.off[t] for t in range(len(r.blk)) if r.live[t]]

    def waste_ratio(self) -> float:
        ref = [b for b in range(self.num_blocks) if self.refcnt[b] > 0]
        if not ref:
            return 0.0
        return 1.0 - sum(self._live_in(b) for b in ref) / (len(ref) * self.S)

    def export_state(self) -> dict:
        reqs = {}
        for req, r in self.reqs.items():
            live = [t for t in range(len(r.blk)) if r.live[t]]
            reqs[req] = {"length": len(r.blk), "live": live, "loc": {t: [r.blk[t], r.off[t]] for t in live},
                         "blocks": sorted(r.owned)}
        blocks = {b: {"refs": self.refcnt[b], "live": self._live_in(b)}
                  for b in range(self.num_blocks) if self.refcnt[b] > 0}
        return {"block_size": self.S, "num_blocks": self.num_blocks, "requests": reqs, "blocks": blocks}


class LeakyAltTable(AltTable):
    """Planted bug (ref-count leak): finishing a request keeps its reference on shared blocks."""

    def free_request(self, req):
        r = self._get(req)
        for t in range(len(r.blk)):
            if r.live[t]:
                self.claims[r.blk[t] * self.S + r.off[t]] -= 1
        blocks = sorted(r.owned)
        for b in blocks:
            if self.refcnt[b] > 1:
                continue  # the bug: a shared block keeps this request's reference
            self._unref(r, b)
        del self.reqs[req]
        return blocks


class ForgetfulAltTable(AltTable):
    """Planted bug found on the first eviction: an evicted token's slot keeps its claim (the
    table reports it dead but never frees the slot, so the waste ratio and the slots disagree
    with the model at once). For tests about what happens to a failure once found, not about
    how hard it is to find."""

    def evict_tokens(self, req, ids):
        r = self._get(req)
        super().evict_tokens(req, ids)
        for t in _int_list(ids):
            self.claims[r.blk[t] * self.S + r.off[t]] += 1  # the bug: the claim stays
