"""The port (``vtoken.vllm_adapter.port``): the one place the adapter's blocks go back to vLLM,
unit by unit over a stand-in pool and scheduler (which record what they are given). The
scenarios over vLLM's scheduler see a port that frees late only as blocks held longer, and its
counter (``deferred_free_calls``, which the audit's vllm-own-tests check reads to explain a
failure by the adapter's held blocks) not at all. Imports no vLLM."""

from collections import Counter
from types import SimpleNamespace

from test_fence import _harness, _step  # the fence tests' stand-ins (same folder)

from vtoken.vllm_adapter.fence import StepClock
from vtoken.vllm_adapter.port import VllmPort


class _Pool:
    def __init__(self, n: int = 16):
        self.blocks = [SimpleNamespace(block_id=i) for i in range(n)]
        self.freed: list[list[int]] = []  # each free_blocks call's block ids, in order
        self.next = 8

    def free_blocks(self, blocks):
        self.freed.append([b.block_id for b in blocks])

    def get_new_blocks(self, n):
        out = self.blocks[self.next:self.next + n]
        self.next += n
        return out

    def get_num_free_blocks(self):
        return 5


def _port(own: bool = True):
    cow = []
    h = _harness(defer=not own, sched_step_seq=0, processed_step_seq=0,
                 _free_cow_retained_blocks=lambda blocks, fence: cow.append(([b.block_id for b in blocks], fence)))
    h.pool = _Pool()
    clock = StepClock(h)
    stats = dict(deferred_free_calls=0)
    return VllmPort(h, clock, stats), h, clock, stats, cow


def _advance(clock, steps: int) -> None:
    for _ in range(steps):
        clock.scheduled(_step("a"))
        clock.processing(_step("a"))


def test_a_fenced_free_is_at_once_when_its_step_was_processed_else_at_the_drain_that_reaches_it():
    port, h, clock, stats, _ = _port()
    _advance(clock, 2)  # processed: 2
    port.free([1, 2], fence=2)
    assert h.pool.freed == [[1, 2]] and not port.deferred
    port.free([3], fence=4)
    port.free([4, 5], fence=3)  # a request's fence may trail a later plan's
    assert h.pool.freed == [[1, 2]] and port.deferred_counts() == Counter({3: 1, 4: 1, 5: 1})
    port.drain()
    assert h.pool.freed == [[1, 2]]  # nothing due yet
    _advance(clock, 1)  # processed: 3
    port.drain()
    assert h.pool.freed == [[1, 2], [4, 5]] and port.deferred_counts() == Counter({3: 1})
    _advance(clock, 1)
    port.drain()
    assert h.pool.freed == [[1, 2], [4, 5], [3]] and not port.deferred and port.deferred_counts() == Counter()
    assert stats["deferred_free_calls"] == 3  # every fenced free counted, at once or not


def test_on_vllms_clock_a_fenced_free_is_vllms_own_deferred_free():
    port, h, clock, stats, cow = _port(own=False)
    port.free([6, 7], fence=9)
    assert cow == [([6, 7], 9)] and h.pool.freed == [] and not port.deferred and stats["deferred_free_calls"] == 1


def test_the_headroom_is_reserved_from_the_pool_and_given_back_without_a_fence():
    port, h, clock, stats, _ = _port()
    assert port.reserve(0) == [] and h.pool.next == 8  # asks the pool for nothing
    assert port.reserve(3) == [8, 9, 10]
    port.unreserve([9, 8])
    assert h.pool.freed == [[9, 8]] and stats["deferred_free_calls"] == 0 and port.num_free() == 5
