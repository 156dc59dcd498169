#!/usr/bin/env bash
# GRPO on the 8 GPUs of one machine: torchrun starts 8 ranks of train.py (SPMD: every rank runs the same
# script), FSDP2 shards the policy over them and each rank samples its own share of the prompts.
#
#   .venv/bin/python examples/gsm8k_grpo.py --gsm8k data/gsm8k/main --convert-only   # the rows, once
#   bash examples/torchrun_8gpu.sh                                  # Qwen2.5-0.5B-Instruct on GSM8K
#   MODEL=Qwen/Qwen2.5-7B-Instruct bash examples/torchrun_8gpu.sh --trainer.tp 2 --rollout.engine vllm
#
# Any train.py flag may follow (it wins over the ones below). --data.batch-size must be a multiple of the
# data-parallel size (8 ranks / --trainer.tp / --trainer.sp). --trainer.tp 2 splits each layer over
# neighbouring GPU pairs (4 data-parallel x 2 tensor-parallel); --rollout.engine vllm samples with vLLM
# (pip install vllm) instead of the native engine. Checkpoints every 50 steps; rerun the same command to
# resume from the newest one (--resume auto is the default).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
TRAIN=${TRAIN:-data/gsm8k_rows/train.parquet}
VAL=${VAL:-data/gsm8k_rows/test.parquet}
OUT=${OUT:-runs/gsm8k-8gpu}
TORCHRUN=${TORCHRUN:-$([ -x .venv/bin/torchrun ] && echo .venv/bin/torchrun || echo torchrun)}
exec "$TORCHRUN" --standalone --nproc_per_node=8 train.py grpo \
    --model.path "$MODEL" --data.train-files "$TRAIN" --data.val-files "$VAL" \
    --data.batch-size 64 --rollout.n 8 --rollout.max-tokens 512 --reward.num-workers 4 \
    --trainer.steps 300 --trainer.val-every 25 --trainer.save-every 50 --out-dir "$OUT" "$@"
