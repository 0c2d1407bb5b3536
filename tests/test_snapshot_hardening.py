"""Input hardening of plan snapshots (issue 11 item 3, the snapshot part): ``load`` /
``loads`` / ``validate`` raise ``SnapshotError`` naming the field for every malformed input,
within 1 s, and the checkers are fast on bounded inputs.

Named cases first (each the issue saw, or a neighbour of one), then Hypothesis: arbitrary
bytes, arbitrary JSON, byte-level and structure-level mutations of valid snapshots --
each must be a valid snapshot or a SnapshotError, within 1 s.
"""

from __future__ import annotations

import copy
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vtoken import snapshot as snapshot_mod
from vtoken.errors import SNAPSHOT_CODES, SnapshotError
from vtoken.invariants import snapshot_checks, z3_checks
from vtoken.invariants.z3_checks import synthetic_snapshot
from vtoken.snapshot import MAX_BLOCK_SIZE, MAX_BLOCKS, MAX_FILE_BYTES, load, loads, validate

pytestmark = pytest.mark.invariants

LIMIT_S = 1.0  # the contract: every malformed input is refused within a second


def good() -> dict:
    return synthetic_snapshot(8, S=4)


def text_of(snap) -> str:
    return json.dumps(snap)


def _set(path, value):
    def f(s):
        node = s
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return s
    return f


R0 = ("pre", "requests", "r0")
# (name, how to make the input: a snapshot edit or raw text/bytes, words the message must contain, code)
CASES = [
    ("non_utf8_bytes", lambda: b"\xff\xfe" + text_of(good()).encode(), "not UTF-8", "bad_encoding"),
    ("deep_nesting_100k", lambda: "[" * 100_000 + "]" * 100_000, "nested too deeply", "too_deep"),
    ("integer_5000_digits", lambda: text_of(good()).replace('"block_size": 4', '"block_size": ' + "9" * 5000),
     "not JSON", "bad_json"),
    ("integer_4000_digits", lambda: text_of(good()).replace('"block_size": 4', '"block_size": ' + "9" * 4000),
     "block_size", "out_of_range"),
    ("bool_as_block", _set(R0 + ("tokens", 0, 0), True), "tokens[0]", "bad_field"),
    ("bool_as_offset", _set(R0 + ("tokens", 2, 1), False), "tokens[2]", "bad_field"),
    ("int_as_live_bit", _set(R0 + ("tokens", 1, 2), 1), "tokens[1]", "bad_field"),
    ("bool_as_length", _set(R0 + ("length",), True), "length", "bad_field"),
    ("bool_in_moves", _set(("plan", "moves", 0, 3), True), "plan.moves[0]", "bad_field"),
    ("bool_in_sources", _set(("plan", "sources", 0), True), "plan.sources[0]", "bad_field"),
    ("bool_plan_id", _set(("plan", "id"), True), "plan.id", "bad_field"),
    ("float_as_block", _set(R0 + ("tokens", 0, 0), 1.0), "tokens[0]", "bad_field"),
    ("absurd_block_size", _set(("block_size",), 10 ** 6), "block_size", "out_of_range"),
    ("block_size_zero", _set(("block_size",), 0), "block_size", "out_of_range"),
    ("huge_block_id", _set(("plan", "sources", 0), 2 ** 70), "plan.sources[0]", "out_of_range"),
    ("negative_block_id", _set(("headroom", 0), -1), "headroom[0]", "out_of_range"),
    ("huge_token_in_move", _set(("plan", "moves", 1, 0), 10 ** 30), "plan.moves[1] token", "out_of_range"),
    ("offset_past_block", _set(R0 + ("tokens", 3, 1), 4), "tokens[3]", "out_of_range"),
    ("huge_length", _set(R0 + ("length",), 2 ** 40), "length", "out_of_range"),
    ("huge_time", _set(("schedule", 0, "t"), 2 ** 64), "schedule[0].t", "out_of_range"),
    ("huge_read_slot", _set(("schedule", 1, "slots", 0), 2 ** 63), "schedule[1].slots[0]", "out_of_range"),
    ("negative_plan_id", _set(("plan", "id"), -5), "plan.id", "out_of_range"),
    ("long_request_name", lambda: _rename(good(), "r" * 5000), "request", "too_large"),
    ("nan", lambda: text_of(good()).replace('"block_size": 4', '"block_size": NaN'), "NaN", "bad_json"),
    ("infinity", lambda: text_of(good()).replace('"block_size": 4', '"block_size": Infinity'), "Infinity", "bad_json"),
    ("duplicate_key", lambda: text_of(good()).replace('"block_size": 4', '"block_size": 4, "block_size": 8'),
     "appears twice", "bad_json"),
    ("not_json", lambda: "{schema: 1", "not JSON", "bad_json"),
    ("empty", lambda: b"", "not JSON", "bad_json"),
    ("top_level_list", lambda: "[1, 2]", "JSON object", "bad_field"),
    ("deep_list_in_a_field", _set(("plan", "moves", 0), json.loads("[" * 500 + "]" * 500)), "plan.moves[0]",
     "bad_field"),
    ("tokens_not_lists", _set(R0 + ("tokens",), "abc"), "tokens", "bad_field"),
    ("events_not_objects", _set(("schedule",), [1, 2]), "schedule[0]", "bad_field"),
    ("in_flight_not_object", _set(("in_flight",), [[1]]), "in_flight[0]", "bad_field"),
    ("missing_evicted_in_flight", lambda: _drop(good(), "evicted_in_flight"), "evicted_in_flight", "missing_field"),
    ("digests_wrong_length", _set(("plan", "digests"), {"pre": [1], "post": [1]}), "plan.digests.pre", "bad_count"),
    ("digest_too_wide", lambda: _digests(good(), 2 ** 64), "plan.digests.pre[0]", "out_of_range"),
    ("dests_used_twice", _set(("dests_used",), [10, 10]), "dests_used", "bad_field"),
    # plan.fills (in-place compaction): optional, validated like sources/dests
    ("fills_null", _set(("plan", "fills"), None), "plan.fills", "bad_field"),
    ("fills_not_a_list", _set(("plan", "fills"), 5), "plan.fills", "bad_field"),
    ("bool_in_fills", _set(("plan", "fills"), [True]), "plan.fills[0]", "bad_field"),
    ("null_block_fill", _set(("plan", "fills"), [3, 0]), "plan.fills", "null_block"),
    ("huge_fill", _set(("plan", "fills"), [2 ** 31]), "plan.fills[0]", "out_of_range"),
    ("in_flight_fills_not_blocks", _set(("in_flight",), [{"id": 2, "request": "r9", "sources": [40], "dests": [],
                                                          "fills": ["x"]}]), "in_flight[0].fills[0]", "bad_field"),
]


def _rename(s, name):
    s["pre"]["requests"][name] = s["pre"]["requests"].pop("r0")
    s["post"]["requests"][name] = s["post"]["requests"].pop("r0")
    s["plan"]["request"] = name
    return s


def _drop(s, key):
    del s[key]
    return s


def _digests(s, v):
    k = len(s["plan"]["moves"])
    s["plan"]["digests"] = {"method": "xxh3", "pre": [v] * k, "post": [v] * k}
    return s


def _make(case):
    make = case[1]
    try:
        out = make()
    except TypeError:  # a snapshot edit
        out = make(good())
    if isinstance(out, dict):
        out = text_of(out)
    return out.encode() if isinstance(out, str) else out


# Bounds on pathological input are CPU-time bounds (process_time: this process's own work,
# whatever else the machine runs), not speed targets: those live in the benchmarks.
def _timed_load_file(path):
    t0 = time.process_time()
    try:
        load(path)
    except SnapshotError as e:
        return time.process_time() - t0, e
    raise AssertionError(f"{path} was accepted")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_input_is_a_snapshot_error_naming_the_field(case, tmp_path):
    name, _make_it, words, code = case
    path = tmp_path / f"{name}.json"
    path.write_bytes(_make(case))
    dt, e = _timed_load_file(path)
    assert e.code == code, str(e)
    assert words in str(e), str(e)
    assert e.code in SNAPSHOT_CODES
    assert dt < LIMIT_S, f"{name}: {dt:.3f} s"


def test_a_directory_a_missing_file_and_a_file_too_large(tmp_path):
    dt, e = _timed_load_file(tmp_path)
    assert e.code == "unreadable" and "is a directory" in str(e) and dt < LIMIT_S
    dt, e = _timed_load_file(tmp_path / "absent.json")
    assert e.code == "unreadable" and "absent.json" in str(e) and dt < LIMIT_S
    big = tmp_path / "big.json"
    with open(big, "wb") as f:  # sparse: costs no disk
        f.truncate(MAX_FILE_BYTES + 1)
    dt, e = _timed_load_file(big)
    assert e.code == "too_large" and dt < LIMIT_S


def test_fills_are_optional_and_in_flight_entries_may_carry_them():
    s = good()
    assert "fills" not in s["plan"]
    validate(s)  # absent == []
    s["plan"]["fills"] = []
    s["in_flight"] = [{"id": 2, "request": "r9", "sources": [40], "dests": [], "fills": [41]},
                      {"id": 3, "request": "r8", "sources": [42], "dests": [43]}]
    validate(s)
    ip = synthetic_snapshot(8, S=4, in_place=True)
    assert loads(text_of(ip))["plan"]["fills"] == [5, 6, 7, 8]


def test_validate_refuses_python_objects_json_cannot_hold():
    class Hostile:
        def __repr__(self):
            raise RuntimeError("no repr for you")

    for value in (Hostile(), (1, 2), {1, 2}, 1.5, b"x"):
        s = good()
        s["plan"]["sources"][0] = value
        with pytest.raises(SnapshotError, match=r"plan\.sources\[0\]"):
            validate(s)
    s = good()
    s["pre"]["requests"]["r0"]["tokens"] = tuple(s["pre"]["requests"]["r0"]["tokens"])
    with pytest.raises(SnapshotError, match="tokens must be list"):
        validate(s)


def test_slowest_malformed_input_and_the_limits(tmp_path):
    """All named cases in one pass: the slowest must stay under a second (printed: the
    figure the issue asks for). The limits are the documented constants."""
    worst, which = 0.0, None
    for case in CASES:
        p = tmp_path / f"{case[0]}.json"
        p.write_bytes(_make(case))
        dt, _e = _timed_load_file(p)
        if dt > worst:
            worst, which = dt, case[0]
    print(f"slowest malformed input: {which} {worst * 1e3:.1f} ms")
    assert worst < LIMIT_S
    assert MAX_BLOCK_SIZE == 4096 and MAX_BLOCKS == 2 ** 31
    assert snapshot_mod.LIMITS["block_size"] == MAX_BLOCK_SIZE


def test_checkers_are_fast_at_the_block_size_limit():
    """The issue measured block_size 10^6 at 18 s (S null-block markers per group). Now
    block_size is bounded (4096) and the null-block question is linear in the values."""
    snap = synthetic_snapshot(4096, S=MAX_BLOCK_SIZE)
    bad = copy.deepcopy(snap)
    bad["plan"]["moves"][0][3:] = bad["plan"]["moves"][1][3:]
    for s, want in ((snap, False), (bad, True)):
        for check in (snapshot_checks.check_snapshot, z3_checks.check_snapshot):
            t0 = time.process_time()
            vs = check(s)
            dt = time.process_time() - t0
            assert bool(vs) == want
            assert dt < 10.0, f"{check.__module__}: {dt:.2f} s at block_size {MAX_BLOCK_SIZE}"  # ~0.4-0.8 s here


# ------------------------------------------------------------------------------ Hypothesis
def _outcome(data) -> str:
    """'valid' or the SnapshotError code; any other exception fails the test. Within 1 s."""
    t0 = time.process_time()
    try:
        loads(data)
        out = "valid"
    except SnapshotError as e:
        out = e.code
    dt = time.process_time() - t0
    assert dt < LIMIT_S, f"{dt:.3f} s for {data[:80]!r}"
    return out


_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), database=None)


@settings(max_examples=1000, **_SETTINGS)
@given(st.binary(max_size=4096))
def test_arbitrary_bytes(data):
    assert _outcome(data) in SNAPSHOT_CODES


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-2 ** 80, 2 ** 80) | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5),
    max_leaves=30)


@settings(max_examples=500, **_SETTINGS)
@given(_JSON)
def test_arbitrary_json(value):
    text = json.dumps(value)  # NaN / Infinity included: JSON the schema refuses
    assert _outcome(text) in SNAPSHOT_CODES


@settings(max_examples=500, **_SETTINGS)
@given(data=st.data())
def test_byte_mutations_of_a_valid_snapshot(data):
    raw = bytearray(text_of(synthetic_snapshot(4, S=2)).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        how = data.draw(st.sampled_from(("flip", "insert", "delete")))
        if how == "flip":
            raw[i] ^= data.draw(st.integers(1, 255))
        elif how == "insert":
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del raw[i:i + data.draw(st.integers(1, 8))]
    out = _outcome(bytes(raw))
    assert out == "valid" or out in SNAPSHOT_CODES


def _paths(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield path + (k,)
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield path + (i,)
            yield from _paths(v, path + (i,))


@settings(max_examples=300, **_SETTINGS)
@given(data=st.data())
def test_structure_mutations_of_a_valid_snapshot_through_both_checkers(data):
    """A valid snapshot with one subtree replaced by arbitrary JSON (or deleted): both
    checkers answer (a list of violations) or raise SnapshotError, each within 1 s."""
    snap = synthetic_snapshot(6, S=4, in_place=data.draw(st.booleans()))
    paths = list(_paths(snap))
    path = data.draw(st.sampled_from(paths))
    node = snap
    for k in path[:-1]:
        node = node[k]
    if isinstance(node, dict) and data.draw(st.booleans()):
        del node[path[-1]]
    else:
        node[path[-1]] = data.draw(_JSON)
    text = json.dumps(snap)
    for check in (snapshot_checks.check_snapshot, z3_checks.check_snapshot):
        t0 = time.process_time()
        try:
            snap2 = json.loads(text)
            out = check(snap2)
            assert isinstance(out, list)
        except SnapshotError as e:
            assert e.code in SNAPSHOT_CODES
        except ValueError as e:  # json.loads of NaN-free text never fails; keep the reason visible
            raise AssertionError(f"{check.__module__}: {e}") from e
        dt = time.process_time() - t0
        assert dt < LIMIT_S, f"{check.__module__}: {dt:.3f} s"
