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
    cfg = PlannerConfig(theta_f=0.05, check_every=1, max_sources=8, headroom=2, record_snapshots=True)
    mgr = ReclamationManager(t, a, chk.wrap(copy), cfg, on_applied=chk.after_apply)
    blocks_b = a.allocate(2)
    t.sync_new_tokens("b", blocks_b, 6)
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
