"""Checks added for mutants of ``vtoken/table.py`` and ``vtoken/planner.py`` that the worked
examples and the conformance machines let survive (``vtoken mutate``, issue 7 item 6).

Each test pins observable behaviour the other tests left open; the mutants it was written
for are named in its docstring (file:line as of the campaign, and the mutation)."""

import json

import numpy as np
import pytest

from vtoken import BlockAllocator, TableError, TokenTable
from vtoken.allocator import RESERVED
from vtoken.planner import APPLIED, NullCopyEngine, PlannerConfig, ReclamationManager
from vtoken.snapshot import validate

pytestmark = pytest.mark.invariants

S = 4


# ====================================================================== the token table
def table_with_a():
    t = TokenTable(S, 16)
    t.sync_new_tokens("a", [1, 2], 6)  # tokens 0..3 in block 1, 4..5 in block 2
    return t


def test_read_accessors_agree_through_decode_steps_and_evictions():
    """num_live / live_tokens / live_mask through one-token growth (the decode path) and
    evictions. Kills: table.py `r.n_live + 1` -> `+ 0` in _sync_one, `num_live` and
    `live_tokens` returning None, `live_mask` sliced one past the length."""
    t = TokenTable(S, 16)
    for n in range(1, 7):  # one token at a time: blocks 1, 2
        t.sync_new_tokens("a", [1, 2], n)
        assert t.num_live("a") == n
    t.sync_new_tokens("a", [1, 2, 3], 10)  # and a multi-token step
    t.evict_tokens("a", [2, 7])
    t.evict_token("a", 4)
    live = [0, 1, 3, 5, 6, 8, 9]
    assert t.num_live("a") == 7 == len(live)
    assert t.live_tokens("a").tolist() == live
    mask = t.live_mask("a")
    assert mask.shape == (t.length("a"),) == (10,)
    assert np.flatnonzero(mask).tolist() == live
    assert t.num_live_slots == 7


@pytest.mark.parametrize("ids", [np.array([3]), np.array([3], dtype=np.int32), [np.int64(3)], (3,), range(3, 4)])
def test_evicting_one_token_by_any_kind_of_id_list(ids):
    """A one-element id list is evicted whatever its type (callers pass numpy arrays).
    Kills: table.py `if len(ids) == 0: return` -> `== 1` in evict_tokens (one id in an
    array was silently ignored)."""
    t = table_with_a()
    t.evict_tokens("a", ids)
    assert t.live_tokens("a").tolist() == [0, 1, 2, 4, 5]
    assert t.num_live("a") == 5 and t.block_live_count(1) == 3
    t.evict_tokens("a", np.array([], dtype=np.int64))  # an empty list changes nothing
    assert t.num_live("a") == 5


def test_numpy_lengths_keep_the_exported_state_plain():
    """A scheduler hands lengths over as numpy integers; the table stores plain ints, so
    the exported state stays JSON (snapshots, failure files). Kills: table.py deletion of
    `total_len = int(total_len)` in sync_new_tokens."""
    t = TokenTable(S, 16)
    t.sync_new_tokens("a", np.array([1, 2], dtype=np.int64), np.int64(6))
    t.sync_new_tokens("a", [1, 2], np.int32(7))
    assert type(t.length("a")) is int and t.length("a") == 7
    state = json.loads(json.dumps(t.export_state()))
    assert state["requests"]["a"]["length"] == 7


def test_a_block_named_at_two_new_positions_is_a_conflict():
    """The same block at two positions of one growth step would put two tokens in one
    slot: ``slot_conflict``, nothing changed. Kills: table.py `np.unique(slots,
    return_index=True)` -> `return_index=False` in the duplicate check."""
    t = table_with_a()
    before = t.export_state()
    for blocks, total in (([1, 2, 3, 3], 16), ([1, 2, 3, 3, 3], 20), ([5, 5], 8)):
        rid = "a" if blocks[0] == 1 else "n"
        with pytest.raises(TableError) as e:
            t.sync_new_tokens(rid, blocks, total)
        assert e.value.code == "slot_conflict"
        assert t.export_state() == before


@pytest.mark.parametrize("total", [1, 3])  # the one-token path and the vector path
def test_negative_block_ids_are_out_of_range(total):
    """A negative block id must not wrap around to the end of the slot arrays. Kills:
    table.py `if not 0 <= b < self.num_blocks` -> `-1 <= b` in _sync_one."""
    t = TokenTable(S, 16)
    for bad in (-1, -2, 16):
        with pytest.raises(TableError) as e:
            t.sync_new_tokens("a", [bad], total)
        assert e.value.code == "block_out_of_range"
    assert "a" not in t and t.export_state()["blocks"] == {}
    t.sync_new_tokens("a", [15], total)  # the last block is fine
    assert t.location("a", 0) == (15, 0)


def test_the_device_lookup_cache_does_not_grow_under_request_churn():
    """Requests that grow (segment moves) and finish hand their device segments back, so
    the read-side cache stays bounded under churn. Kills: table.py deletion of
    `pool.release(r.base, r.cap)` in _grow and `if r.cap:` negated in free_request."""
    t = TokenTable(S, 256)
    blocks = list(range(1, 201))

    def churn(rounds):
        for _ in range(rounds):
            for n in (10, 70, 140, 300, 301):  # device segments of 64, 128, 256, 512 tokens
                t.sync_new_tokens("x", blocks, n)
            t.free_request("x")

    def pool_size():
        t.sync_new_tokens("probe", [201], 1)
        size = t.read_view("probe")[0].untyped_storage().nbytes()
        t.free_request("probe")
        return size

    churn(1)
    first = pool_size()
    churn(12)
    assert pool_size() == first


# ====================================================================== the planner
def make(nb=32, headroom=2, latency=0, **cfg):
    table, alloc = TokenTable(S, nb), BlockAllocator(nb)
    cfg.setdefault("theta_f", 0.0)
    cfg.setdefault("in_place", False)  # these scenarios count destinations: the out-of-place lifecycle
    mgr = ReclamationManager(table, alloc, NullCopyEngine(latency), PlannerConfig(headroom=headroom, **cfg))
    return table, alloc, mgr


def add(mgr, rid, nblocks):
    """A request of ``nblocks`` full fresh blocks, held by the manager's lifecycle."""
    blocks = mgr.alloc.allocate(nblocks)
    mgr.table.sync_new_tokens(rid, blocks, nblocks * S)
    mgr.hold(rid, blocks)
    return blocks


def sparse(mgr, rid, nblocks, keep):
    """``nblocks`` blocks, the last one (the tail) full, ``keep`` live tokens in each other block."""
    blocks = add(mgr, rid, nblocks)
    mgr.table.evict_tokens(rid, [b * S + o for b in range(nblocks - 1) for o in range(keep, S)])
    return blocks


def test_the_headroom_is_topped_up_to_exactly_its_size():
    """The reservation is ``headroom`` blocks, never more, however many blocks are free.
    Kills: planner.py `want = headroom - len(self.headroom)` -> `+`."""
    table, alloc, mgr = make(nb=32, headroom=3)
    assert len(mgr.headroom) == 3 and alloc.num_reserved == 3 and alloc.num_free == 31 - 3
    sparse(mgr, "a", 5, keep=1)
    (plan,) = mgr.step(force_sync=True)
    assert plan.state == APPLIED
    mgr.refill_headroom()
    assert len(mgr.headroom) == 3 and alloc.num_reserved == 3
    assert all(alloc.state[b] == RESERVED for b in mgr.headroom)
    mgr.refill_headroom()  # idempotent
    assert len(mgr.headroom) == 3 and alloc.num_reserved == 3


def test_default_config_plans_in_place_without_headroom_and_at_most_b_sources():
    """The shipped defaults (in-place plans, so no headroom block reserved; B = 32 sources,
    theta_f 0.25, every step, the watermark derived, copy_steps 4, no cap on plans per round,
    and no snapshots: recording keeps every applied plan in ``history``, memory a long run
    cannot afford by default). Kills: planner.py `headroom: int = 0` -> 1, `max_sources: int
    = 32` -> 31/33, `record_snapshots: bool = False` -> True, `in_place: bool = True` -> False."""
    cfg = PlannerConfig()
    assert (cfg.theta_f, cfg.check_every, cfg.max_sources, cfg.headroom, cfg.low_watermark, cfg.copy_steps,
            cfg.in_place) == (0.25, 1, 32, 0, None, 4, True)
    table, alloc = TokenTable(S, 128), BlockAllocator(128)
    mgr = ReclamationManager(table, alloc)
    assert mgr.headroom == [] and alloc.num_reserved == 0 and not mgr.backpressure
    sparse(mgr, "a", 61, keep=1)  # 60 one-live blocks (S = 4) and a full tail: F > 0.25
    assert mgr.eligible()
    (plan,) = mgr.step(force_sync=True)
    # 180 holes could free 45 blocks: B caps it at 32; their 32 live tokens fill the 3 holes
    # of each of the next 11 one-live blocks
    assert len(plan.sources) == 32 and plan.dests == [] and len(plan.fills) == 11 and plan.state == APPLIED
    assert plan.snapshot is None and mgr.history == []


def test_stats_count_every_event():
    """``stats`` (reported by bench and simulate) counts rounds, plans, applies, aborts,
    orphans, deferrals, moves and freed blocks exactly. Kills: planner.py mutated initial values in
    `self.stats = dict(...)`, `stats["plans"] += 1` -> `-=`, `stats["applied"] += 1` -> `+= 0`,
    `stats["rounds"] += 1` -> `+= 2`."""
    table, alloc, mgr = make(nb=32, headroom=2)
    zero = dict(plans=0, applied=0, aborted=0, orphaned=0, deferred=0, moves=0, blocks_freed=0, rounds=0)
    assert mgr.stats == zero
    sparse(mgr, "a", 5, keep=1)  # four one-live blocks and a full tail
    (p1,) = mgr.step()  # a round: planned and launched
    assert mgr.stats == dict(zero, plans=1, rounds=1)
    assert mgr.step() == []  # the copy is observed and applied; "a" is packed now: no round
    assert p1.state == APPLIED and len(p1.moves) == 4 and len(p1.sources) == 4 and len(p1.dests) == 1
    assert mgr.stats == dict(zero, plans=1, applied=1, moves=4, blocks_freed=3, rounds=1)
    sparse(mgr, "b", 3, keep=2)  # two half-live blocks and a tail
    mgr.engine.fail_next = True
    (p2,) = mgr.step()
    assert mgr.stats == dict(zero, plans=2, applied=1, moves=4, blocks_freed=3, rounds=2)
    (p3,) = mgr.step()  # p2's copy failed: aborted; a new round plans "b" again
    assert p2.state == "aborted"
    assert mgr.stats == dict(zero, plans=3, applied=1, aborted=1, moves=4, blocks_freed=3, rounds=3)
    mgr.step()
    assert p3.state == APPLIED
    assert mgr.stats == dict(zero, plans=3, applied=2, aborted=1, moves=8, blocks_freed=4, rounds=3)
    # worth doing but no headroom: a deferral
    table2, alloc2, mgr2 = make(nb=32, headroom=0)
    sparse(mgr2, "c", 4, keep=1)
    assert mgr2.plan_request("c") is None
    assert mgr2.stats == dict(zero, deferred=1)
    # the request finishes while its copy flies: the plan ends orphaned, neither applied nor aborted
    table3, alloc3, mgr3 = make(nb=32, headroom=2, latency=2)
    blocks = sparse(mgr3, "d", 5, keep=1)
    (p4,) = mgr3.step()
    mgr3.finish_request("d")
    mgr3.drain()
    assert mgr3.stats == dict(zero, plans=1, orphaned=1, rounds=1)
    assert p4.state == "aborted" and alloc3.num_free == 31 and mgr3.in_flight == {}


def test_snapshots_record_the_shared_blocks_and_the_whole_schedule():
    """A recorded plan's snapshot lists the request's shared blocks (and only those) and
    the events launch, fence, apply, free in order. Kills: planner.py deletion of
    `shared = sorted(...)` and `t.refs[b] > 1` -> `> 0` in _snapshot, deletion of
    `self.record(plan, "launch", ...)` in launch."""
    table, alloc, mgr = make(nb=32, headroom=2, record_snapshots=True)
    p = add(mgr, "p", 2)
    alloc.incref(p[:1])  # "a" is a prefix-cache hit on p's first block
    own = alloc.allocate(4)
    table.sync_new_tokens("a", p[:1] + own, 5 * S)
    mgr.hold("a", p[:1] + own)
    table.evict_tokens("a", [t for t in range(S, 4 * S) if t % S])  # blocks own[0..2]: one live each
    plan = mgr.plan_request("a")
    assert plan.sources == sorted(own[:3])
    snap = plan.snapshot
    assert snap["shared_blocks"] == [p[0]]
    mgr.launch(plan)
    mgr.poll()
    assert plan.state == APPLIED
    kinds = [e["kind"] for e in snap["schedule"]]
    assert kinds == ["launch", "fence", "apply", "free"]
    assert [e["t"] for e in snap["schedule"]] == sorted(e["t"] for e in snap["schedule"])
    validate(json.loads(json.dumps(snap)))


def test_a_plan_launched_after_the_headroom_changed_takes_only_its_destinations():
    """A plan launched after another plan's copy failed (its destination went back to the
    end of the headroom) takes exactly its own destinations, wherever they now sit.
    Kills: planner.py `b not in taken` -> `b in taken` in launch."""
    table, alloc, mgr = make(nb=32, headroom=3, latency=1)
    h0, h1, h2 = mgr.headroom
    sparse(mgr, "a", 3, keep=1)  # two one-live blocks and a tail
    sparse(mgr, "b", 3, keep=1)
    plan_a = mgr.plan_request("a")
    plan_b = mgr.plan_request("b")
    assert plan_a.dests == plan_b.dests == [h0]
    mgr.engine.fail_next = True
    mgr.launch(plan_b)
    assert mgr.poll() == [plan_b] and plan_b.state == "aborted"
    assert mgr.headroom == [h1, h2, h0]
    mgr.launch(plan_a)  # h0 is no longer at the front
    assert mgr.headroom == [h1, h2]
    assert all(alloc.state[b] == RESERVED for b in (h0, h1, h2))
    mgr.poll(force_sync=True)
    assert plan_a.state == APPLIED and table.blocks_of("a") == sorted([h0, plan_a.sources[-1] + 1])
    assert mgr.headroom == [h1, h2]


def test_a_round_serves_the_request_with_the_most_reclaimable_blocks_first():
    """With one plan per round, the round plans the request whose blocks pack best
    (section 3.3), whatever the order the requests were added in. Kills: planner.py
    deletion of `scored.sort()` and `- -(-max(...) // S)` -> `+ -(...)` in plan_round (the
    gain bound with the packed blocks added instead of subtracted)."""
    table, alloc, mgr = make(nb=64, headroom=8, max_plans_per_round=1)
    sparse(mgr, "dense", 7, keep=3)  # 6 blocks of 3 live + tail: 18 live -> 5 blocks, gain 1
    sparse(mgr, "thin", 4, keep=1)  # 3 blocks of 1 live + tail: 3 live -> 1 block, gain 2
    (plan,) = mgr.plan_round()
    assert plan.req_id == "thin" and plan.reduction == 2
    (plan2,) = mgr.plan_round()  # "thin" is busy now: "dense" next
    assert plan2.req_id == "dense" and plan2.reduction == 1


def test_negative_token_ids_are_unknown_not_wrapped():
    """Token -1 is outside [0, length): ``unknown_token``, not a lookup at the end of the
    arrays. Kills: table.py `if not 0 <= t < r.n` -> `-1 <= t` in location and _evict_one."""
    t = table_with_a()
    for call in (lambda: t.location("a", -1), lambda: t.evict_token("a", -1), lambda: t.evict_tokens("a", [-1]),
                 lambda: t.location("a", 6), lambda: t.evict_token("a", 6)):
        with pytest.raises(TableError) as e:
            call()
        assert e.value.code == "unknown_token"
    assert t.num_live("a") == 6


def test_releasing_a_block_named_twice_is_refused():
    """``duplicate_block``, and nothing released (a second release would drop a reference
    the request does not hold). Kills: table.py deletion of `seen.add(b)` in
    release_empty_blocks."""
    t = table_with_a()
    t.evict_tokens("a", [4, 5])  # block 2 holds no live token
    before = t.export_state()
    with pytest.raises(TableError) as e:
        t.release_empty_blocks("a", [2, 2])
    assert e.value.code == "duplicate_block"
    assert t.export_state() == before and t.block_refs(2) == 1
    assert t.release_empty_blocks("a", [2]) == [2]
    assert t.block_refs(2) == 0 and t.blocks_of("a") == [1]
