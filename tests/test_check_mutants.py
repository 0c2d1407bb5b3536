"""The checkers' own mutation test (``vtoken.invariants.mutants``, ``vtoken check-mutants``):
a bounded, seeded sample of the full run -- snapshots of real planner and decode-engine
runs, every operator applied, every mutant rejected by both checkers, every valid
snapshot accepted, the checkers agreeing."""

from __future__ import annotations

import copy
import json
import random

import pytest

from vtoken.errors import SnapshotError
from vtoken.invariants import mutants, snapshot_checks, z3_checks
from vtoken.invariants.z3_checks import synthetic_snapshot
from vtoken.snapshot import validate

pytestmark = pytest.mark.invariants

PER_OP = 5  # the bounded sample; the full run (vtoken check-mutants) makes 60 per operator


@pytest.fixture(scope="module")
def sample():
    return mutants.run(("planner", "engine"), per_operator=PER_OP, seed=0, quick=True)


def test_sample_every_mutant_rejected_every_valid_snapshot_accepted(sample):
    r = sample
    assert r["failures"] == [], r["failures"][:5]
    assert r["operators"] == len(mutants.OPERATORS) >= 30
    assert r["valid"] > 0 and r["valid_accepted"] == r["valid"]
    assert r["mutants"] == PER_OP * r["operators"] and r["rejected"] == r["mutants"]
    assert r["malformed"] == 0 and r["disagreements"] == 0 and r["operators_short"] == []
    for name, row in r["by_operator"].items():
        assert row["generated"] == PER_OP, name
        for c in mutants.CHECKERS:
            assert row["rejected"][c] == PER_OP, (name, c)
            assert row["flagged"][c][row["invariant"]] == PER_OP, (name, c)
    assert set(r["by_path"]) == {"planner", "engine"} and all(v["valid"] > 0 for v in r["by_path"].values())
    assert r["passed"]


def test_the_issue_operators_are_all_there():
    names = {op.name for op in mutants.OPERATORS}
    assert names >= {"drop_token", "alias_slot", "duplicate_token", "move_shared_block", "move_tail_block",
                     "overlap_in_flight", "not_decreasing", "read_before_copy", "free_before_copy",
                     "write_source_before_copy", "live_in_freed_block", "change_digest", "resurrect_evicted",
                     "oversubscribe_headroom", "move_from_unheld_slot"}
    # in-place plans (plan.fills): each way a fill can be wrong
    assert names >= {"fill_occupied_slot", "fill_shared", "fill_tail", "fill_is_source", "fill_in_flight",
                     "fill_not_owned", "move_to_unlisted_block", "read_fill_hole_before_copy", "free_fill_before_copy"}
    # what the checkers derive or count: the tail, every launch, every request's post, reads of
    # dead tokens, one plan per request, the headroom; and a write onto a live slot
    assert names >= {"tail_unrecorded", "relaunch_after_reuse", "alias_other_post", "read_evicted_after_apply",
                     "read_dead_token", "second_plan_same_request", "plan_block_in_headroom", "overwrite_live_slot"}
    # ownership across the whole snapshot (issue 40): every holder of a block, before and after apply
    assert names >= {"dest_on_held_block", "in_flight_takes_held_block", "in_flight_plans_overlap",
                     "hand_over_held_block", "write_into_held_block"}
    assert {op.invariant for op in mutants.OPERATORS} == {"I1", "I2", "I3", "I4"}


def test_deterministic_for_a_seed():
    a = mutants.run(("planner",), per_operator=3, seed=7, quick=True)
    b = mutants.run(("planner",), per_operator=3, seed=7, quick=True)
    strip = lambda r: {k: v for k, v in r.items() if k not in ("wall_s", "by_path")}  # noqa: E731
    assert json.dumps(strip(a), sort_keys=True) == json.dumps(strip(b), sort_keys=True)


def _synthetic_bases():
    """Two hand-checked valid snapshots with digests: out of place (fresh dests) and in place
    (plan.fills: the moves land in the holes of the request's own blocks)."""
    out = {}
    for name, in_place in (("out_of_place", False), ("in_place", True)):
        base = synthetic_snapshot(8, S=4, in_place=in_place)
        k = len(base["plan"]["moves"])
        base["plan"]["digests"] = {"method": "xxh3", "pre": list(range(7, 7 + k)), "post": list(range(7, 7 + k))}
        assert snapshot_checks.check_snapshot(base) == [] and z3_checks.check_snapshot(base) == [], name
        out[name] = base
    assert out["in_place"]["plan"]["fills"] and out["in_place"]["plan"]["dests"] == []
    return out


def test_each_operator_plants_a_well_formed_violation_in_a_synthetic_snapshot():
    """Independent of the collectors: every operator on a hand-checked valid snapshot (with
    digests, an in-flight copy and a recorded eviction) yields a well-formed mutant both
    checkers reject with the operator's invariant. Every operator applies to one of the two
    bases at least (the fill operators to the in-place one), most to both."""
    bases = _synthetic_bases()
    for op in mutants.OPERATORS:
        applied = set()
        for name, base in bases.items():
            for i in range(4):
                mut = copy.deepcopy(base)
                if not op.fn(mut, random.Random(f"{op.name}/{name}/{i}")):
                    continue
                applied.add(name)
                assert mut != base, (op.name, name)
                validate(mut)
                sets = {}
                for check in (snapshot_checks.check_snapshot, z3_checks.check_snapshot):
                    sets[check.__module__] = {v.invariant for v in check(mut)}
                    assert op.invariant in sets[check.__module__], (op.name, name, i, check.__module__)
                assert len({frozenset(x) for x in sets.values()}) == 1, (op.name, name, i, sets)
        assert applied, op.name
        if op.name.startswith(("fill_", "read_fill", "free_fill")):
            assert "in_place" in applied, op.name


def test_every_rule_is_exercised_by_an_operator(sample):
    """The operator-coverage table: each rule of I1-I4 (the rule names of snapshot_checks'
    docstring) has an operator whose mutants both checkers reject through it, except the rules
    named unreachable, each with its reason."""
    r = sample
    names = [f"{inv}.{rule}" for inv in mutants.INVARIANTS for rule in snapshot_checks.RULES[inv]]
    assert list(r["rule_coverage"]) == names
    assert r["rules_unexercised"] == [] and r["rules_unknown"] == []
    assert set(r["rules_unreachable"]) == {"I2.null"} and all(len(why) > 40 for why in r["rules_unreachable"].values())
    for rule, ops in r["rule_coverage"].items():
        assert bool(ops) == (rule not in r["rules_unreachable"]), rule
        for c in mutants.CHECKERS:
            assert set(ops) <= set(r["rule_coverage_by_checker"][c][rule]), (rule, c)
    # the new rules each have their own operator
    cov = r["rule_coverage"]
    for rule, op in (("I4.tail_block", "tail_unrecorded"), ("I3.early", "relaunch_after_reuse"),
                     ("I2.post_unique", "alias_other_post"), ("I3.stale_read", "read_evicted_after_apply"),
                     ("I3.dead_read", "read_dead_token"), ("I4.one_plan", "second_plan_same_request"),
                     ("I4.headroom", "plan_block_in_headroom"), ("I2.overwrite", "overwrite_live_slot"),
                     ("I4.duplicate_block", "list_block_twice"), ("I4.emptied", "source_not_emptied"),
                     ("I4.dests_used", "wrong_dests_used"), ("I4.fill_kept", "fill_dropped_after"),
                     ("I1.unmoved", "move_unmoved_token"), ("I4.in_flight_dest", "dest_on_held_block"),
                     ("I4.in_flight_source", "in_flight_takes_held_block"),
                     ("I4.plans_overlap", "in_flight_plans_overlap"), ("I4.handed_over", "hand_over_held_block"),
                     ("I4.foreign_write", "write_into_held_block")):
        assert op in cov[rule], (rule, cov[rule])


def test_rule_names_are_the_docstrings_and_the_unreachable_rule_is_unreachable():
    import re

    doc = snapshot_checks.__doc__
    named = set(re.findall(r"\[([a-z_]{2,})\]", doc))  # the bracketed rule names (not ``pre[t]``)
    assert named == {rule for rules in snapshot_checks.RULES.values() for rule in rules}
    # I2.null: validate refuses a live token in block 0 before any rule runs
    snap = synthetic_snapshot(8, S=4)
    snap["pre"]["requests"]["r0"]["tokens"][0][0] = 0
    with pytest.raises(SnapshotError, match="null block"):
        snapshot_checks.check_snapshot(snap)


def test_cli_json_last_line(capsys):
    rc = mutants.main(["--json", "--paths", "planner,engine", "--per-operator", "2", "--quick"])
    out = capsys.readouterr().out.strip().splitlines()
    d = json.loads(out[-1])
    for key in ("operators", "mutants", "rejected", "valid", "valid_accepted", "by_operator", "rule_coverage",
                "rules_unexercised", "rules_unreachable"):
        assert key in d
    assert rc == 0 and d["passed"] and d["mutants"] == 2 * d["operators"] == d["rejected"]
    assert "operator" in out[0]  # the table is printed before the JSON line
    text = "\n".join(out[:-1])
    assert "I3.dead_read" in text and "read_dead_token" in text and "unreachable: validate refuses" in text
    assert f"rules exercised {len(d['rule_coverage']) - 1}/{len(d['rule_coverage'])}" in text


def test_an_unavailable_path_fails_loudly(monkeypatch, capsys):
    def unavailable(**_kw):
        raise mutants.PathUnavailable("adapter path: VTokenAdapter has no `history` of plan snapshots")

    monkeypatch.setitem(mutants.COLLECTORS, "adapter", unavailable)
    with pytest.raises(mutants.PathUnavailable, match="history"):
        mutants.run(("adapter",), per_operator=1)
    assert mutants.main(["--json", "--paths", "adapter"]) == 2
    cap = capsys.readouterr()
    assert "history" in cap.err and json.loads(cap.out.strip().splitlines()[-1])["passed"] is False
    with pytest.raises(ValueError, match="unknown path"):
        mutants.run(("nope",), per_operator=1)


@pytest.mark.vllm
def test_adapter_snapshots_are_collected_and_accepted():
    """The adapter path: a real decode through the vLLM scheduler, its plans' snapshots
    (``VTokenAdapter.history``) accepted by both checkers. (It caught the worker dropping
    the moves of tokens evicted before launch without recording them in
    ``evicted_in_flight``: those tokens read as LOST.)"""
    snaps = mutants.collect_adapter(seed=0)
    assert snaps
    bad = []
    for s in snaps:
        for check in (snapshot_checks.check_snapshot, z3_checks.check_snapshot):
            vs = check(s)
            if vs:
                bad.append((check.__module__, s["plan"]["id"], str(vs[0])))
    assert bad == [], bad[:4]
