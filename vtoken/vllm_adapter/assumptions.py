"""The adapter's assumptions about vLLM and about itself, as a report states them, and what
it refuses at start (a vLLM version not audited).

:data:`ASSUMPTIONS` (name -> statement) and :class:`AdapterAssumptionError`, which every
runtime check raises (its message starts ``assumption broken: <statement> [<name>]``).
Imported by every module of the adapter.
Owns: the names only, nothing at run time.
May call: vtoken.errors (``rebuilt``: how its error unpickles).
Costs: none.
"""

from __future__ import annotations

from ..errors import rebuilt

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
    "vllm_version": "the installed vLLM is a version the adapter was audited on (its contracts "
                    "and vLLM's own tests hold there; another version is audited first with "
                    "`vtoken audit --vllm VERSION`)",
    "kv_groups": "the token table mirrors one KV cache group whose blocks vLLM keeps until the "
                 "request ends (full attention); every other group (sliding window, chunked-local, "
                 "Mamba, cross-attention) is vLLM's, and no list of any group holds a block the "
                 "adapter holds",
}


class AdapterAssumptionError(AssertionError):
    """A runtime check of the adapter failed; ``check`` is the assumption's name. Pickles
    (``check``, ``detail`` and the message as they are)."""

    def __init__(self, check: str, detail: str):
        self.check = check
        self.detail = detail
        super().__init__(f"assumption broken: {ASSUMPTIONS.get(check, check)} [{check}]: {detail}")

    def __reduce__(self):
        return rebuilt, (type(self), self.args, dict(self.__dict__))


# The audit of a candidate version sets this to that version so its checks can run the adapter.
ALLOW_ENV = "VTOKEN_ALLOW_UNSUPPORTED_VLLM"


def check_supported_vllm(installed: str | None, supported) -> None:
    """Refuse, at start, a vLLM the adapter was not audited on (``vllm_version``: not one of
    ``supported``, a version or a tuple of them), unless ``$VTOKEN_ALLOW_UNSUPPORTED_VLLM``
    names exactly that version (what ``vtoken audit --vllm`` sets in the side environment it
    audits)."""
    import os

    ok = (supported,) if isinstance(supported, str) else tuple(supported)
    if installed in ok or (installed is not None and os.environ.get(ALLOW_ENV) == installed):
        return
    raise AdapterAssumptionError("vllm_version", f"vLLM {installed} is installed; the adapter supports "
                                 f"{', '.join(ok)} "
                                 f"(audit a candidate with `vtoken audit --vllm {installed}`; to run it anyway "
                                 f"set {ALLOW_ENV}={installed})")

