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


class _NoEvictions:
    """A stand-in for Hypothesis's ``data`` in a rule called directly: every draw is False
    (the batched decode step draws only whether to evict)."""

    def draw(self, strategy, label=None):
        return False


def test_a_batched_decode_step_compares_two_requests_growing_into_one_block_in_the_same_order():
    """Found by a nightly campaign (seed 17003): a parent wrote 48 tokens in blocks A, B, C;
    child X shares the three and has 33 tokens, child Y shares them and has 32; the parent
    left, so C still holds its token 33 at offset 1. One decode step grows Y into C first (token
    32, the shared prefix's: in the batch), then X into C (token 33: C is already in the batch,
    so X grows on its own). Y's growth makes C shared for X on both tables, so X's token 33 matches
    the parent's and both accept it. Grown at once, before the batch reached the
    implementation (the reference had Y's growth already), X met an unshared C holding a token
    on one side only: a slot_conflict on the implementation alone."""
    m = TableMachine()
    m.start(16, 12)
    blocks = m.alloc.allocate(3)
    for rid, total in ((0, 48), (1, 32), (2, 33)):  # Y = 1 grows first (the machine's order)
        if rid:
            m.alloc.incref(blocks)
        m.pos[rid], m.held[rid] = list(blocks), list(blocks)
        for table in (m.impl, m.spec):  # (the machine's own helpers record Hypothesis events)
            table.sync_new_tokens(rid, m.pos[rid], total)
    for table in (m.impl, m.spec):
        table.free_request(0)
    del m.pos[0], m.held[0]
    assert m.spec.placed.get((blocks[2], 1)) == 33  # the parent's token, left in the shared block
    m.decode_step_batched(_NoEvictions())
    assert m.impl.length(1) == 33 and m.impl.length(2) == 34
    assert m.impl.slots(1).tolist() == m.spec.slot_mapping(1) and m.impl.slots(2).tolist() == m.spec.slot_mapping(2)
