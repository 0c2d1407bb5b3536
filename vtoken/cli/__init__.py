"""The command layer (``vtoken <command>``): thin front ends over the system and the toolkit.

The only part of ``vtoken/`` allowed to import the toolkit (``vtoken.spec``,
``vtoken.invariants``, ``vtoken.fuzz``, ``vtoken.reports``); see tests/test_layers.py.

Owns: nothing (a package marker).
May call: nothing itself; its modules may call the system and the toolkit (spec/, invariants/,
fuzz/, reports/).
Costs: O(1).
"""
