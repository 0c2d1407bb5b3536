"""Capacity in vLLM's real engine at a fixed KV memory (``vtoken bench engine``): plain vLLM (no
eviction), Naive-Evict and vtoken, side by side in one run.

One workload (``requests`` prompts of ``prompt_len`` tokens, ``new_tokens`` generated each,
greedy), one KV pool of ``num_blocks`` blocks of ``block_size``, the same for every mode:

- ``plain``: vLLM unchanged (its own attention, no eviction), its scheduler watched;
- ``naive-evict``: vtoken's worker and attention, ``evict_ratio`` of every request evicted
  (H2O by default), whole blocks freed only when all their tokens died;
- ``vtoken``: the same evictions with vtoken's reclamation.

Per mode: **capacity**, the largest batch (``max_num_seqs``) that runs the workload to its end
without a preemption, found by bisection on ``[1, requests]`` (a run with no preemption at ``b``
raises the floor, one with any lowers the ceiling); and the **workload run** at ``max_num_seqs =
requests`` (what vLLM does unbounded): its peak of requests running, its preemptions and its
generated tokens per second (timed as served: the runtime checks and hash-and-compare off unless
``--checks``). The paper reports 5 -> 8 and 11 -> 22 requests at its budgets (the
simulator here reaches the ideal, 10 / 22). ``capacity_ratio`` = vtoken / Naive-Evict capacity;
``throughput_ratio`` = vtoken / Naive-Evict tokens per second of the workload run. Every engine
of a mode is built in one process for the mode, one after the other.

Runs where vLLM's engine runs (``vtoken bench engine`` picks the engine environment); the last
stdout line is one JSON object.
Owns: the engines it builds, shut down one by one.
May call: vtoken.vllm_engine (run), vLLM.
Costs: per mode about log2(requests) + 1 engine runs of the workload (a few seconds each here).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

MODES = ("plain", "naive-evict", "vtoken")
DEFAULT = dict(requests=24, new_tokens=256, prompt_len=64, prompt_jitter=0, block_size=32, num_blocks=64,
               policy="h2o", evict_ratio=0.5, seed=0, checks=False)


def _run(mode: str, cfg: dict, max_num_seqs: int) -> dict:
    """One run of the workload in this process; returns its counters."""
    from vtoken.vllm_engine.run import run

    spec = dict(mode=mode, requests=cfg["requests"], new_tokens=cfg["new_tokens"], prompt_len=cfg["prompt_len"],
                prompt_jitter=cfg["prompt_jitter"], block_size=cfg["block_size"], num_blocks=cfg["num_blocks"],
                max_num_seqs=max_num_seqs, max_model_len=cfg["prompt_len"] + cfg["new_tokens"] + 64,
                seed=cfg["seed"], settings={"policy": cfg["policy"], "evict_ratio": cfg["evict_ratio"],
                                            "checks": cfg["checks"], "check_relocations": cfg["checks"]})
    res = run(spec)
    sched = (res["stats"] or {}).get("scheduler", {})
    return {"max_num_seqs": max_num_seqs, "preemptions": int(sched.get("preemptions", 0)),
            "peak_running": int(sched.get("peak_running", 0)),
            "peak_running_before_preemption": int(sched.get("peak_running_before_preemption", 0)),
            "peak_used_blocks": int(sched.get("peak_used_blocks", 0)),
            "tokens_per_s": round(res["generated"] / max(res["generate_s"], 1e-9), 1), "generated": res["generated"],
            "generate_s": res["generate_s"], "closed": (res["stats"] or {}).get("closed")}


def capacity(mode: str, cfg: dict) -> tuple[int, list]:
    """The largest ``max_num_seqs`` in ``[1, requests]`` with no preemption (bisection), and the probes."""
    lo, hi, probes = 0, cfg["requests"] + 1, []  # lo: known to run clean (0: none), hi: known to preempt
    while hi - lo > 1:
        b = (lo + hi) // 2
        r = _run(mode, cfg, b)
        probes.append({"max_num_seqs": b, "preemptions": r["preemptions"]})
        lo, hi = (b, hi) if r["preemptions"] == 0 else (lo, b)
    return lo, probes


def one_mode(mode: str, cfg: dict) -> dict:
    """A mode's capacity and workload run, in this process (a process per mode: vLLM resolves its
    KV layout once per process, and vtoken's attention needs its own)."""
    import vllm

    t0 = time.perf_counter()
    cap, probes = capacity(mode, cfg)
    work = _run(mode, cfg, cfg["requests"])
    return dict(work, capacity=cap, probes=probes, seconds=round(time.perf_counter() - t0, 1),
                vllm_version=vllm.__version__)


def bench_engine(python: str | None = None, **kw) -> dict:
    """Every mode in a process of its own (``python``: the engine environment's interpreter)."""
    import subprocess

    cfg = dict(DEFAULT, **kw)
    out = {"config": cfg, "modes": {}}
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("OMP_NUM_THREADS", "1")
    for mode in MODES:
        p = subprocess.run([python or sys.executable, "-m", "vtoken.reports.bench_engine", "--one-mode", mode,
                            "--config", json.dumps(cfg)], capture_output=True, text=True, env=env, timeout=3600,
                           cwd=tempfile.gettempdir())  # -m: no checkout's vtoken from the working directory
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            tail = "\n".join((p.stdout + p.stderr).splitlines()[-30:])
            raise RuntimeError(f"bench engine: mode {mode} failed (exit {p.returncode}):\n{tail}")
        out["modes"][mode] = json.loads(lines[-1])
    m = out["modes"]
    out["vllm_version"] = m["vtoken"]["vllm_version"]
    out["capacity_ratio"] = round(m["vtoken"]["capacity"] / max(m["naive-evict"]["capacity"], 1), 3)
    out["capacity_ratio_vs_plain"] = round(m["vtoken"]["capacity"] / max(m["plain"]["capacity"], 1), 3)
    out["throughput_ratio"] = round(m["vtoken"]["tokens_per_s"] / max(m["naive-evict"]["tokens_per_s"], 1e-9), 3)
    out["throughput_ratio_vs_plain"] = round(m["vtoken"]["tokens_per_s"] / max(m["plain"]["tokens_per_s"], 1e-9), 3)
    return out


def table(res: dict) -> str:
    c = res["config"]
    lines = [f"capacity at {c['num_blocks']} KV blocks of {c['block_size']} tokens: {c['requests']} requests x "
             f"({c['prompt_len']} + {c['new_tokens']}) tokens, {c['policy']} evicting {c['evict_ratio']:.0%} "
             f"(vLLM {res['vllm_version']}; checks {'on' if c['checks'] else 'off'})",
             f"{'mode':>12} | capacity (no preemption) | workload: peak running, preemptions, tokens/s"]
    for mode, m in res["modes"].items():
        lines.append(f"{mode:>12} | {m['capacity']:>24} | {m['peak_running']:>4}, {m['preemptions']:>4}, "
                     f"{m['tokens_per_s']:>8}")
    lines.append(f"vtoken / Naive-Evict: capacity x{res['capacity_ratio']}, throughput x{res['throughput_ratio']}; "
                 f"vtoken / plain: capacity x{res['capacity_ratio_vs_plain']}, throughput "
                 f"x{res['throughput_ratio_vs_plain']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    from vtoken.argtypes import fraction_in, nonneg_int, positive_int

    ap = argparse.ArgumentParser(prog="python -m vtoken.reports.bench_engine")
    for name in ("requests", "new_tokens", "prompt_len", "block_size", "num_blocks"):
        ap.add_argument("--" + name.replace("_", "-"), type=positive_int, default=DEFAULT[name])
    ap.add_argument("--evict-ratio", type=fraction_in(0, 1), default=DEFAULT["evict_ratio"])
    ap.add_argument("--policy", default=DEFAULT["policy"], choices=["h2o", "streaming", "scissorhands", "random"])
    ap.add_argument("--seed", type=nonneg_int, default=0)
    ap.add_argument("--checks", action="store_true", help="the runtime checks and hash-and-compare on")
    ap.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    ap.add_argument("--json", action="store_true", help="(the last stdout line is one JSON object either way)")
    ap.add_argument("--python", default=None, help="the engine environment's interpreter (default: this one)")
    ap.add_argument("--one-mode", choices=MODES, default=None, help=argparse.SUPPRESS)  # a child: one mode
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one_mode:
        print(json.dumps(one_mode(a.one_mode, json.loads(a.config))), flush=True)
        return 0
    kw = {k: getattr(a, k) for k in ("requests", "new_tokens", "prompt_len", "block_size", "num_blocks", "evict_ratio",
                                     "policy", "seed", "checks")}
    if a.quick:
        kw.update(requests=8, new_tokens=96, num_blocks=24)
    res = bench_engine(python=a.python, **kw)
    print(table(res), flush=True)
    print(json.dumps(res, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
