"""Input hardening of the token table (issue 11 item 3, the table part).

``TokenTable`` refuses non-integer input (bool, float, str, None, objects, float / bool /
object arrays and tensors, non-flat lists) with a named :class:`TableError` before any
cast, range-checks every argument, and a failing call changes nothing: host arrays,
``export_state()``, the queued device writes and the device lookup cache read back through
``read_view`` / ``slot_mapping``.

Named regression tests first (each a case issue 11 lists, or one found while fixing them),
then a Hypothesis test that drives every public method with arbitrary inputs next to the
reference model: each call succeeds on both with the same result, or fails on both with
the same code from ``TABLE_CODES`` and neither changed.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from vtoken import TableError, TokenTable
from vtoken.errors import TABLE_CODES
from vtoken.invariants.table_checks import check_unique_mapping
from vtoken.spec import SpecError, SpecTokenTable
from vtoken.spec.token_table import _ints as spec_ints

pytestmark = pytest.mark.invariants

REPO = Path(__file__).resolve().parent.parent
S = 4


def make():
    t = TokenTable(S, 8)
    t.sync_new_tokens("a", [1, 2], 6)  # tokens 0..3 in block 1, 4..5 in block 2
    return t


def make8():
    t = make()
    t.sync_new_tokens("a", [1, 2], 8)  # blocks 1 and 2 full: the next token goes to block_ids[2]
    return t


def full_state(t: TokenTable, device: bool = True):
    """Everything a failed call must leave alone. ``device=True`` flushes and reads the
    device lookup cache back (the whole pool, every request's read view and slot mapping)."""
    pool = t._pool
    if device:
        t.flush()  # first, so the queued-write counts below are those after the flush both times
    host = (
        t.export_state(),
        {rid: (r.n, r.n_live, sorted(r.blocks), r.slot[: r.n].tolist(), r.live[: r.n].tolist(), r.base, r.cap)
         for rid, r in t._reqs.items()},
        t.refs.tolist(), t.n_b.tolist(), t.claims.tolist(), t.placed.tolist(), t._live_slots, t._ref_blocks,
        [len(q) for q in (pool.pend_idx, pool.pend_val, pool.pend_new, pool.pend_dead)],
    )
    if not device:
        return host
    views = {}
    for rid in t.requests():
        slots, live = t.read_view(rid)
        views[rid] = (slots.tolist(), live.tolist(), t.slot_mapping(rid).tolist())
    return host, views, pool.slot.tolist(), pool.live.tolist()


def check_device_matches_host(t: TokenTable) -> None:
    """The device lookup cache says what the host arrays say (read view and slot mapping)."""
    for rid, r in t._reqs.items():
        slots, live = t.read_view(rid)
        assert slots.tolist() == r.slot[: r.n].tolist(), f"device slots of {rid!r} differ from the host"
        assert live.tolist() == r.live[: r.n].tolist(), f"device live mask of {rid!r} differs from the host"
        ids = np.flatnonzero(r.live[: r.n])
        assert t.slot_mapping(rid).tolist() == r.slot[ids].tolist(), f"slot mapping of {rid!r} differs from the host"


def refused(t, code, f):
    """``f(t)`` raises TableError(code) and leaves the full state unchanged."""
    before = full_state(t)
    with pytest.raises(TableError) as e:
        f(t)
    assert e.value.code == code, str(e.value)
    assert full_state(t) == before, "a refused call changed the table"
    return e.value


# ====================================================================== named cases (issue 11)
def test_evict_float_3_9_is_refused_not_token_3():
    t = make()
    refused(t, "not_integer", lambda t: t.evict_tokens("a", [3.9]))
    refused(t, "not_integer", lambda t: t.evict_tokens("a", [3.0]))  # no float is an id, not even 3.0
    refused(t, "not_integer", lambda t: t.evict_tokens("a", np.array([3.9])))
    refused(t, "not_integer", lambda t: t.evict_token("a", 3.9))
    assert t.live_tokens("a").tolist() == [0, 1, 2, 3, 4, 5]


def test_evict_string_37_is_refused_not_tokens_3_and_7():
    t = make()
    t.sync_new_tokens("a", [1, 2], 8)
    for s in ("37", b"\x03\x07", bytearray(b"\x03"), ["3", "7"]):
        refused(t, "not_integer", lambda t: t.evict_tokens("a", s))
    assert t.num_live("a") == 8


def test_float_and_bool_tensors_are_refused_integer_tensors_taken():
    t = make()
    refused(t, "not_integer", lambda t: t.evict_tokens("a", torch.tensor([3.0])))
    refused(t, "not_integer", lambda t: t.evict_tokens("a", torch.tensor([True])))
    refused(t, "not_integer", lambda t: t.sync_new_tokens("a", torch.tensor([1.0, 2.0, 3.0]), 9))
    refused(t, "bad_move", lambda t: t.apply_moves("a", torch.tensor([[0.0, 1, 0, 3, 0]])))
    t.evict_tokens("a", torch.tensor([3]))
    assert t.live_tokens("a").tolist() == [0, 1, 2, 4, 5]


def test_sync_block_id_3_7_is_refused_on_both_paths():
    t = make()
    refused(t, "not_integer", lambda t: t.sync_new_tokens("a", [1, 2, 3.7], 9))  # one token: the scalar path
    refused(t, "not_integer", lambda t: t.sync_new_tokens("a", [1, 2, 3.7], 11))  # several: the batch path
    refused(t, "not_integer", lambda t: t.sync_new_tokens("a", np.array([1.0, 2.0, 3.0]), 9))
    refused(t, "not_integer", lambda t: t.sync_new_tokens("a", [1, 2, 3], 9.0))  # total_len too
    refused(t, "not_integer", lambda t: t.sync_new_tokens("b", [3.7], 1))  # a new request is not created
    assert "b" not in t


def test_true_as_an_id_is_not_integer_not_value_error():
    t = make()
    refused(t, "not_integer", lambda t: t.sync_new_tokens("b", [True], 1))
    refused(t, "not_integer", lambda t: t.sync_new_tokens("b", [3, True], 5))
    refused(t, "not_integer", lambda t: t.evict_tokens("a", [True]))  # was: token 1 evicted
    refused(t, "not_integer", lambda t: t.evict_tokens("a", [1, True]))  # np.asarray would make this [1, 1]
    refused(t, "not_integer", lambda t: t.evict_tokens("a", np.array([True, False])))  # not a mask
    refused(t, "not_integer", lambda t: t.evict_token("a", np.bool_(True)))
    refused(t, "not_integer", lambda t: t.are_live("a", np.array([True, False])))
    refused(t, "not_integer", lambda t: t.location("a", True))
    refused(t, "not_integer", lambda t: t.block_refs(True))
    refused(t, "bad_move", lambda t: t.apply_moves("a", [(True, 1, 0, 3, 0)]))
    refused(t, "not_integer", lambda t: t.release_empty_blocks("a", [True]))
    assert "b" not in t


def test_string_block_list_is_not_integer_not_index_error():
    t = make()
    refused(t, "not_integer", lambda t: t.sync_new_tokens("b", "12", 1))
    refused(t, "not_integer", lambda t: t.sync_new_tokens("b", "1234567", 5))
    refused(t, "not_integer", lambda t: t.sync_new_tokens("b", {1: 1}, 1))  # not a sequence either
    refused(t, "not_integer", lambda t: t.sync_new_tokens("b", np.array([[1, 2]]), 1))
    refused(t, "not_integer", lambda t: t.release_empty_blocks("a", "1"))
    refused(t, "bad_move", lambda t: t.apply_moves("a", "01030"))
    refused(t, "bad_move", lambda t: t.apply_moves("a", ["01030"]))
    assert "b" not in t


def test_2_pow_70_block_id_is_block_out_of_range_on_every_path():
    big = 2 ** 70
    for f in (
        lambda t: t.sync_new_tokens("a", [1, 2, big], 9),  # one new token, in block_ids[2] (scalar path)
        lambda t: t.sync_new_tokens("a", [1, 2, big], 10),  # several (batch path)
        lambda t: t.sync_new_tokens("a", np.array([1, 2, 2 ** 64 - 1], dtype=np.uint64), 10),
        lambda t: t.apply_moves("a", [(0, 1, 0, big, 0)]),
        lambda t: t.release_empty_blocks("a", [big]),
        lambda t: t.block_refs(big),
        lambda t: t.block_live_count(big),
        lambda t: t.references("a", big),
    ):
        refused(make8(), "block_out_of_range", f)
    for f in (lambda t: t.block_refs(-big), lambda t: t.sync_new_tokens("a", [1, 2, -big], 10)):
        refused(make8(), "block_out_of_range", f)


def test_2_pow_70_token_id_is_unknown_token_on_every_path():
    big = 2 ** 70
    for f in (
        lambda t: t.evict_tokens("a", [big]),  # the one-id path
        lambda t: t.evict_tokens("a", [0, big]),  # the batch path
        lambda t: t.evict_token("a", big),
        lambda t: t.evict_tokens("a", np.array([2 ** 64 - 1], dtype=np.uint64)),
        lambda t: t.location("a", big),
        lambda t: t.are_live("a", [big]),
        lambda t: t.apply_moves("a", [(big, 1, 0, 3, 0)]),
    ):
        refused(make(), "unknown_token", f)


def test_block_refs_minus_one_is_out_of_range_not_the_last_block():
    t = make()
    t.sync_new_tokens("b", [7], 1)  # the last block is referenced: -1 would have said 1
    assert t.block_refs(7) == 1
    for f in (lambda t: t.block_refs(-1), lambda t: t.block_live_count(-1), lambda t: t.references("a", -1),
              lambda t: t.block_refs(8)):
        refused(t, "block_out_of_range", f)
    refused(t, "not_integer", lambda t: t.block_refs(1.0))


def test_move_source_block_that_wraps_in_int64_is_wrong_source():
    """Found while fixing the above: the source check compared ``sb * S + so`` with the
    token's slot; with sb = 2**62 + 1 and S = 4 the product wraps to slot 4 and a move from
    a block that does not exist was accepted."""
    t = make()
    refused(t, "wrong_source", lambda t: t.apply_moves("a", [(0, 2 ** 62 + 1, 0, 3, 0)]))
    refused(t, "wrong_source", lambda t: t.apply_moves("a", np.array([[0, 2 ** 62 + 1, 0, 3, 0]])))
    refused(t, "wrong_source", lambda t: t.apply_moves("a", [(1, 1, 1 - S, 3, 0)]))  # offset out of [0, S)


def test_an_empty_move_row_is_bad_move_not_an_empty_plan():
    """Found while fixing the above: ``[[]]`` has size 0 and was taken as no moves."""
    t = make()
    for moves in ([[]], [()], [(0, 1, 0, 3)], [(0, 1, 0, 3, 0, 0)], [(0, 1, 0, 3, 0), (1, 1)], [5], 5, None,
                  np.zeros((1, 0), dtype=np.int64), np.zeros(5, dtype=np.int64), np.zeros((1, 5, 1), dtype=np.int64)):
        refused(t, "bad_move", lambda t: t.apply_moves("a", moves))
    assert t.apply_moves("a", []) == [] and t.apply_moves("a", np.zeros((0, 5), dtype=np.int64)) == []


def test_a_float_array_is_not_a_list_of_ids_even_empty():
    """The type of a list is its dtype: an empty float or bool array is refused like a full one."""
    t = make()
    for a in (np.array([], dtype=np.float64), np.array([], dtype=bool), torch.tensor([], dtype=torch.float32)):
        refused(t, "not_integer", lambda t: t.evict_tokens("a", a))
        refused(t, "not_integer", lambda t: t.release_empty_blocks("a", a))
        refused(t, "not_integer", lambda t: t.are_live("a", a))
    refused(t, "bad_move", lambda t: t.apply_moves("a", np.zeros((0, 5), dtype=np.float64)))
    t.evict_tokens("a", np.array([], dtype=np.int32))  # an empty integer array is fine
    t.evict_tokens("a", [])


def test_unhashable_request_id_is_bad_request_id():
    t = make()
    for f in (lambda t: t.sync_new_tokens(["a"], [1], 1), lambda t: t.evict_tokens(["a"], [0]),
              lambda t: t.slot_mapping({"a": 1}), lambda t: t.length(["a"]), lambda t: ["a"] in t):
        refused(t, "bad_request_id", f)
    refused(t, "unknown_request", lambda t: t.evict_tokens("zz", [3.5]))  # the request first, then the ids


def test_constructor_arguments_are_checked():
    for args, code in (((4.0, 8), "not_integer"), ((4, True), "not_integer"), (("4", 8), "not_integer"),
                       ((0, 8), "bad_config"), ((4, 1), "bad_config"), ((4097, 8), "bad_config"),
                       ((4, 2 ** 31 + 1), "bad_config"), ((4096, 2 ** 19), "bad_config"), ((4, 2 ** 70), "bad_config")):
        with pytest.raises(TableError) as e:
            TokenTable(*args)
        assert e.value.code == code, (args, e.value)
    with pytest.raises(TableError) as e:
        TokenTable(4, 8, device="no-such-device")
    assert e.value.code == "bad_config"
    assert TokenTable(np.int64(4), np.int32(8)).S == 4


def test_returned_slots_may_be_written_by_the_caller():
    """``sync_new_tokens`` returns the new slots; a caller writing into that array must not
    change what the next flush writes to the device lookup cache."""
    t = TokenTable(S, 8)
    out = t.sync_new_tokens("a", [1, 2], 6)
    out[:] = -7
    check_device_matches_host(t)
    assert t.slot_mapping("a").tolist() == [4, 5, 6, 7, 8, 9]


def test_every_code_the_table_and_the_spec_raise_is_listed():
    listed = set(TABLE_CODES)
    for path, pat in (("vtoken/table.py", r'TableError\(\s*"(\w+)"'), ("spec/token_table.py", r'SpecError\(\s*"(\w+)"')):
        raised = set(re.findall(pat, (REPO / path).read_text()))
        code_args = set(re.findall(r'code: str = "(\w+)"', (REPO / path).read_text()))
        assert raised | code_args <= listed, f"{path} raises codes missing from TABLE_CODES: {sorted((raised | code_args) - listed)}"
    for c in ("block_not_empty", "duplicate_block", "not_integer", "bad_request_id"):
        assert c in listed


# ====================================================================== Hypothesis: every method, arbitrary input
NB = 24


def _pick(values):
    """One of ``values``, copied per draw (no example sees another's mutable value), drawn
    by index: ``sampled_from`` would label the strategy by its elements' hashes, which for
    ``object()``, ``None`` or a type are addresses."""
    values = list(values)
    return st.integers(0, len(values) - 1).map(lambda i: copy.copy(values[i]))


_SCALAR_JUNK = st.one_of(
    st.sampled_from([2 ** 31, 2 ** 62 + 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 2 ** 70, -1, -(2 ** 63), -(2 ** 70)]),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1.0, 3.0, 3.9, -0.0]),
    st.text(max_size=3),
    st.binary(max_size=3),
    _pick([None]),
    st.complex_numbers(max_magnitude=4),
    _pick([Fraction(3, 1), np.float64(2.0), np.bool_(True), np.bool_(False), np.array(3),
                     np.uint64(2 ** 64 - 1), np.int8(-1), object()]),
    st.integers(0, 5).map(np.int64),
    st.integers(0, 5).map(np.uint8),
)
_SMALL = st.integers(-2, 12)  # plausible ids and lengths: the success path and every range check
_INT = st.one_of(_SMALL, _SMALL, _SMALL, _SCALAR_JUNK)

_ARRAYS = hnp.arrays(
    dtype=_pick([np.int64, np.int32, np.uint8, np.uint64, np.float64, np.float32, np.bool_]),
    shape=hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=4),
)
_TSHAPE = hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=4)
_TENSORS = st.one_of(
    hnp.arrays(dtype=_pick([np.int64, np.int32]), shape=_TSHAPE, elements=st.integers(-2, 12)),
    hnp.arrays(dtype=np.float32, shape=_TSHAPE, elements=st.floats(-2, 12, width=32)),
    hnp.arrays(dtype=np.bool_, shape=_TSHAPE),
).map(torch.from_numpy)


def _object_array(xs):
    a = np.empty(len(xs), dtype=object)
    a[:] = xs
    return a


def _lists(elem):
    return st.one_of(
        st.lists(elem, max_size=6),
        st.lists(elem, max_size=6).map(tuple),
        st.lists(elem, max_size=6).map(_object_array),
        st.lists(_SMALL, max_size=6).map(lambda xs: np.array(xs, dtype=np.int64)),
        st.lists(st.integers(0, 12), max_size=6).map(lambda xs: np.array(xs, dtype=np.uint64)),
        st.sets(_SMALL, max_size=4),
        st.builds(range, _SMALL, _SMALL),
        st.lists(st.lists(_SMALL, max_size=3), max_size=3),  # not flat
        _ARRAYS, _TENSORS, _SCALAR_JUNK, _SMALL,
        _pick([{}, {1: 2}, "37", b"\x03"]),
    )


_ONE_ID = st.one_of(st.lists(_INT, min_size=1, max_size=1), st.tuples(_INT), st.tuples(_SCALAR_JUNK))  # the fast path
_ID_LISTS = st.one_of(st.lists(_SMALL, max_size=6), st.lists(_SMALL, max_size=6), _lists(_INT))
_MOVE_ROWS = st.one_of(
    st.tuples(_SMALL, _SMALL, _SMALL, _SMALL, _SMALL),
    st.tuples(_INT, _INT, _INT, _INT, _INT),
    st.lists(_INT, max_size=6),
    st.lists(_SMALL, min_size=5, max_size=5).map(lambda xs: np.array(xs, dtype=np.int64)),
    _SCALAR_JUNK,
)
_MOVES = st.one_of(
    st.lists(_MOVE_ROWS, max_size=4),
    st.lists(st.tuples(_SMALL, _SMALL, _SMALL, _SMALL, _SMALL), max_size=4).map(
        lambda rows: np.array(rows, dtype=np.int64).reshape(-1, 5)),
    hnp.arrays(dtype=_pick([np.int64, np.float64, np.bool_, np.uint64]),
               shape=st.tuples(st.integers(0, 3), st.sampled_from([4, 5, 6]))),
    _lists(_INT),
)
_RIDS = st.one_of(_pick(["a", "a", "b", "c"]), _pick(["a", "b", "b", "c"]),
                  _pick(["a", "b"]), _pick([7, None, 2.5, ("t",), ["a"], {"a": 1}, {"a"}]))


def _has_tensor(x) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (list, tuple, set)) or (isinstance(x, np.ndarray) and x.dtype == object):
        return any(_has_tensor(y) for y in x)
    return False


def _plain(x):
    """Tensors as the lists they hold (what the implementation converts them to)."""
    if isinstance(x, torch.Tensor):
        return x.numpy()
    return x


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        a = a.tolist()
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


class _Driver:
    """The implementation and the reference side by side, plus the scheduler's positional
    block lists so that plausible growth is often valid."""

    def __init__(self):
        self.impl, self.spec = TokenTable(S, NB), SpecTokenTable(S, NB)
        self.pos: dict = {}
        self.fresh = list(range(1, NB))
        self.stats = Counter()
        # a start with something to break: "b" shares "a"'s full first block (a prefix hit)
        for rid, bl, n in (("a", [1, 2, 4], 11), ("b", [1, 3], 7)):
            for t in (self.impl, self.spec):
                t.sync_new_tokens(rid, bl, n)
            self.pos[rid] = bl
        self.fresh = [b for b in self.fresh if b not in (1, 2, 3, 4)]
        for t in (self.impl, self.spec):
            t.evict_tokens("a", [1, 5, 9])

    def valid_moves(self, data, rid):
        st_ = self.spec.export_state()
        r = st_["requests"].get(rid)
        if r is None:
            return []
        private = {b for b in r["blocks"] if st_["blocks"][b]["refs"] == 1}
        movable = [t for t in r["live"] if r["loc"][t][0] in private]
        dst_blocks = sorted(private) + self.fresh[:1]
        occupied = {tuple(v) for v in r["loc"].values()}
        free = [(b, o) for b in dst_blocks for o in range(S) if (b, o) not in occupied]
        k = min(len(movable), len(free), data.draw(st.integers(0, 3), label="n_moves"))
        toks = data.draw(st.permutations(movable), label="tokens")[:k]
        dsts = data.draw(st.permutations(free), label="dsts")[:k]
        return [(t, *r["loc"][t], *d) for t, d in zip(toks, dsts)]

    def draw_call(self, data):
        op = data.draw(_pick(OPS), label="op")
        if op in ("flush", "waste_ratio"):
            return op, ()
        rid = data.draw(_RIDS, label="rid")
        known = isinstance(rid, str) and rid in self.spec.tokens
        if op == "sync_new_tokens":
            base = list(self.pos.get(rid, [])) if isinstance(rid, str) else []
            n = len(self.spec.tokens[rid]) if known else 0
            if data.draw(st.booleans(), label="plausible"):
                k = data.draw(st.integers(0, 6), label="new")
                need = -(-(n + k) // S) - len(base)
                if need > 0 and len(self.fresh) >= need:
                    base = base + self.fresh[:need]
                bl = base
                if data.draw(st.integers(0, 3), label="corrupt") == 0 and bl:
                    i = data.draw(st.integers(0, len(bl) - 1), label="at")
                    bl = bl[:i] + [data.draw(_INT, label="entry")] + bl[i + 1:]
                return op, (rid, bl, n + k)
            return op, (rid, data.draw(_lists(_INT), label="block_ids"), data.draw(_INT, label="total_len"))
        if op in ("evict_tokens", "are_live"):
            kind = data.draw(st.integers(0, 2), label="ids_kind") if known else 2
            if kind == 0:
                live = self.spec.live_tokens(rid)
                ids = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=3), label="ids") if live else []
                return op, (rid, ids)
            if kind == 1:  # in and just outside [0, length): dead, duplicate and unknown ids
                n = len(self.spec.tokens[rid])
                return op, (rid, data.draw(st.lists(st.integers(-1, n), max_size=4), label="ids"))
            return op, (rid, data.draw(st.one_of(_ONE_ID, _ID_LISTS), label="ids"))
        if op in ("evict_token", "location"):
            if known and data.draw(st.booleans(), label="in_range"):
                return op, (rid, data.draw(st.integers(-1, len(self.spec.tokens[rid])), label="token"))
            return op, (rid, data.draw(_INT, label="token"))
        if op == "apply_moves":
            if known and data.draw(st.booleans(), label="valid_moves"):
                mv = self.valid_moves(data, rid)
                how = data.draw(_pick(["as_is", "entry", "entry", "append", "dup_dst", "dup_dst", "dup_dst",
                                                 "dup_tok", "array"]), label="corrupt")
                if mv and how == "entry":  # one entry replaced: a wrong value or a wrong type
                    i = data.draw(st.integers(0, len(mv) - 1), label="row")
                    j = data.draw(st.integers(0, 4), label="col")
                    row = list(mv[i])
                    row[j] = data.draw(st.one_of(_SMALL, _INT), label="entry")
                    mv[i] = tuple(row)
                elif how == "append":  # a valid prefix, then a (most likely) bad move: atomicity
                    mv = mv + [data.draw(st.one_of(st.tuples(_SMALL, _SMALL, _SMALL, _SMALL, _SMALL), _MOVE_ROWS),
                                         label="extra")]
                elif how == "dup_dst" and len(mv) > 1:
                    mv[-1] = mv[-1][:3] + mv[0][3:]
                elif how == "dup_tok" and mv:
                    mv = mv + [mv[0]]
                elif how == "array":
                    mv = np.array(mv, dtype=np.int64).reshape(-1, 5)
                return op, (rid, mv)
            return op, (rid, data.draw(_MOVES, label="moves"))
        if op == "release_empty_blocks":
            if known and data.draw(st.booleans(), label="own"):
                own = self.spec.export_state()["requests"][rid]["blocks"]
                return op, (rid, data.draw(st.lists(st.sampled_from(own + [0, NB]), max_size=3), label="blocks"))
            return op, (rid, data.draw(_ID_LISTS, label="blocks"))
        if op == "references":
            return op, (rid, data.draw(_INT, label="block"))
        if op in ("block_refs", "block_live_count"):
            return op, (data.draw(_INT, label="block"),)
        return op, (rid,)

    def call_spec(self, op, args):
        sp = self.spec
        if op in SPEC_SAME:
            return getattr(sp, op)(*args)
        rid = args[0] if args else None
        if op == "block_refs":
            sp.block_live_count(args[0])  # the same checks (not_integer, block_out_of_range)
            return sp.refs(int(args[0]))
        if op == "references":
            sp._get(rid)
            sp.block_live_count(args[1])
            return int(args[1]) in sp.blocks[rid]
        if op == "are_live":
            toks = sp._get(rid)
            ids = spec_ints(args[1])
            if any(not 0 <= t < len(toks) for t in ids):
                raise SpecError("unknown_token")
            return [toks[t]["live"] for t in ids]
        if op == "__contains__":
            sp._hashable(rid)
            return rid in sp.tokens
        if op == "flush":
            return None
        if op == "waste_ratio":
            return sp.waste_ratio()
        toks = sp._get(rid)  # the plain per-request queries: the request checks only
        st_ = sp.export_state()["requests"][rid]
        return {
            "length": len(toks), "num_live": len(st_["live"]), "blocks_of": st_["blocks"],
            "block_array": st_["blocks"], "num_blocks_of": len(st_["blocks"]),
            "releasable_blocks": [b for b in st_["blocks"] if sp.refs(b) == 1 and sp.block_live_count(b) == 0],
            "live_mask": [t["live"] for t in toks],
            "slots": [t["block"] * S + t["offset"] for t in toks],
            "tail_block": toks[-1]["block"] if toks else None,
            "live_slots": (st_["live"], [toks[i]["block"] * S + toks[i]["offset"] for i in st_["live"]]),
            "read_view": ([t["block"] * S + t["offset"] for t in toks], [t["live"] for t in toks]),
        }[op]

    def step(self, data):
        op, args = self.draw_call(data)
        tensors = _has_tensor(args)
        check_device = data.draw(st.booleans(), label="check_device")
        before = full_state(self.impl, device=check_device)
        spec_before = self.spec.export_state()
        try:
            out = getattr(self.impl, op)(*args)
            err = None
        except TableError as e:
            out, err = None, e
        # anything else (ValueError, IndexError, TypeError, ...) propagates and fails the test
        if err is not None:
            assert err.code in TABLE_CODES, err
            assert full_state(self.impl, device=check_device) == before, f"{op}{args!r:.200}: refused ({err}) but changed"
            self.stats[f"refused {err.code}"] += 1
        else:
            self.stats["accepted"] += 1
            self.stats[f"accepted {op}"] += 1
        self.stats[f"op {op}"] += 1
        if tensors and err is not None:
            return  # the reference takes no tensors; nothing changed on our side
        sargs = copy.deepcopy(args) if not tensors else tuple(_plain(a) for a in args)
        try:
            sout, serr = self.call_spec(op, sargs), None
        except SpecError as e:
            sout, serr = None, e.code
        assert (err.code if err else None) == serr, f"{op}{args!r:.200}: implementation {err}, reference {serr!r}"
        if serr is not None:
            assert self.spec.export_state() == spec_before
            return
        if op in ("read_view",):
            out = tuple(x.tolist() for x in out)
        elif op == "live_slots":
            out = tuple(x.tolist() for x in out)
        elif op == "slot_mapping":
            out = out.tolist()
        elif op in ("block_array", "releasable_blocks"):
            out = sorted(out.tolist())
        elif op == "waste_ratio":
            out, sout = round(out, 9), round(sout, 9)
        assert _same(out, sout), f"{op}{args!r:.200}: implementation {out!r:.200}, reference {sout!r:.200}"
        if op == "sync_new_tokens" and isinstance(args[0], str):
            bl = args[1] if isinstance(args[1], list) else None
            if bl is not None and all(type(b) is int for b in bl):
                self.pos[args[0]] = list(bl)
                self.fresh = [b for b in self.fresh if b not in bl]
        if op == "free_request" and args[0] in self.pos:
            del self.pos[args[0]]
        if op == "apply_moves":
            for row in self.spec.export_state()["requests"][args[0]]["blocks"]:
                if row in self.fresh:
                    self.fresh.remove(row)
        si = self.impl.export_state()
        assert si == self.spec.export_state(), f"{op}{args!r:.200}: states differ"
        check_unique_mapping(si)
        if check_device:
            check_device_matches_host(self.impl)


OPS = ["sync_new_tokens"] * 4 + ["evict_tokens"] * 3 + ["apply_moves"] * 3 + [
    "evict_token", "release_empty_blocks", "release_empty_blocks", "free_request", "location", "are_live",
    "references", "block_refs", "block_live_count", "length", "num_live", "live_tokens", "live_mask", "slots",
    "blocks_of", "block_array", "releasable_blocks", "num_blocks_of", "tail_block", "live_slots", "read_view",
    "slot_mapping",
    "__contains__", "flush", "waste_ratio"]
SPEC_SAME = {"sync_new_tokens", "evict_tokens", "evict_token", "apply_moves", "release_empty_blocks", "free_request",
             "location", "block_live_count", "live_tokens", "slot_mapping"}


def test_every_public_method_with_arbitrary_input():
    """Up to 30 calls per example, every public method, arbitrary arguments; each call:
    both accept with equal results and states, or both refuse with the same code and
    neither changed (host arrays, queued device writes, device cache, export_state)."""
    stats = Counter()

    @settings(max_examples=600, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def run(data):
        d = _Driver()
        for _ in range(data.draw(st.integers(1, 30), label="calls")):
            d.step(data)
        full_state(d.impl)  # the device cache can be read back at the end
        check_device_matches_host(d.impl)
        stats.update(d.stats)
        stats["examples"] += 1

    run()
    calls = sum(v for k, v in stats.items() if k.startswith("op "))
    print(f"\ntable hardening: {stats['examples']} examples, {calls} calls, {stats['accepted']} accepted, "
          f"refused by code: {sorted((k[8:], v) for k, v in stats.items() if k.startswith('refused '))}; "
          f"calls (accepted) by method: {sorted((k[3:], v, stats['accepted ' + k[3:]]) for k, v in stats.items() if k.startswith('op '))}")
    assert stats["examples"] >= 500
    assert stats["accepted"] >= calls // 5, stats  # the success path is exercised, not only refusals
    for code in ("not_integer", "bad_move", "bad_request_id", "unknown_request"):  # the input classes
        assert stats[f"refused {code}"] >= 100, (code, stats)
    # The range and state checks are reached too (each is pinned by a named test above and by
    # the conformance machine; here they are counted, not required one by one: Hypothesis
    # seeds floats and strings with constants from every imported module, so the exact mix
    # depends on the test selection).
    state_codes = ("unknown_token", "dead_token", "duplicate_token", "block_out_of_range", "blocks_short",
                   "length_decrease", "wrong_source", "null_block", "slot_conflict", "foreign_block", "shared_block",
                   "block_not_empty", "duplicate_destination", "bad_offset")
    reached = [c for c in state_codes if stats[f"refused {c}"]]
    assert len(reached) >= 11 and sum(stats[f"refused {c}"] for c in state_codes) >= 500, (reached, stats)
    for op in set(OPS):
        assert stats[f"op {op}"] >= 10, (op, stats)
