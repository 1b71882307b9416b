#!/usr/bin/env bash
# Lean CPU install of real SGLang 0.5.23 into a separate venv (no CUDA torch, no torchvision).
# Usage: .ci/install_sglang.sh VENV_DIR     Idempotent: a venv that already imports sglang 0.5.23 is kept.
set -euo pipefail
VENV="${1:?usage: install_sglang.sh VENV_DIR}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
SGLANG_VERSION=0.5.23

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<PY 2>/dev/null
import importlib.metadata as m, sys
sys.exit(0 if m.version("sglang") == "$SGLANG_VERSION" and m.version("torch").startswith("2.13.0") else 1)
PY
then
  echo "install_sglang: $VENV already has sglang $SGLANG_VERSION"
else
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  PIP=("$VENV/bin/pip" install --quiet)
  # torch first: the CPU wheel (a full `pip install sglang` would pull a CUDA torch and 3.6 GB of NVIDIA libs).
  "${PIP[@]}" "torch==2.13.0"
  "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
  "${PIP[@]}" numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic \
    pyzmq tqdm IPython aiohttp huggingface_hub uvicorn uvloop fastapi "transformers==5.19.0" \
    "tokenizers==0.23.2" dill "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" "compressed-tensors==0.18.0" \
    gguf "openai==2.8.0" partial_json_parser setproctitle einops jsonschema "xgrammar==0.2.7" \
    "soundfile==0.13.1" python-multipart pytest pytest-timeout safetensors typer rich pyyaml scipy
  # Refuse a CUDA torch that a dependency may have dragged in.
  "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') and torch.version.cuda is None else 'CUDA or wrong torch: ' + torch.__version__)"
fi
# This project, editable, without touching the pinned set above (registers the sglang.srt.plugins entry point).
"$VENV/bin/pip" install --quiet --no-deps -e "$REPO"
echo "install_sglang: ok ($VENV)"
