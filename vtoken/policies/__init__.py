"""Eviction policies behind one small API (``base.Policy``) and a name registry.

Owns: nothing (the name registry).
May call: vtoken.policies.*; never spec/, invariants/, fuzz/ or reports/.
Costs: ``make_policy`` O(1).
"""

from __future__ import annotations

from typing import Any

from vtoken.policies.base import Policy, protect_recent
from vtoken.policies.h2o import H2O
from vtoken.policies.random_policy import RandomPolicy
from vtoken.policies.scissorhands import Scissorhands
from vtoken.policies.streaming import StreamingLLM
from ..errors import CallError

__all__ = ["POLICIES", "H2O", "Policy", "RandomPolicy", "Scissorhands", "StreamingLLM",
           "make_policy", "protect_recent"]

POLICIES: dict[str, type[Policy]] = {
    "h2o": H2O,
    "streaming": StreamingLLM,
    "scissorhands": Scissorhands,
    "random": RandomPolicy,
}


def make_policy(name: str, **kw: Any) -> Policy:
    """A new policy instance by registry name; ``kw`` go to its constructor."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise CallError("unknown_name", f"unknown policy {name!r}; known: {sorted(POLICIES)}") from None
    return cls(**kw)
