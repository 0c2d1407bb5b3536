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

Owners are named, so a violation says who holds what.

Owns: nothing (a pure check over the pool's view and the owners' claims).
May call: invariants.table_checks, collections.
Costs: O(pool) per call: for machines, audits and the periodic full scan, not for a hot path.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping

from .table_checks import InvariantViolation

NULL_BLOCK = 0


def check_ownership(num_blocks: int, free: Iterable[int], refs: Mapping[int, int],
                    owners: Mapping[str, Iterable[int]], reserved: Iterable[int] = (),
                    reserving: Iterable[str] = ()) -> None:
    """Raise :class:`InvariantViolation` (``ownership``) unless every reference has one owner.

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
    free_set = set(free)
    if len(free_set) != len(free):
        dup = sorted(b for b, n in Counter(free).items() if n > 1)
        raise InvariantViolation("ownership", f"blocks {dup[:8]} are in the free queue more than once")
    reserving = set(reserving)
    reserved = set(reserved)
    claims: dict[int, list[str]] = {}
    res_claims: dict[int, list[str]] = {}
    for name, blocks in owners.items():
        target = res_claims if name in reserving else claims
        for b in blocks:
            b = int(b)
            if b == NULL_BLOCK:
                continue
            target.setdefault(b, []).append(name)
    for b in sorted(free_set):
        who = claims.get(b, []) + res_claims.get(b, [])
        if who:
            raise InvariantViolation("ownership", f"block {b} is free but held by {who}: freed while still owned")
        if refs.get(b, 0):
            raise InvariantViolation("ownership", f"block {b} is free with {refs[b]} reference(s)")
        if b in reserved:
            raise InvariantViolation("ownership", f"block {b} is both free and reserved")
    for b in sorted(reserved):
        who = res_claims.get(b, [])
        if len(who) != 1 or claims.get(b):
            raise InvariantViolation(
                "ownership", f"reserved block {b} claimed by {who} as a reservation and by {claims.get(b, [])} as "
                             f"a reference (want exactly one reservation)")
    for b, who in sorted(res_claims.items()):
        if b not in reserved:
            raise InvariantViolation("ownership", f"block {b} claimed as a reservation by {who} but not reserved")
    for b in sorted(set(refs) | set(claims)):
        if b == NULL_BLOCK or b in free_set:
            continue
        n, who = int(refs.get(b, 0)), claims.get(b, [])
        if n > len(who):
            raise InvariantViolation(
                "ownership", f"block {b} has {n} reference(s) but {len(who)} owner(s) {who}: a reference no owner "
                             f"will drop (leak)")
        if n < len(who):
            raise InvariantViolation(
                "ownership", f"block {b} has {n} reference(s) but {len(who)} owner(s) {who}: an owner's reference "
                             f"is gone (early free or double free)")
    used = {b for b, n in refs.items() if n > 0 and b != NULL_BLOCK}
    total = len(free_set) + len(used) + len(reserved)
    if total != num_blocks - 1:
        lost = sorted(set(range(1, num_blocks)) - free_set - used - reserved)
        raise InvariantViolation(
            "ownership", f"free {len(free_set)} + used {len(used)} + reserved {len(reserved)} = {total}, pool "
                         f"{num_blocks - 1}: blocks {lost[:8]} are nowhere (neither free, referenced nor reserved)")
