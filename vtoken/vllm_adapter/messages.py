"""What the scheduler side and the worker tell each other, step by step, as plain data.

vLLM's engine runs its scheduler and its workers in different processes: the
``SchedulerOutput`` is pickled to the workers and the ``ModelRunnerOutput`` back. So
everything here is built of ids, ints, lists, dicts and numpy arrays, never a live object of
either side, and the in-process paths (the harness driver, vLLM's one-process engine) send
the same records (the driver round-trips them through pickle).

- :class:`StepMeta` on ``sched_out.vtoken``: the step's plans (:func:`plan_order`, to copy
  after this step's forward), its releases (blocks whose tokens all died), and ``drain``
  (nothing is scheduled and plans fly: host-wait every copy now).
- :class:`WorkerReport` on ``ModelRunnerOutput.vtoken_report``: how each finished plan ended
  (``vtoken.lifecycle.Outcome``), each request's full-context length, the worker's counters,
  and ``ops``: every change the worker made to its token table this step, in order, each
  eviction with the worker's word on whether it emptied a block, and last the table's totals.
  The scheduler side keeps a replica of the worker's table and replays ``ops`` on it
  (:func:`replay`), so both tables run the same operations in the same order; the replay
  checks each word and the totals on the replica.
- :class:`Replica`: that replica, which may hold back up to ``MAX_LAG`` reports of decode
  growth, and of evictions that emptied no block, and replay them together, when its owner
  allows it (the adapter's rule: ``VTokenAdapter._replay``).

Owns: the records, :class:`LoggedTable` (a ``TokenTable`` that logs its own changes),
:func:`replay` and the :class:`Replica` (the scheduler side's table and its held-back reports).
May call: vtoken.table, numpy.
Costs: building a record is O(what it carries); a logged change costs O(its arguments) more
than the change itself (a token sync logs only the block-list entries it read).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import OrderError
from ..table import TokenTable

__all__ = ["plan_order", "StepMeta", "WorkerReport", "LoggedTable", "replay", "Replica", "MAX_LAG"]

# The most reports of decode growth (and evictions that emptied no block) the replica may hold
# back (``Replica``): replayed together, the cold-cache price of the replay's array code is paid
# once per batch instead of once per step (docs/ARCHITECTURE.md, "What the adapter's step costs").
MAX_LAG = 8


def plan_order(plan, snapshot: dict | None = None, keep=()) -> dict:
    """One plan as the worker receives it: the lifecycle's ``Plan`` reduced to plain data
    (``id``, ``req_id``, ``sources``, ``dests``, ``fills``, ``moves``: int64 ``(k, 5)``: token,
    src_block, src_offset, dst_block, dst_offset; ``seq``). ``snapshot``: a copy of the plan's
    snapshot for the worker to complete (digests, its events, ``post``) and send back in the
    outcome; None when none is recorded. ``keep``: sources whose prefix-cache hash comes back
    when the plan ends (their bytes must stay as they are after the copy)."""
    return {"id": int(plan.id), "req_id": plan.req_id, "sources": [int(b) for b in plan.sources],
            "dests": [int(b) for b in plan.dests], "fills": [int(b) for b in plan.fills],
            "moves": np.array(plan.moves, dtype=np.int64).reshape(-1, 5), "seq": int(plan.seq), "snapshot": snapshot,
            "keep": [int(b) for b in keep]}


@dataclass
class StepMeta:
    """What the adapter attaches to a ``SchedulerOutput`` (``sched_out.vtoken``)."""

    seq: int  # the fence clock's seq of this step (fence.StepClock; 0: an empty step, nothing attached)
    plans: list = field(default_factory=list)  # plan_order dicts, to copy after this step's forward
    releases: dict = field(default_factory=dict)  # req_id -> [block ids] released (all tokens dead)
    reclaim: bool = True
    drain: bool = False  # nothing scheduled, plans in flight: the worker host-waits every copy


@dataclass
class WorkerReport:
    plans: dict = field(default_factory=dict)  # plan id -> vtoken.lifecycle.Outcome (plans finished now)
    faithful: dict = field(default_factory=dict)  # req -> leading tokens computed with full context
    ops: list = field(default_factory=list)  # the worker's table changes, in order (replay)
    stats: dict = field(default_factory=dict)  # the worker's counters so far (steps, relocations, hash checks, ...)


class LoggedTable(TokenTable):
    """The worker's token table: a ``TokenTable`` that appends each change it made to
    ``ops`` (only changes that succeeded: a refused call changes nothing and logs nothing).
    ``take_ops()`` hands the log over and starts a new one, ending it with the table's totals
    then. The entries are plain tuples: ``("sync", req, total_len, j0, [block ids j0..])``,
    ``("evict", req, ids, emptied)``, ``("sync1", [req], blocks)`` and ``("evict1", [req],
    tokens, emptied)`` (a decode step's one token each; int64 arrays; ``emptied``: the eviction
    left a block of this table without a live token, ``TokenTable.emptied_count``), ``("apply",
    req, moves)``, ``("release", req, ids)``, ``("free", req)``, and last ``("totals",
    live slots, referenced blocks)``. The replay checks each ``emptied`` and the totals on the
    replica's own (:func:`replay`)."""

    def __init__(self, block_size: int, num_blocks: int, device="cpu"):
        super().__init__(block_size, num_blocks, device=device)
        self.ops: list = []

    def take_ops(self) -> list:
        """The changes since the last call, then ``("totals", ...)`` (none when nothing changed)."""
        out, self.ops = self.ops, []
        if out:
            out.append(("totals", self.num_live_slots, self.num_ref_blocks))
        return out

    def sync_new_tokens(self, req_id, block_ids, total_len):
        new = req_id not in self
        n = 0 if new else self.length(req_id)
        slots = super().sync_new_tokens(req_id, block_ids, total_len)
        total = int(total_len)
        if total > n:  # the entries read: those receiving new tokens
            j0, j1 = n // self.S, (total - 1) // self.S + 1
            self.ops.append(("sync", req_id, total, j0, [int(b) for b in list(block_ids[j0:j1])]))
        elif new:  # an empty entry made
            self.ops.append(("sync", req_id, 0, 0, []))
        return slots

    def sync_one_each(self, req_ids, block_ids):
        slots = super().sync_one_each(req_ids, block_ids)
        # int64 arrays: the replica converts them in O(1) checks, not one per element
        self.ops.append(("sync1", list(req_ids), np.array(block_ids, dtype=np.int64)))
        return slots

    def evict_one_each(self, req_ids, token_ids):
        c = self.emptied_count
        super().evict_one_each(req_ids, token_ids)
        self.ops.append(("evict1", list(req_ids), np.array(token_ids, dtype=np.int64), self.emptied_count != c))

    def evict_token(self, req_id, token_id):
        self.evict_tokens(req_id, [token_id])

    def evict_tokens(self, req_id, token_ids):
        c = self.emptied_count
        super().evict_tokens(req_id, token_ids)
        # a list of Python ints: one evicted token (the decode step) replays on the table's scalar path
        self.ops.append(("evict", req_id, np.asarray(token_ids, dtype=np.int64).reshape(-1).tolist(),
                         self.emptied_count != c))

    def apply_moves(self, req_id, moves):
        emptied = super().apply_moves(req_id, moves)
        self.ops.append(("apply", req_id, np.array(moves, dtype=np.int64).reshape(-1, 5)))
        return emptied

    def release_empty_blocks(self, req_id, block_ids):
        out = super().release_empty_blocks(req_id, block_ids)
        self.ops.append(("release", req_id, [int(b) for b in out]))
        return out

    def free_request(self, req_id):
        out = super().free_request(req_id)
        self.ops.append(("free", req_id))
        return out


class _Segment(list):
    """A block list of which only entries ``[j0, j0 + len(seg))`` are known: what a logged
    sync read (``TokenTable.sync_new_tokens`` reads no other entry), so a replayed sync costs
    O(new tokens), not O(the request's blocks). A list to the table; its own items unused."""

    def __init__(self, j0: int, seg: list):
        super().__init__()
        self.j0, self.seg = j0, seg

    def __len__(self) -> int:
        return self.j0 + len(self.seg)

    def __getitem__(self, i):
        if isinstance(i, slice):
            lo, hi, _ = i.indices(len(self))
            return self.seg[max(lo - self.j0, 0):max(hi - self.j0, 0)]
        return self.seg[i - self.j0]


def _check_emptied(table: TokenTable, before: int, op: tuple) -> None:
    """An eviction replayed: did it empty a block on the replica exactly when the worker said it
    did on its table (``op``'s last field; an op without one says nothing)? A report is held back
    on the worker's word that it emptied none (:class:`Replica`): a false word would hold a
    release back, so it ends the run here."""
    if len(op) > 3 and (table.emptied_count != before) != bool(op[3]):
        raise OrderError("state_mismatch", f"replay: the worker says its eviction {op[:2]!r} "
                                           f"{'emptied a block' if op[3] else 'emptied no block'}; on the replica it "
                                           f"{'did not' if op[3] else 'did'} (the tables diverged)")


def replay(table: TokenTable, ops: list) -> None:
    """Run the worker's logged changes on ``table`` (the scheduler side's replica), in order,
    then flush its read-side mirror (so what it queues stays bounded by one step's changes).
    A change the replica refuses raises the table's own error: the two tables had diverged.
    Each eviction's ``emptied`` and each ``totals`` entry are checked against the replica's own
    (``OrderError`` ``state_mismatch`` if they differ). Consecutive moves of distinct requests
    (the plans a report ends, one request each) replay in one ``apply_moves_each``: one
    validation and one application for all of them; consecutive decode growth of the same
    requests (held-back reports) in one ``sync_steps_each``; consecutive prompt chunks of
    distinct requests (a prefill step's) in one ``sync_new_tokens_each``; consecutive frees
    (the requests a step finished) in one ``free_requests``."""
    i, n = 0, len(ops)
    while i < n:
        op = ops[i]
        kind, r = op[0], op[1]
        i += 1
        if kind == "apply":
            items, seen = [(r, op[2])], {r}
            while i < n and ops[i][0] == "apply" and ops[i][1] not in seen:
                items.append((ops[i][1], ops[i][2]))
                seen.add(ops[i][1])
                i += 1
            table.apply_moves_each(items)
            continue
        if kind == "sync":  # a chunk of a prompt; a prefill step's chunks of distinct requests in one call
            items, seen = [(r, _Segment(op[3], op[4]) if op[3] else op[4], op[2])], {r}
            while i < n and ops[i][0] == "sync" and ops[i][1] not in seen:
                _, r2, total, j0, seg = ops[i]
                items.append((r2, _Segment(j0, seg) if j0 else seg, total))
                seen.add(r2)
                i += 1
            if len(items) == 1 or table.sync_new_tokens_each(items) is None:  # None: not one batch
                for item in items:
                    table.sync_new_tokens(*item)
        elif kind == "evict" or kind == "evict1":  # a request's evictions; a decode step's one-token ones
            c = table.emptied_count
            (table.evict_tokens if kind == "evict" else table.evict_one_each)(r, op[2])
            _check_emptied(table, c, op)
        elif kind == "sync1":  # a decode step's growth, one token each; the held-back steps of
            steps = [op[2]]  # the same requests (consecutive reports) in one call
            while i < n and ops[i][0] == "sync1" and ops[i][1] == r:
                steps.append(ops[i][2])
                i += 1
            if len(steps) == 1 or table.sync_steps_each(r, steps) is None:  # None: not one batch
                for x in steps:
                    table.sync_one_each(r, x)
        elif kind == "release":
            table.release_empty_blocks(r, op[2])
        elif kind == "totals":  # the worker's table's totals after the report before it
            if (table.num_live_slots, table.num_ref_blocks) != (op[1], op[2]):
                raise OrderError("state_mismatch", f"replay: the worker's table has {op[1]} live slots in {op[2]} "
                                                   f"blocks, the replica {table.num_live_slots} in "
                                                   f"{table.num_ref_blocks} (the tables diverged)")
        elif kind == "free":  # the requests a step finished, in one call
            ids = [r]
            while i < n and ops[i][0] == "free":
                ids.append(ops[i][1])
                i += 1
            if len(ids) == 1 or table.free_requests(ids) is None:  # None: not one batch
                for x in ids:
                    table.free_request(x)
        else:
            raise OrderError("state_mismatch", f"replay: unknown table op {kind!r} (the worker and the scheduler "
                                               f"side run different vtoken versions?)")
    table.flush()


class Replica:
    """The scheduler side's replica of the worker's token table (``table``, owned here), fed
    each report's ``ops`` in order.

    ``feed(ops, hold=True, evictions=False)``: a report of pure decode growth (every op
    ``sync1``: each running request's next token, in a block its list holds) may be held back
    instead of replayed, at most ``max_lag`` of them; with ``evictions`` a report may hold
    evictions too (``evict1`` / ``evict``), each of which, the worker says, left no block
    without a live token. Any other report (a move, a release, a new or freed request, an
    eviction that emptied a block), a full batch, or ``catch_up()`` replays what is held
    first, in the order the worker made the changes. So the table is behind the worker's by
    growth and by evictions that empty no block, never by a change of which blocks hold live
    tokens elsewhere: the blocks it references stay a subset of what the scheduler side holds
    for each request (the checks' ``table_in_step`` holds on it), its all-dead blocks are the
    worker's but for a tail the growth would move on from, and what a reader that decides (a
    plan) needs is replayed before it reads (its owner calls ``catch_up``). ``totals``: the
    worker's ``(live slots, referenced blocks)`` after the last report fed, held or not, for a
    decision that needs only those (the plan gate). A change the table refuses raises its
    ``TableError``, a false word or total ``OrderError`` ``state_mismatch``, at the replay that
    runs it (up to ``max_lag`` steps after the worker made it); the held reports are dropped
    then (the tables diverged: the run is over). ``max_lag`` 0: every report is replayed at once.

    ``evicted``: the requests holding a dead token, read off the table (``dead_counts``; its
    O(1) total ``num_dead_tokens`` is what a per-step rule asks): while there is none no block
    holds a hole but a tail, so no plan and no release can exist (one of the adapter's rules,
    ``VTokenAdapter._replay``).
    Costs: a held report O(1); a replay O(its ops) (``replay``)."""

    def __init__(self, table: TokenTable, max_lag: int = MAX_LAG):
        self.table = table
        self.max_lag = int(max_lag)
        self.held: list = []  # the ops lists held back, oldest first (each without its totals)
        self.held_max = 0  # the most reports held back at once (tests)
        self.held_evictions = 0  # reports held back with an eviction in them (tests, benches)
        self.totals: tuple | None = None  # the worker's (live slots, referenced blocks) at its last report

    def feed(self, ops: list, hold: bool = True, evictions: bool = False) -> None:
        """Replay ``ops`` (one report's), or hold them back (see the class docstring)."""
        if ops and ops[-1][0] == "totals":
            self.totals = ops[-1][1:]
        if hold and ops and len(self.held) < self.max_lag and all(map(_holdable_with if evictions else _holdable, ops)):
            self.held.append(ops[:-1] if ops[-1][0] == "totals" else ops)  # replayed with the next report's totals
            self.held_max = max(self.held_max, len(self.held))
            self.held_evictions += evictions and any(op[0] != "sync1" for op in self.held[-1])
            return
        replay(self.table, self._take_held() + ops)  # one replay, one flush

    @property
    def evicted(self) -> set:
        """The requests holding a dead token (the table's; O(requests): not for a per-step rule)."""
        t = self.table
        reqs = t.requests()
        return {r for r, d in zip(reqs, t.dead_counts(reqs).tolist()) if d} if reqs else set()

    def catch_up(self) -> None:
        """Replay every held report, oldest first, then check the worker's totals at the last
        (nothing held: nothing done)."""
        if self.held:
            ops = self._take_held()
            if self.totals is not None:
                ops.append(("totals",) + tuple(self.totals))
            replay(self.table, ops)

    def _take_held(self) -> list:
        """The held reports' ops, oldest first, as one list; nothing is held after."""
        held, self.held = self.held, []
        return [op for ops in held for op in ops]


def _holdable(op: tuple) -> bool:
    """May a report with ``op`` be held back (growth only)? ``totals`` ends every report."""
    return op[0] == "sync1" or op[0] == "totals"


def _holdable_with(op: tuple) -> bool:
    """:func:`_holdable`, or an eviction that emptied no block on the worker's table."""
    return _holdable(op) or (op[0] in ("evict1", "evict") and len(op) > 3 and not op[3])
