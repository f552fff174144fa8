#!/bin/bash
# Recipe screening on the real model, on one GPU, in one go (bench/README.md, "The real model"):
# the data stage of bench/real_model.py, a copy of the store converted to FP8 shards, then speculators at its
# defaults, eagle3 at its defaults (on the bf16 shards and on the FP8 ones) and candidate recipes, all trained
# at once (one process each: a 1-layer drafter of a 135M target leaves the GPU mostly idle), then every
# drafter decoded on the same prompts. Each stage skips what an earlier call finished; logs go to .cache/screen/.
#
#   bash bench/real_model_screen.sh [TRAIN_SECONDS] [EVAL_SECONDS]   # how long training and evaluation may take
#
# Add a recipe with a `recipe NAME SEEDS KEY=VALUE ...` line below; its runs are named eagle3-NAME-<seed>, and
# the report pairs each with speculators' run and with eagle3's defaults of its seed.
set -u
cd "$(dirname "$0")/.."
TRAIN_S=${1:-900}
EVAL_S=${2:-420}
LOGS=.cache/screen
source bench/real_model_common.sh
COMMON+=(--max-new-tokens "${EVAL_TOKENS:-128}")

recipe() {  # NAME SEEDS KEY=VALUE ...: eagle3's trainer with these TrainConfig fields, a process per seed
    local name=$1 seeds=$2; shift 2
    local sets=(); for kv in "$@"; do sets+=(--eagle3-set "$kv"); done
    for seed in ${seeds//,/ }; do
        train_in_background "$name-$seed" "$TRAIN_S" --seeds "$seed" --skip-speculators --recipe "$name" "${sets[@]}"
    done
}

prepare_data
bench --stage train --prepare --skip-speculators --store-dtype fp8_e4m3 > "$LOGS/prepare-fp8.log" 2>&1 \
    && say "FP8 copy of the store ready" || say "FP8 conversion failed: $LOGS/prepare-fp8.log"
for seed in 0 1; do
    train_in_background "speculators-$seed" "$TRAIN_S" --seeds "$seed" --skip-eagle3
    train_in_background "eagle3-$seed" "$TRAIN_S" --seeds "$seed" --skip-speculators   # the defaults
    train_in_background "fp8-$seed" "$TRAIN_S" --seeds "$seed" --skip-speculators --recipe fp8 \
        --store-dtype fp8_e4m3                                                          # the same on FP8 shards
done
recipe t3e20 "${T3E20_SEEDS:-0}" ttt_steps=3 epochs=20  # speculators' depth and length
wait
say "training done"
timeout "$EVAL_S" python3 -m bench.real_model --stage eval --seeds 0,1 --ks "${EVAL_KS:-3,5}" --temperatures 0 \
    --prompts-per-source "${EVAL_PROMPTS:-40}" --eval-batch "${EVAL_BATCH:-64}" ${EVAL_WORKERS:+--eval-workers "$EVAL_WORKERS"} "${COMMON[@]}" \
    --results "$LOGS/report.json" > "$LOGS/eval.log" 2>&1
say "evaluation: exit $?"
bench --stage report --seeds 0,1 --ks "${EVAL_KS:-3,5}" --temperatures 0 --results "$LOGS/report.json" \
    > "$LOGS/report.log" 2>&1
say "report: exit $? ($LOGS/report.json)"
