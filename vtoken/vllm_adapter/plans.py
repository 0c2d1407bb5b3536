"""The plan book: the adapter's compaction plans, from proposal to the worker's report.

The lifecycle is :class:`vtoken.lifecycle.PlanLedger`'s, the one the decode engine and the
simulator drive through ``ReclamationManager``: plans in flight (``plans``, one record type
with block ids), the one plan per request (``busy``, I4), ids, outcomes, snapshot clock and
``history``, and the one release of emptied blocks (``ledger.release``, here vLLM's fenced
free). What stays here is the translation to vLLM: its ``KVCacheBlock`` objects, its lists,
its pool's reference counts.
Owns: one reference held on each source, fill and destination of a plan in flight until the
worker reports it; the cached positive reclaim bounds and the requests whose bound is stale.
Plans come from :mod:`vtoken.planner` only (``should_reclaim``, ``reclaim_bounds``,
``propose``: the planner every path runs); the worker applies them with
``planner.apply_completed``. At launch the destinations leave the headroom, the sources
and fills (the request's blocks whose holes take tokens: in-place compaction) are
null-substituted in the request's list (the mirror) or taken out of its held blocks and
lose their prefix-cache hash, and the sources open their fence entries. At the report,
fills and used destinations go to the request (the adapter's ``held``) or back to the pool
if it is gone, unused destinations back to the headroom, and sources back through vLLM's
fenced free (``_free_cow_retained_blocks(sources, plan.seq)``).
May call: what it is given (the ledger, the token table, the rooms ``reserve``, ``held``,
``mirror``, ``fence``, ``hashes``, ``checker``; vLLM's pool and scheduler through the harness;
the request side's six questions, :class:`RequestSide`) and the toolkit's ``plan_hook`` when
one is attached. It never reads the adapter's attributes.
Costs: per planning step O(requests whose table changed + requests with a positive bound),
plus the planner's own cost per plan; per report O(blocks of the reported plans).
"""

from __future__ import annotations

import numpy as np

from typing import Protocol

from .assumptions import AdapterAssumptionError
from .held import unaccounted
from .messages import StepMeta
from ..lifecycle import Plan, PlanLedger
from ..planner import Proposal, plan_snapshot, propose, reclaim_bounds, should_reclaim, trigger_inputs


class RequestSide(Protocol):
    """What the plan book asks of the adapter about requests (the adapter implements it)."""

    def arrival(self, r: str) -> int: ...  # a deterministic order

    def current(self, r: str) -> bool: ...  # mirrored, in the table, its incarnation seen by the worker

    def running(self, r: str) -> bool: ...  # vLLM's status RUNNING

    def look_again(self, r: str) -> None: ...  # look for all-dead blocks at the next step

    def detach_all(self, r: str, blocks) -> list[int]: ...  # take r's references over (list index or -1)


class PlanBook:
    """The adapter's plans (see the module docstring).

    Args:
        ledger: the lifecycle room (``PlanLedger``: plans in flight, outcomes, the one release).
        harness: the ``VllmHarness`` (vLLM's pool and scheduler, read each time: vLLM's tests
            swap the manager after construction).
        table, cfg, stats: the token table the worker writes, the ``PlannerConfig``, the
            adapter's counters.
        reserve, held, mirror, fence, hashes: the adapter's rooms; checker: its runtime checks.
        requests: the request side (:class:`RequestSide`).
        gone_fence: request -> the fence of its freed list (the adapter's dict, read here).
        max_plans_per_step: plans launched per step at most; checks: run the fence check
            at each source free.
    """

    def __init__(self, ledger: PlanLedger, *, harness, table, cfg, stats: dict, reserve, held, mirror, fence, hashes,
                 checker, requests: RequestSide, gone_fence: dict, max_plans_per_step: int, checks: bool):
        self.ledger, self.harness, self.table, self.cfg, self.stats = ledger, harness, table, cfg, stats
        self.reserve, self.held, self.mirror, self.fence, self.hashes = reserve, held, mirror, fence, hashes
        self.checker, self.requests, self.gone_fence = checker, requests, gone_fence
        self.max_plans_per_step, self.checks = int(max_plans_per_step), bool(checks)
        self.plan_hook = None  # the toolkit's contract check, attached through the adapter
        self.stale_bounds: set = set()  # requests whose reclaim bound must be recomputed
        self.bound: dict[str, tuple] = {}  # request -> (-its positive reclaim bound, arrival, request), cached

    @property
    def plans(self) -> dict[int, Plan]:
        """The plans in flight (not yet reported by the worker), by id."""
        return self.ledger.in_flight

    @property
    def busy(self) -> dict:
        """Request -> the ids of its plans in flight (one at most here: a busy request is not planned, I4)."""
        return self.ledger.busy

    def plan(self, meta: StepMeta, steps: int) -> None:
        """Stages 1-3: eligibility (``should_reclaim`` every ``check_every`` steps), requests
        by their reclaimable-block bound (recomputed only for requests whose table changed,
        cached while positive), then one plan per request (``propose``), with the blocks vLLM
        shares or the scheduler side does not hold for the request excluded. ``steps``: the
        adapter's non-empty steps so far (the ``check_every`` clock)."""
        t, cfg = self.table, self.cfg
        need_head = not cfg.in_place  # in-place plans fill the request's own holes: no headroom needed
        if (need_head and not self.reserve) or steps % cfg.check_every or \
                not should_reclaim(cfg, **trigger_inputs(t, self.harness.pool.get_num_free_blocks())):
            return
        bound, arrival = self.bound, self.requests.arrival
        stale = [r for r in self.stale_bounds if r in t]
        for r in self.stale_bounds.difference(stale):  # gone from the table
            bound.pop(r, None)
        for r, gain in zip(stale, reclaim_bounds(t, stale).tolist()):  # the table's tails: the blocks being written
            if gain > 0:
                bound[r] = (-gain, arrival(r), r)  # the sort key, kept with the bound
            else:
                bound.pop(r, None)
        self.stale_bounds = set()
        busy, current, running = self.busy, self.requests.current, self.requests.running
        pool_blocks = self.harness.pool.blocks
        # largest bound first, arrival breaks ties; the eligibility tests run only on the
        # requests reached before the step's plans or the headroom run out
        for _, _, r in sorted(bound.values()):
            if len(meta.plans) >= self.max_plans_per_step or (need_head and not self.reserve):
                break
            if r in busy or not current(r) or not running(r):
                continue
            blocks = t.block_array(r).tolist()
            not_ours = set(unaccounted(self.mirror, self.held, r, blocks))
            exclude = np.asarray([b for b in blocks if pool_blocks[b].ref_cnt != 1 or b in not_ours], dtype=np.int64)
            tail = t.tail_block(r)
            head = self.reserve.ids()
            p, _ = propose(t, r, head, max_sources=cfg.max_sources, tail=tail, excluded=exclude, in_place=cfg.in_place)
            if p is None:
                continue
            if self.plan_hook is not None:  # the toolkit's contract check (spec.planner), when attached
                flying = [b for q in self.plans.values() for b in q.blocks]
                try:
                    self.plan_hook(table=t, req_id=r, proposal=p, tail=tail, headroom=head, excluded=exclude.tolist(),
                                 max_sources=cfg.max_sources, in_flight=flying, in_place=cfg.in_place)
                except AssertionError as e:
                    raise AdapterAssumptionError("plan_contract", f"step {meta.seq}: {e}") from e
            self.launch(meta, r, p, tail, head)

    def launch(self, meta: StepMeta, r: str, p: Proposal, tail, head: list[int]) -> None:
        """Take the proposal's destinations from the headroom, take its sources and fills
        over from the request (null-substituted in its list, or out of its held
        destinations), drop their prefix-cache hashes (no hit may land on a block in flight,
        and a fill's bytes change), open the sources' fence entries, and ride on step
        ``meta.seq``. ``plan.list_index`` records where each source and fill was taken from
        (its list index, -1 for a held block): the incremental check compares them all with
        vLLM's list while the plan flies."""
        pool_blocks = self.harness.pool.blocks
        sources = [pool_blocks[b] for b in p.sources]
        fills = [pool_blocks[b] for b in p.fills]
        table_refs = self.table.refs[np.asarray(p.sources + p.fills, dtype=np.int64)].tolist()
        for k, (blk, refs) in enumerate(zip(sources + fills, table_refs)):  # refused before anything changes hands
            if blk.ref_cnt != 1 or refs != 1:
                self.stats["shared_blocks_moved"] += 1
                raise AdapterAssumptionError(
                    "shared_never_moved", f"plan for request {r!r} takes block {blk.block_id} as a "
                    f"{'source' if k < len(sources) else 'fill'} (vLLM ref_cnt {blk.ref_cnt}, table refs "
                    f"{int(self.table.refs[blk.block_id])}) at step {meta.seq}")
        self.reserve.take(p.dests)
        plan = self.ledger.new_plan(r, p.sources, p.dests, np.asarray(p.moves, dtype=np.int64).reshape(-1, 5),
                                    p.fills, seq=meta.seq)
        if self.cfg.record_snapshots:
            plan.snapshot = plan_snapshot(
                self.table, r, plan.id, p, tail, head,
                [{"id": q.id, "request": str(q.req_id), "sources": list(q.sources), "dests": list(q.dests),
                  "fills": list(q.fills)} for q in self.plans.values()])
        self.hashes.drop_sources(sources + fills)
        plan.list_index = dict(zip(p.sources + p.fills, self.requests.detach_all(r, sources + fills)))
        self.fence.open(plan)
        self.checker.touch([r])
        self.ledger.open(plan)
        meta.plans.append(plan)

    def orphan(self, r: str) -> None:
        """``r``'s list was freed (preemption, finish): its plans in flight are orphaned (their
        blocks return when the worker reports them) and its bound forgotten."""
        self.stats["orphaned_plans"] += len(self.ledger.orphan(r))
        self.bound.pop(r, None)

    def absorb(self, reported: dict) -> None:
        """The worker's report, per finished plan: destinations to the request (or back to
        the headroom), sources back through the fence."""
        stats = self.stats
        blocks = self.harness.pool.blocks
        for pid, res in reported.items():
            plan = self.plans.get(pid)
            if plan is None:
                raise AdapterAssumptionError("ownership", f"the worker reported plan {pid}, which is not in flight")
            if res.shared_sources:
                stats["shared_blocks_moved"] += len(res.shared_sources)
                raise AdapterAssumptionError(
                    "shared_never_moved", f"plan {pid} of request {plan.req_id!r}: sources or fills "
                    f"{res.shared_sources} are not the request's alone at copy time (referenced by another request, "
                    f"or no longer by it)")
            self.checker.touch([plan.req_id])
            self.requests.look_again(plan.req_id)  # it may release again now that no plan flies
            alive = not plan.orphaned and plan.req_id in self.mirror
            gone_fence = self.gone_fence.get(plan.req_id, 0)
            self.ledger.close(plan, "applied" if res.status == "applied" else "aborted")
            fills = [blocks[b] for b in plan.fills]
            if res.status == "applied":
                used_ids = set(res.used_dests)
                used = [blocks[d] for d in plan.dests if d in used_ids]
                unused = [blocks[d] for d in plan.dests if d not in used_ids]
                self.reserve.put(unused)  # never written: straight back to the reservation
                stats["dests_returned"] += len(unused)
                stats["dests_used"] += len(used)
                stats["fills"] += len(plan.fills)
                stats["moves"] += int(res.moved)
                if alive:  # fills stay the request's: held, like destinations (never hashed again)
                    self.held.add(plan.req_id, fills + used)
                else:
                    self.ledger.release(plan.fills + [b.block_id for b in used], max(plan.seq, gone_fence))
                self.free_sources(plan, copy_done=res.copy_done)
                if plan.snapshot is not None and plan.snapshot["post"] is not None:
                    self.ledger.history.append(plan)  # its snapshot completed by the worker (snapshot_applied)
            else:  # aborted: nothing moved (or the request is gone)
                self.reserve.put([blocks[d] for d in plan.dests])
                self.fence.drop(plan)
                if alive and res.table_kept:  # still read by the request
                    self.held.add(plan.req_id, [blocks[b] for b in plan.sources] + fills)
                else:
                    self.ledger.release(plan.sources + plan.fills, max(plan.seq, gone_fence))

    def free_sources(self, plan: Plan, copy_done: bool) -> None:
        """Hand a plan's sources back to the pool at their fence: vLLM's
        ``_free_cow_retained_blocks(sources, plan.seq)`` frees them at once when step
        ``plan.seq`` has been processed, else defers them to it. A source carries no
        prefix-cache hash (dropped at launch, and vLLM never hashes a block outside a
        request's list): one that does was re-hashed under the adapter (``prefix_hash``)."""
        processed = self.harness.scheduler.processed_step_seq
        for b in plan.sources:
            if self.harness.pool.blocks[b].block_hash is not None:
                raise AdapterAssumptionError(
                    "prefix_hash", f"source block {b} of plan {plan.id} (request {plan.req_id!r}) carries "
                    f"a prefix-cache hash at its free: its hash was dropped at launch, so it was re-hashed while in "
                    f"flight")
        self.fence.close(plan, processed, copy_done)
        self.stats["sources_freed"] += len(plan.sources)
        self.ledger.release(plan.sources, plan.seq, plan=plan)
        if self.checks:
            self.fence.check()
