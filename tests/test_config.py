import json

import pytest

from dspark_sgl.config import DSPARK_KEYS, ConfigError, DSparkConfig, default_target_layer_ids

BACKBONE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=100, rms_norm_eps=1e-5, rope_theta=50000.0,
                max_position_embeddings=4096)
DSPARK = dict(block_size=5, target_layer_ids=[1, 3, 6], num_target_layers=8, mask_token_id=97, markov_rank=12,
              markov_head_type="gated", enable_confidence_head=True, confidence_head_with_markov=False,
              sample_from_anchor=True)


def reference() -> DSparkConfig:
    return DSparkConfig(**BACKBONE, **DSPARK)


def layouts() -> dict[str, dict]:
    """The places peers put the DSpark keys."""
    prefixed = {"dspark_block_size": 5, "dspark_markov_rank": 12, "dspark_markov_head_type": "gated",
                "dspark_noise_token_id": 97, "dspark_target_layer_ids": [1, 3, 6], "dspark_num_target_layers": 8,
                "dspark_confidence_head_with_markov": False}
    return {
        "canonical": reference().to_dict(),
        "sglang_top_level": {**BACKBONE, **DSPARK},
        "specforge_dflash_config": {**BACKBONE, "block_size": 5, "num_target_layers": 8, "dflash_config": {
            k: v for k, v in DSPARK.items() if k not in ("block_size", "num_target_layers")}},
        "sglang_dspark_config": {**BACKBONE, "dspark_config": DSPARK},
        "sglang_prefixed_in_target": {**BACKBONE, **prefixed},
        "text_config": {"text_config": BACKBONE, **DSPARK},
        # dspark_config wins over dflash_config (SGLang's precedence)
        "both_nested": {**BACKBONE, "dflash_config": {**DSPARK, "block_size": 9, "markov_rank": 3},
                        "dspark_config": DSPARK},
    }


@pytest.mark.parametrize("name", list(layouts()))
def test_every_layout_reads_to_the_same_config(name, tmp_path):
    cfg = DSparkConfig.from_dict(layouts()[name])
    assert cfg == reference()
    cfg.save_pretrained(tmp_path)  # and our canonical file round-trips
    assert DSparkConfig.from_pretrained(tmp_path) == reference()


def test_canonical_file_carries_every_key_where_each_peer_reads_it(tmp_path):
    reference().save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    for key in DSPARK_KEYS:  # SGLang top-level, SGLang dspark_config, SpecForge/vLLM dflash_config
        assert raw[key] == raw["dspark_config"][key] == raw["dflash_config"][key] == getattr(reference(), key)
    assert raw["architectures"] == ["DSparkDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["mask_token_id"] == 97 and raw["target_layer_ids"] == [1, 3, 6]  # resolved, unlike SpecForge


def test_rope_parameters_of_transformers5_are_read():
    raw = {**BACKBONE, **DSPARK, "rope_parameters": {"rope_theta": 123.0, "rope_type": "default"}}
    raw.pop("rope_theta")
    assert DSparkConfig.from_dict(raw).rope_theta == 123.0


BAD = {
    "block_size": ({"block_size": 0}, "block_size"),
    "heads": ({"num_attention_heads": 6, "num_key_value_heads": 4}, "not divisible"),
    "markov_rank": ({"markov_rank": 0}, "markov_rank"),
    "markov_type": ({"markov_head_type": "lstm"}, "markov_head_type"),
    "mask_missing": ({"mask_token_id": None}, "mask_token_id is missing"),
    "mask_oov": ({"mask_token_id": 100}, "outside the vocabulary"),
    "layer_id": ({"target_layer_ids": [1, 8]}, "only 8 layers"),
    "no_layers": ({"target_layer_ids": []}, "target_layer_ids is empty"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_config_raises_one_clear_error(name):
    change, message = BAD[name]
    with pytest.raises(ConfigError, match=message):
        DSparkConfig(**{**BACKBONE, **DSPARK, **change})


def test_validation_against_the_target():
    cfg = reference()
    with pytest.raises(ConfigError, match="hidden_size=64 != target hidden size 128"):
        cfg.validate(target_hidden_size=128)
    with pytest.raises(ConfigError, match="only 4 layers"):
        cfg.validate(target_num_layers=4)
    with pytest.raises(ConfigError, match="vocab_size=100 != target vocab size 90"):
        cfg.validate(target_vocab_size=90)
    cfg.validate(target_hidden_size=64, target_num_layers=8, target_vocab_size=100)


def test_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        DSparkConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        DSparkConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"block_size": 7}))
    with pytest.raises(ConfigError, match="missing required keys"):
        DSparkConfig.from_pretrained(tmp_path)


def test_default_layer_ids_spread_over_the_target():
    ids = default_target_layer_ids(30, 5)
    assert len(ids) == 5 and ids == sorted(ids) and ids[0] >= 1 and ids[-1] <= 27
    assert default_target_layer_ids(4, 5) == [0, 1, 2, 3] and default_target_layer_ids(4, 2) == [0, 3]
