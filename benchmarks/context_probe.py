"""Does a trained draft use what it is given? Per-slot agreement with the target's argmax, intact and ablated.

A DSpark draft sees three things: the target's hidden states of the prefix (the context), the anchor token, and (in
the Markov head) the previous token. This probe runs a run's exported draft over samples of its own training data
(teacher-forced, as in training: slot k of an anchor block predicts token a+k+1 with the true token a+k as the
Markov head's previous token) and counts how often its argmax equals the target's, per slot:

  intact      everything as trained
  no context  the aux hidden states replaced by zeros (fc sees nothing; hidden_norm of 0 is 0)
  other       the aux hidden states of another sample (a context that is well formed but wrong)
  no Markov   the Markov bias left out (the backbone and the target's lm_head alone)

A draft that uses its context loses much of its agreement without it, and most at slot 0 (the token right after the
anchor, the one the context says most about). The recipe's drafts lose little: see docs/training.md.

Where the attention goes: for every draft layer and slot, the mean softmax mass a block row puts on its own block and
on context tokens by distance from the anchor a (a−1, a−2..a−4, a−5..a−16, earlier). A draft that has learned to read
the state right before its block puts much of slot 0's mass on a−1; one that has not spreads it over the context.

  PYTHONPATH=$PWD python benchmarks/context_probe.py runs/smollm2-135m-cpu [--samples 12] [--out FILE]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import torch
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_sgl.loading import resolve_target_dir  # noqa: E402
from dspark_sgl.model.draft import Attention, DSparkDraft, apply_rope  # noqa: E402
from dspark_sgl.provenance import provenance  # noqa: E402
from dspark_sgl.targets.hf import HFTarget  # noqa: E402

MODES = ("intact", "no_context", "other", "no_markov")


def load_samples(run: Path, n: int) -> list[dict]:
    """The first n/2 and last n/2 samples of the run's data cache (the primary source first, the mixture last)."""
    rows = [json.loads(line) for line in (run / "data" / "samples.jsonl").read_text().splitlines()]
    return rows[: n // 2] + rows[len(rows) - (n - n // 2):]


def probe_anchors(sample: dict, S: int, g: int, max_anchors: int) -> torch.Tensor:
    """Anchor positions a whose next token is supervised and whose whole block fits: the first max_anchors."""
    mask = torch.tensor(sample["loss_mask"][:S], dtype=torch.bool)
    return (torch.nonzero(mask[2:S - g + 1]).flatten() + 1)[:max_anchors]


@torch.no_grad()
def agreement(draft: DSparkDraft, samples: list[dict], captures: list, mode: str, max_anchors: int) -> list[float]:
    """Per-slot fraction of anchor blocks whose teacher-forced argmax equals the target's argmax."""
    g, vocab = draft.config.block_size, draft.vocab
    hit, count = torch.zeros(g), torch.zeros(g)
    k = torch.arange(g)
    for i, (ids, aux, target_argmax) in enumerate(captures):
        S = ids.shape[1]
        anchors = probe_anchors(samples[i], S, g, max_anchors)
        if anchors.numel() == 0:
            continue
        if mode == "no_context":
            aux = torch.zeros_like(aux)
        elif mode == "other":
            other = captures[(i + 1) % len(captures)][1]
            aux = other.repeat(1, S // other.shape[1] + 1, 1)[:, :S]
        h = draft.forward_train(ids, aux, anchors[None])[0]  # [N, γ, H]
        prev = ids[0, anchors[:, None] + k]  # the true token a+k: teacher-forced, as the objective does
        logits = draft.base_logits(h)
        if mode != "no_markov":
            logits = logits + draft.markov_head.bias(draft.markov_head.teacher_forced_latent(prev, h)).float()
        pred = logits.argmax(-1)
        pred = vocab[pred] if vocab is not None else pred
        hit += (pred == target_argmax[0, anchors[:, None] + k]).float().sum(0)
        count += anchors.numel()
    return (hit / count.clamp(min=1)).tolist()


DISTANCES = {"a-1": (1, 1), "a-2..4": (2, 4), "a-5..16": (5, 16), "a-17..": (17, 1 << 30)}


@torch.no_grad()
def attention_by_distance(draft: DSparkDraft, samples: list[dict], captures: list, max_anchors: int) -> dict:
    """{layer: {slot: {bin: mean attention mass}}}: where each slot's queries look, per draft layer (GQA drafts)."""
    g, layers = draft.config.block_size, list(draft.layers)
    probs: list[torch.Tensor] = []

    def keep(attn: Attention, args: tuple) -> None:  # recompute the softmax the layer's sdpa call takes
        x, pos, ctx_k, _ctx_v, mask, inv_freq = args
        q = apply_rope(attn.q_norm(attn._heads(attn.q_proj(x), attn.n_heads)), pos, inv_freq).float()
        k = torch.cat((ctx_k, attn.kv(x, pos, inv_freq)[0]), dim=2).float()
        k = k.repeat_interleave(attn.n_heads // attn.n_kv, dim=1)
        scores = (q @ k.transpose(-1, -2)) * attn.head_dim**-0.5
        probs.append(scores.masked_fill(~mask, float("-inf")).softmax(-1)[0].mean(0))  # [N·γ, S + N·γ], head mean

    hooks = [layer.self_attn.register_forward_pre_hook(keep) for layer in layers]
    sums = {(li, k, b): 0.0 for li in range(len(layers)) for k in range(g) for b in (*DISTANCES, "own block")}
    blocks = 0
    try:
        for i, (ids, aux, _) in enumerate(captures):
            S = ids.shape[1]
            anchors = probe_anchors(samples[i], S, g, max_anchors)
            if anchors.numel() == 0:
                continue
            probs.clear()
            draft.forward_train(ids, aux, anchors[None])
            dist = anchors[:, None] - torch.arange(S)[None, :]  # [N, S]: distance of each context token
            for li, p in enumerate(probs):
                p = p.view(anchors.numel(), g, -1)
                for k in range(g):
                    for b, (lo, hi) in DISTANCES.items():
                        sums[(li, k, b)] += (p[:, k, :S] * ((dist >= lo) & (dist <= hi))).sum().item()
                    sums[(li, k, "own block")] += p[:, k, S:].sum().item()
            blocks += anchors.numel()
    finally:
        for h in hooks:
            h.remove()
    return {f"layer {li}": {f"slot {k}": {b: round(sums[(li, k, b)] / max(blocks, 1), 4)
                                          for b in (*DISTANCES, "own block")} for k in range(g)}
            for li in range(len(layers))}


def main(
    run: Annotated[Path, typer.Argument(help="a training run folder (its draft/ and data/samples.jsonl)")],
    samples: Annotated[int, typer.Option(help="samples probed: half from the data's head, half from its tail")] = 12,
    max_anchors: Annotated[int, typer.Option(help="anchor blocks per sample")] = 128,
    threads: Annotated[int, typer.Option()] = 2,
    out: Annotated[Path | None, typer.Option(help="result JSON")] = None,
) -> None:
    torch.set_num_threads(threads)
    draft = DSparkDraft.from_pretrained(run / "draft")
    target = HFTarget.from_pretrained(resolve_target_dir("smollm2"), draft.config.target_layer_ids,
                                      dtype=torch.float32, device="cpu")
    draft.bind_target(target.embed_tokens, target.lm_head)
    rows = load_samples(run, samples)
    captures = []
    for r in rows:
        ids = torch.tensor([r["input_ids"]])
        cap = target.capture(ids)
        captures.append((ids, cap.aux, target.lm_head(cap.last_hidden).argmax(-1)))
    results = {}
    for mode in MODES:
        results[mode] = agreement(draft, rows, captures, mode, max_anchors)
        print(f"{mode:>10}  " + "  ".join(f"{x:.3f}" for x in results[mode]), flush=True)
    attention = None
    if not draft.config.is_mla:
        attention = attention_by_distance(draft, rows, captures, max_anchors)
        print("attention mass by distance from the anchor (mean over heads and blocks):")
        for layer, slots in attention.items():
            for slot, bins in slots.items():
                print(f"  {layer} {slot}: " + "  ".join(f"{b} {m:.3f}" for b, m in bins.items()))
    if out is not None:
        out.write_text(json.dumps({"provenance": provenance(run=str(run), samples=samples, max_anchors=max_anchors),
                                   "per_slot_agreement": results, "attention_by_distance": attention},
                                  indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    typer.run(main)
