"""The planted-fault catalogue stays honest: every fault is a patch that applies to today's
code (or a faulty engine that exists), the system names no fault, the catalogue is large
enough and covers the vLLM path, and the runner detects faults through shadow trees
(spot-checked here; the full measure is ``vtoken fuzz --planted all --runs 10``)."""

import re
from pathlib import Path

import pytest

from vtoken.fuzz.catalogue import BY_NAME, CATALOGUE
from vtoken.fuzz.faulty_engines import ENGINES
from vtoken.fuzz.patches import Patch, PatchError, apply_text, planted
from vtoken.fuzz.planted import run_all

REPO = Path(__file__).resolve().parent.parent


def test_catalogue_size_and_coverage():
    assert len({f.name for f in CATALOGUE}) == len(CATALOGUE)
    cpu = [f for f in CATALOGUE if not f.cuda_only]
    assert len(cpu) >= 35, len(cpu)
    assert sum(1 for f in cpu if f.detector == "adapter") >= 8
    for f in CATALOGUE:
        assert bool(f.patches) != bool(f.engine), f"{f.name}: a fault is patches or an engine, not both"
        if f.engine:
            assert f.engine in ENGINES, f.name


@pytest.mark.parametrize("name", [f.name for f in CATALOGUE if f.patches])
def test_every_patch_applies_to_the_current_code(name):
    texts = {}
    for p in BY_NAME[name].patches:
        text = texts.get(p.file) or (REPO / p.file).read_text()
        texts[p.file] = apply_text(text, p)  # PatchError (loud) when the target code changed


def test_a_patch_that_no_longer_applies_fails_loudly():
    with pytest.raises(PatchError, match="occurs 0 times"):
        apply_text((REPO / "vtoken/table.py").read_text(),
                   Patch("vtoken/table.py", "TokenTable._claim", "this text is not there", "x"))
    with pytest.raises(PatchError, match="no function"):
        apply_text((REPO / "vtoken/table.py").read_text(), Patch("vtoken/table.py", "TokenTable.gone", "a", "b"))
    with pytest.raises(PatchError):
        with planted([Patch("vtoken/table.py", "TokenTable._claim", "this text is not there", "x")]):
            pass


def test_in_process_patch_is_undone():
    from vtoken.table import TokenTable

    before = TokenTable._evict_one
    with planted(BY_NAME["waste_drift"].patches):
        assert TokenTable._evict_one is not before
    assert TokenTable._evict_one is before


def test_the_system_names_no_fault():
    names = {f.name for f in CATALOGUE}
    for p in (REPO / "vtoken").rglob("*.py"):
        text = p.read_text()
        assert "faults.on(" not in text and "import faults" not in text, p
        hit = [n for n in names if re.search(rf"\b{n}\b", text)]
        assert not hit, f"{p} names planted faults {hit}"


@pytest.mark.invariants
def test_spot_check_detection_through_shadow_trees():
    s = run_all(["stale_slot_after_move", "alloc_double_free"], runs=1, budget_s=60, workers=2, progress=False)
    assert s["planted"] == 2 and s["min_rate"] == 1.0, s["results"]
    for r in s["results"]:
        assert r["steps"] is not None and r["steps"] <= 10, r


def test_gpu_faults_are_run_on_a_device_or_listed_as_not_run(monkeypatch):
    """The CUDA-only faults are never dropped in silence: with a device they run (the I3
    probes, tests/test_gpu.py), without one the summary names each as not run and nothing
    counts as planted."""
    from vtoken.fuzz import planted as planted_mod

    gpu = [f.name for f in CATALOGUE if f.cuda_only]
    assert gpu and all(BY_NAME[n].detector == "gpu" for n in gpu)
    monkeypatch.setattr(planted_mod, "_cuda", lambda: False)
    s = run_all(gpu, runs=1, progress=False)
    assert s["gpu_faults_not_run"] == gpu and s["planted"] == 0 and s["results"] == []
