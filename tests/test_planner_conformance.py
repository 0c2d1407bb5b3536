"""The reclamation planner against its contract (``vtoken.spec.planner``), under the
Hypothesis profile in force (``ci`` by default)."""

import pytest

from vtoken.fuzz.planner_machine import PlannerMachine

pytestmark = pytest.mark.invariants

TestPlannerMachine = PlannerMachine.TestCase
