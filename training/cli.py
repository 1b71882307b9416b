"""The trainer's one front end (typer): `dspark train ...`, and `torchrun ... -m training ...` (same function)."""

from __future__ import annotations

from typing import Annotated

import typer

COMMAND = dict(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})


def train(
    ctx: typer.Context,
    config: Annotated[str | None, typer.Option(help="YAML recipe, e.g. configs/smollm2-135m-cpu.yaml")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the latest complete checkpoint.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Build on the meta device; print params/memory.")]
    = False,
    world_size: Annotated[int | None, typer.Option(help="Dry-run: ranks to plan for (default: the recipe's).")]
    = None,
    export: Annotated[bool, typer.Option("--export", help="Export the latest checkpoint and exit.")] = False,
) -> None:
    """Train a DSpark draft online against its target. Extra args are dotted key=value recipe overrides."""
    from training.recipe import RecipeError, load_recipe

    overrides = list(ctx.args)
    try:
        recipe = load_recipe(config, overrides)
    except RecipeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    if dry_run:
        from training.dryrun import dry_run as run_dry

        run_dry(recipe, world_size=world_size)
        return
    from training.trainer import train as run_train

    run_train(recipe, config, overrides, resume=resume, export_only=export)


def register(app: typer.Typer) -> None:
    """The `dspark_sgl.cli` entry point: `dspark train`."""
    app.command(**COMMAND)(train)


def main() -> None:
    """`python -m training` (what torchrun runs): the same command as `dspark train`."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(**COMMAND)(train)
    app()
