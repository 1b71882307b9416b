#!/usr/bin/env bash
# Serve Kimi-K3 with DSpark speculative decoding (block 7) on one node of 8 GPUs (TP8) or two nodes (TP16).
#
#   K3=/models/Kimi-K3 DRAFT=/models/Kimi-K3-DSpark bash launch/serve_kimi_k3.sh            # TP8, one node
#   NNODES=2 NODE_RANK=0 DIST_ADDR=10.0.0.1:5000 TP=16 ... bash launch/serve_kimi_k3.sh     # TP16, run on both
#
# Which DSPARK runs: with dspark-sgl[sglang] installed, `--speculative-algorithm DSPARK` runs our plugin's worker.
# Kimi-K3 is a hybrid target (KDA linear attention), whose recurrent state our worker does not yet roll back after
# verify, so our worker refuses it at start-up; until it does, this script hands DSPARK back to SGLang's builtin
# by leaving our plugin out of SGLANG_PLUGINS (DSPARK_IMPL=builtin, the default here). See docs/serving.md.
set -euo pipefail

K3="${K3:?set K3 to the Kimi-K3 checkpoint folder}"
DRAFT="${DRAFT:-}"                 # empty: SGLang's builtin auto-detects a bundled draft or a dspark/ subfolder
TP="${TP:-8}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
PORT="${PORT:-30000}"
DSPARK_IMPL="${DSPARK_IMPL:-builtin}"  # builtin | dspark-sgl

case "$DSPARK_IMPL" in
  builtin) export SGLANG_PLUGINS="${SGLANG_PLUGINS_BUILTIN:-none}" ;;  # a whitelist naming no plugin of ours
  dspark-sgl) unset SGLANG_PLUGINS ;;
  *) echo "DSPARK_IMPL must be builtin or dspark-sgl, got $DSPARK_IMPL" >&2; exit 2 ;;
esac

args=(
  --model-path "$K3" --trust-remote-code
  --tp "$TP" --host 0.0.0.0 --port "$PORT"
  --speculative-algorithm DSPARK --speculative-dspark-block-size 7
)
[ -n "$DRAFT" ] && args+=(--speculative-draft-model-path "$DRAFT")
if [ "$NNODES" -gt 1 ]; then
  args+=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --dist-init-addr "${DIST_ADDR:?set DIST_ADDR host:port}")
fi
exec sglang serve "${args[@]}" "$@"
