"""Reference contract of the reclamation planner (paper section 3.3 Stage 3, invariant I4).

Written from the paper, not from ``vtoken/planner.py``: plain data in, plain data out,
small and slow on purpose.

A *view* is what a plan for one request is made from::

    {"S": block size, "num_blocks": N, "max_sources": B,
     "tokens":    [[block, offset, live], ...],   # the request's tokens, by logical id
     "blocks":    [block, ...],                   # blocks the request references
     "refs":      {block: n},                     # requests referencing it (> 1: shared prefix)
     "tail":      block or None,                  # block holding the request's last position
     "in_flight": [block, ...],                   # sources and destinations of plans still copying
     "headroom":  [block, ...],                   # reserved blocks, the only destinations
     "excluded":  [block, ...]}                   # optional: blocks the caller forbids as sources
                                                  # (the substrate shares them, or does not hold
                                                  # them for this request: vLLM's ref_cnt != 1)

A *plan* is ``{"sources": [block], "dests": [block], "moves": [[token, src_block,
src_offset, dst_block, dst_offset], ...]}``. Its reduction is ``len(sources) - len(dests)``.

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
Destinations (out-of-place compaction into the evacuation headroom)
  ``duplicate_dest``; ``null_dest``; ``dest_out_of_range``; ``dest_not_headroom``;
  ``dest_in_flight``; ``move_to_unlisted_dest``; ``bad_offset``; ``duplicate_slot``.
Placement (fill each destination completely, one after another, in logical order)
  ``fill_order``: the k-th moved token in logical order goes to ``dests[k // S]`` at
  offset ``k % S``; ``dest_count``: exactly ``ceil(moved / S)`` destinations are listed.
Reduction (I4: reclamation that frees nothing is refused)
  ``not_reducing``: ``len(sources) > len(dests)`` must hold.

Owns: nothing (pure functions over plain data).
May call: collections, itertools; never the system, invariants/, fuzz/ or reports/.
Costs: ``plan_errors`` O(tokens + moves); ``best_reduction`` brute force over multisets of live
counts (combinatorial in ``max_sources``): small fuzz sizes only.
"""

from __future__ import annotations

from collections import Counter
from itertools import combinations_with_replacement

NULL_BLOCK = 0


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def eligible_sources(view) -> list:
    """Blocks a plan may empty: the request's own, unshared, not the tail, not in flight."""
    flying = set(view["in_flight"]) | set(view.get("excluded", ()))
    return sorted(b for b in set(view["blocks"])
                  if view["refs"].get(b, 0) == 1 and b != view["tail"] and b not in flying)


def live_in(view, block) -> int:
    """Live tokens of the request in ``block``."""
    return sum(1 for b, _, live in view["tokens"] if live and b == block)


def plan_errors(view, plan) -> list:
    """Every rule ``plan`` breaks, given ``view``; ``[]`` for a valid plan."""
    S, N, toks = view["S"], view["num_blocks"], view["tokens"]
    mine, flying, headroom = set(view["blocks"]), set(view["in_flight"]), set(view["headroom"])
    sources, dests = list(plan["sources"]), list(plan["dests"])
    errs = []

    def bad(code, detail):
        errs.append(f"{code}: {detail}")

    # -- moves agree with the view
    good, moved = [], set()
    for i, mv in enumerate(plan["moves"]):
        mv = list(mv)
        if len(mv) != 5 or not all(isinstance(x, int) and not isinstance(x, bool) for x in mv):
            bad("bad_move", f"move #{i} {mv}")
            continue
        t, sb, so, db, do = mv
        if not 0 <= t < len(toks):
            bad("unknown_token", f"move #{i} token {t}")
            continue
        b, o, live = toks[t]
        if not live:
            bad("dead_token", f"move #{i} token {t}")
        if t in moved:
            bad("duplicate_token", f"move #{i} token {t}")
        moved.add(t)
        if (sb, so) != (b, o):
            bad("wrong_source", f"move #{i} token {t} is at ({b}, {o}), not ({sb}, {so})")
        if sb not in sources:
            bad("move_not_from_source", f"move #{i} from block {sb}")
        good.append(mv)

    # -- sources
    if len(set(sources)) != len(sources):
        bad("duplicate_source", f"{sources}")
    if len(sources) > view["max_sources"]:
        bad("too_many_sources", f"{len(sources)} > B={view['max_sources']}")
    for b in sources:
        if b not in mine:
            bad("source_not_owned", f"block {b}")
        elif view["refs"].get(b, 0) != 1:
            bad("source_shared", f"block {b} has {view['refs'].get(b, 0)} references")
        if b == view["tail"]:
            bad("source_tail", f"block {b}")
        if b in flying:
            bad("source_in_flight", f"block {b}")
        if b in set(view.get("excluded", ())):
            bad("source_excluded", f"block {b}")
    for t, (b, _, live) in enumerate(toks):
        if live and b in sources and t not in moved:
            bad("source_not_emptied", f"live token {t} stays in source {b}")

    # -- destinations
    if len(set(dests)) != len(dests):
        bad("duplicate_dest", f"{dests}")
    for b in dests:
        if b == NULL_BLOCK:
            bad("null_dest", "the null block 0")
        elif not 0 < b < N:
            bad("dest_out_of_range", f"block {b}")
        if b not in headroom:
            bad("dest_not_headroom", f"block {b}")
        if b in flying:
            bad("dest_in_flight", f"block {b}")
    slots = set()
    for t, _, _, db, do in good:
        if db not in dests:
            bad("move_to_unlisted_dest", f"token {t} -> block {db}")
        if not 0 <= do < S:
            bad("bad_offset", f"token {t} -> offset {do}")
        if (db, do) in slots:
            bad("duplicate_slot", f"token {t} -> ({db}, {do})")
        slots.add((db, do))

    # -- placement: fill destinations completely, one after another, in logical order
    for k, (t, _, _, db, do) in enumerate(sorted(good)):
        want = (dests[k // S], k % S) if k // S < len(dests) else None
        if (db, do) != want:
            bad("fill_order", f"token {t} (#{k} in logical order) -> ({db}, {do}), expected {want}")
    if len(dests) != ceil_div(len(good), S):
        bad("dest_count", f"{len(dests)} destinations for {len(good)} moved tokens (S={S})")

    # -- reduction
    if not len(sources) > len(dests):
        bad("not_reducing", f"{len(sources)} sources, {len(dests)} destinations")
    return errs


def best_reduction(view, max_dests: int) -> int:
    """The largest ``len(sources) - len(dests)`` of any valid plan using at most ``max_dests``
    destinations; 0 when no valid plan exists (none reduces the block count).

    Brute force over the candidate source sets. A valid plan for source set X moves all of
    X's live tokens, T(X), and then needs exactly ceil(T(X) / S) destinations, so its
    reduction depends only on |X| and T(X). Blocks with the same live count are therefore
    interchangeable, and it is enough to try every sub-multiset of the eligible blocks'
    live counts of size 1..B (at most a few hundred for the fuzzer's sizes).
    """
    S, B = view["S"], view["max_sources"]
    have = Counter(live_in(view, b) for b in eligible_sources(view))
    best = 0
    for k in range(1, min(B, sum(have.values())) + 1):
        for pick in combinations_with_replacement(sorted(have), k):
            if any(pick.count(n) > have[n] for n in set(pick)):
                continue  # not that many blocks with this live count
            need = ceil_div(sum(pick), S)
            if need <= max_dests:
                best = max(best, k - need)
    return best
