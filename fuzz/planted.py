"""The planted-fault runner: how strong are the checks, as a rate over independent seeds?

``vtoken fuzz --planted NAME[,NAME]|all --runs R [--json]`` takes each fault of the
catalogue (``vtoken.fuzz.catalogue``), builds a shadow tree with its patches applied
(``vtoken.fuzz.shadow`` / ``vtoken.fuzz.patches``: the installed code never carries a
fault), and runs the fault's detector in a fresh process that imports the shadow (and
proves it did), once per seed ``0..R-1``. A fault's *rate* is detections / R; each run is
bounded by ``--budget`` seconds. Per fault the report gives the rate, the median and max
seconds to detection, the shrunk example's size (steps) and the time spent shrinking.
The last stdout line with ``--json`` is one JSON object: ``planted`` (faults run),
``detected`` (caught at least once), ``min_rate``, ``median_s``, ``max_s``, ``runs``,
``run_errors``. A run that crashed (its process killed or exiting non-zero: ``worker_died``)
or checked no operation (``zero_ops``) is neither a detection nor a clean miss: it is named
in ``run_errors`` and the command exits 1.

A run is a function of (code, fault, seed): the machines run under Hypothesis with that
seed (``derandomize`` off, no example database), the decode detector seeds its prompts
and its policy with it. Campaigns randomize; this measures.

Detectors: ``table`` / ``planner`` / ``adapter`` (the conformance machines), ``placement``
(the bounded Z3 proof of the placement rule: deterministic, so its rate is 0 or 1),
``decode`` (decodes with hash-and-compare, outputs against naive-evict and the blocks and
plans a finished batch left, with copy lags so copies are in flight: see
:func:`_detect_decode`), ``gpu`` (the I3 probes on a CUDA device, :func:`_detect_gpu`; without
one the faults are listed in ``gpu_faults_not_run``, never counted as planted).

:func:`planted` is the in-process form for unit tests: the fault's patches swapped into the
live modules for a ``with`` block.

Owns: one shadow tree and child process per fault and seed, deleted after.
May call: fuzz (catalogue, patches, shadow, faulty_engines, profiles, registry and its machines, campaign's
``cluster.ray_cluster`` with ``--ray``), ray (``--ray``), vtoken.decode,
invariants (placement_proof, relocation_hash), hypothesis, subprocess.
Costs: ``--runs`` runs per fault, each bounded by ``--budget`` seconds: about R x faults x seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .catalogue import BY_NAME, CATALOGUE, Fault
from .patches import PatchError, apply_to_tree
from .patches import planted as _planted_patches
from vtoken.invariants.relocation_hash import RelocationChecker

from .registry import MACHINES  # the one machine registry (a fault's detector names a machine there)
DEFAULT_BUDGET_S = 60.0
SHRINK_CAP_S = 30  # a shrunk example is for reading; past this the smallest found so far is reported


@contextlib.contextmanager
def planted(*names: str):
    """Patch-based faults swapped in process for a ``with`` block (tests). Engine faults
    are not patches: build the path with ``vtoken.fuzz.faulty_engines.factory(name)``."""
    patches = []
    for n in names:
        f = BY_NAME.get(n)
        if f is None:
            raise ValueError(f"unknown planted fault {n!r}")
        if f.engine is not None:
            raise ValueError(f"{n} is a faulty copy engine: pass vtoken.fuzz.faulty_engines.factory({n!r})")
        patches += list(f.patches)
    with _planted_patches(patches):
        yield


# ---------------------------------------------------------------------------------- detectors (run in the child)
def _steps(text: str) -> int:
    """Operations in a shrunk state-machine example (setup, invariant checks and teardown excluded)."""
    return len(re.findall(r"^[\s|]*state\.(?!teardown|setup|observable|consistent|check_|invariant|ledger)\w+\(",
                          text, flags=re.M))


def _detect_machine(machine_path: str, seed: int, budget_s: float, shrink: bool = True) -> dict:
    """Rounds of up to 200 examples, seeded ``(seed, round)``, until a failure or the budget.

    The first failing test case is timed through Hypothesis's observability callbacks, so
    the time to detection and the time spent shrinking are reported separately. With
    ``shrink`` off (every seed but the first: the rate needs detections, one shrunk example
    per fault is enough to read) the run stops at the first failure. A run that detects
    nothing and checked no operation (``ops`` 0) is no clean run: ``run_error: zero_ops``."""
    import importlib
    import traceback

    from hypothesis import Phase, settings
    from hypothesis import seed as hseed
    from hypothesis.internal.observability import add_observability_callback
    from hypothesis.stateful import get_state_machine_test

    from .profiles import load_profile

    load_profile("ci")
    import hypothesis.internal.conjecture.engine as _engine

    _engine.MAX_SHRINKING_SECONDS = SHRINK_CAP_S  # Hypothesis's own cap (300 s), lowered for a measuring run
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
    rounds = 0
    ops0 = getattr(machine, "ops", 0)
    while err is None and time.perf_counter() - t0 < budget_s:
        test = get_state_machine_test(machine, settings=settings(
            settings(), database=None, derandomize=False, max_examples=getattr(machine, "ROUND_EXAMPLES", 200),
            phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])))
        try:
            hseed(seed * 100_003 + rounds)(test)()
        except BaseException as e:  # noqa: BLE001 -- any failure of the machine is a detection
            if isinstance(e, KeyboardInterrupt):
                raise
            err = e
        rounds += 1
    t_end = time.perf_counter()
    ops = getattr(machine, "ops", 0) - ops0
    if err is None:  # not detected: a clean run only if the machine did checked work
        return {"detected": False, "seconds": t_end - t0, "rounds": rounds, "ops": ops,
                **({"run_error": "zero_ops"} if ops == 0 else {})}
    t_detect = (first_fail[0] if first_fail else t_end) - t0
    text = "".join(traceback.format_exception(err))
    last = text.strip().splitlines()[-1]
    error = last if "state." not in last else next((l for l in text.splitlines() if "Error" in l), "")
    return {"detected": True, "seconds": t_detect, "shrink_seconds": t_end - t0 - t_detect, "steps": _steps(text),
            "shrunk": shrink, "ops": ops,
            "rounds": rounds, "error": error[:240], "example": text[-4000:]}


def _detect_placement(seed: int, budget_s: float) -> dict:
    from vtoken.invariants.placement_proof import prove_placement

    t0 = time.perf_counter()
    res = prove_placement(n_blocks=4, S=8)
    return {"detected": not res.proved, "seconds": time.perf_counter() - t0, "steps": 0,
            "error": str(res.counterexample)[:240]}


def _leftovers(eng) -> str:
    """What a finished vtoken decode still holds ('' when its copy lifecycle ended cleanly):
    every block but the null block free, every launched plan ended once, nothing in flight."""
    a, mgr = eng.alloc, eng.manager
    st = mgr.stats
    bad = []
    if a.num_free != a.num_blocks - 1:
        bad.append(f"{a.num_free} of {a.num_blocks - 1} blocks free after the run ({a.num_used} used, "
                   f"{a.num_reserved} reserved)")
    if st["plans"] != st["applied"] + st["aborted"] + st.get("orphaned", 0) or mgr.in_flight:
        bad.append(f"plans: {st['plans']} launched, {st['applied']} applied, {st['aborted']} aborted, "
                   f"{st.get('orphaned', 0)} orphaned, {len(mgr.in_flight)} in flight")
    return "; ".join(bad)


def _decode_leg(model, seed: int, engine: str | None, prompts, news, lag: int, cfg, compare: bool = True) -> str:
    """One vtoken decode (hash-and-compare; with ``compare``, against naive-evict's outputs):
    what it found ('' nothing). A named vtoken error or a failed internal assertion of the
    run is a finding too, and so is what the finished batch left (:func:`_leftovers`)."""
    from vtoken.decode import DecodeEngine
    from vtoken.errors import RelocationCheckError, VTokenError

    from .faulty_engines import factory

    kw = dict(policy="random", evict_ratio=0.5, block_size=4, seed=seed)
    eng = DecodeEngine(model, mode="vtoken", check_relocations=RelocationChecker, planner_config=cfg,
                       copy_kwargs={"lag": lag}, copy_engine_factory=factory(engine), **kw)
    try:  # vtoken first: hash-and-compare stops at the first bad relocation
        res = eng.run(prompts, news)
    except RelocationCheckError as e:
        return f"hash-and-compare: {e}"
    except (VTokenError, AssertionError) as e:
        return f"the decode raised {type(e).__name__}: {e}"
    found = [f"{res.hash_failures} hash check(s) failed"] if res.hash_failures else []
    left = _leftovers(eng)
    if left:
        found.append(left)
    if compare and res.outputs != DecodeEngine(model, mode="naive-evict", **kw).run(prompts, news).outputs:
        found.append("outputs differ from naive-evict")
    return "; ".join(found)


def _detect_decode(seed: int, budget_s: float, engine: str | None) -> dict:
    """Up to three small decodes (vtoken, hash-and-compare; :func:`_decode_leg`: outputs
    against naive-evict, named errors, what the finished batch left behind):

    1. copy lag 2, the shipped planner defaults, 4 requests of 40 tokens;
    2. the lifecycle legs, with staggered request lengths, in place (even seeds) or out of
       place with a headroom of 8 (odd seeds): copy lag 12, so copies fly for a quarter of
       the decode -- every live token of some source dies while its copy flies (every seed),
       requests finish with copies in flight -- then a copy lag past the batch's end, so
       every copy is still in flight when the last request finishes (only the end of the
       batch ends them; outputs not compared: nothing is applied before).

    Each leg runs only when the ones before found nothing."""
    import numpy as np

    from vtoken.decode import default_planner_config
    from vtoken.model import PagedDecoder
    from vtoken.planner import PlannerConfig

    t0 = time.perf_counter()
    model = PagedDecoder()
    vocab = model.config.vocab_size
    prompts = np.random.default_rng([seed, 1]).integers(0, vocab, size=(4, 32)).tolist()
    detail = _decode_leg(model, seed, engine, prompts, 40, 2, default_planner_config())
    if not detail:
        cfg = PlannerConfig() if seed % 2 == 0 else PlannerConfig(in_place=False, headroom=8)
        prompts = np.random.default_rng([seed, 2]).integers(0, vocab, size=(4, 32)).tolist()
        news = [40, 33, 40, 27]
        detail = _decode_leg(model, seed, engine, prompts, news, 12, cfg)
        detail = f"lifecycle leg (lag 12): {detail}" if detail else ""
        if not detail:
            detail = _decode_leg(model, seed, engine, prompts, news, 1000, cfg, compare=False)
            detail = f"lifecycle leg (copies past the end): {detail}" if detail else ""
    return {"detected": bool(detail), "seconds": time.perf_counter() - t0, "steps": 0,
            "error": detail[:240] or "not detected"}


def _detect_gpu(seed: int, fault: Fault) -> dict:
    """The I3 probes on this process's CUDA device (in the fault's shadow tree): an engine
    fault through :func:`~vtoken.invariants.i3_probe.i3_probe` (the device-side wait, then
    a poll-only read), a patched graph path through ``graph_i3_probe``. Detected: a probe saw
    the sentinel or bytes other than the copy's. The seed picks the order of the scenarios
    and the probe's size (the device's timing is the rest)."""
    import torch

    from vtoken.invariants.i3_probe import graph_i3_probe, i3_probe
    from vtoken.kvcache import KVCache

    t0 = time.perf_counter()
    kv = KVCache(2, 64, 16, 2, 64, dtype=torch.float16, device="cuda", checked=False)
    kv.kv.normal_(generator=torch.Generator(device="cuda").manual_seed(seed))
    n = 32 + 8 * (seed % 3)
    if fault.engine is not None:
        from .faulty_engines import factory

        probes = [i3_probe(kv, scenario=sc, fault=fault.engine, engine_cls=factory(fault.engine), n=n)
                  for sc in (("wait", "poll") if seed % 2 == 0 else ("poll", "wait"))]
    else:
        probes = [graph_i3_probe(kv, n=n)]
    found = [f"{r['scenario']} probe: sentinel {r['sentinel_seen']}, bytes equal {r['bytes_equal']}"
             for r in probes if r["sentinel_seen"] or not r["bytes_equal"]]
    return {"detected": bool(found), "seconds": time.perf_counter() - t0, "steps": 0,
            "error": "; ".join(found)[:240] or "not detected"}


def _detect_prefix(seed: int, budget_s: float) -> dict:
    """The prefix-equality check (``fuzz.vllm_prefix.prefix_equality``, the audit's
    ``vllm-prefix-equality``) with this seed: later requests repeat earlier sequences, with
    prefix caching on and off; with the adapter's ``keep_prefix_bytes`` off (fills take hashed
    blocks, a hash kept on a fill's changed bytes shows there) and then on (the default: no
    hashed block is filled; its sources' and destinations' hashes checked)."""
    from .vllm_prefix import prefix_equality

    t0 = time.perf_counter()
    res = prefix_equality(quick=True, seed=seed, keep_prefix_bytes=False)
    if res["passed"]:
        res = prefix_equality(quick=True, seed=seed, keep_prefix_bytes=True)
    return {"detected": not res["passed"], "seconds": time.perf_counter() - t0, "steps": 0,
            "error": res["detail"][:240] if not res["passed"] else "not detected"}


def run_one(name: str, seeds: list[int], budget_s: float = DEFAULT_BUDGET_S) -> dict:
    """Run fault ``name``'s detector once per seed (call in a process that imports the
    fault's shadow tree: the runner makes one)."""
    fault = BY_NAME[name]
    runs = []
    for i, s in enumerate(seeds):
        if fault.detector in MACHINES:
            r = _detect_machine(MACHINES[fault.detector], s, budget_s, shrink=(i == 0))
        elif fault.detector == "placement":
            r = _detect_placement(s, budget_s)
        elif fault.detector == "decode":
            r = _detect_decode(s, budget_s, fault.engine)
        elif fault.detector == "prefix":
            r = _detect_prefix(s, budget_s)
        elif fault.detector == "gpu":
            r = _detect_gpu(s, fault)
        else:
            raise ValueError(f"detector {fault.detector} does not run here")
        runs.append({"seed": s, **r})
    return {"fault": name, "bug_class": fault.bug_class, "detector": fault.detector, "runs": runs}


# ---------------------------------------------------------------------------------- the runner (parent)
def _sources() -> tuple[Path, bool]:
    """Where the package's sources are: a checkout (``spec/`` beside ``vtoken/``) or an install."""
    import vtoken

    pkg = Path(vtoken.__file__).resolve().parent
    repo = pkg.parent
    return (repo, True) if (repo / "spec").is_dir() and (repo / "fuzz").is_dir() else (pkg, False)


def build_shadow(fault: Fault, work: Path, snap: Path) -> Path:
    """The fault's shadow tree under ``work`` (its patches applied; engine faults: unchanged)."""
    from .shadow import LAYOUT, make_shadow

    sh = make_shadow(snap, work / f"shadow-{fault.name}")
    apply_to_tree(sh, fault.patches, layout=LAYOUT)
    return sh


def shadow_for(names, work: Path) -> Path:
    """A shadow tree under ``work`` with the named faults' patches applied; a process started
    there with :func:`vtoken.fuzz.shadow.env_for` runs the faulty build (tests, replays)."""
    from .shadow import LAYOUT, snapshot

    root, checkout = _sources()
    work = Path(work)
    if checkout:
        snapshot(root, work)
    else:
        import shutil

        shutil.copytree(root, work / "vtoken")
    for n in names:
        apply_to_tree(work, BY_NAME[n].patches, layout=LAYOUT)
    return work


def _summarize(r: dict) -> dict:
    runs = r.get("runs", [])
    det = [x for x in runs if x.get("detected")]
    secs = [x["seconds"] for x in det]
    r["detections"] = len(det)
    r["rate"] = len(det) / len(runs) if runs else 0.0
    r["median_s"] = statistics.median(secs) if secs else None
    r["max_s"] = max(secs) if secs else None
    # the size of the shrunk example (the first seed shrinks; the others stop at detection)
    shrunk = [x["steps"] for x in det if x.get("shrunk")]
    r["steps"] = shrunk[0] if shrunk else max((x.get("steps", 0) for x in det), default=None)
    r["error"] = next((x.get("error", "") for x in det), r.get("error", "not detected"))
    # a run that crashed or checked nothing is neither a detection nor a clean miss: named
    r["run_errors"] = ([r["run_error"]] if r.get("run_error") else []) + [
        {"reason": x["run_error"], "detail": f"seed {x['seed']}: no checked operation ran"}
        for x in runs if x.get("run_error")]
    for x in runs:
        x.pop("example", None)
    return r


def _start_fault(n: str, work: Path, snap: Path, seeds: str, budget_s: float, results: list, progress: bool):
    """Start fault ``n``'s detection run over a new shadow; ``(Popen, shadow, log)``, or None (and a
    result row appended to ``results``) when its patch does not apply."""
    from .shadow import env_for

    try:
        sh = build_shadow(BY_NAME[n], work, snap)
    except PatchError as e:  # a patch that no longer applies is a failure, loudly
        results.append({"fault": n, "detector": BY_NAME[n].detector, "runs": [],
                        "error": f"patch does not apply: {e}"})
        if progress:
            print(f"BROKEN   {n:34s} patch does not apply: {str(e).splitlines()[0]}", flush=True)
        return None
    python = sys.executable
    if BY_NAME[n].detector == "engine":  # vLLM's real engine runs in its own environment
        from vtoken.vllm_engine.envs import engine_python

        python = engine_python()
        if python is None:
            results.append({"fault": n, "detector": "engine", "runs": [],
                            "error": "the engine environment is not built (make engine): not run"})
            if progress:
                print(f"NOT RUN  {n:34s} the engine environment is not built (make engine)", flush=True)
            return None
    env = env_for(sh)
    env.setdefault("HYPOTHESIS_EXPERIMENTAL_OBSERVABILITY_NOCOVER", "1")
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    # output to files, not pipes: a chatty child (vLLM logs) would fill a pipe
    # nobody reads until it exits, and block forever
    log = open(work / f"{n}.log", "w+")
    return (subprocess.Popen(
        [python, "-B", "-m", "vtoken.fuzz.planted", "--one", n, "--seeds", seeds,
         "--budget", str(budget_s), "--shadow", str(sh)],
        cwd=sh, env=env, stdout=log, stderr=subprocess.STDOUT, text=True), sh, log)


def _finish_fault(n: str, sh: Path, log, runs: int, progress: bool, code: int | None = 0) -> dict:
    """The summarized result of fault ``n``'s finished run (``code``: its exit status); closes
    ``log`` and removes the shadow ``sh``."""
    import shutil

    out = _read_log(log)
    shutil.rmtree(sh, ignore_errors=True)
    return _result_of(n, out, runs, progress, code)


def _read_log(log) -> str:
    """A finished detection run's whole output; closes ``log``."""
    log.seek(0)
    out = log.read()
    log.close()
    return out


def _result_of(n: str, out: str, runs: int, progress: bool, code: int | None = 0) -> dict:
    """Fault ``n``'s summarized result from its detection run's output ``out`` and exit status
    ``code``. A run that did not exit cleanly (a signal, a non-zero status: ``worker_died``) is
    never read as detections or misses: its rows are dropped and the reason named."""
    from .campaign import exit_detail

    lines = [l for l in out.strip().splitlines() if l.startswith('{"fault"')]
    r = json.loads(lines[-1]) if lines and code == 0 else {
        "fault": n, "detector": BY_NAME[n].detector, "runs": [], "error": f"detector crashed: {out.strip()[-400:]}"}
    if code != 0 or not lines:
        why = exit_detail(code) if isinstance(code, int) and code != 0 else "no result line"
        r["run_error"] = {"reason": "worker_died", "detail": f"the detection run {why}: {out.strip()[-200:]}"[:300]}
    r = _summarize(r)
    if progress:
        mark = ("CRASHED " if r.get("run_error") else "NOT RUN " if r["run_errors"] else
                "DETECTED" if r["rate"] >= 0.9 else "WEAK    " if r["detections"] else "MISSED  ")
        med = "-" if r["median_s"] is None else f"{r['median_s']:.1f}"
        mx = "-" if r["max_s"] is None else f"{r['max_s']:.1f}"
        print(f"{mark} {n:34s} {r['detections']}/{runs}  median {med:>6} s  max {mx:>6} s  "
              f"steps {r.get('steps')!s:>4}  [{r['detector']}]", flush=True)
    return r


def _fault_on_ray(n: str, snap_tar: bytes, seeds: str, budget_s: float):
    """A Ray task: fault ``n``'s detection run on whichever node runs it, over a shadow built
    from the campaign's snapshot (a tar, so no shared disk is assumed). Returns ``(output,
    None, exit status)`` or ``(None, the result row, None)`` when the patch does not apply."""
    import io
    import shutil
    import tarfile

    work = Path(tempfile.mkdtemp(prefix="vtoken-planted-"))
    try:
        snap = work / "snap"
        with tarfile.open(fileobj=io.BytesIO(snap_tar)) as tf:
            tf.extractall(snap, filter="data")
        rows: list = []
        job = _start_fault(n, work, snap, seeds, budget_s, rows, progress=False)
        if job is None:
            return None, rows[0], None
        p, _, log = job
        p.wait()
        return _read_log(log), None, p.returncode
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_on_ray(ray, names, snap: Path, seeds: str, budget_s: float, runs: int, progress: bool, bar=None) -> list:
    """Every fault as a Ray task (one CPU each) on the connected cluster; their result rows."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(snap, arcname=".")
    blob = ray.put(buf.getvalue())
    task = ray.remote(num_cpus=1, max_retries=0)(_fault_on_ray)
    refs = {task.remote(n, blob, seeds, budget_s): n for n in names}
    results = []
    while refs:
        done, _ = ray.wait(list(refs), num_returns=1)
        n = refs.pop(done[0])
        try:
            out, row, code = ray.get(done[0])
        except Exception as e:  # the task itself failed: the fault's run is a crash, reported as such
            out, row, code = f"ray task failed: {type(e).__name__}: {e}", None, None
        if row is not None and progress:
            print(f"BROKEN   {n:34s} {row['error'].splitlines()[0]}", flush=True)
        results.append(row if row is not None else _result_of(n, out, runs, progress, code))
        if bar is not None:
            bar.update(1)
    return results


def run_all(names=None, runs: int = 1, budget_s: float = DEFAULT_BUDGET_S, workers: int = 2, progress=True,
            ray=None) -> dict:
    """Every fault in its own process, over its own shadow tree, ``runs`` seeds each: ``workers``
    at a time here, or (``ray``: a connected Ray module) as Ray tasks on its cluster."""
    import shutil

    from .shadow import snapshot

    names = names or [f.name for f in CATALOGUE]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown planted faults {unknown}")
    gpu = [n for n in names if BY_NAME[n].cuda_only]
    if gpu and _cuda():  # (torch asked only when a CUDA-only fault is named)
        gpu = []
    names = [n for n in names if n not in gpu]  # the CUDA-only ones without a device: listed as not run
    seeds = ",".join(str(s) for s in range(runs))
    work = Path(tempfile.mkdtemp(prefix="vtoken-planted-"))
    root, checkout = _sources()
    snap = work / "snap"
    if checkout:
        snapshot(root, snap)
    else:
        shutil.copytree(root, snap / "vtoken")
    pending, running, results = list(names), {}, []
    t_all = time.perf_counter()
    from vtoken.progress import bar as progress_bar

    bar = progress_bar(total=len(names), desc="planted faults", unit="fault") if progress else None
    if ray is not None:
        pending = []
        try:
            results = _run_on_ray(ray, names, snap, seeds, budget_s, runs, progress, bar)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    try:
        while pending or running:
            while pending and len(running) < workers:
                n = pending.pop(0)
                job = _start_fault(n, work, snap, seeds, budget_s, results, progress)
                if job is not None:
                    running[n] = job
            time.sleep(0.2)
            for n, (p, sh, log) in list(running.items()):
                if p.poll() is None:
                    continue
                del running[n]
                results.append(_finish_fault(n, sh, log, runs, progress, p.returncode))
                if bar is not None:
                    bar.update(1)
    finally:
        for p, _, log in running.values():
            p.kill()
            log.close()
        shutil.rmtree(work, ignore_errors=True)
        if bar is not None:
            bar.close()
    return _summary(names, results, runs, t_all, gpu)


def _summary(names: list, results: list, runs: int, t_all: float, gpu: list) -> dict:
    """:func:`run_all`'s result: the faults' results in the order named, and the totals."""
    order = {n: i for i, n in enumerate(names)}
    results.sort(key=lambda r: order.get(r["fault"], 1 << 30))
    all_secs = [x["seconds"] for r in results for x in r["runs"] if x.get("detected")]
    return {
        "planted": len(results),
        "runs": runs,
        "detected": sum(1 for r in results if r.get("detections")),
        "min_rate": min((r.get("rate", 0.0) for r in results), default=0.0),
        "median_s": statistics.median(all_secs) if all_secs else None,
        "max_s": max(all_secs) if all_secs else None,
        "wall_s": time.perf_counter() - t_all,
        "by_detector": {d: sum(1 for r in results if r["detector"] == d) for d in sorted({r["detector"] for r in results})},
        "results": results,
        "gpu_faults_not_run": gpu,
        # runs that crashed or checked nothing: neither detected nor clean, the summary fails
        "run_errors": [{"fault": r["fault"], **e} for r in results for e in r.get("run_errors", [])],
    }


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def main_planted(args) -> int:
    """``vtoken fuzz --planted NAME|all --runs R`` (args from the fuzz command line)."""
    names = None if args.planted == "all" else args.planted.split(",")
    runs = max(1, getattr(args, "runs", 1) or 1)
    budget = getattr(args, "budget", None) or DEFAULT_BUDGET_S
    ray = None
    if getattr(args, "ray", None) is not None:
        from .cluster import ray_cluster

        ray = ray_cluster(args.ray)  # the command checked it answers
    s = run_all(names, runs=runs, budget_s=budget, workers=max(1, args.workers), ray=ray)
    print(f"\n{s['detected']}/{s['planted']} planted faults detected; lowest detection rate {s['min_rate']:.2f} "
          f"over {runs} seed(s); median time to detection "
          f"{'-' if s['median_s'] is None else round(s['median_s'], 2)} s (max "
          f"{'-' if s['max_s'] is None else round(s['max_s'], 1)} s); {s['wall_s']:.0f} s in all"
          + (f"; NOT GREEN: {len(s['run_errors'])} run(s) crashed or checked nothing "
             f"({', '.join(sorted({e['reason'] for e in s['run_errors']}))})" if s["run_errors"] else ""))
    if s["gpu_faults_not_run"]:
        print(f"not run here (no CUDA device): {', '.join(s['gpu_faults_not_run'])}")
    for e in s["run_errors"]:
        print(f"vtoken fuzz: {e['reason']} ({e['fault']}): {e['detail']}", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "planted.json"), "w") as f:
        json.dump(s, f, indent=1, default=str)
    if args.json:
        print(json.dumps({k: s[k] for k in ("planted", "detected", "runs", "min_rate", "median_s", "max_s",
                                            "wall_s", "by_detector", "run_errors")}, default=str))
    return 0 if s["planted"] and s["min_rate"] >= 0.9 and not s["run_errors"] else 1


if __name__ == "__main__":
    import argparse

    os.environ.setdefault("HYPOTHESIS_EXPERIMENTAL_OBSERVABILITY_NOCOVER", "1")  # before hypothesis loads

    ap = argparse.ArgumentParser()
    ap.add_argument("--one", required=True)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S)
    ap.add_argument("--shadow", default=None, help="the shadow tree this process must import vtoken from")
    a = ap.parse_args()
    res = run_one(a.one, [int(x) for x in a.seeds.split(",")], a.budget)
    if a.shadow:
        from vtoken.fuzz.shadow import imported_from_shadow

        bad = imported_from_shadow(Path(a.shadow))
        if bad:  # the fault was not under test: never count that as a detection
            res = {"fault": a.one, "detector": res["detector"], "runs": [],
                   "error": f"not the shadow tree: {'; '.join(bad[:3])}"}
    print(json.dumps(res, default=str))
