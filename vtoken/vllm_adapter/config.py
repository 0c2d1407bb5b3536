"""The adapter's configuration: one validated object, checked before anything is built.

:class:`AdapterConfig` holds every setting of a ``VTokenAdapter`` (vLLM's geometry, the
planner configuration, the runtime checks' switches); each field is checked at
construction (:mod:`vtoken.fields`: :class:`~vtoken.errors.ConfigError` naming the field and
the value) and normalised to a plain Python value, so a config that exists is valid and an
adapter built from it never meets a bad field. ``VTokenAdapter(**fields)`` builds one.

Checked where they meet: the combinations vLLM's own configuration refuses are refused here
first, by field (:func:`check_vllm_limits`, derived from vLLM 0.33.0's source, each shown by a
test to be refused by vLLM itself); a sliding window goes with a layout that has a window
group (:func:`check_window`). ``VllmHarness`` runs the same checks on its own fields.

Settings as JSON (one shape wherever a user gives settings as text): :func:`adapter_settings`
/ :meth:`AdapterConfig.of` take a JSON object (or a dict) of ``AdapterConfig`` fields, its
``planner_config`` a nested object of ``PlannerConfig`` fields
(``{"planner_config": {"headroom": 64, "in_place": false}, "checks": true}``):
``--adapter-settings`` (the audit's run of vLLM's own tests) and ``--vtoken-adapter-settings`` (its pytest
plugin). vLLM's engine (``--additional-config '{"vtoken": {...}}'``, ``vllm_engine.settings``)
takes the same nested planner object under its ``planner`` key, through the same
:func:`planner_config_of`: the same fields, the same refusals.
Owns: nothing but its values (frozen).
May call: ``vtoken.fields``, ``vtoken.planner`` (``PlannerConfig``), ``vtoken.table`` (limits),
``layout`` (the layout names), ``json``.
Costs: O(1) per construction; O(text) to parse settings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Optional

from ..errors import ConfigError
from ..fields import need_bool, need_choice, need_device, need_int, refuse
from ..planner import PlannerConfig
from ..table import MAX_BLOCK_SIZE, MAX_BLOCKS
from .layout import KV_LAYOUTS

_OWN = "VTokenAdapter"
_POSITIVE = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_plans_per_step", "check_full_every",
             "headroom_pool_fraction")
_SWITCHES = ("prefix_caching", "async_scheduling", "reclaim", "checks", "evict_unfaithful_hashes", "paranoid_checks",
             "keep_prefix_bytes")
# vLLM's own configuration (``VllmHarness``'s): ``attach`` reads it off the scheduler it is given
VLLM_FIELDS = ("block_size", "num_blocks", "prefix_caching", "async_scheduling", "max_num_seqs",
               "max_num_batched_tokens", "max_model_len", "kv_layout", "sliding_window")

__all__ = ["AdapterConfig", "VLLM_FIELDS", "adapter_settings", "check_vllm_limits", "check_window",
           "planner_config_of"]


def planner_config_of(owner: str, name: str, value) -> PlannerConfig:
    """The planner's settings, one shape wherever they are given: a ``PlannerConfig`` (kept),
    None (the shipped defaults) or a dict of ``PlannerConfig``'s fields (a JSON object, e.g.
    ``{"headroom": 64, "in_place": false}``). Refused with ``ConfigError``: anything else
    (``bad_type``), a key that is not a field (``unsupported``, naming the fields), a value
    ``PlannerConfig`` refuses (its code, named ``<owner>.<name>.<field>``). O(fields)."""
    if value is None:
        return PlannerConfig()
    if isinstance(value, PlannerConfig):
        return value
    if not isinstance(value, dict):
        refuse("bad_type", owner, name, "a PlannerConfig, a dict of its fields or None", value)
    known = tuple(f.name for f in fields(PlannerConfig))
    unknown = [str(k) for k in value if k not in known]
    if unknown:
        refuse("unsupported", owner, name, f"a dict of PlannerConfig's fields ({', '.join(known)}; "
                                           f"not {', '.join(unknown)})", value)
    try:
        return PlannerConfig(**value)
    except ConfigError as e:  # PlannerConfig names its own field; the user wrote it under ``name``
        msg = str(e).split("] ", 1)[-1].replace("PlannerConfig.", f"{owner}.{name}.", 1)
        raise ConfigError(e.code, msg) from None


def check_vllm_limits(owner: str, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                      chunked_prefill: bool = True) -> None:
    """Refuse (``inconsistent``, naming ``max_num_batched_tokens``) the combinations vLLM 0.33.0's
    ``SchedulerConfig.verify_max_model_len`` refuses (``vllm/config/scheduler.py``, run by its
    ``__post_init__``; vLLM raises pydantic's ``ValidationError``): ``max_num_batched_tokens <
    max_num_seqs``, and without chunked prefill ``max_num_batched_tokens < max_model_len``.
    The three are integers >= 1 already (vLLM's ``Field(ge=1)``). O(1)."""
    if max_num_batched_tokens < max_num_seqs:
        refuse("inconsistent", owner, "max_num_batched_tokens",
               f"at least max_num_seqs ({max_num_seqs}), as vLLM's SchedulerConfig requires", max_num_batched_tokens)
    if not chunked_prefill and max_num_batched_tokens < max_model_len:
        refuse("inconsistent", owner, "max_num_batched_tokens",
               f"at least max_model_len ({max_model_len}) without chunked prefill, as vLLM's SchedulerConfig "
               f"requires", max_num_batched_tokens)


def check_window(owner: str, kv_layout, sliding_window):
    """``kv_layout`` one of ``KV_LAYOUTS``; ``sliding_window`` None (two blocks) or, with a layout
    that has a sliding-window group, its window in tokens, an integer >= 1 (vLLM reads a window
    of 0 as no window at all, ``vllm/config/model.py`` ``disable_sliding_window``, and keeps
    ``sliding_window - 1`` tokens behind a request, ``SlidingWindowSpec.num_retained_tokens``).
    Returns ``sliding_window`` as a plain int (or None)."""
    need_choice(owner, "kv_layout", kv_layout, KV_LAYOUTS)
    if sliding_window is None:
        return None
    w = need_int(owner, "sliding_window", sliding_window, 1, none_ok=True)
    if "sliding" not in KV_LAYOUTS[kv_layout]:
        refuse("inconsistent", owner, "sliding_window", f"None with kv_layout {kv_layout!r} (no sliding-window group)",
               sliding_window)
    return w


@dataclass(frozen=True)
class AdapterConfig:
    """Every setting of one adapter.

    Fields:
        block_size, num_blocks, prefix_caching, async_scheduling, max_num_seqs,
        max_num_batched_tokens, max_model_len: the vLLM configuration (``VllmHarness``);
            ``block_size`` in [1, the table's limit], ``num_blocks`` in [2, the table's limit],
            ``max_num_batched_tokens >= max_num_seqs`` (vLLM's rule, :func:`check_vllm_limits`).
        reclaim: plan compactions (False: Naive-Evict, same eviction decisions, no headroom).
        planner_config: ``PlannerConfig`` (its ``headroom`` is the reservation size), or a dict of
            its fields (JSON, :func:`planner_config_of`); None: the shipped defaults.
        max_plans_per_step: plans launched per scheduler step at most.
        checks: run the runtime assumption checks at every hook (``checks.RuntimeChecks``):
            incremental, with a full scan every ``check_full_every`` hooks, at idle, and at
            every hook with ``paranoid_checks`` (campaigns).
        table_device: the replica token table's read-side cache (``'cpu'``, ``'cuda'`` where
            there is one); None (default): none. The replica plans and checks, it never serves
            attention reads, so a device mirror would only cost each replayed change.
        keep_prefix_bytes: an in-place plan never fills a block whose prefix-cache hash describes
            its bytes (computed with full context): a later request repeating the prefix keeps
            its hits (with the sources' parked hashes, Naive-Evict's hit rate on the audit's
            repeated-sequence workload). Such a block may still be emptied: its live tokens go to
            the holes of blocks without such a hash, then to whole fresh destinations from the
            headroom (each block it frees costs a copy of its live tokens, and a destination
            while one is needed). On by default. A request for which no plan exists (its
            bound counts hashed blocks no plan may fill) is skipped until its evictions could
            make one (``plans.PlanBook.no_plan``), not proposed for at every plan step. Off:
            those blocks may be filled and lose their hash (a fill early in a prompt breaks the
            whole prefix chain for a later request repeating it).
        keep_headroom: with ``keep_prefix_bytes``, in-place plans and no reservation of the planner's
            (``planner_config.headroom`` 0), the destinations those plans may take for hashed
            blocks' tokens, up to this many a step (default 64; 0: none): a soft reservation, drawn
            from vLLM's free blocks when a plan launches (never held between steps: no idle block
            is taken from vLLM), only while some request holds an evicted token (no plan can need
            one otherwise: vLLM's own tests, where nothing is evicted, never see it), only from free
            blocks beyond what growth and the next admission's prompt need, and never a reason to
            hold an admission back (``headroom.Headroom``). Without it each plan empties one hashed block at a time
            into the other blocks' holes: on the bench's workload (prompts of 256-1024 tokens,
            50% random eviction, R = 64 / 256) 283 / 563 plans kept 2763 / 11226 blocks, with 32
            destinations 107 / 385 plans kept 1918 / 8173 (docs/ARCHITECTURE.md). 64 is twice the
            planner's ``max_sources`` (32): room for two plans of that many hashed sources a step.
            With 32 the step's first plans often took every destination and its other proposals
            found none, so a request needed two or three plans (over the bench's whole run, R = 64
            / 256: 99 / 377 plans at 32, 64 / 252 at 64, the same plans at 96-256).
        evict_unfaithful_hashes: drop the prefix-cache hash of blocks computed after the
            request's first eviction (``prefix_hash``).
        headroom_pool_fraction: the headroom is at most 1/this of the live pool (default 16:
            no headroom below 17 blocks, where vLLM's own schedule needs every block).
        kv_layout: vLLM's KV cache groups (``harness.KV_LAYOUTS``): ``full`` (one full-attention
            group), ``hybrid`` (full attention + sliding window: the table mirrors the full
            group, vLLM frees the window's blocks), ``sliding`` (no group to reclaim in).
        sliding_window: the sliding-window group's window in tokens (None: two blocks); only
            with a layout that has one (:func:`check_window`).

    Integers are ints >= 1 unless stated (``keep_headroom`` >= 0; never bools), switches bools.
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
    table_device: Optional[str] = None
    evict_unfaithful_hashes: bool = True
    keep_prefix_bytes: bool = True
    keep_headroom: int = 64
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
        put("keep_headroom", need_int(_OWN, "keep_headroom", self.keep_headroom, 0))
        put("planner_config", planner_config_of(_OWN, "planner_config", self.planner_config))
        if self.table_device is not None:
            need_device(_OWN, "table_device", self.table_device)
        put("sliding_window", check_window(_OWN, self.kv_layout, self.sliding_window))
        # vLLM's adapter harness always runs chunked prefill: only the token budget's floor applies
        check_vllm_limits(_OWN, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                          max_model_len=self.max_model_len)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def of(cls, value: Any = None, *, attach: bool = False) -> "AdapterConfig":
        """A config from settings as a user gives them: JSON text, a dict of fields (a nested
        ``planner_config`` object included), a config (kept), or None / ``''`` (the defaults).
        ``attach``: the settings of an adapter attached to a scheduler built elsewhere, where
        vLLM's configuration (``VLLM_FIELDS``) is the scheduler's, so giving it is refused
        (``unsupported``). Every refusal is a one-line ``ConfigError`` naming the field."""
        if isinstance(value, cls):
            return value
        return cls(**adapter_settings(value, attach=attach, check=False))


def _settings_dict(value: Any) -> dict:
    """``value`` (JSON text, a dict, None or ``''``) as a dict whose keys are all
    ``AdapterConfig``'s fields (``bad_type``: not a JSON object; ``unsupported``: an unknown key)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            refuse("bad_type", _OWN, "settings", f"a JSON object ({type(e).__name__}: {str(e)[:80]})", value[:80])
    if not isinstance(value, dict):
        refuse("bad_type", _OWN, "settings", "a JSON object of AdapterConfig's fields", value)
    known = AdapterConfig.names()
    unknown = [str(k) for k in value if k not in known]
    if unknown:
        refuse("unsupported", _OWN, "settings", f"AdapterConfig's fields only ({', '.join(known)}; "
                                                f"not {', '.join(unknown)})", value)
    return dict(value)


def adapter_settings(value: Any, *, attach: bool = False, check: bool = True) -> dict:
    """The adapter's settings as a user writes them (JSON text or a dict; see the module
    docstring for the shape), checked: every key an ``AdapterConfig`` field, every value as
    ``AdapterConfig`` checks it (``check``), none of ``VLLM_FIELDS`` with ``attach``. Returns
    the keys given, values as given (keyword arguments for ``VTokenAdapter`` or
    ``VTokenAdapter.attach``; a nested planner object becomes a ``PlannerConfig`` there).
    Raises ``ConfigError`` (one line naming the field), nothing else. O(text)."""
    d = _settings_dict(value)
    if attach:
        for name in (k for k in VLLM_FIELDS if k in d):
            refuse("unsupported", _OWN, name, "left to the scheduler given to attach (vLLM's configuration is "
                                              "read off it)", d[name])
    if check:
        AdapterConfig(**d)
    return d
