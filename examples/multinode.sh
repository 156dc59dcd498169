#!/usr/bin/env bash
# GRPO across nodes with plain torchrun: run this same command on every node. Two nodes of 8 GPUs by default.
#
#   RDZV=c10d MASTER_ADDR=10.0.0.1 RDZV_ID=job-7 bash examples/multinode.sh      # on every node (c10d)
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/multinode.sh                  # static: on node 0
#   NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash examples/multinode.sh                  # static: on node 1
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/multinode.sh --pipeline.placement split --pipeline.rollout-ranks 8
#
# RDZV=static (the default) is the static rendezvous on MASTER_ADDR:MASTER_PORT (NODE_RANK 0 there);
# RDZV=c10d is torchrun's c10d rendezvous at MASTER_ADDR:MASTER_PORT with the id RDZV_ID, and the launchers
# take their node ranks themselves. Both are tested (docs/cluster.md). --max-restarts 1: a lost rank restarts
# the world, which resumes from the newest checkpoint (--resume auto, the default); checkpoints every 10
# steps bound what is recomputed. OUT must be a directory every node mounts. Ports, network interfaces and
# caches: docs/cluster.md. Any train.py flag may follow (it wins over the ones below).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0 (static) or of the rendezvous host (c10d)}"
RDZV=${RDZV:-static}
NNODES=${NNODES:-2}
GPUS=${GPUS:-8}
MASTER_PORT=${MASTER_PORT:-29500}
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
OUT=${OUT:-runs/grpo-multinode}
TORCHRUN=${TORCHRUN:-$([ -x .venv/bin/torchrun ] && echo .venv/bin/torchrun || echo torchrun)}
if [ "$RDZV" = c10d ]; then
    MEET=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:?set RDZV_ID, an id every node shares}")
else
    MEET=(--node-rank "${NODE_RANK:?set NODE_RANK (0 on the node at MASTER_ADDR)}" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
fi
exec "$TORCHRUN" --nnodes "$NNODES" --nproc-per-node "$GPUS" "${MEET[@]}" --max-restarts 1 \
    train.py grpo --model.path "$MODEL" --data.batch-size 128 --rollout.n 8 --rollout.max-tokens 1024 \
    --rollout.engine vllm --trainer.steps 300 --trainer.save-every 10 --out-dir "$OUT" "$@"
