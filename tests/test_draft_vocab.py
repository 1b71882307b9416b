"""Reduced draft vocabulary (draft_vocab_size K < V, d2t): config and checkpoint, the vLLM/speculators reader
convention, both engines' losslessness at K << V (T = 0 identity, chi-square under sampling with a planted bug),
the Markov step kernel on K rows, the exact objective (slow reference; K = V equals the full-vocabulary path),
choosing the vocabulary, and the exports that must refuse it."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_sgl.config import ConfigError
from dspark_sgl.kernels.accept_reference import ACCEPT_RULES
from dspark_sgl.kernels.noise import sample
from dspark_sgl.model import DSparkDraft
from dspark_sgl.model.checkpoint import CheckpointError, load_draft
from dspark_sgl.speculative.engine import SamplingConfig, SpecEngine
from dspark_sgl.speculative.sampling import draft_probs
from dspark_sgl.targets import HFTarget
from dspark_sgl.vocab import VocabError, choose_vocab, coverage, token_counts, vocab_from
from tests.conftest import draft_config_for, tiny_draft_config, tiny_llama
from tests.test_engine import PROMPTS, bigram_draft, chain_accepts, pairs_from
from tests.test_kernels import run_interpreted
from tests.test_sampling import chi2_pvalue, exact_three_token_distribution


def reduced(target: HFTarget, ids: list[int], **over) -> DSparkDraft:
    draft = DSparkDraft(draft_config_for(target, draft_vocab_size=len(ids), **over))
    draft.set_vocab(torch.tensor(ids))
    return draft


# ---- config and checkpoint -----------------------------------------------------------------------------------
def test_k_equal_v_is_the_full_draft_byte_for_byte(tmp_path):
    full, same = tiny_draft_config(), tiny_draft_config(draft_vocab_size=96)
    assert same.draft_vocab_size is None and same.to_dict() == full.to_dict()
    assert "draft_vocab_size" not in full.to_dict()
    torch.manual_seed(0)
    DSparkDraft(full).save_pretrained(tmp_path / "a")
    torch.manual_seed(0)
    DSparkDraft(same).save_pretrained(tmp_path / "b")
    assert (tmp_path / "a/config.json").read_bytes() == (tmp_path / "b/config.json").read_bytes()
    a, b = (load_file(str(tmp_path / x / "model.safetensors")) for x in "ab")  # (header metadata order varies)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigError, match=r"draft_vocab_size=100 must be in \[1, vocab_size=96\]"):
        tiny_draft_config(draft_vocab_size=100)


def test_checkpoint_round_trip_d2t_convention_and_t2d(tmp_path):
    cfg = tiny_draft_config(draft_vocab_size=10)
    d = DSparkDraft(cfg)
    ids = torch.tensor([3, 7, 8, 20, 33, 41, 50, 64, 90, 95])
    d.set_vocab(ids[torch.randperm(10)])  # any order in, sorted ids stored
    d.save_pretrained(tmp_path)
    raw = load_file(str(tmp_path / "model.safetensors"))
    assert raw["d2t"].dtype == torch.int64 and torch.equal(torch.arange(10) + raw["d2t"], ids)  # target = i + d2t[i]
    assert raw["markov_head.markov_w2.weight"].shape == (10, 16)  # K × r
    assert raw["markov_head.markov_w1.weight"].shape == (96, 16)  # V × r: any previous token
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 10
    assert torch.equal(load_draft(tmp_path).vocab, ids)
    # a speculators checkpoint may carry t2d [V] bool instead of (or next to) d2t
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[ids] = True
    only_t2d = {k: v for k, v in raw.items() if k != "d2t"} | {"t2d": t2d}
    save_file(only_t2d, str(tmp_path / "model.safetensors"))
    assert torch.equal(load_draft(tmp_path).vocab, ids)
    t2d[ids[0]], t2d[1] = False, True
    save_file(raw | {"t2d": t2d}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="d2t and t2d disagree"):
        load_draft(tmp_path)
    bad = dict(raw)
    bad["d2t"] = raw["d2t"].clone()
    bad["d2t"][1] -= 4  # draft ids 0 and 1 both map to target id 3
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="distinct"):
        load_draft(tmp_path)


def test_folder_loads_under_vllm_dspark_reader_rules(tmp_path):
    """vLLM's Qwen3DSparkForCausalLM (vllm#46995, read via its vllm-ascend port) reads `draft_vocab_size` from the
    top-level config, sizes markov_w1 by vocab_size and markov_w2 / lm_head / draft_id_to_target_id by
    draft_vocab_size, skips any name containing "t2d", renames "d2t" -> "draft_id_to_target_id", prefixes every
    other non-lm_head name with "model." and maps ids as draft_ids + draft_id_to_target_id[draft_ids]."""
    cfg = tiny_draft_config(draft_vocab_size=12)
    d = DSparkDraft(cfg)
    d.set_vocab(torch.arange(0, 96, 8))
    d.save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    V, K, r = hf["vocab_size"], hf["draft_vocab_size"], hf["markov_rank"]
    expected = {"model.markov_head.markov_w1.weight": (V, r), "model.markov_head.markov_w2.weight": (K, r),
                "draft_id_to_target_id": (K,)}
    loaded = {}
    for name, t in load_file(str(tmp_path / "model.safetensors")).items():
        if "t2d" in name:
            continue
        name = name.replace("d2t", "draft_id_to_target_id") if "d2t" in name else (
            name if "lm_head" in name else "model." + name)
        loaded[name] = t
    for name, shape in expected.items():
        assert tuple(loaded[name].shape) == shape, name
    draft_ids = torch.tensor([0, 5, 11])
    assert (draft_ids + loaded["draft_id_to_target_id"][draft_ids]).tolist() == [0, 40, 88]


def test_gguf_export_refuses_a_reduced_vocabulary_without_its_target(tmp_path):
    """llama.cpp wants the K-row head (the target's hot rows): with the target GGUF it exports (tests/test_gguf.py)."""
    from dspark_sgl.tools.gguf_export import ExportError, export_gguf

    DSparkDraft(tiny_draft_config(draft_vocab_size=8)).save_pretrained(tmp_path / "d")
    with pytest.raises(ExportError, match="reduced-vocabulary draft .* needs the target GGUF"):
        export_gguf(tmp_path / "d", tmp_path / "d.gguf")


# ---- kernel ----------------------------------------------------------------------------------------------------
def test_markov_step_on_k_rows_maps_to_target_ids():
    from dspark_sgl.kernels.markov_step import markov_step

    g = torch.Generator().manual_seed(0)
    base, lat, w2 = torch.randn(3, 7, generator=g), torch.randn(3, 4, generator=g), torch.randn(7, 4, generator=g)
    vocab = torch.tensor([2, 9, 11, 30, 31, 50, 63])
    tok, logits = markov_step(base, lat, w2, vocab=vocab)
    assert logits.shape == (3, 7)
    assert torch.equal(tok, vocab[(base + lat @ w2.T).argmax(-1)])


# ---- engines: lossless at K << V -------------------------------------------------------------------------------
def test_reduced_draft_is_token_identical_at_t0():
    target = HFTarget(tiny_llama(), [0, 2])
    ref = SpecEngine(target).generate(PROMPTS, 24)
    pairs = pairs_from(PROMPTS, [r.token_ids for r in ref])
    torch.manual_seed(1)
    rand = reduced(target, list(range(0, 64, 4)), block_size=5)  # K = 16 of V = 64
    assert [o.token_ids for o in SpecEngine(target, rand).generate(PROMPTS, 24)] == [r.token_ids for r in ref]
    # a good draft whose vocabulary holds every next token of its bigram table (plus filler): long accepted runs,
    # drafts all inside the vocabulary, and the emitted text is still exactly the target's
    hot = sorted({n for _, n in pairs} | {0, 1})[:32]
    good = bigram_draft(reduced(target, hot, block_size=5, markov_rank=64), [])
    index = {t: i for i, t in enumerate(hot)}
    prev_ids = sorted({p for p, _ in pairs})
    with torch.no_grad():
        for i, p in enumerate(prev_ids):
            good.markov_head.markov_w1.weight[p, i] = 1.0
        for p, n in pairs:
            good.markov_head.markov_w2.weight[:, prev_ids.index(p)] = 0.0
            good.markov_head.markov_w2.weight[index[n], prev_ids.index(p)] = 30.0
    out = SpecEngine(target, good).generate(PROMPTS, 24)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    table = dict(pairs)  # outside the table: all-zero logits -> the first hot id
    assert [o.stats.accepted[:-1] for o in out] == [
        chain_accepts(table, r.token_ids, 5, hot[0])[: len(o.stats.accepted) - 1]
        for o, r in zip(out, ref, strict=True)]
    assert max(max(o.stats.accepted) for o in out) == 5


@pytest.mark.parametrize("rule", ["rejection", "block"])
def test_acceptance_with_q_zero_outside_the_draft_vocabulary(rule):
    """p over V = 40, the draft proposes from K = 5 hot tokens; the first emitted token must follow p. Planted bug:
    q laid over the first K target ids (d2t ignored) instead of the hot ids -> the chi-square test fails."""
    g = torch.Generator().manual_seed(0)
    V, vocab, n = 40, torch.tensor([3, 8, 17, 25, 39]), 40000
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    q_k = torch.softmax(torch.randn(2, 5, generator=g), -1)

    def first_tokens(q_full):
        x = vocab[sample(q_k.expand(n, -1, -1), g)]
        res = ACCEPT_RULES[rule](x, q_full.expand(n, -1, -1), p.expand(n, -1, -1), None, g)
        return torch.where(res.num_accepted > 0, x[:, 0], res.bonus), res.num_accepted

    right = draft_probs(torch.log(q_k), 1.0, vocab, V)
    assert torch.allclose(right[:, vocab], q_k) and right.sum(-1).allclose(torch.ones(2))
    tok, acc = first_tokens(right)
    assert chi2_pvalue(torch.bincount(tok, minlength=V), p[0]) > 1e-3
    assert acc.float().mean() > 0.05  # drafts really accepted
    wrong = torch.zeros(2, V)
    wrong[:, :5] = q_k
    tok, _ = first_tokens(wrong)
    assert chi2_pvalue(torch.bincount(tok, minlength=V), p[0]) < 1e-6


@pytest.mark.parametrize("acceptance", ["rejection", "block"])
def test_reduced_engine_samples_equal_the_target_distribution(acceptance):
    V = 6
    model = tiny_llama(vocab=V, hidden=16, layers=2, seed=3, embed_std=2.0)
    target = HFTarget(model, [0, 1])
    torch.manual_seed(0)
    draft = reduced(target, [1, 4], block_size=3, markov_rank=4)  # K = 2 of V = 6
    with torch.no_grad():
        for prm in draft.parameters():
            prm.normal_(0, 0.5)
    prompt, n = [1, 2, 3], 6000
    exact = exact_three_token_distribution(model, prompt, 1.0, 1.0, V)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, acceptance=acceptance, seed=7)
    out = SpecEngine(target, draft).generate([prompt] * n, 3, sampling)
    seqs = torch.tensor([o.token_ids for o in out])
    counts = torch.bincount(seqs[:, 0] * V * V + seqs[:, 1] * V + seqs[:, 2], minlength=V ** 3)
    assert chi2_pvalue(counts, exact) > 1e-3
    assert sum(sum(o.stats.accepted) for o in out) > 0.1 * n


def test_time_split_is_recorded():
    target = HFTarget(tiny_llama(), [0, 2])
    draft = reduced(target, list(range(16)))
    (g,) = SpecEngine(target, draft, time_split=True).generate(PROMPTS[:1], 12)
    split = g.stats.draft_split
    assert set(split) == {"backbone", "lm_head", "markov", "confidence"} and all(v > 0 for v in split.values())
    assert sum(split.values()) <= g.stats.draft_s * 1.05


# ---- the objective ---------------------------------------------------------------------------------------------
def _objective_setup(K: int | None):
    from tests.test_objective import anchors_for, make_batch, make_draft

    draft = make_draft(draft_vocab_size=K)
    if K is not None:
        g = torch.Generator().manual_seed(5)
        draft.set_vocab(torch.randperm(61, generator=g)[:K])
        draft.bind_target(draft.target.embed_tokens, draft.target.lm_head)
    batch = make_batch()
    return draft, batch, *anchors_for(batch)


def slow_reduced_objective(draft, batch, anchors, valid, cfg):
    """Python loops; TV with the out-of-set target mass, CE only for labels inside S, α = 1 − TV."""
    num, wsum = torch.zeros(()), 0.0
    h = draft.forward_train(batch.input_ids, batch.aux_hidden, anchors)
    lm, vocab = draft.target.lm_head, draft.vocab.tolist()
    mh = draft.markov_head
    for b in range(anchors.shape[0]):
        L = int(batch.lengths[b])
        for n in range(anchors.shape[1]):
            if not valid[b, n]:
                continue
            a = int(anchors[b, n])
            for k in range(draft.config.block_size):
                if a + k + 1 >= L or not all(batch.loss_mask[b, a + j + 1] for j in range(k + 1)):
                    break
                w = math.exp(-k / cfg.gamma_decay)
                latent = mh.teacher_forced_latent(batch.input_ids[b, a:a + k + 1], h[b, n, :k + 1])[-1]
                logits = lm(h[b, n, k]).float()[vocab] + mh.bias(latent).float()
                q = torch.softmax(logits, -1)  # the draft, over S
                p = torch.softmax(lm(batch.last_hidden[b, a + k]).float(), -1)  # the target, over all V
                label = int(batch.input_ids[b, a + k + 1])
                ce = -torch.log(q[vocab.index(label)]) if label in vocab else torch.zeros(())
                l1 = (q - p[vocab]).abs().sum() + (1 - p[vocab].sum())
                alpha = (1 - l1.detach() / 2).clamp(0, 1)
                z = draft.confidence_head(h[b, n, k][None], mh.markov_w1(batch.input_ids[b, a + k][None]))[0]
                bce = -(alpha * torch.log(torch.sigmoid(z)) + (1 - alpha) * torch.log(1 - torch.sigmoid(z)))
                num = num + w * (cfg.ce_weight * ce + cfg.l1_weight * l1 + cfg.bce_weight * bce)
                wsum += w
    return num, wsum


def test_reduced_objective_matches_the_slow_reference():
    from tests.test_objective import assert_grads_close, grads
    from training.objective import ObjectiveConfig, compute_objective

    draft, batch, anchors, valid = _objective_setup(K=20)
    cfg = ObjectiveConfig(num_anchors=6, vocab_chunk_rows=5)
    out = compute_objective(draft, batch, anchors, valid, cfg)
    out.numerator.backward()
    fast = grads(draft)
    draft.zero_grad()
    num, wsum = slow_reduced_objective(draft, batch, anchors, valid, cfg)
    num.backward()
    torch.testing.assert_close(out.numerator, num, atol=1e-4, rtol=1e-5)
    assert abs(float(out.weight_sum) - wsum) < 1e-5
    assert_grads_close(fast, grads(draft))
    assert out.stats[3].sum() > 0  # L1 sums carry the out-of-set mass: α < 1 where the target leaves S


def test_reduced_path_at_k_equal_v_equals_the_full_vocabulary_loss_and_gradients():
    from training.objective import VocabLoss

    g = torch.Generator().manual_seed(0)
    R, H, r, V = 13, 8, 4, 30
    h, lat = torch.randn(R, H, generator=g, requires_grad=True), torch.randn(R, r, generator=g, requires_grad=True)
    w2 = torch.randn(V, r, generator=g, requires_grad=True)
    lm, tgt = torch.randn(V, H, generator=g), torch.randn(R, H, generator=g)
    labels, w = torch.randint(0, V, (R,), generator=g), torch.rand(R, generator=g)
    outs = []
    for extra in ((), (lm, torch.arange(V), labels)):
        res = VocabLoss.apply(h, lat, w2, lm, tgt, labels, w, 0.1, 0.9, 4, *extra)
        res[0].backward()
        outs.append((res, h.grad.clone(), lat.grad.clone(), w2.grad.clone()))
        h.grad = lat.grad = w2.grad = None
    (a, *ga), (b, *gb) = outs
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


# ---- choosing the vocabulary -----------------------------------------------------------------------------------
def test_vocabulary_counts_supervised_tokens_keeps_stop_tokens_and_reports_coverage(tmp_path):
    samples = [([5, 6, 6, 7, 2], [False, True, True, True, True]), ([9, 9, 9, 6], [True, True, True, True])]
    counts = token_counts(samples, 10)
    assert counts.tolist() == [0, 0, 1, 0, 0, 0, 3, 1, 0, 3]  # token 5 is unsupervised
    ids = choose_vocab(counts, 3, required={0})
    assert ids.tolist() == [0, 6, 9]  # the stop token, then the two most frequent
    assert coverage(counts, ids) == pytest.approx(6 / 8)
    assert choose_vocab(counts, 2).tolist() == [6, 9]
    f = tmp_path / "s.jsonl"
    f.write_text("\n".join(json.dumps({"input_ids": i, "loss_mask": [int(m) for m in mk]}) for i, mk in samples))
    assert vocab_from(f, 2, 10).tolist() == [6, 9]
    with pytest.raises(VocabError, match="2 required"):
        choose_vocab(counts, 1, required={0, 1})
    with pytest.raises(VocabError, match="outside the target vocabulary"):
        token_counts([([12], None)], 10)


KERNEL_CHECK = r"""
import torch
from dspark_sgl.kernels.markov_step import markov_step, markov_step_reference
g = torch.Generator().manual_seed(0)
V = 5000
for B, K, R in [(2, 300, 16), (3, 1100, 40)]:
    vocab = torch.randperm(V, generator=g)[:K].sort().values
    base, lat, w2 = torch.randn(B, K, generator=g), torch.randn(B, R, generator=g), torch.randn(K, R, generator=g)
    tok, logits = markov_step(base, lat, w2, backend="triton", vocab=vocab)
    ref_idx, ref_logits = markov_step_reference(base, lat, w2)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert logits.shape == (B, K) and torch.equal(tok, vocab[ref_idx]), (tok, vocab[ref_idx])
print("ok")
"""


def test_triton_markov_step_on_k_rows_in_interpreter():
    run_interpreted(KERNEL_CHECK)


# ---- the recipe key --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)  # two training runs of <= 300 s each
def test_recipe_builds_the_vocabulary_before_step_0_and_resume_reuses_it(tmp_path):
    import shutil

    from dspark_sgl.vocab import stop_token_ids
    from tests.test_trainer import run_training, weights, write_recipe
    from training.tiny import build_tiny_target, mask_token_id, tiny_conversations

    target = build_tiny_target(tmp_path / "target")
    data = tmp_path / "conv.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in tiny_conversations(24)))
    tiny = {"target": str(target), "data": str(data), "mask": mask_token_id(target)}
    K = 64
    rec = write_recipe(tiny, tmp_path / "a", draft={"draft_vocab_size": K}, train={"max_steps": 4, "save_every": 2})
    out = run_training(rec)
    run = tmp_path / "a" / "run"
    assert f"draft vocabulary: {K} of" in out.stdout
    stored = json.loads((run / "draft_vocab.json").read_text())
    ids = torch.tensor(stored["target_ids"])
    assert ids.numel() == K and set(stop_token_ids(target)) <= set(ids.tolist())
    assert 0.5 < stored["coverage"]["train"] <= 1.0
    w = weights(run)
    assert torch.equal(torch.arange(K) + w["d2t"], ids) and w["markov_head.markov_w2.weight"].shape[0] == K
    # resume from step 2: nothing is rebuilt (the stored vocabulary and the checkpoint's d2t carry the run's set)
    ckpts = run / "checkpoints"
    shutil.rmtree(ckpts / "step-00000004")
    shutil.rmtree(run / "draft")
    (ckpts / "latest").write_text("step-00000002\n")
    out = run_training(rec, "--resume")
    assert "resumed from step 2" in out.stdout and "draft vocabulary:" not in out.stdout
    assert torch.equal(torch.arange(K) + weights(run)["d2t"], ids)


# ---- the commands ----------------------------------------------------------------------------------------------
def test_build_vocab_init_draft_generate_and_eval_commands(tmp_path):
    from typer.testing import CliRunner

    from dspark_sgl.cli import app
    from training.tiny import build_tiny_target

    target = build_tiny_target(tmp_path / "target", hidden=32, layers=4)
    run = lambda *a: CliRunner().invoke(app, [str(x) for x in a])  # noqa: E731
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"input_ids": list(range(i, i + 30)), "loss_mask": [1] * 30}) + "\n"
                               for i in range(0, 200, 10)))
    vocab = tmp_path / "vocab.json"
    res = run("build-vocab", "--data", samples, "--size", 64, "--target", target, "--out", vocab,
              "--heldout", samples)
    assert res.exit_code == 0, res.output
    rec = json.loads(vocab.read_text())
    assert rec["draft_vocab_size"] == 64 and rec["coverage"]["samples"] == rec["coverage"]["train"]
    draft = tmp_path / "draft"
    res = run("init-draft", "--target", target, "--out", draft, "--layers", 1, "--markov-rank", 8, "--block-size", 4,
              "--num-aux", 2, "--draft-vocab-size", 64, "--vocab-from", vocab)
    assert res.exit_code == 0 and "draft vocabulary 64 of" in res.output, res.output
    assert torch.equal(load_draft(draft).vocab, torch.tensor(rec["target_ids"]))
    gen = lambda *a: json.loads(run("generate", "--target", target, "--chat", "one two three", "--max-new-tokens",
                                    12, "--dtype", "float32", "--json", *a).stdout.strip().splitlines()[-1])
    out = gen("--draft", draft)
    assert out["token_ids"] == gen("--no-draft")["token_ids"]  # lossless at T = 0
    assert set(out["draft_step_ms"]) == {"backbone", "lm_head", "markov", "confidence"}
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"turns": ["a b c"]}) + "\n")
    report = tmp_path / "report.json"
    res = run("eval", "--target", target, "--draft", draft, "--data", data, "--max-new-tokens", 8, "--dtype",
              "float32", "--json-out", report)
    assert res.exit_code == 0 and "draft step ms: backbone" in res.output, res.output
    ds = json.loads(report.read_text())["datasets"][0]
    assert 0.0 <= ds["draft_vocab_coverage"] <= 1.0 and ds["draft_step_ms"]["lm_head"] > 0
    assert run("init-draft", "--target", target, "--out", tmp_path / "x", "--vocab-from", vocab).exit_code == 2


def test_a_bf16_draft_beside_an_fp32_target_scores_its_hot_rows_in_bf16_and_stays_lossless():
    """The draft dtype lever: only the target decides, so a cheaper draft dtype changes speed, never output."""
    target = HFTarget(tiny_llama(), [0, 2])
    ref = SpecEngine(target).generate(PROMPTS, 16)
    torch.manual_seed(1)
    draft = reduced(target, list(range(0, 64, 2)), block_size=5).to(torch.bfloat16)
    out = SpecEngine(target, draft).generate(PROMPTS, 16)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    hot = draft.head_weight()
    assert hot.dtype == torch.bfloat16 and hot.shape[0] == 32
    assert torch.equal(hot.float(), draft.target.lm_head.weight[draft.vocab].to(torch.bfloat16).float())


def test_full_vocabulary_expansion_for_the_builtin_proposes_what_the_reduced_draft_does():
    """benchmarks/sglang_speed.py serves SGLang's builtin DSPARK (no d2t) the full-vocabulary expansion of a reduced
    draft: same outputs and the same accepted drafts at every step as the reduced draft, here in our engine, on a
    draft whose backbone and Markov table both decide picks."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_cpu"))
    from dspark_testkit import full_vocab_expansion

    target = HFTarget(tiny_llama(), [0, 2])
    ref = SpecEngine(target).generate(PROMPTS, 24)
    pairs = pairs_from(PROMPTS, [r.token_ids for r in ref])
    hot = sorted({n for _, n in pairs} | {0})  # K = 15 of V = 64
    torch.manual_seed(2)
    draft = reduced(target, hot, block_size=5, markov_rank=64).eval()  # random backbone at full norm
    index, prev_ids = {t: i for i, t in enumerate(hot)}, sorted({p for p, _ in pairs})
    with torch.no_grad():
        for p, n in pairs:  # a bigram bias of the size of the base logits: both decide picks
            draft.markov_head.markov_w1.weight[p] = 0.0
            draft.markov_head.markov_w1.weight[p, prev_ids.index(p)] = 1.0
            draft.markov_head.markov_w2.weight[index[n], prev_ids.index(p)] = 3.0
    full = full_vocab_expansion(draft)
    assert full.config.draft_vocab_size is None and full.markov_head.markov_w2.weight.shape == (64, 65)
    a, b = (SpecEngine(target, d).generate(PROMPTS, 24) for d in (draft, full))
    assert [o.token_ids for o in a] == [o.token_ids for o in b] == [r.token_ids for r in ref]
    assert [o.stats.accept_hist for o in a] == [o.stats.accept_hist for o in b]
    assert sum(sum(h[1:]) for h in (o.stats.accept_hist for o in a)) > 0  # drafts are accepted
