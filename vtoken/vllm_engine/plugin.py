"""How vtoken plugs into an unmodified vLLM: its attention backend chosen in every engine
process that runs vtoken, and the hooks the toolkit offers found by name.

- :func:`register` is vtoken's ``vllm.general_plugins`` entry point: vLLM calls it in each of
  its processes (frontend, engine core, workers). It installs :func:`install`'s selector.
- :func:`install` wraps the platform's ``get_attn_backend_cls``: for a model built under a
  vLLM config whose ``additional_config`` has a ``vtoken`` key, decoder full attention is
  vtoken's backend (``attention.VTokenAttentionBackend``); anything else is vLLM's choice,
  unchanged. (vLLM's CPU platform ignores ``attention_config.backend``, CUSTOM included, so
  the choice is made here.) ``vtoken.vllm_engine.worker.Worker`` installs it too, so a worker
  finds it even where the entry point is not installed.
- :func:`load_hook` finds a callable the toolkit registers under the ``vtoken.hooks`` entry
  point group (``relocation_checker``: hash-and-compare of every relocation): the system never
  imports the toolkit; an engine that asks for a hook nobody provides is refused at start.
Owns: nothing (the wrapped selector keeps vLLM's as ``_vtoken_inner``).
May call: vLLM's platform and config (read), ``importlib.metadata``.
Costs: one dictionary look-up per attention layer built.
"""

from __future__ import annotations

from ..errors import ConfigError

BACKEND = "vtoken.vllm_engine.attention.VTokenAttentionBackend"
HOOKS = "vtoken.hooks"  # the entry-point group of the toolkit's hooks

__all__ = ["register", "install", "load_hook", "BACKEND", "HOOKS"]


def register() -> None:
    """vLLM's general-plugin entry point (``vllm.general_plugins``: ``vtoken``)."""
    install()


def _wants_vtoken(selector_config) -> bool:
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    extra = getattr(cfg, "additional_config", None) or {}
    return "vtoken" in extra and not getattr(selector_config, "use_mla", False)


def install() -> None:
    """Wrap the current platform's attention selector (idempotent)."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    inner = cls.get_attn_backend_cls
    if getattr(inner, "_vtoken_inner", None) is not None:
        return
    inner_fn = inner.__func__

    def get_attn_backend_cls(klass, selected_backend, attn_selector_config, *args, **kwargs):
        if _wants_vtoken(attn_selector_config):
            return BACKEND
        return inner_fn(klass, selected_backend, attn_selector_config, *args, **kwargs)

    get_attn_backend_cls._vtoken_inner = inner_fn
    cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def load_hook(name: str):
    """The toolkit's hook ``name`` (an entry point of ``vtoken.hooks``); ``ConfigError`` when
    no installed package provides it."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=HOOKS) if ep.name == name]
    if not found:
        raise ConfigError("unsupported", f"vtoken: the hook {name!r} is not installed (entry point group {HOOKS!r}; "
                                         f"it ships with the vtoken package: reinstall it)")
    return found[0].load()
