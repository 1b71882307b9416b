"""`dspark`: thin command-line front end. Parses, calls the library, prints (rich) or emits JSON."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="DSpark speculative decoding: draft, serve, train.")
console = Console(stderr=True)

TARGET = Annotated[str, typer.Option(help="Target HF folder, or `smollm2` for the embedded SmolLM2-135M-Instruct.")]
DRAFT = Annotated[
    str | None, typer.Option(help="DSpark draft folder, or `random` for a random-init draft (τ≈1).")
]
DTYPE = Annotated[str, typer.Option(help="auto (bf16 only where the hardware has native bf16) | float32 | bfloat16 "
                                         "| float16. Lossless T=0 identity holds exactly in float32.")]
MAX_NEW = Annotated[int, typer.Option(min=1, help="Tokens to generate (>= 1).")]
TEMPERATURE = Annotated[float, typer.Option(min=0.0, help="0 = greedy; > 0 samples.")]


def _top_p(value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise typer.BadParameter(f"{value} is not in the range 0<x<=1 (top_p = 0 would keep no token)")
    return value


TOP_P = Annotated[float, typer.Option(callback=_top_p, help="Nucleus mass in (0, 1].")]
BLOCK = Annotated[int | None, typer.Option(min=1, help="A shorter γ than the draft was trained for.")]


# Commands that start child processes keep the default SIGINT behaviour (a child would inherit a blocked signal).
_SPAWNING_COMMANDS = {"train", "serve"}


@app.callback()
def _main(ctx: typer.Context) -> None:
    """DSpark speculative decoding: draft, serve, train."""
    if ctx.invoked_subcommand not in _SPAWNING_COMMANDS:
        from dspark_sgl.interrupt import prompt_interrupt

        ctx.with_resource(prompt_interrupt())


def _fail(msg: str) -> None:
    # a message may hold [brackets]; soft_wrap: a path in it is never broken by a newline (it stays copyable)
    console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True)
    raise typer.Exit(2)


@app.command("init-draft")
def init_draft(
    target: TARGET = "smollm2",
    out: Annotated[Path, typer.Option(help="Folder to write the draft to.")] = Path("out/draft-random"),
    layers: int = 1,
    layer_ids: Annotated[str | None, typer.Option(help="Comma-separated target layer ids (default: spread).")] = None,
    num_aux: int = 5,
    markov_rank: int = 256,
    markov_head: str = "vanilla",
    block_size: int = 7,
    mask_token_id: int | None = None,
    intermediate_size: int | None = None,
    seed: int = 0,
    draft_vocab_size: Annotated[int | None, typer.Option(
        help="K: propose from K hot target tokens (d2t); default: the full vocabulary.")] = None,
    vocab_from: Annotated[Path | None, typer.Option(
        help="The K tokens: a `dspark build-vocab` .json or token-sample JSONL (default: ids 0..K-1).")] = None,
) -> None:
    """Write a random-init draft sized for a target."""
    import dataclasses

    import torch

    from dspark_sgl.config import ConfigError
    from dspark_sgl.loading import init_draft_config, load_tokenizer, resolve_target_dir
    from dspark_sgl.model import DSparkDraft
    from dspark_sgl.model.draft import num_parameters
    from dspark_sgl.vocab import vocab_from as read_vocab

    if vocab_from is not None and draft_vocab_size is None:
        _fail("--vocab-from needs --draft-vocab-size")
    try:
        tdir = resolve_target_dir(target)
        ids = [int(x) for x in layer_ids.split(",")] if layer_ids else None
        cfg = init_draft_config(tdir, load_tokenizer(tdir), layers, ids, num_aux, markov_rank, markov_head,
                                block_size, mask_token_id, intermediate_size)
        if draft_vocab_size is not None:
            cfg = dataclasses.replace(cfg, draft_vocab_size=draft_vocab_size)
        torch.manual_seed(seed)
        draft = DSparkDraft(cfg)
        if vocab_from is not None and cfg.reduced_vocab:
            draft.set_vocab(read_vocab(vocab_from, cfg.draft_vocab, cfg.vocab_size, tdir))
    except (ConfigError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    draft.save_pretrained(out)
    vocab = f", draft vocabulary {cfg.draft_vocab} of {cfg.vocab_size}" if cfg.reduced_vocab else ""
    console.print(f"wrote {out}: {num_parameters(draft) / 1e6:.2f} M parameters, layers {cfg.target_layer_ids}, "
                  f"mask token {cfg.mask_token_id}, γ={cfg.block_size}{vocab}")


@app.command("build-vocab")
def build_vocab(
    data: Annotated[list[Path], typer.Option(
        help="Token-sample JSONL ({input_ids, loss_mask} as the trainer caches, or {token_ids}); repeatable.")],
    size: Annotated[int, typer.Option(help="K, the draft vocabulary size.")],
    target: TARGET = "smollm2",
    out: Annotated[Path, typer.Option(help="Vocabulary JSON to write.")] = Path("out/draft_vocab.json"),
    heldout: Annotated[list[Path] | None, typer.Option(help="Token samples to report coverage on; repeatable.")] = None,
) -> None:
    """Choose K draft tokens from supervised token frequencies (+ the target's stop tokens); report coverage."""
    from dspark_sgl.config import TargetFacts
    from dspark_sgl.loading import resolve_target_dir
    from dspark_sgl.vocab import choose_vocab, coverage, read_token_samples, save_vocab, stop_token_ids, token_counts

    try:
        tdir = resolve_target_dir(target)
        V = TargetFacts.from_path(tdir).vocab_size
        counts = token_counts((s for p in data for s in read_token_samples(p)), V)
        ids = choose_vocab(counts, size, stop_token_ids(tdir))
        cov = {"train": coverage(counts, ids)}
        for p in heldout or []:
            cov[p.stem] = coverage(token_counts(read_token_samples(p), V), ids)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    save_vocab(out, ids, V, coverage=cov, train_tokens=int(counts.sum()))
    for name, c in cov.items():
        console.print(f"coverage {name}: {100 * c:.2f} % of target tokens inside the {size}-token draft vocabulary")
    console.print(f"wrote {out}")


def _engine(target: str, draft: str | None, no_draft: bool, dtype: str, schedule: str, sps: Path | None,
            block_size: int | None = None, time_split: bool = True, batch_size: int = 1, match: bool = False):
    from dspark_sgl.loading import load_pair
    from dspark_sgl.speculative.engine import SpecEngine

    tgt, model, tok = load_pair(target, None if no_draft else (draft or "random"), dtype, block_size=block_size)
    planner = None
    if schedule == "confidence" and model is not None:
        from dspark_sgl.speculative.engine import confidence_planner

        planner = confidence_planner(tgt, model, sps, max_batch=batch_size)
    elif schedule != "static":
        _fail(f"--schedule must be static or confidence, got {schedule!r}")
    from dspark_sgl.speculative.match import MatchConfig

    return SpecEngine(tgt, model, planner, time_split=time_split, match=MatchConfig() if match else None), tok


MATCH = Annotated[bool, typer.Option("--match", help="Each step verify the draft's block or a match from the "
                                     "request's own text, whichever is expected to commit more (lossless).")]
SERVE_MATCH = Annotated[bool | None, typer.Option(
    "--match/--no-match", help="Each step verify the draft's block or a match from the request's own text, "
    "whichever is expected to commit more (lossless). Default: on with --draft; --no-match: the draft alone.")]


@app.command()
def generate(
    target: TARGET = "smollm2",
    draft: DRAFT = None,
    prompt: Annotated[str | None, typer.Option(help="Raw prompt text (no chat template).")] = None,
    chat: Annotated[str | None, typer.Option(help="A user message, wrapped in the target's chat template.")] = None,
    max_new_tokens: MAX_NEW = 128,
    temperature: TEMPERATURE = 0.0,
    top_p: TOP_P = 1.0,
    acceptance: Annotated[str, typer.Option(help="rejection | block (sampling only).")] = "rejection",
    schedule: Annotated[str, typer.Option(help="static | confidence.")] = "static",
    sps_table: Path | None = None,
    no_draft: Annotated[bool, typer.Option("--no-draft", help="Plain target decoding (the baseline).")] = False,
    match: MATCH = False,
    block_size: BLOCK = None,
    dtype: DTYPE = "auto",
    seed: int = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")] = False,
) -> None:
    """Generate with the target, speculatively with a DSpark draft unless --no-draft."""
    from dspark_sgl.loading import check_context, encode_prompt, eos_ids
    from dspark_sgl.speculative.engine import SamplingConfig

    if (prompt is None) == (chat is None):
        _fail("give exactly one of --prompt or --chat")
    if acceptance not in ("rejection", "block"):
        _fail(f"--acceptance must be rejection or block, got {acceptance!r}")
    try:
        engine, tok = _engine(target, draft, no_draft, dtype, schedule, sps_table, block_size, match=match)
        ids = encode_prompt(tok, chat if chat is not None else prompt, chat is not None)
        check_context(engine.target, len(ids), max_new_tokens)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    if draft is None and not no_draft:
        console.print("[yellow]no --draft given: using a random-init draft (τ≈1); pass --no-draft for the baseline")
    console.print(f"generating up to {max_new_tokens} tokens ({len(ids)}-token prompt)")  # stderr: --json stays pure
    t0 = time.perf_counter()
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, acceptance=acceptance, seed=seed)
    (g,) = engine.generate([ids], max_new_tokens, sampling, eos_ids(tok, engine.target))
    dt = time.perf_counter() - t0
    text = tok.decode(g.token_ids, skip_special_tokens=True)
    result = {"text": text, "token_ids": g.token_ids, "tau": g.stats.tau, "tokens_per_s": len(g.token_ids) / dt,
              "per_position_accept": g.stats.per_position_accept, "accept_hist": g.stats.accept_hist,
              "draft_s": g.stats.draft_s, "verify_s": g.stats.verify_s, "speculative": engine.draft is not None,
              "draft_step_ms": {k: 1e3 * v / max(g.stats.steps, 1) for k, v in g.stats.draft_split.items()}}
    if engine.matcher is not None:
        result["match"] = engine.matcher.counters.to_dict()
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    sys.stdout.write(text + "\n")
    mode = "DSpark" if engine.draft is not None else "plain target"
    console.print(f"[bold]{mode}[/]: {len(g.token_ids)} tokens in {dt:.2f} s = {result['tokens_per_s']:.1f} tok/s, "
                  f"τ = {g.stats.tau:.2f} (draft {g.stats.draft_s:.2f} s / verify {g.stats.verify_s:.2f} s)")


@app.command("eval")
def eval_cmd(
    data: Annotated[list[Path], typer.Option(help='JSONL of {"turns": [...]} records; repeatable.')],
    target: TARGET = "smollm2",
    draft: DRAFT = None,
    limit: Annotated[int | None, typer.Option(min=1)] = None,
    max_new_tokens: MAX_NEW = 128,
    temperature: TEMPERATURE = 0.0,
    top_p: TOP_P = 1.0,
    acceptance: str = "rejection",
    schedule: str = "static",
    sps_table: Path | None = None,
    batch_size: Annotated[int, typer.Option(min=1)] = 1,
    block_size: BLOCK = None,
    no_draft: Annotated[bool, typer.Option("--no-draft")] = False,
    match: MATCH = False,
    dtype: DTYPE = "auto",
    seed: int = 0,
    json_out: Path | None = None,
    plot_dir: Annotated[Path | None, typer.Option(
        help="Where to write each dataset's per-position acceptance PNG (default: beside --json-out).")] = None,
) -> None:
    """Acceptance (τ, per-position) and speed over benchmark prompt files."""
    from dspark_sgl.evaluate import evaluate_dataset, plot_acceptance, report_dict
    from dspark_sgl.loading import eos_ids
    from dspark_sgl.speculative.engine import SamplingConfig

    try:
        engine, tok = _engine(target, draft, no_draft, dtype, schedule, sps_table, block_size, batch_size=batch_size,
                              match=match)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    reports = []
    for path in data:
        try:
            sampling = SamplingConfig(temperature=temperature, top_p=top_p, acceptance=acceptance, seed=seed)
            rep, _ = evaluate_dataset(engine, tok, path, limit, max_new_tokens, sampling, eos_ids(tok, engine.target),
                                      batch_size)
        except (FileNotFoundError, ValueError) as e:
            _fail(str(e))
        reports.append(rep)
    table = Table(title=f"DSpark eval (T={temperature}, γ={engine.gamma})")
    for col in ("dataset", "prompts", "τ", "tok/s", *(f"a{k}" for k in range(1, engine.gamma + 1))):
        table.add_column(col, justify="right")
    for r in reports:
        table.add_row(r.name, str(r.prompts), f"{r.tau:.2f}", f"{r.tokens_per_s:.1f}",
                      *(f"{a:.2f}" for a in r.per_position_accept))
    Console().print(table)
    for r in reports:
        steps = ", ".join(f"{k} {v:.1f}" for k, v in r.step_ms.items())
        console.print(f"{r.name}: ms per step (batch of {batch_size}): {steps}")
        if engine.draft is None:
            continue
        split = ", ".join(f"{k} {v:.2f}" for k, v in r.draft_step_ms.items())
        cov = r.draft_vocab_coverage
        cov = "" if cov is None else f"; output tokens inside the draft vocabulary {cov:.1%}"
        console.print(f"{r.name}: draft step ms: {split}{cov}")
        if r.match is not None:
            acc = r.match["accept_length"]
            console.print(f"{r.name}: match verified on {r.match['match_share']:.1%} of request-steps; accept length "
                          f"draft {acc['draft'] or 0:.2f}, match {acc['match'] or 0:.2f}")
        where = plot_dir or (json_out.parent if json_out else None)
        if where is not None:
            stem = f"{json_out.stem}." if json_out and not plot_dir else ""
            console.print(f"wrote {plot_acceptance(r, where / f'{stem}{r.name}.accept.png')}")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report_dict(reports, target=target, draft=draft, temperature=temperature,
                                                   schedule=schedule, match=match), indent=2))


@app.command("profile-sps")
def profile_sps_cmd(
    target: TARGET = "smollm2",
    out: Annotated[Path, typer.Option(help="JSON table to write.")] = Path("out/sps.json"),
    max_tokens: Annotated[int, typer.Option(help="Largest verify batch, in tokens.")] = 64,
    context: int = 256,
    repeats: int = 5,
    dtype: DTYPE = "auto",
) -> None:
    """Measure steps/s of the target verify forward for 1..max_tokens batch tokens (monotone-smoothed)."""
    from dspark_sgl.loading import load_pair
    from dspark_sgl.speculative.engine import profile_target_sps

    try:
        tgt, _, _ = load_pair(target, None, dtype)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    table = profile_target_sps(tgt, max_tokens, context, repeats)
    table.save(out)
    t = Table(title=f"SPS of {target} verify forward (context {context})")
    t.add_column("tokens", justify="right")
    t.add_column("steps/s", justify="right")
    t.add_column("tokens/s", justify="right")
    for n, r in zip(table.tokens, table.steps_per_s, strict=True):
        t.add_row(str(n), f"{r:.1f}", f"{n * r:.0f}")
    Console().print(t)
    console.print(f"wrote {out}")


@app.command()
def calibrate(
    draft: Annotated[str, typer.Option(help="Draft folder; sts.json is written into it.")],
    data: Annotated[list[Path], typer.Option(help='JSONL of {"turns": [...]} records; repeatable.')],
    target: TARGET = "smollm2",
    limit: int = 50,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    dtype: DTYPE = "auto",
    out: Annotated[Path | None, typer.Option(help="Where to write sts.json (default: the draft folder).")] = None,
    heldout: Annotated[list[Path] | None, typer.Option(
        help="JSONL prompts to report calibration on, not the fitting ones (held-out ECE); repeatable.")] = None,
    heldout_limit: int = 50,
) -> None:
    """Sequential temperature scaling of the confidence head from real speculative runs (ECE/AUROC/Brier)."""
    from dspark_sgl.evaluate import calibrate as run_calibration
    from dspark_sgl.loading import eos_ids, load_pair
    from dspark_sgl.speculative.engine import SpecEngine

    try:
        tgt, model, tok = load_pair(target, draft, dtype)
        cal = run_calibration(SpecEngine(tgt, model), tok, data, limit, max_new_tokens, eos_ids(tok, tgt),
                              heldout, heldout_limit, temperature)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    temps, before, after = cal.temperatures, cal.before, cal.after
    where = f"{cal.report_steps} held-out verify steps" if heldout else "the same steps (in-sample)"
    t = Table(title=f"STS fitted on {cal.fit_steps} verify steps, reported on {where}")
    for col in ("position", "T", "ECE before", "ECE after", "AUROC before", "AUROC after", "Brier before",
                "Brier after", "accept rate"):
        t.add_column(col, justify="right")
    for k in range(len(temps)):
        t.add_row(str(k + 1), f"{float(temps[k]):.3g}", f"{before['ece'][k]:.4f}", f"{after['ece'][k]:.4f}",
                  f"{before['auroc'][k]:.3f}", f"{after['auroc'][k]:.3f}", f"{before['brier'][k]:.4f}",
                  f"{after['brier'][k]:.4f}", f"{after['accept_rate'][k]:.3f}")
    Console().print(t)
    dest = out or Path(draft) / "sts.json"
    cal.save(dest)
    console.print(f"wrote {dest}")


# ---- dspark serve (logic in dspark_sgl/sglang/serve.py) ---------------------------------------------------------
@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    draft: Annotated[Path | None, typer.Option(help="DSpark draft folder (serves DSPARK).")] = None,
    target: TARGET = "smollm2",
    no_draft: Annotated[bool, typer.Option("--no-draft", help="Plain target, or SGLang's own algorithm.")] = False,
    dtype: DTYPE = "auto",
    draft_dtype: Annotated[str | None, typer.Option(help="Draft dtype (default: the target's; auto, bfloat16, ...); "
                                                         "lossless either way: only the target decides.")] = None,
    device: Annotated[str, typer.Option(help="cpu (pure-torch kernels) | cuda (SGLang's).")] = "cpu",
    draft_root: Annotated[Path | None, typer.Option(help="Refuse disk weight updates from folders outside this one "
                                                         "(symlinks resolved).")] = None,
    match: SERVE_MATCH = None,
    speculate: Annotated[str | None, typer.Option(help="auto (default: speculate where the measured costs say it "
                                                       "pays) | on | off | match (never draft; verify matches "
                                                       "from the request's text where they pay; implies --match). "
                                                       "At run time: /set_internal_state "
                                                       "dspark_force_budget_frac.")] = None,
    speculate_max_batch: Annotated[int | None, typer.Option(help="Batches larger than this never speculate.")] = None,
    host: str = "127.0.0.1",
    port: int = 30000,
    python: Annotated[Path | None, typer.Option(help="Interpreter with sglang installed (default: this one).")] = None,
) -> None:
    """Start real SGLang with the DSpark plugin: an OpenAI-compatible server. Extra arguments go to SGLang."""
    from dspark_sgl.loading import resolve_target_dir
    from dspark_sgl.sglang.serve import ServeConfig, ServeError, exec_server, exposure_warning, prepare

    if (draft is None) != no_draft:
        _fail("give exactly one of --draft DIR or --no-draft")
    try:
        cfg = ServeConfig(resolve_target_dir(target), draft, dtype, device, host, port, extra=list(ctx.args),
                          draft_dtype=draft_dtype, draft_root=draft_root, match=match, speculate=speculate,
                          speculate_max_batch=speculate_max_batch)
        if python is not None:
            cfg.python = python.absolute()  # not resolve(): a venv python is a symlink to the base one
        cmd, env = prepare(cfg)
    except (ServeError, FileNotFoundError) as e:
        _fail(str(e))
    mode = f"DSPARK draft {draft}" if draft else "no draft"
    used = cmd[cmd.index("--dtype") + 1]  # `auto` resolved by capability
    console.print(f"serving {cfg.target} ({mode}, {device}, {used}): OpenAI-compatible API at http://{host}:{port}/v1")
    warning = exposure_warning(cfg)
    if warning:
        print(warning, file=sys.stderr)
    exec_server(cmd, env)


@app.command("profile-costs", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def profile_costs_cmd(
    ctx: typer.Context,
    draft: Annotated[Path, typer.Option(help="DSpark draft folder, as for `dspark serve`.")],
    target: TARGET = "smollm2",
    dtype: DTYPE = "auto",
    draft_dtype: Annotated[str | None, typer.Option(help="As for `dspark serve`.")] = None,
    device: Annotated[str, typer.Option(help="cpu | cuda, as for `dspark serve`.")] = "cpu",
    match: SERVE_MATCH = None,
    batch_size: Annotated[list[int] | None, typer.Option(help="Batch sizes to profile (repeatable; default every "
                                                              "bucket up to 16: 1 2 3 4 6 8 12 16).")] = None,
    repeats: Annotated[int, typer.Option(help="Interleaved rounds per arm and batch size.")] = 5,
    new_tokens: Annotated[int, typer.Option(help="Decode steps per request and round.")] = 16,
    python: Annotated[Path | None, typer.Option(help="Interpreter with sglang installed (default: this one).")] = None,
    log: Annotated[Path, typer.Option(help="The profiling server's log.")] = Path("out/profile-costs.log"),
) -> None:
    """Measure the full-cost rule's step costs (off, draft, verify by width, per batch bucket) on a loopback server
    before serving, into the per-machine cache that `dspark serve` with the same flags loads. Extra arguments go to
    SGLang, as for `dspark serve`."""
    from dspark_sgl.loading import resolve_target_dir
    from dspark_sgl.model.checkpoint import load_draft
    from dspark_sgl.sglang.planning import SPS_CACHE_ENV
    from dspark_sgl.sglang.profile import ProfilePlan, ProfileServer, cost_rows, run_profile
    from dspark_sgl.sglang.serve import ServeConfig, ServeError, prepare

    if os.environ.get(SPS_CACHE_ENV, "").lower() in ("off", "0", "none", "false"):
        _fail(f"{SPS_CACHE_ENV}={os.environ[SPS_CACHE_ENV]}: the per-machine cost cache is off; nothing to write")
    try:
        plan = ProfilePlan(repeats=repeats, new_tokens=new_tokens, **({"batch_sizes": tuple(batch_size)}
                                                                       if batch_size else {}))
        target_dir = resolve_target_dir(target)
        gamma = load_draft(draft).config.block_size
        vocab = json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"]
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cfg = ServeConfig(target_dir, draft, dtype, device, "127.0.0.1", port, extra=list(ctx.args),
                          draft_dtype=draft_dtype, match=match)
        if python is not None:
            cfg.python = python.absolute()  # not resolve(): a venv python is a symlink to the base one
        cmd, env = prepare(cfg)
    except (ServeError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    console.print(f"profiling {target_dir} + {draft} on a loopback server (log {log}): batch sizes "
                  f"{list(plan.batch_sizes)}, {plan.repeats} rounds x (off, spec) x {plan.new_tokens} steps")
    with ProfileServer(cmd, env, port, log) as server:
        info = run_profile(server, plan, gamma, vocab, say=console.print)
    path = info.get("cost_table")
    if not path or not Path(path).is_file():
        _fail(f"the server wrote no cost table (record: {info.get('cost_table')!r}; log {log})")
    t = Table(title=f"step costs (ms, median of the last 9) -> {path}")
    for col in ("bucket", "off", "draft", "verify+accept+commit by width 1..γ+1"):
        t.add_column(col, justify="right")
    for r in cost_rows(json.loads(Path(path).read_text())):
        t.add_row(str(r["bucket"]), str(r["off_ms"]), str(r["draft_ms"]),
                  " ".join("-" if a is None else f"{a:g}" for a in r["after_ms"]))
    Console().print(t)
    console.print(f"wrote {path}: `dspark serve` with the same target, draft and flags on this machine loads it")


def _register_plugins() -> None:
    """Commands that live outside the core (quantization tools, the trainer) register through entry points."""
    from dspark_sgl.tools.cli_tools import register as register_tools

    register_tools(app)
    for ep in entry_points(group="dspark_sgl.cli"):
        ep.load()(app)


_register_plugins()

if __name__ == "__main__":
    app()
