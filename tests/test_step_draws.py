"""``fuzz.step_draws``: the machines' steps drawn in one choice, swarm kept, failures still
reported and shrunk (toy machines, so each property is seen alone)."""

from __future__ import annotations

import collections

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.control import current_build_context
from hypothesis.stateful import initialize, precondition, rule, run_state_machine_as_test

from vtoken.fuzz.step_draws import SwarmRules, _SwarmRuleStrategy

CFG = settings(max_examples=150, stateful_step_count=30, database=None, derandomize=True, deadline=None,
               suppress_health_check=list(HealthCheck))


def _toy(n_rules: int, log: list, with_precondition=None):
    """A machine with ``n_rules`` rules that draw nothing; each call is logged as
    ``(example, rule index, choices made so far)``."""
    ns = {"example": -1}

    def make(i):
        def f(self):
            log.append((ns["example"], i, len(current_build_context().data.choices)))
        f.__name__ = f"r{i}"
        r = rule()(f)
        if with_precondition is not None and i in with_precondition:
            r = precondition(with_precondition[i])(r)
        return r

    body = {f"r{i}": make(i) for i in range(n_rules)}

    def start(self):
        ns["example"] += 1
    body["start"] = initialize()(start)
    return type("Toy", (SwarmRules,), body)


def test_the_machines_draw_their_steps_through_it():
    from vtoken.fuzz.adapter_machine import AdapterMachine
    from vtoken.fuzz.planner_machine import PlannerMachine
    from vtoken.fuzz.protocol import PlannerContractMachine
    from vtoken.fuzz.table_machine import TableMachine

    for m in (TableMachine, PlannerMachine, AdapterMachine, PlannerContractMachine):
        assert issubclass(m, SwarmRules), m


def test_a_rule_costs_one_choice_after_the_examples_swarm_draw():
    log: list = []
    n = 6
    run_state_machine_as_test(_toy(n, log), settings=CFG)
    by_example = collections.defaultdict(list)
    for ex, _, seen in log:
        by_example[ex].append(seen)
    long = [v for v in by_example.values() if len(v) >= 5]
    assert long, "no example ran five steps"
    for seen in long:
        # the swarm (p and one flag a rule) is drawn at the first step; every later step is the
        # runner's go-on boolean and one choice for the rule (Hypothesis's own: ~8 on this toy)
        assert [b - a for a, b in zip(seen[1:], seen[2:])] == [2] * (len(seen) - 2), seen


def test_swarm_turns_rules_off_for_whole_examples_and_every_rule_still_runs():
    log: list = []
    n = 6
    run_state_machine_as_test(_toy(n, log), settings=CFG)
    used = collections.defaultdict(set)
    steps = collections.Counter()
    for ex, i, _ in log:
        used[ex].add(i)
        steps[ex] += 1
    assert set().union(*used.values()) == set(range(n)), "a rule never ran"
    long = [ex for ex in used if steps[ex] >= 20]
    assert long, "no example ran twenty steps"
    # with every rule on, twenty steps over six rules miss one with probability ~ 6 * (5/6)**20 = 0.16
    narrowed = [ex for ex in long if len(used[ex]) <= n - 2]
    assert len(narrowed) >= len(long) // 4, (len(narrowed), len(long))


def test_a_rule_whose_precondition_fails_never_runs_and_no_example_is_discarded():
    log: list = []
    # r1 may never run; r0 is the only other rule, so every example where the swarm turns r0
    # off has a valid rule off only: it must run r0 anyway (Hypothesis's filter would discard it)
    m = _toy(2, log, with_precondition={1: lambda self: False})
    run_state_machine_as_test(m, settings=CFG)
    assert {i for _, i, _ in log} == {0}
    steps = collections.Counter(ex for ex, _, _ in log)
    assert len(steps) >= 100 and min(steps.values()) >= 1


class _Buggy(SwarmRules):
    """Fails once ``boom`` runs after ``load`` stored a value over 5: the minimal failure is
    two steps, ``load`` drawing 6, then ``boom``."""

    @initialize()
    def start(self):
        self.v = 0

    @rule(data=st.data())
    def load(self, data):
        self.v = data.draw(st.integers(0, 100), label="value")

    @rule()
    def noise(self):
        pass

    @rule()
    def other(self):
        pass

    @rule()
    def boom(self):
        assert self.v <= 5, f"boom after {self.v}"


def test_a_failure_shrinks_and_its_report_shows_the_rules_and_draws():
    with pytest.raises(AssertionError) as e:
        run_state_machine_as_test(_Buggy, settings=settings(CFG, max_examples=500))
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert "boom after 6" in str(e.value), str(e.value)
    assert "state.load(data=data(...))" in notes and "state.boom()" in notes, notes
    assert "Draw 1 (value): 6" in notes, notes
    assert "state.noise()" not in notes and "state.other()" not in notes, notes


def test_the_swarm_strategy_is_hypothesis_rule_strategy_with_its_draws_replaced():
    m = _toy(3, [])()
    assert type(m._rules_strategy) is _SwarmRuleStrategy



class _Picks(SwarmRules):
    """Fails when a picked request and a drawn count are both past a threshold: the minimal
    failure picks ``"c"`` and draws 3 (values, not indices, in the report)."""

    @rule(data=st.data())
    def go(self, data):
        from vtoken.fuzz.step_draws import integer, pick

        before = len(current_build_context().data.choices)
        r = pick(data, ["a", "b", "c", "d"], "rid")
        k = integer(data, 0, 1000, "count")
        assert len(current_build_context().data.choices) - before == 2  # one choice each
        assert not (r >= "c" and k >= 3), f"{r} {k}"


def test_pick_and_integer_are_one_choice_each_and_report_values():
    with pytest.raises(AssertionError) as e:
        run_state_machine_as_test(_Picks, settings=settings(CFG, max_examples=500))
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert str(e.value).startswith("c 3"), str(e.value)
    assert "Draw 1 (rid): 'c'" in notes and "Draw 2 (count): 3" in notes, notes
