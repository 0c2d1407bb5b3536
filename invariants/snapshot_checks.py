"""Invariants I1-I4 over a plan snapshot, in plain Python: sets, dicts and loops.

This is the second, independent implementation of the rules the Z3 checker
(:mod:`vtoken.invariants.z3_checks`) encodes as "find a counterexample". The two share
only the schema (``vtoken.snapshot.validate``, which both call first) and the rule list
below; they must agree on every snapshot: the same set of violated invariants (the
checkers' own mutation test, :mod:`vtoken.invariants.mutants`, and the agreement tests
assert it). A malformed snapshot raises :class:`vtoken.errors.SnapshotError` naming the
field; otherwise :func:`check_snapshot` returns a :class:`Violation` per broken rule
instance (``[]``: the snapshot satisfies I1-I4).

What this cannot see (its reach; the same for :mod:`vtoken.invariants.z3_checks`):

- only what one snapshot records: one plan, the requests its writer lists (the system's
  writers list only the plan's own request in ``pre`` and ``post``, so a third request's
  blocks, and a block two requests share, are seen only where a snapshot lists them), the
  other plans in flight at plan time (their moves, their ends and their frees are in their
  own snapshots, not here), and the events the writer recorded;
- a request's own frees (a finish, an all-dead release) and an orphan's frees are not
  recorded: so a block a request or an in-flight plan holds is known held at plan time
  only, and a hand-over of a request's block after apply is seen in ``post``, not along
  the schedule;
- the K/V bytes themselves only through ``plan.digests`` (a copy that writes the wrong bytes
  with no digests recorded passes), and time only as the schedule's order: a race the
  schedule does not record (a read the writer did not log) is invisible;
- the pool: reference counts, the free queue and leaks are :mod:`vtoken.invariants.ownership`'s
  (a block no one frees is not a violation of any snapshot).

Notation: ``R`` = the plan's request, ``n`` its pre length, ``pre[t]`` / ``post[t]`` token
``t``'s ``(slot, live)`` before / after the plan (slot = ``block * S + offset``), ``E`` the
recorded ``evicted_in_flight`` (taken as empty with ``evictions_in_flight=False``: no
eviction can have happened), *shared* = ``shared_blocks`` united with every block that
two or more requests of ``pre`` list in their ``blocks``, ``F`` = the plan's fills
(``plan.fills``, absent == ``[]``: the request's own blocks whose holes take moved tokens,
in-place compaction), ``D`` = the plan's fresh destination blocks (``plan.dests`` and the
blocks its moves write that are not fills). A *hole* of a fill is a slot of it holding no
live token of ``R`` in ``pre``. Every rule about out-of-place plans (``F`` empty) is as it
was before fills existed.

What can be derived is derived, not read from a field: sharedness from every request's
``blocks``; the *tail* (the block still written) from the tokens: token ``n - 1`` never
moves (its block is never a source), so its block is where position ``n - 1`` was written
and where position ``n`` will be unless ``n`` is a multiple of ``S`` (``blocks`` is a set, not
the positional list, so a next block not yet written is not in the snapshot). The tail
rules use that block and ``tail_block`` when recorded; a ``tail_block`` that is not that
block is itself a violation. Events are ordered by their index in ``schedule`` (times are
non-decreasing; equal times are in list order).

- **I1** token conservation (rule names in brackets)

  - [move_token] every move's token is a token of ``R``, live before the plan, at the
    move's source slot;
  - [moved_twice] no token is moved twice;
  - after the plan (``post`` not null): [arrival] each moved token not in ``E`` is live
    at its move's destination -- one that is not is LOST, whatever its post slot;
    [evicted] each token in ``E`` is dead at its pre slot (a resurrected token, or one
    moved although recorded evicted, breaks I1); [unmoved] an unmoved token ``t < n``
    keeps its slot while live, never becomes live, and dies only in place (a policy may
    evict it while the copy flies; with ``evictions_in_flight=False`` not even that);
    tokens ``t >= n`` (the request grew meanwhile) are new and not compared;
  - [digest] with ``plan.digests``: each applied move's pre and post K/V digests agree
    (where both are recorded).

- **I2** unique mapping

  - [pre_unique] ``R``'s live slots before the plan, the moves' destination slots and the
    other requests' live slots outside shared blocks are pairwise distinct (no move lands
    on an occupied slot, no two moves share a destination; so a move into a fill lands on
    a hole);
  - [post_unique] after the plan no two live tokens share a slot: ``R``'s, and every other
    request's in ``post`` outside blocks shared (in ``pre``, or listed by two requests of
    ``post`` when not a block of the plan: a prefix hit while the copy flew);
  - [null] no live token and no destination in the null block 0 (``validate`` refuses
    both; kept as a second line);
  - [dangling] after the plan no live token of ``R`` sits in a source block or in a block
    the schedule frees, unless an ``alloc`` of that block to ``R`` follows its last free;
  - [overwrite] no ``write`` (of any request) lands on a slot holding a live token of ``R``:
    before the plan's ``apply`` a live pre slot, after it a moved token's destination (not
    in ``E``) or an unmoved live token's slot; unless the block was freed, or handed to
    another request, earlier in the schedule.

- **I3** pre-attention visibility. The copy completes at an unknown ``c`` after its launch;
  every launch issues it again, so ``c`` follows the *last* launch; a ``fence`` of the
  plan (the first after the last launch) means every later event (in list order) happens
  after ``c``. Without a launch nothing is known. So an event that touches the plan's
  blocks is a violation [early] unless it comes after that fence (an event before a
  second launch -- a free, a reuse, a write of a source -- is one): a read of a slot in
  ``D`` or of a hole of a fill (the copy writes there; reads of a fill's live slots are
  fine); a free of a source or a fill; an alloc of a source or a
  fill (to anyone) or of a block in ``D`` to another request; a write into a source block,
  onto a destination slot or onto a hole of a fill. [stale_read] A read of ``R``'s live
  token before the plan's ``apply`` uses its pre slot; after it, a moved token not in
  ``E`` is read at its destination, and a token in ``E`` is not read at all (dead since
  apply: its old slot is in a freed source). [dead_read] No read of a token of ``R`` dead
  before the plan (dead tokens stay dead: whatever its slot holds, e.g. a fill's hole
  after the copy, is not it).

- **I4** layout-aware planning

  - [consistent] per move: token live at the move's source, source block in
    ``plan.sources``, destination block in ``plan.dests`` or ``plan.fills``;
  - [emptied] every live token of ``R`` in a source block is moved;
  - [blocks] sources are ``R``'s blocks; no source or destination is shared, the tail, or
    both a source and a destination; destinations are fresh (not ``R``'s, not another
    request's) and in the headroom; fills are ``R``'s private blocks (in its ``pre``
    blocks, not shared, not the tail, neither a source nor a destination); no block of the
    plan (source, fill or destination) belongs to an in-flight plan (its sources, dests or
    fills; any request);
  - [duplicate_id] no in-flight plan carries the plan's id, and no two in-flight plans
    share one;
  - [duplicate_block] ``plan.sources``, ``plan.dests`` and ``plan.fills`` name no block
    twice;
    [dst_once] each destination slot is used once;
  - [decrease] the block count strictly decreases: more sources than destinations listed
    and than destination blocks (not fills) used by the moves;
  - [dests_used] when recorded, ``dests_used`` is exactly the blocks other than fills the
    moves not in ``E`` write;
  - [free_before_apply] no source or fill is freed before the plan's ``apply``;
  - [fill_kept] after the plan (``post`` not null) every fill is still one of ``R``'s
    blocks;
  - [tail_block] a recorded ``tail_block`` is the derived tail (null when ``n`` is 0);
  - [one_plan] at most one plan per request in flight: no in-flight plan copies blocks
    of ``R`` (its sources or fills among ``R``'s ``pre`` blocks; an orphaned plan of an
    earlier request of the same name holds none), nor two of another request of ``pre``;
  - [headroom] the headroom holds free blocks only: none of the plan's sources or fills,
    no block of a request of ``pre``, no block of an in-flight plan.

- **I4, ownership** across the whole snapshot: who holds each block, derived from the
  snapshot alone. At plan time each request of ``pre`` holds its ``blocks`` (``R`` its tail
  too) and each in-flight plan its sources, fills and destinations; requests may share a
  block (read only), and a plan's source or fill is also its own request's. Along the
  schedule the plan holds a source until its first ``free`` and a fill or a destination
  until its ``apply`` (all the schedule without one); ``post`` is the state after it.

  - [in_flight_dest] no in-flight plan's destination is a block a request holds (its copy
    would write over tokens the request reads: ``R``'s live block or tail, a third
    request's block);
  - [in_flight_source] an in-flight plan's source or fill is held by no request but its own
    (its apply, or its end as an orphan, frees a block another request reads); an orphan,
    whose request is not in ``pre``, holds no request's block;
  - [plans_overlap] no block is held by two in-flight plans, nor by one in two roles;
  - [handed_over] no ``alloc`` hands out a block the plan holds, and no ``free`` frees one
    of its destinations, before the plan lets go of it; after the plan no other request
    lists a block of the plan in ``post`` unless the schedule allocated it to that request
    once the plan let go of it -- after a free of it when ``R`` holds it after the plan (a
    fill, a destination a move not in ``E`` landed in);
  - [foreign_write] no ``write`` lands in a block the plan holds by a request that does not
    hold it: any request's into a destination, another request's into a source or fill.

Owns: nothing (pure functions).
May call: vtoken.snapshot (validate), invariants.violation (Violation), collections; never z3.
Costs: linear in the snapshot (moves, tokens, events x their tokens; a plan block's allocs x its frees),
no solver.
"""

from __future__ import annotations

from collections import Counter

from vtoken.snapshot import validate

from .violation import Violation  # the one result type of every checker (re-exported here)

ALL_CHECKS = ("I1", "I2", "I3", "I4")
# The rule names of the module docstring, per invariant: every Violation's ``rule`` is one.
RULES = {
    "I1": ("move_token", "moved_twice", "arrival", "evicted", "unmoved", "digest"),
    "I2": ("pre_unique", "post_unique", "null", "dangling", "overwrite"),
    "I3": ("early", "stale_read", "dead_read"),
    "I4": ("consistent", "emptied", "blocks", "duplicate_id", "duplicate_block", "dst_once", "decrease", "dests_used",
           "free_before_apply", "fill_kept", "tail_block", "one_plan", "headroom", "in_flight_dest", "in_flight_source",
           "plans_overlap", "handed_over", "foreign_write"),
}
__all__ = ["ALL_CHECKS", "RULES", "Violation", "check_snapshot", "derived_shared"]


def _loc(S: int, slot: int) -> str:
    return f"(block {slot // S}, offset {slot % S})"


def derived_shared(snap: dict) -> set:
    """``shared_blocks`` united with every block two or more requests of ``pre`` list."""
    count = Counter()
    for r in snap["pre"]["requests"].values():
        count.update(set(r["blocks"]))
    return set(snap["shared_blocks"]) | {b for b, c in count.items() if c > 1}


class _View:
    """The parts of a validated snapshot the rules read."""

    def __init__(self, snap: dict, evictions_in_flight: bool):
        self.S = S = snap["block_size"]
        plan = snap["plan"]
        self.pid, self.req = plan["id"], plan["request"]
        self.sources, self.dests = list(plan["sources"]), list(plan["dests"])
        self.fills = list(plan.get("fills", []))
        self.fill_set = set(self.fills)
        self.moves = [tuple(mv) for mv in plan["moves"]]
        self.digests = plan.get("digests")
        reqs = snap["pre"]["requests"]
        r = reqs[self.req]
        self.n = r["length"]
        self.pre_slot = [b * S + o for b, o, _l in r["tokens"]]
        self.pre_live = [bool(l) for _b, _o, l in r["tokens"]]
        self.pre_blocks = set(r["blocks"])
        # The tail (the block of the last position, still written) is derived from the tokens:
        # token n-1 never moves (its block is never a source), so its block is where position
        # n - 1 was written and, unless n is a multiple of S, where position n will be.
        # ``tail_block`` is a writer's record of it, checked against the derivation.
        self.tail_field = r.get("tail_block")
        self.tail_derived = r["tokens"][self.n - 1][0] if self.n else None
        self.tails = {b for b in (self.tail_field, self.tail_derived) if b is not None}
        self.pre_live_slots = {s for s, l in zip(self.pre_slot, self.pre_live) if l}
        self.post = snap.get("post") is not None
        self.post_slot, self.post_live = [], []
        self.post_blocks = set()
        if self.post:
            q = snap["post"]["requests"][self.req]
            self.post_blocks = set(q["blocks"])
            self.post_slot = [b * S + o for b, o, _l in q["tokens"]]
            self.post_live = [bool(l) for _b, _o, l in q["tokens"]]
        self.recorded_evicted = set(snap["evicted_in_flight"])
        self.evicted = self.recorded_evicted if evictions_in_flight else set()
        self.tolerate_evictions = evictions_in_flight
        self.shared = derived_shared(snap)
        self.others = []  # (request, token, slot) live in other requests, outside shared blocks
        self.other_blocks = {}  # block -> a request other than R listing it
        for rid, o in reqs.items():
            if rid == self.req:
                continue
            for b in o["blocks"]:
                self.other_blocks.setdefault(b, rid)
            for t, (b, off, live) in enumerate(o["tokens"]):
                if live and b not in self.shared:
                    self.others.append((rid, t, b * S + off))
        self.post_others = []  # (request, token, slot) live after the plan in other requests, outside shared blocks
        if self.post:
            self._post_others(snap, plan)
        self.pre_by_name = {str(rid): o for rid, o in reqs.items()}
        self.post_reqs = snap["post"]["requests"] if self.post else {}  # every request's post (ownership rules)
        self.headroom = set(snap["headroom"])
        self.in_flight = list(snap["in_flight"])
        self.schedule = list(snap["schedule"])
        self.dests_used = snap.get("dests_used")
        self.move_dst_blocks = {mv[3] for mv in self.moves}
        self.dst_all = set(self.dests) | (self.move_dst_blocks - self.fill_set)  # fresh destinations
        self.moved = {}  # token -> index of its first move
        for k, mv in enumerate(self.moves):
            self.moved.setdefault(mv[0], k)
        self._own_events()

    def _own_events(self) -> None:
        """The plan's own events: its last launch (every launch issues the copy again: what
        a later launch reads must still be there), its first apply, the first fence after
        the last launch. Events are ordered by their index (equal times in list order)."""
        self.launch = self.apply = self.fence = None
        self.launches = 0
        for i, ev in enumerate(self.schedule):
            if ev.get("plan") != self.pid:
                continue
            if ev["kind"] == "launch":
                self.launch = i
                self.launches += 1
            elif ev["kind"] == "apply" and self.apply is None:
                self.apply = i
        if self.launch is not None:
            for i, ev in enumerate(self.schedule):
                if i > self.launch and ev.get("plan") == self.pid and ev["kind"] == "fence":
                    self.fence = i
                    break

    def _post_others(self, snap: dict, plan: dict) -> None:
        """Other requests' live tokens after the plan, outside blocks shared in ``pre`` or
        listed by two requests of ``post`` (a prefix hit while the copy flew); a block of
        the plan is never shared that way (it is the request's alone)."""
        S, post_reqs = self.S, snap["post"]["requests"]
        count = Counter()
        for o in post_reqs.values():
            count.update(set(o["blocks"]))
        ours = set(plan["sources"]) | set(plan["dests"]) | self.fill_set | {mv[3] for mv in plan["moves"]}
        shared = self.shared | ({b for b, c in count.items() if c > 1} - ours)
        for rid, o in post_reqs.items():
            if rid == self.req:
                continue
            for t, (b, off, live) in enumerate(o["tokens"]):
                if live and b not in shared:
                    self.post_others.append((rid, t, b * S + off))


# ---------------------------------------------------------------------------------- I1
def _i1(d: _View) -> list[Violation]:
    out, S, n = [], d.S, d.n

    def v(rule, why, **model):
        out.append(Violation("I1", why, model, rule))

    for k, (t, sb, so, db, do) in enumerate(d.moves):
        src, dst = sb * S + so, db * S + do
        if not 0 <= t < n:
            v("move_token", f"move #{k} names token {t}, which request {d.req!r} does not have (length {n})", move=k)
        elif not d.pre_live[t]:
            v("move_token", f"move #{k} moves token {t}, which is not live before the plan", move=k)
        elif d.pre_slot[t] != src:
            v("move_token", f"move #{k}: token {t} is at {_loc(S, d.pre_slot[t])}, not at the move's source "
                            f"{_loc(S, src)}", move=k)
        elif d.post and t not in d.evicted and not (d.post_live[t] and d.post_slot[t] == dst):
            if not d.post_live[t]:
                v("arrival", f"move #{k}: token {t} is LOST: not live at its destination {_loc(S, dst)} after the "
                             f"plan, and not recorded as evicted in flight", move=k)
            else:
                v("arrival", f"move #{k}: token {t} ends at {_loc(S, d.post_slot[t])}, not at its destination "
                             f"{_loc(S, dst)}", move=k)
    seen = {}
    for k, mv in enumerate(d.moves):
        if mv[0] in seen:
            v("moved_twice", f"token {mv[0]} is moved twice (moves #{seen[mv[0]]} and #{k})", a=seen[mv[0]], b=k)
            break
        seen[mv[0]] = k
    if not d.post:
        return out
    for t in sorted(d.evicted):  # recorded evicted while the copy flew: dead where it was
        if d.post_live[t] or d.post_slot[t] != d.pre_slot[t]:
            state = "live" if d.post_live[t] else "dead"
            v("evicted", f"token {t} is recorded as evicted in flight but is {state} at {_loc(S, d.post_slot[t])} "
                         f"after the plan (expected dead at {_loc(S, d.pre_slot[t])})", token=t)
    for t in range(n):
        if t in d.moved:
            continue
        pl, ql, ps, qs = d.pre_live[t], d.post_live[t], d.pre_slot[t], d.post_slot[t]
        if pl and not ql and not (d.tolerate_evictions and ps == qs):
            v("unmoved", f"live token {t} of request {d.req!r} is dropped by the plan"
                         + ("" if ps == qs else f" (dead at {_loc(S, qs)}, not where it was)"), token=t)
        elif ql and not pl:
            v("unmoved", f"token {t} of request {d.req!r} becomes live after the plan (renamed or invented)", token=t)
        elif pl and ql and ps != qs:
            v("unmoved", f"token {t} is not moved but goes from {_loc(S, ps)} to {_loc(S, qs)}", token=t)
    if d.digests is not None:
        pre, post = d.digests["pre"], d.digests["post"]
        for k, mv in enumerate(d.moves):
            if mv[0] in d.evicted or pre[k] is None or post[k] is None:
                continue
            if pre[k] != post[k]:
                v("digest", f"move #{k}: token {mv[0]}'s K/V digest changed across the copy "
                            f"({pre[k]:#018x} before, {post[k]:#018x} after)", move=k)
    return out


# ---------------------------------------------------------------------------------- I2
def _first_collision(vals: list) -> tuple[int, int] | None:
    seen = {}
    for k, x in enumerate(vals):
        if x in seen:
            return seen[x], k
        seen[x] = k
    return None


def _i2(d: _View) -> list[Violation]:
    out, S = [], d.S

    def v(rule, why, **model):
        out.append(Violation("I2", why, model, rule))

    lab, vals = [], []
    for t in range(d.n):
        if d.pre_live[t]:
            lab.append(f"live token {t}")
            vals.append(d.pre_slot[t])
    for k, mv in enumerate(d.moves):
        lab.append(f"move #{k} (token {mv[0]})")
        vals.append(mv[3] * S + mv[4])
    for rid, t, s in d.others:
        lab.append(f"live token {t} of request {rid!r}")
        vals.append(s)
    hit = _first_collision(vals)
    if hit:
        a, b = hit
        v("pre_unique", f"before the plan, {lab[a]} and {lab[b]} share slot {_loc(S, vals[a])}",
          slot=[vals[a] // S, vals[a] % S])
    for x, what in zip(vals, lab):
        if x < S:  # block 0: validate refuses it, a second line
            v("null", f"{what} is in the null block 0")
            break
    if not d.post:
        return out
    live = [(t, s) for t, (s, l) in enumerate(zip(d.post_slot, d.post_live)) if l]
    # every request's post counts: another request's live token on a slot of R's is an alias
    lab = ([f"live token {t} of request {d.req!r}" for t, _s in live]
           + [f"live token {t} of request {rid!r}" for rid, t, _s in d.post_others])
    vals = [s for _t, s in live] + [s for _rid, _t, s in d.post_others]
    hit = _first_collision(vals)
    if hit:
        a, b = hit
        sa = vals[a]
        why = (f"live tokens {live[a][0]} and {live[b][0]} of request {d.req!r}" if b < len(live)
               else f"{lab[a]} and {lab[b]}")
        v("post_unique", f"after the plan, {why} share slot {_loc(S, sa)}", slot=[sa // S, sa % S])
    if any(s < S for _t, s in live):
        v("null", "after the plan, a live token is in the null block 0")
    # blocks the request must not hold a live token in after the plan
    last_free, reacquired = {}, set()
    for i, ev in enumerate(d.schedule):
        if ev["kind"] == "free":
            for b in ev["blocks"]:
                last_free[b] = i
                reacquired.discard(b)
        elif ev["kind"] == "alloc" and str(ev["request"]) == str(d.req):
            reacquired.update(b for b in ev["blocks"] if b in last_free)
    gone = (set(d.sources) | set(last_free)) - reacquired
    for t, s in live:
        if s // S in gone:
            what = "a source block of the plan" if s // S in d.sources else "a block the schedule frees"
            v("dangling", f"after the plan, live token {t} of request {d.req!r} maps to {_loc(S, s)}, in {what}",
              token=t, block=s // S)
            break
    return out


def _overwrites(d: _View) -> list[Violation]:
    """[overwrite]: no write lands on a slot holding a live token of ``R`` -- before the
    plan's apply its pre slots, after it the moved tokens' destinations (not ``E``) and the
    unmoved tokens' slots -- unless the block was freed or handed to another request
    earlier in the schedule. Checked whether or not the plan was applied."""
    S = d.S
    before = {d.pre_slot[t]: t for t in range(d.n) if d.pre_live[t]}
    after = {}
    for s, t in before.items():
        k = d.moved.get(t)
        if k is None:
            after[s] = t
        elif t not in d.evicted:
            after[d.moves[k][3] * S + d.moves[k][4]] = t
    released, out = set(), []
    for i, ev in enumerate(d.schedule):
        kind = ev["kind"]
        if kind == "free" or (kind == "alloc" and str(ev["request"]) != str(d.req)):
            released.update(ev["blocks"])
        elif kind == "write":
            s = ev["slot"]
            held = after if d.apply is not None and i > d.apply else before
            if s in held and s // S not in released:
                out.append(Violation("I2", f"new token {ev['token']} of request {ev['request']!r} written at t={ev['t']} "
                                           f"(schedule[{i}]) onto {_loc(S, s)}, where live token {held[s]} of request "
                                           f"{d.req!r} is", {"event": i, "token": held[s]}, "overwrite"))
    return out


# ---------------------------------------------------------------------------------- I3
def _i3(d: _View) -> list[Violation]:
    """I3: [early] (nothing touches the plan's blocks before its copy is launched and fenced),
    then [dead_read] and [stale_read] (the request's own reads, one pass over its reads)."""
    if not d.schedule:
        return []
    return _early(d) + _own_reads(d)


def _early(d: _View) -> list[Violation]:
    """[early]: no read, write, free or hand-over of the plan's blocks before its launch and fence."""
    out, S, sched = [], d.S, d.schedule
    src, dst, fills = set(d.sources), d.dst_all, d.fill_set
    dst_slots = {mv[3] * S + mv[4] for mv in d.moves}

    def hole(s):  # a slot of a fill without a live token of R before the plan: the copy may write it
        return s // S in fills and s not in d.pre_live_slots

    w = sched[d.fence]["t"] if d.fence is not None else None
    for i, ev in enumerate(sched):
        kind = ev["kind"]
        if kind == "read":
            hit = [(t, s) for t, s in zip(ev["tokens"], ev["slots"]) if s // S in dst or hole(s)]
        elif kind == "free":
            hit = [b for b in ev["blocks"] if b in src or b in fills]
        elif kind == "alloc":
            other = str(ev["request"]) != str(d.req)
            hit = [b for b in ev["blocks"] if b in src or b in fills or (other and b in dst)]
        elif kind == "write":
            s = ev["slot"]
            hit = [(ev["token"], s)] if (s // S in src or s in dst_slots or hole(s)) else []
        else:
            continue
        if not hit or (d.fence is not None and i > d.fence):  # after the fence: list order breaks time ties
            continue
        lt = sched[d.launch]["t"] if d.launch is not None else None
        when = (f"at t={ev['t']} (schedule[{i}]) " +
                ("with no launch of the plan" if d.launch is None else
                 f"before the copy is launched{' again' if d.launches > 1 else ''} at t={lt} "
                 f"(schedule[{d.launch}])" if i < d.launch else
                 "before any fence of the plan" if w is None else f"not after the fence at t={w}"))
        if kind == "read":
            what = "destination slot(s)" if any(s // S in dst for _t, s in hit) else "fill hole slot(s)"
            why = (f"attention reads {what} of plan {d.pid} "
                   f"({', '.join(f'token {t} at {_loc(S, s)}' for t, s in hit[:4])}) {when}")
        elif kind == "free":
            role = "source" if all(b in src for b in hit) else "fill" if all(b in fills for b in hit) else "source/fill"
            why = f"{role} block(s) {hit} of plan {d.pid} freed {when}"
        elif kind == "alloc":
            why = f"block(s) {hit} of plan {d.pid} handed to request {ev['request']!r} {when}"
        else:
            (t, s), = hit
            role = ("in a source block" if s // S in src else "on a destination slot" if s in dst_slots
                    else "on a hole of a fill")
            why = f"new token {t} written at {_loc(S, s)}, {role} of plan {d.pid}, {when}"
        out.append(Violation("I3", why, {"event": i, "t": ev["t"]}, "early"))
    return out


def _own_reads(d: _View) -> list[Violation]:
    """[dead_read] and [stale_read]: each read of the request maps each token to where it is
    (its source slot before apply, its destination after; never a dead token)."""
    out, S = [], d.S
    for i, ev in enumerate(d.schedule):
        if ev["kind"] != "read" or str(ev["request"]) != str(d.req):
            continue
        after = d.apply is not None and i > d.apply
        for t, s in zip(ev["tokens"], ev["slots"]):
            if not 0 <= t < d.n:
                continue  # grown while the copy flew: not in pre
            if not d.pre_live[t]:  # dead before the plan, so dead ever since: whatever its slot holds now
                out.append(Violation("I3", f"dead token read: the read at t={ev['t']} (schedule[{i}]) uses "
                                           f"{_loc(S, s)} for token {t}, dead before the plan", {"event": i, "token": t},
                                     "dead_read"))
                continue
            if after and t in d.evicted:  # its move dropped at apply: dead, its old slot in a freed source
                out.append(Violation("I3", f"stale slot mapping: the read at t={ev['t']} (schedule[{i}], after apply) "
                                           f"uses {_loc(S, s)} for token {t}, evicted while the copy flew (dead since "
                                           f"apply: no slot holds it)", {"event": i, "token": t}, "stale_read"))
                continue
            k = d.moved.get(t)
            exp = d.moves[k][3] * S + d.moves[k][4] if (after and k is not None and t not in d.evicted) \
                else d.pre_slot[t]
            if s != exp:
                out.append(Violation("I3", f"stale slot mapping: the read at t={ev['t']} (schedule[{i}], "
                                           f"{'after' if after else 'before'} apply) uses {_loc(S, s)} for token {t}, "
                                           f"expected {_loc(S, exp)}", {"event": i, "token": t}, "stale_read"))
    return out


# ---------------------------------------------------------------------------------- I4
def _consistent(d: _View, v) -> None:
    """[consistent]: each move names a live token of the snapshot, at its recorded slot, out
    of a source into a destination or fill."""
    S, n, srcs, dests, fills = d.S, d.n, set(d.sources), set(d.dests), d.fill_set
    for k, (t, sb, so, db, do) in enumerate(d.moves):
        if not 0 <= t < n:
            v("consistent", f"move #{k} names token {t} outside the snapshot (length {n})", move=k)
        elif not d.pre_live[t]:
            v("consistent", f"move #{k} moves token {t}, dead in the snapshot the plan was made from", move=k)
        elif d.pre_slot[t] != sb * S + so:
            v("consistent", f"move #{k}: token {t} is at {_loc(S, d.pre_slot[t])} in the snapshot, not at "
                            f"{_loc(S, sb * S + so)} (inconsistent snapshot)", move=k)
        elif sb not in srcs:
            v("consistent", f"move #{k} takes token {t} out of block {sb}, which is not one of the plan's sources "
                            f"{d.sources}", move=k)
        elif db not in dests and db not in fills:
            v("consistent", f"move #{k} sends token {t} to block {db}, which is not one of the plan's destinations "
                            f"{d.dests} nor of its fills {d.fills}", move=k)


def _emptied(d: _View, v) -> None:
    """[emptied]: every live token of a source block is moved."""
    S, srcs = d.S, set(d.sources)
    for t in range(d.n):
        if d.pre_live[t] and d.pre_slot[t] // S in srcs and t not in d.moved:
            v("emptied", f"live token {t} in source block {d.pre_slot[t] // S} is not moved: the source is not emptied",
              token=t)


def _blocks(d: _View, v) -> None:
    """[blocks]: sources are the request's private, non-tail blocks; destinations fresh
    headroom blocks; fills the request's own private blocks; no role shared; no block of an
    in-flight plan."""
    srcs, dests, fills = set(d.sources), set(d.dests), d.fill_set
    for b in sorted(srcs):
        if b not in d.pre_blocks:
            v("blocks", f"source block {b} is not one of request {d.req!r}'s blocks (inconsistent snapshot)", x=b)
        if b in d.shared:
            v("blocks", f"plan {d.pid} moves shared-prefix block {b} (a source)", x=b)
        if b in d.tails:
            v("blocks", f"plan {d.pid} moves the tail block {b} (still being written)", x=b)
        if b in d.dst_all:
            v("blocks", f"block {b} is both a source and a destination of plan {d.pid}", x=b)
        if b in fills:
            v("blocks", f"block {b} is both a source and a fill of plan {d.pid}", x=b)
    for b in sorted(d.dst_all):
        if b in d.shared:
            v("blocks", f"plan {d.pid} writes into shared-prefix block {b} (a destination)", x=b)
        if b in d.tails:
            v("blocks", f"plan {d.pid} writes into the tail block {b}", x=b)
        if b in d.pre_blocks:
            v("blocks", f"destination block {b} already belongs to request {d.req!r} (not a fresh block)", x=b)
        elif b in d.other_blocks:
            v("blocks", f"destination block {b} belongs to request {d.other_blocks[b]!r}", x=b)
        if b not in d.headroom:
            v("blocks", f"destination block {b} is not in the headroom {sorted(d.headroom)}", x=b)
    for b in sorted(fills):  # a fill: R's own private block, not the tail, neither a source nor a destination
        if b not in d.pre_blocks:
            v("blocks", f"fill block {b} is not a block of request {d.req!r}", x=b)
        if b in d.shared:
            v("blocks", f"plan {d.pid} fills shared-prefix block {b}", x=b)
        if b in d.tails:
            v("blocks", f"plan {d.pid} fills the tail block {b} (still being written)", x=b)
        if b in dests:
            v("blocks", f"block {b} is both a fill and a destination of plan {d.pid}", x=b)
    ours = srcs | d.dst_all | fills
    for p in d.in_flight:
        both = sorted(ours & (set(p["sources"]) | set(p["dests"]) | set(p.get("fills", []))))
        if both:
            v("blocks", f"plan {d.pid} overlaps in-flight plan {p['id']} (request {p['request']!r}): block {both[0]}",
              in_flight=p["id"], x=both[0])


def _duplicate_id(d: _View, v) -> None:
    """[duplicate_id]: no in-flight plan carries this plan's id or another's."""
    for p in d.in_flight:
        if p["id"] == d.pid:
            v("duplicate_id", f"in-flight plan {p['id']} (request {p['request']!r}) carries plan {d.pid}'s own id",
              in_flight=p["id"])
    for pid, c in sorted(Counter(p["id"] for p in d.in_flight).items()):
        if c > 1:
            v("duplicate_id", f"{c} in-flight plans carry id {pid}", in_flight=pid)


def _duplicate_block(d: _View, v) -> None:
    """[duplicate_block]: the plan's sources, destinations and fills each name a block once."""
    for name, lst in (("sources", d.sources), ("dests", d.dests), ("fills", d.fills)):
        twice = sorted(b for b, k in Counter(lst).items() if k > 1)
        if twice:
            v("duplicate_block", f"plan.{name} names block {twice[0]} twice")


def _dst_once(d: _View, v) -> None:
    """[dst_once]: no destination slot is written by two moves."""
    S = d.S
    hit = _first_collision([mv[3] * S + mv[4] for mv in d.moves])
    if hit:
        a, b = hit
        mv = d.moves[a]
        v("dst_once", f"destination slot {_loc(S, mv[3] * S + mv[4])} is used twice (moves #{a} and #{b})", a=a, b=b)


def _decrease(d: _View, v) -> None:
    """[decrease]: the plan frees more blocks than it uses (listed and written)."""
    n_src, n_used, n_listed = len(set(d.sources)), len(d.move_dst_blocks - d.fill_set), len(set(d.dests))
    if n_src <= n_used or n_src <= n_listed:
        v("decrease", f"plan {d.pid} does not reduce the block count: {n_src} source(s) vs {n_listed} destination(s) "
                      f"listed, {n_used} used", sources=n_src, dests_listed=n_listed, dests_used=n_used)


def _dests_used(d: _View, v) -> None:
    """[dests_used]: the recorded used destinations are the blocks the applied moves write."""
    if d.dests_used is not None:
        want = {mv[3] for mv in d.moves if mv[0] not in d.recorded_evicted} - d.fill_set
        if set(d.dests_used) != want:
            v("dests_used", f"dests_used {sorted(d.dests_used)} differs from the blocks the applied moves write "
                            f"{sorted(want)}")


def _free_before_apply(d: _View, v) -> None:
    """[free_before_apply]: no source or fill is freed before the plan is applied."""
    srcs, fills = set(d.sources), d.fill_set
    last = len(d.schedule) if d.apply is None else d.apply
    for i, ev in enumerate(d.schedule):
        if ev["kind"] == "free" and i < last:
            hit = [b for b in ev["blocks"] if b in srcs or b in fills]
            if hit:
                role = "source" if all(b in srcs for b in hit) else "fill" if all(b in fills for b in hit) \
                    else "source/fill"
                v("free_before_apply", f"{role} block(s) {hit} freed at t={ev['t']} (schedule[{i}]) before plan "
                                       f"{d.pid} is applied", event=i)


def _fill_kept(d: _View, v) -> None:
    """[fill_kept]: every fill is still the request's block after the plan."""
    if d.post:
        for b in sorted(d.fill_set - d.post_blocks):
            v("fill_kept", f"fill block {b} is no longer a block of request {d.req!r} after the plan", x=b)


def _tail_block(d: _View, v) -> None:
    """[tail_block] (derived): the recorded tail block is the block of the last position."""
    if d.tail_field is not None and d.tail_field != d.tail_derived:
        last = ("the request is empty" if d.tail_derived is None
                else f"token {d.n - 1}, the last position, is in block {d.tail_derived}")
        v("tail_block", f"tail_block {d.tail_field} of request {d.req!r} is not its tail ({last})", x=d.tail_field)


def _one_plan(d: _View, v) -> None:
    """[one_plan] (derived): at most one plan per request in flight."""
    for k, p, x in _second_plans(d):
        v("one_plan", f"in-flight plan {p['id']} copies blocks of request {x!r} while "
                      f"{f'plan {d.pid}' if x == str(d.req) else 'another in-flight plan'} of the same request is in "
                      f"flight (at most one plan per request)", in_flight=p["id"], entry=k)


def _headroom(d: _View, v) -> None:
    """[headroom] (derived): the headroom holds free blocks only."""
    held = _held(d)
    for b in sorted(d.headroom & held.keys()):
        v("headroom", f"headroom block {b} is {held[b]}: the headroom holds free blocks only", x=b)


def _i4(d: _View) -> list[Violation]:
    """Every I4 rule, one function each (:data:`_I4_RULES`, in the order of ``RULES["I4"]``)."""
    out = []

    def v(rule, why, **model):
        out.append(Violation("I4", why, model, rule))

    for rule in _I4_RULES.values():
        rule(d, v)
    return out


def _second_plans(d: _View) -> list:
    """``(index, entry, request)`` of each in-flight plan that is a second plan of a request in
    flight: the request's own (current) plan, since it copies blocks the request holds in
    ``pre`` (an orphan of an earlier incarnation of the same name holds none of them), after
    the snapshot's plan (for ``R``) or an earlier such entry."""
    count = Counter({str(d.req): 1})
    out = []
    for k, p in enumerate(d.in_flight):
        x = str(p["request"])
        o = d.pre_by_name.get(x)
        if o is None or not (set(p["sources"]) | set(p.get("fills", []))) & set(o["blocks"]):
            continue
        count[x] += 1
        if count[x] > 1:
            out.append((k, p, x))
    return out


def _held(d: _View) -> dict:
    """block -> what holds it: the plan's sources and fills, every request's blocks in
    ``pre``, every in-flight plan's blocks (none of them may be in the headroom)."""
    held = {}
    for b in d.sources:
        held.setdefault(b, f"a source of plan {d.pid}")
    for b in d.fills:
        held.setdefault(b, f"a fill of plan {d.pid}")
    for rid, o in d.pre_by_name.items():
        for b in o["blocks"]:
            held.setdefault(b, f"a block of request {rid!r}")
    for p in d.in_flight:
        for b in p["sources"] + p["dests"] + p.get("fills", []):
            held.setdefault(b, f"a block of in-flight plan {p['id']}")
    return held


# ---------------------------------------------------------------------------------- I4: ownership
# Who holds each block, derived from the snapshot alone. At plan time (the moment ``pre``,
# ``in_flight`` and ``headroom`` describe): each request of ``pre`` holds its ``blocks`` (``R``
# its tail too), each in-flight plan its sources, fills and destinations. Legal co-holders are
# requests among themselves (a shared block: read, never written), and a plan's source or
# fill with the plan's own request (it reads them until the copy ends). Along the schedule,
# the plan holds a source until its first ``free``, a fill or a destination until its
# ``apply`` (the whole schedule without one). ``post`` is the state at apply: a block of the
# plan another request lists there is held twice unless the schedule freed it and then
# allocated it to that request. The writers record no free of a request's own blocks (a
# finish, an all-dead release) nor an orphan's frees, and no end of another in-flight plan:
# so a request's or an in-flight plan's holding is known at plan time only (see "What this
# cannot see").
def _request_holds(d: _View) -> dict:
    """block -> the names of the requests of ``pre`` holding it at plan time (``R``: its tail too)."""
    held: dict = {}
    for rid, o in d.pre_by_name.items():
        for b in set(o["blocks"]) | (d.tails if rid == str(d.req) else set()):
            held.setdefault(b, []).append(rid)
    return held


def _orphan_note(d: _View, p: dict) -> str:
    return "" if str(p["request"]) in d.pre_by_name else ", not in the snapshot: an orphan of a request that left"


def _in_flight_dest(d: _View, v) -> None:
    """[in_flight_dest] no in-flight plan's destination is a block a request holds at plan time
    (its copy writes over tokens that request reads: a live block, ``R``'s tail, a third
    request's block)."""
    held = _request_holds(d)
    for p in d.in_flight:
        for b in sorted(set(p["dests"])):
            if b in held:
                v("in_flight_dest", f"in-flight plan {p['id']} (request {p['request']!r}) copies into block {b}, which "
                                    f"request {held[b][0]!r} holds: the copy writes over a block it reads",
                  in_flight=p["id"], x=b, request=held[b][0])


def _in_flight_source(d: _View, v) -> None:
    """[in_flight_source] an in-flight plan's source or fill is held at plan time by no request
    but its own (its apply, or its end as an orphan, frees that block while another request
    reads it); an orphan (its request not in ``pre``) holds none of any request's blocks."""
    held = _request_holds(d)
    for p in d.in_flight:
        for role in ("sources", "fills"):
            for b in sorted(set(p.get(role, []))):
                other = [x for x in held.get(b, ()) if x != str(p["request"])]
                if other:
                    v("in_flight_source", f"in-flight plan {p['id']} (request {p['request']!r}{_orphan_note(d, p)}) "
                                          f"holds block {b} as a {role[:-1]}, which request {other[0]!r} holds: its "
                                          f"end frees a block that request reads", in_flight=p["id"], x=b,
                      request=other[0])


def _plans_overlap(d: _View, v) -> None:
    """[plans_overlap] no block is held by two in-flight plans, nor by one in two roles."""
    seen: dict = {}
    for p in d.in_flight:
        for role in ("sources", "dests", "fills"):
            for b in sorted(set(p.get(role, []))):
                if b in seen:
                    q, r = seen[b]
                    who = (f"in-flight plan {p['id']} as both a {r[:-1]} and a {role[:-1]}" if q is p else
                           f"in-flight plans {q['id']} (a {r[:-1]}) and {p['id']} (a {role[:-1]})")
                    v("plans_overlap", f"block {b} is held by {who}", in_flight=p["id"], x=b)
                else:
                    seen[b] = (p, role)


def _plan_windows(d: _View) -> dict:
    """block -> (role, stop): the plan holds each of its blocks from plan time until schedule
    index ``stop`` (exclusive): a source until its first free, a fill or a destination until
    the apply (``len(schedule)``: no event ends it)."""
    end = len(d.schedule)
    first_free: dict = {}
    for i, ev in enumerate(d.schedule):
        if ev["kind"] == "free":
            for b in ev["blocks"]:
                first_free.setdefault(b, i)
    applied = end if d.apply is None else d.apply
    win: dict = {}
    for b in d.sources:
        win.setdefault(b, ("source", first_free.get(b, end)))
    for b in d.fills:
        win.setdefault(b, ("fill", applied))
    for b in sorted(d.dst_all):
        win.setdefault(b, ("destination", applied))
    return win


def _handed_over(d: _View, v) -> None:
    """[handed_over] a block the plan holds is not handed to a request (``alloc``), nor a
    destination freed, before the plan lets go of it (:func:`_plan_windows`); and after the
    plan no other request lists a block of the plan in ``post`` unless the schedule handed
    it over (:func:`_handed_in_post`)."""
    win = _plan_windows(d)
    for i, ev in enumerate(d.schedule):
        if ev["kind"] not in ("alloc", "free"):
            continue
        for b in ev["blocks"]:
            role, stop = win.get(b, (None, -1))
            # a source's or fill's free is [free_before_apply]'s; a destination is never freed by the plan
            if i < stop and (ev["kind"] == "alloc" or role == "destination"):
                what = f"handed to request {ev['request']!r}" if ev["kind"] == "alloc" else "freed"
                v("handed_over", f"block {b}, a {role} plan {d.pid} still holds, is {what} at t={ev['t']} "
                                 f"(schedule[{i}]) before the plan lets go of it", event=i, x=b)
    _handed_in_post(d, v, win)


def _handed_in_post(d: _View, v, win: dict) -> None:
    """The ``post`` half of [handed_over]: another request lists a block of the plan after it
    only when the schedule allocated the block to that request once the plan let go of it --
    and, for a block ``R`` holds after the plan (a fill, a destination a move landed in), after
    a free of it too (``R`` does not hand a block over without freeing it)."""
    ev_gone = d.recorded_evicted
    kept = d.fill_set | ({mv[3] for mv in d.moves if mv[0] not in ev_gone} - d.fill_set)
    frees: dict = {}
    handed = set()  # (request, block) handed over by the schedule
    for i, ev in enumerate(d.schedule):
        if ev["kind"] == "free":
            for b in ev["blocks"]:
                frees.setdefault(b, []).append(i)
        elif ev["kind"] == "alloc":
            for b in ev["blocks"]:
                stop = win.get(b, (None, len(d.schedule)))[1]
                freed = any(stop <= j < i for j in frees.get(b, ()))
                if b in win and i >= stop and (freed or b not in kept):
                    handed.add((str(ev["request"]), b))
    for rid, o in d.post_reqs.items():
        if str(rid) == str(d.req):
            continue
        for b in sorted(set(o["blocks"]) & set(win)):
            if (str(rid), b) not in handed:
                v("handed_over", f"after the plan, request {rid!r} lists block {b} ({win[b][0]} of plan {d.pid}) "
                                 f"which the schedule never handed to it: held twice", x=b, request=str(rid))


def _foreign_write(d: _View, v) -> None:
    """[foreign_write] no ``write`` lands in a block the plan holds (:func:`_plan_windows`) by a
    request that does not hold it: any request into a destination, a request other than ``R``
    into a source or a fill."""
    win = _plan_windows(d)
    for i, ev in enumerate(d.schedule):
        if ev["kind"] != "write":
            continue
        b = ev["slot"] // d.S
        role, stop = win.get(b, (None, -1))
        if i < stop and (role == "destination" or str(ev["request"]) != str(d.req)):
            v("foreign_write", f"new token {ev['token']} of request {ev['request']!r} written at t={ev['t']} "
                               f"(schedule[{i}]) into block {b}, a {role} plan {d.pid} holds", event=i, x=b)


_OWNERSHIP_RULES = (_in_flight_dest, _in_flight_source, _plans_overlap, _handed_over, _foreign_write)

# rule name -> the one function that checks it (the keys are exactly ``RULES["I4"]``)
_I4_RULES = {"consistent": _consistent, "emptied": _emptied, "blocks": _blocks, "duplicate_id": _duplicate_id,
             "duplicate_block": _duplicate_block, "dst_once": _dst_once, "decrease": _decrease,
             "dests_used": _dests_used, "free_before_apply": _free_before_apply, "fill_kept": _fill_kept,
             "tail_block": _tail_block, "one_plan": _one_plan, "headroom": _headroom,
             "in_flight_dest": _in_flight_dest, "in_flight_source": _in_flight_source,
             "plans_overlap": _plans_overlap, "handed_over": _handed_over, "foreign_write": _foreign_write}
assert tuple(_I4_RULES) == RULES["I4"], "one function per named I4 rule"


_CHECKERS = {"I1": _i1, "I2": lambda d: _i2(d) + _overwrites(d), "I3": _i3, "I4": _i4}


def check_snapshot(snap, checks=ALL_CHECKS, evictions_in_flight: bool = True) -> list[Violation]:
    """Every violation of the named invariants (``[]``: none); the rules are the module
    docstring's. Raises :class:`SnapshotError` (naming the field) for a malformed snapshot.

    ``evictions_in_flight=False``: no eviction can have happened while the copy flew, so
    ``evicted_in_flight`` is taken as empty and an unmoved live token that dies is lost.
    """
    unknown = [c for c in checks if c not in _CHECKERS]
    if unknown:
        raise ValueError(f"unknown checks {unknown}; choose from {ALL_CHECKS}")
    validate(snap)
    d = _View(snap, evictions_in_flight)
    out = []
    for c in ALL_CHECKS:
        if c in checks:
            out += _CHECKERS[c](d)
    return out
