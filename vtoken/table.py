"""The token table: per-request logical token ids -> physical (block, offset), plus liveness.

The paper's canonical table (section 3.2), in arrays: a scheduler step costs the tokens
added, evicted or moved, never the tokens already tracked.

State. Per request (``_Req``): ``slot[i] = block * S + offset`` and ``live[i]`` for every
logical id ``i < n`` (ids are positions), and the set of blocks it references. Struct of arrays:
a request's length, live count, block count and segments are row ``h`` of per-request arrays,
its slots and liveness a power-of-two segment of one host pool, so a decode step's growth and
evictions of every request (``sync_one_each``, ``evict_one_each``: what the scheduler side's
replica replays each step) are array operations, with Python work only for a request whose
token opens a block or outgrows its segment; the plans a report ends are one
``apply_moves_each``, held-back decode steps one ``sync_steps_each``, a prefill step's chunks
one ``sync_new_tokens_each``, the requests a step finished one ``free_requests`` (each of those
three says None, changing nothing, for what is not one batch: the caller makes the calls). Per block:
``refs[b]`` (requests referencing ``b``) and ``n_b[b]`` (slots of ``b`` holding a live token
of some request, a shared slot counted once). Per slot: ``claims[s]`` (requests with a live
token at ``s``) and ``placed[s]`` (the id last placed at ``s`` while its block was
referenced, else -1). A new token may land only on a slot unused since its block was taken
or, in a block another request references, where that request placed the same id.

The table never frees blocks: ``apply_moves``, ``release_empty_blocks`` and ``free_request``
return the blocks it stopped referencing, for the caller to free (a move's sources only
*after the copy out of them completed*).

Read side: ``read_view`` (per-token slots and live mask on the device, O(changed) per
update) and ``slot_mapping`` (Eq. 2, cached); every mutation updates or invalidates both
before returning. The host never waits for the device here (host-computed sizes and
indices; pinned, ``non_blocking`` uploads on CUDA; ``tests/test_read_path_no_sync.py``).

Errors: :class:`~vtoken.errors.TableError` with a code of ``vtoken.errors.TABLE_CODES``, the
state unchanged; of several problems the first in input order, checks in the order each
method documents (as ``spec/``). Types are checked before values. An *integer* is an
``int`` or numpy integer scalar, never a ``bool`` / ``numpy.bool_``, float, string or
``None``. A *list of integers* is a list, tuple, range, other non-string iterable (where an
iterable is taken), or a 1-D integer numpy array or torch tensor (``.cpu()`` is the caller's
sync), every element an integer. Anything else is ``not_integer`` (``bad_move`` in
``apply_moves``). Integers beyond int64 are clipped, then refused by the argument's range
check. A request id must be hashable (``bad_request_id``).

Limits: ``block_size`` in ``[1, MAX_BLOCK_SIZE]``, ``num_blocks`` in ``[2, MAX_BLOCKS]`` (the
snapshot schema's) and ``block_size * num_blocks <= MAX_SLOTS``.

Owns: the per-request rows, the host pool of slot/live segments, per-request block sets,
per-block ``refs``/``n_b``, per-slot ``claims``/``placed``, the device read views; never a block
(the caller frees what it returns).
May call: vtoken.errors, numpy, torch; never spec/, invariants/, fuzz/ or reports/.
Costs: O(new tokens) per sync, O(ids) per eviction, O(moves) per apply, ``waste_ratio`` O(1);
``export_state`` O(all tokens), for checkers only.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from typing import Iterable, Sequence

import numpy as np
import torch

from .errors import TableError

NULL_BLOCK = 0
MAX_BLOCK_SIZE = 4096  # = vtoken.snapshot.MAX_BLOCK_SIZE
MAX_BLOCKS = 2 ** 31  # = vtoken.snapshot.MAX_BLOCKS (vLLM keeps block ids in int32)
MAX_SLOTS = 2 ** 30  # num_blocks * block_size: 12 GiB of per-slot host arrays at the limit

_I64_MIN, _I64_MAX = -(2 ** 63), 2 ** 63 - 1
_NOT_A_LIST = (str, bytes, bytearray, memoryview)  # iterable, but of characters / bytes, not ids


def _is_int_type(tp) -> bool:
    """``int`` (and subclasses: IntEnum) or a numpy integer type; never ``bool``."""
    return issubclass(tp, (int, np.integer)) and not issubclass(tp, bool)


def _show(x) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def _fmt(v: int) -> str:
    """An id for a message; the int64 bounds are where out-of-int64 inputs were clipped."""
    return f"{v} (or beyond)" if v in (_I64_MIN, _I64_MAX) else str(v)


def _index(x, what: str, code: str = "not_integer") -> int:
    """``x`` as a Python int without casting (an ``int`` or numpy integer; ``3.0``, ``True``,
    ``"3"``, ``None``, 0-d arrays: ``TableError(code)``). O(1)."""
    if type(x) is int:
        return x
    if _is_int_type(type(x)):
        return int(x)
    raise TableError(code, f"{what} must be an integer, got {_show(x)}")


def _objects_to_int64(seq, what: str, code: str) -> np.ndarray:
    """A list / tuple / object array of Python objects -> int64, if every element is an
    integer: one C-speed pass over the element types, so a bool cannot hide among ints;
    integers beyond int64 are clipped (module docstring)."""
    for tp in set(map(type, seq)):
        if not _is_int_type(tp):
            bad = next(x for x in seq if type(x) is tp)
            raise TableError(code, f"{what} must be integers, got {_show(bad)}")
    try:
        return np.array(seq, dtype=np.int64)
    except OverflowError:  # some beyond int64: clip (rare; per-element Python)
        return np.array([min(max(int(x), _I64_MIN), _I64_MAX) for x in seq], dtype=np.int64)


def _ndarray_to_int64(a: np.ndarray, what: str, code: str) -> np.ndarray:
    """A numpy array -> flat int64 by its dtype (O(1) check; no value is cast from a float)."""
    if a.ndim != 1:
        raise TableError(code, f"{what} must be a flat list of integers, got an array of shape {a.shape}")
    kind = a.dtype.kind
    if kind == "i":
        return a.astype(np.int64, copy=False)
    if kind == "u":
        if a.dtype.itemsize == 8 and len(a):
            a = np.minimum(a, np.uint64(_I64_MAX))  # above int64: clipped, as for Python ints
        return a.astype(np.int64)
    if kind == "O":
        return _objects_to_int64(list(a), what, code)
    raise TableError(code, f"{what} must be integers, got an array of dtype {a.dtype}")


def _to_numpy(x):
    """A torch tensor -> numpy (a view for a CPU tensor); anything else unchanged."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return x


# the per-slot and per-block counts' dtype: np.add.at takes its fast path only for an increment of
# the array's own dtype (a Python int 1 costs ten times more on int32)
_ONE = np.int32(1)


def _index_array(xs, what: str, code: str = "not_integer") -> np.ndarray:
    """Any list of integers (see the module docstring) -> a flat int64 array, O(len(xs))."""
    xs = _to_numpy(xs)
    if isinstance(xs, np.ndarray):
        return _ndarray_to_int64(xs, what, code)
    if isinstance(xs, _NOT_A_LIST):
        raise TableError(code, f"{what} must be a list of integers, got {_show(xs)}")
    if not isinstance(xs, (list, tuple)):
        try:
            xs = list(xs)
        except TypeError:
            raise TableError(code, f"{what} must be a list of integers, got {_show(xs)}") from None
    return _objects_to_int64(xs, what, code)


def waste_ratio_of(live_slots: int, ref_blocks: int, block_size: int) -> float:
    """Eq. 1 from a table's totals (:meth:`TokenTable.waste_ratio`'s formula, for totals a
    table reported rather than the table itself): 0 when no block is referenced. O(1)."""
    if ref_blocks == 0:
        return 0.0
    return 1.0 - live_slots / (ref_blocks * block_size)


def _repeats(x: np.ndarray) -> np.ndarray:
    """True where an entry of ``x`` repeats an earlier one. A set decides the usual case (no
    repeat) in one pass; np.unique's sort runs only when there is one. O(len(x))."""
    if len(set(x.tolist())) == len(x):
        return np.zeros(len(x), dtype=bool)
    _, first = np.unique(x, return_index=True)
    out = np.ones(len(x), dtype=bool)
    out[first] = False
    return out


def _iterable(x) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return True


def _is_sequence(xs) -> bool:
    """A positional block list: list, tuple, range or 1-D numpy array (tensors converted first)."""
    if isinstance(xs, (list, tuple, range)):
        return True
    return isinstance(xs, np.ndarray) and xs.ndim == 1


def _moves_array(moves, what: str = "moves") -> np.ndarray:
    """``moves`` as a (k, 5) int64 array, or ``bad_move``: not a list of rows, a row that is
    not a list / tuple / 1-D array of five integers, or any non-integer entry. O(moves)."""
    moves = _to_numpy(moves)
    if isinstance(moves, np.ndarray):
        if moves.dtype.kind not in "iuO":  # even an empty float array is not a list of moves
            raise TableError("bad_move", f"{what} must be integers, got an array of dtype {moves.dtype}")
        if moves.ndim and len(moves) == 0:
            return np.empty((0, 5), dtype=np.int64)
        if moves.ndim and moves.dtype.kind == "O":  # rows of Python objects: checked as a list
            return _moves_array(list(moves), what)
        if moves.ndim != 2 or moves.shape[1] != 5:
            raise TableError("bad_move", f"{what} must be (token, src_block, src_offset, dst_block, dst_offset) rows, "
                                         f"got an array of shape {moves.shape}")
        return _ndarray_to_int64(moves.reshape(-1), what, "bad_move").reshape(-1, 5)
    if isinstance(moves, _NOT_A_LIST):
        raise TableError("bad_move", f"{what} must be a list of five-integer rows, got {_show(moves)}")
    try:
        rows = moves if isinstance(moves, (list, tuple)) else list(moves)
    except TypeError:
        raise TableError("bad_move", f"{what} must be a list of five-integer rows, got {_show(moves)}") from None
    if not rows:
        return np.empty((0, 5), dtype=np.int64)
    for i, row in enumerate(rows):
        if not (isinstance(row, (list, tuple)) or (isinstance(row, np.ndarray) and row.ndim == 1)) or len(row) != 5:
            raise TableError("bad_move", f"{what}: move #{i} {_show(row)} is not five integers "
                                         "(token, src_block, src_offset, dst_block, dst_offset)")
    flat = list(itertools.chain.from_iterable(rows))
    return _objects_to_int64(flat, what, "bad_move").reshape(-1, 5)


class _OwnTail:
    """:meth:`TokenTable.reclaim_inputs`' default: the request's own tail block."""

    def __repr__(self) -> str:
        return "OWN_TAIL"


OWN_TAIL = _OwnTail()


class _Req:
    """One request: its block set and read-side cache here; its scalars (length, live count,
    capacity, segments) in row ``h`` of the table's per-request arrays, its per-token slots and
    liveness in a segment of the table's host pool, so a decode step's growth and evictions of
    every request are a few array operations (``sync_one_each``, ``evict_one_each``), not one
    Python object visit per request. ``slot`` and ``live`` are views of the segment, valid until
    the table's next growth: read them again after one. Owned by one table; never shared."""

    __slots__ = ("t", "h", "rid", "blocks", "block_arr", "map_cache", "map_len", "map_src_n")

    def __init__(self, table: "TokenTable", h: int, rid):
        self.t = table
        self.h = h  # the row (freed rows are reused: a _Req is dropped when its request is freed)
        self.rid = rid  # its request id
        self.blocks: set[int] = set()
        self.block_arr = None  # read-only int64 array of ``blocks``, None once the set changed (block_array)
        self.map_cache = None  # compacted live slots (device), see slot_mapping
        self.map_len = 0
        self.map_src_n = 0  # tokens [0, map_src_n) are reflected in map_cache

    def _row(name: str, doc: str, cast=int):  # noqa: N805 - builds a property over one row array
        def get(self):
            return cast(getattr(self.t, name)[self.h])

        def put(self, v) -> None:
            getattr(self.t, name)[self.h] = v

        return property(get, put, doc=doc)

    n = _row("_n", "Tokens tracked (the next token's position).")
    n_live = _row("_nl", "Live tokens.")
    cap = _row("_cap", "Entries of the host segment and of the device segment (one power-of-two capacity).")
    base = _row("_db", "The device segment's first index in the read-side pool.")
    map_dirty = _row("_dirty", "The device slot mapping is stale (an eviction or move since it was computed).", bool)
    del _row

    def _segment(self, pool: np.ndarray, empty: np.ndarray) -> np.ndarray:
        """This request's segment of a host pool (a view), or ``empty`` before its first token."""
        t, h = self.t, self.h
        cap = t._cap.item(h)
        if not cap:
            return empty
        b = t._hb.item(h)
        return pool[b:b + cap]

    slot = property(lambda self: self._segment(self.t._host.slot, _NO_SLOTS),
                    doc="``slot[i] = block * S + offset`` of token ``i`` (-1 beyond the length): a view (before "
                        "the first token, a read-only one of 64 entries: indexing past the length stays safe).")
    live = property(lambda self: self._segment(self.t._host.live, _NO_LIVE),
                    doc="Token ``i`` is live: a view (read-only and all False before the first token).")


_NO_SLOTS = np.full(64, -1, dtype=np.int64)  # what a request with no token yet shows
_NO_SLOTS.flags.writeable = False
_NO_LIVE = np.zeros(64, dtype=bool)
_NO_LIVE.flags.writeable = False


class _Segments(ABC):
    """A flat pair of arrays (``slot``, ``live``) cut into power-of-two segments, one per
    request, with a free list per size; the pair doubles when full (the used prefix copied
    over: every view of a segment is stale after). A subclass makes the arrays (``_new``: the
    host's numpy, the device's torch) and says what a growth or a release must do first."""

    def __init__(self):
        self.slot, self.live = self._new(1024)
        self.used = 0
        self.free_segs: dict[int, list[int]] = {}

    @abstractmethod
    def _new(self, size: int):
        """A fresh ``(slot, live)`` pair of ``size`` entries (slot -1, not live)."""

    def _before_move(self) -> None:
        """Runs before the arrays are replaced or a segment is handed back."""

    def _kill(self, base: int, cap: int) -> None:
        self.live[base:base + cap] = False

    def alloc(self, cap: int) -> int:
        """A segment of ``cap`` entries: a freed one, or the pair's end. O(cap) amortised."""
        lst = self.free_segs.get(cap)
        if lst:
            return lst.pop()
        if self.used + cap > len(self.slot):
            self._before_move()
            size = max(2 * len(self.slot), self.used + cap)
            slot, live = self._new(size)
            slot[: self.used] = self.slot[: self.used]
            live[: self.used] = self.live[: self.used]
            self.slot, self.live = slot, live
        base = self.used
        self.used += cap
        return base

    def release(self, base: int, cap: int) -> None:
        """Hand segment ``[base, base + cap)`` back: none of it live for its next owner."""
        self._before_move()
        self._kill(base, cap)
        self.free_segs.setdefault(cap, []).append(base)


class _HostSegments(_Segments):
    """The host pool of every request's per-token slots and liveness (numpy)."""

    def _new(self, size: int):
        return np.full(size, -1, dtype=np.int64), np.zeros(size, dtype=bool)


class _DevicePool(_Segments):
    """The read-side lookup cache: per-token slots and live bits of every request, on the device,
    one flat pair of tensors with each request in a power-of-two segment. Mutations queue
    updates, sent in one batched write (``flush``) that every read runs first. Never waits on
    the device (uploads through :meth:`h2d`, no shape from device data)."""

    mirrors = True  # (a _HostOnly pool does not)

    def __init__(self, device: torch.device, pinned: bool | None = None):
        self.device = device
        # CUDA: stage uploads in pinned memory so they are truly asynchronous. (Settable for
        # tests that check the staging on a machine without CUDA.)
        self.pinned = device.type == "cuda" if pinned is None else pinned
        super().__init__()
        self.pend_idx: list = []  # global indices whose slot changed (arrays or ints)
        self.pend_val: list = []
        self.pend_new: list = []  # indices that became live (new tokens)
        self.pend_dead: list = []  # indices that died

    def _new(self, size: int):
        return (torch.full((size,), -1, dtype=torch.int64, device=self.device),
                torch.zeros(size, dtype=torch.bool, device=self.device))

    def _before_move(self) -> None:
        self.flush()  # queued writes must land before a copy, and not on a segment's next owner

    def _kill(self, base: int, cap: int) -> None:
        self.live[base:base + cap].fill_(False)  # the bit as a kernel argument: no upload, no host wait

    @staticmethod
    def _cat(parts) -> np.ndarray:
        arrs = [p if isinstance(p, np.ndarray) else np.asarray([p], dtype=np.int64) for p in parts]
        return np.concatenate(arrs)

    def h2d(self, a: np.ndarray) -> torch.Tensor:
        """A host int64 array on the device, without blocking the host: on CPU a zero-copy view
        (``a`` must not change while it is used), on CUDA via pinned memory, ``non_blocking=True``
        (the caching host allocator keeps the buffer until the copy passed it). O(len(a))."""
        t = torch.from_numpy(a)
        if self.device.type == "cpu":
            return t
        if self.pinned:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def flush(self) -> None:
        """Write every queued update to the device (at most three indexed writes, no host wait)."""
        if self.pend_idx:
            idx, val = self._cat(self.pend_idx), self._cat(self.pend_val)
            if len(idx) > 1:  # the last write to an index wins (index_put order is unspecified)
                ridx = idx[::-1]
                _, last = np.unique(ridx, return_index=True)
                idx, val = ridx[last], val[::-1][last]
            self.slot[self.h2d(idx)] = self.h2d(val)
            self.pend_idx.clear()
            self.pend_val.clear()
        # index_fill_ takes the bit as a kernel argument; ``live[idx] = True`` would upload a
        # 0-d tensor from pageable memory first, a host sync on CUDA
        if self.pend_new:  # births before deaths: a token born and evicted in one step stays dead
            self.live.index_fill_(0, self.h2d(self._cat(self.pend_new)), True)
            self.pend_new.clear()
        if self.pend_dead:
            self.live.index_fill_(0, self.h2d(self._cat(self.pend_dead)), False)
            self.pend_dead.clear()

    def gather(self, gidx: np.ndarray, out: torch.Tensor) -> None:
        """``out[:] = slot[gidx]`` on the device, ``gidx`` a host array of pool indices: an
        ``index_select`` whose size the host knows (never a mask). O(len(gidx))."""
        if len(gidx):
            torch.index_select(self.slot, 0, self.h2d(gidx), out=out)


class _Discard:
    """A queue that keeps nothing: the pending updates of a table without a read-side mirror."""

    __slots__ = ()

    def append(self, _x) -> None:
        pass

    def clear(self) -> None:
        pass

    def __bool__(self) -> bool:
        return False


class _HostOnly:
    """No read-side lookup cache (``TokenTable(device=None)``): the host arrays are the only
    copy; updates are not queued, reads answer from the host (:meth:`TokenTable.slot_mapping`).
    What a scheduler-side replica needs (it plans and checks, it never serves attention)."""

    mirrors = False
    device = torch.device("cpu")
    pend_idx = pend_val = pend_new = pend_dead = _Discard()

    def alloc(self, cap: int) -> int:
        return 0

    def release(self, base: int, cap: int) -> None:
        pass

    def flush(self) -> None:
        pass


class TokenTable:
    """Per-request token table over ``num_blocks`` blocks of ``block_size`` slots; the
    canonical table is on the host, the read-side lookup cache on ``device`` (``None``: no
    cache, reads answer from the host: a replica that plans and checks but never serves)."""

    def __init__(self, block_size: int, num_blocks: int, device: str | torch.device | None = "cpu"):
        """Checks, in order: ``not_integer`` (block_size, then num_blocks); ``bad_config``
        (outside the limits in the module docstring, or a device torch cannot use)."""
        S = _index(block_size, "block_size")
        nb = _index(num_blocks, "num_blocks")
        if not (1 <= S <= MAX_BLOCK_SIZE and 2 <= nb <= MAX_BLOCKS and S * nb <= MAX_SLOTS):
            raise TableError("bad_config", f"block_size={S} (1..{MAX_BLOCK_SIZE}), num_blocks={nb} (2..{MAX_BLOCKS}), "
                                           f"block_size * num_blocks <= {MAX_SLOTS}")
        self.S = S
        self.num_blocks = nb
        try:
            self._pool = _HostOnly() if device is None else _DevicePool(torch.device(device))
            self.device = self._pool.device
        except (RuntimeError, TypeError, ValueError, AssertionError) as e:  # torch's errors for a bad device
            raise TableError("bad_config", f"device {_show(device)}: {e}") from None
        self._reqs: dict[object, _Req] = {}
        self._row: dict[object, int] = {}  # request -> its row (the batched paths look rows up in C)
        self._row_epoch = 0  # bumped whenever _row changes (a request added or freed): _rows' memo
        self._rows_memo: list = []  # [(epoch, request list, rows)], the two _rows lists used last, the last first
        # per-request rows: length, live count, capacity, host and device segment bases, a block the
        # request references (-1: none known; the batched sync's test that a token lands in a block
        # the request holds already), device slot mapping stale
        self._n = np.zeros(0, dtype=np.int64)
        self._nl = np.zeros(0, dtype=np.int64)
        self._cap = np.zeros(0, dtype=np.int64)
        self._hb = np.zeros(0, dtype=np.int64)
        self._db = np.zeros(0, dtype=np.int64)
        self._last = np.zeros(0, dtype=np.int64)
        self._nblk = np.zeros(0, dtype=np.int64)  # blocks referenced (len(blocks))
        self._bver = np.zeros(0, dtype=np.int64)  # bumped at every change of the block set
        self._dirty = np.zeros(0, dtype=bool)
        self._free_rows: list[int] = []
        self._host = _HostSegments()  # per-token slots and liveness, one segment per request
        self.refs = np.zeros(self.num_blocks, dtype=np.int32)
        self.n_b = np.zeros(self.num_blocks, dtype=np.int32)
        self.claims = np.zeros(self.num_blocks * self.S, dtype=np.int32)
        self.placed = np.full(self.num_blocks * self.S, -1, dtype=np.int64)
        # Incremental totals for Eq. 1, so waste_ratio() never scans.
        self._live_slots = 0  # sum of n_b
        self._ref_blocks = 0  # blocks with refs > 0
        self._dead = 0  # tokens evicted, over the requests in the table (sum of length - live)
        # Requests whose blocks or liveness changed since the last take_changed() (growth
        # inside a block already referenced does not count): what a scheduler-side cache
        # keyed by request must recompute (O(1) to record, O(changed) to take).
        self._changed: set = set()
        # Requests an eviction left a block without a live token in (since take_emptied()):
        # the only requests that can have a new releasable block without a list change
        self._emptied: set = set()
        # The same events counted, never reset (O(1) to read): a call emptied a block iff it
        # moved; the worker says so of each logged eviction and the replica checks its own
        # (vllm_adapter.messages).
        self.emptied_count = 0
        self._lone_dead: set = set()  # dead blocks whose other sharers were freed (one holder left)
        # Opt-in (None: nothing kept): a list that each fall of a block's live count appends to
        # (its block ids, repeated per live slot lost): what a reader keeping per-block
        # figures up to date applies, instead of reading every block it follows each step. Its
        # owner empties it (the adapter's plan book, at each plan check).
        self.drops: list | None = None
        # Opt-in (None: nothing kept): the requests whose block set changed (a block referenced or
        # no longer referenced), for a reader that checks which blocks each table references (the
        # adapter's runtime checks and plan gates); its owner empties it (take_reblocked)
        self.reblocked: set | None = None
        # Opt-in (None: nothing kept): (request, block) for each block a request started to
        # reference, in order, for a reader that checks only what each table gained (the
        # adapter's incremental checks: a block no longer referenced cannot break "every block
        # a table references is held for it"); its owner empties it (take_added)
        self.added: list | None = None

    # ------------------------------------------------------------------ helpers
    def _get(self, req_id):
        """The request's entry or None; ``bad_request_id`` for an unhashable id. O(1)."""
        try:
            return self._reqs.get(req_id)
        except TypeError:
            raise TableError("bad_request_id", f"request id {_show(req_id)} is not hashable") from None

    def _req(self, req_id) -> _Req:
        """Checks: ``bad_request_id``, ``unknown_request``. (``_get`` inlined: every call pays it.)"""
        try:
            r = self._reqs.get(req_id)
        except TypeError:
            raise TableError("bad_request_id", f"request id {_show(req_id)} is not hashable") from None
        if r is None:
            raise TableError("unknown_request", f"request {req_id!r} is not in the table")
        return r

    def _new_req(self, req_id) -> _Req:
        """A new, empty request: a row (a freed one reused) and no segment yet. O(1) amortised."""
        if self._free_rows:
            h = self._free_rows.pop()
        else:
            h = len(self._row) + len(self._free_rows)
            if h >= len(self._n):  # double every row array
                size = max(64, 2 * len(self._n))
                for name in ("_n", "_nl", "_cap", "_hb", "_db", "_last", "_nblk", "_bver", "_dirty"):
                    old = getattr(self, name)
                    new = np.zeros(size, dtype=old.dtype)
                    new[:len(old)] = old
                    setattr(self, name, new)
        self._n[h] = self._nl[h] = self._cap[h] = self._hb[h] = self._nblk[h] = 0
        self._bver[h] += 1  # a reused row never shows an earlier request's version
        if self.reblocked is not None:
            self.reblocked.add(req_id)
        self._db[h], self._last[h], self._dirty[h] = -1, -1, False
        r = self._reqs[req_id] = _Req(self, h, req_id)
        self._row[req_id] = h
        self._row_epoch += 1
        return r

    def _rows_of(self, req_ids) -> np.ndarray:
        """The rows of ``req_ids`` (repeats allowed); ``bad_request_id`` / ``unknown_request`` for
        the first bad one. O(requests), in C."""
        try:
            return np.array(list(map(self._row.__getitem__, req_ids)), dtype=np.int64)
        except (KeyError, TypeError):
            for r in req_ids:
                self._req(r)  # the first bad id's error
            raise

    def _rows(self, req_ids, what: str, who: str) -> np.ndarray:
        """:meth:`_rows_of` distinct requests: ``what`` (an error code) for a request named
        twice, in ``who``'s words. O(requests), in C. A decode step names the same running
        requests step after step: the last two lists found good are remembered with the rows
        they had (the last used first), and an equal list (no request added or freed since)
        reuses them (read-only)."""
        epoch = self._row_epoch
        if type(req_ids) is list:
            memo = self._rows_memo
            for k, (e, ids, hs) in enumerate(memo):
                if e == epoch and ids == req_ids:
                    if k:  # most recently used first: a decode step's growth list stays while its
                        memo[0], memo[k] = memo[k], memo[0]  # eviction lists, new each step, come and go
                    return hs
        hs = self._rows_of(req_ids)
        if len(set(hs.tolist())) != len(hs):
            raise TableError(what, f"{who}: a request named twice in {list(req_ids)!r}")
        if type(req_ids) is list:
            hs.flags.writeable = False
            self._rows_memo = [(epoch, list(req_ids), hs), self._rows_memo[0]] if self._rows_memo else \
                [(epoch, list(req_ids), hs)]
        return hs

    def _holds(self, req_ids, hs: np.ndarray, b: np.ndarray, ask: np.ndarray) -> np.ndarray:
        """Does request ``req_ids[i]`` (row ``hs[i]``) reference block ``b[i]``? Its row's last
        block answers in C (a block it references, or -1); the others where ``ask`` holds look
        in its block set (the few whose token opens a block). O(requests)."""
        held = self._last[hs] == b
        for i in np.flatnonzero(~held if ask is None else ask & ~held).tolist():
            held[i] = int(b[i]) in self._reqs[req_ids[i]].blocks
        return held

    def _block(self, block_id, what: str = "block") -> int:
        """A block id argument: ``not_integer``, then ``block_out_of_range``. O(1)."""
        b = _index(block_id, what)
        if not 0 <= b < self.num_blocks:
            raise TableError("block_out_of_range", f"{what} {_fmt(b)} outside [0, {self.num_blocks})")
        return b

    # State-changing primitives assert what they keep (the TigerBeetle way: O(changed),
    # in every run, not only in the machines): a request references a block once, refs and
    # claims never go negative, a block never holds more than S live slots.
    def _ref_block(self, r: _Req, b: int) -> None:
        assert b not in r.blocks, f"block {b} referenced twice by one request"
        if self.reblocked is not None:
            self.reblocked.add(r.rid)
        if self.added is not None:
            self.added.append((r.rid, b))
        r.blocks.add(b)
        r.block_arr = None
        self._last[r.h] = b
        self._nblk[r.h] += 1
        self._bver[r.h] += 1
        if self.refs[b] == 0:
            self._ref_blocks += 1
        self.refs[b] += 1

    def _ref_blocks_each(self, req_ids, idx: list, rows: np.ndarray, blocks: np.ndarray) -> None:
        """:meth:`_ref_block` for request ``req_ids[i]`` (row ``rows[k]``) and block ``blocks[k]``,
        ``i = idx[k]``, in order: distinct blocks, none already referenced by its request
        (``sync_one_each`` and ``apply_moves_each`` checked both); a request named more than once
        (a plan's new destinations) in consecutive entries. The per-row and per-block counts in
        one array operation each; the block sets and the logs per request."""
        reqs = self._reqs
        rids = [req_ids[i] for i in idx]
        blist = blocks.tolist()
        for rid, b in zip(rids, blist):
            r = reqs[rid]
            assert b not in r.blocks, f"block {b} referenced twice by one request"
            r.blocks.add(b)
            r.block_arr = None
        if self.reblocked is not None:
            self.reblocked.update(rids)
        if self.added is not None:
            self.added += zip(rids, blist)
        m = len(rows)
        if m > 1 and rows[0] == rows[-1]:  # one request's blocks (its entries are consecutive): a prompt's
            h = int(rows[0])
            assert (rows == h).all(), "a request's entries are not consecutive"
            self._last[h] = blocks[-1]
            self._nblk[h] += m
            self._bver[h] += m
        elif m > 1 and (rows[1:] == rows[:-1]).any():  # a request's several blocks
            last = np.append(np.flatnonzero(rows[1:] != rows[:-1]), m - 1)  # each request's last entry
            self._last[rows[last]] = blocks[last]
            runs = last - np.append(-1, last[:-1])  # each request's entries: one run of consecutive ones
            self._nblk[rows[last]] += runs  # one entry per request: a plain indexed add
            self._bver[rows[last]] += runs
        else:
            self._last[rows] = blocks
            self._nblk[rows] += 1  # rows distinct: a plain indexed add counts each once
            self._bver[rows] += 1
        before = self.refs[blocks]  # blocks distinct: a plain indexed write
        self._ref_blocks += int(np.count_nonzero(before == 0))
        self.refs[blocks] = before + 1
        self._changed.update(rids)

    def _unref_block(self, r: _Req, b: int) -> None:
        assert b in r.blocks and self.refs[b] > 0, f"block {b} unreferenced by a request that does not hold it"
        if self.reblocked is not None:
            self.reblocked.add(r.rid)
        r.blocks.discard(b)
        r.block_arr = None
        if self._last[r.h] == b:  # _last is a block the request references, or -1
            self._last[r.h] = -1
        self._nblk[r.h] -= 1
        self._bver[r.h] += 1
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self._ref_blocks -= 1
            self.placed[b * self.S:(b + 1) * self.S] = -1

    def _unref_blocks(self, r: _Req, bl: list) -> None:
        """:meth:`_unref_block` for each of ``bl``, distinct blocks ``r`` references: the per-block
        counts in one array operation each (a plan's emptied sources, a request's blocks at its
        end), the same asserts and logs. O(len(bl)), in C but for the block set."""
        if len(bl) < 4:  # the arrays' fixed price is more than a few scalar calls
            for b in bl:
                self._unref_block(r, b)
            return
        blocks = r.blocks
        for b in bl:
            assert b in blocks, f"block {b} unreferenced by a request that does not hold it"
            blocks.discard(b)
        arr = np.array(bl, dtype=np.int64)  # distinct: a repeat failed the membership assert above
        after = self.refs[arr] - 1
        assert after.min() >= 0, f"blocks {bl}: a reference count below 0"
        if self.reblocked is not None:
            self.reblocked.add(r.rid)
        r.block_arr = None
        h = r.h
        if self._last.item(h) in bl:  # _last is a block the request references, or -1
            self._last[h] = -1
        self._nblk[h] -= len(bl)
        self._bver[h] += len(bl)
        self.refs[arr] = after  # blocks distinct: a plain indexed write
        gone = arr[after == 0]
        if len(gone):
            self._ref_blocks -= len(gone)
            self.placed[(gone[:, None] * self.S + np.arange(self.S)).ravel()] = -1

    def _claim(self, slots: np.ndarray) -> None:
        """Add one live claim on each slot (slots unique within the call)."""
        if len(slots) == 0:
            return
        before = self.claims[slots]
        self.claims[slots] = before + 1
        fresh = slots[before == 0]
        np.add.at(self.n_b, fresh // self.S, _ONE)
        self._live_slots += len(fresh)
        assert len(fresh) == 0 or self.n_b[fresh // self.S].max() <= self.S, "a block holds more than S live slots"

    def _dropped(self, blocks) -> None:
        """``blocks`` (ids, or one id) each lost a live slot: logged in ``drops`` when it is on."""
        if self.drops is not None and np.size(blocks):
            self.drops.append(blocks)

    def _unclaim(self, slots: np.ndarray) -> bool:
        if len(slots) == 0:
            return False
        after = self.claims[slots] - 1
        assert after.min() >= 0, "a slot unclaimed more often than claimed"
        self.claims[slots] = after
        gone = slots[after == 0]
        np.subtract.at(self.n_b, gone // self.S, _ONE)
        self._live_slots -= len(gone)
        self._dropped(gone // self.S)
        return bool(len(gone)) and not self.n_b[gone // self.S].all()  # a block lost its last live token

    # ------------------------------------------------------------------ growth
    def _sync_many(self, chunks: list, strict: bool = True):
        """``sync_new_tokens`` for two new tokens or more per chunk (prefills): the per-token
        checks in one set of array operations over every chunk ``(req_id, r, block_ids, n,
        total_len)`` (``r`` its request or None, ``n`` its length). ``strict`` (one chunk, the
        single call): the first bad token's error, nothing changed. Not ``strict`` (several
        chunks of distinct requests, :meth:`sync_new_tokens_each`): None, nothing changed, when
        an entry read is not an integer, a token is bad or a block is named twice (the caller
        runs the chunks one by one, which raise where they would). Returns each chunk's slots."""
        S = self.S
        j0s = [n // S for _, _, _, n, _ in chunks]
        j1s = [(total - 1) // S + 1 for _, _, _, _, total in chunks]
        if strict:
            rid, _, block_ids, _, _ = chunks[0]
            seg = _index_array(block_ids[j0s[0]:j1s[0]], f"request {rid!r}: block_ids[{j0s[0]}:{j1s[0]}]")
        else:
            flat = [b for (_, _, block_ids, _, _), j0, j1 in zip(chunks, j0s, j1s) for b in block_ids[j0:j1]]
            try:
                seg = _index_array(flat, "sync_new_tokens_each: block ids")
            except TableError:
                return None
        seglist = seg.tolist()
        if not strict and len(set(seglist)) != len(seglist):  # one block named twice: one by one
            return None
        ns = np.array([n for _, _, _, n, _ in chunks], dtype=np.int64)
        ks = np.array([total for _, _, _, _, total in chunks], dtype=np.int64) - ns
        lens = np.array(j1s, dtype=np.int64) - j0s
        first = np.repeat(np.cumsum(ks) - ks, ks)  # each token's chunk's first token, in the batch
        pos = np.arange(int(ks.sum()), dtype=np.int64) - first + np.repeat(ns, ks)
        entry = pos // S + np.repeat(np.cumsum(lens) - lens - j0s, ks)  # its entry in seg
        blk = seg[entry]
        bad_range = (blk < 0) | (blk >= self.num_blocks)
        bad_null = blk == NULL_BLOCK
        slots = np.where(bad_range, 0, blk) * S + pos % S
        # A block another request references is a shared prefix: the slot must already
        # hold this very token. Otherwise the slot must be unused since the block was taken.
        seg_in = (seg >= 0) & (seg < self.num_blocks)
        mine = False
        if any(r is not None and r.blocks for _, r, _, _, _ in chunks):
            owned = [r.blocks if r is not None else () for _, r, _, _, _ in chunks]
            mine = np.fromiter((b in o for o, a, c in zip(owned, np.cumsum(lens) - lens, np.cumsum(lens))
                                for b in seglist[a:c]), dtype=bool, count=len(seglist))
        others = (seg_in & (self.refs[np.where(seg_in, seg, 0)] - mine > 0))[entry]
        placed = self.placed[slots]
        bad_conf = np.where(others, placed != pos, placed != -1)
        # distinct entries place distinct slots (an entry's tokens have distinct offsets); out of
        # range ones all read block 0, and the first of those is refused before any repeat
        if strict and len(set(seglist)) != len(seglist) and len(np.unique(slots)) != len(slots):
            _, first = np.unique(slots, return_index=True)  # a block named at two new positions
            dup = np.ones(len(slots), dtype=bool)
            dup[first] = False
            bad_conf |= dup
        bad = bad_range | bad_null | bad_conf
        if bad.any():
            if not strict:
                return None
            rid = chunks[0][0]
            i = int(np.argmax(bad))
            p, b = int(pos[i]), int(blk[i])
            if bad_range[i]:
                raise TableError("block_out_of_range", f"request {rid!r}: token {p} -> block {_fmt(b)} outside [0, {self.num_blocks})")
            if bad_null[i]:
                raise TableError("null_block", f"request {rid!r}: token {p} would land in the null block")
            raise TableError("slot_conflict", f"request {rid!r}: token {p} -> block {b} offset {p % S} is held by token {int(placed[i])} or named twice")
        return self._sync_write(chunks, seglist, lens, ns, ks, pos, slots)

    def _sync_write(self, chunks: list, seglist: list, lens, ns, ks, pos, slots) -> list[np.ndarray]:
        """:meth:`_sync_many`'s writes, every token checked (nothing here can fail): the new
        requests made, the segments grown, the new blocks referenced, the tokens placed."""
        rows, idx, fresh = [], [], []
        at = 0
        for c, ((rid, r, _, _, total), ln) in enumerate(zip(chunks, lens.tolist())):
            if r is None:
                r = self._new_req(rid)
                self._changed.add(rid)
            self._grow(r, total)
            rows.append(r.h)
            new = [b for b in dict.fromkeys(seglist[at:at + ln]) if b not in r.blocks]  # in list order: the tail's last
            idx += [c] * len(new)
            fresh += new
            at += ln
        rows = np.array(rows, dtype=np.int64)
        if fresh:  # the chunks' new blocks, each chunk's in consecutive entries
            self._ref_blocks_each([c[0] for c in chunks], idx, rows[idx], np.array(fresh, dtype=np.int64))
        self._n[rows] = ns + ks  # requests distinct: plain indexed writes
        self._nl[rows] += ks
        self._write_new(np.repeat(rows, ks), pos, slots)
        return np.split(slots, np.cumsum(ks)[:-1])

    def _write_new(self, rows: np.ndarray, tok: np.ndarray, slots: np.ndarray) -> None:
        """New tokens placed, every one checked: token ``tok[i]`` of the request in row ``rows[i]``
        live at ``slots[i]`` (slots distinct; segments grown already): the host segments, ``placed``,
        the claims (:meth:`_claim`) and the device queue. Lengths and live counts are the caller's."""
        at = self._hb[rows] + tok  # the host segments as they are now
        host = self._host
        host.slot[at] = slots
        host.live[at] = True
        self.placed[slots] = tok
        self._claim(slots)
        pool = self._pool
        if pool.mirrors:  # the device segments as they are now
            gidx = self._db[rows] + tok
            pool.pend_idx.append(gidx)
            pool.pend_val.append(slots.copy())  # the caller may write into the returned array
            pool.pend_new.append(gidx)

    def sync_new_tokens_each(self, items) -> list[np.ndarray] | None:
        """``sync_new_tokens(req_id, block_ids, total_len)`` for each item in order, as one
        operation: a prefill step's chunks. Returns each item's slots, with the state and logs
        the calls leave; or None, nothing changed, when the items are not one batch: anything
        but every item a prefill chunk (two new tokens or more, a list of block ids) of its own
        request, no block named twice and every token good; then the caller makes the calls,
        which raise where they would. One item: the call's result or its error. O(new tokens)
        in array operations (``_sync_many``), plus O(items + entries) Python work."""
        items = list(items)
        if len(items) < 2:
            return [self.sync_new_tokens(*item) for item in items]
        chunks = []
        for item in items:
            try:
                rid, block_ids, total = item
                r = self._get(rid)
            except (TableError, TypeError, ValueError):
                return None
            n = r.n if r is not None else 0
            if type(total) is not int or not isinstance(block_ids, list) or total - n < 2 or \
                    len(block_ids) * self.S < total:
                return None
            chunks.append((rid, r, block_ids, n, total))
        if len({c[0] for c in chunks}) != len(chunks):
            return None
        return self._sync_many(chunks, strict=False)

    def sync_new_tokens(self, req_id, block_ids: Sequence[int], total_len: int) -> np.ndarray:
        """Register the tokens that grew ``req_id`` to ``total_len`` (creating the request).

        ``block_ids``: the request's positional block list (a list of integers): new token ``p``
        lives at ``block_ids[p // S]``, offset ``p % S``; only entries receiving new tokens are read
        (earlier ones may be null), so the cost is O(new tokens). Checks, in order:
        ``bad_request_id``; ``not_integer`` (``total_len``, then ``block_ids`` not a sequence);
        ``length_decrease``; ``blocks_short``; ``not_integer`` (an entry read); then per new token:
        ``block_out_of_range``, ``null_block``, ``slot_conflict``. Returns the new tokens' slots
        (int64, position order): where to write their K/V."""
        r = self._get(req_id)
        n = r.n if r is not None else 0
        if type(total_len) is not int:  # the common case costs one type test each
            total_len = _index(total_len, f"request {req_id!r}: total_len")
        if type(block_ids) is not list:
            if isinstance(block_ids, torch.Tensor):
                block_ids = block_ids.detach().cpu().numpy()
            if not _is_sequence(block_ids):
                raise TableError("not_integer",
                                 f"request {req_id!r}: block_ids must be a list of block ids, got {_show(block_ids)}")
        if total_len < n:
            raise TableError("length_decrease", f"request {req_id!r}: total_len {_fmt(total_len)} < current length {n}")
        if len(block_ids) * self.S < total_len:
            raise TableError("blocks_short", f"request {req_id!r}: {len(block_ids)} blocks cannot hold {_fmt(total_len)} tokens")
        k = total_len - n
        if k == 0:
            if r is None:
                self._new_req(req_id)
                self._changed.add(req_id)
            return np.empty(0, dtype=np.int64)
        if k == 1:
            return self._sync_one(req_id, r, block_ids, n)
        return self._sync_many([(req_id, r, block_ids, n, total_len)])[0]

    def _sync_one(self, req_id, r, block_ids, n) -> np.ndarray:
        """``sync_new_tokens`` for one new token (the decode step): same checks, scalar code."""
        S = self.S
        b = block_ids[n // S]
        if type(b) is not int:  # the common case is one type test; the rest as _index
            b = _index(b, f"request {req_id!r}: block_ids[{n // S}]")
        if not 0 <= b < self.num_blocks:
            raise TableError("block_out_of_range", f"request {req_id!r}: token {n} -> block {_fmt(b)} outside [0, {self.num_blocks})")
        if b == NULL_BLOCK:
            raise TableError("null_block", f"request {req_id!r}: token {n} would land in the null block")
        s = b * S + n % S
        mine = r is not None and b in r.blocks
        placed = int(self.placed[s])
        if (placed != n) if (self.refs[b] - mine) > 0 else (placed != -1):
            raise TableError("slot_conflict", f"request {req_id!r}: token {n} -> block {b} offset {n % S} is held by token {placed}")
        if r is None:
            r = self._new_req(req_id)
        self._place(req_id, r, n, s, b, mine)
        self.placed[s] = n
        c = int(self.claims[s])
        self.claims[s] = c + 1
        if c == 0:
            self.n_b[b] += 1
            self._live_slots += 1
        g = r.base + n
        pool = self._pool
        pool.pend_idx.append(g)
        pool.pend_val.append(s)
        pool.pend_new.append(g)
        return np.array([s], dtype=np.int64)

    def sync_one_each(self, req_ids: Sequence, block_ids: Sequence[int]) -> np.ndarray:
        """``sync_new_tokens(req_ids[i], ..., length + 1)`` for every ``i`` at once: each request
        (distinct, in the table) gains its next token, placed in ``block_ids[i]`` (the block its
        positional list holds at the token's index) at offset ``length % S``. What a decode step
        does to every running request; one call instead of one per request (the scheduler side's
        replica replays a step's growth so). The same checks as the single call, every request
        checked before anything changes; two requests naming one block is ``slot_conflict`` (one
        after the other the first's token could decide the second's check: never in a decode
        step, whose blocks are each request's own tail): ``bad_request_id``, ``unknown_request``,
        ``not_integer``, ``block_out_of_range``, ``null_block``, ``slot_conflict``. Returns the
        slots, in order. O(requests) in array operations, plus Python work only for the requests
        whose token opens a block, or outgrows its segment."""
        hs = self._rows(req_ids, "slot_conflict", "sync_one_each")
        b = _index_array(block_ids, "sync_one_each: block_ids")
        if len(b) != len(hs):
            raise TableError("not_integer", f"sync_one_each: {len(hs)} requests but {len(b)} blocks")
        if not len(b):
            return np.empty(0, dtype=np.int64)
        blist = b.tolist()
        if len(set(blist)) != len(blist):  # one after the other, a request's token may decide another's check
            raise TableError("slot_conflict", f"sync_one_each: a block named twice in {blist} (sync one by one)")
        S = self.S
        n = self._n[hs]
        in_range = min(blist) > NULL_BLOCK and max(blist) < self.num_blocks  # the common case: no mask needed
        bad_range = False if in_range else (b < 0) | (b >= self.num_blocks)
        bs = b if in_range else np.where(bad_range, 1, b)
        s = bs * S + n % S
        mine = self._holds(req_ids, hs, bs, None)
        placed = self.placed[s]
        conflict = np.where(self.refs[bs] - mine > 0, placed != n, placed != -1)
        bad = conflict if in_range else bad_range | (b == NULL_BLOCK) | conflict
        if bad.any():
            self._refuse_one_each(req_ids, b, n, placed, bad, None if in_range else bad_range)
        # ---- apply (nothing below can fail)
        for i in np.flatnonzero(n >= self._cap[hs]).tolist():  # outgrows its segments (doubling: rare)
            self._grow(self._reqs[req_ids[i]], int(n[i]) + 1)
        opening = np.flatnonzero(~mine)  # its token opens a block
        if len(opening):
            self._ref_blocks_each(req_ids, opening.tolist(), hs[opening], b[opening])
        at = self._hb[hs] + n  # the host segments as they are now (a _grow above may have moved one)
        host = self._host
        host.slot[at] = s
        host.live[at] = True
        self._n[hs] = n + 1
        self._nl[hs] += 1  # rows distinct: a plain indexed add counts each once
        self._last[hs] = b
        self.placed[s] = n
        # _claim with distinct blocks (checked above): a plain indexed add counts each once
        before = self.claims[s]
        self.claims[s] = before + 1
        fresh_b = s[before == 0] // S
        self.n_b[fresh_b] += 1
        self._live_slots += len(fresh_b)
        assert len(fresh_b) == 0 or self.n_b[fresh_b].max() <= S, "a block holds more than S live slots"
        pool = self._pool
        if pool.mirrors:  # the device segments as they are now
            gidx = self._db[hs] + n
            pool.pend_idx.append(gidx)
            pool.pend_val.append(s.copy())
            pool.pend_new.append(gidx)
        return s

    def sync_steps_each(self, req_ids: Sequence, steps: Sequence) -> list[np.ndarray] | None:
        """``sync_one_each(req_ids, steps[j])`` for ``j = 0, 1, ...`` in order, as one operation:
        several decode steps' growth of the same requests (the replica's held-back reports).
        Returns each step's slots, with the state and logs the calls leave; or None, nothing
        changed, when the steps are not one batch: anything but each step an int64 array of one
        block per request, every block in range and not null, no block named by two requests or
        by one request after it left it, at most ``S`` steps, each request opening at most one
        block, and every token good; then the caller makes the calls, which raise where they
        would. One step, or a request list the table refuses: the call's result or its error
        (nothing changed). O(steps x requests) in array operations, plus Python work for the
        requests opening a block."""
        k = len(steps)
        hs = self._rows(req_ids, "slot_conflict", "sync_one_each")  # the first call's first check
        R, S = len(hs), self.S
        if k < 2 or R == 0:  # one call: atomic on its own
            return [self.sync_one_each(req_ids, x) for x in steps]
        if k > S or not all(type(x) is np.ndarray and x.dtype == np.int64 and x.shape == (R,) for x in steps):
            return None
        B = np.stack(steps)  # k x R: step j, request i
        if not (B.min() > NULL_BLOCK and B.max() < self.num_blocks):
            return None
        moved = B[1:] != B[:-1]  # a request's token in another block than its previous one
        head = np.vstack([np.ones((1, R), dtype=bool), moved])  # the first token of each run in one block
        heads = B[head]
        if len(set(heads.tolist())) != len(heads):  # a block two requests name, or one a request came back to
            return None
        held = np.zeros((k, R), dtype=bool)  # each run's block referenced by its request before the call
        held[0] = self._holds(req_ids, hs, B[0], None)
        for j, i in zip(*(x.tolist() for x in np.nonzero(moved))):
            held[j + 1, i] = int(B[j + 1, i]) in self._reqs[req_ids[i]].blocks
        opening = head & ~held
        if (opening.sum(axis=0) > 1).any():  # a request opening two blocks: its refs logged step by step
            return None
        run = np.maximum.accumulate(np.where(head, np.arange(k)[:, None], 0), axis=0)  # each token's run head
        mine = held[run, np.arange(R)]
        n = self._n[hs]
        tok = n + np.arange(k)[:, None]
        s = B * S + tok % S  # distinct: each run at most S tokens, the runs' blocks distinct
        placed = self.placed[s]
        # no other request names these blocks in the call, so their references are the table's now
        if np.where(self.refs[B] - mine > 0, placed != tok, placed != -1).any():
            return None
        # ---- apply (nothing below can fail)
        for i in np.flatnonzero(n + k > self._cap[hs]).tolist():  # outgrows its segments (doubling: rare)
            self._grow(self._reqs[req_ids[i]], int(n[i]) + k)
        oj, oi = np.nonzero(opening)  # step by step, in request order: as the calls log them
        if len(oi):
            self._ref_blocks_each(req_ids, oi.tolist(), hs[oi], B[oj, oi])
        self._n[hs] = n + k
        self._nl[hs] += k  # rows distinct: a plain indexed add counts each once
        self._last[hs] = B[-1]
        self._write_new(np.broadcast_to(hs, (k, R)).ravel(), tok.ravel(), s.ravel())  # step by step
        return list(s)

    def _refuse_one_each(self, req_ids, b, n, placed, bad, bad_range) -> None:
        """``sync_one_each``'s error for the first bad request (``bad_range`` None: every block in range)."""
        i = int(np.argmax(bad))
        rid, t, blk = req_ids[i], int(n[i]), int(b[i])
        if bad_range is not None and bad_range[i]:
            raise TableError("block_out_of_range", f"request {rid!r}: token {t} -> block {_fmt(blk)} outside "
                                                   f"[0, {self.num_blocks})")
        if blk == NULL_BLOCK:
            raise TableError("null_block", f"request {rid!r}: token {t} would land in the null block")
        raise TableError("slot_conflict", f"request {rid!r}: token {t} -> block {blk} offset {t % self.S} is held by "
                                          f"token {int(placed[i])} or named twice")

    def _place(self, req_id, r: _Req, t: int, s: int, b: int, own: bool) -> None:
        """Token ``t`` (the request's next) live at slot ``s`` of block ``b`` (``own``: the request
        references ``b`` already) in the request's host arrays; the caller checked it and keeps
        the per-slot arrays and the read side. O(1) amortised."""
        if t + 1 > r.cap:
            self._grow(r, t + 1)
        if not own:
            self._ref_block(r, b)
            self._changed.add(req_id)
        r.slot[t] = s
        r.live[t] = True
        r.n, r.n_live = t + 1, r.n_live + 1
        self._last[r.h] = b

    def _grow(self, r: _Req, need: int) -> None:
        """Make room for ``need`` tokens in the host segment and the device segment."""
        if need <= r.cap:
            return
        # One power-of-two capacity for the host segment and the device segment, so a
        # check against r.cap covers both (doubling: growth is amortised O(1) per token).
        cap = max(64, 1 << (need - 1).bit_length())
        h, old, n, host = r.h, r.cap, r.n, self._host
        hb = host.alloc(cap)
        if old:
            ob = self._hb.item(h)
            host.slot[hb:hb + n] = host.slot[ob:ob + n]
            host.live[hb:hb + n] = host.live[ob:ob + n]
            host.release(ob, old)
        self._hb[h] = hb
        pool = self._pool
        base = pool.alloc(cap)
        if old and pool.mirrors:
            pool.flush()
            pool.slot[base:base + r.n] = pool.slot[r.base:r.base + r.n]
            pool.live[base:base + r.n] = pool.live[r.base:r.base + r.n]
            pool.release(r.base, old)
        self._db[h], self._cap[h] = base, cap

    # ------------------------------------------------------------------ eviction
    def evict_token(self, req_id, token_id: int) -> None:
        """Evict one token. Checks: ``bad_request_id``, ``unknown_request``, ``not_integer``,
        ``unknown_token``, ``dead_token``. O(1)."""
        r = self._req(req_id)
        self._evict_one(req_id, r, _index(token_id, f"request {req_id!r}: token id"))

    def evict_tokens(self, req_id, token_ids: Iterable[int]) -> None:
        """Mark tokens dead (metadata only; no K/V touched, no block freed). Checks, in order:
        ``bad_request_id``, ``unknown_request``; ``not_integer`` (the whole list first); then per id
        in order: ``unknown_token``, ``dead_token``, ``duplicate_token``. O(ids)."""
        r = self._req(req_id)
        if type(token_ids) in (list, tuple) and len(token_ids) == 1 and type(token_ids[0]) is int:
            return self._evict_one(req_id, r, token_ids[0])  # the decode step: scalar code
        ids = _index_array(token_ids, f"request {req_id!r}: token ids")
        if len(ids) == 0:
            return
        bad_range = (ids < 0) | (ids >= r.n)
        safe = np.where(bad_range, 0, ids)
        bad_dead = ~bad_range & ~r.live[safe]
        _, first = np.unique(ids, return_index=True)
        dup = np.ones(len(ids), dtype=bool)
        dup[first] = False
        bad = bad_range | bad_dead | dup
        if bad.any():
            i = int(np.argmax(bad))
            t = int(ids[i])
            code = "unknown_token" if bad_range[i] else "dead_token" if bad_dead[i] else "duplicate_token"
            raise TableError(code, f"request {req_id!r}: evict token {_fmt(t)} (length {r.n})")
        r.live[ids] = False
        r.n_live -= len(ids)
        self._dead += len(ids)
        if self._unclaim(r.slot[ids]):
            self._mark_emptied(req_id)
        self._pool.pend_dead.append(ids + r.base)
        r.map_dirty = True
        self._changed.add(req_id)

    def evict_one_each(self, req_ids: Sequence, token_ids: Sequence[int]) -> None:
        """``evict_tokens(req_ids[i], [token_ids[i]])`` for every ``i`` at once (distinct requests,
        one token each: a decode step's evictions). Every token checked before anything changes:
        ``bad_request_id``, ``unknown_request``, ``not_integer``, ``unknown_token``, ``dead_token``,
        and ``duplicate_token`` for a request named twice. O(requests) in array operations."""
        hs = self._rows(req_ids, "duplicate_token", "evict_one_each")
        t = _index_array(token_ids, "evict_one_each: token_ids")
        if len(t) != len(hs):
            raise TableError("not_integer", f"evict_one_each: {len(hs)} requests but {len(t)} tokens")
        if not len(t):
            return
        n = self._n[hs]
        unknown = (t < 0) | (t >= n)
        at = self._hb[hs] + np.where(unknown, 0, t)
        host = self._host
        dead = ~unknown & ~host.live[at]
        if unknown.any() or dead.any():
            i = int(np.argmax(unknown | dead))
            x = int(t[i])
            if unknown[i]:
                raise TableError("unknown_token", f"request {req_ids[i]!r}: evict token {_fmt(x)} (length {int(n[i])})")
            raise TableError("dead_token", f"request {req_ids[i]!r}: evict token {x} (length {int(n[i])})")
        # ---- apply (nothing below can fail)
        host.live[at] = False
        self._nl[hs] -= 1
        self._dead += len(hs)
        self._dirty[hs] = True
        slots = host.slot[at]
        pool = self._pool
        if pool.mirrors:
            pool.pend_dead.append(self._db[hs] + t)
        self._changed.update(req_ids)
        sl = slots.tolist()
        if len(set(sl)) == len(sl):  # the common case: no shared slot evicted twice in one step
            after = self.claims[slots] - 1
            self.claims[slots] = after
            last = np.arange(len(sl))  # each slot's one evictor is its last
            gone = slots[after == 0]
        else:
            np.subtract.at(self.claims, slots, _ONE)
            after = self.claims[slots]
            _, lst = np.unique(slots[::-1], return_index=True)  # one after the other, a shared slot's
            last = len(sl) - 1 - lst  # last evictor is the one that emptied its block
            gone = np.unique(slots[after == 0])
        assert after.min() >= 0, "a slot unclaimed more often than claimed"
        gb = gone // self.S
        if len(set(gb.tolist())) == len(gb):  # each block once: a plain indexed update counts right
            self.n_b[gb] -= 1
        else:
            np.subtract.at(self.n_b, gb, _ONE)
        self._live_slots -= len(gone)
        self._dropped(gb)
        for i in last[self.n_b[slots[last] // self.S] == 0].tolist():
            self._mark_emptied(req_ids[i])

    def _mark_emptied(self, req_id) -> None:
        """An eviction of ``req_id``'s left one of its blocks with no live token: recorded for
        :meth:`take_emptied` and counted (``emptied_count``). O(1)."""
        self._emptied.add(req_id)
        self.emptied_count += 1

    def _evict_one(self, req_id, r: _Req, t: int) -> None:
        """``evict_tokens`` of one id, ``t`` a Python int (any size): same checks, scalar code."""
        if not 0 <= t < r.n:
            raise TableError("unknown_token", f"request {req_id!r}: evict token {t} (length {r.n})")
        if not r.live[t]:
            raise TableError("dead_token", f"request {req_id!r}: evict token {t} (length {r.n})")
        r.live[t] = False
        r.n_live -= 1
        self._dead += 1
        s = int(r.slot[t])
        c = int(self.claims[s]) - 1
        assert c >= 0, f"slot {s} unclaimed more often than claimed"
        self.claims[s] = c
        if c == 0:
            self.n_b[s // self.S] -= 1
            self._live_slots -= 1
            self._dropped(s // self.S)
            if self.n_b[s // self.S] == 0:
                self._mark_emptied(req_id)
        self._pool.pend_dead.append(r.base + t)
        r.map_dirty = True
        self._changed.add(req_id)

    # ------------------------------------------------------------------ relocation
    def apply_moves(self, req_id, moves) -> list[int]:
        """Atomically move live tokens: moves are ``(token_id, src_block, src_offset, dst_block, dst_offset)``.

        Call after the copy of the moves' K/V completed; the whole list is validated first. Checks:
        ``bad_request_id``, ``unknown_request``, ``bad_move`` (not a (k, 5) integer array or an
        iterable of five-integer rows); then per move in order: ``unknown_token``, ``dead_token``,
        ``duplicate_token``, ``wrong_source``, ``shared_block`` (source), ``block_out_of_range``,
        ``bad_offset``, ``null_block``, ``shared_block`` / ``foreign_block`` (destination),
        ``slot_occupied``, ``duplicate_destination``. O(moves). A destination the request did not
        reference becomes its. Returns the sources left with no live token, sorted, which the table
        stops referencing and the caller frees. (:meth:`apply_moves_each` of one request.)"""
        return self.apply_moves_each([(req_id, moves)])[0]

    def apply_moves_each(self, items) -> list[list[int]]:
        """:meth:`apply_moves` of each ``(req_id, moves)`` of ``items`` (distinct requests: one
        named twice is ``duplicate_token``), validated together and applied together: every
        item's ids and move rows are checked first (in order), then every move's checks (the
        first bad move, in the items' order and then the moves', raises, naming its request and
        its index in that request's list), and nothing changes unless all pass. The same as
        applying them one after the other, but that a block referenced by another item's
        request, even one that item empties, is never a destination (``foreign_block``), and a
        fresh block is the destination of the first item naming it only. (What the scheduler
        side's replica replays: the plans a worker report ends, one request each, I4.) Returns
        each item's emptied sources, as :meth:`apply_moves` does. O(moves + items), in array
        operations over all items' moves at once."""
        rs, ms = self._move_items(items)
        out: list[list[int]] = [[] for _ in rs]
        at = [i for i, m in enumerate(ms) if len(m)]
        if not at:
            return out
        rs = [rs[i] for i in at]
        m = ms[at[0]] if len(at) == 1 else np.concatenate([ms[i] for i in at])
        ri = np.repeat(np.arange(len(at), dtype=np.int64), [len(ms[i]) for i in at])  # each move's request
        S, NB, host = self.S, self.num_blocks, self._host
        rows = np.array([r.h for r in rs], dtype=np.int64)
        tok, src_block, src_off, dst_block, dst_off = m.T
        c_unknown = (tok < 0) | (tok >= self._n[rows][ri])
        # each token's host index (an unknown one reads its request's first entry: the host pool
        # is never empty, and the move is refused as unknown before any other check of it counts)
        g = self._hb[rows][ri] + np.where(c_unknown, 0, tok)
        c_dead, cur = ~c_unknown & ~host.live[g], host.slot[g]
        c_duptok = _repeats(g)
        # compared apart, not as src_block * S + src_off: that can wrap in int64
        c_src = (src_block != cur // S) | (src_off != cur % S)
        c_srcshared = self.refs[cur // S] > 1
        c_range = (dst_block < 0) | (dst_block >= NB)
        dst_block_safe = np.where(c_range, 0, dst_block)
        c_off = (dst_off < 0) | (dst_off >= S)
        c_null = dst_block == NULL_BLOCK
        dref = self.refs[dst_block_safe]
        mine, fresh_taken = self._destinations_of(rs, ri, dst_block_safe, dref)
        c_dshared = mine & (dref > 1)
        c_foreign = (~mine & (dref > 0)) | fresh_taken
        dst = dst_block_safe * S + np.where(c_off, 0, dst_off)
        c_occ = self.claims[dst] > 0  # dst is own or fresh, so a claim is a live token of ours
        c_dupdst = _repeats(dst)
        checks = (
            ("unknown_token", c_unknown), ("dead_token", c_dead), ("duplicate_token", c_duptok),
            ("wrong_source", c_src), ("shared_block", c_srcshared), ("block_out_of_range", c_range),
            ("bad_offset", c_off), ("null_block", c_null), ("shared_block", c_dshared),
            ("foreign_block", c_foreign), ("slot_occupied", c_occ), ("duplicate_destination", c_dupdst),
        )
        bad = np.zeros(len(m), dtype=bool)
        for _, c in checks:
            bad |= c
        if bad.any():
            i = int(np.argmax(bad))
            code = next(name for name, c in checks if c[i])
            k = int(ri[i])
            j = i - int(np.searchsorted(ri, k))  # its index in its request's list
            raise TableError(code, f"request {rs[k].rid!r}: move #{j} ({', '.join(_fmt(int(x)) for x in m[i])})")
        for k, e in zip(at, self._apply_valid_moves(rs, rows, ri, tok, g, cur, dst)):
            out[k] = e
        return out

    def _move_items(self, items) -> tuple[list, list]:
        """:meth:`apply_moves_each`'s argument checks, item after item: the request (``bad_request_id``,
        ``unknown_request``, ``duplicate_token`` when named again), its moves (``bad_move``).
        Returns the requests and their moves as (k, 5) int64 arrays."""
        rs, ms, seen = [], [], set()
        for req_id, moves in items:
            r = self._req(req_id)
            if req_id in seen:
                raise TableError("duplicate_token", f"apply_moves_each: request {req_id!r} named twice")
            seen.add(req_id)
            rs.append(r)
            ms.append(_moves_array(moves, f"request {req_id!r}: moves"))
        return rs, ms

    def _destinations_of(self, rs: list, ri: np.ndarray, blocks: np.ndarray, dref: np.ndarray):
        """Per move: is its destination block one its request ``rs[ri]`` references (``mine``), and
        is it a fresh block (``dref`` 0: referenced by no request) that an earlier item names too
        (``taken``: foreign once that item has taken it). O(moves) in array operations, plus a
        Python pass over the distinct (request, block) pairs: a plan's moves land in few blocks."""
        NB = self.num_blocks
        uk, first_at, inv = np.unique(ri * NB + blocks, return_index=True, return_inverse=True)
        mine, taken, first = [], [], {}
        for k, b, refs in zip(*(x.tolist() for x in (*np.divmod(uk, NB), dref[first_at]))):  # by item, then block
            own = b in rs[k].blocks
            mine.append(own)
            taken.append(not own and refs == 0 and first.setdefault(b, k) != k)
        return np.array(mine, dtype=bool)[inv], np.array(taken, dtype=bool)[inv]

    def _apply_valid_moves(self, rs: list, rows: np.ndarray, ri: np.ndarray, tok, g, cur, dst) -> list[list[int]]:
        """Apply moves :meth:`apply_moves_each` validated: move ``i`` of request ``rs[ri[i]]`` (row
        ``rows[ri[i]]``), token ``tok[i]`` (host index ``g[i]``) from slot ``cur[i]`` to ``dst[i]``.
        Returns each request's emptied sources (sorted), no longer referenced."""
        S, NB, host = self.S, self.num_blocks, self._host
        ks, bs = np.divmod(np.unique(ri * NB + dst // S), NB)  # each request's destination blocks, ascending
        new = [j for j, (k, b) in enumerate(zip(ks.tolist(), bs.tolist())) if b not in rs[k].blocks]
        if new:
            self._ref_blocks_each([r.rid for r in rs], ks[new].tolist(), rows[ks[new]], bs[new])
        self._unclaim(cur)
        self._claim(dst)
        host.slot[g] = dst
        self.placed[dst] = tok
        self._pool.pend_idx.append(tok + self._db[rows][ri])
        self._pool.pend_val.append(dst.copy())
        self._dirty[rows] = True
        src = np.unique(ri * NB + cur // S)  # each request's sources, ascending
        src = src[self.n_b[src % NB] == 0]
        emptied: list[list[int]] = [[] for _ in rs]
        for k, b in zip(*(x.tolist() for x in np.divmod(src, NB))):
            emptied[k].append(b)
        for r, e in zip(rs, emptied):
            self._unref_blocks(r, e)
            self._changed.add(r.rid)
        return emptied

    def release_empty_blocks(self, req_id, block_ids: Iterable[int]) -> list[int]:
        """Stop referencing blocks of ``req_id`` that hold no live token (all evicted). Checks:
        ``bad_request_id``, ``unknown_request``; ``not_integer`` (the whole list first); then per
        block in order: ``block_out_of_range``, ``foreign_block``, ``shared_block``,
        ``block_not_empty``, ``duplicate_block``. Returns the blocks, sorted, for the caller to
        free. O(blocks given)."""
        r = self._req(req_id)
        bl = _index_array(block_ids, f"request {req_id!r}: block ids").tolist()
        seen = set()
        for b in bl:
            if not (0 <= b < self.num_blocks):
                raise TableError("block_out_of_range", f"request {req_id!r}: block {_fmt(b)} outside [0, {self.num_blocks})")
            if b not in r.blocks:
                raise TableError("foreign_block", f"request {req_id!r} does not reference block {b}")
            if self.refs[b] > 1:
                raise TableError("shared_block", f"request {req_id!r}: block {b} is shared")
            if self.n_b[b] != 0:
                raise TableError("block_not_empty", f"request {req_id!r}: block {b} holds {int(self.n_b[b])} live token(s)")
            if b in seen:
                raise TableError("duplicate_block", f"request {req_id!r}: block {b} named twice")
            seen.add(b)
        self._unref_blocks(r, bl)
        self._changed.add(req_id)
        return sorted(bl)

    def free_request(self, req_id) -> list[int]:
        """Forget ``req_id``; returns every block it referenced, sorted (the caller drops one
        reference each). Checks: ``bad_request_id``, ``unknown_request``. O(length + blocks)."""
        r = self._req(req_id)
        live_ids = np.flatnonzero(r.live[: r.n])
        self._unclaim(r.slot[live_ids])
        self._dead -= r.n - r.n_live
        blocks = sorted(r.blocks)
        self._unref_blocks(r, blocks)
        if blocks:
            arr = np.array(blocks, dtype=np.int64)  # its last sharer left it dead: releasable for the holder
            self._lone_dead.update(arr[(self.refs[arr] == 1) & (self.n_b[arr] == 0)].tolist())
        self._forget(r)
        return blocks

    def _forget(self, r: _Req) -> None:
        """The end of a free: ``r``'s segments and row handed back, its id gone (its tokens and
        blocks given back already)."""
        if r.cap:
            self._pool.release(r.base, r.cap)
            self._host.release(self._hb.item(r.h), r.cap)
        del self._reqs[r.rid]
        del self._row[r.rid]
        self._row_epoch += 1
        self._free_rows.append(r.h)
        self._changed.add(r.rid)

    def free_requests(self, req_ids) -> list[list[int]] | None:
        """``free_request(r)`` for each of ``req_ids`` in order, as one operation: the requests a
        step finished. Returns each one's blocks, with the state and logs the calls leave; or
        None, nothing changed, when they are not one batch: anything but distinct requests in
        the table each of whose blocks one of them alone references (no prefix shared: every
        block goes unreferenced, none is left lone-dead); then the caller makes the calls, which
        raise where they would. One request: the call's result or its error. O(their tokens +
        blocks) in array operations, plus O(requests) Python."""
        ids = list(req_ids)
        if len(ids) < 2:
            return [self.free_request(x) for x in ids]
        try:
            rs = [self._req(x) for x in ids]
        except TableError:
            return None
        if len(set(ids)) != len(ids):
            return None
        out = [sorted(r.blocks) for r in rs]
        allb = np.fromiter((b for bl in out for b in bl), dtype=np.int64)
        if len(allb) and self.refs[allb].max() != 1:  # a block shared, or referenced twice among them
            return None
        self._free_alone(rs, out, allb)
        return out

    def _free_alone(self, rs: list, out: list, allb: np.ndarray) -> None:
        """:meth:`free_requests`' array path: ``rs`` distinct requests, ``out`` their blocks
        sorted, ``allb`` all of those, each referenced once in the table (by its request)."""
        live = [r.slot[: r.n][r.live[: r.n]] for r in rs]
        self._unclaim(np.concatenate(live) if live else np.empty(0, dtype=np.int64))
        for r, bl in zip(rs, out):  # _unref_blocks' per-request part; no block stays referenced
            self._dead -= r.n - r.n_live
            if bl and self.reblocked is not None:
                self.reblocked.add(r.rid)
            r.blocks = set()
            r.block_arr = None
            h = r.h
            self._last[h] = -1
            self._nblk[h] -= len(bl)
            self._bver[h] += len(bl)
        if len(allb):
            self.refs[allb] = 0
            self._ref_blocks -= len(allb)
            self.placed[(allb[:, None] * self.S + np.arange(self.S)).ravel()] = -1
        for r in rs:
            self._forget(r)

    # ------------------------------------------------------------------ queries
    # Costs are stated per method. A per-step caller (planner, adapter, engine) uses only the
    # O(1) and O(length)/O(blocks) ones without a sort: num_live, length, num_blocks_of,
    # references, tail_block, block_refs, block_live_count, block_array when unchanged (O(1));
    # releasable_blocks (O(blocks)); live_slots, are_live (O(length) / O(ids)); slot_mapping
    # (cached). blocks_of sorts: snapshots and checks only.
    # Every request-taking query raises bad_request_id / unknown_request first.
    def __contains__(self, req_id) -> bool:
        """Is ``req_id`` in the table? (O(1); an unhashable id is ``bad_request_id``)"""
        return self._get(req_id) is not None

    def present(self, req_ids) -> list:
        """The ids of ``req_ids`` that are in the table, in their order (O(given), in C; an
        unhashable id is ``bad_request_id``)."""
        try:
            return list(filter(self._reqs.__contains__, req_ids))
        except TypeError:
            for r in req_ids:
                self._get(r)  # the first unhashable id's error
            raise

    def requests(self) -> list:
        """Request ids, in insertion order. O(requests)."""
        return list(self._reqs)

    def length(self, req_id) -> int:
        """Tokens tracked (live and dead): the next new token's position. O(1)."""
        return self._req(req_id).n

    def num_live(self, req_id) -> int:
        """Live tokens. O(1)."""
        return self._req(req_id).n_live

    def live_tokens(self, req_id) -> np.ndarray:
        """Live token ids in logical order (a new int64 array). O(length)."""
        r = self._req(req_id)
        return np.flatnonzero(r.live[: r.n])

    def live_mask(self, req_id) -> np.ndarray:
        """Per-token liveness (a bool copy). O(length)."""
        r = self._req(req_id)
        return r.live[: r.n].copy()

    def slots(self, req_id) -> np.ndarray:
        """Per-token slots (host copy; dead tokens' entries are their last location). O(length)."""
        r = self._req(req_id)
        return r.slot[: r.n].copy()

    def blocks_of(self, req_id) -> list[int]:
        """The blocks the request references, sorted (O(blocks log blocks): for snapshots,
        checks and tests, not per-step paths; those use :meth:`block_array`)."""
        return sorted(self._req(req_id).blocks)

    def blocks_outside(self, req_id, *holds) -> set:
        """The blocks the request references that are in none of ``holds`` (iterables of block
        ids: sets, dicts' keys, lists), as a new set: set differences in C, no array built.
        Checks: ``bad_request_id``, ``unknown_request``, then ``not_integer`` for a hold that is
        not iterable or holds an unhashable entry (the table unchanged either way). O(blocks +
        holds)."""
        r = self._req(req_id)
        try:
            return r.blocks.difference(*holds)
        except TypeError:  # a hold not iterable, or holding an unhashable entry
            bad = [h for h in holds if not _iterable(h)]
            got = _show(bad[0]) if bad else "an unhashable entry"
            raise TableError("not_integer", f"blocks_outside: each hold must be a container of block ids, "
                                            f"got {got}") from None

    def block_array(self, req_id) -> np.ndarray:
        """The blocks the request references, in no particular order, as a read-only int64
        array: built in O(blocks) (no sort) when the request's block set changed since the last
        call, else the same array (O(1)). Copy it to modify it."""
        r = self._req(req_id)
        if r.block_arr is None:
            arr = np.fromiter(r.blocks, dtype=np.int64, count=len(r.blocks))
            arr.flags.writeable = False
            r.block_arr = arr
        return r.block_arr

    def take_changed(self) -> set:
        """The requests whose blocks or liveness changed since the previous call, and forget them
        (for the adapter's per-request cache: its work grows with what changed). O(changed)."""
        out, self._changed = self._changed, set()
        return out

    def take_reblocked(self) -> set:
        """The requests whose block set changed since the previous call (empty unless the
        ``reblocked`` log is on), and forget them. O(changed)."""
        if not self.reblocked:
            return set()
        out, self.reblocked = self.reblocked, set()
        return out

    def take_added(self) -> list:
        """``(request, block)`` for each block a request started to reference since the previous
        call, in order (empty unless the ``added`` log is on), and forget them. O(added)."""
        if not self.added:
            return []
        out, self.added = self.added, []
        return out

    def take_emptied(self) -> set:
        """The requests whose evictions left some block with no live token since the previous call
        (the candidates for :meth:`releasable_blocks`), and forget them. O(changed)."""
        out, self._emptied = self._emptied, set()
        return out

    def take_lone_dead(self) -> set:
        """Blocks with no live token that :meth:`free_request` left with one referencing
        request (releasable for it, though its own table did not change) since the previous
        call, and forget them. O(changed)."""
        out, self._lone_dead = self._lone_dead, set()
        return out

    def releasable_blocks(self, req_id) -> np.ndarray:
        """Blocks only this request references that hold no live token: what
        :meth:`release_empty_blocks` accepts. Unsorted int64, the tail included. O(blocks)."""
        b = self.block_array(req_id)
        return b[(self.n_b[b] == 0) & (self.refs[b] == 1)]

    def num_blocks_of(self, req_id) -> int:
        """How many blocks the request references. O(1)."""
        return len(self._req(req_id).blocks)

    def reclaim_inputs(self, req_id, tail=OWN_TAIL) -> tuple[int, int, bool, int]:
        """``(blocks referenced, live tokens, references tail?, live count of block tail)``:
        what the planner's reclaim bound reads, in one lookup (the last is 0 unless the
        request references ``tail``). ``tail``: a block id, None (no tail), or ``OWN_TAIL``
        (default) for :meth:`tail_block`'s block. Checks as :meth:`references`. O(1)."""
        r = self._req(req_id)
        if tail is OWN_TAIL:
            b = self._tail_of(r)
        else:
            b = None if tail is None else self._block(tail)
        return self._reclaim_row(r, b)

    def reclaim_inputs_many(self, req_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`reclaim_inputs` with each request's own tail, as four int64 arrays in ``req_ids``
        order; the first bad id raises. O(requests)."""
        hs = self._rows_of(req_ids)
        n = self._n[hs]
        has = n > 0
        tail = np.where(has, self._host.slot[self._hb[hs] + np.maximum(n - 1, 0)] // self.S, -1)
        held = has & self._holds(req_ids, hs, tail, has)
        return (self._nblk[hs], self._nl[hs], held.astype(np.int64),
                np.where(held, self.n_b[np.where(held, tail, 0)], 0).astype(np.int64))

    def block_versions(self, req_ids) -> np.ndarray:
        """Each request's block-set version, int64 in ``req_ids`` order: it moves by one per block
        the request references or releases (equal versions of one request: the same set; one
        apart: one block more or less). Errors as :meth:`dead_counts`. O(requests)."""
        return self._bver[self._rows_of(req_ids)]

    def dead_counts(self, req_ids) -> np.ndarray:
        """Each request's evicted tokens (length - live), int64 in ``req_ids`` order: grows by one
        per eviction, nothing else changes it. ``bad_request_id`` / ``unknown_request``. O(requests)."""
        hs = self._rows_of(req_ids)
        return self._n[hs] - self._nl[hs]

    def _tail_of(self, r: _Req) -> int | None:
        """The block of ``r``'s last position (a slot the table wrote: in range), None when empty."""
        h = r.h  # row reads by item(): Python ints, no numpy scalar nor segment view (a hot path)
        n = self._n.item(h)
        return self._host.slot.item(self._hb.item(h) + n - 1) // self.S if n else None

    def _reclaim_row(self, r: _Req, b: int | None) -> tuple[int, int, bool, int]:
        held = b is not None and b in r.blocks
        return len(r.blocks), r.n_live, held, (self.n_b.item(b) if held else 0)

    def references(self, req_id, block_id: int) -> bool:
        """Does the request reference ``block_id``? Checks: ``not_integer``,
        ``block_out_of_range``. O(1)."""
        r = self._req(req_id)
        return self._block(block_id) in r.blocks

    def tail_block(self, req_id) -> int | None:
        """The block of the request's last position, live or dead (None when empty): the block
        being written, never a planner's source. O(1)."""
        return self._tail_of(self._req(req_id))

    def live_slots(self, req_id) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, slots)``: the live token ids in logical order and their slots (new int64
        arrays). O(length)."""
        r = self._req(req_id)
        ids = np.flatnonzero(r.live[: r.n])
        return ids, r.slot[ids]

    def are_live(self, req_id, token_ids) -> np.ndarray:
        """Liveness of the given ids, in their order, as a new bool array. Checks: ``not_integer``,
        then ``unknown_token`` (outside ``[0, length)``). O(ids)."""
        r = self._req(req_id)
        ids = _index_array(token_ids, f"request {req_id!r}: token ids")
        if len(ids) and (ids.min() < 0 or ids.max() >= r.n):
            raise TableError("unknown_token", f"request {req_id!r}: token ids outside [0, {r.n})")
        return r.live[ids]

    def location(self, req_id, token_id: int) -> tuple[int, int]:
        """``(block, offset)`` of a live token. Checks: ``not_integer``, ``unknown_token``,
        ``dead_token``. O(1)."""
        r = self._req(req_id)
        t = _index(token_id, f"request {req_id!r}: token id")
        if not 0 <= t < r.n:
            raise TableError("unknown_token", f"request {req_id!r}: token {_fmt(t)} (length {r.n})")
        if not r.live[t]:
            raise TableError("dead_token", f"request {req_id!r}: token {t} was evicted")
        s = int(r.slot[t])
        return s // self.S, s % self.S

    def block_live_count(self, block_id: int) -> int:
        """``n_b``: slots of the block holding a live token. Checks: ``not_integer``,
        ``block_out_of_range``. O(1)."""
        return int(self.n_b[self._block(block_id)])

    def block_refs(self, block_id: int) -> int:
        """Requests referencing the block. Checks: ``not_integer``, ``block_out_of_range``
        (``-1`` is not the last block). O(1)."""
        return int(self.refs[self._block(block_id)])

    def waste_ratio(self) -> float:
        """Eq. 1 over referenced blocks: 1 - sum(n_b) / (N * S); 0 when nothing is allocated. O(1)."""
        return waste_ratio_of(self._live_slots, self._ref_blocks, self.S)

    @property
    def num_ref_blocks(self) -> int:
        return self._ref_blocks

    @property
    def num_live_slots(self) -> int:
        return self._live_slots

    @property
    def num_dead_tokens(self) -> int:
        """Tokens evicted over the requests in the table (each request's length - live). O(1)."""
        return self._dead

    # ------------------------------------------------------------------ read side
    def flush(self) -> None:
        """Push every queued update to the device lookup cache (one batched write; reads flush by
        themselves, an engine calls it once per step). Never waits on the device."""
        self._pool.flush()

    def read_view(self, req_id) -> tuple[torch.Tensor, torch.Tensor]:
        """Device views ``(slots[:n], live[:n])``: valid until the next mutation of the table.
        O(queued updates); no host wait."""
        r = self._req(req_id)
        if not self._pool.mirrors:  # host copies (no device mirror to view)
            return torch.from_numpy(r.slot[:r.n].copy()), torch.from_numpy(r.live[:r.n].copy())
        self._pool.flush()
        return self._pool.slot[r.base:r.base + r.n], self._pool.live[r.base:r.base + r.n]

    def slot_mapping(self, req_id) -> torch.Tensor:
        """Eq. 2 for every live token, logical order, as an int64 tensor on the table's device: a
        view valid until the table's next mutation. Cached: growth appends (O(new tokens)); after
        an eviction or move the next call recomputes it (host-listed live ids, O(length), gathered
        on the device), never reading device data back."""
        r = self._req(req_id)
        pool = self._pool
        if not pool.mirrors:  # computed from the host arrays, O(length)
            return torch.from_numpy(r.slot[np.flatnonzero(r.live[: r.n])])
        pool.flush()
        if r.map_cache is None or r.map_dirty:
            ids = np.flatnonzero(r.live[: r.n])
            k = len(ids)
            r.map_cache = torch.empty(max(64, 2 * k), dtype=torch.int64, device=self.device)
            pool.gather(ids + r.base, r.map_cache[:k])
            r.map_len, r.map_src_n, r.map_dirty = k, r.n, False
        elif r.map_src_n < r.n:
            # clean since the last compute: every token added since is live
            tail = pool.slot[r.base + r.map_src_n:r.base + r.n]
            need = r.map_len + len(tail)
            if need > len(r.map_cache):
                grown = torch.empty(2 * need, dtype=torch.int64, device=self.device)
                grown[: r.map_len] = r.map_cache[: r.map_len]
                r.map_cache = grown
            r.map_cache[r.map_len:need] = tail
            r.map_len, r.map_src_n = need, r.n
        return r.map_cache[: r.map_len]

    # ------------------------------------------------------------------ observation
    def export_state(self) -> dict:
        """The observable state as plain data, for checkers (O(total)): ``requests[req] =``
        :meth:`export_request`, ``blocks =`` :meth:`export_blocks`."""
        return {"block_size": self.S, "num_blocks": self.num_blocks,
                "requests": {rid: self.export_request(rid) for rid in self._reqs}, "blocks": self.export_blocks()}

    def export_request(self, req_id) -> dict:
        """One request of :meth:`export_state`, O(its length): ``{"length", "live": [ids],
        "loc": {id: [block, offset]}, "blocks": sorted}``. ``unknown_request`` if absent."""
        r = self._req(req_id)
        ids = np.flatnonzero(r.live[: r.n])
        blk, off = np.divmod(r.slot[ids], self.S)
        return {"length": r.n, "live": ids.tolist(),
                "loc": {t: [b, o] for t, b, o in zip(ids.tolist(), blk.tolist(), off.tolist())},
                "blocks": sorted(r.blocks)}

    def export_blocks(self) -> dict:
        """The referenced blocks of :meth:`export_state`, O(blocks): ``{b: {"refs", "live"}}``."""
        ref = np.flatnonzero(self.refs > 0)
        return {b: {"refs": r, "live": n} for b, r, n in zip(ref.tolist(), self.refs[ref].tolist(),
                                                               self.n_b[ref].tolist())}
