"""The prefix-hash rules' view of the worker's full-context lengths (``PrefixHashRules.absorb``):
a request's length is visible once the worker has executed its list's incarnation; a report
equal to the last one, all visible, is absorbed without a pass over it, and a restarted list
or a forgotten request makes the next report absorbed in full again."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def _rules():
    from vtoken.vllm_adapter.prefix_hash import PrefixHashRules

    return PrefixHashRules(pool=None, manager=None, block_size=4, stats={}, changes=True)  # a reader keeps them


def test_an_equal_report_changes_nothing_and_a_restart_is_seen():
    rules = _rules()
    started = {"a": 1, "b": 1}
    rules.absorb({"a": 8, "b": 12}, started, processed=1)
    assert rules.faithful == {"a": 8, "b": 12} and rules.changed == {"a", "b"}
    rules.changed.clear()
    rules.absorb({"a": 8, "b": 12}, started, processed=2)  # the same report: nothing changes
    assert rules.faithful == {"a": 8, "b": 12} and not rules.changed
    # b's list restarts (resumed) at step 5: its old length is not shown until the worker ran it
    started["b"] = 5
    rules.restart("b")
    rules.absorb({"a": 8, "b": 12}, started, processed=3)
    assert rules.faithful == {"a": 8} and rules.changed == {"b"}
    rules.changed.clear()
    rules.absorb({"a": 8, "b": 12}, started, processed=4)  # still not executed: not absorbed whole
    assert rules.faithful == {"a": 8} and not rules.changed
    rules.absorb({"a": 8, "b": 12}, started, processed=5)
    assert rules.faithful == {"a": 8, "b": 12} and rules.changed == {"b"}


def test_a_forgotten_request_is_not_brought_back_by_an_equal_report():
    rules = _rules()
    started = {"a": 1}
    rules.absorb({"a": 8}, started, processed=1)
    rules.forget("a")
    assert rules.faithful == {} and "a" in rules.changed
    rules.absorb({"a": 8}, started, processed=2)  # the worker has not freed it yet: shown again
    assert rules.faithful == {"a": 8}


def test_without_reclamation_no_change_is_kept(model):
    """Naive-Evict (reclamation off, eviction on): no plan step empties the rules' record of
    changed full-context lengths, so none is kept (it grew with every request that evicted)."""
    from test_adapter_checks import evicting_run  # the adapter checks' builder (same folder)

    ad, w, d = evicting_run(model, max_tokens=30, reclaim=False)
    seen = 0
    while ad.has_work():
        d.step()
        seen = max(seen, len(ad.hashes.faithful))
        assert ad.hashes.changed is None
    assert seen > 0  # requests evicted: their full-context lengths were reported
    d.drain()
    ad.close()
