"""vLLM adapter: the seam between vtoken and vLLM's scheduler / block pool.

Importing this package does not import vLLM. ``harness`` builds a real vLLM scheduler on
CPU; ``adapter`` is the reclamation over it (its rooms: ``hooks``, ``mirror``, ``fence``,
``prefix_hash``, ``checks``, ``messages``, ``driver``), ``worker`` the model side. The
toolkit checks, by behaviour, every assumption the adapter makes about vLLM
(``vtoken.invariants.vllm_contracts``; pinned to vLLM 0.33.0, see scripts/install_vllm.sh).
"""

VLLM_VERSION = "0.33.0"

__all__ = ["VLLM_VERSION"]
