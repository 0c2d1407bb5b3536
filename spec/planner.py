"""Reference contract of the reclamation planner (paper section 3.3 Stage 3, invariant I4).

Written from the paper, not from ``vtoken/planner.py``: plain data in, plain data out,
small and slow on purpose.

A *view* is what a plan for one request is made from::

    {"S": block size, "num_blocks": N, "max_sources": B,
     "tokens":    [[block, offset, live], ...],   # the request's tokens, by logical id
     "blocks":    [block, ...],                   # blocks the request references
     "refs":      {block: n},                     # requests referencing it (> 1: shared prefix)
     "tail":      block or None,                  # block holding the request's last position
     "in_flight": [block, ...],                   # sources, destinations and fills of plans still copying
     "headroom":  [block, ...],                   # reserved blocks, the only fresh destinations
     "excluded":  [block, ...],                   # optional: blocks the caller forbids as sources
                                                  # and fills (the substrate shares them, or does
                                                  # not hold them for this request: vLLM's
                                                  # ref_cnt != 1)
     "unfillable": [block, ...],                  # optional: blocks a plan may empty but never
                                                  # fill: their bytes must stay as they are (a
                                                  # prefix-cache hash describes them)
     "in_place":  bool}                           # optional, absent == False: fills allowed

A *plan* is ``{"sources": [block], "fills": [block], "dests": [block], "moves": [[token,
src_block, src_offset, dst_block, dst_offset], ...]}`` (``fills`` optional, absent ==
``[]``). Its reduction is ``len(sources) - len(dests)``: fills cost nothing. A *hole* of a
block is a slot of it holding no live token of the request (before the plan); a fill is
one of the request's own private blocks whose holes take moved tokens (in-place
compaction). With ``in_place`` False (the paper's out-of-place compaction) a plan has no
fills.

The rules (each violation is reported as ``"<code>: <detail>"``):

Moves agree with the view
  ``bad_move`` not five integers; ``unknown_token``; ``dead_token``; ``duplicate_token``
  (each token moves once); ``wrong_source`` (the source is not the token's location);
  ``move_not_from_source`` (the source block is not one of the plan's sources).
Sources (I4: shared-prefix blocks never move; no overlap with in-flight plans)
  ``duplicate_source``; ``too_many_sources`` (more than B); ``source_not_owned``;
  ``source_shared`` (refs != 1); ``source_tail`` (still being written);
  ``source_in_flight``; ``source_excluded``; ``source_not_emptied`` (a live token of the request in a source
  is not moved: a source must end empty, or it cannot be freed).
Fills (the same test as a source, and neither a source nor a destination)
  ``fill_not_allowed`` (any fill when the view is not ``in_place``); ``null_fill`` (the
  null block; its other rules are not asked); ``duplicate_fill``; ``fill_not_owned``;
  ``fill_shared`` (refs != 1); ``fill_tail``; ``fill_in_flight``; ``fill_excluded``;
  ``fill_unfillable``; ``fill_is_source``; ``fill_is_dest``.
Destinations (fresh blocks from the evacuation headroom) and slots
  ``duplicate_dest``; ``null_dest``; ``dest_out_of_range``; ``dest_not_headroom``;
  ``dest_in_flight``; ``move_to_unlisted_dest`` (the block is neither a fill nor a
  destination); ``bad_offset``; ``duplicate_slot``; ``slot_occupied`` (a move into a fill
  lands on a slot holding a live token of the request, not on a hole).
Placement (the one rule: holes of the fills, then whole destinations, in logical order)
  The target sequence is the holes of ``fills[0]`` by ascending offset, the holes of
  ``fills[1]``, ... (each fill once), then ``(dests[0], 0..S-1)``, ``(dests[1], 0..S-1)``,
  ...; ``fill_order``: the k-th moved token in logical order goes to the k-th target;
  ``fill_count``: every fill receives at least one token; ``dest_count``: exactly
  ``ceil(max(0, moved - holes of the fills) / S)`` destinations are listed. With no fills
  this is the paper's rule (``dests[k // S]`` at offset ``k % S``, ``ceil(moved / S)``
  destinations).
Reduction (I4: reclamation that frees nothing is refused)
  ``not_reducing``: ``len(sources) > len(dests)`` must hold.

Owns: nothing (pure functions over plain data).
May call: collections, itertools; never the system, invariants/, fuzz/ or reports/.
Costs: ``plan_errors`` O(tokens + moves + (fills + dests) S); ``best_reduction`` brute force over
multisets of live counts (combinatorial in ``max_sources``): small fuzz sizes only.
"""

from __future__ import annotations

from collections import Counter
from itertools import combinations_with_replacement

NULL_BLOCK = 0


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def eligible_sources(view) -> list:
    """Blocks a plan may empty (or fill, in place): the request's own, unshared, not the
    tail, not in flight, not excluded."""
    flying = set(view["in_flight"]) | set(view.get("excluded", ()))
    return sorted(b for b in set(view["blocks"])
                  if view["refs"].get(b, 0) == 1 and b != view["tail"] and b not in flying)


def live_in(view, block) -> int:
    """Live tokens of the request in ``block``."""
    return sum(1 for b, _, live in view["tokens"] if live and b == block)


def holes_in(view, block) -> list:
    """The holes of ``block``: its offsets holding no live token of the request, ascending."""
    taken = {o for b, o, live in view["tokens"] if live and b == block}
    return [o for o in range(view["S"]) if o not in taken]


def _move_errors(toks, sources, moves) -> tuple:
    """The move rules: ``(errors, the well-formed moves, the tokens moved)``."""
    errs, good, moved = [], [], set()
    for i, mv in enumerate(moves):
        mv = list(mv)
        if len(mv) != 5 or not all(isinstance(x, int) and not isinstance(x, bool) for x in mv):
            errs.append(f"bad_move: move #{i} {mv}")
            continue
        t, sb, so, db, do = mv
        if not 0 <= t < len(toks):
            errs.append(f"unknown_token: move #{i} token {t}")
            continue
        b, o, live = toks[t]
        if not live:
            errs.append(f"dead_token: move #{i} token {t}")
        if t in moved:
            errs.append(f"duplicate_token: move #{i} token {t}")
        moved.add(t)
        if (sb, so) != (b, o):
            errs.append(f"wrong_source: move #{i} token {t} is at ({b}, {o}), not ({sb}, {so})")
        if sb not in sources:
            errs.append(f"move_not_from_source: move #{i} from block {sb}")
        good.append(mv)
    return errs, good, moved


def _private_errors(view, kind, b, private) -> list:
    """The rules of a source or a fill ``b``: the request's own, unshared, not the tail, idle, allowed."""
    mine, flying, excluded = private
    errs = []
    if b not in mine:
        errs.append(f"{kind}_not_owned: block {b}")
    elif view["refs"].get(b, 0) != 1:
        errs.append(f"{kind}_shared: block {b} has {view['refs'].get(b, 0)} references")
    if b == view["tail"]:
        errs.append(f"{kind}_tail: block {b}")
    if b in flying:
        errs.append(f"{kind}_in_flight: block {b}")
    if b in excluded:
        errs.append(f"{kind}_excluded: block {b}")
    return errs


def _source_errors(view, sources, moved, private) -> list:
    """The source rules (``moved``: the tokens the plan moves)."""
    errs = []
    if len(set(sources)) != len(sources):
        errs.append(f"duplicate_source: {sources}")
    if len(sources) > view["max_sources"]:
        errs.append(f"too_many_sources: {len(sources)} > B={view['max_sources']}")
    for b in sources:
        errs += _private_errors(view, "source", b, private)
    for t, (b, _, live) in enumerate(view["tokens"]):
        if live and b in sources and t not in moved:
            errs.append(f"source_not_emptied: live token {t} stays in source {b}")
    return errs


def _fill_errors(view, fills, sources, dests, private) -> list:
    """The fill rules: the request's own private blocks, as a source would be, but neither a source nor a dest."""
    errs = []
    if fills and not view.get("in_place", False):
        errs.append(f"fill_not_allowed: fills {fills}: the view is out-of-place only")
    if len(set(fills)) != len(fills):
        errs.append(f"duplicate_fill: {fills}")
    for b in dict.fromkeys(fills):
        if b == NULL_BLOCK:
            errs.append("null_fill: the null block 0")
            continue
        errs += _private_errors(view, "fill", b, private)
        if b in set(view.get("unfillable", ())):
            errs.append(f"fill_unfillable: block {b}: its bytes must stay as they are")
        if b in sources:
            errs.append(f"fill_is_source: block {b}")
        if b in dests:
            errs.append(f"fill_is_dest: block {b}")
    return errs


def _dest_errors(dests, N, headroom, flying) -> list:
    """The destination rules: fresh blocks of ``[1, N)`` from the evacuation headroom, not in flight."""
    errs = []
    if len(set(dests)) != len(dests):
        errs.append(f"duplicate_dest: {dests}")
    for b in dests:
        if b == NULL_BLOCK:
            errs.append("null_dest: the null block 0")
        elif not 0 < b < N:
            errs.append(f"dest_out_of_range: block {b}")
        if b not in headroom:
            errs.append(f"dest_not_headroom: block {b}")
        if b in flying:
            errs.append(f"dest_in_flight: block {b}")
    return errs


def _slot_errors(good, dests, holes, S) -> list:
    """The slot rules of the well-formed moves ``good`` (``holes``: each fill's holes)."""
    errs, slots = [], set()
    for t, _, _, db, do in good:
        if db not in dests and db not in holes:
            errs.append(f"move_to_unlisted_dest: token {t} -> block {db}")
        if not 0 <= do < S:
            errs.append(f"bad_offset: token {t} -> offset {do}")
        if db in holes and 0 <= do < S and do not in holes[db]:
            errs.append(f"slot_occupied: token {t} -> ({db}, {do}): a live token of the request is there")
        if (db, do) in slots:
            errs.append(f"duplicate_slot: token {t} -> ({db}, {do})")
        slots.add((db, do))
    return errs


def _placement_errors(good, dests, holes, S) -> list:
    """The placement rules: the fills' holes, then whole destinations, in logical order."""
    errs = []
    targets = [(b, o) for b, hs in holes.items() for o in hs] + [(d, o) for d in dests for o in range(S)]
    for k, (t, _, _, db, do) in enumerate(sorted(good)):
        want = targets[k] if k < len(targets) else None
        if (db, do) != want:
            errs.append(f"fill_order: token {t} (#{k} in logical order) -> ({db}, {do}), expected {want}")
    into = {mv[3] for mv in good}
    for b in holes:
        if b not in into:
            errs.append(f"fill_count: fill {b} receives no token")
    n_holes = sum(len(hs) for hs in holes.values())
    if len(dests) != ceil_div(max(0, len(good) - n_holes), S):
        errs.append(f"dest_count: {len(dests)} destinations for {len(good)} moved tokens, {n_holes} holes in the "
                    f"fills (S={S})")
    return errs


def plan_errors(view, plan) -> list:
    """Every rule ``plan`` breaks, given ``view``; ``[]`` for a valid plan."""
    S, N, toks = view["S"], view["num_blocks"], view["tokens"]
    mine, flying, headroom = set(view["blocks"]), set(view["in_flight"]), set(view["headroom"])
    excluded = set(view.get("excluded", ()))
    sources, dests = list(plan["sources"]), list(plan["dests"])
    fills = list(plan.get("fills", []))
    private = (mine, flying, excluded)  # a source or a fill: one of mine, not flying, not excluded

    errs, good, moved = _move_errors(toks, sources, plan["moves"])  # moves agree with the view
    errs += _source_errors(view, sources, moved, private)
    errs += _fill_errors(view, fills, sources, dests, private)
    errs += _dest_errors(dests, N, headroom, flying)
    holes = {b: holes_in(view, b) for b in dict.fromkeys(fills)}  # each fill once, in fill order
    errs += _slot_errors(good, dests, holes, S)
    errs += _placement_errors(good, dests, holes, S)
    # reduction
    if not len(sources) > len(dests):
        errs.append(f"not_reducing: {len(sources)} sources, {len(dests)} destinations")
    return errs


def best_reduction(view, max_dests: int) -> int:
    """The largest ``len(sources) - len(dests)`` of any valid plan using at most ``max_dests``
    destinations; 0 when no valid plan exists (none reduces the block count).

    Brute force over the candidate source sets. A valid plan for source set X moves all of
    X's live tokens, T(X). Out of place it then needs exactly ceil(T(X) / S) destinations;
    in place (``view["in_place"]``) the holes of the other fillable eligible blocks, H(F \\ X)
    (F: the eligible blocks not ``unfillable``), take tokens first (any of them may be a fill),
    so it needs ceil(max(0, T(X) - H(F \\ X)) / S). H(F \\ X) = H(F) - (|X & F| S - T(X & F)),
    so the reduction depends only on |X|, T(X) and which of X are fillable: blocks with the
    same live count and the same fillability are interchangeable, and it is enough to try
    every sub-multiset of the eligible blocks' (live count, fillable) pairs of size 1..B (at
    most a few hundred for the fuzzer's sizes). (Without unfillable blocks, in place, the best
    is min(B, floor(H(E) / S)) with no destination; the brute force does not assume it.)
    """
    S, B = view["S"], view["max_sources"]
    eligible = eligible_sources(view)
    unfillable = set(view.get("unfillable", ()))
    have = Counter((live_in(view, b), b not in unfillable) for b in eligible)
    in_place = view.get("in_place", False)
    holes_fillable = sum(S - live_in(view, b) for b in eligible if b not in unfillable)
    best = 0
    for k in range(1, min(B, sum(have.values())) + 1):
        for pick in combinations_with_replacement(sorted(have), k):
            if any(pick.count(n) > have[n] for n in set(pick)):
                continue  # not that many blocks with this live count and fillability
            moved = sum(n for n, _ in pick)
            room = holes_fillable - sum(S - n for n, fillable in pick if fillable) if in_place else 0
            need = ceil_div(max(0, moved - room), S)
            if need <= max_dests:
                best = max(best, k - need)
    return best
