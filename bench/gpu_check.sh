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
# Its own options (everything else goes to bench/gpu_check.py: --model --data --steps --eval-limit --out ...):
#   --dry-run      check the recipe, data, model argument and commands; install and run nothing (no GPU needed)
#   --no-install   use the environment as it is (vLLM already installed)
#   --wheels DIR   install offline: pip --no-index --find-links DIR
#   --any-torch    let pip pick the newest vLLM of the extra's range even if it replaces the installed torch
#                  (by default the installed torch is kept and pip picks the vLLM release built for it)
# Environment: PYTHON, the interpreter of the environment to install into and run (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

dry_run=0 install=1 wheels="" keep_torch=1 pass=()
while [ $# -gt 0 ]; do
  case "$1" in
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
  if [ "$dry_run" = 1 ]; then
    echo "gpu_check: would run (install):$(printf ' %q' "${install_cmd[@]}")"
  else
    echo "gpu_check: running (install):$(printf ' %q' "${install_cmd[@]}")"
    start=$SECONDS
    "${install_cmd[@]}"
    echo "gpu_check: install took $((SECONDS - start)) s"
  fi
fi

exec "$PYTHON" bench/gpu_check.py ${pass[@]+"${pass[@]}"}
