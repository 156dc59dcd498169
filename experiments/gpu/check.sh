#!/usr/bin/env bash
# One short GPU check (issue 9): the trainer on CUDA with random-init 0.5B- and 1.5B-class models, and the
# native engine vs transformers generate. Prints everything to stdout and copies metrics under $OUT.
#   bash experiments/gpu/check.sh              # on the GPU machine, from the repository root
#   QUICK=1 bash experiments/gpu/check.sh      # tiny shapes on CPU: checks the script itself
# Needs torch with CUDA and rlcore's deps (pip install -e .). Nothing is downloaded.
set -euo pipefail
OUT=${OUT:-$(mktemp -d)}
PY=${PY:-python}
work=$(mktemp -d)
if [ "${QUICK:-0}" = 1 ]; then sizes="tiny"; device=cpu; steps=2; quick=--quick; else sizes="0.5b 1.5b"; device=cuda; steps=4; quick=; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
summary() {  # median step, rollout and update seconds of a run's metrics.jsonl (first step dropped)
    $PY - "$1" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])][1:]  # the first step warms up
med = lambda k: statistics.median(r[k] for r in rows if k in r)
tokens = med("response/length_mean") * 64 * 8
print(f"s/step {med('timing/step_s'):.2f}  rollout s {med('timing/rollout_s'):.2f} "
      f"({tokens / med('timing/rollout_s'):.0f} response tok/s)  update s {med('timing/update_s'):.2f}  "
      f"peak memory MB {max(r.get('perf/max_memory_mb', 0) for r in rows):.0f}")
PYEOF
}
train() {  # size, run name, extra flags
    local size=$1 name=$2; shift 2
    $PY train.py grpo --model.path "$work/$size" --model.dtype bfloat16 --trainer.device "$device" \
        --data.batch-size 64 --rollout.n 8 --rollout.max-tokens 256 --data.max-prompt-length 64 \
        --trainer.steps "$steps" --trainer.val-every 0 --log.no-progress --out-dir "$work/$name" \
        --algo.max-tokens-per-micro-batch 32768 "$@"
    mkdir -p "$OUT/$name" && cp "$work/$name/metrics.jsonl" "$OUT/$name/"
    summary "$work/$name/metrics.jsonl"
}
for size in $sizes; do
    $PY experiments/gpu/make_model.py "$size" "$work/$size"
    echo "== trainer, $size, grpo, 64 prompts x 8 samples x 256 new tokens, bf16"
    train "$size" "run-$size"
done
first=${sizes%% *}
echo "== the same, $first, without shared-prompt packing (--algo.no-share-prompts): does packing pay on this device?"
train "$first" "run-$first-unshared" --algo.no-share-prompts
echo "== exact mode (--rollout.exact, issue 41), $first: rollout/logprob_diff_max per step, 0.0 where this device's"
echo "   GEMMs are batch-invariant (exit 3 stops the run at the first step that is not: the plan is sgemm-bi there)"
$PY train.py grpo --model.path "$work/$first" --model.dtype bfloat16 --trainer.device "$device" --data.batch-size 16 \
    --rollout.n 4 --rollout.max-tokens 64 --trainer.steps 3 --trainer.val-every 0 --log.no-progress \
    --out-dir "$work/exact" --rollout.exact || echo "exact: exit $?"
grep -o '"rollout/logprob_diff_max":[^,}]*' "$work/exact/metrics.jsonl" || echo "exact: no step finished"
if [ "${QUICK:-0}" != 1 ]; then
    echo "== update MFU (0.5B shapes)"
    $PY experiments/gpu/bench_update.py | tee "$OUT/bench_update.txt"
fi
echo "== native engine vs generate"
$PY experiments/bench_rollout.py --device "$device" $quick | tee "$OUT/bench_rollout.txt"
