"""T = 0 identity of a reduced-vocabulary draft in the reference engine: DSpark output vs plain target decoding.

Runs the held-out GSM8K prompts (the first 50; the CPU recipe trains on 51-306) through SpecEngine with and without
the draft (fp32) and reports how many outputs are token-identical, τ, and the share of the target's output tokens
inside the draft vocabulary. Also writes the target's outputs as {"token_ids"} JSONL (held-out coverage data for
`dspark build-vocab --heldout` / benchmarks/draft_vocab.py).

    python benchmarks/vocab_identity.py --draft DIR [--data ../shared/data/eval/gsm8k.jsonl --limit 50]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dspark_sgl.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from dspark_sgl.evaluate import read_prompts
    from dspark_sgl.loading import encode_prompt, eos_ids, load_pair
    from dspark_sgl.speculative.engine import SpecEngine

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", required=True)
    ap.add_argument("--data", default="../shared/data/eval/gsm8k.jsonl")
    ap.add_argument("--limit", type=int, default=50)
    ap.add_argument("--skip", type=int, default=0, help="start at this prompt (split a run over processes)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--outputs", default=None, help="write the target's outputs here ({token_ids} JSONL)")
    ap.add_argument("--json-out", default=str(ROOT / "benchmarks" / "results" / "vocab_identity.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, tok = load_pair("smollm2", args.draft, "float32")
    eos = eos_ids(tok, target)
    prompts = [encode_prompt(tok, t, chat=True) for t in read_prompts(args.data, args.limit)[args.skip:]]
    runs = {}
    for name, engine in (("plain", SpecEngine(target)), ("dspark", SpecEngine(target, draft, time_split=True))):
        t0, gens = time.perf_counter(), []
        for i in range(0, len(prompts), args.batch_size):
            gens += engine.generate(prompts[i:i + args.batch_size], args.max_new_tokens, eos_token_ids=eos)
        runs[name] = (gens, time.perf_counter() - t0)
        print(f"{name}: {sum(len(g.token_ids) for g in gens)} tokens in {runs[name][1]:.0f} s", flush=True)
    plain, spec = runs["plain"][0], runs["dspark"][0]
    same = sum(a.token_ids == b.token_ids for a, b in zip(plain, spec, strict=True))
    steps = [c for g in spec for c in g.stats.accepted]
    out_tokens = torch.tensor([t for g in plain for t in g.token_ids])
    vocab = draft.vocab
    cov = float(torch.isin(out_tokens, vocab).float().mean()) if vocab is not None else 1.0
    split = {k: 1e3 * sum(g.stats.draft_split[k] for g in spec) / max(len(steps), 1) for k in spec[0].stats.draft_split}
    res = {"prompts": len(prompts), "first_prompt": args.skip, "identical": same,
           "tau": 1 + sum(steps) / max(len(steps), 1),
           "draft_vocab": draft.config.draft_vocab, "heldout_coverage": cov, "draft_step_ms": split,
           "plain_s": runs["plain"][1], "dspark_s": runs["dspark"][1]}
    print(json.dumps(res, indent=1))
    if args.outputs:
        Path(args.outputs).write_text("".join(json.dumps({"token_ids": g.token_ids}) + "\n" for g in plain))
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    res = {"provenance": provenance(**vars(args)), **res}
    Path(args.json_out).write_text(json.dumps(res, indent=2, default=str))


if __name__ == "__main__":
    main()
