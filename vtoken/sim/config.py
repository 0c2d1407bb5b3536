"""Field checks of the simulator's public objects (``Replay``, ``Schedule``, ``Request``,
``AttentionModel``, the trace, budget and schedule makers, the experiments' ``run_*``): the
system's one vocabulary (:mod:`vtoken.fields`) and the arguments every experiment takes.

Owns: nothing (pure checks).
May call: vtoken.fields; never spec/, invariants/, fuzz/ or reports/.
Costs: O(1) per field.
"""

from __future__ import annotations

from vtoken.fields import need_bool, need_choice, need_int, need_number

__all__ = ["need_int", "need_number", "need_bool", "need_choice", "need_run_args"]


def need_run_args(owner: str, quick, seeds, jobs) -> None:
    """The arguments every experiment (``run_waste`` ... ``run_all``) takes: ``quick`` a bool,
    ``seeds`` and ``jobs`` None (the experiment's default) or integers >= 1."""
    need_bool(owner, "quick", quick)
    need_int(owner, "seeds", seeds, 1, none_ok=True)
    need_int(owner, "jobs", jobs, 1, none_ok=True)
