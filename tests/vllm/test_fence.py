"""The fence's clock and ledger, unit by unit (``vtoken.vllm_adapter.fence``), over a stand-in
harness: the scenarios over vLLM's scheduler reach them only through a correct adapter, so a
ledger that stopped recording, or a clock that settled late or early, went unseen there (a
mutation campaign over the module: ``vtoken mutate --files vtoken/vllm_adapter/fence.py``).
Neither room imports vLLM."""

from types import SimpleNamespace

import pytest

from vtoken.vllm_adapter.assumptions import AdapterAssumptionError
from vtoken.vllm_adapter.fence import FenceLedger, StepClock


def _harness(defer: bool = False, **vllm):
    return SimpleNamespace(scheduler=SimpleNamespace(defer_block_free=defer, **vllm))


def _step(*reqs):
    """A scheduler output scheduling one token for each of ``reqs`` (none: an empty step)."""
    return SimpleNamespace(total_num_scheduled_tokens=len(reqs), num_scheduled_tokens=dict.fromkeys(reqs, 1))


def _req(r):
    return SimpleNamespace(request_id=r)


def test_the_own_clock_counts_non_empty_steps_from_one():
    clock = StepClock(_harness())
    assert clock.own and (clock.seq, clock.processed) == (0, 0)  # 0: no step yet (StepMeta's empty step)
    clock.scheduled(_step())  # an empty step is not counted
    assert clock.seq == 0
    clock.scheduled(_step("a"))
    assert (clock.seq, clock.processed) == (1, 0)
    clock.processing(_step("a"))
    assert (clock.seq, clock.processed) == (1, 1)
    clock.processing(_step())
    assert clock.processed == 1


def test_a_request_is_settled_exactly_when_its_last_scheduled_step_was_processed():
    """Async scheduling: step 2 is scheduled before step 1's output is processed. A request
    step 2 left out is settled once step 1 is (its blocks may go back at once); one step 2
    scheduled is not, until step 2 is (its fence is the step that reads it)."""
    clock = StepClock(_harness())
    assert clock.settled(_req("new"))  # never scheduled: nothing in flight reads it
    clock.scheduled(_step("a", "b"))
    assert not clock.settled(_req("a")) and not clock.settled(_req("b"))
    clock.scheduled(_step("a"))
    clock.processing(_step("a", "b"))
    assert clock.settled(_req("b")) and not clock.settled(_req("a"))
    clock.processing(_step("a"))
    assert clock.settled(_req("a"))


def test_the_clock_forgets_a_request_that_left():
    clock = StepClock(_harness())
    clock.scheduled(_step("a", "b"))
    clock.forget("a")
    clock.forget("gone")  # never scheduled: nothing to forget, no error
    assert clock.last == {"b": 1}  # O(requests scheduled and not gone), not every request ever seen


def test_vllms_clock_is_read_from_vllm_and_never_advanced_here():
    asked = []
    h = _harness(defer=True, sched_step_seq=7, processed_step_seq=5,
                 _request_blocks_can_be_freed=lambda req: asked.append(req.request_id) or req.request_id == "done")
    clock = StepClock(h)
    assert not clock.own
    clock.scheduled(_step("a"))
    clock.processing(_step("a"))
    assert (clock.seq, clock.processed) == (7, 5) and clock.last == {}
    assert clock.settled(_req("done")) and not clock.settled(_req("a")) and asked == ["done", "a"]


def _plan(pid, seq, sources=(3, 4), r="a"):
    return SimpleNamespace(id=pid, req_id=r, seq=seq, sources=list(sources))


def test_the_ledger_rejects_sources_handed_back_before_their_fence():
    """The ledger's check fed the violations it exists for: a source handed back before its
    step was processed, and one handed back with its copy not done."""
    ledger = FenceLedger(StepClock(_harness()))
    ledger.open(_plan(1, seq=4))
    ledger.close(_plan(1, seq=4), processed=3, copy_done=True)
    with pytest.raises(AdapterAssumptionError, match=r"\[fence\].*blocks \[3, 4\] \(sources of plan 1, request 'a'\) "
                                                     r"freed at step 3 .*fence 4"):
        ledger.check()
    ledger.open(_plan(2, seq=4))
    ledger.close(_plan(2, seq=4), processed=4, copy_done=False)
    with pytest.raises(AdapterAssumptionError, match=r"\[fence\].*plan 2.*copy completed: no"):
        ledger.check()


def test_the_ledger_accepts_a_hand_back_at_or_after_its_fence_and_checks_each_once():
    ledger = FenceLedger(StepClock(_harness()))
    for pid, processed in ((1, 4), (2, 9)):
        ledger.open(_plan(pid, seq=4))
        assert len(ledger) == 1
        ledger.close(_plan(pid, seq=4), processed=processed, copy_done=True)
        assert len(ledger) == 0 and len(ledger.closed) == 1
        ledger.check()
        assert not ledger.closed  # checked: not checked again


def test_an_aborted_plan_leaves_the_ledger_and_is_never_checked():
    ledger = FenceLedger(StepClock(_harness()))
    ledger.open(_plan(1, seq=4))
    ledger.open(_plan(2, seq=5))
    ledger.drop(_plan(1, seq=4))
    assert sorted(ledger.pending) == [2] and len(ledger) == 1
    ledger.close(_plan(1, seq=4), processed=0, copy_done=False)  # not pending: nothing handed back through it
    ledger.check()
    assert not ledger.closed
