"""Contract tests of the vLLM surface the vtoken adapter relies on (vLLM 0.33.0).

One test per contract in ``vtoken.invariants.vllm_contracts``, run against a real vLLM
scheduler and block pool on CPU. Without vLLM these tests FAIL (they do not skip): the
project's test target installs it with scripts/install_vllm.sh.
"""

from __future__ import annotations

import pytest

from vtoken.invariants import vllm_contracts as contracts
from vtoken.vllm_adapter import harness

pytestmark = pytest.mark.vllm

NOT_INSTALLED = "vLLM not installed: run scripts/install_vllm.sh"


def require_vllm() -> str:
    """Called first in each test, so a missing vLLM is a FAILURE (not a skip or error)."""
    version = harness.vllm_version()
    if version is None:
        pytest.fail(NOT_INSTALLED, pytrace=False)
    return version


@pytest.mark.parametrize("name", contracts.contract_names())
def test_contract(name):
    require_vllm()
    result = contracts.run_contract(name)
    assert result["passed"], result["detail"]


def test_run_contracts_reports_every_contract():
    require_vllm()
    results = contracts.run_contracts(["vllm_version", "null_block", "no_such_contract"])
    assert [r["name"] for r in results] == ["vllm_version", "null_block", "no_such_contract"]
    assert [r["passed"] for r in results] == [True, True, False]
    assert all(set(r) >= {"name", "passed", "detail"} for r in results)


# ---------------------------------------------------------------------------------------
# A broken assumption is reported, named, and located; the runner never raises.


def _assert_reported(result: dict, contract_name: str, *where: str) -> None:
    c = next(c for c in contracts.CONTRACTS if c.name == contract_name)
    assert result["passed"] is False
    detail = result["detail"]
    assert detail.startswith("assumption broken: ")
    assert c.assumption in detail, detail
    for w in where:
        assert w in detail, detail


def test_broken_free_queue_order_is_reported(monkeypatch):
    require_vllm()
    from vllm.v1.core.block_pool import BlockPool

    original = BlockPool.get_new_blocks

    def reversed_order(self, num_blocks):
        return list(reversed(original(self, num_blocks)))

    monkeypatch.setattr(BlockPool, "get_new_blocks", reversed_order)
    result = contracts.run_contract("get_new_blocks_order")
    _assert_reported(result, "get_new_blocks_order", "BlockPool",
                     "vllm/v1/core/block_pool.py", "not [1, 2, 3]")


def test_broken_free_refcount_is_reported(monkeypatch):
    require_vllm()
    from vllm.v1.core.block_pool import BlockPool

    monkeypatch.setattr(BlockPool, "free_blocks", lambda self, blocks: None)
    result = contracts.run_contract("free_blocks_unhashed")
    _assert_reported(result, "free_blocks_unhashed", "free_blocks",
                     "vllm/v1/core/block_pool.py", "ref_cnt after free")


def test_unexpected_exception_is_reported_not_raised(monkeypatch):
    require_vllm()
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    def boom(self, block_ids):
        raise RuntimeError("evict_blocks removed upstream")

    monkeypatch.setattr(KVCacheManager, "evict_blocks", boom)
    result = contracts.run_contract("writability")
    _assert_reported(result, "writability", "RuntimeError",
                     "evict_blocks removed upstream", "KVCacheManager.evict_blocks")


def test_missing_symbol_is_named(monkeypatch):
    require_vllm()
    from vllm.v1.core.block_pool import BlockPool

    monkeypatch.delattr(BlockPool, "is_block_writable")
    result = contracts.run_contract("symbols_block_pool")
    _assert_reported(result, "symbols_block_pool", "missing: BlockPool.is_block_writable()",
                     "vllm/v1/core/block_pool.py")


def test_missing_vllm_is_reported(monkeypatch):
    monkeypatch.setattr(harness, "vllm_version", lambda: None)
    results = contracts.run_contracts()
    assert len(results) == len(contracts.CONTRACTS)
    assert all(not r["passed"] and r["detail"].startswith(NOT_INSTALLED) for r in results)
