"""Progress bars for long runs (fuzz campaigns, planted-fault runs, the audit, simulations).

:func:`bar` is a ``tqdm`` bar on ``stream`` (stderr by default) when that stream is a
terminal, and a disabled one otherwise: logs, CI and pipes get no progress noise, only the
runs' own result lines. ``VTOKEN_PROGRESS=0`` turns bars off on a terminal too,
``VTOKEN_PROGRESS=1`` forces them on (what the tests use to see one). Results never go
through a bar: a caller prints them itself (``bar.write`` keeps them above a live bar).
Owns: nothing (the caller owns the bar and closes it).
May call: tqdm.
Costs: O(1) per update; tqdm throttles redraws (10 a second at most).
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm


def enabled(stream=None) -> bool:
    """Bars on ``stream``? ``VTOKEN_PROGRESS`` (``0`` / ``1``) decides when set, else: is it a terminal."""
    force = os.environ.get("VTOKEN_PROGRESS")
    if force in ("0", "1"):
        return force == "1"
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def bar(total=None, desc: str = "", unit: str = "it", stream=None) -> tqdm:
    """A progress bar (``total`` None: a counter), disabled off a terminal (:func:`enabled`)."""
    stream = stream if stream is not None else sys.stderr
    return tqdm(total=total, desc=desc, unit=unit, file=stream, disable=not enabled(stream), leave=False,
                dynamic_ncols=True, mininterval=0.1)
