# Quick start: `make run` (set up, then the main job) and `make test` (set up, then the tests).
PYTHON_BASE ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RECIPE ?= recipes/tiny_arith_cpu.yaml
ARGS ?=
UI_PORT ?= 5000
export TRANSFORMERS_VERBOSITY := error
export TOKENIZERS_PARALLELISM := false

.PHONY: setup run test test-fast test-twins test-slow test-sglang-families ui bench clean sglang-env lock

setup: $(STAMP)

# Every package at the exact version and hash of requirements.lock (CPU torch included, so nothing
# pulls a CUDA build), then the project itself without resolving anything. uv installs them (it unpacks
# and compiles the bytecode in parallel, where pip takes one package at a time) from its own environment in
# the user cache, so .venv holds the lock and nothing else; it does not read pip's configuration, so the
# wheel folders pip is pointed at (PIP_FIND_LINKS, else pip's config) are passed on.
USER_CACHE := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/miles-flyte
UV := $(USER_CACHE)/uv/bin/uv
FIND_LINKS := $(or $(PIP_FIND_LINKS),$(shell $(PYTHON_BASE) -m pip config get global.find-links 2>/dev/null))
UV_PIP := $(UV) pip install --quiet --no-deps $(addprefix --find-links ,$(FIND_LINKS))
UV_INSTALL := $(UV_PIP) --python $(PY)

$(UV): requirements-uv.lock
	test -x $(USER_CACHE)/uv/bin/python || $(PYTHON_BASE) -m venv $(USER_CACHE)/uv
	$(USER_CACHE)/uv/bin/pip install --quiet --require-hashes --no-deps -r requirements-uv.lock
	touch $@

$(STAMP): pyproject.toml requirements.lock $(UV)
	test -x $(PY) || $(PYTHON_BASE) -m venv $(VENV)
	$(UV_INSTALL) --require-hashes --compile-bytecode -r requirements.lock
	$(UV_INSTALL) --no-build-isolation -e .
	$(PY) -m pip check
	command -v bwrap >/dev/null || apt-get install -y bubblewrap || sudo apt-get install -y bubblewrap  # code sandbox
	touch $@

# `make run RECIPE=recipes/x.yaml ARGS="sft.seed=1 model.seed=1"`: another recipe, keys overridden. The run's temporary
# files (flytekit's local sandbox: every download of the run, ~400 MB for the main recipe) go to a folder removed after
# it; what the run produced is under its run root.
run: setup
	tmp="$$(mktemp -d)" && trap 'rm -rf "$$tmp"' EXIT INT TERM && cfg="$$($(PY) -m miles_core.config $(RECIPE) $(ARGS))" && \
	TMPDIR="$$tmp" $(VENV)/bin/pyflyte run workflows/rl.py rl --cfg "$$cfg"

# Two test processes (pytest-xdist), each taking whole files so a file's shared runs happen once, the longest files first
# (tests/conftest.py LONGEST_FIRST, an order --no-loadscope-reorder keeps). Three processes were measured slower: 46+
# minutes against 34, every test starved by the others. Torch keeps its default threads: the learning
# tier's runs are deterministic for a thread count, and the megatron run of tests/flyte/test_learning.py learns less at
# one thread (+8.6 points, under its margin) than at two. With two workers and their subprocesses sharing 2 cores,
# OpenMP threads that wait sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE): the same numbers, bit for bit, without
# the spinning threads taking the other's core. The tests' temporary files (pytest's folders, flytekit's local sandbox
# of every process that imports it, servers' logs: ~1 GB) go to a folder removed after them, kept and named when a test
# fails.
test: setup sglang-env
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	tmp="$$(mktemp -d)" && if TMPDIR="$$tmp" OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15; \
	then rm -rf "$$tmp"; else status=$$?; echo "the tests' temporary files are kept in $$tmp"; exit $$status; fi

test-fast: setup
	$(PY) -m pytest -q -m "not flyte and not integration"

# The slower tier: every real-size recipe's tiny twin (recipes/tiny/) through a real pyflyte run on CPU.
test-twins: setup
	$(PY) -m pytest -q -m twins tests/flyte/test_twins.py

# The slower tier kept out of `make test` for its 30 minutes here (together about 6.5 minutes on 2 cores): each algorithm
# family's recipe through a real pyflyte run at smoke size (their arithmetic is in tests/unit/test_algos*.py), and
# megatron-core at TP/PP/EP sizes with resharding and each MLA/MoE family's step (tests/integration/test_megatron_parallel.py).
test-slow: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "algorithm_families or megatron_parallel" tests/flyte/test_families.py tests/integration/test_megatron_parallel.py

# The slower tier: every model family at tiny size launched in the real SGLang server on CPU (one launch each).
test-sglang-families: setup sglang-env
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m integration tests/integration/test_sglang_families.py

ui: setup
	$(VENV)/bin/mlflow server --backend-store-uri sqlite:///$(CURDIR)/runs/mlflow.db \
		--default-artifact-root $(CURDIR)/runs/mlartifacts --host 127.0.0.1 --port $(UI_PORT) --workers 1

bench: setup
	$(PY) bench/rollout.py
	$(PY) bench/trainer.py
	$(PY) bench/contention.py
	$(PY) bench/orchestration.py
	$(PY) bench/async_vs_sync.py
	$(PY) bench/precision.py
	$(PY) bench/lora.py
	$(PY) bench/speculative.py

# Refresh the locks: resolve pyproject.toml (and the SGLang image's requirements, and uv) anew, newest
# versions allowed by their ranges, with hashes. tests/unit/test_lock.py fails when they disagree.
LOCK_TOOL := $(USER_CACHE)/pip-tools
PIP_COMPILE := $(LOCK_TOOL)/bin/pip-compile --quiet --generate-hashes --allow-unsafe --no-emit-index-url --no-emit-find-links
lock:
	test -x $(LOCK_TOOL)/bin/pip-compile || ($(PYTHON_BASE) -m venv $(LOCK_TOOL) && $(LOCK_TOOL)/bin/pip install --quiet pip-tools==7.6.2)
	CUSTOM_COMPILE_COMMAND="make lock" $(PIP_COMPILE) --extra test --strip-extras -o requirements.lock pyproject.toml
	CUSTOM_COMPILE_COMMAND="make lock" $(PIP_COMPILE) -o containers/sglang/requirements.lock containers/sglang/requirements.in
	CUSTOM_COMPILE_COMMAND="make lock" $(PIP_COMPILE) -o requirements-uv.lock requirements-uv.in

# The Flyte cache remembers artifact paths under runs/: forget both together.
clean:
	rm -rf runs
	test ! -x $(VENV)/bin/pyflyte || $(VENV)/bin/pyflyte local-cache clear

# SGLang runs in its own environment outside the clone, keyed by its version, as in its own image
# on a cluster: its CUDA build of torch 2.14.1 stays there (~11 GB, once per machine; uv installs the
# lock, hashes checked and bytecode compiled, as for .venv), and the project's .venv never imports
# sglang. The CPU stand-ins of containers/sglang are copied into it (again whenever they change); a
# missing environment is rebuilt.
SGLANG_VERSION := $(shell sed -n 's/^sglang==//p' containers/sglang/requirements.in)
SGLANG_ENV ?= $(USER_CACHE)/sglang-$(SGLANG_VERSION)
SGLANG_PY := $(SGLANG_ENV)/bin/python
SGLANG_STANDINS := $(wildcard containers/sglang/cpu_standins/*.py containers/sglang/cpu_standins/*/*.py)
export MILES_SGLANG_ENV := $(SGLANG_ENV)

sglang-env: $(SGLANG_ENV)/.standins-installed

$(SGLANG_ENV)/.sglang-installed: containers/sglang/requirements.lock $(UV)
	test -x $(SGLANG_PY) || $(PYTHON_BASE) -m venv $(SGLANG_ENV)
	$(UV_PIP) --python $(SGLANG_PY) --require-hashes --compile-bytecode -r containers/sglang/requirements.lock
	touch $@

$(SGLANG_ENV)/.standins-installed: $(SGLANG_ENV)/.sglang-installed $(SGLANG_STANDINS)
	site="$$($(SGLANG_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" && \
		rm -rf "$$site/miles_sglang_cpu" && mkdir -p "$$site/miles_sglang_cpu" && \
		cp -r containers/sglang/cpu_standins/sgl_kernel "$$site/miles_sglang_cpu/" && \
		cp containers/sglang/cpu_standins/sitecustomize.py "$$site/sitecustomize.py"
	touch $@
