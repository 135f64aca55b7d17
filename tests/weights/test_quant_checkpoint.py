"""Quantized checkpoints: writers -> safetensors -> readers -> containers -> dequantize ~ original;
typed errors naming the tensor; quantization configs and exclusion lists; the quantize tool."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from metrale_jax.errors import CheckpointError, ConfigError, WeightFormatError
from metrale_jax.weights import containers as C
from metrale_jax.weights import quant_formats as qf
from metrale_jax.weights.fp8 import read_fp8_block, read_fp8_tensor, write_fp8_block, write_fp8_tensor
from metrale_jax.weights.nvfp4 import read_nvfp4, write_nvfp4
from metrale_jax.weights.quant_config import (QuantConfig, load_linear, quant_config_from_dicts,
                                              read_quant_config)
from metrale_jax.weights.quantize import quantize_checkpoint, quantize_tensors
from metrale_jax.weights.safetensors_io import CheckpointReader, save_safetensors

P = "backbone.layers.0.mixer.in_proj"
# relative Frobenius error of each format on Gaussian weights (measured ~0.024 / 0.025 / 0.094)
TOL = {"fp8_block": 0.04, "fp8": 0.05, "nvfp4": 0.13}


def _reader(tmp_path, tensors):
    save_safetensors(tmp_path / "model.safetensors", tensors)
    return CheckpointReader(tmp_path)


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("fmt,write,read", [("fp8_block", write_fp8_block, read_fp8_block),
                                            ("fp8", write_fp8_tensor, read_fp8_tensor),
                                            ("nvfp4", write_nvfp4, read_nvfp4)])
def test_round_trip_through_safetensors(tmp_path, rng, fmt, write, read):
    w = (rng.standard_normal((200, 320)) * rng.uniform(0.1, 2, (200, 1))).astype(np.float32)
    r = _reader(tmp_path, write(P, w))
    got = read(r, P, (200, 320))
    err = _rel(got.dequantize(jnp.float32), w)
    assert 1e-3 < err < TOL[fmt]
    assert load_linear(r, P, (200, 320)).__class__ is got.__class__
    np.testing.assert_array_equal(np.asarray(load_linear(r, P).dequantize()), np.asarray(got.dequantize()))


def test_per_tensor_fp8_expands_exactly_to_block_grid(tmp_path, rng):
    w = rng.standard_normal((130, 260)).astype(np.float32)
    r = _reader(tmp_path, write_fp8_tensor(P, w, input_amax=3.0))
    per_tensor = read_fp8_tensor(r, P)
    assert per_tensor.format is C.WeightQuantFormat.FP8_PER_TENSOR and per_tensor.scale.shape == ()
    np.testing.assert_allclose(float(per_tensor.input_scale), 3.0 / 448, rtol=1e-6)
    block = read_fp8_tensor(r, P, to_block=True)
    assert block.format is C.WeightQuantFormat.FP8_BLOCK_SCALED and block.scale.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(block.dequantize()), np.asarray(per_tensor.dequantize()))
    C.check_fp8(P, block, (130, 260), formats=(C.WeightQuantFormat.FP8_BLOCK_SCALED,))


def test_reader_errors_name_the_tensor(tmp_path, rng):
    w = rng.standard_normal((64, 128)).astype(np.float32)
    t = write_fp8_block(P, w)
    t[f"{P}.weight_scale_inv"] = t[f"{P}.weight_scale_inv"][:, :0]            # wrong grid
    with pytest.raises(CheckpointError, match=rf"{P}.weight_scale_inv: shape \[1, 0\], expected \[1, 1\]"):
        (tmp_path / "a").mkdir()
        read_fp8_block(_reader(tmp_path / "a", t), P)
    t = write_nvfp4(P, w)
    t[f"{P}.weight_scale"] = t[f"{P}.weight_scale"].astype(np.float32)        # scale stored as F32
    with pytest.raises(CheckpointError, match=rf"{P}.weight_scale: dtype F32, expected F8_E4M3"):
        (tmp_path / "b").mkdir()
        read_nvfp4(_reader(tmp_path / "b", t), P)
    t = write_nvfp4(P, w)
    with pytest.raises(CheckpointError, match=rf"{P}.weight: shape \[64, 64\], expected \[64, 32\]"):
        (tmp_path / "c").mkdir()
        read_nvfp4(_reader(tmp_path / "c", t), P, (64, 64))
    t = write_fp8_tensor(P, w)
    t[f"{P}.weight_scale"] = np.ones((3,), np.float32)
    with pytest.raises(CheckpointError, match=rf"{P}.weight_scale: shape \[3\]"):
        (tmp_path / "d").mkdir()
        read_fp8_tensor(_reader(tmp_path / "d", t), P)
    with pytest.raises(CheckpointError, match=f"{P}.weight: F8_E4M3 weight without"):
        (tmp_path / "e").mkdir()
        load_linear(_reader(tmp_path / "e", {f"{P}.weight": t[f"{P}.weight"]}), P)


def test_quant_configs_from_files_and_dicts(tmp_path):
    hq = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                             "exclude_modules": ["lm_head", "*.mixer.q_proj"]}}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(hq))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nemotron_h"}))
    q = read_quant_config(tmp_path)
    assert q.method == "nvfp4" and q.is_excluded("lm_head") and q.is_excluded("backbone.layers.3.mixer.q_proj")
    assert not q.is_excluded("backbone.layers.3.mixer.k_proj")
    assert q.expected("backbone.layers.3.mixer.q_proj") == "dense" and q.expected("x.in_proj") == "nvfp4"
    assert quant_config_from_dicts(None, {"quantization_config": {
        "quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["backbone.layers.0"]}}).is_excluded(
        "backbone.layers.0.mixer.in_proj")                                  # a parent module excludes its children
    blk = quant_config_from_dicts(None, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                                 "modules_to_not_convert": ["lm_head"]}})
    assert blk.method == "fp8_block" and blk.is_excluded("lm_head")
    assert quant_config_from_dicts(None, {}).method == "none"
    with pytest.raises(CheckpointError, match="weight_block_size: \\[64, 64\\]"):
        quant_config_from_dicts(None, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}})
    with pytest.raises(CheckpointError, match="quant_method: 'awq'"):
        quant_config_from_dicts(None, {"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(CheckpointError, match="quant_algo 'W4A8_AWQ'"):
        quant_config_from_dicts({"quantization": {"quant_algo": "W4A8_AWQ"}}, None)
    for qc in (QuantConfig("nvfp4", ("lm_head",)), QuantConfig("fp8", ()), QuantConfig("fp8_block", ("a",))):
        assert quant_config_from_dicts(qc.hf_quant_config(), {"quantization_config": qc.quantization_config()}) \
            .method == qc.method


def test_load_linear_checks_the_config(tmp_path, rng):
    w = rng.standard_normal((64, 128)).astype(np.float32)
    t = {**write_nvfp4(P, w), "lm_head.weight": w.astype(ml_dtypes.bfloat16)}
    r = _reader(tmp_path, t)
    excl = QuantConfig("nvfp4", (P,))
    with pytest.raises(CheckpointError, match=f"{P}.weight: stored as nvfp4, but excluded"):
        load_linear(r, P, qcfg=excl)
    with pytest.raises(CheckpointError, match=f"{P}.weight: stored as nvfp4, but the config says fp8_block"):
        load_linear(r, P, qcfg=QuantConfig("fp8_block"))
    dense = load_linear(r, "lm_head", (64, 128), QuantConfig("nvfp4", ("lm_head",)), dtype=jnp.float32)
    assert isinstance(dense, C.DenseWeight) and dense.dtype == jnp.float32


def _tiny_checkpoint(d, rng):
    """A dense HF-style checkpoint: Mamba in/out_proj, MLP, an odd-K linear, norms, embeddings, lm_head."""
    bf = lambda *s: (rng.standard_normal(s) * 0.1).astype(ml_dtypes.bfloat16)
    t = {"backbone.embeddings.weight": bf(50, 64), "lm_head.weight": bf(50, 64), "backbone.norm_f.weight": bf(64),
         "backbone.layers.0.mixer.in_proj.weight": bf(200, 64), "backbone.layers.0.mixer.out_proj.weight": bf(64, 96),
         "backbone.layers.0.mixer.conv1d.weight": bf(160, 1, 4), "backbone.layers.0.mixer.A_log": bf(8),
         "backbone.layers.1.mixer.up_proj.weight": bf(128, 64), "backbone.layers.1.mixer.down_proj.weight": bf(64, 128),
         "backbone.layers.2.mixer.o_proj.weight": bf(64, 40)}
    d.mkdir()
    save_safetensors(d / "model.safetensors", t)
    (d / "config.json").write_text(json.dumps({"model_type": "nemotron_h", "hidden_size": 64}))
    (d / "tokenizer.json").write_text('{"tok": 1}')
    return t


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8", "nvfp4"])
def test_quantize_checkpoint_end_to_end(tmp_path, rng, fmt):
    src = _tiny_checkpoint(tmp_path / "src", rng)
    summary = quantize_checkpoint(tmp_path / "src", tmp_path / "out", fmt, exclude=["*.down_proj"],
                                  shard_bytes=30_000)
    out = tmp_path / "out"
    assert (out / "tokenizer.json").read_text() == '{"tok": 1}'
    assert len(summary["files"]) > 1 and (out / "model.safetensors.index.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] == 64 and cfg["quantization_config"]
    assert (out / "hf_quant_config.json").is_file() == (fmt != "fp8-block")
    q = read_quant_config(out)
    assert q.method == {"fp8-block": "fp8_block", "fp8": "fp8", "nvfp4": "nvfp4"}[fmt]
    r = CheckpointReader(out)
    quantized = ["backbone.layers.0.mixer.in_proj", "backbone.layers.0.mixer.out_proj",
                 "backbone.layers.1.mixer.up_proj"]
    if fmt != "nvfp4":
        quantized.append("backbone.layers.2.mixer.o_proj")
    else:                                    # K = 40 is not a multiple of 16: kept dense and listed as excluded
        assert q.is_excluded("backbone.layers.2.mixer.o_proj")
    for m in quantized:
        c = load_linear(r, m, src[f"{m}.weight"].shape, q, fp8_to_block=True)
        assert not isinstance(c, C.DenseWeight)
        if fmt != "nvfp4":
            assert c.format is C.WeightQuantFormat.FP8_BLOCK_SCALED
        assert _rel(c.dequantize(), np.asarray(src[f"{m}.weight"], np.float64)) < TOL[q.method]
    for m in ("backbone.layers.1.mixer.down_proj", "lm_head"):                 # excluded: bit-identical BF16
        d = load_linear(r, m, None, q)
        assert isinstance(d, C.DenseWeight)
        np.testing.assert_array_equal(np.asarray(d.weight), src[f"{m}.weight"])
    for n in ("backbone.embeddings.weight", "backbone.layers.0.mixer.conv1d.weight", "backbone.layers.0.mixer.A_log"):
        assert r.info(n)[0] == "BF16"
        np.testing.assert_array_equal(r.get(n), src[n])
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(out, tmp_path / "again", "nvfp4")


def test_quantize_tensors_in_memory(rng):
    t = {"a.in_proj.weight": rng.standard_normal((32, 64)).astype(np.float32), "a.norm.weight": np.ones(64, np.float32)}
    out, q = quantize_tensors(t, "nvfp4")
    assert out["a.in_proj.weight"].dtype == np.uint8 and out["a.norm.weight"] is not None and q.method == "nvfp4"
    with pytest.raises(ConfigError, match="expected one of .*got 'int4'") as e:
        quantize_tensors(t, "int4")
    assert e.value.field == "format"


# ---- containers -----------------------------------------------------------------------------------------
def test_fp8_container_checks_name_the_tensor(rng):
    q, s = (jnp.asarray(a) for a in qf.quantize_fp8_block(rng.standard_normal((200, 300)).astype(np.float32)))
    blk = (C.WeightQuantFormat.FP8_BLOCK_SCALED,)
    C.check_fp8(P, C.Fp8Weight(q, s), (200, 300), formats=blk)
    with pytest.raises(WeightFormatError, match=rf"{P}: block scale .* must have shape \[2, 3\], got \[200\]"):
        C.check_fp8(P, C.Fp8Weight(q, jnp.ones(200, jnp.float32)), formats=blk)      # per-row scale
    with pytest.raises(WeightFormatError, match=rf"{P}: block scale .* got \[\]"):
        C.check_fp8(P, C.Fp8Weight(q, jnp.float32(1.0)), formats=blk)                # scalar weight_scale
    with pytest.raises(WeightFormatError, match=f"{P}: FP8 weight tagged FP8_PER_TENSOR; accepted here: FP8_BLOCK"):
        C.check_fp8(P, C.Fp8Weight(q, jnp.float32(1.0), None, C.WeightQuantFormat.FP8_PER_TENSOR), formats=blk)
    with pytest.raises(WeightFormatError, match=f"{P}: weight must be float8_e4m3fn, got bfloat16"):
        C.check_fp8(P, C.Fp8Weight(q.astype(jnp.bfloat16), s), formats=blk)
    with pytest.raises(WeightFormatError, match=f"{P}: block scale .* must be float32, got bfloat16"):
        C.check_fp8(P, C.Fp8Weight(q, s.astype(jnp.bfloat16)), formats=blk)
    with pytest.raises(WeightFormatError, match="cannot expand a FP8_PER_ROW scale exactly"):
        C.fp8_to_block_scaled(C.Fp8Weight(q, jnp.ones(200, jnp.float32), None, C.WeightQuantFormat.FP8_PER_ROW))


def test_nvfp4_containers(rng):
    w = rng.standard_normal((48, 64)).astype(np.float32)
    n = C.quantize_nvfp4_weight(w)
    C.check_nvfp4(P, n, (48, 64))
    t = n.transposed()
    assert t.packed_t.shape == (32, 48) and t.scale_t.shape == (4, 48) and t.shape == (48, 64)
    np.testing.assert_array_equal(np.asarray(t.dequantize()), np.asarray(n.dequantize()))
    C.check_nvfp4_t(P, t, (48, 64))
    with pytest.raises(WeightFormatError, match=rf"{P}: weight_scale \(per 16 along K\) must have shape \[48, 4\]"):
        C.check_nvfp4(P, C.Nvfp4Weight(n.packed, n.scale[:, :2], n.global_scale))
    with pytest.raises(WeightFormatError, match=rf"{P}: weight_scale_2 \(global scale\) must be float32"):
        C.check_nvfp4(P, C.Nvfp4Weight(n.packed, n.scale, n.global_scale.astype(jnp.bfloat16)))
    with pytest.raises(WeightFormatError, match=rf"{P}: packed weight must be \[48, 16\]"):
        C.check_nvfp4(P, n, (48, 32))
    fp = C.fp8_prefill_copy(n)
    assert _rel(fp.dequantize(), np.asarray(n.dequantize(), np.float64)) < 0.04
    C.check_fp8_prefill(P, fp, (48, 64))
