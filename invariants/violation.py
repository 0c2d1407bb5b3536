"""The one result shape of every checker: a list of :class:`Violation` (``[]``: the checked
thing holds).

What this cannot see: anything -- it is the result type, not a check; what a violation
says, and what its checker could not see, is the checker's (each module's own section).

A point-in-time checker's primary entry returns ``list[Violation]``, one function per named
rule behind it; a raising form (``check_ownership``, ``check_unique_mapping``, ...) is a thin
wrapper that raises from the first violation of that list, the exception carrying the whole
list as ``.violations`` (:func:`raise_first`). A run-level tool (small scope, the placement
proof, the I3 probe, the vLLM contracts, the mutation test) keeps its own result (dicts and
dataclasses other code reads, JSON written from them) and adds a ``violations`` view of
what it found (:class:`Found` for a result dict).

Owns: nothing.
May call: dataclasses only.
Costs: O(1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Found", "Violation", "raise_first"]


@dataclass
class Violation:
    """One broken rule: ``invariant`` (I1-I4, or the checker's own name for what it guards:
    ``accounting``, ``ownership``, ...), a readable ``explanation``, the values that show it
    (``model``) and the rule's name (``rule``: which named rule of the checker broke)."""

    invariant: str
    explanation: str
    model: dict = field(default_factory=dict)
    rule: str = ""

    def __str__(self) -> str:
        return f"{self.invariant}: {self.explanation}"


def raise_first(violations: list[Violation], exc_type) -> None:
    """The raising forms' one body: nothing when ``violations`` is empty, else raise
    ``exc_type(invariant, explanation, violations=violations)`` from the first."""
    if violations:
        first = violations[0]
        raise exc_type(first.invariant, first.explanation, violations=list(violations))


class Found(dict):
    """A run-level tool's result dict, unchanged (its keys, its JSON), with ``violations``:
    what the run found, as :class:`Violation` (``[]``: nothing). An attribute, not a key, so
    the JSON and every reader of the dict see what they saw before."""

    def __init__(self, data=(), violations=()):
        super().__init__(data)
        self.violations: list[Violation] = list(violations)
