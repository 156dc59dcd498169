#!/usr/bin/env bash
# Not yet run on a GPU: on CPU with gloo it runs (tests/smoke/test_launch_scripts.py), on GPUs nothing has shown it.
# GRPO on the 8 GPUs of one machine: torchrun starts 8 ranks of train.py (SPMD: every rank runs the same
# script), FSDP2 shards the policy over them and each rank samples its own share of the prompts.
#
#   .venv/bin/python examples/gsm8k_grpo.py --convert-only           # GSM8K as verl's rows, once
#   TRAIN=data/gsm8k_rows/train.parquet VAL=data/gsm8k_rows/test.parquet bash examples/torchrun_8gpu.sh
#   TRAIN=... MODEL=Qwen/Qwen2.5-7B-Instruct bash examples/torchrun_8gpu.sh --trainer.tp 2
#
# TRAIN (required): training rows (parquet/jsonl, verl's format; several: space-separated) or a generated
# task; VAL: held-out rows (unset: validation off, said at start); MODEL: a Hugging Face directory or hub id
# (Qwen/Qwen2.5-0.5B-Instruct).
# GPUS: ranks (8). Any train.py flag may follow (it wins over the ones below). --data.batch-size must be a
# multiple of the data-parallel size (8 ranks / --trainer.tp / --trainer.sp). --trainer.tp 2 splits each layer
# over neighbouring GPU pairs (4 data-parallel x 2 tensor-parallel); --rollout.engine vllm samples with vLLM
# (pip install vllm) instead of the native engine (README's model table says which families it has run
# with). Checkpoints every 50 steps; rerun the same command to resume from the newest one (--resume auto).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
GPUS=${GPUS:-8}
read -r -a DATA <<< "${TRAIN:?set TRAIN to your training rows (parquet/jsonl files, space-separated) or a generated task}"
DATA=(--data.train-files "${DATA[@]}")
[ -z "${VAL:-}" ] || { read -r -a HELD <<< "$VAL" && DATA+=(--data.val-files "${HELD[@]}"); }
OUT=${OUT:-runs/gsm8k-8gpu}
TORCHRUN=${TORCHRUN:-$([ -x .venv/bin/torchrun ] && echo .venv/bin/torchrun || echo torchrun)}
exec "$TORCHRUN" --standalone --nproc_per_node="$GPUS" train.py grpo \
    --model.path "$MODEL" "${DATA[@]}" \
    --data.batch-size 64 --rollout.n 8 --rollout.max-tokens 512 --reward.num-workers 4 \
    --trainer.steps 300 --trainer.val-every 25 --trainer.save-every 50 --out-dir "$OUT" "$@"
