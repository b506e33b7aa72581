# Quick start: `make run` (set up, then the main job) and `make test` (set up, then the tests).
PYTHON_BASE ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RECIPE ?= recipes/tiny_arith_cpu.yaml
UI_PORT ?= 5000
export TRANSFORMERS_VERBOSITY := error
export TOKENIZERS_PARALLELISM := false

.PHONY: setup run test test-fast ui bench clean

setup: $(STAMP)

# CPU torch first, so nothing that depends on torch pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON_BASE) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

run: setup
	cfg="$$($(PY) -m miles_core.config $(RECIPE))" && $(VENV)/bin/pyflyte run workflows/rl.py rl --cfg "$$cfg"

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not flyte and not integration"

ui: setup
	$(VENV)/bin/mlflow server --backend-store-uri sqlite:///$(CURDIR)/runs/mlflow.db \
		--default-artifact-root $(CURDIR)/runs/mlartifacts --host 127.0.0.1 --port $(UI_PORT) --workers 1

bench: setup
	$(PY) bench/rollout.py
	$(PY) bench/trainer.py
	$(PY) bench/orchestration.py
	$(PY) bench/async_vs_sync.py

# The Flyte cache remembers artifact paths under runs/: forget both together.
clean:
	rm -rf runs
	test ! -x $(VENV)/bin/pyflyte || $(VENV)/bin/pyflyte local-cache clear
