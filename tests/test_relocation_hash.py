"""Hash-and-compare (invariants/relocation_hash.py): byte-exact digests, the device
fingerprint (exact integer arithmetic, run here on the CPU), and the checker around real
plans of the reclamation manager with the CPU copy engine."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch

from vtoken.allocator import BlockAllocator
from vtoken.copy_engine import KVCopyEngine
from vtoken.errors import RelocationCheckError
from vtoken.invariants.relocation_hash import (RelocationChecker, _mul32, device_fingerprint, request_digest,
                                               token_layer_digests)
from vtoken.kvcache import KVCache
from vtoken.planner import PlannerConfig, ReclamationManager
from vtoken.snapshot import load as load_snapshot
from vtoken.table import TokenTable

S, NB, L = 4, 48, 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: these are many tiny ops on a shared box (threads only add overhead)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@contextlib.contextmanager
def planted(name):
    """A planted patch fault of the catalogue, swapped into the live modules for a ``with`` block."""
    from vtoken.fuzz.catalogue import CATALOGUE
    from vtoken.fuzz.patches import planted as swap

    fault = next(f for f in CATALOGUE if f.name == name)
    assert fault.patches, f"{name} is not a patch fault"
    with swap(fault.patches):
        yield


def faulty_engine(name):
    """A faulty copy engine of the toolkit (vtoken.fuzz.faulty_engines), by catalogue name."""
    from vtoken.fuzz.faulty_engines import ENGINES

    return ENGINES[name]


def cache(seed=0, dtype=torch.float32):
    kv = KVCache(L, NB, S, 2, 4, dtype=dtype)
    kv.kv.copy_(torch.randn(kv.kv.shape, generator=torch.Generator().manual_seed(seed)).to(dtype))
    return kv


# ---------------------------------------------------------------------------- digests
def test_digests_are_byte_exact():
    kv = cache()
    s = torch.tensor([5, 6])
    kv.flat[:, :, 5] = 0.0
    kv.flat[:, :, 6] = 0.0
    kv.flat[1, 1, 6, 0, 0] = -0.0  # equal as floats, different bytes
    d = token_layer_digests(kv, s)
    assert d.shape == (2, L) and d.dtype == np.uint64
    assert d[0, 0] == d[1, 0] and d[0, 1] != d[1, 1] and d[0, 2] == d[1, 2]
    fp = device_fingerprint(kv, s)
    assert torch.equal(fp[0, 0], fp[1, 0]) and not torch.equal(fp[0, 1], fp[1, 1])
    # two NaNs with different payloads
    u = kv.flat[0, 0, 5].view(torch.int32).view(-1)
    u[0] = 0x7FC00001
    a = token_layer_digests(kv, torch.tensor([5]))
    u[0] = 0x7FC00002
    assert token_layer_digests(kv, torch.tensor([5]))[0, 0] != a[0, 0]


def test_mul32_is_exact():
    rng = np.random.default_rng(1)
    v = rng.integers(0, 1 << 32, size=1000, dtype=np.int64)
    for c in (0x7FEB352D, 0x846CA68B, 1, 0xFFFFFFFF):
        got = _mul32(torch.from_numpy(v), c).numpy()
        want = np.array([(int(x) * c) & 0xFFFFFFFF for x in v], dtype=np.int64)
        assert np.array_equal(got, want)


def test_fingerprint_localises_every_byte_and_order():
    kv = cache(2)
    s = torch.arange(8, 12)
    base = device_fingerprint(kv, s)
    assert torch.equal(base, device_fingerprint(kv, s))  # deterministic
    assert base.shape == (4, L, 2)
    row = kv.flat[:, :, 9]  # token 1 of s
    nbytes = row[0].numel() * 4
    for layer in range(L):
        for byte in range(0, nbytes, 7):
            b = kv.flat[layer, :, 9].contiguous().view(torch.uint8).view(-1).clone()
            b[byte] ^= 0x5A
            old = kv.flat[layer, :, 9].clone()
            kv.flat[layer, :, 9] = b.view(torch.float32).view(old.shape)
            fp = device_fingerprint(kv, s)
            diff = (fp != base).any(dim=-1)
            assert diff[1, layer] and int(diff.sum()) == 1, (layer, byte)
            kv.flat[layer, :, 9] = old
    # swapping two words of one layer changes it too
    w = kv.flat[0, 0, 9].view(-1)
    w[[0, 1]] = w[[1, 0]].clone()
    assert not torch.equal(device_fingerprint(kv, s)[1, 0], base[1, 0])


def test_fingerprint_handles_odd_byte_counts():
    kv = KVCache(2, 8, 2, 1, 3, dtype=torch.float16)  # 2*1*3*2 = 12 bytes per layer
    kv.kv.copy_(torch.randn(kv.kv.shape).half())
    fp = device_fingerprint(kv, torch.tensor([1, 2, 3]))
    assert fp.shape == (3, 2, 2)
    kv5 = KVCache(1, 8, 2, 1, 5, dtype=torch.bfloat16)  # 20 bytes: padded to words
    assert device_fingerprint(kv5, torch.tensor([0])).shape == (1, 1, 2)


def test_request_digest_depends_on_ids_and_order():
    d = np.arange(6, dtype=np.uint64).reshape(3, 2)
    ids = np.array([1, 4, 7])
    base = request_digest(ids, d)
    assert request_digest(np.array([1, 4, 8]), d) != base
    assert request_digest(ids, d[[1, 0, 2]]) != base


# ---------------------------------------------------------------------------- the checker on real plans
class Rig:
    """table + allocator + cache + manager with the checker wrapped around a CPU copy engine."""

    def __init__(self, method=None, lag=0, out_dir=None, raise_on_failure=True, seed=0, engine=KVCopyEngine):
        self.kv = cache(seed)
        self.table = TokenTable(S, NB)
        self.alloc = BlockAllocator(NB)
        self.copy = engine(self.kv, S, lag=lag)
        self.chk = RelocationChecker(self.kv, self.table, out_dir=out_dir, method=method,
                                     raise_on_failure=raise_on_failure)
        cfg = PlannerConfig(theta_f=0.05, check_every=1, max_sources=8, headroom=6, record_snapshots=True, in_place=False)
        self.mgr = ReclamationManager(self.table, self.alloc, self.chk.wrap(self.copy), cfg,
                                      on_applied=self.chk.after_apply)
        self.blocks = {}
        rng = np.random.default_rng(seed)
        for r in range(2):
            n = 30
            self.blocks[r] = self.alloc.allocate(-(-n // S))
            self.table.sync_new_tokens(r, self.blocks[r], n)
            self.mgr.hold(r, self.blocks[r])  # the manager holds every block allocated for a request
            victims = np.sort(rng.choice(n - 1, size=17, replace=False))
            self.table.evict_tokens(r, victims)

    def evict(self, r, ids, tell=True):
        self.table.evict_tokens(r, ids)
        if tell:
            self.chk.note_evicted(r, ids)


def test_checker_passes_on_clean_relocations():
    rig = Rig()
    plans = rig.mgr.step()
    assert plans
    assert rig.chk.in_flight == len(plans)
    rig.mgr.step()  # polls: copy check, apply, read-path check
    assert rig.chk.failed == 0 and rig.chk.passed == 2 * len(plans)
    assert rig.chk.events == len(plans) and rig.chk.in_flight == 0


@pytest.mark.parametrize("method", ["xxh3", "fingerprint"])
def test_flip_caught_with_names_and_snapshot(tmp_path, method):
    rig = Rig(method=method, out_dir=tmp_path, engine=faulty_engine("copy_flip_byte"))
    plans = rig.mgr.step()
    with pytest.raises(RelocationCheckError) as ei:
        rig.mgr.step()
    e = ei.value
    assert e.code == "relocation_mismatch"
    f = rig.chk.failures[0]
    assert f["layer"] == L - 1 and f["plan"] in [p.id for p in plans]
    plan = next(p for p in plans if p.id == f["plan"])
    moved = plan.moves[:, 0].tolist()
    assert f["token"] == moved[len(moved) // 2]  # the fault flips the middle move's entry
    msg = str(e)
    assert f"plan {f['plan']}" in msg and f"request {plan.req_id!r}" in msg and f"token {f['token']}" in msg
    snap = load_snapshot(tmp_path / f"plan-{f['plan']}.json")
    assert snap["plan"]["moves"] == plan.moves.tolist()
    assert json.loads((tmp_path / f"plan-{f['plan']}.failure.json").read_text())["layer"] == L - 1


def test_count_only_mode_and_skip_move():
    rig = Rig(raise_on_failure=False, engine=faulty_engine("copy_skip_move"))
    rig.mgr.step()
    rig.mgr.step()
    assert rig.chk.failed >= 1 and rig.chk.failures[0]["code"] == "relocation_mismatch"


def test_stale_read_path_caught():
    rig = Rig()
    with planted("stale_slot_after_move"):
        rig.mgr.step()
        with pytest.raises(RelocationCheckError) as ei:
            rig.mgr.step()
    assert ei.value.code == "stale_slot"


def test_eviction_during_copy_is_legitimate_but_an_untold_loss_is_not():
    rig = Rig(lag=2)
    plans = rig.mgr.step()
    assert plans
    p = plans[0]
    # a moved token dies while its copy flies (the engine tells the checker): fine,
    # provided the manager drops its move (it does, at apply)
    victim = int(p.moves[0, 0])
    rig.evict(p.req_id, [victim])
    rig.mgr.step()
    rig.mgr.step()
    assert rig.chk.failed == 0 and rig.chk.passed >= 2
    assert p.state == "applied" and p.evicted_in_flight == [victim]

    rig = Rig(lag=2)
    plans = rig.mgr.step()
    p = plans[0]
    live = rig.table.live_tokens(p.req_id)
    other = int(next(t for t in live[:-1] if t not in set(p.moves[:, 0].tolist())))
    rig.evict(p.req_id, [other], tell=False)  # a token vanishes: conservation broken
    with pytest.raises(RelocationCheckError) as ei:
        rig.mgr.step()
        rig.mgr.step()
    assert ei.value.code == "token_set_changed"


def test_aborted_copy_checks_the_unchanged_read_path():
    rig = Rig()
    rig.copy.fail_next_copy = True
    rig.mgr.cfg.max_plans_per_round = 1
    (p,) = rig.mgr.step()
    rig.mgr.step()
    assert p.state == "aborted" or rig.mgr.stats["aborted"] == 1
    assert rig.chk.failed == 0 and rig.chk.passed >= 1


def test_forget_request_drops_launch_records():
    rig = Rig(lag=3)
    plans = rig.mgr.step()
    assert rig.chk.in_flight
    for p in plans:
        rig.chk.forget_request(p.req_id)
    assert rig.chk.in_flight == 0


def test_default_methods():
    kv, t = cache(), TokenTable(S, NB)
    assert RelocationChecker(kv, t).method == "xxh3"
    assert RelocationChecker(kv, t, method="fingerprint").method == "fingerprint"
    with pytest.raises(ValueError):
        RelocationChecker(kv, t, method="crc")


# ---------------------------------------------------------------------------- hash scope (issue 11 item 4)
class WritePastEngine(KVCopyEngine):
    """A faulty copy engine (test-only subclass, nothing in vtoken/): every copy also writes
    one slot past the plan's last destination -- an off-by-one in the scatter."""

    def launch(self, plan):
        h = super().launch(plan)
        m = np.asarray(plan.moves, dtype=np.int64).reshape(-1, 5)
        if len(m):
            past = int((m[:, 3] * self.S + m[:, 4]).max()) + 1
            src = int(m[-1, 1] * self.S + m[-1, 2])
            self.kv.flat[:, :, past] = self.kv.flat[:, :, src]  # a moved token's bytes, one slot too far
        return h


def layout(live_in_sources=8, engine=KVCopyEngine, foreign_in_dest=False, raise_on_failure=True):
    """Request 'a' on blocks 1..5 (4 = last source, 5 = the full tail), the headroom 6..7,
    request 'b' on blocks 8..9. With 8 live tokens in a's sources the plan fills 6 and 7
    exactly, so one slot past its last destination is b's live token 0 (slot 32); with 7, that
    slot is the free last slot of destination block 7."""
    kv = cache(5)
    t, a = TokenTable(S, NB), BlockAllocator(NB)
    blocks_a = a.allocate(5)
    t.sync_new_tokens("a", blocks_a, 5 * S)
    evict = [b * S + o for b in range(4) for o in (2, 3)]
    if live_in_sources == 7:
        evict.append(1)
    t.evict_tokens("a", sorted(evict))
    copy = engine(kv, S)
    chk = RelocationChecker(kv, t, raise_on_failure=raise_on_failure)
    cfg = PlannerConfig(theta_f=0.05, check_every=1, max_sources=8, headroom=2, record_snapshots=True, in_place=False)
    mgr = ReclamationManager(t, a, chk.wrap(copy), cfg, on_applied=chk.after_apply)
    blocks_b = a.allocate(2)
    t.sync_new_tokens("b", blocks_b, 6)
    mgr.hold("a", blocks_a)
    mgr.hold("b", blocks_b)
    assert blocks_a == [1, 2, 3, 4, 5] and mgr.headroom == [6, 7] and blocks_b == [8, 9], \
        (blocks_a, mgr.headroom, blocks_b)  # the layout the scenario relies on
    if foreign_in_dest:
        t.sync_new_tokens("z", [6], 1)  # a token the table places in a reserved headroom block
    return kv, t, chk, mgr


def test_clean_layout_passes_with_the_guard():
    kv, t, chk, mgr = layout()
    (plan,) = mgr.plan_round()
    assert sorted({int(b) for b in plan.moves[:, 3]}) == [6, 7]
    mgr.poll(force_sync=True)
    assert chk.failed == 0 and chk.passed == 2 and chk.guarded > 0


def test_write_past_destination_into_another_requests_live_slot_is_caught():
    kv, t, chk, mgr = layout(engine=WritePastEngine)
    with pytest.raises(RelocationCheckError) as ei:
        mgr.plan_round()
        mgr.poll(force_sync=True)
    assert ei.value.code == "guard_overwritten"
    msg = str(ei.value)
    assert "slot 32 (block 8 offset 0)" in msg and "live token 0 of request 'b'" in msg


def test_write_past_destination_into_a_free_destination_slot_is_caught():
    kv, t, chk, mgr = layout(live_in_sources=7, engine=WritePastEngine)
    with pytest.raises(RelocationCheckError) as ei:
        mgr.plan_round()
        mgr.poll(force_sync=True)
    assert ei.value.code == "guard_overwritten" and "a free slot of destination block 7" in str(ei.value)


def test_write_past_is_missed_without_the_guard_scope():
    """The control: the plan's own request and every moved token are intact (what the
    checker compared before issue 11), only another request's slot is corrupted."""
    kv, t, chk, mgr = layout(engine=WritePastEngine, raise_on_failure=False)
    mgr.plan_round()
    mgr.poll(force_sync=True)
    codes = [f["code"] for f in chk.failures]
    assert codes == ["guard_overwritten"], chk.failures  # nothing else flagged it


def test_another_requests_live_token_in_a_destination_block_is_caught():
    kv, t, chk, mgr = layout(foreign_in_dest=True)
    with pytest.raises(RelocationCheckError) as ei:
        mgr.plan_round()
    assert ei.value.code == "foreign_token" and "request 'z' token 0" in str(ei.value)


def test_guard_has_no_false_alarm_with_lagged_copies_and_evictions():
    rig = Rig(lag=2, seed=3)
    for _ in range(6):
        for p in list(rig.mgr.in_flight.values()):
            live = rig.table.live_tokens(p.req_id)
            if len(live) > 2:
                rig.evict(p.req_id, [int(live[0])])  # a token dies while its copy flies
        rig.mgr.step()
    rig.mgr.poll(force_sync=True)
    assert rig.chk.failed == 0 and rig.chk.passed >= 2 and rig.chk.guarded > 0


def test_snapshot_digests_are_filled_and_checked():
    from vtoken.invariants import snapshot_checks, z3_checks

    rig = Rig()
    plans = rig.mgr.step()
    rig.mgr.step()
    for p in plans:
        dg = p.snapshot["plan"]["digests"]
        assert dg["method"] == "xxh3" and len(dg["pre"]) == len(p.snapshot["plan"]["moves"])
        assert dg["pre"] == dg["post"] and None not in dg["pre"]
        assert snapshot_checks.check_snapshot(p.snapshot) == [] and z3_checks.check_snapshot(p.snapshot) == []
    # a flipped byte shows in the snapshot too: both checkers flag the digest (I1)
    rig = Rig(raise_on_failure=False, engine=faulty_engine("copy_flip_byte"))
    plans = rig.mgr.step()
    rig.mgr.step()
    flagged = 0
    for p in plans:
        for check in (snapshot_checks.check_snapshot, z3_checks.check_snapshot):
            vs = check(p.snapshot)
            if any(v.invariant == "I1" and v.rule == "digest" for v in vs):
                flagged += 1
    assert flagged == 2 * len(plans)


# ---------------------------------------------------------------------------- the fingerprint's collision bound
M32 = (1 << 32) - 1


def _unmix32(y: int) -> int:
    """The inverse of lowbias32, built from its steps (odd multipliers inverted mod 2**32)."""
    def unxorshift(x, k):
        out = x
        for _ in range(32 // k + 1):
            out = x ^ (out >> k)
        return out & M32

    y = unxorshift(y, 16)
    y = (y * pow(0x846CA68B, -1, 1 << 32)) & M32
    y = unxorshift(y, 15)
    y = (y * pow(0x7FEB352D, -1, 1 << 32)) & M32
    return unxorshift(y, 16)


def test_mix_is_a_bijection_on_words():
    """The property (1) of the bound rests on: mix(w) != mix(w') for w != w'."""
    from vtoken.invariants.relocation_hash import _mix32

    rng = np.random.default_rng(7)
    w = np.concatenate([rng.integers(0, 1 << 32, size=20000, dtype=np.int64),
                        np.array([0, 1, 2, 0x7FFFFFFF, 0x80000000, M32, 0xFFFF, 0x10000], dtype=np.int64)])
    m = _mix32(torch.from_numpy(w)).numpy()
    assert m.min() >= 0 and m.max() <= M32
    assert all(_unmix32(int(y)) == int(x) for x, y in zip(w, m))  # a left inverse: injective


def test_weights_are_odd_independent_and_fixed():
    from vtoken.invariants.relocation_hash import _weights

    for n in (1, 7, 96, 1000):
        a1, a2 = _weights(n, "cpu")
        assert a1.shape == a2.shape == (n,)
        assert bool((a1 % 2 == 1).all()) and bool((a2 % 2 == 1).all())  # odd: invertible mod 2**32
        assert int(a1.min()) >= 1 and int(a1.max()) < (1 << 31) and int(a2.max()) < (1 << 31)
        if n > 1:
            assert not torch.equal(a1, a2)
    assert torch.equal(_weights(96, "cpu")[0], _weights(96, "cpu")[0])


def _reference_fingerprint(kv, slot: int):
    """The docstring's formula in Python integers, for one token: [L][2]."""
    from vtoken.invariants.relocation_hash import _weights

    out = []
    for layer in range(kv.num_layers):
        raw = kv.flat[layer, :, slot].contiguous().view(torch.uint8).flatten().numpy().tobytes()
        raw += b"\0" * (-len(raw) % 4)
        words = np.frombuffer(raw, dtype="<u4").astype(np.int64)
        a1, a2 = _weights(len(words), "cpu")
        mixed = [_mix_py(int(w)) for w in words]
        out.append([sum(m * int(a) for m, a in zip(mixed, a1)) & M32, sum(m * int(a) for m, a in zip(mixed, a2)) & M32])
    return out


def _mix_py(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


@pytest.mark.parametrize("dtype,H,D", [(torch.float32, 2, 4), (torch.bfloat16, 2, 4), (torch.float16, 1, 3)])
def test_fingerprint_is_the_documented_formula(dtype, H, D):
    kv = KVCache(2, 6, 2, H, D, dtype=dtype)
    kv.kv.copy_(torch.randn(kv.kv.shape, generator=torch.Generator().manual_seed(3)).to(dtype))
    fp = device_fingerprint(kv, torch.tensor([0, 3, 7]))
    for i, s in enumerate([0, 3, 7]):
        assert fp[i].tolist() == _reference_fingerprint(kv, s)


def test_any_change_inside_one_word_is_always_detected():
    """Bound (1): d * a != 0 mod 2**32 for odd a -- every replacement of one word, including
    the one whose mixed value moves by exactly 2**31 (the largest 2-adic valuation)."""
    from vtoken.invariants.relocation_hash import _mix32

    kv = cache(11)
    s = torch.tensor([13])
    base = device_fingerprint(kv, s)
    per_kv = kv.flat[0, 0, 13].numel()  # words of K (fp32: one word per element), then V's
    rng = np.random.default_rng(5)
    for trial in range(300):
        layer, j = int(rng.integers(L)), int(rng.integers(2 * per_kv))
        words = kv.flat[layer, j // per_kv, 13].view(-1).view(torch.int32)  # contiguous: a view
        old = int(words[j % per_kv])
        if trial % 3 == 0:  # the worst case: mix(new) = mix(old) + 2**31
            m = int(_mix32(torch.tensor([old & M32]))[0])
            new = _unmix32((m + (1 << 31)) & M32)
        else:
            new = int(rng.integers(0, 1 << 32))
            if new == old & M32:
                continue
        words[j % per_kv] = new - (1 << 32) if new >= 1 << 31 else new
        fp = device_fingerprint(kv, s)
        assert bool((fp[0, layer] != base[0, layer]).all()), (trial, layer, j)  # both sums changed
        words[j % per_kv] = old
    assert torch.equal(device_fingerprint(kv, s), base)


def test_documented_blind_spot_two_words_built_from_the_weights():
    """Bound (3), stated honestly: two words whose mixed values both move by 2**31 cancel in
    both sums (a_j + a_k is even). The fingerprint is no MAC; xxh3 still sees the change."""
    from vtoken.invariants.relocation_hash import _mix32

    kv = cache(12)
    s = torch.tensor([21])
    base_fp, base_x = device_fingerprint(kv, s), token_layer_digests(kv, s)
    words = kv.flat[1, 0, 21].view(-1).view(torch.int32)  # layer 1's K words (a view)
    for j in (0, 5):
        m = int(_mix32(torch.tensor([int(words[j]) & M32]))[0])
        new = _unmix32((m + (1 << 31)) & M32)
        words[j] = new - (1 << 32) if new >= 1 << 31 else new
    assert torch.equal(device_fingerprint(kv, s), base_fp)
    assert token_layer_digests(kv, s)[0, 1] != base_x[0, 1]


def test_multi_word_bound_at_an_observable_valuation():
    """Bound (2) over the weights' draw, where it is large enough to measure: differences
    d_j = 2**26 * odd (v = 26) give Pr[one sum unchanged] <= 2**(26 - 31) = 1/32 and
    Pr[both] <= 1/1024. The summation is the shipped one (_weighted_sums), the weights
    drawn as the shipped ones are (odd, 2x+1 with x uniform in [0, 2**30))."""
    from vtoken.invariants.relocation_hash import _weighted_sums

    rng = np.random.default_rng(9)
    trials, W = 40000, 6
    d = (rng.integers(0, 1 << 5, size=W, dtype=np.int64) * 2 + 1) << 26  # v = 26 in every word
    d[2:] = 0  # a change touching 2 of the 6 words (an even count: the sum of the odd terms can vanish)
    a = (rng.integers(0, 1 << 30, size=(trials, 2, W), dtype=np.int64) << 1) | 1
    base = rng.integers(0, 1 << 32, size=W, dtype=np.int64)
    v0 = torch.from_numpy(np.broadcast_to(base, (trials, W)).copy())
    v1 = torch.from_numpy(np.broadcast_to((base + d) & M32, (trials, W)).copy())
    a1, a2 = torch.from_numpy(a[:, 0]), torch.from_numpy(a[:, 1])
    same = (_weighted_sums(v0, a1, a2) == _weighted_sums(v1, a1, a2)).numpy()
    one, both = same[:, 0].mean(), same.all(axis=1).mean()
    assert one <= (1 / 32) * 1.25, one  # the bound holds ...
    assert one >= (1 / 32) * 0.75, one  # ... and is tight here (not a vacuous check)
    assert both <= (1 / 1024) * 2, both


# ---------------------------------------------------------------------------- the 384-flip sweep
SWEEP_L, SWEEP_H, SWEEP_D = 3, 2, 32  # 3 layers x (K, V) x 2 heads x 32 dims = 384 positions


class FlipAtEngine(KVCopyEngine):
    """Copies, then flips one bit of one moved token's destination entry at (layer, k/v, head,
    dim) -- the sweep's fault, a test-only subclass."""

    where = (0, 0, 0, 0, 0)  # layer, kv, head, dim, bit
    move = 0

    def _copy(self, src_t, dst_t):
        super()._copy(src_t, dst_t)
        layer, kvi, h, d, bit = self.where
        e = self.kv.flat[layer, kvi, int(dst_t[self.move]), h, d:d + 1]
        bits = e.view(torch.int16 if e.element_size() == 2 else torch.int32)
        bits ^= torch.tensor(1 << bit if bit < 8 * e.element_size() - 1 else -(1 << bit), dtype=bits.dtype)


def flip_sweep(dtype, method) -> dict:
    """Every (layer, K/V, head, dim) of a moved token flipped (one bit each, the bit cycling
    through every position of the element, the moved token cycling through the plan), one
    relocation each, checked by a fresh checker: how many it catches at the copy check,
    naming the right token and layer. A clean copy of the same plan must pass (control)."""
    kv = KVCache(SWEEP_L, 32, 4, SWEEP_H, SWEEP_D, dtype=dtype)
    kv.kv.copy_(torch.randn(kv.kv.shape, generator=torch.Generator().manual_seed(17)).to(dtype))
    t, a = TokenTable(4, 32), BlockAllocator(32)
    blocks = a.allocate(5)
    t.sync_new_tokens("r", blocks, 20)
    t.evict_tokens("r", [0, 1, 5, 6, 9, 10, 11, 14])
    cfg = PlannerConfig(theta_f=0.05, check_every=1, max_sources=8, headroom=4, record_snapshots=False, in_place=False)
    base = kv.kv.clone()
    mgr = ReclamationManager(t, a, KVCopyEngine(kv, 4), cfg)
    mgr.hold("r", blocks)
    (plan,) = mgr.plan_round()  # a real plan (its copy is redone)
    n_moves = len(plan.moves)
    assert n_moves >= 4

    def relocate(eng):
        kv.kv.copy_(base)
        chk = RelocationChecker(kv, t, method=method, sample=0)
        chk.before_copy(plan)
        chk.after_copy(plan, eng.poll(eng.launch(plan)))
        return chk

    assert relocate(KVCopyEngine(kv, 4)).passed == 1  # control
    eng = FlipAtEngine(kv, 4)
    bits = 8 * kv.kv.element_size()
    caught, wrong, total = 0, [], 0
    for layer in range(SWEEP_L):
        for kvi in range(2):
            for h in range(SWEEP_H):
                for d in range(SWEEP_D):
                    eng.where = (layer, kvi, h, d, total % bits)
                    eng.move = total % n_moves
                    total += 1
                    try:
                        relocate(eng)
                        wrong.append((layer, kvi, h, d, "missed"))
                    except RelocationCheckError as e:
                        tok = int(plan.moves[eng.move, 0])
                        if e.code == "relocation_mismatch" and f"token {tok} layer {layer} " in str(e):
                            caught += 1
                        else:
                            wrong.append((layer, kvi, h, d, str(e)[:120]))
    return {"total": total, "caught": caught, "wrong": wrong[:3]}


@pytest.mark.parametrize("method", ["xxh3", "fingerprint"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_384_flip_sweep(dtype, method):
    r = flip_sweep(dtype, method)
    assert r["total"] == 384
    assert r["caught"] == 384, r


# ---------------------------------------------------------------------------- what crosses to the host, and when
class HostSpy:
    """Records the dtype and shape of every tensor turned into host data (numpy, Python
    numbers, lists, ``.cpu()``) while active. On the CPU this is what 'moved to the host'
    means: K/V are float, their raw bytes uint8; slots, ids and fingerprints are int64."""

    NAMES = ("numpy", "cpu", "tolist", "item", "__array__")

    def __init__(self, monkeypatch):
        self.seen = []
        self.on = False
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)

            def spy(t, *a, _orig=orig, **kw):
                if self.on:
                    self.seen.append((t.dtype, tuple(t.shape)))
                return _orig(t, *a, **kw)

            monkeypatch.setattr(torch.Tensor, name, spy)

    def kv_like(self):
        return [x for x in self.seen if x[0] not in (torch.int64, torch.bool, torch.int32)]


def _spied_steps(rig, spy, n=4):
    spy.on = True
    try:
        for _ in range(n):
            rig.mgr.step()
    finally:
        spy.on = False


def test_fingerprint_check_moves_no_kv_to_the_host(monkeypatch):
    spy = HostSpy(monkeypatch)
    rig = Rig(method="fingerprint")
    rig.chk.sample = 0
    _spied_steps(rig, spy)
    assert rig.chk.passed >= 2 and rig.chk.failed == 0
    assert spy.seen, "the spy saw nothing: it is not wired"
    assert spy.kv_like() == [], spy.kv_like()  # only int64: slots, ids, fingerprints


def test_fingerprint_spot_check_moves_at_most_sample_tokens(monkeypatch):
    spy = HostSpy(monkeypatch)
    rig = Rig(method="fingerprint")
    rig.chk.sample = 4
    _spied_steps(rig, spy)
    assert rig.chk.passed >= 2 and rig.chk.failed == 0
    kv = spy.kv_like()
    assert kv and all(dt == torch.uint8 and shape[0] <= 4 for dt, shape in kv), kv


def test_xxh3_check_does_move_kv_bytes(monkeypatch):
    """The control: the host-digest method brings every hashed token's bytes over."""
    spy = HostSpy(monkeypatch)
    rig = Rig(method="xxh3")
    _spied_steps(rig, spy)
    assert any(dt == torch.uint8 and shape[0] > 4 for dt, shape in spy.kv_like())


def test_comparisons_wait_for_their_digests_and_compare_what_was_hashed_then(monkeypatch):
    """The fingerprint path's deferral, forced on the CPU: every digest 'still in flight'.
    The hooks never block; nothing is decided until settle(); settle compares the digests
    taken when the hooks ran (bytes written afterwards do not matter), in issue order."""
    from vtoken.invariants import relocation_hash as rh

    monkeypatch.setattr(rh._Fetch, "ready", lambda self: False)
    rig = Rig(method="fingerprint")
    plans = rig.mgr.step()
    rig.mgr.step()
    assert plans and rig.chk.passed == 0 and rig.chk.pending >= 3 * len(plans)
    rig.kv.kv.normal_()  # everything overwritten after the hooks: irrelevant to their digests
    rig.chk.settle(block=True)
    assert rig.chk.pending == 0 and rig.chk.failed == 0 and rig.chk.passed == 2 * len(plans)
    # a corrupted copy is caught at settle, not before
    rig = Rig(method="fingerprint", engine=faulty_engine("copy_flip_byte"))
    rig.mgr.step()
    rig.mgr.step()
    assert rig.chk.failed == 0
    with pytest.raises(RelocationCheckError) as ei:
        rig.chk.settle(block=True)
    assert ei.value.code == "relocation_mismatch"


def test_checked_engine_settles_at_wait_and_synchronize(monkeypatch):
    from vtoken.invariants import relocation_hash as rh

    rig = Rig(method="fingerprint", engine=faulty_engine("copy_flip_byte"))
    flag = {"ready": False}
    monkeypatch.setattr(rh._Fetch, "ready", lambda self: flag["ready"])
    wrapped = rig.mgr.engine
    rig.mgr.step()
    rig.mgr.step()
    wrapped.wait_before_attention()  # not ready: nothing decided, nothing raised
    assert rig.chk.pending and rig.chk.failed == 0
    flag["ready"] = True
    with pytest.raises(RelocationCheckError):
        wrapped.wait_before_attention()  # ready now: the failure surfaces before the next attention


def test_digests_of_no_tokens():
    """A read path with no live token (every token of the plan evicted in flight): empty
    digests, not a reshape error (found by the adapter campaign: S=4, lag 4, async)."""
    kv = KVCache(2, 8, 2, 1, 3, dtype=torch.float16)
    none = torch.empty(0, dtype=torch.int64)
    assert token_layer_digests(kv, none).shape == (0, 2)
    assert device_fingerprint(kv, none).shape[:2] == (0, 2)


# ---------------------------------------------------------------- in-place plans (fills)
def inplace_layout(engine=KVCopyEngine, raise_on_failure=True):
    """Request 'a' on blocks 1..5 (S = 4; 5 = the tail): block 1 keeps 2 live tokens, blocks
    2..4 miss offset 1 (one hole each). The in-place plan empties block 1 into the holes of
    blocks 2 and 3; nothing comes from the headroom."""
    kv = cache(5)
    t, a = TokenTable(S, NB), BlockAllocator(NB)
    blocks = a.allocate(5)
    t.sync_new_tokens("a", blocks, 5 * S)
    t.evict_tokens("a", [0, 1, 5, 9, 13])
    chk = RelocationChecker(kv, t, raise_on_failure=raise_on_failure)
    cfg = PlannerConfig(theta_f=0.05, check_every=1, max_sources=8, headroom=0, record_snapshots=True)
    mgr = ReclamationManager(t, a, chk.wrap(engine(kv, S)), cfg, on_applied=chk.after_apply)
    mgr.hold("a", blocks)
    return kv, t, chk, mgr


def test_in_place_plan_fills_holes_and_passes_the_checker():
    kv, t, chk, mgr = inplace_layout()
    (plan,) = mgr.plan_round()
    assert plan.sources == [1] and plan.fills == [2, 3] and plan.dests == []
    assert plan.moves[:, 3:].tolist() == [[2, 1], [3, 1]]  # the holes, fill after fill
    mgr.poll(force_sync=True)
    assert chk.failed == 0 and chk.passed == 2 and chk.guarded > 0
    assert t.location("a", 2) == (2, 1) and t.location("a", 3) == (3, 1) and not t.references("a", 1)


def test_in_place_write_past_a_hole_into_the_fills_live_token_is_caught():
    """One slot past the last hole written (block 3 offset 2) is a live token of 'a' in the
    fill itself: the guard covers a fill's live slots, not only free ones."""
    kv, t, chk, mgr = inplace_layout(engine=WritePastEngine)
    with pytest.raises(RelocationCheckError) as ei:
        mgr.plan_round()
        mgr.poll(force_sync=True)
    assert ei.value.code == "guard_overwritten" and "slot 14 (block 3 offset 2)" in str(ei.value)
    assert "live token 10 of request 'a'" in str(ei.value)


def test_in_place_move_onto_a_live_slot_of_the_fill_is_caught_at_launch():
    kv, t, chk, mgr = inplace_layout()
    plan = mgr.plan_request("a")
    plan.moves = plan.moves.copy()
    plan.moves[1, 4] = 2  # block 3 offset 2 holds live token 10
    with pytest.raises(RelocationCheckError) as ei:
        mgr.launch(plan)
    assert ei.value.code == "foreign_token" and "token 10" in str(ei.value)


# ---------------------------------------------------------------- bystanders: every live slot is guarded
def bystander_layout(guard="live", raise_on_failure=True):
    """Requests 'a' on blocks 1..5 and 'b' on blocks 9..13 (blocks 6..8 a spacer), both with
    the in-place pattern of :func:`inplace_layout`; b's plan (source 9, fills 10 and 11) is
    applied first, so b's token 3 is live at slot 45 (block 11 offset 1), far from every block
    of a's plan (source 1, fills 2 and 3). The copy engine is the toolkit's stale-index fault."""
    from vtoken.fuzz.faulty_engines import BystanderWriteEngine

    kv = cache(5)
    t, a = TokenTable(S, NB), BlockAllocator(NB)
    blocks_a, spacer, blocks_b = a.allocate(5), a.allocate(3), a.allocate(5)
    assert blocks_a == [1, 2, 3, 4, 5] and blocks_b == [9, 10, 11, 12, 13], (blocks_a, spacer, blocks_b)
    for r, bl in (("a", blocks_a), ("b", blocks_b)):
        t.sync_new_tokens(r, bl, 5 * S)
        t.evict_tokens(r, [0, 1, 5, 9, 13])
    chk = RelocationChecker(kv, t, raise_on_failure=raise_on_failure, guard=guard)
    cfg = PlannerConfig(theta_f=0.05, check_every=1, max_sources=8, headroom=0, record_snapshots=True)
    eng = BystanderWriteEngine(kv, S)
    mgr = ReclamationManager(t, a, chk.wrap(eng), cfg, on_applied=chk.after_apply)
    mgr.hold("a", blocks_a)
    mgr.hold("b", blocks_b)
    pb = mgr.plan_request("b")
    mgr.launch(pb)
    mgr.poll(force_sync=True)
    assert pb.state == "applied" and t.location("b", 3) == (11, 1) and eng.targets == []
    return kv, t, chk, mgr, eng


@pytest.mark.parametrize("method", ["xxh3", "fingerprint"])
def test_copy_onto_a_far_bystanders_live_token_is_caught(method):
    """A copy that also writes one moved entry onto another request's live token, far from
    the plan's destinations: the guard covers every live slot of every request."""
    kv, t, chk, mgr, eng = bystander_layout()
    chk.method = method
    pa = mgr.plan_request("a")
    with pytest.raises(RelocationCheckError) as ei:
        mgr.launch(pa)
        mgr.poll(force_sync=True)
    assert eng.targets == [(pa.id, "b", 45)]
    assert ei.value.code == "guard_overwritten"
    msg = str(ei.value)
    assert "slot 45 (block 11 offset 1)" in msg and "live token 3 of request 'b'" in msg


def test_far_bystander_write_passes_the_local_guard():
    """The control: the neighbour-only scope (``guard="local"``, the scope before every live
    slot was guarded) passes the same corrupting copy, and nothing else flags it."""
    kv, t, chk, mgr, eng = bystander_layout(guard="local", raise_on_failure=False)
    before = token_layer_digests(kv, torch.tensor([45]))
    pa = mgr.plan_request("a")
    mgr.launch(pa)
    mgr.poll(force_sync=True)
    assert eng.targets == [(pa.id, "b", 45)]
    assert (token_layer_digests(kv, torch.tensor([45])) != before).any(), "the fault did not corrupt b's token"
    assert pa.state == "applied" and chk.failed == 0 and chk.passed == 4, chk.failures


def test_guard_owner_is_one_incarnation_of_a_request():
    """A request id that finishes and comes back is another owner: its slots are not
    compared with what the earlier incarnation held (no false alarm), the new one is guarded."""
    kv, t, chk, mgr, eng = bystander_layout()
    first = chk._code("b")
    chk.forget_request("b")
    assert chk._code("b") != first and chk._owner(chk._code("b") << 32 | 7) == ("b", 7)
    with pytest.raises(ValueError):
        RelocationChecker(kv, t, guard="near")
