#!/usr/bin/env bash
# lm-evaluation-harness end to end against `tts serve` (issue 29): a loglikelihood task through
# `local-completions` (batches of token id prompts, echo + logprobs, lm-eval's remote tokenizer
# found on vLLM's /tokenize routes) and a generation task through `local-chat-completions`.
# Local data (bench/lm_eval/tasks), no hub. lm-eval is not a dependency of the project:
#
#   pip install "lm-eval[api]==0.4.*"       # or point LM_EVAL_PATH at a --target install
#   bash bench/lm_eval/run.sh [OUT]         # default OUT: bench/results/lm-eval
#
# Writes lm-eval's own layout under OUT/<model>/: results_<time>.json and
# samples_<task>_<time>.jsonl per task, and the two commands' logs beside them.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-bench/results/lm-eval}
PORT=${PORT:-8765}
MODEL=${MODEL:-smollm2-135m}
PY=${PY:-.venv/bin/python}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export PYTHONPATH=${LM_EVAL_PATH:+$LM_EVAL_PATH:}${PYTHONPATH:-}
mkdir -p "$OUT"

"$PY" -m tts_service serve --model "$MODEL" --port "$PORT" > "$OUT/serve.log" 2>&1 &
SERVE=$!
trap 'kill "$SERVE" 2>/dev/null; wait "$SERVE" 2>/dev/null || true' EXIT
for _ in $(seq 1 200); do
    curl -sf -m 2 "http://127.0.0.1:$PORT/healthz" > /dev/null && break
    kill -0 "$SERVE" 2>/dev/null || { cat "$OUT/serve.log"; exit 1; }
    sleep 3
done

BASE="http://127.0.0.1:$PORT/v1"
"$PY" -m lm_eval --model local-completions \
    --model_args "model=$MODEL,base_url=$BASE/completions,num_concurrent=1,max_retries=3" \
    --tasks tts_arith_mc --include_path bench/lm_eval/tasks --batch_size 4 \
    --output_path "$OUT" --log_samples 2>&1 | tee "$OUT/loglikelihood.log" | tail -4
"$PY" -m lm_eval --model local-chat-completions \
    --model_args "model=$MODEL,base_url=$BASE/chat/completions,num_concurrent=4,max_retries=3" \
    --tasks tts_arith_gen --include_path bench/lm_eval/tasks --apply_chat_template \
    --output_path "$OUT" --log_samples 2>&1 | tee "$OUT/generation.log" | tail -4
