"""The decode engine's configuration: one validated object, checked before anything is built.

:class:`DecodeConfig` holds every setting of a ``DecodeEngine`` but the model (mode, eviction,
pool geometry, device, the copy engine's and the relocation checker's hooks, the planner
configuration); each field is checked at construction (:mod:`vtoken.fields`:
:class:`~vtoken.errors.ConfigError` naming the field and its value) and normalised (a device
becomes a ``torch.device``, ``planner_config`` None the shipped defaults, ``cuda_graph`` None
"on CUDA only"), so a config that exists is valid. ``DecodeEngine(model, **fields)`` builds one.
Owns: nothing but its values (frozen).
May call: vtoken.fields, .planner (``PlannerConfig``), .policies (names, keywords),
.copy_engine (the shipped engine's keywords, the checker hook's rule), torch.
Costs: O(1) per construction (plus reading the copy engine's and policy's signatures).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from .copy_engine import KVCopyEngine, checker_factory
from .fields import is_bool, is_int, need_choice, need_device, need_int, need_number, refuse
from .planner import MODES, PlannerConfig
from .policies import POLICIES

# The relocation checker's digest methods (its ``method`` argument; None: its default).
CHECK_METHODS = ("xxh3", "fingerprint")
# Arguments the engine itself passes to the copy engine: never in ``copy_kwargs``.
_ENGINE_OWN = ("kv", "block_size", "force_sync")


_OWN = "DecodeEngine"


def _bad(code: str, name: str, want: str, value) -> None:
    refuse(code, _OWN, name, want, value)


def _keywords(fn) -> Optional[set]:
    """The keyword arguments ``fn`` (a class: its ``__init__`` chain along the MRO, as
    ``super().__init__(*a, **kw)`` passes them on) accepts; None: any (a ``**kwargs`` that
    reaches no fixed signature, or no signature to read). O(MRO)."""
    chain = [c.__init__ for c in fn.__mro__ if "__init__" in vars(c)] if isinstance(fn, type) else [fn]
    names: set = set()
    for f in chain:
        try:
            params = inspect.signature(f).parameters.values()
        except (TypeError, ValueError):
            return None
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return names - {"self"}
    return None


def _check_kwargs(name: str, kw, accepted: Optional[set], who: str) -> dict:
    """``kw`` is None or a dict of keyword arguments ``who`` accepts (``accepted``; None: any)."""
    if kw is None:
        return {}
    if not isinstance(kw, dict) or not all(isinstance(k, str) for k in kw):
        _bad("bad_type", name, "None or a dict of keyword arguments", kw)
    unknown = sorted(k for k in kw if accepted is not None and k not in accepted)
    if unknown:
        _bad("out_of_range", name, f"keyword arguments {who} accepts ({sorted(accepted)}); unknown {unknown}", kw)
    return dict(kw)


def _check_scalars(mode, policy, evict_ratio, block_size, num_blocks, seed) -> None:
    need_choice(_OWN, "mode", mode, MODES)
    need_choice(_OWN, "policy", policy, sorted(POLICIES))
    need_number(_OWN, "evict_ratio", evict_ratio, 0, 1, hi_open=True)
    need_int(_OWN, "block_size", block_size, 1)
    need_int(_OWN, "num_blocks", num_blocks, 2, none_ok=True)
    need_int(_OWN, "seed", seed, 0)


def _check_copy(copy_kwargs, factory, device: torch.device) -> dict:
    """``copy_kwargs``: keywords the copy engine accepts, the shipped engine's own checked
    (``lag`` an integer >= 0, 0 on CUDA; ``sleep_cycles`` an integer >= 0; ``sentinel``,
    ``timed`` bools); ``kv``, ``block_size`` and ``force_sync`` are the engine's to pass."""
    if factory is not None and not callable(factory):
        _bad("bad_type", "copy_engine_factory", "None or a callable (kv, block_size, **kwargs) -> engine", factory)
    kw = _check_kwargs("copy_kwargs", copy_kwargs, None, "the copy engine")
    own = sorted(set(kw) & set(_ENGINE_OWN))
    if own:
        _bad("out_of_range", "copy_kwargs", f"free of {list(_ENGINE_OWN)} (the engine passes them: set "
                                            f"{own} through DecodeEngine's own arguments)", copy_kwargs)
    accepted = _keywords(factory or KVCopyEngine)
    _check_kwargs("copy_kwargs", kw, None if accepted is None else accepted - set(_ENGINE_OWN), "the copy engine")
    for k in ("lag", "sleep_cycles"):
        if k in kw and (not is_int(kw[k]) or kw[k] < 0):
            _bad("bad_type" if not is_int(kw[k]) else "out_of_range", f"copy_kwargs[{k!r}]", "an integer >= 0", kw[k])
    for k in ("sentinel", "timed"):
        if k in kw and not is_bool(kw[k]):
            _bad("bad_type", f"copy_kwargs[{k!r}]", "True or False", kw[k])
    return kw


def _check_flags(mode, copy_kw: dict, check_relocations, planner_config, sentinel_check, check_method, full_bytes,
                 force_sync, cuda_graph, snapshot_dir) -> None:
    for name, v in (("sentinel_check", sentinel_check), ("full_bytes", full_bytes), ("force_sync", force_sync)):
        if not is_bool(v):
            _bad("bad_type", name, "True or False", v)
    if sentinel_check and (mode != "vtoken" or not copy_kw.get("sentinel")):
        _bad("out_of_range", "sentinel_check", "False unless mode='vtoken' with copy_kwargs={'sentinel': True} "
                                               "(the sentinel it looks for is the copy engine's)", sentinel_check)
    if cuda_graph is not None and not is_bool(cuda_graph):
        _bad("bad_type", "cuda_graph", "None, True or False", cuda_graph)
    if check_method is not None and not isinstance(check_method, str):
        _bad("bad_type", "check_method", f"None or one of {CHECK_METHODS}", check_method)
    if check_method is not None and check_method not in CHECK_METHODS:
        _bad("out_of_range", "check_method", f"None or one of {CHECK_METHODS}", check_method)
    if check_relocations is True or (check_relocations not in (None, False) and not callable(check_relocations)):
        _bad("bad_type", "check_relocations", "None or the checker factory, e.g. "
                                              "vtoken.invariants.relocation_hash.RelocationChecker", check_relocations)
    if planner_config is not None and not isinstance(planner_config, PlannerConfig):
        _bad("bad_type", "planner_config", "None or a vtoken.planner.PlannerConfig", planner_config)
    if snapshot_dir is not None and not isinstance(snapshot_dir, (str, os.PathLike)):
        _bad("bad_type", "snapshot_dir", "None or a path", snapshot_dir)



def default_planner_config(record_snapshots: bool = False, headroom: Optional[int] = None) -> PlannerConfig:
    """The engine's planner settings: the shipped defaults, ``PlannerConfig()`` (a thin
    wrapper kept for its callers; there is no engine-only configuration), with
    ``record_snapshots`` and, when given, ``headroom`` set. ``run`` sizes an unset pool for
    full retention plus the headroom, so the reservation never competes with the batch.
    """
    kw = {} if headroom is None else {"headroom": int(headroom)}
    return PlannerConfig(record_snapshots=record_snapshots, **kw)


@dataclass(frozen=True)
class DecodeConfig:
    """Every setting of one ``DecodeEngine`` but the model.

    Fields:
        mode: ``native`` | ``naive-evict`` | ``vtoken``.
        policy: eviction policy name (``vtoken.policies.POLICIES``); ``policy_kwargs`` go to it.
        evict_ratio: fraction of each request's tokens to evict (keep ``ceil((1-r) * n)``).
        block_size: ``S``.
        num_blocks: the KV block budget (incl. the null block); None: sized by ``run`` for
            full retention of its batch plus the headroom.
        device: ``cpu`` or ``cuda`` (a ``torch.device`` once made).
        check_relocations: None, or the relocation checker's factory
            ``(kv, table, out_dir=, method=, full_bytes=) -> checker`` (the toolkit's
            ``RelocationChecker``): hash-and-compare every relocation; the planner then
            records plan snapshots. Kept only in ``vtoken`` mode.
        planner_config: None (the shipped defaults) or a :class:`PlannerConfig`.
        seed: seeds the random policy (per request: ``(seed, request id)``).
        force_sync: host-wait every copy (the force-sync ablation).
        copy_kwargs: extra copy-engine arguments (``lag``, ``sentinel``, ...).
        snapshot_dir: where failing plans' snapshots go.
        sentinel_check: before each decode step, assert no read slot holds the copy
            engine's sentinel (needs ``mode='vtoken'`` and ``copy_kwargs={"sentinel": True}``).
        check_method / full_bytes: the relocation checker's digest method.
        copy_engine_factory: ``(kv, block_size, **kwargs) -> engine`` (None: ``KVCopyEngine``).
        cuda_graph: decode steps through ``StepGraph``: None = on CUDA only; True on the CPU
            runs the same path eagerly; False = the plain ``decode_step`` path.

    Ranges: ``mode`` in :data:`MODES`; ``policy`` a registered name, ``policy_kwargs``
    keywords its class accepts; ``evict_ratio`` in [0, 1); ``block_size`` >= 1;
    ``num_blocks`` None or >= 2; ``seed`` >= 0; ``device`` cpu, or cuda where there is one;
    ``copy_kwargs`` keywords the copy engine accepts (``lag`` >= 0, 0 on CUDA;
    ``sleep_cycles`` >= 0; ``sentinel`` / ``timed`` bools; never ``kv`` / ``block_size`` /
    ``force_sync``); ``check_method`` None or in :data:`CHECK_METHODS`. Integers are ints
    (not bools), flags bools.
    """

    mode: str = "vtoken"
    policy: str = "h2o"
    evict_ratio: float = 0.5
    block_size: int = 16
    num_blocks: Optional[int] = None
    device: object = "cpu"
    check_relocations: Optional[Callable] = None
    planner_config: Optional[PlannerConfig] = None
    seed: int = 0
    force_sync: bool = False
    copy_kwargs: Optional[dict] = None
    snapshot_dir: object = None
    policy_kwargs: Optional[dict] = None
    sentinel_check: bool = False
    check_method: Optional[str] = None
    full_bytes: bool = False
    copy_engine_factory: Optional[Callable] = None
    cuda_graph: Optional[bool] = None

    def __post_init__(self):
        put = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 - frozen: set once, here
        _check_scalars(self.mode, self.policy, self.evict_ratio, self.block_size, self.num_blocks, self.seed)
        dev = need_device(_OWN, "device", self.device)
        copy_kw = _check_copy(self.copy_kwargs, self.copy_engine_factory, dev)
        _check_flags(self.mode, copy_kw, self.check_relocations, self.planner_config, self.sentinel_check,
                     self.check_method, self.full_bytes, self.force_sync, self.cuda_graph, self.snapshot_dir)
        policy_kw = _check_kwargs("policy_kwargs", self.policy_kwargs, _keywords(POLICIES[self.policy]),
                                  f"policy {self.policy!r}")
        factory = checker_factory(self.check_relocations, _OWN)  # validated in every mode
        factory = factory if self.mode == "vtoken" else None
        cfg = self.planner_config or default_planner_config()
        if factory and not cfg.record_snapshots:
            cfg = replace(cfg, record_snapshots=True)
        put("evict_ratio", float(self.evict_ratio))
        put("block_size", int(self.block_size))
        put("num_blocks", None if self.num_blocks is None else int(self.num_blocks))
        put("device", dev)
        put("check_relocations", factory)
        put("planner_config", cfg)
        put("seed", int(self.seed))
        put("copy_kwargs", copy_kw)
        put("policy_kwargs", policy_kw)
        put("copy_engine_factory", self.copy_engine_factory or KVCopyEngine)
        put("cuda_graph", (dev.type == "cuda") if self.cuda_graph is None else bool(self.cuda_graph))
