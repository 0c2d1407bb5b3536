"""Command line: ``vtoken <command>`` (also ``python -m vtoken``), the dispatcher of the
commands' layer: the system's commands (``vtoken.cli``) and the toolkit's (audit, fuzz,
mutate, check-mutants), each imported by name only when chosen.

Owns: nothing (the table of command names).
May call: sys, importlib: by name, the chosen command's entry point only (``vtoken.cli`` or the
toolkit's commands); it imports nothing of spec/, invariants/, fuzz/ or reports/ statically.
Costs: O(1) plus the chosen command's import and run.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "bench": "vtoken.cli.bench:main_bench",
        "audit": "vtoken.reports.audit:main_audit",
        "decode": "vtoken.cli.decode:main_decode",
        "engine": "vtoken.cli.engine:main_engine",
        "simulate": "vtoken.cli.simulate:main_simulate",
        "fuzz": "vtoken.fuzz.campaign:main_fuzz",
        "mutate": "vtoken.fuzz.mutation:main",
        "check-mutants": "vtoken.invariants.mutants:main",
    }
    usage = "vtoken {" + ",".join(commands) + "} ..."
    if argv and argv[0] in ("-h", "--help"):
        print("usage: " + usage)
        return 0
    if not argv or argv[0] not in commands:
        import argparse

        # argparse's own refusal: usage, then one error line, exit 2
        what = f"invalid choice: {argv[0]!r}" if argv else "a command is required"
        argparse.ArgumentParser(prog="vtoken", usage=usage).error(
            f"argument command: {what} (choose from {', '.join(commands)})")
    mod, fn = commands[argv[0]].split(":")
    import importlib

    return int(getattr(importlib.import_module(mod), fn)(argv[1:]) or 0)
