"""Eviction policies: the select_victims contract for all, each policy's own rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vtoken.policies as policies_pkg
from vtoken.policies import POLICIES, H2O, Policy, Scissorhands, StreamingLLM, make_policy

NAMES = sorted(POLICIES)
POLICY_FILES = ["h2o.py", "streaming.py", "scissorhands.py", "random_policy.py"]


def drive(policy: Policy, n_prompt: int, steps: int, budget: int, seed: int = 0,
          req_id=0) -> list[np.ndarray]:
    """Simulate an engine: observe random attention, evict to budget, add a token."""
    rng = np.random.default_rng(seed)
    live = np.arange(n_prompt)
    history = []
    for _ in range(steps):
        policy.observe(req_id, live, rng.dirichlet(np.ones(live.size)))
        victims = policy.select_victims(req_id, live, budget)
        history.append(victims)
        live = np.append(np.setdiff1d(live, victims), live.max() + 1)
    return history


def test_registry():
    assert set(POLICIES) == {"h2o", "streaming", "scissorhands", "random"}
    for name in NAMES:
        p = make_policy(name)
        assert isinstance(p, Policy) and p.name == name
    with pytest.raises(ValueError):
        make_policy("lru")
    assert make_policy("random", seed=3, recent=2).recent == 2


@pytest.mark.parametrize("name", POLICY_FILES)
def test_policy_files_are_small(name):
    path = Path(policies_pkg.__file__).parent / name
    assert len(path.read_text().splitlines()) < 50


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 60), budget=st.integers(1, 70), seed=st.integers(0, 2**16),
       gaps=st.lists(st.integers(0, 3), min_size=60, max_size=60))
def test_select_victims_contract(name, n, budget, seed, gaps):
    policy = make_policy(name)
    live = np.cumsum(np.array(gaps[:n]) + 1) - 1  # increasing ids with holes
    rng = np.random.default_rng(seed)
    policy.observe(7, live, rng.random(n))
    victims = policy.select_victims(7, live, budget)
    assert victims.dtype == np.int64
    assert np.all(np.diff(victims) > 0)  # sorted, distinct
    assert np.isin(victims, live).all()
    assert live[-1] not in victims  # never the newest
    assert n - victims.size == min(n, budget)  # exactly down to the budget
    if n <= budget:
        assert victims.size == 0


@pytest.mark.parametrize("name", NAMES)
def test_budget_below_one_rejected(name):
    with pytest.raises(ValueError):
        make_policy(name).select_victims(0, np.arange(5), 0)
    assert make_policy(name).select_victims(0, np.arange(0), 0).size == 0


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_and_forget(name):
    a = drive(make_policy(name), 20, 30, 12)
    b = drive(make_policy(name), 20, 30, 12)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    p = make_policy(name)
    first = drive(p, 20, 30, 12, req_id="r")
    p.forget("r")  # a fresh start for the same id gives the same answers
    again = drive(p, 20, 30, 12, req_id="r")
    assert all(np.array_equal(x, y) for x, y in zip(first, again))


def test_random_seeds_and_per_request_independence():
    a = drive(make_policy("random", seed=1), 40, 5, 20)
    b = drive(make_policy("random", seed=2), 40, 5, 20)
    assert any(not np.array_equal(x, y) for x, y in zip(a, b))
    # interleaving another request's calls must not change request 0's victims
    p = make_policy("random", seed=1)
    live = np.arange(40)
    p.select_victims(99, live, 5)
    p.select_victims("other", live, 5)
    assert np.array_equal(p.select_victims(0, live, 20), a[0])


def test_random_protects_recent_and_is_roughly_uniform():
    p = make_policy("random", seed=0, recent=8)
    counts = np.zeros(100)
    for r in range(300):
        v = p.select_victims(r, np.arange(100), 50)
        assert v.max() < 92
        counts[v] += 1
    eligible = counts[:92]
    assert eligible.min() > 0.6 * eligible.mean() and eligible.max() < 1.4 * eligible.mean()


def test_h2o_keeps_heavy_hitters_and_recent_window():
    p = H2O(recent=4)
    live = np.arange(30)
    heavy = np.array([2, 9, 17])
    for _ in range(5):
        attn = np.full(30, 0.01)
        attn[heavy] = 1.0
        p.observe(0, live, attn)
    victims = p.select_victims(0, live, 8)  # keep 4 recent + the 4 best older ones
    kept = np.setdiff1d(live, victims)
    assert set(heavy) <= set(kept)
    assert set(range(26, 30)) <= set(kept)
    # scores accumulate: a token heavy once, long ago, beats one slightly above average now
    q = H2O(recent=1)
    q.observe(0, np.arange(4), np.array([3.0, 0.0, 0.0, 0.0]))
    for _ in range(3):
        q.observe(0, np.arange(4), np.array([0.0, 0.5, 0.2, 0.3]))
    assert q.select_victims(0, np.arange(4), 2).tolist() == [1, 2]


def test_h2o_recent_ratio_and_unobserved_tokens():
    p = H2O(recent_ratio=0.5)
    live = np.arange(20)
    p.observe(0, live[:10], np.linspace(1, 0, 10))  # tokens 10..19 never observed
    kept = np.setdiff1d(live, p.select_victims(0, live, 10))
    assert set(range(15, 20)) <= set(kept)  # window = 5
    assert set(range(0, 5)) <= set(kept)  # the best-scored older tokens


def test_streaming_keeps_sinks_and_window():
    p = StreamingLLM(sink=4)
    live = np.arange(100)
    kept = np.setdiff1d(live, p.select_victims(0, live, 20))
    assert kept.tolist() == [0, 1, 2, 3] + list(range(84, 100))
    # with the middle already gone, sinks stay and the oldest survivors go next
    live2 = np.concatenate([np.arange(4), np.arange(84, 101)])
    kept2 = np.setdiff1d(live2, p.select_victims(0, live2, 20))
    assert kept2.tolist() == [0, 1, 2, 3] + list(range(85, 101))


def test_scissorhands_importance_rule():
    p = Scissorhands(history=3, recent=1)
    ids = np.arange(4)
    # t = 4 -> threshold 1/4 (values exact in binary): token 1 sits exactly on it and is
    # important; token 2 is below. With a strict '>' token 1 would tie with 2 and go first.
    step = np.array([0.5, 0.25, 0.1875, 0.0625])
    p.observe(0, ids, step)
    p.observe(0, ids, step)
    assert p.select_victims(0, ids, 3).tolist() == [2]
    # history window: after 3 newer steps where token 0 is unimportant, it is the first out
    for _ in range(3):
        p.observe(0, ids, np.array([0.0, 0.25, 0.25, 0.5]))
    assert p.select_victims(0, ids, 3).tolist() == [0]
    # scale-free: layer-summed stats (sum = L) give the same decisions as probabilities
    q = Scissorhands(history=3, recent=1)
    for _ in range(2):
        q.observe(0, ids, 4 * step)
    assert q.select_victims(0, ids, 3).tolist() == [2]


def test_scissorhands_average_over_presence():
    p = Scissorhands(history=10, recent=1)
    p.observe(0, np.arange(3), np.array([0.1, 0.8, 0.1]))  # token 1 important
    p.observe(0, np.arange(4), np.array([0.1, 0.1, 0.7, 0.1]))  # token 3 arrives, not important
    p.observe(0, np.arange(5), np.array([0.05, 0.05, 0.05, 0.8, 0.05]))
    # averages: 0 -> 0/3, 1 -> 1/3, 2 -> 1/3, 3 -> 1/2 ; newest (4) protected
    assert p.select_victims(0, np.arange(5), 2).tolist() == [0, 1, 2]
    assert p.select_victims(0, np.arange(5), 4).tolist() == [0]
