"""The lifecycle room (``vtoken.lifecycle``): its ledger's contract, and the rules that keep it
the only one: one plan record type in the system, and one place blocks go back to a pool.

The two structural rules read the source (AST), like the layer rule: each is tested on
planted breaches it must reject.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from vtoken.allocator import FREE, RESERVED, USED, BlockAllocator
from vtoken.errors import PlanError
from vtoken.lifecycle import (ABORTED, APPLIED, COPYING, PLANNED, AllocatorPort, Copies, Held, Lifecycle, Outcome,
                              all_dead)
from vtoken.planner import NullCopyEngine, propose
from vtoken.table import TokenTable

ROOT = Path(__file__).resolve().parent.parent


class FakePort:
    """A pool that records what the lifecycle asks of it (blocks 10.. are free)."""

    def __init__(self):
        self.calls, self.next = [], 10

    def free(self, ids, fence):
        self.calls.append(("free", list(ids), fence))

    def reserve(self, n):
        got = list(range(self.next, self.next + n))
        self.next += n
        self.calls.append(("reserve", got))
        return got

    def unreserve(self, ids):
        self.calls.append(("unreserve", list(ids)))

    def adopt(self, ids):
        self.calls.append(("adopt", list(ids)))

    def num_free(self):
        return 100


def _lc(headroom=0, exclusive=False):
    port = FakePort()
    lc = Lifecycle(port, 64, {}, exclusive_held=exclusive)
    lc.refill(headroom)
    port.calls.clear()
    return lc, port


def _plan(lc, req="a", sources=(1, 2), dests=(), fills=(), seq=0):
    return lc.new_plan(req, sources, dests, np.zeros((0, 5), dtype=np.int64), fills, seq=seq)


def _state(lc):
    return (dict((r, list(h)) for r, h in lc.held.items()), list(lc.headroom), sorted(lc.in_flight),
            lc.busy_mask.nonzero()[0].tolist(), dict(lc.stats))


# ------------------------------------------------------------------------------ the block side
def test_every_launched_plan_is_counted_once_by_its_outcome():
    lc, port = _lc()
    for r, blocks in (("a", [1, 2]), ("b", [3, 4]), ("c", [5, 6])):
        lc.hold(r, blocks)
    p1, p2, p3 = _plan(lc, "a", (1, 2)), _plan(lc, "b", (3, 4)), _plan(lc, "c", (5, 6))
    assert [p.id for p in (p1, p2, p3)] == sorted({p1.id, p2.id, p3.id}) and p1.state == PLANNED
    for p in (p1, p2, p3):
        lc.launch(p)
    assert p1.state == COPYING and set(lc.in_flight) == {p1.id, p2.id, p3.id}
    assert lc.busy_requests() == {"a", "b", "c"} and not lc.held  # the plans hold the sources now
    assert lc.finish("c") == [] and p3.orphaned and "c" not in lc.busy
    assert lc.end(p1, Outcome("applied")) == "applied" and p1.state == APPLIED
    assert lc.end(p2, Outcome("aborted", table_kept=True)) == "aborted" and p2.state == ABORTED
    assert lc.end(p3, Outcome("applied")) == "orphaned" and p3.state == APPLIED  # its request left: an orphan
    st = lc.stats
    assert (st["plans"], st["applied"], st["aborted"], st["orphaned"]) == (3, 1, 1, 1)
    assert not lc.in_flight and not lc.busy and not lc.busy_mask.any()
    assert dict(lc.held) == {"b": {3: None, 4: None}}  # the aborted plan gave b its blocks back
    assert ("free", [1, 2], 0) in port.calls and ("free", [5, 6], 0) in port.calls


def test_a_plan_ended_twice_or_never_launched_is_refused():
    lc, _ = _lc()
    lc.hold("a", [1, 2])
    p = _plan(lc)
    with pytest.raises(AssertionError, match="not in flight"):
        lc.end(p, Outcome("applied"))
    lc.launch(p)
    with pytest.raises(PlanError, match="bad_state"):
        lc.launch(p)
    lc.end(p, Outcome("aborted", table_kept=True))
    with pytest.raises(AssertionError, match="not in flight"):
        lc.end(p, Outcome("aborted"))
    assert lc.stats["aborted"] == 1 and lc.stats["plans"] == 1


@pytest.mark.parametrize("case", ["not_held", "stale_dest", "overlap", "twice", "detach_refuses"])
def test_a_refused_launch_changes_nothing(case):
    lc, port = _lc(headroom=2)  # headroom [10, 11]
    lc.hold("a", [1, 2, 3])
    lc.hold("b", [4, 5])
    flying = _plan(lc, "b", (4,), dests=(11,))
    lc.launch(flying)
    detach = None
    if case == "not_held":
        p, code = _plan(lc, "a", (1, 7)), "ownership"
    elif case == "stale_dest":
        p, code = _plan(lc, "a", (1,), dests=(33,)), "stale_plan"
    elif case == "overlap":
        p, code = _plan(lc, "a", (1, 4)), "overlap"
    elif case == "twice":
        p, code = _plan(lc, "a", (1, 2), fills=(2,)), "overlap"
    else:
        def detach(r, ids):
            raise PlanError("ownership", f"{ids} not in {r}'s list")
        p, code = _plan(lc, "a", (1, 9)), "ownership"
    before, calls = _state(lc), list(port.calls)
    with pytest.raises(PlanError, match=code):
        lc.launch(p, detach)
    assert _state(lc) == before and port.calls == calls and p.state == PLANNED


def test_launch_takes_held_blocks_and_the_rest_through_the_paths_list():
    lc, _ = _lc(headroom=2)
    lc.hold("a", [5])  # a held block (a landed fill); 1 and 2 sit in the path's list
    listed = {1: 0, 2: 1}
    p = _plan(lc, "a", (1, 2), dests=(10,), fills=(5,))
    lc.launch(p, detach=lambda r, ids: [listed.pop(b) for b in ids])
    assert p.list_index == {5: -1, 1: 0, 2: 1} and not listed and "a" not in lc.held
    assert lc.headroom == [11] and lc.busy_mask[[1, 2, 5, 10]].all()


def test_an_applied_plan_frees_its_sources_at_its_fence_and_keeps_the_rest():
    lc, port = _lc(headroom=3)  # [10, 11, 12]
    lc.hold("a", [1, 2, 5])
    p = _plan(lc, "a", (1, 2), dests=(10, 11), fills=(5,), seq=7)
    lc.launch(p)
    port.calls.clear()
    assert lc.end(p, Outcome("applied", used_dests=[10])) == "applied"
    assert port.calls == [("adopt", [10]), ("free", [1, 2], 7)]
    assert lc.headroom == [12, 11] and p.dests == [10]
    assert list(lc.held["a"]) == [5, 10]  # the fill and the used destination are the request's


def test_used_destinations_not_the_plans_are_refused():
    lc, _ = _lc(headroom=1)
    lc.hold("a", [1, 2])
    p = _plan(lc, "a", (1, 2), dests=(10,))
    lc.launch(p)
    with pytest.raises(PlanError, match="ownership"):
        lc.end(p, Outcome("applied", used_dests=[10, 33]))
    assert p.id in lc.in_flight


def test_an_orphan_releases_everything_at_its_requests_list_fence():
    lc, port = _lc(headroom=2)
    lc.hold("a", [1, 2, 5, 6])
    p = _plan(lc, "a", (1, 2), dests=(10,), fills=(5,), seq=3)
    lc.launch(p)
    assert lc.finish("a", fence=9) == [6] and p.orphaned and p.gone_fence == 9
    port.calls.clear()
    assert lc.end(p, Outcome("applied", used_dests=[10])) == "orphaned"
    assert port.calls == [("adopt", [10]), ("free", [5, 10], 9), ("free", [1, 2], 3)]
    lc2, port2 = _lc(headroom=1)
    lc2.hold("a", [1, 2])
    q = _plan(lc2, "a", (1, 2), dests=(10,), seq=3)
    lc2.launch(q)
    lc2.finish("a", fence=2)
    port2.calls.clear()
    assert lc2.end(q, Outcome("aborted", reason="request left")) == "orphaned"
    assert port2.calls == [("free", [1, 2], 3)] and lc2.headroom == [10]


def test_release_refuses_a_block_a_plan_in_flight_uses():
    lc, port = _lc(headroom=1)
    lc.hold("a", [1, 2, 3])
    p = _plan(lc, "a", (1,), dests=(10,), fills=(2,))
    lc.launch(p)
    for bad in ([1], [2], [10], [3, 1]):
        with pytest.raises(PlanError, match=rf"ownership.*plan\(s\) \[{p.id}\]"):
            lc.release(bad)
    with pytest.raises(PlanError, match="ownership"):
        lc.release_held("a", [3, 2])
    assert port.calls == [] and list(lc.held["a"]) == [3]
    lc.release_held("a", [3])
    assert port.calls == [("free", [3], 0)]


def test_a_sharer_lets_go_of_its_own_reference_on_a_block_in_flight():
    """A prefix hit on a source being compacted: the sharer holds its own reference, which it
    may release while the plan flies (the plan keeps its own: it is freed at the plan's end)."""
    lc, port = _lc()
    lc.hold("a", [1, 2])
    p = _plan(lc, "a", (1,))
    lc.launch(p)
    lc.hold("b", [1])  # "b" shares block 1 (a prefix hit: one more reference, its own)
    assert lc.finish("b") == [1] and port.calls == [("free", [1], 0)]
    lc.end(p, Outcome("aborted", table_kept=True))  # shared in flight: aborted, back to "a"
    assert list(lc.held["a"]) == [2, 1]


def test_held_refuses_a_double_hold_and_a_take_of_what_is_not_held():
    h = Held(exclusive=True)
    h.add("a", [1, 2])
    for r, ids in (("a", [1]), ("b", [2]), ("b", [3, 3])):
        with pytest.raises(PlanError, match="held twice"):
            h.add(r, ids)
    with pytest.raises(PlanError, match="does not hold"):
        h.take("a", [2, 3])
    assert dict(h) == {"a": {1: None, 2: None}} and h.owner(2) == "a" and not h.index_errors()
    shared = Held()
    shared.add("a", [1])
    shared.add("b", [1])  # a shared prefix: one reference each
    assert shared.owner(1) == "a" and shared.drop_request("a") == [1] and shared.owner(1) == "b"
    shared["b"][7] = None  # written behind the index's back
    assert shared.index_errors() == [((7, "b"), 1)]


def test_headroom_refill_and_give_back_through_the_allocator():
    alloc = BlockAllocator(8)
    lc = Lifecycle(AllocatorPort(alloc), 8)
    assert lc.refill(3) == 3 and alloc.num_reserved == 3 and sorted(lc.take_fresh()) == sorted(lc.headroom)
    assert lc.take_fresh() == []
    back = lc.give_back(2)
    assert len(back) == 2 and alloc.num_reserved == 1 and all(alloc.state[b] == FREE for b in back)
    assert lc.refill(100) == 6 and alloc.num_free == 0  # as far as the free blocks go
    lc.give_back()
    assert alloc.num_free == 7 and not lc.headroom


# ------------------------------------------------------------------------------ the copy side
def _copy_setup(latency=1):
    t, alloc = TokenTable(4, 16), BlockAllocator(16)
    lc = Lifecycle(AllocatorPort(alloc), 16)
    blocks = alloc.allocate(4)
    t.sync_new_tokens("a", blocks, 16)
    lc.hold("a", blocks)
    t.evict_tokens("a", [0, 1, 2, 4, 5, 6])  # one live token in each of the first two blocks
    prop, _ = propose(t, "a", [], max_sources=4, tail=t.tail_block("a"))
    p = lc.new_plan("a", prop.sources, prop.dests, prop.moves, prop.fills)
    lc.launch(p)
    return t, alloc, lc, Copies(t, NullCopyEngine(latency)), p


def test_a_copy_is_applied_only_once_observed_done():
    t, alloc, lc, cp, p = _copy_setup(latency=1)
    before = t.export_state()
    assert cp.launch(p) is None and cp.poll() == [] and t.export_state() == before
    ((q, out),) = cp.poll()
    assert q is p and out.status == "applied" and out.moved == len(p.moves) and out.used_dests == []
    assert lc.end(p, out) == "applied" and all(alloc.state[b] == FREE for b in p.sources)
    assert t.export_state() != before and not cp.pending


@pytest.mark.parametrize("how", ["failed", "left", "shared"])
def test_a_copy_that_cannot_apply_ends_aborted_with_the_table_as_it_was(how):
    t, alloc, lc, cp, p = _copy_setup(latency=1)
    cp.engine.fail_next = how == "failed"
    cp.launch(p)
    if how == "left":
        cp.forget("a")
    elif how == "shared":
        assert p.sources[0] == t.blocks_of("a")[0]  # its first block: "b" can share it as a prefix
        t.sync_new_tokens("b", [p.sources[0]], 1)  # another request now references a source
    before = t.export_state()
    ((q, out),) = cp.poll() or cp.poll()
    assert out.status == "aborted" and t.export_state() == before
    assert out.table_kept == (how != "left") and (out.shared_sources == [p.sources[0]]) == (how == "shared")


def test_a_copy_for_a_request_gone_or_a_shared_block_is_refused_at_launch():
    t, alloc, lc, cp, p = _copy_setup()
    assert p.sources[0] == t.blocks_of("a")[0]  # its first block: "b" can share it as a prefix
    t.sync_new_tokens("b", [p.sources[0]], 1)
    out = cp.launch(p)
    assert out is not None and out.status == "aborted" and out.table_kept and out.shared_sources
    t.free_request("a")
    assert cp.launch(p).reason == "request gone before the copy" and not cp.pending


# ------------------------------------------------------------------------------ the rules on the source
def _system_files() -> list[Path]:
    return sorted(p for p in (ROOT / "vtoken").rglob("*.py") if "cli" not in p.relative_to(ROOT).parts)


def plan_records(files) -> list[str]:
    """Classes that look like a plan record: a class body naming ``id``, ``sources`` and
    ``dests`` as fields (annotated or assigned). The planner's ``Proposal`` (no id: the pure
    output of ``propose``, before any lifecycle) is not one."""
    out = []
    for f in files:
        for node in ast.walk(ast.parse(Path(f).read_text())):
            if isinstance(node, ast.ClassDef):
                names = set()
                for st in node.body:
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                        names.add(st.target.id)
                    elif isinstance(st, ast.Assign):
                        names.update(t.id for t in st.targets if isinstance(t, ast.Name))
                if {"id", "sources", "dests"} <= names:
                    out.append(f"{Path(f).name}:{node.lineno} {node.name}")
    return out


# calls that hand blocks back to a pool: vtoken's allocator (free, unreserve), vLLM's pool
# (free_blocks) and vLLM's fenced free (_free_cow_retained_blocks)
_POOL_FREES = ("free", "unreserve", "free_blocks", "_free_cow_retained_blocks")


def pool_frees(files) -> list[str]:
    """Calls that return blocks to a pool (``<x>.alloc.free/unreserve(...)``,
    ``<x>.pool.free_blocks(...)``, ``<x>._free_cow_retained_blocks(...)``) outside the methods of a
    port class (``class ...Port``), the pool the lifecycle is given: the lifecycle is then the
    only caller that frees (its ports are called from ``vtoken/lifecycle.py`` alone, see
    :func:`port_callers`)."""
    out = []
    for f in files:
        tree = ast.parse(Path(f).read_text())
        ports = {id(fn) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name.endswith("Port")
                 for fn in c.body if isinstance(fn, ast.FunctionDef)}
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or id(fn) in ports:
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _POOL_FREES:
                    owner = node.func.value
                    name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                    if node.func.attr == "_free_cow_retained_blocks" or name in ("alloc", "pool"):
                        out.append(f"{Path(f).name}:{node.lineno} {fn.name}")
    return sorted(set(out))


def port_callers(files) -> list[str]:
    """Calls of a port's pool methods (``<x>.port.free/unreserve/...(...)``) outside
    ``lifecycle.py``."""
    out = []
    for f in files:
        if Path(f).name == "lifecycle.py":
            continue
        for node in ast.walk(ast.parse(Path(f).read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("free", "unreserve", "reserve", "adopt") and \
                    getattr(node.func.value, "attr", getattr(node.func.value, "id", "")) == "port":
                out.append(f"{Path(f).name}:{node.lineno}")
    return out


def test_one_plan_record_in_the_system():
    found = plan_records(_system_files())
    assert found == [f for f in found if f.startswith("lifecycle.py:")] and len(found) == 1, found


def test_blocks_return_to_a_pool_only_through_the_lifecycle():
    assert pool_frees(_system_files()) == []
    assert port_callers(_system_files()) == []


@pytest.mark.parametrize("source, expect", [
    ("from dataclasses import dataclass\n@dataclass\nclass P:\n    id: int\n    sources: list\n    dests: list\n", 1),
    ("class P:\n    id = 0\n    sources = []\n    dests = []\n", 1),
    ("class P:\n    sources: list\n    dests: list\n", 0),  # no identity: a proposal, not a record
    ("class P:\n    id: int\n    sources: list\n", 0),
])
def test_the_record_rule_finds_planted_records(tmp_path, source, expect):
    f = tmp_path / "other.py"
    f.write_text(source)
    assert len(plan_records([f])) == expect


@pytest.mark.parametrize("source, expect", [
    ("def drop(self, b):\n    self.alloc.free([b])\n", ["x.py:2 drop"]),
    ("def drop(alloc, b):\n    alloc.free([b])\n", ["x.py:2 drop"]),
    ("def drop(self, blk):\n    self.scheduler._free_cow_retained_blocks([blk], 3)\n", ["x.py:2 drop"]),
    ("def drop(self, blks):\n    self.harness.pool.free_blocks(blks)\n", ["x.py:2 drop"]),
    ("def drop(self, b):\n    self.alloc.unreserve([b])\n", ["x.py:2 drop"]),
    ("def drop(self, b):\n    self.lifecycle.release([b])\n", []),
    ("def drop(self, b):\n    self.reserved.free(b)\n", []),  # not a pool
    ("class MyPort:\n    def free(self, ids, fence):\n        self.alloc.free(ids)\n", []),  # a port's own
    ("class Mine:\n    def free(self, ids, fence):\n        self.alloc.free(ids)\n", ["x.py:3 free"]),
])
def test_the_release_rule_finds_planted_frees(tmp_path, source, expect):
    f = tmp_path / "x.py"
    f.write_text(source)
    assert pool_frees([f]) == expect


@pytest.mark.parametrize("source, expect", [
    ("def f(self, b):\n    self.lifecycle.port.free([b], 0)\n", ["x.py:2"]),
    ("def f(lc, b):\n    lc.port.unreserve([b])\n", ["x.py:2"]),
    ("def f(self, b):\n    self.lifecycle.release([b])\n", []),
])
def test_the_port_rule_finds_planted_callers(tmp_path, source, expect):
    f = tmp_path / "x.py"
    f.write_text(source)
    assert port_callers([f]) == expect


# ------------------------------------------------------------------------------ the all-dead rule
def test_all_dead_keeps_only_private_empty_blocks_off_the_tail_and_out_of_flight():
    from vtoken.lifecycle import all_dead
    from vtoken.table import TokenTable

    t = TokenTable(4, 16)
    t.sync_new_tokens("a", [1, 2, 3, 4, 5], 20)
    t.sync_new_tokens("b", [1], 4)  # block 1 shared with b
    t.evict_tokens("a", list(range(0, 16)))  # blocks 1-4 of a lose every token; block 5 (its tail) keeps 4
    assert all_dead(t, "a", [4, 3, 2, 1, 5]) == [4, 3, 2]  # order kept; shared 1 and live 5 never
    assert all_dead(t, "a", [4, 3, 2], tail=3) == [4, 2]
    busy = np.zeros(16, dtype=bool)
    busy[2] = True
    assert all_dead(t, "a", [2, 3, 4], busy=busy) == [3, 4]
    assert all_dead(t, "a", []) == []


class _CountingList(list):
    """A headroom that counts the elements Python-level code walks (iteration and ``in``)."""

    walked = 0

    def __iter__(self):
        for b in super().__iter__():
            _CountingList.walked += 1
            yield b

    def __contains__(self, b):
        _CountingList.walked += len(self)
        return super().__contains__(b)


@pytest.mark.parametrize("dests", [(), (5000, 5001)])
def test_a_launch_does_work_of_its_plan_not_of_the_headroom(dests):
    """Issue 38: a launch walks its own blocks, never the whole headroom (the round at 1024
    requests cost x7 the round at 256 when every launch built a set of the headroom). Counted,
    not timed: the headroom elements walked are the same for a headroom of 10 and of 10,000."""
    walked = {}
    for size in (10, 10_000):
        port = FakePort()
        lc = Lifecycle(port, 20_000, {})
        lc.headroom = _CountingList(list(dests) + list(range(6000, 6000 + size)))
        plan = lc.new_plan("a", [1, 2], list(dests), np.zeros((0, 5), dtype=np.int64))
        _CountingList.walked = 0
        lc.launch(plan, detach=lambda r, ids: list(range(len(ids))))
        walked[size] = _CountingList.walked
        assert lc.headroom[:1] == [6000] and plan.state == COPYING
    assert walked[10] == walked[10_000], walked


def test_held_owns_its_dict_and_the_lifecycle_its_counts():
    """``Held`` is a read-only mapping over a dict it owns (no ``held[r] = ...`` or ``pop``
    behind the inverse index's back); a lifecycle built without ``stats`` counts in its own."""
    h = Held()
    h.add("a", [1])
    assert not isinstance(h, dict) and dict(h) == {"a": {1: None}} and h.get("b") is None
    with pytest.raises(TypeError):
        h["b"] = {2: None}
    assert not hasattr(h, "pop") and not hasattr(h, "setdefault")
    a, b = Lifecycle(AllocatorPort(BlockAllocator(4)), 4), Lifecycle(AllocatorPort(BlockAllocator(4)), 4)
    assert a.stats == {"plans": 0, "applied": 0, "aborted": 0, "orphaned": 0} and a.stats is not b.stats
