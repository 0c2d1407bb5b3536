"""Issue 38: a block's prefix-cache hash is dropped only when its bytes change or it is
reused. A plan's sources are only read by its copy: their hashes are parked while it flies (no
prefix hit lands on a block in flight) and put back when they return to vLLM's pool, so a later
request repeating the prompt hits them; fills (their holes take moved tokens) lose theirs."""

from __future__ import annotations

import pytest

from test_adapter import make, prompt  # noqa: E402 - the adapter tests' builder (same folder)

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("lag", [0, 3])
def test_sources_keep_their_hash_and_fills_lose_theirs(model, lag):
    S = 4
    ad, w, d = make(model, S=S, N=96, H=0, ratio=0.5, lag=lag, caching=True)
    for i in range(3):
        ad.add_request(f"q{i}", prompt(i, 28 + 4 * i), max_tokens=40)
    parked, fills, restored = {}, {}, 0
    orig_park, orig_restore = ad.hashes.park, ad.hashes.restore

    def park(plan_id, r, sources, fill_blocks, list_index):
        hashed = {b.block_id: b.block_hash for b in sources if b.block_hash is not None}
        out = orig_park(plan_id, r, sources, fill_blocks, list_index)
        assert set(out) <= set(hashed)  # only hashed sources are parked...
        for b in out:  # ...and no prefix hit can land on them while the copy flies
            assert ad.block(b).block_hash is None
        parked[plan_id] = {b: hashed[b] for b in out}
        fills[plan_id] = [b.block_id for b in fill_blocks]
        return out

    def restore(plan_id):
        nonlocal restored
        orig_restore(plan_id)
        for b, h in parked.get(plan_id, {}).items():  # the very hash it had, on the very block
            assert ad.block(b).block_hash == h, (b, ad.block(b).block_hash, h)
            restored += 1

    ad.hashes.park, ad.hashes.restore = park, restore
    while ad.has_work():
        d.step()
        for pid, p in ad.plans.items():  # in flight: parked sources and fills carry no hash
            assert all(ad.block(b).block_hash is None for b in p.sources + p.fills), pid
    ad.close()
    assert restored > 0 and ad.stats["source_hashes_restored"] == restored, (restored, ad.stats)
    assert sum(map(len, fills.values())) > 0 and w.hash_failures == 0
    cached = {b.block_id for b in ad.pool.free_block_queue.get_all_free_blocks() if b.block_hash is not None}
    assert any(b in cached for ps in parked.values() for b in ps), "no restored source is a cached free block"


def test_keep_prefix_bytes_keeps_every_hit_of_the_repeated_sequences(model):
    """``keep_prefix_bytes`` (on by default): no in-place plan fills a block whose hash
    describes its bytes, so the audit's repeated sequences hit the prefix cache at least as
    often as under Naive-Evict, every hit serving the bytes a fresh prefill writes, while
    relocations still happen."""
    from vtoken.reports import vllm_runs

    res = vllm_runs.prefix_equality(quick=True, seed=0)  # the default
    assert res["passed"], res["detail"]
    row, = res["runs"]
    on = row["cache_on"]
    assert on["hit_rate_off"] > 0 and on["hit_rate_on"] >= on["hit_rate_off"], on
    assert row["relocations"] > 0 and row["hits_served_fresh_bytes_vtoken"]


def test_without_keep_prefix_bytes_fills_cost_hits(model):
    """The control: with the setting off, fills take hashed prompt blocks and lose their hash,
    and the repeated sequences hit the prefix cache less often than under Naive-Evict."""
    from vtoken.reports import vllm_runs

    res = vllm_runs.prefix_equality(quick=True, seed=0, keep_prefix_bytes=False)
    on = res["runs"][0]["cache_on"]
    assert res["passed"] and on["hit_rate_on"] < on["hit_rate_off"], on


def test_hashed_blocks_are_emptied_into_headroom_destinations(model):
    """With ``keep_prefix_bytes`` a hashed block is never a fill; what the other blocks' holes cannot take goes
    to fresh headroom destinations (plans with fills and destinations, holes first): each
    plan's moves checked against the reference contract with the headroom in its view."""
    from vtoken.invariants.plan_contract import check_proposal

    ad, w, d = make(model, S=4, N=96, H=4, ratio=0.5, caching=True, keep=True)
    ad.plan_hook = check_proposal
    assert ad.config.keep_prefix_bytes
    hashed_fills, with_dests = [], 0
    launch = ad.book.launch

    def spy(meta, r, p, tail, head):
        nonlocal with_dests
        hashed_fills.extend(b for b in p.fills if ad.block(b).block_hash is not None)
        with_dests += bool(p.dests)
        return launch(meta, r, p, tail, head)

    ad.book.launch = spy
    for i in range(3):
        ad.add_request(f"q{i}", prompt(i, 28 + 4 * i), max_tokens=40)
    while ad.has_work():
        d.step()
    ad.close()
    assert not hashed_fills and with_dests > 0 and w.hash_failures == 0, (hashed_fills, with_dests, ad.stats)
