"""Acceptance evaluation over `{"turns": [...]}` JSONL files (the first turn, through the target's chat template)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dspark_sgl.loading import encode_prompt
from dspark_sgl.progress import ProgressLine
from dspark_sgl.speculative.engine import Generation, SamplingConfig, SpecEngine


@dataclass
class DatasetReport:
    name: str
    prompts: int
    tau: float  # mean accepted + bonus per verify step, pooled over all steps
    tau_per_request: float  # mean over requests of each request's τ
    per_position_accept: list[float]  # P(draft k accepted), k = 1..γ, pooled over steps
    tokens: int
    seconds: float
    tokens_per_s: float
    draft_s: float
    verify_s: float
    draft_step_ms: dict[str, float] = field(default_factory=dict)  # per draft step: backbone/lm_head/markov/conf
    draft_vocab_coverage: float | None = None  # reduced vocabulary: share of the output tokens inside it
    step_ms: dict[str, float] = field(default_factory=dict)  # per engine step (batch), by timing.STEP_PHASES
    match: dict | None = None  # the hybrid (--match): share of request-steps verifying a match, τ by source


def iter_jsonl(path: str | Path, what: str, error: type[Exception] = ValueError,
               missing: type[Exception] = FileNotFoundError):
    """(line number, record) of a JSONL file, blank lines skipped; a missing file or a bad line is one error."""
    path = Path(path)
    if not path.exists():
        raise missing(f"{what} {path} does not exist")
    for i, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            try:
                yield i + 1, json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{i + 1} is not JSON: {e}") from e


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    out = []
    for n, rec in iter_jsonl(path, "eval data"):
        try:
            turn = rec["turns"][0]
        except (KeyError, IndexError, TypeError) as e:
            raise ValueError(f"{path}:{n} is not a {{\"turns\": [...]}} record: {e}") from e
        out.append(turn if isinstance(turn, str) else turn.get("content", ""))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def summarize(name: str, gens: list[Generation], seconds: float, gamma: int, vocab: torch.Tensor | None = None
              ) -> DatasetReport:
    steps = [c for g in gens for c in g.stats.accepted]
    n = max(len(steps), 1)
    tokens = sum(len(g.token_ids) for g in gens)
    phases = gens[0].stats.draft_split if gens else {}
    split = {k: 1e3 * sum(g.stats.draft_split[k] for g in gens) / n for k in phases}
    cov = None
    if vocab is not None:
        inside = torch.isin(torch.tensor([t for g in gens for t in g.token_ids], dtype=torch.long), vocab.cpu())
        cov = float(inside.float().mean()) if inside.numel() else 1.0
    return DatasetReport(
        name=name,
        prompts=len(gens),
        tau=1.0 + sum(steps) / n,
        tau_per_request=sum(g.stats.tau for g in gens) / max(len(gens), 1),
        per_position_accept=[sum(c >= k for c in steps) / n for k in range(1, gamma + 1)],
        tokens=tokens,
        seconds=seconds,
        tokens_per_s=tokens / max(seconds, 1e-9),
        draft_s=sum(g.stats.draft_s for g in gens) / max(len(gens), 1),
        verify_s=sum(g.stats.verify_s for g in gens) / max(len(gens), 1),
        draft_step_ms=split,
        draft_vocab_coverage=cov,
        match=match_report(gens) if any(g.stats.from_match for g in gens) else None,
    )


def match_report(gens: list[Generation]) -> dict:
    """The hybrid's counters over these generations: request-steps per source, the share that verified a match, and
    the accept length (accepted + bonus per step) by source."""
    from dspark_sgl.speculative.match import MatchCounters

    counters = MatchCounters()
    for g in gens:
        for c, m in zip(g.stats.accepted, g.stats.from_match, strict=True):
            counters.add(m, c)
    return counters.to_dict()


def evaluate_dataset(
    engine: SpecEngine,
    tokenizer,
    path: str | Path,
    limit: int | None,
    max_new_tokens: int,
    sampling: SamplingConfig,
    eos: set[int],
    batch_size: int = 1,
) -> tuple[DatasetReport, list[Generation]]:
    prompts = [encode_prompt(tokenizer, t, chat=True) for t in read_prompts(path, limit)]
    gens: list[Generation] = []
    step_s, steps = dict(engine.step_s), engine.steps
    t0 = time.perf_counter()
    line = ProgressLine(f"eval {Path(path).name}", len(prompts), every_s=20)
    for i in range(0, len(prompts), batch_size):
        gens += engine.generate(prompts[i : i + batch_size], max_new_tokens, sampling, eos)
        line.update(len(prompts[i : i + batch_size]))
    vocab = engine.draft.vocab if engine.draft is not None else None
    rep = summarize(Path(path).stem, gens, time.perf_counter() - t0, engine.gamma, vocab)
    n = max(engine.steps - steps, 1)
    rep.step_ms = {k: 1e3 * (v - step_s[k]) / n for k, v in engine.step_s.items()}
    return rep, gens


def plot_acceptance(report: DatasetReport, path: str | Path) -> Path:
    """Bar chart of P(draft k accepted), k = 1..γ, for one dataset (PNG)."""
    from dspark_sgl.plots import pyplot, save_figure

    plt = pyplot()

    ks = list(range(1, len(report.per_position_accept) + 1))
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.bar(ks, [100 * a for a in report.per_position_accept])
    ax.set_xticks(ks)
    ax.set_ylim(0, 100)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(draft k accepted) (%)")
    ax.set_title(f"{report.name}: τ = {report.tau:.2f} over {report.prompts} prompts")
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def report_dict(reports: list[DatasetReport], **meta) -> dict:
    """The JSON of an eval report: its settings (draft path, engine, T, dtype), where it ran (CPU, commit, date) and
    one entry per dataset."""
    from dspark_sgl.provenance import provenance

    return {"meta": meta, "provenance": provenance(), "datasets": [asdict(r) for r in reports]}


def confidence_pairs(gens: list[Generation]) -> tuple[torch.Tensor, torch.Tensor]:
    """(confidence logits [N, γ], drafts accepted [N]) from full-window (static) verify steps, for STS."""
    logits, accepted = [], []
    for g in gens:
        s = g.stats
        if len(s.confidence) != len(s.verified):  # no confidence head
            continue
        matched = s.from_match or [False] * len(s.accepted)
        for conf, acc, ver, m in zip(s.confidence, s.accepted, s.verified, matched, strict=True):
            if ver == s.block_size and not m:  # a capped step censors the label; a match's step is not the draft's
                logits.append(conf)
                accepted.append(acc)
    if not logits:
        raise ValueError("no full-window verify steps with confidence logits: run with --schedule static and a "
                         "draft that has a confidence head")
    return torch.tensor(logits), torch.tensor(accepted)


@dataclass
class Calibration:
    temperatures: torch.Tensor  # [γ] STS temperatures
    before: dict  # calibration_report on the report steps, raw confidences
    after: dict  # the same with the temperatures
    fit_steps: int
    report_steps: int
    heldout: bool  # reported on other prompts than the fitted ones

    def save(self, path: str | Path) -> None:
        from dspark_sgl.speculative.sts import save_sts

        save_sts(path, self.temperatures, {"before": self.before, "after": self.after, "fit_steps": self.fit_steps,
                                           "report_steps": self.report_steps, "heldout": self.heldout})


def calibrate(engine: SpecEngine, tokenizer, fit: list[str | Path], limit: int, max_new_tokens: int, eos: set[int],
              heldout: list[str | Path] | None = None, heldout_limit: int = 50, temperature: float = 0.0,
              batch_size: int = 1) -> Calibration:
    """Sequential temperature scaling of the draft's confidence head from real (static) speculative runs on the
    `fit` prompts, reported on `heldout` ones (or in-sample when none are given). `dspark calibrate` and the recipe's
    calibration phase both run this."""
    from dspark_sgl.speculative.sts import calibration_report, fit_sts

    def pairs(paths, n):
        gens = []
        for path in paths:
            gens += evaluate_dataset(engine, tokenizer, path, n, max_new_tokens, SamplingConfig(temperature), eos,
                                     batch_size)[1]
        return confidence_pairs(gens)

    logits, accepted = pairs(fit, limit)
    test_logits, test_accepted = pairs(heldout, heldout_limit) if heldout else (logits, accepted)
    temps = fit_sts(logits, accepted)
    return Calibration(temps, calibration_report(test_logits, test_accepted),
                       calibration_report(test_logits, test_accepted, temps), len(accepted), len(test_accepted),
                       bool(heldout))

