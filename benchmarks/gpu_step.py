"""GPU check of the draft's decode step without SGLang: draft block + Markov rollout + confidence + acceptance.

On a random target-shaped input (seeded random weights, a random context of S tokens of target aux hidden states in
a DraftContextCache, random target logits planted so that row b accepts c_b drafts, c_b spread over 0..γ), for each
shape × context length S × batch B × mode, the step `decode_step` below (DSparkDraft.forward_step,
speculative.rows.propose with the confidence head, speculative.rows.accept_rows; on CUDA the Triton markov_step and
acceptance kernels; the column `=plant` says the accepted counts are the planted c_b):

  (a) eager     - ms per step (CUDA events, median of --iters after --warmup steps);
  (b) graph     - the same step captured once with torch.cuda.CUDAGraph from static buffers and replayed: ms per
                  replay, and equality with eager (bitwise, else allclose) on the same seed;
  (c) sync      - one steady-state eager step under torch.cuda.set_sync_debug_mode("error"): pass, or the error;
  (d) bytes     - bytes allocated by one step (memory_stats allocated_bytes delta; allocations; peak above the
                  resting memory) at each S: the summary shows whether they grow with the context length;
  (e) kernels   - the Triton greedy / rejection / block acceptance kernels and markov_step against their torch
                  references on CUDA at a few shapes: equality of accepted counts and bonus tokens (argmax tokens
                  and max |Δlogits| for markov_step), kernel ms vs reference ms. Strict rows (greedy, rejection,
                  markov_step in fp32) must match exactly; block may differ where η lies within an ulp of h_i (its
                  R_i sums in another order) and bf16 markov_step where the reference rounds W2·latent to bf16.

Shapes: `recipe` is the SmolLM2-135M recipe draft (hidden 576, 2 GQA layers 9/3 heads, V 49152, reduced draft vocab
8192, 3 aux layers, γ 7); `k3` is the Kimi-K3 DSpark draft of configs/kimi-k3-dspark-mla.yaml (hidden 7168, 5 MLA
layers, 64 heads, V 163840 full draft vocab, own embedding, 5 aux layers, YaRN, γ 7). Modes: `greedy` (T = 0 rows,
greedy acceptance), `rejection` and `block` (T = 0.8, top-p 0.95 rows, row 0 greedy when B > 1, that rule). bf16
weights on CUDA, fp32 on a CPU.

Imports torch, triton (optional) and this repo's dspark_sgl only: no SGLang, no network, nothing to install. On the
device machine run it from the repository root of the carried working tree:

    python benchmarks/gpu_step.py --json-out $OUT/gpu_step.json        # one H200: well under the 8 min (guard 7)
    python benchmarks/gpu_step.py --shapes recipe --batches 1,8 --iters 10   # a subset

Cases stop being added once --budget-s (420 s) has passed since start; the output says which were skipped. Exit
status 1 when a check failed (an error, a sync, a failed capture, graph ≠ eager, a greedy count ≠ planted, a strict
kernel mismatch), else 0.
Without CUDA, `--cpu-smoke` runs tiny shapes on the CPU (the harness itself): (b) is skipped with its reason, and
(c)/(d) use benchmarks/step_counter.py instead (the ops that WOULD sync on CUDA; bytes of fresh op outputs);
(e) runs only under TRITON_INTERPRET=1 (Triton's CPU interpreter), else it is skipped with its reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the carried working tree, no install
from dspark_sgl.config import DSparkConfig, default_target_layer_ids  # noqa: E402
from dspark_sgl.kernels import accept as kaccept  # noqa: E402
from dspark_sgl.kernels import markov_step as kmarkov  # noqa: E402
from dspark_sgl.kernels.accept_reference import Acceptance, block_accept, greedy_accept, rejection_accept  # noqa: E402
from dspark_sgl.model.draft import DraftContextCache, DSparkDraft, num_parameters  # noqa: E402
from dspark_sgl.provenance import provenance  # noqa: E402
from dspark_sgl.speculative.rows import accept_rows, propose, step_noise  # noqa: E402
from dspark_sgl.speculative.target_dist import BatchSampling, RequestSampling  # noqa: E402

SEED = 1234
YARN = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32768, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
RECIPE = dict(hidden_size=576, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
              intermediate_size=1536, vocab_size=49152, draft_vocab_size=8192, block_size=7, rope_theta=100000.0,
              target_layer_ids=default_target_layer_ids(30, 3), num_target_layers=30, mask_token_id=16,
              markov_rank=64)
K3 = dict(attention_type="mla", hidden_size=7168, num_hidden_layers=5, num_attention_heads=64, num_key_value_heads=64,
          head_dim=112, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
          v_head_dim=128, intermediate_size=14336, vocab_size=163840, rms_norm_eps=1e-5, rope_theta=50000.0,
          rope_scaling=YARN, max_position_embeddings=1048576, own_embed_tokens=True, block_size=7,
          target_layer_ids=[2, 23, 47, 71, 89], num_target_layers=93, mask_token_id=163837, markov_rank=256)
# K3: configs/kimi-k3-dspark-mla.yaml (the Inferact card's draft); head_dim is unused by MLA (DSparkConfig wants one).
SHAPES = {"recipe": RECIPE, "k3": K3}
TINY = {  # --cpu-smoke: the same layouts at toy sizes
    "recipe": RECIPE | dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            intermediate_size=128, vocab_size=512, draft_vocab_size=128, mask_token_id=16,
                            markov_rank=16),
    "k3": K3 | dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                    intermediate_size=128, vocab_size=1024, mask_token_id=1023, markov_rank=16),
}
MODES = ("greedy", "rejection", "block")


# ---- building the inputs -----------------------------------------------------------------------------------------
def build_draft(spec: dict, device: torch.device, dtype: torch.dtype) -> DSparkDraft:
    """Seeded random draft + target lm_head (+ embedding unless the draft owns one), initialised on the device."""
    torch.manual_seed(SEED)
    c = DSparkConfig(**spec)
    with torch.device(device):
        draft = DSparkDraft(c)
        lm_head = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        embed = draft.embed_tokens if c.own_embed_tokens else torch.nn.Embedding(c.vocab_size, c.hidden_size)
    for module in (draft.eval(), lm_head, embed):
        module.to(dtype)
    if c.reduced_vocab:  # K random hot target ids
        draft.set_vocab(torch.randperm(c.vocab_size, generator=torch.Generator().manual_seed(SEED))[: c.draft_vocab])
    return draft.bind_target(embed, lm_head)


@torch.no_grad()
def build_context(draft: DSparkDraft, B: int, S: int, device: torch.device, dtype: torch.dtype) -> DraftContextCache:
    """Context K/V of ragged committed lengths in [S/2, S] (row 0: S) from random aux hidden states, in chunks."""
    g = torch.Generator().manual_seed(SEED + B + S)
    lengths = torch.randint(S // 2, S + 1, (B,), generator=g)
    lengths[0] = S
    cache = DraftContextCache(draft, B, device, dtype)
    aux_dim = draft.config.num_aux * draft.config.hidden_size
    chunk = max(1, min(S, (1 << 28) // (B * aux_dim)))  # ≤ 256 M aux values per chunk
    for start in range(0, S, chunk):
        aux = torch.randn(B, chunk, aux_dim, device=device, dtype=dtype)
        cache.append(aux, (lengths - start).clamp(0, chunk).to(device))
    return cache


@dataclass
class StepInputs:
    """The static buffers of one step: a CUDA graph captured over them replays on whatever they hold."""

    cache: DraftContextCache
    anchor: Tensor  # [B] token ids
    rows: BatchSampling
    rule: str  # acceptance rule of the sampled rows
    target_logits: Tensor | None = None  # [B, γ+1, V] fp32, the verify forward's output stand-in
    planted: Tensor | None = None  # [B] the drafts target_logits accepts


def sampling_rows(mode: str, B: int, V: int, device: torch.device) -> BatchSampling:
    if mode == "greedy":
        return BatchSampling.from_requests([RequestSampling()] * B, V, device)
    reqs = [RequestSampling(temperature=0.8, top_p=0.95) for _ in range(B)]
    if B > 1:
        reqs[0] = RequestSampling()  # a mixed batch, as served
    return BatchSampling.from_requests(reqs, V, device)


@torch.no_grad()
def make_inputs(draft: DSparkDraft, cache: DraftContextCache, mode: str) -> StepInputs:
    """Anchors, sampling rows and target logits that accept a random c_b in 0..γ of this mode's own drafts."""
    c, B, device = draft.config, cache.lengths.shape[0], cache.lengths.device
    torch.manual_seed(SEED)
    x = StepInputs(cache, torch.randint(0, c.vocab_size, (B,), device=device),
                   sampling_rows(mode, B, c.vocab_size, device), "rejection" if mode == "greedy" else mode)
    torch.manual_seed(SEED)  # the same draws as every seeded step below: the same drafts
    tokens = propose(draft, draft.forward_step(x.anchor, cache), x.anchor, x.rows,
                     step_noise(x.rows, None, cache.lengths)).tokens
    x.target_logits, x.planted = plant_logits(tokens, c.vocab_size)
    return x


def plant_logits(tokens: Tensor, V: int) -> tuple[Tensor, Tensor]:
    """Random logits where draft j is the overwhelming choice for j < c_b and impossible at j = c_b; c_b runs
    through 0..γ over the rows (γ // 2 at B = 1). Returns (logits, c)."""
    B, G = tokens.shape
    logits = torch.randn(B, G + 1, V, device=tokens.device) * 3
    c = (torch.arange(B, device=tokens.device) * 3 + G // 2) % (G + 1)
    hit = torch.arange(G, device=tokens.device)[None] < c[:, None]
    logits[:, :G].scatter_(2, tokens[..., None], torch.where(hit, 50.0, -50.0)[..., None])
    return logits, c


# ---- the step -----------------------------------------------------------------------------------------------------
@torch.no_grad()
def decode_step(draft: DSparkDraft, x: StepInputs) -> tuple:
    """The worker's decode step minus SGLang's verify forward and bookkeeping: block, rollout, confidence, accept."""
    noise = step_noise(x.rows, None, x.cache.lengths)  # the global generator: graph-safe
    h = draft.forward_step(x.anchor, x.cache)
    prop = propose(draft, h, x.anchor, x.rows, noise)
    acc = accept_rows(prop, x.target_logits, x.rows, None, noise, x.rule)
    return prop.tokens, prop.logits, prop.conf_logits, acc.num_accepted, acc.bonus


def seeded(fn):
    torch.manual_seed(SEED)
    return fn()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, iters: int, device: torch.device) -> float:
    """Median ms of fn over iters calls: CUDA events on a GPU, perf_counter on a CPU."""
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in events)


def step_counter():
    """benchmarks/step_counter.py's TorchDispatchMode: what a CPU run has for (c) and (d)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_counter import StepCounter

    return StepCounter()


def alloc_per_step(fn, device: torch.device) -> dict:
    """(d): bytes and allocations of one step (CUDA caching allocator), or fresh op-output bytes on a CPU."""
    if device.type != "cuda":
        with step_counter() as counter:
            fn()
        return {"alloc_bytes": counter.bytes["worker"], "alloc_source": "step_counter (fresh op outputs)"}
    sync(device)
    before = torch.cuda.memory_stats(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    sync(device)
    after = torch.cuda.memory_stats(device)
    del out
    return {"alloc_bytes": after["allocated_bytes.all.allocated"] - before["allocated_bytes.all.allocated"],
            "allocs": after["allocation.all.allocated"] - before["allocation.all.allocated"],
            "peak_extra_bytes": after["allocated_bytes.all.peak"] - before["allocated_bytes.all.current"],
            "alloc_source": "torch.cuda.memory_stats"}


def sync_check(fn, device: torch.device) -> dict:
    """(c): one steady-state eager step with device->host syncs made errors (a CPU counts the would-be syncs)."""
    if device.type != "cuda":
        with step_counter() as counter, counter.wrapped_reads():
            fn()
        sites = dict(counter.sites)
        return {"sync_ok": not sites, "sync_error": "; ".join(sites) or None, "sync_source": "step_counter"}
    sync(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        sync_ok, err = True, None
    except RuntimeError as e:
        sync_ok, err = False, str(e).strip().splitlines()[0][:400]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"sync_ok": sync_ok, "sync_error": err, "sync_source": "set_sync_debug_mode(error)"}


def compare(ref: tuple, out: tuple) -> dict:
    """Bitwise and allclose equality of two step outputs (None entries must match None)."""
    bitwise, close, worst = True, True, 0.0
    for a, b in zip(ref, out, strict=True):
        if a is None or b is None:
            bitwise &= a is b
            continue
        bitwise &= a.dtype == b.dtype and torch.equal(a, b)
        if a.is_floating_point():
            close &= torch.allclose(a, b, rtol=1e-3, atol=1e-3)
            worst = max(worst, float((a.float() - b.float()).abs().max()) if a.numel() else 0.0)
        else:
            close &= torch.equal(a, b)
    return {"graph_bitwise": bitwise, "graph_allclose": close, "graph_max_abs_diff": worst}


def graph_check(fn, ref: tuple, iters: int, device: torch.device) -> dict:
    """(b): capture fn once into a CUDA graph (warmed on a side stream), replay it seeded and timed."""
    if device.type != "cuda":
        return {"graph": "skipped: CUDA graphs need CUDA"}
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = fn()
    except Exception as e:  # noqa: BLE001 - reported, the run goes on
        return {"graph": f"capture failed: {str(e).strip().splitlines()[0][:400]}"}
    torch.manual_seed(SEED)
    graph.replay()
    sync(device)
    rec = {"graph": "ok", **compare(ref, out), "graph_ms": timed(graph.replay, iters, device)}
    del graph, out
    return rec


def run_case(draft: DSparkDraft, x: StepInputs, args, device: torch.device) -> dict:
    fn = lambda: decode_step(draft, x)  # noqa: E731
    for _ in range(args.warmup):
        fn()
    rec = {"eager_ms": timed(fn, args.iters, device)}
    rec |= alloc_per_step(fn, device)
    rec |= sync_check(fn, device)
    ref = seeded(fn)
    rec["mean_accepted"] = float(ref[3].float().mean())
    rec["accepted_as_planted"] = bool(torch.equal(ref[3], x.planted))  # the acceptance rule read the right rows
    rec |= graph_check(fn, ref, args.iters, device)
    return rec


# ---- (e) kernels vs references -----------------------------------------------------------------------------------
def same(a: Acceptance, r: Acceptance) -> tuple[int, int]:
    """(rows whose accepted count differs, rows whose bonus differs)."""
    return int((a.num_accepted != r.num_accepted).sum()), int((a.bonus != r.bonus).sum())


def greedy_case(B: int, G: int, V: int, K: int, device: torch.device) -> dict:
    """Drafts = the argmax with one mismatch planted per row at a random place (or none); K > 0: draft ids, d2t."""
    g = torch.Generator(device=device).manual_seed(SEED)
    logits = torch.randn(B, G + 1, V, device=device, generator=g) * 3
    d2t = vocab = None
    best = logits[:, :G].argmax(-1)
    n = K or V
    if K:
        vocab = torch.randperm(V, device=device, generator=g)[:K].sort().values
        d2t = vocab - torch.arange(K, device=device)
        logits[..., vocab] += 10.0  # the argmax is (nearly always) a draft token
        best = torch.searchsorted(vocab, logits[:, :G].argmax(-1)).clamp(max=K - 1)
    j = torch.randint(0, G + 1, (B, 1), device=device, generator=g)
    x = torch.where(torch.arange(G, device=device)[None] == j, (best + 1) % n, best)
    x_target = x if vocab is None else vocab[x]
    limit = torch.randint(0, G + 1, (B,), device=device, generator=g)
    diffs = [same(kaccept.greedy_accept_triton(x, logits, lim, d2t), greedy_accept(x_target, logits, lim))
             for lim in (None, limit)]
    return {"kernel": "greedy", "shape": f"B={B} γ={G} V={V}" + (f" K={K}" if K else ""), "strict": True,
            "count_mismatch": sum(d[0] for d in diffs), "bonus_mismatch": sum(d[1] for d in diffs),
            "kernel_fn": lambda: kaccept.greedy_accept_triton(x, logits, None, d2t),
            "ref_fn": lambda: greedy_accept(x_target, logits, None)}


def sampled_case(rule: str, B: int, G: int, V: int, spread: float, device: torch.device) -> dict:
    """q near p (spread small: most drafts accepted) or far; x ~ q; four seeds of the same noise for both."""
    g = torch.Generator(device=device).manual_seed(SEED)
    p = torch.softmax(torch.randn(B, G + 1, V, device=device, generator=g) * 3, -1)
    q = torch.softmax(torch.log(p[:, :G]) + spread * torch.randn(B, G, V, device=device, generator=g), -1)
    x = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, G)
    kernel, ref = {"rejection": (kaccept.rejection_accept_triton, rejection_accept),
                   "block": (kaccept.block_accept_triton, block_accept)}[rule]
    noise = lambda s: torch.Generator(device=device).manual_seed(s)  # noqa: E731
    diffs = [same(kernel(x, q, p, None, noise(s)), ref(x, q, p, None, noise(s))) for s in range(4)]
    return {"kernel": rule, "shape": f"B={B} γ={G} V={V} spread={spread}", "strict": rule == "rejection",
            "count_mismatch": sum(d[0] for d in diffs), "bonus_mismatch": sum(d[1] for d in diffs),
            "kernel_fn": lambda: kernel(x, q, p, None, noise(0)), "ref_fn": lambda: ref(x, q, p, None, noise(0))}


def markov_case(B: int, K: int, r: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Fused bias + argmax vs base + latent @ W2ᵀ then argmax (the kernel sums in fp32, the reference in W2's dtype)."""
    g = torch.Generator(device=device).manual_seed(SEED)
    base = torch.randn(B, K, device=device, generator=g) * 2
    lat = torch.randn(B, r, device=device, generator=g).to(dtype)
    w2 = (torch.randn(K, r, device=device, generator=g) * 0.1).to(dtype)
    tok, logits = kmarkov.markov_step_triton(base, lat, w2)
    ref_tok, ref_logits = kmarkov.markov_step_reference(base, lat, w2)
    return {"kernel": "markov_step", "shape": f"B={B} K={K} r={r} {str(dtype).removeprefix('torch.')}",
            "strict": dtype == torch.float32,
            "count_mismatch": int((tok != ref_tok).sum()), "bonus_mismatch": None,
            "max_abs_logit_diff": float((logits - ref_logits).abs().max()),
            "kernel_fn": lambda: kmarkov.markov_step_triton(base, lat, w2),
            "ref_fn": lambda: kmarkov.markov_step_reference(base, lat, w2)}


def kernel_cases(tiny: bool, device: torch.device) -> list:
    """Callables building each (e) case; tiny: shapes the Triton interpreter runs in seconds."""
    if tiny:
        V, B, big, K, r = 300, 2, 600, 40, 8
        return [lambda: greedy_case(B, 3, V, 0, device), lambda: greedy_case(B, 3, V, K, device),
                lambda: sampled_case("rejection", B, 3, V, 0.3, device),
                lambda: sampled_case("block", B, 3, V, 0.3, device),
                lambda: markov_case(B, big, r, torch.float32, device)]
    cases = [lambda: greedy_case(1, 7, 49152, 0, device), lambda: greedy_case(32, 7, 49152, 8192, device),
             lambda: greedy_case(32, 7, 163840, 0, device)]
    for rule in ("rejection", "block"):
        cases += [lambda rule=rule, s=s, B=B, V=V: sampled_case(rule, B, 7, V, s, device)
                  for B, V, s in ((8, 49152, 0.3), (32, 163840, 0.3), (32, 163840, 2.0))]
    cases += [lambda B=B, K=K, r=r, dt=dt: markov_case(B, K, r, dt, device)
              for B, K, r, dt in ((1, 8192, 64, torch.bfloat16), (32, 8192, 64, torch.bfloat16),
                                  (32, 163840, 256, torch.bfloat16), (32, 163840, 256, torch.float32))]
    return cases


def kernel_checks(args, device: torch.device, guard) -> tuple[list[dict], str | None]:
    """(e) on CUDA, or on a CPU under TRITON_INTERPRET=1; else skipped with the reason."""
    if kaccept.triton is None:
        return [], "skipped: triton is not installed"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpret:
        return [], "skipped: the Triton kernels need CUDA (or TRITON_INTERPRET=1 for the CPU interpreter)"
    rows = []
    for build in kernel_cases(args.cpu_smoke, device):
        if guard():
            return rows, "stopped: time guard"
        try:
            case = build()
            iters = 2 if interpret else args.iters
            for fn in (case["kernel_fn"], case["ref_fn"]):
                fn()  # compile / warm
            case["kernel_ms"] = timed(case.pop("kernel_fn"), iters, device)
            case["ref_ms"] = timed(case.pop("ref_fn"), iters, device)
            rows.append(case)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            rows.append({"kernel": "?", "error": f"{type(e).__name__}: {str(e)[:300]}"})
            traceback.print_exc()
    return rows, "triton interpreter (CPU): timings meaningless" if interpret else None


# ---- the sweep and the report -------------------------------------------------------------------------------------
def sweep(args, device: torch.device, dtype: torch.dtype, guard, skipped: list[str]) -> list[dict]:
    """Every shape × S × B × mode while the time guard allows; a failed case is recorded and the sweep goes on."""
    cases = []
    for name in args.shapes:
        if guard():
            skipped.append(f"shape {name}")
            continue
        draft = build_draft((TINY if args.cpu_smoke else SHAPES)[name], device, dtype)
        cfg = draft.config
        print(f"\n{name}: {cfg.attention_type} attention, {num_parameters(draft) / 1e6:.1f} M draft params, "
              f"V={cfg.vocab_size} K={cfg.draft_vocab} γ={cfg.block_size} aux={cfg.num_aux}", flush=True)
        for S in args.contexts:
            for B in args.batches:
                cases += sweep_context(draft, name, B, S, args, device, dtype, guard, skipped)
        del draft
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return cases


def sweep_context(draft, name, B, S, args, device, dtype, guard, skipped) -> list[dict]:
    if guard():
        skipped.append(f"{name} B={B} S={S}")
        return []
    cache = build_context(draft, B, S, device, dtype)
    out = []
    for mode in args.modes:
        if guard():
            skipped.append(f"{name} {mode} B={B} S={S}")
            continue
        rec = {"shape": name, "attention": draft.config.attention_type, "mode": mode, "B": B, "S": S,
               "capacity": cache.capacity}
        try:
            rec |= run_case(draft, make_inputs(draft, cache, mode), args, device)
        except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
            rec["error"] = f"{type(e).__name__}: {str(e).strip()[:400]}"
            traceback.print_exc()
        print_case(rec)
        out.append(rec)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del cache
    return out


HEADER = (f"{'shape':6} {'attn':4} {'mode':9} {'B':>3} {'S':>5} {'eager ms':>9} {'graph ms':>9} {'graph=eager':>12} "
          f"{'sync':>5} {'MB/step':>9} {'allocs':>6} {'acc':>5} {'=plant':>6}")


def print_case(r: dict) -> None:
    if "error" in r:
        print(f"{r['shape']:6} {r['attention']:4} {r['mode']:9} {r['B']:>3} {r['S']:>5}  ERROR {r['error']}")
        return
    if r["graph"] == "ok":
        eq = "bitwise" if r["graph_bitwise"] else ("allclose" if r["graph_allclose"] else "DIFFERS")
        graph_ms = f"{r['graph_ms']:9.3f}"
    else:
        eq, graph_ms = "-", f"{'-':>9}"
    print(f"{r['shape']:6} {r['attention']:4} {r['mode']:9} {r['B']:>3} {r['S']:>5} {r['eager_ms']:9.3f} {graph_ms} "
          f"{eq:>12} {'ok' if r['sync_ok'] else 'FAIL':>5} {r['alloc_bytes'] / 2**20:9.2f} {r.get('allocs', '-'):>6} "
          f"{r['mean_accepted']:5.2f} {'yes' if r['accepted_as_planted'] else 'NO':>6}", flush=True)
    for key in ("graph", "sync_error"):
        if r.get(key) not in (None, "ok") and not str(r[key]).startswith("skipped"):
            print(f"    {key}: {r[key]}")


def context_dependence(cases: list[dict]) -> list[dict]:
    """(d)'s summary: bytes per step of each (shape, mode, B) at the smallest and the largest S."""
    groups: dict[tuple, dict[int, int]] = {}
    for r in cases:
        if "alloc_bytes" in r:
            groups.setdefault((r["shape"], r["mode"], r["B"]), {})[r["S"]] = r["alloc_bytes"]
    out = []
    for (shape, mode, B), by_s in groups.items():
        lo, hi = min(by_s), max(by_s)
        if lo != hi:
            out.append({"shape": shape, "mode": mode, "B": B, "S": [lo, hi], "alloc_bytes": [by_s[lo], by_s[hi]],
                        "ratio": by_s[hi] / max(by_s[lo], 1)})
    return out


def print_kernels(rows: list[dict], note: str | None) -> None:
    print(f"\n(e) Triton kernels vs torch references{f' ({note})' if note else ''}")
    if rows:
        print(f"{'kernel':12} {'shape':36} {'count≠':>6} {'bonus≠':>6} {'kernel ms':>10} {'ref ms':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:12} ERROR {r['error']}")
            continue
        bonus = "-" if r["bonus_mismatch"] is None else r["bonus_mismatch"]
        extra = f"  max|Δlogit|={r['max_abs_logit_diff']:.2e}" if "max_abs_logit_diff" in r else ""
        print(f"{r['kernel']:12} {r['shape']:36} {r['count_mismatch']:>6} {bonus:>6} {r['kernel_ms']:10.3f} "
              f"{r['ref_ms']:9.3f}{extra}")


def device_info(device: torch.device) -> dict:
    triton = kaccept.triton
    return {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "cuda": torch.version.cuda, "torch": torch.__version__,
            "triton": None if triton is None else triton.__version__,
            "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"}


def parse_args() -> argparse.Namespace:
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    names = lambda s: s.split(",")  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (no CUDA needed)")
    ap.add_argument("--shapes", type=names, default=list(SHAPES))
    ap.add_argument("--modes", type=names, default=list(MODES))
    ap.add_argument("--batches", type=ints, default=None, help="default 1,8,32 (smoke: 1,4)")
    ap.add_argument("--contexts", type=ints, default=None, help="context lengths S; default 1024,4096 (smoke: 32,96)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps per measurement; default 20 (smoke: 3)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=420.0, help="no new case starts after this many seconds")
    ap.add_argument("--no-kernels", action="store_true", help="skip (e)")
    ap.add_argument("--json-out", type=Path, default=None)
    a = ap.parse_args()
    smoke = a.cpu_smoke
    a.batches = a.batches or ([1, 4] if smoke else [1, 8, 32])
    a.contexts = a.contexts or ([32, 96] if smoke else [1024, 4096])
    a.iters = a.iters or (3 if smoke else 20)
    bad = [s for s in a.shapes if s not in SHAPES] + [m for m in a.modes if m not in MODES]
    if bad:
        ap.error(f"unknown shape/mode {bad}; shapes {list(SHAPES)}, modes {list(MODES)}")
    return a


def main() -> None:
    args = parse_args()
    t0 = time.monotonic()
    guard = lambda: time.monotonic() - t0 > args.budget_s  # noqa: E731
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run with --cpu-smoke for the tiny CPU shapes")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    info = device_info(device)
    print(f"{info}\n" + ("CPU smoke: (b) CUDA graphs skipped (need CUDA); (c) and (d) counted by step_counter\n"
                         if args.cpu_smoke else ""), flush=True)
    kernels, kernel_note = ([], "skipped: --no-kernels") if args.no_kernels else kernel_checks(args, device, guard)
    print_kernels(kernels, kernel_note)
    skipped: list[str] = []
    print("\n" + HEADER)
    cases = sweep(args, device, dtype, guard, skipped)
    dependence = context_dependence(cases)
    print("\n(d) bytes allocated per step, smallest vs largest context:")
    for d in dependence:
        print(f"  {d['shape']:6} {d['mode']:9} B={d['B']:<3} S={d['S'][0]}→{d['S'][1]}: "
              f"{d['alloc_bytes'][0] / 2**20:.2f} → {d['alloc_bytes'][1] / 2**20:.2f} MB (×{d['ratio']:.2f})")
    wall = time.monotonic() - t0
    if skipped:
        print(f"\ntime guard ({args.budget_s:.0f} s) reached: skipped {skipped}")
    failed = [c for c in cases if "error" in c or not c.get("sync_ok", False)
              or (c.get("graph") not in (None, "ok") and not args.cpu_smoke)
              or (c.get("graph") == "ok" and not c["graph_allclose"])
              or (c["mode"] == "greedy" and not c.get("accepted_as_planted", False))]
    kernel_bad = [k for k in kernels if "error" in k or (k["strict"] and (k["count_mismatch"] or k["bonus_mismatch"]))]
    ok = not failed and not kernel_bad
    print(f"\n{'PASS' if ok else 'FAIL'}: {len(cases)} cases in {wall:.0f} s, {len(failed)} with a failed check; "
          f"{len(kernel_bad)} strict kernel rows with mismatches or errors")
    if args.json_out:
        inputs = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        result = {"provenance": provenance(**inputs), **info, "kernels": kernels, "kernels_note": kernel_note,
                  "cases": cases,
                  "context_dependence": dependence, "time_guard": {"budget_s": args.budget_s, "skipped": skipped},
                  "wall_s": round(wall, 1)}
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json_out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
