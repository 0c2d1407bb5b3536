#!/usr/bin/env bash
# pip, quiet, without the warnings of a pip configuration that names index folders this machine
# lacks ("Location ... is ignored"; one line per package); pip's exit status kept. An install
# does not byte-compile (--no-compile): the modules a run imports are compiled at first import.
#
#   scripts/pipq.sh PYTHON PIP-ARGS...      (the Makefile's installs and scripts/install_vllm.sh)
set -uo pipefail
PY=${1:?usage: scripts/pipq.sh PYTHON PIP-ARGS...}
shift
extra=()
[ "${1:-}" = install ] && extra=(--no-compile)
"$PY" -m pip "$@" "${extra[@]}" --quiet 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
