"""Check anyone's token table (or planner): the protocol, and machines bound to an implementation.

The toolkit's reference model (``vtoken.spec``), machines and invariant checks are not tied
to vtoken's own ``TokenTable``: any class that offers the operations and observations below
can be checked by them (``vtoken fuzz --impl module:Class``, ``pytest -m invariants
--vtoken-impl module:Class``; see ``docs/check-your-kv-manager.md``).

A token table (:class:`TokenTableProtocol`) is built as ``Class(block_size, num_blocks)``
and offers, with the semantics of ``vtoken.spec.SpecTokenTable`` (its docstrings are the
contract, error codes and check order included):

- operations: ``sync_new_tokens(req, block_ids, total_len) -> new slots``,
  ``evict_tokens(req, ids)``, ``apply_moves(req, moves) -> emptied sources``,
  ``release_empty_blocks(req, blocks) -> blocks``, ``free_request(req) -> blocks``;
  optionally ``evict_token(req, id)`` (else ``evict_tokens(req, [id])`` stands in) and the
  batched decode step ``sync_one_each(reqs, blocks) -> slots`` / ``evict_one_each(reqs, ids)``
  (one new token / one victim per request; the machine drives them only where both exist);
- observations: ``export_state()`` (the plain-data state, as the spec's; optionally
  ``export_request(req)`` and ``export_blocks()``, its parts, which make the checks cheaper), ``slot_mapping(req)``
  (a sequence of ints), ``location(req, id) -> (block, offset)``, ``length(req)``,
  ``blocks_of(req)``, ``waste_ratio()``, and the attributes ``S`` and ``num_blocks``;
- errors: an operation that refuses raises an exception carrying a ``code`` (a string from
  ``vtoken.errors.TABLE_CODES``) and changes nothing. Where an implementation's codes or
  exception types differ, a mapping ``ERROR_CODES = {their code or exception class name:
  our code}`` on the class (or passed in) translates them.

A planner (:class:`PlannerProtocol`) offers ``propose(view, max_dests) -> plan | None`` on
the spec planner's *view* and *plan* (``vtoken.spec.planner``'s docstring), checked on the
views a real caller passes (plans in flight, ``excluded`` blocks, dead tokens:
:class:`PlannerContractMachine`); a class attribute
``OPTIMAL = True`` claims the best reduction (then it is checked too), and an attribute
``in_place = True`` (the planner's configuration, as vtoken's ``PlannerConfig.in_place``;
absent: False) says its plans may move tokens into the holes of the request's own blocks
(the plan's ``fills``): the views it is given then say ``"in_place": True``.

:func:`table_machine_for` / :func:`planner_machine_for` return the machines bound to a class;
:class:`Conforming` is the thin wrapper that translates errors and records the operations,
so a failure names the operation that diverged.

Owns: per machine its implementation under test, a SpecTokenTable and the recorded operations.
May call: fuzz.table_machine, fuzz.hard_states, vtoken.spec, vtoken.errors, hypothesis, importlib (``load_impl``).
Costs: per step the spec comparison, O(all tokens); ``best_reduction`` per proposal.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
from typing import Any, Optional, Protocol, runtime_checkable

import hypothesis.strategies as st
import numpy as np
from hypothesis import event, note
from hypothesis.stateful import initialize, precondition, rule

from vtoken.errors import TABLE_CODES, TableError

from .hard_states import hard
from .step_draws import SwarmRules, pick, integer
from .table_machine import some_of

__all__ = ["TokenTableProtocol", "PlannerProtocol", "Conforming", "ProtocolError", "load_impl", "kind_of", "check_impl",
           "table_machine_for", "planner_machine_for"]


@runtime_checkable
class TokenTableProtocol(Protocol):
    S: int
    num_blocks: int

    def sync_new_tokens(self, req_id, block_ids, total_len): ...
    def evict_tokens(self, req_id, token_ids): ...
    def apply_moves(self, req_id, moves): ...
    def release_empty_blocks(self, req_id, block_ids): ...
    def free_request(self, req_id): ...
    def export_state(self) -> dict: ...
    def slot_mapping(self, req_id): ...
    def location(self, req_id, token_id): ...
    def length(self, req_id) -> int: ...
    def blocks_of(self, req_id): ...
    def waste_ratio(self) -> float: ...


@runtime_checkable
class PlannerProtocol(Protocol):
    def propose(self, view: dict, max_dests: int) -> Optional[dict]: ...


class ProtocolError(Exception):
    """The implementation does not offer the protocol, or raised an error with no code."""


_TABLE_OPS = ("sync_new_tokens", "evict_tokens", "apply_moves", "release_empty_blocks", "free_request",
              "export_state", "slot_mapping", "location", "length", "blocks_of", "waste_ratio")


def _one_line(e: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters): an error of the input, said once."""
    msg = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {msg}"[:300] if msg else type(e).__name__


def _import(spec: str, mod: str):
    """The module; ModuleNotFoundError passes (the caller may retry from the working directory),
    any other error of the import is a ProtocolError naming the module and the exception."""
    try:
        return importlib.import_module(mod)
    except ModuleNotFoundError:
        raise
    except ImportError as e:
        raise ProtocolError(f"--impl {spec!r}: cannot import {mod!r} ({e})") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the module's own code raised: the input's error
        raise ProtocolError(f"--impl {spec!r}: importing {mod!r} raised {_one_line(e)}") from None


def load_impl(spec: str):
    """``"package.module:Class"`` -> the class; a :class:`ProtocolError` in one line for
    anything else: not ``module:Class``, a module that cannot be imported or raises while it
    is imported (the exception named, no traceback), no such attribute, or an attribute that
    is not a class (an instance: the machines build a fresh one per example)."""
    if not isinstance(spec, str) or spec.count(":") != 1 or "" in spec.split(":"):
        raise ProtocolError(f"--impl {spec!r}: expected module:Class")
    mod, name = spec.split(":")
    try:
        module = _import(spec, mod)
    except ModuleNotFoundError as e:
        # a module of the project being checked: importable from the directory the command
        # runs in (what `python -m` gives), even when started through a console script
        cwd = os.getcwd()
        if cwd in sys.path or not e.name or not mod.startswith(e.name.split(".")[0]):
            raise ProtocolError(f"--impl {spec!r}: cannot import {mod!r} ({e})") from None
        sys.path.insert(0, cwd)
        try:
            module = _import(spec, mod)
        except ModuleNotFoundError as e2:
            raise ProtocolError(f"--impl {spec!r}: cannot import {mod!r} ({e2})") from None
    cls = getattr(module, name, None)
    if cls is None:
        raise ProtocolError(f"--impl {spec!r}: {mod!r} has no attribute {name!r}")
    if not isinstance(cls, type):
        raise ProtocolError(f"--impl {spec!r}: {name!r} is an object of type {type(cls).__qualname__}, not a class "
                            f"(the machines build a fresh one per example: Class(block_size, num_blocks) for a "
                            f"token table, Class() for a planner)")
    return cls


# The table the up-front check builds: a configuration the table machine draws (S, num_blocks).
CHECK_TABLE_ARGS = (2, 8)


def check_impl(spec: str):
    """``(cls, kind)`` for ``module:Class``, checked before any machine runs: it loads
    (:func:`load_impl`), offers a protocol (:func:`kind_of`), and builds once as the machines
    build it (``Class(*CHECK_TABLE_ARGS)`` wrapped in :class:`Conforming` for a table,
    ``Class()`` for a planner). A failure is a :class:`ProtocolError` in one line naming the
    class and the exception: an error of the input, never a conformance failure. O(one build)."""
    cls = load_impl(spec)
    kind = kind_of(cls)
    args = CHECK_TABLE_ARGS if kind == "table" else ()
    try:
        obj = cls(*args)
        if kind == "table":
            Conforming(obj)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - reported as the input's error
        raise ProtocolError(f"--impl {spec!r}: {cls.__qualname__}{args!r} raised {_one_line(e)} "
                            f"(the {kind} machine builds one per example)") from None
    return cls, kind


def kind_of(cls) -> str:
    """``"table"`` or ``"planner"``: which protocol the class offers (ProtocolError if neither,
    or if ``cls`` is not a class)."""
    if not isinstance(cls, type):
        raise ProtocolError(f"{cls!r:.80} is an object of type {type(cls).__qualname__}, not a class (the machines "
                            f"build a fresh one per example)")
    if all(callable(getattr(cls, op, None)) for op in _TABLE_OPS):
        return "table"
    if callable(getattr(cls, "propose", None)):
        return "planner"
    missing = [op for op in _TABLE_OPS if not callable(getattr(cls, op, None))]
    raise ProtocolError(f"{getattr(cls, '__qualname__', cls)!r} offers neither protocol: a token table lacks "
                        f"{missing}; a planner lacks propose(view, max_dests)")


class Conforming:
    """A user's table as the machines see it: errors translated to codes, operations logged.

    ``codes`` maps the implementation's codes (or exception class names) to
    ``vtoken.errors.TABLE_CODES``; an error with no code and no mapping is a
    :class:`ProtocolError` naming the operation.
    """

    def __init__(self, impl, codes: Optional[dict] = None):
        self._impl = impl
        self._codes = dict(getattr(type(impl), "ERROR_CODES", {}) or {})
        self._codes.update(codes or {})
        self.S = int(impl.S)
        self.num_blocks = int(impl.num_blocks)
        self.ops: list[str] = []  # the operations so far, for a failure's report
        # the optional per-part exports, only where the implementation has them (the machines
        # cut them from export_state() otherwise); not logged, as export_state is not: a failure
        # names the last operation, never the check that found it
        if callable(getattr(impl, "export_request", None)):
            self.export_request = lambda req_id: self._call("export_request", req_id, log=False)
        if callable(getattr(impl, "export_blocks", None)):
            self.export_blocks = lambda: self._call("export_blocks", log=False)
        # the batched decode step, optional as a pair (a table with one of them is driven one
        # request at a time, as one with neither)
        if all(callable(getattr(impl, op, None)) for op in ("sync_one_each", "evict_one_each")):
            self.sync_one_each = lambda reqs, blocks: np.asarray(
                list(self._call("sync_one_each", reqs, blocks)), dtype=np.int64)
            self.evict_one_each = lambda reqs, ids: self._call("evict_one_each", reqs, ids)

    def _code(self, op: str, e: BaseException) -> str:
        raw = getattr(e, "code", None)
        for key in (raw, type(e).__name__, type(e)):
            if key is not None and key in self._codes:
                return self._codes[key]
        if isinstance(raw, str) and raw in TABLE_CODES:
            return raw
        raise ProtocolError(f"{op}: {type(self._impl).__name__} raised {type(e).__name__}({e}) with no code "
                            f"vtoken knows (give it a .code from vtoken.errors.TABLE_CODES, or map it in "
                            f"ERROR_CODES)") from e

    def _call(self, op: str, *args, log: bool = True):
        if log:
            self.ops.append(f"{op}{args!r:.200}")
        try:
            return getattr(self._impl, op)(*args)
        except Exception as e:  # noqa: BLE001 - every refusal is translated (or reported) here
            raise TableError(self._code(op, e), f"{op}{args!r:.200}: {e}") from e

    def sync_new_tokens(self, req_id, block_ids, total_len):
        return np.asarray(list(self._call("sync_new_tokens", req_id, block_ids, total_len)), dtype=np.int64)

    def evict_tokens(self, req_id, token_ids):
        return self._call("evict_tokens", req_id, token_ids)

    def evict_token(self, req_id, token_id):
        if callable(getattr(self._impl, "evict_token", None)):
            return self._call("evict_token", req_id, token_id)
        return self._call("evict_tokens", req_id, [token_id])

    def apply_moves(self, req_id, moves):
        return [int(b) for b in self._call("apply_moves", req_id, moves)]

    def release_empty_blocks(self, req_id, block_ids):
        return [int(b) for b in self._call("release_empty_blocks", req_id, block_ids)]

    def free_request(self, req_id):
        return [int(b) for b in self._call("free_request", req_id)]

    def export_state(self) -> dict:
        return self._impl.export_state()

    def slot_mapping(self, req_id):
        return np.asarray(list(self._call("slot_mapping", req_id)), dtype=np.int64)

    def location(self, req_id, token_id):
        b, o = self._call("location", req_id, token_id)
        return int(b), int(o)

    def length(self, req_id) -> int:
        return int(self._call("length", req_id))

    def blocks_of(self, req_id):
        return sorted(int(b) for b in self._call("blocks_of", req_id))

    def waste_ratio(self) -> float:
        return float(self._impl.waste_ratio())


def table_machine_for(cls, codes: Optional[dict] = None, name: Optional[str] = None):
    """The token-table conformance machine (``fuzz/table_machine.py``) bound to ``cls``.

    Every rule runs on ``cls`` and on the reference model side by side, as it does for
    vtoken's own table; ``cls(block_size, num_blocks)`` builds a fresh table per example.
    """
    from .table_machine import TableMachine

    kind_of(cls)  # a clear ProtocolError now rather than an AttributeError mid-run

    def make_impl(block_size, num_blocks):
        return Conforming(cls(block_size, num_blocks), codes)

    m = type(name or f"TableMachine[{cls.__module__}.{cls.__qualname__}]", (TableMachine,),
             {"make_impl": staticmethod(make_impl), "__module__": __name__})
    m.TestCase.__name__ = f"Test{cls.__qualname__}"
    return m


# ---------------------------------------------------------------------------------- planners
class _Flight:
    """A launched plan the contract machine keeps until its copy ends: the blocks it holds
    (``in_flight`` of every later view) and its moves. ``orphaned``: its request left."""

    def __init__(self, rid, plan):
        self.rid, self.orphaned = rid, False
        self.sources, self.fills, self.dests = list(plan["sources"]), list(plan["fills"]), list(plan["dests"])
        self.moves = [list(mv) for mv in plan["moves"]]

    def blocks(self) -> list:
        return self.sources + self.fills + self.dests


class PlannerContractMachine(SwarmRules):
    """A planner under test proposes plans on the views a real caller passes: requests growing,
    sharing prefixes, evicting (dead tokens, whole dead blocks); plans in flight (their
    sources, fills and destinations in ``in_flight``, a request asked again while its own plan
    copies); blocks the caller forbids (``excluded``: shared in its own pool, or not held for
    the request); an exhausted headroom. Every proposal must obey ``spec.planner``'s rules and
    reduce the block count (with ``OPTIMAL``: by the best reduction).

    The machine plays the caller's lifecycle (as vtoken's ``ReclamationManager``): a valid
    plan is applied at once, launched (in flight until a ``complete`` rule ends it), or
    dropped; a copy may fail (the plan aborts, nothing changes), a source may become shared
    meanwhile (the plan aborts), tokens it moves may die meanwhile (they stay dead where they
    were), and its request may finish (the plan is orphaned; its blocks are freed when the
    copy ends). At most one plan per request copies at a time. Applied plans change the
    reference state, so later proposals see compacted layouts. The hard states a planner is
    driven through are counted (:func:`~vtoken.fuzz.hard_states.hard`) as for vtoken's own."""

    planner_cls: Any = None
    ops = 0

    @initialize(S=st.sampled_from([1, 2, 4]), nb=st.integers(8, 20), B=st.integers(1, 4), headroom=st.integers(0, 3),
                data=st.data())
    def setup(self, S, nb, B, headroom, data):
        from vtoken.spec import SpecTokenTable

        self.S, self.nb, self.B = S, nb, B
        self.spec = SpecTokenTable(S, nb)
        self.free = list(range(1, nb))
        self.headroom = [self.free.pop() for _ in range(min(headroom, len(self.free)))]
        self.pos: dict[int, list] = {}
        self.flights: list[_Flight] = []
        self.rewritten: set = set()  # fills a plan wrote into: no prefix hit lands on them (the caller drops their hash)
        self.next_id = 0
        self.planner = self.planner_cls()
        note(f"S={S} num_blocks={nb} B={B} headroom={self.headroom}")
        # a few requests to start from, so most examples reach fragmentation, plans and copies
        for _ in range(integer(data, 1, 2, "initial_requests")):
            self.add_request(integer(data, 2, 4, "nblocks"), data)
            self.fragment(data, self.next_id - 1)

    # ------------------------------------------------------------------ the caller's state
    def _take(self, n):
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        self.rewritten.difference_update(out)
        return out

    def _flying(self, rid=None) -> list:
        """The plans in flight whose request is still here (``rid``'s; None: every request's)."""
        return [f for f in self.flights if not f.orphaned and (rid is None or f.rid == rid)]

    def _held_by_flights(self) -> set:
        return {b for f in self.flights for b in f.sources + f.fills}

    def _release(self, blocks) -> None:
        """Blocks no request references and no plan in flight holds go back to the pool."""
        held = {b for bl in self.spec.blocks.values() for b in bl} | self._held_by_flights()
        self.free += [b for b in dict.fromkeys(blocks) if b not in held and b not in self.free]

    @precondition(lambda self: len(self.pos) < 3)
    @rule(nblocks=st.integers(1, 4), data=st.data())
    def add_request(self, nblocks, data):
        blocks = self._take(nblocks)
        if blocks is None:
            return
        rid = self.next_id
        self.next_id += 1
        self.pos[rid] = blocks
        total = integer(data, max(1, (nblocks - 1) * self.S + 1), nblocks * self.S, "total_len")
        self.spec.sync_new_tokens(rid, blocks, total)

    @precondition(lambda self: self.pos and len(self.pos) < 3)
    @rule(data=st.data())
    def add_shared_request(self, data):
        """A prefix-cache hit on the parent's leading full blocks (possibly a source a plan is
        copying out of: that plan must abort), then private growth."""
        parent = pick(data, sorted(self.pos), "parent")
        full = len(self.spec.tokens[parent]) // self.S
        k = integer(data, 0, min(full, 2), "shared_blocks")
        prefix = self.pos[parent][:k]
        if 0 in prefix or set(prefix) & (self.rewritten | {b for f in self.flights for b in f.fills + f.dests}):
            return  # a freed position, or a block whose bytes a plan rewrites: no prefix hit
        extra = self._take(integer(data, 1, 2, "private_blocks"))
        if extra is None:
            return
        rid = self.next_id
        self.next_id += 1
        self.pos[rid] = prefix + extra
        self.spec.sync_new_tokens(rid, self.pos[rid], data.draw(
            st.integers(k * self.S + 1, (k + len(extra)) * self.S), label="total_len"))

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def evict(self, data):
        """A policy's eviction: a few tokens, or each with probability 1/2 (whole blocks die),
        never the last live one."""
        rid = pick(data, sorted(self.pos), "rid")
        live = self.spec.live_tokens(rid)
        if len(live) < 2:
            return
        if pick(data, [False, True], "scatter"):
            ids = [t for t in live[:-1] if integer(data, 0, 1, f"dies {t}")]
        else:
            ids = some_of(data, live[:-1], 4, "victims")
        self._evict(rid, ids)

    def _evict(self, rid, ids) -> None:
        """Tokens ``ids`` of ``rid`` die (in the reference state: what the caller's table does)."""
        if not ids:
            return
        if set(ids) & {mv[0] for f in self._flying(rid) for mv in f.moves}:
            hard("token evicted while its copy flies")  # its move is not applied when the copy lands
        self.spec.evict_tokens(rid, ids)

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def fragment(self, data, rid=None):
        """Heavy eviction that leaves a request's full blocks partly live (what H2O does to old
        blocks), sometimes all dead: the layouts plans are made of."""
        rid = pick(data, sorted(self.pos), "rid") if rid is None else rid
        by_block: dict = {}
        for t in self.spec.live_tokens(rid)[:-1]:
            by_block.setdefault(self.spec.tokens[rid][t]["block"], []).append(t)
        ids = []
        for b in sorted(by_block):
            toks = by_block[b]
            keep = pick(data, [max(1, len(toks) // 2), max(1, len(toks) // 2), 1, 0], f"keep in {b}")
            ids += toks[keep:] if pick(data, [True, False], f"from the end of {b}") else toks[:len(toks) - keep]
        self._evict(rid, ids)

    @precondition(lambda self: self._flying_live())
    @rule(data=st.data())
    def evict_moving(self, data):
        """A policy evicts tokens a plan in flight is moving: they stay dead where they are."""
        f = pick(data, self._flying_live(), "plan")
        moving = [mv[0] for mv in f.moves if self.spec.tokens[f.rid][mv[0]]["live"]]
        if len(moving) < len(self.spec.live_tokens(f.rid)):  # never the request's last live token
            self._evict(f.rid, some_of(data, moving, len(moving), "victims"))

    def _flying_live(self) -> list:
        return [f for f in self.flights if not f.orphaned and any(self.spec.tokens[f.rid][mv[0]]["live"]
                                                                  for mv in f.moves)]

    @precondition(lambda self: self.pos)
    @rule(data=st.data(), limit=st.booleans(), then=st.sampled_from(["launch", "launch", "launch", "apply", "drop"]))
    def propose(self, data, limit, then):
        """Ask the planner for a plan of one request (mostly one with its own plan in flight,
        when there is one) on the view a caller builds; check it; then launch, apply or drop it."""
        from vtoken.spec.planner import best_reduction

        rid = self._pick(data)
        view = self._view(data, rid)
        max_dests = integer(data, 0, len(self.headroom), "max_dests") if limit else len(self.headroom)
        self._count_hard(rid, view)
        PlannerContractMachine.ops += 1
        plan = self.planner.propose(copy.deepcopy(view), max_dests)  # a planner that edits its view changes nothing here
        best = best_reduction(view, max_dests)
        optimal = getattr(self.planner_cls, "OPTIMAL", False)
        if plan is None:
            if optimal:
                assert best == 0, f"propose: returned no plan, but a valid plan reduces by {best}: view={view}"
            return
        plan = self._checked(view, plan, max_dests, best, optimal)
        if then == "drop" or self._flying(rid):  # one plan per request copies at a time
            return
        f = _Flight(rid, plan)
        used = {m[3] for m in f.moves} - set(f.fills)
        self.headroom = [b for b in self.headroom if b not in used]
        f.dests = [b for b in f.dests if b in used]
        self.flights.append(f)
        self.rewritten.update(f.fills)
        if then == "apply":  # a copy that completed at once (a synchronous engine)
            self._end(f, failed=False)

    def _pick(self, data):
        """A request to plan for: one whose plan copies (half the time where there is one), one a
        plan could shrink, or any, so the states that catch planners are reached often."""
        busy = sorted({f.rid for f in self._flying()})
        kinds = [busy, busy, [r for r in sorted(self.pos) if self._reducible(r)], sorted(self.pos)]
        return pick(data, pick(data, [v for v in kinds if v], "which requests"), "rid")

    def _reducible(self, rid) -> bool:
        """A heuristic of where to look (never a check): the request's own unshared blocks but
        the tail, not in flight, hold their live tokens in fewer blocks than they are."""
        n = len(self.spec.tokens[rid])
        tail = self.pos[rid][(n - 1) // self.S] if n else None
        flying = {b for f in self.flights for b in f.blocks()}
        own = [b for b in self.spec.blocks[rid] if self.spec.refs(b) == 1 and b != tail and b not in flying]
        live = sum(1 for t in self.spec.tokens[rid] if t["live"] and t["block"] in own)
        return len(own) > -(-live // self.S)

    def _view(self, data, rid) -> dict:
        """The view of ``rid`` a caller passes: its tokens (dead ones too), blocks and their
        references, its tail, every block a plan in flight holds, the headroom, and half the time
        ``excluded``: some blocks a plan could otherwise take."""
        from vtoken.spec.planner import eligible_sources

        toks = self.spec.tokens[rid]
        blocks = sorted(self.spec.blocks[rid])
        n = len(toks)
        view = {"S": self.S, "num_blocks": self.nb, "max_sources": self.B,
                "tokens": [[t["block"], t["offset"], t["live"]] for t in toks], "blocks": blocks,
                "refs": {b: self.spec.refs(b) for b in blocks},
                "tail": self.pos[rid][(n - 1) // self.S] if n else None,
                "in_flight": sorted({b for f in self.flights for b in f.blocks()}),
                "headroom": list(self.headroom), "in_place": bool(getattr(self.planner, "in_place", False))}
        could = eligible_sources(view)
        if could and pick(data, [False, True], "excluded"):
            view["excluded"] = sorted(some_of(data, could, len(could), "excluded"))
        return view

    def _count_hard(self, rid, view) -> None:
        """The hard states this proposal is asked in (see fuzz.hard_states)."""
        from vtoken.spec.planner import eligible_sources

        if not view["headroom"]:
            hard("headroom exhausted")
        if self._flying(rid):
            hard("plan overlapping an in-flight one")
        own = {b for b in view["blocks"] if view["refs"][b] == 1 and b != view["tail"]}
        if own & set(view["in_flight"]):
            hard("in-flight block a plan could take")
        if own & set(view.get("excluded", ())) - set(view["in_flight"]):
            hard("excluded block a plan could take")
        cand = set(eligible_sources(view))
        if any(not live and b in cand for b, _, live in view["tokens"]):
            hard("dead token in a candidate block")

    def _checked(self, view, plan, max_dests, best, optimal) -> dict:
        """The proposal as plain data, held to the contract (AssertionError naming the rule)."""
        from vtoken.spec.planner import plan_errors

        plan = {"sources": list(plan["sources"]), "fills": list(plan.get("fills", [])), "dests": list(plan["dests"]),
                "moves": [list(m) for m in plan["moves"]]}
        errs = plan_errors(view, plan)
        assert not errs, f"propose: the plan breaks the contract: {errs}\n plan={plan}\n view={view}"
        assert len(plan["dests"]) <= max_dests, f"propose: {len(plan['dests'])} destinations, max_dests={max_dests}"
        if optimal:
            red = len(plan["sources"]) - len(plan["dests"])
            assert red == best, f"propose: the plan reduces by {red}, the best valid plan by {best}: view={view}"
        return plan

    # ------------------------------------------------------------------ the lifecycle of a plan in flight
    def _end(self, f: _Flight, failed: bool) -> None:
        """Plan ``f``'s copy ended: applied to the reference state (the moves of tokens still
        live), or aborted (``failed``, or a source became shared: nothing changes), or, its
        request gone, its sources and fills freed. Unused destinations go back to the headroom."""
        self.flights.remove(f)
        if f.orphaned or failed or any(self.spec.refs(b) > 1 for b in f.sources):
            if not f.orphaned and not failed:
                event("plan aborted: a source became shared while it copied")
            self.headroom += f.dests
            if f.orphaned:
                self._release(f.sources + f.fills)
            return
        live = set(self.spec.live_tokens(f.rid))
        moves = [mv for mv in f.moves if mv[0] in live]  # tokens evicted during the copy stay dead
        emptied = self.spec.apply_moves(f.rid, moves)
        self.spec.release_empty_blocks(f.rid, sorted(set(f.sources) - set(emptied)))
        into = {mv[3] for mv in moves}
        self.headroom += [b for b in f.dests if b not in into]
        self._release(f.sources)
        self.pos[f.rid] = [0 if b in f.sources else b for b in self.pos[f.rid]]
        event("plan applied")

    @precondition(lambda self: self.flights)
    @rule(data=st.data())
    def complete(self, data):
        """The caller polls: a copy ends, or is still running (half the time, so plans stay in
        flight across several steps); an ended plan applies (or aborts, a source shared
        meanwhile; or frees its blocks, orphaned)."""
        f = pick(data, self.flights, "plan")
        if pick(data, [True, False], "copy done"):
            self._end(f, failed=False)

    @precondition(lambda self: self._flying())
    @rule(data=st.data())
    def fail_copy(self, data):
        """A copy fails part-way: its plan aborts and the reference state is as before."""
        hard("copy failing part-way")
        self._end(pick(data, self._flying(), "plan"), failed=True)

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def finish(self, data):
        """A request finishes (or is preempted), maybe while its plan copies: the plan is
        orphaned, its sources and fills freed only when the copy ends."""
        busy = sorted({f.rid for f in self._flying()})
        rid = pick(data, busy if busy and pick(data, [True, False], "busy one") else sorted(self.pos), "rid")
        for f in self._flying(rid):
            hard("finish while a copy is in flight")
            f.orphaned = True
        self._release(self.spec.free_request(rid))
        del self.pos[rid]

    @rule()
    def refill_headroom(self):
        while len(self.headroom) < 3 and self.free:
            self.headroom.append(self.free.pop())


def planner_machine_for(cls, name: Optional[str] = None):
    """The planner contract machine bound to ``cls`` (built with no arguments per example)."""
    if kind_of(cls) != "planner":
        raise ProtocolError(f"{cls.__qualname__} is not a planner (no propose(view, max_dests))")
    m = type(name or f"PlannerContractMachine[{cls.__module__}.{cls.__qualname__}]", (PlannerContractMachine,),
             {"planner_cls": cls, "__module__": __name__})
    m.TestCase.__name__ = f"Test{cls.__qualname__}"
    return m
