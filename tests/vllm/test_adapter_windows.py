"""Issue 40, item 8: the adapter machine's checks for the windows no test drove, each run on
one directed scenario (the real vLLM scheduler, async scheduling, seeded prompts), with the
shipped code (no alarm) and with the catalogue fault it must catch.

- the fence from the worker's side (``_Run._check_reads``): a request stops (an EOS) at the
  step whose output reports its plan, while the next step, already scheduled, still computes
  it: an orphan's blocks freed at the plan's fence (``adapter_orphan_frees_at_plan_fence``)
  are read by that step after the adapter returned them;
- the runtime checks probed at every hook (``_Run._probes``): a hook whose incremental check
  misses what the adapter changed at it (a touch dropped, new headroom blocks unrecorded) is
  reported at the hook, not at a later full scan.
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


def scenario(fault: str | None = None, *, stop: bool = True, in_place: bool = True) -> dict:
    """Three requests decoded through one instrumented run (``adapter_machine._Run``: async
    scheduling, copies landing on the step that launched them, checks on); with ``stop``, the
    first request whose plan rides on the step in flight stops at that step's token."""
    from vtoken.fuzz import adapter_machine as am
    from vtoken.fuzz.planted import planted

    with planted(fault) if fault else contextlib.nullcontext():
        run = am._Run(reclaim=True, S=4, N=40, H=2, B=4, async_=True, caching=True, lag=0, ratio=0.5, budget=2048,
                      checks=True, in_place=in_place, layout="full")
        rng = np.random.default_rng(0)
        for i in range(3):
            run.add(f"r{i}", rng.integers(1, 63, size=12).tolist(), 20)
        stopped = None
        for _ in range(80):
            run.step()
            nxt = run.d.in_flight[0] if run.d.in_flight else None
            flying = [p for p in run.ad.plans.values() if not p.orphaned and nxt is not None
                      and p.req_id in nxt.num_scheduled_tokens and p.seq == nxt.vtoken.seq]
            if stop and stopped is None and flying and run.stop_next(flying[0].req_id):
                stopped = flying[0].req_id
            if not run.ad.has_work():
                break
        run.drain()
        run.check_ledger()
        run.ad.close()
    return {"stopped": stopped, "stats": dict(run.ad.stats), "probes": run.probes, "reads": run.reads_checked}


def test_the_shipped_adapter_passes_the_stop_window():
    res = scenario()
    assert res["stopped"] is not None and res["stats"]["orphaned"] >= 1 and res["stats"]["applied"] >= 1
    assert res["probes"] > 0
    assert res["reads"] > 0  # the worker's reads were checked (a spy on a call the step no longer makes sees none)


def test_an_orphans_blocks_freed_at_the_plans_fence_are_read_by_the_next_step():
    with pytest.raises(AssertionError, match=r"reads blocks \[\d+.*which the scheduler side no longer holds"):
        scenario("adapter_orphan_frees_at_plan_fence")


@pytest.mark.parametrize("fault, in_place", [("adapter_absorb_untouched", True), ("adapter_launch_untouched", True),
                                             ("adapter_release_untouched", True),
                                             ("headroom_fresh_unrecorded", False)])
def test_a_runtime_check_one_hook_late_is_caught_at_the_hook(fault, in_place):
    scenario(stop=False, in_place=in_place)  # the shipped code: every probe seen at its hook
    with pytest.raises(AssertionError, match="the hook's incremental check did not see it"):
        scenario(fault, stop=False, in_place=in_place)
