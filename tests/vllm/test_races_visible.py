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
