#!/bin/bash
# On-policy refinement and the training levers on the real model, in one lease (bench/README.md, "On-policy
# refinement"): the data stage, eagle3 at its defaults (seed 0) beside each lever recipe (LEVERS, trained at
# once), the defaults' drafter rolled out on the training prompts, then the refinement recipes (ONPOLICY) and
# their control (the same continued training without records) trained at once, then every drafter decoded and
# paired with the defaults on the held-out chitchat, TruthfulQA and MT-Bench prompts. Each stage skips what an
# earlier call finished; logs go to .cache/onpolicy/.
#
#   bash bench/real_model_onpolicy.sh [TRAIN_SECONDS] [EVAL_SECONDS]
#   LEVERS="lk:loss=lk_hybrid topk10:teacher_top_k=10" bash ...   # NAME:KEY=VALUE[,KEY=VALUE] recipes of eagle3
#   ONPOLICY="defaults: ew4:loss.error_weight=4" bash ...           # NAME:KEY=VALUE[,...] OnPolicyConfig recipes
#   ROLLOUT="temperature=0.7,k=3" bash ...                          # the rollouts every refinement shares
#   EVAL_KS=3,5 EVAL_TEMPERATURES=0,0.7 EVAL_PROMPTS=100 RESULTS=bench/results/x.json bash ...
#   CHITCHAT_ROWS=3200 REGEN_STEP=batched LEVERS= bash ...          # a smaller screen; no lever recipes
set -u
cd "$(dirname "$0")/.."
TRAIN_S=${1:-900}
EVAL_S=${2:-600}
LOGS=.cache/onpolicy
source bench/real_model_common.sh
COMMON+=(--max-new-tokens "${EVAL_TOKENS:-128}" --seeds 0 --skip-speculators)
[ -n "${REGEN_STEP:-}" ] && COMMON+=(--regen-step "$REGEN_STEP")
[ -n "${CHITCHAT_ROWS:-}" ] && COMMON+=(--chitchat-rows "$CHITCHAT_ROWS")

sets() {  # "a=1,b=2" -> --FLAG a=1 --FLAG b=2
    local flag=$1 pairs=$2
    local IFS=,
    for pair in $pairs; do [ -n "$pair" ] && printf '%s\n%s\n' "$flag" "$pair"; done
}

prepare_data
train_in_background "eagle3-0" "$TRAIN_S"
for lever in ${LEVERS-"lk:loss=lk_hybrid" "topk10:teacher_top_k=10"}; do
    mapfile -t flags < <(sets --eagle3-set "${lever#*:}")
    train_in_background "$lever" "$TRAIN_S" --recipe "${lever%%:*}" "${flags[@]}"
done
wait
mapfile -t rollout < <(sets --onpolicy-set "${ROLLOUT:-temperature=0.7,k=3}")
bench --stage onpolicy --prepare "${rollout[@]}" > "$LOGS/rollout.log" 2>&1; say "rollouts: exit $?"
for recipe in ${ONPOLICY:-"defaults:" "ew4:loss.error_weight=4" "visited:loss.positions=visited"}; do
    mapfile -t flags < <(sets --onpolicy-set "${recipe#*:}")
    name=${recipe%%:*}
    (timeout "$TRAIN_S" python3 -m bench.real_model --stage onpolicy "${rollout[@]}" "${flags[@]}" \
        $([ "$name" != defaults ] && echo --recipe "$name") "${COMMON[@]}" > "$LOGS/onpolicy-$name.log" 2>&1
     say "onpolicy $name: exit $?") &
done
(timeout "$TRAIN_S" python3 -m bench.real_model --stage onpolicy --no-records "${rollout[@]}" "${COMMON[@]}" \
    > "$LOGS/onpolicy-control.log" 2>&1; say "onpolicy control: exit $?") &
wait
EVAL=(--ks "${EVAL_KS:-3,5}" --temperatures "${EVAL_TEMPERATURES:-0,0.7}" --prompts-per-source "${EVAL_PROMPTS:-100}"
      --results "${RESULTS:-bench/results/real_model_onpolicy.json}")
timeout "$EVAL_S" python3 -m bench.real_model --stage eval "${EVAL[@]}" --eval-batch "${EVAL_BATCH:-64}" \
    --eval-workers "${EVAL_WORKERS:-4}" "${COMMON[@]}" > "$LOGS/eval.log" 2>&1 && say "evaluation and report: done" || {
    say "evaluation cut short: reporting what the workers finished"
    bench --stage report "${EVAL[@]}" > "$LOGS/report.log" 2>&1; say "report: exit $?"; }
