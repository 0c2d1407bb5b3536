"""``vtoken decode``: run the decode engine on random prompts and report; ``bench_decode``.

``vtoken decode --policy h2o --mode vtoken --requests 8 --prompt-tokens 128 --new-tokens 64
--evict-ratio 0.5 --check-relocations --compare naive-evict --json`` prints tokens/s,
relocations, hash checks, retained blocks and the waste ratio; ``--compare`` runs a second
mode on the same prompts (same policy seed, so the same eviction decisions) and reports
whether every output token matches. With ``--json`` the last line is one JSON object with
at least ``relocations``, ``hash_checks``, ``hash_failures``, ``outputs_equal`` (true /
false / null when not compared) and ``tokens_per_s``.

Exit status: 0 ok; 1 a hash-and-compare failure or an output mismatch; 2 a bad argument; 3 the budget could
not hold the batch (out of blocks).

Owns: nothing beyond one ``DecodeEngine`` per mode run, dropped when it returns.
May call: vtoken.decode, .model, .policies, .errors, .table (its limits), vtoken.invariants.relocation_hash, .args,
torch, numpy.
Costs: one decode per mode (two with ``--compare``): the engine's per-step cost times the steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from ..decode import MODES, DecodeEngine, default_planner_config, make_prompts
from ..errors import AllocatorError, RelocationCheckError, VTokenError
from ..model import DecoderConfig, PagedDecoder
from ..policies import POLICIES
from ..invariants.relocation_hash import RelocationChecker
from ..table import MAX_BLOCK_SIZE, MAX_BLOCKS, MAX_SLOTS
from ..argtypes import device, fraction_in, int_in, nonneg_int, positive_int, writable_dir

__all__ = ["main_decode", "bench_decode", "make_prompts"]


def _first_mismatch(a: list, b: list) -> Optional[dict]:
    for r, (x, y) in enumerate(zip(a, b)):
        if x != y:
            i = next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return {"request": r, "index": i}
    if len(a) != len(b):
        return {"request": min(len(a), len(b)), "index": 0}
    return None


def _run(model, mode, a, prompts, cfg) -> dict:
    eng = DecodeEngine(model, mode=mode, policy=a.policy, evict_ratio=a.evict_ratio if mode != "native" else 0.0,
                       block_size=a.block_size, num_blocks=None, device=a.device,
                       check_relocations=RelocationChecker if a.check_relocations and mode == "vtoken" else None, planner_config=cfg,
                       seed=a.seed, force_sync=a.force_sync, snapshot_dir=a.snapshot_dir)
    if a.budget is not None:
        eng.setup(a.budget)
    out = {"mode": mode}
    try:
        res = eng.run(prompts, a.new_tokens)
    except RelocationCheckError as e:
        chk = eng.checker
        out.update(error=str(e), error_code=e.code, hash_checks=chk.passed if chk else 0,
                   hash_failures=max(1, chk.failed if chk else 1),
                   relocations=eng.manager.stats["applied"] if eng.manager else 0,
                   failures=list(chk.failures) if chk else [])
        return out
    except AllocatorError as e:
        out.update(error=str(e), error_code="out_of_blocks", infeasible=True)
        return out
    out.update(res.to_dict(with_outputs=True))
    return out


def _print_summary(d: dict, stream=sys.stdout) -> None:
    if "error" in d:
        print(f"[{d['mode']}] ERROR {d['error']}", file=stream)
        return
    print(f"[{d['mode']}] policy={d['policy']} evict_ratio={d['evict_ratio']} S={d['block_size']} "
          f"budget={d['num_blocks']} blocks", file=stream)
    print(f"  tokens/s {d['tokens_per_s']:.1f} (decode {d['decode_tokens_per_s']:.1f}); "
          f"step median {d['step_ms_median']:.2f} ms over {d['steps']} steps; wall {d['wall_s']:.2f} s", file=stream)
    print(f"  relocations {d['relocations']} (launched {d['plans_launched']}, aborted {d['plans_aborted']}, "
          f"orphaned {d['plans_orphaned']}, moves {d['moves']}, "
          f"blocks freed by compaction {d['blocks_freed_by_compaction']})", file=stream)
    print(f"  hash checks passed {d['hash_checks']}, failed {d['hash_failures']}", file=stream)
    print(f"  retained blocks: end {d['retained_blocks_end']}, peak {d['retained_blocks_peak']}, "
          f"mean {d['retained_blocks_mean']:.1f} (ideal at end {d['ideal_blocks_end']}); "
          f"waste ratio end {d['waste_ratio_end']:.3f}, mean {d['waste_ratio_mean']:.3f}", file=stream)


# flags that only act in a vtoken run (the planner, its copies and their checks)
_VTOKEN_ONLY = ("check_relocations", "snapshot_dir", "force_sync", "theta_f", "check_every", "headroom", "max_sources")


def _refuse_conflicts(ap: argparse.ArgumentParser, a) -> None:
    """Flags that would be silently ignored, or a budget the token table cannot hold:
    ``ap.error`` (one line, exit 2) before anything is built."""
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    if a.compare is not None and a.compare == a.mode:
        ap.error(f"argument --compare: {a.compare} is --mode already (nothing to compare)")
    if a.mode != "vtoken":  # --compare is never vtoken: no run plans
        for name in _VTOKEN_ONLY:
            if getattr(a, name) not in (None, False):
                ap.error(f"argument {flag(name)}: acts in a vtoken run only (--mode is {a.mode})")
    if a.snapshot_dir is not None and not a.check_relocations:
        ap.error("argument --snapshot-dir: only with --check-relocations (it holds the snapshots of failing "
                 "relocations)")
    if a.mode == "native" and a.compare != "naive-evict":  # native evicts nothing
        for name in ("policy", "evict_ratio"):
            if getattr(a, name) is not None:
                ap.error(f"argument {flag(name)}: native mode evicts nothing (use --compare naive-evict or "
                         f"another --mode)")
    if a.budget is not None and a.budget * a.block_size > MAX_SLOTS:
        ap.error(f"argument --budget: {a.budget} blocks of {a.block_size} slots is more than the token "
                 f"table's {MAX_SLOTS} slots")


def main_decode(argv) -> int:
    ap = argparse.ArgumentParser(prog="vtoken decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", choices=sorted(POLICIES), default=None, help="eviction policy (default h2o)")
    ap.add_argument("--mode", choices=MODES, default="vtoken")
    ap.add_argument("--requests", type=positive_int, default=4)
    ap.add_argument("--prompt-tokens", type=positive_int, default=64)
    ap.add_argument("--new-tokens", type=positive_int, default=64, help="generated tokens per request")
    ap.add_argument("--evict-ratio", type=fraction_in(0, 1), default=None, help="in [0, 1) (default 0.5)")
    ap.add_argument("--device", type=device, default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--budget", type=int_in(2, MAX_BLOCKS, "the null block and at least one more; the table's limit"),
                    default=None,
                    help="KV block budget, the null block included (default: full retention + headroom)")
    ap.add_argument("--block-size", type=int_in(1, MAX_BLOCK_SIZE, "the token table's limit"), default=16)
    ap.add_argument("--check-relocations", action="store_true", help="hash-and-compare every relocation")
    ap.add_argument("--compare", choices=["naive-evict", "native"], default=None,
                    help="also run this mode on the same prompts and compare every output token")
    ap.add_argument("--seed", type=nonneg_int, default=0, help="prompts and the random policy")
    ap.add_argument("--model-seed", type=nonneg_int, default=0)
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    ap.add_argument("--snapshot-dir", type=writable_dir, default=None, help="where failing plans' snapshots are written")
    ap.add_argument("--force-sync", action="store_true", help="host-wait every relocation copy (ablation)")
    ap.add_argument("--threads", type=int_in(1, os.cpu_count() or 1, "the CPUs here"), default=None,
                    help="torch CPU threads")
    ap.add_argument("--theta-f", type=fraction_in(0, 1, hi_open=False), default=None, help="in [0, 1]")
    ap.add_argument("--check-every", type=positive_int, default=None)
    ap.add_argument("--headroom", type=nonneg_int, default=None)
    ap.add_argument("--max-sources", type=positive_int, default=None)
    a = ap.parse_args(argv)
    _refuse_conflicts(ap, a)
    a.policy = a.policy or "h2o"
    a.evict_ratio = 0.5 if a.evict_ratio is None else a.evict_ratio
    if a.threads:
        torch.set_num_threads(a.threads)
    base = default_planner_config()  # the shipped defaults; the flags override single fields
    cfg = replace(base, theta_f=a.theta_f if a.theta_f is not None else base.theta_f,
                  check_every=a.check_every or base.check_every,
                  max_sources=a.max_sources or base.max_sources,
                  headroom=a.headroom if a.headroom is not None else base.headroom,
                  record_snapshots=a.check_relocations)
    model = PagedDecoder(DecoderConfig(seed=a.model_seed))
    prompts = make_prompts(a.requests, a.prompt_tokens, model.config.vocab_size, a.seed)
    main = _run(model, a.mode, a, prompts, cfg)
    _print_summary(main)
    other = None
    equal = None
    if a.compare and a.compare != a.mode:
        other = _run(model, a.compare, a, prompts, cfg)
        _print_summary(other)
        if "outputs" in main and "outputs" in other:
            equal = main["outputs"] == other["outputs"]
            mm = _first_mismatch(main["outputs"], other["outputs"])
            print(f"outputs equal to {a.compare}: {equal}" + (f" (first mismatch {mm})" if mm else ""))
    summary = {k: v for k, v in main.items() if k not in ("outputs",)}
    summary.setdefault("relocations", 0)
    summary.setdefault("hash_checks", 0)
    summary.setdefault("hash_failures", 0)
    summary.setdefault("tokens_per_s", None)
    summary["outputs_equal"] = equal
    summary["prompt_tokens"], summary["new_tokens"], summary["requests"] = a.prompt_tokens, a.new_tokens, a.requests
    if other is not None:
        summary["compare"] = {k: v for k, v in other.items() if k not in ("outputs",)}
        if equal is False:
            summary["first_mismatch"] = _first_mismatch(main["outputs"], other["outputs"])
    if a.json:
        print(json.dumps(summary, sort_keys=True, default=str))
    if main.get("infeasible") or (other or {}).get("infeasible"):
        return 3
    if summary["hash_failures"] or "error" in main or (other is not None and "error" in other) or equal is False:
        return 1
    return 0


# ---------------------------------------------------------------------------- bench
def bench_decode(quick: bool = False, seed: int = 0, threads: Optional[int] = 1, reps: Optional[int] = None) -> dict:
    """Decode step time on CPU: native, naive-evict, vtoken with checks off and on.

    Returns a JSON-able dict: per variant the median per-step process CPU time (ms, the min
    over ``reps`` interleaved repetitions: the machine is shared and noisy; wall times are in
    ``step_wall_ms``), plus the ratios:
    ``indirection_ratio`` = vtoken with eviction off (hooks on: token table, slot mapping,
    planner step) / native; ``hash_overhead_ratio`` = vtoken checks on / off;
    ``vtoken_vs_naive_ratio``. Also relocations, hash checks and whether vtoken's outputs
    equal naive-evict's. ``threads``: torch CPU threads during the bench (restored after).
    """
    if quick:
        R, P, N, S, reps_d = 4, 32, 16, 4, 1
    else:
        R, P, N, S, reps_d = 16, 128, 96, 16, 2
    reps = reps or reps_d
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        model = PagedDecoder()
        prompts = make_prompts(R, P, model.config.vocab_size, seed)
        variants = {
            "native": dict(mode="native", evict_ratio=0.0),
            "indirection_only": dict(mode="vtoken", evict_ratio=0.0),
            "naive-evict": dict(mode="naive-evict", evict_ratio=0.5),
            "vtoken": dict(mode="vtoken", evict_ratio=0.5),
            "vtoken_checked": dict(mode="vtoken", evict_ratio=0.5, check_relocations=RelocationChecker),
        }
        step_ms = {k: [] for k in variants}
        cpu_ms = {k: [] for k in variants}
        extra = {}
        for _ in range(reps):
            for name, kw in variants.items():
                eng = DecodeEngine(model, policy="h2o", block_size=S, seed=seed,
                                   planner_config=default_planner_config(headroom=8), **kw)
                res = eng.run(prompts, N)
                step_ms[name].append(res.step_ms_median)
                cpu_ms[name].append(res.step_cpu_ms_median)
                extra[name] = res
        # Ratios from process CPU time per step (min over reps): with one torch thread it is the
        # work done, nearly blind to other processes on a shared box. Wall times reported too.
        med = {k: min(v) for k, v in cpu_ms.items()}
        out = {
            "requests": R, "prompt_tokens": P, "new_tokens": N, "block_size": S, "reps": reps,
            "torch_threads": torch.get_num_threads(), "metric": "median per-step process CPU time, min over reps",
            "step_ms": med,
            "step_wall_ms": {k: min(v) for k, v in step_ms.items()},
            "indirection_ratio": med["indirection_only"] / med["native"],
            "hash_overhead_ratio": med["vtoken_checked"] / med["vtoken"],
            "vtoken_vs_naive_ratio": med["vtoken"] / med["naive-evict"],
            "relocations": extra["vtoken"].relocations,
            "relocations_checked": extra["vtoken_checked"].relocations,
            "hash_checks": extra["vtoken_checked"].hash_checks,
            "hash_failures": extra["vtoken_checked"].hash_failures,
            "outputs_equal": extra["vtoken"].outputs == extra["naive-evict"].outputs
            and extra["vtoken_checked"].outputs == extra["naive-evict"].outputs,
            "indirection_outputs_equal_native": extra["indirection_only"].outputs == extra["native"].outputs,
            "retained_blocks_end": {k: extra[k].retained_blocks_end for k in ("native", "naive-evict", "vtoken")},
        }
        for k, v in med.items():
            print(f"{k:18s} median step {v:.2f} ms CPU ({out['step_wall_ms'][k]:.2f} ms wall)", flush=True)
        print(f"indirection-only / native {out['indirection_ratio']:.3f}; hash-and-compare overhead "
              f"{out['hash_overhead_ratio']:.3f}; vtoken / naive-evict {out['vtoken_vs_naive_ratio']:.3f}", flush=True)
        return out
    finally:
        torch.set_num_threads(old_threads)
