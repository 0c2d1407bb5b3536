"""The adapter's runtime checks: its assumptions verified against vLLM's pool, not against
the adapter's own intentions.

``RuntimeChecks(adapter)`` reads the adapter's state (headroom, held destinations, plans in
flight, the mirror, the fence ledger, pending releases) and vLLM's (``req_to_blocks``,
``deferred_frees``, every block's ``ref_cnt`` and hash) and raises
:class:`~.assumptions.AdapterAssumptionError` naming the broken assumption:
``fence``, ``reservation``, ``ownership``, ``prefix_hash``, ``null_substitution`` (see
``check_pool``) and ``table_in_step`` (``check_table``). It owns nothing and changes
nothing. Cost: O(blocks the adapter holds + request lists) per ``check_pool``, O(blocks of
the live requests) per ``check_table``.
"""

from __future__ import annotations

from collections import Counter

from .assumptions import AdapterAssumptionError


class RuntimeChecks:
    def __init__(self, adapter):
        self.ad = adapter

    def holders(self) -> Counter:
        """References on each block from request lists and vLLM's deferred frees."""
        ad = self.ad
        c: Counter = Counter()
        for lst in ad.req_to_blocks.values():
            for b in lst:
                if not b.is_null:
                    c[b.block_id] += 1
        for _, blocks in ad.scheduler.deferred_frees:
            for b in blocks:
                if not b.is_null:
                    c[b.block_id] += 1
        return c

    def check_pool(self, where: str) -> None:
        """Reservation, ownership, fence and prefix-hash checks against the pool itself, then
        the lists against their mirror."""
        ad = self.ad
        ad.fence.check()
        holders = self.holders()
        mine: Counter = Counter()
        kind: dict[int, str] = {}
        for b in ad.headroom:
            mine[b.block_id] += 1
            kind[b.block_id] = "headroom"
        for r, v in ad.held.items():
            for b in v:
                mine[b.block_id] += 1
                kind[b.block_id] = f"destination of request {r!r}"
        for p in ad.plans.values():
            for b in p.sources:
                mine[b.block_id] += 1
                kind[b.block_id] = f"source of plan {p.id} (request {p.req_id!r}, fence {p.seq})"
            for b in p.dests:
                mine[b.block_id] += 1
                kind[b.block_id] = f"destination of in-flight plan {p.id} (request {p.req_id!r})"
        in_lists = {}
        for r, lst in ad.req_to_blocks.items():
            for b in lst:
                if not b.is_null:
                    in_lists.setdefault(b.block_id, r)
        for b in ad.headroom:
            bid = b.block_id
            if bid in in_lists:
                raise AdapterAssumptionError(
                    "reservation", f"{where}: headroom block {bid} is in request {in_lists[bid]!r}'s block list "
                    f"(ref_cnt {b.ref_cnt})")
            if b.ref_cnt != 1 or b.block_hash is not None:
                raise AdapterAssumptionError(
                    "reservation", f"{where}: headroom block {bid} has ref_cnt {b.ref_cnt} (want 1), "
                    f"hash {'set' if b.block_hash is not None else 'none'}")
        cached = ad.pool.cached_block_hashes_by_block
        for bid, n in mine.items():
            blk = ad.block(bid)
            want = n + holders.get(bid, 0)
            k = kind[bid]
            if blk.ref_cnt != want:
                check = "fence" if k.startswith("source") else "ownership"
                raise AdapterAssumptionError(
                    check, f"{where}: block {bid} ({k}) has ref_cnt {blk.ref_cnt}, but the adapter holds {n} and "
                    f"request lists / deferred frees hold {holders.get(bid, 0)}: it was returned to the pool "
                    f"while still held (freed before its fence)")
            if "destination" in k and (blk.block_hash is not None or bid in cached):
                raise AdapterAssumptionError(
                    "prefix_hash", f"{where}: block {bid} ({k}) carries a prefix-cache hash "
                    f"({blk.block_hash!r}) although it holds relocated tokens of mixed positions")
        for p in ad.plans.values():
            own = ad.req_to_blocks.get(p.req_id, []) if not p.orphaned else []
            for b in p.sources:
                if any(x is b for x in own):
                    raise AdapterAssumptionError(
                        "null_substitution", f"{where}: source block {b.block_id} of plan {p.id} is still in "
                        f"request {p.req_id!r}'s block list")
        ad.mirror.check_lists(where)

    def check_table(self) -> None:
        """Every block the token table references for a live request is one the scheduler
        side holds for it (its list, its destinations, an in-flight plan, a pending release)."""
        ad = self.ad
        t = ad.table
        processed = ad.scheduler.processed_step_seq
        pend: dict[str, set] = {}
        for _, r, b in ad.pending_release:
            pend.setdefault(r, set()).add(b)
        inflight: dict[str, set] = {}
        for p in ad.plans.values():
            inflight.setdefault(p.req_id, set()).update(p.source_ids + p.dest_ids)
        m = ad.mirror
        for r in m.ids:
            if r not in t or m.incarnation.get(r, 0) > processed:
                continue
            ok = set(m.pos.get(r, {})) | {b.block_id for b in ad.held.get(r, ())} | \
                pend.get(r, set()) | inflight.get(r, set())
            extra = [b for b in t.block_array(r).tolist() if b not in ok]
            if extra:
                raise AdapterAssumptionError(
                    "table_in_step", f"request {r!r}: the token table references blocks {sorted(extra)} that the "
                    f"scheduler side does not hold for it (step {processed})")

    def check_all(self) -> None:
        self.check_pool("check_all")
        self.check_table()
