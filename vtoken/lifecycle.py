"""The plan lifecycle: one room, driven by every path (decode engine, simulator, vLLM adapter).

``planned -> copying -> completed -> applied | aborted``, or ended as an *orphan* when its
request finished or was preempted while the copy flew. Two sides:

- the block side, :class:`Lifecycle`: the headroom (reserved destination blocks), the blocks
  held for requests outside the path's own lists, the plans in flight (their busy blocks, one
  plan per request, I4), how each ended, and the one release of blocks to the pool;
- the copy side, :class:`Copies`: each plan's copy issued, polled, and once observed complete
  applied to the token table (:func:`apply_completed`); the :class:`Outcome` it reports is
  what the block side ends the plan with (:meth:`Lifecycle.end`).

The decode engine and the simulator run both sides in one process
(``vtoken.planner.ReclamationManager``); the vLLM adapter runs the block side on the
scheduler and the copy side in its worker, the outcomes riding back on vLLM's outputs. The
planner machine checks the manager, so what it checks is these classes on every path; what
stays per path is where blocks come from (:class:`AllocatorPort` or the adapter's port over
vLLM's ``BlockPool``) and, in the adapter, vLLM's objects.

Ownership, every path: a request's references are in the path's own list (vLLM's block
list) or held here (``held``: on the decode engine and simulator paths every block of the
request, in the adapter the blocks outside its list). A plan in flight holds its sources and
fills (taken over from the request at launch: from ``held``, or through the path's ``detach``)
and its destinations (taken from the headroom). At its end, applied: sources released at the
plan's fence, fills and used destinations held for the request (released if it left), unused
destinations back to the headroom; aborted: sources and fills held for the request again
(released if it left, or if the table no longer reads them), destinations back to the
headroom. Every block goes back to the pool through :meth:`Lifecycle.release`, which refuses a
block a plan in flight still uses.
Owns: the records and holdings above, one reference per held block, per headroom block and
per block of a plan in flight.
May call: vtoken.errors, vtoken.snapshot (``request_state``), numpy; never spec/, invariants/,
fuzz/ or reports/.
Costs: O(1) per plan opened or closed plus O(its blocks) (a launch whose destinations are not the
headroom's front, which no path plans, O(headroom)); ``release`` O(blocks) plus the pool's
free; ``Copies.poll`` O(plans in flight) plus, per plan applied, O(moves + sources + fills).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from .errors import PlanError
from .snapshot import request_state

PLANNED, COPYING, COMPLETED, APPLIED, ABORTED = "planned", "copying", "completed", "applied", "aborted"
OUTCOMES = ("applied", "aborted", "orphaned")


@dataclass
class Plan:
    """One compaction plan, from proposal to its end (block ids throughout).

    Ownership while it flies: the lifecycle holds one reference on each source and fill (taken
    over from the request) and on each destination (taken from the headroom). ``seq`` is the
    scheduler step that carries it, its fence (0 where the copy is host-observed before the
    plan ends, as in the decode engine); ``gone_fence`` the fence of its request's freed list
    when it was orphaned."""

    id: int
    req_id: object
    sources: list  # blocks the plan empties (all of them: moved-out and all-dead ones)
    dests: list  # fresh destination blocks, taken from the headroom (after apply: the used ones)
    moves: np.ndarray  # (k, 5): token, src_block, src_offset, dst_block, dst_offset
    fills: list = field(default_factory=list)  # the request's blocks whose holes take tokens (stay its own)
    state: str = PLANNED
    handle: object = None
    snapshot: Optional[dict] = None
    evicted_in_flight: list = field(default_factory=list)  # moved tokens that died while the copy flew
    orphaned: bool = False  # its request finished or was preempted while the copy flew
    seq: int = 0  # the step that carries it (its fence)
    gone_fence: int = 0  # its request's list fence when it was orphaned
    list_index: dict = field(default_factory=dict)  # source or fill id -> its list index (-1: held)
    clock: Optional[Callable[[], int]] = field(default=None, repr=False)  # its lifecycle's clock (snapshot events)

    @property
    def reduction(self) -> int:
        return len(self.sources) - len(self.dests)

    @property
    def blocks(self) -> list:
        """Every block the copy touches (busy while it flies): sources, fills, dests."""
        return list(self.sources) + list(self.fills) + list(self.dests)

    def record(self, kind: str, **fields) -> None:
        """Append an event to the plan's snapshot schedule (when a snapshot is recorded)."""
        if self.snapshot is not None and self.clock is not None:
            self.snapshot["schedule"].append({"t": self.clock(), "kind": kind, **fields})


@dataclass
class Outcome:
    """How a plan's copy ended, as the copy side reports it to the block side."""

    status: str  # "applied" | "aborted"
    used_dests: list = field(default_factory=list)  # fresh destinations that received a token (not fills)
    moved: int = 0
    copy_done: bool = True  # the copy out of the sources has completed (or never ran)
    table_kept: bool = False  # aborted with the request still reading its sources and fills
    shared_sources: list = field(default_factory=list)  # sources or fills not the request's alone at the end
    reason: str = ""
    snapshot: Optional[dict] = None  # where the copy side runs apart (the adapter's worker): the plan's snapshot
    # as it completed it (digests, its events, ``post``), for the block side to merge into its own


def all_dead(table, req_id, candidates, *, tail=None, busy=None) -> list[int]:
    """Of ``candidates`` (blocks of ``req_id``, in the order they would be freed), those
    reclamation may release now: no live token left (``n_b == 0``), referenced by ``req_id``
    alone (``refs == 1``: a shared block is never released, I4), not ``tail`` (the block being
    written), not ``busy`` (a bool mask over blocks: a source, fill or destination of a plan in
    flight, I3). The one rule of every path (decode engine, simulator, vLLM adapter); a path
    then keeps only the blocks it holds for the request. Order kept. O(len(candidates))."""
    b = np.asarray(candidates, dtype=np.int64).reshape(-1)
    if not len(b):
        return []
    ok = (table.n_b[b] == 0) & (table.refs[b] == 1)
    if tail is not None:
        ok &= b != int(tail)
    if busy is not None:
        ok &= ~busy[b]
    return b[ok].tolist()


# ====================================================================== completed -> applied (the table)
@dataclass
class Applied:
    """What :func:`apply_completed` did."""

    moves: np.ndarray  # the moves applied (their tokens were still live)
    evicted_in_flight: list  # moved tokens evicted while the copy flew: left dead where they were
    used_dests: list  # fresh destination blocks that received a token, sorted (the rest are unused; fills not listed)
    emptied: list  # the plan's sources, all now unreferenced by the request, sorted


def shared_blocks(table, req_id, blocks) -> list[int]:
    """Of ``blocks``, those not ``req_id``'s alone in the table (another request references
    it, or ``req_id`` no longer does): the rule of a block that may move. O(len(blocks))."""
    return [int(b) for b in blocks if table.block_refs(b) != 1 or not table.references(req_id, b)]


def apply_completed(table, req_id, sources: Sequence[int], moves: np.ndarray, fills: Sequence[int] = ()) -> Applied:
    """Apply a plan whose copy has completed: the table's part of ``completed -> applied``.

    Moves of tokens evicted in flight are dropped (they stay dead at their source), the rest go
    through ``TokenTable.apply_moves``, all-dead sources are released; the caller then frees the
    sources (one reference each) and hands ``used_dests`` to the request. Validated first,
    raising :class:`PlanError` with the table untouched: a source another request references
    (``shared_source``), one that would keep a live token (``not_emptied``), a fill no longer the
    request's alone (``shared_fill``: corruption, the copy already wrote it). O(moves + sources
    + fills).
    """
    m = np.asarray(moves, dtype=np.int64).reshape(-1, 5)
    srcs = sorted(int(b) for b in sources)
    evicted: list = []
    if len(m):
        still = table.are_live(req_id, m[:, 0])
        if not still.all():
            evicted = m[~still, 0].tolist()
            m = m[still]
    moved_from = Counter(m[:, 1].tolist()) if len(m) else Counter()
    for b in srcs:
        if table.block_refs(b) != 1 or not table.references(req_id, b):
            raise PlanError("shared_source", f"request {req_id!r}: source block {b} has {table.block_refs(b)} "
                                             f"referencing request(s); shared blocks never move")
        if table.block_live_count(b) != moved_from.get(b, 0):
            raise PlanError("not_emptied", f"request {req_id!r}: source block {b} holds {table.block_live_count(b)} "
                                           f"live token(s), the plan moves {moved_from.get(b, 0)} out of it")
    for b in fills:
        if table.block_refs(b) != 1 or not table.references(req_id, b):
            raise PlanError("shared_fill", f"request {req_id!r}: fill block {b} has {table.block_refs(b)} referencing "
                                           f"request(s) at apply (the request's: {table.references(req_id, b)}); a "
                                           f"block in flight is never shared or released")
    stray = set(moved_from) - set(srcs)
    if stray:
        raise PlanError("not_emptied", f"request {req_id!r}: moves out of blocks {sorted(stray)}, not sources")
    landed = np.unique(m[:, 3]).tolist() if len(m) else []
    used = [b for b in landed if not table.references(req_id, b)]  # fresh: not a fill (already the request's)
    emptied = table.apply_moves(req_id, m) if len(m) else []
    rest = sorted(set(srcs) - set(emptied))
    if rest:  # all-dead sources: nothing to move, the table just lets go of them
        emptied = sorted(list(emptied) + table.release_empty_blocks(req_id, rest))
    assert emptied == srcs, f"plan emptied {emptied}, sources {srcs}"  # guaranteed by the checks above
    return Applied(m, evicted, used, emptied)


def snapshot_applied(snap: dict, table, req_id, applied: Applied) -> None:
    """Complete a snapshot once its plan applied: the one writer of ``evicted_in_flight``,
    ``dests_used`` and ``post`` (``post`` may be longer than ``pre``: tokens added in flight)."""
    snap["evicted_in_flight"] = [int(t) for t in applied.evicted_in_flight]
    snap["dests_used"] = [int(b) for b in applied.used_dests]
    snap["post"] = {"requests": {str(req_id): request_state(table, req_id, None)}}


# ====================================================================== the block pool
class AllocatorPort:
    """vtoken's ``BlockAllocator`` as the lifecycle's pool. The fence is ignored: on these
    paths a plan ends only after its copy was host-observed complete."""

    def __init__(self, alloc):
        self.alloc = alloc

    def free(self, ids: list, fence: int) -> None:
        """Drop one reference on each block (a block whose count reaches 0 is free)."""
        self.alloc.free(ids)

    def reserve(self, n: int) -> list:
        """Up to ``n`` free blocks reserved for the headroom (fewer when fewer are free)."""
        n = min(int(n), self.alloc.num_free)
        return self.alloc.reserve(n) if n > 0 else []

    def unreserve(self, ids: list) -> None:
        """Headroom blocks back to the free queue, never written."""
        self.alloc.unreserve(ids)

    def adopt(self, ids: list) -> None:
        """Headroom blocks a plan wrote become in use (one reference each)."""
        if ids:
            self.alloc.take_reserved(ids)

    def num_free(self) -> int:
        return self.alloc.num_free


class Held(Mapping):
    """``{request: {block id: None}}`` (insertion order) and the inverse, block -> its holders,
    kept in step by :meth:`add`, :meth:`take` and :meth:`drop_request` only. One entry is one
    reference. ``exclusive``: a block is held by one request at most (the adapter: a held block
    is a destination or fill, never shared).

    It owns its dict (read-only to others through the ``Mapping`` interface) rather than being
    one: a caller's ``held[r] = ...`` or ``held.pop(r)`` would bypass the inverse index."""

    def __init__(self, exclusive: bool = False):
        self.exclusive = bool(exclusive)
        self._by_req: dict = {}  # request -> {block id: None}
        self._owners: dict[int, list] = {}  # block id -> the requests holding it

    def __getitem__(self, r) -> dict:
        return self._by_req[r]

    def __iter__(self):
        return iter(self._by_req)

    def __len__(self) -> int:
        return len(self._by_req)

    def __repr__(self) -> str:
        return f"Held({self._by_req!r})"

    def empty(self) -> bool:
        """Nothing held, by either side of the index (O(1))."""
        return not self._by_req and not self._owners

    def owner(self, block_id: int):
        """The first request holding ``block_id`` (None: nobody)."""
        o = self._owners.get(int(block_id))
        return o[0] if o else None

    def add(self, r, ids) -> None:
        """``r`` holds ``ids`` (one reference each). Refused whole (:class:`PlanError`
        ``ownership``) when ``r`` would hold a block twice, or, exclusive, another request holds it."""
        ids = [int(b) for b in ids]
        mine = self.get(r, {})
        twice = sorted({b for b in ids if b in mine or ids.count(b) > 1 or (self.exclusive and self._owners.get(b))})
        if twice:
            raise PlanError("ownership", f"request {r!r}: blocks {twice} would be held twice")
        if not ids:
            return
        self._by_req.setdefault(r, {}).update(dict.fromkeys(ids))
        for b in ids:
            self._owners.setdefault(b, []).append(r)

    def take(self, r, ids) -> None:
        """``r`` no longer holds ``ids``; refused whole (``ownership``) if it does not hold one."""
        ids = [int(b) for b in ids]
        h = self.get(r, {})
        missing = [b for b in ids if b not in h]
        if missing:
            raise PlanError("ownership", f"request {r!r} does not hold blocks {missing}")
        for b in ids:
            del h[b]
            o = self._owners[b]
            o.remove(r)
            if not o:
                del self._owners[b]
        if not h:
            self._by_req.pop(r, None)

    def drop_request(self, r) -> list[int]:
        """Everything ``r`` holds, forgotten here (the caller releases it)."""
        ids = list(self.get(r, ()))
        self.take(r, ids)
        return ids

    def index_errors(self) -> list:
        """``(block, request)`` pairs on which the inverse index and the held blocks disagree
        (empty unless something wrote to the inner dicts directly)."""
        if self.empty():  # both sides empty: they agree
            return []
        held = Counter((b, r) for r, h in self.items() for b in h)
        index = Counter((b, r) for b, rs in self._owners.items() for r in rs)
        return sorted(set(held.items()) ^ set(index.items()), key=repr)


# ====================================================================== the block side
class Lifecycle:
    """The block side of every plan's life (see the module docstring).

    Args:
        port: the pool, ``free(ids, fence)``, ``reserve(n) -> ids``, ``unreserve(ids)``,
            ``adopt(ids)``, ``num_free()`` (:class:`AllocatorPort`, or the adapter's over vLLM).
        num_blocks: the pool's size (the busy mask).
        stats: where this room counts its events, each once (``plans`` at launch; at its end
            ``applied``, ``aborted`` or ``orphaned``). Default: a dict of its own, which the
            vLLM adapter reads; the decode engine's manager still passes its own ``stats``.
        clock: the logical clock of snapshot events (default a counter from 0).
        exclusive_held: a block is held for one request at most (the adapter).
    """

    def __init__(self, port, num_blocks: int, stats: dict | None = None, clock: Callable | None = None,
                 exclusive_held: bool = False):
        self.port = port
        self.stats = stats if stats is not None else {}
        for k in ("plans",) + OUTCOMES:
            self.stats.setdefault(k, 0)
        self.in_flight: dict[int, Plan] = {}
        self.busy: dict = {}  # request -> ids of its plans in flight (not orphaned)
        self.busy_mask = np.zeros(int(num_blocks), dtype=bool)  # blocks of plans in flight
        self.history: list = []  # ended plans whose snapshot the caller kept
        self.headroom: list[int] = []  # reserved destinations, one reference each
        self.fresh: set = set()  # headroom blocks that entered it since take_fresh()
        self.held = Held(exclusive_held)
        self._ids = itertools.count(1)
        self.clock = clock or itertools.count().__next__

    # ------------------------------------------------------------------ records
    def new_plan(self, req_id, sources, dests, moves, fills=(), seq: int = 0) -> Plan:
        """A planned record with the next id, on this lifecycle's clock (nothing flies yet)."""
        return Plan(next(self._ids), req_id, [int(b) for b in sources], [int(b) for b in dests],
                    np.asarray(moves, dtype=np.int64).reshape(-1, 5), [int(b) for b in fills], seq=int(seq),
                    clock=self.clock)

    def busy_requests(self) -> set:
        """Requests with a plan in flight (I4: at most one plan per request copies at a time)."""
        return set(self.busy)

    def is_busy(self, block_id: int) -> bool:
        return bool(self.busy_mask[int(block_id)])

    # ------------------------------------------------------------------ holdings
    def hold(self, req_id, ids) -> None:
        """``req_id``'s references on ``ids`` are held here from now on."""
        self.held.add(req_id, ids)

    def release_held(self, req_id, ids, fence: int = 0) -> None:
        """``req_id`` lets go of ``ids`` (held for it, else refused: ``ownership``, nothing
        freed): its references go back to the pool at ``fence``. A block a plan in flight also
        uses may go (a sharer's own reference on a plan's source): the plan holds its own."""
        ids = [int(b) for b in ids]
        self.held.take(req_id, ids)
        self._free(ids, fence)

    def finish(self, req_id, fence: int = 0) -> list[int]:
        """``req_id`` finished or was preempted: its plans in flight become orphans (their blocks
        are released when they end, at ``fence`` at the earliest) and every block held for it is
        released now, at ``fence``. Returns the blocks released. O(held + plans of the request)."""
        n_flying = len(self.in_flight)
        for pid in self.busy.pop(req_id, ()):  # its plans not yet orphaned (O(its plans), not O(in flight))
            p = self.in_flight[pid]
            assert p.req_id == req_id and not p.orphaned, f"plan {pid} busy for {req_id!r} but {p.req_id!r}'s"
            p.orphaned = True
            p.gone_fence = int(fence)
        ids = self.held.drop_request(req_id)
        self._free(ids, fence)
        # paired: the request holds nothing here and is busy with nothing; its plans still fly
        assert req_id not in self.busy and req_id not in self.held and len(self.in_flight) == n_flying
        return ids

    def release(self, block_ids, fence: int = 0) -> None:
        """Hand back blocks the caller took out of a request's list (the adapter's all-dead
        blocks), at ``fence``. A block a plan in flight uses is refused (:class:`PlanError`
        ``ownership``, nothing freed): a list never holds one. O(blocks) plus the pool's free."""
        ids = [int(b) for b in block_ids]
        self._refuse_busy(ids, "released")
        self._free(ids, fence)

    def _free(self, ids: list, fence: int, plan: Plan | None = None) -> None:
        """The one call of the pool's free (``plan``: record it in the plan's snapshot). Its
        callers have proved the references theirs: held for a request, or a plan's own at its end."""
        if not ids:
            return
        if plan is not None:
            plan.record("free", blocks=ids)
        self.port.free(ids, fence)

    def _refuse_busy(self, ids: list, what: str) -> None:
        busy = [b for b in ids if self.busy_mask[b]]
        if busy:
            users = sorted(p.id for p in self.in_flight.values() if set(busy) & set(p.blocks))
            raise PlanError("ownership", f"blocks {busy} {what} while plan(s) {users} in flight use them")

    # ------------------------------------------------------------------ the headroom
    def refill(self, target: int) -> int:
        """Top the headroom up to ``target`` blocks from the pool (as far as its free blocks go).
        Returns the blocks added."""
        want = int(target) - len(self.headroom)
        got = self.port.reserve(want) if want > 0 else []
        self._to_headroom(got)
        return len(got)

    def give_back(self, n: int | None = None) -> list[int]:
        """The last ``n`` headroom blocks (all: None) back to the pool, never written."""
        k = len(self.headroom) if n is None else max(0, min(int(n), len(self.headroom)))
        if not k:
            return []
        out = self.headroom[-k:]
        del self.headroom[-k:]
        self.fresh.difference_update(out)
        self.port.unreserve(out)
        return out

    def take_fresh(self) -> list[int]:
        """Headroom blocks that entered it since the last call (for incremental checks)."""
        out = [b for b in self.headroom if b in self.fresh] if self.fresh else []
        self.fresh = set()
        return out

    def _to_headroom(self, ids) -> None:
        ids = [int(b) for b in ids]
        self.headroom += ids
        self.fresh.update(ids)

    # ------------------------------------------------------------------ planned -> copying
    def launch(self, plan: Plan, detach: Callable | None = None) -> None:
        """planned -> copying: the destinations leave the headroom; the sources and fills are
        taken over from the request: those held here from ``held``, the rest through ``detach(req,
        ids) -> list indices`` (the path's own list, which refuses a block it does not list;
        ``plan.list_index`` records where each came from, -1: held). Refused whole
        (:class:`PlanError`: ``bad_state``, ``stale_plan`` for a destination no longer in the
        headroom, ``overlap`` for a block of a plan in flight, ``ownership`` for a block the
        request does not hold), nothing changed."""
        if plan.state != PLANNED or plan.id in self.in_flight:
            raise PlanError("bad_state", f"plan {plan.id} is {plan.state}, cannot launch")
        blocks = plan.blocks
        if len(set(blocks)) != len(blocks):
            raise PlanError("overlap", f"plan {plan.id}: sources {plan.sources}, fills {plan.fills} and "
                                       f"destinations {plan.dests} name a block twice")
        busy = [b for b in blocks if self.busy_mask[b]]
        if busy:
            raise PlanError("overlap", f"plan {plan.id}: blocks {busy} belong to a plan in flight")
        k = len(plan.dests)
        n_head, n_flying = len(self.headroom), len(self.in_flight)
        front = self.headroom[:k] == plan.dests  # the usual case, planned from the front just now: O(dests)
        if not front and not set(plan.dests) <= set(self.headroom):
            raise PlanError("stale_plan", f"plan {plan.id}: destinations {plan.dests} are no longer in the headroom")
        r = plan.req_id
        mine = self.held.get(r, {})
        taken = plan.sources + plan.fills
        from_held = [b for b in taken if b in mine]
        rest = [b for b in taken if b not in mine]
        if rest and detach is None:
            raise PlanError("ownership", f"plan {plan.id}: blocks {rest} are not held for request {r!r}")
        index = detach(r, rest) if rest else []  # the path refuses (nothing changed) a block it does not list
        self.held.take(r, from_held)
        plan.list_index = {**dict.fromkeys(from_held, -1), **dict(zip(rest, index))}
        if front:
            del self.headroom[:k]
        else:
            gone = set(plan.dests)
            self.headroom = [b for b in self.headroom if b not in gone]
        self.fresh.difference_update(plan.dests)
        self.busy_mask[blocks] = True
        plan.state = COPYING
        self.in_flight[plan.id] = plan
        self.busy.setdefault(r, set()).add(plan.id)
        self.stats["plans"] += 1
        # paired with the checks on entry: exactly this plan joined, its blocks busy, its
        # destinations out of the headroom (O(the plan's blocks))
        assert plan.state == COPYING and self.in_flight[plan.id] is plan and len(self.in_flight) == n_flying + 1
        assert len(self.headroom) == n_head - k and self.busy_mask[blocks].all()

    # ------------------------------------------------------------------ copying -> its end
    def end(self, plan: Plan, outcome: Outcome) -> str:
        """The plan ended as the copy side reports (``outcome``); returns the outcome counted
        (``orphaned`` when its request left in flight, whatever the copy did).

        Applied: unused destinations back to the headroom, used ones adopted; fills and used
        destinations held for the request (released at its list fence if it left); sources
        released at the plan's fence; ``plan.dests`` becomes the used ones. Aborted:
        destinations back to the headroom; sources and fills held for the request again if it
        is here and its table still reads them, else released. O(blocks of the plan)."""
        assert self.in_flight.get(plan.id) is plan, f"plan {plan.id} ended but not in flight"
        assert plan.state in (COPYING, COMPLETED) and self.busy_mask[plan.blocks].all(), f"plan {plan.id} is {plan.state}"
        n_flying, was = len(self.in_flight), plan.blocks
        used = [d for d in plan.dests if d in set(outcome.used_dests)] if outcome.status == "applied" else []
        if outcome.status == "applied" and len(used) != len(set(outcome.used_dests)):
            raise PlanError("ownership", f"plan {plan.id}: used destinations {outcome.used_dests} are not among its "
                                         f"destinations {plan.dests}")
        counted = "orphaned" if plan.orphaned else outcome.status
        del self.in_flight[plan.id]
        mine = self.busy.get(plan.req_id)
        if mine is not None and plan.id in mine:
            mine.discard(plan.id)
            if not mine:
                del self.busy[plan.req_id]
        self.busy_mask[plan.blocks] = False
        alive, gone = not plan.orphaned, max(plan.seq, plan.gone_fence)
        r = plan.req_id
        if outcome.status == "applied":
            self._to_headroom([d for d in plan.dests if d not in used])
            self.port.adopt(used)
            keep = plan.fills + used
            if alive:
                self.held.add(r, keep)
            else:
                self._free(keep, gone)
            self._free(plan.sources, plan.seq, plan=plan)
            plan.dests = used
            plan.state = APPLIED
        else:
            self._to_headroom(plan.dests)
            back = plan.sources + plan.fills
            if alive and outcome.table_kept:
                self.held.add(r, back)
            else:
                self._free(back, gone)
            plan.state = ABORTED
        self.stats[counted] += 1
        # paired with the entry: this plan left, ended once, none of its blocks still busy
        assert plan.id not in self.in_flight and len(self.in_flight) == n_flying - 1
        assert plan.state in (APPLIED, ABORTED) and not self.busy_mask[was].any()
        return counted


# ====================================================================== the copy side
class Copies:
    """Plans whose copy was issued, until it is observed done: then applied to the table
    (:func:`apply_completed`) and reported as an :class:`Outcome`.

    Args:
        table: the token table the copies are applied to.
        engine: the copy engine (``launch(plan) -> handle``, ``poll(handle)`` / ``wait(handle)``
            -> ``"pending" | "done" | "failed"``).
        after_apply: ``(plan) -> None``, called with the copy's view of each applied plan (its
            moves the applied ones): the relocation checker's hook, when one is attached.

    A copy's view is a :class:`Plan` with the same id and blocks and the moves of the tokens
    still live at launch; ``plan.moves`` keeps the planned ones (apply drops those whose token
    died since). Owns: the handles of copies in flight, and which requests left meanwhile.
    """

    def __init__(self, table, engine, after_apply: Callable | None = None):
        self.table, self.engine, self.after_apply = table, engine, after_apply
        self.pending: dict[int, list] = {}  # plan id -> [view, handle, plan, its request left]

    def __len__(self) -> int:
        return len(self.pending)

    def launch(self, plan: Plan) -> Optional[Outcome]:
        """Issue the copy. An outcome now, without a copy, when the request is gone from the
        table (aborted) or a source or fill is not its alone (aborted, table kept); else None."""
        t, r = self.table, plan.req_id
        if r not in t:
            return Outcome("aborted", reason="request gone before the copy")
        shared = shared_blocks(t, r, plan.sources + plan.fills)
        if shared:
            return Outcome("aborted", table_kept=True, shared_sources=shared,
                           reason="source or fill shared or not the request's")
        m = np.asarray(plan.moves, dtype=np.int64).reshape(-1, 5)
        if len(m):
            m = m[t.are_live(r, m[:, 0])]  # tokens evicted since planning stay dead where they were
        view = Plan(plan.id, r, list(plan.sources), list(plan.dests), m, fills=list(plan.fills),
                    snapshot=plan.snapshot)
        plan.handle = self.engine.launch(view)
        plan.record("launch", plan=plan.id)
        self.pending[plan.id] = [view, plan.handle, plan, False]
        return None

    def forget(self, req_id) -> None:
        """``req_id`` left (finished, or preempted: a later incarnation is another request): its
        copies in flight end aborted, the table untouched."""
        for entry in self.pending.values():
            if entry[2].req_id == req_id:
                entry[3] = True

    def poll(self, force: bool = False, only=None) -> list[tuple[Plan, Outcome]]:
        """Observe finished copies (``force``: host-wait each; ``only``: these plan ids) and
        apply those that completed for a request still here; returns ``(plan, outcome)`` per
        plan whose copy ended."""
        out = []
        for pid in list(self.pending) if only is None else [p for p in only if p in self.pending]:
            view, handle, plan, left = self.pending[pid]
            status = self.engine.wait(handle) if force else self.engine.poll(handle)
            if status == "pending":
                continue
            del self.pending[pid]
            out.append((plan, self._finished(view, plan, left, status)))
        return out

    def _finished(self, view: Plan, plan: Plan, left: bool, status: str) -> Outcome:
        t, r = self.table, plan.req_id
        if left or r not in t:
            return Outcome("aborted", reason="request left while the copy flew")
        if status == "failed":
            return Outcome("aborted", table_kept=True, reason="copy failed")
        plan.state = COMPLETED
        plan.record("fence", plan=plan.id)  # the copy is observed complete: every later event is after it
        shared = shared_blocks(t, r, plan.sources + plan.fills)
        if shared:  # a block became shared in flight: shared blocks never move (I4), the table is kept
            return Outcome("aborted", table_kept=True, shared_sources=shared,
                           reason="source or fill shared or not the request's at apply")
        try:  # the planned moves: apply_completed drops those whose token died since planning
            res = apply_completed(t, r, plan.sources, plan.moves, fills=plan.fills)
        except PlanError as e:
            if e.code not in ("shared_source", "shared_fill"):
                raise
            # refused with the table untouched: reported as shared, named by the same rule
            return Outcome("aborted", table_kept=True, shared_sources=shared_blocks(t, r, plan.sources + plan.fills),
                           reason=str(e))
        view.moves = res.moves
        plan.evicted_in_flight = res.evicted_in_flight
        plan.record("apply", plan=plan.id)
        if self.after_apply is not None:
            self.after_apply(view)
        if plan.snapshot is not None:
            snapshot_applied(plan.snapshot, t, r, res)
        return Outcome("applied", used_dests=res.used_dests, moved=len(res.moves))
