"""Reference model of the token table (paper section 3.2), small and slow on purpose.

Plain dicts and lists, written from the paper's definitions:

- a request is a list of tokens; token ``p`` is ``{"block", "offset", "live"}``;
- token ``p`` is created at ``block_ids[p // S]``, offset ``p % S``;
- ``n_b`` is the number of slots of block ``b`` holding a token live in some request;
- F (Eq. 1) = 1 - sum(n_b) / (N * S) over the N blocks some request references;
- the slot of a live token (Eq. 2) is ``block * S + offset``.

Every operation checks its whole input first and raises :class:`SpecError` with the code
of the *first* problem (input order; per item, checks in the order listed in each
method), changing nothing. The codes are the contract the implementation shares.

Types come first: an id or length must be an integer (``numbers.Integral``: ``int`` or a
numpy integer; never ``bool``), a list of ids a non-string iterable of integers (a 1-D
array included). Anything else is ``not_integer`` (``bad_move`` for a move list); an
unhashable request id is ``bad_request_id``. (The implementation also takes torch tensors,
which this model does not.)

Owns: plain dicts and lists: per request its tokens and block list (nothing shared with the system).
May call: numbers only; never the system, invariants/, fuzz/ or reports/.
Costs: slow on purpose: an operation is O(its input x requests) (a block's ``refs`` scans every
request); ``waste_ratio``, ``block_live_count`` and ``export_state`` rescan every token.
"""

from __future__ import annotations

import numbers
from collections import Counter

NULL_BLOCK = 0


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_list(xs) -> bool:
    """An iterable that can hold ids: not a string or bytes, not a 0-d or n-d array, not an
    array of a non-integer dtype (even an empty one)."""
    return (not isinstance(xs, (str, bytes, bytearray, memoryview)) and getattr(xs, "ndim", 1) == 1
            and _int_dtype(xs))


def _int_dtype(xs) -> bool:
    """No dtype, or a numpy integer / object dtype."""
    return getattr(getattr(xs, "dtype", None), "kind", "O") in "iuO"


def _ints(xs, code="not_integer") -> list:
    """``xs`` as a list of Python ints, or ``SpecError(code)``."""
    if not _is_list(xs):
        raise SpecError(code, f"{xs!r:.60} is not a list of integers")
    try:
        xs = list(xs)
    except TypeError:
        raise SpecError(code, f"{xs!r:.60} is not a list of integers") from None
    if not all(_is_int(x) for x in xs):
        raise SpecError(code, f"{xs!r:.60} holds a non-integer")
    return [int(x) for x in xs]


def _int(x) -> int:
    if not _is_int(x):
        raise SpecError("not_integer", f"{x!r:.60} is not an integer")
    return int(x)


class SpecError(Exception):
    def __init__(self, code: str, message: str = ""):
        super().__init__(f"[{code}] {message}")
        self.code = code


class SpecTokenTable:
    def __init__(self, block_size: int, num_blocks: int):
        self.S = block_size
        self.num_blocks = num_blocks
        self.tokens: dict = {}  # req -> list of {"block", "offset", "live"}
        self.blocks: dict = {}  # req -> set of referenced blocks
        self.placed: dict = {}  # (block, offset) -> token id last placed there while referenced

    # -- derived quantities, recomputed from scratch every time ---------------------
    def refs(self, b: int) -> int:
        return sum(1 for bl in self.blocks.values() if b in bl)

    def live_slots(self) -> set:
        return {(t["block"], t["offset"]) for toks in self.tokens.values() for t in toks if t["live"]}

    def block_live_count(self, b: int) -> int:
        b = _int(b)
        if not 0 <= b < self.num_blocks:
            raise SpecError("block_out_of_range")
        return sum(1 for (blk, _) in self.live_slots() if blk == b)

    def referenced_blocks(self) -> set:
        return set().union(*self.blocks.values()) if self.blocks else set()

    def waste_ratio(self) -> float:
        n = len(self.referenced_blocks())
        return 0.0 if n == 0 else 1.0 - len(self.live_slots()) / (n * self.S)

    def _hashable(self, req):
        try:
            hash(req)
        except TypeError:
            raise SpecError("bad_request_id", f"{req!r:.60}") from None

    def _get(self, req):
        self._hashable(req)
        if req not in self.tokens:
            raise SpecError("unknown_request", f"{req!r}")
        return self.tokens[req]

    def _drop_block(self, req, b):
        self.blocks[req].discard(b)
        if self.refs(b) == 0:
            for off in range(self.S):
                self.placed.pop((b, off), None)

    # -- operations -----------------------------------------------------------------
    def sync_new_tokens(self, req, block_ids, total_len):
        self._hashable(req)
        toks = self.tokens.get(req, [])
        mine = self.blocks.get(req, set())
        n = len(toks)
        total_len = _int(total_len)
        if not (isinstance(block_ids, (list, tuple, range)) or getattr(block_ids, "ndim", None) == 1):
            raise SpecError("not_integer", "block_ids is not a list of block ids")
        if total_len < n:
            raise SpecError("length_decrease")
        if len(block_ids) * self.S < total_len:
            raise SpecError("blocks_short")
        read = [block_ids[j] for j in range(n // self.S, (total_len - 1) // self.S + 1)] if total_len > n else []
        if not all(_is_int(b) for b in read):  # only the entries that receive new tokens are read
            raise SpecError("not_integer", "a block id read is not an integer")
        new = []
        for p in range(n, total_len):
            b, off = int(block_ids[p // self.S]), p % self.S
            if not 0 <= b < self.num_blocks:
                raise SpecError("block_out_of_range", f"token {p} -> block {b}")
            if b == NULL_BLOCK:
                raise SpecError("null_block", f"token {p}")
            shared_with_others = self.refs(b) - (1 if b in mine else 0) > 0
            if shared_with_others:
                ok = self.placed.get((b, off)) == p  # a shared prefix: the same token is already there
            else:
                ok = (b, off) not in self.placed
            if not ok or (b, off) in [(x["block"], x["offset"]) for x in new]:
                raise SpecError("slot_conflict", f"token {p} -> ({b}, {off})")
            new.append({"block": b, "offset": off, "live": True})
        self.tokens[req] = toks + new
        self.blocks[req] = mine | {t["block"] for t in new}
        for i, t in enumerate(new):
            self.placed[(t["block"], t["offset"])] = n + i
        return [t["block"] * self.S + t["offset"] for t in new]

    def evict_tokens(self, req, ids):
        toks = self._get(req)
        ids = _ints(ids)
        seen = set()
        for t in ids:
            if not 0 <= t < len(toks):
                raise SpecError("unknown_token", f"{t}")
            if not toks[t]["live"]:
                raise SpecError("dead_token", f"{t}")
            if t in seen:
                raise SpecError("duplicate_token", f"{t}")
            seen.add(t)
        for t in ids:
            toks[t]["live"] = False

    def evict_token(self, req, t):
        self._get(req)
        self.evict_tokens(req, [_int(t)])

    def apply_moves(self, req, moves):
        toks = self._get(req)
        mine = self.blocks[req]
        S = self.S
        occupied = {(t["block"], t["offset"]) for t in toks if t["live"]}
        seen_tok, seen_dst = set(), set()
        if isinstance(moves, (str, bytes, bytearray, memoryview)) or getattr(moves, "ndim", 2) == 0 \
                or not _int_dtype(moves):
            raise SpecError("bad_move", "moves is not a list of moves")
        try:
            moves = list(moves)
        except TypeError:
            raise SpecError("bad_move", "moves is not a list of moves") from None
        for mv in moves:
            if not (isinstance(mv, (list, tuple)) or getattr(mv, "ndim", None) == 1) or len(mv) != 5:
                raise SpecError("bad_move", "a move is not five integers")
        if not all(_is_int(x) for mv in moves for x in mv):
            raise SpecError("bad_move", "a move is not five integers")
        moves = [tuple(int(x) for x in mv) for mv in moves]
        for i, (t, sb, so, db, do) in enumerate(moves):
            if not 0 <= t < len(toks):
                raise SpecError("unknown_token", f"move #{i}")
            if not toks[t]["live"]:
                raise SpecError("dead_token", f"move #{i}")
            if t in seen_tok:
                raise SpecError("duplicate_token", f"move #{i}")
            if (sb, so) != (toks[t]["block"], toks[t]["offset"]):
                raise SpecError("wrong_source", f"move #{i}")
            if self.refs(sb) > 1:
                raise SpecError("shared_block", f"move #{i} source {sb}")
            if not 0 <= db < self.num_blocks:
                raise SpecError("block_out_of_range", f"move #{i}")
            if not 0 <= do < S:
                raise SpecError("bad_offset", f"move #{i}")
            if db == NULL_BLOCK:
                raise SpecError("null_block", f"move #{i}")
            if db in mine and self.refs(db) > 1:
                raise SpecError("shared_block", f"move #{i} destination {db}")
            if db not in mine and self.refs(db) > 0:
                raise SpecError("foreign_block", f"move #{i} destination {db}")
            if (db, do) in occupied:
                raise SpecError("slot_occupied", f"move #{i}")
            if (db, do) in seen_dst:
                raise SpecError("duplicate_destination", f"move #{i}")
            seen_tok.add(t)
            seen_dst.add((db, do))
        sources = {toks[mv[0]]["block"] for mv in moves}
        for t, sb, so, db, do in moves:
            toks[t]["block"], toks[t]["offset"] = db, do
            self.placed[(db, do)] = t
            mine.add(db)
        still_live = {t["block"] for t in toks if t["live"]}
        emptied = sorted(b for b in sources if b not in still_live)
        for b in emptied:
            self._drop_block(req, b)
        return emptied

    def release_empty_blocks(self, req, block_ids):
        toks = self._get(req)
        mine = self.blocks[req]
        block_ids = _ints(block_ids)
        seen = set()
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise SpecError("block_out_of_range")
            if b not in mine:
                raise SpecError("foreign_block")
            if self.refs(b) > 1:
                raise SpecError("shared_block")
            if any(t["live"] and t["block"] == b for t in toks):
                raise SpecError("block_not_empty")
            if b in seen:
                raise SpecError("duplicate_block")
            seen.add(b)
        for b in block_ids:
            self._drop_block(req, b)
        return sorted(block_ids)

    def free_request(self, req):
        self._get(req)
        blocks = sorted(self.blocks.pop(req))
        del self.tokens[req]
        for b in blocks:
            if self.refs(b) == 0:
                for off in range(self.S):
                    self.placed.pop((b, off), None)
        return blocks

    # -- queries --------------------------------------------------------------------
    def live_tokens(self, req):
        return [p for p, t in enumerate(self._get(req)) if t["live"]]

    def location(self, req, t):
        toks = self._get(req)
        t = _int(t)
        if not 0 <= t < len(toks):
            raise SpecError("unknown_token")
        if not toks[t]["live"]:
            raise SpecError("dead_token")
        return toks[t]["block"], toks[t]["offset"]

    def slot_mapping(self, req):
        return [t["block"] * self.S + t["offset"] for t in self._get(req) if t["live"]]

    def export_state(self):
        """Same shape as ``vtoken.TokenTable.export_state``."""
        reqs = {req: self.export_request(req) for req in self.tokens}
        return {"block_size": self.S, "num_blocks": self.num_blocks, "requests": reqs, "blocks": self.export_blocks()}

    def export_request(self, req):
        """One request of ``export_state``."""
        toks = self._get(req)
        live = [p for p, t in enumerate(toks) if t["live"]]
        return {"length": len(toks), "live": live, "loc": {p: [toks[p]["block"], toks[p]["offset"]] for p in live},
                "blocks": sorted(self.blocks[req])}

    def export_blocks(self):
        """The ``blocks`` of ``export_state``: every referenced block's refs and live slots."""
        live = Counter(blk for (blk, _) in self.live_slots())  # one pass, not one per block
        return {b: {"refs": self.refs(b), "live": live[b]} for b in sorted(self.referenced_blocks())}
