"""Worked examples of the token table's contract (the fuzzers cover the space between them)."""

import numpy as np
import pytest
import torch

from vtoken import TableError, TokenTable

S = 4


def make(n=8, device="cpu"):
    t = TokenTable(S, n, device=device)
    t.sync_new_tokens("a", [1, 2], 6)  # tokens 0..3 in block 1, 4..5 in block 2
    return t


def test_positional_rule_and_slots():
    t = make()
    assert t.location("a", 5) == (2, 1)
    assert t.slot_mapping("a").tolist() == [4, 5, 6, 7, 8, 9]
    assert t.block_live_count(1) == 4 and t.block_live_count(2) == 2
    assert t.waste_ratio() == pytest.approx(1 - 6 / 8)


def test_eviction_is_metadata_only_and_rebuilds_cache():
    t = make()
    t.evict_tokens("a", [1, 4])
    assert t.slot_mapping("a").tolist() == [4, 6, 7, 9]
    assert t.blocks_of("a") == [1, 2]  # no block freed by eviction
    assert t.block_live_count(1) == 3
    with pytest.raises(TableError) as e:
        t.location("a", 1)
    assert e.value.code == "dead_token"


def test_growth_appends_to_cached_mapping():
    t = make()
    first = t.slot_mapping("a")
    assert first.tolist() == [4, 5, 6, 7, 8, 9]
    t.sync_new_tokens("a", [1, 2], 7)
    assert t.slot_mapping("a").tolist() == [4, 5, 6, 7, 8, 9, 10]
    slots, live = t.read_view("a")
    assert slots.tolist() == [4, 5, 6, 7, 8, 9, 10] and live.all()


def test_moves_compact_and_return_emptied_sources():
    t = make()
    t.evict_tokens("a", [0, 1, 2])
    # token 3 (block 1) and 4, 5 (block 2) -> fresh block 3
    freed = t.apply_moves("a", [(3, 1, 3, 3, 0), (4, 2, 0, 3, 1), (5, 2, 1, 3, 2)])
    assert freed == [1, 2]
    assert t.blocks_of("a") == [3]
    assert t.slot_mapping("a").tolist() == [12, 13, 14]
    assert t.waste_ratio() == pytest.approx(1 - 3 / 4)


@pytest.mark.parametrize("moves,code", [
    ([(9, 1, 0, 3, 0)], "unknown_token"),
    ([(0, 1, 1, 3, 0)], "wrong_source"),
    ([(0, 1, 0, 0, 0)], "null_block"),
    ([(0, 1, 0, 3, 4)], "bad_offset"),
    ([(0, 1, 0, 1, 1)], "slot_occupied"),
    ([(0, 1, 0, 3, 0), (1, 1, 1, 3, 0)], "duplicate_destination"),
    ([(0, 1, 0, 3, 0), (0, 1, 0, 3, 1)], "duplicate_token"),
    ([(0, 1, 0, 3, 0), (1, 1, 1, 99, 0)], "block_out_of_range"),
    ([(0, 1, 0)], "bad_move"),
])
def test_bad_moves_fail_atomically(moves, code):
    t = make()
    before = t.export_state()
    with pytest.raises(TableError) as e:
        t.apply_moves("a", moves)
    assert e.value.code == code
    assert t.export_state() == before
    assert t.slot_mapping("a").tolist() == [4, 5, 6, 7, 8, 9]


def test_foreign_and_shared_blocks():
    t = make()
    t.sync_new_tokens("b", [5], 2)
    with pytest.raises(TableError) as e:
        t.apply_moves("a", [(0, 1, 0, 5, 3)])
    assert e.value.code == "foreign_block"
    # a prefix-cache hit: "c" shares block 1 with "a" (same token ids at the same offsets)
    t.sync_new_tokens("c", [1, 6], 5)
    assert t.block_refs(1) == 2 and t.block_live_count(1) == 4
    with pytest.raises(TableError) as e:
        t.apply_moves("a", [(0, 1, 0, 3, 0)])
    assert e.value.code == "shared_block"
    # a different request's private block is not a prefix: conflict
    with pytest.raises(TableError) as e:
        t.sync_new_tokens("d", [2], 1)
    assert e.value.code == "slot_conflict"


def test_null_block_never_receives_tokens():
    t = TokenTable(S, 8)
    with pytest.raises(TableError) as e:
        t.sync_new_tokens("a", [0], 1)
    assert e.value.code == "null_block"
    assert "a" not in t


def test_free_request_returns_blocks_and_resets():
    t = make()
    assert t.free_request("a") == [1, 2]
    assert t.waste_ratio() == 0.0 and t.num_ref_blocks == 0
    t.sync_new_tokens("a", [2], 1)  # a freed block can be taken again
    assert t.slot_mapping("a").tolist() == [8]


def test_long_request_grows_segments():
    t = TokenTable(16, 400)
    blocks = list(range(1, 300))
    for n in range(1, 3000, 7):
        t.sync_new_tokens("a", blocks, n)
    t.evict_tokens("a", list(range(0, 2990, 3)))
    ref = np.arange(16, 16 + 2997)
    mask = np.ones(2997, bool)
    mask[0:2990:3] = False
    assert t.slot_mapping("a").tolist() == ref[mask].tolist()


@pytest.mark.gpu
def test_cuda_device_cache():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")
    t = make(device="cuda")
    t.evict_tokens("a", [2])
    m = t.slot_mapping("a")
    assert m.device.type == "cuda" and m.tolist() == [4, 5, 7, 8, 9]


def test_one_token_sync_after_a_long_sync_has_room():
    # regression: a 200-token sync left the host arrays shorter than the device segment,
    # and the one-token path checked only the latter
    t = TokenTable(16, 32)
    t.sync_new_tokens("x", list(range(1, 14)), 200)
    t.sync_new_tokens("x", list(range(1, 14)), 201)
    assert t.slot_mapping("x").tolist() == [16 + p for p in range(201)]


def test_read_api_for_per_step_callers():
    """The unsorted, O(1) / O(blocks) queries a scheduler step uses (no sort per call)."""
    t = make()
    t.sync_new_tokens("c", [1, 6], 5)  # shares block 1 with "a"
    t.evict_tokens("a", [4, 5])  # block 2 now holds no live token
    assert sorted(t.block_array("a").tolist()) == t.blocks_of("a") == [1, 2]
    assert t.num_blocks_of("a") == 2 and t.references("a", 2) and not t.references("a", 6)
    assert t.tail_block("a") == 2 and t.tail_block("c") == 6
    assert t.blocks_outside("a", {1}) == {2} and t.blocks_outside("c", {6: None}, frozenset()) == {1}
    assert t.blocks_outside("a") == {1, 2} and t.blocks_outside("a", [2], {1}) == set()
    out = t.blocks_outside("a")
    out.add(7)  # a new set: the caller's to change, the table's own untouched
    assert t.blocks_of("a") == [1, 2]
    with pytest.raises(TableError, match="unknown_request"):
        t.blocks_outside("zz", {1})
    with pytest.raises(TableError, match=r"not_integer.*container of block ids, got 5"):
        t.blocks_outside("a", {1}, 5)
    with pytest.raises(TableError, match=r"not_integer.*got None"):
        t.blocks_outside("a", None)
    with pytest.raises(TableError, match=r"not_integer.*got an unhashable entry"):
        t.blocks_outside("a", [[1]])
    assert t.blocks_of("a") == [1, 2]  # refused: nothing changed
    assert t.releasable_blocks("a").tolist() == [2]  # block 1 is shared, block 2 empty and private
    ids, slots = t.live_slots("a")
    assert ids.tolist() == [0, 1, 2, 3] and slots.tolist() == [4, 5, 6, 7]
    assert t.are_live("a", np.array([5, 0])).tolist() == [False, True]
    assert t.release_empty_blocks("a", t.releasable_blocks("a")) == [2]


def test_change_sets_name_what_changed_and_only_that():
    """take_changed / take_emptied / take_lone_dead: the adapter's per-step work follows them,
    so a request missing from them is a release or a plan the adapter never looks at."""
    t = TokenTable(4, 16)
    t.sync_new_tokens("a", [1, 2], 8)
    t.sync_new_tokens("b", [1, 3], 6)  # shares block 1 with "a" (a prefix hit)
    assert t.take_changed() == {"a", "b"} and t.take_emptied() == set()
    t.evict_tokens("a", [4, 5])  # block 2 keeps two live tokens
    assert t.take_changed() == {"a"} and t.take_emptied() == set()
    t.evict_tokens("a", [6, 7])  # block 2 now holds none
    assert t.take_emptied() == {"a"} and t.take_changed() == {"a"}
    assert t.take_changed() == set() and t.take_emptied() == set()  # taken: forgotten
    t.evict_tokens("a", [0, 1, 2, 3])  # block 1 is dead for "a" but "b" still claims it
    t.evict_tokens("b", [0, 1, 2, 3])  # now block 1 holds no live token
    assert t.take_emptied() == {"b"} and t.take_changed() == {"a", "b"}
    assert t.take_lone_dead() == set()
    t.free_request("b")  # "a" alone references dead block 1: releasable for "a", a's table unchanged
    assert t.take_lone_dead() == {1} and t.take_changed() == {"b"}
    assert sorted(t.releasable_blocks("a").tolist()) == [1, 2]


def test_reclaim_inputs_agree_with_the_single_queries_and_refuse_bad_input():
    """The reclaim bound's one-lookup read equals the queries it replaces; bad input raises
    the same codes as ``references`` (and changes nothing: it is a read)."""
    t = TokenTable(4, 16)
    t.sync_new_tokens("a", [1, 2, 3], 10)
    t.evict_tokens("a", [0, 1, 9])
    for tail in (None, 3, 5):
        got = t.reclaim_inputs("a", tail)
        held = tail is not None and t.references("a", tail)
        assert got == (t.num_blocks_of("a"), t.num_live("a"), held, t.block_live_count(tail) if held else 0)
    assert t.reclaim_inputs("a") == t.reclaim_inputs("a", t.tail_block("a"))  # default: the table's own tail
    with pytest.raises(TableError) as e:
        t.reclaim_inputs("nope", 3)
    assert e.value.code == "unknown_request"
    with pytest.raises(TableError) as e:
        t.reclaim_inputs("a", 16)
    assert e.value.code == "block_out_of_range"


def test_block_array_is_cached_read_only_and_follows_the_block_set():
    t = make()
    a = t.block_array("a")
    assert t.block_array("a") is a  # unchanged set: the same array, no rebuild
    with pytest.raises(ValueError):
        a[0] = 7  # callers copy before they modify
    t.sync_new_tokens("a", [1, 2, 3], 9)  # a new block referenced
    b = t.block_array("a")
    assert b is not a and sorted(b.tolist()) == [1, 2, 3] and sorted(a.tolist()) == [1, 2]
    t.evict_tokens("a", [8])
    t.release_empty_blocks("a", [3])
    assert sorted(t.block_array("a").tolist()) == [1, 2]
