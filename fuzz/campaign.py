"""``vtoken fuzz``: a time-boxed campaign over every stateful machine.

Workers (processes on one machine) run the machines in rotation, in batches, against one
Hypothesis example database shared by all of them and kept between nights: a directory
(``--db DIR``) or a Redis server (``--db redis://host:port``) so campaigns on several
machines share what they find. Hypothesis replays the database's saved failures before it
generates anything new, so a failure found once is retried first. A Redis server that does
not answer is refused before anything runs or is written (:func:`check_db`); one lost
mid-campaign stops the worker and is reported as ``db_error``, never as a machine's failure.

With ``--ray ADDRESS|auto`` the workers are Ray tasks on an existing Ray cluster (the way
vLLM itself goes multi-node) instead of local processes: they share the same example
database, their messages come back over a Ray queue, and the failures' files are written
here, by the campaign, from what the workers send (a worker on another node has another
disk). Ray is an optional extra (``pip install 'vtoken[ray]'``).

A campaign is green only when it ran: a worker that dies (a signal, an out-of-memory kill, an
exit, a failed Ray task), a machine that ran no checked operation, or an example database
that stops taking writes is named in the summary's ``run_errors`` (``worker_died``,
``zero_ops``, ``db_write_failed``, ``db_lost``: :data:`RUN_ERRORS`) and ``vtoken fuzz`` exits
non-zero (:func:`main_fuzz`).

Nothing found is lost to a kill: a failure is written to ``--out`` (the minimised example,
its plan snapshot when the machine made one, and a pytest file that replays it) the moment
the worker sees it, the database holds the example as soon as Hypothesis finds it, and the
summary (``summary.json``) is rewritten after every batch.

Owns: its worker processes (or Ray tasks), the example database connection and the ``--out``
folder (failures, summary).
May call: fuzz (registry: the machines and the --impl loader; protocol, hard_states, profiles, catalogue, planted), hypothesis, redis,
ray (``--ray`` only, through ``fuzz.cluster``), vtoken.argtypes.
Costs: time-boxed: ``--budget`` seconds on ``--workers`` processes; the summary is rewritten per
batch.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_mod
import random
import re
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

from .cluster import RayUnavailable, ray_cluster
# the one machine registry and --impl loader (fuzz/registry.py), re-exported: replay files load from here
from .registry import IMPL, MACHINES, available_machines, checked_impl, load_machine  # noqa: F401


def make_db(spec):
    """``None`` (no database), ``redis://host:port[/db]``, or a directory path."""
    if spec is None:
        return None
    spec = str(spec)
    if spec.startswith("redis://"):
        import redis
        from hypothesis.extra.redis import RedisExampleDatabase

        return RedisExampleDatabase(redis.Redis.from_url(spec), expire_after=__import__("datetime").timedelta(days=30))
    from hypothesis.database import DirectoryBasedExampleDatabase

    return DirectoryBasedExampleDatabase(spec)


def watched_db(spec):
    """The campaign's database as a worker hands it to Hypothesis (None: no database), every
    write checked. Hypothesis's directory database swallows the ``OSError`` of a save (a folder
    replaced by a file, a full disk), so a campaign would go on with nothing saved: here a save
    that does not land is recorded, and :meth:`problem` (asked after each batch) also probes
    that a folder database is still a writable folder. Redis errors raise as they are."""
    if spec is None:
        return None
    from hypothesis.database import ExampleDatabase

    class Watched(ExampleDatabase):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.broken = inner, None

        def fetch(self, key):
            return self.inner.fetch(key)

        def save(self, key, value):
            self.inner.save(key, value)
            self._landed(key, value)

        def delete(self, key, value):
            self.inner.delete(key, value)

        def move(self, src, dest, value):
            self.inner.move(src, dest, value)
            self._landed(dest, value)

        def _landed(self, key, value):
            if self.broken is None and value not in set(self.inner.fetch(key)):
                self.broken = f"a saved example did not reach the example database {spec}"

        def problem(self) -> str | None:
            """Why the database no longer takes writes, or None (one probe file for a folder).
            The folder's own state first: it names the cause (a folder replaced by a file),
            where a save that did not land names only the symptom."""
            return _folder_problem(spec) or self.broken

    return Watched(make_db(spec))


def _folder_problem(spec) -> str | None:
    """Why the folder database ``spec`` cannot take a write now (gone, not a folder, not
    writable), or None; a ``redis://`` spec: None. Costs one probe file created and removed."""
    if str(spec).startswith("redis://"):
        return None
    path = Path(spec)
    if not path.is_dir():
        return f"the example database {spec} is no longer a folder" + (" (a file is there)" if path.exists() else "")
    try:
        fd, name = tempfile.mkstemp(dir=path, prefix=".vtoken-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        return f"cannot write to the example database {spec}: {type(e).__name__}: {e}"[:300]
    return None


class DatabaseError(RuntimeError):
    """The example database cannot be reached or used: an error of the campaign's input,
    never a failure of a machine."""


def check_db(spec) -> None:
    """Reach the example database before any work: a ``redis://`` server must answer PING
    (5 s to connect and to answer). :class:`DatabaseError` in one line otherwise; a directory
    or None is not touched (the command checked the folder). Costs one round trip."""
    if spec is None or not str(spec).startswith("redis://"):
        return
    import redis

    try:
        client = redis.Redis.from_url(str(spec), socket_connect_timeout=5, socket_timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError) as e:
        msg = (str(e).strip().splitlines() or [""])[0]
        raise DatabaseError(f"cannot reach the example database {spec}: {type(e).__name__}: {msg}"[:400]) from None


def _db_error(e: BaseException) -> str | None:
    """The database's error behind a run's exception (a Redis connection lost mid-campaign),
    or None: such a run is no finding of the machine."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__module__.split(".")[0] == "redis":
            return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:300]
        e = e.__cause__ or e.__context__
    return None


def _replay_file(machine: str, db: str | None, text: str) -> str:
    steps = "\n".join("#   " + line for line in text.strip().splitlines()[-60:])
    db_line = repr(db) if db else "None"
    return f'''"""Replay of a failure found by `vtoken fuzz` on machine {machine!r}.

Run: pytest {{this file}}. With the campaign's database the saved example is replayed
first; the minimised example as Hypothesis reported it:
{steps}
"""

from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from vtoken.fuzz.campaign import load_machine, make_db


def test_replay():
    machine = load_machine({machine!r})
    run_state_machine_as_test(machine, settings=settings(
        database=make_db({db_line}), phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        max_examples=2000, deadline=None))
'''


def _headline(failure: str) -> str:
    """The line of a failure's report that says what failed: its exception's line (the last
    ``Name: message`` line at the left margin), not Hypothesis's closing hint on how to reproduce it."""
    lines = failure.strip().splitlines()
    said = [l for l in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Failure)\b", l)]
    return (said[-1] if said else lines[-1] if lines else "")[:300]


def _steps_in(text: str) -> int:
    return len(re.findall(r"^\s*state\.(?!teardown|observable|check)\w+\(", text, flags=re.M))


# The explain phase (which lines only failing runs reach) is skipped: it costs a campaign
# more time than the shrink itself, and the minimised steps are what a person reads.
PHASES = None


def _phases():
    from hypothesis import Phase

    return [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]


def _failure_files(name: str, k: int, n_fail: int, failure: str, db_spec, snapshot) -> tuple[str, dict]:
    """The files that record one failure, ``(stem, {relative path: text})``: the report, the
    plan snapshot when the machine made one, and a pytest file that replays it."""
    safe = re.sub(r"[^A-Za-z0-9_]+", "_", name)  # impl:module:Class -> a file (and module) name
    stem = f"failures/{safe}-w{k}-{n_fail}"
    files = {f"{stem}.txt": failure}
    if snapshot:
        files[f"{stem}.snapshot.json"] = json.dumps(snapshot, indent=1, default=str)
    files[f"failures/test_replay_{safe}_w{k}_{n_fail}.py"] = _replay_file(name, db_spec, failure)
    return stem, files


def _write_files(out, files: dict) -> None:
    for rel, text in files.items():
        f = Path(out) / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)


class _DbLost(Exception):
    """The database went away mid-batch (a Redis connection lost): the worker says so and stops."""


def _run_batch(k, name, m, cfg, q) -> str | None:
    """One batch of machine ``name`` under settings ``cfg``: its ops, seconds and hard states
    sent as a "progress" message; the failure's text (everything Hypothesis reported), or None.
    :class:`_DbLost` when the exception is the database's, never a machine's failure."""
    from hypothesis.stateful import run_state_machine_as_test

    from . import hard_states

    ops0, hard0 = m.ops, Counter(hard_states.COUNTS)
    hard_states.tag(None)  # a machine tags its examples' configurations itself
    t0 = time.time()
    try:
        run_state_machine_as_test(m, settings=cfg)
        failure = None
    except Exception as e:  # a failing example: everything Hypothesis reported
        lost = _db_error(e)
        if lost is not None:
            raise _DbLost(lost) from None
        failure = "".join(traceback.format_exception(e))
    hard = Counter(hard_states.COUNTS)
    hard.subtract(hard0)
    q.put(("progress", k, name, m.ops - ops0, time.time() - t0, dict(+hard)))
    return failure


def _worker(k, names, deadline, seed, db_spec, out, q, batch, profile, examples=None, paths=()):
    """One campaign worker: the machines in rotation until ``deadline`` (or ``examples`` each).
    ``out`` None (a Ray task): failure files travel in the "failure" message for the campaign
    to write; else they are written at once, before the message. ``paths``: the campaign's
    import path entries this process lacks go in front (a Ray worker starts with its own
    path, so an ``impl:`` module the campaign imports from a folder it added would not load).

    Messages, in order: "batch" (the machine it starts), "progress", "failure", and last
    "done". A worker that stops early says why first: "db_error" (the database's exception)
    or "db_write_failed" (the database stopped taking writes: checked before the first batch
    and after each). A worker that never says "done" died: the campaign reports it."""
    sys.path[:0] = [p for p in paths if p not in sys.path and os.path.isdir(p)]
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    except ValueError:  # not the main thread (a Ray worker may run tasks elsewhere)
        pass
    import hypothesis.core
    from hypothesis import settings

    from . import hard_states
    from .profiles import load_profile

    global PHASES
    PHASES = _phases()
    load_profile(profile)
    hypothesis.core.threadlocal._hypothesis_global_random = random.Random(seed * 1000 + k)
    db = watched_db(db_spec)
    machines = {n: load_machine(n) for n in names}
    base = settings()
    n_fail = i = 0
    names = list(names)
    left = {n: examples for n in names} if examples is not None else None
    broken = db.problem() if db is not None else None
    if broken:
        q.put(("db_write_failed", k, None, broken))
    while not broken and names and (time.time() < deadline if left is None else any(left.get(n, 0) > 0 for n in names)):
        name = names[i % len(names)]
        i += 1
        n_batch = batch
        if left is not None:  # a fixed number of examples per machine: the same work on any machine
            if left[name] <= 0:
                continue
            n_batch = min(batch, left[name])
            left[name] -= n_batch
        q.put(("batch", k, name))
        cfg = settings(base, database=db, max_examples=n_batch, print_blob=True, phases=PHASES)
        try:
            failure = _run_batch(k, name, machines[name], cfg, q)
        except _DbLost as e:  # the database went away: say so and stop, record no failure
            q.put(("db_error", k, name, str(e)))
            break
        if failure is not None:
            n_fail += 1
            stem, files = _failure_files(name, k, n_fail, failure, db_spec, hard_states.LAST_SNAPSHOT)
            if out is not None:
                _write_files(out, files)
            q.put(("failure", k, name, stem, _steps_in(failure), _headline(failure),
                   files if out is None else None))
            names.remove(name)  # its database entry would replay the same failure every batch
        broken = db.problem() if db is not None else None
        if broken:  # what it finds would no longer be kept: stop, and the campaign is not green
            q.put(("db_write_failed", k, name, broken))
    q.put(("done", k))


def _resolve_machines(machines) -> tuple[list, dict]:
    """The machines to run (``machines``, or every available one) and ``{machine: why not}`` for the rest.

    Raises (before anything runs) for an unknown machine or an ``impl:`` that does not load and build.
    """
    avail, missing = available_machines()
    impls = [m for m in machines or () if m.startswith(IMPL)]
    if impls:  # a user's implementation: it must load and build (a clear error now, not in a worker)
        for m in impls:
            checked_impl(m[len(IMPL):])  # loaded once per process: the workers' binding reuses it
        machines = [m for m in machines if m not in impls]
        avail = avail + impls
    if machines or impls:
        machines = machines + impls
        unknown = [m for m in machines if m not in MACHINES and not m.startswith(IMPL)]
        if unknown:
            raise ValueError(f"unknown machines {unknown}; choose from {sorted(MACHINES)}")
        names = [m for m in machines if m in avail]
        missing = {m: missing[m] for m in machines if m in missing}
    else:
        names = avail
    return names, missing


def _run_error(summary: dict, reason: str, worker=None, machine=None, detail: str = "") -> None:
    """Record one reason the campaign is not green (see :data:`RUN_ERRORS`)."""
    summary["run_errors"].append({"reason": reason, "worker": worker, "machine": machine, "detail": detail})


# Why a campaign that found no failure is still not green, as ``run_errors`` names them:
RUN_ERRORS = {
    "worker_died": "a worker ended without finishing: a signal (a crash, an out-of-memory kill), an exit, "
                   "a Ray task failure",
    "zero_ops": "a machine ran no checked operation",
    "db_write_failed": "the example database stopped taking writes (what was found would not be kept)",
    "db_lost": "the example database stopped answering mid-campaign",
}


def run_error_text(e: dict) -> str:
    """One of ``run_errors`` in words: ``worker_died (worker 0, machine table): killed by ...``."""
    who = [f"worker {e['worker']}"] if e.get("worker") is not None else []
    who += [f"machine {e['machine']}"] if e.get("machine") else []
    return e["reason"] + (f" ({', '.join(who)})" if who else "") + f": {e['detail']}"


def _handle_msg(msg, summary: dict, hard: Counter, t_start: float, progress: bool, track: dict) -> int:
    """Fold one worker message into ``summary`` / ``hard`` / ``track`` (per worker: the machine
    it runs, "done" seen); 1 for a worker's "done", else 0."""
    kind, k = msg[0], msg[1]
    if kind == "batch":
        track["running"][k] = msg[2]
    elif kind == "progress":
        _, k, name, ops, secs, h = msg
        summary["ops"] += ops
        summary["ops_by_machine"][name] = summary["ops_by_machine"].get(name, 0) + ops
        secs_by = summary.setdefault("seconds_by_machine", {})
        secs_by[name] = secs_by.get(name, 0.0) + secs
        hard.update(h)
    elif kind == "failure":
        _, k, name, stem, nsteps, last, files = msg
        if files:  # from a Ray worker: written here
            _write_files(summary["out"], files)
        stem = str(Path(summary["out"]) / stem)
        summary["failures"] += 1
        summary["failure_reports"].append({"machine": name, "worker": k, "files": stem, "steps": nsteps,
                                           "error": last, "found_after_s": time.time() - t_start})
        if progress:
            print(f"\nFAILURE in {name} (worker {k}): {last}\n  -> {stem}.txt", flush=True)
    elif kind in ("db_error", "db_write_failed"):
        _, k, name, why = msg
        if kind == "db_error":
            summary["db_error"] = f"{why} (worker {k}, machine {name})"
        _run_error(summary, "db_lost" if kind == "db_error" else kind, k, name, why)
        if progress:
            print(f"\nDATABASE {'LOST' if kind == 'db_error' else 'NOT WRITABLE'} (worker {k}, machine {name}): "
                  f"{why}", flush=True)
    elif kind == "done":
        track["done"].add(k)
        return 1
    return 0


def _judge(summary: dict, track: dict, ends: dict) -> None:
    """Add to ``summary["run_errors"]`` every worker that died and every machine that ran
    nothing (not asked of an interrupted campaign: its workers were stopped on purpose).
    ``ends``: per worker, how it ended abnormally (the pool's :meth:`join`), or None."""
    if summary["interrupted"]:
        return
    for k in range(summary["workers"]):
        end = ends.get(k)
        if k in track["done"] and (end is None or "still running" in end):
            continue  # it finished its work; only its exit was slow (then stopped)
        detail = end or "exited with status 0 without finishing its work (it never said 'done')"
        _run_error(summary, "worker_died", k, track["running"].get(k), detail)
        summary["worker_errors"].append(f"worker {k}: {detail}")
    found = {r["machine"] for r in summary["failure_reports"]}  # a failure is that machine's verdict
    for name in summary["machines"]:
        if summary["ops_by_machine"].get(name, 0) == 0 and name not in found:
            _run_error(summary, "zero_ops", None, name, "ran no checked operation")


def _recover_failures(summary: dict, out: Path, t_start: float) -> None:
    """Add to ``summary`` the failure files under ``out`` written since ``t_start`` but never reported."""
    # A worker killed between writing a failure and reporting it: the files are the record.
    known = {r["files"] for r in summary["failure_reports"]}
    for f in sorted((out / "failures").glob("*.txt")) if (out / "failures").exists() else []:
        stem = str(f.with_suffix(""))
        if stem not in known and f.stat().st_mtime >= t_start:
            summary["failures"] += 1
            summary["failure_reports"].append({"machine": f.name.split("-w")[0], "files": stem,
                                               "error": f.read_text().strip().splitlines()[-1][:300],
                                               "recovered_from_disk": True,
                                               "found_after_s": f.stat().st_mtime - t_start})


def start_method(device: str) -> str:
    """How local workers start: ``fork`` (fast: they inherit what the campaign imported), or
    ``spawn`` for a CUDA device (and on macOS). A process that asked torch about CUDA (the
    ``--device`` check does) has initialised the driver, and a forked child of it cannot
    use CUDA at all ("Cannot re-initialize CUDA in forked subprocess")."""
    return "spawn" if sys.platform == "darwin" or str(device).startswith("cuda") else "fork"


class _LocalWorkers:
    """The campaign's workers as processes on this machine, started as :func:`start_method`
    says for the device in ``VTOKEN_DEVICE``."""

    empty = (queue_mod.Empty,)

    def __init__(self, workers: int, args_of):
        ctx = mp.get_context(start_method(os.environ.get("VTOKEN_DEVICE", "cpu")))
        self.q = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=args_of(k, self.q, write=True), daemon=True)
                      for k in range(workers)]

    def start(self) -> None:
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return any(p.is_alive() for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()

    def join(self) -> dict:
        """Wait for the processes (10 s each); ``{worker: how it ended}`` for each that did not
        exit with status 0 (killed by a signal, a non-zero status, or still running: then
        terminated)."""
        ends = {}
        for k, p in enumerate(self.procs):
            p.join(timeout=10)
            if p.exitcode is None:
                p.terminate()
                p.join(timeout=5)
                ends[k] = "still running 10 s after the campaign ended (terminated)"
            elif p.exitcode != 0:
                ends[k] = exit_detail(p.exitcode)
        return ends


def exit_detail(code: int) -> str:
    """A process's exit status in words: ``killed by signal 11 (SIGSEGV)``, ``exited with status 1``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-code} ({name})"
    return f"exited with status {code}"


class _RayWorkers:
    """The campaign's workers as Ray tasks (one CPU each) on the cluster ``ray`` is connected
    to; messages over a Ray queue, failure files sent back in them."""

    def __init__(self, ray, workers: int, args_of):
        from ray.util.queue import Empty, Queue

        self.ray, self.empty = ray, (Empty, queue_mod.Empty)
        self.q = Queue()
        # the campaign's own import path travels with each task (see _worker's ``paths``)
        self.args = [args_of(k, self.q, write=False) + (list(sys.path),) for k in range(workers)]
        self.task = ray.remote(num_cpus=1, max_retries=0)(_worker)
        self.refs: list = []

    def start(self) -> None:
        self.refs = [self.task.remote(*a) for a in self.args]

    def alive(self) -> bool:
        _, running = self.ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return bool(running)

    def stop(self) -> None:
        for r in self.refs:
            self.ray.cancel(r, force=True)

    def join(self) -> dict:
        """Wait for the tasks (10 s); ``{worker: how it ended}`` for each that raised or died
        (Ray's error in one line: ``WorkerCrashedError: ...`` for a process killed under it)
        or had not finished (then cancelled)."""
        ready, _ = self.ray.wait(self.refs, num_returns=len(self.refs), timeout=10)
        ends = {}
        for k, r in enumerate(self.refs):
            if r not in ready:
                self.ray.cancel(r, force=True)
                ends[k] = "Ray task still running 10 s after the campaign ended (cancelled)"
                continue
            try:
                self.ray.get(r)
            except Exception as e:  # a worker that crashed: reported, never a machine's failure
                lines = [l for l in str(e).strip().splitlines() if l.strip()] or [""]
                ends[k] = f"Ray task failed: {type(e).__name__}: {lines[0][:200]}"[:300]
        return ends


def run_campaign(minutes=1.0, workers=1, seed=0, db=None, out="fuzz-out", machines=None, batch=50,
                 progress=True, profile="dev", examples=None, ray: str | None = None) -> dict:
    """Run the campaign; returns (and writes ``out/summary.json``) the summary.

    Time-boxed by ``minutes`` (what a nightly campaign wants: explore as much as the night
    allows), or, with ``examples``, exactly that many examples per machine and worker,
    seeded by ``seed``: the same work and the same verdict on any machine at any speed
    (what an audit wants). Machines that cannot run here are listed in
    ``machines_unavailable`` with the reason. ``ray``: an address (``auto``) or None; with it
    the workers are Ray tasks on that cluster (:func:`ray_cluster`; an initialised Ray is
    used as it is), else local processes.

    A campaign is ``green`` only when it ran: no failure, and no ``run_errors`` (a worker that
    died, a machine that ran no operation, an example database that stopped taking writes or
    answering: :data:`RUN_ERRORS`, each with the worker and machine it concerns).
    """
    check_db(db)  # DatabaseError before anything is written or run
    ray_mod = ray_cluster(ray) if ray is not None else None  # RayUnavailable before anything is written
    out = Path(out)
    names, missing = _resolve_machines(machines)
    _make_db_folder(db)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + minutes * 60

    def args_of(k, q, write):
        return (k, names, deadline, seed, db, str(out) if write else None, q, batch, profile, examples)

    pool = _RayWorkers(ray_mod, workers, args_of) if ray_mod is not None else _LocalWorkers(workers, args_of)
    t_start = time.time()
    pool.start()
    summary = {"machines": names, "workers": workers, "seed": seed, "db": db, "ops": 0, "seconds": 0.0,
               "failures": 0, "failure_reports": [], "hard_states": {}, "interrupted": False,
               "ops_by_machine": {}, "machines_unavailable": missing, "examples_per_machine": examples,
               "db_error": None, "out": str(out), "ray": None, "worker_errors": [], "run_errors": [],
               "green": False}
    if ray_mod is not None:
        summary["ray"] = {"address": ray, "nodes": len([n for n in ray_mod.nodes() if n.get("Alive")]),
                          "cpus": ray_mod.cluster_resources().get("CPU", 0)}
    hard = Counter()
    track = {"running": {}, "done": set()}
    from vtoken.progress import bar as progress_bar

    bar = progress_bar(total=None if examples else round(minutes * 60), desc="fuzz", unit="s") if progress else None
    handle = (lambda msg: _handle_msg(msg, summary, hard, t_start, progress, track))

    def write():
        summary["seconds"] = time.time() - t_start
        summary["ops_per_s_per_worker"] = summary["ops"] / max(summary["seconds"], 1e-9) / workers
        # a worker runs one batch at a time: a machine's ops over the seconds workers spent in it
        summary["ops_per_s_by_machine"] = {m: summary["ops_by_machine"][m] / max(t, 1e-9)
                                           for m, t in summary.get("seconds_by_machine", {}).items()}
        from .hard_states import by_tag, states_of

        summary["hard_states"] = {h: hard.get(h, 0) for h in states_of(names)}
        summary["hard_states_by_config"] = by_tag(hard)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))

    _collect(pool, handle, write, bar, summary, t_start)
    _judge(summary, track, summary.pop("_ends"))
    _recover_failures(summary, out, t_start)
    summary["green"] = not (summary["failures"] or summary["run_errors"] or summary["interrupted"])
    write()
    return summary


def _collect(pool, handle, write, bar, summary: dict, t_start: float) -> None:
    """Fold the workers' messages into the summary (rewritten after each) until every worker
    said "done" or none is alive; on Ctrl-C stop them (``interrupted``). Then join them
    (``summary["_ends"]``: how each that did not finish cleanly ended) and read what they said
    before they stopped."""
    done = 0
    try:
        while done < summary["workers"]:
            try:
                msg = pool.q.get(timeout=1.0)
            except pool.empty:
                if not pool.alive():
                    break
                continue
            done += handle(msg)
            write()
            if bar is not None:  # seconds of the time box (or elapsed), ops and failures so far
                el = round(time.time() - t_start)
                bar.n = min(el, bar.total) if bar.total else el
                bar.set_postfix(ops=summary["ops"], failures=summary["failures"], refresh=True)
    except KeyboardInterrupt:
        summary["interrupted"] = True
        pool.stop()
    summary["_ends"] = pool.join()
    while True:  # what the workers said before they stopped
        try:
            handle(pool.q.get(timeout=0.2))
        except pool.empty + (OSError, EOFError):
            break
    if bar is not None:
        bar.close()


def _make_db_folder(db) -> None:
    """A folder database exists before the workers start (so a folder that disappears or turns
    into a file later is told from one never made); :class:`DatabaseError` if it cannot be."""
    if db is None or str(db).startswith("redis://"):
        return
    try:
        Path(db).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DatabaseError(f"cannot make the example database folder {db}: {type(e).__name__}: {e}"[:400]) from None


def _fuzz_parser() -> argparse.ArgumentParser:
    """The argument parser of ``vtoken fuzz``."""
    from vtoken.argtypes import comma_choices, device, example_db, nonneg_int, positive_float, positive_int
    from vtoken.argtypes import writable_dir

    from .catalogue import BY_NAME

    ap = argparse.ArgumentParser(prog="vtoken fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=positive_float, default=None, help="campaign length (default 1)")
    ap.add_argument("--workers", type=positive_int, default=None,
                    help="worker processes (default 1); with --ray, Ray tasks (default: the cluster's CPUs)")
    ap.add_argument("--ray", metavar="ADDRESS|auto", default=None,
                    help="run the workers as Ray tasks on an existing Ray cluster (pip install 'vtoken[ray]')")
    ap.add_argument("--device", type=device, choices=["cpu", "cuda"], default="cpu",
                    help="device of the tables' lookup cache (cuda needs a GPU)")
    ap.add_argument("--seed", type=nonneg_int, default=None, help="campaign seed (default 0)")
    ap.add_argument("--db", type=example_db, default=None, help="example database: a directory or redis://host:port")
    ap.add_argument("--out", type=writable_dir, default="reports/fuzz")
    ap.add_argument("--machines", nargs="*", choices=sorted(MACHINES))
    ap.add_argument("--impl", action="append", default=[], metavar="module:Class",
                    help="check your own token table or planner class (vtoken.fuzz.protocol); repeatable")
    ap.add_argument("--profile", default=None, choices=["ci", "dev", "nightly"], help="Hypothesis profile (default dev)")
    ap.add_argument("--planted", metavar="NAME|all", type=comma_choices(BY_NAME, special=("all",)),
                    help="run the checks against planted faults instead (comma-separated names, or all)")
    ap.add_argument("--runs", type=positive_int, default=None,
                    help="--planted: independent seeds per fault (the rate's denominator; default 1)")
    ap.add_argument("--budget", type=positive_float, default=None, help="--planted: seconds per detection run (default 60)")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON line last")
    return ap


def _checked_args(ap, a) -> list:
    """Refuse what ``vtoken fuzz`` cannot run (``ap.error``: exit 2, one line) before any work:
    conflicting flags, an ``--impl`` that does not load, a database or a Ray cluster that does
    not answer. Fills in the defaults; returns the machines to run (``[]``: every one)."""
    from vtoken.argtypes import repeated

    if a.planted and (a.machines is not None or a.impl or a.db is not None):
        ap.error("argument --planted: runs the planted faults; it does not take --machines, --impl or --db")
    for flag, v in (("--minutes", a.minutes), ("--seed", a.seed), ("--profile", a.profile)):
        if a.planted and v is not None:  # the planted runs have their own budget and seeds
            ap.error(f"argument {flag}: not with --planted (it runs --runs seeds of --budget seconds per fault)")
    if a.machines == []:  # `--machines` and no name: not "every machine" by accident
        ap.error(f"argument --machines: expected one or more of {', '.join(sorted(MACHINES))}")
    for flag, names in (("--machines", a.machines or []), ("--impl", a.impl)):
        if repeated(names):
            ap.error(f"argument {flag}: {', '.join(map(repr, repeated(names)))} given twice")
    a.minutes, a.seed, a.profile = a.minutes or 1.0, a.seed or 0, a.profile or "dev"
    if not a.planted and (a.runs is not None or a.budget is not None):
        ap.error(f"argument {'--runs' if a.runs is not None else '--budget'}: only with --planted")
    machines = list(a.machines or [])
    if a.impl:
        from .protocol import ProtocolError

        for spec in a.impl:
            try:
                checked_impl(spec)  # the one load of this class in the campaign (fuzz/registry.py)
            except ProtocolError as e:
                ap.error(f"argument --impl: {str(e).removeprefix('--impl ')}")
        machines += [f"{IMPL}{spec}" for spec in a.impl]
    if a.db is not None:
        try:
            check_db(a.db)
        except DatabaseError as e:
            ap.error(f"argument --db: {e}")
    if a.ray is not None:
        try:
            ray = ray_cluster(a.ray)
        except RayUnavailable as e:
            ap.error(f"argument --ray: {e}")
        a.workers = a.workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    a.workers = a.workers or 1
    return machines


def _to_engine_environment(ap, argv) -> None:
    """The engine machine runs where vLLM's engine runs: here, or the whole campaign re-executed
    with the engine environment's interpreter (same arguments); refused in argparse's one line
    when there is none (``make engine``)."""
    from vtoken.vllm_engine.envs import engine_python, runs_engine_here

    if runs_engine_here():
        return
    py = engine_python()
    if py is None:
        ap.error("argument --machines: the engine machine runs vLLM's real engine: build its environment first "
                 "(make engine)")
    print(f"vtoken fuzz: the engine machine runs in the engine environment: {py}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execv(py, [py, "-m", "vtoken", "fuzz", *argv])


def main_fuzz(argv) -> int:
    """``vtoken fuzz``. Exit status: 0 a green campaign (it ran, every machine did checked work,
    nothing found); 1 a failure found (or an asked machine unavailable); 2 the example database
    failed mid-campaign (``db_lost``, ``db_write_failed``); 3 the campaign did not run what it
    was asked (``worker_died``, ``zero_ops``); 130 interrupted. Each reason is named in the
    summary's ``run_errors`` and printed."""
    ap = _fuzz_parser()
    a = ap.parse_args(argv)
    machines = _checked_args(ap, a)
    if "engine" in (a.machines or ()):
        _to_engine_environment(ap, argv)  # returns only where vLLM's engine runs here
    os.environ["VTOKEN_DEVICE"] = a.device
    if a.planted:
        from .planted import main_planted

        try:
            return main_planted(a)
        except KeyboardInterrupt:
            print(f"\nvtoken fuzz: interrupted: the planted-fault runs are summarised only when all finish, so "
                  f"nothing was recorded ({Path(a.out) / 'planted.json'} not written)", file=sys.stderr, flush=True)
            return 130
    try:
        s = run_campaign(a.minutes, a.workers, a.seed, a.db, a.out, machines or None, progress=True,
                         profile=a.profile, ray=a.ray)
    except KeyboardInterrupt:  # before the workers ran (or while they were being stopped)
        summary = Path(a.out) / "summary.json"
        print(f"\nvtoken fuzz: interrupted before the campaign finished; "
              f"{'partial results: ' + str(summary) if summary.exists() else 'no summary written'}",
              file=sys.stderr, flush=True)
        return 130
    except DatabaseError as e:
        print(f"vtoken fuzz: {e}", file=sys.stderr, flush=True)
        return 2
    _report(s, a)
    if s["interrupted"]:
        return 130
    reasons = {e["reason"] for e in s["run_errors"]}
    if reasons & {"db_lost", "db_write_failed"}:
        print(f"vtoken fuzz: the example database {a.db} failed mid-campaign: "
              f"{s['db_error'] or next(e['detail'] for e in s['run_errors'] if e['reason'] == 'db_write_failed')}; "
              f"the campaign stopped (not a failure of a machine)", file=sys.stderr, flush=True)
        return 2
    asked_missing = a.machines and s["machines_unavailable"]
    if s["failures"] or asked_missing:
        return 1
    return 3 if s["run_errors"] else 0


def _report(s: dict, a) -> None:
    """Print the campaign's summary: the text (stderr with ``--json``, whose stdout holds the
    JSON line alone), each run error on stderr, then the JSON line."""
    text = sys.stderr if a.json else sys.stdout
    not_green = sorted({e["reason"] for e in s["run_errors"]})
    print(f"ops {s['ops']} in {s['seconds']:.0f} s: {s['ops_per_s_per_worker']:.0f} ops/s per worker, "
          f"{s['failures']} failure(s); hard states: " + ", ".join(f"{k} {v}" for k, v in s["hard_states"].items())
          + (f"; NOT GREEN: {', '.join(not_green)}" if not_green else ""), file=text)
    for config, states in s.get("hard_states_by_config", {}).items():
        print(f"  {config}: " + ", ".join(f"{k} {v}" for k, v in states.items()), file=text)
    for m, why in s["machines_unavailable"].items():
        print(f"machine {m} NOT RUN: {why}", file=text)
    if s["interrupted"]:
        done = ", ".join(f"{m} {n} ops" for m, n in s["ops_by_machine"].items()) or "no batch finished"
        print(f"interrupted after {s['seconds']:.0f} s ({done}; {s['failures']} failure(s)); partial results: "
              f"{Path(a.out) / 'summary.json'}" + (f", failures in {Path(a.out) / 'failures'}" if s["failures"] else ""),
              flush=True, file=text)
    for e in s["run_errors"]:
        print(f"vtoken fuzz: {run_error_text(e)}", file=sys.stderr)
    if a.json:
        print(json.dumps({k: s.get(k) for k in ("workers", "ops", "seconds", "ops_per_s_per_worker", "failures",
                                                "hard_states", "hard_states_by_config", "interrupted", "ops_by_machine",
                                                "ops_per_s_by_machine", "machines_unavailable", "db_error", "ray",
                                                "worker_errors", "run_errors", "green")}))
