#!/usr/bin/env python3
"""The GPU check (run by scripts/gpu_check.sh on a machine with a CUDA device), < 10 minutes.

Phases, each with its own time limit, each reported even when another fails:

1. ``tests``: ``pytest -m gpu tests/test_gpu.py`` (streams/events/wait, graph replay with the
   slot buffer updated in place, the ordering faults caught by the sentinel probe, a decode
   on the device equal to Naive-Evict's);
2. ``sanitizer``: ``vtoken decode --device cuda --check-relocations --compare naive-evict``
   under ``TORCH_CUDA_SANITIZER=1`` (CSAN: unsynchronised cross-stream accesses raise);
3. ``i3``: I3 checked directly with the sentinel probe (clean, and each ordering fault), and a
   sentinel-mode decode (destinations filled with a sentinel, relocation stream delayed, every
   attention input checked) equal to Naive-Evict's;
4. ``bandwidth``: the copy engine's device time for a large plan against a plain device
   copy of the same number of bytes.

Prints one JSON object as its last line and writes it to ``$OUT/gpu_check.json`` when
``OUT`` is set. Exit 0 only if every phase passed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMITS = {"tests": 240, "sanitizer": 150, "i3": 60, "bandwidth": 60}


def bootstrap() -> None:
    """Make ``vtoken.invariants`` / ``vtoken.spec`` / ``vtoken.fuzz`` importable from a plain
    checkout (pyproject maps the top-level folders there only when the package is installed)."""
    sys.path.insert(0, str(ROOT))
    import vtoken

    for sub, folder in (("invariants", "invariants"), ("spec", "spec"), ("fuzz", "fuzz")):
        name = f"vtoken.{sub}"
        if name in sys.modules or not (ROOT / folder / "__init__.py").exists():
            continue
        try:
            if importlib.util.find_spec(name) is not None:
                continue
        except ModuleNotFoundError:
            pass
        spec = importlib.util.spec_from_file_location(name, ROOT / folder / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / folder)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        setattr(vtoken, sub, mod)
        try:
            spec.loader.exec_module(mod)
        except Exception:  # e.g. fuzz needs hypothesis; the GPU check does not need it
            del sys.modules[name]
            delattr(vtoken, sub)


def _sub(args: list, limit: int, env=None) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, str(Path(__file__).resolve())] + args, cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=limit)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), \
            (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    return {"rc": rc, "stdout": out, "stderr": err, "wall_s": round(time.perf_counter() - t0, 1)}


def _last_json(text: str):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


# ---------------------------------------------------------------------------- phases
def phase_tests() -> dict:
    xml = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_tests_{os.getpid()}.xml"
    r = _sub(["--pytest", "tests/test_gpu.py", "-m", "gpu", "-o", "addopts=", "-p", "no:cacheprovider",
              "--noconftest", "-q", "-rs", f"--junitxml={xml}"], LIMITS["tests"])
    out = {"ok": r["rc"] == 0, "rc": r["rc"], "wall_s": r["wall_s"]}
    try:
        import xml.etree.ElementTree as ET

        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        out.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        out["failed_tests"] = [tc.get("name") for tc in suite.iter("testcase")
                               if tc.find("failure") is not None or tc.find("error") is not None]
    except Exception as e:  # no xml: pytest did not get that far
        out["xml_error"] = repr(e)
    if not out["ok"]:
        out["tail"] = (r["stdout"] + r["stderr"])[-4000:]
    return out


def phase_sanitizer() -> dict:
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    r = _sub(["--decode", "--device", "cuda", "--policy", "random", "--requests", "2", "--prompt-tokens", "16",
              "--new-tokens", "24", "--block-size", "4", "--check-relocations", "--compare", "naive-evict",
              "--theta-f", "0.1", "--check-every", "1", "--headroom", "6", "--json"], LIMITS["sanitizer"], env=env)
    d = _last_json(r["stdout"]) or {}
    text = r["stdout"] + r["stderr"]
    races = ("CSAN" in text) or ("data race" in text)
    out = {"ok": r["rc"] == 0 and not races and d.get("outputs_equal") is True and d.get("relocations", 0) > 0,
           "rc": r["rc"], "wall_s": r["wall_s"], "csan_reports": races,
           "relocations": d.get("relocations"), "hash_checks": d.get("hash_checks"),
           "hash_failures": d.get("hash_failures"), "outputs_equal": d.get("outputs_equal"),
           "prefill_fallback": d.get("prefill_fallback")}
    if not out["ok"]:
        out["tail"] = text[-4000:]
    return out


def phase_i3() -> dict:
    import torch

    from vtoken.invariants.i3_probe import i3_probe
    from vtoken.decode_cli import make_prompts
    from vtoken.engine import DecodeEngine
    from vtoken.kvcache import KVCache
    from vtoken.model import PagedDecoder
    from vtoken.planner import PlannerConfig

    def cache():
        kv = KVCache(2, 64, 16, 2, 64, dtype=torch.float16, device="cuda", checked=False)
        kv.kv.normal_()
        return kv

    probes = []
    expect = [(None, "wait", False), (None, "poll", False), ("cuda_wait_dropped", "wait", True),
              ("cuda_event_wrong_stream", "wait", True), ("cuda_event_wrong_stream", "poll", True),
              ("cuda_release_before_event", "poll", True)]
    ok = True
    for fault, scen, violation in expect:
        r = i3_probe(cache(), scenario=scen, fault=fault, sleep_cycles=400_000_000)
        r["expected_violation"] = violation
        r["ok"] = r["sentinel_seen"] == violation and r["bytes_equal"] != violation
        ok &= r["ok"]
        probes.append(r)
    model = PagedDecoder()
    prompts = make_prompts(4, 32, model.config.vocab_size, seed=5)
    cfg = PlannerConfig(theta_f=0.1, check_every=1, max_sources=8, headroom=8)
    kw = dict(policy="h2o", evict_ratio=0.5, block_size=4, device="cuda", planner_config=cfg)
    ref = DecodeEngine(model, mode="naive-evict", **kw).run(prompts, 32)
    eng = DecodeEngine(model, mode="vtoken", copy_kwargs={"sentinel": True, "sleep_cycles": 50_000_000},
                       sentinel_check=True, check_relocations=True, **kw)
    res = eng.run(prompts, 32)
    dec = {"relocations": res.relocations, "hash_checks": res.hash_checks, "hash_failures": res.hash_failures,
           "outputs_equal": res.outputs == ref.outputs, "device_waits": res.copy_stats["device_waits"],
           "host_syncs": res.copy_stats["host_syncs"], "prefill_fallback": res.prefill_fallback}
    ok &= dec["outputs_equal"] and dec["hash_failures"] == 0 and dec["relocations"] > 0
    return {"ok": bool(ok), "probes": probes, "sentinel_decode": dec}


def phase_bandwidth() -> dict:
    import numpy as np
    import torch

    from vtoken.copy_engine import KVCopyEngine, _ProbePlan
    from vtoken.kvcache import KVCache

    S, L, H, D, NB = 16, 32, 8, 128, 1024
    kv = KVCache(L, NB, S, H, D, dtype=torch.float16, device="cuda", checked=False)
    n = 4096
    rng = np.random.default_rng(0)
    src = np.sort(rng.choice(np.arange(S, 512 * S), size=n, replace=False))
    dst = np.arange(512 * S, 512 * S + n)
    moves = np.stack([np.arange(n), src // S, src % S, dst // S, dst % S], axis=1)
    eng = KVCopyEngine(kv, S, timed=True)
    for _ in range(2):
        eng.wait(eng.launch(_ProbePlan(0, moves)))
    ms, launch_us = [], []
    for i in range(10):
        t0 = time.perf_counter()
        h = eng.launch(_ProbePlan(i + 1, moves))
        launch_us.append((time.perf_counter() - t0) * 1e6)
        eng.wait(h)
        ms.append(eng.copy_ms(h))
    nbytes = n * kv.bytes_per_token
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(2):
        b.copy_(a)
    ref = []
    for _ in range(10):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        b.copy_(a)
        t1.record()
        t1.synchronize()
        ref.append(t0.elapsed_time(t1))
    med = float(np.median(ms))
    rmed = float(np.median(ref))
    return {"ok": True, "moves": n, "bytes": nbytes, "copy_engine_ms": med,
            "copy_engine_gbps": 2 * nbytes / med / 1e6, "device_copy_ms": rmed,
            "device_copy_gbps": 2 * nbytes / rmed / 1e6, "copy_engine_vs_device_copy": rmed / med,
            "host_launch_us_median": float(np.median(launch_us)),
            "note": "GB/s count bytes read + written; the engine gathers into a temporary then scatters"}


# ---------------------------------------------------------------------------- main
def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--pytest":
        bootstrap()
        import pytest

        return int(pytest.main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "--decode":
        bootstrap()
        from vtoken.decode_cli import main_decode

        return int(main_decode(sys.argv[2:]))
    bootstrap()
    t_start = time.perf_counter()
    summary = {"ok": False, "phases": {}}
    try:
        import torch

        summary["torch"] = torch.__version__
        summary["cuda_available"] = torch.cuda.is_available()
        if not torch.cuda.is_available():
            summary["error"] = "torch.cuda.is_available() is False"
            print(json.dumps(summary))
            return 2
        summary["device"] = torch.cuda.get_device_name()
    except Exception as e:
        summary["error"] = f"torch import failed: {e!r}"
        print(json.dumps(summary))
        return 2
    only = [a for a in sys.argv[1:] if not a.startswith("-")] or ["tests", "sanitizer", "i3", "bandwidth"]
    phases = {"tests": phase_tests, "sanitizer": phase_sanitizer, "i3": phase_i3, "bandwidth": phase_bandwidth}
    for name in only:
        t0 = time.perf_counter()
        try:
            res = phases[name]()
        except Exception as e:
            res = {"ok": False, "error": repr(e), "traceback": traceback.format_exc()[-3000:]}
        res.setdefault("wall_s", round(time.perf_counter() - t0, 1))
        summary["phases"][name] = res
        print(f"[gpu_check] {name}: {'ok' if res.get('ok') else 'FAILED'} ({res['wall_s']} s)", flush=True)
    summary["ok"] = all(p.get("ok") for p in summary["phases"].values())
    summary["wall_s"] = round(time.perf_counter() - t_start, 1)
    line = json.dumps(summary, default=str)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_check.json").write_text(line + "\n")
    print(line)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
