#!/usr/bin/env bash
# Run agentic-rl-lab chapter scripts, unmodified, against the local PyTRIO server, offline.
#
#   examples/agentic_rl_lab/drive.sh search-r1     # 03-search-r1/train.py, $STEPS steps
#   examples/agentic_rl_lab/drive.sh opd           # 02-opd/general-opd/01-demo-sync.py, 2 steps
#
# Variables (defaults in brackets):
#   CHAPTERS   a checkout of github.com/KMnO4-zx/agentic-rl-lab at commit 5fc44d8 [./agentic-rl-lab]
#   PY         python that runs trl-grpo-ext (the server, make_data.py) [python]
#   CHAPTER_PY python with the chapters' imports (pytrio, swanlab, deepseek-search, python-dotenv) [$PY]
#   WORK       scratch folder: data, certificates, warm-up model, server storage, logs [/tmp/arl]
#   STEPS      search-r1: training steps [3]
#   PORT, SEARCH_PORT  the server's and the search stand-in's ports [8790, 8791]
#   TEACHER    opd: the model served as Qwen/Qwen3.6-27B, the teacher [$WORK/warm-smollm2]; TEACHER=embedded
#              serves the student's own base model, whose reverse KL is then 0 (a control)
# Started processes are stopped (by their pid) when the script exits.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
what="${1:-}"
CHAPTERS="$(cd "${CHAPTERS:-agentic-rl-lab}" && pwd)"
PY="${PY:-python}"
CHAPTER_PY="${CHAPTER_PY:-$PY}"
WORK="${WORK:-/tmp/arl}"
PORT="${PORT:-8790}"
SEARCH_PORT="${SEARCH_PORT:-8791}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p "$WORK"

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT

wait_for() {  # url, log file, pid of the process that should answer
  for _ in $(seq 1 300); do
    if curl -s -o /dev/null "$1"; then return 0; fi
    if ! kill -0 "$3" 2>/dev/null; then break; fi
    sleep 1
  done
  echo "error: nothing answers $1; see $2" >&2
  tail -n 5 "$2" >&2
  exit 1
}

start_server() {  # pytrio-serve arguments...
  [ -s "$WORK/key" ] || "$PY" -c "import secrets; print(secrets.token_urlsafe(24))" > "$WORK/key"
  "$PY" -m trl_grpo_ext.cli pytrio-serve --port "$PORT" --api-key-file "$WORK/key" \
    --storage-dir "$WORK/server-storage" "$@" > "$WORK/server.log" 2>&1 &
  pids+=($!)
  wait_for "http://127.0.0.1:$PORT/" "$WORK/server.log" "$!"
  export PYTRIO_BASE_URL="http://127.0.0.1:$PORT" PYTRIO_API_KEY="$(cat "$WORK/key")"
}

"$PY" "$here/make_data.py" --out "$WORK/data"

case "$what" in
  search-r1)
    if [ ! -f "$WORK/warm-smollm2/config.json" ]; then
      "$CHAPTER_PY" "$here/warmup.py" --chapter-dir "$CHAPTERS/03-search-r1" \
        --data "$WORK/data/search_r1/warmup.jsonl" --out "$WORK/warm-smollm2"
    fi
    "$PY" "$here/search_backend.py" --corpus "$WORK/data/search_r1/corpus.jsonl" --port "$SEARCH_PORT" \
      --cert-dir "$WORK/certs" --log "$WORK/searches.jsonl" > "$WORK/search.log" 2>&1 &
    pids+=($!)
    wait_for "http://127.0.0.1:$SEARCH_PORT/w/api.php?gsrsearch=x" "$WORK/search.log" "$!"
    start_server --model "$WORK/warm-smollm2" --served-name Qwen/Qwen3.5-4B
    : > "$WORK/searches.jsonl"
    cd "$CHAPTERS/03-search-r1"
    https_proxy="http://127.0.0.1:$SEARCH_PORT" SSL_CERT_FILE="$WORK/certs/ca.pem" \
      no_proxy=127.0.0.1,localhost NO_PROXY=127.0.0.1,localhost \
      "$CHAPTER_PY" train.py --max-steps "${STEPS:-3}" --questions-per-batch 2 --group-size 4 --save-every 0 \
      --base-model Qwen/Qwen3.5-4B --lora-rank 8 --search-backend wikipedia --search-concurrency 2 \
      --data "$WORK/data/search_r1/train.jsonl" --max-assistant-turns 3 --max-search-calls 2 \
      --max-assistant-tokens 40 --max-tool-response-tokens 160 --max-trajectory-tokens 1024 \
      --temperature 1.5 --learning-rate 1e-4 --run-name search-r1-local --swanlab-mode disabled
    echo "searches that reached the stand-in: $(wc -l < "$WORK/searches.jsonl") (log: $WORK/searches.jsonl)"
    ;;
  opd)
    TEACHER="${TEACHER:-$WORK/warm-smollm2}"
    if [ "$TEACHER" = embedded ]; then
      # the teacher's name is one more name of the student's base model (served once)
      start_server --model embedded --served-name Qwen/Qwen3.5-4B --served-name Qwen/Qwen3.6-27B
    elif [ -f "$TEACHER/config.json" ]; then
      start_server --model embedded --served-name Qwen/Qwen3.5-4B --model "Qwen/Qwen3.6-27B=$TEACHER"
    else
      echo "error: no model in $TEACHER (the default teacher is the warm-up model: run '$0 search-r1' first)" >&2
      exit 2
    fi
    cd "$CHAPTERS/02-opd/general-opd"
    "$CHAPTER_PY" 01-demo-sync.py --steps 2 --batch-size 2 --group-size 2 --max-tokens 24 --sample-size 4 \
      --lora-rank 8 --dataset-dir "$WORK/data/opd/DeepMath-103K" --no-swanlab
    ;;
  *)
    echo "usage: $0 search-r1|opd" >&2
    exit 2
    ;;
esac
