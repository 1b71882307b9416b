#!/usr/bin/env bash
# Serve Kimi-K3 with DSpark speculative decoding (block 7), with the Kimi-K3-DSpark model card's flags:
# TP8 + DCP8 on one node of 8 GPUs, --max-mamba-cache-size 160, 32 running requests.
#
#   K3=/models/Kimi-K3 DRAFT=/models/Kimi-K3-DSpark bash launch/serve_kimi_k3.sh            # TP8, one node
#   NNODES=2 NODE_RANK=0 DIST_ADDR=10.0.0.1:5000 TP=16 ... bash launch/serve_kimi_k3.sh     # TP16, run on both
#   DRY_RUN=1 K3=... bash launch/serve_kimi_k3.sh                                            # print the command
#   K3=... bash launch/serve_kimi_k3.sh --dry-run [--context-len N --gpu-gb G --json]        # per-rank memory plan
#
# --dry-run hands the exact argument list below to `python -m dspark_sgl.sglang.plan` (meta device: no weights, no
# GPU, no SGLang): per-rank memory of target, draft (replicated vs TP-sharded), KV and KDA caches, and the per-step
# collectives. It reads $K3/config.json and $DRAFT/config.json when they exist, else the project's K3 stand-in config
# (configs/kimi-k3-target/) and the card's draft recipe (configs/kimi-k3-dspark.yaml; DRAFT_RECIPE=... for another).
#
# Which DSPARK runs: with dspark-sgl[sglang] installed, `--speculative-algorithm DSPARK` runs our plugin's worker
# (DSPARK_IMPL=dspark-sgl, the default). K3 is a KDA + MLA hybrid: after every verify the worker commits each
# request's KDA state for exactly its accepted prefix through SGLang's own update_mamba_state_after_mtp_verify
# (dspark_sgl/sglang/hybrid.py). DSPARK_IMPL=builtin hands DSPARK back to SGLang's builtin worker by leaving our
# plugin out of SGLANG_PLUGINS. See docs/serving.md.
set -euo pipefail

K3="${K3:?set K3 to the Kimi-K3 checkpoint folder}"
DRAFT="${DRAFT:-}"                 # empty: SGLang auto-detects a bundled draft or a dspark/ subfolder
TP="${TP:-8}"
DCP="${DCP:-8}"
MAMBA_CACHE="${MAMBA_CACHE:-160}"
MAX_RUNNING="${MAX_RUNNING:-32}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
PORT="${PORT:-30000}"
DSPARK_IMPL="${DSPARK_IMPL:-dspark-sgl}"  # dspark-sgl | builtin

case "$DSPARK_IMPL" in
  builtin) export SGLANG_PLUGINS="${SGLANG_PLUGINS_BUILTIN:-none}" ;;  # a whitelist naming no plugin of ours
  dspark-sgl) unset SGLANG_PLUGINS ;;
  *) echo "DSPARK_IMPL must be dspark-sgl or builtin, got $DSPARK_IMPL" >&2; exit 2 ;;
esac

args=(
  --trust-remote-code --model-path "$K3"
  --tp-size "$TP" --dcp-size "$DCP"
  --mem-fraction-static 0.85 --max-mamba-cache-size "$MAMBA_CACHE"
  --max-running-requests "$MAX_RUNNING" --cuda-graph-max-bs-decode "$MAX_RUNNING"
  --reasoning-parser kimi_k3 --tool-call-parser kimi_k3
  --host 0.0.0.0 --port "$PORT"
  --speculative-algorithm DSPARK --speculative-dspark-block-size 7
)
[ -n "$DRAFT" ] && args+=(--speculative-draft-model-path "$DRAFT")
if [ "$NNODES" -gt 1 ]; then
  args+=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --dist-init-addr "${DIST_ADDR:?set DIST_ADDR host:port}")
fi
dry_run=0
rest=()
for a in "$@"; do
  if [ "$a" = "--dry-run" ]; then dry_run=1; else rest+=("$a"); fi
done
if [ "$dry_run" = 1 ]; then
  here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  plan=("${args[@]}" --draft-recipe "${DRAFT_RECIPE:-$here/configs/kimi-k3-dspark.yaml}" ${rest[@]+"${rest[@]}"})
  PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m dspark_sgl.sglang.plan "${plan[@]}"
fi
if [ -n "${DRY_RUN:-}" ]; then
  echo "SGLANG_PLUGINS=${SGLANG_PLUGINS-<unset>} sglang serve ${args[*]} $*"
  exit 0
fi
exec sglang serve "${args[@]}" "$@"
