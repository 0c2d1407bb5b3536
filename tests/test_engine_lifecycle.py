"""The end of a batch: once every request finished, nothing of the copy lifecycle is left.

After ``DecodeEngine.run`` (and the simulator's ``Replay.run``) every block but the null
block is free, every launched plan ended exactly once (``plans == applied + aborted +
orphaned``), no copy is pending, no deferred free is left and the checker holds no launch
record. A copy that runs late past the batch's last step (copy lag) is the case: its
request has finished, nobody polls it again unless the batch is drained
(``ReclamationManager.drain``, the one drain every path calls).

Also here: a busy source that becomes all-dead while its copy flies (every live token in
it evicted mid-copy) stays allocated until the plan ends, and is freed exactly once then.
"""

from __future__ import annotations

import numpy as np
import pytest

from vtoken.allocator import NULL_BLOCK, USED, BlockAllocator
from vtoken.decode import DecodeEngine
from vtoken.errors import PlanError
from vtoken.fuzz.planted import planted
from vtoken.invariants.relocation_hash import RelocationChecker
from vtoken.planner import ABORTED, APPLIED, NullCopyEngine, PlannerConfig, ReclamationManager
from vtoken.sim.replay import Replay
from vtoken.sim.schedule import Schedule
from vtoken.table import TokenTable

S = 4
NEWS = [48, 35, 43, 27]  # requests finish at different steps, the longest with copies in flight
LAGS = list(range(0, 11))
CONFIGS = {"in_place": dict(theta_f=0.1), "out_of_place": dict(theta_f=0.1, in_place=False, headroom=8)}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def naive_outputs(model, prompts):
    eng = DecodeEngine(model, mode="naive-evict", policy="random", evict_ratio=0.5, block_size=S, seed=0)
    return eng.run(prompts, NEWS).outputs


def leftovers(alloc, mgr, engine=None, checker=None) -> list[str]:
    """What a finished batch still holds (empty when the lifecycle ended cleanly)."""
    st = mgr.stats
    out = []
    if alloc.num_free != alloc.num_blocks - 1:
        out.append(f"{alloc.num_free} of {alloc.num_blocks - 1} blocks free "
                   f"({alloc.num_used} used, {alloc.num_reserved} reserved)")
    if st["plans"] != st["applied"] + st["aborted"] + st.get("orphaned", 0):
        out.append(f"launched {st['plans']} != applied {st['applied']} + aborted {st['aborted']} "
                   f"+ orphaned {st.get('orphaned', 0)}")
    if mgr.in_flight:
        out.append(f"plans still in flight: {sorted(mgr.in_flight)}")
    if mgr.lifecycle.held:
        out.append(f"blocks still held for requests: {dict(mgr.lifecycle.held)}")
    if mgr.copies.pending:
        out.append(f"copies still pending on the copy side: {sorted(mgr.copies.pending)}")
    if engine is not None and getattr(engine, "pending", 0):
        out.append(f"{engine.pending} copies still pending in the copy engine")
    if checker is not None and checker.in_flight:
        out.append(f"{checker.in_flight} launch records left in the checker")
    return out


def decode(model, prompts, lag: int, config: str, **kw) -> DecodeEngine:
    cfg = PlannerConfig(**CONFIGS[config])
    return DecodeEngine(model, mode="vtoken", policy="random", evict_ratio=0.5, block_size=S, seed=0,
                        check_relocations=RelocationChecker, planner_config=cfg, copy_kwargs={"lag": lag}, **kw)


# ---------------------------------------------------------------------------- the decode engine
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("lag", LAGS)
def test_run_frees_every_block_and_ends_every_plan(model, prompts, naive_outputs, lag, config):
    eng = decode(model, prompts, lag, config)
    res = eng.run(prompts, NEWS)
    assert leftovers(eng.alloc, eng.manager, eng.copy_engine, eng.checker) == []
    assert res.plans_launched == res.relocations + res.plans_aborted + res.plans_orphaned
    assert res.relocations > 0 and res.hash_failures == 0
    assert res.outputs == naive_outputs


def test_a_request_finishing_while_its_fills_fly_gets_them_freed_after_the_copy(model, prompts):
    """In place, lag 7: requests finish while their plans' copies (sources and fills) fly,
    the last one at the batch's end; each such plan ends as an orphan and its blocks are
    freed then, not before."""
    eng = decode(model, prompts, 7, "in_place")
    eng.setup(200)
    seen = []
    finish = eng.manager.finish_request

    def spy(req_id):
        for p in eng.manager.in_flight.values():
            if p.req_id == req_id and p.fills:
                seen.append((p, list(p.fills)))
        freed = finish(req_id)
        for p, fills in seen:
            assert not set(fills) & set(freed), "a fill freed while its copy flies"
        return freed

    eng.manager.finish_request = spy
    res = eng.run(prompts, NEWS)
    assert seen, "no request finished while its fills flew (the case this test is for)"
    assert all(p.state == ABORTED and p.id not in eng.manager.in_flight for p, _ in seen)
    assert res.plans_orphaned >= len(seen)
    assert leftovers(eng.alloc, eng.manager, eng.copy_engine, eng.checker) == []


# ---------------------------------------------------------------------------- all-dead busy sources
def _all_dead_busy_sources(eng):
    """Run ``eng`` over the module's prompts, recording every in-flight plan's source that
    became all-dead while its copy flew (before the engine's release of empty blocks)."""
    hits = []
    release = eng._release_empty

    def spy(r, victims):
        t, mgr = eng.table, eng.manager
        for p in mgr.in_flight.values():
            for b in p.sources:
                if p.req_id == r.id and t.references(r.id, b) and t.n_b[b] == 0 and (p, b) not in hits:
                    hits.append((p, b))
        release(r, victims)

    eng._release_empty = spy
    return hits


def test_a_busy_source_that_dies_in_flight_stays_until_the_plan_ends(model, prompts, naive_outputs):
    """Lag 12: sources lose every live token while their copies fly. Such a source is not
    released by the eviction path (the copy still reads it), the plan still names it, and
    it is freed exactly once, by the plan's end (apply, or an orphan's deferred free)."""
    eng = decode(model, prompts, 12, "in_place")
    eng.setup(200)
    hits = _all_dead_busy_sources(eng)
    ends = {}
    end = eng.manager.lifecycle.end

    def at_end(plan, outcome):
        for p, b in hits:
            if p is plan:  # still allocated, and still the plan's (busy) until it ends
                assert eng.alloc.state[b] == USED, f"source {b} of plan {plan.id} freed before the plan ended"
                assert eng.manager.is_busy(b), f"source {b} of plan {plan.id} let go before the plan ended"
        counted = end(plan, outcome)
        ends[plan.id] = plan.state
        return counted

    eng.manager.lifecycle.end = at_end
    res = eng.run(prompts, NEWS)
    applied = [(p, b) for p, b in hits if ends.get(p.id) == APPLIED]
    assert applied, "no all-dead busy source in an applied plan (the case this test is for)"
    for p, b in hits:
        assert b in p.sources and ends.get(p.id) in (APPLIED, ABORTED)
    assert res.outputs == naive_outputs and res.hash_failures == 0
    assert leftovers(eng.alloc, eng.manager, eng.copy_engine, eng.checker) == []


@pytest.mark.parametrize("fault", ["decode_release_busy_all_dead", "apply_keeps_dead_source"])
def test_planted_faults_of_an_all_dead_busy_source_are_caught(model, prompts, fault):
    """Either way of mishandling it fails this decode: released early (the plan's apply then
    refuses a source no longer the request's), or never freed (a leak after the run)."""
    eng = decode(model, prompts, 12, "in_place")
    with planted(fault):
        try:
            eng.run(prompts, NEWS)
            caught = leftovers(eng.alloc, eng.manager, eng.copy_engine, eng.checker)
        except PlanError as e:
            caught = [str(e)]
    assert caught, f"{fault} went unnoticed"


def test_planted_no_drain_leaks(model, prompts):
    """The control of the drain: without it, the run of the sweep above leaks."""
    eng = decode(model, prompts, 7, "in_place")
    with planted("decode_run_no_drain"):
        eng.run(prompts, NEWS)
    assert leftovers(eng.alloc, eng.manager, eng.copy_engine, eng.checker)


# ---------------------------------------------------------------------------- the manager's drain
def _manager(latency: int, headroom: int = 0, in_place: bool = True):
    """Request 'a' on blocks 1..5 with one hole in each of blocks 2..4 and two live tokens in
    block 1: one in-place plan (source 1, fills 2, 3) or out-of-place plan is ready."""
    table, alloc = TokenTable(S, 24), BlockAllocator(24)
    blocks = alloc.allocate(5)
    table.sync_new_tokens("a", blocks, 5 * S)
    table.evict_tokens("a", [0, 1, 5, 9, 13])
    applied = []
    cfg = PlannerConfig(theta_f=0.05, headroom=headroom, in_place=in_place)
    mgr = ReclamationManager(table, alloc, NullCopyEngine(latency), cfg, on_applied=applied.append)
    mgr.hold("a", blocks)
    return table, alloc, mgr, blocks, applied


def test_drain_applies_a_live_requests_plan_and_returns_the_headroom():
    table, alloc, mgr, blocks, applied = _manager(latency=50, headroom=3, in_place=False)
    (plan,) = mgr.plan_round()
    assert mgr.poll() == [] and alloc.num_reserved == 3
    assert mgr.drain() == [plan]
    assert plan.state == APPLIED and applied == [plan] and not mgr.in_flight
    assert alloc.num_reserved == 0 and mgr.headroom == []
    assert mgr.stats["applied"] == mgr.stats["plans"] == 1
    mgr.step()  # still usable: the next step reserves the headroom again
    assert len(mgr.headroom) == 3


@pytest.mark.parametrize("fail", [False, True])
def test_drain_ends_an_orphan_and_frees_its_sources_and_fills(fail):
    table, alloc, mgr, blocks, applied = _manager(latency=50)
    mgr.engine.fail_next = fail
    (plan,) = mgr.plan_round()
    assert plan.fills, "an in-place plan"
    freed = mgr.finish_request("a")
    assert not set(freed) & set(plan.sources + plan.fills)  # the copy still uses them
    mgr.drain()
    assert plan.state == ABORTED and applied == []
    assert mgr.stats["orphaned"] == 1 and mgr.stats["aborted"] == 0 and mgr.stats["applied"] == 0
    assert alloc.num_free == alloc.num_blocks - 1 and not mgr.lifecycle.held and not mgr.copies.pending


# ---------------------------------------------------------------------------- the simulator
def _schedule(rng, prompt: int, output: int, keep: float = 0.5) -> Schedule:
    """Random victims (never the newest token), keeping ``ceil(keep * length)`` live."""
    live, vic, off, n = list(range(prompt)), [], [0], prompt
    for s in range(output + 1):
        if s:
            live.append(n)
            n += 1
        step = []
        while len(live) > max(1, int(np.ceil(keep * n))):
            step.append(live.pop(int(rng.integers(0, len(live) - 1))))
        vic += sorted(step)
        off.append(len(vic))
    return Schedule(prompt, output, np.asarray(vic, dtype=np.int64), np.asarray(off, dtype=np.int64))


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("latency", list(range(0, 8)))
def test_replay_run_frees_every_block_and_ends_every_plan(latency, config):
    rng = np.random.default_rng(3)
    scheds = [_schedule(rng, 32, o) for o in (40, 40, 33, 40)]
    cfg = PlannerConfig(**{**CONFIGS[config], "theta_f": 0.25})
    rp = Replay(scheds, "vtoken", S, 200, planner=cfg, latency=latency)
    out = rp.run()
    assert out["feasible"] and out["finished"] == len(scheds)
    assert leftovers(rp.alloc, rp.mgr) == []
    assert out["planner"]["plans"] > 0 and not rp.busy_mask.any() and not rp.lifecycle.in_flight
    assert rp.alloc.state[NULL_BLOCK] == USED  # the null block stays out of the pool
