"""The mutation tool (``vtoken.fuzz.mutation``) on tiny modules: what it mutates, what it
leaves alone, and that a run kills a bad mutant and lets an equivalent one survive.
(The campaign over the core itself is ``vtoken mutate``; it is far too slow for a test.)"""

import json
import textwrap

import pytest

from vtoken.fuzz.mutation import generate, main

TINY = textwrap.dedent('''
    """A tiny module."""


    def clamp(x, lo, hi):
        """Clamp x into [lo, hi]."""
        if x < lo:
            return lo
        if x > hi:
            return hi
        return x
''')

FAULTY = textwrap.dedent('''
    from . import faults


    def _planted_helper(a):
        return a + 100


    def f(a, b, xs):
        if faults.on("planted_a"):
            a = _planted_helper(a)
        if not faults.on("planted_b"):
            b = b * 2
        else:
            b = b - 7
        s = b * (3 + faults.on("planted_c"))
        if a < 0:
            raise ValueError("bad_a", f"a={a + 1} is negative")
        total = a + s
        xs.append(total)
        return xs[1:len(xs)]
''')


def _by_line(mutants):
    out = {}
    for m in mutants:
        out.setdefault(m.original, []).append(m)
    return out


def test_generates_every_family_on_a_tiny_module():
    ms = generate(TINY, "vtoken/tiny.py")
    ops = {m.op for m in ms}
    assert {"cmp", "negate", "return"} <= ops
    descs = {(m.original, m.desc) for m in ms}
    assert ("if x < lo:", "< -> <=") in descs and ("if x < lo:", "< -> >=") in descs
    assert ("if x > hi:", "> -> >=") in descs
    assert ("return x", "return value -> None") in descs
    assert all("Clamp" not in m.original for m in ms)  # docstrings are not mutated
    assert len({m.key for m in ms}) == len(ms)
    for m in ms:  # every mutant is valid Python, differs from the original, keeps line numbers
        compile(m.source, m.file, "exec")
        assert m.source != TINY
        assert m.source.count("\n") == TINY.count("\n")


def test_skips_planted_fault_branches_raise_and_strings_but_mutates_the_rest():
    ms = generate(FAULTY, "vtoken/faulty.py")
    lines = _by_line(ms)
    assert "a = _planted_helper(a)" not in lines  # body of `if faults.on(...)`
    assert not any(m.func == "_planted_helper" for m in ms)  # called only from planted code
    assert {m.func for m in ms} == {"f"}
    assert "b = b - 7" not in lines  # else of `if not faults.on(...)`
    assert not any("raise" in m.original for m in ms)  # error codes / messages stay
    assert not any("faults.on" in m.mutated and "faults.on" not in m.original for m in ms)
    # normal code next to the switches is mutated, the switch's own operator is not
    assert {"* -> //", "delete statement", "2 -> 3", "2 -> 1"} <= {m.desc for m in lines["b = b * 2"]}
    s_descs = {m.desc for m in lines['s = b * (3 + faults.on("planted_c"))']}
    assert "* -> //" in s_descs and "+ -> -" not in s_descs
    assert not any(m.desc.startswith("negate") for m in ms if "faults.on" in m.original)
    assert {"negate if condition", "< -> <="} <= {m.desc for m in lines["if a < 0:"]}
    assert "delete statement" in {m.desc for m in lines["xs.append(total)"]}
    ret = {m.desc for m in lines["return xs[1:len(xs)]"]}
    assert {"slice upper bound + 1", "slice upper bound - 1", "1 -> 0", "return value -> None"} <= ret


def _tiny_repo(tmp_path):
    root = tmp_path / "repo"
    for pkg in ("vtoken", "spec", "invariants", "fuzz"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "vtoken" / "tiny.py").write_text(TINY)
    (root / "tests").mkdir()
    (root / "tests" / "test_tiny.py").write_text(textwrap.dedent('''
        import vtoken.tiny
        from vtoken.tiny import clamp


        def test_clamp():
            assert vtoken.tiny.__file__.endswith("tiny.py")
            assert clamp(-5, 0, 10) == 0
            assert clamp(3, 0, 10) == 3
            assert clamp(12, 0, 10) == 10
    '''))
    (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    return root


@pytest.mark.parametrize("isolation", ["fork", "subprocess"])
def test_a_bad_mutant_is_killed_and_an_equivalent_one_survives(tmp_path, capsys, isolation):
    root = _tiny_repo(tmp_path)
    ms = generate(TINY, "vtoken/tiny.py")
    bad = next(m for m in ms if m.original == "if x < lo:" and m.desc == "< -> >=")
    # x == lo returns lo either way: equivalent
    equivalent = next(m for m in ms if m.original == "if x < lo:" and m.desc == "< -> <=")
    out = tmp_path / "out"
    rc = main(["--repo", str(root), "--files", "vtoken/tiny.py", "--tests", "tests/test_tiny.py",
               "--only", bad.key, equivalent.key, "--out", str(out), "--json", "--workers", "2",
               "--timeout", "120", "--isolation", isolation])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "MUTATION-CHECK vtoken.tiny -> " in text and str(root) not in text.split("MUTATION-CHECK vtoken.tiny -> ")[1].split("\n")[0]
    summary = json.loads(text.strip().splitlines()[-1])
    assert (summary["total"], summary["killed"], summary["survived"], summary["timeout"]) == (2, 1, 1, 0)
    assert summary["score"] == 0.5
    (surv,) = summary["survivors"]
    assert (surv["key"], surv["line"], surv["desc"]) == (equivalent.key, equivalent.line, "< -> <=")
    assert f"SURVIVED vtoken/tiny.py:{equivalent.line}" in text
    report = (out / "survivors.md").read_text()
    assert "vtoken/tiny.py:" in report and "if x <= lo:" in report
    results = json.loads((out / "results.json").read_text())["mutants"]
    (killed,) = [r for r in results if r["status"] == "killed"]
    assert killed["key"] == bad.key and killed["killed_by"] == "tests/test_tiny.py::test_clamp"
