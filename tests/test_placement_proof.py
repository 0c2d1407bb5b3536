"""The bounded proof of the placement rule (``vtoken.invariants.placement_proof``)."""

import numpy as np
import pytest

from vtoken.fuzz.planted import planted
from vtoken.invariants.placement_proof import PROPERTIES, prove_placement
from vtoken import placement
from vtoken.placement import dest_count, place

pytestmark = pytest.mark.invariants


def test_placement_rule_is_proved_for_8_blocks_of_16():
    r = prove_placement(8, 16)
    assert r.proved, str(r)
    assert r.properties == {p: "proved" for p in PROPERTIES}
    assert r.counterexample is None
    assert r.seconds < 60, r.seconds


@pytest.mark.parametrize("n_blocks,S", [(1, 1), (2, 4), (3, 5)])
def test_small_shapes_are_proved(n_blocks, S):
    assert prove_placement(n_blocks, S).proved


def _replay(ce, S):
    """Run the real place() on the counterexample's live bits (fault still planted: the
    patched function is the module's attribute while the patch is in)."""
    live = [bool(b) for b in ce["live"]]
    dest_index, offset = placement.place(np.asarray(live), S)
    return live, list(zip(dest_index.tolist(), offset.tolist()))


def test_off_by_one_yields_a_real_counterexample():
    with planted("placement_off_by_one"):
        r = prove_placement(8, 16, stop_at_first=True)
        assert not r.proved
        ce = r.counterexample
        assert ce["property"] == "range" and r.properties["range"] == "counterexample"
        live, out = _replay(ce, 16)
    # the counterexample is concrete: the faulty rule really puts that token out of range
    i = ce["token"]
    assert live[i]
    d, off = out[i]
    assert (d, off) == (ce["dest_index"], ce["offset"])
    assert not (0 <= off < 16 and 0 <= d < dest_count(sum(live), 16))
    assert "outside" in ce["why"]


def test_off_by_one_full_report_on_a_small_shape():
    with planted("placement_off_by_one"):
        r = prove_placement(2, 4)
    assert not r.proved
    # off by one keeps the order and uniqueness but breaks range, density and the dest list
    assert r.properties["range"] == "counterexample" and r.properties["dense"] == "counterexample"
    assert r.properties["order"] == "proved" and r.properties["unique"] == "proved"
    assert r.properties["excluded"] == "counterexample"


def test_without_the_fault_the_same_pattern_is_fine():
    with planted("placement_off_by_one"):
        ce = prove_placement(2, 4, stop_at_first=True).counterexample
    live = [bool(b) for b in ce["live"]]
    out = list(zip(*(a.tolist() for a in place(np.asarray(live), 4))))
    k = 0
    for i, l in enumerate(live):
        if l:
            assert out[i] == (k // 4, k % 4)
            k += 1


def test_place_on_numbers_is_the_rank_among_the_live():
    """The array the planner runs equals the rule stated per token (every pattern of 10 flags)."""
    for bits in range(1 << 10):
        live = np.array([(bits >> i) & 1 == 1 for i in range(10)])
        for S in (1, 3, 4):
            d, off = place(live, S)
            k = 0
            for i in range(10):
                if live[i]:
                    assert (int(d[i]), int(off[i])) == (k // S, k % S), (bits, S, i)
                    k += 1
