"""The graph path of DecodeEngine on the CPU (its eager fallback): the same StepGraph, slot
buffer and hook order that CUDA captures and replays, checked against the plain path token
for token with relocations on; the fixed-shape decoder step against the plain one; a replay
that skips the slot-buffer update caught by the sentinel (and missed without it).

The CUDA side (capture, replay on the compute stream, the event wait before replay, the
catalogue's ``graph_replay_on_capture_stream``) is in tests/test_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vtoken.decode import DecodeEngine, StepGraph
from vtoken.errors import RelocationCheckError
from vtoken.fuzz.catalogue import BY_NAME
from vtoken.fuzz.faulty_engines import DECODE_ENGINES
from vtoken.fuzz.patches import planted
from vtoken.model import PagedDecoder
from vtoken.model.decoder import DecodeItem
from vtoken.planner import PlannerConfig
from vtoken.invariants.relocation_hash import RelocationChecker

POLICIES = ["h2o", "streaming", "scissorhands", "random"]
S_OF = {"h2o": 4, "streaming": 8, "scissorhands": 4, "random": 16}
BUDGET = {4: 72, 8: 40, 16: 24}
LENS = [48, 35, 43, 27]  # requests finish at different steps: the batch shape changes


pytestmark = pytest.mark.usefixtures("one_thread")


def cfg():
    return PlannerConfig(theta_f=0.1, check_every=1, max_sources=8, headroom=8, low_watermark=None)


def engine(model, mode, policy, cls=DecodeEngine, **kw):
    S = S_OF[policy]
    if mode == "vtoken":
        kw.setdefault("planner_config", cfg())
    return cls(model, mode=mode, policy=policy, evict_ratio=0.5, block_size=S, num_blocks=BUDGET[S], seed=0, **kw)


# ---------------------------------------------------------------------------- the main property
@pytest.mark.parametrize("policy", POLICIES)
def test_graph_cpu_fallback_equals_plain_path_with_relocations(model, prompts, policy):
    """vtoken on the graph path (lagged copies, hash-and-compare) gives naive-evict's plain-path
    tokens; naive-evict on the graph path gives the same tokens as vtoken on it (bitwise
    comparable: same shapes, same bytes)."""
    ref = engine(model, "naive-evict", policy).run(prompts, LENS)
    assert ref.cuda_graph is False and ref.graph_replays == 0
    eng = engine(model, "vtoken", policy, cuda_graph=True, check_relocations=RelocationChecker, copy_kwargs={"lag": 2})
    res = eng.run(prompts, LENS)
    assert res.cuda_graph is True and res.graph_replays == res.steps and res.graph_captures == 0  # CPU: eager
    assert res.relocations > 0 and res.hash_failures == 0
    assert res.hash_checks == 2 * res.relocations + res.plans_aborted
    assert res.outputs == ref.outputs, "graph path tokens differ from the plain path's"
    naive_graph = engine(model, "naive-evict", policy, cuda_graph=True).run(prompts, LENS)
    assert naive_graph.outputs == res.outputs
    assert len({k[0] for k in eng._graphs}) >= 1
    assert eng.alloc.num_used == 0


def test_native_on_the_graph_path_equals_native(model, prompts):
    nat = DecodeEngine(model, mode="native", block_size=4).run(prompts, 24)
    g = DecodeEngine(model, mode="native", block_size=4, cuda_graph=True).run(prompts, 24)
    assert g.outputs == nat.outputs and g.graph_replays == g.steps


def test_default_is_the_plain_path_on_cpu(model):
    assert DecodeEngine(model, device="cpu").cuda_graph is False
    assert DecodeEngine(model, device="cpu", cuda_graph=True).cuda_graph is True


# ---------------------------------------------------------------------------- the hooks, in order
class Spy(DecodeEngine):
    """Records the graph path's hook order and checks the slot buffer after every write."""

    def setup(self, num_blocks):
        super().setup(num_blocks)
        self.log, self.ptrs = [], {}
        ce = self.copy_engine
        w, launch = ce.wait_before_attention, ce.launch

        def wait():
            self.log.append("wait")
            return w()

        def lau(plan):
            self.log.append("launch")
            return launch(plan)

        ce.wait_before_attention, ce.launch = wait, lau

    def _graph_for(self, active, B):
        gs = super()._graph_for(active, B)
        if not getattr(gs, "_spied", False):
            run = gs.run

            def spied_run():
                self.log.append("run")
                # what the graph will read is exactly the table's read path (less the step's
                # new token, synced already), row by row
                nread = gs.inputs[3].tolist()
                for i, rid in enumerate(self.active):
                    want = self.table.slot_mapping(rid)
                    assert nread[i] == want.numel() - 1
                    assert torch.equal(gs.read_slots[i, : nread[i]], want[:-1]), (rid, i)
                    assert int(gs.inputs[2, i]) == int(want[-1])  # the write slot: the new token's
                return run()

            gs.run, gs._spied = spied_run, True
        self.ptrs.setdefault((gs.B, gs.T), set()).add(gs.read_slots.data_ptr())
        return gs

    def _write_read_slots(self, gs, row, req, read):
        self.log.append("write")
        super()._write_read_slots(gs, row, req, read)


def test_hook_order_and_slot_buffer_in_place(model, prompts):
    eng = Spy(model, mode="vtoken", policy="random", evict_ratio=0.5, block_size=4, num_blocks=BUDGET[4],
              planner_config=cfg(), cuda_graph=True, check_relocations=RelocationChecker, copy_kwargs={"lag": 1})
    res = eng.run(prompts, LENS)
    assert res.relocations > 0
    # one slot buffer per batch shape, reused (the same storage) on every step of that shape
    assert all(len(p) == 1 for p in eng.ptrs.values()) and len(eng.ptrs) >= 2
    # per step: the device-side wait, then the slot-buffer rows, then the run; launches only after
    steps, cur = [], []
    for ev in eng.log:
        if ev == "wait" and cur:
            steps.append(cur)
            cur = []
        cur.append(ev)
    steps.append(cur)
    steps = [s for s in steps if "run" in s]
    assert len(steps) == res.steps
    for s in steps:
        assert s[0] == "wait", s
        r = s.index("run")
        assert set(s[1:r]) == {"write"} and "launch" not in s[:r], s
    assert any("launch" in s for s in steps)


# ---------------------------------------------------------------------------- the planted fault
def test_append_only_slot_buffer_caught_by_sentinel(model, prompts):
    """The graph path's slot buffer updated as if append-only: after an applied move the
    replay reads the moved tokens' sources. In sentinel mode the engine poisons blocks it
    gives up, so the sentinel check (reading the slot buffer itself) catches it."""
    bad = DECODE_ENGINES["graph_slot_buffer_append_only"]
    with pytest.raises(RelocationCheckError) as ei:
        engine(model, "vtoken", "random", cls=bad, cuda_graph=True, copy_kwargs={"lag": 2, "sentinel": True},
               sentinel_check=True).run(prompts, LENS)
    assert ei.value.code == "i3_sentinel"
    # without the sentinel check, the poisoned reads change the tokens (the output comparison)
    ref = engine(model, "naive-evict", "random").run(prompts, LENS)
    res = engine(model, "vtoken", "random", cls=bad, cuda_graph=True,
                 copy_kwargs={"lag": 2, "sentinel": True}).run(prompts, LENS)
    assert res.outputs != ref.outputs
    # controls: the shipped engine passes the same sentinel run ...
    ok = engine(model, "vtoken", "random", cuda_graph=True, copy_kwargs={"lag": 2, "sentinel": True},
                sentinel_check=True, check_relocations=RelocationChecker).run(prompts, LENS)
    assert ok.outputs == ref.outputs and ok.hash_failures == 0 and ok.relocations > 0
    # ... and hash-and-compare alone is blind to it (the table's read path is right and the
    # stale sources still hold the old bytes): why the sentinel poisons freed blocks
    blind = engine(model, "vtoken", "random", cls=bad, cuda_graph=True, check_relocations=RelocationChecker).run(prompts, LENS)
    assert blind.hash_failures == 0 and blind.relocations > 0


def test_catalogue_graph_fault_is_cuda_only(model, prompts):
    """graph_replay_on_capture_stream patches the CUDA branch of StepGraph.run: on the CPU the
    patched engine behaves as the shipped one (hence cuda_only, detector gpu)."""
    f = BY_NAME["graph_replay_on_capture_stream"]
    assert f.cuda_only and f.detector == "gpu" and f.patches[0].file == "vtoken/decode.py"
    ref = engine(model, "vtoken", "random", cuda_graph=True).run(prompts, 24)
    before = StepGraph.run
    with planted(f.patches):
        assert StepGraph.run is not before
        res = engine(model, "vtoken", "random", cuda_graph=True).run(prompts, 24)
    assert StepGraph.run is before
    assert res.outputs == ref.outputs


# ---------------------------------------------------------------------------- StepGraph and decode_static
def test_step_graph_protocol_on_cpu():
    calls = []

    def fn(gs):
        calls.append(gs.inputs.clone())
        return gs.inputs[0] * 2, gs.read_slots.float().sum(dim=1, keepdim=True).expand(gs.B, gs.T + 1).clone()

    gs = StepGraph(3, 5, "cpu", fn)
    gs.read_slots[:] = torch.arange(15).view(3, 5)
    gs.stage([1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 1, 2])
    assert gs.inputs.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 1, 2]]
    gs.run()
    with pytest.raises(RuntimeError, match="before the previous step's fetch"):
        gs.stage([0] * 3, [0] * 3, [0] * 3, [0] * 3)
    tok, st = gs.fetch()
    assert tok == [2, 4, 6] and st.shape == (3, 6) and st[1, 0] == sum(range(5, 10))
    st[:] = -1  # a host copy: the caller may keep or change it
    assert gs.out[1][0, 0] != -1
    gs.stage([5, 5, 5], [0] * 3, [0] * 3, [0] * 3)
    gs.run()
    assert gs.fetch(stats=False) == ([10, 10, 10], None)
    assert len(calls) == 2 and gs.runs == 2 and gs.captures == 0


def _items(rng, kv, n_read, T_used):
    perm = rng.permutation(np.arange(8, kv.num_slots))
    items, off = [], 0
    for n in n_read:
        rs = torch.from_numpy(perm[off:off + n].copy())
        off += n
        items.append(DecodeItem(int(rng.integers(0, 512)), int(rng.integers(0, T_used)), int(perm[off]), rs))
        off += 1
    return items


def _static(model, kv, items, T, fill=None):
    rs = torch.zeros(len(items), T, dtype=torch.int64) if fill is None else fill.clone()
    for i, it in enumerate(items):
        rs[i, : it.read_slots.numel()] = it.read_slots
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return model.decode_static(kv, t([it.token_id for it in items]), t([it.position for it in items]),
                               t([it.write_slot for it in items]), rs, t([it.read_slots.numel() for it in items]),
                               model.rope_tables(128, "cpu"))


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_decode_static_matches_decode_step(batch_invariant):
    model = PagedDecoder(batch_invariant=batch_invariant)
    rng = np.random.default_rng(0)
    for trial in range(3):
        kv = model.make_kv_cache(64, 4)
        kv.kv.copy_(torch.randn(kv.kv.shape, generator=torch.Generator().manual_seed(trial)))
        kv2 = model.make_kv_cache(64, 4)
        kv2.kv.copy_(kv.kv)
        n_read = [0, 5, 17, 33][: 2 + trial]
        items = _items(rng, kv, n_read, 60)
        lg, st = model.decode_step(kv, items)
        T = 40
        lg2, st2 = _static(model, kv2, items, T)
        assert torch.equal(lg.argmax(-1), lg2.argmax(-1))
        assert torch.allclose(lg, lg2, rtol=0, atol=1e-4)
        for i, n in enumerate(n_read[: len(items)]):
            got = torch.cat([st2[i, :n], st2[i, T:]])
            assert torch.allclose(st[i], got, rtol=0, atol=1e-5)
            assert float(st2[i, n:T].abs().max()) == 0.0  # masked columns get nothing
        # the first layer's K/V writes see the same inputs: the same bytes
        ws = torch.tensor([it.write_slot for it in items])
        assert torch.equal(kv.flat[0, :, ws], kv2.flat[0, :, ws])


def test_decode_static_ignores_stale_entries_and_is_placement_invariant():
    model = PagedDecoder()
    rng = np.random.default_rng(1)
    kv = model.make_kv_cache(64, 4)
    kv.kv.copy_(torch.randn(kv.kv.shape, generator=torch.Generator().manual_seed(5)))
    base = kv.kv.clone()
    items = _items(rng, kv, [3, 11, 20], 50)
    T = 32
    lg, st = _static(model, kv, items, T)
    # stale entries past the read count (any in-range slot) change nothing, bit for bit
    kv.kv.copy_(base)
    junk = torch.from_numpy(rng.integers(0, kv.num_slots, size=(3, T)))
    lg2, st2 = _static(model, kv, items, T, fill=junk)
    assert torch.equal(lg, lg2) and torch.equal(st, st2)
    # the same bytes at other slots (a relocation): bitwise the same result
    kv.kv.copy_(base)
    free = np.setdiff1d(np.arange(8, kv.num_slots),
                        np.concatenate([it.read_slots.numpy() for it in items] + [[it.write_slot for it in items]]))
    moved = []
    for j, it in enumerate(items):
        new = torch.from_numpy(free[j * 20: j * 20 + it.read_slots.numel()].copy())
        kv.flat[:, :, new] = base.view_as(kv.kv).view(kv.flat.shape)[:, :, it.read_slots]
        moved.append(it._replace(read_slots=new))
    lg3, st3 = _static(model, kv, moved, T)
    assert torch.equal(lg, lg3) and torch.equal(st, st3)
