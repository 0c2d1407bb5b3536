"""The toolkit checks code vtoken did not write: the protocol, the bound machines, the pytest
plugin (``--vtoken-impl``) and ``vtoken fuzz --impl``, on the independent implementations in
``tests/alt_table.py`` and ``tests/alt_planner.py`` and their planted-bug variants."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from vtoken.fuzz.protocol import ProtocolError, kind_of, load_impl, planner_machine_for, table_machine_for

REPO = Path(__file__).resolve().parent.parent
# The conformance of the alternative implementations is an invariants test; the plugin and
# CLI end-to-end runs (subprocesses re-running the machines) are toolkit tests of the
# default run only, keeping `pytest -m invariants` inside its 5 minutes.


@pytest.mark.invariants
def test_kinds_and_clear_errors():
    assert kind_of(load_impl("tests.alt_table:AltTable")) == "table"
    assert kind_of(load_impl("vtoken.table:TokenTable")) == "table"
    assert kind_of(load_impl("tests.alt_planner:AltPlanner")) == "planner"
    for bad, words in (("tests.alt_table", "module:Class"), ("tests.nope:X", "cannot import"),
                       ("tests.alt_table:Nope", "no attribute"), ("vtoken.errors:TableError", "neither protocol")):
        with pytest.raises(ProtocolError, match=words):
            kind_of(load_impl(bad))


_FIND = (Phase.explicit, Phase.reuse, Phase.generate)  # caught is the verdict: no shrinking


@pytest.mark.invariants
def test_alt_table_conforms():
    from tests.alt_table import AltTable

    run_state_machine_as_test(table_machine_for(AltTable), settings=settings(settings(), max_examples=60))


@pytest.mark.invariants
def test_leaky_alt_table_is_caught():
    from tests.alt_table import LeakyAltTable

    with pytest.raises(AssertionError, match="state differs"):
        run_state_machine_as_test(table_machine_for(LeakyAltTable), settings=settings(settings(), max_examples=200,
                                                                                     phases=_FIND))


@pytest.mark.invariants
def test_alt_planner_conforms_and_tail_moving_variant_is_caught():
    from tests.alt_planner import AltPlanner, TailMovingAltPlanner

    run_state_machine_as_test(planner_machine_for(AltPlanner), settings=settings(settings(), max_examples=60))
    with pytest.raises(AssertionError, match="source_tail"):
        run_state_machine_as_test(planner_machine_for(TailMovingAltPlanner),
                                  settings=settings(settings(), max_examples=200, phases=_FIND))


@pytest.mark.invariants
def test_error_codes_are_translated_or_the_operation_named():
    from vtoken.fuzz.protocol import Conforming
    from vtoken.errors import TableError

    class Raw:
        S, num_blocks = 2, 4
        ERROR_CODES = {"KeyError": "unknown_request"}

        def evict_tokens(self, req, ids):
            raise KeyError(req)

        def free_request(self, req):
            raise RuntimeError("no code at all")

    c = Conforming(Raw())
    with pytest.raises(TableError) as e:
        c.evict_tokens("r", [0])
    assert e.value.code == "unknown_request"
    with pytest.raises(ProtocolError, match=r"free_request: Raw raised RuntimeError.*no code"):
        c.free_request("r")


def _pytest(impl, tmp_path):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "invariants",
                           "--vtoken-impl", impl, "--vtoken-examples", "150", "-k", "vtoken-impl",
                           f"--rootdir={tmp_path}", "-c", os.devnull, str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONHASHSEED="0"))


def test_plugin_passes_alt_table_and_names_the_operation_for_the_leaky_one(tmp_path):
    ok = _pytest("tests.alt_table:AltTable", tmp_path)
    assert ok.returncode == 0 and "1 passed" in ok.stdout, ok.stdout[-2000:]
    bad = _pytest("tests.alt_table:LeakyAltTable", tmp_path)
    assert bad.returncode == 1, f"exit {bad.returncode}:\n{bad.stdout[-3000:]}\n{bad.stderr[-2000:]}"
    assert "does not conform (table machine); the last operation on tests.alt_table:LeakyAltTable: free_request" \
        in bad.stdout, bad.stdout[-3000:]
    replay = tmp_path / ".vtoken" / "replays" / "test_replay_tests_alt_table_LeakyAltTable_table.py"
    assert replay.exists() and "load_impl('tests.alt_table:LeakyAltTable')" in replay.read_text()
    again = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                            str(replay)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1, again.stdout[-2000:]  # the replay reproduces the failure


def test_fuzz_impl_cli_json(tmp_path):
    r = subprocess.run([sys.executable, "-m", "vtoken", "fuzz", "--impl", "tests.alt_table:AltTable", "--minutes",
                        "0.1", "--json", "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["failures"] == 0 and d["ops"] > 100 and d["ops_by_machine"] == {"impl:tests.alt_table:AltTable": d["ops"]}
    bad = subprocess.run([sys.executable, "-m", "vtoken", "fuzz", "--impl", "tests.alt_table:Nope", "--minutes", "0.1"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no attribute 'Nope'" in bad.stderr and "Traceback" not in bad.stderr
