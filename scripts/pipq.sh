#!/usr/bin/env bash
# pip, quiet, without the warnings of a pip configuration that names index folders this machine
# lacks ("Location ... is ignored"; one line per package) and setuptools' editable-install
# warning (below); pip's exit status kept. An install
# does not byte-compile (--no-compile): the modules a run imports are compiled at first import.
#
#   scripts/pipq.sh PYTHON PIP-ARGS...      (the Makefile's installs and scripts/install_vllm.sh)
set -uo pipefail
PY=${1:?usage: scripts/pipq.sh PYTHON PIP-ARGS...}
shift
extra=()
[ "${1:-}" = install ] && extra=(--no-compile)
# also dropped: setuptools' warning block on an editable install of a package whose name is a
# folder of the checkout (vtoken/ is that package: the warning has nothing to act on), at most
# 12 lines from its first, ending at its last line when that comes
"$PY" -m pip "$@" "${extra[@]}" --quiet 2>&1 | awk '
    /is ignored: it is neither a file nor a directory/ { next }
    /BuildBackendWarning: Editable installation\./ { skip = 12 }
    skip > 0 { skip--; if ($0 ~ /with strategy, WheelFile\(/) skip = 0; next }
    { print; fflush() }'

