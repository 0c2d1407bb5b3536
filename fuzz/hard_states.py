"""Named hard states: where bugs in a KV block manager hide.

Machines call :func:`hard` when they reach one; it is a Hypothesis ``event`` (so
``--hypothesis-show-statistics`` shows it) and a process-wide counter the campaign runner
reports. Keep configurations small (few blocks, small S) so these states are common.

A machine may tag the configuration its current example runs (:func:`tag`, e.g. the adapter
machine's KV layout and fence clock): each state is then also counted under
``"<state> [<tag>]"``, so a campaign can say how often each state was reached in each
configuration (:func:`by_tag`).
Owns: one process-wide counter of the hard states reached, and the current tag.
May call: hypothesis (``event``), collections, fuzz.registry (an ``impl:`` class's kind, loaded once).
Costs: O(1) per call.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import event

HARD_STATES = (
    "block exactly full",
    "token at a block boundary",
    "allocator exhausted",
    "headroom exhausted",
    "plan overlapping an in-flight one",
    "copy failing part-way",
    "finish while a copy is in flight",  # preemption takes the same path (finish_request)
    # the adapter machine, over the real vLLM scheduler
    "prefix hit on an in-flight source",  # a new request's prefix covers a block a copy is moving out of
    "preemption with a plan in flight",
    "finish mid-copy",  # finished or aborted while its plan's copy flies
    "resume with a replaced block list",
    "plan and growth in one step",
    "copy pending across preempt and resume",  # the request resumed while its old incarnation's copy flies
    "copy failed in the adapter",  # aborted with the table kept: sources and fills back to the request
    # the planner protocol's machine (a user's planner), on the views a real caller passes
    "in-flight block a plan could take",  # the request's own unshared block, held by its plan in flight
    "excluded block a plan could take",  # a block the caller forbids that the table alone would allow
    "dead token in a candidate block",  # a block a plan may empty or fill holds dead tokens of the request
    "token evicted while its copy flies",  # the plan's move of it must not be applied
    # the engine machine, vLLM's real engine with vtoken against Naive-Evict
    "engine plan applied",  # a relocation landed in vLLM's own K/V tensors, hashed
    "engine copy in flight across a step",  # a copy launched after one forward still flies at the next
    "engine abort with a plan in flight",
    "engine prefix-cache hit",  # a request started from cached blocks
    "engine outputs compared",  # requests computed alike in both engines, compared token for token
)

# which machine reaches which (a campaign reports the states of the machines it ran)
BY_MACHINE = {
    "table": ("block exactly full", "token at a block boundary", "allocator exhausted"),
    "planner": ("headroom exhausted", "plan overlapping an in-flight one", "copy failing part-way",
                "finish while a copy is in flight"),
    "adapter": HARD_STATES[7:14],
    "planner protocol": HARD_STATES[14:18],
    "engine": HARD_STATES[18:],
}
assert sorted(sum(BY_MACHINE.values(), ())) == sorted(HARD_STATES)

# a user's class (impl:module:Class) runs the machine of its protocol: a token table the table
# machine (its states), a planner the planner protocol's machine, which drives a planner through
# the planner machine's states and those of the views a caller passes
BY_KIND = {"table": BY_MACHINE["table"], "planner": BY_MACHINE["planner"] + BY_MACHINE["planner protocol"]}


def states_of(machines) -> tuple:
    """The hard states the named machines reach, in HARD_STATES order (unknown names: none;
    ``impl:module:Class``: those of its protocol's machine, the class loaded to know which)."""
    mine = set()
    for m in machines:
        if m.startswith("impl:"):
            from .protocol import ProtocolError
            from .registry import impl_kind

            try:
                mine.update(BY_KIND[impl_kind(m[len("impl:"):])])  # the campaign's one load, reused
            except ProtocolError:  # (the campaign checked it loads: only a caller's typo gets here)
                mine.update(BY_KIND["table"] + BY_KIND["planner"])
        else:
            mine.update(BY_MACHINE.get(m, ()))
    return tuple(h for h in HARD_STATES if h in mine)


COUNTS: Counter = Counter()
LAST_SNAPSHOT: dict = {}  # the most recent plan snapshot a machine made (for failure reports)


TAG: str | None = None  # the configuration of the example running now (None: untagged)


def tag(config: str | None) -> None:
    """The configuration the current example runs (its hard states are counted under it too)."""
    global TAG
    TAG = config


def hard(name: str) -> None:
    assert name in HARD_STATES, f"unknown hard state {name!r}"
    COUNTS[name] += 1
    if TAG is not None:
        COUNTS[f"{name} [{TAG}]"] += 1
    event(f"hard: {name}")


def by_tag(counts) -> dict:
    """``{tag: {state: count}}`` from a counter of :func:`hard`'s keys (untagged keys left out)."""
    out: dict = {}
    for key, n in counts.items():
        if key.endswith("]") and " [" in key:
            name, t = key[:-1].split(" [", 1)
            out.setdefault(t, {})[name] = out.get(t, {}).get(name, 0) + n
    return {t: dict(sorted(v.items())) for t, v in sorted(out.items())}


def note_snapshot(snap) -> None:
    LAST_SNAPSHOT.clear()
    if snap is not None:
        LAST_SNAPSHOT.update(snap)
