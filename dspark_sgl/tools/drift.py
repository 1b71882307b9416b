"""Drift of a quantized (or lower-precision) draft against an FP32 reference: card 000's method.

Why FP32 and a BF16 floor: the served baseline already computes in BF16, so its own divergence from an exact
reference is the noise floor a quantized build must be read against; FP32 vs itself is exactly zero.

Per block (anchor + γ-1 masks over a context of aux hidden states), every variant sees the same input:
  * teacher-forced (the reference's greedy tokens as Markov prev): greedy agreement, 1-TV and KL(ref‖cand) of
    the step distributions at T=1, hidden-state relative error, confidence (σ of the raw head logit): Pearson
    r and the flip rate of the scheduling decision "cumulative survival Π c ≥ threshold";
  * free-running (each variant its own greedy Markov rollout, `dspark_sgl.speculative.markov.rollout`): per-position
    agreement with the reference's tokens, and the matching-prefix length, whose mean is the drift-limited
    acceptance ceiling (of γ). The card computes the ceiling as Σ_k Π_{i≤k} p_i from the marginal per-position
    rates; we report that as `ceiling_card` and use the direct mean prefix length (with a CI) as `ceiling`.
Every mean carries a 95% CI over blocks (blocks are independent; positions within a block are not).

Aux-hidden regimes: `target` (the real target's captures, when a target is given), `boot` (the reference
draft's own layer outputs run causally over the tokens: realistic activation statistics), `heavy` (Student-t,
ν=3, unit variance) and `gauss` (N(0,1)): synthetic stress.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark_sgl.dtypes import DTYPES
from dspark_sgl.model.draft import DSparkDraft
from dspark_sgl.speculative.markov import rollout

REGIMES = ("target", "boot", "heavy", "gauss")
Z95 = 1.959964


class DriftError(ValueError):
    """A drift request that cannot run (unknown regime, mismatched drafts, missing target for `target`)."""


@dataclass
class DriftSettings:
    blocks: int = 256  # blocks per regime
    regimes: tuple[str, ...] = ("boot", "heavy", "gauss")
    seq_len: int = 64  # context window per token stream
    anchors_per_seq: int = 8
    threshold: float = 0.5  # scheduling threshold on cumulative survival Π c
    batch_seqs: int = 8
    seed: int = 0


@dataclass
class Variant:
    label: str
    model: DSparkDraft
    source: str
    compute_dtype: str
    weight_snr_db: float | None = None  # None for the reference itself


@dataclass
class DriftReport:
    gamma: int
    settings: dict[str, Any]
    heads: str  # "target" or "synthetic"
    variants: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(_finite(self.__dict__), indent=2)


def _finite(x):
    """JSON has no inf/nan: write them as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


# ---- statistics
# ------------------------------------------------------------------------------------------------
def mean_ci(x: Tensor) -> dict[str, float]:
    """Mean and normal-approximation 95% CI over independent samples (blocks)."""
    x = x.double().flatten()
    n = x.numel()
    m = float(x.mean())
    half = float(Z95 * x.std(unbiased=True) / math.sqrt(n)) if n > 1 else float("nan")
    return {"mean": m, "lo": m - half, "hi": m + half, "n": n}


def pearson_ci(a: Tensor, b: Tensor) -> dict[str, float]:
    """Pearson r with a Fisher-z 95% CI (n = number of pooled positions)."""
    a, b = a.double().flatten(), b.double().flatten()
    n = a.numel()
    if torch.equal(a, b):
        return {"r": 1.0, "lo": 1.0, "hi": 1.0, "n": n}
    r = float(torch.corrcoef(torch.stack((a, b)))[0, 1])
    if not math.isfinite(r) or n < 4:
        return {"r": r, "lo": float("nan"), "hi": float("nan"), "n": n}
    z, half = math.atanh(max(min(r, 1 - 1e-15), -1 + 1e-15)), Z95 / math.sqrt(n - 3)
    return {"r": r, "lo": math.tanh(z - half), "hi": math.tanh(z + half), "n": n}


# ---- models
# ------------------------------------------------------------------------------------------------------
def synthetic_heads(vocab: int, hidden: int, seed: int) -> tuple[nn.Embedding, nn.Linear]:
    """Stand-in target embedding / lm_head: logits of a unit-RMS hidden have std 3 (peaked, LM-like)."""
    g = torch.Generator().manual_seed(seed)
    embed, head = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(vocab, hidden, generator=g))
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * (3.0 / math.sqrt(hidden)))
    return embed.requires_grad_(False), head.requires_grad_(False)


@torch.no_grad()
def random_draft(config, seed: int = 0, markov_gain: float = 2.0, bf16_exact: bool = True) -> DSparkDraft:
    """A random draft whose layers actually move the hidden state (for demos and tests, no training needed).

    The training init (std 0.02) leaves a random draft's residual stream almost untouched by its weights, so
    quantization would barely show. Here every Linear is N(0, 1/fan_in) (scale-preserving), the Markov bias
    has std ≈ markov_gain logits, and with bf16_exact the weights are rounded to bf16 like a published
    checkpoint, so the BF16 variant's weight error is exactly zero and its drift is pure compute noise (the
    card's noise floor).
    """
    torch.manual_seed(seed)
    model = DSparkDraft(config)
    for name, p in model.named_parameters():
        if name.endswith("bias") or p.dim() == 1:
            continue
        fan_in = p.shape[1]
        if name == "markov_head.markov_w1.weight":
            p.normal_(0, 1.0)
        elif name == "markov_head.markov_w2.weight":
            p.normal_(0, markov_gain / math.sqrt(fan_in))
        else:
            p.normal_(0, 1 / math.sqrt(fan_in))
        if bf16_exact:
            p.copy_(p.to(torch.bfloat16).float())
    return model.eval()


def _bind(model: DSparkDraft, embed: nn.Module, head: nn.Module, dtype: torch.dtype) -> DSparkDraft:
    """Each variant gets the shared heads in its compute dtype (a served BF16 draft meets a BF16 lm_head)."""
    if dtype == torch.float32:
        return model.bind_target(embed, head)
    e = nn.Embedding.from_pretrained(embed.weight.detach().to(dtype), freeze=True)
    h = nn.Linear(head.weight.shape[1], head.weight.shape[0], bias=False).to(dtype).requires_grad_(False)
    h.weight.data.copy_(head.weight.detach())
    return model.bind_target(e, h)


def _manifest_tensors(path: Path) -> list[str] | None:
    from dspark_sgl.tools.quantize import MANIFEST_FILE

    file = path / MANIFEST_FILE
    return sorted(json.loads(file.read_text())["quantized"]) if file.exists() else None


def variant_weight_snr(ref: DSparkDraft, cand: DSparkDraft, only: list[str] | None = None) -> float:
    """SNR (dB) over the tensors the candidate changed (its manifest's quantized list when it has one)."""
    rs, cs = ref.state_dict(), cand.state_dict()
    names = only if only is not None else [n for n in rs if not torch.equal(rs[n].float(), cs[n].float())]
    if not names:
        return float("inf")
    sig = sum(float(rs[n].double().pow(2).sum()) for n in names)
    err = sum(float((rs[n].double() - cs[n].double()).pow(2).sum()) for n in names)
    return float("inf") if err == 0 else 10 * math.log10(sig / err)


def load_variants(
    reference: str | Path | DSparkDraft,
    candidates: list[str],
    compute_dtype: str = "bf16",
    floor: bool = True,
) -> tuple[DSparkDraft, list[Variant]]:
    """The FP32 reference and the variants: 'bf16'/'fp16'/'fp32' = the reference weights computed in that
    dtype (the noise floor; 'fp32' is the self-check), anything else = a draft folder (quantized or not).
    """
    if compute_dtype not in DTYPES:
        raise DriftError(f"compute dtype must be one of {sorted(DTYPES)}, got {compute_dtype!r}")
    ref = reference if isinstance(reference, DSparkDraft) else DSparkDraft.from_pretrained(reference)
    ref = ref.float().eval()
    specs = (["bf16"] if floor and "bf16" not in candidates else []) + list(candidates)
    out = []
    for spec in specs:
        if spec in DTYPES:
            model = _copy(ref).to(DTYPES[spec])
            out.append(Variant(spec.upper(), model, "reference", spec, variant_weight_snr(ref, model)))
            continue
        path = Path(spec)
        if not (path / "config.json").exists():
            raise DriftError(f"candidate {spec!r} is neither fp32/bf16/fp16 nor a draft folder")
        model = DSparkDraft.from_pretrained(path, dtype=torch.float32)
        if _shape_key(model) != _shape_key(ref):
            raise DriftError(f"candidate {spec} does not have the reference's architecture")
        snr = variant_weight_snr(ref, model, _manifest_tensors(path))
        out.append(Variant(_label(path), model.to(DTYPES[compute_dtype]), str(path), compute_dtype, snr))
    return ref, out


def _copy(model: DSparkDraft) -> DSparkDraft:
    clone = DSparkDraft(model.config)
    clone.load_state_dict(model.state_dict())
    return clone.eval()


def _shape_key(model: DSparkDraft) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _label(path: Path) -> str:
    from dspark_sgl.tools.quantize import MANIFEST_FILE

    file = path / MANIFEST_FILE
    if file.exists():
        recipe = json.loads(file.read_text())["recipe"]
        if recipe.get("mixed"):  # o_proj=mxfp4,default=fp8 -> "MXFP4(o_proj)+FP8"
            mixed = dict(recipe["mixed"])
            default = mixed.pop("default", recipe.get("scheme"))
            parts = [f"{v.upper()}({k})" for k, v in mixed.items()] + ([default.upper()] if default else [])
            return "+".join(parts)
        if recipe.get("scheme"):
            return recipe["scheme"].upper()
    return path.name


# ---- inputs
# ------------------------------------------------------------------------------------------------------
def read_token_streams(path: str | Path, tokenizer=None) -> list[int]:
    """JSONL rows of input_ids, text or turns (eval sets; text needs the target tokenizer) -> one stream."""
    ids: list[int] = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if "input_ids" in row:
            ids.extend(int(t) for t in row["input_ids"])
        elif "text" in row or "turns" in row:
            if tokenizer is None:
                raise DriftError(f"{path}:{i + 1} has text but no tokenizer is available (give --target)")
            text = row["text"] if "text" in row else "\n".join(row["turns"])
            ids.extend(tokenizer(text)["input_ids"])
        else:
            raise DriftError(f"{path}:{i + 1} has none of 'input_ids', 'text', 'turns'")
    return ids


def token_windows(stream: list[int] | None, n: int, seq_len: int, vocab: int, mask_id: int, seed: int) -> Tensor:
    """n windows of seq_len tokens: consecutive slices of the stream (cycled), or uniform random tokens."""
    g = torch.Generator().manual_seed(seed)
    if not stream:
        ids = torch.randint(0, vocab - 1, (n, seq_len), generator=g)
        return ids + (ids >= mask_id).long()  # never the mask token
    if max(stream) >= vocab:
        raise DriftError(f"token id {max(stream)} is outside the draft's vocabulary of {vocab}")
    t = torch.tensor(stream, dtype=torch.long)
    reps = math.ceil(n * seq_len / t.numel())
    return t.repeat(reps)[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def draft_layer_outputs(draft: DSparkDraft, ids: Tensor) -> Tensor:
    """'boot' aux: the draft's own decoder layers run causally over tokens, num_aux spaced outputs."""
    B, S = ids.shape
    c = draft.config
    x = draft.embed(ids)
    pos = torch.arange(S).expand(B, S)
    causal = torch.ones(S, S, dtype=torch.bool).tril()[None, None]
    (nk, dk), (nv, dv) = draft.context_kv_dims()  # GQA K/V heads or the MLA latent: no context here
    empty = (x.new_zeros(B, nk, 0, dk), x.new_zeros(B, nv, 0, dv))
    outs = []
    for layer in draft.layers:
        x = layer(x, pos, causal, draft.inv_freq, ctx_kv=empty)
        outs.append(x)
    L, K = len(outs), c.num_aux
    pick = [round(i * (L - 1) / max(K - 1, 1)) for i in range(K)]
    return torch.cat([outs[j] for j in pick], dim=-1).float()


def regime_aux(regime: str, ref: DSparkDraft, ids: Tensor, g: torch.Generator, target=None) -> Tensor:
    B, S = ids.shape
    width = ref.config.num_aux * ref.config.hidden_size
    if regime == "boot":
        return draft_layer_outputs(ref, ids)
    if regime == "gauss":
        return torch.randn(B, S, width, generator=g)
    if regime == "heavy":  # Student-t(3) = N / sqrt(χ²₃/3), scaled to unit variance
        normal = torch.randn(B, S, width, generator=g)
        chi2 = torch.randn(B, S, width, 3, generator=g).pow(2).sum(-1)
        return normal / torch.sqrt(chi2 / 3) / math.sqrt(3.0)
    if regime == "target":
        if target is None:
            raise DriftError("the 'target' regime needs --target")
        return target.capture(ids.to(target.device)).aux.float().cpu()
    raise DriftError(f"unknown regime {regime!r}; expected one of {REGIMES}")


# ---- one batch of blocks
# -----------------------------------------------------------------------------------------
@torch.no_grad()
def teacher_forced(draft: DSparkDraft, h: Tensor, anchor: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor | None]:
    """Step logits [B, γ, V] and confidence logits [B, γ] with the given tokens as each step's Markov prev."""
    prev = torch.cat((anchor[:, None], tokens[:, :-1]), dim=1)
    head = draft.markov_head
    logits = draft.base_logits(h) + head.bias(head.teacher_forced_latent(prev, h)).float()
    conf = None
    if draft.confidence_head is not None:
        conf = draft.confidence_head(h, head.markov_w1(prev).to(h.dtype))
    return logits, conf


@dataclass
class BlockPass:
    h: Tensor  # [N, γ, H] fp32
    tokens: Tensor  # [N, γ] free-running greedy rollout
    logits: Tensor  # [N, γ, V] teacher-forced on the reference's tokens
    conf: Tensor | None  # [N, γ] σ(teacher-forced confidence logit)


@torch.no_grad()
def run_blocks(draft: DSparkDraft, ids: Tensor, aux: Tensor, anchors: Tensor, ref_tokens: Tensor | None) -> BlockPass:
    dtype = draft.fc.weight.dtype
    h = draft.forward_train(ids, aux.to(dtype), anchors)
    h = h.flatten(0, 1)  # [B·N, γ, H]
    anchor_ids = ids.gather(1, anchors).flatten()
    tokens = rollout(draft, h, anchor_ids, 0.0).tokens
    forced = tokens if ref_tokens is None else ref_tokens
    logits, conf = teacher_forced(draft, h, anchor_ids, forced)
    return BlockPass(h.float(), tokens, logits.float(), None if conf is None else torch.sigmoid(conf.float()))


def compare(ref: BlockPass, cand: BlockPass, threshold: float) -> dict[str, Tensor]:
    """Per-block / per-position drift statistics of one batch of blocks."""
    log_p, log_q = F.log_softmax(ref.logits, -1), F.log_softmax(cand.logits, -1)
    p = log_p.exp()
    kl = (p * (log_p - log_q)).sum(-1).clamp(min=0)  # [N, γ]
    tv = 0.5 * (p - log_q.exp()).abs().sum(-1)
    seq = cand.tokens == ref.tokens
    out = {
        "greedy": (cand.logits.argmax(-1) == ref.logits.argmax(-1)).float(),
        "seq": seq.float(),
        "prefix": seq.long().cumprod(-1).sum(-1).float(),
        "one_minus_tv": 1 - tv,
        "kl": kl,
        "hidden_rel_err": (cand.h - ref.h).norm(dim=-1) / ref.h.norm(dim=-1).clamp(min=1e-30),
    }
    if ref.conf is not None and cand.conf is not None:
        out["conf_ref"], out["conf_cand"] = ref.conf, cand.conf
        out["flip"] = ((ref.conf.cumprod(-1) >= threshold) != (cand.conf.cumprod(-1) >= threshold)).float()
    return out


def summarize(stats: dict[str, Tensor], gamma: int) -> dict[str, Any]:
    """Pooled per-block tensors -> means with CIs (block-level), percentiles, per-position rates."""
    per_block = lambda k: stats[k].mean(-1)  # noqa: E731
    seq_pos = stats["seq"].mean(0)
    out: dict[str, Any] = {
        "blocks": int(stats["seq"].shape[0]),
        "ceiling": mean_ci(stats["prefix"]),
        "ceiling_card": float(seq_pos.double().cumprod(0).sum()),
        "greedy_agreement": mean_ci(per_block("greedy")),
        "sequential_agreement": mean_ci(per_block("seq")),
        "one_minus_tv": mean_ci(per_block("one_minus_tv")),
        "kl_mean": mean_ci(per_block("kl")),
        "kl_p99": float(torch.quantile(stats["kl"].double().flatten(), 0.99)),
        "hidden_rel_err": mean_ci(per_block("hidden_rel_err")),
        "per_position_sequential": [mean_ci(stats["seq"][:, k]) for k in range(gamma)],
    }
    if "flip" in stats:
        out["confidence_r"] = pearson_ci(stats["conf_ref"], stats["conf_cand"])
        out["flip_rate"] = mean_ci(per_block("flip"))
    return out


# ---- the run
# -----------------------------------------------------------------------------------------------------
def run_drift(
    ref: DSparkDraft,
    variants: list[Variant],
    settings: DriftSettings,
    embed: nn.Module,
    lm_head: nn.Module,
    stream: list[int] | None = None,
    target=None,
    progress=None,
) -> DriftReport:
    """Measure every variant against the reference on every regime (same blocks, same aux, same heads)."""
    c = ref.config
    bad = [r for r in settings.regimes if r not in REGIMES]
    if bad:
        raise DriftError(f"unknown regimes {bad}; expected some of {REGIMES}")
    if settings.seq_len < 2 or settings.blocks < 1 or settings.anchors_per_seq < 1:
        raise DriftError("need seq_len >= 2, blocks >= 1 and anchors_per_seq >= 1")
    _bind(ref, embed, lm_head, torch.float32)
    for v in variants:
        _bind(v.model, embed, lm_head, DTYPES[v.compute_dtype])
    n_seqs = math.ceil(settings.blocks / settings.anchors_per_seq)
    ids_all = token_windows(stream, n_seqs, settings.seq_len, c.vocab_size, c.mask_token_id, settings.seed)
    g = torch.Generator().manual_seed(settings.seed + 1)
    anchors_all = torch.randint(1, settings.seq_len, (n_seqs, settings.anchors_per_seq), generator=g)

    results: dict[str, dict[str, Any]] = {v.label: {} for v in variants}
    for regime in settings.regimes:
        pooled: dict[str, dict[str, list[Tensor]]] = {v.label: {} for v in variants}
        for start in range(0, n_seqs, settings.batch_seqs):
            ids = ids_all[start : start + settings.batch_seqs]
            anchors = anchors_all[start : start + settings.batch_seqs]
            aux = regime_aux(regime, ref, ids, g, target)
            ref_pass = run_blocks(ref, ids, aux, anchors, None)
            for v in variants:
                stats = compare(ref_pass, run_blocks(v.model, ids, aux, anchors, ref_pass.tokens), settings.threshold)
                for k, t in stats.items():
                    pooled[v.label].setdefault(k, []).append(t)
            if progress is not None:
                progress(regime, min(start + settings.batch_seqs, n_seqs), n_seqs)
        for v in variants:
            stats = {k: torch.cat(ts)[: settings.blocks] for k, ts in pooled[v.label].items()}
            results[v.label][regime] = summarize(stats, c.block_size)

    report = DriftReport(
        gamma=c.block_size,
        settings={**settings.__dict__, "regimes": list(settings.regimes)},
        heads="target" if target is not None else "synthetic",
    )
    for v in variants:
        report.variants.append(
            {
                "label": v.label,
                "source": v.source,
                "compute_dtype": v.compute_dtype,
                "weight_snr_db": v.weight_snr_db,
                "regimes": results[v.label],
            }
        )
    return report


# ---- output
# ------------------------------------------------------------------------------------------------------
def _pm(stat: dict[str, float], scale: float = 1.0, digits: int = 2) -> str:
    m, lo, hi = stat["mean"] * scale, stat["lo"] * scale, stat["hi"] * scale
    if not math.isfinite(lo):
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ± {(hi - lo) / 2:.{digits}f}"


def _snr(v: float | None) -> str:
    return "—" if v is None else ("exact" if math.isinf(v) else f"{v:.1f} dB")


def report_tables(report: DriftReport):
    """The card's three tables (rich): ceiling per regime, detail (first regime), per-position decay."""
    from rich.table import Table

    regimes = report.settings["regimes"]
    first = regimes[0]
    ceiling = Table(title=f"Drift-limited acceptance ceiling (of {report.gamma}), mean ± 95% CI")
    ceiling.add_column("Variant")
    for r in regimes:
        ceiling.add_column(r, justify="right")
    ceiling.add_row("FP32 reference", *[f"{report.gamma:.2f}" for _ in regimes])
    for v in report.variants:
        ceiling.add_row(v["label"], *[_pm(v["regimes"][r]["ceiling"]) for r in regimes])

    detail = Table(title=f"Detail ({first})")
    detail.add_column("Metric")
    for v in report.variants:
        detail.add_column(v["label"], justify="right")
    rows = [
        ("Weight SNR", lambda v, s: _snr(v["weight_snr_db"])),
        ("Greedy agreement %", lambda v, s: _pm(s["greedy_agreement"], 100)),
        ("Sequential rollout %", lambda v, s: _pm(s["sequential_agreement"], 100)),
        ("1−TV coupling %", lambda v, s: _pm(s["one_minus_tv"], 100)),
        ("KL mean", lambda v, s: _pm(s["kl_mean"], 1, 5)),
        ("KL p99", lambda v, s: f"{s['kl_p99']:.5f}"),
        ("Hidden-state rel err %", lambda v, s: _pm(s["hidden_rel_err"], 100)),
        ("Confidence r", lambda v, s: f"{s['confidence_r']['r']:.4f}" if "confidence_r" in s else "—"),
        ("Threshold flip rate %", lambda v, s: _pm(s["flip_rate"], 100) if "flip_rate" in s else "—"),
        ("Ceiling (card formula)", lambda v, s: f"{s['ceiling_card']:.2f}"),
    ]
    for name, fn in rows:
        detail.add_row(name, *[fn(v, v["regimes"][first]) for v in report.variants])

    decay = Table(title=f"Per-position sequential agreement % ({first})")
    decay.add_column("Variant")
    for k in range(report.gamma):
        decay.add_column(str(k + 1), justify="right")
    for v in report.variants:
        decay.add_row(v["label"], *[f"{p['mean'] * 100:.1f}" for p in v["regimes"][first]["per_position_sequential"]])
    return ceiling, detail, decay


def plot_decay(report: DriftReport, path: str | Path) -> Path:
    """Per-position sequential agreement, one panel per regime, 95% CI bands."""
    from dspark_sgl.plots import pyplot, save_figure

    plt = pyplot()

    regimes = report.settings["regimes"]
    fig, axes = plt.subplots(1, len(regimes), figsize=(4.2 * len(regimes), 3.6), squeeze=False, sharey=True)
    xs = list(range(1, report.gamma + 1))
    for ax, regime in zip(axes[0], regimes, strict=True):
        for v in report.variants:
            pos = v["regimes"][regime]["per_position_sequential"]
            mean = [p["mean"] * 100 for p in pos]
            lo = [p["lo"] * 100 if math.isfinite(p["lo"]) else p["mean"] * 100 for p in pos]
            hi = [p["hi"] * 100 if math.isfinite(p["hi"]) else p["mean"] * 100 for p in pos]
            ax.plot(xs, mean, marker="o", label=v["label"])
            ax.fill_between(xs, lo, hi, alpha=0.2)
        ax.set_title(regime)
        ax.set_xlabel("draft position")
        ax.set_xticks(xs)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("sequential agreement with FP32 (%)")
    axes[0][-1].legend(fontsize=8)
    return save_figure(fig, path)
