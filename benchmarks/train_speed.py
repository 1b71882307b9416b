"""Training-objective speed and memory: ours (`training.objective`) vs SpecForge 0.2.0's DSpark objective.

Same draft weights (SpecForge loads our checkpoint folder), same batch, same anchors, same loss weights; each
measurement runs in a fresh subprocess so its peak RSS is its own. Reports anchor-tokens/s (supervised block slots
through forward + backward per second) and peak RSS above the process's state after building the models, over a
range of anchor counts: the full-vocabulary part of ours is chunked with gradients formed in forward, so its memory
should not grow with the number of anchors; SpecForge's checkpointed 128-block chunks recompute in backward.

    python benchmarks/train_speed.py [--vocab 49152 --hidden 576 --seq 512 --anchors 64 128 256 --threads 1]
                                     [--draft-vocab-sizes 49152 8192]   (ours only below V: SpecForge has no d2t)

SpecForge is bench-only: `pip install --no-deps specforge==0.2.0`.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from dspark_sgl.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_mib() -> float:
    """Peak resident set of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def build(args):
    from dspark_sgl.config import DSparkConfig
    from dspark_sgl.model.draft import DSparkDraft

    H, V = args.hidden, args.vocab
    cfg = DSparkConfig(hidden_size=H, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, head_dim=H // args.heads, intermediate_size=args.ffn,
                       vocab_size=V, block_size=7, target_layer_ids=list(range(args.aux)),
                       num_target_layers=args.aux + 2, mask_token_id=V - 1, markov_rank=args.markov_rank,
                       draft_vocab_size=args.point_vocab)
    torch.manual_seed(0)
    draft = DSparkDraft(cfg)
    if cfg.reduced_vocab:  # a random hot set: most labels fall outside it, which costs nothing extra
        draft.set_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(2))[:cfg.draft_vocab])
    embed, lm_head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    nn.init.normal_(lm_head.weight, std=1 / math.sqrt(H))
    embed.requires_grad_(False), lm_head.requires_grad_(False)
    draft.bind_target(embed, lm_head)
    g = torch.Generator().manual_seed(1)
    B, S = args.batch, args.seq
    ids = torch.randint(0, V - 1, (B, S), generator=g)
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[:, S // 8:] = True  # a prompt, then a supervised answer
    from training.objective import Batch

    batch = Batch(ids, mask, torch.full((B,), S), torch.arange(B), torch.randn(B, S, args.aux * H, generator=g),
                  torch.randn(B, S, H, generator=g))
    return draft, batch


def measure(args) -> dict:
    """One (impl, anchors) point in this process."""
    torch.set_num_threads(args.threads)
    from training.objective import ObjectiveConfig, anchor_seed, compute_objective, sample_anchors

    draft, batch = build(args)
    anchors, valid = sample_anchors(batch.loss_mask, batch.lengths, args.point_anchors,
                                    [anchor_seed(0, 0, i) for i in range(batch.input_ids.shape[0])])
    if args.impl == "ours":
        cfg = ObjectiveConfig(num_anchors=args.point_anchors, vocab_chunk_rows=args.chunk_rows)

        def step():
            out = compute_objective(draft, batch, anchors, valid, cfg)
            (out.numerator / out.weight_sum).backward()
            return out.stats[0].sum()
        model = draft
    else:
        model = specforge_model(draft, args)
        model._sample_anchor_positions = lambda *_: (anchors, valid)

        def step():
            loss, _, metrics = model(batch.input_ids, batch.aux_hidden, batch.loss_mask.float(), batch.last_hidden)
            loss.backward()
            return metrics["accuracy_denom"]
    base = current_rss_mib()  # models and batch built; the objective's own memory comes on top
    step()  # warm-up (allocator, kernels)
    model.zero_grad(set_to_none=True)
    times, slots = [], 0.0
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        slots = float(step())
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    t = sorted(times)[len(times) // 2]
    return {"impl": args.impl, "draft_vocab": args.point_vocab, "anchors": args.point_anchors, "slots": slots,
            "step_s": t,
            "anchor_tokens_per_s": slots / t, "peak_rss_mib": rss_mib(), "peak_over_base_mib": rss_mib() - base}


def specforge_model(draft, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from safetensors.torch import load_file
        from specforge.algorithms.common.dflash_family_model import OnlineDSparkModel
        from specforge.modeling import auto as sf_auto
    with tempfile.TemporaryDirectory() as tmp:
        draft.save_pretrained(tmp)
        conf = sf_auto.AutoDraftModelConfig.from_file(str(Path(tmp) / "config.json"))
        conf._attn_implementation = "sdpa"
        sf_draft = sf_auto.AutoDraftModel.from_config(conf).float()
        sf_draft.load_state_dict(load_file(str(Path(tmp) / "model.safetensors")), strict=True)
    del draft.markov_head  # only SpecForge's copy lives on
    return OnlineDSparkModel(sf_draft, draft.target.lm_head, draft.target.embed_tokens, args.vocab - 1, block_size=7,
                             attention_backend="sdpa", num_anchors=args.point_anchors, loss_decay_gamma=4.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--aux", type=int, default=5)
    ap.add_argument("--markov-rank", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--anchors", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--chunk-rows", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--impls", nargs="+", default=["ours", "specforge"])
    ap.add_argument("--draft-vocab-sizes", type=int, nargs="+", default=None, help="K values (default: V only)")
    ap.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "train_speed.json"))
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    ap.add_argument("--point-anchors", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--point-vocab", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.impl:  # a child measuring one point
        print(json.dumps(measure(args)))
        return
    rows = []
    for K in args.draft_vocab_sizes or [args.vocab]:
        for n in args.anchors:
            for impl in args.impls:
                if impl == "specforge" and K != args.vocab:
                    continue  # SpecForge's DSpark trainer has no reduced vocabulary
                cmd = [sys.executable, __file__, *sys.argv[1:], "--impl", impl, "--point-anchors", str(n),
                       "--point-vocab", str(K)]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"{impl} @ K={K}, {n} anchors failed:\n{out.stderr[-2000:]}")
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                r = rows[-1]
                print(f"{impl:>9} K {K:6d} anchors {n:4d}: {r['anchor_tokens_per_s']:8.0f} anchor-tok/s, step "
                      f"{r['step_s']:.2f} s, peak RSS {r['peak_rss_mib']:.0f} MiB (+{r['peak_over_base_mib']:.0f} "
                      "over base)", flush=True)
    meta = {k: getattr(args, k) for k in ("vocab", "hidden", "layers", "seq", "batch", "chunk_rows", "threads")}
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    record = {"provenance": provenance(**vars(args)), "meta": meta, "rows": rows}
    Path(args.json_out).write_text(json.dumps(record, indent=2, default=str))
    print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
