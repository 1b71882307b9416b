"""`torchrun --nnodes N --nproc-per-node M -m training --config configs/X.yaml [--resume] [--dry-run] [k=v ...]`."""

from __future__ import annotations

import argparse
import sys

from training.recipe import load_recipe


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m training", description=__doc__)
    ap.add_argument("--config", help="YAML recipe (configs/*.yaml)")
    ap.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    ap.add_argument("--dry-run", action="store_true", help="build on the meta device; print params and memory")
    ap.add_argument("--export", action="store_true", help="export the latest checkpoint to out_dir/draft-step-N")
    ap.add_argument("--world-size", type=int, default=None, help="dry-run: ranks to plan for (default: recipe)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value, e.g. train.max_steps=10")
    args = ap.parse_args(argv)
    recipe = load_recipe(args.config, args.overrides)
    if args.dry_run:
        from training.dryrun import dry_run

        dry_run(recipe, world_size=args.world_size)
        return
    from training.trainer import train

    train(recipe, args.config, args.overrides, resume=args.resume, export_only=args.export)


if __name__ == "__main__":
    main(sys.argv[1:])
