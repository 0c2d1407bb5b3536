"""The executable reference model (installed as ``vtoken.spec``).

Small, obviously right, dict-based and slow on purpose. It never imports ``vtoken``'s
internals; the fuzzers hold the two side by side and compare observable state and error
codes after every operation.

Owns: nothing (re-exports).
May call: spec.token_table only; never the system (``vtoken``'s internals).
Costs: O(1).
"""

from .token_table import SpecError, SpecTokenTable

__all__ = ["SpecError", "SpecTokenTable"]
