#!/usr/bin/env bash
#SBATCH --job-name=rlcore-grpo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.log
# Not yet run on Slurm or a GPU: its torchrun line runs on CPU with gloo (tests/smoke/test_launch_scripts.py).
# GRPO on 2 Slurm nodes x 8 GPUs: one task per node runs torchrun (examples/multinode.sh) with the c10d
# rendezvous on the job's first node, its id the job id. PLACEMENT=split puts the rollout ranks on the
# node torchrun numbers 0 and the trainer ranks on the other.
#
#   TRAIN=rows/train.parquet VAL=rows/test.parquet sbatch examples/slurm_2x8.sh    # colocated
#   TRAIN=... PLACEMENT=split sbatch examples/slurm_2x8.sh --pipeline.push delta
#
# TRAIN (required), VAL and MODEL as in examples/multinode.sh (sbatch passes the environment on).
# Resubmitting the same script resumes from the newest checkpoint (--resume auto). OUT must be on a filesystem
# both nodes mount; RLCORE_CACHE and TMPDIR point at each node's local disk. Ports and interfaces:
# docs/cluster.md. Any train.py flag may follow.
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
: "${TRAIN:?set TRAIN to your training rows (parquet/jsonl files, space-separated) or a generated task}"
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-29400} NNODES=$SLURM_NNODES GPUS=8 RDZV=c10d RDZV_ID=$SLURM_JOB_ID
export OUT=${OUT:-runs/grpo-slurm} RLCORE_CACHE=${RLCORE_CACHE:-/tmp/$(id -un)/rlcore-cache} TMPDIR=${TMPDIR:-/tmp/$(id -un)}
SPLIT=()
if [ "${PLACEMENT:-colocate}" = split ]; then
    SPLIT=(--pipeline.placement split --pipeline.rollout-ranks 8 --pipeline.max-staleness 1)
fi
# one task per node; the launchers take their node ranks from the rendezvous
srun --kill-on-bad-exit=0 bash examples/multinode.sh "${SPLIT[@]}" "$@"
