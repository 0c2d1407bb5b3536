"""Issue 40, item 7: races made visible. Each test runs the adapter machine's instrumented run
(``adapter_machine._Run``: the real vLLM scheduler, async scheduling unless named, seeded
prompts) on one directed scenario.

- poison on return: a block back in vLLM's pool has its K/V poisoned (NaN), at once or, for
  vLLM's own frees of a request that left, before the first step scheduled after the free
  (``_Run._poison_freed``); a step that reads a poisoned slot for a request fails at that read
  (``_Run._check_poison_reads``), whatever the machine's own bookkeeping believes;
- a block of a plan in flight handed to another holder mid-copy (shared, freed, listed,
  hashed): the refusal that must fire, fires;
- timeliness: a corruption is reported on the hook where it happens, by the incremental check
  and by the full scan alike.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def no_hypothesis_events(monkeypatch):
    """The machine's runs record Hypothesis events; these scenarios run outside a test case."""
    from vtoken.fuzz import adapter_machine, hard_states

    monkeypatch.setattr(adapter_machine, "event", lambda *a, **k: None)
    monkeypatch.setattr(hard_states, "event", lambda *a, **k: None)


BASE = dict(reclaim=True, S=4, N=40, H=2, B=4, async_=True, caching=True, lag=0, ratio=0.5, budget=2048, checks=True,
            in_place=True, layout="full")


def make_run(n: int = 4, seed: int = 0, **kw):
    """An instrumented run with ``n`` seeded requests of 12 prompt tokens and 20 outputs."""
    from vtoken.fuzz import adapter_machine as am

    run = am._Run(**{**BASE, **kw})
    rng = np.random.default_rng(seed)
    for i in range(n):
        run.add(f"r{i}", rng.integers(1, 63, size=12).tolist(), 20)
    return run


def drive(run, *, stop: bool = True, ledger: bool = True, until=None, steps: int = 120):
    """Step ``run``; with ``stop`` each request whose plan rides on the step in flight stops at
    that step's token (the EOS window); ``until(run)`` true ends the loop early (returns True)."""
    for _ in range(steps):
        run.step()
        nxt = run.d.in_flight[0] if run.d.in_flight else None
        flying = [p for p in run.ad.plans.values() if not p.orphaned and nxt is not None
                  and p.req_id in nxt.num_scheduled_tokens and p.seq == nxt.vtoken.seq]
        if stop and flying:
            run.stop_next(flying[0].req_id)
        if ledger:
            run.check_ledger()
        if until is not None and until(run):
            return True
        if not run.ad.has_work():
            break
    return False


def finish(run, ledger: bool = True) -> None:
    run.drain()
    if ledger:
        run.check_ledger()
        run.ad.close()


def scenario(fault: str | None = None, *, stop: bool = True, ledger: bool = True, **kw):
    from vtoken.fuzz.planted import planted

    with planted(fault) if fault else contextlib.nullcontext():
        run = make_run(**kw)
        drive(run, stop=stop, ledger=ledger)
        finish(run, ledger=ledger)
    return run


# ---------------------------------------------------------------------------- poison on return
CONFIGS = [dict(), dict(layout="hybrid"), dict(vllm_clock=True), dict(lag=3), dict(in_place=False),
           dict(async_=False), dict(caching=False, lag=2), dict(layout="hybrid", vllm_clock=True, lag=1)]


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_the_shipped_adapter_never_reads_a_poisoned_block(kw):
    run = scenario(**kw)
    assert run.poisoned_blocks > 0 and run.reads_checked > 0  # the poison and the read check both ran
    assert run.ad.stats["applied"] + run.ad.stats["orphaned"] > 0


def test_a_block_given_back_by_a_request_that_left_stays_readable_by_the_step_in_flight():
    """The audit's seeded campaign found this false alarm: with async scheduling, a request
    aborted while a step that computes it flies gives its blocks back (poison due before the
    next step); the pool hands one out and takes it back (the machine's grab and release)
    before the step in flight executes. That step may still read the block (a later step's
    writes come after it): the release must keep the earlier due, not poison at once."""
    from vtoken.fuzz import adapter_machine as am

    run = am._Run(**{**BASE, "N": 16, "H": 1, "B": 1, "ratio": 0.3, "in_place": False})
    run.add("r0", [1], 2)
    run.step()
    run.step()
    assert run.d.in_flight and "r0" in run.d.in_flight[0].num_scheduled_tokens  # a step computing r0 flies
    held = [b.block_id for b in run.ad.scheduler.kv_cache_manager.get_blocks("r0").blocks[0]]
    assert run.abort("r0")
    due = {b: run.poison_due.get(b) for b in held}
    assert all(s is not None for s in due.values()), due  # readable until the next step
    run.grab(16)
    assert set(held) <= {b.block_id for b in run.grabbed}
    run.release()
    assert {b: run.poison_due.get(b) for b in held} == due  # the release kept the earlier due
    reads = run.reads_checked
    run.step()  # the step in flight reads r0's blocks: no poison yet
    finish(run)
    assert run.reads_checked > reads
    # no step was scheduled after the abort: the blocks are still due before the next one
    assert {b: run.poison_due.get(b) for b in held} == due == {b: run.ad.clock.seq + 1 for b in held}


def test_a_stop_enters_the_history_where_it_falls_among_the_runs():
    """The machine compares a request's outputs with Naive-Evict's only when both runs computed
    it alike. A stop (every token a stop token) lands on the request's next sampled token: a
    run that admitted the request later (vtoken's headroom takes blocks) stops it at another
    token. A campaign found such a pair compared (6 vs 7 tokens, the same chunks): the stop's
    place among the runs is part of the history now."""
    early, late = make_run(n=1), make_run(n=1)
    for _ in range(3):
        early.step()
    late.step()
    assert early.stop_next("r0") and late.stop_next("r0")
    assert early.history["r0"][-1] == late.history["r0"][-1] == ("stop",)
    assert early.history["r0"] != late.history["r0"]  # not comparable
    finish(early)
    finish(late)


@pytest.mark.parametrize("lag", [1, 2])
def test_a_finished_requests_blocks_the_worker_still_maps_are_poisoned_when_it_learns(lag):
    """A 10-minute campaign found this false alarm: the adapter frees a finished request's held
    destinations at their fence, and the machine poisoned them at once, while the worker's
    table (it learns the request left at the next step) still maps its tokens there: another
    plan's guard then read the poison as its copy overwriting them (``guard_overwritten``).
    Such a block is poisoned before the next step instead; early frees are still poisoned at
    once (the early-free faults above)."""
    run = make_run(n=5, seed=1, in_place=False, lag=lag, H=3, budget=64)
    drive(run, stop=True)
    finish(run)
    assert any("which left" in why for why in run.poisoned.values()), run.poisoned


def blind_bookkeeping(monkeypatch):
    """The machine's own view of who may read what (its fence ledger, its readable blocks) off:
    what is left is the poison."""
    from vtoken.fuzz import adapter_machine as am

    monkeypatch.setattr(am._Run, "_check_reads", lambda *a, **k: None)
    monkeypatch.setattr(am._Run, "_freed", lambda *a, **k: None)


@pytest.mark.parametrize("fault, kw", [("adapter_orphan_frees_at_plan_fence", {}),
                                       ("adapter_orphan_frees_at_plan_fence", {"in_place": False}),
                                       ("adapter_dests_unfenced", {}),
                                       ("adapter_own_clock_unfenced", {})])
def test_a_read_of_a_block_freed_before_its_step_reads_poison(monkeypatch, fault, kw):
    """A block the adapter returns to the pool before a step scheduled earlier reads it: that
    step reads NaN, named at the read (the bookkeeping checks off: the poison alone)."""
    blind_bookkeeping(monkeypatch)
    with pytest.raises(AssertionError, match=r"step \d+ reads poisoned slot \d+ \(block \d+\) for request 'r\d'"):
        scenario(fault, ledger=False, **kw)


def test_without_the_poison_the_same_early_free_passes_unseen(monkeypatch):
    """The control of the test above: the same fault, bookkeeping off and no poison, passes (on
    the CPU a freed block keeps its bytes until someone writes it, so only the poison shows it)."""
    blind_bookkeeping(monkeypatch)
    scenario("adapter_orphan_frees_at_plan_fence", ledger=False, poison=False)


def test_a_block_freed_behind_the_adapters_back_is_read_as_poison(monkeypatch):
    """A block a running request still reads, returned to the pool behind everyone's back (its
    list keeps it): the next step that reads it fails at that read."""
    blind_bookkeeping(monkeypatch)
    run = make_run(n=2, caching=False)  # no prefix-cache hash: a hashed free block keeps its bytes
    for _ in range(6):
        run.step()
    r = "r0"
    live = run.w.table.slot_mapping(r).cpu().numpy()  # the slots its next step reads
    b = run.ad.block(int(live[-1]) // run.S)  # the newest token: never evicted before the read
    assert b.ref_cnt == 1 and b.block_hash is None
    b.ref_cnt = 1  # vLLM's reference only: the free below returns it to the pool
    run.ad.pool.free_blocks([b])
    b.ref_cnt = 1  # the list still names it (as a stale list would); its bytes are poison now
    run.ad.pool.free_block_queue.remove(b)
    with pytest.raises(AssertionError, match=rf"reads poisoned slot \d+ \(block {b.block_id}\) for request 'r0'"):
        for _ in range(4):
            run.step()


# ---------------------------------------------------------------------------- mid-copy handover
def in_flight(run, role: str):
    """Step ``run`` (no stops, copies 4 polls late) until a plan flies with a block of ``role``
    (``sources``, ``fills`` or ``dests``); returns ``(plan, block)``."""
    def found(run):
        return any(getattr(p, role) for p in run.ad.plans.values() if not p.orphaned)

    assert drive(run, stop=False, until=found, steps=60), f"no plan with {role} in flight"
    p = next(p for p in run.ad.plans.values() if not p.orphaned and getattr(p, role))
    return p, run.ad.block(getattr(p, role)[0])


def hook(run, where: str = "handover") -> None:
    """One runtime-check hook, as the adapter runs it (the machine's probes bypassed)."""
    chk = run.ad.checker
    type(chk).after_hook(chk, where, table=True)


def share(run, blk):
    blk.ref_cnt += 1  # another holder's reference (a prefix hit's touch, a stale copy of the id)


def free(run, blk):
    run.ad.pool.free_blocks([blk])  # returned to the pool behind the adapter's back


def listed(run, blk):
    """vLLM hands the block to a new request's list at the next ``schedule()``: it is put at the
    front of the free queue with one reference dropped (as a free behind the adapter's back
    would), a request arrives, and the step runs up to its first hook."""
    pool = run.ad.pool
    blk.ref_cnt -= 1
    if blk.ref_cnt == 0:
        pool.free_block_queue.prepend_n([blk])  # the next block vLLM hands out
    run.add("r9", list(range(1, 10)), 4)
    run.step()


def hashed(run, blk):
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    h = make_block_hash_with_group_id(bytes(32), 0)
    blk.set_block_hash(h)  # vLLM caches it: a later request's prefix hit would land on it
    run.ad.pool.cached_block_hash_to_block.insert(h, blk)


HANDOVERS = {"shared": share, "freed": free, "listed": listed, "hashed": hashed}
EXPECT = {  # (handover, role) -> the runtime check that must refuse it at the next hook
    **{("shared", r): c for r, c in (("sources", "fence"), ("fills", "ownership"), ("dests", "ownership"))},
    **{("freed", r): c for r, c in (("sources", "fence"), ("fills", "ownership"), ("dests", "ownership"))},
    **{("listed", r): c for r, c in (("sources", "fence"), ("fills", "ownership"))},
    # a destination the pool hands out again goes to the headroom first (it is refilled before
    # vLLM schedules), and the next proposal naming it is refused by the planner's contract
    ("listed", "dests"): "plan_contract",
    **{("hashed", r): "prefix_hash" for r in ("sources", "fills", "dests")},
}


@pytest.mark.parametrize("full", [False, True], ids=["incremental", "full-scan"])
@pytest.mark.parametrize("role", ["sources", "fills", "dests"])
@pytest.mark.parametrize("how", list(HANDOVERS))
def test_a_block_of_a_plan_in_flight_handed_over_mid_copy_is_refused_at_the_next_hook(how, role, full):
    """A block of a plan whose copy flies becomes another holder's (shared, freed, listed,
    hashed): the very next runtime-check hook refuses it, naming the block (the incremental
    check, whose verdict the full scan confirms, and the full scan alone, ``paranoid``)."""
    from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

    run = make_run(n=4, lag=4, caching=True, in_place=role != "dests")
    p, blk = in_flight(run, role)
    run.ad.checker.paranoid = full
    hook(run, "before")  # clean before the handover
    with pytest.raises(AdapterAssumptionError) as e:
        HANDOVERS[how](run, blk)  # "listed" runs the step whose schedule hands it out: its first hook
        hook(run)
    assert e.value.check == EXPECT[(how, role)], str(e.value)
    assert f"block {blk.block_id}" in str(e.value)


# ---------------------------------------------------------------------------- timeliness of the full scan
def stray_ref(run, kind: str):
    """A corruption the adapter's own events did not touch (so the incremental check need not
    see it): a stray reference on an old headroom block or a block held for a request, or a
    list entry of a request nulled behind vLLM's back. Returns the text the error must name."""
    ad = run.ad
    if kind == "headroom":
        b = ad.lifecycle.headroom[0]
        ad.pool.blocks[b].ref_cnt += 1
        return f"headroom block {b} "
    if kind == "held":
        r, v = next((r, v) for r, v in ad.lifecycle.held.items() if v)
        b = next(iter(v))
        ad.pool.blocks[b].ref_cnt += 1
        return f"block {b} "
    r = next(r for r, lst in ad.req_to_blocks.items() if r in ad.mirror and any(not x.is_null for x in lst))
    lst = ad.req_to_blocks[r]
    j = next(i for i, x in enumerate(lst) if not x.is_null)
    lst[j] = ad.pool.null_block
    return f"request {r!r} index {j}:"


@pytest.mark.parametrize("kind", ["headroom", "held", "list"])
@pytest.mark.parametrize("full_every", [1, 3, 5])
def test_the_full_scan_reports_an_untouched_corruption_within_full_every_hooks(kind, full_every):
    """The checks' contract (``checks.RuntimeChecks``): a violation the incremental view was not
    pointed at is caught by the full scan within ``full_every`` hooks at the latest (every hook
    with ``paranoid``, here ``full_every=1``); counted in hooks, with nothing else happening."""
    from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

    run = make_run(n=4)  # landed plans' fills are held for their requests; a headroom of 2

    def ready(run):
        return run.ad.lifecycle.headroom and any(run.ad.lifecycle.held.values()) and not run.ad.plans

    assert drive(run, stop=False, until=ready, steps=80)
    chk = run.ad.checker
    chk.full_every = full_every
    chk.hooks = 0  # the next full scan is hook ``full_every`` from here
    hook(run, "clean")  # (a full scan when full_every is 1)
    key = stray_ref(run, kind)
    for n in range(1, full_every + 1):
        try:
            hook(run, f"hook {n} after")
        except AdapterAssumptionError as e:
            assert key in str(e), str(e)
            assert n <= full_every
            return
    pytest.fail(f"{kind}: corruption not reported within {full_every} hooks (full scans so far {chk.full_scans})")


@pytest.mark.parametrize("full", [False, True], ids=["incremental", "full-scan"])
def test_a_table_reading_a_block_the_scheduler_side_let_go_is_reported_at_the_hook(full):
    """A block held for a request (a landed fill) leaves the adapter's ledger while the token
    table still reads it, and the request is touched (as the adapter's own event would): the
    very next hook reports ``table_in_step`` naming it, incremental (no full scan due) and full
    scan alike."""
    from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

    run = make_run(n=4)

    def ready(run):
        t, held = run.ad.table, run.ad.lifecycle.held
        return any(r in t and set(v) & set(t.block_array(r).tolist()) and r not in run.ad.busy for r, v in held.items())

    assert drive(run, stop=False, until=ready, steps=80)
    ad, chk = run.ad, run.ad.checker
    r, b = next((r, b) for r, v in ad.lifecycle.held.items() if r in ad.table and r not in ad.busy
                for b in v if b in set(ad.table.block_array(r).tolist()))
    chk.full_every, chk.hooks, chk.paranoid = 1 << 20, 0, full
    hook(run, "clean")
    ad.lifecycle.held.take(r, [b])  # the ledger lets go of it; the table still maps tokens there
    chk.touch([r])
    with pytest.raises(AdapterAssumptionError, match=rf"request {r!r}: the token table references blocks \[{b}\]") as e:
        hook(run)
    assert e.value.check == "table_in_step"
    assert chk.full_scans == (1 if full else 0)  # incremental: found with no full scan due (one confirms it)


# ---------------------------------------------------------------------------- planted
def test_an_orphans_fill_freed_while_its_copy_flies_is_refused_at_the_next_hook():
    """``adapter_orphan_fills_freed_at_finish``: a request stops while its plan flies (copies 3
    polls late) and the plan's fills go back with the request's blocks: the next hook refuses
    the fill (the adapter holds it for the plan, the pool or a deferred free holds it too)."""
    from vtoken.vllm_adapter.assumptions import AdapterAssumptionError

    from vtoken.fuzz.planted import planted

    scenario(lag=3)  # the shipped code: clean
    with planted("adapter_orphan_fills_freed_at_finish"):
        run = make_run(lag=3)
        lc, chk, left = run.ad.lifecycle, run.ad.checker, []
        lc_finish = lc.finish

        def finish_spy(r, fence=0):  # the hook count when a request with a plan in flight left
            if lc.busy.get(r):
                left.append(chk.hooks)
            return lc_finish(r, fence)

        lc.finish = finish_spy
        with pytest.raises(AdapterAssumptionError, match=r"block \d+ \(fill of in-flight plan \d+") as e:
            drive(run)
            finish(run)
    assert e.value.check == "ownership"
    # on the hook right after the request left (the fill waits in the adapter's deferred free,
    # not yet in the pool): not at the later hook where the pool gets it
    assert left and chk.hooks - left[0] <= 1, (left, chk.hooks)
