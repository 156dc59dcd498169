#!/usr/bin/env bash
# LoRA: GRPO on the default task (builtin:reverse, the built-in tiny-reverse model) training rank-16 adapters
# (peft) instead of every weight; the reference is the same model with its adapter disabled (no second copy).
#
#   bash examples/lora.sh                        # 30 steps on CPU
#   bash examples/lora.sh --trainer.steps 5      # any train.py flag may follow
#
# The learning rate defaults to LoRA's (5e-3 for a built-in model, 1e-5 for a pretrained one; the study:
# experiments/README.md, "bench_lora: LoRA vs full fine-tuning"). The run directory's final/ is the merged
# model and final/adapter/ the peft adapter. On a pretrained model add e.g. --model.path Qwen/Qwen2.5-0.5B-Instruct.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
exec "$PYTHON" train.py grpo --model.lora-rank 16 --model.lora-alpha 32 "$@"
