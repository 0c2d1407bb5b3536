"""Every command refuses a bad argument at parse time, in argparse's one-line format, before it
does any work; a campaign or an audit stopped by Ctrl-C says what it finished and where its
partial results are, and exits 130 (issue 18)."""

from __future__ import annotations

import json
import queue
import types

import pytest

import vtoken.cli.bench as bench
import vtoken.cli.bench_adapter as bench_adapter
import vtoken.cli.decode as decode
import vtoken.cli.simulate as simulate
import vtoken.fuzz.campaign as campaign
import vtoken.fuzz.mutation as mutation
import vtoken.fuzz.planted as planted
import vtoken.invariants.mutants as mutants
import vtoken.invariants.small_scope as small_scope
import vtoken.reports.audit as audit
import vtoken.reports.vllm_own_tests as own_tests
from vtoken.cli.main import main

# Placeholders, filled per test: {file} a regular file, {notjson} a file that is not JSON,
# {list_json} JSON of the wrong kind, {out} an output folder that must not get created,
# {fake_py} / {fake_py_novllm} an executable that answers the own-tests probe as a Python with
# vLLM 0.33.0 / without vLLM. Pseudo-commands: "vtoken" the dispatcher itself, "bench-adapter",
# "own-tests" (python -m vtoken.reports.vllm_own_tests), "small-scope" (python -m
# vtoken.invariants.small_scope).
ROWS = [
    # the dispatcher
    (["vtoken", "nope"], "command"),
    (["vtoken"], "command"),
    # decode: the rows of the issue, then every numeric argument at its boundary
    (["decode", "--requests", "-3", "--json"], "--requests"),
    (["decode", "--block-size", "0"], "--block-size"),
    (["decode", "--evict-ratio", "1.5", "--requests", "1", "--new-tokens", "2", "--json"], "--evict-ratio"),
    (["decode", "--policy", "nope"], "--policy"),
    (["decode", "--mode", "nope"], "--mode"),
    (["decode", "--requests", "0"], "--requests"),
    (["decode", "--prompt-tokens", "0"], "--prompt-tokens"),
    (["decode", "--new-tokens", "0"], "--new-tokens"),
    (["decode", "--evict-ratio", "1.0"], "--evict-ratio"),
    (["decode", "--evict-ratio", "-0.01"], "--evict-ratio"),
    (["decode", "--evict-ratio", "nan"], "--evict-ratio"),
    (["decode", "--budget", "0"], "--budget"),
    (["decode", "--seed", "-1"], "--seed"),
    (["decode", "--model-seed", "-1"], "--model-seed"),
    (["decode", "--threads", "0"], "--threads"),
    (["decode", "--theta-f", "1.01"], "--theta-f"),
    (["decode", "--theta-f", "-0.01"], "--theta-f"),
    (["decode", "--check-every", "0"], "--check-every"),
    (["decode", "--headroom", "-1"], "--headroom"),
    (["decode", "--max-sources", "0"], "--max-sources"),
    (["decode", "--requests", "x"], "--requests"),
    (["decode", "--device", "tpu"], "--device"),
    (["decode", "--device", "cuda:99"], "--device"),  # no such device, with or without a GPU
    (["decode", "--compare", "nope"], "--compare"),
    (["decode", "--snapshot-dir", "{file}/snaps"], "--snapshot-dir"),
    (["decode", "--budget", "1"], "--budget"),  # the allocator needs the null block and one more
    (["decode", "--block-size", "5000"], "--block-size"),  # over the token table's 4096
    (["decode", "--budget", "300000", "--block-size", "4096"], "--budget"),  # over the table's 2^30 slots
    (["decode", "--threads", "100000"], "--threads"),  # torch crashed (SIGSEGV)
    # flags that would be silently ignored
    (["decode", "--mode", "native", "--compare", "native"], "--compare"),
    (["decode", "--mode", "native", "--check-relocations"], "--check-relocations"),
    (["decode", "--mode", "naive-evict", "--theta-f", "0.5"], "--theta-f"),
    (["decode", "--mode", "naive-evict", "--force-sync"], "--force-sync"),
    (["decode", "--snapshot-dir", "{out}"], "--snapshot-dir"),  # without --check-relocations
    (["decode", "--mode", "native", "--policy", "random"], "--policy"),
    (["decode", "--mode", "native", "--evict-ratio", "0.3"], "--evict-ratio"),
    # bench (and its adapter front end)
    (["bench", "nope"], "what"),
    (["bench", "table", "--seed", "-1"], "--seed"),
    (["bench", "table", "--profile"], "--profile"),
    (["bench", "planner", "--breakdown"], "--breakdown"),
    (["bench-adapter", "--seed", "-1"], "--seed"),
    (["bench-adapter", "--repeats", "0"], "--repeats"),
    (["bench", "table", "--repeats", "2"], "--repeats"),
    (["bench", "table", "--against", "HEAD"], "--against"),
    (["bench", "planner", "--R", "64"], "--R"),
    (["bench-adapter", "--variants", "off"], "--variants"),  # only with --against
    (["bench-adapter", "--R", "64"], "--R"),  # likewise
    (["bench-adapter", "--against", "HEAD", "--variants", "plain"], "--variants"),
    (["bench-adapter", "--against", "HEAD", "--variants", ","], "--variants"),
    (["bench-adapter", "--against", "HEAD", "--R", "0"], "--R"),
    (["bench-adapter", "--against", "HEAD", "--breakdown"], "--breakdown"),
    (["bench-adapter", "--against", "no-such-ref"], "--against"),  # refused before any run starts
    # simulate
    (["simulate", "frontier", "--seeds", "0", "--out", "{out}"], "--seeds"),
    (["simulate", "nope"], "experiment"),
    (["simulate", "waste", "--jobs", "0"], "--jobs"),
    (["simulate", "waste", "--out", "{file}"], "--out"),
    # fuzz
    (["fuzz", "--minutes", "-1", "--out", "{out}"], "--minutes"),
    (["fuzz", "--minutes", "0"], "--minutes"),
    (["fuzz", "--workers", "0"], "--workers"),
    (["fuzz", "--seed", "-1"], "--seed"),
    (["fuzz", "--device", "tpu"], "--device"),
    (["fuzz", "--db", "redis://localhost:notaport"], "--db"),
    (["fuzz", "--db", "redis://:6379"], "--db"),
    (["fuzz", "--db", "redis://localhost:6379/x"], "--db"),
    (["fuzz", "--db", "{file}"], "--db"),
    (["fuzz", "--out", "{file}/fuzz"], "--out"),
    (["fuzz", "--machines", "nope"], "--machines"),
    (["fuzz", "--machines", "--out", "{out}"], "--machines"),  # no name: not every machine by accident
    (["fuzz", "--profile", "nope"], "--profile"),
    (["fuzz", "--impl", "no_colon"], "--impl"),
    (["fuzz", "--impl", ":X"], "--impl"),
    (["fuzz", "--impl", "vtoken_cli_args_raises:T", "--out", "{out}"], "--impl"),  # the module raises at import
    (["fuzz", "--impl", "vtoken_cli_args_impls:INSTANCE", "--out", "{out}"], "--impl"),  # an object, not a class
    (["fuzz", "--impl", "vtoken_cli_args_impls:RaisesInInit", "--out", "{out}"], "--impl"),
    (["fuzz", "--impl", "vtoken_cli_args_impls:NoSize", "--out", "{out}"], "--impl"),  # builds, but has no S
    (["fuzz", "--impl", "vtoken_cli_args_impls:PlannerRaisesInInit", "--out", "{out}"], "--impl"),
    (["fuzz", "--db", "redis://127.0.0.1:{closed_port}", "--machines", "table", "--out", "{out}"], "--db"),
    (["fuzz", "--planted", "waste_drift", "--db", "{out}"], "--planted"),
    (["fuzz", "--planted", "nope"], "--planted"),
    (["fuzz", "--planted", "all", "--runs", "0"], "--runs"),
    (["fuzz", "--planted", "all", "--budget", "0"], "--budget"),
    (["fuzz", "--runs", "2"], "--runs"),
    (["fuzz", "--planted", "all", "--machines", "table"], "--planted"),
    (["fuzz", "--planted", "all", "--minutes", "5"], "--minutes"),  # the planted runs ignored these
    (["fuzz", "--planted", "all", "--profile", "ci"], "--profile"),
    (["fuzz", "--planted", "all", "--seed", "3"], "--seed"),
    (["fuzz", "--planted", "waste_drift,waste_drift"], "--planted"),
    (["fuzz", "--machines", "table", "table"], "--machines"),
    (["fuzz", "--impl", "tests.alt_table:AltTable", "--impl", "tests.alt_table:AltTable"], "--impl"),
    # audit
    (["audit", "--compare", "/nonexistent.json", "--only", "table", "--out", "{out}"], "--compare"),
    (["audit", "--compare", "{notjson}"], "--compare"),
    (["audit", "--compare", "{list_json}"], "--compare"),
    (["audit", "--compare", "{out}"], "--compare"),
    # a well-formed path to a file that is not an audit in what the comparison reads
    (["audit", "--compare", "{audit:checks_not_list}"], "--compare"),
    (["audit", "--compare", "{audit:passed_not_bool}"], "--compare"),
    (["audit", "--compare", "{audit:metrics_list}"], "--compare"),
    (["audit", "--compare", "{audit:contracts_of_ints}"], "--compare"),
    (["audit", "--compare", "{audit:contracts_dict}"], "--compare"),
    (["audit", "--compare", "{audit:contract_no_name}"], "--compare"),
    (["audit", "--compare", "{audit:divergence_list_test}"], "--compare"),
    (["audit", "--compare", "{audit:divergences_of_ints}"], "--compare"),
    (["audit", "--compare", "{audit:safe_list}"], "--compare"),
    (["audit", "--compare", "{deep_json}"], "--compare"),
    (["audit", "--compare", "{bigint_json}"], "--compare"),
    (["audit", "--only", "tabel"], "--only"),
    (["audit", "--only", "--out", "{out}"], "--only"),  # no name: not the whole audit by accident
    (["audit", "--only", ""], "--only"),
    (["audit", "--only", "check"], "--only"),  # a part of every check's name
    (["audit", "--only", "waste", "waste"], "--only"),
    (["audit", "--only", "waste,tabel"], "--only"),  # comma-separated: each name must select a check
    (["audit", "--only", "waste,"], "--only"),
    (["audit", "--only", "waste,check"], "--only"),
    (["audit", "--only", "waste,waste"], "--only"),
    (["audit", "--only", "waste", "table,waste"], "--only"),
    (["audit", "--vllm", "0.33.0", "--matrix", "0.33.0"], "--matrix"),
    (["audit", "--matrix", "0.33.0", "--compare", "{audit_ok}"], "--compare"),
    (["audit", "--rebuild-env"], "--rebuild-env"),
    (["audit", "--fuzz-examples", "0"], "--fuzz-examples"),
    (["audit", "--seed", "-1"], "--seed"),
    (["audit", "--out", "{file}"], "--out"),
    # mutate
    (["mutate", "--workers", "0", "--out", "{out}"], "--workers"),
    (["mutate", "--max-mutants", "0"], "--max-mutants"),
    (["mutate", "--seed", "-1"], "--seed"),
    (["mutate", "--timeout", "0"], "--timeout"),
    (["mutate", "--hypothesis-seed", "-1"], "--hypothesis-seed"),
    (["mutate", "--fail-under", "100.5"], "--fail-under"),
    (["mutate", "--fail-under", "-1"], "--fail-under"),
    (["mutate", "--isolation", "nope"], "--isolation"),
    (["mutate", "--files", "vtoken/nope.py"], "--files"),
    (["mutate", "--tests", "tests/test_nope.py"], "--tests"),
    (["mutate", "--rerun", "{list_json}"], "--rerun"),
    (["mutate", "--rerun", "{notjson}"], "--rerun"),
    (["mutate", "--repo", "{out}"], "--repo"),
    (["mutate", "--out", "{file}"], "--out"),
    (["mutate", "--only", "nope", "--out", "{out}"], "--only"),  # no such mutant key
    (["mutate", "--only", "nope", "nope"], "--only"),
    (["mutate", "--files", "vtoken/table.py", "vtoken/table.py"], "--files"),
    (["mutate", "--files", "fuzz/campaign.py"], "--files"),  # not under vtoken/: not in the snapshot there
    (["mutate", "--files", "vtoken/../vtoken/table.py"], "--files"),
    # check-mutants
    (["check-mutants", "--per-operator", "0"], "--per-operator"),
    (["check-mutants", "--seed", "-1"], "--seed"),
    (["check-mutants", "--paths", "nope"], "--paths"),
    (["check-mutants", "--paths", ","], "--paths"),
    (["check-mutants", "--paths", "planner,planner"], "--paths"),
    # python -m vtoken.reports.vllm_own_tests
    (["own-tests", "--jobs", "0"], "--jobs"),
    (["own-tests", "--timeout", "-1"], "--timeout"),
    (["own-tests", "--adapter-settings", "{bad"], "--adapter-settings"),
    (["own-tests", "--adapter-settings", "[1]"], "--adapter-settings"),
    (["own-tests", "--no-vtoken", "--adapter-settings", "{}"], "--adapter-settings"),
    (["own-tests", "--python", "/nonexistent/python"], "--python"),
    (["own-tests", "--python", "{file}"], "--python"),  # not executable
    (["own-tests", "--python", "{fake_py_novllm}"], "--python"),
    (["own-tests", "--python", "{fake_py}", "--version", "0.32.0"], "--version"),
    (["own-tests", "--version", "0.33"], "--version"),
    (["own-tests", "--out", "{file}"], "--out"),
    (["own-tests", "/abs/test_x.py"], "targets"),
    # python -m vtoken.invariants.small_scope [max_S [max_blocks [max_requests [budget_s]]]]
    (["small-scope", "x"], "max_S"),
    (["small-scope", "-1"], "max_S"),
    (["small-scope", "2", "0"], "max_blocks"),
    (["small-scope", "2", "3", "1", "nan"], "budget_s"),
]

# pseudo-command -> (prog, entry point)
ENTRY = {"vtoken": ("vtoken", main), "bench-adapter": ("vtoken bench adapter", lambda a: bench_adapter.main(a)),
         "own-tests": ("python -m vtoken.reports.vllm_own_tests", lambda a: own_tests.main(a)),
         "small-scope": ("python -m vtoken.invariants.small_scope", lambda a: small_scope.main(a))}


def _started(*a, **k):
    raise AssertionError("a bad argument got past parsing: the command started its work")


@pytest.fixture
def no_work(monkeypatch):
    """Every command's runner replaced by one that fails the test if it is reached."""
    monkeypatch.setattr(decode, "_run", _started)
    monkeypatch.setattr(decode, "PagedDecoder", _started)
    monkeypatch.setattr(bench, "BENCHES", {k: _started for k in bench.BENCHES})
    monkeypatch.setattr(bench_adapter, "bench_adapter", _started)
    monkeypatch.setattr(simulate, "COMMANDS", {k: _started for k in simulate.COMMANDS})
    monkeypatch.setattr(simulate, "run_all", _started)
    monkeypatch.setattr(campaign, "run_campaign", _started)
    monkeypatch.setattr(planted, "main_planted", _started)
    monkeypatch.setattr(audit, "run_audit", _started)
    monkeypatch.setattr(mutation, "run_campaign", _started)
    monkeypatch.setattr(mutants, "run", _started)
    monkeypatch.setattr(own_tests, "run", _started)
    monkeypatch.setattr(small_scope, "run_small_scope", _started)


def _audit(checks, **top):
    return {"passed": True, "vllm_version": "0.33.0", "checks": checks, **top}


# {audit:NAME}: JSON that parses but is not an audit where compare() reads it
BAD_AUDITS = {
    "checks_not_list": _audit({"name": "x", "passed": True}),
    "passed_not_bool": _audit([{"name": "x", "passed": [1]}]),
    "metrics_list": _audit([{"name": "vllm-own-tests", "passed": True, "metrics": [1, 2]}]),
    "contracts_of_ints": _audit([{"name": "vllm-contracts", "passed": True, "metrics": {"contracts": [1]}}]),
    "contracts_dict": _audit([{"name": "vllm-contracts", "passed": True, "metrics": {"contracts": {"a": 1}}}]),
    "contract_no_name": _audit([{"name": "vllm-contracts", "passed": True, "metrics": {"contracts": [{"passed": 1}]}}]),
    "divergence_list_test": _audit([{"name": "vllm-own-tests", "passed": True,
                                     "metrics": {"divergences": [{"test": ["t"], "kind": "k"}]}}]),
    "divergences_of_ints": _audit([{"name": "vllm-own-tests", "passed": True, "metrics": {"divergences": [3]}}]),
    "safe_list": _audit([], safe=[True]),
}

# --impl modules: one that raises while it is imported, and objects that are not a usable class
_RAISES = 'raise RuntimeError("boom at import")\n'
_IMPLS = """from tests.alt_table import AltTable

INSTANCE = AltTable(2, 8)


class RaisesInInit(AltTable):
    def __init__(self, block_size, num_blocks):
        raise RuntimeError("boom in __init__")


class NoSize(AltTable):
    def __init__(self, block_size, num_blocks):
        pass


class PlannerRaisesInInit:
    def __init__(self):
        raise ValueError("no planner today")

    def propose(self, view, max_dests):
        return None
"""


def _closed_port() -> str:
    import socket

    with socket.socket() as s:  # a port nothing listens on (bound, then closed)
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.parametrize("argv,arg", ROWS, ids=[" ".join(r[0]) for r in ROWS])
def test_bad_argument_refused_at_parse_time(argv, arg, tmp_path, monkeypatch, capsys, no_work):
    inputs, cwd, out = tmp_path / "inputs", tmp_path / "cwd", tmp_path / "outs" / "new"
    inputs.mkdir()
    cwd.mkdir()
    (inputs / "file").write_text("x")
    (inputs / "notjson.json").write_text("{not json")
    (inputs / "list.json").write_text("[1, 2]")
    (inputs / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (inputs / "bigint.json").write_text('{"checks": [], "n": ' + "9" * 5000 + "}")
    (inputs / "vtoken_cli_args_raises.py").write_text(_RAISES)
    (inputs / "vtoken_cli_args_impls.py").write_text(_IMPLS)
    (inputs / "audit_ok.json").write_text(json.dumps(_audit([])))
    for name, vllm in (("fake_py", '"0.33.0"'), ("fake_py_novllm", "null")):
        (inputs / name).write_text("#!/bin/sh\necho '{\"vllm\": %s, \"pytest\": true, \"vtoken\": true}'\n" % vllm)
        (inputs / name).chmod(0o755)
    monkeypatch.syspath_prepend(str(inputs))
    subs = {"{file}": str(inputs / "file"), "{notjson}": str(inputs / "notjson.json"),
            "{list_json}": str(inputs / "list.json"), "{out}": str(out), "{deep_json}": str(inputs / "deep.json"),
            "{bigint_json}": str(inputs / "bigint.json"), "{closed_port}": _closed_port(),
            "{audit_ok}": str(inputs / "audit_ok.json"), "{fake_py}": str(inputs / "fake_py"),
            "{fake_py_novllm}": str(inputs / "fake_py_novllm")}
    for name, obj in BAD_AUDITS.items():
        (inputs / f"{name}.json").write_text(json.dumps(obj))
        subs[f"{{audit:{name}}}"] = str(inputs / f"{name}.json")
    argv = [next((a.replace(k, v) for k, v in subs.items() if k in a), a) for a in argv]
    monkeypatch.chdir(cwd)  # default output folders (reports/, out/) are relative to it
    monkeypatch.setenv("VTOKEN_DEVICE", "cpu")
    cmd = argv[0]
    prog, entry = ENTRY.get(cmd, (f"vtoken {cmd}", None))
    with pytest.raises(SystemExit) as e:
        if entry is not None:
            entry(argv[1:])
        else:
            main(argv)
    assert e.value.code == 2
    std = capsys.readouterr()
    assert "Traceback" not in std.err + std.out
    lines = std.err.strip().splitlines()
    errors = [l for l in lines if l.startswith(f"{prog}: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], std.err  # one error line, after argparse's usage
    assert lines[0].startswith(f"usage: {prog}")
    assert f"argument {arg}" in errors[0], errors[0]
    assert not any(cwd.iterdir()), sorted(map(str, cwd.rglob("*")))
    assert not out.parent.exists()


# ---------------------------------------------------------------------------- Ctrl-C
class _FakeQueue:
    """What the workers said (one batch of the table machine), then Ctrl-C in the parent."""

    def __init__(self):
        self.msgs = [("progress", 0, "table", 123, 0.5, {})]
        self.interrupted = False

    def get(self, timeout=None):
        if self.msgs:
            return self.msgs.pop(0)
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        raise queue.Empty


class _FakeProcess:
    exitcode = -15  # as a terminated worker's (the campaign was interrupted)

    def __init__(self, *a, **k):
        pass

    def start(self):
        pass

    def is_alive(self):
        return False

    def terminate(self):
        pass

    def join(self, timeout=None):
        pass


def test_fuzz_ctrl_c_reports_partial_results_and_exits_130(tmp_path, monkeypatch, capsys):
    ctx = types.SimpleNamespace(Queue=_FakeQueue, Process=_FakeProcess)
    monkeypatch.setattr(campaign, "mp", types.SimpleNamespace(get_context=lambda *_: ctx))
    monkeypatch.setattr(campaign, "available_machines", lambda: (["table"], {}))
    monkeypatch.setenv("VTOKEN_DEVICE", "cpu")
    out = tmp_path / "out"
    rc = main(["fuzz", "--minutes", "0.1", "--machines", "table", "--out", str(out), "--json"])
    std = capsys.readouterr()
    assert rc == 130
    assert "Traceback" not in std.out + std.err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["ops"] == 123
    # --json: the text goes to stderr, stdout holds the JSON alone
    assert "interrupted" in std.err and "table 123 ops" in std.err and str(out / "summary.json") in std.err
    assert json.loads(std.out)["interrupted"] is True


def test_fuzz_ctrl_c_before_any_batch_exits_130(tmp_path, monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(campaign, "run_campaign", interrupted)
    monkeypatch.setenv("VTOKEN_DEVICE", "cpu")
    assert main(["fuzz", "--out", str(tmp_path / "out")]) == 130
    std = capsys.readouterr()
    assert "Traceback" not in std.out + std.err and "interrupted" in std.err


@pytest.mark.parametrize("how", ["raise", "campaign"])
def test_audit_ctrl_c_reports_partial_results_and_exits_130(how, tmp_path, monkeypatch, capsys):
    def check_first(ctx):
        return audit.CheckResult("first", True, "fine")

    def check_second(ctx):
        if how == "raise":
            raise KeyboardInterrupt
        return audit.CheckResult("second", True, "a campaign that stopped", metrics={"interrupted": True})

    def check_third(ctx):
        raise AssertionError("the audit went on after Ctrl-C")

    monkeypatch.setattr(audit, "CHECKS", [check_first, check_second, check_third])
    monkeypatch.setattr(audit, "vllm_version", lambda: None)
    rc = main(["audit", "--out", str(tmp_path / "reports")])
    std = capsys.readouterr()
    assert rc == 130
    assert "Traceback" not in std.out + std.err
    (folder,) = (tmp_path / "reports").iterdir()
    report = json.loads((folder / "audit.json").read_text())
    assert report["passed"] is False and [c["name"] for c in report["checks"]] == ["first"]
    assert report["interrupted"] == {"in": "second", "not_run": ["second", "third"]}
    assert "INTERRUPTED" in (folder / "audit.md").read_text()
    last = std.out.strip().splitlines()[-1]
    assert "INTERRUPTED in second" in last and "first PASS" in last and f"{folder}/audit.md" in last


class _Picked(Exception):
    pass


@pytest.mark.parametrize("names", [["vllm-prefix-equality,vllm-decode"], ["vllm-prefix-equality", "vllm-decode"]])
def test_audit_only_takes_names_space_or_comma_separated(names, tmp_path, monkeypatch):
    """``--only a,b`` (issue 38's acceptance command) selects what ``--only a b`` does: the run
    gets one flat list of names (a bad or empty name in a list is refused: the bad rows above)."""
    def run_audit(out, quick, seed, examples, compare, only):
        raise _Picked(only)

    monkeypatch.setattr(audit, "run_audit", run_audit)
    with pytest.raises(_Picked) as e:
        main(["audit", "--out", str(tmp_path), "--only", *names])
    (only,) = e.value.args
    assert only == ["vllm-prefix-equality", "vllm-decode"]
    assert [audit.CHECK_NAMES[c] for c in audit.CHECKS if audit._selected(c, only)] == ["vllm-decode",
                                                                                       "vllm-prefix-equality"]


# ---------------------------------------------------------------------------- what --compare accepts, compare() reads
def _compare_inputs():
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=3)
    junk = st.recursive(scalars, lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=3), ch,
                                                                                        max_size=3), max_leaves=6)

    def field(good):  # mostly the right shape, one time in eight any JSON value
        return st.integers(0, 7).flatmap(lambda i: junk if i == 0 else good)

    contract = st.fixed_dictionaries({}, optional={"name": field(st.sampled_from(["a", "b"])),
                                                   "passed": field(st.booleans()), "detail": junk})
    div = st.fixed_dictionaries({}, optional={"test": field(st.sampled_from(["t1", "t2"])), "kind": field(st.just("k"))})
    metrics = st.fixed_dictionaries({}, optional={
        "contracts": field(st.lists(field(contract), max_size=3)), "divergences": field(st.lists(field(div), max_size=3)),
        "shipped": junk, "with_vtoken": junk})
    check = st.fixed_dictionaries({
        "name": field(st.sampled_from(["vllm-contracts", "vllm-own-tests", "fuzz-campaign"])),
        "passed": field(st.sampled_from([True, False, None]))}, optional={"metrics": field(metrics), "detail": junk})
    report = st.fixed_dictionaries({"checks": field(st.lists(field(check), max_size=4))}, optional={
        "safe": field(st.booleans()), "passed": junk, "vllm_version": junk})
    return field(report)


def _new_reports():
    def one(passed, contracts, divergences):
        return {"vllm_version": "0.33.0", "safe": passed, "passed": passed, "checks": [
            {"name": "vllm-contracts", "passed": passed, "detail": "d", "metrics": {"contracts": contracts}},
            {"name": "vllm-own-tests", "passed": passed, "detail": "d",
             "metrics": {"shipped": {"passed": 1}, "with_vtoken": {"passed": 1}, "divergences": divergences}},
            {"name": "fuzz-campaign", "passed": None, "detail": "d", "metrics": {}}]}

    return [one(True, [{"name": "a", "passed": True}], []),
            one(False, [{"name": "b", "passed": False, "detail": "x"}], [{"test": "t1", "kind": "k"}])]


def test_every_audit_json_the_compare_argument_accepts_compares():
    """The --compare check reads what compare() reads: whatever it accepts, compare() runs on
    (against new reports that take every branch), so a malformed old audit.json is refused
    at parse time instead of crashing after every check has run."""
    from hypothesis import given, settings

    new = _new_reports()

    @settings(max_examples=400, deadline=None)
    @given(_compare_inputs())
    def run(old):
        if audit._audit_json_kind(old) is None:
            for n in new:
                assert isinstance(audit.compare(old, n), list)

    run()


# ---------------------------------------------------------------------------- the refusals' other sides
def test_vllm_tests_plugin_refuses_bad_adapter_settings_as_a_usage_error(tmp_path):
    """``--vtoken-adapter-settings`` that is not a JSON object: pytest's usage error (exit 4, one
    error line naming the option), not an INTERNALERROR traceback from pytest_configure."""
    import subprocess
    import sys

    (tmp_path / "test_x.py").write_text("def test_x():\n    pass\n")
    for bad in ("{bad", "[1]"):
        p = subprocess.run([sys.executable, "-m", "pytest", "-p", "vtoken.reports.vllm_tests_plugin", "-p",
                            "no:cacheprovider", "--vtoken-adapter-settings", bad, "test_x.py"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
        out = p.stdout + p.stderr
        assert p.returncode == 4, out
        assert "INTERNALERROR" not in out and "Traceback" not in out
        assert "error: argument --vtoken-adapter-settings: " in out, out


def test_mutate_only_takes_the_keys_of_the_mutants_of_files():
    """The --only check refuses what no mutant has and accepts what --list names (the keys of
    the repository's --files, as the snapshot will hold them)."""
    import argparse
    from pathlib import Path

    repo = Path(mutation.__file__).resolve().parents[1]
    keys = [m.key for m in mutation.generate((repo / "vtoken/table.py").read_text(), "vtoken/table.py")]
    mutation._check_only(argparse.ArgumentParser(), keys[:3], repo, ["vtoken/table.py"])
    with pytest.raises(SystemExit):
        mutation._check_only(argparse.ArgumentParser(), keys[:1], repo, ["vtoken/planner.py"])


def test_own_tests_preflight_accepts_a_python_that_has_the_version(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho '{\"vllm\": \"0.33.0\", \"pytest\": true, \"vtoken\": false}'\n")
    fake.chmod(0o755)
    probe, version = own_tests.preflight(str(fake), None, with_vtoken=False)
    assert version == "0.33.0" and probe["pytest"] is True
    with pytest.raises(own_tests.PreflightError) as e:
        own_tests.preflight(str(fake), "0.33.0", with_vtoken=True)
    assert e.value.arg == "--python" and "cannot import vtoken" in str(e.value)
