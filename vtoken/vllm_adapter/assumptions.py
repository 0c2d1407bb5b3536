"""The adapter's assumptions about vLLM and about itself, as a report states them, and what
it refuses at start.

:data:`ASSUMPTIONS` (name -> statement) and :class:`AdapterAssumptionError`, which every
runtime check raises (its message starts ``assumption broken: <statement> [<name>]``).
Refused at start, before anything is built: a vLLM version not audited, a KV layout not
supported, and a bad configuration field of the adapter's constructors (:func:`check_field`,
raising :class:`vtoken.errors.ConfigError` naming the field and the value).
Imported by every module of the adapter.
Owns: the names only, nothing at run time.
May call: numpy (scalar types), torch (device names), ``vtoken.errors``; nothing else.
Costs: none at run time; O(1) per field checked.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError

# name -> the assumption, as a report states it.
ASSUMPTIONS: dict[str, str] = {
    "fence": "sources freed only after the fence (their copy completed and the step that "
             "carried the plan processed)",
    "prefix_hash": "no relocated block keeps a stale prefix-cache hash (destinations are "
                   "never hashed; sources and fills lose their hash at launch; a released block keeps it "
                   "only if it was computed with full context)",
    "null_substitution": "moved or released blocks are null-substituted in req_to_blocks, "
                         "list length kept (never popped)",
    "reservation": "headroom blocks are held with ref_cnt 1, unhashed, and never handed to "
                   "allocate_slots (in no request's block list)",
    "shared_never_moved": "shared-prefix blocks are never moved",
    "table_in_step": "the token table is in step with the scheduler's block lists",
    "ownership": "every reference the adapter holds is accounted for in the pool",
    "all_returned": "every block returns to the pool after drain (free count N-1)",
    "plan_contract": "every plan satisfies the planner contract (vtoken.spec.planner) and is optimal",
    "hash_and_compare": "every relocation preserves the ordered live token ids and their K/V "
                        "bytes (hash-and-compare)",
    "outputs_equal": "reclamation does not change the output of a request computed alike (same "
                     "eviction decisions, same prefix-cache hits and preemptions), token for token",
    "vllm_version": "the installed vLLM is the version the adapter was audited on (its contracts "
                    "and vLLM's own tests hold there; another version is audited first with "
                    "`vtoken audit --vllm VERSION`)",
    "single_full_attention_pool": "the KV cache is one block pool of one full-attention KV "
                                  "group (no sliding-window, chunked-local or hybrid groups: vLLM "
                                  "itself puts the null block in their lists, and their blocks are "
                                  "not the token table's)",
}


class AdapterAssumptionError(AssertionError):
    """A runtime check of the adapter failed; ``check`` is the assumption's name."""

    def __init__(self, check: str, detail: str):
        self.check = check
        self.detail = detail
        super().__init__(f"assumption broken: {ASSUMPTIONS.get(check, check)} [{check}]: {detail}")


def check_supported_kv_config(kv_cache_config) -> None:
    """Refuse, at start, a KV layout the adapter does not support (``single_full_attention_pool``):
    exactly one KV cache group whose spec is vLLM's ``FullAttentionSpec`` or a subclass (MLA;
    a full-attention spec recording a sliding window still allocates blocks for every token,
    so it is accepted); ``SlidingWindowSpec``, ``ChunkedLocalAttentionSpec``, Mamba and hybrid
    (several groups) layouts are refused. Raises
    :class:`AdapterAssumptionError` naming the group, before any state is built."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise AdapterAssumptionError("single_full_attention_pool", f"{len(groups)} KV cache groups {kinds}; "
                                     "the adapter supports exactly one")
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec):
        raise AdapterAssumptionError("single_full_attention_pool", f"the KV cache group's spec is "
                                     f"{type(spec).__name__}, not full attention")


# The audit of a candidate version sets this to that version so its checks can run the adapter.
ALLOW_ENV = "VTOKEN_ALLOW_UNSUPPORTED_VLLM"


def check_supported_vllm(installed: str | None, supported: str) -> None:
    """Refuse, at start, a vLLM the adapter was not audited on (``vllm_version``), unless
    ``$VTOKEN_ALLOW_UNSUPPORTED_VLLM`` names exactly that version (what ``vtoken audit --vllm``
    sets in the side environment it audits)."""
    import os

    if installed == supported or (installed is not None and os.environ.get(ALLOW_ENV) == installed):
        return
    raise AdapterAssumptionError("vllm_version", f"vLLM {installed} is installed; the adapter supports {supported} "
                                 f"(audit a candidate with `vtoken audit --vllm {installed}`; to run it anyway "
                                 f"set {ALLOW_ENV}={installed})")


def _is_bool(v) -> bool:
    return isinstance(v, (bool, np.bool_))


def _is_int(v) -> bool:
    return not _is_bool(v) and isinstance(v, (int, np.integer))


def check_field(owner: str, name: str, value, kind: str, lo=None, hi=None, choices=(), types=(),
                optional: bool = False):
    """One field of a constructor's configuration, refused before anything is built.

    ``kind``: ``"bool"`` (True or False); ``"int"`` (an integer, not a bool, in ``[lo, hi]``,
    either bound None for none); ``"number"`` (a finite int or float, not a bool, with
    ``lo <= value < hi``); ``"choice"`` (one of ``choices``); ``"instance"`` (an instance of
    ``types``). ``optional``: None is accepted too. Raises :class:`~vtoken.errors.ConfigError`
    (``bad_type`` for the wrong kind of value, ``out_of_range`` for one outside its range)
    with ``<owner>.<name> must be <what>, got <value>``; returns the value as a plain Python
    ``bool`` / ``int`` / ``float`` (numpy scalars converted). O(1).
    """
    if value is None and optional:
        return None

    def refuse(code: str, want: str):
        raise ConfigError(code, f"{owner}.{name} must be {want}{' or None' if optional else ''}, got {value!r}")

    if kind == "bool":
        if not _is_bool(value):
            refuse("bad_type", "True or False")
        return bool(value)
    if kind == "int":
        want = "an integer" + (f" >= {lo}" if lo is not None and hi is None else "") + \
               (f" in [{lo}, {hi}]" if lo is not None and hi is not None else "")
        if not _is_int(value):
            refuse("bad_type", want)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            refuse("out_of_range", want)
        return int(value)
    if kind == "number":
        want = f"a finite number in [{lo}, {hi})"
        if _is_bool(value) or not isinstance(value, (int, float, np.integer, np.floating)):
            refuse("bad_type", want)
        if not (math.isfinite(float(value)) and lo <= value < hi):
            refuse("out_of_range", want)
        return float(value)
    if kind == "choice":
        if not isinstance(value, str):
            refuse("bad_type", f"one of {sorted(choices)}")
        if value not in choices:
            refuse("out_of_range", f"one of {sorted(choices)}")
        return value
    if kind == "instance":
        if not isinstance(value, types):
            refuse("bad_type", "a " + " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,))))
        return value
    raise ValueError(f"check_field: unknown kind {kind!r}")


def check_device(owner: str, name: str, device):
    """A device field: a ``str`` or ``torch.device`` torch parses, CUDA only where CUDA is
    available (:class:`~vtoken.errors.ConfigError` otherwise). Returns it unchanged."""
    import torch

    check_field(owner, name, device, "instance", types=(str, torch.device))
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ConfigError("out_of_range", f"{owner}.{name} must be a device torch knows, got {device!r} ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("out_of_range", f"{owner}.{name} must be a device this machine has, got {device!r} "
                                          f"(no CUDA device)")
    return device
