"""Fuzzers (installed as ``vtoken.fuzz``): stateful machines that hold ``vtoken`` and the
reference model side by side, and the campaign runner.

Owns: nothing (a package marker).
May call: nothing itself; its modules call the system, spec/ and invariants/.
Costs: O(1).
"""
