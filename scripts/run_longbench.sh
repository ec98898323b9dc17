#!/usr/bin/env bash
# Run the standard LongBench suite (v1: 21 tasks, LongBench-E: 13 tasks, v2) through minimax-m3, offline.
#
#   trn2.48xlarge (NxDI):  BACKEND=neuron    MODEL=/path/to/checkpoint ENGINE_OPTS="--batch 8" scripts/run_longbench.sh
#   GPU (reference torch): BACKEND=reference MODEL=/path/to/checkpoint DEVICE=cuda  scripts/run_longbench.sh
#
# ENGINE_OPTS takes the engine options every minimax-m3 command shares (README, "Engine spec"): --tp, --ep, --lnc,
# --batch, --context-buckets, --token-buckets, --compiled DIR, ... With the same options as `minimax-m3 compile`
# (and MAX_SEQ_LEN as its --seq-len), the neuron backend loads the NEFFs that compile wrote.
#
# Needs a THUDM/LongBench checkout (LONGBENCH_DIR, for config/dataset2prompt.json, dataset2maxlen.json and
# prompts/0shot.txt) and the data downloaded once beforehand: v1 data.zip unzipped to $LONGBENCH_DIR/LongBench/data,
# v2 data.json in $V2_DATA. Nothing is fetched at run time. Re-running the same command resumes.
set -euo pipefail

: "${MODEL:?set MODEL to the checkpoint (or compiled model) directory}"
: "${LONGBENCH_DIR:?set LONGBENCH_DIR to a checkout of github.com/THUDM/LongBench}"
BACKEND="${BACKEND:-neuron}"
DATA="${DATA:-$LONGBENCH_DIR/LongBench/data}"
V2_DATA="${V2_DATA:-$LONGBENCH_DIR/data}"
OUT="${OUT:-longbench_out/$(basename "$MODEL")-$BACKEND}"
MAX_SEQ_LEN="${MAX_SEQ_LEN:-32768}"            # engine context: prompt + generated ids
MAX_INPUT_TOKENS="${MAX_INPUT_TOKENS:-31500}"  # pred.py's max_length for a 32k model (v1/E)
V2_MAX_INPUT_TOKENS="${V2_MAX_INPUT_TOKENS:-$((MAX_SEQ_LEN - 640))}"  # v2: 128 new ids + chat wrapper
BATCH_SIZE="${BATCH_SIZE:-1}"  # prompts handed to the engine per call: match the engine's --batch to fill its slots
SUITES="${SUITES:-v1 e v2}"
LIMIT_ARGS=()
[[ -n "${LIMIT:-}" ]] && LIMIT_ARGS=(--limit "$LIMIT")
ENGINE_ARGS=(--backend "$BACKEND" --model "$MODEL" --max-seq-len "$MAX_SEQ_LEN")
[[ -n "${TOKENIZER:-}" ]] && ENGINE_ARGS+=(--tokenizer "$TOKENIZER")
[[ "$BACKEND" == "reference" ]] && ENGINE_ARGS+=(--device "${DEVICE:-cuda}")
[[ -n "${DTYPE:-}" ]] && ENGINE_ARGS+=(--dtype "$DTYPE")   # default: bf16 on neuron and CUDA
read -r -a EXTRA <<< "${ENGINE_OPTS:-}"
ENGINE_ARGS+=("${EXTRA[@]}")

export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

run() {  # run <tasks> <data dir> <out subdir> <max input tokens>
  minimax-m3 longbench "${ENGINE_ARGS[@]}" --data "$2" --longbench-dir "$LONGBENCH_DIR" --tasks "$1" \
    --out "$OUT/$3" --batch-size "$BATCH_SIZE" --max-input-tokens "$4" "${LIMIT_ARGS[@]}"
}

for suite in $SUITES; do
  case "$suite" in
    v1) run all "$DATA" v1 "$MAX_INPUT_TOKENS" ;;
    e)  run e "$DATA" e "$MAX_INPUT_TOKENS" ;;
    v2) run v2 "$V2_DATA" v2 "$V2_MAX_INPUT_TOKENS" ;;
    *)  echo "unknown suite '$suite' in SUITES (use v1, e, v2)" >&2; exit 2 ;;
  esac
done
echo "reports: $OUT/{v1,e,v2}/report.md"
