"""Test helpers for real SGLang on CPU: start/stop a server on loopback, and build a deliberately good draft.

Used by tests/test_sglang_*.py and benchmarks/sglang_speed.py. Nothing here is product code: the CPU kernels, the
server arguments and environment come from the product (dspark_sgl.sglang.cpu, dspark_sgl.sglang.serve).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from dspark_sgl.sglang.client import post_json
from dspark_sgl.sglang.cpu import PLUGIN_ENTRY_POINTS, probe, server_env, tp_size_of
from dspark_sgl.sglang.planning import SPS_CACHE_ENV
from dspark_sgl.sglang.serve import CPU_SERVER_ARGS as PRODUCT_CPU_ARGS

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SGL_VENV = Path(os.environ.get("DSPARK_SGL_VENV", "/work/sgl-venv"))

CPU_SERVER_ARGS = [*PRODUCT_CPU_ARGS, "--dtype", "float32"]  # what `dspark serve` passes on a CPU, in fp32


@cache
def sglang_python() -> Path | None:
    """The interpreter of a venv where sglang imports (the current one, else $DSPARK_SGL_VENV); probed once."""
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    for py in (Path(sys.executable), SGL_VENV / "bin" / "python"):
        if py.exists():
            ok = subprocess.run([str(py), "-c", "import sglang, dspark_sgl"], capture_output=True, env=env, cwd="/tmp")
            if ok.returncode == 0:
                return py
    return None


@cache
def _facts(py: Path) -> dict:
    facts = probe(py)
    absent = [name for name in PLUGIN_ENTRY_POINTS if name not in facts["plugins"]]
    if absent:  # e.g. a venv installed before the entry point existed
        raise RuntimeError(f"{py} lacks the sglang.srt.plugins entry points {absent}: rerun .ci/install_sglang.sh")
    return facts


def cpu_env(extra: dict[str, str] | None = None, tp_size: int = 1) -> dict[str, str]:
    """The product's CPU server environment (stand-ins the sglang venv lacks, each TP rank's cores), plus `extra`."""
    py = sglang_python()
    env = server_env(py, facts=_facts(py), tp_size=tp_size) if py else dict(os.environ)
    env.setdefault(SPS_CACHE_ENV, "off")  # every server measures its own SPS table unless a test says otherwise
    env.update(extra or {})
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """One `python -m sglang.launch_server` process group; `stop()` ends exactly the group it started."""

    model: Path
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        py = sglang_python()
        if py is None:
            raise RuntimeError("no venv with sglang + dspark_sgl (run .ci/install_sglang.sh)")
        return [str(py), "-m", "sglang.launch_server", "--model-path", str(self.model), *CPU_SERVER_ARGS,
                "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]

    def process_env(self) -> dict[str, str]:
        return cpu_env(self.env, tp_size_of(self.extra_args))

    def start(self, timeout: float = 600.0) -> Server:
        cmd = self.command()
        self.log_path = self.log_path or Path(f"/tmp/dspark-sglang-{self.port}.log")
        log = open(self.log_path, "w")  # noqa: SIM115 - the child owns it until stop()
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.process_env(),
                                     cwd="/tmp", start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
        self.stop()
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.log()[-3000:]}")

    def run_to_exit(self, timeout: float = 600.0) -> tuple[int, str]:
        """Start expecting a start-up failure: (exit code, log)."""
        try:
            res = subprocess.run(self.command(), capture_output=True, text=True, timeout=timeout,
                                 env=self.process_env(), cwd="/tmp", start_new_session=True)
        except subprocess.TimeoutExpired as e:
            return -1, f"{e.stdout or ''}{e.stderr or ''}"
        return res.returncode, res.stdout + res.stderr

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        time.sleep(1)
        try:  # children (scheduler, detokenizer) share the group; make sure none outlives the launcher
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- HTTP --------------------------------------------------------------------------------------------
    def post(self, path: str, payload: dict, timeout: float = 300.0) -> dict:
        return post_json(self.url, path, payload, timeout)

    def get(self, path: str, timeout: float = 60.0) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def generate(self, input_ids: list[list[int]], max_new_tokens: int, **sampling) -> list[dict]:
        """One batched /generate (SGLang schedules the requests concurrently)."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **sampling}
        out = self.post("/generate", {"input_ids": input_ids, "sampling_params": params})
        return out if isinstance(out, list) else [out]


@dataclass
class ServeCommand(Server):
    """The product command, `dspark serve --target MODEL --dtype float32 SERVE_ARGS`, not a bare launch_server."""

    serve_args: list[str] = field(default_factory=list)

    def command(self) -> list[str]:
        py = sglang_python()
        if py is None:
            raise RuntimeError("no venv with sglang + dspark_sgl (run .ci/install_sglang.sh)")
        return [sys.executable, "-m", "dspark_sgl.cli", "serve", "--python", str(py), "--target", str(self.model),
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", *self.serve_args]

    def process_env(self) -> dict[str, str]:
        # `dspark serve` builds the server's environment itself; the SPS cache as in cpu_env
        return {SPS_CACHE_ENV: "off", **os.environ, **self.env}

    def chat(self, content: str, max_tokens: int) -> dict:
        """One greedy request through the OpenAI-compatible endpoint."""
        model = self.get("/v1/models")["data"][0]["id"]
        return self.post("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": content}],
                                                  "temperature": 0, "max_tokens": max_tokens})


# ---- a deliberately good draft ------------------------------------------------------------------------------
def bigram_table(sequences: list[list[int]]) -> dict[int, int]:
    """prev token -> most frequent next token over the given sequences (ties to the smaller id)."""
    counts: dict[int, Counter] = defaultdict(Counter)
    for seq in sequences:
        for a, b in zip(seq, seq[1:], strict=False):
            counts[a][b] += 1
    return {a: min(c, key=lambda t: (-c[t], t)) for a, c in counts.items()}


def draft_fields_for(target_dir: Path, block_size: int, **more) -> dict:
    """A one-layer draft's config fields shaped like the target's layers (heads, head_dim, norm eps, rope theta)."""
    from dspark_sgl.config import default_target_layer_ids

    t = json.loads((Path(target_dir) / "config.json").read_text())
    return dict(
        hidden_size=t["hidden_size"], num_hidden_layers=1, num_attention_heads=t["num_attention_heads"],
        num_key_value_heads=t["num_key_value_heads"], head_dim=t.get("head_dim") or t["hidden_size"] // t[
            "num_attention_heads"], intermediate_size=t["intermediate_size"], vocab_size=t["vocab_size"],
        rms_norm_eps=t["rms_norm_eps"], rope_theta=(t.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        block_size=block_size, target_layer_ids=default_target_layer_ids(t["num_hidden_layers"], 3),
        num_target_layers=t["num_hidden_layers"], mask_token_id=0, **more)


def build_bigram_draft(target_dir: Path, sequences: list[list[int]], out_dir: Path, block_size: int = 7,
                       scale: float = 30.0, seed: int = 0, final_norm: float = 1e-3, **overrides) -> Path:
    """A DSpark draft whose Markov head is the bigram table of `sequences` (e.g. the target's own greedy outputs).

    The backbone is random but its final norm is ~0, so base logits are tiny and each draft token is the bigram
    successor of the previous one: a good predictor of a target that repeats itself, built without training.
    `final_norm=1.0` keeps the random backbone's base logits (SmolLM2: max ≈ 10-14 over the vocabulary): with a
    `scale` of that size, each proposal is the bigram successor or the backbone's pick over the context. The
    confidence head says 0.95 when the previous token is in the table and 0.05 when it is not, so the confidence
    schedule has something true to act on. The whole draft path (context K/V, block forward, rollout, confidence)
    still runs.
    """
    import torch

    from dspark_sgl.config import DSparkConfig
    from dspark_sgl.model.checkpoint import save_draft
    from dspark_sgl.model.draft import DSparkDraft

    table = bigram_table(sequences)
    prevs = sorted(table)
    fields = draft_fields_for(target_dir, block_size, markov_rank=max(len(prevs), 8))
    fields.update(overrides)
    config = DSparkConfig(**fields)
    torch.manual_seed(seed)
    draft = DSparkDraft(config)
    with torch.no_grad():
        draft.norm.weight.fill_(final_norm)
        head = draft.markov_head
        head.markov_w1.weight.zero_()
        head.markov_w2.weight.zero_()
        for j, prev in enumerate(prevs):
            head.markov_w1.weight[prev, j] = 1.0
            head.markov_w2.weight[table[prev], j] = scale
        conf = draft.confidence_head
        if conf is not None and conf.with_markov:
            conf.proj.weight.zero_()
            conf.proj.weight[0, config.hidden_size:] = 6.0  # markov_w1(prev) is one-hot when prev is known
            conf.proj.bias.fill_(-3.0)
    return save_draft(draft, out_dir)


def hot_vocab(keep: set[int], vocab_size: int, k: int) -> list[int]:
    """K target ids for a reduced-vocabulary draft: `keep` plus the lowest other ids, sorted."""
    filler = (i for i in range(vocab_size) if i not in keep)
    return sorted(keep | {next(filler) for _ in range(k - len(keep))})


def restrict_vocab(full_dir: Path, out_dir: Path, keep: set[int], k: int) -> Path:
    """The same draft over K target ids (hot_vocab of keep): markov_w2 rows gathered, d2t set. Restricting the
    bigram draft to ids that hold every bigram successor leaves its greedy choices unchanged."""
    import dataclasses

    import torch

    from dspark_sgl.model.draft import DSparkDraft

    full = DSparkDraft.from_pretrained(full_dir)
    ids = hot_vocab(keep, full.config.vocab_size, k)
    draft = DSparkDraft(dataclasses.replace(full.config, draft_vocab_size=k))
    state = full.state_dict()
    state["markov_head.markov_w2.weight"] = state["markov_head.markov_w2.weight"][ids]
    draft.load_state_dict(state | {"d2t": torch.tensor(ids) - torch.arange(k)})
    draft.save_pretrained(out_dir)
    return out_dir


# ---- a random draft whose proposals depend on everything --------------------------------------------------------
def build_random_draft(target_dir: Path, out_dir: Path, block_size: int = 3, seed: int = 0, std: float = 0.5,
                       draft_vocab: list[int] | None = None, sequences: list[list[int]] | None = None,
                       scale: float = 3.0, **overrides) -> Path:
    """A random fp32 DSpark draft (every weight N(0, std), final norm included): unlike the bigram oracle above, its
    proposals depend on the backbone, the draft context K/V, positions and the Markov previous token, so a wrong
    context write, commit or stale-context cap changes what it proposes (and so the accept counts). draft_vocab:
    target ids of a reduced vocabulary (d2t). sequences: also put their bigram table into the Markov head at
    `scale` (comparable to the random base logits), so long runs are accepted too and the previous token matters."""
    import torch

    from dspark_sgl.config import DSparkConfig
    from dspark_sgl.model.checkpoint import save_draft
    from dspark_sgl.model.draft import DSparkDraft

    table = bigram_table(sequences or [])
    fields = draft_fields_for(target_dir, block_size, markov_rank=max(len(table), 8),
                              draft_vocab_size=len(draft_vocab) if draft_vocab else None)
    fields.update(overrides)
    torch.manual_seed(seed)
    draft = DSparkDraft(DSparkConfig(**fields))
    with torch.no_grad():
        for prm in draft.parameters():
            prm.normal_(0, std)
    if draft_vocab:
        draft.set_vocab(torch.tensor(draft_vocab))
    ids = (draft.vocab if draft_vocab else torch.arange(fields["vocab_size"])).tolist()
    head = draft.markov_head
    with torch.no_grad():
        for j, prev in enumerate(sorted(table)):
            head.markov_w1.weight[:, j] = 0.0
            head.markov_w1.weight[prev, j] = 1.0
            head.markov_w2.weight[:, j] = 0.0
            if table[prev] in ids:
                head.markov_w2.weight[ids.index(table[prev]), j] = scale
    return save_draft(draft, out_dir)


def reference_accept(target_dir: Path, draft_dir: Path, prompts: list[list[int]], max_new: int) -> dict:
    """What a served DSPARK worker must reproduce at T = 0 under the static schedule with `ignore_eos`: the reference
    engine's (dspark_sgl.speculative.engine, fp32, no EOS stop) outputs, per-request accepted-count histograms
    (`accept_hist`, c = 0..γ) and its plain (no draft) outputs."""
    from dspark_sgl.model.checkpoint import load_draft
    from dspark_sgl.speculative.engine import SpecEngine
    from dspark_sgl.targets.hf import HFTarget

    draft = load_draft(draft_dir)
    hf = HFTarget.from_pretrained(target_dir, draft.config.target_layer_ids)
    out = SpecEngine(hf, draft).generate(prompts, max_new)
    plain = SpecEngine(hf).generate(prompts, max_new)
    return {"outputs": [o.token_ids for o in out], "hists": [o.stats.accept_hist for o in out],
            "plain": [o.token_ids for o in plain], "gamma": draft.config.block_size}


def served_hists(outs: list[dict], gamma: int) -> list[list[int]]:
    """Each served request's accepted-count histogram (SGLang's spec_correct_drafts_histogram), padded to γ + 1."""
    hists = [list(o["meta_info"]["spec_correct_drafts_histogram"]) for o in outs]
    return [h + [0] * (gamma + 1 - len(h)) for h in hists]


# ---- a tiny random target with a small vocabulary (cheap enough for thousands of served samples) -------------------
def build_tiny_target(out_dir: Path, vocab: int = 8, hidden: int = 64, layers: int = 4, seed: int = 0) -> Path:
    """A random fp32 Llama with `vocab` tokens and a word-level tokenizer t0..t{vocab-1} (eos = the last token), so
    SGLang serves it like any model: input_ids in, output_ids out, min_new_tokens available."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    eos = vocab - 1
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
                      tie_word_embeddings=False, rope_theta=10000.0, bos_token_id=0, eos_token_id=eos,
                      torch_dtype="float32")
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # sharper than the default init: distributions far from uniform
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    words = {f"t{i}": i for i in range(vocab)}
    tk = Tokenizer(WordLevel(words, unk_token="t0"))
    tk.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="t0", eos_token=f"t{eos}", unk_token="t0",
                            pad_token="t0").save_pretrained(out_dir)
    return out_dir


# ---- a reduced-vocabulary draft for SGLang's builtin, which has no d2t ---------------------------------------------
OUTSIDE_VOCAB_BIAS = -1e4  # far below any base logit, so no token outside the draft vocabulary can win the argmax


def full_vocab_expansion(draft, outside_bias: float = OUTSIDE_VOCAB_BIAS):
    """The same draft over the full vocabulary: what a reduced-vocabulary (d2t) draft proposes, in a form SGLang's
    builtin DSPARK loads. A vanilla Markov head gains one rank whose latent is 1 for every previous token: its W2
    column is 0 on the K draft tokens and `outside_bias` elsewhere, and the K draft tokens' W2 rows are the reduced
    head's. So every draft token's step logit is unchanged (base = the same lm_head row, bias + 0) and every other
    token's is pushed out of reach: the greedy pick is the reduced draft's (up to fp32 summation order). The
    confidence head (which reads the same latent) gets a zero weight for the new rank. Greedy drafts only: the
    step distribution under sampling is not the reduced draft's (exp(-1e4) is not exactly 0 in every kernel)."""
    import dataclasses

    import torch

    from dspark_sgl.model.draft import DSparkDraft

    c = draft.config
    if not c.reduced_vocab:
        return draft
    if c.markov_head_type != "vanilla":
        raise ValueError(f"full_vocab_expansion handles the vanilla Markov head, not {c.markov_head_type!r}")
    big = DSparkDraft(dataclasses.replace(c, draft_vocab_size=None, markov_rank=c.markov_rank + 1))
    state = {k: v for k, v in draft.state_dict().items() if k != "d2t"}
    w1, w2 = state["markov_head.markov_w1.weight"], state["markov_head.markov_w2.weight"]
    state["markov_head.markov_w1.weight"] = torch.cat((w1, w1.new_ones(w1.shape[0], 1)), 1)
    full = w2.new_zeros(c.vocab_size, c.markov_rank + 1)
    full[:, -1] = outside_bias
    full[draft.vocab] = torch.cat((w2, w2.new_zeros(w2.shape[0], 1)), 1)
    state["markov_head.markov_w2.weight"] = full
    if draft.confidence_head is not None and draft.confidence_head.with_markov:
        w = state["confidence_head.proj.weight"]
        state["confidence_head.proj.weight"] = torch.cat((w, w.new_zeros(w.shape[0], 1)), 1)
    big.load_state_dict(state)
    return big.to(next(draft.parameters()).dtype)


def expand_draft_folder(draft_dir: Path, out_dir: Path) -> Path:
    """`full_vocab_expansion` of a draft folder, written to out_dir (sts.json, if any, is copied along)."""
    import shutil

    from dspark_sgl.model.checkpoint import load_draft, save_draft

    out = save_draft(full_vocab_expansion(load_draft(draft_dir)), out_dir)
    if (Path(draft_dir) / "sts.json").exists():
        shutil.copy(Path(draft_dir) / "sts.json", out / "sts.json")
    return out
