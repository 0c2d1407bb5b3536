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

from vtoken.allocator import BlockAllocator
from vtoken.lifecycle import ABORTED, APPLIED, COPYING, PLANNED, PlanLedger, allocator_release

ROOT = Path(__file__).resolve().parent.parent


def _ledger():
    freed = []
    return PlanLedger(lambda ids, fence: freed.append((list(ids), fence)), {}), freed


def _plan(led, req="a", sources=(1, 2), dests=(3,), fills=(), seq=0):
    return led.new_plan(req, sources, dests, np.zeros((0, 5), dtype=np.int64), fills, seq=seq)


# ------------------------------------------------------------------------------ the ledger
def test_every_opened_plan_is_counted_once_by_its_outcome():
    led, _ = _ledger()
    p1, p2, p3 = _plan(led, "a"), _plan(led, "b"), _plan(led, "c")
    assert [p.id for p in (p1, p2, p3)] == sorted({p1.id, p2.id, p3.id}) and p1.state == PLANNED
    for p in (p1, p2, p3):
        led.open(p)
    assert p1.state == COPYING and set(led.in_flight) == {p1.id, p2.id, p3.id}
    assert led.busy_requests() == {"a", "b", "c"}
    assert led.orphan("c") == [p3] and p3.orphaned and "c" not in led.busy
    assert led.orphan("c") == []  # already orphaned: nothing new
    assert led.close(p1, "applied") == "applied" and p1.state == APPLIED
    assert led.close(p2, "aborted") == "aborted" and p2.state == ABORTED
    assert led.close(p3, "applied") == "orphaned" and p3.state == ABORTED  # its request left: an orphan
    st = led.stats
    assert (st["plans"], st["applied"], st["aborted"], st["orphaned"]) == (3, 1, 1, 1)
    assert not led.in_flight and not led.busy


def test_a_plan_closed_twice_or_never_opened_is_refused():
    led, _ = _ledger()
    p = _plan(led)
    with pytest.raises(AssertionError, match="not in flight"):
        led.close(p, "applied")
    led.open(p)
    with pytest.raises(AssertionError, match="opened in state"):
        led.open(p)
    led.close(p, "aborted")
    with pytest.raises(AssertionError, match="not in flight"):
        led.close(p, "aborted")
    assert led.stats["aborted"] == 1 and led.stats["plans"] == 1


def test_busy_follows_each_plan_of_a_request():
    led, _ = _ledger()
    p1, p2 = _plan(led, "a", (1,)), _plan(led, "a", (2,))
    led.open(p1)
    led.open(p2)
    assert led.busy == {"a": {p1.id, p2.id}}
    led.close(p1, "applied")
    assert led.busy == {"a": {p2.id}}
    led.close(p2, "applied")
    assert led.busy == {}


def test_release_goes_to_the_port_at_its_fence_and_records_the_free():
    led, freed = _ledger()
    p = _plan(led, seq=7)
    p.snapshot = {"schedule": []}
    led.open(p)
    led.release([], 7, plan=p)  # nothing to free: the port is not called, nothing recorded
    led.release(p.sources, p.seq, plan=p)
    assert freed == [([1, 2], 7)]
    assert [e["kind"] for e in p.snapshot["schedule"]] == ["free"]
    assert p.snapshot["schedule"][0]["blocks"] == [1, 2]


def test_allocator_release_frees_in_the_allocator():
    alloc = BlockAllocator(8)
    got = alloc.allocate(3)
    led = PlanLedger(allocator_release(alloc))
    before = alloc.num_free
    led.release(got[:2], fence=5)
    assert alloc.num_free == before + 2


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


_POOL_FREES = ("free", "_free_cow_retained_blocks")
_PORTS = {("lifecycle.py", "allocator_release"), ("adapter.py", "free_ids")}


def pool_frees(files) -> list[str]:
    """Calls that return blocks to a pool (``<x>.alloc.free(...)``, ``alloc.free(...)``,
    ``<x>._free_cow_retained_blocks(...)``) outside the two release ports the ledger is given."""
    out = []
    for f in files:
        tree = ast.parse(Path(f).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or (Path(f).name, fn.name) in _PORTS:
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _POOL_FREES:
                    owner = node.func.value
                    name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                    if node.func.attr == "_free_cow_retained_blocks" or name == "alloc":
                        out.append(f"{Path(f).name}:{node.lineno} {fn.name}")
    return sorted(set(out))


def test_one_plan_record_in_the_system():
    found = plan_records(_system_files())
    assert found == [f for f in found if f.startswith("lifecycle.py:")] and len(found) == 1, found


def test_blocks_return_to_a_pool_only_through_the_ledger():
    assert pool_frees(_system_files()) == []


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
    ("def drop(self, b):\n    self.ledger.release([b])\n", []),
    ("def drop(self, b):\n    self.reserved.free(b)\n", []),  # not a pool
])
def test_the_release_rule_finds_planted_frees(tmp_path, source, expect):
    f = tmp_path / "x.py"
    f.write_text(source)
    assert pool_frees([f]) == expect


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
