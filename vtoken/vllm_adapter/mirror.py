"""The block-list mirror: each request's positional block ids exactly as vLLM's outputs sent
them, and null substitution, for the KV cache group the token table mirrors (``group``; the
other groups' new entries are recorded for the checks, their lists are vLLM's).

Owns: per request ``ids`` (the positional block ids), ``pos`` (block id -> index), ``subst``
(index -> block id replaced by ``null_block``), ``incarnation`` (the step that (re)started the
list), ``where`` (block id -> requests whose list holds it) and ``expect`` (the KVCacheBlock
objects the list must hold, checked by identity). It never frees a block. ``detach`` is the
one place a list changes under vLLM: the entry becomes ``null_block``, the length stays.
May call: nothing but ``assumptions``; it writes only ``null_block`` into vLLM's lists.
Costs: O(new block ids) per output, O(1) per detach, O(list) per :meth:`check_lists`.
"""

from __future__ import annotations

from itertools import compress
from operator import is_, itemgetter
from typing import Callable, Optional

from .assumptions import AdapterAssumptionError


class BlockMirror:
    def __init__(self, req_to_blocks, null_block, blocks, on_start: Optional[Callable[[str, int], None]] = None,
                 group: Optional[int] = 0, groups: int = 1):
        self.req_to_blocks = req_to_blocks  # vLLM's live dict: request -> list of KVCacheBlock
        self.group = group  # the index of the mirrored group in the outputs' block_ids (None: none)
        self.groups = int(groups)  # KV cache groups in the outputs' block_ids
        self.null = null_block
        self.blocks = blocks  # vLLM's pool.blocks: block id -> its KVCacheBlock (blocks[i].block_id == i)
        self.on_start = on_start  # called with (request, seq) when a list (re)starts
        self.ids: dict[str, list[int]] = {}
        self.expect: dict[str, list] = {}  # the list vLLM must hold: blocks[id], null where substituted
        self.pos: dict[str, dict[int, int]] = {}
        self.subst: dict[str, dict[int, int]] = {}
        self.incarnation: dict[str, int] = {}
        self.where: dict[int, set] = {}  # block id -> requests whose list holds it (not substituted)
        self.changed: set = set()  # requests whose list changed since take_changed()
        self.started: set = set()  # requests whose list (re)started since take_started()
        self.new_ids: list[tuple[str, int]] = []  # (request, block id) entered a list since take_new_ids()

    def __contains__(self, r) -> bool:
        return r in self.ids

    def __getitem__(self, r) -> list[int]:
        """``r``'s positional block ids as the outputs gave them."""
        return self.ids[r]

    def observe(self, sched_out, seq_next: int) -> None:
        """Mirror one ``SchedulerOutput`` (``seq_next``: the step it carries)."""
        g = self.group
        c = sched_out.scheduled_cached_reqs
        if self.groups > 1 or g is None:
            self._observe_others(sched_out)  # other groups' new entries: for the checks only
        if g is None:
            return
        for d in sched_out.scheduled_new_reqs:
            self.start(d.req_id, list(d.block_ids[g]), seq_next)
        resumed = c.resumed_req_ids
        # a decode step grows few lists: only requests with new blocks (or resumed) are visited;
        # vLLM sends None for a request with none, so without a resumed one C picks them out
        grown = [(r, nb) for r, nb in zip(c.req_ids, c.new_block_ids) if (nb and nb[g]) or r in resumed] if resumed \
            else [(r, nb) for r, nb in compress(zip(c.req_ids, c.new_block_ids), c.new_block_ids) if nb[g]]
        for r, nb in grown:
            ids = list(nb[g]) if nb else []
            if r in resumed:
                self.start(r, ids, seq_next)
            elif ids:
                m = self.ids.setdefault(r, [])
                pos = self.pos.setdefault(r, {})
                ex = self.expect.setdefault(r, [])
                for b in ids:
                    pos[b] = len(m)
                    m.append(b)
                    ex.append(self.blocks[b])
                    self.where.setdefault(b, set()).add(r)
                self.new_ids += [(r, b) for b in ids]
                self.changed.add(r)

    def _observe_others(self, sched_out) -> None:
        """Record ``(request, block id)`` for every block that entered a list of a group other
        than the mirrored one (those lists are vLLM's: not mirrored, checked against what the
        adapter holds). O(new block ids)."""
        g = self.group
        c = sched_out.scheduled_cached_reqs
        pairs = [(d.req_id, d.block_ids) for d in sched_out.scheduled_new_reqs]
        pairs += [(r, nb) for r, nb in zip(c.req_ids, c.new_block_ids) if nb is not None]
        null = self.null.block_id
        self.new_ids += [(r, b) for r, per_group in pairs for k, ids in enumerate(per_group) if k != g
                         for b in ids if b != null]

    def start(self, r: str, ids: list[int], seq: int) -> None:
        """A new block list for ``r`` (a new request or a resumed one)."""
        self._unindex(r)
        w = self.where
        for b in [b for b in ids if b in w]:  # a block another list holds (a prefix hit)
            w[b].add(r)
        w.update({b: {r} for b in ids if b not in w})  # a prompt's blocks: one comprehension, not a call each
        self.new_ids += [(r, b) for b in ids]
        self.changed.add(r)
        self.started.add(r)
        self.ids[r] = ids
        self.expect[r] = [self.blocks[b] for b in ids]
        self.pos[r] = {b: i for i, b in enumerate(ids)}
        self.subst[r] = {}
        self.incarnation[r] = seq
        if self.on_start is not None:
            self.on_start(r, seq)

    def forget(self, r: str) -> None:
        self._unindex(r)
        self.changed.add(r)
        for d in (self.ids, self.expect, self.pos, self.subst, self.incarnation):
            d.pop(r, None)

    def _unindex(self, r: str) -> None:
        for b in self.pos.get(r, ()):
            self._drop_holder(b, r)

    def _drop_holder(self, b: int, r: str) -> None:
        """``r``'s list no longer holds ``b`` (the reverse index forgets an empty entry)."""
        holders = self.where.get(b)
        if holders is not None:
            holders.discard(r)
            if not holders:
                del self.where[b]

    def take_changed(self) -> set:
        """Requests whose list was started, grown, substituted or forgotten since the last call."""
        out, self.changed = self.changed, set()
        return out

    def take_started(self) -> set:
        """Requests whose list was started (new or resumed) since the last call; the others of
        :meth:`take_changed` only grew, were substituted or were forgotten."""
        out, self.started = self.started, set()
        return out

    def take_new_ids(self) -> list[tuple[str, int]]:
        """``(request, block id)`` for every block that entered a list (new, grown, resumed)
        since the last call."""
        out, self.new_ids = self.new_ids, []
        return out

    def holders(self, b: int) -> set:
        """The requests whose list holds block ``b`` (as the outputs gave it, not substituted)."""
        return self.where.get(b, set())

    def index(self, r: str, b: int) -> Optional[int]:
        """The positional index of block ``b`` in ``r``'s list (not substituted), or None."""
        return self.pos.get(r, {}).get(b)

    def detach(self, r: str, blk) -> int:
        """Null-substitute ``blk``'s entry in ``r``'s list (the adapter takes the request's
        reference over); returns its index."""
        return self.detach_many(r, [blk])[0]

    def detach_many(self, r: str, blks) -> list[int]:
        """:meth:`detach` for several blocks of ``r``'s list (a plan's sources): all are
        validated before any entry changes; returns their indices, in the given order.
        O(len(blks))."""
        pos = self.pos.get(r, {})
        lst = self.req_to_blocks.get(r)
        m = self.ids.get(r, [])
        if lst is not None and len(lst) != len(m):
            raise AdapterAssumptionError(
                "null_substitution", f"request {r!r}'s block list has {len(lst)} entries, the scheduler "
                f"outputs gave it {len(m)} (an entry was popped instead of null-substituted)")
        missing = [blk.block_id for blk in blks if blk.block_id not in pos]
        if missing:
            raise AdapterAssumptionError("table_in_step", f"request {r!r}: blocks {missing} are not in its block "
                                                          f"list (or were substituted already)")
        idx = [pos[blk.block_id] for blk in blks]
        if len(set(idx)) != len(idx):
            raise AdapterAssumptionError("null_substitution", f"request {r!r}: blocks "
                                         f"{[blk.block_id for blk in blks]} name one entry twice")
        for blk, i in zip(blks, idx):
            if lst is None or i >= len(lst) or lst[i] is not blk:
                got = None if lst is None or i >= len(lst) else lst[i].block_id
                raise AdapterAssumptionError(
                    "table_in_step", f"request {r!r}: block {blk.block_id} expected at req_to_blocks index {i}, "
                    f"found {got}")
        sub = self.subst.setdefault(r, {})
        ex = self.expect[r]
        for i, blk in sorted(zip(idx, blks), key=itemgetter(0), reverse=True):  # last index first (any order is right)
            b = blk.block_id
            del pos[b]
            lst[i] = self.null
            ex[i] = self.null
            sub[i] = b
            self._drop_holder(b, r)
        self.changed.add(r)
        return idx

    def check_lists(self, where: str, requests=None) -> None:
        """Every mirrored request's ``req_to_blocks`` equals its mirror, with null exactly
        where the adapter substituted: same length, same order. ``requests``: only these."""
        for r in (self.ids if requests is None else requests):
            m = self.ids.get(r)
            lst = self.req_to_blocks.get(r)
            if m is None or lst is None:
                continue
            if len(lst) != len(m):
                raise AdapterAssumptionError(
                    "null_substitution", f"{where}: request {r!r}'s block list has {len(lst)} entries, the scheduler "
                    f"outputs gave it {len(m)} (an entry was popped instead of null-substituted, or the list "
                    f"re-grew): {[b.block_id for b in lst]} vs {m}")
            if all(map(is_, lst, self.expect[r])):  # the fast path: the very objects expected, in C
                continue
            sub = self.subst.get(r, {})
            for i, (blk, bid) in enumerate(zip(lst, m)):
                if i in sub:
                    if blk is not self.null:
                        raise AdapterAssumptionError(
                            "null_substitution", f"{where}: request {r!r} index {i}: block {blk.block_id} where "
                            f"null_block was substituted for block {sub[i]}")
                elif blk.block_id != bid:
                    raise AdapterAssumptionError(
                        "null_substitution", f"{where}: request {r!r} index {i}: req_to_blocks has block "
                        f"{blk.block_id}, the outputs gave {bid}")

