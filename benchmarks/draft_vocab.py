"""Draft step time by draft vocabulary size K: backbone, lm_head, Markov rollout, confidence (ms per step).

The CPU recipe's draft shape (configs/smollm2-135m-cpu.yaml: SmolLM2-135M target, V = 49,152, H = 576, 2 layers,
γ = 7, Markov rank 64) at batch 1 against a 256-token context, random weights (speed does not depend on them), the
rollout and timer of the reference engine (`dspark_sgl.speculative.markov.rollout`, `StepTimer`). Optionally also
the held-out coverage of a vocabulary built from token samples (`--train-samples`, `--heldout-samples`).

    python benchmarks/draft_vocab.py [--sizes 49152 32768 16384 8192 4096 --threads 1 --steps 60]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

from dspark_sgl.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def draft_for(K: int, args):
    from dspark_sgl.config import DSparkConfig
    from dspark_sgl.model.draft import DSparkDraft

    H, V = args.hidden, args.vocab
    cfg = DSparkConfig(hidden_size=H, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                       intermediate_size=1536, vocab_size=V, block_size=7, target_layer_ids=[1, 8, 14, 18, 26][:5],
                       num_target_layers=30, mask_token_id=16, markov_rank=64, rope_theta=100000.0,
                       draft_vocab_size=K)
    torch.manual_seed(0)
    draft = DSparkDraft(cfg).eval()
    if cfg.reduced_vocab:
        draft.set_vocab(torch.randperm(V)[:K])
    embed, head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    nn.init.normal_(head.weight, std=1 / math.sqrt(H))
    return draft.bind_target(embed.requires_grad_(False), head.requires_grad_(False))


@torch.no_grad()
def step_split(K: int, args) -> dict:
    from dspark_sgl.model.draft import DraftContextCache
    from dspark_sgl.speculative.markov import rollout
    from dspark_sgl.speculative.timing import StepTimer

    draft = draft_for(K, args)
    ctx = DraftContextCache(draft, 1, "cpu", torch.float32)
    ctx.append(torch.randn(1, args.context, 5 * args.hidden), torch.tensor([args.context]))
    anchor = torch.tensor([42])
    laps = []
    for i in range(args.warmup + args.steps):
        t = StepTimer()
        h = draft.forward_step(anchor, ctx)
        t.lap("backbone")
        rollout(draft, h, anchor, 0.0, None, t)
        if i >= args.warmup:
            laps.append(dict(t.seconds))
    med = {k: 1e3 * statistics.median(lap[k] for lap in laps) for k in laps[0]}
    med["total"] = 1e3 * statistics.median(sum(lap.values()) for lap in laps)
    return {"K": K, **med}


def coverage_rows(args, sizes) -> list[dict]:
    from dspark_sgl.vocab import choose_vocab, coverage, read_token_samples, stop_token_ids, token_counts

    train = token_counts(read_token_samples(args.train_samples), args.vocab)
    held = token_counts(read_token_samples(args.heldout_samples), args.vocab)
    stops = stop_token_ids(args.target_dir) if args.target_dir else set()
    rows = []
    for K in sizes:
        ids = choose_vocab(train, K, stops)
        rows.append({"K": K, "train": coverage(train, ids), "heldout": coverage(held, ids)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[49152, 32768, 16384, 8192, 4096])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--train-samples", help="token-sample JSONL the vocabulary is built from")
    ap.add_argument("--heldout-samples", help="token-sample JSONL to measure coverage on")
    ap.add_argument("--target-dir", help="target folder (its stop tokens join the vocabulary)")
    ap.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "draft_vocab.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for K in args.sizes:
        rows.append(step_split(K, args))
        r = rows[-1]
        print(f"K {K:6d}: draft step {r['total']:6.2f} ms = backbone {r['backbone']:.2f} + lm_head {r['lm_head']:.2f} "
              f"+ markov {r['markov']:.2f} + confidence {r['confidence']:.2f}", flush=True)
    out = {"meta": {k: getattr(args, k) for k in ("vocab", "hidden", "context", "threads", "steps")}, "steps": rows}
    if args.train_samples and args.heldout_samples:
        out["coverage"] = coverage_rows(args, args.sizes)
        for c in out["coverage"]:
            print(f"K {c['K']:6d}: coverage train {100 * c['train']:.2f} %, held-out {100 * c['heldout']:.2f} %")
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    out = {"provenance": provenance(**vars(args)), **out}
    Path(args.json_out).write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
