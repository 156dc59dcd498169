#!/usr/bin/env bash
# Not yet run on a GPU: on CPU with gloo it runs (tests/smoke/test_launch_scripts.py), on GPUs nothing has shown it.
# GRPO across nodes with plain torchrun: run this same command on every node. Two nodes of 8 GPUs by default.
#
#   TRAIN=rows/train.parquet VAL=rows/test.parquet RDZV=c10d MASTER_ADDR=10.0.0.1 RDZV_ID=job-7 bash examples/multinode.sh
#   TRAIN=... NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/multinode.sh       # static: on node 0
#   TRAIN=... NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash examples/multinode.sh       # static: on node 1
#   TRAIN=... NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/multinode.sh --pipeline.placement split --pipeline.rollout-ranks 8
#
# TRAIN (required): your training rows (parquet/jsonl, verl's format) or generated tasks; VAL: held-out rows
# (unset: validation off, said at start); MODEL: a Hugging Face directory or hub id (Qwen/Qwen2.5-7B-Instruct).
# The native engine samples; `--rollout.engine vllm` after the command switches to vLLM (README's model table
# says which families it has run with). RDZV=static (the default) is the static rendezvous on
# MASTER_ADDR:MASTER_PORT (NODE_RANK 0 there); RDZV=c10d is torchrun's c10d rendezvous at MASTER_ADDR:MASTER_PORT
# with the id RDZV_ID, and the launchers take their node ranks themselves (docs/cluster.md). --max-restarts 1:
# a lost rank restarts the world, which resumes from the newest checkpoint (--resume auto, the default);
# checkpoints every 10 steps bound what is recomputed. OUT must be a directory every node mounts. Ports,
# network interfaces and caches: docs/cluster.md. Any train.py flag may follow (it wins over the ones below).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${TRAIN:?set TRAIN to your training rows (parquet/jsonl files, space-separated) or a generated task}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0 (static) or of the rendezvous host (c10d)}"
RDZV=${RDZV:-static}
NNODES=${NNODES:-2}
GPUS=${GPUS:-8}
MASTER_PORT=${MASTER_PORT:-29500}
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
OUT=${OUT:-runs/grpo-multinode}
read -r -a DATA <<< "$TRAIN" && DATA=(--data.train-files "${DATA[@]}")
[ -z "${VAL:-}" ] || { read -r -a HELD <<< "$VAL" && DATA+=(--data.val-files "${HELD[@]}"); }
TORCHRUN=${TORCHRUN:-$([ -x .venv/bin/torchrun ] && echo .venv/bin/torchrun || echo torchrun)}
if [ "$RDZV" = c10d ]; then
    MEET=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:?set RDZV_ID, an id every node shares}")
else
    MEET=(--node-rank "${NODE_RANK:?set NODE_RANK (0 on the node at MASTER_ADDR)}" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
exec "$TORCHRUN" --nnodes "$NNODES" --nproc-per-node "$GPUS" "${MEET[@]}" --max-restarts 1 \
    train.py grpo --model.path "$MODEL" "${DATA[@]}" \
    --data.batch-size 128 --rollout.n 8 --rollout.max-tokens 1024 --trainer.steps 300 --trainer.save-every 10 \
    --out-dir "$OUT" "$@"
