"""The adapter's price on vLLM's scheduler, against plain vLLM (``vtoken bench adapter``).

What vLLM's engine-core thread pays per step: ``schedule()`` + ``update_from_output()``
(the adapter's hooks run inside them; the worker is timed apart and not counted). Variants,
all in one process, interleaved in rounds (a shared machine's noise hits them alike):

- ``plain``: vLLM 0.33.0's own ``Scheduler``, driven by the same real worker;
- ``off``: the adapter with reclamation off (indirection only);
- ``defaults``: the adapter at its defaults, no eviction acting;
- ``evict50``: the adapter at its defaults, 50% random eviction (plans every few steps);
- the three adapter variants again with ``checks=False``;
- only with ``--against`` (``AGAINST_ONLY``): ``evict50_keepoff``, ``evict50`` with
  ``keep_prefix_bytes`` off (in-place plans may fill a block whose hash describes its bytes):
  what keeping prefix-cache hits costs the step on this workload, whose prompts no request repeats;
  ``evict50_noplan``, ``evict50`` with reclamation off (the worker evicts, no plan is made): the
  floor of an evicting step on this design, the worker's evictions and growth replayed on the
  scheduler side's replica and checked, whatever the plans cost.

Sync scheduling, prefix caching on, S = 16, prompts of 256-1024 tokens, a pool large enough
that nothing is preempted. Per variant and R: the median of the per-step cost over the
measured decode steps; ``ratio`` = median variant / median plain; ``spread`` = (p75 - p25) /
median of each variant. ``--repeats N`` runs the whole measurement N times on fresh runs of the
same workload and reports the median of the N ratios (each in ``ratio_runs``): on a shared
machine one run's ratio moves by +-0.1. ``ratio_mean`` is the same from mean step costs: an
evicting run's steps are bimodal (steps that plan, steps that do not), where a median can
jump between the modes, while the mean is what the engine thread pays over the window.
``ratio_run`` is the same from each run's total scheduler time over the whole run, its every
step (``run_steps``) from the first ``schedule()`` to the last request's end: the prefill steps
(a prompt's tokens entered in the table and its replica) and the steps where requests finish
(their tables freed), which a window of decode steps leaves out. ``ratio_parts`` splits that
total into the run's three parts (``RUN_PARTS``, their steps in ``parts_steps``): ``prefill``
(until every request decodes), ``decode`` (until a request first finishes) and ``ends`` (from
there on), each variant's time in a part over plain's in the same steps. The
last stdout line is one JSON object.

``--against REF`` (:func:`bench_against`) compares this tree's adapter with commit REF's in
one process instead: the two bench runs a change's effect would otherwise need differ by
more than most changes of the adapter's step do.

Owns: one harness, scheduler, adapter and worker per variant of a run, dropped when it returns.
May call: vtoken.vllm_adapter (adapter, harness, worker), vtoken.model, vtoken.table, torch, numpy,
cProfile; with ``--against``, git (``archive`` of the checkout's commit) and that commit's copy.
Costs: one decode per variant, round and repeat on the real vLLM scheduler: about 2 minutes a repeat;
the profile and breakdown passes more.
"""

from __future__ import annotations

import re
import statistics
import time

import numpy as np

VARIANTS = ("plain", "off", "defaults", "evict50", "off_nochecks", "defaults_nochecks", "evict50_nochecks")
AGAINST_ONLY = ("evict50_keepoff", "evict50_noplan")  # selectable with --against --variants, not run by the bench itself
AGAINST_VARIANTS = VARIANTS[1:] + AGAINST_ONLY  # what --against --variants may name (never plain)
RUN_PARTS = ("prefill", "decode", "ends")  # the whole run's parts (``ratio_parts``)


def _model(pkg: str = "vtoken"):
    """The bench's tiny decoder, built from package ``pkg`` (``vtoken``, or a tree loaded under
    another name by :func:`_load_tree`: its worker accepts only its own decoder class)."""
    import importlib

    import torch

    m = importlib.import_module(f"{pkg}.model")
    torch.manual_seed(0)
    return m.PagedDecoder(m.DecoderConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                                          intermediate_size=64, vocab_size=64))


class _Run:
    def __init__(self, variant: str, R: int, prompts: list, new: int, seed: int, model, pkg: str = "vtoken"):
        import importlib

        TokenTable = importlib.import_module(f"{pkg}.table").TokenTable
        VTokenAdapter = importlib.import_module(f"{pkg}.vllm_adapter.adapter").VTokenAdapter
        VllmHarness = importlib.import_module(f"{pkg}.vllm_adapter.harness").VllmHarness
        VTokenWorker = importlib.import_module(f"{pkg}.vllm_adapter.worker").VTokenWorker

        S = 16
        N = sum(-(-(len(p) + new) // S) for p in prompts) + 64
        kw = dict(block_size=S, num_blocks=N, prefix_caching=True, async_scheduling=False, max_num_seqs=R,
                  max_num_batched_tokens=8192, max_model_len=2048)
        self.variant = variant
        evict = 0.5 if variant.startswith("evict50") else 0.0
        if variant == "plain":
            self.harness = VllmHarness(**kw)
            self.sched = self.harness.scheduler
            table = TokenTable(S, N)
            for i, p in enumerate(prompts):
                self.harness.add_request(f"r{i}", p, max_tokens=new)
        else:
            if variant.endswith("keepoff"):  # only then: a tree from before the setting takes the others
                kw["keep_prefix_bytes"] = False
            self.ad = VTokenAdapter(reclaim=not (variant.startswith("off") or variant.endswith("noplan")),
                                    checks=not variant.endswith("nochecks"), **kw)
            self.sched = self.ad.scheduler
            table = self.ad.table
            for i, p in enumerate(prompts):
                self.ad.add_request(f"r{i}", p, max_tokens=new)
        self.w = VTokenWorker(model, table, N, S, policy="random", evict_ratio=evict, seed=seed,
                              check_relocations=False)
        if variant != "plain":
            self.ad.attach_worker(self.w)
        self.times: list[float] = []  # the measured window's steps
        self.run_times: list[float] = []  # every step, from the first schedule() on
        self.done = False  # a step scheduled nothing: every request has finished
        self.R = R
        self.decode_at = None  # index in run_times of the first step with every request decoding (_whole_runs)
        self.ends_at = None  # index in run_times of the first step in which a request finished
        self.window: dict = {}  # work() over the window, taken at its end (window_end)

    def step(self, measure: bool) -> bool:
        t0 = time.perf_counter()
        sched_out = self.sched.schedule()
        t1 = time.perf_counter()
        out = self.w.execute(sched_out)
        t2 = time.perf_counter()
        self.sched.update_from_output(sched_out, out)
        t3 = time.perf_counter()
        self.run_times.append((t1 - t0) + (t3 - t2))
        if measure:
            self.times.append(self.run_times[-1])
        self.done = sched_out.total_num_scheduled_tokens == 0
        if self.ends_at is None and self.decode_at is not None and len(self.sched.running) < self.R:
            self.ends_at = len(self.run_times) - 1  # vLLM took a finished request out of running in this step
        return not self.done

    def window_end(self, steps: int) -> None:
        """The measured window is over: its work (:meth:`work`, plain: none) kept in ``window``
        before the run goes on to its end."""
        if self.variant != "plain":
            self.window = dict(self.work(steps), applied=self.ad.stats.get("applied"))

    def work(self, steps: int) -> dict:
        """What the adapter did over the run (its counters) and the blocks it retained, by the
        mean over the last ``steps`` non-empty steps (``VTokenAdapter.retained``): what a
        variant's step cost buys."""
        st, kept = self.ad.stats, [x[1] for x in getattr(self.ad, "retained", [])[-steps:]]
        return {"plans": st.get("plans"), "sources_freed": st.get("sources_freed"), "moves": st.get("moves"),
                "retained_mean": statistics.fmean(kept) if kept else None}  # None: a ref that does not count it

    def prefilled(self, R: int) -> bool:
        """All ``R`` requests run and decode."""
        return len(self.sched.running) == R and all(r.num_computed_tokens >= r.num_prompt_tokens
                                                    for r in self.sched.running)

    def prefill(self, R: int) -> None:
        """Step (chunked prefill, not in the window) until all ``R`` requests run and decode."""
        for _ in range(200):
            self.step(False)
            if self.prefilled(R):
                return

    def stats(self) -> dict:
        self.times.sort()
        n = len(self.times)
        med = statistics.median(self.times)
        return {"median_ms": med * 1e3, "mean_ms": statistics.fmean(self.times) * 1e3,
                "p25_ms": self.times[n // 4] * 1e3, "p75_ms": self.times[(3 * n) // 4] * 1e3,
                "spread": (self.times[(3 * n) // 4] - self.times[n // 4]) / med if med else 0.0, "steps": n,
                "run_ms": sum(self.run_times) * 1e3, "run_steps": len(self.run_times), **self.parts()}

    def parts(self) -> dict:
        """The whole run's time in each of ``RUN_PARTS`` (``parts_ms``) and where each starts
        (``parts_steps``: the first decode step, the first step a request finished in, the run's
        steps); empty unless the run was driven by :func:`_whole_runs` to its end."""
        d, e, rt = self.decode_at, self.ends_at, self.run_times
        if d is None or e is None or not self.done:
            return {}
        return {"parts_ms": dict(zip(RUN_PARTS, (sum(rt[:d]) * 1e3, sum(rt[d:e]) * 1e3, sum(rt[e:]) * 1e3))),
                "parts_steps": [d, e, len(rt)]}


def bench_adapter(seed: int = 0, quick: bool = False, Rs=(64, 256), steps: int = 50, profile_evict: bool = False,
                  repeats: int = 1, breakdown: bool = False) -> dict:
    """Run every variant at each R (interleaved rounds of 5 steps); see the module docstring.

    ``repeats``: the whole measurement again, on fresh runs of the same workload; ``ratio`` is
    then the median over the repeats of each repeat's ratio (``ratio_runs`` lists them), so
    one slow stretch of a shared machine moves one repeat, not the figure."""
    import torch

    torch.set_num_threads(1)
    model = _model()
    if quick:
        Rs, steps = (8,), 10
    out = {"ratio": {}, "ratio_mean": {}, "ratio_run": {}, "run_steps": {}, "ratio_parts": {}, "parts_steps": {},
           "spread": {}, "median_ms": {}, "ratio_runs": {},
           "R": list(Rs), "steps": steps,
           "repeats": int(repeats), "variants": list(VARIANTS)}
    for R in Rs:
        prompts = _prompts(seed, R, quick)
        reps = []
        for rep in range(max(1, int(repeats))):
            runs = _measure(R, prompts, steps, seed, model)
            reps.append({v: r.stats() for v, r in runs.items()})
            if rep == 0:
                out.setdefault("applied_plans", {})[str(R)] = runs["evict50"].window["applied"]
            del runs
        if profile_evict and R == max(Rs):
            out["profile_top10"] = _profile(R, prompts, steps, seed, model)
        if breakdown:
            out.setdefault("breakdown_ms", {})[str(R)] = _breakdown(R, prompts, steps, seed, model)
        key = str(R)
        out["ratio_runs"][key] = _ratio_runs(reps, "median_ms")
        out["ratio"][key] = {v: statistics.median(x) for v, x in out["ratio_runs"][key].items()}
        out["ratio_mean"][key] = {v: statistics.median(x) for v, x in _ratio_runs(reps, "mean_ms").items()}
        out["ratio_run"][key] = {v: statistics.median(x) for v, x in _ratio_runs(reps, "run_ms").items()}
        out["run_steps"][key] = {v: reps[0][v]["run_steps"] for v in VARIANTS}
        out["parts_steps"][key] = {v: reps[0][v]["parts_steps"] for v in VARIANTS}
        out["ratio_parts"][key] = {v: {p: statistics.median(st[v]["parts_ms"][p] / st["plain"]["parts_ms"][p]
                                                            for st in reps) for p in RUN_PARTS}
                                   for v in VARIANTS if v != "plain"}
        out["median_ms"][key] = {v: statistics.median(st[v]["median_ms"] for st in reps) for v in VARIANTS}
        out["spread"][key] = {v: statistics.median(st[v]["spread"] for st in reps) for v in VARIANTS}
    return out


def _ratio_runs(reps: list, stat: str) -> dict:
    """Per adapter variant, each repeat's ``stat`` (``median_ms``, ``mean_ms`` or ``run_ms``)
    over plain's."""
    return {v: [st[v][stat] / st["plain"][stat] for st in reps] for v in VARIANTS if v != "plain"}


def parts_text(res: dict, R: str) -> str:
    """``res["ratio_parts"]`` at ``R`` as one line: plain's steps in each part, then each
    variant's ratios in the parts' order (``off x1.60/x1.18/x1.67, ...``)."""
    d, e, n = res["parts_steps"][R]["plain"]
    return (f"R={R}, by part of the whole run (prefill steps 0-{d - 1}, decode {d}-{e - 1}, ends {e}-{n - 1}): "
            + ", ".join(f"{v} " + "/".join(f"x{x[p]:.2f}" for p in RUN_PARTS) for v, x in res["ratio_parts"][R].items()))


def ratio_text(res: dict, R: str, key: str = "ratio") -> str:
    """``res[key]`` (the median-based ``ratio``, ``ratio_mean`` or ``ratio_run``) at ``R`` as one line:
    ``off x1.07, defaults x1.09, ...``."""
    return ", ".join(f"{v} x{x:.2f}" for v, x in res[key][R].items())


def _measure(R: int, prompts: list, steps: int, seed: int, model) -> dict:
    """One interleaved measurement: a fresh run per variant, the whole run of each timed
    (:func:`_whole_runs`), the window its first ``steps`` decode steps."""
    new = steps + 48  # decoding through the measured steps and the profile
    runs = {v: _Run(v, R, prompts, new, seed, model) for v in VARIANTS}
    _whole_runs(list(runs.values()), R, steps)
    return runs


def _whole_runs(runs: list, R: int, steps: int, flip: bool = False) -> None:
    """Every run from its first step to its end, interleaved: the prefill one step a run per
    round (until each has all ``R`` requests decoding), the window (:func:`_rounds`, ``steps``
    decode steps each, its work kept: ``_Run.window_end``), then the rest in rounds of 5 until
    every request has finished. Each run's every step lands in ``run_times``: the scheduler's
    total over the run, prefill and the requests' ends included, which a window of decode
    steps leaves out."""
    for _ in range(200):
        todo = [run for run in runs if not run.prefilled(R)]
        if not todo:
            break
        for run in todo:
            run.step(False)
    for run in runs:
        run.decode_at = len(run.run_times)
    _rounds(runs, steps, flip)
    for run in runs:
        run.window_end(steps)
    for k in range(100000):
        todo = [run for run in runs if not run.done]
        if not todo:
            return
        for run in (todo[::-1] if flip and k % 2 else todo):
            for _ in range(5):
                if not run.step(False):
                    break


def _prompts(seed: int, R: int, quick: bool) -> list:
    """The bench's ``R`` prompts for ``seed`` (256-1024 tokens each; 32-64 when ``quick``)."""
    rng = np.random.default_rng([seed, R])
    lo, hi = (32, 64) if quick else (256, 1024)
    return [rng.integers(1, 63, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(R)]


def _rounds(runs: list, steps: int, flip: bool = False) -> None:
    """``steps`` measured decode steps of every run, interleaved in rounds of 5 (the last may be
    shorter); ``flip``: the runs' order reversed every other round."""
    for k in range(0, steps, 5):
        for run in (runs[::-1] if flip and (k // 5) % 2 else runs):
            for _ in range(min(5, steps - k)):
                run.step(True)


PHASES = ("replay", "plan", "checks", "other")


def _breakdown(R: int, prompts: list, steps: int, seed: int, model) -> dict:
    """Where an adapter step's price goes: fresh ``plain``, ``off`` and ``evict50`` runs
    (interleaved in rounds of 5 steps, as the measurement), each adapter hook timed over the
    same decode window: mean ms per step of ``replay`` (the worker's table changes on the
    replica), ``plan`` (the plan step: skip checks, proposals, launches), ``checks`` (the
    runtime checks, full scans included) and ``other`` (the rest of the hooks: the mirror, the
    clock, the worker's report, releases), beside plain's whole step (``plain_step``). A pass
    apart: its timers (a few per step) never touch the measured runs."""
    import time

    runs = {v: _Run(v, R, prompts, steps + 48, seed, model) for v in ("plain", "off", "evict50")}
    spent: dict = {v: dict.fromkeys(PHASES + ("hooks",), 0.0) for v in ("off", "evict50")}
    on = [False]

    def timed(obj, name, acc, key):
        f = getattr(obj, name)

        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                if on[0]:
                    acc[key] += time.perf_counter() - t0

        setattr(obj, name, call)  # on this run's own objects only

    for v, acc in spent.items():
        ad = runs[v].ad
        for hook in ("_before_schedule", "_restore_withheld", "_after_schedule", "_before_update", "_after_update",
                     "_on_request_free"):
            timed(ad, hook, acc, "hooks")
        timed(ad, "_replay", acc, "replay")
        timed(ad.book, "plan", acc, "plan")
        timed(ad.checker, "after_hook", acc, "checks")
    for run in runs.values():
        run.prefill(R)
    on[0] = True
    _rounds(list(runs.values()), steps)
    out = {"plain_step": statistics.fmean(runs["plain"].times) * 1e3}
    for v, acc in spent.items():
        ms = {k: x * 1e3 / len(runs[v].times) for k, x in acc.items()}
        ms["other"] = ms.pop("hooks") - ms["replay"] - ms["plan"] - ms["checks"]
        out[v] = {k: round(ms[k], 4) for k in PHASES}
    out["plain_step"] = round(out["plain_step"], 4)
    return out


def breakdown_text(res: dict, R: str) -> str:
    """``res["breakdown_ms"][R]`` as one line per variant: each phase's ms per step and its
    share of plain's step."""
    b = res["breakdown_ms"][R]
    plain = b["plain_step"]
    return "\n".join(f"R={R} {v} (ms/step, x plain's {plain:.2f} ms step): " +
                     ", ".join(f"{k} {b[v][k]:.3f} (+{b[v][k] / plain:.2f})" for k in PHASES)
                     for v in ("off", "evict50"))


def _profile(R: int, prompts: list, steps: int, seed: int, model) -> list[str]:
    """cProfile top-10 (cumulative) of the adapter's own functions (``vtoken/``) inside the
    scheduler-side calls of a fresh ``evict50`` run, over the same decode window the
    measurement times (its first ``steps`` decode steps, after the prefill)."""
    import cProfile
    import io
    import pstats

    run = _Run("evict50", R, prompts, steps + 48, seed, model)
    run.prefill(R)
    pr = cProfile.Profile()
    for _ in range(steps):
        sched_out = pr.runcall(run.sched.schedule)
        outp = run.w.execute(sched_out)
        pr.runcall(run.sched.update_from_output, sched_out, outp)
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(r"vtoken[/\\]", 10)
    return [l for l in s.getvalue().splitlines() if l.strip()][:24]


# ---------------------------------------------------------------------------- two trees, one process
_ABS_NAME = re.compile(r"(^|[^A-Za-z0-9_.])vtoken\.")  # vtoken.x, also in importlib strings
_IMPORT = re.compile(r"^([ \t]*)(from|import) vtoken(?=[ \t]|$)", re.M)


def _load_tree(ref: str) -> tuple[str, str]:
    """Commit ``ref``'s ``vtoken/`` package (``git archive`` of the checkout the installed
    ``vtoken`` runs from), importable in this process beside it under its own name
    ``vtoken_at_<commit>``: its absolute imports renamed, its relative ones as they are.
    Returns ``(package name, commit)``. ``ValueError`` naming the problem when the installed
    package is not in a git checkout or ``ref`` names no commit there; nothing is loaded then.
    Owns: a temporary directory holding the copy, removed at exit; one tree per commit and
    process (asked again, the loaded one is returned)."""
    import atexit
    import importlib
    import io
    import shutil
    import subprocess
    import sys
    import tarfile
    import tempfile
    from pathlib import Path

    import vtoken

    root = Path(vtoken.__file__).resolve().parents[1]

    def git(*args) -> bytes:
        try:
            return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True).stdout
        except FileNotFoundError:
            raise ValueError(f"ref {ref!r}: git is not installed") from None
        except subprocess.CalledProcessError as e:
            why = e.stderr.decode(errors="replace").strip() or "no such commit"
            raise ValueError(f"ref {ref!r}: `git {' '.join(args)}` failed in {root}: {why}") from None

    commit = git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").decode().strip()
    pkg = f"vtoken_at_{commit[:12]}"
    if pkg in sys.modules:
        return pkg, commit
    data = git("archive", "--format=tar", commit, "vtoken")
    dest = Path(tempfile.mkdtemp(prefix="vtoken-against-"))
    atexit.register(shutil.rmtree, dest, True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    (dest / "vtoken").rename(dest / pkg)
    for f in (dest / pkg).rglob("*.py"):
        f.write_text(_IMPORT.sub(rf"\1\2 {pkg}", _ABS_NAME.sub(rf"\1{pkg}.", f.read_text())))
    sys.path.insert(0, str(dest))
    importlib.invalidate_caches()
    importlib.import_module(pkg)
    return pkg, commit


def bench_against(ref: str, seed: int = 0, quick: bool = False, Rs=(64,), steps: int = 150, repeats: int = 3,
                  variants=("off", "evict50")) -> dict:
    """This tree's adapter against commit ``ref``'s, in one process (``vtoken bench adapter
    --against REF``): a fresh run per variant and tree beside one plain vLLM run, the bench's
    workload, interleaved in rounds of 5 steps whose order flips each round, so a shared
    machine's noise hits both trees alike: one repeat's ``head/ref`` moves by a few percent
    (up to 5% at R = 256), where two bench runs of one commit differ by 5% and more. Per R:
    each variant's mean step over plain's for ``ref`` and this tree (``ratio_mean``, per
    repeat) and ``head_over_ref``, the ratio of the two means (below 1: this tree is cheaper);
    ``work``: per variant and tree, per repeat, its plans, sources freed, moves and mean retained
    blocks (``_Run.work``: what the step cost bought); ``ratio_run`` and ``run_head_over_ref``: the same
    from each run's total over the whole run (the bench's ``ratio_run``). The ratios themselves are this harness's,
    not the bench's (more runs share the process's caches; longer runs plan more).
    Owns: its runs, dropped per repeat; the loaded tree (:func:`_load_tree`)."""
    import torch

    bad = [v for v in variants if v not in AGAINST_VARIANTS]
    if bad or not variants:
        raise ValueError(f"--variants: {bad or 'none'}: each must be one of {', '.join(AGAINST_VARIANTS)}")
    pkg, commit = _load_tree(ref)
    torch.set_num_threads(1)
    models = {"vtoken": _model(), pkg: _model(pkg)}
    if quick:
        Rs, steps, repeats = (8,), 10, 1
    sides = (("ref", pkg), ("head", "vtoken"))
    out = {"against": ref, "commit": commit, "R": list(Rs), "steps": steps, "repeats": int(repeats),
           "variants": list(variants), "plain_mean_ms": {}, "ratio_mean": {}, "ratio_run": {}, "head_over_ref": {},
           "run_head_over_ref": {}, "work": {}}
    for R in Rs:
        prompts = _prompts(seed, R, quick)
        ratios: dict = {f"{v}@{side}": [] for v in variants for side, _ in sides}
        whole: dict = {name: [] for name in ratios}
        plain_ms, work = [], {}
        for _ in range(max(1, int(repeats))):
            runs = {"plain": _Run("plain", R, prompts, steps + 48, seed, models["vtoken"])}
            for v in variants:
                for side, p in sides:
                    runs[f"{v}@{side}"] = _Run(v, R, prompts, steps + 48, seed, models[p], pkg=p)
            _whole_runs(list(runs.values()), R, steps, flip=True)
            plain = statistics.fmean(runs["plain"].times)
            plain_ms.append(plain * 1e3)
            for name in ratios:
                ratios[name].append(statistics.fmean(runs[name].times) / plain)
                whole[name].append(sum(runs[name].run_times) / sum(runs["plain"].run_times))
                work.setdefault(name, []).append({k: x for k, x in runs[name].window.items() if k != "applied"})
            del runs
        key = str(R)
        out["plain_mean_ms"][key] = plain_ms
        out["ratio_mean"][key] = ratios
        out["ratio_run"][key] = whole
        out["work"][key] = work
        out["head_over_ref"][key] = {v: statistics.fmean(ratios[f"{v}@head"]) / statistics.fmean(ratios[f"{v}@ref"])
                                     for v in variants}
        out["run_head_over_ref"][key] = {v: statistics.fmean(whole[f"{v}@head"]) / statistics.fmean(whole[f"{v}@ref"])
                                         for v in variants}
    return out


def against_text(res: dict, R: str) -> str:
    """``res`` (:func:`bench_against`) at ``R`` as one line: per variant this tree over the
    ref's mean step, and each one's mean ratio over plain."""
    rm, rr = res["ratio_mean"][R], res["ratio_run"][R]
    return f"R={R}: " + ", ".join(
        f"{v} x{x:.3f} of {res['commit'][:12]} (x{statistics.fmean(rm[v + '@ref']):.3f} -> "
        f"x{statistics.fmean(rm[v + '@head']):.3f} plain; whole run x{res['run_head_over_ref'][R][v]:.3f}: "
        f"x{statistics.fmean(rr[v + '@ref']):.3f} -> x{statistics.fmean(rr[v + '@head']):.3f})"
        for v, x in res["head_over_ref"][R].items())
