#!/bin/bash
# Recipe screening on the real model, on one GPU, in one go (bench/README.md, "The real model"):
# the data stage of bench/real_model.py, then several eagle3 recipes and speculators at its defaults trained
# at once (one process each: a 1-layer drafter of a 135M target leaves the GPU mostly idle), then every
# drafter decoded. Each stage skips what an earlier call finished; logs go to .cache/screen/.
#
#   bash bench/real_model_screen.sh [TRAIN_SECONDS] [EVAL_SECONDS]   # how long training and evaluation may take
#
# Add a recipe with a `recipe NAME KEY=VALUE ...` line below; its runs are named eagle3-NAME-<seed>.
set -u
cd "$(dirname "$0")/.."
TRAIN_S=${1:-600}
EVAL_S=${2:-400}
LOGS=.cache/screen
mkdir -p "$LOGS"
say() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOGS/driver.log"; }
DATA=(--regen-batch 512 --regen-max-new-tokens 256 --shard-size 512 --regen-kv-cache dynamic --end-of-turn "<|im_end|>")
bench() { python3 -m bench.real_model "$@" "${DATA[@]}"; }

bench --stage data > "$LOGS/data.log" 2>&1 || { say "data failed: $LOGS/data.log"; exit 2; }
bench --stage train --prepare > "$LOGS/prepare.log" 2>&1 || { say "vocabulary or speculators' data failed"; exit 2; }
say "data and vocabulary ready"

recipe() {  # NAME KEY=VALUE ...: eagle3's trainer with these TrainConfig fields, seed 0, in the background
    local name=$1; shift
    local sets=(); for kv in "$@"; do sets+=(--eagle3-set "$kv"); done
    (timeout "$TRAIN_S" python3 -m bench.real_model --stage train --seeds 0 --skip-speculators \
        ${name:+--recipe "$name"} "${sets[@]}" "${DATA[@]}" > "$LOGS/train-${name:-default}.log" 2>&1
     say "eagle3 ${name:-default}: exit $?") &
}
speculators() {  # its defaults; its fused loss failed to compile under torch 2.11 once: then the same loss unfused
    (timeout "$TRAIN_S" python3 -m bench.real_model --stage train --seeds 0 --skip-eagle3 "${DATA[@]}" \
        > "$LOGS/train-speculators.log" 2>&1 && say "speculators: exit 0" || {
        say "speculators (fused loss) failed: $(grep -m1 -o 'AssertionError.*' "$LOGS/train-speculators.log" | cut -c1-120); retrying unfused"
        timeout "$TRAIN_S" python3 -m bench.real_model --stage train --seeds 0 --skip-eagle3 --speculators-loss eager \
            "${DATA[@]}" > "$LOGS/train-speculators-eager.log" 2>&1; say "speculators (eager loss): exit $?"; }) &
}

speculators
recipe ""                                    # eagle3's defaults
recipe spec optimizer=muon lr=1e-3 schedule=linear ttt_steps=3 epochs=20 batch_tokens=8192
recipe t7e20 ttt_steps=7 epochs=20
recipe lr2e3 lr=2e-3
wait
say "training done"
timeout "$EVAL_S" python3 -m bench.real_model --stage eval --seeds 0 --ks 3,5 --temperatures 0 --max-new-tokens 128 \
    --prompts-per-source 42 --eval-workers 14 "${DATA[@]}" --results "$LOGS/report.json" > "$LOGS/eval.log" 2>&1
say "evaluation: exit $?"
bench --stage report --seeds 0 --ks 3,5 --temperatures 0 --max-new-tokens 128 --prompts-per-source 42 \
    --results "$LOGS/report.json" > "$LOGS/report.log" 2>&1
say "report: exit $? ($LOGS/report.json)"
