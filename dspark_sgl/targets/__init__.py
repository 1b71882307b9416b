from dspark_sgl.targets.hf import HFTarget, TargetKV, TargetOutput

__all__ = ["HFTarget", "TargetKV", "TargetOutput"]
