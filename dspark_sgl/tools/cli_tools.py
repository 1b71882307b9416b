"""`dspark quantize | drift | breakeven | export-gguf`: thin typer wrappers over dspark_sgl.tools.*.

The lead's cli.py calls `register(app)`; every heavy import happens inside the command that needs it.
"""

from __future__ import annotations

from pathlib import Path

import typer


def _fail(e: Exception) -> None:
    typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def quantize(
    draft: Path = typer.Option(..., "--draft", help="unquantized draft folder"),
    out: Path = typer.Option(..., "--out", help="output folder (compressed-tensors checkpoint)"),
    scheme: str = typer.Option(None, "--scheme", help="fp8 | nvfp4 | mxfp4 (card 000 selection)"),
    include: list[str] = typer.Option(None, "--include", help="module glob(s) to quantize instead of the default"),
    exclude: list[str] = typer.Option(None, "--exclude", help="module glob(s) to keep unquantized"),
    mixed: str = typer.Option(None, "--mixed", help="per-pattern schemes, e.g. o_proj=mxfp4,default=fp8 (card 002)"),
    rest_dtype: str = typer.Option("bf16", "--rest-dtype", help="dtype of the unquantized tensors: bf16|fp16|fp32"),
    recipe: str = typer.Option(
        None, "--recipe", help="a model card's build by name: kimi-k3-dspark-{fp8,nvfp4,mxfp4,oproj-mxfp4}"
    ),
) -> None:
    """Weight-only FP8 / NVFP4 / MXFP4 quantization into a compressed-tensors checkpoint plus a manifest."""
    from rich.console import Console
    from rich.table import Table

    from dspark_sgl.tools.quantize import quantize_draft

    try:
        result = quantize_draft(draft, out, scheme, include or None, exclude or None, mixed, rest_dtype, recipe)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    m = result.manifest
    table = Table(title=f"{out} ({m['params']['fraction'] * 100:.1f}% of parameters quantized)")
    for col in ("format", "tensors", "example"):
        table.add_column(col)
    for fmt, names in m["tensors_by_scheme"].items():
        table.add_row(fmt, str(len(names)), names[0] if names else "")
    Console().print(table)


def drift(
    reference: Path = typer.Option(..., "--reference", help="FP32 reference draft folder"),
    candidate: list[str] = typer.Option(
        ...,
        "--candidate",
        help="draft folder, or fp32/bf16/fp16 (reference weights in that compute dtype); repeatable",
    ),
    data: Path = typer.Option(None, "--data", help='JSONL rows with "input_ids", "text" or "turns"'),
    target: Path = typer.Option(None, "--target", help="HF target folder: real heads, tokenizer, 'target' aux"),
    regimes: str = typer.Option("boot,heavy,gauss", "--regimes", help="comma list of target,boot,heavy,gauss"),
    blocks: int = typer.Option(256, "--blocks", help="blocks per regime"),
    seq_len: int = typer.Option(64, "--seq-len"),
    compute_dtype: str = typer.Option("bf16", "--compute-dtype", help="compute dtype of folder candidates"),
    threshold: float = typer.Option(0.5, "--threshold", help="scheduling threshold on cumulative confidence"),
    no_floor: bool = typer.Option(False, "--no-floor", help="do not add the BF16 noise-floor variant"),
    seed: int = typer.Option(0, "--seed"),
    out: Path = typer.Option(Path("drift"), "--out", help="writes OUT.json and OUT.png"),
) -> None:
    """Drift of candidates vs an FP32 reference (card 000): tables, JSON and a per-position decay PNG."""
    from rich.console import Console

    from dspark_sgl.tools import drift as D

    try:
        names = tuple(r.strip() for r in regimes.split(",") if r.strip())
        settings = D.DriftSettings(blocks=blocks, regimes=names, seq_len=seq_len, threshold=threshold, seed=seed)
        ref, variants = D.load_variants(reference, candidate, compute_dtype, floor=not no_floor)
        tgt, tokenizer = None, None
        if target is not None:
            from transformers import AutoTokenizer

            from dspark_sgl.targets.hf import HFTarget

            tgt = HFTarget.from_pretrained(target, ref.config.target_layer_ids)
            ref.config.validate(tgt.hidden_size, tgt.num_layers, tgt.vocab_size)
            embed, head = tgt.embed_tokens, tgt.lm_head
            try:  # only text rows need it; a bare model folder (no tokenizer files) still works
                tokenizer = AutoTokenizer.from_pretrained(str(target))
            except (OSError, ValueError):
                tokenizer = None
            if "target" not in names:
                settings.regimes = ("target", *names)
        else:
            if "target" in names:
                raise D.DriftError("the 'target' regime needs --target")
            embed, head = D.synthetic_heads(ref.config.vocab_size, ref.config.hidden_size, seed)
        stream = D.read_token_streams(data, tokenizer) if data else None
        console = Console()
        if not console.is_terminal:  # piped to a file: do not squeeze the tables into 80 columns
            console = Console(width=160)
        report = D.run_drift(
            ref,
            variants,
            settings,
            embed,
            head,
            stream,
            tgt,
            progress=lambda r, i, n: console.log(f"{r}: {i}/{n} windows"),
        )
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    for table in D.report_tables(report):
        console.print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out.with_suffix(".json"), out.with_suffix(".png")
    json_path.write_text(report.to_json())
    D.plot_decay(report, png_path)
    console.print(f"wrote {json_path} and {png_path}")


def breakeven(
    a_ref: float = typer.Option(..., "--a-ref", help="acceptance length of the reference draft"),
    a_cand: float = typer.Option(..., "--a-cand", help="acceptance length (or ceiling) of the candidate"),
    d_ratio: float = typer.Option(..., "--d-ratio", help="candidate draft-pass cost / reference draft-pass cost"),
    d_over_t: float = typer.Option(None, "--d-over-t", help="reference draft-pass cost / target verify cost"),
) -> None:
    """The a/(d+T) break-even arithmetic of card 000: decide before benchmarking."""
    from rich.console import Console
    from rich.table import Table

    from dspark_sgl.tools.breakeven import breakeven as compute
    from dspark_sgl.tools.breakeven import describe

    try:
        result = compute(a_ref, a_cand, d_ratio, d_over_t)
    except ValueError as e:
        _fail(e)
    table = Table(title="Speculative break-even: throughput ∝ a / (d + T)")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for row in describe(result):
        table.add_row(*row)
    Console().print(table)


def export_gguf(
    draft: Path = typer.Option(..., "--draft", help="unquantized draft folder"),
    out: Path = typer.Option(..., "--out", help="output .gguf file"),
    arch: str = typer.Option("dflash", "--arch", help="dflash (llama.cpp upstream) or dspark"),
    target: str = typer.Option(
        "smollm2", "--target", help="the target GGUF llama.cpp serves (-m), or `smollm2` for the packaged one"
    ),
) -> None:
    """GGUF for llama.cpp's dflash architecture (`llama-server -m TARGET.gguf -md OUT --spec-type draft-dspark`):
    the target's tokenizer copied in; embedding and lm_head stripped (card 003), or, for a reduced vocabulary, the
    target's K hot output rows as the draft's head (docs/llamacpp.md)."""
    from dspark_sgl.tools.gguf_export import export_gguf as run

    try:
        if target == "smollm2":
            from dspark_sgl.targets.smollm2 import smollm2_gguf_path

            target = smollm2_gguf_path()
        summary = run(draft, out, arch, target_gguf=target)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    typer.echo(
        f"wrote {summary.path}: {len(summary.written)} tensors, {summary.nbytes / 2**20:.1f} MiB, "
        f"arch={summary.arch}" + (f", stripped {summary.stripped}" if summary.stripped else "")
    )


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize)
    app.command("drift")(drift)
    app.command("breakeven")(breakeven)
    app.command("export-gguf")(export_gguf)
