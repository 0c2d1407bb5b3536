"""vtoken's settings inside vLLM's engine: one validated object, read from
``vllm_config.additional_config["vtoken"]`` in every engine process.

A user passes them as ``LLM(..., additional_config={"vtoken": {...}})`` (``engine_args`` builds
the whole set of engine arguments) or ``vllm serve MODEL --additional-config '{"vtoken": {...}}'``.
They are plain JSON values, so they cross vLLM's process boundaries as its own config does.
Every key is checked when the engine starts (scheduler and worker alike): an unknown key, a
wrong type or a value out of range raises :class:`~vtoken.errors.ConfigError` with a one-line
message naming ``vtoken.<key>`` and the value; nothing is built.

Keys (defaults in :class:`EngineSettings`): ``policy`` (``h2o``, ``streaming``,
``scissorhands``, ``random``), ``policy_kwargs``, ``evict_ratio`` in [0, 1) or ``budget``
(tokens kept per request, >= 1; the two exclusive), ``reclaim`` (False: Naive-Evict, the same
evictions with whole-block frees only), ``planner`` (``PlannerConfig`` fields, nested: the shape
the adapter's JSON settings take under ``planner_config``, through the same
``vllm_adapter.config.planner_config_of``, so the same object is accepted or refused alike),
``checks`` (the scheduler side's runtime checks), ``check_relocations`` (hash-and-compare of
every relocation in the worker), ``copy_lag`` (a copy completes on its n-th poll), ``seed``,
``max_plans_per_step``, ``check_full_every``, ``paranoid_checks``, ``headroom_pool_fraction``,
``keep_prefix_bytes`` (never fill a block whose prefix-cache hash describes it: hits kept; default on),
``keep_headroom`` (the soft reservation for those plans' destinations, ``AdapterConfig.keep_headroom``),
``stats_path`` (where the scheduler writes its counters and the worker's as JSON), ``snapshot_dir``
(where a failing relocation's snapshot goes).
Owns: nothing but its values (frozen).
May call: ``vtoken.fields``, ``vtoken.planner`` (``PlannerConfig``), ``vtoken.policies``,
``vtoken.vllm_adapter.config`` (the planner settings' parser).
Costs: O(keys) per construction.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from ..errors import ConfigError
from ..fields import need_bool, need_choice, need_instance, need_int, need_number, refuse
from ..planner import PlannerConfig
from ..vllm_adapter.config import planner_config_of

_OWN = "vtoken"
KEY = "vtoken"  # the key of vllm_config.additional_config


@dataclass(frozen=True)
class EngineSettings:
    policy: str = "h2o"
    policy_kwargs: dict = field(default_factory=dict)
    evict_ratio: Optional[float] = None  # None: 0.5, or none at all with a budget
    budget: Optional[int] = None
    reclaim: bool = True
    planner: dict = field(default_factory=dict)
    checks: bool = True
    check_relocations: bool = True
    copy_lag: int = 0
    seed: int = 0
    max_plans_per_step: int = 4
    check_full_every: int = 64
    paranoid_checks: bool = False
    keep_prefix_bytes: bool = True
    keep_headroom: int = 64
    headroom_pool_fraction: int = 16
    stats_path: Optional[str] = None
    snapshot_dir: Optional[str] = None

    def __post_init__(self):
        from ..policies import POLICIES

        put = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 - frozen: set once, here
        need_choice(_OWN, "policy", self.policy, POLICIES)
        put("policy_kwargs", dict(need_instance(_OWN, "policy_kwargs", self.policy_kwargs, dict)))
        put("budget", need_int(_OWN, "budget", self.budget, 1, none_ok=True))
        if self.budget is not None and self.evict_ratio is not None:
            refuse("inconsistent", _OWN, "budget", "given without evict_ratio (one or the other)", self.budget)
        ratio = (0.0 if self.budget is not None else 0.5) if self.evict_ratio is None else self.evict_ratio
        put("evict_ratio", need_number(_OWN, "evict_ratio", ratio, 0, 1, hi_open=True))
        for name in ("reclaim", "checks", "check_relocations", "paranoid_checks", "keep_prefix_bytes"):
            put(name, need_bool(_OWN, name, getattr(self, name)))
        for name, lo in (("copy_lag", 0), ("seed", 0), ("max_plans_per_step", 1), ("check_full_every", 1),
                         ("headroom_pool_fraction", 1), ("keep_headroom", 0)):
            put(name, need_int(_OWN, name, getattr(self, name), lo))
        for name in ("stats_path", "snapshot_dir"):
            need_instance(_OWN, name, getattr(self, name), str, none_ok=True)
        planner = dict(need_instance(_OWN, "planner", self.planner, dict))
        planner_config_of(_OWN, "planner", planner)  # the adapter's JSON shape and refusals (one parser)
        put("planner", planner)

    # ------------------------------------------------------------------ conversions
    @classmethod
    def of(cls, value: Any) -> "EngineSettings":
        """From a dict (``additional_config["vtoken"]``), a JSON string, or settings. Unknown keys
        are refused (``unsupported``), naming the known ones."""
        if isinstance(value, EngineSettings):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError("bad_type", f"{_OWN}: settings must be a JSON object, got {value!r} ({e})") from None
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError("bad_type", f"{_OWN}: settings must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError("unsupported", f"{_OWN}: unknown setting(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

    @classmethod
    def from_vllm_config(cls, vllm_config) -> Optional["EngineSettings"]:
        """The settings of an engine, or None when vtoken is not switched on (no ``vtoken`` key)."""
        extra = getattr(vllm_config, "additional_config", None) or {}
        if KEY not in extra:
            return None
        return cls.of(extra[KEY])

    def to_dict(self) -> dict:
        """Plain JSON values that rebuild these settings (``of``)."""
        d = asdict(self)
        if self.budget is not None:
            d["evict_ratio"] = None  # the budget decides; a ratio beside it is refused
        return d

    def planner_config(self) -> PlannerConfig:
        return PlannerConfig(**self.planner)

    def adapter_settings(self) -> dict:
        """The ``VTokenAdapter`` settings (its geometry comes from vLLM's scheduler)."""
        return dict(reclaim=self.reclaim, planner_config=self.planner_config(), checks=self.checks,
                    max_plans_per_step=self.max_plans_per_step, check_full_every=self.check_full_every,
                    paranoid_checks=self.paranoid_checks, headroom_pool_fraction=self.headroom_pool_fraction,
                    keep_prefix_bytes=self.keep_prefix_bytes, keep_headroom=self.keep_headroom)
