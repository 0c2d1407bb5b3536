"""The planted-bug catalogue: how strong are the checks?

Each entry is a deliberate bug compiled into ``vtoken`` behind a name (``vtoken.faults``),
drawn from the bug classes real KV managers have shipped (``shared/design/PRIOR_ART.md``),
and the detector expected to catch it. ``vtoken fuzz --planted all`` switches each on in
turn (in its own process) and reports, per fault: detected or not, the time to detection,
the size of the shrunk example (steps) and the time spent shrinking, separately.

Detectors:
- ``table``: the token-table conformance machine (``fuzz/table_machine.py``);
- ``planner``: the planner machine (``fuzz/planner_machine.py``);
- ``z3``: plans made by the real planner, checked by the Z3 I1-I4 encoding on their snapshots;
- ``placement``: the bounded Z3 proof of the placement rule;
- ``decode``: a small decode with relocations, hash-and-compare and output comparison;
- ``vllm``: the audit's decode through the vLLM adapter (needs vLLM installed);
- ``gpu``: the CUDA ordering tests (only where a GPU is present).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    name: str
    bug_class: str  # PRIOR_ART.md bug class, or the invariant it breaks
    what: str
    detector: str


CATALOGUE = [
    Fault("alloc_double_free", "1 double free", "the allocator accepts freeing a block more times than it is referenced", "table"),
    Fault("alloc_queue_dup", "2 block in the free queue twice", "a still-referenced block is queued as free", "table"),
    Fault("waste_drift", "3 accounting drift", "the live-slot total is not decremented on eviction (F drifts)", "table"),
    Fault("refcount_leak", "4 ref-count leak", "finishing a request keeps its reference on shared blocks", "table"),
    Fault("slot_formula_wrong_s", "5 wrong block size in the slot formula", "new tokens' slots use S+1 as the block size", "table"),
    Fault("stale_slot_after_move", "6 stale lookup cache after a move", "the device slot cache is not updated by apply_moves", "table"),
    Fault("nb_double_count", "3 accounting drift (n_b)", "n_b counts a shared slot once per request", "table"),
    Fault("nonatomic_apply_moves", "I2 non-atomic failed apply_moves", "a failing move list applies its valid prefix", "table"),
    Fault("dup_dst_accepted", "9 duplicate destination slot", "apply_moves accepts two moves into one slot", "table"),
    Fault("evict_wrong_token", "I1 eviction of the wrong token", "eviction marks the next token dead", "table"),
    Fault("release_nonempty", "9 phantom slot after compaction", "a block with live tokens is released", "table"),
    Fault("headroom_leak", "3 accounting drift (reservations)", "reserved headroom blocks stay allocatable", "planner"),
    Fault("plan_moves_shared", "7 a shared-prefix block moved", "shared blocks are compaction sources", "planner"),
    Fault("plan_moves_tail", "I4 tail block moved", "the block being written is a compaction source", "planner"),
    Fault("plan_nondecreasing", "I4 non-decreasing plan accepted", "a plan that frees no block is made", "planner"),
    Fault("plan_dup_dst", "9 duplicate destination slot (planner)", "the planner gives two tokens one destination", "planner"),
    Fault("plan_overlaps_inflight", "I4 overlap with an in-flight plan", "a block of an in-flight plan is planned again", "planner"),
    Fault("free_sources_at_plan", "8 source freed before its copy completed", "sources return to the allocator at launch", "planner"),
    Fault("apply_before_complete", "8/I3 read before the copy completes", "a pending copy is applied (slot mapping switched) without its fence", "planner"),
    Fault("abort_leaks_dests", "4 leak on a copy aborted part-way", "an aborted plan's destinations never return", "planner"),
    Fault("finish_frees_inflight_sources", "8 source reused before its copy completes", "finishing a request frees blocks an in-flight copy reads", "planner"),
    Fault("skip_apply", "6 table not updated after the copy", "a completed plan frees sources without updating the table", "planner"),
    Fault("placement_off_by_one", "5 wrong-slot placement", "the k-th moved token goes to slot k+1", "placement"),
    Fault("copy_flip_byte", "I1 corrupted relocation", "one byte of one moved K/V entry flips", "decode"),
    Fault("copy_skip_move", "I1 skipped move", "one move of a plan is not copied", "decode"),
    Fault("adapter_free_before_fence", "8 source freed before its fence (vLLM async scheduling)",
          "the vLLM adapter frees a relocation source before the step that copies it is processed", "vllm"),
    Fault("adapter_stale_prefix_hash", "7 prefix-cache poisoning", "a relocated block keeps a prefix-cache hash", "vllm"),
    Fault("adapter_pop_not_null", "positional block list broken", "a source is popped from vLLM's block list instead of null-substituted", "vllm"),
    Fault("adapter_headroom_to_allocate", "3 reservation leak", "headroom blocks are handed back to vLLM's allocate_slots", "vllm"),
]

GPU_FAULTS = ["cuda_wait_dropped", "cuda_event_wrong_stream", "cuda_release_before_event"]

MACHINES = {"table": "vtoken.fuzz.table_machine:TableMachine", "planner": "vtoken.fuzz.planner_machine:PlannerMachine"}


def _steps(text: str) -> int:
    """Operations in a shrunk state-machine example (setup, invariant checks and teardown excluded)."""
    return len(re.findall(r"^\s*state\.(?!teardown|setup|observable|consistent|check_|invariant)\w+\(", text, flags=re.M))


def _detect_machine(machine_path: str, budget_s: float) -> dict:
    """One Hypothesis run (generate, then shrink). The first failing test case is timed
    through Hypothesis's observability callbacks (coverage collection off), so the time to
    detection and the time spent shrinking are reported separately."""
    import importlib
    import traceback

    from hypothesis import Phase, settings
    from hypothesis.internal.observability import add_observability_callback
    from hypothesis.stateful import run_state_machine_as_test

    from .profiles import load_profile

    load_profile("ci")
    mod, cls = machine_path.split(":")
    machine = getattr(importlib.import_module(mod), cls)
    first_fail = []

    def observe(obs):
        status = getattr(obs, "status", None) or (obs.get("status") if isinstance(obs, dict) else None)
        if status == "failed" and not first_fail:
            first_fail.append(time.perf_counter())

    add_observability_callback(observe)
    t0 = time.perf_counter()
    err = None
    while err is None and time.perf_counter() - t0 < budget_s:
        try:
            run_state_machine_as_test(machine, settings=settings(
                settings(), database=None, max_examples=200,
                phases=[Phase.explicit, Phase.generate, Phase.shrink]))
        except BaseException as e:  # noqa: BLE001 -- any failure of the machine is a detection
            if isinstance(e, KeyboardInterrupt):
                raise
            err = e
    t_end = time.perf_counter()
    if err is None:
        return {"detected": False, "seconds": t_end - t0}
    t_detect = (first_fail[0] if first_fail else t_end) - t0
    text = "".join(traceback.format_exception(err))
    return {"detected": True, "seconds": t_detect, "shrink_seconds": t_end - t0 - t_detect, "steps": _steps(text),
            "error": text.strip().splitlines()[-1][:240] if "state." not in text.strip().splitlines()[-1]
            else next((l for l in text.splitlines() if "Error" in l), "")[:240],
            "example": text[-4000:]}


def _detect_placement(budget_s: float) -> dict:
    from vtoken.invariants.placement_proof import prove_placement

    t0 = time.perf_counter()
    res = prove_placement(n_blocks=4, S=8)
    return {"detected": not res.proved, "seconds": time.perf_counter() - t0, "steps": 0,
            "error": str(res.counterexample)[:240]}


def _detect_decode(budget_s: float) -> dict:
    """A small decode in vtoken mode with hash-and-compare, against naive-evict's outputs."""
    from vtoken.engine import DecodeEngine, default_planner_config
    from vtoken.errors import RelocationCheckError
    from vtoken.model import PagedDecoder

    import numpy as np

    t0 = time.perf_counter()
    model = PagedDecoder()
    prompts = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(4, 32)).tolist()
    outs, detail = {}, ""
    for mode in ("vtoken", "naive-evict"):  # vtoken first: hash-and-compare stops at the first bad relocation
        eng = DecodeEngine(model, mode=mode, policy="random", evict_ratio=0.5, block_size=4,
                           check_relocations=(mode == "vtoken"), planner_config=default_planner_config(), seed=0)
        try:
            res = eng.run(prompts, 40)
        except RelocationCheckError as e:
            return {"detected": True, "seconds": time.perf_counter() - t0, "steps": 0, "error": f"hash-and-compare: {e}"[:240]}
        outs[mode] = res.outputs
        if res.hash_failures:
            detail = f"{res.hash_failures} hash check(s) failed"
    if outs["vtoken"] != outs["naive-evict"]:
        detail = (detail + "; " if detail else "") + "outputs differ from naive-evict"
    return {"detected": bool(detail), "seconds": time.perf_counter() - t0, "steps": 0, "error": detail or "not detected"}


def _detect_vllm(budget_s: float) -> dict:
    from vtoken.vllm_adapter.audit_run import audit_decode

    t0 = time.perf_counter()
    res = audit_decode(quick=True, seed=0, snapshot_dir=None)
    return {"detected": not res["passed"], "seconds": time.perf_counter() - t0, "steps": 0, "error": res["detail"][:240]}


def run_one(name: str, budget_s: float = 120.0) -> dict:
    """Run the detector of fault ``name`` with the fault planted (call in a fresh process)."""
    from vtoken import faults

    fault = {f.name: f for f in CATALOGUE}[name]
    with faults.planted(name):
        if fault.detector in MACHINES:
            res = _detect_machine(MACHINES[fault.detector], budget_s)
        elif fault.detector == "placement":
            res = _detect_placement(budget_s)
        elif fault.detector == "decode":
            res = _detect_decode(budget_s)
        elif fault.detector == "vllm":
            res = _detect_vllm(budget_s)
        else:
            raise ValueError(f"unknown detector {fault.detector}")
    return {"fault": name, "bug_class": fault.bug_class, "detector": fault.detector, **res}


def run_all(names=None, budget_s: float = 120.0, workers: int = 2, progress=True) -> dict:
    """Each fault in its own process (a planted fault must not leak into the next run)."""
    names = names or [f.name for f in CATALOGUE]
    pending = list(names)
    running: dict[str, subprocess.Popen] = {}
    results = []
    while pending or running:
        while pending and len(running) < workers:
            n = pending.pop(0)
            running[n] = subprocess.Popen(
                [sys.executable, "-m", "vtoken.fuzz.planted", "--one", n, "--budget", str(budget_s)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.2)
        for n, p in list(running.items()):
            if p.poll() is None:
                continue
            out, err = p.communicate()
            del running[n]
            lines = [l for l in out.strip().splitlines() if l.startswith("{")]
            r = json.loads(lines[-1]) if lines else {"fault": n, "detected": False,
                                                    "error": f"detector crashed: {err.strip()[-300:]}"}
            results.append(r)
            if progress:
                mark = "DETECTED" if r.get("detected") else "MISSED  "
                print(f"{mark} {n:32s} {r.get('seconds', 0):7.1f} s  steps {r.get('steps', '-')!s:>3}  "
                      f"shrink {r.get('shrink_seconds', 0):6.1f} s  [{r.get('detector', '?')}]", flush=True)
    order = {n: i for i, n in enumerate(names)}
    results.sort(key=lambda r: order[r["fault"]])
    det = [r for r in results if r.get("detected")]
    summary = {
        "planted": len(results),
        "detected": len(det),
        "median_s": statistics.median(r["seconds"] for r in det) if det else None,
        "max_steps": max((r.get("steps", 0) for r in det), default=0),
        "results": results,
        "gpu_faults_not_run": GPU_FAULTS if not _cuda() else [],
    }
    return summary


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def main_planted(args) -> int:
    """``vtoken fuzz --planted NAME|all`` (args from the fuzz command line)."""
    names = None if args.planted == "all" else args.planted.split(",")
    s = run_all(names, budget_s=120.0, workers=max(1, args.workers))
    print(f"\n{s['detected']}/{s['planted']} planted faults detected; median time to detection "
          f"{s['median_s'] if s['median_s'] is None else round(s['median_s'], 2)} s; largest shrunk example "
          f"{s['max_steps']} steps")
    if s["gpu_faults_not_run"]:
        print(f"not run here (no CUDA device): {', '.join(s['gpu_faults_not_run'])}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "planted.json"), "w") as f:
        json.dump(s, f, indent=1)
    if args.json:
        print(json.dumps({k: s[k] for k in ("planted", "detected", "median_s", "max_steps")}))
    return 0 if s["detected"] == s["planted"] else 1


if __name__ == "__main__":
    import argparse

    os.environ.setdefault("HYPOTHESIS_EXPERIMENTAL_OBSERVABILITY_NOCOVER", "1")  # before hypothesis loads

    ap = argparse.ArgumentParser()
    ap.add_argument("--one", required=True)
    ap.add_argument("--budget", type=float, default=120.0)
    a = ap.parse_args()
    print(json.dumps(run_one(a.one, a.budget), default=str))
