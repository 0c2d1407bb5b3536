"""Invariant checkers I1-I4 (installed as ``vtoken.invariants``).

Owns: nothing (re-exports).
May call: invariants.table_checks.
Costs: O(1).
"""

from .table_checks import InvariantViolation, check_block_accounting, check_conservation, check_unique_mapping

__all__ = ["InvariantViolation", "check_block_accounting", "check_conservation", "check_unique_mapping"]
