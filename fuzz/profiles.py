"""Hypothesis profiles: ``ci`` (default, fast, deterministic), ``dev`` and ``nightly``.

Chosen by ``VTOKEN_HYPOTHESIS_PROFILE``. Deadlines are off everywhere: the machines run
the reference model, which is slow on purpose, and a shared CI box is noisy.

``ci`` is derandomized and has no example database: a verdict is a function of the code
(the same commit runs the same examples, on any machine, every time). ``dev`` and
``nightly`` randomize and keep a database: campaigns explore, and what they find is
replayed first. Detection strength is measured over independent seeds (``vtoken fuzz
--planted all --runs 10``), never from one run.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.filter_too_much])

settings.register_profile("ci", max_examples=200, stateful_step_count=40, derandomize=True, database=None,
                          **_common)
settings.register_profile("dev", max_examples=400, stateful_step_count=60, **_common)
settings.register_profile("nightly", max_examples=5000, stateful_step_count=100, **_common)


def load_profile(name: str | None = None) -> str:
    name = name or os.environ.get("VTOKEN_HYPOTHESIS_PROFILE", "ci")
    settings.load_profile(name)
    return name
