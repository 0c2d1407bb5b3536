"""The simulator's public objects check every argument at construction: a bad one raises
ConfigError (``bad_type`` / ``out_of_range``) naming ``Owner.field`` and the value, before
anything is built or run."""

from __future__ import annotations

import math

import numpy as np
import pytest

import vtoken.sim as sim
import vtoken.sim.frontier as frontier
import vtoken.sim.replay as replay_mod
import vtoken.sim.report as report
import vtoken.sim.robustness as robustness
import vtoken.sim.scaling as scaling
import vtoken.sim.workloads as workloads
from vtoken.errors import ConfigError
from vtoken.planner import PlannerConfig
from vtoken.sim.attention import AttentionModel
from vtoken.sim.replay import Replay
from vtoken.sim.schedule import Schedule, cached_schedule, fixed_budget, make_schedule, ratio_budget
from vtoken.sim.traces import Request, make_trace


def _sched(**over):
    """A valid schedule: prompt 8, output 3, token 1 evicted at step 0 and token 9 at step 2."""
    kw = dict(prompt=8, output=3, victims=np.array([1, 9], dtype=np.int64),
              offsets=np.array([0, 1, 1, 2, 2], dtype=np.int64))
    kw.update(over)
    return Schedule(**kw)


def _replay(**over):
    kw = dict(schedules=[_sched()], mode="vtoken", block_size=4, num_blocks=16)
    kw.update(over)
    return Replay(**kw)


def _i64(*xs):
    return np.array(xs, dtype=np.int64)


# (what, build, code, the field the message names)
ROWS = [
    # Replay
    ("sample_every -1", lambda: _replay(sample_every=-1), "out_of_range", "Replay.sample_every"),
    ("flush_every -1", lambda: _replay(flush_every=-1), "out_of_range", "Replay.flush_every"),
    ("sample_every 1.5", lambda: _replay(sample_every=1.5), "bad_type", "Replay.sample_every"),
    ("timeline_every 0", lambda: _replay(timeline_every=0), "out_of_range", "Replay.timeline_every"),  # was clamped to 1
    ("latency -1", lambda: _replay(latency=-1), "out_of_range", "Replay.latency"),
    ("max_batch 0", lambda: _replay(max_batch=0), "out_of_range", "Replay.max_batch"),  # was "every request"
    ("mode nope", lambda: _replay(mode="nope"), "out_of_range", "Replay.mode"),
    ("block_size 0", lambda: _replay(block_size=0), "out_of_range", "Replay.block_size"),
    ("block_size True", lambda: _replay(block_size=True), "bad_type", "Replay.block_size"),
    ("block_size 4.0", lambda: _replay(block_size=4.0), "bad_type", "Replay.block_size"),
    ("num_blocks 1", lambda: _replay(num_blocks=1), "out_of_range", "Replay.num_blocks"),
    ("num_blocks over the slots", lambda: _replay(block_size=4096, num_blocks=2 ** 19), "out_of_range",
     "Replay.num_blocks"),
    ("planner dict", lambda: _replay(planner={"theta_f": 0.1}), "bad_type", "Replay.planner"),
    ("schedules empty", lambda: _replay(schedules=[]), "out_of_range", "Replay.schedules"),
    ("schedules of objects", lambda: _replay(schedules=[object()]), "bad_type", "Replay.schedules"),
    ("schedules a Schedule", lambda: _replay(schedules=_sched()), "bad_type", "Replay.schedules"),
    ("stop_on_preempt 'yes'", lambda: _replay(stop_on_preempt="yes"), "bad_type", "Replay.stop_on_preempt"),
    ("force_sync 1", lambda: _replay(force_sync=1), "bad_type", "Replay.force_sync"),
    ("defer_inflight_victims None", lambda: _replay(defer_inflight_victims=None), "bad_type",
     "Replay.defer_inflight_victims"),
    # Schedule
    ("prompt 0", lambda: _sched(prompt=0), "out_of_range", "Schedule.prompt"),
    ("output -1", lambda: _sched(output=-1), "out_of_range", "Schedule.output"),
    ("victims a list", lambda: _sched(victims=[1, 9]), "bad_type", "Schedule.victims"),
    ("victims floats", lambda: _sched(victims=np.array([1.0, 9.0])), "bad_type", "Schedule.victims"),
    ("offsets too short", lambda: _sched(offsets=_i64(0, 1, 2)), "out_of_range", "Schedule.offsets"),
    ("offsets not from 0", lambda: _sched(offsets=_i64(1, 1, 1, 2, 2)), "out_of_range", "Schedule.offsets"),
    ("offsets falling", lambda: _sched(offsets=_i64(0, 2, 1, 2, 2)), "out_of_range", "Schedule.offsets"),
    ("offsets past the victims", lambda: _sched(offsets=_i64(0, 1, 1, 2, 3)), "out_of_range", "Schedule.offsets"),
    ("victim not yet a token", lambda: _sched(victims=_i64(8, 9)), "out_of_range", "Schedule.victims[0]"),
    ("victim negative", lambda: _sched(victims=_i64(1, -1)), "out_of_range", "Schedule.victims[1]"),
    ("victim twice", lambda: _sched(victims=_i64(1, 1)), "out_of_range", "Schedule.victims"),
    ("policy None", lambda: _sched(policy=None), "bad_type", "Schedule.policy"),
    # AttentionModel
    ("rho 1", lambda: AttentionModel(rho=1.0), "out_of_range", "AttentionModel.rho"),
    ("tau 0", lambda: AttentionModel(tau=0.0), "out_of_range", "AttentionModel.tau"),
    ("sigma nan", lambda: AttentionModel(sigma=math.nan), "out_of_range", "AttentionModel.sigma"),
    ("noise -0.1", lambda: AttentionModel(noise=-0.1), "out_of_range", "AttentionModel.noise"),
    ("sink_boost 0", lambda: AttentionModel(sink_boost=0.0), "out_of_range", "AttentionModel.sink_boost"),
    ("n_sink -1", lambda: AttentionModel(n_sink=-1), "out_of_range", "AttentionModel.n_sink"),
    ("alpha '1'", lambda: AttentionModel(alpha="1"), "bad_type", "AttentionModel.alpha"),
    # Request and make_trace
    ("Request id -1", lambda: Request(-1, 10, 5), "out_of_range", "Request.id"),
    ("Request prompt 0", lambda: Request(0, 0, 5), "out_of_range", "Request.prompt"),
    ("Request output 1.5", lambda: Request(0, 10, 1.5), "bad_type", "Request.output"),
    ("make_trace nope", lambda: make_trace("nope", 4, 0), "out_of_range", "make_trace.workload"),
    ("make_trace n 0", lambda: make_trace("sharegpt", 0, 0), "out_of_range", "make_trace.n"),
    ("make_trace seed -1", lambda: make_trace("sharegpt", 4, -1), "out_of_range", "make_trace.seed"),
    ("make_trace scale 0", lambda: make_trace("sharegpt", 4, 0, scale=0.0), "out_of_range", "make_trace.scale"),
    # budgets and schedules
    ("ratio_budget keep 1.5", lambda: ratio_budget(1.5), "out_of_range", "ratio_budget.keep"),
    ("ratio_budget min_keep -1", lambda: ratio_budget(0.5, -1), "out_of_range", "ratio_budget.min_keep"),
    ("fixed_budget -1", lambda: fixed_budget(-1), "out_of_range", "fixed_budget.b"),
    ("make_schedule policy", lambda: make_schedule(64, 8, "nope", fixed_budget(32), 0, 0), "out_of_range",
     "make_schedule.policy"),
    ("make_schedule window 0", lambda: make_schedule(64, 8, "h2o", fixed_budget(32), 0, 0, window=0),
     "out_of_range", "make_schedule.window"),
    ("make_schedule prompt 0", lambda: make_schedule(0, 8, "h2o", fixed_budget(32), 0, 0), "out_of_range",
     "make_schedule.prompt"),
    ("make_schedule budget 5", lambda: make_schedule(64, 8, "h2o", 5, 0, 0), "bad_type", "make_schedule.budget"),
    ("make_schedule seed -1", lambda: make_schedule(64, 8, "h2o", fixed_budget(32), -1, 0), "out_of_range",
     "make_schedule.seed"),
    ("make_schedule recent -1", lambda: make_schedule(64, 8, "h2o", fixed_budget(32), 0, 0, recent=-1),
     "out_of_range", "make_schedule.recent"),
    ("make_schedule model", lambda: make_schedule(64, 8, "h2o", fixed_budget(32), 0, 0, model={}), "bad_type",
     "make_schedule.model"),
    ("cached_schedule window 0", lambda: cached_schedule(64, 8, "h2o", fixed_budget(32), 0, 0, window=0),
     "out_of_range", "cached_schedule.window"),
    # the experiments (seeds 0 was "the default number of seeds")
    ("run_waste seeds 0", lambda: sim.run_waste(quick=True, seeds=0), "out_of_range", "run_waste.seeds"),
    ("run_retained jobs 0", lambda: sim.run_retained(quick=True, jobs=0), "out_of_range", "run_retained.jobs"),
    ("run_sweeps quick 1", lambda: sim.run_sweeps(quick=1), "bad_type", "run_sweeps.quick"),
    ("run_frontier seeds 0", lambda: sim.run_frontier(quick=True, seeds=0), "out_of_range", "run_frontier.seeds"),
    ("run_scaling seeds -1", lambda: sim.run_scaling(quick=True, seeds=-1), "out_of_range", "run_scaling.seeds"),
    ("run_robustness jobs 0", lambda: sim.run_robustness(quick=True, jobs=0), "out_of_range",
     "run_robustness.jobs"),
    ("run_all seeds 0", lambda: sim.run_all(quick=True, seeds=0), "out_of_range", "run_all.seeds"),
]


def _built(*a, **k):
    raise AssertionError("a bad argument got past the checks: something was built or run")


@pytest.mark.parametrize("what,build,code,field", ROWS, ids=[r[0] for r in ROWS])
def test_bad_sim_argument_refused_at_construction(what, build, code, field, monkeypatch, tmp_path):
    monkeypatch.setenv("VTOKEN_SIM_CACHE", str(tmp_path / "cache"))
    for mod, name in ((replay_mod, "TokenTable"), (replay_mod, "BlockAllocator"), (workloads, "_setting"),
                      (frontier, "setting"), (robustness, "setting"), (scaling, "_setting"), (report, "out_dir")):
        monkeypatch.setattr(mod, name, _built)
    with pytest.raises(ConfigError) as e:
        build()
    assert e.value.code == code, str(e.value)
    assert f"] {field} must be " in str(e.value), str(e.value)
    assert not (tmp_path / "cache").exists()


def test_valid_arguments_build():
    """The boundaries the checks keep: 0 turns sampling and flushing off, a schedule may evict
    the token of its own step, an empty victim list is a schedule."""
    rp = _replay(sample_every=0, flush_every=0, latency=0, max_batch=1, planner=PlannerConfig())
    assert rp.run()["feasible"]
    s = _sched(victims=_i64(7, 10), offsets=_i64(0, 1, 1, 1, 2))  # token 10 exists at step 3
    assert Replay([s, _sched(victims=_i64(), offsets=_i64(0, 0, 0, 0, 0))], "naive-evict", 4, 16).run()["feasible"]
    assert AttentionModel(rho=0.0, noise=0.0).describe()["rho"] == 0.0
    assert ratio_budget(1.0, 0)(10) == 10 and fixed_budget(0)(5) == 0
    assert [r.total for r in make_trace("longbench", 2, 0, scale=0.01)]
