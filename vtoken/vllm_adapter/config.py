"""The adapter's configuration: one validated object, checked before anything is built.

:class:`AdapterConfig` holds every setting of a ``VTokenAdapter`` (vLLM's geometry, the
planner configuration, the runtime checks' switches); each field is checked at
construction (:mod:`vtoken.fields`: :class:`~vtoken.errors.ConfigError` naming the field and
the value) and normalised to a plain Python value, so a config that exists is valid and an
adapter built from it never meets a bad field. ``VTokenAdapter(**fields)`` builds one.
Owns: nothing but its values (frozen).
May call: ``vtoken.fields``, ``vtoken.planner`` (``PlannerConfig``), ``vtoken.table`` (limits),
``layout`` (the layout names).
Costs: O(1) per construction.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..fields import need_bool, need_choice, need_device, need_instance, need_int
from ..planner import PlannerConfig
from ..table import MAX_BLOCK_SIZE, MAX_BLOCKS
from .layout import KV_LAYOUTS

_OWN = "VTokenAdapter"
_POSITIVE = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_plans_per_step", "check_full_every",
             "headroom_pool_fraction")
_SWITCHES = ("prefix_caching", "async_scheduling", "reclaim", "checks", "evict_unfaithful_hashes", "paranoid_checks")


@dataclass(frozen=True)
class AdapterConfig:
    """Every setting of one adapter.

    Fields:
        block_size, num_blocks, prefix_caching, async_scheduling, max_num_seqs,
        max_num_batched_tokens, max_model_len: the vLLM configuration (``VllmHarness``);
            ``block_size`` in [1, the table's limit], ``num_blocks`` in [2, the table's limit].
        reclaim: plan compactions (False: Naive-Evict, same eviction decisions, no headroom).
        planner_config: ``PlannerConfig`` (its ``headroom`` is the reservation size); None:
            the shipped defaults.
        max_plans_per_step: plans launched per scheduler step at most.
        checks: run the runtime assumption checks at every hook (``checks.RuntimeChecks``):
            incremental, with a full scan every ``check_full_every`` hooks, at idle, and at
            every hook with ``paranoid_checks`` (campaigns).
        table_device: where the token table lives (CUDA only where there is one).
        evict_unfaithful_hashes: drop the prefix-cache hash of blocks computed after the
            request's first eviction (``prefix_hash``).
        headroom_pool_fraction: the headroom is at most 1/this of the live pool (default 16:
            no headroom below 17 blocks, where vLLM's own schedule needs every block).
        kv_layout: vLLM's KV cache groups (``harness.KV_LAYOUTS``): ``full`` (one full-attention
            group), ``hybrid`` (full attention + sliding window: the table mirrors the full
            group, vLLM frees the window's blocks), ``sliding`` (no group to reclaim in).
        sliding_window: the sliding-window group's window in tokens (None: two blocks).

    Integers are ints >= 1 unless stated (never bools), switches bools.
    """

    block_size: int = 16
    num_blocks: int = 128
    prefix_caching: bool = True
    async_scheduling: bool = True
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 1024
    reclaim: bool = True
    planner_config: PlannerConfig | None = None
    max_plans_per_step: int = 4
    checks: bool = True
    table_device: str = "cpu"
    evict_unfaithful_hashes: bool = True
    check_full_every: int = 64
    paranoid_checks: bool = False
    headroom_pool_fraction: int = 16
    kv_layout: str = "full"
    sliding_window: int | None = None

    def __post_init__(self):
        put = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 - frozen: set once, here
        put("block_size", need_int(_OWN, "block_size", self.block_size, 1, MAX_BLOCK_SIZE))
        put("num_blocks", need_int(_OWN, "num_blocks", self.num_blocks, 2, MAX_BLOCKS))
        for name in _POSITIVE:
            put(name, need_int(_OWN, name, getattr(self, name), 1))
        for name in _SWITCHES:
            put(name, need_bool(_OWN, name, getattr(self, name)))
        pc = need_instance(_OWN, "planner_config", self.planner_config, PlannerConfig, none_ok=True)
        put("planner_config", pc if pc is not None else PlannerConfig())
        need_device(_OWN, "table_device", self.table_device)
        need_choice(_OWN, "kv_layout", self.kv_layout, KV_LAYOUTS)
        if self.sliding_window is not None:
            put("sliding_window", need_int(_OWN, "sliding_window", self.sliding_window, 1))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
