"""Hash-and-compare (invariants/relocation_hash.py): byte-exact digests, the device
fingerprint (exact integer arithmetic, run here on the CPU), and the checker around real
plans of the reclamation manager with the CPU copy engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vtoken import faults
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

    def __init__(self, method=None, lag=0, out_dir=None, raise_on_failure=True, seed=0):
        self.kv = cache(seed)
        self.table = TokenTable(S, NB)
        self.alloc = BlockAllocator(NB)
        self.copy = KVCopyEngine(self.kv, S, lag=lag)
        self.chk = RelocationChecker(self.kv, self.table, out_dir=out_dir, method=method,
                                     raise_on_failure=raise_on_failure)
        cfg = PlannerConfig(theta_f=0.05, check_every=1, max_sources=8, headroom=6, record_snapshots=True)
        self.mgr = ReclamationManager(self.table, self.alloc, self.chk.wrap(self.copy), cfg,
                                      on_applied=self.chk.after_apply)
        self.blocks = {}
        rng = np.random.default_rng(seed)
        for r in range(2):
            n = 30
            self.blocks[r] = self.alloc.allocate(-(-n // S))
            self.table.sync_new_tokens(r, self.blocks[r], n)
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
    rig = Rig(method=method, out_dir=tmp_path)
    with faults.planted("copy_flip_byte"):
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
    rig = Rig(raise_on_failure=False)
    with faults.planted("copy_skip_move"):
        plans = rig.mgr.step()
        rig.mgr.step()
    assert rig.chk.failed >= 1 and rig.chk.failures[0]["code"] == "relocation_mismatch"


def test_stale_read_path_caught():
    rig = Rig()
    with faults.planted("stale_slot_after_move"):
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
    # provided the manager drops its move (the engine's manager does; here by hand)
    victim = int(p.moves[0, 0])
    rig.evict(p.req_id, [victim])
    p.moves = p.moves[1:]
    rig.mgr.step()
    rig.mgr.step()
    assert rig.chk.failed == 0 and rig.chk.passed >= 2

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
