#!/usr/bin/env bash
# Multi-node DSpark training with torchrun's c10d rendezvous (run the same command on every node).
#   NNODES=4 NPROC=4 RDZV_HOST=node0 CONFIG=configs/kimi-k3-dspark.yaml launch/torchrun-multinode.sh [key=value ...]
# Extra args are recipe overrides; add --resume to continue from the latest checkpoint after a failure.
set -euo pipefail
: "${NNODES:?number of nodes}" "${NPROC:?ranks per node}" "${RDZV_HOST:?host of the rendezvous (any node)}"
CONFIG=${CONFIG:-configs/kimi-k3-dspark.yaml}
RDZV_PORT=${RDZV_PORT:-29500}
RUN_ID=${RUN_ID:-dspark-$(basename "$CONFIG" .yaml)}
exec torchrun \
  --nnodes "$NNODES" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "$RUN_ID" \
  --max-restarts "${MAX_RESTARTS:-3}" \
  -m training --config "$CONFIG" --resume "$@"
