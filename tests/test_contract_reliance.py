"""Each vLLM contract names the adapter module relying on it, and a broken one says so in the
audit's failure line and in the verdict."""

from __future__ import annotations

import os

import pytest

from reports import verdict as verdict_mod

pytest.importorskip("vllm")


def test_every_contract_names_an_existing_adapter_module():
    from vtoken.invariants.vllm_contracts import CONTRACTS

    assert len(CONTRACTS) == 20
    for c in CONTRACTS:
        mods = [m.split(" ")[0] for m in c.relied_on_by.split(", ")]
        assert mods and all(m.startswith("vtoken/vllm_adapter/") and os.path.exists(m) for m in mods), c.name


def test_a_contract_without_a_relying_module_is_refused():
    from vtoken.invariants.vllm_contracts import contract

    with pytest.raises(ValueError):
        contract("orphan", "nothing", "nowhere", relied_on_by="")


def test_the_audit_failure_line_of_a_broken_contract_names_the_relying_module(monkeypatch):
    from reports.audit import check_vllm
    from vtoken.invariants import vllm_contracts as vc

    def broken() -> str:
        vc.expect(False, "measured otherwise")
        return "unreachable"

    fake = vc.Contract("fake_contract", "the pool behaves", "vllm/x.py", broken,
                       relied_on_by="vtoken/vllm_adapter/port.py")
    monkeypatch.setattr(vc, "CONTRACTS", [fake])
    r = check_vllm({"note": lambda _line: None})
    assert r.passed is False
    assert "fake_contract" in r.detail and "relied on by: vtoken/vllm_adapter/port.py" in r.detail
    assert r.metrics["contracts"][0]["relied_on_by"] == "vtoken/vllm_adapter/port.py"


def test_the_verdict_lists_a_broken_contract_with_the_relying_module():
    row = {"name": "writability", "passed": False, "detail": "x", "assumption": "a",
           "relied_on_by": "vtoken/vllm_adapter/prefix_hash.py"}
    report = {"vllm_version": "0.33.0", "checks": [
        {"name": "vllm-contracts", "passed": False, "detail": "broken", "metrics": {"contracts": [row]}}]}
    v = verdict_mod.verdict(report)
    md = "\n".join(verdict_mod.verdict_md(report, v))
    assert "`writability` (relied on by vtoken/vllm_adapter/prefix_hash.py)" in md
