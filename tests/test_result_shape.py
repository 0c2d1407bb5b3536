"""One result shape for every checker (issue 39, item 5): a list of ``Violation``.

Each point-in-time checker is fed one violation it must reject: its list form returns
``Violation`` objects naming a rule and an invariant, and its raising form (kept for its
callers: same name, exception type and message) raises from the first of them, the
exception carrying the same list as ``.violations``; fed a valid input, the list form
returns ``[]`` and the raising form nothing. The run-level tools (small scope, the
placement proof, the I3 probe, the vLLM contracts, the mutation test) keep their results
and add a ``violations`` view. Last, the count: every public ``check_*`` / ``*_violations``
function of ``invariants/`` returns ``list[Violation]`` or is a thin wrapper over one --
one result convention."""

from __future__ import annotations

import ast
import copy
import json
import pickle
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vtoken.invariants import Violation as PackageViolation
from vtoken.invariants import snapshot_checks, z3_checks
from vtoken.invariants.ownership import check_ownership, ownership_violations
from vtoken.invariants.plan_contract import check_proposal, proposal_violations
from vtoken.invariants.table_checks import (InvariantViolation, block_accounting_violations, check_block_accounting,
                                            check_conservation, check_unique_mapping, conservation_violations,
                                            unique_mapping_violations)
from vtoken.invariants.violation import Found, Violation

pytestmark = pytest.mark.invariants

ROOT = Path(__file__).resolve().parents[1]


def shaped(found, invariant: str | None = None) -> list[Violation]:
    """``found`` is a non-empty list of Violations, each naming a rule and an invariant."""
    assert isinstance(found, list) and found, found
    for v in found:
        assert type(v) is Violation, v
        assert v.rule and v.invariant and v.explanation, v
        assert invariant is None or v.invariant == invariant, v
    return found


def raises_with(exc_type, found: list[Violation], fn, *args, **kw):
    """``fn`` raises ``exc_type`` from the first of ``found``, carrying the whole list."""
    with pytest.raises(exc_type) as ei:
        fn(*args, **kw)
    assert ei.value.violations == found
    assert f"{found[0].invariant}: {found[0].explanation}" in str(ei.value)
    return ei.value


def test_violation_is_one_type_everywhere():
    assert snapshot_checks.Violation is Violation is z3_checks.Violation is PackageViolation
    assert str(Violation("I2", "x")) == "I2: x"


# ------------------------------------------------------------------ table checks
def state(loc_b: int = 1):
    """One request, two live tokens in block 1 (block 0: the null block), unless ``loc_b``."""
    return {"block_size": 4, "num_blocks": 4,
            "blocks": {1: {"live": 2, "refs": 1}},
            "requests": {"r": {"live": [0, 1], "loc": {0: (loc_b, 0), 1: (1, 1)}, "blocks": [1], "length": 2}}}


def test_unique_mapping():
    assert unique_mapping_violations(state()) == [] and check_unique_mapping(state()) is None
    bad = state(loc_b=0)  # a live token in the null block
    found = shaped(unique_mapping_violations(bad), "I2")
    assert found[0].rule == "in_range"
    e = raises_with(InvariantViolation, found, check_unique_mapping, bad)
    assert e.invariant == "I2"


def test_conservation():
    pre, post = state(), copy.deepcopy(state())
    post["requests"]["r"]["loc"][1] = (1, 2)
    assert conservation_violations(pre, [(1, 1, 1, 1, 2)], post, "r") == []
    check_conservation(pre, [(1, 1, 1, 1, 2)], post, "r")
    found = shaped(conservation_violations(pre, [], post, "r"), "I1")  # token 1 moved without a move
    assert [v.rule for v in found] == ["arrival"]
    raises_with(InvariantViolation, found, check_conservation, pre, [], post, "r")
    twice = [(1, 1, 1, 1, 2), (1, 1, 1, 1, 3)]
    assert [v.rule for v in conservation_violations(pre, twice, post, "r")] == ["moved_twice"]


def test_block_accounting():
    alloc = {"num_blocks": 4, "free_queue": [2, 3], "reserved": [], "ref": {1: 1}}
    assert block_accounting_violations(state(), alloc) == [] and check_block_accounting(state(), alloc) is None
    leaky = dict(alloc, free_queue=[2])  # block 3 neither free, used nor reserved
    found = shaped(block_accounting_violations(state(), leaky), "accounting")
    assert found[0].rule == "pool_total"
    raises_with(InvariantViolation, found, check_block_accounting, state(), leaky)


def test_ownership():
    args = dict(num_blocks=5, free=[1, 2], refs={3: 1, 4: 1}, owners={"a": [3], "b": [4]})
    assert ownership_violations(**args) == [] and check_ownership(**args) is None
    bad = dict(args, owners={"a": [3, 2], "b": [4]})  # block 2 free but still held
    found = shaped(ownership_violations(**bad), "ownership")
    assert found[0].rule == "free_held" and "freed while still owned" in found[0].explanation
    raises_with(InvariantViolation, found, check_ownership, **bad)


def test_plan_contract():
    from vtoken import TokenTable

    t = TokenTable(4, 16)
    t.sync_new_tokens("r", [2, 3, 4], 12)
    t.evict_tokens("r", [0, 1, 2, 7])  # block 2: one live token; block 3: a hole; 4 the tail
    p = SimpleNamespace(sources=[2], fills=[3], dests=[], moves=np.array([[3, 2, 3, 3, 3]]), reduction=1)
    kw = dict(table=t, req_id="r", proposal=p, tail=4, headroom=[1], max_sources=4)
    assert proposal_violations(**kw, in_place=True) == []
    assert check_proposal(**kw, in_place=True)["in_place"] is True  # still returns the view
    found = shaped(proposal_violations(**kw), "plan_contract")  # a fill in an out-of-place plan
    assert found[0].rule == "contract" and "fill_not_allowed" in found[0].explanation
    raises_with(InvariantViolation, found, check_proposal, **kw)
    lazy = SimpleNamespace(sources=[2], fills=[3], dests=[], moves=np.array([[3, 2, 3, 3, 3]]), reduction=0)
    assert [v.rule for v in proposal_violations(**dict(kw, proposal=lazy), in_place=True)] == ["optimal"]


# ------------------------------------------------------------------ snapshot checkers
@pytest.mark.parametrize("checker", [snapshot_checks.check_snapshot, z3_checks.check_snapshot],
                         ids=["python", "z3"])
def test_snapshot_checkers(checker):
    from vtoken.invariants.mutants import op_drop_token

    snap = z3_checks.synthetic_snapshot(8, S=4)
    assert checker(snap) == []
    assert op_drop_token(snap, random.Random(0))
    found = shaped(checker(snap))
    assert "I1" in {v.invariant for v in found}
    assert all(v.rule in snapshot_checks.RULES[v.invariant] for v in found)


# ------------------------------------------------------------------ relocation hash
def _relocation_rig(engine_name: str | None):
    from vtoken.allocator import BlockAllocator
    from vtoken.copy_engine import KVCopyEngine
    from vtoken.fuzz.faulty_engines import ENGINES
    from vtoken.invariants.relocation_hash import RelocationChecker
    from vtoken.kvcache import KVCache
    from vtoken.planner import PlannerConfig, ReclamationManager
    from vtoken.table import TokenTable

    S, NB = 4, 48
    kv = KVCache(2, NB, S, 2, 4)
    kv.kv.copy_(torch.randn(kv.kv.shape, generator=torch.Generator().manual_seed(0)))
    table, alloc = TokenTable(S, NB), BlockAllocator(NB)
    chk = RelocationChecker(kv, table)
    eng = (ENGINES[engine_name] if engine_name else KVCopyEngine)(kv, S)
    cfg = PlannerConfig(theta_f=0.05, check_every=1, max_sources=8, headroom=6, record_snapshots=True, in_place=False)
    mgr = ReclamationManager(table, alloc, chk.wrap(eng), cfg, on_applied=chk.after_apply)
    blocks = alloc.allocate(8)
    table.sync_new_tokens(0, blocks, 30)
    mgr.hold(0, blocks)
    table.evict_tokens(0, np.sort(np.random.default_rng(0).choice(29, size=17, replace=False)))
    return chk, mgr


def test_relocation_check():
    from vtoken.errors import RelocationCheckError

    chk, mgr = _relocation_rig(None)
    assert mgr.step()  # launches
    mgr.step()  # polls: the copy checked, applied
    assert chk.failed == 0 and chk.passed > 0 and chk.violations == []
    chk, mgr = _relocation_rig("copy_flip_byte")
    mgr.step()
    with pytest.raises(RelocationCheckError) as ei:
        mgr.step()
    found = shaped(ei.value.violations, "relocation")
    assert found == chk.violations and found[0].rule == ei.value.code == "relocation_mismatch"
    assert found[0].explanation in str(ei.value)


# ------------------------------------------------------------------ run-level tools: a violations view
def test_found_is_the_dict_it_was():
    f = Found({"a": 1}, [Violation("I3", "x", {}, "r")])
    assert f == {"a": 1} and json.loads(json.dumps(f)) == {"a": 1} and f.violations[0].rule == "r"
    g = pickle.loads(pickle.dumps(f))
    assert g == f and g.violations == f.violations
    assert Found({"a": 1}).violations == []


def test_i3_probe_view():
    from vtoken.invariants.i3_probe import probe_violations

    assert probe_violations({"scenario": "wait", "sentinel_seen": False, "bytes_equal": True}) == []
    found = shaped(probe_violations({"scenario": "poll", "sentinel_seen": True, "bytes_equal": False}), "I3")
    assert [v.rule for v in found] == ["sentinel_read", "bytes_differ"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_i3_probe_on_cuda():
    from vtoken.fuzz.faulty_engines import factory
    from vtoken.invariants.i3_probe import i3_probe
    from vtoken.kvcache import KVCache

    def cache():
        return KVCache(2, 64, 16, 2, 64, dtype=torch.float16, device="cuda", checked=False)

    assert i3_probe(cache(), scenario="wait").violations == []
    r = i3_probe(cache(), scenario="wait", fault="cuda_wait_dropped", engine_cls=factory("cuda_wait_dropped"))
    assert shaped(r.violations, "I3")[0].rule == "sentinel_read"


def test_placement_proof_view():
    from vtoken.fuzz.planted import planted
    from vtoken.invariants.placement_proof import prove_placement

    assert prove_placement(2, 4).violations == []
    with planted("placement_off_by_one"):
        r = prove_placement(2, 4)
    found = shaped(r.violations, "placement")
    assert {v.rule for v in found} == {k for k, s in r.properties.items() if s == "counterexample"}
    assert found[0].model == r.counterexample


def test_small_scope_view():
    from vtoken.fuzz.planted import planted
    from vtoken.invariants.small_scope import check_state, run_small_scope

    n, found = r = check_state(2, [(6, (False, True, False, True, True, True), False)], 3, churn=True)
    assert found == [] and r.violations == [] and n >= 2
    with planted("plan_moves_tail"):
        res = run_small_scope(2, 2, 2, time_budget_s=60)
    vs = shaped(res.violations)
    assert len(vs) == res["violations"] > 0
    assert all(v.model["where"] and v.model["state"] in e for v, e in zip(vs, res["examples"]))


@pytest.mark.vllm
def test_vllm_contracts_view():
    from vtoken.invariants.vllm_contracts import run_contract, run_contracts

    kept = run_contract("vllm_version")
    assert kept["passed"], kept["detail"]
    assert kept.violations == []
    res = run_contracts(["vllm_version", "no_such_contract"])
    found = shaped(res.violations, "vllm_contract")
    assert [v.rule for v in found] == ["no_such_contract"] and not res[1]["passed"]


def test_mutants_view(monkeypatch):
    from vtoken.invariants import mutants

    res = mutants.run(("planner", "engine"), per_operator=5, seed=0, quick=True)  # test_check_mutants' sample
    assert res["passed"] and res.violations == []
    monkeypatch.setitem(mutants.CHECKERS, "z3", lambda snap: [])  # a checker that accepts everything
    res = mutants.run(("planner",), per_operator=1, seed=0, quick=True)
    found = shaped(res.violations, "check_mutants")
    assert "mutant_accepted" in {v.rule for v in found} and not res["passed"]
    assert {v.rule for v in found} <= {"valid_rejected", "mutant_accepted", "disagreement", "malformed_mutant",
                                       "operator_short", "rule_unexercised", "rule_unknown", "empty"}


# ------------------------------------------------------------------ the count: one convention
def _public_checkers(path: Path) -> list[ast.FunctionDef]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
            and (n.name.startswith("check_") or n.name.endswith("_violations"))]


def _calls(fn: ast.FunctionDef) -> set[str]:
    return {c.func.id if isinstance(c.func, ast.Name) else c.func.attr for c in ast.walk(fn)
            if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))}


def result_conventions(root: Path = ROOT) -> dict:
    """``{"list[Violation]": [...], "wrapper": [...], other shape: [...]}`` over the public
    ``check_*`` / ``*_violations`` functions of ``root/invariants``: a list form is annotated
    ``-> list[Violation]``; a wrapper returns another shape but calls ``raise_first`` or a
    list form (a ``-> None`` raising form must be nothing but its docstring and that call);
    anything else is a convention of its own, named by its annotation."""
    fns = {p.name: _public_checkers(p) for p in sorted((root / "invariants").glob("*.py"))}
    list_forms = {f.name for fs in fns.values() for f in fs if ast.unparse(f.returns or ast.Constant(None)) ==
                  "list[Violation]"}
    out: dict = {}
    for mod, fs in fns.items():
        for f in fs:
            shape = ast.unparse(f.returns) if f.returns is not None else "unannotated"
            if shape != "list[Violation]" and _calls(f) & (list_forms | {"raise_first"}):
                body = [s for s in f.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
                thin = shape != "None" or (len(body) == 1 and "raise_first" in _calls(f))
                shape = "wrapper" if thin else f"fat wrapper ({shape})"
            out.setdefault(shape, []).append(f"{mod}:{f.name}")
    return out


def test_one_result_convention():
    got = result_conventions()
    conventions = sorted(k for k in got if k != "wrapper")
    print(f"\nresult conventions: {len(conventions)} {conventions}; "
          + "; ".join(f"{k}: {len(v)}" for k, v in sorted(got.items())))
    assert conventions == ["list[Violation]"], got
    # the raising forms the callers know are among the wrappers, and each has its list form
    wrappers = set(got["wrapper"])
    for name in ("table_checks.py:check_unique_mapping", "table_checks.py:check_conservation",
                 "table_checks.py:check_block_accounting", "ownership.py:check_ownership",
                 "plan_contract.py:check_proposal"):
        assert name in wrappers, name
    assert len(got["list[Violation]"]) >= 7, got


def test_the_count_sees_a_second_convention(tmp_path):
    """The count itself, fed a module with a checker that raises without a list form."""
    (tmp_path / "invariants").mkdir()
    (tmp_path / "invariants" / "probe.py").write_text(
        "def check_a(x) -> list[Violation]:\n    return []\n\n"
        "def check_b(x) -> None:\n    raise_first(check_a(x), E)\n\n"
        "def check_c(x) -> None:\n    if x:\n        raise E('c', 'x')\n")
    got = result_conventions(tmp_path)
    assert got == {"list[Violation]": ["probe.py:check_a"], "wrapper": ["probe.py:check_b"],
                   "None": ["probe.py:check_c"]}
