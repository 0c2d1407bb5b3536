"""Invariant checkers I1-I4 (installed as ``vtoken.invariants``).

What this cannot see: it checks nothing itself; what it re-exports (``table_checks``) sees
plain-data states one at a time. Every checker's result is a list of :class:`Violation`
(``invariants.violation``); a raising form wraps it. Each checker module states its own reach in a "What this
cannot see" section of its docstring; ``docs/ARCHITECTURE.md`` lists them side by side.

Owns: nothing (re-exports).
May call: invariants.table_checks, invariants.violation.
Costs: O(1).
"""

from .table_checks import (InvariantViolation, block_accounting_violations, check_block_accounting, check_conservation,
                           check_unique_mapping, conservation_violations, unique_mapping_violations)
from .violation import Violation

__all__ = ["InvariantViolation", "Violation", "block_accounting_violations", "check_block_accounting", "check_conservation",
           "check_unique_mapping", "conservation_violations", "unique_mapping_violations"]
