"""The fuzz machines' one registry and the one loader of a user's ``--impl`` class.

``MACHINES`` names every machine (name -> ``module:Class``); :func:`load_machine` loads one by
name, or binds ``impl:module:Class`` (a user's token table or planner, ``vtoken.fuzz.protocol``)
to its conformance machine. The campaign (``vtoken fuzz --machines/--impl``), the planted runs
(a fault's ``detector`` names a machine here) and the pytest plugin (``--vtoken-impl``) all
resolve machines and implementations through this module; none keeps its own table.

An ``--impl`` class is loaded and checked once per process (:func:`checked_impl`:
``protocol.check_impl``, cached by its spec): the argument check, the campaign's resolution
and the machine's binding share that one load; a forked worker inherits it (a spawned or Ray
worker loads it once in its own process).

Owns: ``MACHINES`` and the per-process cache of checked ``--impl`` classes (spec -> (class, kind)).
May call: importlib, fuzz.protocol (check_impl, table_machine_for, planner_machine_for) and the
machine modules it names (lazily, by name).
Costs: one import per machine loaded; one load and one build per ``--impl`` spec per process.
"""

from __future__ import annotations

import importlib

MACHINES = {
    "table": "vtoken.fuzz.table_machine:TableMachine",
    "planner": "vtoken.fuzz.planner_machine:PlannerMachine",
    "adapter": "vtoken.fuzz.adapter_machine:AdapterMachine",  # needs vLLM (make vllm)
    "engine": "vtoken.fuzz.engine_machine:EngineMachine",  # vLLM's real engine: the engine environment (make engine)
}
IMPL = "impl:"  # the machine name of a user's implementation: "impl:module:Class"

_CHECKED: dict[str, tuple] = {}  # spec -> (class, kind), loaded and checked once per process


def checked_impl(spec: str) -> tuple:
    """``(cls, kind)`` for a user's ``module:Class``: loaded and checked by
    ``protocol.check_impl`` (it loads, offers a protocol, builds once) the first time this
    process asks, the cached answer afterwards. Raises ``ProtocolError`` (one line) for a spec
    that does not load or build (never cached)."""
    if spec not in _CHECKED:
        from .protocol import check_impl

        _CHECKED[spec] = check_impl(spec)
    return _CHECKED[spec]


def machine_of(cls, kind: str | None = None):
    """The conformance machine bound to a user's class: the table machine for a token table,
    the planner contract machine for a planner (the one dispatch on an implementation's kind;
    ``kind`` when already known, else ``protocol.kind_of(cls)``). Loads nothing."""
    from .protocol import kind_of, planner_machine_for, table_machine_for

    kind = kind or kind_of(cls)
    return table_machine_for(cls) if kind == "table" else planner_machine_for(cls)


def impl_machine(spec: str):
    """The conformance machine bound to ``spec``'s class (:func:`machine_of`), the class loaded
    and checked once per process (:func:`checked_impl`)."""
    return machine_of(*checked_impl(spec))


def impl_kind(spec: str) -> str:
    """``"table"`` or ``"planner"``: the protocol ``spec``'s class offers (one load per process,
    :func:`checked_impl`; ``ProtocolError`` for a spec that does not load or build)."""
    return checked_impl(spec)[1]


def load_machine(name: str):
    """A machine by name (``MACHINES``), or ``impl:module:Class``: the table or planner machine
    bound to a user's implementation (:func:`impl_machine`). ``KeyError`` for an unknown name;
    the machine module's ``ImportError`` when it cannot load here."""
    if name.startswith(IMPL):
        return impl_machine(name[len(IMPL):])
    mod, cls = MACHINES[name].split(":")
    return getattr(importlib.import_module(mod), cls)


def available_machines() -> tuple[list[str], dict[str, str]]:
    """``(machines that load, {machine: why not})``: a machine that cannot run here (the
    adapter machine without vLLM) is reported, never dropped silently."""
    out, missing = [], {}
    for name in MACHINES:
        try:
            load_machine(name)
        except (ImportError, AttributeError) as e:
            missing[name] = f"{type(e).__name__}: {e}"
            continue
        out.append(name)
    return out, missing
