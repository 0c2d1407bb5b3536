"""The blocks the adapter holds for requests outside their lists: landed plans' fills and
used destinations (and the sources and fills of a plan aborted while its request still
reads them).

``HeldBlocks`` reads as ``{request: {block id: KVCacheBlock}}`` (in the order they were
taken) and keeps the inverse, block id -> request, so "does the adapter hold this block,
for whom?" is O(1) for any block (the checks ask it of every block vLLM puts in a list).
Both change only through :meth:`add`, :meth:`take` and :meth:`drop_request`, which keep
them in step.
Owns: one adapter reference on every block in it; the adapter frees them (at the request's
free, with its fence) or hands them to a plan (``take``).
May call: ``assumptions``.
Costs: O(blocks given) per call; :meth:`index_errors` O(blocks held).
:func:`unaccounted` (the list and the held blocks together) lives here too.
"""

from __future__ import annotations

from typing import Optional

from .assumptions import AdapterAssumptionError

_NO_BLOCKS: dict = {}  # read-only stand-in for a request with no entry


def unaccounted(mirror, held: "HeldBlocks", r: str, block_ids, also=frozenset()) -> list[int]:
    """Of ``block_ids``, those the scheduler side does not hold for ``r`` (sorted): not in its
    list (``mirror.pos``), not held for it, not in ``also``; set differences in C.
    O(len(block_ids))."""
    return sorted(set(block_ids).difference(mirror.pos.get(r, _NO_BLOCKS), held.get(r, _NO_BLOCKS), also))


class HeldBlocks(dict):
    def __init__(self):
        super().__init__()
        self._owner: dict[int, str] = {}  # block id -> the request holding it

    def owner(self, block_id: int) -> Optional[str]:
        return self._owner.get(block_id)

    def add(self, r: str, blocks) -> None:
        """``r`` keeps ``blocks``. A block held twice is an ownership error (one adapter
        reference each), refused before anything is added."""
        ids = [b.block_id for b in blocks]
        twice = [b for b in ids if b in self._owner]
        if twice or len(set(ids)) != len(ids):
            raise AdapterAssumptionError("ownership", f"request {r!r}: blocks {twice or ids} would be held twice")
        self.setdefault(r, {}).update(zip(ids, blocks))
        self._owner.update(dict.fromkeys(ids, r))

    def take(self, r: str, block_ids) -> None:
        """``r`` no longer holds ``block_ids`` (all held for it: the caller checked)."""
        h = self[r]
        for b in block_ids:
            del h[b]
            del self._owner[b]

    def drop_request(self, r: str) -> list:
        """Everything ``r`` holds, forgotten here (the caller frees it)."""
        blocks = list(self.pop(r, {}).values())
        for b in blocks:
            del self._owner[b.block_id]
        return blocks

    def index_errors(self) -> list:
        """``(block, request)`` pairs on which the inverse index and the held blocks disagree
        (empty unless something wrote to the inner dicts directly)."""
        owner = {b: r for r, h in self.items() for b in h}
        return sorted(set(owner.items()) ^ set(self._owner.items()))
