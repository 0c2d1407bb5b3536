"""The adapter's runtime checks: its assumptions verified against vLLM's pool, not against
the adapter's own intentions.

``RuntimeChecks`` reads the rooms it is given (the lifecycle's headroom, held blocks and plans
in flight; the mirror, the fence ledger, pending releases) and vLLM's (``req_to_blocks``,
``deferred_frees``, every block's ``ref_cnt`` and hash) and raises
:class:`~.assumptions.AdapterAssumptionError` naming the broken assumption: ``fence``,
``reservation``, ``ownership``, ``prefix_hash``, ``null_substitution``, ``kv_groups`` (the pool
checks) and ``table_in_step``. It owns nothing and changes nothing.

What a hook costs (``after_hook``): the checks run on what changed since the last hook,
plus the adapter's own small, bounded holdings. The adapter reports the requests each of
its own events changed the holdings of (``touch``: launch, report, release, free) and the
requests whose list vLLM changed (``touch_lists``: the mirror's changed lists; a table's block set
changing leaves vLLM's list as it was, and an eviction changes liveness, never which blocks a table
references); the check then covers the lists of both, the whole tables of the first, of requests whose list
(re)started (``touch_tables``) and of those with a plan in flight, and of every other table the
blocks it gained since (``touch_added``: the table's ``added`` log; a block a table no longer
references cannot break the check, and what the scheduler side holds for a request changes only
with those events), the held destinations and fills of the
first, the headroom blocks that entered it since the last hook and every block of the
plans in flight (at most ``max_plans_per_step`` x (B + fills + destinations) per step in
flight), counting a block's holders from the mirror's reverse index and vLLM's deferred
frees instead of scanning every list. Every ``full_every`` hooks (default 64), at idle
(``drain_idle``, ``close``) and with ``paranoid`` on every hook, the full scan runs instead:
every block the adapter holds against holders counted from vLLM's own lists, every list
against its mirror, every table. A violation the full scan sees is therefore caught within
``full_every`` hooks at the latest, and on the hook it happens when it touches what
changed.
Owns: the touched-request sets, the hook counter (when the next full scan runs) and the
false alarms seen. It changes nothing of the adapter's or vLLM's state but the lifecycle's
record of headroom blocks new since the last check (``Lifecycle.take_fresh``).
May call: the rooms it is given and vLLM's pool and lists (through the harness), read only.
Costs: incremental O(touched + new headroom blocks + in-flight blocks + deferred frees);
full O(pool) (request lists, deferred frees and the adapter's holdings).
"""

from __future__ import annotations

from collections import Counter
from itertools import chain
from operator import attrgetter

from .assumptions import AdapterAssumptionError


_HEADROOM = ("headroom",)
_block_id = attrgetter("block_id")
_NONE: frozenset = frozenset()
_DESTINATIONS = ("held", "dest", "fill")


def _describe(kind: tuple) -> str:
    """A block's role in the checks' ledger, as the error names it."""
    role = kind[0]
    if role == "held":
        return f"destination of request {kind[1]!r}"
    if role == "source":
        p = kind[1]
        return f"source of plan {p.id} (request {p.req_id!r}, fence {p.seq})"
    if role == "dest":
        p = kind[1]
        return f"destination of in-flight plan {p.id} (request {p.req_id!r})"
    if role == "fill":
        p = kind[1]
        return f"fill of in-flight plan {p.id} (request {p.req_id!r})"
    return "headroom"


class RuntimeChecks:
    """The checks over one adapter's rooms.

    Args:
        harness: the ``VllmHarness`` (vLLM's pool, scheduler and lists, read each time).
        table, mirror, fence: the adapter's token table and rooms.
        lifecycle: the lifecycle room (``headroom``, ``held``, ``in_flight``: read, never changed
            but for ``take_fresh``).
        pending_release: ``(seq, request, block)`` released and not yet applied by the worker
            (the adapter's list, updated in place).
        current: the adapter's question whether a request's table is checkable (mirrored, in
            the table, its incarnation seen by the worker: ``VTokenAdapter.current``).
        full_every, paranoid: the full scan's period, or at every hook.
        incremental: False when no hook runs the checks (the adapter's ``checks`` off): what is
            touched is not kept (it would only grow); ``check_all`` and ``check_pool`` still scan.
    """

    def __init__(self, *, harness, table, lifecycle, mirror, fence, pending_release: list, current,
                 full_every: int = 64, paranoid: bool = False, incremental: bool = True):
        self.harness, self.table, self.lifecycle, self.current = harness, table, lifecycle, current
        self.held, self.plans = lifecycle.held, lifecycle.in_flight  # the lifecycle's own objects, read here
        self.mirror, self.fence, self.pending_release = mirror, fence, pending_release
        self.full_every = int(full_every)  # >= 1: the adapter refuses less at construction
        self.paranoid = bool(paranoid)
        self.incremental = bool(incremental)
        self.hooks = 0
        self.full_scans = 0
        self.touched_requests: set = set()  # the adapter changed what it holds for these
        self.touched_lists: set = set()  # vLLM changed their lists (their holdings unchanged)
        self.touched_tables: set = set()  # whole tables to check at the next table hook (lists restarted, events)
        self.added: list = []  # (request, block) a table started to reference, for the next table hook
        self.new_entries: list = []  # (request, block id) vLLM put in a list since the last hook
        self.false_alarms: list[str] = []  # incremental findings the full scan did not confirm

    # ------------------------------------------------------------------ what changed
    def touch(self, requests) -> None:
        """Requests an event changed the blocks or table of (O(given)): their lists, tables
        and destinations are checked at the next hook (the blocks new to the headroom and
        the plans in flight are checked at every hook)."""
        if self.incremental:
            self.touched_requests.update(requests)

    def touch_lists(self, requests) -> None:
        """Requests whose block list vLLM changed (started, grown): their lists are checked at the
        next hook; the blocks the adapter holds for them did not change hands (O(given))."""
        if self.incremental:
            self.touched_lists.update(requests)

    def touch_tables(self, requests) -> None:
        """Requests whose list (re)started: their whole tables are checked at the next hook that
        checks tables (O(given))."""
        if self.incremental:
            self.touched_tables.update(requests)

    def touch_added(self, pairs) -> None:
        """``(request, block)``: blocks a table started to reference (the table's ``added`` log),
        each checked at the next hook that checks tables to be one the scheduler side holds for
        the request. What a table no longer references cannot break that, and what the scheduler
        side holds changes only with the adapter's events (``touch``: the whole table is checked)
        or a list restarted (``touch_tables``): so the tables of requests that only grew are
        checked by what they gained, not whole (O(given))."""
        if self.incremental:
            self.added += pairs

    def touch_entries(self, entries) -> None:
        """``(request, block id)`` pairs vLLM put in a list (new, grown, resumed): each is
        checked at the next hook against every block the adapter holds (a held block vLLM
        hands out again was freed behind the adapter's back). O(given)."""
        if self.incremental:
            self.new_entries += entries

    def after_hook(self, where: str, table: bool = False) -> None:
        """The checks of one hook: incremental, or the full scan when it is due."""
        self.hooks += 1
        if self.paranoid or self.hooks % self.full_every == 0:
            self.check_pool(where)
            if table:
                self.check_table()
                self.touched_tables.clear()
                self.added = []
            else:  # the tables wait for the next hook that checks them
                self.touched_tables |= self.touched_requests
            self.full_scans += 1
            self.touched_requests.clear()
            self.touched_lists.clear()
            self.new_entries = []
            return
        try:
            self.check_touched(where, table=table)
        except AdapterAssumptionError as e:
            # the incremental view (the mirror's reverse index, the touched sets) is a cache:
            # a violation it sees is confirmed by the full scan, whose error is the verdict
            self.check_pool(where)
            if table:
                self.check_table()
            self.full_scans += 1
            self.false_alarms.append(f"{where}: {e}")

    # ------------------------------------------------------------------ the incremental check
    def check_touched(self, where: str, table: bool = False) -> None:
        self.fence.check()
        reqs, self.touched_requests = self.touched_requests, set()
        lists, self.touched_lists = self.touched_lists | reqs, set()
        fresh = self.lifecycle.take_fresh()  # the rest of the headroom: at the full scan
        held = [(r, self.held[r]) for r in reqs if r in self.held]
        if fresh:
            self._check_headroom(where, lambda bid: min(self.mirror.holders(bid), default=None), fresh)
        self._check_new_entries(where)
        if fresh or held or self.plans:  # else no hold to count (``_check_refs`` would find none)
            deferred = self._deferred_counts()
            listed, no = self.mirror.where, ()
            self._check_refs(where, fresh, held, lambda bid: len(listed.get(bid, no)) + deferred.get(bid, 0))
        self._check_sources_detached(where, thorough=False)
        self.mirror.check_lists(where, requests=lists)
        self.touched_tables |= reqs  # the adapter changed what it holds for them: whole tables
        if table:
            tables, self.touched_tables = self.touched_tables, set()
            added, self.added = self.added, []
            tables |= {p.req_id for p in self.plans.values()}
            self.check_table(requests=tables, gained=added)

    # ------------------------------------------------------------------ the full scan
    def check_pool(self, where: str) -> None:
        """Reservation, ownership, fence and prefix-hash checks against the pool itself (a
        block's holders counted from vLLM's own lists of every KV cache group and its deferred
        frees, not the mirror), then every mirrored list against its mirror."""
        self.fence.check()
        # every group's lists: a block the adapter holds is in none of them (other groups' are vLLM's)
        lists = list(self.harness.all_lists())
        g0 = self.mirror.group
        self._check_other_groups(where, [(g, r, [b.block_id for b in lst if not b.is_null])
                                         for g, r, lst in lists if g != g0])
        # the holders of each block the adapter holds (the only counts read), counted in C over
        # every list's entries: the pool's blocks are filtered before counting, not each counted
        held = list(self.held.items())
        mine = set(self.lifecycle.headroom).union(self._held_ids(held))
        mine.discard(self.harness.pool.null_block.block_id)  # a list holding null holds no block
        holders = Counter(filter(mine.__contains__, map(_block_id, chain.from_iterable(lst for _, _, lst in lists))))
        in_lists = holders.copy()
        holders.update(self._deferred_counts())

        def list_holder(bid):  # the first request whose list holds bid (names a violation)
            if not in_lists.get(bid):
                return None
            return next((r for _, r, lst in lists if any(b.block_id == bid for b in lst)), None)  # bid is never null

        self.lifecycle.take_fresh()
        self.new_entries = []  # every list is scanned below
        stale = self.held.index_errors()
        if stale:
            raise AdapterAssumptionError("ownership", f"{where}: the held-block index disagrees with the held blocks: "
                                                      f"{stale[:8]}")
        self._check_headroom(where, list_holder, self.lifecycle.headroom)
        self._check_refs(where, self.lifecycle.headroom, held, lambda bid: holders.get(bid, 0))
        self._check_sources_detached(where, thorough=True)
        self.mirror.check_lists(where)

    def check_table(self, requests=None, gained=()) -> None:
        """Every block the token table references for a live request is one the scheduler
        side holds for it (its list, its destinations, an in-flight plan, a pending release).
        ``requests``: only these, whole (default: every mirrored request). ``gained``:
        ``(request, block)`` pairs (the table's ``added`` log) of other requests: only those
        blocks, while the table still references them (a block it no longer references cannot
        break the check). O(blocks checked + pending releases + plans' blocks)."""
        t, m = self.table, self.mirror
        processed = self.fence.clock.processed
        whole, current = (m.ids if requests is None else requests), self.current
        todo = [r for r in whole if current(r)]
        gained_by: dict[str, list] = {}
        pos = m.pos
        for r, b in gained:  # a block in the request's list is held for it: never unaccounted
            if b not in pos.get(r, _NONE) and r not in whole and current(r) and t.references(r, b):
                gained_by.setdefault(r, []).append(b)
        if not todo and not gained_by:
            return
        pend: dict[str, set] = {}
        for _, r, b in self.pending_release:
            pend.setdefault(r, set()).add(b)
        inflight: dict[str, set] = {}
        for p in self.plans.values():
            inflight.setdefault(p.req_id, set()).update(p.blocks)
        held = self.held

        def holds(r) -> tuple:  # what the scheduler side holds for r: its list, held blocks, releases, plans
            return pos.get(r, _NONE), held.get(r, _NONE), pend.get(r, _NONE), inflight.get(r, _NONE)

        for r in todo:  # whole tables: the table's own block set less every hold, in C
            extra = t.blocks_outside(r, *holds(r))
            if extra:
                self._unheld(r, extra, processed)
        for r, ids in gained_by.items():
            extra = set(ids).difference(*holds(r))
            if extra:
                self._unheld(r, extra, processed)

    @staticmethod
    def _unheld(r: str, extra, processed: int) -> None:
        raise AdapterAssumptionError(
            "table_in_step", f"request {r!r}: the token table references blocks {sorted(extra)} that the "
            f"scheduler side does not hold for it (step {processed})")

    def check_all(self) -> None:
        self.check_pool("check_all")
        self.check_table()

    # ------------------------------------------------------------------ shared pieces
    def _deferred_counts(self) -> dict:
        """References on each block held by deferred frees, vLLM's and the adapter's port's ({}
        when none wait)."""
        port, theirs = self.lifecycle.port, self.harness.scheduler.deferred_frees
        if not (port.deferred or theirs):  # nothing waits (with reclamation off, never): no Counter built
            return {}
        out = port.deferred_counts()
        out.update(b.block_id for _, blocks in theirs for b in blocks if not b.is_null)
        return out

    def _held_ids(self, held) -> list:
        """Every hold the adapter has besides its headroom, one entry per hold, in the order the
        errors name them: ``held``'s ``(request, {id: None})`` pairs, then each plan in flight's
        sources, fills and destinations. None of them may carry a prefix hash. O(what it holds)."""
        ids = [b for _, h in held for b in h]
        for p in self.plans.values():
            ids += p.sources
            ids += p.fills
            ids += p.dests
        return ids

    def _roles(self, headroom, held) -> dict[int, tuple]:
        """Each block of ``headroom`` (ids), of ``held``'s ``(request, {id: None})`` pairs and of
        the plans in flight -> its role (see :func:`_describe`)."""
        kind: dict[int, tuple] = dict.fromkeys(headroom, _HEADROOM)
        for r, h in held:
            kind.update(dict.fromkeys(h, ("held", r)))
        for p in self.plans.values():
            for role, blocks in (("source", p.sources), ("fill", p.fills), ("dest", p.dests)):
                kind.update((b, (role, p)) for b in blocks)
        return kind

    def _check_other_groups(self, where: str, lists) -> None:
        """No list of a group the table does not mirror (``(group, request, block ids)``; vLLM's
        sliding-window, chunked-local, Mamba lists) holds a block the adapter holds
        (``kv_groups``). O(their blocks + the adapter's holdings)."""
        if not lists:
            return
        kind = self._roles(self.lifecycle.headroom, list(self.held.items()))
        for g, r, ids in lists:
            bad = [b for b in ids if b in kind]
            if bad:
                raise AdapterAssumptionError(
                    "kv_groups", f"{where}: block {bad[0]} ({_describe(kind[bad[0]])}) is in request {r!r}'s list of "
                    f"KV cache group {g}, which vLLM manages: it was returned to the pool while the adapter holds it")

    def _check_new_entries(self, where: str) -> None:
        """No block vLLM put in a list since the last hook is one the adapter holds: in the
        headroom (``reservation``), a source of a plan in flight (``fence``), a fill or
        destination in flight or held for a request (``ownership``). O(new entries + plans'
        blocks + headroom)."""
        entries, self.new_entries = self.new_entries, []
        if not entries or not (self.lifecycle.headroom or self.plans or not self.held.empty()):
            return  # nothing new, or the adapter holds no block (reclamation off, idle): none can be one of its
        kind = self._roles(self.lifecycle.headroom, ())  # headroom and plans in flight; held blocks by their index
        for r, bid in entries:
            holder = self.held.owner(bid)
            k = kind.get(bid) or (("held", holder) if holder is not None else None)
            if k is _HEADROOM:
                raise AdapterAssumptionError(
                    "reservation", f"{where}: headroom block {bid} is in request {r!r}'s block list "
                    f"(ref_cnt {self.harness.pool.blocks[bid].ref_cnt}): vLLM handed it out while the adapter holds it")
            if k is not None:
                raise AdapterAssumptionError(
                    "fence" if k[0] == "source" else "ownership",
                    f"{where}: block {bid} ({_describe(k)}) entered request {r!r}'s block list while the adapter "
                    f"holds it (ref_cnt {self.harness.pool.blocks[bid].ref_cnt}): it was returned to the pool while still held")

    def _check_headroom(self, where: str, list_holder, ids) -> None:
        pool_blocks = self.harness.pool.blocks
        for bid in ids:
            b = pool_blocks[bid]
            r = list_holder(bid)
            if r is not None:
                raise AdapterAssumptionError(
                    "reservation", f"{where}: headroom block {bid} is in request {r!r}'s block list "
                    f"(ref_cnt {b.ref_cnt})")
            if b.ref_cnt != 1 or b.block_hash is not None:
                raise AdapterAssumptionError(
                    "reservation", f"{where}: headroom block {bid} has ref_cnt {b.ref_cnt} (want 1), "
                    f"hash {'set' if b.block_hash is not None else 'none'}")

    def _check_refs(self, where: str, headroom, held, others) -> None:
        """Each block the adapter holds (``headroom`` ids, the ``(request, {id: None})``
        pairs of ``held``, every block of the plans in flight) has ``ref_cnt`` = the adapter's
        holds on it + ``others(block)`` (request lists, deferred frees); a destination or fill
        carries no prefix hash, nor a source while its copy flies (its hash was parked at launch:
        one hashed since would let a prefix hit land on a block in flight; seen at this hook, not
        only at the plan's end). The holds are counted in C (``Counter``) and compared in one
        comprehension; only when that finds something are the roles worked out and the first
        violation (in the order headroom, held, plans) named."""
        blocks, cached = self.harness.pool.blocks, self.harness.pool.cached_block_hashes_by_block
        dest_like = self._held_ids(held)  # no hash on a held block nor any block of a plan in flight
        ids = list(headroom) + dest_like  # every hold, in the order the errors name them
        if not ids:
            return
        mine = Counter(ids)
        if not any(blocks[bid].ref_cnt != n + others(bid) for bid, n in mine.items()) and \
                not any(blocks[bid].block_hash is not None or bid in cached for bid in dest_like):
            return
        kind = self._roles(headroom, held)
        for bid, n in mine.items():  # the first violation, named (the roles as the errors give them)
            blk = blocks[bid]
            k = kind[bid]
            if blk.ref_cnt != n + others(bid):
                check = "fence" if k[0] == "source" else "ownership"
                raise AdapterAssumptionError(
                    check, f"{where}: block {bid} ({_describe(k)}) has ref_cnt {blk.ref_cnt}, but the adapter holds "
                    f"{n} and request lists / deferred frees hold {others(bid)}: it was returned to the pool while "
                    f"still held (freed before its fence)")
            if (k[0] in _DESTINATIONS or k[0] == "source") and (blk.block_hash is not None or bid in cached):
                raise AdapterAssumptionError(
                    "prefix_hash", f"{where}: block {bid} ({_describe(k)}) carries a prefix-cache hash "
                    f"({blk.block_hash!r}) " + ("while its copy flies (parked at launch): a prefix hit could land on it"
                                                 if k[0] == "source" else
                                                 "although it holds relocated tokens of mixed positions"))

    def _check_sources_detached(self, where: str, thorough: bool) -> None:
        """No source or fill of a plan in flight is in its request's list (at the index it was
        taken from, ``Plan.list_index``, or with ``thorough`` anywhere in the list). A
        source or fill with no recorded index is itself a violation: the incremental check
        could never compare it with vLLM's list."""
        for p in self.plans.values():
            if p.orphaned:
                continue
            own = self.harness.req_to_blocks.get(p.req_id, [])
            for bid in p.sources + p.fills:
                i = p.list_index.get(bid)
                if i is None:
                    raise AdapterAssumptionError(
                        "null_substitution", f"{where}: block {bid} of plan {p.id} (request {p.req_id!r}) has "
                        f"no recorded list index: where it was taken from is unknown")
                b = self.harness.pool.blocks[bid]
                there = any(x is b for x in own) if thorough else (0 <= i < len(own) and own[i] is b)
                if there or self.mirror.index(p.req_id, bid) is not None:
                    raise AdapterAssumptionError(
                        "null_substitution", f"{where}: block {bid} (a source or fill) of plan {p.id} is still in "
                        f"request {p.req_id!r}'s block list")
