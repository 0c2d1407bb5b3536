"""vLLM adapter: the seam between vtoken and vLLM's scheduler / block pool.

Importing this package does not import vLLM. ``harness`` builds a real vLLM scheduler on CPU;
``adapter`` is the reclamation over it (its rooms: ``hooks``, ``mirror``, ``fence``,
``prefix_hash``, ``checks``, ``messages``, ``driver``, ``plans``, ``headroom``), ``worker`` the
model side. Pinned to vLLM 0.33.0 (scripts/install_vllm.sh); ``invariants/vllm_contracts.py``
checks each of its assumptions about vLLM by behaviour.
Owns: ``VLLM_VERSION`` (the one vLLM version the adapter is pinned to).
May call: nothing at import (vLLM loads lazily in its modules); the system never imports
spec/, invariants/, fuzz/ or reports/.
Costs: nothing at import.
"""

VLLM_VERSION = "0.33.0"

__all__ = ["VLLM_VERSION"]
