"""The planted-fault catalogue: every fault a patch on the shipped code (or a faulty engine).

Each :class:`Fault` is drawn from the bug classes real KV managers have shipped
(``shared/design/PRIOR_ART.md``) or from an invariant it breaks, and names the detector
expected to catch it. A fault is either a list of :class:`~vtoken.fuzz.patches.Patch`
(applied in a shadow tree by the runner, swapped in process by tests) or the name of a
faulty copy engine (``vtoken.fuzz.faulty_engines``) the detector builds the path with.
Nothing in ``vtoken/`` names a fault.

Detectors: ``table`` (the table conformance machine), ``planner`` (the planner machine),
``placement`` (the bounded Z3 proof of the placement rule), ``decode`` (a decode with
hash-and-compare and output comparison against naive-evict), ``adapter`` (the adapter
conformance machine over the real vLLM scheduler), ``prefix`` (the audit's prefix-equality
run: later requests repeating earlier sequences, caching on against off), ``gpu`` (CUDA ordering, only where a
GPU is present).

Owns: nothing (data: the faults).
May call: fuzz.patches.
Costs: O(1) (built at import).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .patches import Patch

T, A, P, L = "vtoken/table.py", "vtoken/allocator.py", "vtoken/planner.py", "vtoken/placement.py"
LC = "vtoken/lifecycle.py"  # the lifecycle every path runs: a fault here is in each of them
E = "vtoken/decode.py"
AD = "vtoken/vllm_adapter/adapter.py"
WC = "vtoken/vllm_adapter/worker_core.py"
MI, PH = "vtoken/vllm_adapter/mirror.py", "vtoken/vllm_adapter/prefix_hash.py"
HR, PL = "vtoken/vllm_adapter/headroom.py", "vtoken/vllm_adapter/plans.py"
PO, MS = "vtoken/vllm_adapter/port.py", "vtoken/vllm_adapter/messages.py"
EK, EW = "vtoken/vllm_engine/kv.py", "vtoken/vllm_engine/worker.py"  # vLLM's real engine (detector "engine")
EA, ES = "vtoken/vllm_engine/attention.py", "vtoken/vllm_engine/scheduler.py"


@dataclass(frozen=True)
class Fault:
    name: str
    bug_class: str
    what: str
    detector: str
    patches: tuple = field(default=())  # Patch, applied in order
    engine: str | None = None  # a faulty copy engine instead of patches
    cuda_only: bool = False


def _p(file, function, old, new):
    return Patch(file, function, old, new)


CATALOGUE: list[Fault] = [
    # ---------------------------------------------------------------- table and allocator
    Fault("alloc_double_free", "1 double free", "the allocator accepts freeing a block more times than it is referenced",
          "table", (_p(A, "BlockAllocator.free", "if self.state[b] != USED or self.ref[b] < k:", "if False:"),)),
    Fault("alloc_queue_dup", "2 block in the free queue twice", "a still-referenced block is queued as free", "table",
          (_p(A, "BlockAllocator.free", "                freed.append(b)\n",
              "                freed.append(b)\n            else:\n                self._queue.append(b)\n"),)),
    Fault("waste_drift", "3 accounting drift", "the live-slot total is not decremented on a one-token eviction (F drifts)",
          "table", (_p(T, "TokenTable._evict_one", "self._live_slots -= 1", "self._live_slots -= 0"),)),
    Fault("refcount_leak", "4 ref-count leak", "finishing a request keeps its reference on shared blocks", "table",
          (_p(T, "TokenTable.free_request", "        self._unref_blocks(r, blocks)\n",
              "        self._unref_blocks(r, [b for b in blocks if self.refs[b] <= 1])\n"),)),
    Fault("slot_formula_wrong_s", "5 wrong block size in the slot formula", "a one-token sync computes its slot with S+1",
          "table", (_p(T, "TokenTable._sync_one", "s = b * S + n % S", "s = b * (S + 1) + n % S"),)),
    Fault("stale_slot_after_move", "6 stale lookup cache after a move", "the device slot cache is not updated by apply_moves",
          "table", (_p(T, "TokenTable._apply_valid_moves",
                       "        self._pool.pend_idx.append(tok + self._db[rows][ri])\n        self._pool.pend_val.append(dst.copy())\n", ""),)),
    Fault("nb_double_count", "3 accounting drift (n_b)", "n_b counts a shared slot once per request", "table",
          (_p(T, "TokenTable._claim", "np.add.at(self.n_b, fresh // self.S, _ONE)\n        self._live_slots += len(fresh)",
              "np.add.at(self.n_b, slots // self.S, _ONE)\n        self._live_slots += len(slots)"),
           _p(T, "TokenTable._sync_one", "        if c == 0:\n            self.n_b[b] += 1", "        if True:\n            self.n_b[b] += 1"))),
    Fault("nonatomic_apply_moves", "I2 non-atomic failed apply_moves", "a failing move list applies its valid prefix", "table",
          (_p(T, "TokenTable.apply_moves_each", "            code = next(name for name, c in checks if c[i])\n",
              "            code = next(name for name, c in checks if c[i])\n            if i > 0:\n"
              "                self._apply_valid_moves(rs, rows, ri[:i], tok[:i], g[:i], cur[:i], dst[:i])\n"),)),
    Fault("dup_dst_accepted", "9 duplicate destination slot", "apply_moves accepts two moves into one slot", "table",
          (_p(T, "TokenTable.apply_moves_each", ' ("slot_occupied", c_occ), ("duplicate_destination", c_dupdst),',
              ' ("slot_occupied", c_occ),'),)),
    Fault("evict_wrong_token", "I1 eviction of the wrong token", "a one-token eviction marks the next token dead", "table",
          (_p(T, "TokenTable._evict_one", "        if not 0 <= t < r.n:\n",
              "        if t + 1 < r.n and r.live[t + 1]:\n            t += 1\n        if not 0 <= t < r.n:\n"),)),
    Fault("release_nonempty", "9 phantom slot after compaction", "a block with live tokens is released", "table",
          (_p(T, "TokenTable.release_empty_blocks", "if self.n_b[b] != 0:", "if False:"),)),
    Fault("segment_growth_drops_queued", "6 stale lookup cache after a segment grows",
          "a request outgrowing its device segment is copied to the new one before its queued updates are written "
          "(they land in the released segment)", "table",
          (_p(T, "TokenTable._grow", "            pool.flush()\n            pool.slot[base:base + r.n]",
              "            pool.slot[base:base + r.n]"),)),
    # ---------------------------------------------------------------- the planner
    Fault("headroom_leak", "3 accounting drift (reservations)", "reserved headroom blocks stay allocatable", "planner",
          (_p(A, "BlockAllocator.reserve", "        for b in out:\n            self.state[b] = RESERVED",
              "        self._queue.extend(out)\n        for b in out:\n            self.state[b] = RESERVED"),)),
    Fault("plan_moves_shared", "7 a shared-prefix block moved", "shared blocks are compaction sources", "planner",
          (_p(P, "eligible_blocks", "ok = (table.refs[blocks] == 1) & (blocks", "ok = (blocks"),)),
    Fault("plan_moves_tail", "I4 tail block moved", "the block being written is a compaction source", "planner",
          (_p(P, "eligible_blocks", " & (blocks != (tail if tail is not None else -1))", ""),)),
    Fault("plan_nondecreasing", "I4 non-decreasing plan accepted", "a plan that frees no block is made", "planner",
          (_p(P, "propose", "        if reductions[m - 1] <= 0:\n            return None, worthwhile\n"
                            "        dests = [int(b) for b in headroom[: int(need[m - 1])]]",
              "        n_dest = min(max(int(need[m - 1]), m), limit)\n"
              "        if n_dest == 0:\n            return None, worthwhile\n        dests = [int(b) for b in headroom[:n_dest]]"),)),
    Fault("plan_dup_dst", "9 duplicate destination slot (planner)", "the planner gives two tokens one destination", "planner",
          (_p(P, "_moves_of", "    return moves\n",
              "    if len(toks) > 1:\n        moves[1, 3:] = moves[0, 3:]\n    return moves\n"),)),
    Fault("plan_overlaps_inflight", "I4 overlap with an in-flight plan", "blocks of an in-flight plan are planned again",
          "planner", (_p(P, "ReclamationManager.plan_request", "excluded=self.busy_mask if self.in_flight else None",
                         "excluded=None"),
                      _p(P, "ReclamationManager.plan_round", "            if rid in busy:\n                continue\n", ""))),
    Fault("free_sources_at_plan", "8 source freed before its copy completed", "sources return to the pool at launch",
          "planner", (_p(LC, "Lifecycle.launch", "        self.held.take(r, from_held)\n",
                         "        self.held.take(r, from_held)\n        self.port.free(plan.sources, 0)\n"),
                      _p(LC, "Lifecycle.end", "            self._free(plan.sources, plan.seq, plan=plan)\n", ""))),
    Fault("apply_before_complete", "8/I3 read before the copy completes",
          "a pending copy is applied (slot mapping switched) without its fence", "planner",
          (_p(LC, "Copies.poll", '            if status == "pending":\n                continue\n',
              '            if status == "pending":\n                status = "done"\n'),)),
    Fault("abort_leaks_dests", "4 leak on a copy aborted part-way", "an aborted plan's destinations never return", "planner",
          (_p(LC, "Lifecycle.end", "            self._to_headroom(plan.dests)\n            back = plan.sources + plan.fills\n",
              "            back = plan.sources + plan.fills\n"),)),
    Fault("finish_frees_inflight_sources", "8 source reused before its copy completes",
          "finishing a request frees the blocks its in-flight copy reads and writes (sources and fills)", "planner",
          (_p(LC, "Lifecycle.finish", "            p.gone_fence = int(fence)\n",
              "            p.gone_fence = int(fence)\n            self.port.free(p.sources + p.fills, fence)\n"),
           _p(LC, "Lifecycle.end", "            else:\n                self._free(back, gone)\n",
              "            elif alive:\n                self._free(back, gone)\n"))),
    Fault("resumed_applies_old_plan", "8 a plan applied to another incarnation (copy across preempt and resume)",
          "a request preempted while its copy flies is not forgotten by the copy side: once the id resumes, the "
          "old incarnation's plan is applied to the new one's table", "planner",
          (_p(P, "ReclamationManager.finish_request", "        self.copies.forget(req_id)\n", ""),)),
    Fault("skip_apply", "6 table not updated after the copy", "a completed plan frees sources without updating the table",
          "planner", (_p(LC, "Copies._finished",
                         "            res = apply_completed(t, r, plan.sources, plan.moves, fills=plan.fills)\n",
                         "            mv = np.asarray(plan.moves, dtype=np.int64).reshape(-1, 5)\n"
                         "            res = Applied(mv, [], sorted({int(b) for b in mv[:, 3]} - set(plan.fills)), "
                         "list(plan.sources))\n"),)),
    Fault("drain_drops_orphans", "4 leak: an orphan's frees dropped at the end of a batch",
          "drain ends a plan whose request is gone without waiting for its copy: counted orphaned, out of flight, "
          "but its sources and fills are never freed and its destinations stay reserved", "planner",
          (_p(P, "ReclamationManager.drain", "        done = self.poll(force_sync=True)\n",
              "        for p in [p for p in self.in_flight.values() if p.orphaned]:\n"
              "            self.copies.pending.pop(p.id, None)\n            del self.in_flight[p.id]\n"
              "            self.busy_mask[p.blocks] = False\n            self.stats['orphaned'] += 1\n"
              "        done = self.poll(force_sync=True)\n"),)),
    # ---------------------------------------------------------------- placement
    Fault("placement_off_by_one", "5 wrong-slot placement", "the k-th moved token goes to slot k+1", "placement",
          (_p(L, "place", "return before // S, before % S", "return (before + one) // S, (before + one) % S"),)),
    # ---------------------------------------------------------------- the copy engine (faulty engines)
    Fault("copy_flip_byte", "I1 corrupted relocation", "one byte of one moved K/V entry flips", "decode",
          engine="copy_flip_byte"),
    Fault("copy_skip_move", "I1 skipped move", "one move of a plan is not copied", "decode", engine="copy_skip_move"),
    Fault("copy_write_past_dst", "5 wrong-slot write (the scatter's off-by-one)", "each moved entry lands one slot past its destination",
          "decode", engine="copy_write_past_dst"),
    Fault("cuda_release_before_event", "8/I3 copy reported done before it landed",
          "poll reports done without the event (CPU: before the lagged copy ran)", "decode",
          engine="cuda_release_before_event"),
    Fault("copy_write_bystander", "I1/I2 a write onto a bystander's live token (stale index buffer)",
          "each copy also scatters one moved entry through an earlier copy's destination index, onto another "
          "request's live token far from the plan's own blocks", "decode", engine="copy_write_bystander"),
    Fault("cuda_wait_dropped", "I3 no wait before attention", "wait_before_attention does nothing", "gpu",
          engine="cuda_wait_dropped", cuda_only=True),
    Fault("cuda_event_wrong_stream", "I3 event on the wrong stream", "the completion event is recorded on the compute stream",
          "gpu", engine="cuda_event_wrong_stream", cuda_only=True),
    # ---------------------------------------------------------------- the decode engine's copy lifecycle
    Fault("decode_run_no_drain", "4 leak: copies in flight at the end of a batch",
          "run returns without draining the manager: a plan still copying when the last request finishes is "
          "never polled again, its deferred sources and fills never freed (and the headroom stays reserved)",
          "decode", (_p(E, "DecodeEngine.drain", "            self.manager.drain()\n", "            pass\n"),)),
    Fault("decode_release_busy_all_dead", "8 source released while its copy reads it",
          "a source whose every live token was evicted while its copy flies is released at once like any "
          "all-dead block (the plan still names it)", "decode",
          (_p(E, "DecodeEngine._release_empty", "busy=mgr.busy_mask if mgr is not None else None", "busy=None"),)),
    Fault("apply_keeps_dead_source", "4 leak: a source that died in flight is never freed",
          "apply frees only the sources its surviving moves emptied: one whose every token was evicted while "
          "the copy flew is released by the table but stays allocated", "decode",
          (_p(LC, "Lifecycle.end",
              "            self._free(plan.sources, plan.seq, plan=plan)\n",
              "            dead = set(plan.evicted_in_flight)\n"
              "            kept = sorted({int(m[1]) for m in plan.moves.tolist() if m[0] not in dead})\n"
              "            self._free(kept, plan.seq, plan=plan)\n"),)),
    # ---------------------------------------------------------------- the graph path (CUDA graphs)
    Fault("graph_replay_on_capture_stream", "10 a replay that skips a host-side hook (the event wait before replay)",
          "the decode graph is replayed on its capture stream, which never waited on pending copies nor on the "
          "slot-buffer update: the replay reads destinations before their copy landed", "gpu",
          (_p(E, "StepGraph.run", "            self.graph.replay()\n",
              "            with torch.cuda.stream(self.stream):\n                self.graph.replay()\n"),),
          cuda_only=True),
    # ---------------------------------------------------------------- the vLLM adapter
    Fault("adapter_free_before_fence", "8 source freed before its fence (vLLM async scheduling)",
          "the adapter hands a plan's sources back to the pool at launch, before the step that copies them",
          "adapter", (_p(PL, "PlanBook.launch", "        meta.plans.append(order)\n",
                         "        meta.plans.append(order)\n        self.harness.pool.free_blocks(list(sources))\n"
                         "        plan.freed_early = True\n"),
                      _p(LC, "Lifecycle.end", "            self._free(plan.sources, plan.seq, plan=plan)\n",
                         "            if not getattr(plan, 'freed_early', False):\n"
                         "                self._free(plan.sources, plan.seq, plan=plan)\n"))),
    Fault("adapter_stale_prefix_hash", "7 prefix-cache poisoning",
          "a source's prefix-cache hash moves to the destination (or first fill) at launch (the tokens moved, the hash follows)",
          "adapter", (_p(PL, "PlanBook.launch", "        keep = self.hashes.park(plan.id, r, sources, fills, plan.list_index)\n",
                         "        self.hashes.drop_sources(fills)\n"
                         "        dests = [pool_blocks[d] for d in p.dests]\n"
                         "        for blk in sources:\n"
                         "            to = (dests or fills)[:1]\n"
                         "            if to and to[0].block_hash is None and blk.block_hash is not None:\n"
                         "                self.harness.pool.move_block_hashes(blk, to[0])\n"
                         "            else:\n                self.hashes.drop_sources([blk])\n"
                         "        keep = []\n"),)),
    Fault("adapter_source_keeps_hash", "7/I4 in-flight prefix hit on a source",
          "a source keeps its prefix-cache hash while its copy flies (not parked: vLLM can hand it out as a hit)",
          "adapter",
          (_p(PH, "PrefixHashRules.park", "            hashes = self.pool._remove_cached_block_hashes(blk)\n",
              "            hashes = []\n"),)),
    Fault("adapter_fill_keeps_hash", "7 prefix-cache poisoning (a hash kept on changed bytes)",
          "a plan's fills keep their prefix-cache hash though their holes take moved tokens: a later request "
          "repeating the sequence hits bytes a fresh prefill does not write", "prefix",
          (_p(PH, "PrefixHashRules.drop_sources", "            self.pool.evict_blocks(hashed)\n", "            pass\n"),)),
    Fault("adapter_pop_not_null", "positional block list broken",
          "a source is popped from vLLM's block list instead of null-substituted", "adapter",
          (_p(MI, "BlockMirror.detach_many", "lst[i] = self.null", "lst.pop(i)"),)),
    Fault("adapter_headroom_to_allocate", "3 reservation leak",
          "headroom blocks (reserved, or drawn for a plan's destinations) are handed back to vLLM's allocate_slots",
          "adapter", (_p(HR, "Headroom.before_schedule", "lc.refill(len(lc.headroom) + take)",
                         "lc.refill(len(lc.headroom) + take)\n"
                         "                    pool.free_blocks([pool.blocks[b] for b in lc.headroom[-take:]])"),
                      _p(HR, "Headroom.draw", "        lc.refill(n + k)\n",
                         "        lc.refill(n + k)\n"
                         "        self.harness.pool.free_blocks([self.harness.pool.blocks[b] for b in lc.headroom[n:]])\n"))),
    Fault("adapter_dests_unfenced", "8 block freed before its fence (preemption / finish)",
          "a finished or preempted request's destinations are freed at once, not at vLLM's fence", "adapter",
          (_p(AD, "VTokenAdapter._on_request_free", "self.lifecycle.finish(r, fence)", "self.lifecycle.finish(r, 0)"),)),
    Fault("worker_preempt_no_reset", "preemption reset missed", "the worker keeps a preempted request's token table",
          "adapter", (_p(WC, "WorkerCore.begin", "        for r in sched_out.preempted_req_ids or ():\n            self.drop(r, forget=False)\n", ""),
                      _p(WC, "WorkerCore._lists", "                if r in t:\n                    self.drop(r, forget=False)\n", ""))),
    Fault("adapter_resume_appends", "resumed block list appended",
          "preemption is taken for a pause: the adapter keeps the preempted request's mirror and appends the "
          "resumed request's new block list to it instead of replacing it", "adapter",
          (_p(MI, "BlockMirror.observe", "            if r in resumed:\n",
              "            if False:\n"),
           _p(AD, "VTokenAdapter._on_request_free", "        self.mirror.forget(r)\n",
              "        if request.is_finished():\n            self.mirror.forget(r)\n"))),
    Fault("adapter_keeps_unfaithful_hash", "7 prefix-cache poisoning (a block computed after an eviction)",
          "the hashes of blocks a request computed after its first eviction are kept: a later request repeating "
          "its sequence hits K/V that a fresh prefill would not write", "prefix",
          (_p(PH, "PrefixHashRules.evict_unfaithful", "        if not self.enabled or f is None or not lst:\n",
              "        if True:\n"),)),
    Fault("adapter_release_unfenced", "8 released block freed before its fence (async step offsets)",
          "blocks whose tokens all died are freed with the previous step's fence", "adapter",
          (_p(AD, "VTokenAdapter._release_empty", "self.lifecycle.release([b], meta.seq)",
              "self.lifecycle.release([b], meta.seq - 2)"),)),
    Fault("adapter_fill_index_dropped", "positional block list broken (a check blind to fills)",
          "a plan records the list indices of its sources only, so the incremental check never compares a fill "
          "with vLLM's list", "adapter",
          (_p(LC, "Lifecycle.launch", "        plan.list_index = {**dict.fromkeys(from_held, -1), **dict(zip(rest, index))}\n",
              "        plan.list_index = {b: i for b, i in {**dict.fromkeys(from_held, -1), **dict(zip(rest, index))}.items()\n"
              "                           if b not in plan.fills}\n"),)),
    Fault("worker_shared_fill_by_refs", "7 a shared block moved (named by its count only)",
          "after apply refuses a fill, the worker names shared blocks by reference count alone: a fill held by "
          "another request alone takes the quiet 'aborted, table kept' path", "adapter",
          (_p(LC, "shared_blocks", "if table.block_refs(b) != 1 or not table.references(req_id, b)]",
              "if table.block_refs(b) != 1]"),)),
    Fault("adapter_used_dests_to_headroom", "3 reservation leak (out of place)",
          "an applied out-of-place plan gives its written destinations back to the headroom (the unwritten ones "
          "are lost)", "adapter",
          (_p(LC, "Lifecycle.end", "self._to_headroom([d for d in plan.dests if d not in used])",
              "self._to_headroom(used)"),)),
    Fault("worker_resumed_applies_old_plan", "8 a plan applied to another incarnation (copy across preempt and resume)",
          "a plan whose copy outlived its request's preemption is applied once the request resumed (the "
          "incarnation check dropped)", "adapter",
          (_p(WC, "WorkerCore.drop", "        self.copies.forget(r)  # its copies in flight end aborted (a resumed "
                                         "incarnation is another request)\n", ""),)),
    Fault("worker_failed_copy_frees_table", "8 blocks freed while still read (a failed copy)",
          "a failed copy is reported without the table kept: the adapter frees the sources and fills the "
          "request still reads", "adapter",
          (_p(LC, "Copies._finished", 'table_kept=True, reason="copy failed")',
              'table_kept=False, reason="copy failed")'),)),
    Fault("worker_copies_unchecked", "I1 corruption in flight unnoticed (hash-and-compare not wired)",
          "the worker builds the relocation checker but never wraps its copy engine with it: a fill or moved "
          "entry corrupted while the copy flies goes unnoticed", "adapter",
          (_p(WC, "WorkerCore.__init__", "            engine = self.checker.wrap(self.copy_engine)\n", ""),)),
    Fault("adapter_own_clock_unfenced", "8 block freed before its fence (vLLM's deferred frees off)",
          "where vLLM does not defer its frees, the adapter's port frees its own blocks (sources, releases, a "
          "finished request's destinations) at once instead of at their fence", "adapter",
          (_p(PO, "VllmPort.free", "        elif fence <= self.clock.processed:\n", "        elif True:\n"),)),
    Fault("worker_window_through_table_group", "hybrid layout: a window read through the wrong group",
          "the worker's sliding-window layers take their blocks from the full-attention group's list, which "
          "eviction and relocation rearrange (vLLM's window group unused)", "adapter",
          (_p(WC, "WorkerCore._lists", "wblocks=list(d.block_ids[wg]) if wg is not None else None)",
              "wblocks=list(d.block_ids[g]) if wg is not None else None)"),
           _p(WC, "WorkerCore._lists", "            wids = list(nb[wg]) if nb and wg is not None else []\n",
              "            wids = list(nb[g]) if nb and wg is not None else []\n"))),
    Fault("worker_copy_writes_window", "I1/I2 a write onto another KV cache group's slot (hybrid layout)",
          "right after a copy is issued, one moved entry is also written onto another running request's newest "
          "sliding-window slot, which the token table does not map and the next step's windowed layers read",
          "adapter",
          (_p(WC, "WorkerCore.launch", "        now = self.copies.launch(plan)\n",
              "        now = self.copies.launch(plan)\n"
              "        for r, _pos, sl in self.window_reads():\n"
              "            if now is None and r != plan.req_id and len(sl) and len(plan.moves):\n"
              "                m = plan.moves[0]\n"
              "                self.kv.flat[:, :, int(sl[-1])] = self.kv.flat[:, :, int(m[1]) * self.S + int(m[2])]\n"
              "                break\n"),)),
    Fault("worker_emptied_word_false", "a release held back on the worker's false word (a lagging replica)",
          "the worker's table says of every eviction that it emptied no block, so the scheduler side's replica "
          "holds back reports whose evictions left a block with no live token (its release waits)", "adapter",
          (_p(MS, "LoggedTable.evict_one_each", "np.array(token_ids, dtype=np.int64), self.emptied_count != c))",
              "np.array(token_ids, dtype=np.int64), False))"),
           _p(MS, "LoggedTable.evict_tokens", "                         self.emptied_count != c))\n",
              "                         False))\n"))),
    # issue 40: windows no test drove (a block read by a step scheduled before its free; a check one hook late)
    Fault("adapter_orphan_frees_at_plan_fence", "8 block freed before the step that reads it (a request that left "
          "while its plan flew)",
          "an orphaned plan's blocks (fills and used destinations of one applied as its request stopped) go back at "
          "the plan's fence, not its request's: the next step, scheduled before the stop was processed, still "
          "reads them", "adapter",
          (_p(LC, "Lifecycle.end", "alive, gone = not plan.orphaned, max(plan.seq, plan.gone_fence)",
              "alive, gone = not plan.orphaned, plan.seq"),)),
    # issue 40 item 7: a block of a plan in flight handed to another holder while its copy flies
    Fault("adapter_orphan_fills_freed_at_finish", "8 a fill freed while its copy flies (a request that left mid-copy)",
          "when a request leaves while its plan flies, the plan's fills go back with the request's own blocks (at its "
          "list fence) instead of when the copy ends: the copy still writes them, the pool may hand them out",
          "adapter",
          (_p(LC, "Lifecycle.finish", "            p.gone_fence = int(fence)\n",
              "            p.gone_fence = int(fence)\n            self._free(list(p.fills), fence)\n"
              "            p.fills_freed = True\n"),
           _p(LC, "Lifecycle.end", "            keep = plan.fills + used\n",
              "            keep = ([] if getattr(plan, 'fills_freed', False) else plan.fills) + used\n"),
           _p(LC, "Lifecycle.end", "            back = plan.sources + plan.fills\n",
              "            back = plan.sources + ([] if getattr(plan, 'fills_freed', False) else plan.fills)\n"))),
    Fault("adapter_absorb_untouched", "runtime check one hook late (a landed plan's blocks)",
          "a plan's end (its fills and destinations now held for the request) is not reported to the runtime "
          "checks: a corruption of them is seen only at a later full scan", "adapter",
          (_p(PL, "PlanBook.absorb", "            self.checker.touch([plan.req_id])\n", ""),)),
    Fault("adapter_launch_untouched", "runtime check one hook late (a launch's null substitution)",
          "a plan's launch (its sources and fills null-substituted in the request's list) is not reported to the "
          "runtime checks: a corruption of that list is seen only at a later hook", "adapter",
          (_p(PL, "PlanBook.launch", "        self.checker.touch([r])\n", ""),)),
    Fault("adapter_release_untouched", "runtime check one hook late (a release's null substitution)",
          "a release of all-dead blocks is not reported to the runtime checks: a corruption of the request's list "
          "or held blocks is seen only at a later hook", "adapter",
          (_p(AD, "VTokenAdapter._release_empty", "                self.checker.touch([r])\n", ""),)),
    Fault("headroom_fresh_unrecorded", "runtime check one hook late (new headroom blocks)",
          "blocks entering the headroom are not recorded as new: the incremental check never looks at them, a "
          "corruption (a block vLLM still references) is seen only at the next full scan", "adapter",
          (_p(LC, "Lifecycle._to_headroom", "        self.fresh.update(ids)\n", ""),)),
]

# ---------------------------------------------------------------- vLLM's real engine (vtoken.vllm_engine)
ENGINE_FAULTS = [
    Fault("engine_copy_skipped", "I1 a copy skipped (one layer of vLLM's cache)",
          "the copy over vLLM's own K/V tensors writes every layer but the last: the moved tokens' last-layer "
          "K/V never arrive", "engine",
          (_p(EK, "_Layers.index_copy_", "        for li, r in enumerate(self.rows):\n",
              "        for li, r in enumerate(self.rows[:-1]):\n"),)),
    Fault("engine_row_repointed_early", "I3 a read before the copy landed (a block-table row repointed early)",
          "the worker points the step's reads at the destinations of copies still in flight (as a runner whose "
          "block-table row is repointed at launch would): attention reads slots the copy has not written yet",
          "engine",
          (_p(EW, "EngineSide.before", "        STEP.publish(self.runner, self.chunks)\n",
              "        S = self.core.S\n"
              "        for view, _h, plan, _left in list(self.core.copies.pending.values()):\n"
              "            ch = self.chunks.get(plan.req_id)\n"
              "            if ch is not None and len(view.moves):\n"
              "                rd = ch.read.clone()\n"
              "                for t, sb, so, db, do in view.moves.tolist():\n"
              "                    rd[rd == sb * S + so] = db * S + do\n"
              "                ch.read = rd\n"
              "        STEP.publish(self.runner, self.chunks)\n"),)),
    Fault("engine_stale_slot_read", "I2 a stale slot read (a key cache that misses relocations)",
          "the attention backend caches each request's key slots by request and length, so a step that reads as "
          "many tokens as an earlier one reads that step's slots: moved and evicted tokens read where they were",
          "engine",
          (_p(EA, "VTokenMetadataBuilder.build", "            rows.append((r, lo, hi, torch.cat([ch.read.cpu(), w])))\n",
              "            key = (r, len(ch.read))\n"
              "            stale = self.__dict__.setdefault('_cache', {}).get(key)\n"
              "            read = stale if stale is not None else ch.read.cpu()\n"
              "            self._cache[key] = read\n"
              "            rows.append((r, lo, hi, torch.cat([read, w])))\n"),)),
    Fault("engine_source_freed_early", "8 a source freed before its fence (vLLM's engine)",
          "the engine's scheduler hands the sources of every plan in flight back to vLLM's pool once the step "
          "that carries them is processed, without waiting for their copy's report", "engine",
          (_p(ES, "Scheduler.update_from_output",
              "        out = super().update_from_output(scheduler_output, model_runner_output)\n",
              "        out = super().update_from_output(scheduler_output, model_runner_output)\n"
              "        ad = self.vtoken_adapter\n"
              "        if ad is not None:\n"
              "            pool = self.kv_cache_manager.block_pool\n"
              "            for p in list(ad.plans.values()):\n"
              "                if not getattr(p, 'freed_early', False):\n"
              "                    pool.free_blocks([pool.blocks[b] for b in p.sources])\n"
              "                    p.freed_early = True\n"),)),
]
CATALOGUE += ENGINE_FAULTS

BY_NAME = {f.name: f for f in CATALOGUE}
