"""Target engine processes: `python -m training.engine_server --bind ADDR [--config X.yaml] [key=value ...]`.

An engine turns full tokenized conversations into (aux hidden [T, K·H], post-norm last hidden [T, H]) with one
prefill-only pass and streams them to trainer ranks (`training/stream.py`). `hf` is the embedded transformers target
(`dspark_sgl.targets.hf.HFTarget`); `sglang` is a stock SGLang 0.5.23 engine whose capture comes from this
project's SGLang plugin (`dspark_sgl.sglang.engine`): in-process, or a running capture server at engine.sglang_url.
A colocated engine is started, and restarted when found dead, by its rank's `EngineSupervisor`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer


class EngineSupervisor:
    """The colocated engine of one rank: started with the rank, restarted when it is found dead."""

    def __init__(self, recipe_path: str | None, overrides: list[str], bind: str, log: Path):
        self.args = (recipe_path, overrides, bind, log)
        self.proc = spawn_engine(*self.args)
        self.restarts = 0

    def revive(self, _engine_index: int = 0) -> None:
        if self.proc.poll() is not None:
            print(f"[trainer] engine exited ({self.proc.returncode}); restarting it", file=sys.stderr, flush=True)
            self.proc = spawn_engine(*self.args)
            self.restarts += 1

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def spawn_engine(recipe_path: str | None, overrides: list[str], bind: str, log: Path) -> subprocess.Popen:
    """A colocated engine process for this rank (same recipe, its own device)."""
    cmd = [sys.executable, "-m", "training.engine_server", "--bind", bind]
    if recipe_path:
        cmd += ["--config", recipe_path]
    cmd += list(overrides)
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=dict(os.environ))


def serve_engine(recipe, bind: str, local_rank: int = 0) -> None:
    """Serve captures for `recipe` at `bind` until stopped."""
    import torch

    from dspark_sgl.sglang.engine import SGLangCapture, capture_engine_args
    from training.stream import serve
    from training.target import default_device, draft_config, load_hf_target, resolve_target_path, target_config

    dcfg = draft_config(recipe, target_config(recipe))
    device = default_device(recipe.engine.device, local_rank)
    if recipe.train.threads:
        torch.set_num_threads(recipe.train.threads)
    e = recipe.engine
    if e.kind == "sglang":
        from dspark_sgl.dtypes import dtype_name, resolve_dtype

        args = None if e.sglang_url else capture_engine_args(
            str(resolve_target_path(recipe.target.path)), dtype_name(resolve_dtype(recipe.target.dtype, device)),
            dcfg.target_layer_ids, device, e.tp_size, recipe.train.seed, e.sglang_args)
        capture = SGLangCapture(dcfg.num_aux, dcfg.hidden_size, engine_args=args, url=e.sglang_url,
                                dtype=resolve_dtype(recipe.target.dtype, device))
        where = e.sglang_url or f"an in-process sglang.Engine on {device}"
    else:
        target = load_hf_target(recipe, dcfg.target_layer_ids, device)
        capture = lambda ids, attn: target.capture(ids.to(target.device), attn.to(target.device))
        where = f"HFTarget on {device}"
    print(f"[engine] {recipe.target.path} layers {dcfg.target_layer_ids} via {where}, serving {bind}", flush=True)
    t0 = time.time()
    try:
        serve(capture, bind, e.max_batch, recipe.stream.wire_dtype)
    finally:
        if e.kind == "sglang":
            capture.close()
    print(f"[engine] stopped after {time.time() - t0:.0f}s", flush=True)


def main(
    bind: Annotated[str, typer.Option(help="tcp://*:5555 or ipc:///path")],
    config: Annotated[str | None, typer.Option(help="YAML recipe")] = None,
    local_rank: Annotated[int, typer.Option(envvar="LOCAL_RANK")] = 0,
    overrides: Annotated[list[str] | None, typer.Argument(help="dotted key=value recipe overrides")] = None,
) -> None:
    """Serve target hidden states to trainer ranks."""
    from training.recipe import load_recipe

    serve_engine(load_recipe(config, overrides or []), bind, local_rank)


if __name__ == "__main__":
    typer.run(main)
