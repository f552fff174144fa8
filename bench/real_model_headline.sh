#!/bin/bash
# The headline run of bench/real_model.py on one GPU (bench/README.md, "The real model"): data, eagle3 at its
# defaults and speculators at its own for seeds 0 and 1 (one process per trainer and seed, all at once: each
# pair shares the GPU alike), the speedup alone at batch 1, then every drafter decoded, then the report. Each
# stage skips what an earlier call finished, so the script may be run again after a time limit; logs go to
# .cache/headline/. One lease of the GPU host holds about 26 minutes: the sizes below are chosen to fit it.
#
#   bash bench/real_model_headline.sh [TRAIN_SECONDS] [EVAL_SECONDS]
#   REPLY_TOKENS=256 EVAL_TOKENS=128 bash bench/real_model_headline.sh   # regeneration and decoding budgets
#   TARGET_STEP=eager bash bench/real_model_headline.sh   # the evaluation's target step (default auto: graphed on a GPU)
#   EVAL_KS=3,5 EVAL_TEMPERATURES=0 EVAL_PROMPTS=100 bash bench/real_model_headline.sh   # a smaller evaluation
#   EVAL_BATCH=1 EVAL_WORKERS=12 bash ...   # one prompt at a time (default: 64 at once, evaluate/batched.py)
#   RESULTS=.cache/headline/report.json bash ...   # the report elsewhere than bench/results/real_model_<device>.json
#   SPECULATORS_LOSS=eager bash ...   # speculators' loss unfused from the start (its fused loss fails under torch 2.11)
#   BESIDE_TRAINING="python3 -m bench.al_selection --device cuda" bash ...   # another job while the runs train,
#                                                  # waited for before the speedup is timed alone on the GPU
set -u
cd "$(dirname "$0")/.."
TRAIN_S=${1:-600}
EVAL_S=${2:-480}
LOGS=.cache/headline
source bench/real_model_common.sh
COMMON+=(--max-new-tokens "${EVAL_TOKENS:-128}")

prepare_data
for seed in 0 1; do
    train_in_background "eagle3-$seed" "$TRAIN_S" --seeds "$seed" --skip-speculators
    train_in_background "speculators-$seed" "$TRAIN_S" --seeds "$seed" --skip-eagle3 \
        ${SPECULATORS_LOSS:+--speculators-loss "$SPECULATORS_LOSS"}
done
if [ -n "${BESIDE_TRAINING:-}" ]; then
    (bash -c "$BESIDE_TRAINING" > "$LOGS/beside-training.log" 2>&1; say "beside training: exit $?") &
fi
wait
bench --stage speedup --seeds 0 --ks 1,3,5,7 --speedup-prompts 16 > "$LOGS/speedup.log" 2>&1; say "speedup: exit $?"
EVAL=(--seeds 0,1 --ks "${EVAL_KS:-1,3,5,7}" --temperatures "${EVAL_TEMPERATURES:-0,0.7}"
      --prompts-per-source "${EVAL_PROMPTS:-100}" ${RESULTS:+--results "$RESULTS"})
timeout "$EVAL_S" python3 -m bench.real_model --stage eval "${EVAL[@]}" --eval-batch "${EVAL_BATCH:-64}" ${EVAL_WORKERS:+--eval-workers "$EVAL_WORKERS"} \
    --target-step "${TARGET_STEP:-auto}" "${COMMON[@]}" \
    > "$LOGS/eval.log" 2>&1 && say "evaluation and report: done (bench/results/real_model_*.json)" || {
    say "evaluation cut short: reporting what the workers finished"
    bench --stage report "${EVAL[@]}" > "$LOGS/report.log" 2>&1; say "report: exit $?"; }
