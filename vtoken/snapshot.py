"""Plan snapshots: the JSON record of what a plan was made from and what it did.

A snapshot is the unit the invariant checks take (``vtoken.invariants.snapshot_checks``
in plain Python, ``vtoken.invariants.z3_checks`` in Z3), that a fuzz failure is minimised
to, that an audit records, and that can be replayed. Schema ``vtoken.plan-snapshot/1``::

    {
      "schema": "vtoken.plan-snapshot/1",
      "block_size": S,
      "plan": {"id": int, "request": str, "sources": [block], "dests": [block],
               "fills": [block],                                              # optional (absent == [])
               "moves": [[token, src_block, src_offset, dst_block, dst_offset], ...],
               "digests": {"method": str, "pre": [d | null], "post": [d | null]}   # optional
              },
      "pre":  {"requests": {req: {"length": n, "blocks": [block], "tail_block": b | null,
                                  "tokens": [[block, offset, live], ...]   # by token id
                                  }}},
      "post": {"requests": {...same shape...}} | null       # null until the plan is applied
      "shared_blocks": [block],        # referenced by more than one request at plan time
      "headroom": [block],             # reserved blocks available to the planner
      "in_flight": [{"id", "request", "sources", "dests", "fills"?}],   # other plans still copying
      "schedule": [event, ...],        # in time order, see below
      "evicted_in_flight": [token],    # REQUIRED (empty list when none), see below
      "dests_used": [block]            # optional: fresh destinations that received a token
    }

Fields:

- ``plan.fills`` (absent == ``[]``, the out-of-place plan; ``null`` refused): the request's
  own private blocks (not shared, not its tail, not a source or destination) whose *holes*
  (slots without a live token of the request before the plan) receive moved tokens, in fill
  order. A move lands in ``plan.dests`` (fresh, from the headroom) or on a hole of a fill.
  Fills stay the request's and are in flight like sources; validated like ``sources`` (block
  ids, never the null block 0), in ``in_flight`` entries too.
- ``tokens[i] = [block, offset, live]``: the token's slot (a dead token's: where it last
  was) and its live bit, a JSON boolean (``1``/``0`` are refused).
- ``evicted_in_flight``: the plan's moved tokens evicted while its copy flew; their moves
  were dropped at apply and each stays dead at its pre slot. A moved token live before the
  plan, not listed here, and not live at its destination afterwards is LOST (I1).
- ``dests_used``: written at apply, the fresh destinations the applied moves landed in
  (``plan.dests`` stays as planned; fills never listed).
- ``plan.digests`` (optional): per move, a 64-bit digest (``method``: ``xxh3`` or
  ``fingerprint``) of the token's K/V bytes at its source before the copy (``pre``) and at
  its destination after (``post``), ``null`` where the writer had no bytes (filled by
  ``vtoken.invariants.relocation_hash.RelocationChecker``). A live move whose digests
  differ breaks I1.
- Sharedness is a fact of ``pre``: a block in two requests' ``blocks`` is shared whether
  or not ``shared_blocks`` lists it.

Events carry an integer time ``t`` (a logical clock, non-decreasing in the order things
happened) and a ``kind``: ``launch`` {plan} (the copy was issued; its completion is
symbolic, after it); ``fence`` {plan} (a wait on the copy's event: every later event
happens after the copy completed); ``apply`` {plan} (the table points at the
destinations); ``free`` {blocks}; ``alloc`` {request, blocks}; ``read`` {request, tokens,
slots} (attention read these tokens at these slots); ``write`` {request, token, slot}.

Limits (:data:`LIMITS`), so a snapshot's size bounds every check's work: ``block_size`` <=
4096; block ids < 2**31; tokens per request <= 2**24; requests and in-flight plans <= 2**16
each; schedule events <= 2**22; ids and times < 2**62; request names <= 1024 chars; a file
for :func:`load` <= 256 MiB.

:func:`validate` checks every field and raises :class:`SnapshotError` naming it;
:func:`load` / :func:`loads` turn every failure to read or parse (non-UTF-8, deep nesting,
huge integers, NaN, duplicate keys, a directory, a file too large) into one too.

Owns: nothing (pure functions over plain data; ``save``/``load`` touch only the file named).
May call: vtoken.errors, json, pathlib, reprlib; never spec/, invariants/, fuzz/ or reports/.
Costs: ``validate`` linear in the snapshot (bounded by :data:`LIMITS`); ``request_state`` O(request
length).
"""

from __future__ import annotations

import json
import reprlib
from pathlib import Path

from .errors import SnapshotError

SCHEMA = "vtoken.plan-snapshot/1"
EVENT_KINDS = frozenset({"launch", "fence", "apply", "free", "alloc", "read", "write"})

MAX_BLOCK_SIZE = 4096
MAX_BLOCKS = 2 ** 31  # block ids in [0, MAX_BLOCKS)
MAX_TOKENS = 2 ** 24  # tokens per request
MAX_REQUESTS = 2 ** 16
MAX_PLANS = 2 ** 16  # in-flight plans listed
MAX_EVENTS = 2 ** 22
MAX_BLOCK_LIST = 2 ** 24  # any list of blocks (sources, headroom, a request's blocks, ...)
MAX_ID = 2 ** 62  # plan ids and event times in [0, MAX_ID)
MAX_NAME = 1024  # characters of a request name
MAX_FILE_BYTES = 256 * 2 ** 20
DIGEST_BITS = 64
LIMITS = dict(block_size=MAX_BLOCK_SIZE, blocks=MAX_BLOCKS, tokens=MAX_TOKENS, requests=MAX_REQUESTS,
              plans=MAX_PLANS, events=MAX_EVENTS, block_list=MAX_BLOCK_LIST, id=MAX_ID, name=MAX_NAME,
              file_bytes=MAX_FILE_BYTES)

_r = reprlib.Repr()
_r.maxlevel, _r.maxstring, _r.maxother, _r.maxlist, _r.maxdict, _r.maxlong = 2, 40, 40, 4, 4, 40


def _show(v) -> str:
    """A short, safe rendering of a bad value (never recursion, never a 5000-digit str)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"an integer of {v.bit_length()} bits"
    try:
        return _r.repr(v)
    except Exception:  # a hostile __repr__ (validate is also handed Python objects)
        return f"a {type(v).__name__}"


def _fail(code: str, msg: str):
    raise SnapshotError(code, msg)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v, where: str, lo: int, hi: int) -> int:
    """An int in [lo, hi) (bools refused: ``true`` is not block 1)."""
    if not _is_int(v):
        _fail("bad_field", f"{where} must be an integer, got {_show(v)}")
    if not lo <= v < hi:
        _fail("out_of_range", f"{where} = {_show(v)} outside [{lo}, {hi})")
    return v


def _need(obj, key, typ, where):
    if not isinstance(obj, dict) or key not in obj:
        _fail("missing_field", f"{where}.{key} is missing")
    v = obj[key]
    if typ is int:
        if not _is_int(v):
            _fail("bad_field", f"{where}.{key} must be an integer, got {_show(v)}")
    elif not isinstance(v, typ):
        _fail("bad_field", f"{where}.{key} must be {typ.__name__}, got {type(v).__name__}")
    return v


def _list(v, where: str, limit: int) -> list:
    if not isinstance(v, list):
        _fail("bad_field", f"{where} must be a list, got {type(v).__name__}")
    if len(v) > limit:
        _fail("too_large", f"{where} has {len(v)} entries (limit {limit})")
    return v


def _int_list(v, where, lo: int = 0, hi: int = MAX_BLOCKS, limit: int = MAX_BLOCK_LIST):
    _list(v, where, limit)
    for i, x in enumerate(v):
        if not _is_int(x) or not lo <= x < hi:
            if not _is_int(x):
                _fail("bad_field", f"{where}[{i}] must be an integer, got {_show(x)}")
            _fail("out_of_range", f"{where}[{i}] = {_show(x)} outside [{lo}, {hi})")
    return v


def _block_list(v, where):
    return _int_list(v, where, 0, MAX_BLOCKS, MAX_BLOCK_LIST)


def _name(v, where: str):
    """A request name: a string (<= MAX_NAME chars) or an integer."""
    if isinstance(v, str):
        if len(v) > MAX_NAME:
            _fail("too_large", f"{where}: a request name of {len(v)} characters (limit {MAX_NAME})")
        return v
    if _is_int(v):
        if not -MAX_ID <= v < MAX_ID:
            _fail("out_of_range", f"{where} = {_show(v)} outside [-{MAX_ID}, {MAX_ID})")
        return v
    _fail("bad_field", f"{where} must be a string (or an integer), got {_show(v)}")


def _validate_state(state, S, where):
    reqs = _need(state, "requests", dict, where)
    if len(reqs) > MAX_REQUESTS:
        _fail("too_large", f"{where}.requests has {len(reqs)} entries (limit {MAX_REQUESTS})")
    for rid, r in reqs.items():
        _name(rid, f"{where}.requests key")
        w = f"{where}.requests[{_show(rid)}]"
        n = _need(r, "length", int, w)
        if not 0 <= n <= MAX_TOKENS:
            _fail("out_of_range", f"{w}.length = {_show(n)} outside [0, {MAX_TOKENS}]")
        blocks = set(_block_list(_need(r, "blocks", list, w), f"{w}.blocks"))
        toks = _list(_need(r, "tokens", list, w), f"{w}.tokens", MAX_TOKENS)
        if len(toks) != n:
            _fail("bad_count", f"{w}.tokens has {len(toks)} entries but length is {n}")
        for i, tok in enumerate(toks):
            if not isinstance(tok, list) or len(tok) != 3:
                _fail("bad_field", f"{w}.tokens[{i}] must be [block, offset, live], got {_show(tok)}")
            b, off, live = tok
            if not _is_int(b) or not _is_int(off) or not isinstance(live, bool):
                _fail("bad_field", f"{w}.tokens[{i}] must hold two integers and a boolean live bit, got {_show(tok)}")
            if not 0 <= b < MAX_BLOCKS:
                _fail("out_of_range", f"{w}.tokens[{i}]: block {_show(b)} outside [0, {MAX_BLOCKS})")
            if not 0 <= off < S:
                _fail("out_of_range", f"{w}.tokens[{i}]: offset {_show(off)} outside [0, {S})")
            if live and b == 0:
                _fail("null_block", f"{w}.tokens[{i}]: live token in the null block 0")
            if live and b not in blocks:
                _fail("bad_count", f"{w}.tokens[{i}]: block {b} is not in the request's blocks")
        tb = r.get("tail_block")
        if tb is not None:
            if not _is_int(tb):
                _fail("bad_field", f"{w}.tail_block must be an integer or null, got {_show(tb)}")
            _int(tb, f"{w}.tail_block", 0, MAX_BLOCKS)
    return reqs


def _validate_digests(dg, k: int):
    if not isinstance(dg, dict):
        _fail("bad_field", f"plan.digests must be an object, got {type(dg).__name__}")
    m = dg.get("method")
    if m is not None and (not isinstance(m, str) or len(m) > 64):
        _fail("bad_field", f"plan.digests.method must be a short string, got {_show(m)}")
    for side in ("pre", "post"):
        v = _list(_need(dg, side, list, "plan.digests"), f"plan.digests.{side}", MAX_TOKENS)
        if len(v) != k:
            _fail("bad_count", f"plan.digests.{side} has {len(v)} entries for {k} moves")
        for i, x in enumerate(v):
            if x is not None:
                _int(x, f"plan.digests.{side}[{i}]", 0, 2 ** DIGEST_BITS)


def _validate_plan(snap, S):
    """Check ``snap["plan"]`` (block size ``S``); returns ``(request, moves)`` or raises SnapshotError."""
    plan = _need(snap, "plan", dict, "snapshot")
    _int(_need(plan, "id", int, "plan"), "plan.id", 0, MAX_ID)
    if "request" not in plan:
        _fail("missing_field", "plan.request is missing")
    req = _name(plan["request"], "plan.request")
    src = _block_list(_need(plan, "sources", list, "plan"), "plan.sources")
    dst = _block_list(_need(plan, "dests", list, "plan"), "plan.dests")
    if 0 in src or 0 in dst:
        _fail("null_block", "plan.sources/dests name the null block 0")
    if "fills" in plan:
        if 0 in _block_list(_need(plan, "fills", list, "plan"), "plan.fills"):
            _fail("null_block", "plan.fills names the null block 0")
    moves = _list(_need(plan, "moves", list, "plan"), "plan.moves", MAX_TOKENS)
    for i, mv in enumerate(moves):
        if not isinstance(mv, list) or len(mv) != 5 or not all(_is_int(x) for x in mv):
            _fail("bad_field", f"plan.moves[{i}] must be five integers, got {_show(mv)}")
        t, src_block, src_off, dst_block, dst_off = mv
        _int(t, f"plan.moves[{i}] token", 0, MAX_TOKENS)
        _int(src_block, f"plan.moves[{i}] source block", 0, MAX_BLOCKS)
        _int(dst_block, f"plan.moves[{i}] destination block", 0, MAX_BLOCKS)
        if not 0 <= src_off < S:
            _fail("out_of_range", f"plan.moves[{i}]: source offset {src_off} outside [0, {S})")
        if not 0 <= dst_off < S:
            _fail("out_of_range", f"plan.moves[{i}]: destination offset {dst_off} outside [0, {S})")
        if dst_block == 0:
            _fail("null_block", f"plan.moves[{i}] moves token {t} into the null block 0")
    if plan.get("digests") is not None:
        _validate_digests(plan["digests"], len(moves))
    return req, moves


def _validate_in_flight(snap) -> None:
    """Check every ``snap["in_flight"]`` plan entry or raise SnapshotError naming it."""
    for i, p in enumerate(_list(_need(snap, "in_flight", list, "snapshot"), "in_flight", MAX_PLANS)):
        w = f"in_flight[{i}]"
        if not isinstance(p, dict):
            _fail("bad_field", f"{w} must be an object, got {_show(p)}")
        _int(_need(p, "id", int, w), f"{w}.id", 0, MAX_ID)
        _block_list(_need(p, "sources", list, w), f"{w}.sources")
        _block_list(_need(p, "dests", list, w), f"{w}.dests")
        if "fills" in p:
            _block_list(_need(p, "fills", list, w), f"{w}.fills")
        if "request" not in p:
            _fail("missing_field", f"{w}.request is missing")
        _name(p["request"], f"{w}.request")


def _validate_schedule(snap, S) -> None:
    """Check ``snap["schedule"]`` events (kinds, fields, time order) or raise SnapshotError."""
    last = None
    n_slots = MAX_BLOCKS * S
    for i, ev in enumerate(_list(_need(snap, "schedule", list, "snapshot"), "schedule", MAX_EVENTS)):
        w = f"schedule[{i}]"
        if not isinstance(ev, dict):
            _fail("bad_field", f"{w} must be an object, got {_show(ev)}")
        t = _int(_need(ev, "t", int, w), f"{w}.t", 0, MAX_ID)
        kind = _need(ev, "kind", str, w)
        if kind not in EVENT_KINDS:
            _fail("bad_field", f"{w}.kind {_show(kind)} is not one of {sorted(EVENT_KINDS)}")
        if last is not None and t < last:
            _fail("bad_field", f"{w}.t={t} goes back in time (previous {last})")
        last = t
        if kind in ("launch", "fence", "apply"):
            _int(_need(ev, "plan", int, w), f"{w}.plan", 0, MAX_ID)
        if kind in ("read", "write", "alloc"):
            if "request" not in ev:
                _fail("missing_field", f"{w}.request is missing")
            _name(ev["request"], f"{w}.request")
        if kind in ("free", "alloc"):
            _block_list(_need(ev, "blocks", list, w), f"{w}.blocks")
        if kind == "read":
            tk = _int_list(_need(ev, "tokens", list, w), f"{w}.tokens", 0, MAX_TOKENS, MAX_TOKENS)
            sl = _int_list(_need(ev, "slots", list, w), f"{w}.slots", 0, n_slots, MAX_TOKENS)
            if len(tk) != len(sl):
                _fail("bad_count", f"{w}: {len(tk)} tokens but {len(sl)} slots")
        if kind == "write":
            _int(_need(ev, "token", int, w), f"{w}.token", 0, MAX_TOKENS)
            _int(_need(ev, "slot", int, w), f"{w}.slot", 0, n_slots)


def _validate_evicted(snap, moves, pre_n) -> None:
    """Check ``snap["evicted_in_flight"]``: ids < ``pre_n``, moved by the plan, no repeats."""
    ev_ids = _int_list(_need(snap, "evicted_in_flight", list, "snapshot"), "evicted_in_flight", 0, pre_n,
                       MAX_TOKENS)
    if ev_ids:
        moved = {mv[0] for mv in moves}
        seen = set()
        for i, t in enumerate(ev_ids):
            if t not in moved:
                _fail("bad_field", f"evicted_in_flight[{i}]: token {t} is not moved by the plan")
            if t in seen:
                _fail("bad_field", f"evicted_in_flight[{i}]: token {t} listed twice")
            seen.add(t)


def validate(snap) -> dict:
    """Check a snapshot's shape, types, ranges and internal consistency; returns it or
    raises :class:`SnapshotError` naming the field. Linear in the snapshot's size."""
    if not isinstance(snap, dict):
        _fail("bad_field", f"snapshot must be a JSON object, got {type(snap).__name__}")
    schema = snap.get("schema")
    if schema != SCHEMA:
        _fail("schema", f"schema: unknown version {_show(schema)} (expected {SCHEMA!r})")
    S = _need(snap, "block_size", int, "snapshot")
    if not 1 <= S <= MAX_BLOCK_SIZE:
        _fail("out_of_range", f"block_size = {_show(S)} outside [1, {MAX_BLOCK_SIZE}]")
    req, moves = _validate_plan(snap, S)
    pre = _validate_state(_need(snap, "pre", dict, "snapshot"), S, "pre")
    if req not in pre:
        _fail("missing_field", f"pre.requests has no entry for the plan's request {_show(req)}")
    pre_n = pre[req]["length"]
    if snap.get("post") is not None:
        post = _validate_state(_need(snap, "post", dict, "snapshot"), S, "post")
        if req not in post:
            _fail("missing_field", f"post.requests has no entry for the plan's request {_show(req)}")
        if post[req]["length"] < pre_n:  # requests may grow while a copy is in flight
            _fail("bad_count", f"post.requests[{_show(req)}].length {post[req]['length']} < pre length {pre_n}")
    _block_list(_need(snap, "shared_blocks", list, "snapshot"), "shared_blocks")
    _block_list(_need(snap, "headroom", list, "snapshot"), "headroom")
    _validate_in_flight(snap)
    _validate_schedule(snap, S)
    _validate_evicted(snap, moves, pre_n)
    if snap.get("dests_used") is not None:
        used = _block_list(snap["dests_used"], "dests_used")
        if len(set(used)) != len(used):
            _fail("bad_field", "dests_used names a block twice")
    return snap


def request_state(table, req_id, tail_block=None) -> dict:
    """One request's part of a snapshot state, read from a ``vtoken.TokenTable``."""
    slots, live = table.slots(req_id), table.live_mask(req_id)
    S = table.S
    return {
        "length": int(len(slots)),
        "blocks": table.blocks_of(req_id),
        "tail_block": tail_block,
        "tokens": [[int(s) // S, int(s) % S, bool(l)] for s, l in zip(slots.tolist(), live.tolist())],
    }


def save(snap: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(snap, indent=1, sort_keys=True, default=str))
    return path


def _no_constant(name):
    raise SnapshotError("bad_json", f"not JSON: {name} is not a number JSON allows")


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise SnapshotError("bad_json", f"not JSON this schema accepts: key {_show(k)} appears twice in one object")
        out[k] = v
    return out


def loads(data, where: str = "snapshot") -> dict:
    """Parse (bytes or str) and validate; every failure is a :class:`SnapshotError`."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        if len(data) > MAX_FILE_BYTES:
            _fail("too_large", f"{where}: {len(data)} bytes (limit {MAX_FILE_BYTES})")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise SnapshotError("bad_encoding", f"{where}: not UTF-8 (byte {e.start}: {e.reason})") from None
    elif isinstance(data, str):
        text = data
        if len(text) > MAX_FILE_BYTES:
            _fail("too_large", f"{where}: {len(text)} characters (limit {MAX_FILE_BYTES})")
    else:
        raise SnapshotError("bad_field", f"{where}: expected bytes or str, got {type(data).__name__}")
    try:
        snap = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except SnapshotError as e:
        raise SnapshotError(e.code, f"{where}: {str(e).split('] ', 1)[-1]}") from None
    except json.JSONDecodeError as e:
        raise SnapshotError("bad_json", f"{where}: not JSON ({e})") from None
    except RecursionError:
        raise SnapshotError("too_deep", f"{where}: nested too deeply to be a snapshot") from None
    except ValueError as e:  # e.g. an integer longer than Python's int-string conversion limit
        raise SnapshotError("bad_json", f"{where}: not JSON this schema accepts ({_show(str(e))})") from None
    except MemoryError:
        raise SnapshotError("too_large", f"{where}: too large to parse") from None
    return validate(snap)


def load(path) -> dict:
    """Read, parse and validate a snapshot file; every failure (unreadable, a directory,
    too large, not UTF-8, not JSON, malformed) is a :class:`SnapshotError`."""
    p = Path(path)
    try:
        if p.is_dir():
            _fail("unreadable", f"{path}: is a directory, not a snapshot file")
        size = p.stat().st_size
        if size > MAX_FILE_BYTES:
            _fail("too_large", f"{path}: {size} bytes (limit {MAX_FILE_BYTES})")
        data = p.read_bytes()
    except OSError as e:
        raise SnapshotError("unreadable", f"{path}: cannot read ({type(e).__name__}: {e.strerror or e})") from None
    return loads(data, where=str(path))
