"""`torchrun --nnodes N --nproc-per-node M -m training --config configs/X.yaml [--resume] [--dry-run] [k=v ...]`."""

from training.cli import main

if __name__ == "__main__":
    main()
