"""Plan snapshots: the JSON record of what a plan was made from and what it did.

A snapshot is the unit the Z3 checks take, that a fuzz failure is minimised to, that an
audit records, and that can be replayed. Schema ``vtoken.plan-snapshot/1``::

    {
      "schema": "vtoken.plan-snapshot/1",
      "block_size": S,
      "plan": {"id": int, "request": str, "sources": [block], "dests": [block],
               "moves": [[token, src_block, src_offset, dst_block, dst_offset], ...]},
      "pre":  {"requests": {req: {"length": n, "blocks": [block], "tail_block": b | null,
                                  "tokens": [[block, offset, live], ...]   # by token id
                                  }}},
      "post": {"requests": {...same shape...}} | null       # null until the plan is applied
      "shared_blocks": [block],        # referenced by more than one request at plan time
      "headroom": [block],             # reserved blocks available to the planner
      "in_flight": [{"id", "request", "sources", "dests"}],   # other plans still copying
      "schedule": [event, ...]         # in time order, see below
    }

Events carry an integer time ``t`` (a logical clock, strictly increasing in the order
things happened; several per scheduler step) and a ``kind``:

- ``launch``  {plan}: the copy was issued (on the relocation stream). Its completion time
  is not in the record: the checks leave it symbolic, after ``launch``.
- ``fence``   {plan}: a wait on the copy's event (device-side before attention, or a host
  query that returned done): every later event happens after the copy completed.
- ``apply``   {plan}: the table was updated (slot mapping now points at destinations).
- ``free``    {blocks}: blocks returned to the allocator.
- ``alloc``   {request, blocks}: blocks handed to a request.
- ``read``    {request, tokens, slots}: attention read these tokens at these slots.
- ``write``   {request, token, slot}: a new token's K/V was written at ``slot``.

Every field is checked by :func:`validate`, which raises :class:`SnapshotError` naming
the field; the checkers call it first so a malformed snapshot never crashes them.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import SnapshotError

SCHEMA = "vtoken.plan-snapshot/1"
EVENT_KINDS = {"launch", "fence", "apply", "free", "alloc", "read", "write"}


def _need(obj, key, typ, where):
    if not isinstance(obj, dict) or key not in obj:
        raise SnapshotError("missing_field", f"{where}.{key} is missing")
    v = obj[key]
    if typ is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise SnapshotError("bad_field", f"{where}.{key} must be an integer, got {v!r}")
    if typ is not int and not isinstance(v, typ):
        raise SnapshotError("bad_field", f"{where}.{key} must be {typ.__name__}, got {type(v).__name__}")
    return v


def _int_list(v, where):
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise SnapshotError("bad_field", f"{where} must be a list of integers")
    return v


def _validate_state(state, S, where):
    reqs = _need(state, "requests", dict, where)
    for rid, r in reqs.items():
        w = f"{where}.requests[{rid!r}]"
        n = _need(r, "length", int, w)
        _int_list(_need(r, "blocks", list, w), f"{w}.blocks")
        toks = _need(r, "tokens", list, w)
        if len(toks) != n:
            raise SnapshotError("bad_count", f"{w}.tokens has {len(toks)} entries but length is {n}")
        for i, tok in enumerate(toks):
            if not isinstance(tok, list) or len(tok) != 3:
                raise SnapshotError("bad_field", f"{w}.tokens[{i}] must be [block, offset, live]")
            b, off, live = tok
            if not isinstance(b, int) or not isinstance(off, int) or not isinstance(live, (bool, int)):
                raise SnapshotError("bad_field", f"{w}.tokens[{i}] must hold integers and a live bit")
            if live and b == 0:
                raise SnapshotError("null_block", f"{w}.tokens[{i}]: live token in the null block 0")
            if live and not 0 <= off < S:
                raise SnapshotError("bad_field", f"{w}.tokens[{i}]: offset {off} outside [0, {S})")
            if live and b not in r["blocks"]:
                raise SnapshotError("bad_count", f"{w}.tokens[{i}]: block {b} is not in the request's blocks")
        tb = r.get("tail_block")
        if tb is not None and (isinstance(tb, bool) or not isinstance(tb, int)):
            raise SnapshotError("bad_field", f"{w}.tail_block must be an integer or null")


def validate(snap) -> dict:
    """Check a snapshot's shape and internal consistency; returns it or raises SnapshotError."""
    if not isinstance(snap, dict):
        raise SnapshotError("bad_field", "snapshot must be a JSON object")
    schema = snap.get("schema")
    if schema != SCHEMA:
        raise SnapshotError("schema", f"schema: unknown version {schema!r} (expected {SCHEMA!r})")
    S = _need(snap, "block_size", int, "snapshot")
    if S < 1:
        raise SnapshotError("bad_field", f"block_size must be positive, got {S}")
    plan = _need(snap, "plan", dict, "snapshot")
    _need(plan, "id", int, "plan")
    if "request" not in plan:
        raise SnapshotError("missing_field", "plan.request is missing")
    if not isinstance(plan["request"], (str, int)) or isinstance(plan["request"], bool):
        raise SnapshotError("bad_field", f"plan.request must be a string or an integer, got {plan['request']!r}")
    src = _int_list(_need(plan, "sources", list, "plan"), "plan.sources")
    dst = _int_list(_need(plan, "dests", list, "plan"), "plan.dests")
    moves = _need(plan, "moves", list, "plan")
    for i, mv in enumerate(moves):
        if not isinstance(mv, list) or len(mv) != 5 or any(isinstance(x, bool) or not isinstance(x, int) for x in mv):
            raise SnapshotError("bad_field", f"plan.moves[{i}] must be five integers")
        if mv[3] == 0:
            raise SnapshotError("null_block", f"plan.moves[{i}] moves token {mv[0]} into the null block 0")
    if 0 in src or 0 in dst:
        raise SnapshotError("null_block", "plan.sources/dests name the null block 0")
    _validate_state(_need(snap, "pre", dict, "snapshot"), S, "pre")
    if plan["request"] not in snap["pre"]["requests"]:
        raise SnapshotError("missing_field", f"pre.requests has no entry for the plan's request {plan['request']!r}")
    if snap.get("post") is not None:
        _validate_state(snap["post"], S, "post")
        pre_n = snap["pre"]["requests"][plan["request"]]["length"]
        post_r = snap["post"]["requests"].get(plan["request"])
        if post_r is not None and post_r["length"] < pre_n:  # requests may grow while a copy is in flight
            raise SnapshotError("bad_count", f"post.requests[{plan['request']!r}].length {post_r['length']} < pre length {pre_n}")
    _int_list(_need(snap, "shared_blocks", list, "snapshot"), "shared_blocks")
    _int_list(_need(snap, "headroom", list, "snapshot"), "headroom")
    for i, p in enumerate(_need(snap, "in_flight", list, "snapshot")):
        _need(p, "id", int, f"in_flight[{i}]")
        _int_list(_need(p, "sources", list, f"in_flight[{i}]"), f"in_flight[{i}].sources")
        _int_list(_need(p, "dests", list, f"in_flight[{i}]"), f"in_flight[{i}].dests")
        if "request" not in p:
            raise SnapshotError("missing_field", f"in_flight[{i}].request is missing")
    last = None
    for i, ev in enumerate(_need(snap, "schedule", list, "snapshot")):
        t = _need(ev, "t", int, f"schedule[{i}]")
        kind = _need(ev, "kind", str, f"schedule[{i}]")
        if kind not in EVENT_KINDS:
            raise SnapshotError("bad_field", f"schedule[{i}].kind {kind!r} is not one of {sorted(EVENT_KINDS)}")
        if last is not None and t < last:
            raise SnapshotError("bad_field", f"schedule[{i}].t={t} goes back in time (previous {last})")
        last = t
        if kind in ("free", "alloc"):
            _int_list(_need(ev, "blocks", list, f"schedule[{i}]"), f"schedule[{i}].blocks")
        if kind == "read":
            tk = _int_list(_need(ev, "tokens", list, f"schedule[{i}]"), f"schedule[{i}].tokens")
            sl = _int_list(_need(ev, "slots", list, f"schedule[{i}]"), f"schedule[{i}].slots")
            if len(tk) != len(sl):
                raise SnapshotError("bad_count", f"schedule[{i}]: {len(tk)} tokens but {len(sl)} slots")
        if kind == "write":
            _need(ev, "token", int, f"schedule[{i}]")
            _need(ev, "slot", int, f"schedule[{i}]")
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


def load(path) -> dict:
    """Load and validate; a snapshot that is not JSON is a SnapshotError too."""
    try:
        snap = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise SnapshotError("bad_json", f"{path}: not JSON ({e})") from None
    return validate(snap)
