"""Quantized checkpoints through the model: the built-in model quantized by quantize_checkpoint to each format,
loaded with NemotronH.from_pretrained, against its dequantized float32 twin (built from the same files with
load_linear(...).dequantize(), not through the model's loader): the arm serving each projection, logits,
the native_fp8_ssm levers, corrupted files, save/load round trips, and greedy text against the BF16 model."""

import shutil
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from metrale_jax.builtin import builtin_model_dir
from metrale_jax.config import ModelConfig, ModelLevers
from metrale_jax.errors import CheckpointError, ConfigError
from metrale_jax.layers.attention import NemotronAttentionLayer
from metrale_jax.layers.mamba2 import NemotronMamba2Layer
from metrale_jax.layers.mlp import NemotronMLPLayer
from metrale_jax.layers.moe import NemotronMoELayer
from metrale_jax.model import NemotronH
from metrale_jax.runtime.executables import bucket
from metrale_jax.tokenizer import load_tokenizer
from metrale_jax.weights import containers as C
from metrale_jax.weights import quant_formats as qf
from metrale_jax.weights.checkpoint import expected_tensors
from metrale_jax.weights.quant_config import load_linear, read_quant_config
from metrale_jax.weights.quantize import quantize_checkpoint
from metrale_jax.weights.safetensors_io import CheckpointReader, SafetensorsFile, save_safetensors
from tests.numpy_refs import rel_err

FORMATS = ("fp8-block", "fp8", "nvfp4")
METHOD = {"fp8-block": "fp8_block", "fp8": "fp8", "nvfp4": "nvfp4"}
PROMPT = "And God said unto Moses,"
NEW = 40
DECODE_STEPS = 6
F32 = jnp.float32


# ---- fixtures ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The built-in (BF16) model quantized to each format."""
    root = tmp_path_factory.mktemp("quantized")
    return {fmt: quantize_checkpoint(builtin_model_dir(), root / fmt, fmt)["out_dir"] for fmt in FORMATS}


# the containers' own dequantize, jitted (containers are pytrees): elementwise products, so the bits of the eager
# call (checked for all three formats), in one compile per container type and shape instead of one per op (the
# eager twins of the three built-in checkpoints took 4.0 s, these 0.9 s)
_dequantize = jax.jit(lambda w: w.dequantize(F32))


def twin(directory) -> NemotronH:
    """The dense float32 twin of a checkpoint: quantized weights read with load_linear and dequantized, the rest
    as stored. No tokenizer, notes or quantization, so every twin has the same structure and shares compiles."""
    config = ModelConfig.from_hf(directory)
    reader, q = CheckpointReader(directory), read_quant_config(directory)
    tensors = {}
    for name, spec in expected_tensors(config).items():
        if reader.info(name)[0] in ("F8_E4M3", "U8"):
            tensors[name] = _dequantize(load_linear(reader, name[:-len(".weight")], spec.shape, q))
        else:
            tensors[name] = np.asarray(reader.get(name), np.float32)
    return NemotronH(config, tensors, dtype=F32)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(builtin_model_dir())


@pytest.fixture(scope="module")
def base(tokenizer):
    """The built-in model's BF16 weights, run in float32, and its greedy continuation of PROMPT."""
    model = twin(builtin_model_dir())
    prompt = tokenizer.encode(PROMPT)
    cont = model.generate([prompt], NEW)[0].tokens
    assert len(cont) == NEW
    ids = np.array([prompt + cont], np.int32)
    return types.SimpleNamespace(model=model, prompt=prompt, ids=ids, logits=np.asarray(model.forward(ids)))


@pytest.fixture(scope="module")
def loaded(ckpts):
    """Each format loaded as the library does (levers: native_fp8_ssm=full) in float32, and its twin."""
    lev = ModelLevers(native_fp8_ssm="full")
    return {fmt: (NemotronH.from_pretrained(ckpts[fmt], dtype=F32, levers=lev), twin(ckpts[fmt])) for fmt in FORMATS}


def _decode_logits(model, ids, steps=DECODE_STEPS):
    """Logits of `steps` decode steps from a fresh slot (every projection in its decode arm), in the cache
    shape model.generate uses for PROMPT + NEW tokens (so the compile is shared)."""
    cache = model.new_cache(1, bucket(ids.shape[1], 16))
    out = []
    for k in range(steps):
        logits, cache = model.decode(cache, np.array([0]), ids[:, k])
        out.append(np.asarray(logits))
    return np.concatenate(out)


def _mamba(model):
    return [l for l in model.layers if isinstance(l, NemotronMamba2Layer)]


def _linears(model):
    """(name, Projection) of every non-Mamba linear module."""
    out = []
    for layer in model.layers:
        if isinstance(layer, NemotronAttentionLayer):
            out += [(p.name, p) for p in layer._projections()]
        elif isinstance(layer, NemotronMLPLayer):
            out += [(p.name, p) for p in (layer.mlp.up_proj, layer.mlp.down_proj)]
        elif isinstance(layer, NemotronMoELayer):
            out += [(p.name, p) for p in (layer.shared_experts.up_proj, layer.shared_experts.down_proj)]
    return out


def _same_tree(a, b) -> bool:
    """Same containers (types, tags, structure) holding the same bits."""
    return jax.tree.structure(a) == jax.tree.structure(b) and _same_leaves(a, b)


def _same_leaves(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and x.shape == y.shape and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb))


# ---- (a) arms and containers --------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_projection_gets_its_arm_and_the_files_numbers(ckpts, loaded, fmt):
    model, _ = loaded[fmt]
    reader = CheckpointReader(ckpts[fmt])
    q = read_quant_config(ckpts[fmt])
    assert model.quant_config.method == METHOD[fmt] and q.is_excluded("lm_head")
    nv = fmt == "nvfp4"
    for layer in _mamba(model):
        assert layer.active_arm("decode", 1) == dict.fromkeys(("in_proj", "out_proj"), "nvfp4" if nv else "fp8_native")
        assert layer.active_arm("prefill", 64) == dict.fromkeys(("in_proj", "out_proj"),
                                                                "nvfp4_t" if nv else "fp8_native")
        for p in (layer.in_proj, layer.out_proj):
            assert p.active_kernel("decode", 1) == ("w4a16_gemv" if nv else "w8a16_gemv")
            assert p.active_kernel("prefill", 64) == ("w4a16_gemm_t" if nv else "w8a16_gemm_pipelined")
            assert p.installed_arms() == (("nvfp4_t", "nvfp4") if nv else ("fp8_native",))
            file = load_linear(reader, p.name, p.shape, q, fp8_to_block=True)
            assert _same_tree(p.base_weight(), file)                       # the file's numbers, untouched
            if nv:
                assert _same_tree(p.arm_weight("nvfp4_t"), file.transposed())
            else:
                assert p.base_weight().format is C.WeightQuantFormat.FP8_BLOCK_SCALED
                assert p.base_weight().scale.shape == qf.block_grid(*p.shape)
    for name, p in _linears(model):                                       # attention, MLP, shared experts
        assert p.installed_arms() == (("nvfp4",) if nv else ("fp8_native",)), name
        assert _same_tree(p.base_weight(), load_linear(reader, name, p.shape, q, fp8_to_block=True)), name
    assert model.lm_head.installed_arms() == ("dense",)             # excluded: the stored BF16 values
    np.testing.assert_array_equal(np.asarray(model.lm_head.dense_weight().weight),
                                  np.asarray(reader.get("lm_head.weight"), np.float32))
    moe = next(l for l in model.layers if isinstance(l, NemotronMoELayer))  # stacked experts: kept quantized
    e1 = load_linear(reader, f"backbone.layers.{moe.layer_idx}.mixer.experts.1.down_proj", None, q)
    assert not isinstance(e1, C.DenseWeight)
    stacked = moe.moe_weights().experts_down
    assert isinstance(stacked, C.StackedExperts) and isinstance(stacked.member, C.Nvfp4Weight if nv else C.Fp8Weight)
    np.testing.assert_array_equal(np.asarray(stacked[1].dequantize(F32)), np.asarray(e1.dequantize(F32)))
    assert not any("dequantized" in n for n in model.load_notes)


# ---- (b) logits against the dequantized twin -----------------------------------------------------------------
# Measured on PROMPT + the BF16 model's 40-token greedy continuation (65 tokens) against the twin: decode 0.0
# for every format (w8a16_gemv / w4a16_gemv dequantize exactly and accumulate in float32 like the dense
# matmul); prefill 0.0 for NVFP4 (w4a16_gemm_t dequantizes exactly) and 0.0090 (fp8-block) / 0.0088 (fp8)
# for FP8, whose prefill arm (w8a16_gemm_pipelined, the FP8 matrix-unit GEMM) also rounds the activations
# to E4M3 per row per 128 columns (up to 2^-4 relative per element). Bounds: 1e-6 where the arms are exact,
# 0.025 (~2.8x the measurement) for FP8 prefill.
PREFILL_TOL = {"fp8-block": 0.025, "fp8": 0.025, "nvfp4": 1e-6}


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_match_the_dequantized_twin(base, loaded, fmt):
    model, dense = loaded[fmt]
    got, want = np.asarray(model.forward(base.ids)), np.asarray(dense.forward(base.ids))
    assert np.isfinite(got).all()
    err = rel_err(got, want)
    assert err <= PREFILL_TOL[fmt], err
    if fmt != "nvfp4":
        assert err > 1e-4                              # the activation rounding is really there
    assert rel_err(_decode_logits(model, base.ids), _decode_logits(dense, base.ids)) <= 1e-6


# ---- (c) native_fp8_ssm levers ----------------------------------------------------------------------------
LEVER_ARMS = {   # mode -> (installed, decode arm, prefill arm) of every Mamba projection of an FP8 checkpoint
    "full": (("fp8_native",), "fp8_native", "fp8_native"),
    "decode": (("fp8_native", "fp8_prefill"), "fp8_native", "fp8_prefill"),
    "off": (("nvfp4_t", "nvfp4"), "nvfp4", "nvfp4_t"),
}


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8"])
@pytest.mark.parametrize("mode", ["off", "decode", "full"])
def test_native_fp8_ssm_levers_install_the_design_arms(ckpts, fmt, mode):
    model = NemotronH.from_pretrained(ckpts[fmt], dtype=F32, levers=ModelLevers(native_fp8_ssm=mode))
    reader, q = CheckpointReader(ckpts[fmt]), read_quant_config(ckpts[fmt])
    installed, dec, pre = LEVER_ARMS[mode]
    for layer in _mamba(model):
        for p in (layer.in_proj, layer.out_proj):
            assert (p.installed_arms(), p.active_arm("decode", 1), p.active_arm("prefill", 64)) == (installed, dec, pre)
            fp8 = load_linear(reader, p.name, p.shape, q, fp8_to_block=True)
            if mode != "off":
                assert _same_tree(p.arm_weight("fp8_native"), fp8)
                assert p.fp8_prefill_enabled == (mode == "full")
            if mode == "decode":                        # pre-dequantized copy of the FP8 numbers
                assert _same_tree(p.arm_weight("fp8_prefill"), C.fp8_prefill_copy(fp8))
            if mode == "off":                           # FP8 -> NVFP4 requantized (the double quantization)
                assert _same_tree(p.arm_weight("nvfp4"), C.quantize_nvfp4_weight(fp8))
                assert _same_tree(p.arm_weight("nvfp4_t"), C.quantize_nvfp4_weight(fp8).transposed())
    assert all(p.installed_arms() == ("fp8_native",) for _, p in _linears(model))   # SSM lever only


# Measured decode-path logits against the twin: decode mode 0.0 (w8a16_gemv on the file's FP8 numbers);
# off mode 0.023 (Mamba projections requantized FP8 -> NVFP4, ~9% weight error each, diluted by the other
# blocks). Bounds: 1e-6 and 0.05.
@pytest.mark.parametrize("mode, tol", [("decode", 1e-6), ("off", 0.05)])
def test_lever_modes_decode_logits(base, ckpts, loaded, mode, tol):
    model = NemotronH.from_pretrained(ckpts["fp8-block"], dtype=F32, levers=ModelLevers(native_fp8_ssm=mode))
    err = rel_err(_decode_logits(model, base.ids), _decode_logits(loaded["fp8-block"][1], base.ids))
    assert err <= tol
    if mode == "off":
        assert err > 1e-3


def test_nvfp4_checkpoint_ignores_the_fp8_lever(ckpts):
    model = NemotronH.from_pretrained(ckpts["nvfp4"], dtype=F32, levers=ModelLevers(native_fp8_ssm="off"))
    assert {p.installed_arms() for l in _mamba(model) for p in (l.in_proj, l.out_proj)} == {("nvfp4_t", "nvfp4")}


def test_nvfp4_activations_lever_serves_w4a4(base, ckpts, loaded, tmp_path):
    """nvfp4_activations='nvfp4': every NVFP4 linear on the W4A4 arm (activations quantized per 16) in decode and
    prefill, the file's numbers untouched, logits near the W4A16 model (activation rounding: > 0, bounded) and a
    save that writes the same quantized tensors back (the model runs in float32, so the dense ones are wider)."""
    model = NemotronH.from_pretrained(ckpts["nvfp4"], dtype=F32, levers=ModelLevers(nvfp4_activations="nvfp4"))
    w4a16 = loaded["nvfp4"][0]
    projections = [p for l in _mamba(model) for p in (l.in_proj, l.out_proj)] + [p for _, p in _linears(model)]
    reader, q = CheckpointReader(ckpts["nvfp4"]), read_quant_config(ckpts["nvfp4"])
    for p in projections:
        assert (p.active_arm("decode", 1), p.active_arm("prefill", 64), p.active_kernel("decode", 1)) == \
            ("w4a4", "w4a4", "w4a4_gemm")
        assert _same_tree(p.arm_weight("w4a4").weight, load_linear(reader, p.name, p.shape, q))
    got, want = np.asarray(model.forward(base.ids)), np.asarray(w4a16.forward(base.ids))
    # measured 0.037 (NVFP4 activations: 3-bit mantissa per 16 values); bound ~3x that
    assert np.isfinite(got).all() and 1e-4 < rel_err(got, want) < 0.12, rel_err(got, want)
    model.save_pretrained(tmp_path)
    src, out = CheckpointReader(ckpts["nvfp4"]), CheckpointReader(tmp_path)
    assert sorted(out.keys()) == sorted(src.keys())
    quantized = [n for n in src.keys() if src.info(n)[0] in ("U8", "F8_E4M3") or ".weight_scale" in n]
    assert len(quantized) > 3 * len(projections)                  # weight, scale, global scale each
    assert all(np.array_equal(out.get(n).view(np.uint8), src.get(n).view(np.uint8)) for n in quantized)
    with pytest.raises(ConfigError, match="nvfp4_activations"):
        ModelLevers(nvfp4_activations="fp4")


# ---- (d) corrupted checkpoints ---------------------------------------------------------------------------
def _corrupt(src, dst, edit):
    shutil.copytree(src, dst)
    f = SafetensorsFile(dst / "model.safetensors")
    tensors = {n: np.array(f.get(n)) for n in f.keys()}
    f.close()
    edit(tensors)
    save_safetensors(dst / "model.safetensors", tensors)
    return dst


M0 = "backbone.layers.0.mixer.in_proj"
A1 = "backbone.layers.1.mixer.q_proj"


def test_corrupted_checkpoints_raise_one_error_naming_every_tensor(ckpts, tmp_path):
    def block(t):
        t[f"{M0}.weight_scale_inv"] = t[f"{M0}.weight_scale_inv"][:, :1]          # wrong grid
        t[f"{A1}.weight_scale_inv"] = t[f"{A1}.weight_scale_inv"].astype(np.float16)   # wrong dtype
    with pytest.raises(CheckpointError) as e:
        NemotronH.from_pretrained(_corrupt(ckpts["fp8-block"], tmp_path / "a", block))
    assert len(e.value.problems) == 2                  # both found in one pass, before any model exists
    assert f"{M0}.weight_scale_inv: shape [7, 1], expected [7, 2]" in str(e.value)
    assert f"{A1}.weight_scale_inv: dtype F16, expected F32" in str(e.value)

    def modelopt(t):
        del t[f"{M0}.weight_scale"]                                               # missing scale
    with pytest.raises(CheckpointError, match=f"{M0}.weight: F8_E4M3 weight without weight_scale"):
        NemotronH.from_pretrained(_corrupt(ckpts["fp8"], tmp_path / "b", modelopt))

    def nvfp4(t):
        t[f"{M0}.weight_scale"] = t[f"{M0}.weight_scale"].astype(np.float32)       # scale not E4M3
        t[f"{A1}.weight_scale_2"] = np.ones((2,), np.float32)                      # global scale not a scalar
        t["backbone.layers.2.mixer.up_proj.weight"] = t["backbone.layers.2.mixer.up_proj.weight"][:, :-8]
    with pytest.raises(CheckpointError) as e:
        NemotronH.from_pretrained(_corrupt(ckpts["nvfp4"], tmp_path / "c", nvfp4))
    msg = str(e.value)
    assert len(e.value.problems) == 3
    assert f"{M0}.weight_scale: dtype F32, expected F8_E4M3" in msg
    assert f"{A1}.weight_scale_2: shape [2]" in msg
    assert "backbone.layers.2.mixer.up_proj.weight: shape [768, 88], expected [768, 96]" in msg

    def excluded(t):                                   # lm_head is excluded, so it must be dense
        t["lm_head.weight"] = t["lm_head.weight"].astype(ml_dtypes.float8_e4m3fn)
        t["lm_head.weight_scale_inv"] = np.ones((3, 2), np.float32)
    with pytest.raises(CheckpointError, match="lm_head.weight: stored as fp8_block, but excluded"):
        NemotronH.from_pretrained(_corrupt(ckpts["fp8-block"], tmp_path / "d", excluded))

    def stray(t):
        t["backbone.layers.0.mixer.conv1d.weight_scale"] = np.ones((), np.float32)   # not a linear module
    with pytest.raises(CheckpointError, match=r"conv1d.weight_scale: unexpected tensor"):
        NemotronH.from_pretrained(_corrupt(ckpts["nvfp4"], tmp_path / "e", stray))


def test_quantized_weights_go_on_a_mesh_as_containers(ckpts, loaded):
    """Containers are placed on a mesh (tests/sharding/test_tp_quantized.py checks the numbers over 2 devices); a
    state dict in the checkpoint layout (scales beside the packed weights) is refused with or without a mesh."""
    from metrale_jax import sharding
    mesh = sharding.make_mesh(1)
    model = loaded["nvfp4"][0]
    tensors = {**{n: np.zeros(s.shape, np.float32) for n, s in expected_tensors(model.config).items()},
               M0 + ".weight": model.layers[0].in_proj.base_weight()}
    placed = NemotronH(model.config, tensors, mesh=mesh, dtype=F32)
    got = placed.layers[0].in_proj.base_weight()
    assert type(got) is type(tensors[M0 + ".weight"]) and placed.quant_config.method == "nvfp4"
    np.testing.assert_array_equal(np.asarray(got.packed), np.asarray(tensors[M0 + ".weight"].packed))
    state = model.state_dict()                          # the checkpoint layout: packed weights beside their scales
    assert state[M0 + ".weight"].dtype == np.uint8 and M0 + ".weight_scale_2" in state
    for m in (mesh, None):
        with pytest.raises(CheckpointError, match=f"{M0}.weight_scale: a scale in the checkpoint layout"):
            NemotronH(model.config, state, mesh=m)


# ---- (e) save_pretrained round trip --------------------------------------------------------------------------
def _all_arms(model):
    return {p.name: {a: p.arm_weight(a) for a in p.installed_arms()}
            for l in _mamba(model) for p in (l.in_proj, l.out_proj)} | \
           {n: {a: p.arm_weight(a) for a in p.installed_arms()} for n, p in _linears(model)}


@pytest.mark.parametrize("fmt, mode", [("fp8-block", "full"), ("fp8", "decode"), ("nvfp4", "full")])
def test_save_pretrained_round_trips_the_quantized_files(ckpts, tmp_path, fmt, mode):
    lev = ModelLevers(native_fp8_ssm=mode)
    model = NemotronH.from_pretrained(ckpts[fmt], levers=lev)            # bfloat16, as stored
    model.save_pretrained(tmp_path)
    again = NemotronH.from_pretrained(tmp_path, levers=lev)
    assert _same_tree(_all_arms(again), _all_arms(model))
    assert _same_leaves(again, model)                   # every weight of the model, bit for bit
    q = read_quant_config(tmp_path)
    assert q.method == METHOD[fmt] and q.is_excluded("lm_head")
    assert not q.is_excluded("backbone.layers.3.mixer.experts.0.up_proj")   # experts stay quantized
    assert (tmp_path / "hf_quant_config.json").is_file() == (fmt != "fp8-block")
    src, out = CheckpointReader(ckpts[fmt]), CheckpointReader(tmp_path)
    assert sorted(out.keys()) == sorted(src.keys())
    for name in src.keys():                             # every file tensor back bit for bit, the experts' too
        assert out.info(name) == src.info(name), name
        assert np.array_equal(out.get(name).view(np.uint8), src.get(name).view(np.uint8)), name


def test_save_pretrained_refuses_what_the_model_no_longer_holds(ckpts, tmp_path):
    model = NemotronH.from_pretrained(ckpts["fp8-block"], levers=ModelLevers(native_fp8_ssm="off"))
    with pytest.raises(CheckpointError, match=f"{M0}: holds Nvfp4Weight .* 'fp8_block' checkpoint cannot store "
                                              r"\(FP8 weights requantized to NVFP4"):
        model.save_pretrained(tmp_path / "x")
    assert not (tmp_path / "x").exists()                # nothing written


# ---- the built-in model's text per format -------------------------------------------------------------------
# Measured on the 40-token greedy continuation of PROMPT (float32 compute; BF16 model: mean log p -0.445):
#   teacher-forced log p of the BF16 model's continuation, mean |quantized - BF16| per token:
#     fp8-block 0.014 (max 0.10), fp8 0.010 (max 0.045), nvfp4 0.039 (max 0.19);
#   the quantized model's own greedy continuation: identical to the BF16 one for both FP8 formats; NVFP4
#   leaves it at token 32 ("I have see" for "I will see") and the BF16 model scores its continuation
#   0.025 nats per token *higher* than its own.
# Bounds: 0.04 / 0.12 mean |d log p| (FP8 / NVFP4, ~3x), and the quantized continuation no more than
# 0.1 nats per token below the BF16 one under the BF16 model.
LOGP_TOL = {"fp8-block": 0.04, "fp8": 0.04, "nvfp4": 0.12}


def _logp(logits, ids, start):
    """log p(ids[t+1] | ids[:t+1]) for t >= start - 1 (the continuation's tokens), float64."""
    z = np.asarray(logits[0], np.float64)
    z = z - z.max(-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    t = np.arange(start - 1, ids.shape[1] - 1)
    return lp[t, ids[0, t + 1]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_builtin_model_still_writes_text(base, loaded, tokenizer, fmt):
    model, _ = loaded[fmt]
    P = len(base.prompt)
    lp_base = _logp(base.logits, base.ids, P)
    lp_q = _logp(np.asarray(model.forward(base.ids)), base.ids, P)
    assert np.abs(lp_q - lp_base).mean() <= LOGP_TOL[fmt]
    cont = model.generate([base.prompt], NEW)[0].tokens
    assert len(cont) == NEW
    ids = np.array([base.prompt + cont], np.int32)
    mine = _logp(np.asarray(base.model.forward(ids)), ids, P).mean()
    assert mine >= lp_base.mean() - 0.1
    text = tokenizer.decode(cont)
    assert sum(c.isalpha() or c in " ,.;:'\n" for c in text) >= 0.9 * len(text), text


# ---- a random model with what the built-in one lacks: MoE latent projections, biases -------------------------
SMALL = ModelConfig.from_hf(dict(
    vocab_size=40, hidden_size=32, hybrid_override_pattern="M*E-", mamba_num_heads=2, mamba_head_dim=16,
    ssm_state_size=8, n_groups=1, chunk_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    intermediate_size=48, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1, moe_latent_size=16, attention_bias=True,
    mlp_bias=True))


# Decode-path logits against the twin (exact arms for both formats; measured 0.0). The prefill path is not
# compared here: on this random model the FP8 activation rounding flips MoE routing choices now and then
# (0.03-0.11 over ten seeds), which says nothing about the loader.
@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_latent_projections_and_biases_of_a_random_model(tmp_path, rng, fmt):
    NemotronH.from_config(SMALL, jax.random.key(int(rng.integers(2**31))), dtype=F32).save_pretrained(tmp_path / "d")
    quantize_checkpoint(tmp_path / "d", tmp_path / "q", fmt)
    model = NemotronH.from_pretrained(tmp_path / "q", dtype=F32)
    moe = model.layers[2]
    arm = "nvfp4" if fmt == "nvfp4" else "fp8_native"
    assert moe.fc1_latent_proj.installed_arms() == moe.fc2_latent_proj.installed_arms() == (arm,)
    assert model.layers[1].q_proj.installed_arms() == (arm,) and model.layers[1].q_bias is not None
    reader = CheckpointReader(tmp_path / "q")
    np.testing.assert_array_equal(np.asarray(moe.fc2_latent_bias[...]),
                                  np.asarray(reader.get("backbone.layers.2.mixer.fc2_latent_proj.bias")))
    ids = rng.integers(0, SMALL.vocab_size, (1, NEW + 4))
    got, want = _decode_logits(model, ids, 4), _decode_logits(twin(tmp_path / "q"), ids, 4)
    assert np.isfinite(got).all() and rel_err(got, want) <= 1e-6


def test_nvfp4_prefill_copy_only_where_the_plain_gemm_is_not_mosaic():
    """On Hopper the plain-layout Mosaic GEMM serves NVFP4 prefill from the layer's own weights, so no transposed
    copy is built; where the plain GEMM would be Triton's (or Mosaic does not take the shape / dtype) it is."""
    from metrale_jax.layers.install import nvfp4_prefill_copy_pays
    bf16 = jnp.bfloat16
    assert not nvfp4_prefill_copy_pays((18560, 4096), bf16, "auto", platform="gpu")
    assert not nvfp4_prefill_copy_pays((4096, 8192), bf16, "pallas", platform="gpu")
    assert nvfp4_prefill_copy_pays((18560, 4096), jnp.float32, "auto", platform="gpu")   # the Mosaic arm: bf16 x
    assert nvfp4_prefill_copy_pays((18560 + 64, 4096), bf16, "auto", platform="gpu")     # N % 128
    assert nvfp4_prefill_copy_pays((18560, 4096), bf16, "triton", platform="gpu")
    assert nvfp4_prefill_copy_pays((18560, 4096), bf16, "auto")                           # this CPU: the reference
