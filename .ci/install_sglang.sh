#!/usr/bin/env bash
# Lean CPU install of real SGLang 0.5.23 into a separate venv (no CUDA torch, no torchvision).
# Usage: .ci/install_sglang.sh VENV_DIR     Idempotent: a venv that already imports sglang 0.5.23 is kept.
set -euo pipefail
VENV="${1:?usage: install_sglang.sh VENV_DIR}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
SGLANG_VERSION=0.5.23

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - <<PY 2>/dev/null
import importlib.metadata as m, sys
import matplotlib  # the test-time set grows: a venv from an older list is topped up below
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
  # SGLang's CPU runtime set is the package's `serve-cpu` extra (one list, in pyproject.toml); then what the tests use.
  mapfile -t SERVE_CPU < <("$VENV/bin/python" -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["serve-cpu"]))' \
    "$REPO/pyproject.toml")
  "${PIP[@]}" "${SERVE_CPU[@]}" pytest pytest-timeout safetensors typer rich pyyaml scipy matplotlib "python-dateutil<3"
  # Refuse a CUDA torch that a dependency may have dragged in.
  "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') and torch.version.cuda is None else 'CUDA or wrong torch: ' + torch.__version__)"
fi
# This project, editable, without touching the pinned set above (registers the sglang.srt.plugins entry points
# `dspark` and `dspark_cpu`; rerun after pulling a change to them).
"$VENV/bin/pip" install --quiet --no-deps -e "$REPO"
echo "install_sglang: ok ($VENV)"
