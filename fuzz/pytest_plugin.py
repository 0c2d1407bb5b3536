"""The pytest plugin: ``pytest -m invariants --vtoken-impl module:Class`` checks your own table.

Registered through the ``pytest11`` entry point (installing vtoken is enough; without the
option it does nothing). For each ``--vtoken-impl`` (repeatable) it adds test items, marked
``invariants``:

- a token table (``vtoken.fuzz.protocol.TokenTableProtocol``): the table conformance
  machine, every rule run on your class and on the reference model side by side, with the
  invariant checks (I2 unique mapping, block accounting) after every step;
- a planner (``PlannerProtocol``): the planner contract machine, on the views a real caller
  passes (plans in flight, excluded blocks, dead tokens; ``vtoken.fuzz.protocol``).

After the run, the terminal summary gives each item's hard states (``vtoken.fuzz.hard_states``)
and how often the machine reached each, as ``vtoken fuzz`` does.

Runs use the ``ci`` Hypothesis profile (derandomized: one verdict per commit of yours) with
an example database under ``.vtoken/examples`` in the rootdir, so a failure found once is
replayed first. A failure is reported with the operation that diverged, and a replay test
that imports your class is written to ``.vtoken/replays/`` (run it with pytest to see the
shrunk example again). ``--vtoken-examples N`` sets the examples per machine (default: the
profile's).

A ``--vtoken-impl`` that cannot be checked (a module that does not import or raises while it
is imported, a name that is not a class, a class that cannot be built as the machine builds
it) is a usage error in one line before any test runs (``vtoken.fuzz.protocol.check_impl``),
never a conformance failure.

Owns: one test item per ``--vtoken-impl``; its example database and replay files under ``.vtoken/``.
May call: fuzz.registry (the --impl loader), fuzz.protocol, fuzz.profiles, vtoken.argtypes (the option's check), pytest, hypothesis.
Costs: nothing without the option; with it, one machine run per implementation (the profile's
examples).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

_HARD = pytest.StashKey[list]()  # (item name, {hard state: count}) per ImplCheck run


def pytest_addoption(parser):
    g = parser.getgroup("vtoken", "check a token table or planner against vtoken's reference model")
    g.addoption("--vtoken-impl", action="append", default=[], metavar="module:Class",
                help="a token table or planner class to check (repeatable)")
    from vtoken.argtypes import positive_int  # argparse's one-line refusal of 0, -1, x

    g.addoption("--vtoken-examples", type=positive_int, default=None, metavar="N",
                help="examples per machine for --vtoken-impl (default: the ci profile's)")


def pytest_configure(config):
    config.addinivalue_line("markers", "invariants: invariant checkers and reference-model conformance")


class ImplCheck(pytest.Item):
    """One machine run against one implementation."""

    def __init__(self, *, impl: str, kind: str, **kw):
        super().__init__(**kw)
        self.impl, self.kind = impl, kind
        self.add_marker("invariants")
        self.ops: list[str] = []

    def _machine(self):
        """The machine bound to this item's class (``fuzz/registry.py``: the class loaded and
        checked once, at collection)."""
        from vtoken.fuzz.registry import impl_machine

        return impl_machine(self.impl)

    def runtest(self):
        from vtoken.fuzz import hard_states

        before = Counter(hard_states.COUNTS)
        try:
            self._run()
        finally:  # reached states are reported whether the class passed or not
            got = Counter(hard_states.COUNTS)
            got.subtract(before)
            counts = {h: got.get(h, 0) for h in hard_states.BY_KIND[self.kind]}
            self.user_properties.append(("vtoken_hard_states", counts))
            self.config.stash.setdefault(_HARD, []).append((self.name, counts))

    def _run(self):
        from hypothesis import Phase, settings
        from hypothesis.database import DirectoryBasedExampleDatabase
        from hypothesis.stateful import run_state_machine_as_test

        from vtoken.fuzz import protocol
        from vtoken.fuzz.profiles import load_profile

        load_profile("ci")
        root = Path(self.config.rootpath)
        db = DirectoryBasedExampleDatabase(str(root / ".vtoken" / "examples"))
        n = self.config.getoption("vtoken_examples")
        machine = self._machine()
        seen: list = []
        if self.kind == "table":  # keep the wrapper of the failing example, to name its last operation
            make = machine.make_impl

            def recording(block_size, num_blocks):
                t = make(block_size, num_blocks)
                seen.append(t)
                return t

            machine.make_impl = staticmethod(recording)
        kw = dict(database=db, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
        if n:
            kw["max_examples"] = n
        try:
            run_state_machine_as_test(machine, settings=settings(settings(), **kw))
        except BaseException as e:  # noqa: BLE001 - reported with the operation and a replay file
            if isinstance(e, KeyboardInterrupt):
                raise
            last = seen[-1].ops[-1] if seen and isinstance(seen[-1], protocol.Conforming) and seen[-1].ops else None
            replay = self._write_replay(root, db)
            raise ImplCheckFailure(self.impl, self.kind, last, e, replay) from e

    def _write_replay(self, root: Path, db) -> Path:
        safe = re.sub(r"[^A-Za-z0-9]+", "_", self.impl).strip("_")
        path = root / ".vtoken" / "replays" / f"test_replay_{safe}_{self.kind}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'''"""Replay of a vtoken conformance failure of {self.impl} ({self.kind} machine).

Run: pytest {path.name} (from {root}). The failing example saved in .vtoken/examples is
replayed first and shrunk again.
"""

from hypothesis import Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import run_state_machine_as_test

from vtoken.fuzz.protocol import load_impl
from vtoken.fuzz.registry import machine_of


def test_replay():
    machine = machine_of(load_impl({self.impl!r}))
    run_state_machine_as_test(machine, settings=settings(
        database=DirectoryBasedExampleDatabase({str(root / ".vtoken" / "examples")!r}),
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink], max_examples=200, deadline=None))
''')
        return path

    def repr_failure(self, excinfo):
        e = excinfo.value
        if isinstance(e, ImplCheckFailure):
            return str(e)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"vtoken {self.kind} machine: {self.impl}"


class ImplCheckFailure(Exception):
    def __init__(self, impl, kind, last_op, error, replay):
        import traceback

        text = "".join(traceback.format_exception(error))
        where = f"the last operation on {impl}: {last_op}" if last_op else "see the steps below"
        super().__init__(f"{impl} does not conform ({kind} machine); {where}\n"
                         f"replay: pytest {replay}\n\n{text[-6000:]}")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the items carry the invariants marker
def pytest_collection_modifyitems(session, config, items):
    impls = config.getoption("vtoken_impl")
    if not impls:
        return
    from vtoken.fuzz.protocol import ProtocolError
    from vtoken.fuzz.registry import checked_impl

    for spec in impls:
        try:
            _, kind = checked_impl(spec)  # the one load of the class (the item's machine reuses it)
        except ProtocolError as e:
            raise pytest.UsageError(f"--vtoken-impl {str(e).removeprefix('--impl ')}") from None
        items.append(ImplCheck.from_parent(session, name=f"vtoken-impl[{spec}]::{kind}-machine", impl=spec, kind=kind))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Each ``--vtoken-impl`` item's hard states and how often its machine reached them."""
    for name, counts in config.stash.get(_HARD, []):
        terminalreporter.write_line(f"{name}: hard states: " + ", ".join(f"{h} {n}" for h, n in counts.items()))
