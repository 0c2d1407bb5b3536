"""The checkers' own mutation test: valid snapshots from real runs, violations planted in
them by operators, and every checker measured on what it accepts and rejects.

What this cannot see: a violation no operator plants (the operators are what it
measures; a rule no operator reaches is listed as not exercised); paths it cannot collect
(the adapter's without vLLM: refused loudly, never skipped); a false positive on a
snapshot shape no collected run produces (the valid snapshots are those runs').

Why here (``invariants/``) and not in ``fuzz/``: this measures the checkers, not the
system. It ships with them (``vtoken check-mutants``, the audit, ``pytest -m
invariants``), imports only the checkers and the system's public drivers, and depends on
none of the fuzz machines -- so a change to a checker is measured by the module next to it.

What it does (``run``):

1. **Collect** valid snapshots from real runs of every path, each through a JSON round
   trip (what a replay reads):

   - ``planner``: the real ``TokenTable`` + ``BlockAllocator`` + ``ReclamationManager``
     (``PlannerConfig(record_snapshots=True)``, a ``NullCopyEngine`` with latency) driven by
     a seeded scheduler stand-in: shared prefixes, growth and evictions while copies are in
     flight, attention reads through the table's slot mapping recorded while plans fly.
     Snapshots at launch (``post`` null) and after apply. Runs alternate in-place plans
     (``in_place=True``, the default: ``plan.fills``) and out-of-place ones (fresh
     ``dests``), so the operators of both kinds find bases; so does ``engine``.
   - ``engine``: ``vtoken.decode.DecodeEngine(check_relocations=RelocationChecker)`` decoding with the
     small paged decoder on the CPU (several policies, block sizes, copy lags): applied
     snapshots with the engine's events and the relocation checker's K/V digests.
   - ``adapter``: the vLLM adapter (``VTokenAdapter(planner_config=
     default_adapter_planner_config(record_snapshots=True))``, its ``history``). Where the
     adapter does not record snapshots, :class:`PathUnavailable` is raised -- never a
     silent skip.

   Every collected snapshot must be accepted by every checker ("valid accepted").

2. **Mutate**: each operator of :data:`OPERATORS` takes a valid snapshot and plants one
   violation of its target invariant, keeping the snapshot well-formed (``validate``
   passes: a mutant that does not is counted ``malformed``, an operator bug). Operators
   draw their choices from a seeded ``random.Random``; base snapshots are visited in a
   seeded order; the whole run is deterministic for a seed.

3. **Check**: every mutant goes to every checker (:data:`CHECKERS`: the plain-Python
   ``snapshot_checks`` and the Z3 ``z3_checks``, each claiming I1-I4). A checker
   *rejects* a mutant when it reports a violation of the operator's target invariant.
   The two must also agree: the same set of violated invariants on every snapshot.

4. **Cover**: each Violation names its rule (:data:`RULES`, the rule names of
   ``snapshot_checks``' docstring); the run tabulates, for each rule of I1-I4, the operators
   whose mutants every checker flagged through it (``rule_coverage``). A rule no operator
   reaches is ``rules_unexercised`` unless :data:`UNREACHABLE` names it with the reason.

The goal: every mutant rejected by every checker, every valid snapshot accepted, no
disagreement, at least 50 mutants per operator (the default run makes 60), every rule
exercised by some operator. ``run``'s dict has a ``violations`` view of what missed the
goal (:class:`~vtoken.invariants.violation.Violation`, invariant ``check_mutants``, ``rule``
the failure's kind: ``valid_rejected``, ``mutant_accepted``, ``disagreement``,
``malformed_mutant`` -- the few failures the dict keeps -- and ``operator_short``,
``rule_unexercised``, ``rule_unknown``; ``[]``: the run passed).

Owns: nothing beyond one run's collected snapshots and mutants, dropped when it returns.
May call: invariants (snapshot_checks, z3_checks, relocation_hash, violation), the system's public drivers
(table, allocator, planner, decode, model, snapshot, vllm_adapter), vtoken.argtypes; never fuzz/.
Costs: collection runs each path once (a CPU decode; the adapter where vLLM is installed); then
every mutant through both checkers, each linear in its snapshot.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from vtoken.errors import SnapshotError
from vtoken.snapshot import validate

from . import snapshot_checks, z3_checks
from .relocation_hash import RelocationChecker
from .violation import Found, Violation

ALL_PATHS = ("planner", "engine", "adapter")
CHECKERS: dict[str, Callable] = {"python": snapshot_checks.check_snapshot, "z3": z3_checks.check_snapshot}
INVARIANTS = ("I1", "I2", "I3", "I4")
RULES = snapshot_checks.RULES  # the rule names of I1-I4 (snapshot_checks' docstring)
# Rules no operator can reach, with the reason (the coverage table names them as such).
UNREACHABLE = {
    "I2.null": "validate refuses a live token, a move's destination and a plan block in the null block 0 before "
               "any rule runs, so no well-formed mutant carries one (the rule is the checkers' second line)",
}


class PathUnavailable(RuntimeError):
    """A path cannot give snapshots (e.g. the vLLM adapter records none yet)."""


# ====================================================================== collection
def _roundtrip(snap: dict) -> dict:
    return json.loads(json.dumps(snap))


def collect_planner(seed: int = 0, runs: int = 4, steps: int = 14) -> list[dict]:
    """Snapshots of the real reclamation manager driven by a seeded scheduler stand-in."""
    from vtoken.allocator import BlockAllocator
    from vtoken.planner import NullCopyEngine, PlannerConfig, ReclamationManager
    from vtoken.table import TokenTable

    out: list[dict] = []
    for run in range(runs):
        rng = random.Random(f"planner/{seed}/{run}")
        S = (2, 4, 8, 4)[run % 4]
        NB = 512
        t, a = TokenTable(S, NB), BlockAllocator(NB)
        pos: dict = {}  # request -> positional block list (null where a source was reclaimed)

        def on_applied(plan, pos=pos):
            src = set(int(b) for b in plan.sources)
            pos[plan.req_id] = [0 if b in src else b for b in pos[plan.req_id]]

        cfg = PlannerConfig(theta_f=0.0, check_every=1, max_sources=rng.choice((2, 4, 8)), headroom=8,
                            record_snapshots=True, in_place=run % 2 == 0)
        m = ReclamationManager(t, a, engine=NullCopyEngine(rng.choice((1, 2, 3))), config=cfg, on_applied=on_applied)
        first = None
        for r in range(rng.randint(3, 6)):
            rid = f"r{r}"
            L = rng.randint(S + 1, 7 * S)
            nb = -(-L // S)
            if first is not None and rng.random() < 0.5:  # a prefix-cache hit on r0's first block
                a.incref([first])
                blocks = [first] + a.allocate(nb - 1)
            else:
                blocks = a.allocate(nb)
            if r == 0:
                first = blocks[0]
            pos[rid] = list(blocks)
            t.sync_new_tokens(rid, pos[rid], L)
            m.hold(rid, blocks)  # the manager holds every reference allocated for a request
            live = t.live_tokens(rid).tolist()[:-1]
            t.evict_tokens(rid, sorted(rng.sample(live, k=len(live) // 2)))
        seen: set = set()
        for _ in range(steps):
            for rid in list(pos):
                if rng.random() < 0.4:  # grow by a token or two (a block when the list is full)
                    n = t.length(rid) + rng.randint(1, 2)
                    grown = a.allocate(max(0, -(-n // S) - len(pos[rid])))  # a block when the list is full
                    pos[rid] += grown
                    t.sync_new_tokens(rid, pos[rid], n)
                    m.hold(rid, grown)
                live = t.live_tokens(rid).tolist()[:-1]
                if live and rng.random() < 0.5:  # evict, in-flight moves included
                    t.evict_tokens(rid, sorted(rng.sample(live, k=max(1, len(live) // 4))))
            for p in list(m.in_flight.values()):  # attention reads through the slot mapping
                if p.snapshot is not None and p.req_id in pos:
                    m.record(p, "read", request=str(p.req_id), tokens=t.live_tokens(p.req_id).tolist(),
                             slots=t.slot_mapping(p.req_id).tolist())
            for p in m.step():
                if p.snapshot is not None:
                    out.append(_roundtrip(p.snapshot))  # at launch: post null
        m.poll(force_sync=True)
        for p in m.history:
            if p.snapshot is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(_roundtrip(p.snapshot))
    return out


def collect_engine(seed: int = 0, runs: int = 4, new_tokens: int = 40) -> list[dict]:
    """Applied snapshots of ``DecodeEngine(check_relocations=RelocationChecker)`` (digests included)."""
    import torch

    from vtoken.decode import make_prompts
    from vtoken.decode import DecodeEngine
    from vtoken.model import PagedDecoder
    from vtoken.planner import PlannerConfig

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = PagedDecoder()
        out: list[dict] = []
        configs = [("random", 4, 2), ("h2o", 4, 0), ("streaming", 8, 3), ("random", 2, 1), ("scissorhands", 4, 1),
                   ("random", 8, 2)]
        for run in range(runs):
            policy, S, lag = configs[run % len(configs)]
            prompts = make_prompts(4, 32, model.config.vocab_size, seed=seed * 101 + run)
            cfg = PlannerConfig(theta_f=0.1, check_every=1, max_sources=8, headroom=8, low_watermark=None,
                                record_snapshots=True, in_place=run % 2 == 0)
            eng = DecodeEngine(model, mode="vtoken", policy=policy, evict_ratio=0.5, block_size=S, seed=seed + run,
                               check_relocations=RelocationChecker, planner_config=cfg, copy_kwargs={"lag": lag})
            eng.run(prompts, new_tokens)
            out += [_roundtrip(p.snapshot) for p in eng.manager.history if p.snapshot is not None]
        return out
    finally:
        torch.set_num_threads(old)


def collect_adapter(seed: int = 0, runs: int = 1, max_tokens: int = 40) -> list[dict]:
    """Snapshots of the vLLM adapter's plans (``VTokenAdapter.history``); raises
    :class:`PathUnavailable` when vLLM is missing or the adapter records no snapshots."""
    try:
        from vtoken.vllm_adapter import harness
    except Exception as e:  # noqa: BLE001 - any import failure makes the path unavailable
        raise PathUnavailable(f"adapter path: the vLLM adapter cannot be imported ({type(e).__name__}: {e})") from e
    if harness.vllm_version() is None:
        raise PathUnavailable("adapter path: vLLM is not installed (make vllm)")
    import numpy as np
    import torch

    from vtoken.model import DecoderConfig, PagedDecoder
    from vtoken.vllm_adapter.adapter import AdapterDriver, VTokenAdapter, default_adapter_planner_config
    from vtoken.vllm_adapter.worker import VTokenWorker

    out: list[dict] = []
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = PagedDecoder(DecoderConfig(), batch_invariant=True)
        for run in range(runs):
            cfg = default_adapter_planner_config(record_snapshots=True)
            ad = VTokenAdapter(block_size=4, num_blocks=160, planner_config=cfg)
            try:
                if not hasattr(ad, "history"):
                    raise PathUnavailable(
                        "adapter path: VTokenAdapter has no `history` of plan snapshots (expected a list of snapshot "
                        "dicts when built with default_adapter_planner_config(record_snapshots=True)); the adapter "
                        "does not record snapshots yet, so its plans cannot be checked here")
                w = VTokenWorker(model, ad.table, 160, 4, policy="random", evict_ratio=0.5, seed=seed + run,
                                 check_relocations=RelocationChecker, copy_lag=1)
                d = AdapterDriver(ad, w)
                rng = np.random.default_rng([seed, run])
                for i in range(4):
                    ad.add_request(f"q{i}", rng.integers(1, 512, size=24).tolist(), max_tokens=max_tokens)
                n = 0
                while ad.has_work() and n < 5000:
                    d.step()
                    n += 1
                while d.in_flight:
                    d._finish_one()
                ad.drain_idle()
                snaps = [s if isinstance(s, dict) else getattr(s, "snapshot", None) for s in ad.history]
                out += [_roundtrip(s) for s in snaps if s is not None]
            finally:
                ad.close()
    finally:
        torch.set_num_threads(old)
    if not out:
        raise PathUnavailable("adapter path: the adapter ran but its history holds no snapshots")
    return out


COLLECTORS = {"planner": collect_planner, "engine": collect_engine, "adapter": collect_adapter}


# ====================================================================== snapshot helpers
def _R(s):
    return s["plan"]["request"]


def _pre(s):
    return s["pre"]["requests"][_R(s)]


def _post(s):
    return s["post"]["requests"][_R(s)] if s.get("post") is not None else None


def _live_moves(s):
    """Indices of moves whose token is not recorded as evicted in flight."""
    ev = set(s["evicted_in_flight"])
    return [k for k, mv in enumerate(s["plan"]["moves"]) if mv[0] not in ev]


def _fills(s) -> list:
    """The plan's fills (in-place compaction; absent == [])."""
    return s["plan"].get("fills", [])


def _dests_used_now(s) -> None:
    """Rewrite a recorded ``dests_used`` to follow the moves (fresh blocks only, not fills)."""
    if s.get("dests_used") is not None:
        ev, fills = set(s["evicted_in_flight"]), set(_fills(s))
        s["dests_used"] = sorted({mv[3] for mv in s["plan"]["moves"] if mv[0] not in ev} - fills)


def _follow(s, k: int) -> None:
    """After retargeting move ``k``: the table followed it (post, when applied, and not evicted)."""
    post, mv = _post(s), s["plan"]["moves"][k]
    if post is not None and mv[0] not in set(s["evicted_in_flight"]):
        post["tokens"][mv[0]] = [mv[3], mv[4], True]
        _ensure_block(post, mv[3])


def _all_blocks(s) -> set:
    out = set(s["plan"]["sources"]) | set(s["plan"]["dests"]) | set(s["headroom"]) | set(s["shared_blocks"])
    out |= set(_fills(s))
    for state in (s["pre"], s.get("post") or {"requests": {}}):
        for r in state["requests"].values():
            out |= set(r["blocks"]) | {tok[0] for tok in r["tokens"]}
            if r.get("tail_block") is not None:
                out.add(r["tail_block"])
    for mv in s["plan"]["moves"]:
        out |= {mv[1], mv[3]}
    for p in s["in_flight"]:
        out |= set(p["sources"]) | set(p["dests"]) | set(p.get("fills", []))
    for ev in s["schedule"]:
        out |= set(ev.get("blocks", ()))
    return out


def _fresh(s, k: int = 1) -> list[int]:
    top = max(_all_blocks(s) | {0})
    return [top + 1 + i for i in range(k)]


def _ensure_block(r, b):
    if b not in r["blocks"]:
        r["blocks"] = sorted(r["blocks"] + [b])


def _other_request(s) -> str:
    names = set(map(str, s["pre"]["requests"]))
    k = 0
    while f"x{k}" in names:
        k += 1
    return f"x{k}"


def _insert_after_launch(s, events: list[dict]) -> None:
    """Insert ``events`` right after the plan's launch, at the launch's time (a launch at the
    front is added when the schedule has none): before any fence, so before completion."""
    sched, pid = s["schedule"], s["plan"]["id"]
    i = next((k for k, ev in enumerate(sched) if ev["kind"] == "launch" and ev.get("plan") == pid), None)
    if i is None:
        t0 = sched[0]["t"] if sched else 0
        sched.insert(0, {"t": t0, "kind": "launch", "plan": pid})
        i = 0
    t = sched[i]["t"]
    sched[i + 1:i + 1] = [dict(ev, t=t) for ev in events]


# ====================================================================== operators
# Each takes (snapshot copy, rng) and mutates it in place, returning True, or False when it
# does not apply to this snapshot (the caller then tries another base).

def op_drop_token(s, rng) -> bool:
    """A moved token (not recorded as evicted) is not live at its destination afterwards."""
    post, live = _post(s), _live_moves(s)
    if post is None or not live:
        return False
    moves, pre = s["plan"]["moves"], _pre(s)
    how = rng.choice(("in_place", "dead_at_dst", "all_in_place"))
    ks = live if how == "all_in_place" else [rng.choice(live)]
    for k in ks:
        t = moves[k][0]
        if how == "dead_at_dst":
            post["tokens"][t][2] = False
        else:  # dead where it was, and NOT recorded as evicted in flight (issue 11 (A), (B))
            post["tokens"][t] = [pre["tokens"][t][0], pre["tokens"][t][1], False]
    return True


def op_alias_slot(s, rng) -> bool:
    """Two live tokens on one slot: after the plan, or a move onto an occupied slot."""
    post, moves = _post(s), s["plan"]["moves"]
    choices = []
    if post is not None and sum(1 for tok in post["tokens"] if tok[2]) >= 2:
        choices.append("post")
    if len(moves) >= 2:
        choices.append("dst_dst")
    pre = _pre(s)
    moved = {mv[0] for mv in moves}
    occupied = [t for t, tok in enumerate(pre["tokens"]) if tok[2] and t not in moved
                and (post is None or (post["tokens"][t][2] and post["tokens"][t][:2] == tok[:2]))]
    if moves and occupied:
        choices.append("occupied")
    if not choices:
        return False
    how = rng.choice(choices)
    if how == "post":
        live = [t for t, tok in enumerate(post["tokens"]) if tok[2]]
        a, b = rng.sample(live, 2)
        post["tokens"][a] = list(post["tokens"][b])
        return True
    k = rng.randrange(len(moves))
    if how == "dst_dst":
        j = rng.choice([x for x in range(len(moves)) if x != k])
        moves[k][3:] = moves[j][3:]
    else:
        o = pre["tokens"][rng.choice(occupied)]
        moves[k][3:] = [o[0], o[1]]
    _follow(s, k)  # the table followed the move
    _dests_used_now(s)
    return True


def op_duplicate_token(s, rng) -> bool:
    """A token mapped at two slots: a second move of a moved token to a free destination slot."""
    moves, S = s["plan"]["moves"], s["block_size"]
    if not moves:
        return False
    k = rng.randrange(len(moves))
    used = {(mv[3], mv[4]) for mv in moves}
    free = [(b, o) for b in sorted({mv[3] for mv in moves} | set(s["plan"]["dests"])) for o in range(S)
            if (b, o) not in used]
    b, o = rng.choice(free) if free else (moves[k][3], moves[k][4])
    moves.append(moves[k][:3] + [b, o])
    dg = s["plan"].get("digests")
    if dg is not None:
        dg["pre"].append(dg["pre"][k])
        dg["post"].append(dg["post"][k])
    return True


def op_move_shared_block(s, rng) -> bool:
    """A source (or destination) is a shared-prefix block: listed in ``shared_blocks``, or in
    another request's block list (issue 11 (C): sharedness derived from every list)."""
    src = s["plan"]["sources"]
    if not src:
        return False
    b = rng.choice(src)
    if rng.random() < 0.5:
        s["shared_blocks"] = sorted(set(s["shared_blocks"]) | {b})
        return True
    pre, S = _pre(s), s["block_size"]
    toks = [list(tok) for tok in pre["tokens"] if tok[2] and tok[0] == b]  # the same prefix tokens
    s["pre"]["requests"][_other_request(s)] = {"length": len(toks), "blocks": [b], "tail_block": None, "tokens": toks}
    return True


def op_move_tail_block(s, rng) -> bool:
    """The tail block (still being written) is a source or a destination."""
    src = s["plan"]["sources"]
    dst = sorted({mv[3] for mv in s["plan"]["moves"]} | set(s["plan"]["dests"]) | set(_fills(s)))
    opts = [("src", b) for b in src] + [("dst", b) for b in dst]
    if not opts:
        return False
    _kind, b = rng.choice(opts)
    if rng.random() < 0.5 and _last_position_in(s, b, rng):  # the tail itself (derived from the tokens)
        return True
    _pre(s)["tail_block"] = b  # the record says so
    return True


def _last_position_in(s, b: int, rng) -> bool:
    """Make block ``b`` the request's tail as the checkers derive it: a new last position,
    a dead token at a slot of ``b`` without a live token; ``tail_block`` then records it (or
    is null). False (nothing changed) where ``post`` has grown past ``pre`` or ``b`` is full."""
    pre, post, S = _pre(s), _post(s), s["block_size"]
    if post is not None and post["length"] != pre["length"]:
        return False
    live = {(tok[0], tok[1]) for tok in pre["tokens"] if tok[2]}
    if post is not None:
        live |= {(tok[0], tok[1]) for tok in post["tokens"] if tok[2]}
    free = [o for o in range(S) if (b, o) not in live]
    if not free:
        return False
    tok = [b, rng.choice(free), False]
    for r in (pre, post) if post is not None else (pre,):
        r["tokens"].append(list(tok))
        r["length"] += 1
    pre["tail_block"] = b if rng.random() < 0.5 else None
    return True


def op_overlap_in_flight(s, rng) -> bool:
    """An in-flight plan overlapping the plan's blocks, with the plan's own id or another."""
    plan = s["plan"]
    ours = sorted(set(plan["sources"]) | set(plan["dests"]) | set(_fills(s)) | {mv[3] for mv in plan["moves"]})
    ids = {p["id"] for p in s["in_flight"]} | {plan["id"]}
    other_id = max(ids) + 1
    how = rng.choice(("same_id_overlap", "same_id_apart", "other_id_same_request", "other_id_other_request"))
    if not ours and how != "same_id_apart":
        how = "same_id_apart"
    fresh = _fresh(s, 2)
    if how == "same_id_apart":  # issue 11 (E): a duplicate id is rejected even without overlap
        entry = {"id": plan["id"], "request": plan["request"], "sources": [fresh[0]], "dests": [fresh[1]]}
    else:
        b = rng.choice(ours)
        pid = plan["id"] if how == "same_id_overlap" else other_id
        req = _other_request(s) if how == "other_id_other_request" else plan["request"]
        entry = {"id": pid, "request": req, "sources": [b], "dests": [fresh[0]]}
        if rng.random() < 0.5:
            entry = {"id": pid, "request": req, "sources": [fresh[0]], "dests": [b]}
    s["in_flight"] = s["in_flight"] + [entry]
    return True


def op_not_decreasing(s, rng) -> bool:
    """As many destinations as sources (or more): the block count does not decrease."""
    plan = s["plan"]
    need = len(set(plan["sources"])) - len(set(plan["dests"])) + rng.randint(0, 1)
    if need <= 0 or not plan["sources"]:
        return False
    add = _fresh(s, need)
    plan["dests"] = plan["dests"] + add
    s["headroom"] = s["headroom"] + add
    return True


def op_read_before_copy(s, rng) -> bool:
    """Attention reads a destination slot before the copy completes."""
    plan, S = s["plan"], s["block_size"]
    if plan["moves"]:
        mv = rng.choice(plan["moves"])
        tok, slot = mv[0], mv[3] * S + mv[4]
    elif plan["dests"]:
        tok, slot = 0, rng.choice(plan["dests"]) * S + rng.randrange(S)
    else:
        return False
    req = plan["request"] if rng.random() < 0.7 else _other_request(s)
    _insert_after_launch(s, [{"kind": "read", "request": req, "tokens": [tok], "slots": [slot]}])
    return True


def op_free_before_copy(s, rng) -> bool:
    """A source is freed before the copy out of it completes."""
    src = s["plan"]["sources"]
    if not src:
        return False
    _insert_after_launch(s, [{"kind": "free", "blocks": [rng.choice(src)]}])
    return True


def op_write_source_before_copy(s, rng) -> bool:
    """A source is reallocated and written (or only written) before the copy out of it completes."""
    src, S = s["plan"]["sources"], s["block_size"]
    if not src:
        return False
    b = rng.choice(src)
    other = _other_request(s)
    w = {"kind": "write", "request": other, "token": 0, "slot": b * S + rng.randrange(S)}
    how = rng.choice(("free_alloc_write", "alloc_write", "write"))
    evs = {"free_alloc_write": [{"kind": "free", "blocks": [b]}, {"kind": "alloc", "request": other, "blocks": [b]}, w],
           "alloc_write": [{"kind": "alloc", "request": other, "blocks": [b]}, w],
           "write": [w]}[how]
    _insert_after_launch(s, evs)
    return True


def op_live_in_freed_block(s, rng) -> bool:
    """After the plan a live token sits in a source (freed) block (issue 11 (D))."""
    post, S = _post(s), s["block_size"]
    src = s["plan"]["sources"]
    if post is None or not src:
        return False
    live = _live_moves(s)
    pre, moves = _pre(s), s["plan"]["moves"]
    if live and rng.random() < 0.5:  # a moved token left live where it was
        t = moves[rng.choice(live)][0]
        post["tokens"][t] = [pre["tokens"][t][0], pre["tokens"][t][1], True]
        _ensure_block(post, pre["tokens"][t][0])
        return True
    b = rng.choice(src)  # a token added while the copy flew, written into a source block
    taken = {(tok[0], tok[1]) for tok in post["tokens"] if tok[2]}
    free = [o for o in range(S) if (b, o) not in taken]
    if not free:
        return False
    post["tokens"].append([b, rng.choice(free), True])
    post["length"] += 1
    _ensure_block(post, b)
    return True


def op_change_digest(s, rng) -> bool:
    """A moved token's K/V digest differs before and after the copy."""
    dg = s["plan"].get("digests")
    if dg is None:
        return False
    ks = [k for k in _live_moves(s) if dg["pre"][k] is not None and dg["post"][k] is not None]
    if not ks:
        return False
    k = rng.choice(ks)
    side = rng.choice(("pre", "post"))
    dg[side][k] ^= 1 << rng.randrange(64)
    return True


def op_resurrect_evicted(s, rng) -> bool:
    """A token recorded as evicted in flight is live afterwards (at its pre slot or its destination)."""
    post = _post(s)
    if post is None:
        return False
    pre, moves = _pre(s), s["plan"]["moves"]
    first = {}
    for k, mv in enumerate(moves):
        first.setdefault(mv[0], k)
    ev = list(s["evicted_in_flight"])
    if not ev:  # record one (a valid intermediate: dead in place, move dropped), then resurrect it
        live = _live_moves(s)
        if not live:
            return False
        t = moves[rng.choice(live)][0]
        s["evicted_in_flight"] = [t]
        post["tokens"][t] = [pre["tokens"][t][0], pre["tokens"][t][1], False]
        _dests_used_now(s)
        ev = [t]
    t = rng.choice(ev)
    if rng.random() < 0.5:
        b, o = pre["tokens"][t][0], pre["tokens"][t][1]
    else:
        b, o = moves[first[t]][3], moves[first[t]][4]
    post["tokens"][t] = [b, o, True]
    _ensure_block(post, b)
    return True


def op_oversubscribe_headroom(s, rng) -> bool:
    """The plan takes more destinations than the headroom reserves."""
    dests = s["plan"]["dests"]
    if not dests:
        return False
    if rng.random() < 0.5:
        gone = {rng.choice(dests)}
    else:
        gone = set(dests)
    s["headroom"] = [b for b in s["headroom"] if b not in gone]
    return True


def op_move_from_unheld_slot(s, rng) -> bool:
    """A move's source is a slot the table does not hold for its token."""
    moves, S = s["plan"]["moves"], s["block_size"]
    if not moves:
        return False
    k = rng.randrange(len(moves))
    pre = _pre(s)
    choices = ["fresh_block"]
    if S > 1:
        choices.append("other_offset")
    dead = [tok for tok in pre["tokens"] if not tok[2] and tok[0] != 0]
    if dead:
        choices.append("dead_slot")
    how = rng.choice(choices)
    if how == "other_offset":
        moves[k][2] = (moves[k][2] + rng.randrange(1, S)) % S
    elif how == "fresh_block":
        moves[k][1] = _fresh(s)[0]
    else:
        tok = rng.choice(dead)
        if tok[:2] == moves[k][1:3]:
            moves[k][2] = (moves[k][2] + 1) % S if S > 1 else moves[k][2]
            if S == 1:
                moves[k][1] = _fresh(s)[0]
        else:
            moves[k][1:3] = [tok[0], tok[1]]
    return True


# ---------------------------------------------------------------- in-place plans (plan.fills)
def _fill_moves(s) -> list[int]:
    """Indices of the moves into a fill."""
    fills = set(_fills(s))
    return [k for k, mv in enumerate(s["plan"]["moves"]) if mv[3] in fills]


def op_fill_occupied_slot(s, rng) -> bool:
    """A move into a fill lands on a slot holding a live token of the request (not a hole)."""
    fills, moves, pre, post = set(_fills(s)), s["plan"]["moves"], _pre(s), _post(s)
    if not fills or not moves:
        return False
    moved = {mv[0] for mv in moves}
    occupied = [t for t, tok in enumerate(pre["tokens"]) if tok[2] and tok[0] in fills and t not in moved
                and (post is None or (post["tokens"][t][2] and post["tokens"][t][:2] == tok[:2]))]
    if not occupied:
        return False
    k = rng.choice(_fill_moves(s) or list(range(len(moves))))
    o = pre["tokens"][rng.choice(occupied)]
    moves[k][3:] = [o[0], o[1]]
    _follow(s, k)
    _dests_used_now(s)
    return True


def op_fill_shared(s, rng) -> bool:
    """A fill is a shared block: in ``shared_blocks``, or in another request's block list."""
    fills = _fills(s)
    if not fills:
        return False
    b = rng.choice(fills)
    if rng.random() < 0.5:
        s["shared_blocks"] = sorted(set(s["shared_blocks"]) | {b})
        return True
    toks = [list(tok) for tok in _pre(s)["tokens"] if tok[2] and tok[0] == b]  # the same (prefix) tokens
    s["pre"]["requests"][_other_request(s)] = {"length": len(toks), "blocks": [b], "tail_block": None, "tokens": toks}
    return True


def op_fill_tail(s, rng) -> bool:
    """A fill is the request's tail block (still being written)."""
    fills = _fills(s)
    if not fills:
        return False
    b = rng.choice(fills)
    if rng.random() < 0.5 and _last_position_in(s, b, rng):  # the tail itself (derived from the tokens)
        return True
    _pre(s)["tail_block"] = b  # the record says so
    return True


def op_fill_is_source(s, rng) -> bool:
    """A block is both a source and a fill (a source listed as a fill, or a fill as a source)."""
    plan = s["plan"]
    fills, src = _fills(s), plan["sources"]
    opts = [("src_as_fill", b) for b in src if b not in fills] + [("fill_as_src", b) for b in fills if b not in src]
    if not opts:
        return False
    how, b = rng.choice(opts)
    if how == "src_as_fill":
        plan["fills"] = fills + [b]
    else:
        plan["sources"] = src + [b]
    return True


def op_fill_in_flight(s, rng) -> bool:
    """A fill is also a block (source, destination or fill) of another plan still in flight."""
    fills = _fills(s)
    if not fills:
        return False
    plan = s["plan"]
    b = rng.choice(fills)
    pid = max({p["id"] for p in s["in_flight"]} | {plan["id"]}) + 1
    req = plan["request"] if rng.random() < 0.5 else _other_request(s)
    fresh = _fresh(s, 1)[0]
    role = rng.choice(("sources", "dests", "fills"))
    entry = {"id": pid, "request": req, "sources": [fresh], "dests": [], "fills": []}
    entry[role] = entry[role] + [b]
    s["in_flight"] = s["in_flight"] + [entry]
    return True


def op_fill_not_owned(s, rng) -> bool:
    """A fill is not the request's block: a fresh block, or another request's, listed as a fill
    (its moves relabelled to land there, or not)."""
    plan, fills = s["plan"], _fills(s)
    x = _fresh(s, 1)[0]
    if rng.random() < 0.5:  # another request holds it
        s["pre"]["requests"][_other_request(s)] = {"length": 0, "blocks": [x], "tail_block": None, "tokens": []}
    into = {}
    for k in _fill_moves(s):
        into.setdefault(plan["moves"][k][3], []).append(k)
    if into and rng.random() < 0.5:  # the moves into one fill go to x instead (same offsets: x is empty)
        f = rng.choice(sorted(into))
        plan["fills"] = [x if b == f else b for b in fills]
        for k in into[f]:
            plan["moves"][k][3] = x
            _follow(s, k)
    else:
        plan["fills"] = fills + [x]
    return True


def op_move_to_unlisted_block(s, rng) -> bool:
    """A move writes a block that is neither a destination nor a fill: a fill dropped from
    ``plan.fills``, or a move sent to a fresh block listed nowhere."""
    plan, moves, S = s["plan"], s["plan"]["moves"], s["block_size"]
    if not moves:
        return False
    fm = _fill_moves(s)
    if fm and rng.random() < 0.5:
        f = moves[rng.choice(fm)][3]
        plan["fills"] = [b for b in _fills(s) if b != f]
        return True
    k = rng.randrange(len(moves))
    moves[k][3:] = [_fresh(s, 1)[0], rng.randrange(S)]
    _follow(s, k)
    return True


def op_read_fill_hole_before_copy(s, rng) -> bool:
    """Attention reads a hole of a fill (a slot the copy may write) before the copy completes."""
    fills, S, plan = _fills(s), s["block_size"], s["plan"]
    if not fills:
        return False
    live = {tok[0] * S + tok[1] for tok in _pre(s)["tokens"] if tok[2]}
    targets = [(plan["moves"][k][0], plan["moves"][k][3] * S + plan["moves"][k][4]) for k in _fill_moves(s)]
    holes = [(0, b * S + o) for b in fills for o in range(S) if b * S + o not in live]
    opts = [x for x in targets if x[1] not in live] or holes
    if not opts:
        return False
    tok, slot = rng.choice(opts)
    req = plan["request"] if rng.random() < 0.7 else _other_request(s)
    _insert_after_launch(s, [{"kind": "read", "request": req, "tokens": [tok], "slots": [slot]}])
    return True


def op_free_fill_before_copy(s, rng) -> bool:
    """A fill is freed (or handed to another request) before the copy into it completes."""
    fills = _fills(s)
    if not fills:
        return False
    b = rng.choice(fills)
    evs = [{"kind": "free", "blocks": [b]}]
    if rng.random() < 0.5:
        evs.append({"kind": "alloc", "request": _other_request(s), "blocks": [b]})
    _insert_after_launch(s, evs)
    return True



# ------------------------------------------------- what the checkers derive, and every event counting
def _tail(s):
    """The request's tail as the checkers derive it: the block of its last position."""
    pre = _pre(s)
    return pre["tokens"][pre["length"] - 1][0] if pre["length"] else None


def _plan_event(s, kind: str):
    """Index of the plan's first ``kind`` event (None: absent)."""
    pid = s["plan"]["id"]
    return next((i for i, ev in enumerate(s["schedule"]) if ev["kind"] == kind and ev.get("plan") == pid), None)


def _append(s, events: list[dict], same_time: bool) -> None:
    """Append ``events`` at the end of the schedule: at the last event's time (list order
    orders them) or one tick apart."""
    t = s["schedule"][-1]["t"] if s["schedule"] else 0
    s["schedule"] += [dict(ev, t=t if same_time else t + 1 + k) for k, ev in enumerate(events)]


def op_tail_unrecorded(s, rng) -> bool:
    """The plan fills its tail (derived: the block of the last position), a move landing on
    the slot the next token will be written to when it is a hole, while ``tail_block`` is
    null or names a block of no request; or only a wrong ``tail_block``."""
    pre, plan, S = _pre(s), s["plan"], s["block_size"]
    tail = _tail(s)
    if tail is None:
        return False
    how = rng.choice(("null", "bogus", "record_only"))
    pre["tail_block"] = None if how == "null" else _fresh(s, 1)[0]
    if how == "record_only":
        return True
    plan["fills"] = _fills(s) + [tail]
    nxt = tail * S + pre["length"] % S
    live = {tok[0] * S + tok[1] for tok in pre["tokens"] if tok[2]}
    if pre["length"] % S and nxt not in live and plan["moves"]:
        k = rng.randrange(len(plan["moves"]))
        plan["moves"][k][3:] = [tail, pre["length"] % S]
        _follow(s, k)
        _dests_used_now(s)
    return True


def op_relaunch_after_reuse(s, rng) -> bool:
    """The plan's copy is launched again after a source or fill was freed, handed to another
    request and rewritten (or only rewritten): the second copy reads or writes reused memory."""
    plan, S = s["plan"], s["block_size"]
    blocks = plan["sources"] + _fills(s)
    if not blocks or _plan_event(s, "launch") is None:
        return False
    b = rng.choice(blocks)
    other = _other_request(s)
    live = {tok[0] * S + tok[1] for tok in _pre(s)["tokens"] if tok[2]}
    # a write the copy conflicts with: anywhere in a source, on a hole of a fill
    slots = [b * S + o for o in range(S) if b in plan["sources"] or b * S + o not in live]
    w = {"kind": "write", "request": other, "token": 0, "slot": rng.choice(slots or [b * S])}
    reuse = [{"kind": "free", "blocks": [b]}, {"kind": "alloc", "request": other, "blocks": [b]}, w] \
        if rng.random() < 0.7 or not slots else [w]
    _append(s, reuse + [{"kind": "launch", "plan": plan["id"]}], same_time=rng.random() < 0.5)
    return True


def op_alias_other_post(s, rng) -> bool:
    """After the plan another request holds a live token on a slot a move filled (a fill's
    hole or a destination slot): an alias only visible in the other request's ``post``."""
    post = _post(s)
    if post is None:
        return False
    ev = set(s["evicted_in_flight"])
    landed = [mv for mv in s["plan"]["moves"] if mv[0] not in ev and post["tokens"][mv[0]] == [mv[3], mv[4], True]]
    if not landed:
        return False
    mv = rng.choice(landed)
    x = _other_request(s)
    toks = [[mv[3], mv[4], True]]
    blocks = [mv[3]]
    if rng.random() < 0.5:  # it also holds a block of its own
        own = _fresh(s, 1)[0]
        toks.insert(0, [own, 0, True])
        blocks.append(own)
    s["post"]["requests"][x] = {"length": len(toks), "blocks": sorted(blocks), "tail_block": None, "tokens": toks}
    return True


def op_read_evicted_after_apply(s, rng) -> bool:
    """After apply, attention reads a token evicted while the copy flew (its move dropped,
    dead since apply) at its old slot, in a freed source, or at its dropped destination."""
    post = _post(s)
    if post is None or _plan_event(s, "apply") is None:
        return False
    pre, moves = _pre(s), s["plan"]["moves"]
    ev = list(s["evicted_in_flight"])
    if not ev:  # record one first (a valid intermediate: dead in place, its move dropped)
        live = _live_moves(s)
        if not live:
            return False
        t = moves[rng.choice(live)][0]
        s["evicted_in_flight"] = [t]
        post["tokens"][t] = [pre["tokens"][t][0], pre["tokens"][t][1], False]
        _dests_used_now(s)
        for e in s["schedule"]:  # the reads after apply no longer see it (a valid base)
            if e["kind"] == "read" and t in e["tokens"]:
                k = e["tokens"].index(t)
                del e["tokens"][k], e["slots"][k]
        ev = [t]
    t = rng.choice(ev)
    S = s["block_size"]
    mv = next(m for m in moves if m[0] == t)
    slot = mv[1] * S + mv[2] if rng.random() < 0.7 else mv[3] * S + mv[4]
    _append(s, [{"kind": "read", "request": s["plan"]["request"], "tokens": [t], "slots": [slot]}],
            same_time=rng.random() < 0.5)
    return True


def op_read_dead_token(s, rng) -> bool:
    """Attention reads a token of the request that was dead before the plan -- at a fill's
    hole where one is, else where it last was -- after the fence or at the end."""
    pre, S, plan = _pre(s), s["block_size"], s["plan"]
    fills = set(_fills(s))
    dead = [t for t, tok in enumerate(pre["tokens"]) if not tok[2]]
    if not dead:
        return False
    in_fill = [t for t in dead if pre["tokens"][t][0] in fills]
    t = rng.choice(in_fill or dead)
    b, o = pre["tokens"][t][:2]
    ev = {"kind": "read", "request": plan["request"], "tokens": [t], "slots": [b * S + o]}
    f = next((i for i, e in enumerate(s["schedule"]) if e["kind"] == "fence" and e.get("plan") == plan["id"]), None)
    if f is not None and rng.random() < 0.5:  # right after the fence, at its own time
        s["schedule"].insert(f + 1, dict(ev, t=s["schedule"][f]["t"]))
    else:
        _append(s, [ev], same_time=rng.random() < 0.5)
    return True


def op_second_plan_same_request(s, rng) -> bool:
    """Another plan of the same request is in flight: an in-flight entry of the request
    whose sources (or fills) are blocks the request holds."""
    plan, pre = s["plan"], _pre(s)
    ours = set(plan["sources"]) | set(plan["dests"]) | set(_fills(s)) | {mv[3] for mv in plan["moves"]}
    held = [b for b in pre["blocks"] if b not in ours] or list(pre["blocks"])
    if not held:
        return False
    pid = max({p["id"] for p in s["in_flight"]} | {plan["id"]}) + 1
    role = rng.choice(("sources", "fills"))
    entry = {"id": pid, "request": plan["request"], "sources": [], "dests": [_fresh(s, 1)[0]], "fills": []}
    entry[role] = [rng.choice(held)]
    s["in_flight"] = s["in_flight"] + [entry]
    return True


def op_plan_block_in_headroom(s, rng) -> bool:
    """The headroom lists a block in use: a source or fill of the plan, another block of the
    request, or a block of an in-flight plan."""
    plan = s["plan"]
    opts = plan["sources"] + _fills(s) + _pre(s)["blocks"]
    for p in s["in_flight"]:
        opts += p["sources"] + p["dests"] + p.get("fills", [])
    opts = sorted(set(opts) - set(s["headroom"]))
    if not opts:
        return False
    s["headroom"] = s["headroom"] + [rng.choice(opts)]
    return True



# ------------------------------------------------- one operator per rule the others reach only as a side effect
def op_overwrite_live_slot(s, rng) -> bool:
    """A new token (of another request, or the request's own next one) is written onto a
    slot holding a live token of the request: an unmoved token's slot, or after apply a
    moved token's destination."""
    pre, post, plan, S = _pre(s), _post(s), s["plan"], s["block_size"]
    moved = {mv[0]: mv for mv in plan["moves"]}
    released = set()
    for ev in s["schedule"]:
        if ev["kind"] == "free" or (ev["kind"] == "alloc" and str(ev["request"]) != str(plan["request"])):
            released |= set(ev["blocks"])
    opts = [tok[0] * S + tok[1] for t, tok in enumerate(pre["tokens"]) if tok[2] and t not in moved
            and (post is None or post["tokens"][t] == tok)]
    if post is not None and _plan_event(s, "apply") is not None:
        ev = set(s["evicted_in_flight"])
        opts += [mv[3] * S + mv[4] for t, mv in moved.items() if t not in ev and post["tokens"][t] == [mv[3], mv[4], True]]
    opts = [x for x in opts if x // S not in released]
    if not opts:
        return False
    own = rng.random() < 0.5
    w = {"kind": "write", "request": plan["request"] if own else _other_request(s),
         "token": (post or pre)["length"] if own else 0, "slot": rng.choice(opts)}
    _append(s, [w], same_time=rng.random() < 0.5)
    return True


def op_list_block_twice(s, rng) -> bool:
    """``plan.sources``, ``plan.dests`` or ``plan.fills`` names one block twice."""
    plan = s["plan"]
    roles = [r for r in ("sources", "dests", "fills") if plan.get(r)]
    if not roles:
        return False
    role = rng.choice(roles)
    lst = plan[role]
    lst.insert(rng.randrange(len(lst) + 1), rng.choice(lst))
    return True


def op_source_not_emptied(s, rng) -> bool:
    """A live token in a source block is not moved: its move dropped (the token stays where
    it was, live, after the plan)."""
    plan, post = s["plan"], _post(s)
    live = _live_moves(s)
    if not live:
        return False
    k = rng.choice(live)
    t, sb, so = plan["moves"][k][:3]
    del plan["moves"][k]
    dg = plan.get("digests")
    if dg is not None:
        del dg["pre"][k], dg["post"][k]
    if post is not None:
        post["tokens"][t] = [sb, so, True]
        _ensure_block(post, sb)
    _dests_used_now(s)
    return True


def op_wrong_dests_used(s, rng) -> bool:
    """``dests_used`` (written at apply) is not the fresh blocks the applied moves landed in:
    one missing, or a fill or a block no move wrote listed."""
    used = s.get("dests_used")
    if used is None:
        return False
    if used and rng.random() < 0.5:
        s["dests_used"] = [b for b in used if b != rng.choice(used)]
    else:
        extra = sorted(set(_fills(s)) - set(used)) + _fresh(s, 1)
        s["dests_used"] = sorted(used + [rng.choice(extra)])
    return True


def op_fill_dropped_after(s, rng) -> bool:
    """After the plan a fill is no longer the request's block: its tokens all dead (those
    moved in recorded as evicted in flight, the others dead in place) and the block gone
    from the request's list."""
    post, plan = _post(s), s["plan"]
    fills = _fills(s)
    if post is None or not fills:
        return False
    f = rng.choice(fills)
    into = {mv[0]: mv for mv in plan["moves"] if mv[3] == f}
    ev = set(s["evicted_in_flight"])
    pre = _pre(s)
    for t, tok in enumerate(post["tokens"]):
        if tok[0] == f and tok[2]:
            if t in into:  # moved in: evicted while the copy flew, dead at its pre slot
                ev.add(t)
                post["tokens"][t] = [pre["tokens"][t][0], pre["tokens"][t][1], False]
            else:
                tok[2] = False
    s["evicted_in_flight"] = sorted(ev)
    post["blocks"] = [b for b in post["blocks"] if b != f]
    _dests_used_now(s)
    return True


def op_move_unmoved_token(s, rng) -> bool:
    """A token the plan does not move changes after it: it moves to another free slot of the
    request, or a dead one becomes live where it was."""
    pre, post, S = _pre(s), _post(s), s["block_size"]
    if post is None:
        return False
    moved = {mv[0] for mv in s["plan"]["moves"]}
    taken = {(tok[0], tok[1]) for tok in post["tokens"] if tok[2]}
    stay = [t for t, tok in enumerate(pre["tokens"]) if tok[2] and t not in moved and post["tokens"][t] == tok]
    free = [(b, o) for b in post["blocks"] for o in range(S) if (b, o) not in taken]
    born = [t for t, tok in enumerate(pre["tokens"]) if not tok[2] and t not in moved and not post["tokens"][t][2]
            and tuple(post["tokens"][t][:2]) not in taken and post["tokens"][t][0] in post["blocks"]]
    opts = (["stray"] if stay and free else []) + (["born"] if born else [])
    if not opts:
        return False
    if rng.choice(opts) == "stray":
        b, o = rng.choice(free)
        post["tokens"][rng.choice(stay)] = [b, o, True]
    else:
        post["tokens"][rng.choice(born)][2] = True
    return True


# ------------------------------------------------- ownership across the whole snapshot (issue 40)
def _next_plan_id(s) -> int:
    return max({p["id"] for p in s["in_flight"]} | {s["plan"]["id"]}) + 1


def _plan_blocks(s) -> set:
    plan = s["plan"]
    return set(plan["sources"]) | set(plan["dests"]) | set(_fills(s)) | {mv[3] for mv in plan["moves"]}


def _add_request(s, name: str, where: str = "pre") -> int:
    """Request ``name`` holding one fresh block with one live token; returns the block."""
    b = _fresh(s, 1)[0]
    s[where]["requests"][name] = {"length": 1, "blocks": [b], "tail_block": None, "tokens": [[b, 0, True]]}
    return b


def _while_held(s, events: list[dict]) -> None:
    """Insert ``events`` where the plan still holds its blocks but its copy is done when it
    was fenced: right before its apply (after the fence; before the sources' free), at the
    apply's time, or at the end of the schedule when it has no apply."""
    i = _plan_event(s, "apply")
    if i is None:
        _append(s, events, same_time=True)
        return
    t = s["schedule"][i]["t"]
    s["schedule"][i:i] = [dict(ev, t=t) for ev in events]


def op_dest_on_held_block(s, rng) -> bool:
    """Another plan still in flight copies into a block a request reads: one of the
    request's blocks (outside the plan where it has one), its tail, or a third request's."""
    pre, ours = _pre(s), _plan_blocks(s)
    held = sorted((set(pre["blocks"]) | ({_tail(s)} - {None})) - ours) or sorted(pre["blocks"])
    if held and rng.random() < 0.6:
        b = rng.choice(held)
    else:  # a third request's block
        b = _add_request(s, _other_request(s))
    entry = {"id": _next_plan_id(s), "request": _other_request(s), "sources": _fresh(s, 1), "dests": [b], "fills": []}
    s["in_flight"] = s["in_flight"] + [entry]
    return True


def op_in_flight_takes_held_block(s, rng) -> bool:
    """A plan of another request (listed, or an orphan whose request left) still in flight
    holds one of the request's blocks as a source or a fill: its end frees a block the request reads."""
    pre, ours = _pre(s), _plan_blocks(s)
    held = sorted(set(pre["blocks"]) - ours) or sorted(pre["blocks"])
    if not held:
        return False
    x = _other_request(s)
    own, dst = _fresh(s, 2)
    if rng.random() < 0.5:  # x listed, holding its own source; else an orphan (x left)
        s["pre"]["requests"][x] = {"length": 1, "blocks": [own], "tail_block": None, "tokens": [[own, 0, True]]}
    entry = {"id": _next_plan_id(s), "request": x, "sources": [own], "dests": [dst], "fills": []}
    role = rng.choice(("sources", "fills"))
    entry[role] = entry[role] + [rng.choice(held)]
    s["in_flight"] = s["in_flight"] + [entry]
    return True


def op_in_flight_plans_overlap(s, rng) -> bool:
    """Two plans in flight hold one block (any roles), or one holds a block in two roles."""
    roles = ("sources", "dests", "fills")
    b, c, e = _fresh(s, 3)
    pid, x = _next_plan_id(s), _other_request(s)
    first = {"id": pid, "request": x, "sources": [c], "dests": [], "fills": []}
    ra = rng.choice(roles)
    how = rng.choice(("two_new", "with_existing", "two_roles") if s["in_flight"] else ("two_new", "two_roles"))
    if how == "two_roles":
        rb = rng.choice([r for r in roles if r != ra])
        first[ra], first[rb] = first[ra] + [b], first[rb] + [b]
    elif how == "with_existing":  # a block an in-flight plan holds, taken by a new one
        q = rng.choice(s["in_flight"])
        theirs = q["sources"] + q["dests"] + q.get("fills", [])
        if theirs:
            b = rng.choice(theirs)
        else:
            q["dests"] = q["dests"] + [b]
        first[ra] = first[ra] + [b]
    else:
        second = {"id": pid + 1, "request": f"{x}b", "sources": [e], "dests": [], "fills": []}
        first[ra] = first[ra] + [b]
        second[rng.choice(roles)].append(b)
        s["in_flight"] = s["in_flight"] + [first, second]
        return True
    s["in_flight"] = s["in_flight"] + [first]
    return True


def op_hand_over_held_block(s, rng) -> bool:
    """A block of the plan gets a second holder: allocated to a request (or a destination
    freed) while the plan still holds it, or listed by another request after the plan
    with no free and alloc to it in the schedule (a fill or a destination handed over)."""
    plan, post = s["plan"], _post(s)
    blocks = sorted(_plan_blocks(s))
    if not blocks:
        return False
    how = rng.choice(("alloc", "free_dest", "post") if post is not None else ("alloc", "free_dest"))
    dests = sorted(_plan_blocks(s) - set(plan["sources"]) - set(_fills(s)))
    if how == "free_dest" and dests:
        _while_held(s, [{"kind": "free", "blocks": [rng.choice(dests)]}])
    elif how == "post":
        kept = [b for b in blocks if b in _fills(s) or b in (s.get("dests_used") or [])] or blocks
        x = _other_request(s)
        s["post"]["requests"][x] = {"length": 0, "blocks": [rng.choice(kept)], "tail_block": None, "tokens": []}
    else:
        to = plan["request"] if rng.random() < 0.3 else _other_request(s)
        _while_held(s, [{"kind": "alloc", "request": to, "blocks": [rng.choice(blocks)]}])
    return True


def op_write_into_held_block(s, rng) -> bool:
    """A request writes into a block the plan holds and it does not: anyone into a
    destination before apply, another request into a source or a fill."""
    plan, S = s["plan"], s["block_size"]
    dests = sorted(_plan_blocks(s) - set(plan["sources"]) - set(_fills(s)))
    opts = [("dest", b) for b in dests] + [("own", b) for b in plan["sources"] + _fills(s)]
    if not opts:
        return False
    kind, b = rng.choice(opts)
    own = kind == "dest" and rng.random() < 0.5
    who = plan["request"] if own else _other_request(s)
    tok = (_post(s) or _pre(s))["length"] if own else 0
    _while_held(s, [{"kind": "write", "request": who, "token": tok, "slot": b * S + rng.randrange(S)}])
    return True


@dataclass(frozen=True)
class Operator:
    name: str
    invariant: str  # the invariant a mutant breaks; both checkers claim it
    fn: Callable
    what: str


OPERATORS: tuple[Operator, ...] = (
    Operator("drop_token", "I1", op_drop_token, "drop a token"),
    Operator("alias_slot", "I2", op_alias_slot, "alias two tokens onto one slot"),
    Operator("duplicate_token", "I1", op_duplicate_token, "duplicate a token at two slots"),
    Operator("move_shared_block", "I4", op_move_shared_block, "move a shared-prefix block"),
    Operator("move_tail_block", "I4", op_move_tail_block, "move the tail block"),
    Operator("overlap_in_flight", "I4", op_overlap_in_flight, "overlap an in-flight plan (same or other id)"),
    Operator("not_decreasing", "I4", op_not_decreasing, "block count not strictly decreasing"),
    Operator("read_before_copy", "I3", op_read_before_copy, "read a destination before its copy completes"),
    Operator("free_before_copy", "I3", op_free_before_copy, "free a source before its copy completes"),
    Operator("write_source_before_copy", "I3", op_write_source_before_copy,
             "reallocate and write a source before the copy out of it completes"),
    Operator("live_in_freed_block", "I2", op_live_in_freed_block, "leave a live token in a freed block"),
    Operator("change_digest", "I1", op_change_digest, "change a moved token's K/V digest"),
    Operator("resurrect_evicted", "I1", op_resurrect_evicted, "resurrect a token evicted in flight"),
    Operator("oversubscribe_headroom", "I4", op_oversubscribe_headroom, "over-subscribe the headroom"),
    Operator("move_from_unheld_slot", "I1", op_move_from_unheld_slot, "a move from a slot the table does not hold"),
    # in-place plans: moves into the holes of the request's own blocks (plan.fills)
    Operator("fill_occupied_slot", "I2", op_fill_occupied_slot, "move into a fill's slot that holds a live token"),
    Operator("fill_shared", "I4", op_fill_shared, "fill a shared block"),
    Operator("fill_tail", "I4", op_fill_tail, "fill the tail block"),
    Operator("fill_is_source", "I4", op_fill_is_source, "a block both a source and a fill"),
    Operator("fill_in_flight", "I4", op_fill_in_flight, "fill a block of another in-flight plan"),
    Operator("fill_not_owned", "I4", op_fill_not_owned, "fill a block that is not the request's"),
    Operator("move_to_unlisted_block", "I4", op_move_to_unlisted_block,
             "move into a block that is neither a destination nor a fill"),
    Operator("read_fill_hole_before_copy", "I3", op_read_fill_hole_before_copy,
             "read a fill's hole before the copy completes"),
    Operator("free_fill_before_copy", "I3", op_free_fill_before_copy,
             "free or hand off a fill before its copy completes"),
    # what the checkers derive (the tail, a request's plans, the headroom), every launch and
    # every request's post counting, reads of dead tokens
    Operator("tail_unrecorded", "I4", op_tail_unrecorded,
             "fill the derived tail while tail_block is null or wrong"),
    Operator("relaunch_after_reuse", "I3", op_relaunch_after_reuse,
             "launch the copy again after a source or fill was reused"),
    Operator("alias_other_post", "I2", op_alias_other_post,
             "another request's live token on a moved token's slot after the plan"),
    Operator("read_evicted_after_apply", "I3", op_read_evicted_after_apply,
             "read a token evicted in flight after apply"),
    Operator("read_dead_token", "I3", op_read_dead_token, "read a token dead before the plan"),
    Operator("second_plan_same_request", "I4", op_second_plan_same_request,
             "a second plan of the same request in flight"),
    Operator("plan_block_in_headroom", "I4", op_plan_block_in_headroom, "list a block in use in the headroom"),
    Operator("overwrite_live_slot", "I2", op_overwrite_live_slot, "write a new token onto a live token's slot"),
    # the rules the operators above reach only as a side effect, each planted on its own
    Operator("list_block_twice", "I4", op_list_block_twice, "name a block twice in sources, dests or fills"),
    Operator("source_not_emptied", "I4", op_source_not_emptied, "leave a live token in a source unmoved"),
    Operator("wrong_dests_used", "I4", op_wrong_dests_used, "dests_used not the blocks the moves landed in"),
    Operator("fill_dropped_after", "I4", op_fill_dropped_after, "a fill no longer the request's after the plan"),
    Operator("move_unmoved_token", "I1", op_move_unmoved_token, "an unmoved token moves or comes alive"),
    # ownership across the whole snapshot: every holder of a block, before and after apply
    Operator("dest_on_held_block", "I4", op_dest_on_held_block,
             "an in-flight plan's destination is a block a request reads"),
    Operator("in_flight_takes_held_block", "I4", op_in_flight_takes_held_block,
             "an in-flight plan (another request's, or an orphan) holds a request's block as source or fill"),
    Operator("in_flight_plans_overlap", "I4", op_in_flight_plans_overlap, "two in-flight plans hold one block"),
    Operator("hand_over_held_block", "I4", op_hand_over_held_block,
             "a block of the plan handed to a request (or a destination freed) without the plan letting go"),
    Operator("write_into_held_block", "I4", op_write_into_held_block,
             "a request writes into a block the plan holds and it does not"),
)


# ====================================================================== running
def _flagged(checker: Callable, snap: dict):
    """(set of violated invariants, set of (invariant, rule)) or raises SnapshotError."""
    vs = checker(snap)
    return {v.invariant for v in vs}, {(v.invariant, v.rule) for v in vs}


def make_mutants(valid: list[tuple[str, dict]], per_operator: int, seed: int = 0, operators=OPERATORS):
    """Yield ``(operator, path, mutant, malformed_error)`` -- ``per_operator`` mutants per
    operator (fewer only if no base snapshot admits it), deterministic for ``seed``."""
    for op in operators:
        rng = random.Random(f"{seed}/{op.name}")
        order = list(range(len(valid)))
        made, tries = 0, 0
        while made < per_operator and order and tries < 20 * per_operator + len(valid):
            rng.shuffle(order)
            progressed = False
            for i in order:
                if made >= per_operator:
                    break
                tries += 1
                path, base = valid[i]
                mut = copy.deepcopy(base)
                if not op.fn(mut, rng):
                    continue
                progressed = True
                made += 1
                try:
                    validate(mut)
                    err = None
                except SnapshotError as e:
                    err = str(e)
                yield op, path, mut, err
            if not progressed:
                break


def _collect(paths, seed: int, quick: bool, say) -> tuple[list, dict]:
    """The valid snapshots of every path, as ``(path, snapshot)``, and the per-path figures."""
    sizes = dict(planner=dict(runs=2, steps=10), engine=dict(runs=2, new_tokens=28)) if quick else {}
    valid: list[tuple[str, dict]] = []
    by_path: dict = {}
    for p in paths:
        if p not in COLLECTORS:
            raise ValueError(f"unknown path {p!r}; choose from {ALL_PATHS}")
        c0 = time.perf_counter()
        snaps = COLLECTORS[p](seed=seed, **sizes.get(p, {}))
        valid += [(p, s) for s in snaps]
        by_path[p] = dict(valid=len(snaps), collect_s=round(time.perf_counter() - c0, 2))
        say(f"{p}: {len(snaps)} valid snapshots")
    return valid, by_path


def _check_valid(valid: list, by_path: dict, failures: list) -> tuple[dict, int]:
    """Every checker on every valid snapshot: (accepted per checker, accepted by every checker)."""
    acc = {c: 0 for c in CHECKERS}
    valid_accepted = 0
    for p, s in valid:
        ok_all = True
        for c, fn in CHECKERS.items():
            vs = fn(s)
            if vs:
                ok_all = False
                if len(failures) < 20:
                    failures.append(dict(kind="valid_rejected", path=p, checker=c, violations=[str(v) for v in vs[:3]],
                                         plan=s["plan"]["id"]))
            else:
                acc[c] += 1
        valid_accepted += ok_all
        by_path[p]["accepted"] = by_path[p].get("accepted", 0) + ok_all
    return acc, valid_accepted


def _check_mutant(op: Operator, path: str, mut: dict, row: dict, cover: dict, failures: list) -> tuple[bool, bool]:
    """Every checker on one well-formed mutant, counted into ``row`` and ``cover``: (rejected by all, disagreement)."""
    sets, rules = {}, {}
    for c, fn in CHECKERS.items():
        sets[c], rules[c] = _flagged(fn, mut)
        for i in sets[c]:
            row["flagged"][c][i] += 1
        if op.invariant in sets[c]:
            row["rejected"][c] += 1
        elif len(failures) < 20:
            failures.append(dict(kind="mutant_accepted", operator=op.name, path=path, checker=c,
                                 flagged=sorted(sets[c]), plan=mut["plan"]["id"]))
    for c in CHECKERS:
        for inv, rule in rules[c]:
            cover[c].setdefault(f"{inv}.{rule}", set()).add(op.name)
    # agreement: the same violated invariants; every rule Z3 names is one Python names
    disagree = len({frozenset(x) for x in sets.values()}) > 1 or not rules["z3"] <= rules["python"]
    if disagree:
        row["disagreements"] += 1
        if len(failures) < 20:
            failures.append(dict(kind="disagreement", operator=op.name, path=path,
                                 python=sorted(rules["python"]), z3=sorted(rules["z3"])))
    return all(op.invariant in sets[c] for c in CHECKERS), disagree


def run(paths=ALL_PATHS, per_operator: int = 60, seed: int = 0, quick: bool = False,
        progress: Optional[Callable[[str], None]] = None) -> dict:
    """Collect, mutate, check (see the module docstring). Returns the figures as a dict:
    ``operators``, ``mutants``, ``rejected`` (by every checker), ``valid``,
    ``valid_accepted`` (by every checker), ``malformed``, ``disagreements``, ``by_operator``,
    ``by_path``, ``by_checker``, the rule-coverage table (:func:`rule_coverage`), ``passed``
    and the failures found (``failures``, a few); ``.violations``: what missed the goal."""
    t0 = time.perf_counter()
    say = progress or (lambda _m: None)
    valid, by_path = _collect(paths, seed, quick, say)
    failures: list[dict] = []
    acc, valid_accepted = _check_valid(valid, by_path, failures)
    by_op: dict = {}
    cover: dict = {c: {} for c in CHECKERS}  # checker -> "I1.arrival" -> operators whose mutants it flagged so
    total = rejected_all = malformed = disagreements = 0
    for op, path, mut, err in make_mutants(valid, per_operator, seed):
        row = by_op.setdefault(op.name, dict(what=op.what, invariant=op.invariant, generated=0, malformed=0,
                                             rejected={c: 0 for c in CHECKERS},
                                             flagged={c: {i: 0 for i in INVARIANTS} for c in CHECKERS},
                                             disagreements=0, by_path={}))
        row["generated"] += 1
        row["by_path"][path] = row["by_path"].get(path, 0) + 1
        total += 1
        if err is not None:
            row["malformed"] += 1
            malformed += 1
            if len(failures) < 20:
                failures.append(dict(kind="malformed_mutant", operator=op.name, path=path, error=err))
            continue
        by_all, disagree = _check_mutant(op, path, mut, row, cover, failures)
        rejected_all += by_all
        disagreements += disagree
        if total % 200 == 0:
            say(f"{total} mutants checked")
    short = [name for name in (o.name for o in OPERATORS) if by_op.get(name, {}).get("generated", 0) < per_operator]
    res = dict(
        operators=len(OPERATORS), mutants=total, rejected=rejected_all, valid=len(valid), valid_accepted=valid_accepted,
        malformed=malformed, disagreements=disagreements, per_operator_target=per_operator,
        operators_short=short, by_operator=by_op, by_path=by_path,
        by_checker={c: dict(valid_accepted=acc[c], rejected=sum(r["rejected"][c] for r in by_op.values()))
                    for c in CHECKERS},
        checkers={"python": "vtoken.invariants.snapshot_checks (I1-I4)", "z3": "vtoken.invariants.z3_checks (I1-I4)"},
        seed=seed, paths=list(paths), wall_s=round(time.perf_counter() - t0, 2), failures=failures,
    )
    res.update(rule_coverage(cover))
    res["passed"] = bool(total and rejected_all == total - malformed and malformed == 0 and not disagreements
                         and valid and valid_accepted == len(valid) and not short
                         and not res["rules_unexercised"] and not res["rules_unknown"])
    return Found(res, _run_violations(res))


_FAILURE_WHY = {
    "valid_rejected": "{checker} rejects a valid {path} snapshot (plan {plan}): {violations}",
    "mutant_accepted": "{checker} accepts a {operator} mutant of a {path} snapshot (plan {plan}; flagged {flagged})",
    "disagreement": "the checkers disagree on a {operator} mutant of a {path} snapshot: python {python}, z3 {z3}",
    "malformed_mutant": "operator {operator} made a malformed mutant of a {path} snapshot: {error}",
}


def _run_violations(res: dict) -> list[Violation]:
    """What a run found short of its goal, as :class:`Violation` (``[]``: it passed)."""
    out = [Violation("check_mutants", _FAILURE_WHY[f["kind"]].format(**f), dict(f), f["kind"])
           for f in res["failures"]]
    out += [Violation("check_mutants", f"operator {name} made fewer than {res['per_operator_target']} mutants",
                      {"operator": name}, "operator_short") for name in res["operators_short"]]
    out += [Violation("check_mutants", f"no operator's mutants reach rule {r}", {"rule": r}, "rule_unexercised")
            for r in res["rules_unexercised"]]
    out += [Violation("check_mutants", f"a checker names rule {r}, which the rule list does not", {"rule": r},
                      "rule_unknown") for r in res["rules_unknown"]]
    if not out and not res["passed"]:  # nothing made, or nothing collected
        out.append(Violation("check_mutants", f"{res['mutants']} mutants of {res['valid']} valid snapshots: "
                                              f"nothing to measure", {}, "empty"))
    return out


def rule_coverage(cover: dict) -> dict:
    """The operator-coverage table from a run's ``cover`` (checker -> rule -> operators).

    ``rule_coverage``: every rule of :data:`RULES` (``"I1.arrival"``, ...) -> the operators
    whose mutants *every* checker flagged through that rule, sorted; ``rule_coverage_by_checker``
    the same per checker; ``rules_unexercised``: the rules no operator reached, apart from
    ``rules_unreachable`` (:data:`UNREACHABLE`, with the reason)."""
    names = [f"{inv}.{rule}" for inv in INVARIANTS for rule in RULES[inv]]
    by_c = {c: {r: sorted(cover[c].get(r, ())) for r in names} for c in cover}
    both = {r: sorted(set.intersection(*(set(by_c[c][r]) for c in by_c))) for r in names}
    unknown = sorted({r for c in cover for r in cover[c]} - set(names))  # a rule the docstring does not name
    return dict(rule_coverage=both, rule_coverage_by_checker=by_c, rules_unreachable=dict(UNREACHABLE),
                rules_unexercised=[r for r in names if not both[r] and r not in UNREACHABLE], rules_unknown=unknown)


def format_table(res: dict) -> str:
    """The operator x checker table (text), for the command and the audit report."""
    cs = list(CHECKERS)
    head = f"{'operator':26} {'inv':3} {'made':>5} " + " ".join(f"{c + ' rej':>8}" for c in cs) + "  paths"
    lines = [head, "-" * len(head)]
    for name, r in res["by_operator"].items():
        paths = ",".join(f"{p}:{n}" for p, n in sorted(r["by_path"].items()))
        lines.append(f"{name:26} {r['invariant']:3} {r['generated']:5d} "
                     + " ".join(f"{r['rejected'][c]:8d}" for c in cs) + f"  {paths}")
    lines.append("-" * len(head))
    lines.append(f"mutants {res['mutants']}, rejected by every checker {res['rejected']}, malformed {res['malformed']}, "
                 f"disagreements {res['disagreements']}")
    per_path = ", ".join(f"{p}: {v['valid']}" for p, v in res["by_path"].items())
    lines.append(f"valid snapshots {res['valid']} ({per_path}), accepted by every checker {res['valid_accepted']}")
    if "rule_coverage" in res:
        lines += ["", f"{'rule':22} {'ops':>3}  operators whose mutants every checker rejects through the rule",
                  "-" * len(head)]
        for rule, ops in res["rule_coverage"].items():
            shown = ", ".join(ops) if ops else ("unreachable: " + res["rules_unreachable"][rule]
                                                if rule in res["rules_unreachable"] else "NOT EXERCISED")
            lines.append(f"{rule:22} {len(ops):3d}  {shown}")
        lines.append(f"rules exercised {sum(1 for o in res['rule_coverage'].values() if o)}/{len(res['rule_coverage'])}"
                     f", unreachable {len(res['rules_unreachable'])}, not exercised {len(res['rules_unexercised'])}"
                     f"{' ' + ','.join(res['rules_unexercised']) if res['rules_unexercised'] else ''}")
    return "\n".join(lines)


def main(argv=None) -> int:
    """``vtoken check-mutants [--json] [--per-operator N] [--seed S] [--paths a,b] [--quick]``.

    Exit 0: every mutant rejected by every checker, every valid snapshot accepted, no
    disagreement, every operator at its count, every rule exercised (or named unreachable);
    1: otherwise; 2: a path could not give
    snapshots (named in the error; nothing is skipped silently). With ``--json`` the last
    stdout line is one JSON object (see :func:`run`)."""
    from vtoken.argtypes import comma_choices, nonneg_int, positive_int

    ap = argparse.ArgumentParser(prog="vtoken check-mutants", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    ap.add_argument("--per-operator", type=positive_int, default=60, help="mutants per operator (default 60)")
    ap.add_argument("--seed", type=nonneg_int, default=0)
    ap.add_argument("--paths", type=comma_choices(ALL_PATHS), default=",".join(ALL_PATHS),
                    help=f"comma-separated subset of {','.join(ALL_PATHS)}")
    ap.add_argument("--quick", action="store_true", help="smaller collection runs")
    a = ap.parse_args(argv)
    paths = [p.strip() for p in a.paths.split(",") if p.strip()]
    try:
        res = run(paths, per_operator=a.per_operator, seed=a.seed, quick=a.quick,
                  progress=lambda m: print(m, file=sys.stderr))
    except PathUnavailable as e:
        print(f"check-mutants: {e}", file=sys.stderr)
        if a.json:
            print(json.dumps({"error": str(e), "passed": False, "paths": paths}))
        return 2
    print(format_table(res))
    if a.json:
        print(json.dumps(res, sort_keys=True))
    return 0 if res["passed"] else 1
