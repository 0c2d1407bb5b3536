"""Check anyone's token table (or planner): the protocol, and machines bound to an implementation.

The toolkit's reference model (``vtoken.spec``), machines and invariant checks are not tied
to vtoken's own ``TokenTable``: any class that offers the operations and observations below
can be checked by them (``vtoken fuzz --impl module:Class``, ``pytest -m invariants
--vtoken-impl module:Class``; see ``docs/CHECK_YOUR_KV_MANAGER.md``).

A token table (:class:`TokenTableProtocol`) is built as ``Class(block_size, num_blocks)``
and offers, with the semantics of ``vtoken.spec.SpecTokenTable`` (its docstrings are the
contract, error codes and check order included):

- operations: ``sync_new_tokens(req, block_ids, total_len) -> new slots``,
  ``evict_tokens(req, ids)``, ``apply_moves(req, moves) -> emptied sources``,
  ``release_empty_blocks(req, blocks) -> blocks``, ``free_request(req) -> blocks``;
  optionally ``evict_token(req, id)`` (else ``evict_tokens(req, [id])`` stands in);
- observations: ``export_state()`` (the plain-data state, as the spec's; optionally
  ``export_request(req)`` and ``export_blocks()``, its parts, which make the checks cheaper), ``slot_mapping(req)``
  (a sequence of ints), ``location(req, id) -> (block, offset)``, ``length(req)``,
  ``blocks_of(req)``, ``waste_ratio()``, and the attributes ``S`` and ``num_blocks``;
- errors: an operation that refuses raises an exception carrying a ``code`` (a string from
  ``vtoken.errors.TABLE_CODES``) and changes nothing. Where an implementation's codes or
  exception types differ, a mapping ``ERROR_CODES = {their code or exception class name:
  our code}`` on the class (or passed in) translates them.

A planner (:class:`PlannerProtocol`) offers ``propose(view, max_dests) -> plan | None`` on
the spec planner's *view* and *plan* (``vtoken.spec.planner``'s docstring); a class attribute
``OPTIMAL = True`` claims the best reduction (then it is checked too), and an attribute
``in_place = True`` (the planner's configuration, as vtoken's ``PlannerConfig.in_place``;
absent: False) says its plans may move tokens into the holes of the request's own blocks
(the plan's ``fills``): the views it is given then say ``"in_place": True``.

:func:`table_machine_for` / :func:`planner_machine_for` return the machines bound to a class;
:class:`Conforming` is the thin wrapper that translates errors and records the operations,
so a failure names the operation that diverged.

Owns: per machine its implementation under test, a SpecTokenTable and the recorded operations.
May call: fuzz.table_machine, vtoken.spec, vtoken.errors, hypothesis, importlib (``load_impl``).
Costs: per step the spec comparison, O(all tokens); ``best_reduction`` per proposal.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Optional, Protocol, runtime_checkable

import hypothesis.strategies as st
import numpy as np
from hypothesis import event, note
from hypothesis.stateful import initialize, precondition, rule

from vtoken.errors import TABLE_CODES, TableError

from .step_draws import SwarmRules, pick, integer

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
class PlannerContractMachine(SwarmRules):
    """A planner under test proposes plans on states the reference table reaches (requests
    growing, sharing prefixes, evicting); every proposal must obey ``spec.planner``'s rules
    and reduce the block count (with ``OPTIMAL``: by the best reduction). Valid plans are
    applied to the reference state, so later proposals see compacted layouts."""

    planner_cls: Any = None
    ops = 0

    @initialize(S=st.sampled_from([1, 2, 4]), nb=st.integers(8, 20), B=st.integers(1, 4), headroom=st.integers(0, 3))
    def setup(self, S, nb, B, headroom):
        from vtoken.spec import SpecTokenTable

        self.S, self.nb, self.B = S, nb, B
        self.spec = SpecTokenTable(S, nb)
        self.free = list(range(1, nb))
        self.headroom = [self.free.pop() for _ in range(min(headroom, len(self.free)))]
        self.pos: dict[int, list] = {}
        self.next_id = 0
        self.planner = self.planner_cls()
        note(f"S={S} num_blocks={nb} B={B} headroom={self.headroom}")

    def _take(self, n):
        if n > len(self.free):
            return None
        out, self.free = self.free[:n], self.free[n:]
        return out

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
        parent = pick(data, sorted(self.pos), "parent")
        full = len(self.spec.tokens[parent]) // self.S
        k = integer(data, 0, min(full, 2), "shared_blocks")
        prefix = self.pos[parent][:k]
        if 0 in prefix:
            return
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
        rid = pick(data, sorted(self.pos), "rid")
        live = self.spec.live_tokens(rid)
        if len(live) < 2:
            return
        ids = data.draw(st.lists(st.sampled_from(live[:-1]), unique=True, min_size=1, max_size=len(live) - 1),
                        label="victims")
        self.spec.evict_tokens(rid, ids)

    @precondition(lambda self: self.pos)
    @rule(data=st.data(), limit=st.booleans())
    def propose(self, data, limit):
        from vtoken.spec.planner import best_reduction, plan_errors

        rid = pick(data, sorted(self.pos), "rid")
        toks = self.spec.tokens[rid]
        blocks = sorted(self.spec.blocks[rid])
        n = len(toks)
        view = {"S": self.S, "num_blocks": self.nb, "max_sources": self.B,
                "tokens": [[t["block"], t["offset"], t["live"]] for t in toks], "blocks": blocks,
                "refs": {b: self.spec.refs(b) for b in blocks},
                "tail": self.pos[rid][(n - 1) // self.S] if n else None, "in_flight": [],
                "headroom": list(self.headroom), "in_place": bool(getattr(self.planner, "in_place", False))}
        max_dests = integer(data, 0, len(self.headroom), "max_dests") if limit else len(self.headroom)
        PlannerContractMachine.ops += 1
        plan = self.planner.propose(view, max_dests)
        best = best_reduction(view, max_dests)
        if plan is None:
            if getattr(self.planner_cls, "OPTIMAL", False):
                assert best == 0, f"propose: returned no plan, but a valid plan reduces by {best}: view={view}"
            return
        plan = {"sources": list(plan["sources"]), "fills": list(plan.get("fills", [])), "dests": list(plan["dests"]),
                "moves": [list(m) for m in plan["moves"]]}
        errs = plan_errors(view, plan)
        assert not errs, f"propose: the plan breaks the contract: {errs}\n plan={plan}\n view={view}"
        assert len(plan["dests"]) <= max_dests, f"propose: {len(plan['dests'])} destinations, max_dests={max_dests}"
        if getattr(self.planner_cls, "OPTIMAL", False):
            red = len(plan["sources"]) - len(plan["dests"])
            assert red == best, f"propose: the plan reduces by {red}, the best valid plan by {best}: view={view}"
        # apply it to the reference state: what a copy engine and the table would do
        emptied = self.spec.apply_moves(rid, plan["moves"])
        rest = sorted(set(plan["sources"]) - set(emptied))
        self.spec.release_empty_blocks(rid, rest)
        used = {m[3] for m in plan["moves"]} - set(plan["fills"])  # fills are the request's own already
        self.headroom = [b for b in self.headroom if b not in used]
        self.free += plan["sources"]
        self.pos[rid] = [0 if b in plan["sources"] else b for b in self.pos[rid]]
        event("plan applied")

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def finish(self, data):
        rid = pick(data, sorted(self.pos), "rid")
        blocks = self.spec.free_request(rid)
        others = {b for r, bl in self.spec.blocks.items() for b in bl}
        self.free += [b for b in blocks if b not in others]
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
