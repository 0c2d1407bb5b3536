"""Progress bars (``vtoken.progress``): on a terminal only, or as ``VTOKEN_PROGRESS`` says; and
the long runs draw one (a fuzz campaign here), never into a pipe or a log."""

from __future__ import annotations

import io

import pytest

from vtoken.progress import bar, enabled


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("env, tty, want", [(None, False, False), (None, True, True), ("0", True, False),
                                            ("1", False, True)])
def test_bars_only_on_a_terminal_unless_forced(monkeypatch, env, tty, want):
    if env is None:
        monkeypatch.delenv("VTOKEN_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("VTOKEN_PROGRESS", env)
    stream = _Tty() if tty else io.StringIO()
    assert enabled(stream) is want
    b = bar(total=3, desc="phase-x", unit="step", stream=stream)
    b.update(3)
    b.close()
    assert ("phase-x" in stream.getvalue()) is want, stream.getvalue()


def test_a_campaign_draws_its_bar_only_where_asked(monkeypatch, tmp_path, capsys):
    from vtoken.fuzz.campaign import run_campaign

    monkeypatch.delenv("VTOKEN_PROGRESS", raising=False)  # pytest's capture is no terminal
    run_campaign(workers=1, out=tmp_path / "a", machines=["table"], batch=2, examples=2, profile="ci")
    assert "fuzz" not in capsys.readouterr().err
    monkeypatch.setenv("VTOKEN_PROGRESS", "1")
    run_campaign(workers=1, out=tmp_path / "b", machines=["table"], batch=2, examples=2, profile="ci")
    err = capsys.readouterr().err
    assert "fuzz" in err and "ops=" in err, err[-500:]
