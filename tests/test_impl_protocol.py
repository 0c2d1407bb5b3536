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
def test_the_optional_part_exports_are_used_and_checked():
    """A table with ``export_request`` / ``export_blocks`` is checked through them after each
    step; one whose part export lies about a block is caught even though its full export
    is right."""
    from tests.alt_table import AltTable

    calls = []

    class Parts(AltTable):
        def export_request(self, req):
            calls.append(req)
            reqs = self.export_state()["requests"]
            if req not in reqs:
                raise KeyError(req)
            return reqs[req]

        def export_blocks(self):
            return self.export_state()["blocks"]

    class LyingParts(Parts):
        def export_blocks(self):
            return {b: {**v, "refs": v["refs"] + 1} for b, v in self.export_state()["blocks"].items()}

    Parts.ERROR_CODES = LyingParts.ERROR_CODES = {**getattr(AltTable, "ERROR_CODES", {}), "KeyError": "unknown_request"}
    run_state_machine_as_test(table_machine_for(Parts), settings=settings(settings(), max_examples=20))
    assert calls, "the machine never used export_request"
    with pytest.raises(AssertionError, match="blocks differ"):
        run_state_machine_as_test(table_machine_for(LyingParts), settings=settings(settings(), max_examples=20,
                                                                                  phases=_FIND))


@pytest.mark.invariants
def test_the_part_exports_are_not_logged_as_operations():
    """A failure names the last operation (``Conforming.ops``), never the export that found it."""
    from tests.alt_table import AltTable
    from vtoken.fuzz.protocol import Conforming

    class Parts(AltTable):
        def export_request(self, req):
            return self.export_state()["requests"][req]

        def export_blocks(self):
            return self.export_state()["blocks"]

    t = Conforming(Parts(2, 4))
    t.sync_new_tokens("a", [1], 2)
    assert t.export_request("a")["length"] == 2 and set(t.export_blocks()) == {1}
    assert len(t.ops) == 1 and t.ops[-1].startswith("sync_new_tokens")


@pytest.mark.invariants
def test_leaky_alt_table_is_caught():
    from tests.alt_table import LeakyAltTable

    with pytest.raises(AssertionError, match="state differs|blocks differ|state of request .* differs"):
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
@pytest.mark.parametrize("cls,rule", [("BlindAltPlanner", r"source_(in_flight|excluded)"),
                                      ("InFlightBlindAltPlanner", "source_in_flight"),
                                      ("ExcludedBlindAltPlanner", "source_excluded")])
def test_a_planner_blind_to_what_the_caller_forbids_is_caught(cls, rule):
    """Issue 40 #6: the planner machine always gave an empty ``in_flight`` and no ``excluded``,
    so a planner ignoring both passed. Now the views carry plans in flight and excluded blocks."""
    import tests.alt_planner as alt

    with pytest.raises(AssertionError, match=rule):
        run_state_machine_as_test(planner_machine_for(getattr(alt, cls)),
                                  settings=settings(settings(), max_examples=200, phases=_FIND))


@pytest.mark.invariants
@pytest.mark.parametrize("cls", ["tests.alt_planner:AltPlanner", "tests.test_spec_fills:InPlacePlanner"])
def test_a_users_planner_is_driven_through_every_hard_state(cls):
    """Every hard state of a planner (the planner machine's and those of the views a caller
    passes: in-flight and excluded blocks, dead tokens, evictions under a copy) is reached for
    a user's planner, out of place and in place, and the class conforms."""
    from collections import Counter

    from vtoken.fuzz import hard_states

    before = Counter(hard_states.COUNTS)
    run_state_machine_as_test(planner_machine_for(load_impl(cls)), settings=settings(settings(), max_examples=400))
    got = Counter(hard_states.COUNTS)
    got.subtract(before)
    counts = {h: got[h] for h in hard_states.BY_KIND["planner"]}
    assert all(counts.values()), counts


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


def test_plugin_and_campaign_catch_a_planner_blind_to_in_flight_and_excluded(tmp_path):
    """Issue 40 #6 end to end: ``pytest -m invariants --vtoken-impl`` and ``vtoken fuzz --impl``
    fail on ``BlindAltPlanner`` naming the rule; the conforming ``AltPlanner``'s run reports
    every planner hard state reached."""
    bad = _pytest("tests.alt_planner:BlindAltPlanner", tmp_path)
    assert bad.returncode == 1, f"exit {bad.returncode}:\n{bad.stdout[-3000:]}"
    assert "BlindAltPlanner does not conform (planner machine)" in bad.stdout
    assert "source_in_flight" in bad.stdout or "source_excluded" in bad.stdout, bad.stdout[-3000:]
    (tmp_path / "ok").mkdir()
    ok = _pytest("tests.alt_planner:AltPlanner", tmp_path / "ok")
    assert ok.returncode == 0, ok.stdout[-3000:]
    line = next(l for l in ok.stdout.splitlines() if "AltPlanner]::planner-machine: hard states:" in l)
    assert " 0," not in line + "," and "in-flight block a plan could take" in line, line
    r = subprocess.run([sys.executable, "-m", "vtoken", "fuzz", "--impl", "tests.alt_planner:BlindAltPlanner",
                        "--minutes", "0.25", "--json", "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 1 and d["failures"] == 1, (r.returncode, d)
    assert "source_in_flight" in r.stdout or "source_excluded" in r.stdout, r.stdout[-2000:]


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


# ---------------------------------------------------------------------------- inputs that are not a usable class
_BAD_MODULES = {
    "vt_raises_at_import": 'raise RuntimeError("boom at import")\n',
    "vt_bad_impls": """from tests.alt_table import AltTable

INSTANCE = AltTable(2, 8)


class RaisesInInit(AltTable):
    def __init__(self, block_size, num_blocks):
        raise RuntimeError("boom in __init__")
""",
}


@pytest.fixture
def bad_modules(tmp_path, monkeypatch):
    mods = tmp_path / "mods"
    mods.mkdir()
    for name, text in _BAD_MODULES.items():
        (mods / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(mods))
    return mods


@pytest.mark.parametrize("spec,line", [
    ("vt_raises_at_import:T", "--impl 'vt_raises_at_import:T': importing 'vt_raises_at_import' raised RuntimeError: "
                              "boom at import"),
    ("vt_bad_impls:INSTANCE", "--impl 'vt_bad_impls:INSTANCE': 'INSTANCE' is an object of type AltTable, not a class"),
    ("vt_bad_impls:RaisesInInit", "--impl 'vt_bad_impls:RaisesInInit': RaisesInInit(2, 8) raised RuntimeError: "
                                  "boom in __init__ (the table machine builds one per example)"),
])
def test_check_impl_refuses_in_one_line(spec, line, bad_modules):
    from vtoken.fuzz.protocol import check_impl

    with pytest.raises(ProtocolError) as e:
        check_impl(spec)
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)
    assert e.value.__cause__ is None and (e.value.__context__ is None or e.value.__suppress_context__)  # nothing chained


def test_machines_refuse_an_instance():
    from tests.alt_table import AltTable

    with pytest.raises(ProtocolError, match="not a class"):
        table_machine_for(AltTable(2, 8))
    assert check_impl_kind("tests.alt_table:AltTable") == "table"


def check_impl_kind(spec):
    from vtoken.fuzz.protocol import check_impl

    return check_impl(spec)[1]


@pytest.mark.parametrize("spec,words", [
    ("vt_raises_at_import:T", "importing 'vt_raises_at_import' raised RuntimeError: boom at import"),
    ("vt_bad_impls:INSTANCE", "'INSTANCE' is an object of type AltTable, not a class"),
    ("vt_bad_impls:RaisesInInit", "RaisesInInit(2, 8) raised RuntimeError: boom in __init__"),
])
def test_plugin_refuses_a_bad_impl_as_a_usage_error(spec, words, bad_modules, tmp_path):
    """A module raising at import, an instance, a class raising in __init__: one usage line
    (exit 4), no INTERNALERROR, no traceback, no test run, no replay written."""
    root = tmp_path / "root"
    root.mkdir()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "invariants",
                        "--vtoken-impl", spec, "-k", "vtoken-impl", f"--rootdir={root}", "-c", os.devnull, str(root)],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=os.pathsep.join([str(bad_modules), str(REPO)])))
    out = r.stdout + r.stderr
    assert r.returncode == 4, f"exit {r.returncode}:\n{out[-3000:]}"
    assert "INTERNALERROR" not in out and "Traceback" not in out, out[-3000:]
    errors = [l for l in out.splitlines() if l.startswith("ERROR: ")]
    assert errors == [f"ERROR: --vtoken-impl {spec!r}: " + errors[0].split(f"{spec!r}: ", 1)[-1]], out[-2000:]
    assert words in errors[0], errors
    assert not (root / ".vtoken").exists(), sorted(map(str, root.rglob("*")))


@pytest.mark.parametrize("n", ["0", "-1", "x"])
def test_plugin_refuses_a_bad_example_count(n, tmp_path):
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "invariants",
                        "--vtoken-impl", "tests.alt_table:AltTable", f"--vtoken-examples={n}", "-k", "vtoken-impl",
                        f"--rootdir={tmp_path}", "-c", os.devnull, str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONHASHSEED="0"))
    out = r.stdout + r.stderr
    assert r.returncode == 4, f"exit {r.returncode}:\n{out[-3000:]}"
    assert "error: argument --vtoken-examples: " in out and "Traceback" not in out, out[-2000:]
    assert not (tmp_path / ".vtoken").exists()


def test_fuzz_cli_refuses_a_class_raising_in_init_before_the_campaign(bad_modules, tmp_path):
    """Not a conformance failure with a replay test: an error of the input, nothing written."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "vtoken", "fuzz", "--impl", "vt_bad_impls:RaisesInInit", "--minutes",
                        "0.1", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(bad_modules), str(REPO)])))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "vtoken fuzz: error: argument --impl: 'vt_bad_impls:RaisesInInit': RaisesInInit(2, 8) raised RuntimeError: "
        "boom in __init__ (the table machine builds one per example)")
    assert not out.exists()
