"""A prefix-cache hit on blocks another request of the same step writes. vLLM caches a full
block when it schedules the tokens that fill it, so a request admitted later in the same
``schedule()`` hits the blocks an earlier one prefills in that very step (vLLM's attention
writes every request's K/V before any reads them). The worker must place the earlier
request's tokens before the later one's hit: a 10-minute adapter campaign found the batched
step placing every hit first (``TableError[slot_conflict]``)."""

from __future__ import annotations

import pytest

from test_adapter import make, prompt  # noqa: E402 - the adapter tests' builder (same folder)

pytestmark = pytest.mark.vllm


def _run(model, caching: bool, async_: bool):
    # a 28-token prompt in chunks of 20: a's second chunk completes its half-written block 2
    # (and writes block 3) while b, admitted in the same step, hits blocks 0-2
    ad, w, d = make(model, S=8, N=48, H=2, caching=caching, async_=async_, ratio=0.5, batched=20)
    firsts = []
    schedule = ad.scheduler.schedule

    def spy(*a, **kw):
        so = schedule(*a, **kw)
        if any(r.req_id == "b" for r in so.scheduled_new_reqs):
            firsts.append((dict(so.num_scheduled_tokens), {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}))
        return so

    ad.scheduler.schedule = spy
    p = prompt(0, 28)
    ad.add_request("a", p, max_tokens=6)
    d.step()
    ad.add_request("b", p + [5], max_tokens=6)
    d.drain()
    ad.close()
    return firsts[0], {r: ad.output_tokens(r) for r in "ab"}


@pytest.mark.parametrize("async_", [False, True])
def test_a_hit_on_blocks_written_in_the_same_step(model, async_):
    first, outs = _run(model, True, async_)
    assert first == ({"a": 8, "b": 5}, {"b": 24}), first  # b hits blocks 0-2 as a completes block 2: one step
    _, alone = _run(model, False, async_)
    assert outs == alone  # the hit served the bytes a's prefill wrote in that step
