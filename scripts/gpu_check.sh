#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): <= 8 minutes on an H200, figures in one JSON file.
#
#   bash scripts/gpu_check.sh                    on a GPU machine: every section
#   bash scripts/gpu_check.sh --only i3,sanitizer
#   bash scripts/gpu_check.sh --dry-run          here (CPU): sections, imports, CPU smokes, the JSON writer
#   bash scripts/gpu_check.sh --prepare-wheels   here, where a package index is reachable: download what a
#                                                bare GPU image with torch lacks into .whl/ (carried along)
#
# A bare image (torch, Triton, hypothesis, xxhash, numpy, pytest) lacks z3-solver. The wheels in
# $VTOKEN_WHEELS (default .whl/) are installed offline into a temporary folder first, for what is
# not importable already; nothing is fetched on the GPU machine. The device tool carries the
# folder when a run names it: carry [".whl"] (about 29 MB).
# Picks the first Python whose torch sees a CUDA device ($PY, python3, .venv/bin/python);
# --dry-run takes the first with torch at all.
set -u
cd "$(dirname "$0")/.."
WHEELS=${VTOKEN_WHEELS:-.whl}
Z3_VERSION=4.15.4.0  # the smallest z3-solver wheel that satisfies pyproject (>= 4.12): ~29 MB

if [ "${1:-}" = "--prepare-wheels" ]; then
  py=${PY:-.venv/bin/python}; [ -x "$py" ] || py=python3
  mkdir -p "$WHEELS"
  grep -qxF "/$WHEELS/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$WHEELS/" >> .git/info/exclude; }
  exec "$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" "z3-solver==$Z3_VERSION"
fi

dry=0
for a in "$@"; do [ "$a" = "--dry-run" ] && dry=1; done
if [ $dry = 1 ]; then probe='import torch'; else probe='import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; fi
PYBIN=
for c in "${PY:-}" python3 .venv/bin/python python; do
  [ -n "$c" ] || continue
  command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
  if "$c" -c "$probe" >/dev/null 2>&1; then PYBIN=$c; break; fi
done
if [ -z "$PYBIN" ]; then
  echo '{"schema": "vtoken-gpu-check/1", "ok": false, "error": "no Python with a (CUDA-enabled) torch found: tried $PY, python3, .venv/bin/python, python"}'
  exit 2
fi

# offline install of the carried wheels, only of what is missing (never over the image's own packages)
if ! "$PYBIN" -c 'import z3' >/dev/null 2>&1; then
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/vtoken-site.XXXXXX")
    if "$PYBIN" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl; then
      export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    else
      echo "[gpu_check] installing the wheels in $WHEELS failed; the env section will say what is missing" >&2
    fi
  else
    echo "[gpu_check] z3 is not importable and $WHEELS holds no wheels (bash scripts/gpu_check.sh --prepare-wheels)" >&2
  fi
fi
exec timeout 470 "$PYBIN" scripts/gpu_check.py "$@"
