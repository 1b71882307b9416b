from dspark_sgl.target.hf import HFTarget, TargetKV, TargetOutput

__all__ = ["HFTarget", "TargetKV", "TargetOutput"]
