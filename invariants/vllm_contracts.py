"""Behavioural contracts of the vLLM surface the vtoken adapter relies on.

Each contract is one assumption the adapter makes about vLLM (written against vLLM 0.33.0),
checked against a real scheduler / block pool (``harness.VllmHarness``), not only by
name. ``run_contracts()`` runs them and never raises: a broken contract comes back as
``{"name", "passed": False, "detail"}`` whose detail names the assumption and where it
lives in vLLM (symbol and file), so an upgrade audit can tell what to re-check. Each
result dict has a ``violations`` view (a broken contract: one
:class:`~vtoken.invariants.violation.Violation`, invariant ``vllm_contract``, ``rule`` the
contract's name; a kept one: ``[]``), and so has ``run_contracts``' list (all of them).

What this cannot see: an assumption no contract states (each is one the adapter names);
vLLM behaviour outside the small CPU scheduler and pool the harness builds (GPU workers,
other configurations); the adapter's own correctness (the adapter machine and the snapshot
checkers check that).

    from vtoken.invariants.vllm_contracts import run_contracts
    for r in run_contracts():
        print(r["name"], r["passed"], r["detail"])

Files named in ``where`` are relative to the installed ``vllm`` package.

Owns: nothing beyond the vLLM schedulers and pools each contract builds and drops.
May call: vllm (scheduler, block pool, KV cache manager), vtoken.vllm_adapter.harness, invariants.violation,
inspect.
Costs: one small real scheduler or pool per contract; ``run_contracts`` runs them all once.
"""

from __future__ import annotations

import dataclasses
import inspect
import traceback
from dataclasses import dataclass
from typing import Callable

from vtoken.vllm_adapter import harness as _harness
from vtoken.vllm_adapter import SUPPORTED_VLLM
from vtoken.vllm_adapter.harness import VLLM_VERSION, VllmHarness

from .violation import Found, Violation

BLOCK_POOL = "vllm.v1.core.block_pool.BlockPool (vllm/v1/core/block_pool.py)"
KV_BLOCK = "vllm.v1.core.kv_cache_utils.KVCacheBlock (vllm/v1/core/kv_cache_utils.py)"
KV_MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager (vllm/v1/core/kv_cache_manager.py)"
SINGLE_MGR = (
    "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager "
    "(vllm/v1/core/single_type_kv_cache_manager.py)"
)
SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler (vllm/v1/core/sched/scheduler.py)"
SCHED_OUT = "vllm.v1.core.sched.output (vllm/v1/core/sched/output.py)"


class ContractBroken(AssertionError):
    """Raised inside a contract check when vLLM does not behave as assumed."""


def expect(cond: object, message: str) -> None:
    if not cond:
        raise ContractBroken(message)


@dataclass(frozen=True)
class Contract:
    """One assumption: ``where`` it lives in vLLM, and ``relied_on_by``: the adapter
    module(s) that break when it does (what an upgrade has to re-read)."""
    name: str
    assumption: str
    where: str
    check: Callable[[], str]  # returns what was measured; raises when broken
    relied_on_by: str = ""


CONTRACTS: list[Contract] = []


def contract(name: str, assumption: str, where: str, relied_on_by: str):
    """Register a check; ``relied_on_by`` names the adapter module(s) relying on it (required:
    a contract nobody relies on is not one)."""
    if not relied_on_by:
        raise ValueError(f"contract {name!r} names no adapter module relying on it")

    def register(fn: Callable[[], str]) -> Callable[[], str]:
        CONTRACTS.append(Contract(name, assumption, where, fn, relied_on_by))
        return fn

    return register


def contract_names() -> list[str]:
    return [c.name for c in CONTRACTS]


def _fail_detail(c: Contract, exc: BaseException) -> str:
    if isinstance(exc, ContractBroken):
        why = str(exc)
    else:
        tb = traceback.extract_tb(exc.__traceback__)
        at = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        why = f"{type(exc).__name__}: {exc}{at}"
    return f"assumption broken: {c.assumption} [vLLM: {c.where}] [relied on by: {c.relied_on_by}] -- {why}"


def _result(result: dict) -> Found:
    """``result`` with its ``violations`` view: none when it passed, else the broken contract."""
    broken = [] if result["passed"] else [Violation("vllm_contract", result["detail"], dict(result), result["name"])]
    return Found(result, broken)


class ContractResults(list):
    """``run_contracts``' list of result dicts, with ``violations``: every broken contract's."""

    @property
    def violations(self) -> list[Violation]:
        return [v for r in self for v in r.violations]


def run_contract(c: Contract | str) -> dict:
    """Run one contract; never raises. The result dict has a ``violations`` view."""
    return _result(_run_contract(c))


def _run_contract(c: Contract | str) -> dict:
    if isinstance(c, str):
        found = [x for x in CONTRACTS if x.name == c]
        if not found:
            return {"name": c, "passed": False, "detail": f"no contract named {c!r}"}
        c = found[0]
    result = {"name": c.name, "assumption": c.assumption, "where": c.where, "relied_on_by": c.relied_on_by}
    version = _harness.vllm_version()
    if version is None:
        result.update(
            passed=False,
            detail=f"vLLM not installed: run scripts/install_vllm.sh "
            f"(contract {c.name}: {c.assumption})",
        )
        return result
    try:
        measured = c.check()
    except BaseException as exc:  # noqa: BLE001 - the runner must never raise
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        result.update(passed=False, detail=_fail_detail(c, exc))
    else:
        result.update(passed=True, detail=measured or "ok")
    return result


def run_contracts(names: list[str] | None = None) -> list[dict]:
    """Run every contract (or those named); returns dicts with name, passed, detail
    (plus assumption and where), as a list with a ``violations`` view. Never raises."""
    selected = CONTRACTS if names is None else [c for c in CONTRACTS if c.name in names]
    out = ContractResults(run_contract(c) for c in selected)
    if names is not None:
        known = {c.name for c in CONTRACTS}
        out += [run_contract(n) for n in names if n not in known]
    return out


# ---------------------------------------------------------------------- helpers
def _missing_attrs(obj: object, names: list[str], label: str) -> list[str]:
    return [f"{label}.{n}" for n in names if not hasattr(obj, n)]


def _missing_callables(obj: object, names: list[str], label: str) -> list[str]:
    out = []
    for n in names:
        if not callable(getattr(obj, n, None)):
            out.append(f"{label}.{n}()")
    return out


def _field_names(cls: type) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(cls, "__annotations__", {}))


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def _prompt(seed: int, n: int) -> list[int]:
    return [1000 * (seed + 1) + i for i in range(n)]


def _scheduled_block_ids(so) -> set[int]:
    ids: set[int] = set()
    for d in so.scheduled_new_reqs:
        for group in d.block_ids:
            ids.update(group)
    for group_tuple in so.scheduled_cached_reqs.new_block_ids:
        if group_tuple:
            for group in group_tuple:
                ids.update(group)
    return ids


def _decode_until(h: VllmHarness, req_ids: list[str], max_steps: int = 200) -> None:
    """Step until every request in ``req_ids`` has finished its prefill."""
    for _ in range(max_steps):
        reqs = [h.request(r) for r in req_ids]
        if all(r is not None and r.num_output_tokens > 0 for r in reqs):
            return
        h.step()
    raise ContractBroken(f"requests {req_ids} never reached decode in {max_steps} steps")


# -------------------------------------------------------------------- contracts
@contract(
    "vllm_version",
    f"vLLM is one of {', '.join(SUPPORTED_VLLM)}, the versions these contracts were audited on",
    "vllm.__version__ (vllm/version.py)",
    relied_on_by="vtoken/vllm_adapter/assumptions.py (check_supported_vllm)"
)
def _c_version() -> str:
    import vllm

    expect(vllm.__version__ in SUPPORTED_VLLM, f"found vllm {vllm.__version__}")
    return f"vllm {vllm.__version__}"


@contract(
    "symbols_block_pool",
    "BlockPool has get_new_blocks, free_blocks, touch, evict_blocks, is_block_writable, "
    "get_num_free_blocks and a null_block",
    BLOCK_POOL,
    relied_on_by="vtoken/vllm_adapter/port.py, vtoken/vllm_adapter/headroom.py"
)
def _c_symbols_block_pool() -> str:
    from vllm.v1.core.block_pool import BlockPool

    methods = ["get_new_blocks", "free_blocks", "touch", "evict_blocks",
               "is_block_writable", "get_num_free_blocks"]
    missing = _missing_callables(BlockPool, methods, "BlockPool")
    h = VllmHarness(num_blocks=8)
    missing += _missing_attrs(h.pool, ["null_block"], "BlockPool(instance)")
    expect(not missing, f"missing: {', '.join(missing)}")
    return "BlockPool." + "/".join(methods + ["null_block"])


@contract(
    "symbols_kv_cache_block",
    "KVCacheBlock exposes block_id, ref_cnt, block_hash, is_null",
    KV_BLOCK,
    relied_on_by="vtoken/vllm_adapter/port.py, vtoken/vllm_adapter/prefix_hash.py"
)
def _c_symbols_kv_block() -> str:
    h = VllmHarness(num_blocks=8)
    blk = h.pool.get_new_blocks(1)[0]
    missing = _missing_attrs(blk, ["block_id", "ref_cnt", "block_hash", "is_null"],
                             "KVCacheBlock")
    expect(not missing, f"missing: {', '.join(missing)}")
    expect(isinstance(blk.block_id, int) and isinstance(blk.ref_cnt, int),
           f"block_id/ref_cnt not ints: {blk.block_id!r}/{blk.ref_cnt!r}")
    return "KVCacheBlock.block_id/ref_cnt/block_hash/is_null"


@contract(
    "symbols_kv_cache_manager",
    "KVCacheManager has allocate_slots (with full_sequence_must_fit, reserved_blocks), "
    "free, get_blocks, evict_blocks, block_pool, coordinator.single_type_managers",
    KV_MANAGER,
    relied_on_by="vtoken/vllm_adapter/adapter.py, vtoken/vllm_adapter/harness.py"
)
def _c_symbols_kv_manager() -> str:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    methods = ["allocate_slots", "free", "get_blocks", "evict_blocks"]
    missing = _missing_callables(KVCacheManager, methods, "KVCacheManager")
    if not missing:
        params = set(inspect.signature(KVCacheManager.allocate_slots).parameters)
        for p in ["request", "num_new_tokens", "num_new_computed_tokens",
                  "new_computed_blocks", "num_lookahead_tokens",
                  "full_sequence_must_fit", "reserved_blocks"]:
            if p not in params:
                missing.append(f"KVCacheManager.allocate_slots(param {p})")
    h = VllmHarness(num_blocks=8)
    kvm = h.kv_cache_manager
    missing += _missing_attrs(kvm, ["block_pool", "coordinator"], "KVCacheManager")
    if hasattr(kvm, "coordinator"):
        missing += _missing_attrs(kvm.coordinator, ["single_type_managers"],
                                  "KVCacheCoordinator")
    expect(not missing, f"missing: {', '.join(missing)}")
    expect(kvm.block_pool is h.scheduler.kv_cache_manager.coordinator.block_pool,
           "KVCacheManager.block_pool is not the coordinator's pool")
    return "KVCacheManager." + "/".join(methods + ["block_pool", "coordinator"])


@contract(
    "symbols_single_type_manager",
    "SingleTypeKVCacheManager has req_to_blocks, num_cached_block, cache_blocks, "
    "remove_skipped_blocks; KVCacheManager.get_blocks returns the live req_to_blocks list",
    SINGLE_MGR,
    relied_on_by="vtoken/vllm_adapter/mirror.py, vtoken/vllm_adapter/harness.py"
)
def _c_symbols_single_mgr() -> str:
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    missing = _missing_callables(SingleTypeKVCacheManager,
                                 ["cache_blocks", "remove_skipped_blocks"],
                                 "SingleTypeKVCacheManager")
    h = VllmHarness(num_blocks=16, block_size=4)
    mgr = h.manager
    expect(isinstance(mgr, SingleTypeKVCacheManager),
           f"coordinator.single_type_managers[0] is {type(mgr).__name__}")
    missing += _missing_attrs(mgr, ["req_to_blocks", "num_cached_block"],
                              "SingleTypeKVCacheManager")
    expect(not missing, f"missing: {', '.join(missing)}")
    h.add_request("A", _prompt(0, 10), max_tokens=4)
    h.step()
    live = mgr.req_to_blocks["A"]
    got = h.kv_cache_manager.get_blocks("A").blocks[0]
    expect(got is live or list(got) == list(live),
           "KVCacheManager.get_blocks(req).blocks[0] differs from req_to_blocks[req]")
    return (f"{type(mgr).__name__}: req_to_blocks/num_cached_block/cache_blocks/"
            f"remove_skipped_blocks; get_blocks is the live list: {got is live}")


@contract(
    "symbols_scheduler",
    "Scheduler has schedule, update_from_output, add_request, requests, kv_cache_manager; "
    "SchedulerConfig.scheduler_cls lets a subclass be plugged in",
    SCHEDULER + "; vllm.config.scheduler.SchedulerConfig (vllm/config/scheduler.py)",
    relied_on_by="vtoken/vllm_adapter/hooks.py"
)
def _c_symbols_scheduler() -> str:
    from vllm.config import SchedulerConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    missing = _missing_callables(Scheduler, ["schedule", "update_from_output",
                                             "add_request", "has_requests",
                                             "finish_requests"], "Scheduler")
    h = VllmHarness(num_blocks=8)
    missing += _missing_attrs(h.scheduler, ["requests", "kv_cache_manager"], "Scheduler")
    if "scheduler_cls" not in _field_names(SchedulerConfig):
        missing.append("SchedulerConfig.scheduler_cls")
    if "async_scheduling" not in _field_names(SchedulerConfig):
        missing.append("SchedulerConfig.async_scheduling")
    expect(not missing, f"missing: {', '.join(missing)}")
    expect(issubclass(AsyncScheduler, Scheduler), "AsyncScheduler is not a Scheduler")
    return "Scheduler.schedule/update_from_output/add_request; SchedulerConfig.scheduler_cls"


@contract(
    "symbols_scheduler_output",
    "SchedulerOutput carries scheduled_new_reqs (NewRequestData.block_ids), "
    "scheduled_cached_reqs (CachedRequestData.req_ids/new_block_ids/resumed_req_ids), "
    "num_scheduled_tokens, preempted_req_ids, finished_req_ids, kv_cache_block_copies",
    SCHED_OUT + "; vllm.v1.core.kv_cache_utils.KVCacheBlockCopy",
    relied_on_by="vtoken/vllm_adapter/mirror.py, vtoken/vllm_adapter/worker_core.py"
)
def _c_symbols_sched_out() -> str:
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    missing = []
    want = {
        SchedulerOutput: ["scheduled_new_reqs", "scheduled_cached_reqs",
                          "num_scheduled_tokens", "total_num_scheduled_tokens",
                          "preempted_req_ids", "finished_req_ids",
                          "kv_cache_block_copies"],
        CachedRequestData: ["req_ids", "new_block_ids", "resumed_req_ids",
                            "num_computed_tokens"],
        NewRequestData: ["req_id", "block_ids"],
    }
    for cls, fields in want.items():
        have = _field_names(cls)
        missing += [f"{cls.__name__}.{f}" for f in fields if f not in have]
    if tuple(getattr(KVCacheBlockCopy, "_fields", ())) != ("src_block_id", "dst_block_id"):
        missing.append("KVCacheBlockCopy(src_block_id, dst_block_id)")
    expect(not missing, f"missing: {', '.join(missing)}")
    return "SchedulerOutput/CachedRequestData/NewRequestData fields; KVCacheBlockCopy"


@contract(
    "null_block",
    "block 0 is BlockPool.null_block (is_null), never handed out by get_new_blocks; the "
    "pool starts with N-1 free blocks; free_blocks ignores the null block",
    BLOCK_POOL + " __init__/get_new_blocks/free_blocks",
    relied_on_by="vtoken/vllm_adapter/mirror.py"
)
def _c_null_block() -> str:
    n = 12
    h = VllmHarness(num_blocks=n, block_size=4)
    pool = h.pool
    null = pool.null_block
    expect(null.block_id == 0 and null.is_null, f"null_block is block {null.block_id}, "
           f"is_null={null.is_null}")
    expect(pool.get_num_free_blocks() == n - 1,
           f"initial free count {pool.get_num_free_blocks()} != N-1={n - 1}")
    got = pool.get_new_blocks(n - 1)
    expect(0 not in _ids(got), f"get_new_blocks handed out block 0: {_ids(got)}")
    expect(all(not b.is_null for b in got), "a handed-out block has is_null set")
    pool.free_blocks(got)
    before = pool.get_num_free_blocks()
    pool.free_blocks([null])
    expect(pool.get_num_free_blocks() == before,
           f"free_blocks([null_block]) changed the free count {before} -> "
           f"{pool.get_num_free_blocks()}")
    return f"null_block id 0; {n - 1} free of {n}; free_blocks skips null"


@contract(
    "get_new_blocks_order",
    "get_new_blocks pops from the free-queue head (a fresh pool hands out 1,2,3,...), "
    "gives ref_cnt 1 and no hash, and raises ValueError (taking nothing) when short",
    BLOCK_POOL + ".get_new_blocks",
    relied_on_by="vtoken/vllm_adapter/headroom.py, vtoken/vllm_adapter/port.py"
)
def _c_get_new_blocks() -> str:
    n = 10
    h = VllmHarness(num_blocks=n, block_size=4)
    pool = h.pool
    first = pool.get_new_blocks(3)
    expect(_ids(first) == [1, 2, 3], f"fresh pool handed out {_ids(first)}, not [1, 2, 3]")
    nxt = pool.get_new_blocks(2)
    expect(_ids(nxt) == [4, 5], f"then handed out {_ids(nxt)}, not [4, 5]")
    expect(all(b.ref_cnt == 1 and b.block_hash is None for b in first + nxt),
           f"new blocks ref_cnt/hash: {[(b.ref_cnt, b.block_hash) for b in first + nxt]}")
    free = pool.get_num_free_blocks()
    try:
        pool.get_new_blocks(free + 1)
    except ValueError:
        pass
    else:
        raise ContractBroken(f"get_new_blocks({free + 1}) with {free} free did not raise "
                             "ValueError")
    expect(pool.get_num_free_blocks() == free,
           f"failed get_new_blocks changed the free count {free} -> "
           f"{pool.get_num_free_blocks()}")
    return "fresh order 1..; ValueError when short, nothing taken"


@contract(
    "free_blocks_unhashed",
    "free_blocks decrements ref_cnt; a block reaching 0 returns to the free queue; "
    "unhashed blocks go to the queue head in the order given (the next get_new_blocks "
    "returns them first, in that order)",
    BLOCK_POOL + ".free_blocks / FreeKVCacheBlockQueue.prepend_n "
    "(vllm/v1/core/kv_cache_utils.py)",
    relied_on_by="vtoken/vllm_adapter/port.py"
)
def _c_free_unhashed() -> str:
    h = VllmHarness(num_blocks=12, block_size=4)
    pool = h.pool
    a, b, c, d = pool.get_new_blocks(4)
    pool.touch([a])
    expect(a.ref_cnt == 2, f"touch did not raise ref_cnt to 2 ({a.ref_cnt})")
    free0 = pool.get_num_free_blocks()
    pool.free_blocks([a, b, c])
    expect((a.ref_cnt, b.ref_cnt, c.ref_cnt) == (1, 0, 0),
           f"ref_cnt after free: a={a.ref_cnt} b={b.ref_cnt} c={c.ref_cnt}, want 1,0,0")
    expect(pool.get_num_free_blocks() == free0 + 2,
           f"free count {free0} -> {pool.get_num_free_blocks()}, want +2")
    again = pool.get_new_blocks(2)
    expect(_ids(again) == [b.block_id, c.block_id],
           f"after free_blocks([{a.block_id},{b.block_id},{c.block_id}]) (a still held) "
           f"get_new_blocks(2) gave {_ids(again)}, want [{b.block_id}, {c.block_id}]")
    pool.free_blocks([a, d] + again)
    expect(pool.get_num_free_blocks() == 11, f"free count {pool.get_num_free_blocks()} != 11")
    return "ref_cnt decremented; freed unhashed blocks reused first, in the given order"


@contract(
    "free_blocks_hashed",
    "with prefix caching, a finished request's full blocks keep their hash and go to the "
    "free-queue tail (reused last, LRU), its unhashed tail block to the head; the hash is "
    "dropped only when get_new_blocks hands the block out again",
    BLOCK_POOL + ".free_blocks/get_new_blocks; SingleTypeKVCacheManager.free "
    "(frees a request's blocks in reverse order)",
    relied_on_by="vtoken/vllm_adapter/prefix_hash.py"
)
def _c_free_hashed() -> str:
    n, s = 16, 4
    h = VllmHarness(num_blocks=n, block_size=s, prefix_caching=True)
    h.add_request("A", _prompt(0, 10), max_tokens=2)
    h.step()  # prefill of 10 tokens: 2 full blocks + 1 partial
    blocks = list(h.blocks("A"))
    expect(len(blocks) == 3, f"request A holds {len(blocks)} blocks, want 3")
    full, tail = blocks[:2], blocks[2]
    expect(all(b.block_hash is not None for b in full) and tail.block_hash is None,
           f"hashes: {[b.block_hash is not None for b in blocks]}, want [True, True, False]")
    h.drain()
    expect(h.request("A") is None and "A" not in h.req_to_blocks, "A not finished/freed")
    expect(h.free_count() == n - 1, f"free count {h.free_count()} != {n - 1}")
    expect(all(b.ref_cnt == 0 for b in blocks), "a finished request's block kept a ref")
    expect(all(b.block_hash is not None for b in full),
           "a freed full block lost its hash (prefix cache entry) on free")
    taken = h.pool.get_new_blocks(n - 1)
    order = _ids(taken)
    want_tail = [full[1].block_id, full[0].block_id]
    expect(order[0] == tail.block_id,
           f"unhashed tail block {tail.block_id} not reused first: {order}")
    expect(order[-2:] == want_tail,
           f"hashed blocks not reused last (reverse order {want_tail}): {order}")
    expect(all(b.block_hash is None for b in taken),
           "get_new_blocks handed out a block that still has a hash")
    return f"reuse order after finish: {order} (tail first, hashed last, hash dropped)"


@contract(
    "shared_prefix_refcount",
    "with prefix caching, requests sharing a full-block prefix share the same block "
    "objects with ref_cnt == number of holders, hashed, and counted in num_cached_block; "
    "without prefix caching nothing is shared or hashed",
    BLOCK_POOL + ".touch/cache_full_blocks; SingleTypeKVCacheManager.num_cached_block",
    relied_on_by="vtoken/vllm_adapter/plans.py, vtoken/vllm_adapter/prefix_hash.py"
)
def _c_shared_prefix() -> str:
    s = 4
    measured = []
    for caching in (True, False):
        h = VllmHarness(num_blocks=32, block_size=s, prefix_caching=caching)
        shared = _prompt(0, 3 * s)
        h.add_request("A", shared + [1], max_tokens=4)  # 14 tokens after 2 steps
        h.step()
        h.add_request("B", shared + [2] * 5, max_tokens=4)
        h.step()
        a, b = h.blocks("A"), h.blocks("B")
        if caching:
            for i in range(3):
                expect(a[i] is b[i], f"prefix block {i}: A has {a[i].block_id}, "
                       f"B has {b[i].block_id}")
                expect(a[i].ref_cnt == 2, f"shared block {a[i].block_id} ref_cnt "
                       f"{a[i].ref_cnt} != 2")
                expect(a[i].block_hash is not None, f"shared block {a[i].block_id} unhashed")
            expect(b[3].ref_cnt == 1 and a[3] is not b[3],
                   "divergent block shared or ref_cnt != 1")
            expect(h.num_cached_block.get("A") == 3 and h.num_cached_block.get("B") == 4,
                   f"num_cached_block A={h.num_cached_block.get('A')} "
                   f"B={h.num_cached_block.get('B')}, want 3 and 4")
            measured.append(f"caching: shared {_ids(a[:3])} rc2")
        else:
            expect(not set(_ids(a)) & set(_ids(b)),
                   f"blocks shared without prefix caching: {_ids(a)} / {_ids(b)}")
            expect(all(x.ref_cnt == 1 and x.block_hash is None for x in a + b),
                   "a block is hashed or shared without prefix caching")
            measured.append("no caching: disjoint, unhashed")
        h.drain()
        expect(h.free_count() == 31, f"free count after drain {h.free_count()} != 31")
    return "; ".join(measured)


@contract(
    "writability",
    "is_block_writable(b) == not null and ref_cnt == 1 and unhashed: null, shared and "
    "hashed blocks are not writable; evict_blocks drops the hash and makes a private "
    "full block writable; a private partial tail is writable (full attention has no "
    "partial-block hashing)",
    BLOCK_POOL + ".is_block_writable/evict_blocks; KVCacheManager.evict_blocks; "
    "KVCacheCoordinator.enable_partial_hash_hits (vllm/v1/core/kv_cache_coordinator.py)",
    relied_on_by="vtoken/vllm_adapter/prefix_hash.py"
)
def _c_writability() -> str:
    s = 4
    h = VllmHarness(num_blocks=32, block_size=s, prefix_caching=True)
    pool, kvm = h.pool, h.kv_cache_manager
    expect(not getattr(kvm.coordinator, "enable_partial_hash_hits", False),
           "partial-block hashing is on for a full-attention model")
    shared = _prompt(0, 2 * s)
    h.add_request("A", shared + _prompt(5, 2 * s + 2), max_tokens=8)
    h.step()
    h.add_request("B", shared + [9] * 3, max_tokens=8)
    h.step()
    a = h.blocks("A")
    expect(not pool.is_block_writable(pool.null_block), "null_block is writable")
    expect(a[0].ref_cnt == 2 and not pool.is_block_writable(a[0]),
           f"shared block {a[0].block_id} (rc {a[0].ref_cnt}) is writable")
    private_full = a[2]
    expect(private_full.ref_cnt == 1 and private_full.block_hash is not None,
           f"A[2] rc={private_full.ref_cnt} hashed={private_full.block_hash is not None}")
    expect(not pool.is_block_writable(private_full),
           "a hashed private full block is writable")
    tail = a[-1]
    expect(tail.block_hash is None and pool.is_block_writable(tail),
           f"private partial tail {tail.block_id} not writable (hash {tail.block_hash})")
    kvm.evict_blocks({private_full.block_id})
    expect(private_full.block_hash is None, "evict_blocks did not drop the hash")
    expect(pool.is_block_writable(private_full), "evicted private block not writable")
    expect(private_full.ref_cnt == 1 and private_full in h.blocks("A"),
           "evict_blocks changed the holder or ref_cnt of a held block")
    kvm.evict_blocks({a[0].block_id})
    expect(not pool.is_block_writable(a[0]), "evicted but shared block became writable")
    fresh = pool.get_new_blocks(1)[0]
    expect(pool.is_block_writable(fresh), "a fresh get_new_blocks block is not writable")
    pool.free_blocks([fresh])
    h.drain()
    expect(h.free_count() == 31, f"free count after drain {h.free_count()} != 31")
    return "null/shared/hashed not writable; evict -> writable; tail and fresh writable"


@contract(
    "reservation",
    "blocks taken with BlockPool.get_new_blocks and held outside any request are never "
    "handed to allocate_slots: under memory pressure the scheduler preempts instead",
    KV_MANAGER + ".allocate_slots; " + BLOCK_POOL + ".get_new_blocks",
    relied_on_by="vtoken/vllm_adapter/headroom.py"
)
def _c_reservation() -> str:
    n, s, k = 20, 4, 6
    h = VllmHarness(num_blocks=n, block_size=s, prefix_caching=True,
                    max_num_batched_tokens=64, max_model_len=128)
    held = h.pool.get_new_blocks(k)
    held_ids = set(_ids(held))
    for i in range(4):
        h.add_request(f"R{i}", _prompt(i, 10), max_tokens=14)
    min_free, preempted = n, 0
    for _ in range(500):
        if not h.has_requests():
            break
        so = h.step()
        preempted += len(so.preempted_req_ids or ())
        leak = _scheduled_block_ids(so) & held_ids
        expect(not leak, f"held blocks {sorted(leak)} appear in a SchedulerOutput")
        for r, blocks in h.req_to_blocks.items():
            leak = set(_ids(blocks)) & held_ids
            expect(not leak, f"held blocks {sorted(leak)} allocated to request {r}")
        min_free = min(min_free, h.free_count())
    expect(not h.has_requests(), "workload did not finish")
    expect(all(b.ref_cnt == 1 and b.block_hash is None for b in held),
           "a held block changed ref_cnt or got a hash")
    expect(h.free_count() == n - 1 - k, f"free {h.free_count()} != N-1-k={n - 1 - k}")
    h.pool.free_blocks(held)
    expect(h.free_count() == n - 1, f"free {h.free_count()} != N-1 after releasing")
    expect(min_free == 0 or preempted > 0, f"no pressure reached (min free {min_free})")
    return f"{k} held blocks never allocated; min free {min_free}, {preempted} preemptions"


def _null_sub_setup(caching: bool):
    s = 4
    h = VllmHarness(num_blocks=48, block_size=s, prefix_caching=caching)
    # X (edited) and Y (control) have the same length, different tokens.
    h.add_request("X", _prompt(1, 3 * s + 1), max_tokens=12)
    h.add_request("Y", _prompt(2, 3 * s + 1), max_tokens=12)
    _decode_until(h, ["X", "Y"])
    return h


@contract(
    "null_substitution",
    "replacing a req_to_blocks entry by null_block (and freeing the old block) keeps the "
    "list length: the scheduler keeps growing it exactly like an unedited request, never "
    "re-fills the null slot, and finish frees everything (null is skipped)",
    SINGLE_MGR + ".req_to_blocks/allocate_new_blocks/_remove_blocks_in_range "
    "(the SlidingWindowManager idiom)",
    relied_on_by="vtoken/vllm_adapter/mirror.py"
)
def _c_null_sub() -> str:
    h = _null_sub_setup(caching=True)
    x = h.req_to_blocks["X"]
    old = x[1]
    x[1] = h.pool.null_block
    h.pool.free_blocks([old])
    grew_x = grew_y = 0
    while h.request("X") is not None and h.request("Y") is not None:
        so = h.step()
        c = so.scheduled_cached_reqs
        new = {r: (nb[0] if nb else []) for r, nb in zip(c.req_ids, c.new_block_ids)}
        grew_x += len(new.get("X", []))
        grew_y += len(new.get("Y", []))
        if h.request("X") is None or h.request("Y") is None:
            break
        bx, by = h.blocks("X"), h.blocks("Y")
        expect(len(bx) == len(by), f"edited list length {len(bx)} != control {len(by)}")
        expect(bx[1].is_null, f"null slot re-filled with block {bx[1].block_id}")
    expect(grew_x == grew_y, f"edited request got {grew_x} new blocks, control {grew_y}")
    h.drain()
    expect(h.free_count() == 47, f"free count after drain {h.free_count()} != 47")
    return f"length kept, null kept, {grew_x} normal growth blocks, all freed"


@contract(
    "pop_regrows",
    "shrinking a req_to_blocks list (pop) is NOT safe: the allocator sizes the list by "
    "length, so the next step appends a block out of position (this is why the adapter "
    "substitutes null and never shrinks)",
    SINGLE_MGR + ".allocate_new_blocks (num_required_blocks - len(req_blocks))",
    relied_on_by="vtoken/vllm_adapter/mirror.py"
)
def _c_pop_regrows() -> str:
    h = _null_sub_setup(caching=False)
    x = h.req_to_blocks["X"]
    before = _ids(x)
    popped = x.pop(1)
    h.pool.free_blocks([popped])
    so = h.step()
    c = so.scheduled_cached_reqs
    new = {r: (nb[0] if nb else []) for r, nb in zip(c.req_ids, c.new_block_ids)}
    after = h.block_ids("X")
    expect(len(new.get("X", [])) > len(new.get("Y", [])),
           f"no re-growth after pop: X got {new.get('X')}, control Y got {new.get('Y')}")
    expect(len(after) == len(h.blocks("Y")),
           f"after re-growth X has {len(after)} blocks, control {len(h.blocks('Y'))}")
    h.drain()
    expect(h.free_count() == 47, f"free count after drain {h.free_count()} != 47")
    return f"X {before} -> pop [1] -> {after} (re-grown at the end)"


@contract(
    "new_block_ids_append_only",
    "the worker's view of each request's block table, rebuilt from SchedulerOutputs "
    "(scheduled_new_reqs.block_ids, then CachedRequestData.new_block_ids appended, "
    "replaced for resumed_req_ids), equals req_to_blocks at every step, preemptions "
    "included",
    SCHED_OUT + " NewRequestData/CachedRequestData; Scheduler._make_cached_request_data",
    relied_on_by="vtoken/vllm_adapter/mirror.py, vtoken/vllm_adapter/worker_core.py"
)
def _c_append_only() -> str:
    s = 4
    h = VllmHarness(num_blocks=12, block_size=s, prefix_caching=True,
                    max_num_batched_tokens=64, max_model_len=64)
    for i in range(3):
        h.add_request(f"R{i}", _prompt(i, 10), max_tokens=20)
    mirror: dict[str, list[int]] = {}
    resumed = preempted = steps = 0
    while h.has_requests() and steps < 500:
        so = h.schedule()
        steps += 1
        preempted += len(so.preempted_req_ids or ())
        for d in so.scheduled_new_reqs:
            mirror[d.req_id] = list(d.block_ids[0])
        c = so.scheduled_cached_reqs
        for r, nb in zip(c.req_ids, c.new_block_ids):
            ids = list(nb[0]) if nb else []
            if r in c.resumed_req_ids:
                resumed += 1
                mirror[r] = ids
            else:
                expect(r in mirror, f"cached request {r} never sent as new")
                mirror[r] = mirror[r] + ids
        for r in so.num_scheduled_tokens:
            expect(mirror[r] == h.block_ids(r),
                   f"step {steps}: worker view of {r} {mirror[r]} != "
                   f"req_to_blocks {h.block_ids(r)}")
        h.finish(so)
    expect(not h.has_requests(), "workload did not finish")
    expect(preempted > 0, "workload did not preempt (test too weak)")
    return f"{steps} steps, {preempted} preemptions, {resumed} resumed rows replaced"


@contract(
    "preempt_and_finish_free_all",
    "preemption returns all of a request's blocks at once (its req_to_blocks entry "
    "disappears) and it is recomputed from token 0; finishing returns all blocks; after "
    "draining, the free count is N-1 and no block keeps a reference",
    SCHEDULER + "._preempt_request/_free_request_blocks; " + KV_MANAGER + ".free",
    relied_on_by="vtoken/vllm_adapter/mirror.py, vtoken/vllm_adapter/adapter.py"
)
def _c_preempt_free() -> str:
    n, s = 12, 4
    out = []
    for caching in (True, False):
        h = VllmHarness(num_blocks=n, block_size=s, prefix_caching=caching,
                        max_num_batched_tokens=64, max_model_len=64)
        for i in range(3):
            h.add_request(f"R{i}", _prompt(i, 10), max_tokens=20)
        preempted = 0
        for _ in range(500):
            if not h.has_requests():
                break
            so = h.step()
            for r in so.preempted_req_ids or ():
                preempted += 1
                req = h.request(r)
                if req is not None and r not in so.num_scheduled_tokens:
                    expect(not h.req_to_blocks.get(r),
                           f"preempted {r} still holds {h.block_ids(r)}")
                    expect(req.num_computed_tokens == 0,
                           f"preempted {r} keeps {req.num_computed_tokens} computed tokens")
        expect(not h.has_requests(), "workload did not finish")
        expect(preempted > 0, "no preemption happened (test too weak)")
        expect(h.free_count() == n - 1, f"free count {h.free_count()} != N-1={n - 1}")
        held = [b.block_id for b in h.pool.blocks if not b.is_null and b.ref_cnt != 0]
        expect(not held, f"blocks still referenced after drain: {held}")
        expect(not h.req_to_blocks or not any(h.req_to_blocks.values()),
               f"req_to_blocks not empty: {dict(h.req_to_blocks)}")
        out.append(f"caching={caching}: {preempted} preemptions, all freed")
    return "; ".join(out)


@contract(
    "async_two_steps_in_flight",
    "with async scheduling (AsyncScheduler) a second step is scheduled before the first "
    "step's output is processed; outputs are applied in FIFO order and the pool drains "
    "to N-1",
    "vllm.v1.core.sched.async_scheduler.AsyncScheduler "
    "(vllm/v1/core/sched/async_scheduler.py)",
    relied_on_by="vtoken/vllm_adapter/fence.py"
)
def _c_async() -> str:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    n, s = 32, 4
    h = VllmHarness(num_blocks=n, block_size=s, async_scheduling=True)
    expect(isinstance(h.scheduler, AsyncScheduler), "harness did not build AsyncScheduler")
    h.add_request("A", _prompt(0, 9), max_tokens=6)
    s1 = h.schedule()
    s2 = h.schedule()
    expect(s1.num_scheduled_tokens.get("A") == 9 and s2.num_scheduled_tokens.get("A") == 1,
           f"step1 {s1.num_scheduled_tokens}, step2 {s2.num_scheduled_tokens}: "
           "no decode scheduled ahead of the prefill's output")
    h.finish(s1)
    h.finish(s2)
    h.drain()
    expect(h.free_count() == n - 1, f"free count {h.free_count()} != {n - 1}")
    return "decode step scheduled while the prefill step was in flight"


@contract(
    "fence_step_seq",
    "Scheduler.sched_step_seq counts non-empty scheduled steps (the step's seq is its "
    "value after schedule()), processed_step_seq counts their outputs in "
    "update_from_output (FIFO), and deferred_frees entries (fence_seq, blocks) return to "
    "the pool exactly when processed_step_seq >= fence_seq; the counters only run when "
    "defer_block_free is True (False by default, set by vLLM only for a KV-consumer "
    "connector with overlapping batches)",
    SCHEDULER + ".sched_step_seq/processed_step_seq/deferred_frees/defer_block_free/"
    "_drain_deferred_frees/_free_cow_retained_blocks/_request_blocks_can_be_freed",
    relied_on_by="vtoken/vllm_adapter/fence.py, vtoken/vllm_adapter/port.py"
)
def _c_fence() -> str:
    n, s = 32, 4
    # Default: no connector, no fence counting.
    h = VllmHarness(num_blocks=n, block_size=s, async_scheduling=True)
    sch = h.scheduler
    missing = _missing_attrs(sch, ["sched_step_seq", "processed_step_seq",
                                   "deferred_frees", "defer_block_free"], "Scheduler")
    missing += _missing_callables(sch, ["_drain_deferred_frees",
                                        "_free_cow_retained_blocks"], "Scheduler")
    expect(not missing, f"missing: {', '.join(missing)}")
    expect(sch.defer_block_free is False, "defer_block_free is on without a KV connector")
    h.add_request("A", _prompt(0, 9), max_tokens=3)
    h.drain()
    default_seq = (sch.sched_step_seq, sch.processed_step_seq)
    expect(default_seq == (0, 0),
           f"counters moved without defer_block_free: {default_seq}")

    # With defer_block_free (vLLM sets it for a KV-consumer connector; the fence then runs on these counters).
    h = VllmHarness(num_blocks=n, block_size=s, async_scheduling=True)
    sch, pool = h.scheduler, h.pool
    sch.defer_block_free = True
    b1, b2 = pool.get_new_blocks(2)
    h.add_request("A", _prompt(0, 9), max_tokens=4)
    s1 = h.schedule()
    expect(sch.sched_step_seq == 1 and sch.processed_step_seq == 0,
           f"after 1st schedule: sched={sch.sched_step_seq} processed="
           f"{sch.processed_step_seq}, want 1/0")
    sch.deferred_frees.append((sch.sched_step_seq, [b1]))  # fence = step 1
    s2 = h.schedule()
    expect(sch.sched_step_seq == 2, f"after 2nd schedule: sched={sch.sched_step_seq}")
    sch.deferred_frees.append((sch.sched_step_seq, [b2]))  # fence = step 2
    h.finish(s1)
    expect(sch.processed_step_seq == 1, f"processed={sch.processed_step_seq} after step 1")
    expect(b1.ref_cnt == 0 and b2.ref_cnt == 1,
           f"after step 1's output: b1 rc={b1.ref_cnt} (want 0), b2 rc={b2.ref_cnt} (want 1)")
    h.finish(s2)
    expect(sch.processed_step_seq == 2 and b2.ref_cnt == 0,
           f"after step 2's output: processed={sch.processed_step_seq}, b2 rc={b2.ref_cnt}")
    # A step with nothing scheduled does not advance the fence.
    h.drain()
    before = (sch.sched_step_seq, sch.processed_step_seq)
    empty = h.schedule()
    expect(empty.total_num_scheduled_tokens == 0, "idle scheduler scheduled tokens")
    h.finish(empty)
    expect((sch.sched_step_seq, sch.processed_step_seq) == before,
           f"empty step moved the counters {before} -> "
           f"{(sch.sched_step_seq, sch.processed_step_seq)}")
    expect(not sch.deferred_frees, f"deferred_frees not drained: {sch.deferred_frees}")
    expect(h.free_count() == n - 1, f"free count {h.free_count()} != {n - 1}")
    return (f"default counters {default_seq}; with defer_block_free: fence s frees at "
            f"processed_step_seq >= s; empty steps do not count; final {before}")
