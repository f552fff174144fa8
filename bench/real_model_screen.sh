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
source bench/real_model_common.sh

recipe() {  # NAME KEY=VALUE ...: eagle3's trainer with these TrainConfig fields, seed 0
    local name=$1; shift
    local sets=(); for kv in "$@"; do sets+=(--eagle3-set "$kv"); done
    train_in_background "${name:-default}" "$TRAIN_S" --seeds 0 --skip-speculators ${name:+--recipe "$name"} "${sets[@]}"
}

prepare_data
train_in_background speculators "$TRAIN_S" --seeds 0 --skip-eagle3
recipe ""                                    # eagle3's defaults (TTT 7, 10 epochs, the head trained)
recipe frozen head=frozen                    # the head left at the target's rows, as speculators leaves it
recipe frozen-t3e20 head=frozen ttt_steps=3 epochs=20
recipe t3e20 ttt_steps=3 epochs=20
wait
say "training done"
timeout "$EVAL_S" python3 -m bench.real_model --stage eval --seeds 0 --ks 3,5,7 --temperatures 0 --max-new-tokens 128 \
    --prompts-per-source 60 --eval-workers 12 "${COMMON[@]}" --results "$LOGS/report.json" > "$LOGS/eval.log" 2>&1
say "evaluation: exit $?"
bench --stage report --seeds 0 --ks 3,5,7 --temperatures 0 --max-new-tokens 128 --prompts-per-source 60 \
    --results "$LOGS/report.json" > "$LOGS/report.log" 2>&1
say "report: exit $? ($LOGS/report.json)"
