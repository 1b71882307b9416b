#!/usr/bin/env bash
# One target engine for disaggregated training: serves prefill-only capture requests on tcp://*:PORT.
#   CONFIG=configs/X.yaml PORT=5555 launch/target-engine.sh [key=value ...]
# engine.kind=hf runs the transformers target on this host's GPU 0 (or CPU); engine.kind=sglang needs the
# dspark_sgl SGLang capture plugin; its attn-TP rank 0 ships rows straight to the trainer ranks over the recipe's
# transport (dist: NCCL/gloo pairs; shm: same host). Restart it freely: trainers re-send what it had in flight.
set -euo pipefail
CONFIG=${CONFIG:?recipe yaml}
PORT=${PORT:-5555}
exec python -m training.engine_server --config "$CONFIG" --bind "tcp://*:$PORT" "$@"
