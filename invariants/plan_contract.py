"""The planner contract (``vtoken.spec.planner``) checked on a live proposal, from any path.

The vLLM adapter and the machines hand every proposal to :func:`check_proposal` before it
launches (the adapter through its ``plan_hook``): the view is rebuilt from the table's
public read API, then the reference rules (``plan_errors``) and optimality
(``best_reduction`` over the same headroom) are asked. :func:`proposal_violations` returns
what broke as :class:`~vtoken.invariants.violation.Violation` (invariant ``plan_contract``),
one function per rule: ``contract`` (the reference planner's rules) and ``optimal`` (the
best reduction; asked only of a plan the contract accepts); :func:`check_proposal` is its
raising form (the first of them; it returns the view). ``in_place`` is the implementation's
``PlannerConfig.in_place`` (the view's mode: fills allowed); the proposal's ``fills``
(absent: none) go into the plan, and ``in_flight`` must list every in-flight plan's
sources, destinations and fills.

What this cannot see: a proposal only, before launch -- nothing of its copy, apply, frees
or end (the snapshot checkers and ``relocation_hash`` see those); it trusts the ``in_flight``
list the caller passes (a plan left out is not checked against); optimality only against
the reference's own brute force over the same headroom; the K/V bytes not at all.

Owns: nothing (a pure check).
May call: vtoken.spec.planner, invariants.table_checks, invariants.violation; the table's public read API.
Costs: O(request length) per plan, plus ``best_reduction``'s brute force: a check mode, not a hot
path.
"""

from __future__ import annotations

from vtoken.spec.planner import best_reduction, plan_errors

from .table_checks import InvariantViolation
from .violation import Violation, raise_first

RULES = ("contract", "optimal")


def view_of(table, req_id, *, tail, headroom, max_sources: int, in_flight=(), excluded=(),
            in_place: bool = False, unfillable=()) -> dict:
    """The spec planner's view of one request, read through the table's public API
    (``in_flight``: the blocks of the plans still copying, their fills included)."""
    S = table.S
    slots, live = table.slots(req_id), table.live_mask(req_id)
    blocks = table.blocks_of(req_id)
    return {
        "S": S, "num_blocks": table.num_blocks, "max_sources": int(max_sources),
        "tokens": [[int(s) // S, int(s) % S, bool(l)] for s, l in zip(slots.tolist(), live.tolist())],
        "blocks": blocks,
        "refs": {b: table.block_refs(b) for b in blocks},
        "tail": tail,
        "in_flight": sorted(int(b) for b in in_flight),
        "headroom": [int(b) for b in headroom],
        "excluded": sorted(int(b) for b in excluded),
        "unfillable": sorted(int(b) for b in unfillable),
        "in_place": bool(in_place),
    }


def _contract(view: dict, plan: dict, req_id):
    errs = plan_errors(view, plan)
    if errs:
        return Violation("plan_contract", f"request {req_id!r}: plan breaks the contract: {errs}; plan={plan}",
                         {"request": req_id, "errors": errs, "plan": plan}, "contract")


def _optimal(view: dict, plan: dict, req_id, reduction: int):
    best = best_reduction(view, len(view["headroom"]))
    if reduction != best:
        return Violation("plan_contract", f"request {req_id!r}: plan reduces by {reduction}, the best "
                                          f"valid plan by {best}; plan={plan}",
                         {"request": req_id, "reduction": reduction, "best": best, "plan": plan}, "optimal")


def _judged(*, table, req_id, proposal, tail, headroom, max_sources: int, in_flight=(), excluded=(),
            in_place: bool = False, unfillable=()) -> tuple[dict, list[Violation]]:
    """(the view, the proposal's violations): the view is built once for both forms."""
    view = view_of(table, req_id, tail=tail, headroom=headroom, max_sources=max_sources, in_flight=in_flight,
                   excluded=excluded, in_place=in_place, unfillable=unfillable)
    plan = {"sources": [int(b) for b in proposal.sources], "fills": [int(b) for b in getattr(proposal, "fills", [])],
            "dests": [int(b) for b in proposal.dests],
            "moves": [[int(x) for x in mv] for mv in proposal.moves.tolist()]}
    broken = _contract(view, plan, req_id)
    if broken:
        return view, [broken]
    return view, [v for v in [_optimal(view, plan, req_id, proposal.reduction)] if v]


def proposal_violations(*, table, req_id, proposal, tail, headroom, max_sources: int, in_flight=(), excluded=(),
                        in_place: bool = False, unfillable=()) -> list[Violation]:
    """What the proposal breaks (``[]``: it obeys every rule of the reference planner and
    reduces by the best reduction the headroom allows); the arguments are
    :func:`check_proposal`'s."""
    return _judged(table=table, req_id=req_id, proposal=proposal, tail=tail, headroom=headroom,
                   max_sources=max_sources, in_flight=in_flight, excluded=excluded, in_place=in_place,
                   unfillable=unfillable)[1]


def check_proposal(*, table, req_id, proposal, tail, headroom, max_sources: int, in_flight=(), excluded=(),
                   in_place: bool = False, unfillable=()) -> dict:
    """Raise :class:`InvariantViolation` (``plan_contract``) unless the proposal obeys every
    rule of the reference planner and reduces by the best reduction the headroom allows (the
    first of :func:`proposal_violations`, the whole list as ``.violations``).
    Returns the view (for reports)."""
    view, found = _judged(table=table, req_id=req_id, proposal=proposal, tail=tail, headroom=headroom,
                          max_sources=max_sources, in_flight=in_flight, excluded=excluded, in_place=in_place,
                          unfillable=unfillable)
    raise_first(found, InvariantViolation)
    return view
