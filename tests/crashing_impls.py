"""Token tables that take their worker down with them (what an out-of-memory kill or a bug in
a user's native code does): the campaign must call such a run a failure, never a pass.

Each builds as ``AltTable`` does (the up-front ``check_impl`` build passes), then dies on its
first ``sync_new_tokens``, the first operation every example of the table machine makes:

- ``SegfaultingAltTable``: the process kills itself with SIGSEGV (a crash in native code);
- ``ExitingAltTable``: ``os._exit(0)``, a clean exit status with nothing reported;
- ``DbClobberingAltTable``: replaces the campaign's example-database folder (named in
  ``VTOKEN_TEST_CLOBBER_DB``) by a file, once, then behaves as ``AltTable`` (the database
  stops accepting writes mid-campaign).

``IdleMachine`` is a state machine that runs and checks nothing (a planted-fault run on it
ran 0 operations).
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import time

from hypothesis.stateful import rule

from tests.alt_table import AltTable
from vtoken.fuzz.step_draws import SwarmRules


def _segfault():
    faulthandler.disable()  # (pytest's dump of the crash would only clutter the test's output)
    os.kill(os.getpid(), signal.SIGSEGV)


class SegfaultingAltTable(AltTable):
    def sync_new_tokens(self, req_id, block_ids, total_len):
        _segfault()


class ExitingAltTable(AltTable):
    def sync_new_tokens(self, req_id, block_ids, total_len):
        os._exit(0)


class DbClobberingAltTable(AltTable):
    def sync_new_tokens(self, req_id, block_ids, total_len):
        path = os.environ.get("VTOKEN_TEST_CLOBBER_DB")
        if path and os.path.isdir(path):  # once: the folder becomes a file of the same name
            shutil.rmtree(path)
            with open(path, "w") as f:
                f.write("not a folder\n")
        return super().sync_new_tokens(req_id, block_ids, total_len)


class IdleMachine(SwarmRules):
    """A machine whose examples check nothing (its ``ops`` never moves): a detection run on it
    that finds nothing is no clean run."""

    ops = 0

    @rule()
    def nothing(self):
        pass


class SegfaultingMachine(SwarmRules):
    """A machine whose first step kills its process with SIGSEGV, half a second in (so what
    the worker reported before, a queue's background thread sends, has left the process)."""

    ops = 0

    @rule()
    def crash(self):
        time.sleep(0.5)
        _segfault()
