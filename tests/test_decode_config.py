"""DecodeEngine checks its arguments at construction, before anything is built.

Each bad argument raises ``ConfigError`` (a ``ValueError``) with the code ``bad_type`` or
``out_of_range``, naming the argument and its value; the engine is built with
``num_blocks`` set, so a check that came after ``setup`` would be seen: no KV cache made,
no copy engine built, the model untouched.
"""

import math

import numpy as np
import pytest
import torch

from vtoken.copy_engine import KVCopyEngine
from vtoken.decode import DecodeEngine
from vtoken.errors import ConfigError
from vtoken.fuzz.faulty_engines import FailingCopyEngine
from vtoken.invariants.relocation_hash import RelocationChecker
from vtoken.model import PagedDecoder
from vtoken.planner import PlannerConfig


class SpyDecoder(PagedDecoder):
    """Counts the KV caches made for it."""

    kv_built = 0

    def make_kv_cache(self, *a, **kw):
        SpyDecoder.kv_built += 1
        return super().make_kv_cache(*a, **kw)


class SpyEngine(KVCopyEngine):
    """The shipped copy engine, counting its builds (its keywords are KVCopyEngine's)."""

    built = 0

    def __init__(self, *a, **kw):
        SpyEngine.built += 1
        super().__init__(*a, **kw)


@pytest.fixture(scope="module")
def model():
    return SpyDecoder()


NAN = math.nan
# (argument named in the message, the bad keyword arguments, code)
BAD = [
    ("mode", dict(mode="fast"), "out_of_range"),
    ("mode", dict(mode=3), "bad_type"),
    ("policy", dict(policy="lru"), "out_of_range"),
    ("policy", dict(policy=None), "bad_type"),
    ("evict_ratio", dict(evict_ratio=1.0), "out_of_range"),
    ("evict_ratio", dict(evict_ratio=-0.1), "out_of_range"),
    ("evict_ratio", dict(evict_ratio=NAN), "out_of_range"),
    ("evict_ratio", dict(evict_ratio=True), "bad_type"),
    ("evict_ratio", dict(evict_ratio="0.5"), "bad_type"),
    ("block_size", dict(block_size=0), "out_of_range"),
    ("block_size", dict(block_size=4.0), "bad_type"),
    ("block_size", dict(block_size=True), "bad_type"),
    ("num_blocks", dict(num_blocks=1), "out_of_range"),
    ("num_blocks", dict(num_blocks=8.0), "bad_type"),
    ("device", dict(device="tpu"), "out_of_range"),
    ("device", dict(device=0), "bad_type"),
    ("seed", dict(seed=-1), "out_of_range"),
    ("seed", dict(seed=1.5), "bad_type"),
    ("seed", dict(seed=False), "bad_type"),
    ("copy_kwargs['lag']", dict(copy_kwargs={"lag": -1}), "out_of_range"),
    ("copy_kwargs['lag']", dict(copy_kwargs={"lag": 1.5}), "bad_type"),
    ("copy_kwargs['sleep_cycles']", dict(copy_kwargs={"sleep_cycles": -5}), "out_of_range"),
    ("copy_kwargs['sentinel']", dict(copy_kwargs={"sentinel": 1}), "bad_type"),
    ("copy_kwargs['timed']", dict(copy_kwargs={"timed": "yes"}), "bad_type"),
    ("copy_kwargs", dict(copy_kwargs={"lagg": 1}), "out_of_range"),
    ("copy_kwargs", dict(copy_kwargs={"force_sync": True}), "out_of_range"),
    ("copy_kwargs", dict(copy_kwargs={"block_size": 4}), "out_of_range"),
    ("copy_kwargs", dict(copy_kwargs=[("lag", 1)]), "bad_type"),
    ("sentinel_check", dict(sentinel_check=True), "out_of_range"),
    ("sentinel_check", dict(sentinel_check=True, copy_kwargs={"sentinel": False}), "out_of_range"),
    ("sentinel_check", dict(mode="naive-evict", sentinel_check=True, copy_kwargs={"sentinel": True}), "out_of_range"),
    ("sentinel_check", dict(sentinel_check="yes"), "bad_type"),
    ("check_method", dict(check_method="md5", check_relocations=RelocationChecker), "out_of_range"),
    ("check_method", dict(check_method=1), "bad_type"),
    ("check_relocations", dict(check_relocations=True), "bad_type"),
    ("check_relocations", dict(check_relocations="xxh3"), "bad_type"),
    ("cuda_graph", dict(cuda_graph=1), "bad_type"),
    ("cuda_graph", dict(cuda_graph="auto"), "bad_type"),
    ("planner_config", dict(planner_config={"headroom": 2}), "bad_type"),
    ("policy_kwargs", dict(policy_kwargs={"window": 4}), "out_of_range"),
    ("policy_kwargs", dict(policy_kwargs=["recent"]), "bad_type"),
    ("force_sync", dict(force_sync="no"), "bad_type"),
    ("full_bytes", dict(full_bytes=1), "bad_type"),
    ("copy_engine_factory", dict(copy_engine_factory=5), "bad_type"),
    ("snapshot_dir", dict(snapshot_dir=5), "bad_type"),
]
if not torch.cuda.is_available():
    BAD.append(("device", dict(device="cuda"), "out_of_range"))  # a device this machine lacks


def _ids():
    return [f"{field}-{i}" for i, (field, _, _) in enumerate(BAD)]


@pytest.mark.parametrize("field,kw,code", BAD, ids=_ids())
def test_bad_argument_refused_before_anything_is_built(model, field, kw, code):
    kw = {"mode": "vtoken", "num_blocks": 8, "copy_engine_factory": SpyEngine, "block_size": 4, **kw}
    kv0, eng0 = SpyDecoder.kv_built, SpyEngine.built
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError) as e:
        DecodeEngine(model, **kw)
    assert e.value.code == code, str(e.value)
    assert f"DecodeEngine.{field} must be" in str(e.value), str(e.value)
    value = next(v for k, v in kw.items() if field == k or field.startswith(f"{k}["))
    shown = repr(value[field.split("'")[1]]) if "[" in field else repr(value)
    assert shown in str(e.value), str(e.value)
    assert isinstance(e.value, ValueError)  # callers catching ValueError keep working
    assert (SpyDecoder.kv_built, SpyEngine.built) == (kv0, eng0), "something was built before the check"
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_model_that_is_not_a_paged_decoder_is_refused():
    with pytest.raises(ConfigError, match=r"DecodeEngine\.model must be .*'object'") as e:
        DecodeEngine(object(), num_blocks=8)
    assert e.value.code == "bad_type"


def test_valid_arguments_are_accepted_and_normalized(model):
    eng = DecodeEngine(model, mode="vtoken", policy="random", evict_ratio=np.float32(0.25),
                       block_size=np.int64(4), num_blocks=np.int64(16), device=torch.device("cpu"),
                       seed=np.int32(3), copy_kwargs={"lag": np.int64(2), "sentinel": True},
                       sentinel_check=True, check_relocations=RelocationChecker, check_method="xxh3",
                       planner_config=PlannerConfig(), policy_kwargs={"recent": 4}, cuda_graph=False,
                       copy_engine_factory=SpyEngine)
    assert (eng.S, eng.num_blocks, eng.seed, type(eng.seed)) == (4, 16, 3, int)
    assert eng.kv is not None and eng.copy_engine.lag == 2
    # a copy engine's own keywords (along its __init__ chain) are accepted
    DecodeEngine(model, block_size=4, num_blocks=8, copy_engine_factory=FailingCopyEngine,
                 copy_kwargs={"fail_every": 2, "lag": 1})
    # a factory taking **kwargs names no fixed set: its keywords are its own business
    DecodeEngine(model, block_size=4, num_blocks=8,
                 copy_engine_factory=lambda kv, S, **kw: KVCopyEngine(kv, S, force_sync=kw["force_sync"]),
                 copy_kwargs={"anything": 1})
    # the other modes take the defaults; no copy engine is built there
    for mode in ("native", "naive-evict"):
        assert DecodeEngine(model, mode=mode, block_size=4, num_blocks=8).copy_engine is None


def test_decode_summary_prints_orphaned_plans():
    """``vtoken decode``'s summary lists every way a plan ended, the orphans too."""
    import io

    from vtoken.cli.decode import _print_summary
    from vtoken.decode import DecodeResult

    res = DecodeResult(mode="vtoken", policy="h2o", evict_ratio=0.5, block_size=4, num_blocks=32, device="cpu",
                       outputs=[], tokens_per_s=1.0, decode_tokens_per_s=1.0, wall_s=1.0, steps=1, step_ms_median=1.0,
                       step_ms_mean=1.0, step_ms=[], relocations=5, plans_launched=9, plans_aborted=1,
                       plans_orphaned=3)
    out = io.StringIO()
    _print_summary(res.to_dict(), stream=out)
    assert "launched 9, aborted 1, orphaned 3," in out.getvalue(), out.getvalue()


# ------------------------------------------------------------------------------ the config object
def test_the_config_object_is_validated_when_made_and_builds_the_same_engine(model):
    from vtoken.decode import DecodeConfig

    with pytest.raises(ConfigError, match=r"DecodeEngine\.evict_ratio must be") as e:
        DecodeConfig(evict_ratio=1.5)  # refused with no engine, cache or model in sight
    assert e.value.code == "out_of_range"
    c = DecodeConfig(mode="naive-evict", block_size=4, num_blocks=8, seed=3)
    assert c.device == torch.device("cpu") and c.planner_config == PlannerConfig() and c.cuda_graph is False
    a, b = DecodeEngine(model, c), DecodeEngine(model, mode="naive-evict", block_size=4, num_blocks=8, seed=3)
    assert a.config == b.config == c
    assert (a.mode, a.S, a.num_blocks, a.seed) == (b.mode, b.S, b.num_blocks, b.seed) == ("naive-evict", 4, 8, 3)


def test_a_config_and_settings_together_or_a_foreign_config_are_refused(model):
    from vtoken.decode import DecodeConfig

    with pytest.raises(ConfigError, match=r"DecodeEngine\.config must be alone") as e:
        DecodeEngine(model, DecodeConfig(), num_blocks=8)
    assert e.value.code == "inconsistent"
    with pytest.raises(ConfigError, match=r"DecodeEngine\.config must be None or a") as e:
        DecodeEngine(model, {"num_blocks": 8})
    assert e.value.code == "bad_type"


def test_a_checker_makes_the_config_record_snapshots(model):
    from vtoken.decode import DecodeConfig

    assert DecodeConfig(check_relocations=RelocationChecker).planner_config.record_snapshots
    off = DecodeConfig(mode="naive-evict", check_relocations=RelocationChecker)
    assert off.check_relocations is None and not off.planner_config.record_snapshots  # vtoken mode only
