"""Conformance machine: ``vtoken.TokenTable`` and ``vtoken.spec.SpecTokenTable`` side by side.

A tiny scheduler drives both over one small :class:`~vtoken.BlockAllocator` (few blocks,
small S, so exhaustion, full blocks and block boundaries are common). Every rule applies
the same operation to both tables; afterwards the observable states, slot mappings and
waste ratios must be equal, and the invariant checkers must pass. Bad operations must fail
in both with the same error code and leave both unchanged. The comparison costs what
changed: the requests the operations named (recorded from the calls, ``Touching``) and
every block after each rule; every request, with the checkers, every ``FULL_EVERY`` checks
and at teardown.

The machine also plays the scheduler's part of the ownership contract: blocks it allocated
for a request are freed when the table says the request no longer references them
(moves' emptied sources, released empty blocks, finished requests).

A scheduler step does several updates before anything reads the table (``step_then_grow``:
an eviction, growth or moves, then a growth that often takes the request one token past a
power of two from 64 on, where vtoken's per-request arrays and device segment double; S = 16
with 6 more blocks in one example of five, so a request passes 64 tokens). For vtoken's own
table the device lookup cache (``read_view``: live bits, live tokens' slots) is compared
with the host's after every step too.

Owns: per example its TokenTable, SpecTokenTable, BlockAllocator and the blocks it holds per
request.
May call: vtoken.table, .allocator, .errors, vtoken.spec, invariants.table_checks, fuzz.hard_states,
hypothesis.
Costs: per rule the named requests' states and read paths (the device view included) and the
blocks, O(those requests + blocks); a full comparison, O(all tokens + pool), every FULL_EVERY rules.
"""

from __future__ import annotations

import copy
import os
import sys

import hypothesis.strategies as st
from hypothesis import event, note
from hypothesis.stateful import initialize, invariant, precondition, rule

from vtoken.allocator import BlockAllocator
from vtoken.errors import AllocatorError, TableError, VTokenError
from vtoken.spec import SpecError, SpecTokenTable
from vtoken.table import TokenTable
from vtoken.invariants.table_checks import check_block_accounting, check_conservation, check_unique_mapping

from .hard_states import hard
from .step_draws import SwarmRules, pick, integer


# Values of the wrong type, or integers beyond int64, for the bad_input rule.
_JUNK = (3.0, 2.5, True, False, "37", b"\x03", None, [1], (), float("nan"), 2 ** 70, -(2 ** 70))


def both(impl_call, spec_call):
    """Run one operation on both sides; return (impl_result, spec_result) or the shared error code."""
    try:
        a = impl_call()
        ea = None
    except VTokenError as e:
        a, ea = None, e.code
    try:
        b = spec_call()
        eb = None
    except SpecError as e:
        b, eb = None, e.code
    assert ea == eb, f"implementation raised {ea!r}, reference raised {eb!r}"
    return a, b, ea


def alloc_or_none(alloc, n):
    """``n`` blocks, or None when the allocator is exhausted (a counted hard state)."""
    try:
        return alloc.allocate(n)
    except AllocatorError:
        hard("allocator exhausted")
        return None


def sync_both(impl, spec, rid, block_ids, total):
    """``sync_new_tokens`` on both tables; the same slots or the same error code. Counts the
    hard states a growth reaches."""
    a, b, err = both(lambda: impl.sync_new_tokens(rid, block_ids, total),
                     lambda: spec.sync_new_tokens(rid, block_ids, total))
    if err is None:
        assert list(a) == b, f"new slots differ: {list(a)} vs {b}"
        S = impl.S
        for p in range(total - len(a), total):
            if p % S == S - 1:
                hard("block exactly full")
            if p % S == 0 and p > 0:
                hard("token at a block boundary")
    return err


def export_request(table, rid) -> dict:
    """One request of ``table.export_state()``, through ``export_request`` where the table has
    it (vtoken's and the spec's, O(the request)); else cut from the whole export."""
    f = getattr(table, "export_request", None)
    if callable(f):
        return f(rid)
    reqs = table.export_state()["requests"]
    if rid not in reqs:
        raise TableError("unknown_request", f"{rid!r} (not in export_state)")
    return reqs[rid]


def export_blocks(table) -> dict:
    """The ``blocks`` of ``table.export_state()``, through ``export_blocks`` where the table has it."""
    f = getattr(table, "export_blocks", None)
    return f() if callable(f) else table.export_state()["blocks"]


def compare_parts(impl, spec, rids) -> tuple[dict, dict]:
    """The named requests and every block of ``impl`` against ``spec`` (a request unknown
    to both, e.g. freed, is fine: ``both`` checks they agree). Returns the compared
    ``({request: its export}, blocks)``. O(those requests + blocks)."""
    got = {}
    for rid in sorted(rids, key=repr):
        a, b, err = both(lambda: export_request(impl, rid), lambda: spec.export_request(rid))
        if err is None:
            assert a == b, f"state of request {rid!r} differs:\n impl={a}\n spec={b}"
            got[rid] = a
    bi, bs = export_blocks(impl), spec.export_blocks()
    assert bi == bs, f"blocks differ:\n impl={bi}\n spec={bs}"
    return got, bi


class Touching:
    """The table under test, recording the request each mutating call names (its first
    argument, whatever the rule that made the call): the requests the next state comparison
    must look at. A name that cannot be recorded (unhashable junk) asks for a full one."""

    MUTATING = frozenset(("sync_new_tokens", "evict_tokens", "evict_token", "apply_moves", "release_empty_blocks",
                          "free_request"))

    def __init__(self, table):
        self._table = table
        self._named: set = set()
        self._unnamed = False
        self.calls = 0  # mutating calls made, ever

    def __getattr__(self, name):
        attr = getattr(self._table, name)
        if name not in Touching.MUTATING:
            return attr

        def call(rid, *args, **kw):
            self.calls += 1
            try:
                self._named.add(rid)
            except TypeError:
                self._unnamed = True
            return attr(rid, *args, **kw)

        return call

    def __contains__(self, rid) -> bool:  # dunders bypass __getattr__
        return rid in self._table

    def take(self) -> tuple[set, bool]:
        """The requests named since the last take, and whether a full comparison is due."""
        out = self._named, self._unnamed
        self._named, self._unnamed = set(), False
        return out


def some_of(data, items: list, most: int, label: str, k: int | None = None) -> list:
    """Up to ``most`` distinct elements of ``items`` in two choices: how many (``k``, one to
    ``most`` unless given), then one integer read as ``k`` digits in base ``len(items)``, each
    an index (a repeat dropped). Shrinks to fewer elements, then to the first ones. A list
    of indices costs two choices an element; a choice is most of what a step costs."""
    n = len(items)
    if k is None:
        k = integer(data, 1, min(most, n), f"{label}: how many")
    if k <= 0 or n == 0:
        return []
    x = integer(data, 0, n ** k - 1, label)
    idx = []
    for _ in range(k):
        x, i = divmod(x, n)
        idx.append(i)
    return [items[i] for i in dict.fromkeys(idx)]


def distinct_indices(data, n: int, k: int, label: str) -> list:
    """``k`` distinct indices into ``range(n)`` (``k <= n``) from one draw of ``k`` indices, a
    repeat moved on to the next free one: a choice of ``k`` elements at the cost of one list
    draw (``permutations`` shuffles the whole list, a draw per element), shrinking to the first."""
    taken, out = set(), []
    for i in data.draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k), label=label):
        while i in taken:
            i = (i + 1) % n
        taken.add(i)
        out.append(i)
    return out


def policy_victims(data, spec, rid) -> list:
    """What a policy evicts of ``rid`` after a decode step: nothing half the time, else one to
    four of its live tokens, never the one just written (drawn from the reference's view)."""
    live = spec.live_tokens(rid)[:-1]
    if not live:
        return []
    v = integer(data, 0, 7, "evict (how many)")  # 0-3: none; 4-7: one to four
    return some_of(data, live, 4, "victims", k=min(v - 3, len(live))) if v >= 4 else []


class TableMachine(SwarmRules):
    """Stateful conformance test of the token table (see module docstring)."""

    ops = 0  # operations checked, summed over all runs in this process (campaign counter)
    FULL_EVERY = 8  # every request compared (and the checkers run) at least every 8th check, and at teardown

    @staticmethod
    def make_impl(block_size: int, num_blocks: int):
        """The table under test (vtoken's own; ``vtoken.fuzz.protocol.table_machine_for`` binds
        another implementation here)."""
        return TokenTable(block_size, num_blocks, device=os.environ.get("VTOKEN_DEVICE", "cpu"))

    # S = 16 in one example of five, with 6 more blocks (5 hold 65 tokens): a request can outgrow
    # the 64 entries its arrays and device segment start with (step_then_grow); no smaller S gets
    # there in so few blocks.
    @initialize(S=st.sampled_from([1, 2, 3, 4, 16]), nb=st.integers(4, 14), data=st.data())
    def setup(self, S, nb, data):
        nb += 6 if S == 16 else 0
        self.start(S, nb)
        note(f"S={S} num_blocks={nb}")
        # a request or two to start from: an example whose draws leave the table empty spends
        # its steps on the few rules that need no request
        for _ in range(integer(data, 1, 2, "initial_requests")):
            self.add_request(integer(data, 1, 3, "nblocks"), data)

    def start(self, S: int, nb: int) -> None:
        """Both tables (S, ``nb`` blocks) and the allocator, with no request: ``setup``'s state,
        which a test driving the rules by hand starts from too."""
        self.S = S
        self.impl = Touching(self.make_impl(S, nb))
        self.spec = SpecTokenTable(S, nb)
        self.alloc = BlockAllocator(nb)
        self.pos: dict[int, list[int]] = {}  # positional block list, as a scheduler holds it
        self.held: dict[int, list[int]] = {}  # allocator references held per request
        self.next_id = 0
        self._checked = None  # the table's mutating calls at the last comparison
        self._checks = 0

    # ------------------------------------------------------------------ helpers
    def _alloc(self, n):
        return alloc_or_none(self.alloc, n)

    def _before(self, rid=None):
        """What a refused operation on ``rid`` must leave as it was: the request (none for an
        unknown one) and the blocks. The other requests are compared with the reference's,
        which the refusal left alone too, at the next full comparison."""
        return None if rid is None else export_request(self.impl, rid), export_blocks(self.impl)

    def _check_unchanged(self, rid, before):
        assert self._before(rid) == before, "a failed operation changed the implementation"

    def _free_blocks(self, rid, blocks):
        for b in blocks:
            self.held[rid].remove(b)
            self.alloc.free([b])
            self.pos[rid] = [0 if x == b else x for x in self.pos[rid]]  # null substitution

    def _sync(self, rid, total):
        TableMachine.ops += 1
        return sync_both(self.impl, self.spec, rid, self.pos[rid], total)

    def rids(self):
        return sorted(self.pos)

    # ------------------------------------------------------------------ rules
    @rule(nblocks=st.integers(1, 3), data=st.data())
    def add_request(self, nblocks, data):
        blocks = self._alloc(nblocks)
        if blocks is None:
            return
        rid = self.next_id
        self.next_id += 1
        self.pos[rid], self.held[rid] = list(blocks), list(blocks)
        total = integer(data, 0, nblocks * self.S, "total_len")
        err = self._sync(rid, total)
        assert err is None, err

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def add_shared_request(self, data):
        """A prefix-cache hit: share the parent's leading full blocks, then grow privately."""
        parent = pick(data, self.rids(), "parent")
        plen = self.impl.length(parent) // self.S
        k = integer(data, 0, plen, "shared_blocks")
        prefix = self.pos[parent][:k]
        if 0 in prefix:
            return  # a freed position: nothing to share
        extra = self._alloc(integer(data, 0, 1, "private_blocks"))
        if extra is None:
            return
        self.alloc.incref(prefix)
        rid = self.next_id
        self.next_id += 1
        self.pos[rid], self.held[rid] = prefix + extra, prefix + extra
        total = integer(data, 0, (k + len(extra)) * self.S, "total_len")
        err = self._sync(rid, total)
        if err is not None:  # e.g. a parent token moved into its own vacated prefix slot
            event(f"shared sync refused: {err}")
            self.free_request_id(rid, expect_ok=True)
        elif k:
            event("shared prefix")

    def _grow_by(self, rid, k) -> bool:
        """Grow ``rid`` by ``k`` tokens, allocating the blocks they need; False when the pool
        is exhausted or both tables refused the growth."""
        n = self.impl.length(rid)
        need = -(-(n + k) // self.S) - len(self.pos[rid])
        if need > 0:
            blocks = self._alloc(need)
            if blocks is None:
                return False
            self.pos[rid] += blocks
            self.held[rid] += blocks
        return self._sync(rid, n + k) is None  # may fail (slot_conflict after moves into the tail): both must agree

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def grow(self, data):
        rid = pick(data, self.rids(), "rid")
        self._grow_by(rid, integer(data, 1, 3 * self.S, "new_tokens"))

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def decode_step(self, data):
        """One decode step of every request, in order (what a scheduler does each step): each
        grows by one token (a new block when its last one is full), then its policy may evict
        some of its older live tokens. Every operation is compared with the reference as it
        happens (result and error code), the states once the step is done (the invariant)."""
        for rid in self.rids():
            if not self._grow_by(rid, 1):
                continue
            ids = policy_victims(data, self.spec, rid)
            if ids:
                TableMachine.ops += 1
                assert both(lambda: self.impl.evict_tokens(rid, ids), lambda: self.spec.evict_tokens(rid, ids))[2] is None

    @precondition(lambda self: self.pos and callable(getattr(self.impl, "sync_one_each", None))
                  and callable(getattr(self.impl, "evict_one_each", None)))
    @rule(data=st.data())
    def decode_step_batched(self, data):
        """A decode step as the worker and the scheduler side's replica make it: every request's
        next token in one ``sync_one_each``, then one victim each (some requests) in one
        ``evict_one_each``. The reference makes the same changes one request at a time: it
        decides which are valid (a refused one leaves it unchanged and stays out of the batch),
        and the batch must succeed with the same slots."""
        grown, slots, blocks, alone = [], [], [], []
        for rid in self.rids():
            n = self.impl.length(rid)
            if -(-(n + 1) // self.S) > len(self.pos[rid]):
                new = self._alloc(1)
                if new is None:
                    continue
                self.pos[rid] += new
                self.held[rid] += new
            block = self.pos[rid][n // self.S]
            if block in blocks:  # the batch names each block once: this one grows on its own, on both,
                alone.append(rid)  # after the batch (the reference has the batch's growth already)
                continue
            try:
                got = self.spec.sync_new_tokens(rid, self.pos[rid], n + 1)
            except SpecError:
                continue  # refused by the reference (unchanged): not in the batch
            grown.append(rid)
            slots += list(got)
            blocks.append(block)
        TableMachine.ops += 1
        assert list(self.impl.sync_one_each(grown, blocks)) == slots, "batched growth placed tokens elsewhere"
        for rid in alone:
            self._sync(rid, self.impl.length(rid) + 1)
        pairs = []
        for rid in grown:
            live = self.spec.live_tokens(rid)
            if len(live) > 1 and data.draw(st.booleans(), label=f"evict one of {rid}"):
                x = pick(data, live[:-1], "victim")
                self.spec.evict_tokens(rid, [x])
                pairs.append((rid, x))
        if pairs:
            TableMachine.ops += 1
            self.impl.evict_one_each([r for r, _ in pairs], [x for _, x in pairs])
            event("batched decode step with evictions")

    @precondition(lambda self: self.pos)
    @rule(data=st.data(), first=st.sampled_from(["evict", "grow", "moves"]))
    def step_then_grow(self, data, first):
        """One scheduler step with no read in between: an update of the request (an eviction,
        a growth or moves; the table may only queue it for the device), then a growth, often
        just across a power of two from 64 on, where a table's per-request arrays and device
        segment double: the queued update must reach what the request grew into."""
        rids = self.rids()
        if data.draw(st.booleans(), label="longest"):  # half the time the longest: the likeliest to pass 64
            rid = max(rids, key=self.impl.length)
        else:
            rid = pick(data, rids, "rid")
        if first == "evict":
            live = self.spec.live_tokens(rid)
            if live:
                ids = some_of(data, live, 3, "victims")
                TableMachine.ops += 1
                assert both(lambda: self.impl.evict_tokens(rid, ids), lambda: self.spec.evict_tokens(rid, ids))[2] is None
        elif first == "grow":
            self._grow_by(rid, integer(data, 1, self.S, "new_tokens"))
        else:
            self._apply_moves_drawn(rid, data)
        n = self.impl.length(rid)
        cap = max(64, 1 << max(n - 1, 0).bit_length())  # the next doubling at or above n
        k = pick(data, [cap + 1 - n] * 3 + [self.S], "new_tokens")
        if self._grow_by(rid, k) and n <= cap < n + k:
            event("grown across a power of two >= 64 with updates queued")

    @precondition(lambda self: self.pos)
    @rule(data=st.data(), kind=st.sampled_from(["shrink", "short", "null", "range", "repeat"]))
    def grow_bad(self, data, kind):
        rid = pick(data, self.rids(), "rid")
        n = self.impl.length(rid)
        bl = list(self.pos[rid])
        total = n + 1
        if kind == "shrink":
            if n == 0:
                return
            total = n - 1
        elif kind == "short":
            total = len(bl) * self.S + 1
        else:
            j = n // self.S
            bl = bl[:j] + [{"null": 0, "range": 10**6, "repeat": (bl[0] if bl else 0)}[kind]]
        before = self._before(rid)
        TableMachine.ops += 1
        _, _, err = both(lambda: self.impl.sync_new_tokens(rid, bl, total),
                         lambda: self.spec.sync_new_tokens(rid, bl, total))
        if err is not None:
            self._check_unchanged(rid, before)

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def evict(self, data):
        rid = pick(data, self.rids(), "rid")
        n = self.impl.length(rid)
        ids = data.draw(st.lists(st.integers(-1, n), max_size=6), label="evict_ids")
        before = self._before(rid)
        TableMachine.ops += 1
        _, _, err = both(lambda: self.impl.evict_tokens(rid, ids), lambda: self.spec.evict_tokens(rid, ids))
        if err is not None:
            self._check_unchanged(rid, before)

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def evict_live(self, data):
        rid = pick(data, self.rids(), "rid")
        live = self.spec.live_tokens(rid)
        if not live:
            return
        ids = some_of(data, live, 4, "victims")
        TableMachine.ops += 1
        _, _, err = both(lambda: self.impl.evict_tokens(rid, ids), lambda: self.spec.evict_tokens(rid, ids))
        assert err is None, err

    def _valid_moves(self, rid, data, min_moves=1):
        """A small valid move list: live tokens out of private blocks into free slots of
        the request's own private blocks or of fresh blocks (compaction destinations)."""
        r = self.spec.export_request(rid)
        private = {b for b in r["blocks"] if self.spec.refs(b) == 1}
        movable = [t for t in r["live"] if r["loc"][t][0] in private]
        if not movable:
            return None, []
        fresh = self._alloc(integer(data, 0, 2, "fresh_blocks")) or []
        occupied = {tuple(v) for v in r["loc"].values()}
        free_slots = [(b, o) for b in sorted(private) + fresh for o in range(self.S) if (b, o) not in occupied]
        if not free_slots:
            self.alloc.free(fresh)
            return None, []
        most = min(len(movable), len(free_slots))
        k = integer(data, min(min_moves, most), most, "n_moves")
        toks = [movable[i] for i in distinct_indices(data, len(movable), k, "tokens")]
        dsts = [free_slots[i] for i in distinct_indices(data, len(free_slots), k, "dsts")]
        moves = [(t, *r["loc"][t], *d) for t, d in zip(toks, dsts)]
        return moves, fresh

    def _commit_fresh(self, rid, fresh):
        used = set(self.impl.blocks_of(rid))
        for b in fresh:
            if b in used:
                self.held[rid].append(b)
            else:
                self.alloc.free([b])

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def apply_valid_moves(self, data):
        self._apply_moves_drawn(pick(data, self.rids(), "rid"), data)

    def _apply_moves_drawn(self, rid, data):
        """Valid moves of ``rid`` (``_valid_moves``) on both tables; the same result, tokens conserved."""
        moves, fresh = self._valid_moves(rid, data)
        if moves is None:
            return
        pre = {"requests": {rid: self.spec.export_request(rid)}}  # what check_conservation reads
        TableMachine.ops += 1
        a, b, err = both(lambda: self.impl.apply_moves(rid, moves), lambda: self.spec.apply_moves(rid, moves))
        assert err is None, f"valid moves refused: {err} {moves}"
        assert a == b, f"emptied sources differ: {a} vs {b}"
        check_conservation(pre, moves, {"requests": {rid: export_request(self.impl, rid)}}, rid)
        self._commit_fresh(rid, fresh)
        self._free_blocks(rid, a)
        if a:
            event("moves emptied a source block")

    @precondition(lambda self: self.pos)
    @rule(data=st.data(), kind=st.sampled_from(
        ["wrong_source", "dead", "unknown", "dup_token", "dup_dst", "occupied", "null", "range", "offset", "foreign"]))
    def apply_invalid_moves(self, data, kind):
        rid = pick(data, self.rids(), "rid")
        moves, fresh = self._valid_moves(rid, data, min_moves=2 if kind == "dup_dst" else 1)
        if moves is None:
            return
        r = self.spec.export_request(rid)
        i = integer(data, 0, len(moves) - 1, "corrupt_index")
        t, sb, so, db, do = moves[i]
        dead = [p for p in range(r["length"]) if p not in r["loc"]]
        others = [b for b in sorted(self.spec.referenced_blocks()) if b not in r["blocks"]]
        if kind == "wrong_source":
            moves[i] = (t, sb, (so + 1) % self.S if self.S > 1 else so, db, do) if self.S > 1 else (t, sb + 1, so, db, do)
        elif kind == "dead" and dead:
            moves[i] = (dead[0], sb, so, db, do)
        elif kind == "unknown":
            moves[i] = (r["length"], sb, so, db, do)
        elif kind == "dup_token":
            moves.append(moves[i])
        elif kind == "dup_dst" and len(moves) > 1:
            moves[(i + 1) % len(moves)] = moves[(i + 1) % len(moves)][:3] + (db, do)
        elif kind == "occupied":
            moves[i] = (t, sb, so, *r["loc"][r["live"][0]])
        elif kind == "null":
            moves[i] = (t, sb, so, 0, do)
        elif kind == "range":
            moves[i] = (t, sb, so, self.impl.num_blocks, do)
        elif kind == "offset":
            moves[i] = (t, sb, so, db, self.S)
        elif kind == "foreign" and others:
            moves[i] = (t, sb, so, others[0], do)
        else:
            self.alloc.free(fresh)
            return
        before = self._before(rid)
        TableMachine.ops += 1
        a, b, err = both(lambda: self.impl.apply_moves(rid, moves), lambda: self.spec.apply_moves(rid, moves))
        if err is None:  # the corruption happened to stay valid (e.g. a dead slot reused)
            assert a == b
            self._commit_fresh(rid, fresh)
            self._free_blocks(rid, a)
            return
        event(f"invalid moves refused: {err}")
        self._check_unchanged(rid, before)
        self.alloc.free(fresh)

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def release_empty(self, data):
        rid = pick(data, self.rids(), "rid")
        r = self.spec.export_request(rid)
        offer = r["blocks"] + [0, 10**6]  # its blocks, the null block and one out of range
        mask = integer(data, 0, (1 << len(offer)) - 1, "picked (bit mask)")  # one draw, not one a block
        cand = [b for i, b in enumerate(offer) if mask >> i & 1]
        before = self._before(rid)
        TableMachine.ops += 1
        a, b, err = both(lambda: self.impl.release_empty_blocks(rid, cand),
                         lambda: self.spec.release_empty_blocks(rid, cand))
        if err is not None:
            self._check_unchanged(rid, before)
            return
        assert a == b
        self._free_blocks(rid, a)

    def free_request_id(self, rid, expect_ok=False):
        TableMachine.ops += 1
        a, b, err = both(lambda: self.impl.free_request(rid), lambda: self.spec.free_request(rid))
        if expect_ok and err == "unknown_request":
            a = b = []
        elif err is not None:
            raise AssertionError(f"free_request refused: {err}")
        assert a == b, f"freed blocks differ: {a} vs {b}"
        self.alloc.free(self.held.pop(rid))
        del self.pos[rid]

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def free_request(self, data):
        self.free_request_id(pick(data, self.rids(), "rid"))

    @rule(data=st.data())
    def double_free(self, data):
        """Freeing more references than are held must be refused and change nothing."""
        free = self.alloc.free_queue()
        held = [b for bl in self.held.values() for b in bl]
        cand = free[:2] + held[:2] + [0]
        b = pick(data, cand, "block")
        extra = integer(data, 0, 1, "extra_refs")
        times = (int(self.alloc.ref[b]) + 1 + extra) if b else 1
        before = self.alloc.export_state()
        TableMachine.ops += 1
        try:
            self.alloc.free([b] * times)
        except AllocatorError as e:
            assert e.code in ("double_free", "null_block"), e.code
            assert self.alloc.export_state() == before, "a refused free changed the allocator"
        else:
            raise AssertionError(f"freeing block {b} {times} time(s) with {before['ref'].get(b, 0)} reference(s) was accepted")

    # junk drawn by index (a fresh copy each time): sampled_from would label by element hashes
    @precondition(lambda self: self.pos)
    @rule(data=st.data(), op=st.sampled_from(["sync", "evict", "evict_one", "moves", "release", "location"]),
          junk=st.integers(0, len(_JUNK) - 1).map(lambda i: copy.copy(_JUNK[i])))
    def bad_input(self, data, op, junk):
        """A value of the wrong type (or beyond int64) where an id or a list of ids belongs:
        both refuse with the same code (``not_integer`` / ``bad_move`` / a range code) and
        neither changes. The junk replaces one entry or the whole argument."""
        rid = pick(data, self.rids(), "rid")
        r = self.spec.export_request(rid)
        whole = data.draw(st.booleans(), label="whole_argument")
        if op == "sync":
            n = r["length"]
            bl = list(self.pos[rid]) + [0]
            j = n // self.S
            if whole:  # never a list: a list of integers is a real block list, not junk
                args = (rid, "37" if isinstance(junk, (list, tuple)) else junk, n + 1)
            else:
                bl[min(j, len(bl) - 1)] = junk
                args = (rid, bl, pick(data, [n + 1, n + 2, n + 1.0], "total"))
            impl_call, spec_call = self.impl.sync_new_tokens, self.spec.sync_new_tokens
        elif op in ("evict", "evict_one", "location"):
            ids = junk if whole else [t for t in r["live"][:1]] + [junk]
            if op == "evict":
                args, impl_call, spec_call = (rid, ids), self.impl.evict_tokens, self.spec.evict_tokens
            elif op == "evict_one":
                args, impl_call, spec_call = (rid, junk), self.impl.evict_token, self.spec.evict_token
            else:
                args, impl_call, spec_call = (rid, junk), self.impl.location, self.spec.location
        elif op == "moves":
            moves, fresh = self._valid_moves(rid, data)
            if moves is None:
                return
            self.alloc.free(fresh)
            if whole:
                moves = junk
            else:
                i = integer(data, 0, len(moves) - 1, "row")
                c = integer(data, 0, 4, "col")
                row = list(moves[i])
                row[c] = junk
                moves[i] = tuple(row)
            args, impl_call, spec_call = (rid, moves), self.impl.apply_moves, self.spec.apply_moves
        else:
            args = (rid, junk if whole else list(r["blocks"][:1]) + [junk])
            impl_call, spec_call = self.impl.release_empty_blocks, self.spec.release_empty_blocks
        before = self._before(rid)
        TableMachine.ops += 1
        a, b, err = both(lambda: impl_call(*args), lambda: spec_call(*args))
        if err is None:  # () is an empty list, [1] a list of integers: a real call, on both
            assert op != "sync", f"sync_new_tokens{args!r} accepted a bad input"
            event(f"bad_input accepted: {op}")
            if op == "release":
                assert a == b
                self._free_blocks(rid, a)
            return
        event(f"bad input refused: {err}")
        self._check_unchanged(rid, before)

    # (an argument: rules are ordered by argument count, and a rule that cannot run passes its
    # step to the next in that order, so this one does not follow a run of rules needing requests)
    @rule(op=st.sampled_from(["evict", "moves", "release", "free", "location"]))
    def unknown_request(self, op):
        """Every operation on a request neither table knows (but growth, which adds one): both
        refuse (``unknown_request``) and nothing changes."""
        call = {"evict": ("evict_tokens", ["nope", [0]]),
                "moves": ("apply_moves", ["nope", [(0, 1, 0, 2, 0)]]), "release": ("release_empty_blocks", ["nope", [1]]),
                "free": ("free_request", ["nope"]), "location": ("location", ["nope", 0])}[op]
        before = self._before()
        TableMachine.ops += 1
        _, _, err = both(lambda: getattr(self.impl, call[0])(*call[1]), lambda: getattr(self.spec, call[0])(*call[1]))
        assert err == "unknown_request", f"{call[0]} of an unknown request: {err}"
        assert self._before() == before, "a failed operation changed the implementation"

    # ------------------------------------------------------------------ invariants
    @invariant()
    def observable_state_equal(self):
        """The two tables agree, at a cost that follows what changed: after each operation the
        requests it named (``Touching``: recorded from the calls, not from the rules), every
        block's refs and live count, and the waste ratio; every request and the invariant
        checkers every ``FULL_EVERY`` checks, when a call named no recordable request, and
        at teardown. A state is never checked twice: with no mutating call since the last
        check (a rule that found nothing to do, an allocation refused) the tables show the
        state checked then (the allocator alone changes nothing they show; its accounting
        against them is checked in the full comparisons)."""
        if not hasattr(self, "impl") or self.impl.calls == self._checked:
            return
        self._checked = self.impl.calls
        self._checks += 1
        rids, full = self.impl.take()
        if full or self._checks % self.FULL_EVERY == 0:
            self._compare_all(self.alloc.export_state())
            return
        for rid, r in compare_parts(self.impl, self.spec, rids)[0].items():
            self._compare_request(rid, r)
        assert abs(self.impl.waste_ratio() - self.spec.waste_ratio()) < 1e-9

    def _compare_all(self, alloc: dict) -> None:
        """Every request, the blocks and the waste ratio; then the invariant checkers on the state."""
        si, ss = self.impl.export_state(), self.spec.export_state()
        assert si == ss, f"state differs:\n impl={si}\n spec={ss}"
        for rid in self.rids():
            self._compare_request(rid, si["requests"][rid])
        assert abs(self.impl.waste_ratio() - self.spec.waste_ratio()) < 1e-9
        check_unique_mapping(si)
        check_block_accounting(si, alloc)

    def _compare_request(self, rid, r: dict) -> None:
        """The read path of one request (its exported state ``r``, already compared): slot
        mapping, a few locations, and vtoken's device lookup cache."""
        assert self.impl.slot_mapping(rid).tolist() == self.spec.slot_mapping(rid), f"slot mapping of {rid} differs"
        for t in r["live"][:3]:
            assert self.impl.location(rid, t) == self.spec.location(rid, t)
        if callable(getattr(self.impl, "read_view", None)):  # vtoken's table: its device lookup cache too
            self._check_read_view(rid, r)

    def teardown(self):
        # the last operations may not have had a full comparison yet; an example already
        # failing keeps its own error (this runs in Hypothesis's finally)
        if hasattr(self, "impl") and sys.exc_info()[0] is None:
            self._compare_all(self.alloc.export_state())

    def _check_read_view(self, rid, r):
        """The device view (``read_view``) says what the host table says: a live bit per token,
        and each live token's slot."""
        slots, live = self.impl.read_view(rid)
        want = [False] * r["length"]
        for t in r["live"]:
            want[t] = True
        got = live.tolist()
        assert got == want, (f"device live bits of {rid} differ at tokens "
                             f"{[t for t in range(max(len(got), len(want))) if got[t:t + 1] != want[t:t + 1]]}")
        got = slots.tolist()
        S = self.S
        bad = {t: (got[t], b * S + o) for t, (b, o) in r["loc"].items() if got[t] != b * S + o}
        assert not bad, f"device slots of {rid} differ (token: device, host): {bad}"


TestTableMachine = TableMachine.TestCase
