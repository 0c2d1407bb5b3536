"""Input hardening of the block allocator (issue 11 item 3, the allocator part).

``BlockAllocator`` refuses non-integer counts and block ids (bool, float, str, None, float
/ bool arrays and tensors, strings as block lists) with ``not_integer`` before any cast,
range-checks every argument, and a failing call changes nothing. Named cases first, then a
Hypothesis test driving every public method with arbitrary arguments next to a small
dict model of the documented rules: the same result or the same code, and a refused call
leaves the allocator exactly as it was.
"""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtoken import BlockAllocator
from vtoken.errors import ALLOCATOR_CODES, AllocatorError

pytestmark = pytest.mark.invariants


def full_state(a: BlockAllocator):
    return a.export_state(), a.ref.tolist(), a.state.tolist(), a.num_reserved, a.free_queue()


def refused(a, code, f):
    before = full_state(a)
    with pytest.raises(AllocatorError) as e:
        f(a)
    assert e.value.code == code, str(e.value)
    assert full_state(a) == before, "a refused call changed the allocator"


# ====================================================================== named cases
def test_float_bool_and_string_counts_are_not_integer():
    a = BlockAllocator(8)
    for n in (2.0, 2.5, True, "2", None, np.float64(1), np.bool_(True), torch.tensor(2)):
        refused(a, "not_integer", lambda a: a.allocate(n))
        refused(a, "not_integer", lambda a: a.reserve(n))
    assert a.allocate(np.int64(2)) == [1, 2]


def test_block_3_7_and_true_are_not_block_3_and_1():
    a = BlockAllocator(8)
    a.allocate(4)
    a.reserve(2)
    for bl in ([3.7], [True], [1, True], np.array([3.0]), np.array([True]), torch.tensor([3.0]), "3", b"\x03",
               [[3]], np.array([[3]]), 3, None, [None]):
        for f in (lambda a: a.free(bl), lambda a: a.incref(bl), lambda a: a.take_reserved(bl), lambda a: a.unreserve(bl)):
            refused(a, "not_integer", f)
    a.free(torch.tensor([3]))  # an integer tensor is a block list
    assert a.ref[3] == 0


def test_huge_and_negative_block_ids_are_out_of_range_everywhere():
    a = BlockAllocator(8)
    a.allocate(2)
    for b in (2 ** 70, -1, -(2 ** 70), 8, np.uint64(2 ** 64 - 1)):
        for f in (lambda a: a.free([b]), lambda a: a.incref([b]), lambda a: a.take_reserved([b]),
                  lambda a: a.unreserve([b])):
            refused(a, "block_out_of_range", f)


def test_constructor_is_checked():
    for n, code in ((8.0, "not_integer"), (True, "not_integer"), ("8", "not_integer"), (1, "bad_config"),
                    (2 ** 70, "bad_config"), (-3, "bad_config")):
        with pytest.raises(AllocatorError) as e:
            BlockAllocator(n)
        assert e.value.code == code, (n, e.value)


def test_every_code_the_allocator_raises_is_listed():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "vtoken/allocator.py").read_text()
    raised = set(re.findall(r'AllocatorError\(\s*"(\w+)"', text))
    assert raised and raised <= set(ALLOCATOR_CODES), sorted(raised - set(ALLOCATOR_CODES))


# ====================================================================== Hypothesis
NB = 10


class Model:
    """The allocator's documented rules over plain data (module docstring of vtoken/allocator.py)."""

    def __init__(self, nb):
        self.nb = nb
        self.queue = list(range(1, nb))
        self.ref: dict[int, int] = {}
        self.reserved: set[int] = set()

    @staticmethod
    def _is_int(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    def _count(self, n):
        if not self._is_int(n):
            raise AllocatorError("not_integer", "")
        n = int(n)
        if n < 0:
            raise AllocatorError("bad_count", "")
        if n > len(self.queue):
            raise AllocatorError("out_of_blocks", "")
        return n

    def _blocks(self, bl):
        if isinstance(bl, (str, bytes, bytearray, memoryview)) or getattr(bl, "ndim", 1) != 1 \
                or getattr(getattr(bl, "dtype", None), "kind", "O") not in "iuO":  # a float array, even empty
            raise AllocatorError("not_integer", "")
        try:
            bl = list(bl)
        except TypeError:
            raise AllocatorError("not_integer", "") from None
        if not all(self._is_int(b) for b in bl):
            raise AllocatorError("not_integer", "")
        bl = [int(b) for b in bl]
        for b in bl:
            if not 0 <= b < self.nb:
                raise AllocatorError("block_out_of_range", "")
            if b == 0:
                raise AllocatorError("null_block", "")
        return bl

    def allocate(self, n):
        n = self._count(n)
        out, self.queue = self.queue[:n], self.queue[n:]
        for b in out:
            self.ref[b] = 1
        return out

    def reserve(self, n):
        n = self._count(n)
        out, self.queue = self.queue[:n], self.queue[n:]
        self.reserved |= set(out)
        return out

    def incref(self, bl):
        bl = self._blocks(bl)
        for b in bl:
            if b not in self.ref:
                raise AllocatorError("not_allocated", "")
        for b in bl:
            self.ref[b] += 1

    def free(self, bl):
        bl = self._blocks(bl)
        for b, k in Counter(bl).items():
            if self.ref.get(b, 0) < k:
                raise AllocatorError("double_free", "")
        freed = []
        for b in bl:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                del self.ref[b]
                self.queue.append(b)
                freed.append(b)
        return freed

    def _reserved_list(self, bl):
        bl = self._blocks(bl)
        if len(set(bl)) != len(bl):
            raise AllocatorError("duplicate_block", "")
        for b in bl:
            if b not in self.reserved:
                raise AllocatorError("not_reserved", "")
        return bl

    def take_reserved(self, bl):
        for b in self._reserved_list(bl):
            self.reserved.discard(b)
            self.ref[b] = 1

    def unreserve(self, bl):
        for b in self._reserved_list(bl):
            self.reserved.discard(b)
            self.queue.append(b)

    def export_state(self):
        return {"num_blocks": self.nb, "free_queue": list(self.queue), "reserved": sorted(self.reserved),
                "ref": dict(sorted(self.ref.items()))}


def _pick(values):
    """One of ``values``, copied per draw (no example sees another's mutable value), drawn
    by index: ``sampled_from`` would label the strategy by its elements' hashes, which for
    ``object()``, ``None`` or a type are addresses."""
    values = list(values)
    return st.integers(0, len(values) - 1).map(lambda i: copy.copy(values[i]))


_JUNK = st.one_of(
    st.booleans(), st.floats(allow_nan=True), st.sampled_from([0.0, 1.0, 2.0, 3.9]), st.text(max_size=2),
    st.binary(max_size=2), _pick([None]),
    _pick([2 ** 63, 2 ** 64, 2 ** 70, -(2 ** 70), np.bool_(True), np.float64(1.0), np.uint64(2 ** 64 - 1),
                     np.array(2), object()]),
    st.integers(0, NB).map(np.int64),
)
_B = st.one_of(st.integers(-1, NB), st.integers(-1, NB), st.integers(-1, NB), _JUNK)
_LISTS = st.one_of(
    st.lists(st.integers(0, NB - 1), max_size=4), st.lists(st.integers(-1, NB), max_size=4),
    st.lists(st.sampled_from([-1, NB, 2 ** 63, 2 ** 70, -(2 ** 70)]), min_size=1, max_size=2),  # out of range
    st.lists(_B, max_size=4), st.lists(_B, max_size=4).map(tuple),
    st.lists(st.integers(0, NB - 1), max_size=4).map(lambda xs: np.array(xs, dtype=np.int64)),
    st.lists(st.integers(0, NB - 1), max_size=4).map(lambda xs: np.array(xs, dtype=np.float64)),
    st.lists(st.booleans(), max_size=3).map(np.array),
    st.lists(st.integers(0, NB - 1), max_size=3).map(torch.tensor),
    st.lists(st.integers(0, NB - 1), max_size=3).map(lambda xs: torch.tensor(xs, dtype=torch.float32)),
    st.sets(st.integers(0, NB - 1), max_size=3), st.lists(st.lists(st.integers(0, 4), max_size=2), max_size=2),
    _JUNK, st.integers(-1, NB), _pick(["12", {1: 1}, range(1, 3)]),
)
_COUNTS = st.one_of(st.integers(-1, 4), st.integers(-1, 4), st.integers(NB - 2, NB + 1), _JUNK)


def test_every_public_method_with_arbitrary_input():
    stats = Counter()

    @settings(max_examples=500, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def run(data):
        a, m = BlockAllocator(NB), Model(NB)
        for _ in range(data.draw(st.integers(1, 25), label="calls")):
            op = data.draw(_pick(["allocate", "reserve", "incref", "free", "free", "take_reserved",
                                            "unreserve"]), label="op")
            if op in ("allocate", "reserve"):
                arg = data.draw(_COUNTS, label="n")
            else:
                held = sorted(m.ref) + sorted(m.reserved)
                plausible = st.lists(st.sampled_from(held), max_size=3) if held else st.just([])
                arg = data.draw(st.one_of(plausible, plausible, plausible, _LISTS), label="blocks")
            before = full_state(a)
            try:
                out, err = getattr(a, op)(arg), None
            except AllocatorError as e:
                out, err = None, e
            if err is not None:
                assert err.code in ALLOCATOR_CODES, err
                assert full_state(a) == before, f"{op}({arg!r:.100}) refused ({err}) but changed the allocator"
                stats[f"refused {err.code}"] += 1
            else:
                stats["accepted"] += 1
            stats[f"op {op}"] += 1
            marg = arg.numpy() if isinstance(arg, torch.Tensor) else copy.deepcopy(arg)
            try:
                mout, merr = getattr(m, op)(marg), None
            except AllocatorError as e:
                mout, merr = None, e.code
            assert (err.code if err else None) == merr, f"{op}({arg!r:.100}): allocator {err}, model {merr!r}"
            assert out == mout, f"{op}({arg!r:.100}): allocator {out}, model {mout}"
            assert a.export_state() == m.export_state(), f"after {op}({arg!r:.100})"
            # the three states partition the non-null blocks
            q = a.free_queue()
            assert len(set(q)) == len(q) and a.num_free + a.num_reserved + a.num_used == NB - 1
        stats["examples"] += 1

    run()
    calls = sum(v for k, v in stats.items() if k.startswith("op "))
    print(f"\nallocator hardening: {stats['examples']} examples, {calls} calls, {stats['accepted']} accepted, "
          f"refused by code: {sorted((k[8:], v) for k, v in stats.items() if k.startswith('refused '))}")
    assert stats["examples"] >= 500 and stats["accepted"] >= calls // 5
    for code in ALLOCATOR_CODES:
        if code != "bad_config":  # constructor only: the named test above
            assert stats[f"refused {code}"] >= 1, (code, stats)
    assert stats["refused not_integer"] >= 500, stats
