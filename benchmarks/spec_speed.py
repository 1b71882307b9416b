"""The reference engine, plain target decoding vs DSpark on the same prompts in the same run: tok/s ratio, τ, and
where the milliseconds of a decode step go (draft, rollout, verify forward, accept, commit/KV bookkeeping, other).

Plain decoding runs through the same engine loop (the baseline shares every line but the draft). Drafts (--draft,
repeatable): `random` (a random-init draft sized for the target, τ ≈ 1: the engine's overhead at full draft cost) or
a draft folder (`dspark init-draft --layers 2 --markov-rank 64` has the recipe's shape). Each --tau adds an oracle
built on the first draft: its forward pass and lm_head run as usual (real cost), then its block logits are overridden
so that the first k drafts of each step are the target's own greedy continuation (k drawn per row and step with
P(k ≥ i) = α^i, α solved from τ): a controllable τ at the draft's real cost; the τ printed is the one measured.
T = 0 token identity against plain decoding is counted for every prompt, and required in float32.

    python benchmarks/spec_speed.py [--draft random] [--tau 2 --tau 3] [--batch-size 1 --batch-size 10]
                                    [--dtype auto --dtype float32] [--limit 10] [--max-new-tokens 64]
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.table import Table

from dspark_sgl.dtypes import dtype_name, resolve_dtype
from dspark_sgl.evaluate import read_prompts
from dspark_sgl.loading import encode_prompt, eos_ids, load_pair
from dspark_sgl.model.draft import DraftContextCache, DSparkDraft
from dspark_sgl.provenance import provenance
from dspark_sgl.speculative.engine import SamplingConfig, SpecEngine
from dspark_sgl.speculative.timing import STEP_PHASES

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval" / "gsm8k.jsonl"
RESULTS = Path(__file__).resolve().parent / "results"


class OracleDraft(DSparkDraft):
    """A draft that proposes the target's own continuation for a random number of tokens per step.

    Its forward pass and lm_head are the wrapped draft's (real cost); base_logits then adds a large logit on the chosen
    token of each block position, so the Markov rollout picks it. Rows are matched to the reference sequences of the
    batch in order (finished rows leave the batch in order) by their committed length and anchor token; a row that
    left the reference (bf16 can diverge from plain decoding) gets no help and its τ drops: the τ reported is measured.
    """

    def set_reference(self, seqs: list[list[int]], alpha: float, seed: int = 0) -> None:
        self.seqs, self.alpha = seqs, alpha
        self.gen = torch.Generator().manual_seed(seed)

    def forward_step(self, anchor_ids, cache: DraftContextCache):
        self._rows = (anchor_ids.tolist(), cache.lengths.tolist())
        return super().forward_step(anchor_ids, cache)

    def base_logits(self, h):
        base = super().base_logits(h)
        B, gamma, V = base.shape
        k = (torch.rand(B, gamma, generator=self.gen) < self.alpha).long().cumprod(1).sum(1)  # P(k >= i) = α^i
        picks = torch.zeros(B, gamma, dtype=torch.long)
        r = 0
        for b, (a, n) in enumerate(zip(*self._rows, strict=True)):
            hit = next((j for j in range(r, len(self.seqs)) if n < len(self.seqs[j]) and self.seqs[j][n] == a), None)
            if hit is None:
                continue
            r, seq = hit + 1, self.seqs[hit]
            for i in range(gamma):
                true = seq[n + 1 + i] if n + 1 + i < len(seq) else 0
                picks[b, i] = true if i < k[b] else (true + 1) % V  # the first wrong draft ends the accepted run
        big = torch.full((B, gamma, 1), 1e4, device=base.device)
        return base.scatter_add(-1, picks[..., None].to(base.device), big)


def tau_to_alpha(tau: float, gamma: int) -> float:
    """α with 1 + Σ_{i=1..γ} α^i = τ (bisection)."""
    if not 1.0 <= tau <= gamma + 1:
        raise typer.BadParameter(f"--tau {tau} must lie in [1, γ+1 = {gamma + 1}]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 1 + sum(mid ** i for i in range(1, gamma + 1)) < tau else (lo, mid)
    return (lo + hi) / 2


def run(engine: SpecEngine, prompts, max_new: int, eos, batch_size: int, refs=None, alpha: float = 0.0) -> dict:
    """Generate all prompts in batches; tok/s and the engine's per-step phase milliseconds of this run."""
    before = dict(engine.step_s), engine.steps, engine.prefill_s
    gens, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        if refs is not None:
            engine.draft.set_reference([p + r for p, r in zip(prompts[i : i + batch_size], refs[i : i + batch_size],
                                                               strict=True)], alpha, seed=i)
        gens += engine.generate(prompts[i : i + batch_size], max_new, SamplingConfig(), eos)
    secs = time.perf_counter() - t0
    steps = engine.steps - before[1]
    ms = {k: 1e3 * (engine.step_s[k] - before[0][k]) / max(steps, 1) for k in STEP_PHASES}
    accepted = [c for g in gens for c in g.stats.accepted]
    tokens = sum(len(g.token_ids) for g in gens)
    return {"gens": gens, "seconds": secs, "tokens": tokens, "tok_s": tokens / secs, "steps": steps,
            "step_ms": ms, "step_ms_total": sum(ms.values()), "prefill_ms": 1e3 * (engine.prefill_s - before[2]),
            "tau": 1 + sum(accepted) / len(accepted) if accepted else None}


def main(
    draft: Annotated[list[str] | None, typer.Option(help="random | a draft folder; repeatable.")] = None,
    tau: Annotated[list[float] | None, typer.Option(help="Oracle τ targets on the first draft; repeatable (default 2 "
                                                    "and 3; 0: no oracle).")] = None,
    target: str = "smollm2",
    data: Annotated[Path, typer.Option(help="Prompt file ({'turns': [...]} JSONL).")] = DEFAULT_DATA,
    limit: int = 10,
    max_new_tokens: int = 64,
    batch_size: Annotated[list[int] | None, typer.Option(help="Repeatable (default 1 and 10).")] = None,
    dtype: Annotated[list[str] | None, typer.Option(help="Repeatable (default auto and float32).")] = None,
    threads: int = 0,
    json_out: Path = RESULTS / "spec_speed.json",
) -> None:
    if threads:
        torch.set_num_threads(threads)
    drafts, taus = draft or ["random"], [t for t in tau or [2.0, 3.0] if t]
    rows = []
    for dt in dtype or ["auto", "float32"]:
        tgt, first, tok = load_pair(target, drafts[0], dt)  # the target captures the layers the drafts read
        models = [first] + [load_pair(target, d, dt)[1] for d in drafts[1:]]
        eos = eos_ids(tok, tgt)
        prompts = [encode_prompt(tok, t, chat=True) for t in read_prompts(data, limit)]
        name = dtype_name(resolve_dtype(dt, quiet=True))
        variants = [(d if d == "random" else Path(d).name, m, 0.0) for d, m in zip(drafts, models, strict=True)]
        if taus:
            oracle = OracleDraft(models[0].config).to(models[0].fc.weight.dtype)
            oracle.load_state_dict(models[0].state_dict())
            variants += [(f"oracle τ≈{t:g}", oracle, tau_to_alpha(t, oracle.config.block_size)) for t in taus]
        for bs in batch_size or [1, 10]:
            plain = SpecEngine(tgt)
            run(plain, prompts[:1], 8, eos, 1)  # warm-up
            base = run(plain, prompts, max_new_tokens, eos, bs)
            ref = [g.token_ids for g in base["gens"]]
            rows.append(record(name, bs, "plain", base, base, ref))
            for label, model, alpha in variants:
                spec = SpecEngine(tgt, model)
                refs = ref if isinstance(model, OracleDraft) else None
                run(spec, prompts[:1], 8, eos, 1, refs and refs[:1], alpha)  # warm-up
                rows.append(record(name, bs, label, run(spec, prompts, max_new_tokens, eos, bs, refs, alpha), base,
                                   ref))
    report(rows, max_new_tokens, limit)
    json_out.parent.mkdir(parents=True, exist_ok=True)
    prov = provenance(target=target, data=str(data), limit=limit, max_new_tokens=max_new_tokens, drafts=drafts,
                      oracle_taus=taus, threads=torch.get_num_threads(), temperature=0.0)
    prov["load_avg_1_5_15"] = os.getloadavg()  # a shared box: how busy it was when the run ended
    json_out.write_text(json.dumps({"provenance": prov, "rows": rows}, indent=2) + "\n")
    Console(stderr=True).print(f"wrote {json_out}")
    bad = [(r["dtype"], r["batch"], r["engine"]) for r in rows if r["dtype"] == "float32" and
           r["identical"] != r["prompts"]]
    if bad:
        raise SystemExit(f"T=0 output differs from plain greedy decoding in float32 for {bad}: a bug, not noise")


def record(dtype: str, batch: int, engine: str, res: dict, base: dict, ref: list[list[int]]) -> dict:
    Console(stderr=True).print(f"{dtype} batch {batch} {engine}: {res['tok_s']:.1f} tok/s, "
                               f"{res['step_ms_total']:.1f} ms/step, τ {res['tau'] or 1:.2f}")
    return {"dtype": dtype, "batch": batch, "engine": engine, "prompts": len(ref), "tokens": res["tokens"],
            "tau": res["tau"], "tok_s": res["tok_s"], "ratio": res["tok_s"] / base["tok_s"], "steps": res["steps"],
            "step_ms": res["step_ms"], "step_ms_total": res["step_ms_total"], "prefill_ms": res["prefill_ms"],
            "ms_per_token": 1e3 * res["seconds"] / res["tokens"],
            "identical": sum(g.token_ids == r for g, r in zip(res["gens"], ref, strict=True))}


def report(rows: list[dict], max_new: int, limit: int) -> None:
    table = Table(title=f"reference engine, T=0, {limit} prompts × {max_new} new tokens: ms per decode step by phase")
    cols = ("dtype", "batch", "engine", "τ", "tok/s", "vs plain", "identical", *STEP_PHASES, "step ms", "ms/token")
    for col in cols:
        table.add_column(col, justify="left" if col in ("dtype", "engine") else "right")
    for r in rows:
        table.add_row(r["dtype"], str(r["batch"]), r["engine"], "-" if r["tau"] is None else f"{r['tau']:.2f}",
                      f"{r['tok_s']:.1f}", f"{r['ratio']:.2f}x", f"{r['identical']}/{r['prompts']}",
                      *(f"{r['step_ms'][p]:.1f}" for p in STEP_PHASES), f"{r['step_ms_total']:.1f}",
                      f"{r['ms_per_token']:.1f}")
    Console(width=200).print(table)


if __name__ == "__main__":
    typer.run(main)
