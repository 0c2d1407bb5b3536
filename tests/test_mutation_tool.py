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

MIXED = textwrap.dedent('''
    def f(a, b, xs):
        assert a is not None, "a is required"
        b = b * 2
        s = b * (3 + a)
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


def test_skips_raise_asserts_and_strings_but_mutates_the_rest():
    ms = generate(MIXED, "vtoken/mixed.py")
    lines = _by_line(ms)
    assert {m.func for m in ms} == {"f"}
    assert not any("raise" in m.original for m in ms)  # error codes / messages stay
    assert not any(m.original.startswith("assert") for m in ms)  # assertions are the checks, not the code
    assert {"* -> //", "delete statement", "2 -> 3", "2 -> 1"} <= {m.desc for m in lines["b = b * 2"]}
    assert {"* -> //", "+ -> -", "3 -> 4"} <= {m.desc for m in lines["s = b * (3 + a)"]}
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


def stale_exemptions(equivalent, root) -> list[str]:
    """Equivalent-mutant entries whose original line no longer occurs in their file (a stale
    exemption matches nothing: it silently stops saying why a survivor is harmless)."""
    from pathlib import Path

    out = []
    for e in equivalent:
        f = Path(root) / e["file"]
        lines = {ln.strip() for ln in f.read_text().splitlines()} if f.exists() else set()
        if e["original"] not in lines:
            out.append(f"{e['file']}: {e['original']!r}")
    return out


def test_every_equivalent_mutant_entry_names_a_line_that_exists():
    from pathlib import Path

    from vtoken.fuzz.mutation import ADAPTER_TESTS, DEFAULT_FILES, EQUIVALENT

    root = Path(__file__).resolve().parent.parent
    assert stale_exemptions(EQUIVALENT, root) == []
    # an exemption for a file never mutated is dead (the adapter's modules: with --files, their own tests)
    assert {e["file"] for e in EQUIVALENT} <= set(DEFAULT_FILES) | set(ADAPTER_TESTS)


def test_the_stale_exemption_check_finds_a_planted_one(tmp_path):
    (tmp_path / "m.py").write_text("x = 1\nif need <= r.cap:\n    pass\n")
    entries = [dict(file="m.py", original="if need <= r.cap:"), dict(file="m.py", original="if need <= cap:"),
               dict(file="gone.py", original="x = 1")]
    assert stale_exemptions(entries, tmp_path) == ["m.py: 'if need <= cap:'", "gone.py: 'x = 1'"]
