"""Planted planner bugs must be caught by the planner machine under the ci profile.

Each fault's patch (``vtoken.fuzz.catalogue``) is swapped in for the test; the machine must
then fail. Shrinking is left to ``vtoken fuzz
--planted`` so this stays fast; the test asserts detection, and that the failure comes from
a check meant to catch that fault.
"""

import re

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from vtoken.fuzz.planted import planted
from vtoken.errors import VTokenError
from vtoken.fuzz.planner_machine import PlannerMachine

pytestmark = pytest.mark.invariants

# fault -> the checks that may catch it (a regex over the failure message)
PLANNER_FAULTS = {
    "plan_moves_shared": r"source_shared|fill_shared",  # in place a shared block is taken as a fill as often
    "plan_moves_tail": r"source_tail|fill_tail",  # in place the tail is taken as a fill as often as a source
    "plan_nondecreasing": r"not_reducing|dest_count|no plan, but a valid plan",
    "plan_dup_dst": r"duplicate_slot|fill_order",
    "free_sources_at_plan": r"freed before its copy completed|aborted plan changed state|ownership",
    "plan_overlaps_inflight": r"source_in_flight",
}
# The catalogue's other faults whose detector is this machine (fuzz/planted.py).
OTHER_FAULTS = {
    "apply_before_complete": r"applied before the engine reported its copy complete",
    "abort_leaks_dests": r"not back in the headroom|not back in the free queue|aborted plan changed state|reserved|"
                         r"ownership",
    "finish_frees_inflight_sources": r"sources of plan \d+ still copying|freed before its copy completed|"
                                     r"an owner's reference is gone \(early free",
    "headroom_leak": r"not reserved|accounting|ownership: block \d+ is free but held by \['headroom'\]|"
                     r"in the free queue but held",  # the allocator's own assertion on handing it out
    # the manager itself trips over the stale table, or the comparison with the spec sees it
    "skip_apply": r"block_not_empty|state differs|blocks differ|state of request \d+ differs|source_not_owned",
    "resumed_applies_old_plan": r"shared_source|not the request's|state differs|blocks differ|"
                                r"state of request \d+ differs",
    # leaks only at the end of a batch: seen once the drain rule or the end of the example drains
    "drain_drops_orphans": r"after drain|after every request finished|ownership: block \d+ has \d+ reference\(s\) "
                           r"but 0 owner\(s\).*leak|reserved .* != headroom",
}


def _caught(fault):
    # 800: the machine draws the compaction mode too (in place / out of place), so a fault of
    # one lifecycle path needs about twice the examples it did with one mode (stops at the first)
    fast = settings(settings(), phases=[Phase.explicit, Phase.generate], database=None, max_examples=800,
                    report_multiple_bugs=False)
    with planted(fault):
        with pytest.raises((AssertionError, VTokenError)) as e:
            run_state_machine_as_test(PlannerMachine, settings=fast)
    return str(e.value)


@pytest.mark.parametrize("fault", sorted(PLANNER_FAULTS))
def test_planted_planner_fault_is_caught(fault):
    msg = _caught(fault)
    assert re.search(PLANNER_FAULTS[fault], msg), f"{fault} caught by an unexpected check: {msg}"


@pytest.mark.parametrize("fault", sorted(OTHER_FAULTS))
def test_other_planted_fault_is_caught(fault):
    msg = _caught(fault)
    assert re.search(OTHER_FAULTS[fault], msg), f"{fault} caught by an unexpected check: {msg}"


def test_machine_passes_without_faults():
    run_state_machine_as_test(PlannerMachine, settings=settings(settings(), max_examples=30, database=None))
