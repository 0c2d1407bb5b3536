# Two commands set everything up on a fresh machine:
#   make audit   the main job: audit the bundled default, write a report under reports/
#   make test    the test suite
# Both create (or reuse) a local virtual environment in $(VENV) and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.vtoken-installed

.PHONY: test audit fuzz bench venv clean-venv

venv: $(STAMP)

# torch is pinned here, not in pyproject: on these machines torch==2.13.0 is a CPU wheel
# already on disk; elsewhere it is the ordinary PyPI build. pyproject asks only torch>=2.1,
# which the pinned install satisfies, so nothing larger is pulled in.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

test: $(STAMP)
	$(PY) -m pytest

audit: $(STAMP)
	$(PY) -m vtoken audit

clean-venv:
	rm -rf $(VENV)
