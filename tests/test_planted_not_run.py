"""The planted-fault runner never counts a run that crashed or checked nothing as a detection
or a clean miss (issue 40 #3): it is named (``worker_died``, ``zero_ops``) and fails the summary."""

from __future__ import annotations

import subprocess
import sys
import types

from vtoken.fuzz import planted


def test_a_detection_run_that_dies_is_named_never_a_miss(monkeypatch, capsys, tmp_path):
    """The fault's child process killed by SIGSEGV (as an out-of-memory kill would): before,
    a row read as "MISSED" (rate 0); now ``worker_died`` with the signal, and exit 1."""
    real = subprocess.Popen

    def crashing(cmd, **kw):
        return real([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"], **kw)

    monkeypatch.setattr(planted.subprocess, "Popen", crashing)
    args = types.SimpleNamespace(planted="alloc_double_free", runs=2, budget=5.0, ray=None, workers=1,
                                 out=str(tmp_path / "out"), json=True)
    assert planted.main_planted(args) == 1
    std = capsys.readouterr()
    assert "CRASHED  alloc_double_free" in std.out and "MISSED" not in std.out
    assert "vtoken fuzz: worker_died (alloc_double_free): the detection run killed by signal 11 (SIGSEGV)" in std.err
    s = planted.json.loads((tmp_path / "out" / "planted.json").read_text())
    r = s["results"][0]
    assert r["run_error"]["reason"] == "worker_died" and r["detections"] == 0 and r["runs"] == []
    assert [e["reason"] for e in s["run_errors"]] == ["worker_died"]


def test_an_undetected_run_that_checked_nothing_is_zero_ops():
    r = planted._detect_machine("tests.crashing_impls:IdleMachine", 0, budget_s=0.5, shrink=False)
    assert r["detected"] is False and r["ops"] == 0 and r["run_error"] == "zero_ops", r
    row = planted._summarize({"fault": "x", "detector": "table", "runs": [{"seed": 0, **r}]})
    assert row["run_errors"] == [{"reason": "zero_ops", "detail": "seed 0: no checked operation ran"}]


def test_a_run_that_did_checked_work_is_clean():
    from vtoken.fuzz.table_machine import TableMachine  # noqa: F401 (the machine the path names)

    r = planted._detect_machine("vtoken.fuzz.table_machine:TableMachine", 0, budget_s=0.5, shrink=False)
    assert r["detected"] is False and r["ops"] > 0 and "run_error" not in r, r
