"""``vtoken fuzz --ray``: the campaign's workers and the planted-fault runs as Ray tasks, on a
local Ray cluster this module starts (``ray.init`` with 2 CPUs), torn down at the end.

Ray is a test dependency (``pip install 'vtoken[test]'`` brings it): a missing Ray fails
these tests, it never skips them.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vtoken.fuzz import campaign
from vtoken.fuzz.campaign import run_campaign
from vtoken.fuzz.cluster import RayUnavailable, ray_cluster


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_a_campaign_on_ray_runs_its_workers_as_tasks_and_sums_them(ray_local, tmp_path):
    s = run_campaign(workers=2, seed=1, out=tmp_path / "out", machines=["table", "planner"], batch=5,
                     progress=False, examples=5, ray="auto")
    assert s["ray"]["nodes"] == 1 and s["ray"]["cpus"] == 2 and s["workers"] == 2
    assert s["failures"] == 0 and s["worker_errors"] == [] and s["db_error"] is None
    assert set(s["ops_by_machine"]) == {"table", "planner"} and s["ops"] > 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["ops"] == s["ops"]


def test_a_failure_found_on_a_ray_worker_is_written_here_with_its_replay(ray_local, tmp_path):
    """A user's table with a bug the machine finds on its first eviction
    (``tests.alt_table:ForgetfulAltTable``: what this checks is the failure's way back, not how
    hard it is to find): the worker sends the failure's files, the campaign writes them under
    ``--out``. The table's module is importable only through the path this test adds: the
    campaign hands its path to the tasks."""
    root = str(campaign.Path(__file__).parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    s = run_campaign(workers=1, seed=0, out=tmp_path / "out", machines=["impl:tests.alt_table:ForgetfulAltTable"],
                     batch=20, progress=False, examples=20, profile="ci", ray="auto")
    assert s["worker_errors"] == [] and s["machines_unavailable"] == {}, (s["worker_errors"], s["machines_unavailable"])
    assert s["failures"] == 1 and s["ops"] > 0, {k: s[k] for k in ("failures", "ops", "failure_reports")}
    rep = s["failure_reports"][0]
    assert rep["machine"].startswith("impl:") and (campaign.Path(rep["files"] + ".txt")).exists()
    replays = list((tmp_path / "out" / "failures").glob("test_replay_*.py"))
    assert replays and "run_state_machine_as_test" in replays[0].read_text()


def test_a_planted_fault_is_found_through_ray(ray_local):
    from vtoken.fuzz.planted import run_all

    s = run_all(["alloc_double_free"], runs=1, budget_s=60, progress=False, ray=ray_local)
    r = s["results"][0]
    assert s["planted"] == 1 and r["fault"] == "alloc_double_free" and r["detections"] == 1, r


def test_without_ray_the_command_refuses_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(RayUnavailable, match=r"pip install 'vtoken\[ray\]'"):
        ray_cluster("auto")


def test_no_cluster_at_the_address_is_refused_before_any_work(tmp_path):
    p = subprocess.run([sys.executable, "-m", "vtoken", "fuzz", "--ray", "127.0.0.1:1", "--minutes", "0.01",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "argument --ray: no Ray cluster at '127.0.0.1:1'" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out" / "summary.json").exists()


def test_a_ray_worker_that_dies_fails_the_campaign(ray_local, tmp_path, monkeypatch, capsys):
    """Issue 40 #3: with ``--ray`` a task whose process died (a table raising SIGSEGV, as an
    out-of-memory kill would) was listed in ``worker_errors`` and the command still exited 0.
    Now: ``worker_died`` per task (Ray's error named), ``zero_ops``, exit 3."""
    from vtoken.fuzz.campaign import main_fuzz

    root = str(campaign.Path(__file__).parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    monkeypatch.setenv("VTOKEN_DEVICE", "cpu")
    spec = "tests.crashing_impls:SegfaultingAltTable"
    rc = main_fuzz(["--impl", spec, "--ray", "auto", "--workers", "1", "--minutes", "0.5", "--json",
                    "--out", str(tmp_path / "out")])
    std = capsys.readouterr()
    d = json.loads(std.out.strip().splitlines()[-1])
    assert rc == 3, (rc, d)
    died = [e for e in d["run_errors"] if e["reason"] == "worker_died"]
    assert len(died) == 1 and died[0]["machine"] == f"impl:{spec}" and "WorkerCrashedError" in died[0]["detail"], d
    assert any(e["reason"] == "zero_ops" for e in d["run_errors"]) and d["green"] is False
    assert "NOT GREEN: worker_died, zero_ops" in std.err
