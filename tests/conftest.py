from vtoken.fuzz.profiles import load_profile

load_profile()


# ---------------------------------------------------------------------------- decoder fixtures
# Shared by the decode tests (test_engine, test_engine_lifecycle, test_graph_path): a module
# opts in with ``pytest.mark.usefixtures("one_thread")`` and asks for ``model`` / ``prompts``.
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module: the decoder is bitwise stable per thread count, and on
    a shared 2-core box many tiny ops only lose to more threads."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def model():
    from vtoken.model import PagedDecoder

    return PagedDecoder()


@pytest.fixture(scope="module")
def prompts(model):
    """Four seeded prompts of 32 tokens."""
    from vtoken.decode import make_prompts

    return make_prompts(4, 32, model.config.vocab_size, seed=3)
