"""Issue 38: a request for which an in-place proposal found no plan (with ``keep_prefix_bytes``
its bound counts hashed blocks no plan may fill) is skipped until its evictions could make one
(``PlanBook.no_plan``, ``planner.shortfall``), not proposed for again at every plan check; and
skipping it loses no plan: the same plans launch at the same steps as when every request with a
positive bound is proposed for at every check."""

from __future__ import annotations

import pytest

from test_adapter import make, prompt  # noqa: E402 - the adapter tests' builder (same folder)

pytestmark = pytest.mark.vllm


def _decode(model, monkeypatch, skip: bool) -> dict:
    import vtoken.vllm_adapter.plans as plans

    ad, w, d = make(model, S=4, N=200, H=0, ratio=0.5, caching=True, keep=True)
    calls = {"propose": 0, "skipped_max": 0}
    real = plans.propose

    def counting(*a, **k):
        calls["propose"] += 1
        calls["skipped_max"] = max(calls["skipped_max"], len(ad.book.no_plan))
        return real(*a, **k)

    monkeypatch.setattr(plans, "propose", counting)
    if not skip:  # the behaviour before: a request with a positive bound is proposed for at every check
        monkeypatch.setattr(ad.book, "_no_plan", lambda *a, **k: None)
    launched = []
    launch = ad.book.launch

    def spy(meta, r, p, tail, head):
        launched.append((meta.seq, r, list(p.sources), list(p.fills), list(p.dests)))
        return launch(meta, r, p, tail, head)

    ad.book.launch = spy
    for i in range(6):
        ad.add_request(f"q{i}", prompt(i, 40 + 8 * i), max_tokens=60)
    d.drain(max_steps=3000)
    ad.close()
    assert w.hash_failures == 0
    return dict(calls, launched=launched, outputs={f"q{i}": ad.output_tokens(f"q{i}") for i in range(6)})


def test_a_request_no_plan_can_serve_is_skipped_and_no_plan_is_lost(model, monkeypatch):
    with monkeypatch.context() as m:
        every = _decode(model, m, skip=False)
    with monkeypatch.context() as m:
        skipping = _decode(model, m, skip=True)
    assert every["launched"], "no plan launched: the workload does not exercise the planner"
    assert skipping["launched"] == every["launched"]  # the same plans, at the same steps
    assert skipping["outputs"] == every["outputs"]
    assert every["skipped_max"] == 0 < skipping["skipped_max"]
    # proposals that found nothing are what the skip saves
    assert skipping["propose"] * 2 <= every["propose"], (skipping["propose"], every["propose"])
