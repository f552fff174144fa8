# Sourced by bench/real_model_{screen,headline}.sh (set LOGS first): the log, the data settings both use, the
# data stage, and one training run in the background, run again with speculators' loss unfused if its fused
# loss fails to compile (as under torch 2.11 on the H200 host).
mkdir -p "$LOGS"
say() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOGS/driver.log"; }
COMMON=(--regen-batch 512 --regen-max-new-tokens "${REPLY_TOKENS:-256}" --shard-size 512 --regen-kv-cache dynamic
        --end-of-turn "<|im_end|>")
bench() { python3 -m bench.real_model "$@" "${COMMON[@]}"; }

prepare_data() {  # the data stage, then the vocabulary and speculators' dataset that runs started at once share
    bench --stage data > "$LOGS/data.log" 2>&1 || { say "data failed: $LOGS/data.log"; exit 2; }
    bench --stage train --prepare > "$LOGS/prepare.log" 2>&1 || { say "vocabulary or speculators' data failed"; exit 2; }
    say "data, vocabulary and speculators' dataset ready"
}

train_in_background() {  # LABEL SECONDS FLAGS...: `--stage train FLAGS`, logged to train-LABEL.log
    local label=$1 seconds=$2; shift 2
    (timeout "$seconds" python3 -m bench.real_model --stage train "$@" "${COMMON[@]}" > "$LOGS/train-$label.log" 2>&1
     rc=$?
     if [ $rc -ne 0 ] && grep -q "already tracked for mutation" "$LOGS/train-$label.log"; then
         say "$label: speculators' fused loss failed to compile; again unfused"
         timeout "$seconds" python3 -m bench.real_model --stage train "$@" --speculators-loss eager "${COMMON[@]}" \
             > "$LOGS/train-$label-eager.log" 2>&1
         rc=$?
     fi
     say "$label: exit $rc") &
}
