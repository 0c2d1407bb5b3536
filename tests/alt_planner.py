"""A second planner, written from ``vtoken/spec/planner.py``'s docstring (not from vtoken/):
the planner protocol (``vtoken.fuzz.protocol.PlannerProtocol``) checked on code vtoken did
not write, and a planted-bug variant the planner contract machine must catch.

The rule (from the spec): a plan empties source blocks the request alone references, that
are not its tail nor in flight; it needs ceil(live tokens of the sources / S) destinations
from the headroom, filled one after another in logical order; its reduction is sources
minus destinations. For k sources the fewest live tokens are the k blocks with the fewest,
so trying every k over the blocks sorted by live count finds the best plan.

Planted-bug variants: ``TailMovingAltPlanner`` (moves the tail), ``BlindAltPlanner`` (ignores
``in_flight`` and ``excluded``), ``InFlightBlindAltPlanner`` and ``ExcludedBlindAltPlanner``
(one of the two each).
"""


class AltPlanner:
    OPTIMAL = True

    def propose(self, view, max_dests):
        S = view["S"]
        toks = view["tokens"]
        banned = set(view["in_flight"]) | set(view.get("excluded", []))
        live_in = {}
        for b, _, live in toks:
            if live:
                live_in[b] = live_in.get(b, 0) + 1
        eligible = [b for b in view["blocks"]
                    if view["refs"].get(b, 0) == 1 and b != view["tail"] and b not in banned]
        eligible.sort(key=lambda b: (live_in.get(b, 0), b))
        eligible = eligible[: view["max_sources"]]
        room = min(max_dests, len(view["headroom"]))
        best, best_k, total = 0, 0, 0
        for k, b in enumerate(eligible, 1):
            total += live_in.get(b, 0)
            need = (total + S - 1) // S
            if need <= room and k - need > best:
                best, best_k = k - need, k
        if best <= 0:
            return None
        sources = sorted(eligible[:best_k])
        moved = [t for t, (b, _, live) in enumerate(toks) if live and b in sources]
        dests = list(view["headroom"][: (len(moved) + S - 1) // S])
        moves = [[t, toks[t][0], toks[t][1], dests[i // S], i % S] for i, t in enumerate(moved)]
        return {"sources": sources, "dests": dests, "moves": moves}


class TailMovingAltPlanner(AltPlanner):
    """Planted bug: forgets that the tail block is still being written."""

    def propose(self, view, max_dests):
        return super().propose(dict(view, tail=None), max_dests)


class BlindAltPlanner(AltPlanner):
    """Planted bug: ignores what the caller forbids beyond the table, the blocks of plans in
    flight (``in_flight``) and the blocks it excludes (``excluded``: shared in its own pool)."""

    def propose(self, view, max_dests):
        return super().propose(dict(view, in_flight=[], excluded=[]), max_dests)


class InFlightBlindAltPlanner(AltPlanner):
    """Planted bug: ignores ``in_flight`` only (plans a block a copy is still moving)."""

    def propose(self, view, max_dests):
        return super().propose(dict(view, in_flight=[]), max_dests)


class ExcludedBlindAltPlanner(AltPlanner):
    """Planted bug: ignores ``excluded`` only (moves a block the caller's pool shares)."""

    def propose(self, view, max_dests):
        return super().propose(dict(view, excluded=[]), max_dests)
