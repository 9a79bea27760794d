#!/usr/bin/env bash
# TRL conformance: TRL's own GRPO trainer tests (tests/test_grpo_trainer.py of the TRL release installed, 1.16.0),
# run offline on CPU twice: against trl.GRPOTrainer / trl.GRPOConfig, then against trl_grpo_ext's (the test file's
# one `from trl import GRPOConfig, GRPOTrainer` line swapped). Prints both variants' counts, the tests that fail for
# both (environment limits) and every test that passes with TRL and not with ours; exits 1 if there is any.
#
#   bash bench/trl_conformance.sh [TRL_TESTS]
#
# TRL_TESTS (or $TRL_TESTS): TRL's test_grpo_trainer.py, or a TRL checkout's tests/ folder at the installed
# release's tag (then its testing_utils.py and conftest.py come along). Without it the file is looked for in
# bench/trl_tests/ (a vendored copy), then in TRL's sdist from PyPI (1.16.0's sdist has no tests/): the script
# stops with exit 2 if none has it.
#
# Offline: HF_HUB_OFFLINE=1; the hub ids the tests name are tiny random stand-ins built here
# (bench/trl_conformance/fixtures.py), the zen datasets too; bench/trl_conformance/offline_plugin.py serves them,
# sets an unset bf16 to False on a machine without bf16 support and bounds each test's time.
#
# Environment: PYTHON (default .venv/bin/python), TRL_CONFORMANCE_WORKDIR (default outputs/trl_conformance: logs,
# JUnit reports, the hub cache), TRL_CONFORMANCE_TEST_TIMEOUT (seconds per test, default 300),
# TRL_CONFORMANCE_RUN_TIMEOUT (seconds per variant, default 2700), OMP_NUM_THREADS (default 1).
# Exit: 0 no test passes with TRL and fails with ours; 1 some do (listed); 2 the run could not be made.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
WORK=${TRL_CONFORMANCE_WORKDIR:-outputs/trl_conformance}
SOURCE=${1:-${TRL_TESTS:-}}
IMPORT_LINE='from trl import GRPOConfig, GRPOTrainer'
OUR_IMPORT='from trl_grpo_ext import GRPOConfig, GRPOTrainer'

TRL_VERSION=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("trl"))')
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false TRL_EXPERIMENTAL_SILENCE=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TRL_CONFORMANCE_TEST_TIMEOUT=${TRL_CONFORMANCE_TEST_TIMEOUT:-300}
# The work folder is emptied first: only one this script made (its marker file) or an empty one.
if [ -d "$WORK" ] && [ -n "$(ls -A "$WORK")" ] && [ ! -f "$WORK/.trl_conformance" ]; then
  echo "trl_conformance: $WORK is not empty and not a folder of this script's; set TRL_CONFORMANCE_WORKDIR"
  exit 2
fi
rm -rf "$WORK" && mkdir -p "$WORK" && touch "$WORK/.trl_conformance"
WORK=$(cd "$WORK" && pwd)
export HF_HOME="$WORK/hf" HF_HUB_CACHE="$WORK/hf/hub"

# --- TRL's test file (and, from a checkout, its test helpers)
helpers=""
if [ -n "$SOURCE" ] && [ -d "$SOURCE" ]; then
  test_file="$SOURCE/test_grpo_trainer.py" helpers="$SOURCE"
elif [ -n "$SOURCE" ]; then
  test_file="$SOURCE"
elif [ -f bench/trl_tests/test_grpo_trainer.py ]; then
  test_file=bench/trl_tests/test_grpo_trainer.py
else
  test_file=""
  echo "trl_conformance: looking for tests/ in the trl==$TRL_VERSION sdist"
  if "$PYTHON" -m pip download -q --no-deps --no-binary :all: "trl==$TRL_VERSION" -d "$WORK/sdist" >"$WORK/sdist.log" 2>&1; then
    tar -xzf "$WORK"/sdist/trl-*.tar.gz -C "$WORK/sdist"
    found=$(find "$WORK/sdist" -path '*/tests/test_grpo_trainer.py' | head -n 1)
    [ -n "$found" ] && test_file=$found helpers=$(dirname "$found")
  fi
fi
if [ -z "$test_file" ] || [ ! -f "$test_file" ]; then
  echo "trl_conformance: no test_grpo_trainer.py of TRL $TRL_VERSION: its sdist has no tests/; pass the file (or a"
  echo "  TRL checkout's tests/ at tag v$TRL_VERSION) as the argument or TRL_TESTS, or vendor it in bench/trl_tests/"
  exit 2
fi
if [ "$(grep -cxF "$IMPORT_LINE" "$test_file")" != 1 ]; then
  echo "trl_conformance: $test_file does not import GRPOConfig, GRPOTrainer in one line '$IMPORT_LINE'"
  exit 2
fi
echo "trl_conformance: TRL $TRL_VERSION tests from $test_file (sha256 $(sha256sum "$test_file" | cut -c1-16))"

# --- offline stand-ins for the hub ids the file names
PYTHONPATH="bench/trl_conformance${PYTHONPATH:+:$PYTHONPATH}" \
  "$PYTHON" bench/trl_conformance/fixtures.py "$test_file" "$HF_HUB_CACHE"

# --- the two variants, one after the other (pytest exits 1 when a test fails: the comparison decides)
for variant in trl ours; do
  dir="$WORK/$variant/tests"
  mkdir -p "$dir"
  touch "$dir/__init__.py"
  if [ -n "$helpers" ] && [ -f "$helpers/testing_utils.py" ]; then
    cp "$helpers/testing_utils.py" "$dir/"
    [ -f "$helpers/conftest.py" ] && cp "$helpers/conftest.py" "$dir/"
  else
    cp bench/trl_conformance/testing_utils.py "$dir/"
  fi
  if [ "$variant" = ours ]; then
    sed "s/^$IMPORT_LINE\$/$OUR_IMPORT/" "$test_file" >"$dir/test_grpo_trainer.py"
  else
    cp "$test_file" "$dir/test_grpo_trainer.py"
  fi
  printf '[pytest]\nmarkers =\n    slow\n    low_priority\n' >"$WORK/$variant/pytest.ini"
  echo "trl_conformance: running TRL's tests against $variant (log: $WORK/$variant.log)"
  start=$SECONDS
  set +e
  PYTHONPATH="$PWD/bench/trl_conformance:$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout "${TRL_CONFORMANCE_RUN_TIMEOUT:-2700}" \
    "$PYTHON" -m pytest -p no:cacheprovider -p offline_plugin -c "$WORK/$variant/pytest.ini" --rootdir "$WORK/$variant" \
    -q -rA --junitxml "$WORK/$variant.xml" "$dir/test_grpo_trainer.py" >"$WORK/$variant.log" 2>&1
  status=$?
  set -e
  echo "trl_conformance: $variant: pytest exit $status after $((SECONDS - start)) s: $(tail -n 1 "$WORK/$variant.log")"
  if [ "$status" -gt 1 ]; then
    echo "trl_conformance: $variant did not run to the end (exit $status; 124: TRL_CONFORMANCE_RUN_TIMEOUT)"
    exit 2
  fi
done

"$PYTHON" bench/trl_conformance/compare.py "$WORK/trl.xml" "$WORK/ours.xml"
