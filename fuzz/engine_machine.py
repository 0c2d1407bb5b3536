"""The engine conformance machine: vLLM's real engine with vtoken, against Naive-Evict in the
same process, driven by the same operations (``vtoken fuzz --machines engine``).

Two of vLLM's engines (``vllm.LLMEngine``, one process each, ``VLLM_ENABLE_V1_MULTIPROCESSING
=0``), built from ``vtoken.vllm_engine.engine_args`` with the same settings but ``reclaim``: the
machine adds requests (random prompts, some repeating an earlier one: prefix-cache hits), aborts
running ones and steps both engines in lock step. The settings are drawn per example (policy,
evict ratio, copy lag, prefix caching); the engines of each combination are built once per
process and reused (a built engine costs about a second), with their prefix caches emptied at
each example's start (``_fresh_caches``: an example replays as it first ran).

After every step of the vtoken engine: the adapter's runtime checks and its ownership ledger
(``check_all``), no hash-and-compare failure in the worker, and the worker's block-table rows in
step with the scheduler side's lists (an entry the scheduler lists is the one the runner reads;
an entry the runner nulled the scheduler no longer lists). At the end of each example both
engines run to idle and every request both finished, computed alike (the same prefix-cache
hit, no preemption), has the same output, token for token; the vtoken engine holds no plan and
no block for a request that left.

Runs only where vLLM's engine runs (``vllm._C``): ``vtoken fuzz`` hands an engine machine to
the engine environment's interpreter.
Owns: the engines it builds (per process, per settings).
May call: vLLM (``LLM``, its engine), vtoken.vllm_engine, hypothesis.
Costs: per step two engine steps (a few milliseconds each for the tiny model) plus the
adapter's checks.
"""

from __future__ import annotations

import os

import hypothesis.strategies as st
from hypothesis import event, note
from hypothesis.stateful import initialize, invariant, precondition, rule

from vtoken.vllm_engine.envs import runs_engine_here

from .hard_states import hard, tag
from .step_draws import SwarmRules, integer, pick

if not runs_engine_here():  # a campaign lists the machine as unavailable here, with this reason
    raise ImportError("vLLM's engine does not run in this environment: the engine machine runs in the engine "
                      "environment (make engine; `vtoken fuzz --machines engine` goes there by itself)")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # an engine built per settings would flood a campaign's output

POLICIES = ("h2o", "streaming", "scissorhands", "random")
# copy lag 3: a copy launched after a step's forward is still in flight at the next step's reads
SETTINGS = [(p, r, lag, pc) for p in POLICIES for r in (0.5, 0.7) for lag in (0, 3) for pc in (False, True)]
BLOCK_SIZE, NUM_BLOCKS = 16, 512

_ENGINES: dict = {}


def engines(key: tuple):
    """The (vtoken, naive-evict) engines of ``key`` = (policy, evict ratio, copy lag, prefix
    caching), built at first use in this process."""
    if key not in _ENGINES:
        from vllm import LLM

        from vtoken.vllm_engine import engine_args
        from vtoken.vllm_engine.tiny_llama import ensure_tiny_llama

        policy, ratio, lag, pc = key
        base = dict(model=str(ensure_tiny_llama()), skip_tokenizer_init=True, block_size=BLOCK_SIZE,
                    max_model_len=1024, enforce_eager=True, seed=0, max_num_seqs=32, enable_prefix_caching=pc,
                    num_gpu_blocks_override=NUM_BLOCKS, kv_cache_memory_bytes=64 << 20)
        s = dict(policy=policy, evict_ratio=ratio, copy_lag=lag, paranoid_checks=True)
        _ENGINES[key] = tuple(LLM(**base, **engine_args(**s, reclaim=reclaim)).llm_engine for reclaim in (True, False))
    return _ENGINES[key]


def _scheduler(engine):
    return engine.engine_core.engine_core.scheduler


def _settle(engine) -> None:
    """Step ``engine``'s core until its scheduler has nothing left: the vtoken engine's plans in
    flight end on steps with nothing scheduled (vLLM's engine stops stepping without requests)."""
    core = engine.engine_core.engine_core
    for _ in range(100):
        if not core.scheduler.has_requests():
            break
        core.step()


def _runner(engine):
    return engine.engine_core.engine_core.model_executor.driver_worker.worker.vtoken.runner


class EngineMachine(SwarmRules):
    """vtoken and Naive-Evict in vLLM's engine, operation for operation (module docstring)."""

    ROUND_EXAMPLES = 10  # a measuring run (planted faults) checks its time budget this often
    ops = 0  # operations checked (an add, an abort, an engine step of both), summed over the process's runs
    def __init__(self):
        super().__init__()
        self.vt = self.ne = None
        self.prompts: list = []
        self.live: set = set()
        self.aborted: set = set()
        self.outputs: dict = {"vt": {}, "ne": {}}
        self.cached: dict = {"vt": {}, "ne": {}}
        self.n = 0

    @initialize(key=st.sampled_from(SETTINGS))
    def setup(self, key):
        self.key = key
        self.vt, self.ne = engines(key)
        self.ad = _scheduler(self.vt).vtoken_adapter
        self._fresh_caches()
        self.base = f"{id(self)}-"  # request ids unique across the examples an engine serves
        self.applied0 = self.ad.stats["applied"]
        tag(f"{key[0]}, copy lag {key[2]}, prefix caching {'on' if key[3] else 'off'}")
        note(f"settings (policy, evict ratio, copy lag, prefix caching): {key}")

    def _fresh_caches(self) -> None:
        """Each example starts from empty prefix caches. The engines serve every example of their
        settings in this process, and the prompts recur across examples (they are drawn from
        the example's own counters): a hit on a block an earlier example cached changes which
        tokens are computed, evicted and moved, so the replay of an example (Hypothesis
        replays to shrink) would take other steps than its first run and be refused as
        inconsistent data generation, a failure no one can reproduce. An example that ended
        in a failure may have left requests: they run to their end first."""
        for e in (self.vt, self.ne):
            for _ in range(5000):
                if not e.has_unfinished_requests():
                    break
                e.step()
            _settle(e)
            assert e.reset_prefix_cache(), "the engine's prefix cache did not reset between examples"

    # ---------------------------------------------------------------- operations
    @rule(data=st.data())
    def add(self, data):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        import numpy as np

        if self.prompts and integer(data, 0, 3, "repeat") == 0:
            p = pick(data, self.prompts, "repeat of")
        else:
            n = integer(data, 4, 80, "prompt length")
            p = np.random.default_rng([len(self.prompts), n, self.n]).integers(3, 1000, size=n).tolist()
        self.prompts.append(p)
        new = integer(data, 1, 48, "new tokens")
        rid = f"{self.base}{self.n}"
        self.n += 1
        sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False, seed=self.n)
        for e in (self.vt, self.ne):
            e.add_request(rid, TokensPrompt(prompt_token_ids=p), sp)
        self.live.add(rid)
        EngineMachine.ops += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        # the engine's own request ids carry a suffix of its own: "<ours>-<8 hex>"
        copying = {str(p.req_id).rsplit("-", 1)[0] for p in self.ad.plans.values() if not p.orphaned}
        flying = sorted(copying & self.live)
        # half the time, when one is there, a request whose plan's copy flies (the orphan's path)
        rid = pick(data, flying if flying and integer(data, 0, 1, "abort a copying request") else sorted(self.live),
                   "abort")
        if rid in flying:
            hard("engine abort with a plan in flight")
        for e in (self.vt, self.ne):
            e.abort_request([rid])
        self.live.discard(rid)
        self.aborted.add(rid)
        EngineMachine.ops += 1
        event("request aborted")

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def step(self, data):
        for _ in range(integer(data, 1, 12, "steps")):
            self._step_both()

    def _step_both(self) -> None:
        for name, e in (("vt", self.vt), ("ne", self.ne)):
            if not e.has_unfinished_requests():
                continue
            for o in e.step():
                if o.finished:
                    self.outputs[name][o.request_id] = list(o.outputs[0].token_ids)
                    self.cached[name][o.request_id] = int(o.num_cached_tokens or 0)
                    if name == "vt" and o.num_cached_tokens:
                        hard("engine prefix-cache hit")
                    self.live.discard(o.request_id)
        self.check_vtoken()
        EngineMachine.ops += 1

    # ---------------------------------------------------------------- checks
    def check_vtoken(self) -> None:
        ad = self.ad
        ad.check_all()  # the runtime checks, the ownership ledger included
        w = ad.worker_stats
        assert not w.get("hash_failures"), f"hash-and-compare failed in the worker: {w}"
        if ad.stats["applied"] > self.applied0:
            self.applied0 = ad.stats["applied"]
            hard("engine plan applied")
        if ad.plans and any(p.seq < ad.clock.processed for p in ad.plans.values()):
            hard("engine copy in flight across a step")
        self._check_rows()

    def _check_rows(self) -> None:
        """The runner's block-table rows follow the scheduler side's lists (entry by entry)."""
        ad, batch = self.ad, _runner(self.vt).input_batch
        rows = batch.block_table[0].block_table.np
        for r, row in batch.req_id_to_index.items():
            lst = ad.req_to_blocks.get(r)
            if lst is None or not ad.current(r):
                continue
            n = int(batch.block_table[0].num_blocks_per_row[row])
            for j, blk in enumerate(lst[:n]):
                got = int(rows[row, j])
                assert blk.is_null or got == blk.block_id, (
                    f"request {r!r}: the runner reads block {got} at index {j}, the scheduler lists {blk.block_id}")
                assert got != 0 or blk.is_null, f"request {r!r}: the runner nulled index {j}, still listed"

    def teardown(self):
        if self.vt is None:
            return
        for _ in range(5000):  # every request to its end
            if not (self.vt.has_unfinished_requests() or self.ne.has_unfinished_requests()):
                break
            self._step_both()
        self._idle()
        both = set(self.outputs["vt"]) & set(self.outputs["ne"])
        alike = [r for r in sorted(both) if self.cached["vt"][r] == self.cached["ne"][r] and r not in self.aborted]
        obs = self.ad.scheduler.vtoken_observer
        pre = {str(r).rsplit("-", 1)[0] for r in obs.preempted} if obs is not None else set()  # the engine's ids
        for r in alike:
            if r in pre:
                continue
            a, b = self.outputs["vt"][r], self.outputs["ne"][r]
            assert a == b, f"request {r!r}: outputs differ from Naive-Evict's in the same engine: {a} vs {b}"
            hard("engine outputs compared")

    def _idle(self) -> None:
        """Both engines idle: the vtoken engine's last steps taken (plans in flight end), then
        nothing left for requests that left."""
        for e in (self.vt, self.ne):
            _settle(e)
        ad = self.ad
        ad.check_all()
        assert not ad.plans, f"plans still in flight at idle: {sorted(ad.plans)}"
        left = {r: list(h) for r, h in ad.held.items() if h}
        assert not left, f"blocks still held for requests that left: {left}"


EngineMachine.TestCase.settings = None  # the campaign's and the tests' profiles decide
