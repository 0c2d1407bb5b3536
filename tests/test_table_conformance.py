"""The token table against the reference model, under the Hypothesis profile in force."""

import pytest

from vtoken.fuzz.table_machine import TableMachine

pytestmark = pytest.mark.invariants

TestTableMachine = TableMachine.TestCase
