"""vLLM adapter: the seam between vtoken and vLLM's scheduler / block pool.

Importing this package does not import vLLM. ``harness`` builds a real vLLM scheduler on
CPU; ``contracts`` checks, by behaviour, every assumption the adapter makes about vLLM
(pinned to vLLM 0.33.0; see scripts/install_vllm.sh and tests/vllm/).
"""

VLLM_VERSION = "0.33.0"

__all__ = ["VLLM_VERSION"]
