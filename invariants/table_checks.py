"""Invariant checkers over plain-data states (``export_state()`` of a table or the spec).

They take plain data so the same checks run on the implementation, on the reference model,
and on snapshots loaded from disk. Each returns nothing and raises
:class:`InvariantViolation` naming the invariant and the first offending token or block.

What this cannot see: one state (or one move list) at a time -- nothing about time, the
copy, or what happens between two states (a destination read early, a source freed
early: I3, the snapshot checkers and ``i3_probe``); no K/V bytes (``relocation_hash``);
who holds each reference (``check_block_accounting`` compares counts: an owner whose
reference is gone while the count still matches is ``ownership``'s); it reports the
first offending token or block only.

- :func:`check_unique_mapping`: I2 -- every live token at exactly one in-range slot, no slot
  claimed by two tokens (a shared-prefix slot may be claimed by several requests only for
  the same logical token, in a block they all reference).
- :func:`check_conservation`: I1 at the metadata level -- a move list neither adds, drops
  nor renames a live token, and every moved token ends where its move said.
- :func:`check_block_accounting`: free + used + reserved = total; no block free and
  referenced at once; the free queue holds no block twice; table references never exceed
  allocator references; ``n_b`` equals a recount of live slots.

Owns: nothing (pure functions over plain data).
May call: collections only.
Costs: O(tokens + pool) per check.
"""

from __future__ import annotations

from collections import Counter, defaultdict


class InvariantViolation(AssertionError):
    def __init__(self, invariant: str, message: str):
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant


def _live_slots(state):
    """(block, offset) -> list of (req, token) holding it live."""
    out = defaultdict(list)
    for req, r in state["requests"].items():
        for t, (b, off) in r["loc"].items():
            out[(b, off)].append((req, int(t)))
    return out


def check_unique_mapping(state: dict) -> None:
    S, NB = state["block_size"], state["num_blocks"]
    blocks = state["blocks"]
    for req, r in state["requests"].items():
        if sorted(int(t) for t in r["loc"]) != sorted(r["live"]):
            raise InvariantViolation("I2", f"request {req!r}: live set and located set differ")
        for t, (b, off) in r["loc"].items():
            if not (0 < b < NB and 0 <= off < S):
                raise InvariantViolation("I2", f"request {req!r} token {t} at ({b}, {off}): out of range or null block")
            if b not in r["blocks"]:
                raise InvariantViolation("I2", f"request {req!r} token {t} in block {b} the request does not reference")
    for (b, off), holders in _live_slots(state).items():
        reqs = [h[0] for h in holders]
        if len(set(reqs)) != len(reqs):
            raise InvariantViolation("I2", f"slot ({b}, {off}) holds two live tokens of request {reqs[0]!r}: {holders}")
        if len(holders) > 1:
            ids = {h[1] for h in holders}
            if len(ids) > 1 or blocks.get(b, {}).get("refs", 0) < 2:
                raise InvariantViolation("I2", f"slot ({b}, {off}) aliased by {holders} outside a shared prefix")


def check_conservation(pre: dict, moves, post: dict, req) -> None:
    a, b = pre["requests"][req], post["requests"][req]
    if a["live"] != b["live"] or a["length"] != b["length"]:
        lost = sorted(set(a["live"]) - set(b["live"]))
        gained = sorted(set(b["live"]) - set(a["live"]))
        raise InvariantViolation("I1", f"request {req!r}: live ids changed (lost {lost[:5]}, gained {gained[:5]})")
    moved = {}
    for t, sb, so, db, do in moves:
        if int(t) in moved:
            raise InvariantViolation("I1", f"request {req!r}: token {t} moved twice")
        if list(a["loc"].get(int(t), [None, None])) != [sb, so]:
            raise InvariantViolation("I1", f"request {req!r}: token {t} was not at its move's source ({sb}, {so})")
        moved[int(t)] = [int(db), int(do)]
    for t in a["live"]:
        want = moved.get(t, list(a["loc"][t]))
        if list(b["loc"][t]) != want:
            raise InvariantViolation("I1", f"request {req!r}: token {t} at {b['loc'][t]}, expected {want}")


def check_block_accounting(state: dict, alloc: dict | None = None) -> None:
    S = state["block_size"]
    recount = Counter(b for (b, _off) in _live_slots(state))
    refs = Counter(b for r in state["requests"].values() for b in r["blocks"])
    for b, info in state["blocks"].items():
        if info["live"] != recount.get(b, 0):
            raise InvariantViolation("accounting", f"block {b}: n_b={info['live']} but {recount.get(b, 0)} live slots")
        if not 0 <= info["live"] <= S:
            raise InvariantViolation("accounting", f"block {b}: n_b={info['live']} outside [0, {S}]")
        if info["refs"] != refs.get(b, 0):
            raise InvariantViolation("accounting", f"block {b}: refs={info['refs']} but {refs.get(b, 0)} requests reference it")
    for b in set(recount) | set(refs):
        if b not in state["blocks"]:
            raise InvariantViolation("accounting", f"block {b} is referenced or live but missing from the block table")
    if alloc is None:
        return
    total = alloc["num_blocks"] - 1
    queue, reserved, aref = alloc["free_queue"], set(alloc["reserved"]), alloc["ref"]
    if len(set(queue)) != len(queue):
        dup = [b for b, c in Counter(queue).items() if c > 1]
        raise InvariantViolation("accounting", f"block(s) {dup} in the free queue twice")
    used = set(aref)
    if len(queue) + len(reserved) + len(used) != total:
        raise InvariantViolation("accounting", f"free {len(queue)} + used {len(used)} + reserved {len(reserved)} != {total}")
    for b in queue:
        if b in used or b in reserved or b == 0:
            raise InvariantViolation("accounting", f"block {b} is free and {'null' if b == 0 else 'used/reserved'} at once")
    for b, n in refs.items():
        if b in queue or b in reserved:
            raise InvariantViolation("accounting", f"block {b} is referenced by the table but {'free' if b in queue else 'reserved'} in the allocator")
        if aref.get(b, 0) < n:
            raise InvariantViolation("accounting", f"block {b}: {n} table references but allocator ref {aref.get(b, 0)}")
