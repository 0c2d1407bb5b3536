"""Which of vLLM's KV cache groups the token table mirrors, derived from the managers vLLM built.

A hybrid model (Gemma 2/3, Mistral, GPT-OSS, Llama 4, Qwen3-Next) has several KV cache groups
over one block pool: full attention, sliding window, chunked-local, Mamba, cross-attention.
Token-level reclamation is sound in a group whose block list keeps every block until the
request ends (vLLM never frees one of them mid-request): only then is each block the token
table's to move, fill and release. vLLM frees the out-of-window blocks of every other kind
itself (``remove_skipped_blocks``: a null in the list); those groups stay vLLM's, and the
adapter only checks that none of their blocks is one it holds.

The table's group is derived from behaviour, not from a spec's class name (``RSWASpec`` and
``SinkFullAttentionSpec`` subclass ``FullAttentionSpec``; R-SWA frees a middle gap): the first
group whose manager is a ``FullAttentionManager`` that overrides none of the methods by which
a manager frees or sizes blocks on its own.
Owns: nothing.
May call: vLLM's manager classes (read only).
Costs: O(groups) per call.
"""

from __future__ import annotations

from dataclasses import dataclass

# The KV layouts the harness builds (``VllmHarness(kv_layout=...)``): group kinds in vLLM's order.
KV_LAYOUTS = {"full": ("full",), "hybrid": ("full", "sliding"), "sliding": ("sliding",)}

# the methods through which a manager frees blocks before the request ends, or sizes its list
# differently from the tokens it holds
_OWN_FREES = ("remove_skipped_blocks", "get_num_skipped_tokens", "get_num_blocks_to_allocate",
              "allocate_new_blocks", "cache_blocks")


def keeps_every_block(manager) -> bool:
    """Does ``manager`` keep each of a request's blocks until the request is freed (a plain
    full-attention manager: no method of ``_OWN_FREES`` overridden)?"""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    cls = type(manager)
    return isinstance(manager, FullAttentionManager) and all(
        getattr(cls, name, None) is getattr(FullAttentionManager, name, None) for name in _OWN_FREES)


def table_group(managers) -> int | None:
    """The index of the first group whose manager keeps every block (``keeps_every_block``), or
    None when none does (sliding-window or chunked-local only: nothing to reclaim)."""
    return next((g for g, m in enumerate(managers) if keeps_every_block(m)), None)


def describe(managers) -> list[str]:
    """Each group's manager class, in vLLM's group order (for reports and errors)."""
    return [type(m).__name__ for m in managers]


@dataclass(frozen=True)
class WorkerLayout:
    """What the worker reads of vLLM's KV cache groups: ``table``, the index of the group the
    token table mirrors; ``window_group`` (None: none), the sliding-window group whose layers
    read the last ``window`` positions through that group's own blocks (vLLM's positional
    block table: eviction and relocation never touch it). Which model layers are windowed
    is the model's: ``window_layers``."""

    table: int = 0
    window_group: int | None = None
    window: int = 0

    def __post_init__(self):
        """Every field checked here (``ConfigError`` naming ``WorkerLayout.<field>``), plain ints
        kept: ``table`` >= 0; ``window_group`` None or >= 0 and not ``table``; ``window`` 0
        without a window group, >= 1 with one (a window of no token reads nothing). Whether
        the groups exist is vLLM's: checked where the worker meets the adapter
        (``VTokenAdapter.attach_worker``) and vLLM's step (``WorkerCore.begin``). O(1)."""
        from ..fields import need_int, refuse

        own, put = "WorkerLayout", lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 - frozen
        put("table", need_int(own, "table", self.table, 0))
        put("window_group", need_int(own, "window_group", self.window_group, 0, none_ok=True))
        put("window", need_int(own, "window", self.window, 0))
        if self.window_group is None and self.window:
            refuse("inconsistent", own, "window", "0 without a window_group", self.window)
        if self.window_group is not None:
            if self.window_group == self.table:
                refuse("inconsistent", own, "window_group", f"a group other than the table's ({self.table})",
                       self.window_group)
            if self.window < 1:
                refuse("out_of_range", own, "window", "an integer >= 1 with a window_group", self.window)

    def groups_needed(self) -> int:
        """How many KV cache groups a step must carry for this layout: its highest index + 1."""
        return max(self.table, -1 if self.window_group is None else self.window_group) + 1

    def window_layers(self, num_layers: int) -> frozenset:
        """The windowed layers of an ``num_layers``-layer model: every second one (1, 3, ...),
        as Gemma and GPT-OSS interleave them; none without a window group."""
        return frozenset(range(1, num_layers, 2)) if self.window_group is not None else frozenset()


def worker_layout(managers) -> WorkerLayout:
    """The ``WorkerLayout`` of vLLM's managers: the table's group (``table_group``) and the first
    sliding-window group. ``ConfigError`` (``unsupported``) when no group keeps every block, or
    when the window's blocks are not the table's size (one K/V cache holds both)."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    from ..errors import ConfigError

    g = table_group(managers)
    if g is None:
        raise ConfigError("unsupported", f"no KV cache group keeps every block ({describe(managers)}): "
                                         "the worker needs a full-attention group for the token table")
    w = next((i for i, m in enumerate(managers) if isinstance(m, SlidingWindowManager)), None)
    if w is not None and managers[w].block_size != managers[g].block_size:
        raise ConfigError("unsupported", f"the sliding-window group's block size ({managers[w].block_size}) differs "
                                         f"from the table's ({managers[g].block_size}): the worker reads one cache")
    return WorkerLayout(g, w, int(managers[w].sliding_window) if w is not None else 0)
