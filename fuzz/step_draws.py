"""How the project's state machines draw a step: the rule in one choice (swarm kept), and
``data.draw`` at the cost of the choice it makes.

Measured on the token-table machine (Hypothesis 6.170, this 2-core box), Hypothesis's own
step costs more than the checked operation it selects:

- *the rule*: the stateful runner picks it by rejection sampling over all rules, filtered by
  preconditions and by swarm feature flags decided lazily: an index draw and a flag draw a
  try, three tries, then a walk over the rules with a flag draw each. About 8.7 choices a
  step, three quarters of all the choices a campaign makes;
- *each* ``data.draw`` inside a rule: about 60 us over the 10 us of the choice itself (two
  ``random.getstate()`` copies to catch a strategy that uses the global random, an
  argument span, the observability label).

``SwarmRules`` (the machines' base class) keeps swarm testing (Groce et al., 2012: some
rules are off for a whole example) and makes both cheap:

- once per example: ``p`` (0..254, as Hypothesis draws it), then one boolean per rule, in
  the rules' order, true with probability ``p / 255``: that rule is off for the example.
  Shrinking drives them false (every rule on), as Hypothesis's flags shrink;
- per step: one integer over *all* rules. A rule that is off or whose precondition fails
  passes the choice on to the next rule, cyclically, that is on and valid: an index names
  the same rule whenever that rule may run, so a shrink that turns a rule back on leaves the
  other steps' rules as they were. When every valid rule is off, the valid ones are all on
  for that step (Hypothesis would discard the example);
- ``data.draw`` in a rule is the choice and a counter; on the final (reporting) run each
  draw is noted as Hypothesis notes it (``Draw 3 (rid): 1``), so a failure reads the same.
  Not kept: the global-random guard (no strategy of the machines uses ``random``) and
  explain-phase comments on draws;
- ``pick(data, items, label)`` and ``integer(data, lo, hi, label)``: ``sampled_from`` and
  ``integers`` drawn as the same single choice they make, without a strategy object built
  and validated per draw (a list of requests is a new ``sampled_from`` every step).

Measured (``vtoken fuzz --minutes 2 --workers 2``, checked operations per second per
worker): table 1,229-1,427 before, 2,624 after; planner 1,854-1,895 before, 3,710 after.

A rule's arguments are drawn from its own strategies, in Hypothesis's order, and the
``@initialize`` rules and everything after the choice of rule are Hypothesis's. The
hooks are Hypothesis's private ``RuleBasedStateMachine._rules_strategy`` and
``DataObject.conjecture_data`` (6.1xx); a Hypothesis without them keeps its own selection
and draws, with a warning, and the machines run unchanged, slower.

Owns: nothing beyond one strategy object per machine instance.
May call: hypothesis (the stateful internals named above), warnings.
Costs: per example 1 + (number of rules) choices; per step one choice and O(rules)
precondition calls; per ``data.draw``, ``pick`` or ``integer`` one draw.
"""

from __future__ import annotations

import warnings

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.control import should_note
from hypothesis.errors import InvalidDefinition
from hypothesis.stateful import RuleBasedStateMachine

try:  # private: where Hypothesis 6.1xx keeps its rule strategy and its data object
    from hypothesis.internal.compat import add_note as _add_note  # BaseException.add_note before 3.11
    from hypothesis.stateful import RuleStrategy as _RuleStrategy
    from hypothesis.strategies._internal.core import DataObject as _DataObject
except ImportError:  # pragma: no cover
    _RuleStrategy = _DataObject = None


class _Off(st.SearchStrategy):
    """The indices of the rules off for one example (see the module docstring)."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def do_draw(self, data) -> frozenset:
        p = data.draw_integer(0, 254) / 255
        return frozenset(i for i in range(self.n) if data.draw_boolean(p))


def _valid(machine, rule) -> bool:
    """``RuleStrategy.is_valid`` without its observability bookkeeping (a description
    formatted per precondition per call: most of a step's selection cost)."""
    return all(machine.bundle(b.name) for b in rule.bundles) and all(p(machine) for p in rule.preconditions)


if _RuleStrategy is not None:

    class _FastData(_DataObject):
        """``st.data()``'s object, drawing at the cost of the choice (module docstring)."""

        def __init__(self, data, count: int):
            super().__init__(data)
            self.count = count
            self._noting = should_note()  # fixed for a run: the final (reporting) run or verbose

        def draw(self, strategy, label=None):
            return self.drawn(label, self.conjecture_data.draw(strategy))

        def drawn(self, label, value):
            """``value``, counted as the next draw and, on the reporting run, noted as Hypothesis
            notes it (``Draw 3 (rid): 1``)."""
            self.count += 1
            if self._noting:
                note(f"Draw {self.count}{'' if label is None else f' ({label})'}: {value!r}")
            return value

    class _SwarmRuleStrategy(_RuleStrategy):
        """Hypothesis's ``RuleStrategy``, its rule and data draws as the module docstring says."""

        def __init__(self, machine) -> None:
            super().__init__(machine)
            self._off_strategy = _Off(len(self.rules))
            self._off: tuple = (None, frozenset())  # (the example's data, the rules off in it)
            self._fast = None

        def do_draw(self, data):
            rules, m, n = self.rules, self.machine, len(self.rules)
            valid = [_valid(m, r) for r in rules]
            if not any(valid):
                raise InvalidDefinition(f"No progress can be made from state {m!r}, because no available rule had "
                                        f"a True precondition. rules: {', '.join(r.function.__name__ for r in rules)}")
            if self._off[0] is not data:  # the example's first step
                self._off = (data, data.draw(self._off_strategy))
            off = self._off[1]
            i = data.draw_integer(0, n - 1)
            order = [(i + k) % n for k in range(n)]
            # the next rule on and valid; every valid rule off: all of them on for this step
            j = next((j for j in order if valid[j] and j not in off), None)
            rule = rules[j if j is not None else next(j for j in order if valid[j])]
            arguments = {}
            for k, strat in rule.arguments_strategies.items():
                try:
                    v = data.draw(strat)
                except Exception as err:
                    _add_note(err, f"while generating {k!r} from {strat!r} for rule {rule.function.__name__}")
                    raise
                if type(v) is _DataObject:  # st.data(): one object per example, its count kept
                    if self._fast is None or self._fast.conjecture_data is not data:
                        self._fast = _FastData(data, v.count)
                    v = self._fast
                arguments[k] = v
            return rule, arguments

else:  # pragma: no cover - no fast draws: pick and integer draw through Hypothesis
    _FastData = None


def pick(data, items, label: str):
    """``data.draw(st.sampled_from(items), label=label)``, the same choice (an index, shrinking
    to the first), without a strategy built and validated per draw."""
    if type(data) is _FastData and items:  # (none: sampled_from's own refusal, the example discarded)
        return data.drawn(label, items[data.conjecture_data.draw_integer(0, len(items) - 1)])
    return data.draw(st.sampled_from(items), label=label)


def integer(data, lo: int, hi: int, label: str) -> int:
    """``data.draw(st.integers(lo, hi), label=label)``, the same choice (with its weight on the
    bounds of a wide range), without a strategy looked up and validated per draw."""
    if type(data) is _FastData and lo <= hi:
        w = {lo: 2 / 128, lo + 1: 1 / 128, hi - 1: 1 / 128, hi: 2 / 128} if hi - lo > 127 else None
        return data.drawn(label, data.conjecture_data.draw_integer(lo, hi, weights=w))
    return data.draw(st.integers(lo, hi), label=label)


class SwarmRules(RuleBasedStateMachine):
    """A ``RuleBasedStateMachine`` whose steps are drawn as the module docstring says."""

    def __init__(self) -> None:
        super().__init__()
        if _RuleStrategy is not None and isinstance(getattr(self, "_rules_strategy", None), _RuleStrategy):
            self._rules_strategy = _SwarmRuleStrategy(self)
        else:  # pragma: no cover - a Hypothesis that moved its rule strategy
            warnings.warn("vtoken: Hypothesis's rule strategy not found; steps drawn by Hypothesis's own "
                          "(slower) selection", stacklevel=2)
