"""Exact-resume checkpoints with torch.distributed.checkpoint, written so that a kill at any moment is harmless.

A checkpoint is a folder `step-XXXXXXXX/` holding the sharded model + optimizer (DCP, every rank writes its shards)
and `meta.pt` (step, scheduler, per-rank RNG states, the data-stream position). It is written under a `.tmp` name
and renamed only after every rank finished, then `latest` is replaced atomically: a run killed mid-save leaves a
`.tmp` folder that resume ignores and removes, never a half-written checkpoint that looks complete.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

LATEST = "latest"


def _name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(root: Path, step: int, model, optim, sched, stream_state: dict, keep: int = 2) -> Path:
    rank = dist.get_rank()
    final, tmp = root / _name(step), root / (_name(step) + ".tmp")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    dist.barrier()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=str(tmp))
    rng = [None] * dist.get_world_size()
    dist.all_gather_object(rng, torch.get_rng_state())
    if rank == 0:
        meta = {"step": step, "sched": sched.state_dict(), "rng": rng, "stream": stream_state}
        torch.save(meta, tmp / "meta.pt")
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        pointer = root / (LATEST + ".tmp")
        pointer.write_text(final.name + "\n")
        pointer.replace(root / LATEST)
        _prune(root, keep)
    dist.barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: Path) -> Path | None:
    pointer = root / LATEST
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "meta.pt").exists() else None


def load_checkpoint(root: Path, model, optim, sched, prune: bool = True) -> dict | None:
    """Restore model, optimizer, scheduler and this rank's RNG from the latest complete checkpoint; return its meta."""
    path = latest_checkpoint(root)
    if prune and dist.get_rank() == 0:
        for stale in root.glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)  # a save interrupted by a kill
    if path is None:
        return None
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])
    meta = torch.load(path / "meta.pt", weights_only=False)
    sched.load_state_dict(meta["sched"])
    rng = meta["rng"]
    if len(rng) == dist.get_world_size():
        torch.set_rng_state(rng[dist.get_rank()])
    return meta


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The unsharded fp32 weights on CPU (every rank must call; only rank 0 gets a non-empty dict)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
