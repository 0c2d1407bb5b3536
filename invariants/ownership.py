"""The block ownership ledger: every reference a pool counts has exactly one owner.

What this cannot see: only the one moment it is called with, and only the claims it is
given -- an owner that forgot a block, or claims one it does not hold, is believed (the
caller builds the claims from its own books); a block freed and taken again between two
calls; which owner may *write* a block (a plan copying into a block a request reads is the
snapshot checkers' ``in_flight_dest`` / ``foreign_write``, not this ledger's); K/V bytes and
token slots (``table_checks``, ``relocation_hash``). It is a pool-level ledger: the snapshot
checkers derive their own holders from a snapshot and do not call it.

Allocator-level accounting (``check_block_accounting``) says references cover what the
token table uses; it cannot see a reference nobody will ever drop (a leak) or an owner
whose reference is gone (an early free). This check takes the pool's own view (which
blocks are free, each block's reference count, which are reserved) and the owners'
claims (each request's block list, the headroom, in-flight plans, deferred frees, ...),
and demands, block by block:

- a free block has no owner (else: freed while still held -- an early free);
- a used block's reference count equals the number of owner claims on it (more
  references: a leak, a reference no owner will drop; fewer: an owner whose reference is
  gone);
- a reserved block (when the pool has such a state) is claimed by exactly one reserving
  owner and by nothing else;
- free + used + reserved is the whole pool (the null block apart).

Owners are named, so a violation says who holds what. :func:`ownership_violations` returns
every :class:`~vtoken.invariants.violation.Violation` (invariant ``ownership``; ``[]``: the
ledger balances), one function per rule: ``free_twice`` (the free queue holds a block twice),
``free_held``, ``free_referenced``, ``free_reserved`` (a free block owned, referenced or
reserved), ``one_reservation`` (a reserved block not claimed by exactly one reserving
owner), ``reserved_claim`` (a reservation claim on a block not reserved), ``leak`` and
``lost_reference`` (references and owner claims differ), ``pool_total`` (free + used +
reserved is not the pool). :func:`check_ownership` is its raising form (the first of them).

Owns: nothing (a pure check over the pool's view and the owners' claims).
May call: invariants.table_checks, invariants.violation, collections.
Costs: O(pool) per call: for machines, audits and the periodic full scan, not for a hot path.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping

from .table_checks import InvariantViolation
from .violation import Violation, raise_first

NULL_BLOCK = 0
RULES = ("free_twice", "free_held", "free_referenced", "free_reserved", "one_reservation", "reserved_claim", "leak",
         "lost_reference", "pool_total")


def _v(rule: str, why: str, **model) -> Violation:
    return Violation("ownership", why, model, rule)


def _claims(owners: Mapping[str, Iterable[int]], reserving: set) -> tuple[dict, dict]:
    """(block -> owners claiming a reference on it, block -> owners claiming it as a reservation)."""
    claims: dict[int, list[str]] = {}
    res_claims: dict[int, list[str]] = {}
    for name, blocks in owners.items():
        target = res_claims if name in reserving else claims
        for b in blocks:
            b = int(b)
            if b == NULL_BLOCK:
                continue
            target.setdefault(b, []).append(name)
    return claims, res_claims


def _free_twice(free: list):
    if len(set(free)) != len(free):
        dup = sorted(b for b, n in Counter(free).items() if n > 1)
        return _v("free_twice", f"blocks {dup[:8]} are in the free queue more than once", blocks=dup)


def _free_held(b: int, who: list):
    if who:
        return _v("free_held", f"block {b} is free but held by {who}: freed while still owned", block=b, owners=who)


def _free_referenced(b: int, refs: Mapping[int, int]):
    if refs.get(b, 0):
        return _v("free_referenced", f"block {b} is free with {refs[b]} reference(s)", block=b)


def _free_reserved(b: int, reserved: set):
    if b in reserved:
        return _v("free_reserved", f"block {b} is both free and reserved", block=b)


def _one_reservation(b: int, who: list, held: list):
    if len(who) != 1 or held:
        return _v("one_reservation", f"reserved block {b} claimed by {who} as a reservation and by {held} as "
                                     f"a reference (want exactly one reservation)", block=b, owners=who + held)


def _reserved_claim(b: int, who: list, reserved: set):
    if b not in reserved:
        return _v("reserved_claim", f"block {b} claimed as a reservation by {who} but not reserved", block=b,
                  owners=who)


def _leak(b: int, n: int, who: list):
    if n > len(who):
        return _v("leak", f"block {b} has {n} reference(s) but {len(who)} owner(s) {who}: a reference no owner "
                          f"will drop (leak)", block=b, refs=n, owners=who)


def _lost_reference(b: int, n: int, who: list):
    if n < len(who):
        return _v("lost_reference", f"block {b} has {n} reference(s) but {len(who)} owner(s) {who}: an owner's "
                                    f"reference is gone (early free or double free)", block=b, refs=n, owners=who)


def _pool_total(num_blocks: int, free_set: set, refs: Mapping[int, int], reserved: set):
    used = {b for b, n in refs.items() if n > 0 and b != NULL_BLOCK}
    total = len(free_set) + len(used) + len(reserved)
    if total != num_blocks - 1:
        lost = sorted(set(range(1, num_blocks)) - free_set - used - reserved)
        return _v("pool_total", f"free {len(free_set)} + used {len(used)} + reserved {len(reserved)} = {total}, pool "
                                f"{num_blocks - 1}: blocks {lost[:8]} are nowhere (neither free, referenced nor "
                                f"reserved)", blocks=lost)


def ownership_violations(num_blocks: int, free: Iterable[int], refs: Mapping[int, int],
                         owners: Mapping[str, Iterable[int]], reserved: Iterable[int] = (),
                         reserving: Iterable[str] = ()) -> list[Violation]:
    """Every reference without exactly one owner (``[]``: the ledger balances), in the order
    :func:`check_ownership` raises them: the free queue, the free blocks, the reserved ones,
    the reservation claims, the referenced ones, the pool's total.

    Args:
        num_blocks: pool size, the null block (0) included and ignored.
        free: the blocks the pool can hand out now (its free queue).
        refs: reference count of every block that has references (absent: 0).
        owners: owner name -> the blocks it holds one reference on each (a block named
            twice by one owner is two references).
        reserved: blocks in the pool's reserved state (no references; the headroom of an
            allocator that has one), and ``reserving``: the owners whose claims are such
            reservations, not references.
    """
    free = list(free)
    out = [_free_twice(free)]
    free_set, reserved = set(free), set(reserved)
    claims, res_claims = _claims(owners, set(reserving))
    for b in sorted(free_set):
        out += [_free_held(b, claims.get(b, []) + res_claims.get(b, [])), _free_referenced(b, refs),
                _free_reserved(b, reserved)]
    out += [_one_reservation(b, res_claims.get(b, []), claims.get(b, [])) for b in sorted(reserved)]
    out += [_reserved_claim(b, who, reserved) for b, who in sorted(res_claims.items())]
    for b in sorted(set(refs) | set(claims)):
        if b == NULL_BLOCK or b in free_set:
            continue
        n, who = int(refs.get(b, 0)), claims.get(b, [])
        out += [_leak(b, n, who), _lost_reference(b, n, who)]
    out.append(_pool_total(num_blocks, free_set, refs, reserved))
    return [v for v in out if v]


def check_ownership(num_blocks: int, free: Iterable[int], refs: Mapping[int, int],
                    owners: Mapping[str, Iterable[int]], reserved: Iterable[int] = (),
                    reserving: Iterable[str] = ()) -> None:
    """Raise :class:`InvariantViolation` (``ownership``) unless every reference has one owner:
    the first of :func:`ownership_violations` (its arguments), the whole list as ``.violations``."""
    raise_first(ownership_violations(num_blocks, free, refs, owners, reserved, reserving), InvariantViolation)
