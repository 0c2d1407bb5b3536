#!/usr/bin/env python3
"""The GPU check: everything the CUDA path must show on a device, in <= 8 minutes, one JSON file.

Run by ``scripts/gpu_check.sh`` (which installs the carried wheels first). Sections, each
with its own time limit, each recorded as ``pass`` / ``fail`` / ``error`` (the exception
and its traceback) / ``skipped`` (with the reason) with its figures, so one failure never
hides the rest; the JSON file is rewritten after every section (a kill keeps what ran):

``env``            torch, CUDA device, z3 / hypothesis / xxhash versions, where vtoken came from
``fuzz_table``     ``vtoken fuzz --machines table --device cuda --minutes 2`` (in the background,
``fuzz_planner``   from the start, one worker each; collected after the correctness sections)
``gpu_tests``      ``pytest -m gpu`` over every test file with gpu-marked tests (tests/test_gpu.py:
                   streams, events, graphs, probes, sync debug; the table's no-sync test; ...)
``sanitizer``      the shipped decode (vtoken vs naive-evict) under ``TORCH_CUDA_SANITIZER=1``,
                   eager path and graph path (a replay is one launch: CSAN sees the capture)
``i3``             the I3 sentinel probes (clean and each ordering fault), the StepGraph probe
                   (clean and ``graph_replay_on_capture_stream``), a sentinel-mode decode
``graph_replay``   the engine's graph path against the eager path with relocations, token for
                   token; naive-evict on the graph path; the checked run's plan snapshots
                   through both snapshot checkers (plain Python and Z3)
``sync_debug``     the decode loop with relocations under ``set_sync_debug_mode("error")``:
                   graph path (the verdict), plus the plain path and check mode as figures
``bandwidth``      the copy engine's device time for a large plan against a plain device copy
                   of the same bytes (ratio)
``hash_overhead``  decode with hash-and-compare: host digests (xxh3, full bytes) vs device
                   fingerprints, against no checks (ratios), and digests of 1024 tokens alone

Modes: ``--dry-run`` (CPU: lists the sections, checks every import they need, collects the
gpu tests, runs the sections that have a CPU smoke on the CPU, writes the JSON; exit 0 when
all of that worked), ``--only a,b`` (some sections), ``--out FILE``, ``--budget S``.
Internal: ``--pytest ...``, ``--cli ...``, ``--decode-json JSON`` (subprocesses of this file).

Output: ``--out``, else ``$OUT/gpu_check.json`` when ``OUT`` is set, else
``reports/gpu-check/gpu_check.json``; the last line printed is the same JSON. Exit 0 only
when every section that ran passed.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "vtoken-gpu-check/1"
BUDGET_S = 450  # the whole run; gpu_check.sh kills at 470 s, the device lets a command run 600 s
FUZZ_MINUTES = 2.0
STATUSES = ("pass", "fail", "error", "skipped", "planned")


# ---------------------------------------------------------------------------- the checkout under test
def bootstrap() -> None:
    """Import ``vtoken`` from this checkout, with ``vtoken.invariants`` / ``.spec`` / ``.fuzz``
    mapped to their folders (what pyproject's package-dir does when installed), whatever
    else is installed: the check is about this tree. Child processes call it again; forked
    ones inherit it."""
    sys.meta_path[:] = [f for f in sys.meta_path if "vtoken" not in type(f).__module__]  # an editable install's finder
    for name in [m for m in sys.modules if m == "vtoken" or m.startswith("vtoken.")]:
        del sys.modules[name]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    sys.path.insert(0, str(ROOT))
    import vtoken

    for sub in ("invariants", "spec", "fuzz"):
        name = f"vtoken.{sub}"
        spec = importlib.util.spec_from_file_location(name, ROOT / sub / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / sub)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        setattr(vtoken, sub, mod)
        spec.loader.exec_module(mod)


def _child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def _self_cmd(*args: str) -> list:
    return [sys.executable, str(Path(__file__).resolve()), *args]


LOGS: list = []  # [folder]: where each subprocess's whole output is kept (next to the JSON)


def _log(label: str, text: str) -> None:
    """Keep a child's whole output (the JSON holds only its tail) as ``logs/LABEL.txt``."""
    if LOGS and label:
        LOGS[0].mkdir(parents=True, exist_ok=True)
        (LOGS[0] / f"{label}.txt").write_text(text, errors="replace")


def _run(cmd: list, limit: float, env=None, label: str = "") -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env or _child_env(), capture_output=True, text=True, timeout=limit)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        dec = lambda x: x.decode() if isinstance(x, bytes) else (x or "")  # noqa: E731
        rc, out, err = 124, dec(e.stdout), dec(e.stderr)
    _log(label, f"$ {' '.join(map(str, cmd))}\n# rc {rc}\n--- stdout\n{out}\n--- stderr\n{err}")
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


# ---------------------------------------------------------------------------- the section runner
class SectionTimeout(Exception):
    pass


class Runner:
    """Runs sections one after another within a budget and keeps the JSON file current.

    A section is ``fn() -> dict`` of figures; ``figures["ok"]`` (default True) decides
    pass / fail; an exception is ``error`` with its type, message and traceback; a section
    past its limit is interrupted (SIGALRM, main thread) and recorded as ``error`` (timed
    out); a section that cannot get ``min_s`` seconds of the budget is ``skipped``."""

    def __init__(self, out: Path, budget_s: float = BUDGET_S, dry_run: bool = False):
        self.out = Path(out)
        self.t0 = time.monotonic()
        self.budget_s = float(budget_s)
        self.report = {"schema": SCHEMA, "ok": None, "dry_run": dry_run,
                       "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                       "budget_s": self.budget_s, "wall_s": 0.0, "order": [], "sections": {}}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def write(self) -> None:
        r = self.report
        ran = [s for s in r["sections"].values() if s["status"] in ("pass", "fail", "error")]
        r["ok"] = bool(ran) and all(s["status"] == "pass" for s in ran)
        r["wall_s"] = round(time.monotonic() - self.t0, 1)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(r, indent=1, default=str, sort_keys=False) + "\n")
        os.replace(tmp, self.out)

    def record(self, name: str, status: str, limit_s=None, wall_s=0.0, **kw) -> dict:
        assert status in STATUSES, status
        sec = {"status": status, "limit_s": limit_s, "wall_s": round(wall_s, 1), **kw}
        if name not in self.report["sections"]:
            self.report["order"].append(name)
        self.report["sections"][name] = sec
        self.write()
        mark = {"pass": "ok", "fail": "FAILED", "error": "ERROR", "skipped": "skipped", "planned": "planned"}[status]
        print(f"[gpu_check] {name}: {mark} ({sec['wall_s']} s)" + (f" -- {kw.get('error') or kw.get('reason')}"
                                                                    if status in ('error', 'skipped') else ""),
              flush=True)
        return sec

    def run(self, name: str, fn, limit_s: float, min_s: float = 5.0) -> dict:
        left = self.left()
        if left < min_s:
            return self.record(name, "skipped", limit_s, reason=f"out of time ({left:.0f} s of the budget left)")
        limit = max(1.0, min(limit_s, left))
        t0 = time.perf_counter()

        def alarm(signum, frame):
            raise SectionTimeout(f"timed out after {limit:.0f} s")

        old = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            figures = fn() or {}
            ok = bool(figures.pop("ok", True))
            return self.record(name, "pass" if ok else "fail", limit_s, time.perf_counter() - t0, figures=figures)
        except BaseException as e:  # noqa: BLE001 -- a section's failure is data; Ctrl-C still ends the run
            if isinstance(e, KeyboardInterrupt):
                raise
            return self.record(name, "error", limit_s, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}",
                               traceback=traceback.format_exc()[-4000:])
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    def finish(self) -> dict:
        self.write()
        return self.report


# ---------------------------------------------------------------------------- shared pieces
def _decode_case(device="cuda", mode="vtoken", policy="h2o", requests=4, prompt=32, new=32, S=4, cuda_graph=None,
                 check=False, method=None, full_bytes=False, copy_kwargs=None, sentinel_check=False, seed=1,
                 engine_cls=None, sample=None, headroom=8):
    """A small batch through DecodeEngine; returns (engine, result)."""
    from vtoken.decode import make_prompts
    from vtoken.decode import DecodeEngine
    from vtoken.invariants.relocation_hash import RelocationChecker
    from vtoken.model import PagedDecoder
    from vtoken.planner import PlannerConfig

    model = PagedDecoder()
    prompts = make_prompts(requests, prompt, model.config.vocab_size, seed=seed)
    cfg = PlannerConfig(theta_f=0.1, check_every=1, max_sources=8, headroom=headroom)
    eng = (engine_cls or DecodeEngine)(
        model, mode=mode, policy=policy, evict_ratio=0.5, block_size=S, device=device, planner_config=cfg,
        check_relocations=RelocationChecker if check else None, check_method=method, full_bytes=full_bytes, copy_kwargs=copy_kwargs,
        sentinel_check=sentinel_check, cuda_graph=cuda_graph)
    if check and sample is not None:  # the spot check's size is the checker's: build it first
        eng.setup(_budget(prompts, new, S, headroom, mode))
        eng.checker.sample = int(sample)
    return eng, eng.run(prompts, new)


def _budget(prompts, new, S, headroom, mode):
    from vtoken.decode import full_retention_blocks

    return full_retention_blocks([len(p) for p in prompts], new, S, headroom if mode == "vtoken" else 0) + 2


def _summary(res) -> dict:
    return {k: getattr(res, k) for k in ("relocations", "plans_launched", "plans_aborted", "hash_checks",
                                          "hash_failures", "cuda_graph", "graph_captures", "graph_replays", "steps",
                                          "step_ms_median", "prefill_fallback")}


def _decode_ms(res) -> float:
    """Decode time without the first step (it captures the graph of the batch shape)."""
    return float(sum(res.step_ms[1:]))


# ---------------------------------------------------------------------------- sections
def sec_env(dev: str) -> dict:
    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
           "vtoken_from": str(Path(importlib.import_module("vtoken").__file__).parent)}
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name()
        out["torch_cuda"] = torch.version.cuda
    for mod in ("z3", "hypothesis", "xxhash", "numpy", "pytest", "triton"):
        try:
            m = importlib.import_module(mod)
            out[mod] = getattr(m, "__version__", None) or (m.get_version_string() if mod == "z3" else "present")
        except Exception as e:  # noqa: BLE001
            out[mod] = f"MISSING ({type(e).__name__})"
    out["ok"] = (dev == "cpu" or out["cuda_available"]) and not str(out["z3"]).startswith("MISSING")
    return out


FUZZ: dict = {}


def fuzz_start(machine: str, minutes: float = FUZZ_MINUTES, device: str = "cuda") -> None:
    """Start ``vtoken fuzz --machines M --device cuda`` in the background (output to a file)."""
    work = Path(tempfile.mkdtemp(prefix=f"vtoken-fuzz-{machine}-"))
    log = open(work / "log.txt", "w")
    cmd = _self_cmd("--cli", "fuzz", "--machines", machine, "--device", device, "--minutes", str(minutes),
                    "--workers", "1", "--out", str(work / "out"), "--json")
    FUZZ[machine] = {"proc": subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdout=log, stderr=subprocess.STDOUT,
                                              text=True), "log": log, "work": work, "t0": time.monotonic(),
                     "minutes": minutes}


def fuzz_collect(machine: str, grace_s: float = 60.0) -> dict:
    f = FUZZ.get(machine)
    if f is None:
        raise RuntimeError("the campaign was not started")
    p = f["proc"]
    deadline = f["t0"] + f["minutes"] * 60 + grace_s
    while p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    if p.poll() is None:
        p.kill()
        p.wait()
    f["log"].close()
    text = (f["work"] / "log.txt").read_text(errors="replace")
    _log(f"fuzz_{machine}", text)
    for i, fail in enumerate(sorted((f["work"] / "out" / "failures").glob("*.txt"))[:5]):  # with their replays
        _log(f"fuzz_{machine}_failure{i}", fail.read_text(errors="replace"))
    d = _last_json(text) or {}
    out = {"rc": p.returncode, "wall_s": round(time.monotonic() - f["t0"], 1), "ops": d.get("ops"),
           "seconds": d.get("seconds"), "failures": d.get("failures"), "ops_by_machine": d.get("ops_by_machine"),
           "machines_unavailable": d.get("machines_unavailable"), "hard_states": d.get("hard_states")}
    if machine == "planner":
        out["note"] = "fuzz/planner_machine.py builds its TokenTable without VTOKEN_DEVICE: its table is on the CPU"
    out["ok"] = p.returncode == 0 and d.get("failures") == 0 and (d.get("ops") or 0) > 0
    if not out["ok"]:
        out["tail"] = text[-3000:]
    return out


def gpu_test_files() -> list:
    """Every test file that marks tests ``gpu`` (tests/test_gpu.py and any other), outside
    tests/vllm (vLLM is not on the GPU image)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text(errors="replace"))


def sec_gpu_tests(dev: str) -> dict:
    xml = Path(tempfile.gettempdir()) / f"vtoken_gpu_tests_{os.getpid()}.xml"
    files = gpu_test_files()
    r = _run(_self_cmd("--pytest", *files, "-m", "gpu", "-o", "addopts=", "-p", "no:cacheprovider",
                       "-q", "-rs", f"--junitxml={xml}"), 170, label="gpu_tests")
    out = {"files": files, "rc": r["rc"], "wall_s": r["wall_s"]}
    try:
        import xml.etree.ElementTree as ET

        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        out.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        out["failed_tests"] = [tc.get("name") for tc in suite.iter("testcase")
                               if tc.find("failure") is not None or tc.find("error") is not None]
    except Exception as e:  # noqa: BLE001 -- no xml: pytest did not get that far
        out["xml_error"] = repr(e)
    out["ok"] = r["rc"] == 0 and out.get("tests", 0) > 0  # skips are listed (-rs) in the tail and counted
    if not out["ok"] or out.get("skipped"):
        out["tail"] = (r["stdout"] + r["stderr"])[-5000:]
    return out


CSAN_CONTROL = """
import torch
x = torch.zeros(4096, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    y = (x + 1).sum()
torch.cuda.current_stream().wait_stream(s)
h = torch.empty((), pin_memory=True)
h.copy_(y, non_blocking=True)
torch.cuda.synchronize()
print('{"control": %s}' % float(h))
"""


def sec_sanitizer(dev: str) -> dict:
    """Both paths under CSAN; each a subprocess (the sanitizer is switched on at import).

    The decode is the shipped one, without the relocation checker: CSAN tracks whole tensors,
    and the checker's launch digests of one plan read the KV cache on the compute stream
    while an earlier plan's copy writes other slots of it on the relocation stream (disjoint
    by I2, which the checker itself verifies). Ordering those reads behind the copy would add
    a compute-stream wait the system does not have, and hide a dropped wait from a checked
    run. Outputs are still compared with naive-evict on the same path.

    First a control: a few well-ordered torch ops on two streams under CSAN. If the control
    fails, the sanitizer itself does not work with this torch and Python, and the section is
    an ``error`` that says so (its decode runs are still recorded, but they prove nothing
    either way)."""
    out, ok = {}, True
    env = _child_env({"TORCH_CUDA_SANITIZER": "1"} if dev == "cuda" else {})
    if dev == "cuda":
        r = _run([sys.executable, "-c", CSAN_CONTROL], 60, env=env, label="sanitizer_control")
        out["control"] = {"rc": r["rc"], "ok": r["rc"] == 0 and '"control": 4096.0' in r["stdout"]}
        if not out["control"]["ok"]:
            out["control"]["tail"] = (r["stdout"] + r["stderr"])[-3000:]
    for path, graph in (("eager", False), ("graph", True)):
        case = dict(device=dev, policy="random", requests=2, prompt=16, new=24, S=4, check=False, cuda_graph=graph,
                    headroom=6)
        r = _run(_self_cmd("--decode-json", json.dumps(case)), 100, env=env, label=f"sanitizer_{path}")
        d = _last_json(r["stdout"]) or {}
        text = r["stdout"] + r["stderr"]
        races = "CSAN" in text or "data race" in text.lower()
        sub = {"rc": r["rc"], "wall_s": r["wall_s"], "csan_reports": races, **{k: d.get(k) for k in (
            "relocations", "hash_checks", "hash_failures", "outputs_equal", "graph_captures", "graph_replays")}}
        sub["ok"] = r["rc"] == 0 and not races and d.get("outputs_equal") is True and (d.get("relocations") or 0) > 0
        if not sub["ok"]:
            sub["tail"] = text[-3000:]
        ok &= sub["ok"]
        out[path] = sub
    if not out.get("control", {"ok": True})["ok"]:
        raise RuntimeError("CSAN fails its control (plain torch ops on two streams) with this torch and Python: "
                           f"the sanitizer cannot judge the decode; see logs/sanitizer_control.txt ({out})")
    out["ok"] = ok
    return out


def decode_json_main(case: dict) -> int:
    """``--decode-json``: vtoken (checked) vs naive-evict on the same path; one JSON line."""
    eng, res = _decode_case(**case)
    ref_case = {k: v for k, v in case.items() if k not in ("check", "method", "full_bytes", "copy_kwargs",
                                                            "sentinel_check", "sample")}
    _, ref = _decode_case(**{**ref_case, "mode": "naive-evict"})
    d = _summary(res)
    d["outputs_equal"] = res.outputs == ref.outputs
    print(json.dumps(d, default=str))
    return 0 if d["outputs_equal"] and not res.hash_failures else 1


def sec_i3(dev: str) -> dict:
    import torch

    from vtoken.fuzz.faulty_engines import factory
    from vtoken.invariants.i3_probe import i3_probe
    from vtoken.kvcache import KVCache

    def cache():
        kv = KVCache(2, 64, 16, 2, 64, dtype=torch.float16, device="cuda", checked=False)
        kv.kv.normal_()
        return kv

    probes, ok = [], True
    for fault, scen, violation in [(None, "wait", False), (None, "poll", False), ("cuda_wait_dropped", "wait", True),
                                   ("cuda_event_wrong_stream", "wait", True), ("cuda_event_wrong_stream", "poll", True),
                                   ("cuda_release_before_event", "poll", True)]:
        r = i3_probe(cache(), scenario=scen, fault=fault, engine_cls=factory(fault) if fault else None,
                     sleep_cycles=400_000_000)
        r["expected_violation"] = violation
        r["ok"] = r["sentinel_seen"] == violation and r["bytes_equal"] != violation
        ok &= r["ok"]
        probes.append(r)
    graph = []
    from vtoken.fuzz.catalogue import BY_NAME
    from vtoken.fuzz.patches import planted
    from vtoken.invariants.i3_probe import graph_i3_probe  # the probe the gpu tests and the planted runner use

    for fault in (None, "graph_replay_on_capture_stream"):
        with planted(list(BY_NAME[fault].patches) if fault else []):
            r = graph_i3_probe(cache())
        r.update(fault=fault, expected_violation=fault is not None)
        r["ok"] = r["sentinel_seen"] == r["expected_violation"] and r["bytes_equal"] != r["expected_violation"]
        ok &= r["ok"]
        graph.append(r)
    eng, res = _decode_case(dev, copy_kwargs={"sentinel": True, "sleep_cycles": 50_000_000}, sentinel_check=True,
                            check=True)
    _, ref = _decode_case(dev, mode="naive-evict")
    dec = {**_summary(res), "outputs_equal": res.outputs == ref.outputs,
           "device_waits": res.copy_stats["device_waits"], "host_syncs": res.copy_stats["host_syncs"]}
    ok &= dec["outputs_equal"] and dec["hash_failures"] == 0 and dec["relocations"] > 0
    return {"ok": bool(ok), "probes": probes, "graph_probes": graph, "sentinel_decode": dec}


def sec_graph_replay(dev: str, quick: bool = False) -> dict:
    """Graph path vs eager path, relocations on, token for token; the snapshots it recorded
    through both snapshot checkers."""
    kw = dict(device=dev, policy="h2o", requests=4 if quick else 8, prompt=32 if quick else 64,
              new=24 if quick else 64, S=4)
    eng_g, g = _decode_case(**kw, cuda_graph=True, check=True)
    _, e = _decode_case(**kw, cuda_graph=False, check=True)
    _, n = _decode_case(**kw, mode="naive-evict", cuda_graph=True)
    _, g_unchecked = _decode_case(**kw, cuda_graph=True)
    _, e_unchecked = _decode_case(**kw, cuda_graph=False)
    from vtoken.invariants import snapshot_checks, z3_checks

    snaps = [p.snapshot for p in eng_g.manager.history][:40]
    py_bad = sum(1 for s in snaps if snapshot_checks.check_snapshot(s))
    z3_bad = sum(1 for s in snaps if z3_checks.check_snapshot(s))
    out = {"graph": _summary(g), "eager": _summary(e), "outputs_equal_eager": g.outputs == e.outputs,
           "outputs_equal_naive_graph": n.outputs == g.outputs,
           "outputs_equal_unchecked": g_unchecked.outputs == g.outputs == e_unchecked.outputs,
           "decode_ms_graph": _decode_ms(g_unchecked), "decode_ms_eager": _decode_ms(e_unchecked),
           "snapshots_checked": len(snaps), "snapshots_failing_python": py_bad, "snapshots_failing_z3": z3_bad}
    out["graph_vs_eager_decode_ratio"] = out["decode_ms_graph"] / max(out["decode_ms_eager"], 1e-9)
    out["ok"] = (out["outputs_equal_eager"] and out["outputs_equal_naive_graph"] and out["outputs_equal_unchecked"]
                 and g.relocations > 0 and g.hash_failures == 0 and g.graph_replays == g.steps
                 and (dev == "cpu" or g.graph_captures >= 1) and py_bad == 0 and z3_bad == 0 and len(snaps) > 0)
    return out


def sec_sync_debug(dev: str) -> dict:
    """Admit (prefill) and the first step (capture) outside, then every decode step under
    ``set_sync_debug_mode("error")``. The graph path decides; the plain path and check mode
    are recorded as figures (both read data back to the host by design)."""
    import torch

    from vtoken.decode import make_prompts
    from vtoken.decode import DecodeEngine, full_retention_blocks
    from vtoken.invariants.relocation_hash import RelocationChecker
    from vtoken.model import PagedDecoder
    from vtoken.planner import PlannerConfig

    on_cuda = dev == "cuda"

    def loop(cuda_graph, check):
        model = PagedDecoder()
        prompts = make_prompts(4, 32, model.config.vocab_size, seed=2)
        cfg = PlannerConfig(theta_f=0.1, check_every=1, max_sources=8, headroom=8)
        eng = DecodeEngine(model, mode="vtoken", policy="h2o", evict_ratio=0.5, block_size=4, device=dev,
                           planner_config=cfg, cuda_graph=cuda_graph,
                           check_relocations=RelocationChecker if check else None)
        eng.setup(full_retention_blocks([32] * 4, 40, 4, 8) + 2)
        for i, p in enumerate(prompts):
            eng.admit(i, p, 40)
        eng.step()
        steps, err = 0, None
        if on_cuda:  # the CPU smoke runs the same loop without the debug mode (there is none)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            while eng.active:
                eng.step()
                steps += 1
        except RuntimeError as e:
            err = f"{e}".splitlines()[0][:300]
            err_tb = traceback.format_exc()[-1500:]
        finally:
            if on_cuda:
                torch.cuda.set_sync_debug_mode("default")
        eng.copy_engine.synchronize()
        r = {"steps_under_debug": steps, "error": err, "relocations_applied": eng.manager.stats["applied"]}
        if err:
            r["where"] = err_tb
        return r

    out = {"graph": loop(True, False), "plain": loop(False, False), "graph_checked": loop(True, True)}
    g = out["graph"]
    out["ok"] = g["error"] is None and g["relocations_applied"] > 0 and g["steps_under_debug"] > 0
    return out


def sec_bandwidth(dev: str) -> dict:
    import numpy as np
    import torch

    from vtoken.copy_engine import KVCopyEngine
    from vtoken.invariants.i3_probe import ProbePlan
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
        eng.wait(eng.launch(ProbePlan(0, moves)))
    ms, launch_us = [], []
    for i in range(10):
        t0 = time.perf_counter()
        h = eng.launch(ProbePlan(i + 1, moves))
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
    med, rmed = float(np.median(ms)), float(np.median(ref))
    return {"ok": True, "moves": n, "bytes": nbytes, "copy_engine_ms": med, "copy_engine_gbps": 2 * nbytes / med / 1e6,
            "device_copy_ms": rmed, "device_copy_gbps": 2 * nbytes / rmed / 1e6,
            "ratio_copy_engine_vs_device_copy": rmed / med, "host_launch_us_median": float(np.median(launch_us)),
            "note": "GB/s count bytes read + written once; the engine gathers into a temporary, then scatters"}


def sec_hash_overhead(dev: str, quick: bool = False) -> dict:
    """Decode time with hash-and-compare: host digests (xxh3 of every hashed token's bytes)
    vs device fingerprints (sample 8, and 0), each against no checks; then the digests of
    1024 tokens of a large-geometry cache alone."""
    import numpy as np
    import torch

    kw = dict(device=dev, policy="h2o", requests=4 if quick else 8, prompt=32 if quick else 64,
              new=16 if quick else 64, S=4 if quick else 16)
    runs = {"none": dict(check=False), "xxh3": dict(check=True, full_bytes=True),
            "fingerprint": dict(check=True, method="fingerprint"),
            "fingerprint_sample0": dict(check=True, method="fingerprint", sample=0)}
    out = {"variants": {}}
    ms = {}
    for name, v in runs.items():
        best = None
        for _ in range(1 if quick else 2):  # the better of two: the first pays for warm-up
            eng, res = _decode_case(**kw, **v)
            if best is None or _decode_ms(res) < best[1]:
                best = (eng, _decode_ms(res), res)
        eng, t, res = best
        ms[name] = t
        out["variants"][name] = {"decode_ms": t, "relocations": res.relocations, "hash_checks": res.hash_checks,
                                 "hash_failures": res.hash_failures,
                                 "host_bytes": dict(eng.checker.host_bytes) if eng.checker else {}}
    out["ratio_host_vs_device"] = ms["xxh3"] / max(ms["fingerprint"], 1e-9)
    out["overhead_xxh3"] = ms["xxh3"] / max(ms["none"], 1e-9)
    out["overhead_fingerprint"] = ms["fingerprint"] / max(ms["none"], 1e-9)
    out["overhead_fingerprint_sample0"] = ms["fingerprint_sample0"] / max(ms["none"], 1e-9)
    # the digests alone, 1024 tokens of a 32-layer, 8-head, 128-dim fp16 cache (128 KiB a token)
    from vtoken.invariants.relocation_hash import device_fingerprint, token_layer_digests
    from vtoken.kvcache import KVCache

    big = (2, 4, 2, 16) if quick else (32, 8, 128, 1024)
    L, H, D, n = big
    kv = KVCache(L, max(2, n // 16 + 2), 16, H, D, dtype=torch.float16, device=dev, checked=False)
    kv.kv.normal_()
    slots = np.arange(16, 16 + n)
    sd = torch.from_numpy(slots).to(dev)

    def timed(fn, reps=5):
        fn()
        ts = []
        for _ in range(reps):
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if dev == "cuda":
                torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) * 1e3)
        return float(np.median(ts))

    host_ms = timed(lambda: token_layer_digests(kv, slots))
    dev_ms = timed(lambda: device_fingerprint(kv, sd).cpu())
    out["digests_1024"] = {"tokens": n, "bytes_per_token": kv.bytes_per_token, "xxh3_host_ms": host_ms,
                           "fingerprint_ms": dev_ms, "ratio_host_vs_device": host_ms / max(dev_ms, 1e-9)}
    fails = sum(v["hash_failures"] for v in out["variants"].values())
    fp_kinds = set(out["variants"]["fingerprint_sample0"]["host_bytes"])
    out["fingerprint_sample0_host_kinds"] = sorted(fp_kinds)
    out["ok"] = fails == 0 and all(v["relocations"] > 0 for v in out["variants"].values()) \
        and fp_kinds <= {"slots", "fingerprints"}
    return out


# ---------------------------------------------------------------------------- the plan
# name -> (function, limit s, CUDA only, CPU smoke (a function run by --dry-run) or None, imports it needs)
def _smoke_graph():
    return sec_graph_replay("cpu", quick=True)


def _smoke_overhead():
    return sec_hash_overhead("cpu", quick=True)


def _smoke_sanitizer():
    return sec_sanitizer("cpu")


def _smoke_sync_debug():
    return sec_sync_debug("cpu")


def _smoke_fuzz():
    fuzz_start("table", minutes=0.05, device="cpu")
    return fuzz_collect("table", grace_s=60)


NEEDS_COMMON = ["torch", "numpy", "xxhash", "vtoken.decode:DecodeEngine", "vtoken.decode:StepGraph",
                "vtoken.decode:make_prompts", "vtoken.model:PagedDecoder", "vtoken.planner:PlannerConfig"]
SECTIONS = {
    "env": (sec_env, 20, False, lambda: sec_env("cpu"), ["torch"]),
    "gpu_tests": (sec_gpu_tests, 180, True, None, ["pytest", "tests/test_gpu.py"]),
    "sanitizer": (sec_sanitizer, 210, True, _smoke_sanitizer, ["torch.cuda._sanitizer"]),
    "i3": (sec_i3, 90, True, None, ["vtoken.invariants.i3_probe:i3_probe", "vtoken.invariants.i3_probe:graph_i3_probe",
                                    "vtoken.fuzz.catalogue:BY_NAME",
                                    "vtoken.fuzz.faulty_engines:factory", "vtoken.fuzz.patches:planted"]),
    "graph_replay": (sec_graph_replay, 120, True, _smoke_graph,
                     ["vtoken.invariants.snapshot_checks:check_snapshot", "vtoken.invariants.z3_checks:check_snapshot",
                      "z3"]),
    "sync_debug": (sec_sync_debug, 90, True, _smoke_sync_debug, ["vtoken.decode:full_retention_blocks"]),
    "fuzz_table": (lambda dev: fuzz_collect("table"), 200, True, _smoke_fuzz,
                   ["vtoken.fuzz.campaign:main_fuzz", "vtoken.fuzz.table_machine", "hypothesis"]),
    "fuzz_planner": (lambda dev: fuzz_collect("planner"), 200, True, None,
                     ["vtoken.fuzz.campaign:main_fuzz", "vtoken.fuzz.planner_machine"]),
    "bandwidth": (sec_bandwidth, 60, True, None, ["vtoken.copy_engine:KVCopyEngine", "vtoken.invariants.i3_probe:ProbePlan",
                                                  "vtoken.kvcache:KVCache"]),
    "hash_overhead": (sec_hash_overhead, 120, True, _smoke_overhead,
                      ["vtoken.invariants.relocation_hash:device_fingerprint",
                       "vtoken.invariants.relocation_hash:token_layer_digests"]),
}
ORDER = ["env", "gpu_tests", "sanitizer", "i3", "graph_replay", "sync_debug", "fuzz_table", "fuzz_planner",
         "bandwidth", "hash_overhead"]


def _check_need(need: str):
    """An import (``module[:attr]``) or a repository file; None when fine, else the reason."""
    if "/" in need:
        return None if (ROOT / need).exists() else f"{need}: no such file"
    mod, _, attr = need.partition(":")
    try:
        m = importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001
        return f"{mod}: {type(e).__name__}: {e}"
    if attr and not hasattr(m, attr):
        return f"{mod} has no {attr}"
    return None


def dry_run(runner: Runner, only: list) -> None:
    """CPU: every section's imports, the gpu tests' collection, the CPU smokes; nothing on a GPU."""
    import torch

    torch.set_num_threads(1)  # small CPU smokes on a shared box: threads only add overhead
    os.environ["OMP_NUM_THREADS"] = "1"  # and in the children
    missing = {}
    for n in ["(common)"] + only:
        needs = NEEDS_COMMON if n == "(common)" else SECTIONS[n][4]
        bad = [r for r in (_check_need(x) for x in needs) if r]
        if bad:
            missing[n] = bad

    def imports():
        return {"ok": not missing, "missing": missing}

    runner.run("dry_run_imports", imports, 60)

    def collect():
        files = gpu_test_files()
        r = _run(_self_cmd("--pytest", *files, "-m", "gpu", "-o", "addopts=", "-p", "no:cacheprovider",
                           "--collect-only", "-q"), 120)
        n = sum(1 for line in r["stdout"].splitlines() if "::" in line)
        return {"ok": r["rc"] == 0 and n > 0 and "tests/test_gpu.py" in files, "collected": n, "files": files,
                "rc": r["rc"],
                **({"tail": (r["stdout"] + r["stderr"])[-2000:]} if r["rc"] else {})}

    if "gpu_tests" in only:
        runner.run("dry_run_collect_gpu_tests", collect, 120)
    whl = Path(os.environ.get("VTOKEN_WHEELS", ROOT / ".whl"))
    wheels = sorted(whl.glob("*.whl")) if whl.is_dir() else []
    runner.record("dry_run_wheels", "pass" if wheels else "fail", figures={
        "folder": str(whl), "wheels": [w.name for w in wheels], "bytes": sum(w.stat().st_size for w in wheels),
        **({} if wheels else {"hint": "bash scripts/gpu_check.sh --prepare-wheels (here, where an index is reachable)"})})
    for n in only:
        fn, limit, cuda_only, smoke, needs = SECTIONS[n]
        if smoke is not None:
            runner.run(f"{n} (cpu smoke)", smoke, limit)
        runner.record(n, "planned", limit, reason="dry run", cuda_only=cuda_only, needs=needs)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--pytest"]:
        bootstrap()
        import pytest

        return int(pytest.main(argv[1:]))
    if argv[:1] == ["--cli"]:
        bootstrap()
        from vtoken.cli.main import main as cli

        return int(cli(argv[1:]) or 0)
    if argv[:1] == ["--decode-json"]:
        bootstrap()
        return decode_json_main(json.loads(argv[1]))
    import argparse

    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU: list sections, check imports, run CPU smokes")
    ap.add_argument("--only", default=None, help="comma-separated sections (default: all): " + ",".join(ORDER))
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    ap.add_argument("--fuzz-minutes", type=float, default=FUZZ_MINUTES)
    a = ap.parse_args(argv)
    only = ORDER if not a.only else [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        print(f"gpu_check: unknown sections {bad}; choose from {ORDER}", file=sys.stderr)
        return 2
    out = Path(a.out) if a.out else (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT")
                                     else ROOT / "reports" / "gpu-check" / "gpu_check.json")
    bootstrap()
    LOGS[:] = [out.parent / "logs"]
    runner = Runner(out, a.budget, dry_run=a.dry_run)
    if a.dry_run:
        dry_run(runner, only)
    else:
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        for m in ("table", "planner"):  # in the background from the start: 2 minutes each
            if f"fuzz_{m}" in only and dev == "cuda":
                fuzz_start(m, a.fuzz_minutes)
        for name in only:
            fn, limit, cuda_only, _smoke, _needs = SECTIONS[name]
            if cuda_only and dev != "cuda":
                runner.record(name, "skipped", limit, reason="needs a CUDA device (torch.cuda.is_available() is False)")
                continue
            runner.run(name, lambda fn=fn: fn(dev), limit)
    for f in FUZZ.values():  # a campaign still running past its section (out of time): stop it
        if f["proc"].poll() is None:
            f["proc"].kill()
    rep = runner.finish()
    print(json.dumps(rep, default=str))
    return 0 if rep["ok"] else 1


if __name__ == "__mp_main__":  # a process multiprocessing spawned from a child of this script
    bootstrap()  # (a campaign's worker on CUDA): the same tree as its parent, before it unpickles
elif __name__ == "__main__":
    sys.exit(main())
