"""Eviction schedules: which tokens a real policy evicts at which step of a request.

A request's evictions depend only on its own attention and policy state, so they are
computed once (real ``vtoken.policies`` fed by the synthetic attention model) and replayed by
every system: Naive-Evict and vToken see identical evictions.

Step 0 is the prefill (``prompt`` tokens); step ``s >= 1`` appends token ``prompt + s - 1``;
done after step ``output``. ``victims[offsets[s]:offsets[s + 1]]`` are evicted at step ``s``
after its tokens are registered. Policies run once per ``window`` decode steps (default 16)
on the window's summed attention and pick its victims, evicted in logical order as the
budget requires (the live count never exceeds the budget).

Owns: the on-disk schedule cache (``cache_dir()``; keyed by the arguments and the code's hash).
May call: vtoken.policies, .errors, vtoken.sim.attention, .config, numpy, hashlib; never spec/, invariants/,
fuzz/ or reports/.
Costs: a schedule O(steps / window x policy cost): seconds for 12K steps; a cache hit O(file).
"""

from __future__ import annotations

import hashlib
import math
import os
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from vtoken.errors import ConfigError
from vtoken.policies import POLICIES, make_policy

from .attention import AttentionModel
from .config import need_choice, need_int, need_number


@dataclass
class Schedule:
    """One request's evictions: ``victims[offsets[s]:offsets[s + 1]]`` at step ``s``. Checked at
    construction (ConfigError naming ``Schedule.<field>``): ``prompt`` >= 1, ``output`` >= 0;
    ``victims``, ``offsets`` 1-D integer arrays (int64), ``offsets`` of ``output + 2`` entries
    rising from 0 to ``len(victims)``; each victim exists at its step (``< prompt + s``), none
    twice. O(victims log victims)."""

    prompt: int
    output: int
    victims: np.ndarray  # int64, concatenated per step
    offsets: np.ndarray  # int64, len output + 2
    policy: str = ""

    def __post_init__(self) -> None:
        o = "Schedule"
        self.prompt = need_int(o, "prompt", self.prompt, 1)
        self.output = need_int(o, "output", self.output, 0)
        for name in ("victims", "offsets"):
            v = getattr(self, name)
            if not isinstance(v, np.ndarray) or v.ndim != 1 or not np.issubdtype(v.dtype, np.integer):
                what = f"{v.ndim}-D {v.dtype} array" if isinstance(v, np.ndarray) else type(v).__name__
                raise ConfigError("bad_type", f"{o}.{name} must be a 1-D integer numpy array, got a {what}")
            setattr(self, name, v.astype(np.int64, copy=False))
        off, vic = self.offsets, self.victims
        if len(off) != self.output + 2:
            raise ConfigError("out_of_range", f"{o}.offsets must be output + 2 = {self.output + 2} entries long, "
                                              f"got {len(off)}")
        falling = bool(np.any(np.diff(off) < 0))
        if off[0] != 0 or off[-1] != len(vic) or falling:
            raise ConfigError("out_of_range", f"{o}.offsets must be rising from 0 to len(victims) = {len(vic)}, got "
                                              f"{off[0]} .. {off[-1]}" + (" (falling)" if falling else ""))
        if len(vic):
            step = np.repeat(np.arange(self.output + 1), np.diff(off))
            bad = (vic < 0) | (vic >= self.prompt + step)  # step 0 holds the prompt, step s one more token each
            if bad.any():
                i = int(np.argmax(bad))
                raise ConfigError("out_of_range", f"{o}.victims[{i}] must be a token of length {self.prompt + step[i]} "
                                                  f"at step {step[i]}, got {int(vic[i])}")
            u, n = np.unique(vic, return_counts=True)
            if len(u) != len(vic):
                raise ConfigError("out_of_range", f"{o}.victims must be distinct tokens, got token "
                                                  f"{int(u[np.argmax(n > 1)])} twice")
        if not isinstance(self.policy, str):
            raise ConfigError("bad_type", f"{o}.policy must be a str, got {self.policy!r}")

    @property
    def steps(self) -> int:
        return self.output + 1

    def at(self, s: int) -> np.ndarray:
        return self.victims[self.offsets[s]:self.offsets[s + 1]]

    def live_after(self, s: int) -> int:
        """Live tokens after step ``s`` (no deferral)."""
        return self.prompt + s - int(self.offsets[s + 1])


class _Budget:
    """A budget rule with a ``key`` naming it (for the schedule cache)."""

    def __init__(self, fn: Callable[[int], int], key: str):
        self.fn, self.key = fn, key

    def __call__(self, n: int) -> int:
        return self.fn(n)


def ratio_budget(keep: float, min_keep: int = 64) -> Callable[[int], int]:
    """Keep ``ceil(keep * length)`` tokens (at least ``min_keep``); ``keep`` in [0, 1],
    ``min_keep`` an integer >= 0 (ConfigError otherwise)."""
    need_number("ratio_budget", "keep", keep, 0, 1)
    need_int("ratio_budget", "min_keep", min_keep, 0)
    return _Budget(lambda n: max(min_keep, int(math.ceil(keep * n))), f"ratio({keep!r},{min_keep!r})")


def fixed_budget(b: int) -> Callable[[int], int]:
    """Keep ``b`` tokens (an integer >= 0; ConfigError otherwise)."""
    need_int("fixed_budget", "b", b, 0)
    return _Budget(lambda n: b, f"fixed({b!r})")


# ---------------------------------------------------------------- the schedule cache
# A schedule is a pure function of its arguments and of the code that makes it (the
# policies, the attention model, this module), so it is cached on disk keyed by both: the
# frontier and robustness experiments replay the same 12K-step H2O schedules (~1.5 s each).
_CODE_KEY: list = []


def _code_key() -> str:
    if not _CODE_KEY:
        from pathlib import Path

        import vtoken.policies as pol

        h = hashlib.sha256()
        files = sorted(Path(pol.__file__).parent.glob("*.py")) + [Path(__file__), Path(__file__).with_name("attention.py")]
        for f in files:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        _CODE_KEY.append(h.hexdigest()[:16])
    return _CODE_KEY[0]


def cache_dir():
    """``$VTOKEN_SIM_CACHE`` (``off``: no cache), else ``<repo>/.vtoken/sim-cache`` when run
    from the repository, else ``~/.cache/vtoken/sim``."""
    from pathlib import Path

    env = os.environ.get("VTOKEN_SIM_CACHE")
    if env:
        return None if env.lower() in ("off", "0", "no") else Path(env)
    repo = Path(__file__).resolve().parents[2]
    if (repo / "vtoken").is_dir() and (repo / ".git").exists():
        return repo / ".vtoken" / "sim-cache"
    return Path.home() / ".cache" / "vtoken" / "sim"


def cached_schedule(prompt: int, output: int, policy: str, budget, seed: int, req_key: int,
                    model: AttentionModel | None = None, window: int = 16, recent: int | None = None) -> Schedule:
    """:func:`make_schedule`, read from the cache when it was made before with the same
    arguments and code (``budget`` must come from :func:`fixed_budget` / :func:`ratio_budget`)."""
    check_schedule_args("cached_schedule", prompt, output, policy, budget, seed, req_key, model, window, recent)
    d = cache_dir()
    key_budget = getattr(budget, "key", None)
    if d is None or key_budget is None:
        return make_schedule(prompt, output, policy, budget, seed, req_key, model=model, window=window, recent=recent)
    model = model or AttentionModel()
    args = repr((prompt, output, policy, key_budget, seed, req_key, sorted(model.describe().items()), window, recent))
    name = hashlib.sha256((_code_key() + args).encode()).hexdigest()[:32]
    path = d / "schedules" / f"{name}.npz"
    try:
        with np.load(path) as z:
            return Schedule(prompt, output, z["victims"], z["offsets"], policy)
    except (OSError, KeyError, ValueError):
        pass
    sch = make_schedule(prompt, output, policy, budget, seed, req_key, model=model, window=window, recent=recent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{name}.{os.getpid()}.npz")
        np.savez(tmp, victims=sch.victims, offsets=sch.offsets)
        os.replace(tmp, path)  # atomic: concurrent workers never read half a file
    except OSError:
        pass
    return sch


def check_schedule_args(owner: str, prompt, output, policy, budget, seed, req_key, model, window, recent) -> None:
    """The arguments of :func:`make_schedule` / :func:`cached_schedule`: ``prompt`` >= 1,
    ``output`` >= 0, ``policy`` a ``vtoken.policies`` name, ``budget`` callable, ``seed`` and
    ``req_key`` >= 0 (they seed numpy), ``model`` None or an ``AttentionModel``, ``window`` >= 1,
    ``recent`` None or >= 0; ConfigError naming ``owner.<argument>`` otherwise. O(1)."""
    need_int(owner, "prompt", prompt, 1)
    need_int(owner, "output", output, 0)
    need_choice(owner, "policy", policy, sorted(POLICIES))
    if not callable(budget):
        raise ConfigError("bad_type", f"{owner}.budget must be callable (length -> tokens kept), got {budget!r}")
    need_int(owner, "seed", seed, 0)
    need_int(owner, "req_key", req_key, 0)
    if model is not None and not isinstance(model, AttentionModel):
        raise ConfigError("bad_type", f"{owner}.model must be an AttentionModel or None, got {model!r}")
    need_int(owner, "window", window, 1)
    need_int(owner, "recent", recent, 0, none_ok=True)


def policy_kwargs(name: str, seed: int, req_key: int, recent: int | None = None) -> dict:
    if name == "random":
        return {"seed": int(zlib.crc32(f"{seed}/{req_key}".encode()))}
    if name == "h2o" and recent is not None:
        return {"recent": recent}
    return {}


def make_schedule(prompt: int, output: int, policy: str, budget: Callable[[int], int], seed: int,
                  req_key: int, model: AttentionModel | None = None, window: int = 16,
                  recent: int | None = None) -> Schedule:
    """Run one request's policy against the synthetic attention and record its victims.
    The arguments are checked first (:func:`check_schedule_args`)."""
    check_schedule_args("make_schedule", prompt, output, policy, budget, seed, req_key, model, window, recent)
    model = model or AttentionModel()
    rng = np.random.default_rng([seed, req_key, 0xA77])
    total = prompt + output
    w = model.importance(total, rng)
    pol = make_policy(policy, **policy_kwargs(policy, seed, req_key, recent))
    uses_attn = type(pol).uses_attention  # the class says so; never decided by its name here
    live = np.zeros(total, dtype=bool)
    counts = np.zeros(output + 1, dtype=np.int64)
    chunks: list[np.ndarray] = []
    rid = req_key

    # step 0: prefill
    live[:prompt] = True
    n, n_live, last_q = prompt, prompt, prompt
    ids = np.arange(prompt)
    if uses_attn:
        pol.observe(rid, ids, model.window(w, ids, 0, prompt, rng))
    b = budget(n)
    if n_live > b:
        v = pol.select_victims(rid, ids, b)
        live[v] = False
        n_live -= len(v)
        chunks.append(v)
        counts[0] = len(v)

    pending = np.empty(0, dtype=np.int64)
    pi = 0
    cum_due = []  # per step of the current window: victims due by that step
    for s in range(1, output + 1):
        n += 1
        live[n - 1] = True
        n_live += 1
        if (s - 1) % window == 0:
            ids = np.flatnonzero(live[:n])
            if uses_attn:
                pol.observe(rid, ids, model.window(w, ids, last_q, n, rng))
                last_q = n
            # victims the next `window` steps need, all chosen now from the present tokens
            s_end = min(output, s + window - 1)
            c, cum_due = 0, []
            for j in range(s, s_end + 1):
                c = max(c, n_live + (j - s) - budget(prompt + j))
                cum_due.append(c)
            need = min(c, n_live - 1)
            pending = pol.select_victims(rid, ids, n_live - need) if need > 0 else np.empty(0, dtype=np.int64)
            pi = 0
        due = min(cum_due[(s - 1) % window], len(pending))
        if due > pi:
            v = pending[pi:due]
            pi = due
            live[v] = False
            n_live -= len(v)
            chunks.append(v)
            counts[s] = len(v)
    if uses_attn or hasattr(pol, "forget"):
        pol.forget(rid)
    victims = np.concatenate(chunks).astype(np.int64) if chunks else np.empty(0, dtype=np.int64)
    offsets = np.zeros(output + 2, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return Schedule(prompt, output, victims, offsets, policy)
