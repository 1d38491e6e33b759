# Two entry points for a fresh machine: `make demo` and `make test` (both install first; the
# tests also install the real engine, vLLM's CPU build, into .venv-engine: scripts/ensure-engine).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: demo test install lint bench engine

engine:
	scripts/ensure-engine

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/gateway demo

test: $(VENV)/.installed
	scripts/ensure-deps
	scripts/ensure-engine
	$(PY) -m pytest

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check gateway prefix_index policies simulator bench tests
	$(VENV)/bin/mypy gateway prefix_index policies simulator
