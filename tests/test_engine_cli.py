"""``vtoken engine`` refuses bad arguments in argparse's one line, before any engine or
environment is touched (exit 2)."""

from __future__ import annotations

import pytest

from vtoken.cli.main import main


@pytest.mark.parametrize("argv, match", [
    (["--evict-ratio", "1.5"], "argument --evict-ratio"),
    (["--evict-ratio", "0.5", "--budget", "10"], "not allowed with argument"),
    (["--budget", "0"], "argument --budget"),
    (["--policy", "lru"], "argument --policy"),
    (["--requests", "0"], "argument --requests"),
    (["--settings", '{"polcy": "h2o"}'], r"unknown setting\(s\) \['polcy'\]"),
    (["--settings", '{"planner": {"headroom": -1}}'], r"planner\.headroom must be an integer >= 0"),
    (["--settings", "[1]"], "argument --settings"),
    (["--compare", "plain"], "argument --compare"),
])
def test_bad_engine_arguments_are_refused_first(argv, match, capsys, monkeypatch):
    import vtoken.cli.engine as eng

    monkeypatch.setattr(eng, "engine_python", lambda *a, **k: pytest.fail("an engine was looked for"))
    with pytest.raises(SystemExit) as e:
        main(["engine", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "vtoken engine: error:" in err and __import__("re").search(match, err), err


def test_bench_checks_only_with_the_engine_bench(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "table", "--checks"])
    assert e.value.code == 2 and "--checks: only with engine" in capsys.readouterr().err
