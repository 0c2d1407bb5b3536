"""Output files: ``<name>.md``, ``<name>.json`` and ``<name>.png`` per experiment.

Owns: nothing (writes the files it is given).
May call: json, matplotlib, numpy; never spec/, invariants/, fuzz/ or reports/.
Costs: O(result size) per write, plus the figure's rendering.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np


def default_out() -> Path:
    """``./reports/simulate-<timestamp>`` of the directory the user runs in (never the
    install's own folder)."""
    return Path.cwd() / "reports" / f"simulate-{time.strftime('%Y%m%d-%H%M%S')}"


def out_dir(out) -> Path:
    p = Path(out) if out else default_out()
    p.mkdir(parents=True, exist_ok=True)
    return p


def _jsonable(o):
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return _jsonable(o.tolist())
    if isinstance(o, Path):
        return str(o)
    return o


def write(out: Path, name: str, result: dict, markdown: str, fig=None) -> dict:
    """Write the three files; returns ``{"md", "json", "png"}`` paths (png None without a figure)."""
    files = {"md": str(out / f"{name}.md"), "json": str(out / f"{name}.json"), "png": None}
    if fig is not None:
        files["png"] = str(out / f"{name}.png")
        fig.savefig(files["png"], dpi=110, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(fig)
    result["files"] = files
    with open(files["json"], "w") as f:
        json.dump(_jsonable(result), f, indent=1, sort_keys=True)
    with open(files["md"], "w") as f:
        f.write(markdown.rstrip() + "\n")
        if files["png"]:
            f.write(f"\n![{name}]({os.path.basename(files['png'])})\n")
    return files


def plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as pyplot

    return pyplot


def md_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        out.append("| " + " | ".join(str(x) for x in r) + " |")
    return "\n".join(out)
