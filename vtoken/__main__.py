"""``python -m vtoken``: the command line (``vtoken.cli.main``).

Owns: nothing.
May call: ``vtoken.cli.main`` only (the commands' layer; the system never imports the toolkit).
Costs: O(1) plus the chosen command.
"""

from __future__ import annotations

import sys

from vtoken.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
