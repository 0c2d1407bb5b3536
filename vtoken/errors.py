"""Errors raised by vtoken.

Every error carries a stable ``code``, shared with the reference model in ``spec/`` (its own
exception type, the same codes), so the fuzzers compare what went wrong. A failed operation
never changes state: every mutating call validates its whole input before writing.

Owns: nothing (the exception classes and the code lists).
May call: the standard library only; never spec/, invariants/, fuzz/ or reports/.
Costs: O(1).
"""

from __future__ import annotations


def rebuilt(cls: type, args: tuple, state: dict) -> BaseException:
    """An exception of ``cls`` with ``args`` and attributes ``state``, made without calling its
    ``__init__`` (what unpickling calls: an error's constructor takes other arguments than
    the ``args`` it stores)."""
    e = cls.__new__(cls, *args)
    e.args = args
    e.__dict__.update(state)
    return e


class VTokenError(Exception):
    """Base class. ``code`` names the problem; the message says where. Pickles (every
    subclass: its message and attributes as they are), so an error raised in a worker
    process reaches the engine that started it."""

    code = "error"

    def __init__(self, code: str, message: str):
        super().__init__(f"[{code}] {message}")
        self.code = code

    def __reduce__(self):
        return rebuilt, (type(self), self.args, dict(self.__dict__))


class TableError(VTokenError):
    """A token-table operation was given bad input (nothing was changed)."""


class AllocatorError(VTokenError):
    """A block-allocator operation was given bad input or could not be served."""


class PlanError(VTokenError):
    """A reclamation plan is invalid or used out of its lifecycle order."""


class SnapshotError(VTokenError):
    """A plan snapshot is malformed; the message names the field."""


class RelocationCheckError(VTokenError):
    """Hash-and-compare found a relocation that changed a token's id or K/V bytes.

    ``violations``: what was found, as the checkers' one result shape (the toolkit's
    ``Violation`` records, built by the checker that raises this: ``invariants.relocation_hash``);
    empty where the system raises it itself (the decode engine's sentinel check, which names
    no toolkit type)."""

    def __init__(self, code: str, message: str, violations: list | None = None):
        super().__init__(code, message)
        self.violations = list(violations or [])


class CallError(VTokenError, ValueError):
    """A call of the system was given arguments it refuses (``code`` in ``CALL_CODES``);
    nothing was changed. A ``ValueError`` too, so callers that caught the bare one still do."""


class CallTypeError(CallError, TypeError):
    """A :class:`CallError` about an argument's type (a ``TypeError`` too)."""


class CallIndexError(CallError, IndexError):
    """A :class:`CallError` about an index out of its range (an ``IndexError`` too)."""


class OrderError(VTokenError, RuntimeError):
    """An operation called out of its order or against a state it cannot serve (``code`` in
    ``ORDER_CODES``): not set up, a step before the previous one ended, a run that did not
    finish. A ``RuntimeError`` too."""


class ConfigError(VTokenError, ValueError):
    """A configuration object was built with a bad field (``code`` in ``CONFIG_CODES``); the
    message names the field and the value. Raised at construction, before anything uses it."""


# The codes a token table raises. Kept here as the single list both sides document.
TABLE_CODES = (
    "unknown_request",     # req_id not registered
    "length_decrease",     # sync_new_tokens with total_len below the current length
    "blocks_short",        # block_ids too short to hold total_len tokens
    "block_out_of_range",  # a block id outside [0, num_blocks)
    "null_block",          # a token would be placed in the null block 0
    "slot_conflict",       # a new token's slot is held by a different token
    "unknown_token",       # token id outside [0, length)
    "dead_token",          # token already evicted
    "duplicate_token",     # a token named twice in one batch
    "bad_offset",          # an offset outside [0, block_size)
    "wrong_source",        # move source differs from the token's current location
    "shared_block",        # move out of or into a block referenced by several requests
    "foreign_block",       # move destination owned by another request
    "slot_occupied",       # move destination holds a live token
    "duplicate_destination",  # two moves name the same destination slot
    "bad_move",            # a move that is not five integers (a row of another length, a non-integer entry)
    "block_not_empty",     # release_empty_blocks of a block that still holds a live token
    "duplicate_block",     # release_empty_blocks naming a block twice
    "not_integer",         # a token id, block id or length that is not an integer (bool, float, str,
                           # None, object, float/bool array or tensor), or a list of them that is not flat
    "bad_request_id",      # a request id that cannot be a dict key (unhashable)
    "bad_config",          # TokenTable(block_size, num_blocks, device) outside its stated limits
)

# The codes a block allocator raises (AllocatorError).
ALLOCATOR_CODES = (
    "bad_config",          # BlockAllocator(num_blocks) with fewer than two blocks or beyond the limit
    "not_integer",         # a count or block id that is not an integer (bool, float, str, None, ...)
    "bad_count",           # allocate / reserve of a negative count
    "out_of_blocks",       # allocate / reserve of more blocks than are free
    "block_out_of_range",  # a block id outside [0, num_blocks)
    "null_block",          # the null block 0 named in incref / free / take_reserved / unreserve
    "not_allocated",       # incref of a block that is not in use
    "double_free",         # free of a block more times than it is referenced, or of a free/reserved block
    "duplicate_block",     # take_reserved / unreserve naming a block twice
    "not_reserved",        # take_reserved / unreserve of a block that is not reserved
)

# The codes a snapshot check raises (SnapshotError); the message names the field.
SNAPSHOT_CODES = (
    "schema",         # unknown or missing schema version
    "missing_field",  # a required field is absent
    "bad_field",      # a field of the wrong type or shape (a bool where an int is expected included)
    "out_of_range",   # an integer outside its stated limit (vtoken.snapshot.LIMITS)
    "too_large",      # a list, name or file longer than its stated limit
    "bad_count",      # counts that disagree (tokens vs length, tokens vs slots, ...)
    "null_block",     # a live token or a destination in the null block 0
    "bad_json",       # not JSON, or JSON the schema refuses (NaN, duplicate keys, huge integers)
    "bad_encoding",   # bytes that are not UTF-8
    "too_deep",       # nesting deeper than the parser's limit
    "unreadable",     # a path that cannot be read as a file (a directory, missing, no permission)
)

# The codes a configuration object raises (ConfigError) at construction; the message names the field.
CONFIG_CODES = (
    "bad_type",      # a field of the wrong type (a bool where a number belongs included, a float where an int does)
    "out_of_range",  # a number outside the field's stated range (NaN and infinities included)
    "inconsistent",  # fields that disagree with each other (heads not a multiple of KV heads, ...)
    "unsupported",   # a setting the system does not implement (a model feature, a CPU-only knob on CUDA)
)

# The codes a call of the system raises (CallError) for arguments it refuses.
CALL_CODES = (
    "bad_type",        # an argument of the wrong type (slots that are not integers, a checker that is not callable)
    "bad_shape",       # a tensor or array of the wrong shape or of lengths that disagree
    "bad_value",       # a value outside what the call accepts (an empty prompt, a budget below 1, ...)
    "duplicate_slot",  # two requests or two copies writing one slot, or a write slot also read
    "duplicate_request",  # a request id admitted twice
    "unknown_name",    # a name not in the registry it is looked up in (a policy)
    "bad_weights",     # a checkpoint whose tensors do not match the model
    "out_of_range",    # a slot or layer index outside its range (CallIndexError)
)

# The codes a plan's lifecycle raises (PlanError): a plan refused, or a block used out of its owner's hands.
PLAN_CODES = (
    "bad_state",       # launch of a plan not planned (launched already, or ended)
    "stale_plan",      # a destination no longer in the headroom at launch
    "overlap",         # a plan naming a block twice, or a block of a plan in flight
    "ownership",       # a block taken, released or handed on by someone who does not hold it
    "shared_source",   # a source another request references at apply (shared blocks never move)
    "shared_fill",     # a fill not the request's alone at apply (the copy already wrote it)
    "not_emptied",     # a source that would keep a live token, or a move out of a block not a source
)
# The codes an operation out of its order raises (OrderError).
ORDER_CODES = (
    "not_set_up",      # used before its setup
    "out_of_order",    # a step before the previous one ended
    "state_mismatch",  # the caller's view and the system's disagree (a chunk start, a request's length)
    "did_not_finish",  # a bounded run that did not end within its bound
)
