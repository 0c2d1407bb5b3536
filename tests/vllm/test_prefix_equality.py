"""The outputs guarantee under prefix caching, and its checkers.

Guarantee (``reports.vllm_runs.outputs_guarantee``): with the same requests, eviction policy
and seed, every request computed alike with reclamation on and off (the same prefix-cache
hits, the same preemptions) has the same output tokens. Caching off: every request. Caching
on: reclamation drops the hashes of moved blocks, so later requests may hit less; those are
listed, not compared, and the hit rates reported. Every prefix hit's K/V must equal what a
fresh prefill writes (``served_from_cache_mismatch``).
"""

import pytest

from vtoken.reports import vllm_runs
from vtoken.reports.vllm_runs import outputs_guarantee, served_from_cache_mismatch

pytestmark = pytest.mark.vllm


def _fake(outputs, incarnations, prompt=8, first_kv=None):
    return {"outputs": outputs, "incarnations": incarnations, "prompt_tokens": {r: prompt for r in outputs},
            "first_kv": first_kv or {r: [] for r in outputs}}


# ---------------------------------------------------------------------------- the checkers, fed violations
def test_guarantee_rejects_different_outputs_of_requests_computed_alike():
    inc = {"a": [(0, 0)], "b": [(0, 0)]}
    on = _fake({"a": [1, 2, 3], "b": [4, 5]}, inc)
    off = _fake({"a": [1, 2, 9], "b": [4, 5]}, inc)
    g = outputs_guarantee(on, off)
    assert not g["equal"] and g["differ"] == [["a", 2]] and g["compared"] == 2


def test_guarantee_does_not_compare_requests_with_other_hits_and_reports_hit_rates():
    on = _fake({"a": [1], "b": [7]}, {"a": [(0, 0)], "b": [(0, 0)]})
    off = _fake({"a": [1], "b": [8]}, {"a": [(0, 0)], "b": [(0, 8)]})
    g = outputs_guarantee(on, off)
    assert g["equal"] and g["compared"] == 1 and g["not_compared"] == ["b"]
    assert g["hit_rate_on"] == 0.0 and g["hit_rate_off"] == 0.5  # 8 of the 16 prompt tokens


def test_guarantee_counts_a_preempted_request_apart():
    on = _fake({"a": [1, 2]}, {"a": [(0, 0), (1, 0)]})  # preempted after one output, recomputed
    off = _fake({"a": [1, 3]}, {"a": [(0, 0)]})
    g = outputs_guarantee(on, off)
    assert g["compared"] == 0 and g["not_compared"] == ["a"]


def test_guarantee_refuses_runs_of_different_requests():
    with pytest.raises(ValueError, match="different requests"):
        outputs_guarantee(_fake({"a": []}, {"a": []}), _fake({"b": []}, {"b": []}))


def test_served_bytes_checker_rejects_a_hit_on_other_bytes():
    cached = _fake({"a": [], "b": []}, {"a": [(0, 3)], "b": [(0, 0)]}, first_kv={"a": [1, 2, 3, 4], "b": [5]})
    fresh = _fake({"a": [], "b": []}, {"a": [(0, 0)], "b": [(0, 0)]}, first_kv={"a": [1, 2, 9, 4], "b": [6]})
    assert served_from_cache_mismatch(cached, fresh) == [["a", 2]]  # b took nothing from the cache
    fresh["first_kv"]["a"] = [1, 2, 3, 7]  # differs only past the hit: fine
    assert served_from_cache_mismatch(cached, fresh) == []


# ---------------------------------------------------------------------------- through the real scheduler
@pytest.fixture(scope="module")
def equality(model):
    return vllm_runs.prefix_equality(quick=True, seed=0)


def test_repeated_sequences_equal_with_caching_off_and_alike_with_it_on(equality):
    """A finished request's whole sequence, a prompt and a prefix repeated later: with caching
    off every request equals Naive-Evict's; with it on, every request computed alike does,
    and each prefix hit served the bytes a fresh prefill writes."""
    assert equality["passed"], equality["detail"]
    row, = equality["runs"]
    off, on = row["cache_off"], row["cache_on"]
    assert off["compared"] == off["requests"] == 7 and off["equal"]
    assert on["equal"] and on["compared"] >= 4  # the first four never hit
    assert row["relocations"] > 0 and row["hash_failures"] == 0
    assert on["hit_rate_off"] > 0  # the repeats reach the prefix cache under Naive-Evict
    assert row["hits_served_fresh_bytes_naive-evict"] and row["hits_served_fresh_bytes_vtoken"]
    assert "hit rate naive-evict" in equality["detail"]


def test_unfaithful_hashes_kept_are_caught_by_the_repeated_sequence(model):
    """Planted: blocks computed after an eviction keep their hash. The repeated sequence then
    hits K/V a fresh prefill would not write; both runs share the fault, so only the
    comparison with caching off sees it."""
    from vtoken.fuzz.planted import planted

    with planted("adapter_keeps_unfaithful_hash"):
        res = vllm_runs.prefix_equality(quick=True, seed=2)
    assert not res["passed"]
    assert "prefix hits served K/V a fresh prefill does not write" in res["detail"]
