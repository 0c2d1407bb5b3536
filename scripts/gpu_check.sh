#!/usr/bin/env bash
# GPU check for the CUDA path of the copy engine / decode engine (see scripts/gpu_check.py).
# Usage: scripts/gpu_check.sh [tests] [sanitizer] [i3] [bandwidth]   (default: all, < 10 min)
# Picks the first Python whose torch sees a CUDA device: $PY, .venv/bin/python, python3.
set -u
cd "$(dirname "$0")/.."
pick() {
  for c in "${PY:-}" .venv/bin/python python3 python; do
    [ -n "$c" ] || continue
    command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
    if "$c" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
      echo "$c"; return 0
    fi
  done
  return 1
}
if ! PYBIN=$(pick); then
  echo '{"ok": false, "error": "no Python with a CUDA-enabled torch found (tried $PY, .venv/bin/python, python3, python)"}'
  exit 2
fi
exec timeout 580 "$PYBIN" scripts/gpu_check.py "$@"
