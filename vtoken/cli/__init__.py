"""The command layer (``vtoken <command>``): thin front ends over the system and the toolkit.

The only part of ``vtoken/`` allowed to import the toolkit (``vtoken.spec``,
``vtoken.invariants``, ``vtoken.fuzz``, ``vtoken.reports``); see tests/test_layers.py.
"""
