"""The audit's terminal and its logs: one line per check on the terminal, everything else in
the report folder.

A check's own output (vLLM's warnings, repeated per scheduler it builds; the output of the
subprocesses it starts; pytest's progress; a check's progress notes) goes to
``logs/<check>.log`` of the report folder (:func:`captured`: file descriptors 1 and 2 and
Python's ``sys.stdout`` / ``sys.stderr``, so C code, subprocesses and logging handlers bound
to either land there too). The terminal gets one line per check from :class:`Console`:
``[ 3/12] fuzz-campaign          PASS     123.4 s  <the detail, clipped>``. On a terminal the
line shows the check's latest note while it runs and is rewritten in place when it ends;
off a terminal (a pipe, a CI log) the line's start is written when the check starts and its
end when the check ends: one line per check either way. :func:`log_summary` says what a log
holds (lines, the most repeated ones) for the report.

Owns: the duplicate of the terminal's descriptor (closed by ``Console.close``) and the log
files ``captured`` opens (closed when it exits, Ctrl-C included).
May call: os, sys, re, shutil, collections.
Costs: O(1) per line written; ``log_summary`` reads a log once, O(its size).
"""

from __future__ import annotations

import io
import os
import re
import shutil
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

MARKS = {True: "PASS", False: "FAIL", None: "NOT RUN"}
NAME_WIDTH = 22  # the longest check name (vllm-prefix-equality) and a space
DETAIL_CHARS = 110  # a line a person reads whole; the report holds the rest
# vLLM's log prefix ("WARNING 12-05 06:33:08 [cpu.py:314] ", "(EngineCore pid=7) "): dropped
# so that one warning repeated from many places counts as one line
_LOG_PREFIX = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+"
                         r"\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s+)?")


def clip(text: str, n: int = DETAIL_CHARS) -> str:
    """``text`` on one line, at most ``n`` characters (``...`` where it was cut)."""
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3].rstrip() + "..."


class Console:
    """The audit's lines on the terminal (``stream``, default ``sys.stdout`` when made).

    Where ``stream`` has a file descriptor the console writes to a duplicate of it, so
    that :func:`captured` moving descriptors 1 and 2 into a log never moves the console's
    lines there; a stream without one (a test's capture) is written as it is. ``begin`` /
    ``note`` / ``end`` make one line per check; ``line`` writes a whole line."""

    def __init__(self, stream=None):
        stream = sys.stdout if stream is None else stream
        stream.flush()
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, io.UnsupportedOperation):
            fd = None
        self._own = fd is not None
        self.out = os.fdopen(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace") if self._own \
            else stream
        isatty = getattr(stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self._head = None  # the open check line's start, between begin and end

    def line(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def begin(self, i: int, n: int, name: str) -> None:
        """Open check ``i`` of ``n``'s line (no newline until :meth:`end`)."""
        self._head = f"[{i:>{len(str(n))}}/{n}] {name:<{NAME_WIDTH}}"
        self.out.write(self._head + (" running" if self.tty else ""))
        self.out.flush()

    def note(self, msg: str) -> None:
        """A check's progress: into its log (the captured stdout); on a terminal also in
        place on the open check line, clipped to the terminal's width."""
        print(msg, flush=True)
        if self.tty and self._head is not None:
            width = shutil.get_terminal_size((120, 24)).columns
            self.out.write("\r\x1b[K" + (self._head + " " + clip(msg, 200))[:width - 1])
            self.out.flush()

    def end(self, mark: str, seconds: float, detail: str) -> None:
        """Close the open check line with its outcome, time and clipped detail."""
        tail = f" {mark:<8} {seconds:>6.1f} s  {clip(detail)}"
        self.out.write(("\r\x1b[K" + self._head if self.tty else "") + tail + "\n")
        self.out.flush()
        self._head = None

    def close(self) -> None:
        if self._head is not None:  # a line left open (an exception): end it
            self.out.write("\n")
        self.out.flush()
        if self._own:
            self.out.close()


@contextmanager
def captured(path: Path):
    """Inside: everything this process and its children write to stdout or stderr is
    appended to ``path`` (descriptors 1 and 2 and ``sys.stdout`` / ``sys.stderr``); on exit,
    Ctrl-C included, all four are as they were."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for s in (sys.stdout, sys.stderr):
        s.flush()
    log = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
    saved = []
    try:
        for fd in (1, 2):
            try:
                saved.append((fd, os.dup(fd)))
            except OSError:  # no such descriptor (a daemon): nothing to move
                continue
            os.dup2(log.fileno(), fd)
        streams = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = log
        try:
            yield log
        finally:
            sys.stdout, sys.stderr = streams
    finally:
        log.flush()
        for fd, dup in saved:
            os.dup2(dup, fd)
            os.close(dup)
        log.close()


def log_summary(path: Path, top: int = 3) -> dict:
    """What the log ``path`` holds: ``{"path", "lines", "repeated": [[line, count], ...]}``,
    the ``top`` lines written more than once, most repeated first (vLLM's prefix of level,
    time and source dropped, so one warning counts as one line)."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return {"path": str(path), "lines": 0, "repeated": []}
    counts = Counter(_LOG_PREFIX.sub("", ln).strip() for ln in lines)
    rep = [[t, c] for t, c in counts.most_common(top) if c > 1]
    return {"path": str(path), "lines": len(lines), "repeated": rep}
