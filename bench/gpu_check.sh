#!/usr/bin/env bash
# GPU check, <= 10 minutes on one recent datacenter GPU (H100/H200): installs the `[vllm]` extra, runs
# Qwen2.5-0.5B-Instruct GRPO-LoRA on GSM8K (local JSONL) with colocated vLLM for a fixed number of steps
# (recipes/gsm8k/gpu_colocate.yaml), evaluates GSM8K test problems before and after with `trl-grpo-ext eval`, and
# prints step time, generation tokens/s, peak GPU memory and accuracy (also in <out>/gpu_check.json).
#
#   bash bench/gpu_check.sh                        # model from the hub, data from ../shared/data/gsm8k
#   bash bench/gpu_check.sh --model /models/Qwen2.5-0.5B-Instruct --wheels /wheels   # no hub, no package index
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh --dry-run   # on CPU: validate, print the commands
#
# Offline (a box with torch/transformers/accelerate/peft and no network; bench/gpu_offline.py, docs/gpu.md):
#   bash bench/stage_wheels.sh --out wheels       # beforehand, where the package index is reachable (<= 60 MiB)
#   bash bench/gpu_check.sh --offline --wheels wheels   # on the box: installs them, then the offline check
#   bash bench/gpu_check.sh --offline --dry-run   # on CPU: the same check at a tiny shape (CI runs this)
#
# Its own options (everything else goes to bench/gpu_check.py: --model --data --steps --eval-limit --out ...):
#   --offline      the offline check (bench/gpu_offline.py): the installed torch/transformers, a random model of
#                  Qwen2.5-0.5B-Instruct's shape; installs only --wheels DIR (bench/stage_wheels.sh), never torch
#   --dry-run      check the recipe, data, model argument and commands; install and run nothing (no GPU needed);
#                  with --offline: install nothing, run the offline check on CPU at a tiny shape
#   --no-install   use the environment as it is (vLLM already installed)
#   --wheels DIR   install offline: pip --no-index --find-links DIR
#   --any-torch    let pip pick the newest vLLM of the extra's range even if it replaces the installed torch
#                  (by default the installed torch is kept and pip picks the vLLM release built for it)
# Environment: PYTHON, the interpreter of the environment to install into and run (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

dry_run=0 install=1 wheels="" keep_torch=1 offline=0 pass=()
while [ $# -gt 0 ]; do
  case "$1" in
    --offline) offline=1 ;;
    --dry-run) dry_run=1; pass+=("$1") ;;
    --no-install) install=0 ;;
    --wheels) wheels=${2:?"--wheels needs a folder"}; shift ;;
    --any-torch) keep_torch=0 ;;
    *) pass+=("$1") ;;
  esac
  shift
done

if [ -n "$wheels" ] && [ ! -d "$wheels" ]; then
  echo "gpu_check: error: --wheels $wheels is not a folder" >&2
  exit 2
fi

run() {  # run NAME CMD...: print it; under --dry-run only print; stop with its exit status if it fails
  local name=$1; shift
  if [ "$dry_run" = 1 ]; then
    echo "gpu_check: would run ($name):$(printf ' %q' "$@")"
    return 0
  fi
  echo "gpu_check: running ($name):$(printf ' %q' "$@")"
  local start=$SECONDS status=0
  "$@" || status=$?
  if [ "$status" != 0 ]; then
    echo "gpu_check: error: $name failed (exit status $status)" >&2
    exit "$status"
  fi
  echo "gpu_check: $name took $((SECONDS - start)) s"
}

if [ "$offline" = 1 ]; then
  # The box's own torch, transformers, accelerate and peft are kept: pip may install the staged wheels only.
  if [ "$install" = 1 ] && [ "$dry_run" = 0 ] && [ -z "$wheels" ]; then
    echo "gpu_check: error: --offline installs from --wheels DIR (bench/stage_wheels.sh), or give --no-install" >&2
    exit 2
  fi
  if [ -n "$wheels" ]; then
    if [ ! -f "$wheels/requirements.txt" ] || ! ls "$wheels"/trl_grpo_ext-*.whl >/dev/null 2>&1; then
      echo "gpu_check: error: --wheels $wheels has no requirements.txt or trl_grpo_ext wheel: make it with bench/stage_wheels.sh" >&2
      exit 2
    fi
    keep=$(mktemp)
    trap 'rm -f "$keep"' EXIT
    "$PYTHON" - "$keep" <<'PY'
import sys
from importlib import metadata
with open(sys.argv[1], "w") as out:
    for name in ("torch", "transformers", "accelerate", "peft"):
        try:
            out.write(f"{name}=={metadata.version(name)}\n")
        except metadata.PackageNotFoundError:
            pass
PY
    echo "gpu_check: keeping the installed $(tr '\n' ' ' <"$keep")"
    if [ "$install" = 1 ]; then
      run "install wheels" "$PYTHON" -m pip install --no-index --find-links "$wheels" -r "$wheels/requirements.txt" -c "$keep"
      run "install project" "$PYTHON" -m pip install --no-index --no-deps --force-reinstall "$wheels"/trl_grpo_ext-*.whl
    fi
  fi
  status=0
  "$PYTHON" bench/gpu_offline.py ${pass[@]+"${pass[@]}"} || status=$?
  [ "$status" = 0 ] || echo "gpu_check: error: the offline check failed (exit status $status)" >&2
  exit "$status"
fi

install_cmd=("$PYTHON" -m pip install -e '.[vllm]')
if [ -n "$wheels" ]; then
  install_cmd+=(--no-index --find-links "$wheels")
fi
if [ "$keep_torch" = 1 ] && torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
  # Each vLLM release pins one torch: constraining torch makes pip choose the release that matches it.
  constraint=$(mktemp)
  trap 'rm -f "$constraint"' EXIT
  echo "torch==$torch_version" >"$constraint"
  install_cmd+=(-c "$constraint")
  echo "gpu_check: keeping the installed torch $torch_version"
fi

if [ "$install" = 1 ]; then
  run install "${install_cmd[@]}"
fi

exec "$PYTHON" bench/gpu_check.py ${pass[@]+"${pass[@]}"}
