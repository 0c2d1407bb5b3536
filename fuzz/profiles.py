"""Hypothesis profiles: ``ci`` (default, fast, deterministic), ``dev`` and ``nightly``.

Chosen by ``VTOKEN_HYPOTHESIS_PROFILE``. Deadlines are off everywhere: the machines run
the reference model, which is slow on purpose, and a shared CI box is noisy.

``ci`` is derandomized and has no example database: a verdict is a function of the code
(the same commit runs the same examples, on any machine, every time). ``dev`` and
``nightly`` randomize and keep a database: campaigns explore, and what they find is
replayed first. Detection strength is measured over independent seeds (``vtoken fuzz
--planted all --runs 10``), never from one run.

Owns: nothing (registers Hypothesis profiles).
May call: hypothesis, os, warnings.
Costs: O(1).
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


def _no_local_constants() -> None:
    """Hypothesis (6.1xx) mixes literal constants harvested from every *imported* local
    module into its draws, so a derandomized run's examples depend on which modules the
    test selection happened to import: one commit would not mean one verdict. For ``ci``
    the harvest is turned off (its draws then depend on the code under test and the seed
    only). A private hook of Hypothesis: if it moves, this does nothing and says so."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover
        return
    if hasattr(providers, "_get_local_constants") and hasattr(providers, "Constants"):
        empty = providers.Constants()
        providers._get_local_constants = lambda: empty
    else:  # pragma: no cover - a Hypothesis without the harvest (or with it renamed)
        import warnings

        warnings.warn("vtoken: Hypothesis's local-constant harvest not found; ci verdicts may depend on the "
                      "test selection", stacklevel=2)


def load_profile(name: str | None = None) -> str:
    name = name or os.environ.get("VTOKEN_HYPOTHESIS_PROFILE", "ci")
    settings.load_profile(name)
    if name == "ci":
        _no_local_constants()
    return name
