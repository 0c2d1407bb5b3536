"""Shared fixtures of the vLLM adapter tests."""

import pytest

from vtoken.vllm_adapter import harness


@pytest.fixture(scope="module")
def model():
    """A small seeded decoder, one torch thread (bitwise reproducible for a fixed thread count)."""
    if harness.vllm_version() is None:
        pytest.fail("vLLM not installed: run scripts/install_vllm.sh", pytrace=False)
    import torch

    from vtoken.model import DecoderConfig, PagedDecoder

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield PagedDecoder(DecoderConfig(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                                     intermediate_size=128))
    torch.set_num_threads(old)
