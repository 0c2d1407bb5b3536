"""Invariant checkers over plain-data states (``export_state()`` of a table or the spec).

They take plain data so the same checks run on the implementation, on the reference model,
and on snapshots loaded from disk. Each check has two forms: ``*_violations`` returns every
:class:`~vtoken.invariants.violation.Violation` it finds (``[]``: the state holds; one
function per named rule behind it, ``rule`` naming it), and ``check_*`` is a thin wrapper
that raises :class:`InvariantViolation` from the first of them, naming the invariant and
the first offending token or block, the whole list as ``.violations``.

What this cannot see: one state (or one move list) at a time -- nothing about time, the
copy, or what happens between two states (a destination read early, a source freed
early: I3, the snapshot checkers and ``i3_probe``); no K/V bytes (``relocation_hash``);
who holds each reference (``check_block_accounting`` compares counts: an owner whose
reference is gone while the count still matches is ``ownership``'s); it reports the
first offending token or block only (the ``check_*`` form; the list form reports every one it
reaches, a stage whose rules presume an earlier one's asked only when that one holds).

- :func:`unique_mapping_violations` (raising: :func:`check_unique_mapping`): I2 -- every live
  token at exactly one in-range slot, no slot claimed by two tokens (a shared-prefix slot may
  be claimed by several requests only for the same logical token, in a block they all
  reference). Rules: ``located``, ``in_range``, ``referenced``, ``one_per_request``,
  ``shared_only``.
- :func:`conservation_violations` (raising: :func:`check_conservation`): I1 at the metadata
  level -- a move list neither adds, drops nor renames a live token, and every moved token
  ends where its move said. Rules: ``live_ids``, ``moved_twice``, ``move_source``, ``arrival``.
- :func:`block_accounting_violations` (raising: :func:`check_block_accounting`): free + used +
  reserved = total; no block free and referenced at once; the free queue holds no block
  twice; table references never exceed allocator references; ``n_b`` equals a recount of
  live slots. Rules: ``live_count``, ``live_range``, ``refs_count``, ``missing_block``,
  ``free_twice``, ``pool_total``, ``free_in_use``, ``table_ref_free``, ``ref_short``.

Owns: nothing (pure functions over plain data).
May call: invariants.violation, collections.
Costs: O(tokens + pool) per check.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from .violation import Violation, raise_first

# rule names per check: every Violation's ``rule`` is one of its check's
RULES = {
    "unique_mapping": ("located", "in_range", "referenced", "one_per_request", "shared_only"),
    "conservation": ("live_ids", "moved_twice", "move_source", "arrival"),
    "block_accounting": ("live_count", "live_range", "refs_count", "missing_block", "free_twice", "pool_total",
                         "free_in_use", "table_ref_free", "ref_short"),
}


class InvariantViolation(AssertionError):
    """A ``check_*`` wrapper's failure: ``invariant``, the first violation's message, and
    ``violations``, the whole list the ``*_violations`` form returned (one built from the
    message when raised directly)."""

    def __init__(self, invariant: str, message: str, violations: list[Violation] | None = None):
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant
        self.violations = list(violations) if violations is not None else [Violation(invariant, message)]


def _live_slots(state):
    """(block, offset) -> list of (req, token) holding it live."""
    out = defaultdict(list)
    for req, r in state["requests"].items():
        for t, (b, off) in r["loc"].items():
            out[(b, off)].append((req, int(t)))
    return out


# ---------------------------------------------------------------- I2: unique mapping
def _located(req, r):
    if sorted(int(t) for t in r["loc"]) != sorted(r["live"]):
        return Violation("I2", f"request {req!r}: live set and located set differ", {"request": req}, "located")


def _in_range(req, t, b, off, S: int, NB: int):
    if not (0 < b < NB and 0 <= off < S):
        return Violation("I2", f"request {req!r} token {t} at ({b}, {off}): out of range or null block",
                         {"request": req, "token": t, "block": b, "offset": off}, "in_range")


def _referenced(req, r, t, b):
    if b not in r["blocks"]:
        return Violation("I2", f"request {req!r} token {t} in block {b} the request does not reference",
                         {"request": req, "token": t, "block": b}, "referenced")


def _one_per_request(b, off, holders):
    reqs = [h[0] for h in holders]
    if len(set(reqs)) != len(reqs):
        return Violation("I2", f"slot ({b}, {off}) holds two live tokens of request {reqs[0]!r}: {holders}",
                         {"block": b, "offset": off, "holders": holders}, "one_per_request")


def _shared_only(b, off, holders, blocks):
    if len(holders) > 1:
        ids = {h[1] for h in holders}
        if len(ids) > 1 or blocks.get(b, {}).get("refs", 0) < 2:
            return Violation("I2", f"slot ({b}, {off}) aliased by {holders} outside a shared prefix",
                             {"block": b, "offset": off, "holders": holders}, "shared_only")


def unique_mapping_violations(state: dict) -> list[Violation]:
    """Every I2 violation of ``state`` (``[]``: the mapping is unique); per token and per slot
    the first rule it breaks, in the order ``check_unique_mapping`` raises them."""
    S, NB = state["block_size"], state["num_blocks"]
    out = []
    for req, r in state["requests"].items():
        out += filter(None, [_located(req, r)])
        for t, (b, off) in r["loc"].items():
            out += filter(None, [_in_range(req, t, b, off, S, NB) or _referenced(req, r, t, b)])
    for (b, off), holders in _live_slots(state).items():
        out += filter(None, [_one_per_request(b, off, holders) or _shared_only(b, off, holders, state["blocks"])])
    return out


def check_unique_mapping(state: dict) -> None:
    """Raise :class:`InvariantViolation` (``I2``) from the first :func:`unique_mapping_violations`."""
    raise_first(unique_mapping_violations(state), InvariantViolation)


# ---------------------------------------------------------------- I1: conservation
def _live_ids(req, a, b):
    if a["live"] != b["live"] or a["length"] != b["length"]:
        lost = sorted(set(a["live"]) - set(b["live"]))
        gained = sorted(set(b["live"]) - set(a["live"]))
        return Violation("I1", f"request {req!r}: live ids changed (lost {lost[:5]}, gained {gained[:5]})",
                         {"request": req, "lost": lost, "gained": gained}, "live_ids")


def _moved_twice(req, t, moved):
    if int(t) in moved:
        return Violation("I1", f"request {req!r}: token {t} moved twice", {"request": req, "token": t}, "moved_twice")


def _move_source(req, a, t, sb, so):
    if list(a["loc"].get(int(t), [None, None])) != [sb, so]:
        return Violation("I1", f"request {req!r}: token {t} was not at its move's source ({sb}, {so})",
                         {"request": req, "token": t, "source": [sb, so]}, "move_source")


def _arrival(req, a, b, t, moved):
    want = moved.get(t, list(a["loc"][t]))
    if list(b["loc"][t]) != want:
        return Violation("I1", f"request {req!r}: token {t} at {b['loc'][t]}, expected {want}",
                         {"request": req, "token": t, "at": list(b["loc"][t]), "expected": want}, "arrival")


def conservation_violations(pre: dict, moves, post: dict, req) -> list[Violation]:
    """Every I1 violation of ``moves`` taking request ``req`` from ``pre`` to ``post``. The
    stages presume the earlier ones: the moves are asked only when the live ids held, the
    arrivals only when every move was well formed."""
    a, b = pre["requests"][req], post["requests"][req]
    first = _live_ids(req, a, b)
    if first:
        return [first]
    out, moved = [], {}
    for t, sb, so, db, do in moves:
        v = _moved_twice(req, t, moved) or _move_source(req, a, t, sb, so)
        if v:
            out.append(v)
        moved[int(t)] = [int(db), int(do)]
    if out:
        return out
    return [v for t in a["live"] if (v := _arrival(req, a, b, t, moved))]


def check_conservation(pre: dict, moves, post: dict, req) -> None:
    """Raise :class:`InvariantViolation` (``I1``) from the first :func:`conservation_violations`."""
    raise_first(conservation_violations(pre, moves, post, req), InvariantViolation)


# ---------------------------------------------------------------- block accounting
def _acc(rule: str, why: str, **model) -> Violation:
    return Violation("accounting", why, model, rule)


def _live_count(b, info, recount):
    if info["live"] != recount.get(b, 0):
        return _acc("live_count", f"block {b}: n_b={info['live']} but {recount.get(b, 0)} live slots", block=b)


def _live_range(b, info, S: int):
    if not 0 <= info["live"] <= S:
        return _acc("live_range", f"block {b}: n_b={info['live']} outside [0, {S}]", block=b)


def _refs_count(b, info, refs):
    if info["refs"] != refs.get(b, 0):
        return _acc("refs_count", f"block {b}: refs={info['refs']} but {refs.get(b, 0)} requests reference it", block=b)


def _missing_block(b, state):
    if b not in state["blocks"]:
        return _acc("missing_block", f"block {b} is referenced or live but missing from the block table", block=b)


def _free_twice(queue):
    if len(set(queue)) != len(queue):
        dup = [b for b, c in Counter(queue).items() if c > 1]
        return _acc("free_twice", f"block(s) {dup} in the free queue twice", blocks=dup)


def _pool_total(queue, reserved, used, total: int):
    if len(queue) + len(reserved) + len(used) != total:
        return _acc("pool_total", f"free {len(queue)} + used {len(used)} + reserved {len(reserved)} != {total}")


def _free_in_use(b, used, reserved):
    if b in used or b in reserved or b == 0:
        return _acc("free_in_use", f"block {b} is free and {'null' if b == 0 else 'used/reserved'} at once", block=b)


def _table_ref_free(b, queue, reserved):
    if b in queue or b in reserved:
        return _acc("table_ref_free", f"block {b} is referenced by the table but "
                                      f"{'free' if b in queue else 'reserved'} in the allocator", block=b)


def _ref_short(b, n, aref):
    if aref.get(b, 0) < n:
        return _acc("ref_short", f"block {b}: {n} table references but allocator ref {aref.get(b, 0)}", block=b)


def _alloc_violations(alloc: dict, refs: Counter) -> list[Violation]:
    """The allocator side of :func:`block_accounting_violations`."""
    total = alloc["num_blocks"] - 1
    queue, reserved, aref = alloc["free_queue"], set(alloc["reserved"]), alloc["ref"]
    used = set(aref)
    out = [_free_twice(queue), _pool_total(queue, reserved, used, total)]
    out += [_free_in_use(b, used, reserved) for b in queue]
    for b, n in refs.items():
        out += [_table_ref_free(b, queue, reserved), _ref_short(b, n, aref)]
    return [v for v in out if v]


def block_accounting_violations(state: dict, alloc: dict | None = None) -> list[Violation]:
    """Every accounting violation of the table ``state`` (and of the allocator's ``alloc``
    against it, when given), in the order ``check_block_accounting`` raises them."""
    S = state["block_size"]
    recount = Counter(b for (b, _off) in _live_slots(state))
    refs = Counter(b for r in state["requests"].values() for b in r["blocks"])
    out = []
    for b, info in state["blocks"].items():
        out += [_live_count(b, info, recount), _live_range(b, info, S), _refs_count(b, info, refs)]
    out += [_missing_block(b, state) for b in set(recount) | set(refs)]
    out = [v for v in out if v]
    return out if alloc is None else out + _alloc_violations(alloc, refs)


def check_block_accounting(state: dict, alloc: dict | None = None) -> None:
    """Raise :class:`InvariantViolation` (``accounting``) from the first :func:`block_accounting_violations`."""
    raise_first(block_accounting_violations(state, alloc), InvariantViolation)
