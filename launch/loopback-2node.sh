#!/usr/bin/env bash
# The multi-node training topology on ONE machine: a disaggregated target engine plus a 2-node trainer, each
# "node" its own torchrun invocation (--nnodes 2 --node-rank 0/1) on 127.0.0.1, hidden states over two-member
# gloo pairs (transport.kind=dist). tests/test_transport_multinode.py runs it with kills; this is the manual form.
#   CONFIG=configs/X.yaml launch/loopback-2node.sh [key=value ...]
# The same commands with real host names are the K3 layout: launch/target-engine.sh on each replica host,
# launch/torchrun-multinode.sh (or the sbatch file) on each trainer node, transport.backend=nccl.
set -euo pipefail
CONFIG=${CONFIG:?recipe yaml}
ENGINE_PORT=${ENGINE_PORT:-5555}
MASTER_PORT=${MASTER_PORT:-29511}
LOGS=${LOGS:-runs/loopback-2node}
mkdir -p "$LOGS"
common=(engine.placement=disaggregated "engine.endpoints=[tcp://127.0.0.1:$ENGINE_PORT]" engine.replicas=1
        transport.kind=dist transport.host=127.0.0.1 transport.backend=gloo train.world_size=2 "$@")
python -m training.engine_server --bind "tcp://127.0.0.1:$ENGINE_PORT" --config "$CONFIG" "${common[@]}" \
  >"$LOGS/engine.log" 2>&1 &
engine=$!
trap 'kill $engine 2>/dev/null || true' EXIT
for node in 0 1; do
  torchrun --nnodes 2 --node-rank "$node" --nproc-per-node 1 --master-addr 127.0.0.1 --master-port "$MASTER_PORT" \
    -m training --config "$CONFIG" --resume "${common[@]}" >"$LOGS/node$node.log" 2>&1 &
done
wait %2 %3
tail -n 5 "$LOGS/node0.log"
