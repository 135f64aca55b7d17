"""ModelConfig.from_hf on real-style configs; broken ones raise ConfigError naming the field."""

import json
import math
from pathlib import Path

import pytest

from metrale_jax import ConfigError, ModelConfig, ModelLevers

CONFIGS = Path(__file__).parent.parent / "fixtures" / "configs"


def _load(name):
    return json.loads((CONFIGS / name).read_text())


def test_nemotron_h_8b():
    cfg = ModelConfig.from_hf(CONFIGS / "nemotron_h_8b.json")
    assert cfg.num_hidden_layers == 52
    assert cfg.hybrid_override_pattern.count("M") == 24 and cfg.hybrid_override_pattern.count("*") == 4
    assert cfg.head_dim == 128                          # from attention_head_dim
    assert cfg.time_step_limit == (0.0, math.inf)       # {"__float__": "Infinity"}
    assert cfg.d_inner == 8192
    assert cfg.conv_dim == 8192 + 2 * 8 * 128
    assert cfg.in_proj_dim == 8192 + cfg.conv_dim + 128 == 18560
    assert cfg.gated_norm_group_size == 1024
    assert len(cfg.mamba_layer_ids) == 24 and cfg.mamba_layer_ids[:3] == (0, 2, 4)


def test_nemotron_3_nano_legacy_names(tmp_path):
    # the directory form, bare Infinity, legacy mamba_* names, an eos list
    (tmp_path / "config.json").write_text((CONFIGS / "nemotron_3_nano_legacy.json").read_text())
    cfg = ModelConfig.from_hf(tmp_path)
    assert cfg.layer_kinds.count("moe") == 23
    assert (cfg.n_groups, cfg.conv_kernel, cfg.chunk_size, cfg.expand) == (8, 4, 128, 2)
    assert cfg.time_step_limit == (0.0, math.inf)
    assert cfg.time_step_floor == 1e-4
    assert cfg.eos_token_id == (2, 11)
    assert cfg.n_routed_experts == 128 and cfg.num_experts_per_tok == 6 and cfg.routed_scaling_factor == 2.5
    assert cfg.in_proj_dim == 2 * 4096 + 2 * 8 * 128 + 64


def test_hf_written_layers_block_type():
    cfg = ModelConfig.from_hf(_load("hf_written.json"))
    assert cfg.hybrid_override_pattern == "M*-EM"
    assert cfg.time_step_limit == (0.0, math.inf)        # "inf"
    assert cfg.moe_latent_size is None and cfg.n_group == 2
    assert cfg.mtp_hybrid_override_pattern == "*E"


def test_round_trip_through_hf_dict():
    cfg = ModelConfig.from_hf(CONFIGS / "nemotron_h_8b.json")
    again = ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf_dict())))
    assert again == cfg


@pytest.mark.parametrize("spelling", [float("inf"), "inf", "Infinity", "+inf", {"__float__": "Infinity"}, 1e9])
def test_time_step_limit_spellings(spelling):
    raw = _load("hf_written.json") | {"time_step_limit": [0.001, spelling]}
    hi = ModelConfig.from_hf(raw).time_step_limit[1]
    assert hi == (1e9 if spelling == 1e9 else math.inf)


def test_legacy_and_current_name_must_agree():
    raw = _load("hf_written.json") | {"mamba_chunk_size": 64}
    with pytest.raises(ConfigError, match="mamba_chunk_size"):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize("patch, field", [
    ({"n_groups": 3}, "n_groups"),                                   # does not divide mamba_num_heads
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"time_step_limit": [0.5, 0.1]}, "time_step_limit"),
    ({"time_step_limit": [0.0, "lots"]}, "time_step_limit"),
    ({"time_step_limit": 3}, "time_step_limit"),
    ({"layers_block_type": ["linear_attention", "conv"]}, "layers_block_type"),
    ({"hybrid_override_pattern": "M*X"}, "hybrid_override_pattern"),
    ({"hybrid_override_pattern": "M*-E"}, "layers_block_type"),        # disagrees with the list
    ({"num_hidden_layers": 7}, "num_hidden_layers"),
    ({"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 3}, "topk_group"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),              # > topk_group * experts per group
    ({"hidden_size": "64"}, "hidden_size"),
    ({"conv_kernel": 1}, "conv_kernel"),
    ({"mamba_ssm_cache_dtype": "float8"}, "mamba_ssm_cache_dtype"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),     # bounds every length check
    ({"pad_token_id": 10 ** 30}, "pad_token_id"),                   # token ids are rows of the embeddings
    ({"pad_token_id": -1}, "pad_token_id"),
    ({"bos_token_id": 256}, "bos_token_id"),                         # = vocab_size
    ({"eos_token_id": [2, 256]}, "eos_token_id"),
    ({"eos_token_id": 2.5}, "eos_token_id"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
    ({"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "", "mtp_layers_block_type": []},
     "mtp_hybrid_override_pattern"),
])
def test_broken_configs_name_the_field(patch, field):
    raw = _load("hf_written.json") | patch
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(raw)
    assert e.value.field == field, str(e.value)
    assert field in str(e.value)


def test_missing_required_and_missing_pattern(tmp_path):
    raw = _load("hf_written.json")
    with pytest.raises(ConfigError, match="vocab_size"):
        ModelConfig.from_hf({k: v for k, v in raw.items() if k != "vocab_size"})
    with pytest.raises(ConfigError, match="hybrid_override_pattern"):
        ModelConfig.from_hf({k: v for k, v in raw.items() if k != "layers_block_type"})
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_hf(tmp_path)                    # no config.json there
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)


def test_levers_from_env():
    env = {"METRALE_NEMOTRON_NATIVE_FP8_SSM": "decode", "METRALE_GRAPHS": "0", "METRALE_KERNELS": "interpret",
           "METRALE_CHUNK_SIZE": "64", "METRALE_PREFILL_TOKEN_BUDGET": "512", "METRALE_GATED_NORM_QUANT": "Off"}
    lv = ModelLevers.from_env(env)
    assert (lv.native_fp8_ssm, lv.graphs, lv.kernels, lv.chunk_size, lv.prefill_token_budget, lv.gated_norm_quant) == (
        "decode", False, "interpret", 64, 512, "off")
    assert ModelLevers().gated_norm_quant == "group"
    assert ModelLevers.from_env({}) == ModelLevers()
    assert ModelLevers.from_env(env, graphs=True).graphs is True
    cfg = ModelConfig.from_hf(_load("hf_written.json"))
    assert lv.ssm_chunk_size(cfg) == 64 and ModelLevers().ssm_chunk_size(cfg) == 16


@pytest.mark.parametrize("var, value", [
    ("METRALE_NEMOTRON_NATIVE_FP8_SSM", "sometimes"), ("METRALE_GRAPHS", "maybe"),
    ("METRALE_KERNELS", "cuda"), ("METRALE_CHUNK_SIZE", "big"), ("METRALE_CHUNK_SIZE", "0"),
    ("METRALE_GATED_NORM_QUANT", "rows"),
])
def test_bad_lever_env_names_the_variable(var, value):
    with pytest.raises(ConfigError) as e:
        ModelLevers.from_env({var: value})
    assert e.value.field == var
