"""Hash-and-compare over slots the worker reads outside the token table (issue 40, item 2):
``RelocationChecker.guard_outside`` and the worker core's sliding-window reads, on the CPU
without vLLM (the end-to-end run through vLLM's scheduler is ``tests/vllm/test_window_guard.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtoken.allocator import BlockAllocator
from vtoken.copy_engine import KVCopyEngine
from vtoken.errors import CallError, RelocationCheckError
from vtoken.invariants.relocation_hash import RelocationChecker, token_layer_digests
from vtoken.kvcache import KVCache
from vtoken.planner import PlannerConfig, ReclamationManager
from vtoken.table import TokenTable

S, NB, L = 4, 48, 2
WINDOW = [40, 41, 42]  # the slots request 'b' reads outside the table (block 10), positions 5..7


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


class WindowWrite(KVCopyEngine):
    """Test-only fault: each copy also writes its first moved entry onto ``target``."""

    target = WINDOW[-1]

    def _slots(self, plan):
        src, dst = super()._slots(plan)
        return (np.append(src, src[0]), np.append(dst, self.target)) if len(src) else (src, dst)


def rig(engine=KVCopyEngine, guard_window=True, reads=None, lag=0, raise_on_failure=True):
    """Request 'a' on blocks 1..5 with holes (one out-of-place plan: sources 1..4 into the
    headroom 6..7), request 'b' on blocks 8..9 whose window (slots 40..42, block 10) the table
    does not map; ``reads``: the outside reader (default: b's window, always)."""
    kv = KVCache(L, NB, S, 2, 4)
    kv.kv.copy_(torch.randn(kv.kv.shape, generator=torch.Generator().manual_seed(5)))
    t, a = TokenTable(S, NB), BlockAllocator(NB)
    blocks_a = a.allocate(5)
    t.sync_new_tokens("a", blocks_a, 5 * S)
    t.evict_tokens("a", sorted(b * S + o for b in range(4) for o in (2, 3)))
    chk = RelocationChecker(kv, t, raise_on_failure=raise_on_failure)
    if guard_window:
        chk.guard_outside(reads or (lambda: [("b", np.array([5, 6, 7]), np.array(WINDOW))]), "the test window")
    cfg = PlannerConfig(theta_f=0.05, check_every=1, max_sources=8, headroom=2, record_snapshots=True, in_place=False)
    mgr = ReclamationManager(t, a, chk.wrap(engine(kv, S, lag=lag)), cfg, on_applied=chk.after_apply)
    blocks_b = a.allocate(2)
    t.sync_new_tokens("b", blocks_b, 8)
    mgr.hold("a", blocks_a)
    mgr.hold("b", blocks_b)
    assert mgr.headroom == [6, 7] and blocks_b == [8, 9]
    return kv, t, chk, mgr


def _run(mgr):
    mgr.plan_round()
    mgr.poll(force_sync=True)


def test_a_write_onto_a_guarded_outside_slot_is_caught():
    kv, t, chk, mgr = rig(WindowWrite)
    with pytest.raises(RelocationCheckError) as e:
        _run(mgr)
    assert e.value.code == "guard_overwritten"
    assert "slot 42 (block 10 offset 2)" in str(e.value) and "position 7 of request 'b' in the test window" in \
        str(e.value)


def test_the_same_write_passes_a_guard_over_the_table_alone():
    """The control (the guard before issue 40): the write lands, nothing flags it."""
    kv, t, chk, mgr = rig(WindowWrite, guard_window=False)
    before = token_layer_digests(kv, torch.tensor([42]))
    _run(mgr)
    assert (token_layer_digests(kv, torch.tensor([42])) != before).any()
    assert chk.failed == 0 and chk.passed == 2


def test_a_slot_that_left_the_reads_while_the_copy_flew_may_change():
    """A window slides: a slot no longer read when the copy is done (vLLM may have handed its
    block to someone else) is not compared; one still read is."""
    now = {"slots": WINDOW}

    def reads():
        return [("b", np.arange(5, 5 + len(now["slots"])), np.array(now["slots"]))]

    kv, t, chk, mgr = rig(WindowWrite, reads=reads, lag=1)
    mgr.plan_round()
    now["slots"] = WINDOW[:2]  # the written slot (42) left the window before the copy is seen done
    mgr.poll(force_sync=True)
    assert chk.failed == 0 and chk.passed == 2


def test_an_outside_slot_in_a_destination_block_is_caught_at_launch():
    kv, t, chk, mgr = rig(reads=lambda: [("b", np.array([0]), np.array([6 * S + 1]))])
    with pytest.raises(RelocationCheckError) as e:
        mgr.plan_round()
    assert e.value.code == "foreign_token" and "position 0 of request 'b' in the test window" in str(e.value)


def test_the_shipped_engine_passes_with_the_outside_guard():
    kv, t, chk, mgr = rig(lag=1)
    _run(mgr)
    assert chk.failed == 0 and chk.passed == 2 and chk.guarded >= len(WINDOW)


# ---------------------------------------------------------------- the worker core's window reads
def _core(check_relocations=RelocationChecker, window=6):
    from vtoken.vllm_adapter.layout import WorkerLayout
    from vtoken.vllm_adapter.messages import LoggedTable
    from vtoken.vllm_adapter.worker_core import WorkerCore, WorkerRequest

    kv = KVCache(L, NB, S, 2, 4)
    core = WorkerCore(kv, LoggedTable(S, NB), S, policy="random", policy_kwargs=None, evict_ratio=0.5, seed=0,
                      check_relocations=check_relocations, snapshot_dir=None, copy_lag=0, copy_engine_factory=None,
                      layout=WorkerLayout(0, 1, window))
    core.reqs["x"] = WorkerRequest(list(range(11)), [], [1, 2, 3], wblocks=[0, 20, 21])
    core.table.sync_new_tokens("x", [1, 2, 3], 11)
    core.reqs["gone"] = WorkerRequest([1], [], [4], wblocks=[22])  # not in the table: reads nothing
    return core


def test_window_reads_are_the_next_chunks_window_through_the_window_list():
    core = _core()
    ((r, pos, slots),) = core.window_reads()
    assert r == "x" and pos.tolist() == [6, 7, 8, 9, 10]  # the chunk at 11 reads [6, 11] (window 6)
    assert slots.tolist() == [20 * S + 2, 20 * S + 3, 21 * S, 21 * S + 1, 21 * S + 2]
    core.reqs["x"].wblocks = [0, 0, 21]  # vLLM freed block 20: its positions are not read
    assert core.window_reads()[0][1].tolist() == [8, 9, 10]
    assert core.checker._outside and core.checker._outside[0][0] == core.window_reads


def test_a_checker_that_cannot_guard_the_window_is_refused():
    class TableOnly:
        def __init__(self, kv, table, out_dir=None):
            pass

        def wrap(self, engine):
            return engine

    with pytest.raises(CallError, match="guard_outside"):
        _core(check_relocations=TableOnly)
