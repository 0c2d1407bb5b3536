"""Planted token-table bugs must be caught by the conformance machine under the ci profile.

Each fault's patch is swapped in (``vtoken.fuzz.planted.planted``); the machine must then fail. Shrinking
is left to ``vtoken fuzz --planted`` so this stays fast; the test only asserts detection.
"""

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from vtoken.fuzz.planted import planted
from vtoken.fuzz.table_machine import TableMachine

pytestmark = pytest.mark.invariants

TABLE_FAULTS = ["stale_slot_after_move", "nb_double_count", "nonatomic_apply_moves", "dup_dst_accepted"]


@pytest.mark.parametrize("fault", TABLE_FAULTS)
def test_planted_table_fault_is_caught(fault):
    fast = settings(settings(), phases=[Phase.explicit, Phase.generate], database=None, max_examples=400)
    with planted(fault):
        with pytest.raises(AssertionError):
            run_state_machine_as_test(TableMachine, settings=fast)


def test_machine_passes_without_faults():
    run_state_machine_as_test(TableMachine, settings=settings(settings(), max_examples=30, database=None))
