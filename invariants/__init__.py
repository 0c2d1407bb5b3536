"""Invariant checkers I1-I4 (installed as ``vtoken.invariants``).

What this cannot see: it checks nothing itself; what it re-exports (``table_checks``) sees
plain-data states one at a time. Each checker module states its own reach in a "What this
cannot see" section of its docstring; ``docs/ARCHITECTURE.md`` lists them side by side.

Owns: nothing (re-exports).
May call: invariants.table_checks.
Costs: O(1).
"""

from .table_checks import InvariantViolation, check_block_accounting, check_conservation, check_unique_mapping

__all__ = ["InvariantViolation", "check_block_accounting", "check_conservation", "check_unique_mapping"]
