"""The system's benchmarks: the token table's host step cost against the reference model,
the planner's settling (``vtoken bench table|planner``). Each prints figures and returns one
dict; variants are compared within one run and reported as ratios, because the machine is
shared and noisy. Speed targets live here, never in timed unit tests.

Owns: nothing beyond one run's tables, allocators and managers, dropped when it returns.
May call: vtoken.table, .allocator, .planner, vtoken.spec, vtoken.invariants.z3_checks, numpy.
Costs: seconds (``quick``) to minutes; each benchmark's cost is what it times.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from vtoken.allocator import BlockAllocator
from vtoken.table import TokenTable


def _steady_table_run(make_table, sync, evict, read_side, R, L, S, steps, seed, step_end=None):
    """Drive ``R`` requests of ``L`` tracked tokens (half live) for ``steps`` scheduler steps.

    Each step every request gains one token (a new block when the last is full) and evicts
    one random live token, then the read side is brought up to date. Returns per-step
    times (seconds) of the timed steps.
    """
    rng = np.random.default_rng(seed)
    nblocks_per_req = (L + steps) // S + 2
    alloc = BlockAllocator(R * nblocks_per_req + 1)
    table = make_table(S, R * nblocks_per_req + 1)
    blocks, live_sets, lengths = {}, {}, {}
    for r in range(R):
        blocks[r] = alloc.allocate(-(-L // S))
        sync(table, r, blocks[r], L)
        victims = rng.choice(L - 1, size=L // 2, replace=False)  # never the newest token
        evict(table, r, victims.tolist())
        live = np.ones(L + steps + 1, dtype=bool)
        live[victims] = False
        live_sets[r], lengths[r] = live, L
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for r in range(R):
            n = lengths[r]
            if n % S == 0:
                blocks[r] += alloc.allocate(1)
            sync(table, r, blocks[r], n + 1)
            live = live_sets[r]
            while True:  # a random live token, never the newest
                v = int(rng.integers(0, n))
                if live[v]:
                    break
            live[v] = False
            evict(table, r, [v])
            if read_side is not None:
                read_side(table, r)
            lengths[r] = n + 1
        if step_end is not None:
            step_end(table)
        times.append(time.perf_counter() - t0)
    return times


def _impl_ops():
    def sync(t, r, bl, n):
        t.sync_new_tokens(r, bl, n)

    def evict(t, r, ids):
        t.evict_tokens(r, ids)

    def step_end(t):
        t.flush()  # the device-side per-token slots and live mask, current for the next step

    return (lambda S, nb: TokenTable(S, nb)), sync, evict, None, step_end


def _spec_ops():
    from vtoken.spec import SpecTokenTable

    def sync(t, r, bl, n):
        # the reference's sync is quadratic in one call's size: feed it a block at a time
        cur = len(t.tokens.get(r, []))
        while cur < n:
            cur = min(n, (cur // t.S + 1) * t.S)
            t.sync_new_tokens(r, bl, cur)

    def evict(t, r, ids):
        t.evict_tokens(r, ids)

    def read_side(t, r):
        t.slot_mapping(r)  # the reference's read side: recomputed from the table

    return (lambda S, nb: SpecTokenTable(S, nb)), sync, evict, read_side, None


def bench_table(R=256, S=16, steps=20, spec_requests=8, seed=0, quick=False) -> dict:
    if quick:
        R, steps, spec_requests = 64, 10, 2
    out = {"R": R, "block_size": S, "steps": steps}
    make, sync, evict, read, end = _impl_ops()
    for L, key in ((1024, "step_ms_1k"), (16384, "step_ms_16k")):
        ts = _steady_table_run(make, sync, evict, read, R, L, S, steps, seed, end)
        out[key] = statistics.median(ts) * 1e3
        print(f"impl  R={R} L={L}: median step {out[key]:.2f} ms (min {min(ts)*1e3:.2f})", flush=True)
    out["history_ratio"] = out["step_ms_16k"] / out["step_ms_1k"]
    # The reference at R=spec_requests, scaled linearly to R. Its per-request cost also grows
    # with R (reference counts scan every request), so linear scaling flatters the reference.
    make, sync, evict, read, end = _spec_ops()
    ts = _steady_table_run(make, sync, evict, read, spec_requests, 16384, S, max(3, steps // 4), seed)
    spec_ms = statistics.median(ts) * 1e3 * R / spec_requests
    out["spec_step_ms_16k_scaled"] = spec_ms
    out["spec_scaling"] = f"reference run with {spec_requests} requests x 16K tokens, scaled x{R // spec_requests} (linear)"
    out["speedup_vs_spec"] = spec_ms / out["step_ms_16k"]
    print(f"spec  R={spec_requests} L=16384 scaled to R={R}: {spec_ms:.1f} ms", flush=True)
    return out


def _planner_setup(R, L, S, evict, headroom, theta_f, seed, max_sources=None):
    """R requests of L tokens with ``evict`` of them evicted at random, in a pool with just
    the headroom and a block to spare (so the pool is under pressure), and a manager with
    the shipped planner defaults (``PlannerConfig()``) but for the arguments not None."""
    from dataclasses import replace

    from vtoken.planner import PlannerConfig, ReclamationManager

    rng = np.random.default_rng(seed)
    headroom = PlannerConfig().headroom if headroom is None else headroom
    nb = R * (-(-L // S)) + headroom + 2
    table, alloc = TokenTable(S, nb), BlockAllocator(nb)
    blocks = {}
    for r in range(R):
        blocks[r] = alloc.allocate(-(-L // S))
        table.sync_new_tokens(r, blocks[r], L)
        table.evict_tokens(r, rng.choice(L - 1, size=int(L * evict), replace=False))
    over = dict(theta_f=theta_f, headroom=headroom, max_sources=max_sources)
    cfg = replace(PlannerConfig(), **{k: v for k, v in over.items() if v is not None})
    mgr = ReclamationManager(table, alloc, config=cfg)
    for r, b in blocks.items():  # the manager holds each request's blocks (and keeps them across plans)
        mgr.hold(r, b)
    return table, alloc, mgr


def bench_planner(seed=0, quick=False, rounds=5) -> dict:
    """Planning-round time vs request count, settled retained blocks vs ideal, and Z3 check time.

    Every request count's setup is built first and their rounds are run in turn (round k of
    each count, then round k + 1), so a slow stretch of a shared machine falls on all counts
    alike; each count's figure is the median of its ``rounds`` round times."""
    S, L = 16, (2048 if quick else 16384)
    counts = (16, 64) if quick else (16, 256, 1024)
    out = {"block_size": S, "tokens_per_request": L, "eviction": "random 50%", "plan_ms": {}}
    from vtoken.planner import PlannerConfig

    # headroom for one full plan (B destinations at most) per request: each round is a full planning pass
    setups = {R: _planner_setup(R, L, S, 0.5, headroom=PlannerConfig().max_sources * R, theta_f=0.0, seed=seed)
              for R in counts}
    ts: dict = {R: [] for R in counts}
    plans = dict.fromkeys(counts, 0)
    for _ in range(rounds):
        for R in counts:
            mgr = setups[R][2]
            t0 = time.perf_counter()
            launched = mgr.plan_round()
            ts[R].append(time.perf_counter() - t0)
            plans[R] += len(launched)
            mgr.poll(force_sync=True)
            mgr.refill_headroom()
    for R in counts:
        out["plan_ms"][str(R)] = statistics.median(ts[R]) * 1e3
        print(f"planner R={R} L={L}: median round {out['plan_ms'][str(R)]:.1f} ms, {plans[R] / rounds:.0f} plans/round",
              flush=True)
    del setups
    keys = [str(c) for c in counts]
    out["plan_ratio_1024_256" if not quick else "plan_ratio_last_prev"] = out["plan_ms"][keys[-1]] / out["plan_ms"][keys[-2]]
    out.update(settle_experiment(R=16 if quick else 64, L=1024 if quick else 4096, seed=seed))
    print(f"settled: retained {out['settled_blocks']} vs ideal {out['ideal_blocks']} -> {out['settled_over_ideal']:.4f}", flush=True)
    try:
        from vtoken.invariants.z3_checks import z3_check_time
    except ImportError as e:  # the Z3 checks are part of this package; say so if they are missing
        out["z3_s"] = f"unavailable: {e}"
    else:
        out["z3_s"] = {str(n): statistics.median(z3_check_time(n) for _ in range(3)) for n in (256, 1024, 4096)}
        print(f"z3 check seconds: {out['z3_s']}", flush=True)
    return out


def settle_experiment(R=64, L=4096, S=16, evict=0.5, headroom=None, theta_f=0.02, seed=0, max_steps=5000) -> dict:
    """Random eviction at ``evict`` over R requests of L tokens, then reclamation with the
    shipped planner defaults (``PlannerConfig()``) but ``theta_f`` 0.02 -- the question is how
    close to ideal packing the planner gets when asked to pack, and once its first plans
    free memory the pool is no longer short, so the defaults' 0.25 would stop at F = 0.25 --
    until it settles (a step with nothing launched and nothing in flight). Retained blocks
    are the blocks the table references; the ideal is sum(ceil(live_r / S))."""
    table, alloc, mgr = _planner_setup(R, L, S, evict, headroom, theta_f, seed)
    before = table.num_ref_blocks
    steps = 0
    for steps in range(1, max_steps + 1):
        launched = mgr.step()
        if not launched and not mgr.in_flight:
            break
    ideal = sum(-(-table.num_live(r) // S) for r in range(R))
    return {"settled_blocks": table.num_ref_blocks, "blocks_before": before, "ideal_blocks": ideal,
            "settled_over_ideal": table.num_ref_blocks / ideal, "settle_steps": steps,
            "settle_theta_f": mgr.cfg.theta_f, "settle_headroom": mgr.cfg.headroom, "settle_moves": mgr.stats["moves"],
            "settle_config": {k: v for k, v in vars(mgr.cfg).items()}}
