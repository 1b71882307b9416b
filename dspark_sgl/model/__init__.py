from dspark_sgl.model.checkpoint import CheckpointError, load_draft, save_draft
from dspark_sgl.model.draft import DraftContextCache, DSparkDraft, block_attention_mask

__all__ = ["CheckpointError", "DSparkDraft", "DraftContextCache", "block_attention_mask", "load_draft", "save_draft"]
