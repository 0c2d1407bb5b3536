"""The pytest plugin every ``vtoken mutate`` run loads (copied into the shadow tree as
``_vtoken_mutation_guard.py``): it fails the run (a usage error, never a kill) unless every
``vtoken`` module came from the shadow tree, and turns Hypothesis's shrinking off (a failure
found is a kill either way; ``VTOKEN_MUTATION_SHRINK=1`` keeps it).

Owns: nothing (a pytest plugin's hooks).
May call: hypothesis (settings), os, sys; no vtoken module (it inspects ``sys.modules``).
Costs: O(modules loaded) once per run.
"""

import os
import sys

SHADOW = os.path.dirname(os.path.abspath(__file__))


def _no_shrink():
    """The profile in force (ci), minus shrinking: a failure found is a kill either way, and
    shrinking it only costs time (the planted-fault tests run the machines the same way).
    Applied before each test module is imported (a state machine's TestCase takes its
    settings then), after the conftest has loaded the profile."""
    if os.environ.get("VTOKEN_MUTATION_SHRINK") == "1":
        return
    try:
        from hypothesis import Phase, settings
    except ImportError:
        return
    cur = settings.default
    if Phase.shrink in cur.phases:
        settings.register_profile("vtoken-mutation", settings(cur, phases=[p for p in cur.phases if p != Phase.shrink]))
        settings.load_profile("vtoken-mutation")


def pytest_sessionstart(session):
    _no_shrink()


def pytest_collectstart(collector):
    _no_shrink()


def pytest_sessionfinish(session, exitstatus):
    bad = []
    for name, mod in list(sys.modules.items()):
        if name != "vtoken" and not name.startswith("vtoken."):
            continue
        f = getattr(mod, "__file__", None)
        if f is not None and not os.path.abspath(f).startswith(SHADOW + os.sep):
            bad.append("%s from %s" % (name, f))
    if bad:
        sys.stderr.write("MUTATION-GUARD: not the shadow tree: " + "; ".join(bad) + "\n")
        session.exitstatus = 4
