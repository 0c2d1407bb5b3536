"""A fixed-budget block allocator with a null block, reference counts and reservations,
with the ownership rules of vLLM's ``BlockPool`` (``vllm/v1/core/block_pool.py``):

- Block 0 is the *null block*: never handed out, never freed, never receives a token;
  freed positions in a request's block list may point at it.
- Every other block is in exactly one state: FREE (in the free queue, ref 0), USED (ref >=
  1: one reference per holding request), or RESERVED (evacuation headroom, ref 0, owned by
  the reclamation manager and invisible to ordinary allocation).
- ``allocate`` pops from the head of the free queue; ``free`` appends to the tail (LRU reuse).

Every call validates its whole input first; a failing call raises
:class:`~vtoken.errors.AllocatorError` (a code of ``vtoken.errors.ALLOCATOR_CODES``) and
changes nothing. A count or block id must be an ``int`` or numpy integer (not ``bool``,
float, string, ``None``: ``not_integer``); a block list a non-string iterable of them (1-D
integer arrays and tensors included). Ids beyond int64 are ``block_out_of_range``.
``num_blocks`` <= ``MAX_BLOCKS``.

Owns: the pool's bookkeeping (free queue, per-block ``ref`` and state); whoever called
``allocate``/``take_reserved`` holds one reference and must ``free`` it exactly once.
May call: vtoken.errors, numpy, collections; never spec/, invariants/, fuzz/ or reports/.
Costs: O(blocks named or requested) per call; ``export_state`` O(pool).
"""

from __future__ import annotations

import collections
from typing import Iterable

import numpy as np

from .errors import AllocatorError

FREE, USED, RESERVED = 0, 1, 2
NULL_BLOCK = 0
MAX_BLOCKS = 2 ** 31  # = vtoken.table.MAX_BLOCKS


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _count(n, what: str) -> int:
    if not _is_int(n):
        raise AllocatorError("not_integer", f"{what}: the count must be an integer, got {n!r:.60}")
    return int(n)


def _block_list(blocks, what: str) -> list[int]:
    """``blocks`` as a list of Python ints, or ``not_integer`` (checked as a whole, before any
    range check). Block lists are short (a request's or a plan's blocks): O(len) Python."""
    if hasattr(blocks, "detach"):  # a torch tensor
        blocks = blocks.detach().cpu().numpy()
    if isinstance(blocks, np.ndarray):
        if blocks.ndim != 1 or blocks.dtype.kind not in "iuO":
            raise AllocatorError("not_integer", f"{what}: blocks must be a flat list of integers, "
                                                f"got an array of dtype {blocks.dtype}, shape {blocks.shape}")
    elif isinstance(blocks, (str, bytes, bytearray, memoryview)):
        raise AllocatorError("not_integer", f"{what}: blocks must be a list of integers, got {blocks!r:.60}")
    try:
        out = list(blocks)
    except TypeError:
        raise AllocatorError("not_integer", f"{what}: blocks must be a list of integers, got {blocks!r:.60}") from None
    for b in out:
        if not _is_int(b):
            raise AllocatorError("not_integer", f"{what}: block id {b!r:.60} is not an integer")
    return [int(b) for b in out]


class BlockAllocator:
    def __init__(self, num_blocks: int):
        """Checks: ``not_integer``, ``bad_config`` (fewer than 2 or more than ``MAX_BLOCKS``)."""
        num_blocks = _count(num_blocks, "num_blocks")
        if not 2 <= num_blocks <= MAX_BLOCKS:
            raise AllocatorError("bad_config", f"num_blocks={num_blocks}: need the null block and at least one more, "
                                               f"at most {MAX_BLOCKS}")
        self.num_blocks = num_blocks
        self.ref = np.zeros(self.num_blocks, dtype=np.int32)
        self.state = np.zeros(self.num_blocks, dtype=np.int8)
        self.state[NULL_BLOCK] = USED  # pinned forever, never in the queue
        self._queue: collections.deque[int] = collections.deque(range(1, self.num_blocks))
        self._num_reserved = 0

    # -- queries -----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._queue)

    @property
    def num_reserved(self) -> int:
        return self._num_reserved

    @property
    def num_used(self) -> int:
        """Blocks held by requests (the null block excluded)."""
        return self.num_blocks - 1 - self.num_free - self._num_reserved

    def free_queue(self) -> list[int]:
        return list(self._queue)

    def export_state(self) -> dict:
        """Plain-data view for the invariant checkers."""
        return {
            "num_blocks": self.num_blocks,
            "free_queue": list(self._queue),
            "reserved": [int(b) for b in np.flatnonzero(self.state == RESERVED)],
            "ref": {int(b): int(self.ref[b]) for b in np.flatnonzero(self.ref > 0) if b != NULL_BLOCK},
        }

    # -- validation helpers ------------------------------------------------------------
    def _check_ids(self, blocks: list[int], what: str) -> None:
        for b in blocks:
            if not (0 <= b < self.num_blocks):
                raise AllocatorError("block_out_of_range", f"{what}: block {b} outside [0, {self.num_blocks})")
            if b == NULL_BLOCK:
                raise AllocatorError("null_block", f"{what}: the null block 0 is never allocated or freed")

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue; the caller holds one reference each.
        Checks: ``not_integer``, ``bad_count`` (negative), ``out_of_blocks``. O(n)."""
        n = _count(n, "allocate")
        if n < 0:
            raise AllocatorError("bad_count", f"allocate({n})")
        if n > len(self._queue):
            raise AllocatorError("out_of_blocks", f"allocate({n}) with {len(self._queue)} free")
        out = [self._queue.popleft() for _ in range(n)]
        for b in out:
            assert self.state[b] == FREE and self.ref[b] == 0, f"block {b} in the free queue but held"
            self.ref[b] = 1
            self.state[b] = USED
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        """Add a reference to used blocks (a prefix-cache hit shares them). Checks: ``not_integer``;
        per block ``block_out_of_range``, ``null_block``; then per block ``not_allocated``. O(blocks)."""
        blocks = _block_list(blocks, "incref")
        self._check_ids(blocks, "incref")
        for b in blocks:
            if self.state[b] != USED:
                raise AllocatorError("not_allocated", f"incref: block {b} is not in use")
        for b in blocks:
            self.ref[b] += 1

    def free(self, blocks: Iterable[int]) -> list[int]:
        """Drop one reference from each block; blocks reaching zero go to the queue tail and are
        returned. Naming a block more times than its references, or a free or reserved one, is a
        double free. Checks: ``not_integer``; per block ``block_out_of_range``, ``null_block``; then
        per distinct block ``double_free``. O(blocks)."""
        blocks = _block_list(blocks, "free")
        self._check_ids(blocks, "free")
        drops = collections.Counter(blocks)
        for b, k in drops.items():
            if self.state[b] != USED or self.ref[b] < k:
                raise AllocatorError(
                    "double_free", f"free: block {b} has {int(self.ref[b])} reference(s), asked to drop {k}")
        freed = []
        for b in blocks:
            self.ref[b] -= 1
            assert self.ref[b] >= 0, f"block {b}: references went negative"  # the double_free check above
            if self.ref[b] == 0:
                self.state[b] = FREE
                self._queue.append(b)
                freed.append(b)
        return freed

    # -- headroom reservations ---------------------------------------------------------------
    def reserve(self, n: int) -> list[int]:
        """Move ``n`` free blocks into the reserved state (evacuation headroom). Checks:
        ``not_integer``, ``bad_count`` (negative), ``out_of_blocks``. O(n)."""
        n = _count(n, "reserve")
        if n < 0:
            raise AllocatorError("bad_count", f"reserve({n})")
        if n > len(self._queue):
            raise AllocatorError("out_of_blocks", f"reserve({n}) with {len(self._queue)} free")
        out = [self._queue.popleft() for _ in range(n)]
        for b in out:
            self.state[b] = RESERVED
        self._num_reserved += n
        return out

    def _reserved_list(self, blocks: Iterable[int], op: str) -> list[int]:
        """``blocks`` as a list of distinct reserved block ids, or the error naming the first
        problem (nothing changed)."""
        blocks = _block_list(blocks, op)
        self._check_ids(blocks, op)
        if len(set(blocks)) != len(blocks):
            raise AllocatorError("duplicate_block", f"{op}: {blocks} names a block twice")
        for b in blocks:
            if self.state[b] != RESERVED:
                raise AllocatorError("not_reserved", f"{op}: block {b} is not reserved")
        return blocks

    def take_reserved(self, blocks: Iterable[int]) -> None:
        """Hand reserved blocks to a request (compaction destinations): RESERVED -> USED, ref 1.
        Checks: ``not_integer``; per block ``block_out_of_range``, ``null_block``; ``duplicate_block``;
        per block ``not_reserved``. O(blocks)."""
        blocks = self._reserved_list(blocks, "take_reserved")
        for b in blocks:
            self.state[b] = USED
            self.ref[b] = 1
        self._num_reserved -= len(blocks)

    def unreserve(self, blocks: Iterable[int]) -> None:
        """Return reserved blocks to the free queue. Checks: ``not_integer``; per block
        ``block_out_of_range``, ``null_block``; ``duplicate_block``; per block ``not_reserved``. O(blocks)."""
        blocks = self._reserved_list(blocks, "unreserve")
        for b in blocks:
            self.state[b] = FREE
            self._queue.append(b)
        self._num_reserved -= len(blocks)
