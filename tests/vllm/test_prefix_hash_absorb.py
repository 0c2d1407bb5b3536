"""The prefix-hash rules' view of the worker's full-context lengths (``PrefixHashRules.absorb``):
a request's length is visible once the worker has executed its list's incarnation; a report
equal to the last one, all visible, is absorbed without a pass over it, and a restarted list
or a forgotten request makes the next report absorbed in full again."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


def _rules(pool=None, manager=None, stats=None):
    from vtoken.vllm_adapter.prefix_hash import PrefixHashRules

    return PrefixHashRules(pool=pool, manager=manager, block_size=4, stats={} if stats is None else stats,
                           changes=True)  # a reader keeps them


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


class _Pool:
    """Records what the rules drop, park and put back (vLLM's ``evict_blocks``,
    ``_remove_cached_block_hashes``, ``_insert_block_hash``)."""

    def __init__(self):
        self.evicted: list[set] = []
        self.inserted: list[tuple] = []  # (hash, block id, num_tokens) put back
        self.blocks: dict = {}  # block id -> block, for restore

    def evict_blocks(self, ids):
        self.evicted.append(set(ids))

    def _remove_cached_block_hashes(self, blk):
        return [blk.block_hash]

    def _insert_block_hash(self, h, blk, n):
        self.inserted.append((h, blk.block_id, n))


def _blk(b, hashed=True, ref_cnt=1):
    from types import SimpleNamespace

    return SimpleNamespace(block_id=b, block_hash=f"h{b}" if hashed else None, block_hash_num_tokens=4,
                           ref_cnt=ref_cnt, is_null=False)


def test_a_block_is_faithful_only_below_the_full_context_length():
    """The second guard behind ``evict_unfaithful`` (a release or a plan's source keeps its hash
    only if faithful): the scenarios never reach it with an unfaithful hashed block, because the
    first guard dropped that hash already; fed directly, it must draw the line at the first
    block holding a token computed after the eviction (a mutation campaign: an off-by-one
    there, and f * S for f // S, survived every scenario)."""
    rules = _rules()
    rules.absorb({"a": 9}, {"a": 1}, processed=1)  # 9 tokens with full context, S = 4: blocks 0 and 1
    assert rules.faithful_blocks("a") == 2 and rules.faithful_blocks("never_evicted") == float("inf")
    assert [rules.is_faithful("a", i) for i in (-1, 0, 1, 2, 3)] == [False, True, True, False, False]
    assert rules.is_faithful("never_evicted", 10**6) and not rules.is_faithful("never_evicted", -1)


def test_a_release_or_a_source_keeps_its_hash_only_if_faithful():
    pool, stats = _Pool(), dict(hashes_kept=0, hashes_evicted=0, source_hashes_dropped=0)
    rules = _rules(pool, stats=stats)
    rules.absorb({"a": 9}, {"a": 1}, processed=1)
    rules.on_release("a", _blk(10), 1)
    rules.on_release("a", _blk(11), 2)
    rules.on_release("a", _blk(12, hashed=False), 3)  # no hash: nothing to keep or drop
    assert rules.kept == [(10, "released empty, bytes untouched, full context")] and pool.evicted == [{11}]
    assert (stats["hashes_kept"], stats["hashes_evicted"]) == (1, 1)
    pool.evicted.clear()
    parked = rules.park(7, "a", [_blk(20), _blk(21), _blk(22)], fills=[_blk(23)], list_index={20: 0, 21: 2})
    assert parked == [20] and pool.evicted == [{21, 22, 23}]  # 21 unfaithful, 22 not in the list, 23 a fill
    assert rules.parked == {7: [(20, ["h20"], 4)]} and stats["source_hashes_dropped"] == 3
    assert stats["source_hashes_parked"] == 1
    pool.blocks[20] = _blk(20, hashed=False)  # out of vLLM's map while it flew
    rules.restore(7)  # the plan ended, the source goes back to the pool: its hash with it
    assert pool.inserted == [("h20", 20, 4)] and rules.parked == {} and stats["source_hashes_restored"] == 1
    rules.park(8, "a", [_blk(30)], fills=[], list_index={30: 0})
    rules.unpark(8)  # an aborted copy: the source stays with its request, held, hashless
    rules.restore(8)
    assert rules.parked == {} and pool.inserted == [("h20", 20, 4)]
    rules.park(9, "a", [_blk(31)], fills=[], list_index={31: 1})
    rules.unpark_all()  # vLLM reset its prefix cache: nothing parked goes back
    assert rules.parked == {}


def test_forget_and_restart_clear_exactly_what_they_own():
    """``forget``: the request's length and scan go, and it is reported changed only if it had a
    length (the plan book re-tests what is reported); ``restart``: its scan starts over. The
    adapter calls both around a preemption, so each hid the other's loss from the scenarios."""
    rules = _rules()
    rules.absorb({"a": 8}, {"a": 1, "b": 1}, processed=1)
    rules.scanned.update(a=3, b=2)
    rules.changed.clear()
    rules.forget("b")  # no length reported: nothing changed for the plan book
    assert rules.changed == set() and "b" not in rules.scanned
    rules.forget("a")
    assert rules.changed == {"a"} and rules.faithful == {} and rules.scanned == {}
    rules.scanned["c"] = 5
    rules.restart("c")
    assert "c" not in rules.scanned


def test_a_length_is_not_absorbed_for_a_request_with_no_current_list():
    """The worker still reports a request the scheduler side has let go (finished or preempted
    in this very update): no list, no length (it would never be forgotten again)."""
    rules = _rules()
    rules.absorb({"gone": 8, "a": 4}, {"a": 1}, processed=3)
    assert rules.faithful == {"a": 4} and rules.changed == {"a"}


def test_the_first_guard_drops_each_unfaithful_hash_as_vllm_caches_its_block():
    """``evict_unfaithful_grown``: a block of a request that evicted loses its hash as soon as
    vLLM caches it (its cached count passes what was scanned) if it lies at or past the
    full-context length; faithful and shared blocks keep theirs; the rest of the list
    at the request's end (``upto``)."""
    from types import SimpleNamespace

    pool, manager = _Pool(), SimpleNamespace(num_cached_block={})
    stats = dict(unfaithful_hashes_evicted=0)
    rules = _rules(pool, manager, stats)
    lists = {"a": [_blk(0), _blk(1), _blk(2), _blk(3, ref_cnt=2), _blk(4), _blk(5)], "b": [_blk(9)]}
    rules.absorb({"a": 9, "b": 3}, {"a": 1, "b": 1}, processed=1)  # a: blocks 0-1 faithful; b: none
    manager.num_cached_block.update(a=3, b=1)
    rules.evict_unfaithful_grown(lists)
    assert pool.evicted == [{2}, {9}]  # a's block 2 (cached, past 9 // 4); b's first block, cached once
    manager.num_cached_block["a"] = 5
    rules.evict_unfaithful_grown(lists)
    assert pool.evicted[2:] == [{4}]  # block 3 is shared (another request's prefix hit): not ours to drop
    rules.evict_unfaithful_grown(lists)
    assert len(pool.evicted) == 3  # nothing new cached: nothing scanned again
    rules.evict_unfaithful("a", lists["a"], upto=1 << 30)  # the request ends: the rest of its list
    assert pool.evicted[3:] == [{5}] and stats["unfaithful_hashes_evicted"] == 4
