#!/bin/bash
# The headline run of bench/real_model.py on one GPU (bench/README.md, "The real model"): data, eagle3 at its
# defaults and speculators at its own for seeds 0 and 1 (one process per trainer and seed, all at once: each
# pair shares the GPU alike), the speedup alone at batch 1, then every drafter decoded, then the report. Each
# stage skips what an earlier call finished, so the script may be run again after a time limit; logs go to
# .cache/headline/. One lease of the GPU host holds about 26 minutes: the sizes below are chosen to fit it.
#
#   bash bench/real_model_headline.sh [TRAIN_SECONDS] [EVAL_SECONDS]
#   REPLY_TOKENS=256 EVAL_TOKENS=128 bash bench/real_model_headline.sh   # regeneration and decoding budgets
set -u
cd "$(dirname "$0")/.."
TRAIN_S=${1:-600}
EVAL_S=${2:-480}
LOGS=.cache/headline
mkdir -p "$LOGS"
say() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOGS/driver.log"; }
COMMON=(--regen-batch 512 --regen-max-new-tokens "${REPLY_TOKENS:-256}" --shard-size 512 --regen-kv-cache dynamic
        --end-of-turn "<|im_end|>" --max-new-tokens "${EVAL_TOKENS:-128}")
bench() { python3 -m bench.real_model "$@" "${COMMON[@]}"; }
train() {  # TRAINER SEED [FLAGS...]: one trainer's run of one seed, in the background
    local trainer=$1 seed=$2; shift 2
    local skip=--skip-speculators; [ "$trainer" = speculators ] && skip=--skip-eagle3
    (timeout "$TRAIN_S" python3 -m bench.real_model --stage train --seeds "$seed" $skip "$@" "${COMMON[@]}" \
        > "$LOGS/train-$trainer-$seed.log" 2>&1
     rc=$?
     if [ $rc -ne 0 ] && [ "$trainer" = speculators ] && grep -q "already tracked for mutation" "$LOGS/train-$trainer-$seed.log"; then
         say "speculators $seed: its fused loss failed to compile; again unfused"
         timeout "$TRAIN_S" python3 -m bench.real_model --stage train --seeds "$seed" $skip --speculators-loss eager \
             "${COMMON[@]}" > "$LOGS/train-$trainer-$seed-eager.log" 2>&1; rc=$?
     fi
     say "$trainer $seed: exit $rc") &
}

bench --stage data > "$LOGS/data.log" 2>&1 || { say "data failed: $LOGS/data.log"; exit 2; }
bench --stage train --prepare > "$LOGS/prepare.log" 2>&1 || { say "vocabulary or speculators' data failed"; exit 2; }
say "data, vocabulary and speculators' dataset ready"
for seed in 0 1; do train eagle3 "$seed"; train speculators "$seed"; done
wait
bench --stage speedup --seeds 0 --ks 1,3,5,7 --speedup-prompts 16 > "$LOGS/speedup.log" 2>&1; say "speedup: exit $?"
timeout "$EVAL_S" python3 -m bench.real_model --stage eval --seeds 0,1 --eval-workers 12 "${COMMON[@]}" \
    > "$LOGS/eval.log" 2>&1 && say "evaluation and report: done (bench/results/real_model_*.json)" || {
    say "evaluation cut short: reporting what the workers finished"
    bench --stage report --seeds 0,1 > "$LOGS/report.log" 2>&1; say "report: exit $?"; }
