"""Where a CPU training step goes, by sample length: the target's capture, the sparse teacher, the draft's
forward + objective and its backward, on 4-sample micro-batches of a run's own data (1 thread, bf16, as one rank
of the CPU recipe). Why: a capture costs its tokens while every sample gives the same number of anchors, so the
length samples are cut at sets how many steps an hour buys (configs/smollm2-135m-cpu.yaml, `data.max_length`).

  PYTHONPATH=$PWD python benchmarks/step_profile.py runs/smollm2-135m-cpu --lengths 512,256 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_sgl.loading import resolve_target_dir  # noqa: E402
from dspark_sgl.model.draft import DSparkDraft  # noqa: E402
from dspark_sgl.provenance import provenance  # noqa: E402
from dspark_sgl.targets.hf import HFTarget  # noqa: E402
from training.objective import Batch, ObjectiveConfig, Teacher, compute_objective, sample_anchors  # noqa: E402
from training.sources import MemoryCachedSource  # noqa: E402


def micro_batch(rows: list[dict], max_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, loss mask, attention mask and lengths of rows cut at max_length."""
    L = torch.tensor([min(len(r["input_ids"]), max_length) for r in rows])
    ids, mask, attn = (torch.zeros(len(rows), int(L.max()), dtype=d) for d in (torch.long, torch.bool, torch.long))
    for b, r in enumerate(rows):
        n = int(L[b])
        ids[b, :n], mask[b, :n], attn[b, :n] = torch.tensor(r["input_ids"][:n]), torch.tensor(r["loss_mask"][:n]), 1
    return ids, mask, attn, L


def profile(draft, target, rows, max_length: int, cfg: ObjectiveConfig, seed: int) -> dict:
    ids, mask, attn, L = micro_batch(rows, max_length)
    t0 = time.perf_counter()
    cap = target.capture(ids, attn)
    t1 = time.perf_counter()
    src = MemoryCachedSource(None, 0)  # the recipe's own sparse teacher: top-k at the supervised rows only
    src.teacher_head = (target.lm_head.weight, cfg.teacher_topk)
    ts = [src._teacher(cap.last_hidden[b, : int(L[b])], mask[b, : int(L[b])]) for b in range(len(rows))]
    pad = lambda t, n, fill=0: torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, n - t.shape[0]), value=fill)  # noqa: E731
    S = ids.shape[1]
    teacher = Teacher(torch.stack([pad(t.ids, S) for t in ts]), torch.stack([pad(t.probs, S) for t in ts]),
                      torch.stack([pad(t.rest, S, 1.0) for t in ts]))
    t2 = time.perf_counter()
    anchors, valid = sample_anchors(mask, L, cfg.num_anchors, [seed + b for b in range(len(rows))])
    out = compute_objective(draft, Batch(ids, mask, L, torch.arange(len(rows)), cap.aux, None, teacher), anchors, valid,
                            cfg)
    t3 = time.perf_counter()
    out.numerator.backward()
    t4 = time.perf_counter()
    draft.zero_grad(set_to_none=True)
    return {"tokens": int(L.sum()), "padded": int(ids.numel()), "capture_s": t1 - t0, "teacher_s": t2 - t1,
            "forward_objective_s": t3 - t2, "backward_s": t4 - t3, "step_s": t4 - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="a run folder (its draft/ and data/samples.jsonl)")
    ap.add_argument("--lengths", default="512,256")
    ap.add_argument("--batches", type=int, default=4, help="micro-batches of 4 samples per length")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    draft = DSparkDraft.from_pretrained(args.run / "draft").to(torch.bfloat16)
    target = HFTarget.from_pretrained(resolve_target_dir("smollm2"), draft.config.target_layer_ids,
                                      dtype=torch.bfloat16, device="cpu")
    draft.bind_target(target.embed_tokens, target.lm_head)
    rows = [json.loads(line) for line in (args.run / "data" / "samples.jsonl").read_text().splitlines()]
    rows = random.Random(1).sample(rows, 4 * args.batches)
    cfg = ObjectiveConfig(num_anchors=64, teacher_topk=64, vocab_chunk_rows=64)  # the CPU recipe's objective
    results = {}
    for n in (int(x) for x in args.lengths.split(",")):
        runs = [profile(draft, target, rows[4 * i: 4 * i + 4], n, cfg, 10 * i) for i in range(args.batches)]
        results[n] = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
        print(f"max_length {n}: " + ", ".join(f"{k} {v:.2f}" for k, v in results[n].items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"provenance": provenance(run=str(args.run), batches=args.batches),
                                        "mean_per_micro_batch": results}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
