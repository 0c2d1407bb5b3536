"""Invariants I1-I4 over a plan snapshot, each asked of Z3 as "find a counterexample".

``check_snapshot(snap)`` validates the snapshot (``vtoken.snapshot.validate``: every field
the checks read, with its type and stated range), then asks Z3 one question per check and
returns a :class:`Violation` for every counterexample found (an empty list: the snapshot
satisfies the checks). A malformed snapshot raises :class:`vtoken.errors.SnapshotError`
naming the field, never a KeyError or TypeError.

What this cannot see: what :mod:`vtoken.invariants.snapshot_checks` cannot (the same rules
over the same snapshot; its "What this cannot see" is this module's too): one plan's
snapshot only, the requests its writer lists (the system lists only the plan's own), other
in-flight plans at plan time only (their ends are not here), a request's own frees (never
recorded, so a hand-over of its block after apply is seen in ``post`` only), K/V bytes only
through ``plan.digests``, time only as the schedule's order. Z3 is asked about the facts
this module derives from the snapshot, so a fact it does not derive is not asked; it names
at most ``MAX_PER_QUESTION`` counterexamples per question (detection is not capped).

The rules are those of the plain-Python checker :mod:`vtoken.invariants.snapshot_checks`
(its docstring is the reference list, with rule names); the two implementations must agree
on every snapshot (the same violated invariants; every rule named here is one it names).
In short (``R`` = the plan's request, ``E`` = the snapshot's ``evicted_in_flight``, ``F`` =
``plan.fills``, absent == ``[]``: ``R``'s own blocks whose *holes* -- slots without a live
token of ``R`` before the plan -- take moved tokens, in-place compaction; the fresh
destinations are ``plan.dests`` and the blocks the moves write that are not fills):

- **I1** token conservation: every move names a token of ``R`` that is live and sits at the
  move's source; no token is moved twice; after the plan every moved token not in ``E`` is
  live at its destination (otherwise it is LOST: nothing is inferred from a dead token's
  position), every token in ``E`` is dead at its pre slot, an unmoved token keeps its slot
  while live, never becomes live and dies only in place; recorded K/V digests
  (``plan.digests``) agree across the copy.
- **I2** unique mapping: the live slots of ``R`` before the plan, the moves' destination
  slots and the live slots of other requests (outside shared blocks) are pairwise
  distinct (so a move into a fill lands on a hole); after the plan no two live tokens
  share a slot (``R``'s and every other request's in ``post``, outside shared blocks), none
  of ``R``'s sits in a source block or a block the schedule frees (unless re-allocated to
  ``R`` after); no destination and no live token in the null block (a second line behind
  ``validate``).
- **I3** pre-attention visibility, with the copy's completion time ``c`` symbolic
  (``c > t_launch`` of the *last* launch: every launch issues the copy again; a ``fence``
  of this plan after it makes every later event, in list order, happen at ``max(t, c)``):
  no read of a fresh destination block's slot or of a fill's hole, no
  ``free`` of a source or fill block, no ``write`` into a source block, onto a destination
  slot or onto a fill's hole, no ``alloc`` of a source or fill block (or of a fresh
  destination block to another request) can happen before ``c``. Read
  consistency (concrete): a read of ``R``'s token before the plan's ``apply`` uses its pre
  slot, after it the moved token's destination (no stale slot mapping), a token evicted in
  flight is not read after apply, and a token dead before the plan is never read.
- **I4** layout-aware planning: moves come from a consistent snapshot (token live, at the
  move's source, source block among the plan's sources, destination among its dests or
  fills); sources and destinations avoid shared blocks (``shared_blocks`` and every block
  two requests list), the tail block and each other; destinations are fresh (no request's
  block) and from the headroom; fills are ``R``'s private blocks (its, not shared, not the
  tail, neither a source nor a destination) and still ``R``'s after the plan; no block
  (source, fill, destination) is shared with any in-flight plan's sources, dests or fills
  and no in-flight plan carries the plan's id (nor two the same id); the block count
  strictly decreases (sources against fresh destinations); each destination slot is used
  once; every live token in a source block is moved; ``dests_used`` matches the applied
  moves outside fills; no source or fill is freed before ``apply``. Derived, not trusted:
  the tail is the block of token ``n - 1`` (a recorded ``tail_block`` that differs is a
  violation); at most one plan per request in flight (an in-flight plan copying blocks the
  request holds); the headroom holds no block of the plan, of a request or of an in-flight
  plan.

Encoding and why it scales (4096 moves: ~0.3 s of CPU, measured):

- No arrays, no bit-vectors, no lookup chains, nothing quadratic. A per-item property is
  asked with a symbolic index and per-index facts, ``(or (and (= i k) BAD_k) ...)``, where
  ``BAD_k`` compares move ``k``'s numbers with its token's pre/post numbers: one disjunct
  per move or token, and the model's ``i`` is the offending index (the earliest one: a
  binary search on ``i <= bound``; more by adding ``i != k``, a few at most).
- Uniqueness is one ``distinct`` per group (e.g. pre live slots + destination slots +
  other requests' live slots). When it is unsat, a cheap pass finds the colliding values
  and a second query restricted to those items (``a < b``, ``v_a == v_b``) names the pair.
  The values are numerals: Int constants pinned by facts are eliminated by the solver's
  preprocessing anyway and cost ten times the parse.
- Block-set questions (a source that is shared, in flight, the tail, ...) are one indexed
  question over (property, block) candidates with membership facts: linear, where
  ``(or (= x a_i)) and (or (= x b_j))`` makes the solver split ``|a| * |b|`` ways.
- I3: a symbolic ``c`` and a symbolic event index ``e`` over the events that touch the
  plan's blocks, each with its effective time, ``t`` or ``(ite (> c t) c t)``.
- Questions are SMT-LIB text parsed by Z3 (``from_string``): the Python API costs
  microseconds per node, text nanoseconds per character. All questions of a snapshot are
  first asked at once (one parse, one check: "is any counterexample possible?"); only a
  failing snapshot is asked question by question, to name each counterexample. The solver
  is reused per thread inside push/pop (a fresh solver costs more than a small snapshot).

Owns: one reusable Z3 solver per thread (``threading.local``).
May call: z3, vtoken.snapshot (validate), vtoken.errors, invariants.violation (Violation),
numpy.
Costs: one parse and one check per snapshot when it holds (about 0.3 s for 4096 moves); per question
when it fails. The ownership facts: requests x the in-flight plans' blocks, and a plan block's events.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Iterable

import numpy as np
import z3

from vtoken.errors import SnapshotError
from vtoken.snapshot import SCHEMA, validate

from .violation import Violation  # the one result type of every checker

ALL_CHECKS = ("I1", "I2", "I3", "I4")
MAX_PER_QUESTION = 5  # counterexamples reported per question (the first is the earliest index)


# ---------------------------------------------------------------------------------- parsing
class _Snap:
    """The parts of a validated snapshot the checks read, as arrays."""

    def __init__(self, snap: dict, evictions_in_flight: bool = True):
        self.evictions_in_flight = evictions_in_flight
        self.S = S = snap["block_size"]
        plan = snap["plan"]
        self.pid = plan["id"]
        self.req = plan["request"]
        self.sources = list(plan["sources"])
        self.dests = list(plan["dests"])
        self.fills = list(plan.get("fills", []))  # in-place compaction: R's blocks whose holes take tokens
        self.moves = m = _int_array(plan["moves"], "plan.moves", 5)
        self.src_slot = m[:, 1] * S + m[:, 2]
        self.dst_slot = m[:, 3] * S + m[:, 4]
        self.digests = plan.get("digests")
        pre = snap["pre"]["requests"][self.req]
        self.n = pre["length"]
        self.pre = _int_array(pre["tokens"], f"pre.requests[{self.req!r}].tokens", 3)
        self.pre_live = (self.pre[:, 2] != 0).tolist()
        self.pre_slot = self.pre[:, 0] * S + self.pre[:, 1]
        self.pre_blocks = list(pre["blocks"])
        self.pre_live_slots = set(self.pre_slot[np.asarray(self.pre_live, dtype=bool)].tolist()) if self.n else set()
        # the tail: derived from the tokens (token n-1 never moves: its block is where the last
        # position was written), the recorded tail_block checked against it
        self.tail_field = pre.get("tail_block")
        self.tail_derived = int(self.pre[self.n - 1, 0]) if self.n else None
        self.tails = {b for b in (self.tail_field, self.tail_derived) if b is not None}
        self.post = None
        self.post_blocks: list = []
        self.post_live, self.post_slot = [], np.zeros(0, dtype=np.int64)
        if snap.get("post") is not None:
            q = snap["post"]["requests"][self.req]  # validate: present, at least n tokens
            self.post_blocks = list(q["blocks"])
            self.post = _int_array(q["tokens"], f"post.requests[{self.req!r}].tokens", 3)
            self.post_live = (self.post[:, 2] != 0).tolist()
            self.post_slot = self.post[:, 0] * S + self.post[:, 1]
        # Sharedness is a fact of pre: shared_blocks plus every block two requests list.
        listed: dict = {}
        for r in snap["pre"]["requests"].values():
            for b in set(r["blocks"]):
                listed[b] = listed.get(b, 0) + 1
        self.shared = sorted(set(snap["shared_blocks"]) | {b for b, c in listed.items() if c > 1})
        shared = set(self.shared)
        self.others = []  # (request, token, slot) live in other requests, outside shared blocks
        self.other_blocks: dict = {}  # block -> a request other than R listing it
        for rid, r in snap["pre"]["requests"].items():
            if rid == self.req:
                continue
            for b in r["blocks"]:
                self.other_blocks.setdefault(b, rid)
            for t, (b, o, live) in enumerate(r["tokens"]):
                if live and b not in shared:
                    self.others.append((rid, t, b * S + o))
        self.pre_by_name = {str(rid): r for rid, r in snap["pre"]["requests"].items()}
        self.pre_reqs = snap["pre"]["requests"]  # every request's lists: the ownership rules
        self.post_reqs = snap["post"]["requests"] if snap.get("post") is not None else {}
        self.post_others = []  # (request, token, slot): other requests' live tokens after the plan
        if snap.get("post") is not None:
            self._post_others(snap, shared)
        self.headroom = list(snap["headroom"])
        self.in_flight = list(snap["in_flight"])
        self.schedule = list(snap["schedule"])
        self.dests_used = snap.get("dests_used")
        self.dst_blocks = sorted(set(m[:, 3].tolist()))  # every block a move writes, fills included
        self.fresh_dst_blocks = sorted(set(self.dst_blocks) - set(self.fills))  # ... the fresh ones
        # The snapshot's own record of the moved tokens evicted while the copy flew (their
        # moves dropped, left dead at the pre slot). Nothing is inferred from the post state:
        # with evictions_in_flight=False the record is taken as empty (no eviction possible).
        self.recorded_evicted = [False] * self.n
        for t in snap["evicted_in_flight"]:
            self.recorded_evicted[t] = True
        self.evicted = list(self.recorded_evicted) if evictions_in_flight else [False] * self.n

    def _post_others(self, snap: dict, shared: set) -> None:
        """Every request's post counts: other requests' live tokens after the plan, outside
        blocks shared in ``pre`` or listed by two requests of ``post`` (never a plan block)."""
        S, plan = self.S, snap["plan"]
        listed: dict = {}
        for r in snap["post"]["requests"].values():
            for b in set(r["blocks"]):
                listed[b] = listed.get(b, 0) + 1
        ours = set(plan["sources"]) | set(plan["dests"]) | set(plan.get("fills", [])) | {mv[3] for mv in plan["moves"]}
        gone = shared | {b for b, c in listed.items() if c > 1 and b not in ours}
        for rid, r in snap["post"]["requests"].items():
            if rid == self.req:
                continue
            for t, (b, o, live) in enumerate(r["tokens"]):
                if live and b not in gone:
                    self.post_others.append((rid, t, b * S + o))


def _int_array(rows, where: str, width: int) -> np.ndarray:
    if len(rows) == 0:
        return np.zeros((0, width), dtype=np.int64)
    try:
        return np.asarray(rows, dtype=np.int64).reshape(len(rows), width)
    except (OverflowError, ValueError, TypeError) as e:
        raise SnapshotError("bad_field", f"{where}: entries must be {width} integers within int64 ({e})") from None


def load_checked(snap, evictions_in_flight: bool = True) -> _Snap:
    """Validate (raising SnapshotError naming the field: ``validate`` covers every field the
    checks read, with its type and range) and parse."""
    validate(snap)
    return _Snap(snap, evictions_in_flight)


# ---------------------------------------------------------------------------------- Z3 plumbing
def _b(x) -> str:
    return "true" if x else "false"


_local = threading.local()
_names = itertools.count()
_SOLVER_REUSE = 2000  # checks per solver before a fresh one (its parser keeps every declaration)


def _shared_solver() -> z3.Solver:
    """A per-thread solver reused across checks: creating one and its first check cost ~1 ms,
    more than a whole small snapshot; push/pop on a warm one costs microseconds."""
    uses = getattr(_local, "uses", _SOLVER_REUSE)
    if uses >= _SOLVER_REUSE:
        _local.solver, uses = z3.Solver(), 0
    _local.uses = uses + 1
    return _local.solver


class _Ask:
    """The questions of one check, inside a push/pop scope of the thread's solver. Each
    question is parsed once and guarded by its own assumption literal (``(assert (=> q
    (or ...)))``, ``check(q)``). Names are unique (the solver's parser keeps declarations
    across calls and scopes).

    With ``probe=True`` nothing is asked: questions are collected (answering "no
    counterexample"), and :meth:`any_counterexample` then asks them all at once -- one parse,
    one check. A snapshot that passes (the common case) costs just that; one that fails is
    checked again question by question to name every counterexample.
    """

    def __init__(self, probe: bool = False):
        self.s = _shared_solver()
        self.probe = probe
        self._decls: list[str] = []
        self._bodies: list[str] = []

    def __enter__(self):
        self.s.push()
        return self

    def __exit__(self, *exc):
        self.s.pop()
        return False

    def _collect(self, decls: str, body: str) -> None:
        self._decls.append(decls)
        self._bodies.append(body)

    def any_counterexample(self) -> bool:
        """Probe mode: is any collected question satisfiable?"""
        if not self._bodies:
            return False
        self.s.from_string("".join(self._decls) + f"(assert (or {' '.join(self._bodies)}))")
        return self.s.check() != z3.unsat

    def name(self, base: str) -> str:
        return f"{base}!{next(_names)}"

    def _guarded(self, text_decls: str, body: str) -> z3.BoolRef:
        q = self.name("q")
        self.s.from_string(f"(declare-const {q} Bool){text_decls}(assert (=> {q} {body}))")
        return z3.Bool(q)

    def index(self, var: str, disjuncts: list[str], prelude: str = "", cap: int = MAX_PER_QUESTION,
              extra: Iterable[str] = ()) -> list[tuple[int, dict]]:
        """Values ``k`` of a symbolic index making some ``(and (= IDX k) BAD_k)`` true.

        ``disjuncts`` use the placeholder ``IDX`` for the index; constants of their own
        (declared in ``prelude``, reported through ``extra``) end in ``@``, made unique here.
        Returns up to ``cap`` ``(k, model)``, earliest index first; ``model`` has the index
        under ``var`` and the ``extra`` constants under their plain names.
        """
        if not disjuncts:
            return []
        tag = self.name("_")
        iv_name = f"{var}{tag}"
        body = " ".join(disjuncts).replace("IDX", iv_name).replace("@", tag)
        if self.probe:
            self._collect(f"(declare-const {iv_name} Int){prelude.replace('@', tag)}", f"(or {body})")
            return []
        # the prelude only speaks of this question's own (fresh) names: asserted unguarded,
        # it constrains nothing any other question mentions
        q = self._guarded(f"(declare-const {iv_name} Int){prelude.replace('@', tag)}", f"(or {body})")
        s = self.s
        iv = z3.Int(iv_name)
        others = [(x.rstrip("@"), z3.Int(x.replace("@", tag))) for x in extra]
        found = []
        while len(found) < cap and s.check(q) == z3.sat:
            m = s.model()
            k = m.eval(iv, model_completion=True).as_long()
            lo = 0  # the earliest offending index: binary search on an upper bound
            while lo < k:
                mid = (lo + k) // 2
                p = z3.Bool(self.name("p"))
                s.add(z3.Implies(p, iv <= mid))
                if s.check(q, p) == z3.sat:
                    m = s.model()
                    k = m.eval(iv, model_completion=True).as_long()
                else:
                    lo = mid + 1
            model = {var: k}
            for plain, o in others:
                val = m.eval(o, model_completion=True)
                model[plain] = val.as_long() if z3.is_int_value(val) else str(val)
            found.append((k, model))
            s.add(z3.Implies(q, iv != k))
        return found

    def distinct(self, groups: dict[str, list[int]]) -> dict[str, tuple[int, int, dict]]:
        """``{name: values}``; for each group whose values are not pairwise distinct returns
        ``(a, b, model)`` with ``a < b`` indexing an offending pair.

        One ``distinct`` per group behind its assumption literal. The values are numerals:
        Int constants pinned by facts would be eliminated by the solver's preprocessing
        anyway, and cost ten times the parse.
        """
        lits, parts = {}, []
        for name, vals in groups.items():
            if len(vals) < 2:
                continue
            if self.probe:
                self._collect("", f"(not (distinct {' '.join(map(str, vals))}))")
                continue
            g = lits[name] = self.name("g")
            parts.append(f"(declare-const {g} Bool)(assert (=> {g} (distinct {' '.join(map(str, vals))})))")
        if not lits:
            return {}
        self.s.from_string("".join(parts))
        return {name: self._pair(groups[name]) for name, g in lits.items() if self.s.check(z3.Bool(g)) != z3.sat}

    def _pair(self, vals: list[int]) -> tuple[int, int, dict]:
        """The second query, restricted to the items whose value collides: Z3 names a pair."""
        seen: dict = {}
        for k, v in enumerate(vals):  # the cheap search for colliding values
            seen.setdefault(v, []).append(k)
        groups = [ks for ks in seen.values() if len(ks) > 1]
        items = [k for ks in groups[:8] for k in ks]
        a, b, va, vb = (self.name(x) for x in ("a", "b", "va", "vb"))
        q = self._guarded(
            f"(declare-const {a} Int)(declare-const {b} Int)(declare-const {va} Int)(declare-const {vb} Int)",
            f"(and (< {a} {b}) (= {va} {vb})"
            f" (or {' '.join(f'(and (= {a} {k}) (= {va} {vals[k]}))' for k in items)})"
            f" (or {' '.join(f'(and (= {b} {k}) (= {vb} {vals[k]}))' for k in items)}))")
        if self.s.check(q) == z3.sat:
            m = self.s.model()
            ia, ib = m.eval(z3.Int(a)).as_long(), m.eval(z3.Int(b)).as_long()
        else:  # cannot happen when the distinct was unsat; keep the cheap answer
            ia, ib = groups[0][:2]
        return ia, ib, {"a": ia, "b": ib, "value": vals[ia], "colliding_values": len(groups)}

    def holds(self, decls: str, body: str) -> bool:
        """Is ``body`` (over the constants declared in ``decls``) satisfiable?"""
        if self.probe:
            self._collect(decls, body)
            return False
        return self.s.check(self._guarded(decls, body)) == z3.sat


def _loc(S: int, slot: int) -> str:
    return f"(block {slot // S}, offset {slot % S})"


def _moved_mask(d: _Snap) -> np.ndarray:
    m, n = d.moves, d.n
    moved = np.zeros(n, dtype=bool)
    if len(m):
        ok = (m[:, 0] >= 0) & (m[:, 0] < n)
        moved[m[ok, 0]] = True
    return moved


# ---------------------------------------------------------------------------------- I1
def _check_i1(d: _Snap, ask: _Ask) -> list[Violation]:
    out = []
    n, S, m = d.n, d.S, d.moves
    pl, ps = d.pre_live, d.pre_slot
    ev = d.evicted
    # (a) per move: token known, live, at the move's source; after the plan a move not
    # recorded as evicted in flight is live at its destination (anything else: LOST)
    dis = []
    post = d.post is not None
    for k, (t, ss, ds) in enumerate(zip(m[:, 0].tolist(), d.src_slot.tolist(), d.dst_slot.tolist())):
        if not 0 <= t < n:
            dis.append(f"(and (= IDX {k}) (not (< -1 {t} {n})))")
        elif post:
            arrived = f"(and {_b(d.post_live[t])} (= {d.post_slot[t]} {ds}))"
            dis.append(f"(and (= IDX {k}) (or (not {_b(pl[t])}) (not (= {ps[t]} {ss})) "
                       f"(and (not {_b(ev[t])}) (not {arrived}))))")
        else:
            dis.append(f"(and (= IDX {k}) (or (not {_b(pl[t])}) (not (= {ps[t]} {ss}))))")
    for k, model in ask.index("i", dis):
        t, sb, so, db, do = m[k].tolist()
        model.update(move=[t, sb, so, db, do])
        rule = "move_token"
        if not 0 <= t < n:
            why = f"move #{k} names token {t}, which request {d.req!r} does not have (length {n})"
        elif not pl[t]:
            why = f"move #{k} moves token {t}, which is not live before the plan"
        elif ps[t] != sb * S + so:
            why = f"move #{k}: token {t} is at {_loc(S, ps[t])}, not at the move's source {_loc(S, sb * S + so)}"
        elif not d.post_live[t]:
            rule = "arrival"
            why = (f"move #{k}: token {t} is dropped: LOST (not live at its destination {_loc(S, db * S + do)} "
                   f"after the plan, and not recorded as evicted in flight)")
        else:
            rule = "arrival"
            why = f"move #{k}: token {t} ends at {_loc(S, d.post_slot[t])}, not at its destination {_loc(S, db * S + do)}"
        model.update(pre_slot=_pair(S, ps[t]) if 0 <= t < n else None)
        out.append(Violation("I1", why, model, rule))
    # (b) no token moved twice
    res = ask.distinct({"moved_once": m[:, 0].tolist()})
    if "moved_once" in res:
        a, b, model = res["moved_once"]
        out.append(Violation("I1", f"token {int(m[a, 0])} is moved twice (moves #{a} and #{b})", model, "moved_twice"))
    if not post:
        return out
    _i1_after(d, ask, out)
    return out


def _i1_after(d: _Snap, ask: _Ask, out: list) -> None:
    """I1 (c)-(e) on a snapshot with a post state: evicted, unmoved and digest rules, appended to ``out``."""
    n, S, m = d.n, d.S, d.moves
    pl, ps = d.pre_live, d.pre_slot
    ev = d.evicted
    ql, qs = d.post_live, d.post_slot
    # (c) a token recorded as evicted in flight is dead at its pre slot after the plan
    dis = [f"(and (= IDX {t}) (or {_b(ql[t])} (not (= {ps[t]} {qs[t]}))))" for t in range(n) if ev[t]]
    for t, model in ask.index("e", dis):
        model.update(pre=_pair(S, ps[t]), post=[*_pair(S, qs[t]), bool(ql[t])])
        out.append(Violation("I1", f"token {t} is recorded as evicted in flight but is {'live' if ql[t] else 'dead'} "
                                   f"at {_loc(S, qs[t])} after the plan (expected dead at {_loc(S, ps[t])})",
                             model, "evicted"))
    # (d) per unmoved token: the live id set is unchanged, unmoved live tokens stay; a policy
    # may evict one in place while the copy flies (not with evictions_in_flight=False)
    moved = _moved_mask(d).tolist()
    tol = _b(d.evictions_in_flight)
    dis = []
    for t in range(n):  # tokens grown while the copy was in flight (ids >= n) are new: not compared
        if moved[t]:
            continue
        lost = f"(and {_b(pl[t])} (not {_b(ql[t])}) (not (and {tol} (= {ps[t]} {qs[t]}))))"
        born = f"(and (not {_b(pl[t])}) {_b(ql[t])})"
        stray = f"(and {_b(pl[t])} {_b(ql[t])} (not (= {ps[t]} {qs[t]})))"
        dis.append(f"(and (= IDX {t}) (or {lost} {born} {stray}))")
    for t, model in ask.index("j", dis):
        model.update(pre=[*_pair(S, ps[t]), bool(pl[t])], post=[*_pair(S, qs[t]), bool(ql[t])])
        if pl[t] and not ql[t]:
            why = (f"live token {t} of request {d.req!r} is dropped by the plan"
                   + ("" if ps[t] == qs[t] else f" (dead at {_loc(S, qs[t])}, not where it was)"))
        elif ql[t] and not pl[t]:
            why = f"token {t} of request {d.req!r} becomes live after the plan (renamed or invented)"
        else:
            why = f"token {t} is not moved but goes from {_loc(S, ps[t])} to {_loc(S, qs[t])}"
        out.append(Violation("I1", why, model, "unmoved"))
    # (e) K/V digests, where recorded: unchanged across the copy for every applied move
    if d.digests is not None:
        pre_d, post_d = d.digests["pre"], d.digests["post"]
        dis = [f"(and (= IDX {k}) (not (= {pre_d[k]} {post_d[k]})))" for k, t in enumerate(m[:, 0].tolist())
               if not (0 <= t < n and ev[t]) and pre_d[k] is not None and post_d[k] is not None]
        for k, model in ask.index("g", dis):
            model.update(pre_digest=pre_d[k], post_digest=post_d[k])
            out.append(Violation("I1", f"move #{k}: token {int(m[k, 0])}'s K/V digest changed across the copy "
                                       f"({pre_d[k]:#018x} before, {post_d[k]:#018x} after)", model, "digest"))


def _pair(S: int, slot: int) -> list[int]:
    return [slot // S, slot % S]


# ---------------------------------------------------------------------------------- I2
def _check_i2(d: _Snap, ask: _Ask) -> list[Violation]:
    out = []
    S, m = d.S, d.moves
    live_ids = np.flatnonzero(d.pre_live)
    nxt_vals = (d.pre_slot[live_ids].tolist() + d.dst_slot.tolist() + [slot for _r, _t, slot in d.others])
    nxt_lab = ([("pre", int(t)) for t in live_ids]
               + [("dst", k, int(t)) for k, t in enumerate(m[:, 0].tolist())]
               + [("other", rid, t) for rid, t, _s in d.others])
    groups = {"next": nxt_vals}
    post_ids = np.flatnonzero(d.post_live) if d.post is not None else np.zeros(0, dtype=np.int64)
    if d.post is not None:  # every request's post: another request's live token on R's slot is an alias
        groups["post"] = d.post_slot[post_ids].tolist() + [slot for _r, _t, slot in d.post_others]
        post_lab = [("post", int(t)) for t in post_ids] + [("other", rid, t) for rid, t, _s in d.post_others]
    res = ask.distinct(groups)

    def say(lab):
        if lab[0] in ("pre", "post"):
            return f"live token {lab[1]}"
        if lab[0] == "dst":
            return f"move #{lab[1]} (token {lab[2]})"
        return f"live token {lab[2]} of request {lab[1]!r}"

    if "next" in res:
        a, b, model = res["next"]
        la, lb = nxt_lab[a], nxt_lab[b]
        slot = nxt_vals[a]
        model.update(slot=_pair(S, slot))
        if la[0] == "dst" and lb[0] == "dst":
            why = f"moves #{la[1]} (token {la[2]}) and #{lb[1]} (token {lb[2]}) share destination slot {_loc(S, slot)}"
        elif "dst" in (la[0], lb[0]):
            mv, occ = (la, lb) if la[0] == "dst" else (lb, la)
            why = f"move #{mv[1]} sends token {mv[2]} into occupied slot {_loc(S, slot)}, held by {say(occ)}"
        else:
            why = f"before the plan, {say(la)} and {say(lb)} share slot {_loc(S, slot)}"
        out.append(Violation("I2", why, model, "pre_unique"))
    if "post" in res:
        a, b, model = res["post"]
        slot = groups["post"][a]
        model.update(slot=_pair(S, slot))
        la, lb = post_lab[a], post_lab[b]
        both = (f"live tokens {la[1]} and {lb[1]} of request {d.req!r}" if la[0] == lb[0] == "post"
                else f"{say(la) if la[0] == 'other' else f'live token {la[1]} of request {d.req!r}'} and {say(lb)}")
        out.append(Violation("I2", f"after the plan, {both} share slot {_loc(S, slot)}", model, "post_unique"))
    # The null block, a second line (validate already refuses a live token or a destination
    # there): one indexed question "some slot below S", linear in the values, not S markers.
    for vals, labs, where in ((nxt_vals, nxt_lab, ""),
                              (groups.get("post", []), post_lab if d.post is not None else [], "after the plan, ")):
        for k, model in ask.index("z", [f"(and (= IDX {k}) (< {v} {S}))" for k, v in enumerate(vals)], cap=1):
            out.append(Violation("I2", f"{where}{say(labs[k])} is in the null block 0", model, "null"))
    if d.post is not None:
        out += _z3_dangling(d, ask, post_ids)
    return out


def _z3_dangling(d: _Snap, ask: _Ask, post_ids) -> list[Violation]:
    """[dangling]: after the plan, no live token of R in a source block or a block the
    schedule frees (unless an alloc of that block to R follows its last free)."""
    out, S = [], d.S
    last_free, reacquired = {}, set()
    for i, ev in enumerate(d.schedule):
        if ev["kind"] == "free":
            for b in ev["blocks"]:
                last_free[b] = i
                reacquired.discard(b)
        elif ev["kind"] == "alloc" and str(ev["request"]) == str(d.req):
            reacquired.update(b for b in ev["blocks"] if b in last_free)
    gone = sorted((set(d.sources) | set(last_free)) - reacquired)
    if gone:
        blk = (d.post_slot[post_ids] // S).tolist()
        prelude = "(declare-fun gone@ (Int) Bool)" + "".join(
            f"(assert {'' if b in gone else '(not '}(gone@ {b}){'' if b in gone else ')'})"
            for b in sorted(set(blk) | set(gone)))
        dis = [f"(and (= IDX {k}) (gone@ {b}))" for k, b in enumerate(blk)]
        for k, model in ask.index("y", dis, prelude=prelude, cap=1):
            t, b = int(post_ids[k]), blk[k]
            what = "a source block of the plan" if b in d.sources else "a block the schedule frees"
            model.update(token=t, block=b)
            out.append(Violation("I2", f"after the plan, live token {t} of request {d.req!r} maps to "
                                       f"{_loc(S, int(d.post_slot[t]))}, in {what}", model, "dangling"))
    return out


def _check_overwrite(d: _Snap, ask: _Ask) -> list[Violation]:
    """No write on a slot holding a live token of R (before apply its pre slots; after it the
    moved tokens' destinations, not evicted in flight, and the unmoved ones' slots) unless the
    block was freed or handed to another request earlier: one indexed question over the
    writes, each with its concrete fact."""
    S = d.S
    if not any(ev["kind"] == "write" for ev in d.schedule):
        return []
    _launch, _fence, apply = _plan_events(d)
    live_pre = {s_: t for t, (s_, live) in enumerate(zip(d.pre_slot.tolist(), d.pre_live)) if live}
    dest_of = {}
    for t, ds in zip(d.moves[:, 0].tolist(), d.dst_slot.tolist()):
        dest_of.setdefault(t, ds)
    live_post = {}
    for s_, t in live_pre.items():
        if t not in dest_of:
            live_post[s_] = t
        elif not d.evicted[t]:
            live_post[dest_of[t]] = t
    facts, freed = [], set()
    for i, ev in enumerate(d.schedule):
        if ev["kind"] == "free" or (ev["kind"] == "alloc" and str(ev["request"]) != str(d.req)):
            freed |= set(ev["blocks"])
        elif ev["kind"] == "write":
            held = live_post if apply is not None and i > apply else live_pre
            facts.append((i, ev, held.get(ev["slot"]) if ev["slot"] // S not in freed else None))
    dis = [f"(and (= IDX {k}) {_b(t is not None)})" for k, (_i, _ev, t) in enumerate(facts)]
    out = []
    for k, model in ask.index("w", dis):
        i, ev, t = facts[k]
        model.update(event=i, token=t)
        out.append(Violation("I2", f"new token {ev['token']} of request {ev['request']!r} written at t={ev['t']} "
                                   f"(schedule[{i}]) onto {_loc(S, ev['slot'])}, where live token {t} of request "
                                   f"{d.req!r} is", model, "overwrite"))
    return out


# ---------------------------------------------------------------------------------- I3
def _plan_events(d: _Snap):
    """(last launch, first fence after it, first apply) as schedule indices (None: absent).
    Every launch issues the copy again, so the last one is the copy whose completion the
    plan's blocks wait for; list order breaks time ties."""
    launch = fence = apply = None
    for i, ev in enumerate(d.schedule):
        if ev.get("plan") != d.pid or ev["kind"] not in ("launch", "apply"):
            continue
        if ev["kind"] == "launch":
            launch = i
        elif ev["kind"] == "apply" and apply is None:
            apply = i
    if launch is not None:  # a fence counts only once the (last) copy was launched
        for i, ev in enumerate(d.schedule):
            if i > launch and ev.get("plan") == d.pid and ev["kind"] == "fence":
                fence = i
                break
    return launch, fence, apply


def _i3_touches(d: _Snap) -> list:
    """The schedule events touching the copy's blocks or slots: ``(event index, kind, what it touches)``."""
    S = d.S
    fills = set(d.fills)
    src, dst = set(d.sources), set(d.dests) | set(d.fresh_dst_blocks)
    dst_slots = set(d.dst_slot.tolist())
    live_pre = d.pre_live_slots

    def hole(s):  # a slot of a fill holding no live token of R before the plan: the copy may write it
        return s // S in fills and s not in live_pre

    cands = []  # (event index, kind, what it touches)
    for i, ev in enumerate(d.schedule):
        kind = ev["kind"]
        if kind == "read":  # a fresh destination's slot, or a fill's hole (its live slots are R's, readable)
            hit = [(t, s) for t, s in zip(ev["tokens"], ev["slots"]) if s // S in dst or hole(s)]
        elif kind == "free":
            hit = [b for b in ev["blocks"] if b in src or b in fills]
        elif kind == "alloc":  # a source or fill reused, or a destination handed to another request
            other = str(ev["request"]) != str(d.req)
            hit = [b for b in ev["blocks"] if b in src or b in fills or (other and b in dst)]
        elif kind == "write":  # a new token into a source block, or onto a slot the copy writes
            s_ = ev["slot"]
            hit = [(ev["token"], s_)] if (s_ // S in src or s_ in dst_slots or hole(s_)) else []
        else:
            continue
        if hit:
            cands.append((i, kind, hit))
    return cands


def _i3_touch_why(d: _Snap, ev: dict, kind: str, hit: list, when: str) -> str:
    """The message for one event that touches the copy's blocks or slots too early (``when``: at what point)."""
    S = d.S
    fills = set(d.fills)
    src, dst = set(d.sources), set(d.dests) | set(d.fresh_dst_blocks)
    dst_slots = set(d.dst_slot.tolist())
    if kind == "read":
        desc = ", ".join(f"token {t} at {_loc(S, s)}" for t, s in hit[:4])
        what = "destination slot(s)" if any(s // S in dst for _t, s in hit) else "fill hole slot(s)"
        return f"attention reads {what} of plan {d.pid} ({desc}) {when}"
    if kind == "free":
        role = "source" if all(b in src for b in hit) else "fill" if all(b in fills for b in hit) else "source/fill"
        return f"{role} block(s) {hit} of plan {d.pid} freed {when}"
    if kind == "alloc":
        return f"block(s) {hit} of plan {d.pid} handed to request {ev['request']!r} {when}"
    (t, s), = hit
    role = ("in a source block" if s // S in src else "on a destination slot" if s in dst_slots
            else "on a hole of a fill")
    return f"new token {t} written at {_loc(S, s)}, {role} of plan {d.pid}, {when}"


def _i3_early(d: _Snap, ask: _Ask) -> list[Violation]:
    """I3 ``early``: no event touches the copy's blocks or slots while the copy can still be running."""
    out = []
    sched = d.schedule
    launch, fence, _apply = _plan_events(d)
    cands = _i3_touches(d)
    t_launch = sched[launch]["t"] if launch is not None else max(ev["t"] for ev in sched)
    w = sched[fence]["t"] if fence is not None else None
    dis = []
    for k, (i, _kind, _hit) in enumerate(cands):
        t = sched[i]["t"]
        eff = f"(ite (> c@ {t}) c@ {t})" if fence is not None and i > fence else f"{t}"  # list order breaks ties
        dis.append(f"(and (= IDX {k}) (< {eff} c@))")
    prelude = f"(declare-const c@ Int)(assert (> c@ {t_launch}))"
    for k, model in ask.index("e", dis, prelude=prelude, extra=("c@",)):
        i, kind, hit = cands[k]
        ev = sched[i]
        model.update(event=i, t=ev["t"], kind=kind, touches=hit[:8])
        if launch is None:
            when = f"at t={ev['t']} (schedule[{i}]), and plan {d.pid} has no launch event: the copy has not even started"
        elif i < launch:
            when = f"at t={ev['t']} (schedule[{i}]), before the copy was (last) launched (t={t_launch}, schedule[{launch}])"
        else:
            when = (f"at t={ev['t']} (schedule[{i}]) while the copy can still be running (it may complete at "
                    f"c={model['c']}; launched t={t_launch}, " + ("no fence before)" if w is None or i <= fence else "fenced)"))
        out.append(Violation("I3", _i3_touch_why(d, ev, kind, hit, when), model, "early"))
    return out


def _i3_reads(d: _Snap, ask: _Ask) -> list[Violation]:
    """I3 read consistency: R's reads use the pre slot before apply, the destination after it."""
    out = []
    S, sched = d.S, d.schedule
    _launch, _fence, apply = _plan_events(d)
    n, pl, ps = d.n, d.pre_live, d.pre_slot
    dest_of = {}
    for t, ds in zip(d.moves[:, 0].tolist(), d.dst_slot.tolist()):
        dest_of.setdefault(t, ds)
    items, dis = [], []
    for i, ev in enumerate(sched):
        if ev["kind"] != "read" or str(ev["request"]) != str(d.req):
            continue
        after = apply is not None and i > apply
        for t, s in zip(ev["tokens"], ev["slots"]):
            if not 0 <= t < n:
                continue  # grown while the copy flew
            # a token dead before the plan is dead ever since; one evicted in flight is dead
            # from apply on (its move dropped, its old slot in a freed source): no slot holds it
            exp = (-1 if not pl[t] or (after and t in dest_of and d.evicted[t]) else
                   dest_of[t] if (after and t in dest_of) else ps[t])
            dis.append(f"(and (= IDX {len(items)}) (not (= {s} {exp})))")
            items.append((i, t, s, exp))
    for k, model in ask.index("r", dis):
        i, t, s, exp = items[k]
        model.update(event=i, t=sched[i]["t"], token=t, slot=_pair(S, s), expected=_pair(S, exp) if exp >= 0 else None)
        phase = "after" if apply is not None and i > apply else "before"
        if not pl[t]:
            out.append(Violation("I3", f"dead token read: the read at t={sched[i]['t']} (schedule[{i}]) uses "
                                       f"{_loc(S, s)} for token {t}, dead before the plan", model, "dead_read"))
        elif exp < 0:
            out.append(Violation("I3", f"stale slot mapping: the read at t={sched[i]['t']} (schedule[{i}], after apply) "
                                       f"uses {_loc(S, s)} for token {t}, evicted while the copy flew (dead since "
                                       f"apply: no slot holds it)", model, "stale_read"))
        else:
            out.append(Violation("I3", f"stale slot mapping: the read at t={sched[i]['t']} (schedule[{i}], {phase} apply) "
                                       f"uses {_loc(S, s)} for token {t}, expected {_loc(S, exp)}", model, "stale_read"))
    return out


def _check_i3(d: _Snap, ask: _Ask) -> list[Violation]:
    """I3 on the schedule: nothing touches the copy's blocks too early, every read uses the right slot."""
    if not d.schedule:
        return []
    return _i3_early(d, ask) + _i3_reads(d, ask)


# ---------------------------------------------------------------------------------- I4
def _derived_cands(d: _Snap) -> list:
    """Candidates ``(message, fact, model, rule)`` of the rules on derived facts: the recorded
    tail_block against the tail of the tokens [tail_block]; an in-flight plan that is a second
    current plan of a request [one_plan] (current: it copies blocks the request holds in
    ``pre``; an orphan of an earlier incarnation of the name holds none); a block held by the
    plan, a request or an in-flight plan listed in the headroom [headroom]."""
    cands = []
    if d.tail_field is not None:
        last = ("the request is empty" if d.tail_derived is None
                else f"token {d.n - 1}, the last position, is in block {d.tail_derived}")
        cands.append((f"tail_block {d.tail_field} of request {d.req!r} is not its tail ({last})",
                      d.tail_field != d.tail_derived, dict(x=d.tail_field), "tail_block"))
    current = {str(d.req): 1}
    for k, p in enumerate(d.in_flight):
        x = str(p["request"])
        r = d.pre_by_name.get(x)
        if r is None or not (set(p["sources"]) | set(p.get("fills", []))) & set(r["blocks"]):
            continue
        current[x] = current.get(x, 0) + 1
        cands.append((f"in-flight plan {p['id']} copies blocks of request {x!r} while "
                      f"{f'plan {d.pid}' if x == str(d.req) else 'another in-flight plan'} of the same request is in "
                      f"flight (at most one plan per request)", current[x] > 1, dict(in_flight=p["id"], entry=k),
                      "one_plan"))
    holder: dict = {}
    for b in d.sources:
        holder.setdefault(b, f"a source of plan {d.pid}")
    for b in d.fills:
        holder.setdefault(b, f"a fill of plan {d.pid}")
    for rid, r in d.pre_by_name.items():
        for b in r["blocks"]:
            holder.setdefault(b, f"a block of request {rid!r}")
    for p in d.in_flight:
        for b in p["sources"] + p["dests"] + p.get("fills", []):
            holder.setdefault(b, f"a block of in-flight plan {p['id']}")
    for b in sorted(set(d.headroom)):
        if b in holder:
            cands.append((f"headroom block {b} is {holder[b]}: the headroom holds free blocks only", True, dict(x=b),
                          "headroom"))
    return cands


def _i4_membership(d: _Snap) -> str:
    """The fact table ``src@`` / ``dst@`` (a plan source; where a move may write), fixed per block."""
    S, m = d.S, d.moves
    srcs, lands = set(d.sources), set(d.dests) | set(d.fills)
    blocks = set(m[:, 1].tolist()) | set(m[:, 3].tolist()) | set((d.pre_slot // S).tolist()) | srcs | lands
    return ("(declare-fun src@ (Int) Bool)(declare-fun dst@ (Int) Bool)"
            + "".join(f"(assert {'' if b in srcs else '(not '}(src@ {b}){'' if b in srcs else ')'})"
                      f"(assert {'' if b in lands else '(not '}(dst@ {b}){'' if b in lands else ')'})"
                      for b in blocks))


def _i4_moves(d: _Snap, ask: _Ask, prelude: str, v) -> None:
    """I4 ``consistent`` (each move agrees with the snapshot and the plan's blocks) and ``emptied``, through ``v``."""
    S, n, m = d.S, d.n, d.moves
    pl, ps = d.pre_live, d.pre_slot
    src, dests, fill_list = d.sources, d.dests, d.fills
    srcs = set(src)
    # consistent snapshot: per move, token live at the move's source, source among the plan's
    # sources, destination among its dests or fills. Membership is a fact table: predicates fixed per block.
    dis = []
    for k, (t, sb, ss, db) in enumerate(zip(m[:, 0].tolist(), m[:, 1].tolist(), d.src_slot.tolist(), m[:, 3].tolist())):
        if not 0 <= t < n:
            dis.append(f"(and (= IDX {k}) true)")
        else:
            dis.append(f"(and (= IDX {k}) (or (not {_b(pl[t])}) (not (= {ps[t]} {ss})) (not (src@ {sb})) "
                       f"(not (dst@ {db}))))")
    for k, model in ask.index("i", dis, prelude=prelude):
        t, sb, so, db, do = m[k].tolist()
        model.update(move=[t, sb, so, db, do])
        if not 0 <= t < n:
            why = f"move #{k} names token {t} outside the snapshot (length {n})"
        elif not pl[t]:
            why = f"move #{k} moves token {t}, dead in the snapshot the plan was made from"
        elif ps[t] != sb * S + so:
            why = (f"move #{k}: token {t} is at {_loc(S, ps[t])} in the snapshot, not at {_loc(S, sb * S + so)} "
                   f"(inconsistent snapshot)")
        elif sb not in srcs:
            why = f"move #{k} takes token {t} out of block {sb}, which is not one of the plan's sources {src}"
        else:
            why = (f"move #{k} sends token {t} to block {db}, which is not one of the plan's destinations {dests} "
                   f"nor of its fills {fill_list}")
        v("consistent", why, **model)
    # every source emptied of the request's live tokens
    moved = _moved_mask(d).tolist()
    blk = (ps // S).tolist()
    dis = [f"(and (= IDX {t}) (src@ {blk[t]}) {_b(not moved[t])})" for t in np.flatnonzero(pl).tolist()]
    for t, model in ask.index("j", dis, prelude=prelude):
        v("emptied", f"live token {t} in source block {blk[t]} is not moved: the source is not emptied", token=t, **model)


def _i4_block_cands(d: _Snap) -> list:
    """Candidates ``(message, fact, model, rule)`` of the block-set rules, the in-flight ones and the derived ones."""
    src, fills, dsts = d.sources, set(d.fills), set(d.dests)
    srcs = set(src)
    dst_all = sorted(dsts | set(d.fresh_dst_blocks))  # fresh destinations: listed, or written and not a fill
    cands = []  # (message, fact, model, rule)

    def each(blocks, member, msg, rule="blocks", **extra):
        for b in sorted(set(blocks)):
            cands.append((msg.replace("{b}", str(b)), member(b), dict(x=b, **extra), rule))

    pre_blocks, shared, head, dset = set(d.pre_blocks), set(d.shared), set(d.headroom), set(dst_all)
    each(src, lambda b: b not in pre_blocks,
         f"source block {{b}} is not one of request {d.req!r}'s blocks {d.pre_blocks} (inconsistent snapshot)")
    each(src, lambda b: b in shared, f"plan {d.pid} moves shared-prefix block {{b}} (a source)")
    each(dst_all, lambda b: b in shared, f"plan {d.pid} writes into shared-prefix block {{b}} (a destination)")
    each(src, lambda b: b in d.tails, f"plan {d.pid} moves the tail block {{b}} (still being written)")
    each(dst_all, lambda b: b in d.tails, f"plan {d.pid} writes into the tail block {{b}}")
    each(src, lambda b: b in dset, f"block {{b}} is both a source and a destination of plan {d.pid}")
    each(src, lambda b: b in fills, f"block {{b}} is both a source and a fill of plan {d.pid}")
    each(dst_all, lambda b: b in pre_blocks,
         f"destination block {{b}} already belongs to request {d.req!r} (not a fresh block)")
    each(dst_all, lambda b: b not in pre_blocks and b in d.other_blocks,
         "destination block {b} belongs to another request")
    each(dst_all, lambda b: b not in head, f"destination block {{b}} is not in the headroom {d.headroom}")
    # a fill: R's own private block, not the tail, not a destination; still R's after the plan
    each(fills, lambda b: b not in pre_blocks, f"fill block {{b}} is not a block of request {d.req!r}")
    each(fills, lambda b: b in shared, f"plan {d.pid} fills shared-prefix block {{b}}")
    each(fills, lambda b: b in d.tails, f"plan {d.pid} fills the tail block {{b}} (still being written)")
    each(fills, lambda b: b in dsts, f"block {{b}} is both a fill and a destination of plan {d.pid}")
    if d.post is not None:
        post_blocks = set(d.post_blocks)
        each(fills, lambda b: b not in post_blocks,
             f"fill block {{b}} is no longer a block of request {d.req!r} after the plan", rule="fill_kept")
    ours = srcs | dset | fills
    seen_ids: dict = {}
    for p in d.in_flight:  # no block shared with an in-flight plan (any request); no duplicate ids
        theirs = set(p["sources"]) | set(p["dests"]) | set(p.get("fills", []))
        each(ours, lambda b, th=theirs: b in th,
             f"plan {d.pid} overlaps in-flight plan {p['id']} (request {p['request']!r}): block {{b}}",
             in_flight=p["id"])
        cands.append((f"in-flight plan {p['id']} (request {p['request']!r}) carries plan {d.pid}'s own id",
                      p["id"] == d.pid, dict(in_flight=p["id"]), "duplicate_id"))
        cands.append((f"two in-flight plans carry id {p['id']}", p["id"] in seen_ids, dict(in_flight=p["id"]),
                      "duplicate_id"))
        seen_ids[p["id"]] = True
    return cands + _derived_cands(d)


def _i4_counts(d: _Snap, ask: _Ask, v) -> None:
    """I4 ``duplicate_block``, ``dst_once`` and ``decrease`` (the block count strictly falls), through ``v``."""
    S = d.S
    src, dests, fill_list = d.sources, d.dests, d.fills
    # no block named twice; each destination slot used once
    lists = {"sources": list(src), "dests": list(dests), "fills": list(fill_list)}
    res = ask.distinct({**lists, "dst_once": d.dst_slot.tolist()})
    for name in ("sources", "dests", "fills"):
        if name in res:
            a, _b2, model = res[name]
            v("duplicate_block", f"plan.{name} names block {lists[name][a]} twice", **model)
    if "dst_once" in res:
        a, b, model = res["dst_once"]
        v("dst_once", f"destination slot {_loc(S, int(d.dst_slot[a]))} is used twice (moves #{a} and #{b})", **model)
    # the block count strictly decreases: sources > destinations listed and > fresh destinations used
    n_src, n_used, n_listed = len(set(src)), len(d.fresh_dst_blocks), len(set(dests))
    ns, nu, nl = (ask.name(x) for x in ("n_sources", "n_used", "n_listed"))
    if ask.holds(f"(declare-const {ns} Int)(declare-const {nu} Int)(declare-const {nl} Int)",
                 f"(and (= {ns} {n_src}) (= {nu} {n_used}) (= {nl} {n_listed}) (or (<= {ns} {nu}) (<= {ns} {nl})))"):
        v("decrease", f"plan {d.pid} does not reduce the block count: {n_src} source(s) vs {n_listed} destination(s) "
                      f"listed, {n_used} used", sources=n_src, dests_listed=n_listed, dests_used=n_used)


def _i4_dests_used(d: _Snap, ask: _Ask, v) -> None:
    """I4 ``dests_used``, when recorded: exactly the blocks the moves not recorded as evicted write, through ``v``."""
    if d.dests_used is None:
        return
    n, m, fills = d.n, d.moves, set(d.fills)
    rec = d.recorded_evicted
    want = {db for t, db in zip(m[:, 0].tolist(), m[:, 3].tolist())
            if not (0 <= t < n and rec[t]) and db not in fills}
    used = set(d.dests_used)
    every = sorted(want | used)
    pre_u = "(declare-fun used@ (Int) Bool)(declare-fun want@ (Int) Bool)" + "".join(
        f"(assert {'' if b in used else '(not '}(used@ {b}){'' if b in used else ')'})"
        f"(assert {'' if b in want else '(not '}(want@ {b}){'' if b in want else ')'})" for b in every)
    dis = [f"(and (= IDX {k}) (distinct (used@ {b}) (want@ {b})))" for k, b in enumerate(every)]
    for k, model in ask.index("u", dis, prelude=pre_u, cap=1):
        b = every[k]
        model.update(block=b)
        v("dests_used", f"dests_used {sorted(used)} differs from the blocks the applied moves write {sorted(want)} "
                        f"(block {b})", **model)


def _i4_frees(d: _Snap, ask: _Ask, v) -> None:
    """I4 ``free_before_apply``: sources and fills freed only after the plan is applied, through ``v``."""
    srcs, fills = set(d.sources), set(d.fills)
    # free events as an indexed fact table: event index, "frees a source", position before/after the plan's apply event
    _launch, _fence, apply = _plan_events(d)
    frees = [(i, ev, [b for b in ev["blocks"] if b in srcs or b in fills]) for i, ev in enumerate(d.schedule)
             if ev["kind"] == "free"]
    last = len(d.schedule) if apply is None else apply
    dis = [f"(and (= IDX {k}) {_b(bool(hit))} (< {i} {last}))" for k, (i, _ev, hit) in enumerate(frees)]
    for k, model in ask.index("f", dis):
        i, ev, hit = frees[k]
        role = "source" if all(b in srcs for b in hit) else "fill" if all(b in fills for b in hit) else "source/fill"
        v("free_before_apply", f"{role} block(s) {hit} freed at t={ev['t']} (schedule[{i}]) before plan {d.pid} is "
                               f"applied", event=i, t=ev["t"], blocks=hit, **model)


def _check_i4(d: _Snap, ask: _Ask) -> list[Violation]:
    """I4 on the plan: its moves, its blocks, in-flight plans, the counts, dests_used and the frees."""
    out = []

    def v(rule, why, **model):
        out.append(Violation("I4", why, model, rule))

    prelude = _i4_membership(d)
    _i4_moves(d, ask, prelude, v)
    # Block-set facts, all in one question: a symbolic index over (property, block) candidates,
    # each with its membership fact; the model names the property and the block.
    cands = _i4_block_cands(d)
    dis = [f"(and (= IDX {k}) {_b(fact)})" for k, (_msg, fact, _m, _r) in enumerate(cands)]
    for k, model in ask.index("x", dis, cap=4 * MAX_PER_QUESTION):
        msg, _fact, extra, rule = cands[k]
        model.update(extra)
        v(rule, msg, **model)
    _i4_counts(d, ask, v)
    _i4_dests_used(d, ask, v)
    _i4_frees(d, ask, v)
    for rule in _OWNERSHIP_RULES:
        rule(d, ask, v)
    return out


# ---------------------------------------------------------------------------------- I4: ownership
# Who holds each block, as facts Z3 is asked about: ``lists@ r b`` (request r of ``pre`` holds
# block b at plan time, ``R`` its tail too; a table closed over the blocks asked about) with a
# symbolic request ``r@`` Z3 must find; the plan's hold on each of its blocks as comparisons
# of event indices (a source until its first free, a fill or a destination until the apply).
def _pre_lists(d: _Snap) -> tuple[list, list]:
    """(request names, the set of blocks each holds at plan time), in ``pre``'s order."""
    names, held = [], []
    for rid, r in d.pre_reqs.items():
        names.append(str(rid))
        held.append(set(r["blocks"]) | (d.tails if str(rid) == str(d.req) else set()))
    return names, held


def _lists_prelude(held: list, blocks) -> str:
    """The fact table ``lists@`` over ``blocks`` and a symbolic request index ``r@``."""
    facts = "".join(f"(assert {'' if b in h else '(not '}(lists@ {r} {b}){'' if b in h else ')'})"
                    for r, h in enumerate(held) for b in sorted(set(blocks)))
    return f"(declare-fun lists@ (Int Int) Bool)(declare-const r@ Int)(assert (<= 0 r@))(assert (< r@ {len(held)})){facts}"


def _z3_in_flight_dest(d: _Snap, ask: _Ask, v) -> None:
    """I4 ``in_flight_dest``: some request ``r@`` holds an in-flight plan's destination."""
    items = [(p, b) for p in d.in_flight for b in sorted(set(p["dests"]))]
    if not items:
        return
    names, held = _pre_lists(d)
    dis = [f"(and (= IDX {k}) (lists@ r@ {b}))" for k, (_p, b) in enumerate(items)]
    for k, model in ask.index("o", dis, prelude=_lists_prelude(held, [b for _p, b in items]), extra=("r@",)):
        p, b = items[k]
        x = names[model["r"]]
        v("in_flight_dest", f"in-flight plan {p['id']} (request {p['request']!r}) copies into block {b}, which "
                            f"request {x!r} holds: the copy writes over a block it reads", in_flight=p["id"], x=b,
          request=x, **model)


def _z3_in_flight_source(d: _Snap, ask: _Ask, v) -> None:
    """I4 ``in_flight_source``: some request ``r@`` other than its own holds an in-flight plan's
    source or fill (its own: -1 for an orphan whose request is not in ``pre``)."""
    names, held = _pre_lists(d)
    items = [(p, role, b, names.index(str(p["request"])) if str(p["request"]) in names else -1)
             for p in d.in_flight for role in ("sources", "fills") for b in sorted(set(p.get(role, [])))]
    if not items:
        return
    dis = [f"(and (= IDX {k}) (lists@ r@ {b}) (not (= r@ {own})))" for k, (_p, _r, b, own) in enumerate(items)]
    for k, model in ask.index("o", dis, prelude=_lists_prelude(held, [it[2] for it in items]), extra=("r@",)):
        p, role, b, own = items[k]
        x = names[model["r"]]
        orphan = "" if own >= 0 else ", not in the snapshot: an orphan of a request that left"
        v("in_flight_source", f"in-flight plan {p['id']} (request {p['request']!r}{orphan}) holds block {b} as a "
                              f"{role[:-1]}, which request {x!r} holds: its end frees a block that request reads",
          in_flight=p["id"], x=b, request=x, **model)


def _z3_plans_overlap(d: _Snap, ask: _Ask, v) -> None:
    """I4 ``plans_overlap``: the in-flight plans' (plan, role, block) holdings name pairwise distinct blocks."""
    items = [(p, role, b) for p in d.in_flight for role in ("sources", "dests", "fills")
             for b in sorted(set(p.get(role, [])))]
    res = ask.distinct({"plans_overlap": [b for _p, _r, b in items]})
    if "plans_overlap" in res:
        a, c, model = res["plans_overlap"]
        (p, ra, b), (q, rc, _b2) = items[a], items[c]
        who = (f"in-flight plan {p['id']} as both a {ra[:-1]} and a {rc[:-1]}" if p is q else
               f"in-flight plans {p['id']} (a {ra[:-1]}) and {q['id']} (a {rc[:-1]})")
        v("plans_overlap", f"block {b} is held by {who}", in_flight=q["id"], x=b, **model)


def _z3_roles(d: _Snap) -> dict:
    """block -> the role in which the plan holds it (a source first, then a fill, then a destination)."""
    roles: dict = {}
    for role, blocks in (("source", d.sources), ("fill", d.fills),
                         ("destination", sorted(set(d.dests) | set(d.fresh_dst_blocks)))):
        for b in blocks:
            roles.setdefault(b, role)
    return roles


def _z3_holds_at(role: str, frees: list, apply, i) -> str:
    """The plan still holds a block of ``role`` at schedule index ``i``: a source while no free
    of it came before, a fill or a destination before the apply."""
    if role == "source":
        return f"(and true {' '.join(f'(not (< {f} {i}))' for f in frees)})"
    return "true" if apply is None else f"(< {i} {apply})"


def _z3_handed_over(d: _Snap, ask: _Ask, v) -> None:
    """I4 ``handed_over`` along the schedule: an ``alloc`` of a block the plan holds, a ``free``
    of one of its destinations, while the plan holds it; then :func:`_z3_handed_in_post`."""
    roles = _z3_roles(d)
    _launch, _fence, apply = _plan_events(d)
    frees: dict = {}
    for i, ev in enumerate(d.schedule):
        for b in ev["blocks"] if ev["kind"] == "free" else ():
            frees.setdefault(b, []).append(i)
    items = [(i, ev, b) for i, ev in enumerate(d.schedule) if ev["kind"] in ("alloc", "free") for b in ev["blocks"]
             if b in roles and (ev["kind"] == "alloc" or roles[b] == "destination")]
    dis = [f"(and (= IDX {k}) {_z3_holds_at(roles[b], frees.get(b, []), apply, i)})"
           for k, (i, _ev, b) in enumerate(items)]
    for k, model in ask.index("o", dis):
        i, ev, b = items[k]
        what = f"handed to request {ev['request']!r}" if ev["kind"] == "alloc" else "freed"
        v("handed_over", f"block {b}, a {roles[b]} plan {d.pid} still holds, is {what} at t={ev['t']} "
                         f"(schedule[{i}]) before the plan lets go of it", event=i, x=b, **model)
    _z3_handed_in_post(d, ask, v, roles, frees, apply)


def _z3_handed_in_post(d: _Snap, ask: _Ask, v, roles: dict, frees: dict, apply) -> None:
    """I4 ``handed_over`` after the plan: another request lists a block of the plan in ``post``
    and no ``alloc`` of it to that request comes once the plan let go of it (after a free of
    it too, for a block ``R`` holds after the plan: a fill, a destination an applied move landed in)."""
    m, n = d.moves, d.n
    landed = {db for t, db in zip(m[:, 0].tolist(), m[:, 3].tolist()) if not (0 <= t < n and d.recorded_evicted[t])}
    kept = set(d.fills) | landed

    def after(x):  # schedule index x comes once the plan let go of the block (a source's first free counts)
        return lambda b: (f"(or false {' '.join(f'(<= {f} {x})' for f in frees.get(b, []))})" if roles[b] == "source"
                          else "false" if apply is None else f"(<= {apply} {x})")

    items, dis = [], []
    for rid, r in d.post_reqs.items():
        if str(rid) == str(d.req):
            continue
        for b in sorted(set(r["blocks"]) & set(roles)):
            allocs = [i for i, ev in enumerate(d.schedule)
                      if ev["kind"] == "alloc" and str(ev["request"]) == str(rid) and b in ev["blocks"]]
            ok = []
            for a in allocs:
                freed = f"(or false {' '.join(f'(and {after(f)(b)} (< {f} {a}))' for f in frees.get(b, []))})"
                ok.append(f"(and {after(a)(b)} {freed if b in kept else 'true'})")
            dis.append(f"(and (= IDX {len(items)}) (not (or false {' '.join(ok)})))")
            items.append((rid, b))
    for k, model in ask.index("o", dis):
        rid, b = items[k]
        v("handed_over", f"after the plan, request {rid!r} lists block {b} ({roles[b]} of plan {d.pid}) which the "
                         f"schedule never handed to it: held twice", x=b, request=str(rid), **model)


def _z3_foreign_write(d: _Snap, ask: _Ask, v) -> None:
    """I4 ``foreign_write``: a ``write`` into a block the plan holds, by any request into a
    destination, by a request other than ``R`` into a source or a fill."""
    S, roles = d.S, _z3_roles(d)
    _launch, _fence, apply = _plan_events(d)
    frees: dict = {}
    for i, ev in enumerate(d.schedule):
        for b in ev["blocks"] if ev["kind"] == "free" else ():
            frees.setdefault(b, []).append(i)
    items = [(i, ev, ev["slot"] // S) for i, ev in enumerate(d.schedule)
             if ev["kind"] == "write" and ev["slot"] // S in roles]
    dis = [f"(and (= IDX {k}) {_z3_holds_at(roles[b], frees.get(b, []), apply, i)} "
           f"{_b(roles[b] == 'destination' or str(ev['request']) != str(d.req))})" for k, (i, ev, b) in enumerate(items)]
    for k, model in ask.index("o", dis):
        i, ev, b = items[k]
        v("foreign_write", f"new token {ev['token']} of request {ev['request']!r} written at t={ev['t']} "
                           f"(schedule[{i}]) into block {b}, a {roles[b]} plan {d.pid} holds", event=i, x=b, **model)


_OWNERSHIP_RULES = (_z3_in_flight_dest, _z3_in_flight_source, _z3_plans_overlap, _z3_handed_over, _z3_foreign_write)


# ---------------------------------------------------------------------------------- API
_CHECKERS = {"I1": _check_i1, "I2": lambda d, ask: _check_i2(d, ask) + _check_overwrite(d, ask), "I3": _check_i3,
             "I4": _check_i4}


def check_snapshot(snap, checks=ALL_CHECKS, evictions_in_flight: bool = True) -> list[Violation]:
    """Every counterexample Z3 finds to the named invariants (``[]``: none).

    Raises :class:`SnapshotError` (naming the field) for a malformed snapshot. With
    ``post`` null (a plan not yet applied) the post-state parts are skipped; everything
    about the moves, the plan's blocks and the schedule so far is still checked.

    Evictions while the copy was in flight are read from the snapshot's own record,
    ``evicted_in_flight`` (the moved tokens whose moves were dropped): a moved token live
    before, not recorded there and not live at its destination afterwards is lost (I1), and
    a recorded one must be dead at its pre slot. An unmoved token may still die in place (a
    policy's eviction during the copy is not the plan's business); pass
    ``evictions_in_flight=False`` when no eviction can have happened: the record is then
    taken as empty and any live token that dies is lost. Tokens added while the copy was in
    flight (``post`` longer than ``pre``) are new: they are checked for unique slots (I2),
    not against ``pre``. The rules are those of :mod:`vtoken.invariants.snapshot_checks`
    (the plain-Python checker, which must agree on every snapshot).
    """
    unknown = [c for c in checks if c not in _CHECKERS]
    if unknown:
        raise ValueError(f"unknown checks {unknown}; choose from {ALL_CHECKS}")
    d = load_checked(snap, evictions_in_flight)
    with _Ask(probe=True) as probe:
        early = []  # every question goes through the probe; kept as a safety net
        for c in ALL_CHECKS:
            if c in checks:
                early += _CHECKERS[c](d, probe)
        if not early and not probe.any_counterexample():
            return []
    out = []
    with _Ask() as ask:
        for c in ALL_CHECKS:
            if c in checks:
                out += _CHECKERS[c](d, ask)
    return out


def check_and_explain(snap, checks=ALL_CHECKS, evictions_in_flight: bool = True) -> str:
    """A readable report of :func:`check_snapshot`'s list: one line per invariant, then each
    counterexample."""
    try:
        d = load_checked(snap, evictions_in_flight)
    except SnapshotError as e:
        return f"malformed snapshot: {e}"
    t0 = time.perf_counter()
    lines = [f"plan {d.pid} on request {d.req!r}: {len(d.moves)} moves, sources {d.sources}, dests {d.dests}"
             f"{f', fills {d.fills}' if d.fills else ''}"
             f"{'' if d.post is not None else ' (not applied: post-state checks skipped)'}"]
    ev = [t for t, e in enumerate(d.recorded_evicted) if e]
    if ev:
        lines.append(f"  tokens evicted while the copy was in flight (recorded; left dead in place): {ev[:16]}"
                     f"{' ...' if len(ev) > 16 else ''}")
    for c in ALL_CHECKS:
        if c not in checks:
            continue
        vs = check_snapshot(snap, (c,), evictions_in_flight)
        lines.append(f"  {c}: {'ok' if not vs else f'{len(vs)} violation(s)'}")
        for v in vs:
            lines.append(f"    - {v.explanation}")
            if v.model:
                lines.append(f"      model: {v.model}")
    lines.append(f"  ({time.perf_counter() - t0:.3f}s)")
    return "\n".join(lines)


def _synthetic_schedule(pre: list, post: list, src: list, S: int, reads: bool) -> list:
    """The synthetic plan's schedule: launch, reads of the pre slots, fence, apply, free, reads of the post slots."""
    live_pre = [t for t in range(len(pre)) if pre[t][2]]
    sched = []
    t = 0

    def ev(kind, **f):
        nonlocal t
        t += 1
        sched.append({"t": t, "kind": kind, **f})

    ev("launch", plan=1)
    if reads:
        ev("read", request="r0", tokens=list(live_pre), slots=[pre[i][0] * S + pre[i][1] for i in live_pre])
    ev("fence", plan=1)
    ev("apply", plan=1)
    ev("free", blocks=list(src))
    if reads:
        ev("read", request="r0", tokens=list(live_pre), slots=[post[i][0] * S + post[i][1] for i in live_pre])
    return sched


def synthetic_snapshot(n_moves: int, S: int = 16, reads: bool = True, in_place: bool = False) -> dict:
    """A valid, applied snapshot with ``n_moves`` moves: half-full source blocks packed into
    fresh destinations, a tail block, the full schedule (launch, reads of the pre slots,
    fence, apply, free, reads of the post slots).

    ``in_place=True``: the same sources, emptied into the holes of the request's own other
    blocks instead (``plan.fills``: each holds ``S // 2`` live tokens, then holes where dead
    tokens last were; no destination at all). The fills stay the request's."""
    half = max(1, S // 2)
    n_src = -(-n_moves // half)
    src = list(range(1, n_src + 1))
    fills: list = []
    fill_live = S // 2
    if in_place:
        holes = S - fill_live
        fills = list(range(n_src + 1, n_src + 1 + -(-n_moves // holes)))
        targets = [(b, o) for b in fills for o in range(fill_live, S)]
        n_dst = 0
    else:
        n_dst = -(-n_moves // S)
        targets = []
    tail = n_src + len(fills) + 1
    dests = list(range(tail + 1, tail + 1 + n_dst))
    headroom = dests + [tail + 1 + n_dst + k for k in range(2)]
    if not in_place:
        targets = [(b, o) for b in dests for o in range(S)]
    pre, post, moves = [], [], []
    k = 0
    for b in src:
        for o in range(S):
            live = o < half and k < n_moves
            pre.append([b, o, live])
            if live:
                db, do = targets[k]
                moves.append([len(pre) - 1, b, o, db, do])
                post.append([db, do, True])
                k += 1
            else:
                post.append([b, o, False])
    for b in fills:  # live tokens first, then dead ones where the holes are
        for o in range(S):
            pre.append([b, o, o < fill_live])
            post.append([b, o, o < fill_live])
    for o in range(S // 2):  # the tail block, half written
        pre.append([tail, o, True])
        post.append([tail, o, True])
    n = len(pre)
    blocks_pre = src + fills + [tail]
    sched = _synthetic_schedule(pre, post, src, S, reads)
    plan = {"id": 1, "request": "r0", "sources": src, "dests": dests, "moves": moves}
    if in_place:
        plan["fills"] = fills
    return {
        "schema": SCHEMA,
        "block_size": S,
        "plan": plan,
        "pre": {"requests": {"r0": {"length": n, "blocks": blocks_pre, "tail_block": tail, "tokens": pre}}},
        "post": {"requests": {"r0": {"length": n, "blocks": sorted(dests + fills + [tail]), "tail_block": None,
                                     "tokens": post}}},
        "shared_blocks": [],
        "headroom": headroom,
        "in_flight": [],
        "schedule": sched,
        "evicted_in_flight": [],
        "dests_used": sorted({mv[3] for mv in moves} - set(fills)),
    }


def z3_check_time(n_moves: int, S: int = 16) -> float:
    """Seconds for ``check_snapshot`` on a synthetic valid snapshot with ``n_moves`` moves."""
    snap = synthetic_snapshot(n_moves, S)
    t0 = time.perf_counter()
    vs = check_snapshot(snap)
    dt = time.perf_counter() - t0
    if vs:  # the synthetic snapshot is valid by construction
        raise AssertionError(f"synthetic snapshot flagged: {vs[:3]}")
    return dt
