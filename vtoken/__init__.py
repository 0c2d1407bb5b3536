"""vtoken: token-level KV-cache virtualization over a block-paged KV cache. The system lives
here; the reference model is ``vtoken.spec`` (``spec/``), the checkers ``vtoken.invariants``
(``invariants/``), the fuzzers ``vtoken.fuzz`` (``fuzz/``).

Owns: nothing (re-exports ``TokenTable``, ``BlockAllocator`` and the error types).
May call: vtoken.table, vtoken.allocator, vtoken.errors; never spec/, invariants/, fuzz/ or
reports/.
Costs: importing it imports the table (torch, numpy); nothing runs.
"""

from .allocator import BlockAllocator
from .errors import AllocatorError, PlanError, SnapshotError, TableError, VTokenError
from .table import TokenTable

__all__ = ["BlockAllocator", "TokenTable", "VTokenError", "TableError", "AllocatorError", "PlanError", "SnapshotError"]
__version__ = "0.1.0"
