"""HF-layout checkpoints: save_pretrained -> from_pretrained bit-exact (single file and sharded), casts,
and one CheckpointError that lists every missing / unexpected / mis-shaped / mis-typed tensor."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from metrale_jax.config import ModelConfig
from metrale_jax.errors import CheckpointError, ConfigError, ModelNotFoundError
from metrale_jax.model import NemotronH
from metrale_jax.runtime import Engine, SpeculativeConfig
from metrale_jax.weights.checkpoint import expected_tensors, mtp_tensors
from metrale_jax.weights.containers import Fp8Weight, StackedExperts
from metrale_jax.weights.quantize import quantize_checkpoint
from metrale_jax.weights.safetensors_io import SafetensorsFile, save_safetensors
from tests import numpy_refs_model as ref
from tests.numpy_refs import rel_err

CFG = ModelConfig.from_hf(dict(
    vocab_size=40, hidden_size=16, hybrid_override_pattern="M*E-", mamba_num_heads=2, mamba_head_dim=8,
    ssm_state_size=8, n_groups=1, chunk_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
    moe_shared_expert_intermediate_size=12, n_group=2, topk_group=1, moe_latent_size=8, attention_bias=True,
    mlp_bias=True))


def _write(d, cfg, tensors):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_safetensors(d / "model.safetensors", tensors)


def _random_checkpoint(rng, cfg=CFG, dtype=np.float32):
    out = {}
    for name, spec in expected_tensors(cfg).items():
        out[name] = (rng.standard_normal(spec.shape) * 0.3).astype(np.float32 if spec.keep_f32 else dtype)
    return out


def _assert_same_state(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k].view(np.uint8), b[k].view(np.uint8), err_msg=k)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_save_then_load_is_bit_exact(tmp_path, dtype):
    model = NemotronH.from_config(CFG, jax.random.key(3), dtype=dtype)
    files = model.save_pretrained(tmp_path)
    assert [f.name for f in files] == ["model.safetensors"]
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["hybrid_override_pattern"] == "M*E-" and cfg["torch_dtype"] == jnp.dtype(dtype).name
    again = NemotronH.from_pretrained(tmp_path, dtype=dtype)
    assert again.config == model.config
    _assert_same_state(model.state_dict(), again.state_dict())
    f = SafetensorsFile(tmp_path / "model.safetensors")
    assert f.info("backbone.layers.0.mixer.conv1d.weight")[1] == (CFG.conv_dim, 1, CFG.conv_kernel)   # HF layout
    assert f.info("backbone.layers.0.mixer.A_log")[0] == "F32"
    assert f.info("backbone.layers.1.mixer.q_proj.weight")[0] == {jnp.float32: "F32", jnp.bfloat16: "BF16"}[dtype]
    f.close()


def test_sharded_save_and_load(tmp_path):
    model = NemotronH.from_config(CFG, jax.random.key(4), dtype=jnp.float32)
    (tmp_path / "model.safetensors").write_bytes(b"stale")           # an old single file is replaced, on request
    files = model.save_pretrained(tmp_path, max_shard_bytes=4096, overwrite=True)
    assert len(files) > 2 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected_tensors(CFG))
    assert set(index["weight_map"].values()) == {f.name for f in files}
    assert files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    again = NemotronH.from_pretrained(tmp_path, dtype=jnp.float32)
    _assert_same_state(model.state_dict(), again.state_dict())
    model.save_pretrained(tmp_path, overwrite=True)                   # back to one file: index removed
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert [p.name for p in tmp_path.glob("model*.safetensors")] == ["model.safetensors"]


def test_casts_kept_float32_and_conv_layouts(tmp_path, rng):
    """An f32 checkpoint loaded as bf16: weights are rounded, A_log / D / dt_bias / router stay f32;
    a conv1d weight stored [C, K] is accepted as well as [C, 1, K]."""
    t = _random_checkpoint(rng)
    conv = "backbone.layers.0.mixer.conv1d.weight"
    t[conv] = t[conv][:, 0, :]
    _write(tmp_path, CFG, t)
    model = NemotronH.from_pretrained(tmp_path, dtype=jnp.bfloat16)
    s = model.state_dict()
    for name in ("backbone.layers.0.mixer.A_log", "backbone.layers.0.mixer.D", "backbone.layers.0.mixer.dt_bias",
                 "backbone.layers.2.mixer.gate.weight", "backbone.layers.2.mixer.gate.e_score_correction_bias"):
        assert s[name].dtype == np.float32
        np.testing.assert_array_equal(s[name], t[name])
    w = "backbone.layers.2.mixer.experts.3.down_proj.weight"
    assert s[w].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(s[w], t[w].astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(s[conv][:, 0, :], t[conv].astype(ml_dtypes.bfloat16))


def test_every_problem_is_listed_at_once(tmp_path, rng):
    t = _random_checkpoint(rng)
    del t["backbone.layers.1.mixer.k_proj.weight"]
    del t["backbone.layers.2.mixer.experts.1.up_proj.weight"]
    t["backbone.layers.3.mixer.gate_proj.weight"] = np.ones((24, 16), np.float32)
    t["backbone.layers.0.mixer.out_proj.weight"] = np.ones((16, 15), np.float32)
    t["backbone.layers.3.mixer.up_proj.bias"] = np.ones(24, np.int32)
    t["mtp.layers.0.mixer.q_proj.weight"] = np.ones((4, 4), np.float32)     # ignored, not a problem
    _write(tmp_path, CFG, t)
    with pytest.raises(CheckpointError) as e:
        NemotronH.from_pretrained(tmp_path, dtype=jnp.float32)
    problems = e.value.problems
    assert len(problems) == 5, problems
    text = str(e.value)
    assert "backbone.layers.1.mixer.k_proj.weight: missing (expected shape [8, 16])" in text
    assert "backbone.layers.2.mixer.experts.1.up_proj.weight: missing (expected shape [8, 8])" in text
    assert "backbone.layers.3.mixer.gate_proj.weight: unexpected" in text
    assert "backbone.layers.0.mixer.out_proj.weight: shape [16, 15], expected [16, 16]" in text
    assert "backbone.layers.3.mixer.up_proj.bias: dtype I32" in text
    assert "mtp" not in text


def test_mtp_tensors_of_a_config_without_mtp_layers_are_skipped_with_a_note(tmp_path, rng):
    t = _random_checkpoint(rng)
    t["mtp.layers.0.mixer.q_proj.weight"] = np.ones((4, 4), np.float32)
    _write(tmp_path, CFG, t)
    model = NemotronH.from_pretrained(tmp_path, dtype=jnp.float32)
    assert any("mtp" in n and "num_nextn_predict_layers = 0" in n for n in model.load_notes)
    assert model.mtp is None and not any(k.startswith("mtp") for k in model.state_dict())


MTP_CFG = dataclasses.replace(CFG, num_nextn_predict_layers=1)      # MTP step "*E" (biases: attention, latent MoE)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mtp_head_loads_and_round_trips(tmp_path, dtype):
    model = NemotronH.from_config(MTP_CFG, jax.random.key(5), dtype=dtype)
    model.save_pretrained(tmp_path)
    f = SafetensorsFile(tmp_path / "model.safetensors")
    names = set(f.keys())
    f.close()
    assert set(mtp_tensors(MTP_CFG)) <= names and set(expected_tensors(MTP_CFG)) <= names
    for n in ("mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight",
              "mtp.layers.0.mixer.q_proj.bias", "mtp.layers.1.mixer.experts.3.down_proj.weight",
              "mtp.layers.1.mixer.gate.e_score_correction_bias", "mtp.layers.1.final_layernorm.weight"):
        assert n in names, n
    again = NemotronH.from_pretrained(tmp_path, dtype=dtype)
    assert again.mtp is not None and again.config.num_nextn_predict_layers == 1
    _assert_same_state(model.state_dict(), again.state_dict())
    assert again.state_dict()["mtp.layers.1.mixer.gate.weight"].dtype == np.float32      # router stays f32


def test_missing_or_misshaped_mtp_tensors_are_named(tmp_path, rng):
    t = _random_checkpoint(rng, MTP_CFG)
    t.update({n: (rng.standard_normal(s.shape) * 0.3).astype(np.float32) for n, s in mtp_tensors(MTP_CFG).items()})
    del t["mtp.layers.1.mixer.experts.2.up_proj.weight"]
    t["mtp.layers.0.eh_proj.weight"] = t["mtp.layers.0.eh_proj.weight"][:, :16]
    t["mtp.layers.0.extra.weight"] = np.ones(3, np.float32)
    _write(tmp_path, MTP_CFG, t)
    with pytest.raises(CheckpointError) as e:
        NemotronH.from_pretrained(tmp_path, dtype=jnp.float32)
    text = str(e.value)
    assert len(e.value.problems) == 3, e.value.problems
    assert "mtp.layers.1.mixer.experts.2.up_proj.weight: missing (expected shape [8, 8])" in text
    assert "mtp.layers.0.eh_proj.weight: shape [16, 16], expected [16, 32]" in text
    assert "mtp.layers.0.extra.weight: unexpected" in text
    given = {n: v for n, v in t.items() if n != "mtp.layers.0.extra.weight"}
    with pytest.raises(CheckpointError, match=r"mtp\.layers\.1\.mixer\.experts\.2\.up_proj\.weight: missing"):
        NemotronH(MTP_CFG, given, dtype=jnp.float32)                  # built from tensors: the same check
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers = 0"):
        NemotronH(CFG, {**_random_checkpoint(rng), "mtp.layers.0.enorm.weight": np.ones(16, np.float32)})


def test_a_checkpoint_without_mtp_tensors_loads_without_the_head(tmp_path, rng):
    _write(tmp_path, MTP_CFG, _random_checkpoint(rng, MTP_CFG))
    model = NemotronH.from_pretrained(tmp_path, dtype=jnp.float32)
    assert model.mtp is None and any("no MTP tensors" in n for n in model.load_notes)
    with pytest.raises(ConfigError, match="no MTP head"):
        model.new_mtp_cache(2, 8)
    with pytest.raises(ConfigError, match="no mtp.* tensors"):
        Engine(model, speculative=SpeculativeConfig(method="mtp"))


def test_a_quantized_mtp_head_loads_quantized_and_round_trips(tmp_path):
    NemotronH.from_config(MTP_CFG, jax.random.key(6), dtype=jnp.bfloat16).save_pretrained(tmp_path / "dense")
    quantize_checkpoint(tmp_path / "dense", tmp_path / "q", "fp8-block")
    model = NemotronH.from_pretrained(tmp_path / "q")
    assert isinstance(model.mtp.layers[0].q_proj.base_weight(), Fp8Weight)
    assert isinstance(model.mtp.layers[1].moe_weights().experts_up, StackedExperts)
    state = model.state_dict()
    assert "mtp.layers.0.q_proj.weight_scale_inv" not in state and "mtp.layers.0.mixer.q_proj.weight_scale_inv" in state
    model.save_pretrained(tmp_path / "again")
    _assert_same_state(state, NemotronH.from_pretrained(tmp_path / "again").state_dict())


def test_quantized_checkpoints_are_refused_with_a_pointer(tmp_path, rng):
    t = _random_checkpoint(rng)
    w = "backbone.layers.1.mixer.q_proj.weight"
    t[w] = t[w].astype(ml_dtypes.float8_e4m3fn)
    t[w.replace("weight", "weight_scale")] = np.ones((), np.float32)
    _write(tmp_path / "fp8", CFG, t)
    with pytest.raises(CheckpointError, match="quantized loader") as e:
        NemotronH.from_pretrained(tmp_path / "fp8")
    assert w in str(e.value)
    _write(tmp_path / "cfg", dataclasses.replace(CFG, quantization_config={"quant_method": "modelopt"}),
           _random_checkpoint(rng))
    with pytest.raises(CheckpointError, match="quantized loader"):
        NemotronH.from_pretrained(tmp_path / "cfg")


def test_tied_embeddings(tmp_path, rng):
    cfg = dataclasses.replace(CFG, tie_word_embeddings=True)
    t = _random_checkpoint(rng, cfg)
    assert "lm_head.weight" not in t
    _write(tmp_path, cfg, t)
    model = NemotronH.from_pretrained(tmp_path, dtype=jnp.float32)
    assert model.lm_head is None
    ids = rng.integers(0, cfg.vocab_size, (1, 11))
    assert rel_err(np.asarray(model.forward(ids))[0], ref.model_forward(t, cfg, ids[0])) < 1e-5
    model.save_pretrained(tmp_path / "again")
    f = SafetensorsFile(tmp_path / "again" / "model.safetensors")
    assert "lm_head.weight" not in f.keys()
    f.close()


def test_bad_directories(tmp_path):
    with pytest.raises(ModelNotFoundError, match="missing: no such directory"):
        NemotronH.from_pretrained(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_hf_dict()))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        NemotronH.from_pretrained(tmp_path)
