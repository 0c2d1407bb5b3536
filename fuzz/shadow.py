"""Shadow trees: a copy of the package, laid out as installed, that a run imports instead.

The planted-fault runner and the mutation tool both test a changed copy of the shipped
code without touching it: :func:`snapshot` copies ``vtoken/`` and the toolkit folders
(``spec/``, ``invariants/``, ``fuzz/`` as ``vtoken/spec`` ... per pyproject's package-dir
mapping) once; :func:`make_shadow` makes a cheap per-run copy (hard links) into which one
changed module is written; a process started with the shadow first on ``PYTHONPATH`` (and
its working directory there) imports that copy. :func:`imported_from_shadow` lets the run
prove it did.

Owns: nothing beyond the directories it is told to make (callers delete them).
May call: os, shutil, pathlib, sys.
Costs: ``snapshot`` O(tree bytes) once; ``make_shadow`` O(files) hard links.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Optional

# pyproject's package-dir mapping: repository folder -> its place in the shadow package
SUBPACKAGES = {"spec": "vtoken/spec", "invariants": "vtoken/invariants", "fuzz": "vtoken/fuzz",
               "reports": "vtoken/reports"}
LAYOUT = {"vtoken": "vtoken", **SUBPACKAGES}


def _ignore(_dir, names):
    # report output folders (reports/<timestamp>-...) and caches are not sources
    return [n for n in names if n in ("__pycache__", ".hypothesis", ".pytest_cache") or n.endswith(".pyc")
            or ("-vllm-" in n and not n.endswith(".py"))]


def snapshot(repo: Path, dest: Path) -> Path:
    """Copy the package sources into ``dest`` laid out as the installed package."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(repo / "vtoken", dest / "vtoken", ignore=_ignore)
    for folder, target in SUBPACKAGES.items():
        if not (repo / folder).is_dir():  # a tree without that toolkit folder (a test's tiny repo)
            continue
        if (dest / target).exists():
            shutil.rmtree(dest / target)
        shutil.copytree(repo / folder, dest / target, ignore=_ignore)
    return dest


def _link_or_copy(s, d):
    try:
        os.link(s, d)
    except OSError:
        shutil.copy2(s, d)


def make_shadow(snap: Path, dest: Path, mutant=None) -> Path:
    """A per-run copy of the snapshot (hard links); ``mutant`` (with ``.file`` and
    ``.source``) has its module written in. Files to change later must be unlinked first
    (never write through a hard link into the snapshot)."""
    shutil.copytree(snap, dest, copy_function=_link_or_copy)
    if mutant is not None:
        target = dest / mutant.file
        target.unlink()
        target.write_text(mutant.source)
    return dest


def env_for(shadow: Path, base: Optional[dict] = None) -> dict:
    """The environment of a process that must import the shadow's ``vtoken``."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = str(shadow) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("PYTHONHASHSEED", "0")  # a run is a function of (code, seed): no hash randomization
    return env


def imported_from_shadow(shadow: Path) -> list[str]:
    """``vtoken`` modules of this process NOT imported from ``shadow`` (empty: all were)."""
    root = os.path.abspath(shadow) + os.sep
    bad = []
    for name, mod in list(sys.modules.items()):
        if name != "vtoken" and not name.startswith("vtoken."):
            continue
        f = getattr(mod, "__file__", None)
        if f is not None and not os.path.abspath(f).startswith(root):
            bad.append(f"{name} from {f}")
    return bad
