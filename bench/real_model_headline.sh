#!/bin/bash
# The headline run of bench/real_model.py on one GPU (bench/README.md, "The real model"): data, eagle3 at its
# defaults and speculators at its own for seeds 0 and 1 (eagle3's runs in one process, speculators' in another,
# at once), the speedup alone at batch 1, then every drafter decoded, then the report. Each stage skips what an
# earlier call finished, so the script may be run again after a time limit; logs go to .cache/headline/.
#
#   bash bench/real_model_headline.sh [TRAIN_SECONDS] [EVAL_SECONDS]
set -u
cd "$(dirname "$0")/.."
TRAIN_S=${1:-900}
EVAL_S=${2:-600}
LOGS=.cache/headline
mkdir -p "$LOGS"
say() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOGS/driver.log"; }
COMMON=(--regen-batch 512 --regen-max-new-tokens 256 --shard-size 512 --regen-kv-cache dynamic --end-of-turn "<|im_end|>" --seeds 0,1)
bench() { python3 -m bench.real_model "$@" "${COMMON[@]}"; }

bench --stage data > "$LOGS/data.log" 2>&1 || { say "data failed: $LOGS/data.log"; exit 2; }
bench --stage train --skip-eagle3 --skip-speculators > "$LOGS/vocab.log" 2>&1 || { say "vocabulary failed"; exit 2; }
say "data and vocabulary ready"
(timeout "$TRAIN_S" python3 -m bench.real_model --stage train --skip-speculators "${COMMON[@]}" > "$LOGS/train-eagle3.log" 2>&1
 say "eagle3 training: exit $?") &
(timeout "$TRAIN_S" python3 -m bench.real_model --stage train --skip-eagle3 "${COMMON[@]}" > "$LOGS/train-speculators.log" 2>&1 ||
 timeout "$TRAIN_S" python3 -m bench.real_model --stage train --skip-eagle3 --speculators-loss eager "${COMMON[@]}" \
     > "$LOGS/train-speculators-eager.log" 2>&1
 say "speculators training: exit $?") &
wait
bench --stage speedup --ks 1,3,5,7 --max-new-tokens 256 > "$LOGS/speedup.log" 2>&1; say "speedup: exit $?"
timeout "$EVAL_S" python3 -m bench.real_model --stage eval --eval-workers 8 "${COMMON[@]}" > "$LOGS/eval.log" 2>&1 &&
    say "evaluation and report: done (bench/results/real_model_*.json)" || {
    say "evaluation cut short: reporting what the workers finished"
    bench --stage report > "$LOGS/report.log" 2>&1; say "report: exit $?"; }
