"""The outputs guarantee under prefix caching, as a check: the real vLLM scheduler with the
adapter, reclamation on and off, prefix caching on and off (the audit's ``vllm-prefix-equality``
and the planted runs' ``prefix`` detector run this one body).

``prefix_equality(quick, seed, keep_prefix_bytes)``: later requests repeat an earlier
request's whole sequence, a prompt and a prefix; equal outputs for every request computed
alike (:func:`outputs_guarantee`; caching off: all of them), both runs' prefix-cache hit
rates, and every prefix hit's K/V against the same tokens computed with caching off
(:func:`served_from_cache_mismatch`). A broken assumption makes ``passed`` False and the
``detail`` start with ``assumption broken: <statement> [<name>]``; it never raises.
``_run`` (one decode through the adapter and vLLM's scheduler) and its helpers are shared with
the audit's other vLLM runs (``reports/vllm_runs.py`` imports them from here: the check lives
with the checks, the audit only reports it).

Owns: nothing beyond one run's harness, adapter and worker, dropped when it returns (and one
cached decoder model).
May call: vllm, vtoken.vllm_adapter, vtoken.model, vtoken.invariants (relocation_hash), torch;
never reports/ (the audit sits above the fuzzers).
Costs: four CPU decodes through the real vLLM scheduler per policy (one policy when quick).
"""

from __future__ import annotations

import contextlib
import time
import traceback
from typing import Callable, Optional

from vtoken.vllm_adapter import harness as _harness  # noqa: F401 - CPU environment before vLLM
from vtoken.vllm_adapter.adapter import ASSUMPTIONS, AdapterAssumptionError, AdapterConfig, AdapterDriver, \
    VTokenAdapter, default_adapter_planner_config
from vtoken.invariants.relocation_hash import RelocationChecker

__all__ = ["outputs_guarantee", "prefix_equality", "served_from_cache_mismatch"]


_MODEL_CACHE: dict = {}


def _model():
    from vtoken.model import DecoderConfig, PagedDecoder

    if "m" not in _MODEL_CACHE:
        _MODEL_CACHE["m"] = PagedDecoder(DecoderConfig(), batch_invariant=True)
    return _MODEL_CACHE["m"]


@contextlib.contextmanager
def _one_thread():
    """One torch thread for the run: results are bitwise reproducible for a fixed thread
    count, and on a loaded 2-core machine one thread is also much faster."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _broken(exc: BaseException) -> str:
    """A failure as a detail that names the broken assumption."""
    from vtoken.errors import RelocationCheckError, VTokenError

    if isinstance(exc, AdapterAssumptionError):
        return str(exc)
    if isinstance(exc, RelocationCheckError):
        return f"assumption broken: {ASSUMPTIONS['hash_and_compare']} [hash_and_compare]: {exc}"
    tb = traceback.extract_tb(exc.__traceback__)
    at = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    kind = "table" if isinstance(exc, VTokenError) else "run"
    return f"{kind} error {type(exc).__name__}: {exc}{at}"


def _prompt(seed: int, i: int, n: int, vocab: int = 512) -> list[int]:
    import numpy as np

    rng = np.random.default_rng([seed, i, n])
    return rng.integers(1, vocab, size=n).tolist()


class _Incarnations:
    """What the worker is told at each start of a request's computation (new, or resumed after
    preemption): ``(outputs known, tokens served from the prefix cache)``, in order. Two runs
    that give a request the same list computed it the same way (the same prefix-cache hits,
    the same preemptions at the same lengths): the premise of the outputs guarantee.

    ``first_kv``: per request, the K/V digest of every token its first step left in its table
    (``KVCache.slot_digests``, logical order; nothing is evicted before a request decodes), so
    the bytes a prefix hit served can be compared with the bytes a run without the hit wrote."""

    def __init__(self, worker):
        self.history: dict[str, list] = {}
        self.first_kv: dict[str, list] = {}
        self._worker = worker
        self._execute = worker.execute
        worker.execute = self

    def __call__(self, sched_out):
        started = [d.req_id for d in sched_out.scheduled_new_reqs]
        for d in sched_out.scheduled_new_reqs:
            self.history.setdefault(d.req_id, []).append((0, int(d.num_computed_tokens)))
        c = sched_out.scheduled_cached_reqs
        for i, r in enumerate(c.req_ids):
            if r in c.resumed_req_ids:
                self.history.setdefault(r, []).append((int(c.num_output_tokens[i]), int(c.num_computed_tokens[i])))
        out = self._execute(sched_out)
        w = self._worker
        for r in started:
            if r in w.table and r not in self.first_kv:
                self.first_kv[r] = w.kv.slot_digests(w.table.slot_mapping(r)).tolist()
        return out


def _run(*, reclaim: bool, prompts: dict, max_tokens: int, policy: str, seed: int, num_blocks: int,
         block_size: int = 16, prefix_caching: bool = True, async_scheduling: bool = True, copy_lag: int = 0,
         headroom: Optional[int] = None, snapshot_dir=None, late: Optional[dict] = None, evict_ratio: float = 0.5,
         max_num_batched_tokens: int = 2048, then: Optional[Callable[[Callable], dict]] = None,
         kv_layout: str = "full", keep_prefix_bytes: Optional[bool] = None) -> dict:
    """One decode through the adapter; returns outputs and measurements (raises on a broken
    assumption). ``late``: requests added after the first step (prefix-hit requests).
    ``then``: called once every request has finished, with ``output_tokens(req_id)``; the
    requests it returns (id -> prompt) are decoded next (a later request repeating an
    earlier one's prompt or its whole sequence).
    ``headroom``: None, the adapter's defaults (what the audit audits: in-place plans keeping
    hashed bytes, with the soft reservation of ``AdapterConfig.keep_headroom`` for their
    destinations, so the reservation path stays under the audit's runtime checks and the
    planted ``adapter_headroom_to_allocate`` is caught here); a number: the planner's own
    reservation of that size instead.
    ``kv_layout``: vLLM's KV cache groups (``hybrid``: full attention + a sliding window of two
    blocks, read by the model's odd layers). ``keep_prefix_bytes``: the adapter's setting
    (in-place plans never fill a block its prefix-cache hash describes); None: its default."""
    from vtoken.vllm_adapter.worker import VTokenWorker

    ad = VTokenAdapter(block_size=block_size, num_blocks=num_blocks, prefix_caching=prefix_caching,
                       async_scheduling=async_scheduling, reclaim=reclaim,
                       planner_config=None if headroom is None else default_adapter_planner_config(headroom=headroom),
                       max_num_batched_tokens=max_num_batched_tokens, kv_layout=kv_layout,
                       **({} if keep_prefix_bytes is None else {"keep_prefix_bytes": keep_prefix_bytes}))
    w = VTokenWorker(_model(), ad.table, num_blocks, block_size, policy=policy, evict_ratio=evict_ratio,
                     seed=seed, check_relocations=RelocationChecker if reclaim else None, snapshot_dir=snapshot_dir,
                     copy_lag=copy_lag, layout=ad.worker_layout())
    if reclaim:  # every plan of the audited run against the reference planner's contract
        from vtoken.invariants.plan_contract import check_proposal

        ad.plan_hook = check_proposal
    seen = _Incarnations(w)
    d = AdapterDriver(ad, w)
    t0 = time.perf_counter()
    for r, p in prompts.items():
        ad.add_request(r, p, max_tokens=max_tokens)
    if late:
        d.step()
        for r, p in late.items():
            ad.add_request(r, p, max_tokens=max_tokens)
    every = dict(prompts, **(late or {}))
    _finish_all(ad, d)
    if then is not None:
        more = then(ad.output_tokens)
        for r, p in more.items():
            ad.add_request(r, p, max_tokens=max_tokens)
        every.update(more)
        _finish_all(ad, d)
    ad.drain_idle()
    wall = time.perf_counter() - t0
    ad.close()
    return _measures(ad, w, seen, every, wall, num_blocks)


def _finish_all(ad, d) -> None:
    """Step the driver ``d`` until adapter ``ad`` has no work (RuntimeError past 20000 steps),
    then finish every step still in flight."""
    n = 0
    while ad.has_work():
        d.step()
        n += 1
        if n > 20000:
            raise RuntimeError("decode did not finish")
    while d.in_flight:
        d._finish_one()


def _measures(ad, w, seen: _Incarnations, every: dict, wall: float, num_blocks: int) -> dict:
    """What :func:`_run` returns for a finished run: each request's outputs, incarnations,
    first K/V digests and prompt length (``every``: id -> prompt), the retained-block series
    and its summaries, the adapter's and worker's counters."""
    ret = ad.retained
    k = len(every)
    full = [x for x in ret if x[2] == k]
    return {
        "outputs": {r: ad.output_tokens(r) for r in every},
        "incarnations": {r: seen.history.get(r, []) for r in every},
        "first_kv": {r: seen.first_kv.get(r, []) for r in every},
        "prompt_tokens": {r: len(p) for r, p in every.items()},
        "retained": ret,
        "retained_mean": sum(x[1] for x in ret) / max(1, len(ret)),
        "retained_peak": max((x[1] for x in ret), default=0),
        "retained_all_running": full[-1][1] if full else 0,
        "stats": dict(ad.stats), "worker": dict(w.stats),
        "hash_checks": w.hash_checks, "hash_failures": w.hash_failures,
        "steps": ad.steps, "wall_s": wall, "preempted": ad.stats["preemptions"],
        "free_end": ad.pool.get_num_free_blocks(), "N": num_blocks,
    }


# ---------------------------------------------------------------------------- the outputs guarantee
def _first_difference(a: list, b: list) -> int:
    return next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))


def _hit_rate(run: dict, reqs) -> float:
    """Tokens served from the prefix cache over the tokens known at each start (new or resumed)."""
    hit = known = 0
    for r in reqs:
        for outs, cached in run["incarnations"][r]:
            hit += cached
            known += run["prompt_tokens"][r] + outs
    return hit / known if known else 0.0


def outputs_guarantee(on: dict, off: dict) -> dict:
    """The outputs guarantee, checked between two runs (``_run`` results) of the same requests,
    eviction policy and seed: every request that both runs computed the same way (the same
    :class:`_Incarnations` list: the same prefix-cache hits, the same preemptions at the same
    lengths) has the same output tokens in both.

    With prefix caching off there are no hits, so without preemption every request is
    compared. With it on, reclamation drops the hashes of the blocks a plan moves out of or
    into, so a later request with the same prefix may hit less than under Naive-Evict and
    compute those tokens instead; a policy that scores attention (H2O, Scissorhands) sees no
    statistics for cached tokens, so its decisions, and the outputs, may follow the hits.
    Such requests are not compared: they are listed in ``not_compared``, and the hit rates of
    both runs are reported. ``differ``: ``[request, first differing output index]`` of
    compared requests whose outputs differ (a broken guarantee). Pure.
    """
    reqs = list(on["outputs"])
    if set(reqs) != set(off["outputs"]):
        raise ValueError(f"the runs decoded different requests: {sorted(set(reqs) ^ set(off['outputs']))}")
    same = [r for r in reqs if on["incarnations"][r] == off["incarnations"][r]]
    differ = [[r, _first_difference(on["outputs"][r], off["outputs"][r])] for r in same
              if on["outputs"][r] != off["outputs"][r]]
    return {"compared": len(same), "requests": len(reqs), "equal": not differ, "differ": differ,
            "not_compared": [r for r in reqs if r not in same],
            "hit_rate_on": round(_hit_rate(on, reqs), 4), "hit_rate_off": round(_hit_rate(off, reqs), 4)}


def served_from_cache_mismatch(cached: dict, fresh: dict) -> list:
    """Prefix hits against fresh compute: for every request whose first step took ``k`` > 0
    tokens from the prefix cache in the ``cached`` run, the K/V digests of those ``k`` tokens
    against the same tokens in the ``fresh`` run (the same requests with caching off, where
    every token is computed). ``[[request, first differing position], ...]``: a hit served
    bytes a fresh prefill does not write (a stale or unfaithful hash: prefix-cache poisoning).
    Sound where a token's K/V does not depend on how its prefill was chunked (the
    batch-invariant decoder here). Pure."""
    bad = []
    for r, inc in cached["incarnations"].items():
        k = inc[0][1] if inc else 0
        got, want = cached["first_kv"][r][:k], fresh["first_kv"][r][:k]
        if k and got != want:
            bad.append([r, _first_difference(got, want)])
    return bad


def _repeats(prompts: dict, seed: int) -> Callable[[Callable], dict]:
    """The later requests of the prefix-equality run: the first request's whole sequence
    (prompt + outputs: its faithful blocks are cached, its later ones were computed after
    evictions), the second's prompt again, and the third's first two blocks with a new tail."""
    first, second, third = list(prompts)[:3]

    def then(output_tokens) -> dict:
        return {"again-seq": prompts[first] + output_tokens(first), "again-prompt": list(prompts[second]),
                "again-prefix": prompts[third][:32] + _prompt(seed, 999, 20)}
    return then


def _prefix_policy_row(policy: str, runs: dict, g_off: dict, g_on: dict, problems: list) -> dict:
    """One policy's row of :func:`prefix_equality`; appends what is wrong to ``problems``."""
    row = {"policy": policy, "cache_off": g_off, "cache_on": g_on,
           "relocations": runs[(True, True)]["stats"]["applied"],
           "hash_failures": runs[(True, True)]["hash_failures"] + runs[(True, False)]["hash_failures"]}
    if g_off["compared"] != g_off["requests"] or not g_off["equal"]:
        problems.append(f"{policy}, caching off: {g_off['compared']}/{g_off['requests']} requests "
                        f"compared, differ {g_off['differ']}")
    if not g_on["equal"]:
        problems.append(f"{policy}, caching on: outputs differ with the same prefix-cache hits "
                        f"{g_on['differ']}")
    if g_on["hit_rate_off"] == 0:
        problems.append(f"{policy}: no prefix-cache hit even with reclamation off (the run is too weak)")
    if min(runs[(True, True)]["stats"]["applied"], runs[(True, False)]["stats"]["applied"]) == 0:
        problems.append(f"{policy}: no relocation happened (the run is too weak)")
    if row["hash_failures"]:
        problems.append(f"{policy}: {row['hash_failures']} hash failures")
    for reclaim, name in ((True, "vtoken"), (False, "naive-evict")):
        bad = served_from_cache_mismatch(runs[(reclaim, True)], runs[(reclaim, False)])
        row[f"hits_served_fresh_bytes_{name}"] = not bad
        if bad:
            problems.append(f"{policy}, {name}: prefix hits served K/V a fresh prefill does not write "
                            f"{bad} (a stale or unfaithful prefix-cache hash)")
    if policy == "random":  # decisions independent of attention: hits must be transparent
        for reclaim, name in ((True, "vtoken"), (False, "naive-evict")):
            a, b = runs[(reclaim, True)]["outputs"], runs[(reclaim, False)]["outputs"]
            bad = [[r, _first_difference(a[r], b[r])] for r in a if a[r] != b[r]]
            row[f"hits_transparent_{name}"] = not bad
            if bad:
                problems.append(f"{policy}, {name}: outputs with prefix caching on differ from caching "
                                f"off {bad} (a hit served bytes a recompute does not write: a stale or "
                                f"unfaithful prefix-cache hash)")
    return row


def prefix_equality(quick: bool = True, seed: int = 0, keep_prefix_bytes: Optional[bool] = None) -> dict:
    """What the outputs guarantee says under prefix caching, checked (``vtoken audit`` check
    ``vllm-prefix-equality``). Requests decode and finish; then later requests repeat a whole
    earlier sequence, a prompt, and a prefix. Each policy runs with reclamation on and off,
    with prefix caching off and on:

    - caching off: every request's output equal on and off (:func:`outputs_guarantee`, all
      compared);
    - caching on: equal for every request computed the same way on and off, and the
      prefix-cache hit rate of both runs reported (reclamation lowers it: moved blocks lose
      their hash);
    - a hit serves exactly the bytes a recompute writes (only blocks computed with full
      context keep a hash): with a policy that does not score attention (random), each of the
      two adapters gives the same outputs with caching on as with it off. A stale or
      unfaithful hash (prefix-cache poisoning) shows up here.

    ``keep_prefix_bytes``: vtoken's runs with the adapter's setting of that name (None: the
    adapter's default, on); on, its hit rate must reach Naive-Evict's, a problem otherwise.
    Never raises."""
    t0 = time.perf_counter()
    res = dict(passed=False, detail="", runs=[])
    if keep_prefix_bytes is None:
        keep_prefix_bytes = AdapterConfig.keep_prefix_bytes  # the shipped default
    nreq, new = 4, 24
    prompts = {f"r{i}": _prompt(seed, i, 40 + 13 * i) for i in range(nreq)}
    policies = ["random"] if quick else ["random", "h2o"]
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        res["detail"] = f"vLLM not installed ({exc}): run scripts/install_vllm.sh"
        return res
    problems, parts = [], []
    try:
        with _one_thread():
            for policy in policies:
                nb = 2 + 8 + 2 * sum(-(-(len(p) + new) // 16) + 1 for p in prompts.values())
                kw = dict(prompts=prompts, max_tokens=new, policy=policy, seed=seed, num_blocks=nb,
                          then=_repeats(prompts, seed))
                runs = {(reclaim, cache): _run(reclaim=reclaim, prefix_caching=cache,
                                               keep_prefix_bytes=keep_prefix_bytes if reclaim else None, **kw)
                        for reclaim in (True, False) for cache in (False, True)}
                g_off = outputs_guarantee(runs[(True, False)], runs[(False, False)])
                g_on = outputs_guarantee(runs[(True, True)], runs[(False, True)])
                row = _prefix_policy_row(policy, runs, g_off, g_on, problems)
                if keep_prefix_bytes and g_on["hit_rate_on"] < g_on["hit_rate_off"]:
                    problems.append(f"{policy}: keep_prefix_bytes on, yet the hit rate fell below "
                                    f"Naive-Evict's ({g_on['hit_rate_on']} < {g_on['hit_rate_off']})")
                res["runs"].append(row)
                parts.append(f"{policy}: caching off {g_off['compared']}/{g_off['requests']} equal; caching on "
                             f"{g_on['compared']}/{g_on['requests']} computed alike and equal "
                             f"({len(g_on['not_compared'])} with other prefix-cache hits not compared); hit rate "
                             f"naive-evict {100 * g_on['hit_rate_off']:.1f}%, vtoken {100 * g_on['hit_rate_on']:.1f}%")
    except Exception as exc:  # noqa: BLE001 - a broken assumption or a crash is a failed check
        res["detail"] = _broken(exc)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        return res
    res["passed"] = not problems
    res["detail"] = ("; ".join(problems) + "; " if problems else "") + "; ".join(parts)
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res
