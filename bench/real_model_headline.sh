#!/bin/bash
# The headline run of bench/real_model.py on one GPU (bench/README.md, "The real model"): data, then for seeds 0
# and 1 at once eagle3's whole pipeline at its defaults (training, its drafter's rollouts on the training
# prompts, the on-policy refinement: each seed's chain starts its next stage as soon as its own run ends) and
# speculators at its own (training on eagle3's offline shards: it has no on-policy stage), then the speedup
# alone at batch 1 (SPEEDUP=0 skips it), then every drafter decoded, then the report with each side's GPU
# seconds. Each stage skips what an earlier call finished, so the script may be run again after a time limit;
# logs go to .cache/headline/.
#
#   bash bench/real_model_headline.sh [TRAIN_SECONDS] [EVAL_SECONDS]
#   REPLY_TOKENS=256 EVAL_TOKENS=128 bash bench/real_model_headline.sh   # regeneration and decoding budgets
#   ONPOLICY=0 bash ...            # eagle3's offline drafter only (the headline before on-policy refinement)
#   ROLLOUT="temperature=0.7,k=3" bash ...   # --onpolicy-set pairs for the rollouts and the refinement
#   EVAL_RUNS=eagle3-onpolicy-0,speculators-0 bash ...   # decode only these drafters (default every one)
#   TARGET_STEP=eager bash bench/real_model_headline.sh   # the evaluation's target step (default auto: graphed on a GPU)
#   EVAL_KS=3,5 EVAL_TEMPERATURES=0 EVAL_PROMPTS=100 bash bench/real_model_headline.sh   # a smaller evaluation
#   EVAL_BATCH=1 EVAL_WORKERS=12 bash ...   # one prompt at a time (default: 64 at once, evaluate/batched.py)
#   RESULTS=.cache/headline/report.json bash ...   # the report elsewhere than bench/results/real_model_<device>.json
#   SPECULATORS_LOSS=eager bash ...   # speculators' loss unfused from the start (its fused loss fails under torch 2.11)
#   REGEN_STEP=batched bash ...       # regenerate.step (default eagle3's)
#   SEEDS=0 bash ...                  # the seeds run (default "0 1")
#   CHITCHAT_ROWS=3200 bash ...       # a smaller run: the first 3,200 chitchat rows
#   BESIDE_TRAINING="python3 -m bench.al_selection --device cuda" bash ...   # another job while the runs train,
#                                                  # waited for before the speedup is timed alone on the GPU
set -u
cd "$(dirname "$0")/.."
TRAIN_S=${1:-600}
EVAL_S=${2:-480}
LOGS=.cache/headline
source bench/real_model_common.sh
COMMON+=(--max-new-tokens "${EVAL_TOKENS:-128}")

[ -n "${REGEN_STEP:-}" ] && COMMON+=(--regen-step "$REGEN_STEP")
[ -n "${CHITCHAT_ROWS:-}" ] && COMMON+=(--chitchat-rows "$CHITCHAT_ROWS")
mapfile -t ROLLOUT_FLAGS < <(IFS=,; for pair in ${ROLLOUT:-}; do printf -- '--onpolicy-set\n%s\n' "$pair"; done)

eagle3_chain() {  # SEED: eagle3's pipeline for one seed, each stage as soon as the one before it ended
    local seed=$1
    timeout "$TRAIN_S" python3 -m bench.real_model --stage train --seeds "$seed" --skip-speculators "${COMMON[@]}" \
        > "$LOGS/train-eagle3-$seed.log" 2>&1
    say "eagle3-$seed: exit $?"
    [ "${ONPOLICY:-1}" = 0 ] && return
    bench --stage onpolicy --prepare --seeds "$seed" "${ROLLOUT_FLAGS[@]}" > "$LOGS/rollout-$seed.log" 2>&1
    say "rollouts $seed: exit $?"
    timeout "$TRAIN_S" python3 -m bench.real_model --stage onpolicy --seeds "$seed" "${ROLLOUT_FLAGS[@]}" \
        --skip-speculators "${COMMON[@]}" > "$LOGS/onpolicy-$seed.log" 2>&1
    say "onpolicy $seed: exit $?"
}

prepare_data
for seed in ${SEEDS:-0 1}; do
    eagle3_chain "$seed" &
    train_in_background "speculators-$seed" "$TRAIN_S" --seeds "$seed" --skip-eagle3 \
        ${SPECULATORS_LOSS:+--speculators-loss "$SPECULATORS_LOSS"}
done
if [ -n "${BESIDE_TRAINING:-}" ]; then
    (bash -c "$BESIDE_TRAINING" > "$LOGS/beside-training.log" 2>&1; say "beside training: exit $?") &
fi
wait
if [ "${SPEEDUP:-1}" != 0 ]; then
    bench --stage speedup --seeds 0 --ks 1,3,5,7 --speedup-prompts 16 > "$LOGS/speedup.log" 2>&1; say "speedup: exit $?"
fi
EVAL=(--seeds "$(echo ${SEEDS:-0 1} | tr " " ,)" --ks "${EVAL_KS:-1,3,5,7}" --temperatures "${EVAL_TEMPERATURES:-0,0.7}"
      --prompts-per-source "${EVAL_PROMPTS:-100}" ${RESULTS:+--results "$RESULTS"} ${EVAL_RUNS:+--eval-runs "$EVAL_RUNS"})
timeout "$EVAL_S" python3 -m bench.real_model --stage eval "${EVAL[@]}" --eval-batch "${EVAL_BATCH:-64}" ${EVAL_WORKERS:+--eval-workers "$EVAL_WORKERS"} \
    --target-step "${TARGET_STEP:-auto}" "${COMMON[@]}" \
    > "$LOGS/eval.log" 2>&1 && say "evaluation and report: done (bench/results/real_model_*.json)" || {
    say "evaluation cut short: reporting what the workers finished"
    bench --stage report "${EVAL[@]}" > "$LOGS/report.log" 2>&1; say "report: exit $?"; }
