"""Target engines behind one interface, and the feature sources the trainer reads batches from.

An engine turns full tokenized conversations into (aux hidden [T, K·H], post-norm last hidden [T, H]) with one
prefill-only pass. `hf` is the embedded transformers target (`dspark_sgl.targets.hf.HFTarget`); `sglang` is a stock
SGLang 0.5.23 engine whose capture comes from this project's SGLang plugin (`dspark_sgl.sglang.capture`): an
in-process `sglang.Engine` started by the engine process, or a running capture server at `engine.sglang_url`.
Either way the trainer streams from `python -m training.engines serve` processes. Placement, chosen in the recipe:

  inprocess      the rank calls HFTarget directly (no copy, no serialisation; the CPU default)
  colocated      each rank starts its own engine process on its device and streams from it (ipc://)
  disaggregated  engines run elsewhere (`python -m training.engines serve ...`), every rank streams from all of them

Every source returns the same `objective.Batch`, checked finite before the trainer touches it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dspark_sgl.config import DSparkConfig, default_target_layer_ids
from training.data import Sample, collate
from training.objective import Batch
from training.recipe import Recipe
from training.stream import DTYPES, Request, StreamClient

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineError(RuntimeError):
    """The target engine cannot serve the trainer (missing plugin, bad output)."""


# ---- target facts and heads --------------------------------------------------------------------------------
def resolve_target_path(path: str) -> Path:
    """The one target resolution of the project (`smollm2` or an HF folder), as an engine error."""
    from dspark_sgl.loading import resolve_target_dir

    try:
        return resolve_target_dir(path)
    except FileNotFoundError as e:
        raise EngineError(str(e)) from e


def target_facts(recipe: Recipe) -> dict:
    """hidden_size / num_hidden_layers / vocab_size of the target (from its config.json, or the recipe for meta)."""
    t = recipe.target
    if t.hidden_size and t.num_hidden_layers and t.vocab_size:
        return {"hidden_size": t.hidden_size, "num_hidden_layers": t.num_hidden_layers, "vocab_size": t.vocab_size}
    raw = json.loads((resolve_target_path(t.path) / "config.json").read_text())
    raw = raw.get("text_config", raw)
    return {k: raw[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}


def draft_config(recipe: Recipe, facts: dict) -> DSparkConfig:
    """The recipe's draft section completed and validated against the target."""
    d = dict(recipe.draft)
    d.setdefault("hidden_size", facts["hidden_size"])
    d.setdefault("vocab_size", facts["vocab_size"])
    d.setdefault("num_target_layers", facts["num_hidden_layers"])
    d.setdefault("target_layer_ids", default_target_layer_ids(facts["num_hidden_layers"]))
    d.setdefault("head_dim", d["hidden_size"] // d.get("num_attention_heads", 1))
    unknown = sorted(set(d) - set(DSparkConfig.__dataclass_fields__))
    if unknown:
        raise EngineError(f"unknown draft key(s) {unknown}")
    cfg = DSparkConfig(**d)
    cfg.validate(target_hidden_size=facts["hidden_size"], target_num_layers=facts["num_hidden_layers"],
                 target_vocab_size=facts["vocab_size"])
    return cfg


def load_target_heads(path: Path, dtype: torch.dtype, device) -> tuple[nn.Embedding, nn.Linear]:
    """Only embed_tokens and lm_head from the target's safetensors (a trainer rank never needs the full target)."""
    files = sorted(path.glob("*.safetensors"))
    found: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name.endswith("embed_tokens.weight") and "embed" not in found:
                    found["embed"] = st.get_tensor(name)
                elif name.endswith("lm_head.weight") and "lm_head" not in found:
                    found["lm_head"] = st.get_tensor(name)
    if "embed" not in found:
        raise EngineError(f"no *embed_tokens.weight in {path}")
    lm = found.get("lm_head", found["embed"])  # tied embeddings
    embed = nn.Embedding.from_pretrained(found["embed"].to(device, dtype), freeze=True)
    head = nn.Linear(lm.shape[1], lm.shape[0], bias=False).to(device, dtype).requires_grad_(False)
    head.weight.data.copy_(lm)
    return embed, head


def default_device(spec: str, local_rank: int) -> torch.device:
    if spec != "auto":
        return torch.device(spec)
    return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")


def load_hf_target(recipe: Recipe, layer_ids: list[int], device: torch.device):
    from dspark_sgl.targets.hf import HFTarget

    return HFTarget.from_pretrained(resolve_target_path(recipe.target.path), layer_ids,
                                    dtype=TORCH_DTYPES[recipe.target.dtype], device=str(device))


def check_sglang_plugin() -> None:
    """The sglang engine needs stock SGLang in the engine's Python (the capture hooks ship in dspark_sgl.sglang)."""
    if importlib.util.find_spec("sglang") is None:
        raise EngineError(f"engine.kind=sglang needs SGLang 0.5.23 importable by {sys.executable} "
                          "(pip install 'dspark-sgl[sglang]'), or use engine.kind=hf")


# SGLang on a CPU (see docs/serving.md): torch attention, no CUDA graphs, a small fixed KV pool.
SGLANG_CPU_ARGS = dict(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                       max_total_tokens=8192, mem_fraction_static=0.2)


def sglang_engine_args(recipe: Recipe, dcfg: DSparkConfig, device: torch.device) -> dict:
    """sglang.Engine keyword arguments of a capture engine for this recipe (recipe.engine.sglang_args last)."""
    from dspark_sgl.sglang.capture import engine_kwargs

    capture = engine_kwargs(dcfg.target_layer_ids)
    clash = sorted(set(recipe.engine.sglang_args) & set(capture))
    if clash:
        raise EngineError(f"engine.sglang_args may not set {clash}: the capture engine needs them as they are")
    args = dict(model_path=str(resolve_target_path(recipe.target.path)), dtype=recipe.target.dtype,
                tp_size=recipe.engine.tp_size, random_seed=recipe.train.seed)
    if device.type == "cpu":
        args.update(SGLANG_CPU_ARGS)
    else:
        args["base_gpu_id"] = device.index or 0
    return {**args, **capture, **recipe.engine.sglang_args}


class SGLangCapture:
    """capture(ids, attn) over SGLang: an in-process sglang.Engine, or a running capture server at engine.sglang_url.

    Each row of the batch is sent unpadded (its attention-mask length); replies are padded back to [B, T, ·]."""

    def __init__(self, recipe: Recipe, dcfg: DSparkConfig, device: torch.device):
        self.num_aux, self.hidden = dcfg.num_aux, dcfg.hidden_size
        self.engine = None
        if recipe.engine.sglang_url:
            self.handle = recipe.engine.sglang_url
            return
        check_sglang_plugin()
        if device.type == "cpu":
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's own switch for its CPU code paths
        import sglang

        self.engine = self.handle = sglang.Engine(**sglang_engine_args(recipe, dcfg, device))

    def __call__(self, ids: torch.Tensor, attn: torch.Tensor):
        from dspark_sgl.sglang.capture import capture
        from dspark_sgl.targets.hf import TargetOutput

        lengths = attn.sum(1).tolist()
        got = capture(self.handle, [ids[b, :n].tolist() for b, n in enumerate(lengths)], self.num_aux, self.hidden)
        B, T = ids.shape
        aux = torch.zeros(B, T, self.num_aux * self.hidden)
        last = torch.zeros(B, T, self.hidden)
        for b, (n, c) in enumerate(zip(lengths, got, strict=True)):
            aux[b, :n], last[b, :n] = c.aux, c.last
        return TargetOutput(aux=aux, last_hidden=last, logits=None)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


# ---- feature sources ---------------------------------------------------------------------------------------
def check_finite(aux: torch.Tensor, last: torch.Tensor, keys) -> None:
    if not (torch.isfinite(aux).all() and torch.isfinite(last).all()):
        raise EngineError(f"the target engine returned non-finite hidden states for samples {list(keys)}; "
                          "nothing was trained on them and no checkpoint was written")


class InProcessSource:
    """The rank's own HFTarget: capture on demand, no serialisation."""

    def __init__(self, target, pad_id: int):
        self.target, self.pad_id = target, pad_id

    def submit(self, items: list[tuple[int, Sample]]) -> None:
        pass

    def batch(self, items: list[tuple[int, Sample]], device) -> Batch:
        ids, mask, lengths, sids = collate([s for _, s in items], self.pad_id)
        attn = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        out = self.target.capture(ids.to(self.target.device), attn.to(self.target.device))
        check_finite(out.aux, out.last_hidden, sids.tolist())
        return Batch(ids, mask, lengths, sids, out.aux, out.last_hidden).to(device)

    def pending(self) -> list[int]:
        return []

    def close(self) -> None:
        pass


class StreamSource:
    """Features from engine processes over the stream (colocated or disaggregated)."""

    def __init__(self, client: StreamClient, pad_id: int, dtype: torch.dtype):
        self.client, self.pad_id, self.dtype = client, pad_id, dtype

    def submit(self, items: list[tuple[int, Sample]]) -> None:
        self.client.submit([Request(k, s.input_ids) for k, s in items])

    def batch(self, items: list[tuple[int, Sample]], device) -> Batch:
        ids, mask, lengths, sids = collate([s for _, s in items], self.pad_id)
        self.submit(items)
        feats = [self.client.get(k) for k, _ in items]
        S = ids.shape[1]
        aux = torch.zeros(len(items), S, feats[0].aux.shape[-1], dtype=self.dtype)
        last = torch.zeros(len(items), S, feats[0].last.shape[-1], dtype=self.dtype)
        for b, f in enumerate(feats):
            if f.aux.shape[0] != int(lengths[b]):
                raise EngineError(f"engine returned {f.aux.shape[0]} rows for a {int(lengths[b])}-token sample")
            aux[b, : f.aux.shape[0]], last[b, : f.last.shape[0]] = f.aux, f.last
        check_finite(aux, last, sids.tolist())
        return Batch(ids, mask, lengths, sids, aux, last).to(device)

    def pending(self) -> list[int]:
        return self.client.pending_ids()

    def close(self) -> None:
        self.client.close()


class MemoryCachedSource:
    """A source whose captures are kept in RAM, up to a byte budget, for the epochs that follow.

    The target is frozen, so a sample's features never change: a small run that revisits its samples for several
    epochs (the CPU recipe) need not pay the target prefill again. Nothing touches the disk; samples beyond the budget
    are simply captured again. Off by default: a re-captured sample may differ in the last bit from its cached copy
    (other batch padding), and exact-resume runs want every capture taken the same way.
    """

    def __init__(self, inner, budget_bytes: int):
        self.inner, self.budget, self.used = inner, budget_bytes, 0
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def pad_id(self) -> int:
        return self.inner.pad_id

    @pad_id.setter
    def pad_id(self, value: int) -> None:
        self.inner.pad_id = value

    def submit(self, items: list[tuple[int, Sample]]) -> None:
        self.inner.submit([it for it in items if it[1].id not in self.cache])

    def batch(self, items: list[tuple[int, Sample]], device) -> Batch:
        missing = [it for it in items if it[1].id not in self.cache]
        rows = {}
        if missing:
            fresh = self.inner.batch(missing, "cpu")
            for b, (_, s) in enumerate(missing):
                n = int(fresh.lengths[b])
                rows[s.id] = (fresh.input_ids[b, :n], fresh.loss_mask[b, :n], fresh.aux_hidden[b, :n].clone(),
                              fresh.last_hidden[b, :n].clone())
                size = sum(t.numel() * t.element_size() for t in rows[s.id])
                if self.used + size <= self.budget:
                    self.cache[s.id], self.used = rows[s.id], self.used + size
        rows.update({s.id: self.cache[s.id] for _, s in items if s.id not in rows})
        return stack_rows([rows[s.id] for _, s in items], [s.id for _, s in items], self.pad_id).to(device)

    def pending(self) -> list[int]:
        return self.inner.pending()

    def close(self) -> None:
        self.inner.close()


def stack_rows(rows, sample_ids: list[int], pad_id: int) -> Batch:
    """Right-padded Batch from per-sample (ids, mask, aux, last) rows."""
    S = max(r[0].shape[0] for r in rows)
    B = len(rows)
    ids = torch.full((B, S), pad_id, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.bool)
    aux = torch.zeros(B, S, rows[0][2].shape[-1], dtype=rows[0][2].dtype)
    last = torch.zeros(B, S, rows[0][3].shape[-1], dtype=rows[0][3].dtype)
    for b, (i, m, a, h) in enumerate(rows):
        n = i.shape[0]
        ids[b, :n], mask[b, :n], aux[b, :n], last[b, :n] = i, m, a, h
    lengths = torch.tensor([r[0].shape[0] for r in rows])
    return Batch(ids, mask, lengths, torch.tensor(sample_ids), aux, last)


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
    cmd = [sys.executable, "-m", "training.engines", "serve", "--bind", bind]
    if recipe_path:
        cmd += ["--config", recipe_path]
    cmd += list(overrides)
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=dict(os.environ))


def make_source(recipe: Recipe, dcfg: DSparkConfig, rank: int, local_rank: int, world: int, pad_id: int,
                recipe_path: str | None, overrides: list[str], out_dir: Path):
    """(source, engine processes this rank owns, target or None)."""
    e = recipe.engine
    if e.kind == "sglang" and e.placement == "colocated" and not e.sglang_url:
        check_sglang_plugin()  # the colocated engine starts sglang.Engine in this Python; remote engines have their own
    device = default_device(e.device, local_rank)
    if e.placement == "inprocess":
        if e.kind != "hf":
            raise EngineError("engine.placement=inprocess is only possible with engine.kind=hf")
        target = load_hf_target(recipe, dcfg.target_layer_ids, device)
        return cached(recipe, InProcessSource(target, pad_id)), [], target
    procs = []
    if e.placement == "colocated":
        bind = f"ipc://{out_dir.resolve()}/engine-{rank}.sock"
        procs.append(EngineSupervisor(recipe_path, overrides, bind, out_dir / "logs" / f"engine-{rank}.log"))
        endpoints = [bind]
    else:
        endpoints = e.endpoints
    dtype = DTYPES[recipe.stream.wire_dtype]
    per_token = (dcfg.num_aux + 1) * dcfg.hidden_size * torch.tensor([], dtype=dtype).element_size()
    client = StreamClient(endpoints, per_token, credits=recipe.stream.credits,
                          byte_budget=int(recipe.stream.byte_budget_mb * 2**20), timeout_s=recipe.stream.timeout_s,
                          on_silence=procs[0].revive if procs else None)
    return cached(recipe, StreamSource(client, pad_id, dtype)), procs, None


def cached(recipe: Recipe, source):
    mb = recipe.stream.memory_cache_mb
    return MemoryCachedSource(source, int(mb * 2**20)) if mb > 0 else source


# ---- `python -m training.engines serve` --------------------------------------------------------------------
def serve_main(argv: list[str] | None = None) -> None:
    from training.recipe import load_recipe
    from training.stream import serve

    ap = argparse.ArgumentParser(prog="python -m training.engines serve")
    ap.add_argument("--config")
    ap.add_argument("--bind", required=True, help="tcp://*:5555 or ipc:///path")
    ap.add_argument("--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    recipe = load_recipe(args.config, args.overrides)
    dcfg = draft_config(recipe, target_facts(recipe))
    device = default_device(recipe.engine.device, args.local_rank)
    if recipe.train.threads:
        torch.set_num_threads(recipe.train.threads)
    if recipe.engine.kind == "sglang":
        capture = SGLangCapture(recipe, dcfg, device)
        where = recipe.engine.sglang_url or f"an in-process sglang.Engine on {device}"
    else:
        target = load_hf_target(recipe, dcfg.target_layer_ids, device)
        capture = lambda ids, attn: target.capture(ids.to(target.device), attn.to(target.device))
        where = f"HFTarget on {device}"
    print(f"[engine] {recipe.target.path} layers {dcfg.target_layer_ids} via {where}, serving {args.bind}",
          flush=True)
    t0 = time.time()
    try:
        serve(capture, args.bind, recipe.engine.max_batch, recipe.stream.wire_dtype)
    finally:
        if recipe.engine.kind == "sglang":
            capture.close()
    print(f"[engine] stopped after {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "serve":
        raise SystemExit("usage: python -m training.engines serve --bind ADDR [--config X.yaml] [key=value ...]")
    serve_main(sys.argv[2:])
