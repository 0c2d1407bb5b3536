"""The token table against the reference model, under the Hypothesis profile in force."""

import pytest

from vtoken.fuzz.table_machine import TableMachine

pytestmark = pytest.mark.invariants

TestTableMachine = TableMachine.TestCase


def test_segment_growth_with_updates_queued_is_reached():
    """A request growing past its device segment while updates are queued (the copy to the
    new segment must come after they are written): a wrong line there fails this suite."""
    from hypothesis import Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    from vtoken.fuzz.planted import planted

    with planted("segment_growth_drops_queued"):
        with pytest.raises(AssertionError, match="differ"):
            run_state_machine_as_test(TableMachine, settings=settings(settings(), phases=[Phase.explicit, Phase.generate],
                                                                      database=None))
