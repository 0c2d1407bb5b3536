"""The token table: per-request logical token ids -> physical (block, offset), plus liveness.

This is the paper's canonical table (section 3.2), held in arrays so that the cost of a
scheduler step grows with the tokens added, evicted or moved, never with the tokens
already tracked.

State
-----
Per request (``_Req``): ``slot[i] = block * S + offset`` and ``live[i]`` for every logical
token id ``i < n`` (ids are positions: token ``p`` is the ``p``-th token of the sequence),
and the set of blocks the request references.

Per block (global arrays over ``num_blocks``):

- ``refs[b]``: how many requests reference ``b`` (prefix sharing makes it > 1);
- ``n_b[b]``: live-token count: slots of ``b`` that hold a live token of some request.
  With sharing one slot may be live in several requests and still counts once.

Per slot: ``claims[s]`` (how many requests hold a live token at ``s``) and ``placed[s]``
(the logical id last placed at ``s`` while its block was referenced, -1 otherwise). A new
token may only land on a slot never used since its block was taken, or, in a block that
another request references (a shared prefix), on the slot where that request placed the
same logical id.

Ownership and freeing
---------------------
The table never frees blocks; it tells the caller which blocks it stopped referencing:
``apply_moves`` returns the source blocks the moves left without live tokens (the caller
frees them *after the copy out of them has completed*), ``release_empty_blocks`` gives up
blocks whose tokens were all evicted, and ``free_request`` returns every block the request
referenced (the caller drops one reference on each).

The read side
-------------
Attention consumes, per request, a device-resident view: ``read_view`` gives per-token
slots and a live mask (updated in place, O(changed) per operation), and ``slot_mapping``
gives the live slots in logical order (Eq. 2), cached: appended on ordinary growth,
recomputed on the device only after a structural change (eviction or move). Neither is
ever stale: every mutation updates or invalidates them before returning.

Errors
------
Bad input raises :class:`~vtoken.errors.TableError` with a ``code`` from
``vtoken.errors.TABLE_CODES`` and changes nothing. Where several problems exist, the
reported one is the first in input order, checks in the order the method documents; the
reference model in ``spec/`` follows the same order so the fuzzers can compare codes.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch

from .errors import TableError

NULL_BLOCK = 0


class _Req:
    """One request's host arrays; its device entries live in a segment of the table's pool."""

    __slots__ = ("slot", "live", "n", "n_live", "blocks", "base", "cap", "map_cache", "map_len", "map_src_n", "map_dirty")

    def __init__(self):
        self.slot = np.full(64, -1, dtype=np.int64)
        self.live = np.zeros(64, dtype=bool)
        self.n = 0
        self.n_live = 0
        self.blocks: set[int] = set()
        self.base = -1  # device segment [base, base + cap) in the pool
        self.cap = 0
        self.map_cache = None  # compacted live slots (device), see slot_mapping
        self.map_len = 0
        self.map_src_n = 0  # tokens [0, map_src_n) are reflected in map_cache
        self.map_dirty = False

    def reserve(self, new: int) -> None:
        """Grow the host arrays to exactly ``new`` entries (the caller doubles)."""
        cap = len(self.slot)
        if new <= cap:
            return
        slot = np.full(new, -1, dtype=np.int64)
        slot[:cap] = self.slot
        live = np.zeros(new, dtype=bool)
        live[:cap] = self.live
        self.slot, self.live = slot, live


class _DevicePool:
    """The read-side lookup cache: per-token slots and live bits of every request, on the device.

    One flat pair of tensors holds all requests, each in a power-of-two segment, so the
    updates of a whole scheduler step reach the device in one batched write (``flush``)
    instead of several small ones per request. Mutations only queue updates; every read
    flushes first, so no reader sees a stale entry.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.slot = torch.full((1024,), -1, dtype=torch.int64, device=device)
        self.live = torch.zeros(1024, dtype=torch.bool, device=device)
        self.used = 0
        self.free_segs: dict[int, list[int]] = {}
        self.pend_idx: list = []  # global indices whose slot changed (arrays or ints)
        self.pend_val: list = []
        self.pend_new: list = []  # indices that became live (new tokens)
        self.pend_dead: list = []  # indices that died

    def alloc(self, cap: int) -> int:
        lst = self.free_segs.get(cap)
        if lst:
            return lst.pop()
        if self.used + cap > len(self.slot):
            self.flush()
            size = max(2 * len(self.slot), self.used + cap)
            slot = torch.full((size,), -1, dtype=torch.int64, device=self.device)
            live = torch.zeros(size, dtype=torch.bool, device=self.device)
            slot[: self.used] = self.slot[: self.used]
            live[: self.used] = self.live[: self.used]
            self.slot, self.live = slot, live
        base = self.used
        self.used += cap
        return base

    def release(self, base: int, cap: int) -> None:
        self.flush()  # queued writes must not land on the segment's next owner
        self.live[base:base + cap] = False
        self.free_segs.setdefault(cap, []).append(base)

    @staticmethod
    def _cat(parts) -> np.ndarray:
        arrs = [p if isinstance(p, np.ndarray) else np.asarray([p], dtype=np.int64) for p in parts]
        return np.concatenate(arrs)

    def flush(self) -> None:
        if self.pend_idx:
            idx, val = self._cat(self.pend_idx), self._cat(self.pend_val)
            if len(idx) > 1:  # the last write to an index wins (index_put order is unspecified)
                ridx = idx[::-1]
                _, last = np.unique(ridx, return_index=True)
                idx, val = ridx[last], val[::-1][last]
            self.slot[torch.from_numpy(idx).to(self.device)] = torch.from_numpy(val).to(self.device)
            self.pend_idx.clear()
            self.pend_val.clear()
        if self.pend_new:  # births before deaths: a token born and evicted in one step stays dead
            self.live[torch.from_numpy(self._cat(self.pend_new)).to(self.device)] = True
            self.pend_new.clear()
        if self.pend_dead:
            self.live[torch.from_numpy(self._cat(self.pend_dead)).to(self.device)] = False
            self.pend_dead.clear()


def _as_int_array(xs, what: str) -> np.ndarray:
    try:
        a = np.asarray(xs, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise TableError("bad_move" if what == "moves" else "unknown_token", f"{what}: not integers ({e})") from None
    return a


class TokenTable:
    """Per-request token table over ``num_blocks`` blocks of ``block_size`` slots.

    ``device`` is where the read-side lookup cache lives (``cpu`` or ``cuda``); the
    canonical table is always on the host.
    """

    def __init__(self, block_size: int, num_blocks: int, device: str | torch.device = "cpu"):
        if block_size < 1 or num_blocks < 2:
            raise TableError("bad_config", f"block_size={block_size}, num_blocks={num_blocks}")
        self.S = int(block_size)
        self.num_blocks = int(num_blocks)
        self.device = torch.device(device)
        self._reqs: dict[object, _Req] = {}
        self._pool = _DevicePool(self.device)
        self.refs = np.zeros(self.num_blocks, dtype=np.int32)
        self.n_b = np.zeros(self.num_blocks, dtype=np.int32)
        self.claims = np.zeros(self.num_blocks * self.S, dtype=np.int32)
        self.placed = np.full(self.num_blocks * self.S, -1, dtype=np.int64)
        # Incremental totals for Eq. 1, so waste_ratio() never scans.
        self._live_slots = 0  # sum of n_b
        self._ref_blocks = 0  # blocks with refs > 0

    # ------------------------------------------------------------------ helpers
    def _req(self, req_id) -> _Req:
        r = self._reqs.get(req_id)
        if r is None:
            raise TableError("unknown_request", f"request {req_id!r} is not in the table")
        return r

    def _ref_block(self, r: _Req, b: int) -> None:
        r.blocks.add(b)
        if self.refs[b] == 0:
            self._ref_blocks += 1
        self.refs[b] += 1

    def _unref_block(self, r: _Req, b: int) -> None:
        r.blocks.discard(b)
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self._ref_blocks -= 1
            self.placed[b * self.S:(b + 1) * self.S] = -1

    def _claim(self, slots: np.ndarray) -> None:
        """Add one live claim on each slot (slots unique within the call)."""
        if len(slots) == 0:
            return
        before = self.claims[slots]
        self.claims[slots] = before + 1
        fresh = slots[before == 0]
        np.add.at(self.n_b, fresh // self.S, 1)
        self._live_slots += len(fresh)

    def _unclaim(self, slots: np.ndarray) -> None:
        if len(slots) == 0:
            return
        after = self.claims[slots] - 1
        self.claims[slots] = after
        gone = slots[after == 0]
        np.subtract.at(self.n_b, gone // self.S, 1)
        self._live_slots -= len(gone)

    # ------------------------------------------------------------------ growth
    def sync_new_tokens(self, req_id, block_ids: Sequence[int], total_len: int) -> np.ndarray:
        """Register the tokens that grew ``req_id`` to ``total_len`` (creating the request).

        ``block_ids`` is the request's whole positional block list as the scheduler holds
        it: new token ``p`` lives at ``block_ids[p // S]``, offset ``p % S``. Only entries
        that receive new tokens are read, so the cost is O(new tokens); earlier entries may
        hold the null block (a freed position) and are ignored.

        Checks, in order: ``length_decrease``; ``blocks_short``; then per new token in
        position order: ``block_out_of_range``, ``null_block``, ``slot_conflict``.
        Returns the new tokens' slots (int64, position order): where to write their K/V.
        """
        r = self._reqs.get(req_id)
        n = r.n if r is not None else 0
        total_len = int(total_len)
        if total_len < n:
            raise TableError("length_decrease", f"request {req_id!r}: total_len {total_len} < current length {n}")
        if len(block_ids) * self.S < total_len:
            raise TableError("blocks_short", f"request {req_id!r}: {len(block_ids)} blocks cannot hold {total_len} tokens")
        k = total_len - n
        if k == 0:
            if r is None:
                self._reqs[req_id] = _Req()
            return np.empty(0, dtype=np.int64)
        if k == 1:
            return self._sync_one(req_id, r, block_ids, n)
        S = self.S
        j0, j1 = n // S, (total_len - 1) // S + 1
        seg = _as_int_array(block_ids[j0:j1], "block_ids")
        pos = np.arange(n, total_len, dtype=np.int64)
        blk = seg[pos // S - j0]
        bad_range = (blk < 0) | (blk >= self.num_blocks)
        bad_null = blk == NULL_BLOCK
        slots = np.where(bad_range, 0, blk) * S + pos % S
        owned = r.blocks if r is not None else ()
        # A block another request references is a shared prefix: the slot must already
        # hold this very token. Otherwise the slot must be unused since the block was taken.
        others = np.array([(self.refs[b] - (b in owned)) > 0 if 0 <= b < self.num_blocks else False
                           for b in seg.tolist()], dtype=bool)[pos // S - j0]
        placed = self.placed[slots]
        bad_conf = np.where(others, placed != pos, placed != -1)
        if len(np.unique(slots)) != k:  # a block named at two new positions
            _, first = np.unique(slots, return_index=True)
            dup = np.ones(k, dtype=bool)
            dup[first] = False
            bad_conf |= dup
        bad = bad_range | bad_null | bad_conf
        if bad.any():
            i = int(np.argmax(bad))
            p, b = int(pos[i]), int(blk[i])
            if bad_range[i]:
                raise TableError("block_out_of_range", f"request {req_id!r}: token {p} -> block {b} outside [0, {self.num_blocks})")
            if bad_null[i]:
                raise TableError("null_block", f"request {req_id!r}: token {p} would land in the null block")
            raise TableError("slot_conflict", f"request {req_id!r}: token {p} -> block {b} offset {p % S} is held by token {int(placed[i])} or named twice")

        # ---- apply (nothing below can fail)
        if r is None:
            r = self._reqs[req_id] = _Req()
        self._grow(r, total_len)
        for b in set(seg.tolist()):
            if b not in r.blocks:
                self._ref_block(r, b)
        r.slot[n:total_len] = slots
        r.live[n:total_len] = True
        r.n, r.n_live = total_len, r.n_live + k
        self.placed[slots] = pos
        self._claim(slots)
        gidx = np.arange(r.base + n, r.base + total_len, dtype=np.int64)
        pool = self._pool
        pool.pend_idx.append(gidx)
        pool.pend_val.append(slots)
        pool.pend_new.append(gidx)
        return slots

    def _sync_one(self, req_id, r, block_ids, n) -> np.ndarray:
        """``sync_new_tokens`` for one new token (the decode step): same checks, scalar code."""
        S = self.S
        try:
            b = int(block_ids[n // S])
        except (TypeError, ValueError):
            raise TableError("block_out_of_range", f"request {req_id!r}: block id {block_ids[n // S]!r} is not an integer") from None
        if not 0 <= b < self.num_blocks:
            raise TableError("block_out_of_range", f"request {req_id!r}: token {n} -> block {b} outside [0, {self.num_blocks})")
        if b == NULL_BLOCK:
            raise TableError("null_block", f"request {req_id!r}: token {n} would land in the null block")
        s = b * S + n % S
        mine = r is not None and b in r.blocks
        placed = int(self.placed[s])
        if (placed != n) if (self.refs[b] - mine) > 0 else (placed != -1):
            raise TableError("slot_conflict", f"request {req_id!r}: token {n} -> block {b} offset {n % S} is held by token {placed}")
        if r is None:
            r = self._reqs[req_id] = _Req()
        if n + 1 > r.cap:
            self._grow(r, n + 1)
        if not mine:
            self._ref_block(r, b)
        r.slot[n] = s
        r.live[n] = True
        r.n, r.n_live = n + 1, r.n_live + 1
        self.placed[s] = n
        c = int(self.claims[s])
        self.claims[s] = c + 1
        if c == 0:
            self.n_b[b] += 1
            self._live_slots += 1
        g = r.base + n
        pool = self._pool
        pool.pend_idx.append(g)
        pool.pend_val.append(s)
        pool.pend_new.append(g)
        return np.array([s], dtype=np.int64)

    def _grow(self, r: _Req, need: int) -> None:
        """Make room for ``need`` tokens in the host arrays and the device segment."""
        if need <= r.cap:
            return
        # One power-of-two capacity for the host arrays and the device segment, so a
        # check against r.cap covers both (doubling: growth is amortised O(1) per token).
        cap = max(64, 1 << (need - 1).bit_length())
        r.reserve(cap)
        pool = self._pool
        base = pool.alloc(cap)
        if r.cap:
            pool.flush()
            pool.slot[base:base + r.n] = pool.slot[r.base:r.base + r.n]
            pool.live[base:base + r.n] = pool.live[r.base:r.base + r.n]
            pool.release(r.base, r.cap)
        r.base, r.cap = base, cap

    # ------------------------------------------------------------------ eviction
    def evict_token(self, req_id, token_id: int) -> None:
        self.evict_tokens(req_id, [token_id])

    def evict_tokens(self, req_id, token_ids: Iterable[int]) -> None:
        """Mark tokens dead (metadata only; no K/V is touched, no block is freed).

        Checks per id in input order: ``unknown_token``, ``dead_token``, ``duplicate_token``.
        """
        r = self._req(req_id)
        if isinstance(token_ids, (list, tuple)) and len(token_ids) == 1 and isinstance(token_ids[0], int):
            return self._evict_one(req_id, r, token_ids[0])
        ids = _as_int_array(list(token_ids) if not isinstance(token_ids, np.ndarray) else token_ids, "token ids")
        if ids.ndim != 1:
            raise TableError("unknown_token", f"request {req_id!r}: token ids must be a flat list")
        if len(ids) == 0:
            return
        bad_range = (ids < 0) | (ids >= r.n)
        safe = np.where(bad_range, 0, ids)
        bad_dead = ~bad_range & ~r.live[safe]
        _, first = np.unique(ids, return_index=True)
        dup = np.ones(len(ids), dtype=bool)
        dup[first] = False
        bad = bad_range | bad_dead | dup
        if bad.any():
            i = int(np.argmax(bad))
            t = int(ids[i])
            code = "unknown_token" if bad_range[i] else "dead_token" if bad_dead[i] else "duplicate_token"
            raise TableError(code, f"request {req_id!r}: evict token {t} (length {r.n})")
        r.live[ids] = False
        r.n_live -= len(ids)
        self._unclaim(r.slot[ids])
        self._pool.pend_dead.append(ids + r.base)
        r.map_dirty = True

    def _evict_one(self, req_id, r: _Req, t: int) -> None:
        if not 0 <= t < r.n:
            raise TableError("unknown_token", f"request {req_id!r}: evict token {t} (length {r.n})")
        if not r.live[t]:
            raise TableError("dead_token", f"request {req_id!r}: evict token {t} (length {r.n})")
        r.live[t] = False
        r.n_live -= 1
        s = int(r.slot[t])
        c = int(self.claims[s]) - 1
        self.claims[s] = c
        if c == 0:
            self.n_b[s // self.S] -= 1
            self._live_slots -= 1
        self._pool.pend_dead.append(r.base + t)
        r.map_dirty = True

    # ------------------------------------------------------------------ relocation
    def apply_moves(self, req_id, moves) -> list[int]:
        """Atomically move live tokens: moves are ``(token_id, src_block, src_offset, dst_block, dst_offset)``.

        Called after the copy of the moves' K/V has completed. The whole list is validated
        before anything changes. Checks per move in list order: ``unknown_token``,
        ``dead_token``, ``duplicate_token``, ``wrong_source``, ``shared_block`` (source),
        ``block_out_of_range``, ``bad_offset``, ``null_block``, ``shared_block`` /
        ``foreign_block`` (destination), ``slot_occupied``, ``duplicate_destination``.
        (A malformed list, not k x 5 integers, is ``bad_move``.)

        A destination block the request did not reference becomes the request's. Returns
        the source blocks left with no live token, sorted; the table stops referencing
        them and the caller frees them, after the copy out of them has completed.
        """
        r = self._req(req_id)
        m = _as_int_array(moves, "moves")
        if m.size == 0:
            return []
        if m.ndim != 2 or m.shape[1] != 5:
            raise TableError("bad_move", f"request {req_id!r}: moves must be (token, src_block, src_offset, dst_block, dst_offset) tuples")
        S, NB = self.S, self.num_blocks
        tok, sb, so, db, do = m.T
        k = len(m)
        c_unknown = (tok < 0) | (tok >= r.n)
        t_safe = np.where(c_unknown, 0, tok)
        c_dead = ~c_unknown & ~r.live[t_safe]
        _, first = np.unique(tok, return_index=True)
        c_duptok = np.ones(k, dtype=bool)
        c_duptok[first] = False
        cur = r.slot[t_safe]
        c_src = (sb * S + so != cur) | (so < 0) | (so >= S)
        c_srcshared = self.refs[cur // S] > 1
        c_range = (db < 0) | (db >= NB)
        db_safe = np.where(c_range, 0, db)
        c_off = (do < 0) | (do >= S)
        c_null = db == NULL_BLOCK
        dref = self.refs[db_safe]
        mine = np.fromiter((b in r.blocks for b in db_safe.tolist()), dtype=bool, count=k)
        c_dshared = mine & (dref > 1)
        c_foreign = ~mine & (dref > 0)
        dst = db_safe * S + np.where(c_off, 0, do)
        c_occ = self.claims[dst] > 0  # dst is own or fresh, so a claim is a live token of ours
        _, first = np.unique(dst, return_index=True)
        c_dupdst = np.ones(k, dtype=bool)
        c_dupdst[first] = False
        checks = (
            ("unknown_token", c_unknown), ("dead_token", c_dead), ("duplicate_token", c_duptok),
            ("wrong_source", c_src), ("shared_block", c_srcshared), ("block_out_of_range", c_range),
            ("bad_offset", c_off), ("null_block", c_null), ("shared_block", c_dshared),
            ("foreign_block", c_foreign), ("slot_occupied", c_occ), ("duplicate_destination", c_dupdst),
        )
        bad = np.zeros(k, dtype=bool)
        for _, c in checks:
            bad |= c
        if bad.any():
            i = int(np.argmax(bad))
            code = next(name for name, c in checks if c[i])
            raise TableError(code, f"request {req_id!r}: move #{i} {tuple(int(x) for x in m[i])}")
        return self._apply_valid_moves(r, m, tok, cur, dst)

    def _apply_valid_moves(self, r: _Req, m, tok, cur, dst) -> list[int]:
        S = self.S
        for b in np.unique(dst // S).tolist():
            if b not in r.blocks:
                self._ref_block(r, b)
        self._unclaim(cur)
        self._claim(dst)
        r.slot[tok] = dst
        self.placed[dst] = tok
        self._pool.pend_idx.append(tok + r.base)
        self._pool.pend_val.append(dst.copy())
        r.map_dirty = True
        emptied = [b for b in np.unique(cur // S).tolist() if self.n_b[b] == 0]
        for b in emptied:
            self._unref_block(r, b)
        return emptied

    def release_empty_blocks(self, req_id, block_ids: Iterable[int]) -> list[int]:
        """Stop referencing blocks of ``req_id`` that hold no live token (all evicted).

        Checks per block: ``block_out_of_range``, ``foreign_block`` (not the request's),
        ``shared_block``, ``block_not_empty``, ``duplicate_destination`` never applies;
        a block named twice is ``duplicate_block``. Returns the blocks; the caller frees them.
        """
        r = self._req(req_id)
        bl = [int(b) for b in block_ids]
        seen = set()
        for b in bl:
            if not (0 <= b < self.num_blocks):
                raise TableError("block_out_of_range", f"request {req_id!r}: block {b}")
            if b not in r.blocks:
                raise TableError("foreign_block", f"request {req_id!r} does not reference block {b}")
            if self.refs[b] > 1:
                raise TableError("shared_block", f"request {req_id!r}: block {b} is shared")
            if self.n_b[b] != 0:
                raise TableError("block_not_empty", f"request {req_id!r}: block {b} holds {int(self.n_b[b])} live token(s)")
            if b in seen:
                raise TableError("duplicate_block", f"request {req_id!r}: block {b} named twice")
            seen.add(b)
        for b in bl:
            self._unref_block(r, b)
        return sorted(bl)

    def free_request(self, req_id) -> list[int]:
        """Forget ``req_id``; returns every block it referenced (caller drops one reference each)."""
        r = self._req(req_id)
        live_ids = np.flatnonzero(r.live[: r.n])
        self._unclaim(r.slot[live_ids])
        blocks = sorted(r.blocks)
        for b in blocks:
            self._unref_block(r, b)
        if r.cap:
            self._pool.release(r.base, r.cap)
        del self._reqs[req_id]
        return blocks

    # ------------------------------------------------------------------ queries
    def __contains__(self, req_id) -> bool:
        return req_id in self._reqs

    def requests(self) -> list:
        return list(self._reqs)

    def length(self, req_id) -> int:
        return self._req(req_id).n

    def num_live(self, req_id) -> int:
        return self._req(req_id).n_live

    def live_tokens(self, req_id) -> np.ndarray:
        """Live token ids in logical order."""
        r = self._req(req_id)
        return np.flatnonzero(r.live[: r.n])

    def live_mask(self, req_id) -> np.ndarray:
        r = self._req(req_id)
        return r.live[: r.n].copy()

    def slots(self, req_id) -> np.ndarray:
        """Per-token slots (host copy; dead tokens' entries are their last location)."""
        r = self._req(req_id)
        return r.slot[: r.n].copy()

    def blocks_of(self, req_id) -> list[int]:
        """The blocks the request references, sorted (O(blocks log blocks): not for hot paths)."""
        return sorted(self._req(req_id).blocks)

    def block_array(self, req_id) -> np.ndarray:
        """The blocks the request references, unsorted, as int64 (O(blocks), no sort)."""
        bl = self._req(req_id).blocks
        return np.fromiter(bl, dtype=np.int64, count=len(bl))

    def num_blocks_of(self, req_id) -> int:
        return len(self._req(req_id).blocks)

    def references(self, req_id, block_id: int) -> bool:
        """Does the request reference ``block_id``? (O(1))"""
        return int(block_id) in self._req(req_id).blocks

    def tail_block(self, req_id) -> int | None:
        """The block of the request's last position, live or dead (None when empty).

        It is the block being written: a planner never takes it as a source. (O(1))
        """
        r = self._req(req_id)
        return int(r.slot[r.n - 1]) // self.S if r.n else None

    def live_slots(self, req_id) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, slots)``: the live token ids in logical order and their slots (O(length))."""
        r = self._req(req_id)
        ids = np.flatnonzero(r.live[: r.n])
        return ids, r.slot[ids]

    def are_live(self, req_id, token_ids: np.ndarray) -> np.ndarray:
        """Liveness of the given ids (each must be < length), as a bool array (O(ids))."""
        r = self._req(req_id)
        ids = np.asarray(token_ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= r.n):
            raise TableError("unknown_token", f"request {req_id!r}: token ids outside [0, {r.n})")
        return r.live[ids]

    def location(self, req_id, token_id: int) -> tuple[int, int]:
        r = self._req(req_id)
        t = int(token_id)
        if not 0 <= t < r.n:
            raise TableError("unknown_token", f"request {req_id!r}: token {t} (length {r.n})")
        if not r.live[t]:
            raise TableError("dead_token", f"request {req_id!r}: token {t} was evicted")
        s = int(r.slot[t])
        return s // self.S, s % self.S

    def block_live_count(self, block_id: int) -> int:
        b = int(block_id)
        if not 0 <= b < self.num_blocks:
            raise TableError("block_out_of_range", f"block {b}")
        return int(self.n_b[b])

    def block_refs(self, block_id: int) -> int:
        return int(self.refs[int(block_id)])

    def waste_ratio(self) -> float:
        """Eq. 1 over referenced blocks: 1 - sum(n_b) / (N * S); 0 when nothing is allocated."""
        if self._ref_blocks == 0:
            return 0.0
        return 1.0 - self._live_slots / (self._ref_blocks * self.S)

    @property
    def num_ref_blocks(self) -> int:
        return self._ref_blocks

    @property
    def num_live_slots(self) -> int:
        return self._live_slots

    # ------------------------------------------------------------------ read side
    def flush(self) -> None:
        """Push every queued update to the device lookup cache (one batched write).

        Reads flush by themselves; an engine calls this once per step so the device work
        of the step's bookkeeping is issued together.
        """
        self._pool.flush()

    def read_view(self, req_id) -> tuple[torch.Tensor, torch.Tensor]:
        """Device views ``(slots[:n], live[:n])``: valid until the next mutation of the table."""
        r = self._req(req_id)
        self._pool.flush()
        return self._pool.slot[r.base:r.base + r.n], self._pool.live[r.base:r.base + r.n]

    def slot_mapping(self, req_id) -> torch.Tensor:
        """Eq. 2 for every live token, logical order, as an int64 tensor on the table's device.

        Cached: ordinary growth appends the new tokens' slots; an eviction or a move marks
        the cache dirty and the next call recomputes it on the device from the read view.
        """
        slots, live = self.read_view(req_id)
        r = self._reqs[req_id]
        if r.map_cache is None or r.map_dirty:
            m = slots[live]
            r.map_cache = torch.empty(max(64, 2 * len(m)), dtype=torch.int64, device=self.device)
            r.map_cache[: len(m)] = m
            r.map_len, r.map_src_n, r.map_dirty = len(m), r.n, False
        elif r.map_src_n < r.n:
            tail = slots[r.map_src_n:]  # clean since the last compute: every new token is live
            need = r.map_len + len(tail)
            if need > len(r.map_cache):
                grown = torch.empty(2 * need, dtype=torch.int64, device=self.device)
                grown[: r.map_len] = r.map_cache[: r.map_len]
                r.map_cache = grown
            r.map_cache[r.map_len:need] = tail
            r.map_len, r.map_src_n = need, r.n
        return r.map_cache[: r.map_len]

    # ------------------------------------------------------------------ observation
    def export_state(self) -> dict:
        """The observable state as plain data (O(total); for checkers and fuzzers, not hot paths).

        ``requests[req] = {"length", "live": [ids], "loc": {id: [block, offset]} for live ids,
        "blocks": sorted referenced blocks}``; ``blocks[b] = {"refs", "live"}`` for referenced blocks.
        """
        reqs = {}
        for rid, r in self._reqs.items():
            ids = np.flatnonzero(r.live[: r.n])
            sl = r.slot[ids]
            reqs[rid] = {
                "length": r.n,
                "live": ids.tolist(),
                "loc": {int(t): [int(s) // self.S, int(s) % self.S] for t, s in zip(ids, sl)},
                "blocks": sorted(r.blocks),
            }
        blocks = {int(b): {"refs": int(self.refs[b]), "live": int(self.n_b[b])}
                  for b in np.flatnonzero(self.refs > 0)}
        return {"block_size": self.S, "num_blocks": self.num_blocks, "requests": reqs, "blocks": blocks}
