"""The fused block boundary in decode (layers/blocks.py): an output projection hands on its split-K partials (a
dense one its float32 output) and the next block's input norm (or norm_f) adds them to the residual stream in one
kernel (norms.add_rmsnorm). Quantized and BF16 models in interpret mode: decode and speculative verify give the
same logits, states and tokens, bit for bit, with the fused kernel as with it disabled (the partials' sum +
residual add, then the plain norm)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from metrale_jax import sharding
from metrale_jax.config import ModelConfig, ModelLevers
from metrale_jax.errors import ShapeError
from metrale_jax.layers.attention import NemotronAttentionLayer
from metrale_jax.layers.blocks import PendingResidual, close_block, linear, settled
from metrale_jax.layers.lora import head_rows, slot_adapters
from metrale_jax.model import NemotronH, decode_step, random_tensors
from metrale_jax.runtime import steps
from metrale_jax.weights.checkpoint import linear_module
from metrale_jax.weights.containers import quantize_fp8_block_weight, quantize_nvfp4_weight
from pallas_kernels import registry
from pallas_kernels.split_partials import SplitPartials
from tests.tiny_models import ALL_KINDS

QUANT = {"fp8-block": quantize_fp8_block_weight, "nvfp4": quantize_nvfp4_weight, "bf16": lambda w: w}
V = ALL_KINDS.vocab_size


# 128 wide: the input norms in front of w8a8_gemv hand on E4M3 rows only at whole 128-column blocks
WIDE = ModelConfig.from_hf(dict(
    vocab_size=96, hidden_size=128, hybrid_override_pattern="M*-", mamba_num_heads=4, mamba_head_dim=32,
    ssm_state_size=8, n_groups=2, chunk_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    intermediate_size=256))


def _model(fmt: str, seed: int, kernels: str = "interpret", config=ALL_KINDS, **levers) -> NemotronH:
    """ALL_KINDS (Mamba, attention, MoE, MLP) in bf16 with every linear the format takes quantized (bf16: none)."""
    tensors = random_tensors(config, jax.random.key(seed), jnp.bfloat16)
    tensors = {n: QUANT[fmt](v) if linear_module(n) and n != "lm_head.weight" and v.shape[-1] % 16 == 0 else v
               for n, v in tensors.items()}
    return NemotronH(config, tensors, dtype=jnp.bfloat16, levers=ModelLevers(kernels=kernels, **levers))


def _fused_and_unfused(fn, *args):
    """fn(*args) traced afresh (the dispatch is decided at trace time) with the fused boundary kernels and with them
    disabled: ((jaxpr text, outputs) fused, (jaxpr text, outputs) unfused); args are copied per run."""
    def run():      # a fresh function per run: jax caches traces by function
        text = str(jax.make_jaxpr(lambda *a: fn(*a))(*args))
        return text, jax.jit(lambda *a: fn(*a))(*jax.tree.map(jnp.copy, args))
    fused = run()
    with registry.disabled("add_rmsnorm"), registry.disabled("add_rmsnorm_fp8"):
        unfused = run()
    return fused, unfused


def _two_sequences_one_step(model, rng, T: int):
    """Two sequences of T prompt tokens prefilled, then one decode step traced and run fused and unfused."""
    ids = rng.integers(0, V, (2, T)).astype(np.int32)
    _, cache = model.prefill(model.new_cache(2, 16), [0, 1], ids)
    tok = jnp.asarray(rng.integers(0, V, 2), jnp.int32)
    return _fused_and_unfused(lambda c, s, t: decode_step(model, c, s, t), cache, jnp.asarray([0, 1]), tok)


def _same_trees(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("fmt", list(QUANT))
def test_decode_is_bitwise_the_unfused_step(rng, fmt):
    """Three sequences at their own lengths, two steps: the three boundaries after an output projection (Mamba
    -> attention, attention -> MoE, MLP -> norm_f; the MoE's expert sum is not one projection's) run fused."""
    model = _model(fmt, int(rng.integers(1 << 30)))
    ids = rng.integers(0, V, (3, 7)).astype(np.int32)
    lens = np.array([7, 3, 5])
    _, cache = model.prefill(model.new_cache(3, 16), [2, 0, 1], np.where(np.arange(7) < lens[:, None], ids, 0), lens)
    slots, tok = jnp.asarray([2, 0, 1]), jnp.asarray(rng.integers(0, V, 3), jnp.int32)
    (text, (logits, new)), (text_u, (logits_u, new_u)) = _fused_and_unfused(
        lambda c, s, t: decode_step(model, c, s, t), cache, slots, tok)
    assert text.count("add_rmsnorm") == 3 and "add_rmsnorm" not in text_u
    _same_trees((logits, new), (logits_u, new_u))
    assert np.all(np.isfinite(np.asarray(logits)))
    if fmt == "fp8-block":   # a lone sequence (padded to two rows by the step), a second step on the new cache
        (_, one), (_, one_u) = _fused_and_unfused(lambda c, s, t: decode_step(model, c, s, t), new, slots[:1],
                                                  tok[:1])
        _same_trees(one, one_u)


def test_e4m3_decode_is_bitwise_the_unfused_step(rng):
    """fp8_decode_activations="e4m3": the input norms in front of w8a8_gemv hand their rows on in E4M3, so the
    boundaries into the attention and MLP blocks open with add_rmsnorm_fp8; the same logits and states bit for bit
    as the settled stream and rmsnorm_fp8."""
    model = _model("fp8-block", int(rng.integers(1 << 30)), config=WIDE, fp8_decode_activations="e4m3")
    (text, out), (text_u, out_u) = _two_sequences_one_step(model, rng, 6)
    assert "add_rmsnorm_fp8" in text and "add_rmsnorm_fp8" not in text_u
    _same_trees(out, out_u)
    assert np.all(np.isfinite(np.asarray(out[0])))


def test_speculative_verify_is_bitwise_the_unfused_step(rng):
    """Two sequences, a pending token and three drafts each: the verify sweep (Mamba states after every row) and
    its acceptance."""
    model = _model("fp8-block", int(rng.integers(1 << 30)))
    ids = rng.integers(0, V, (2, 6)).astype(np.int32)
    _, cache = model.prefill(model.new_cache(2, 16), [0, 1], ids)
    tokens = jnp.asarray(rng.integers(0, V, (2, 4)), jnp.int32)
    z, o = jnp.zeros(2, jnp.float32), jnp.ones(2, jnp.float32)
    fn = lambda c, t: steps.verify_step(model, c, jnp.asarray([0, 1]), t, jnp.asarray([3, 3]), z, o,
                                        jnp.zeros(2, jnp.uint32), jnp.zeros(2, jnp.uint32), sampling=False)
    (text, out), (text_u, out_u) = _fused_and_unfused(fn, cache, tokens)
    assert "add_rmsnorm" in text and "add_rmsnorm" not in text_u
    _same_trees(out, out_u)


def test_decode_with_lora_is_bitwise_the_unfused_step(rng):
    """An adapter on every output projection: each block hands on its float32 output (base + low-rank term) as one
    partial, and the step is the unfused one bit for bit."""
    model = _model("fp8-block", int(rng.integers(1 << 30)))
    model.add_adapter("a", r=2, lora_alpha=4.0, target_modules=["out_proj", "o_proj", "down_proj"],
                      key=jax.random.key(3))
    for layer in model.layers:
        for proj in (getattr(layer, "out_proj", None), getattr(layer, "o_proj", None),
                     getattr(getattr(layer, "mlp", None), "down_proj", None)):
            if proj is not None and proj.lora is not None:
                proj.lora.b.set_value(jnp.asarray(rng.standard_normal(proj.lora.b.shape), proj.lora.b.dtype))
    (text, out), (text_u, out_u) = _two_sequences_one_step(model, rng, 5)
    assert text.count("add_rmsnorm") == 3 and "add_rmsnorm" not in text_u
    _same_trees(out, out_u)


def test_decode_attention_sums_the_new_keys_and_values_split_partials(rng, monkeypatch):
    """In decode the attention block hands the step's keys and values to the decode attention kernel as k_proj's /
    v_proj's split partials (the kernel sums them: no sum launches): the step's logits and states are those of the
    projections' outputs, bit for bit."""
    model = _model("fp8-block", int(rng.integers(1 << 30)))
    ids = rng.integers(0, V, (2, 6)).astype(np.int32)
    _, cache = model.prefill(model.new_cache(2, 16), [0, 1], ids)
    tok, slots = jnp.asarray(rng.integers(0, V, 2), jnp.int32), jnp.asarray([0, 1])
    operand, handed = NemotronAttentionLayer._new_keys_or_values, []

    def spy(*args):
        out = operand(*args)
        handed.append(isinstance(out, SplitPartials))
        return out

    monkeypatch.setattr(NemotronAttentionLayer, "_new_keys_or_values", staticmethod(spy))
    out = jax.jit(lambda c, t: decode_step(model, c, slots, t))(jax.tree.map(jnp.copy, cache), tok)
    assert handed == [True, True]
    monkeypatch.setattr(NemotronAttentionLayer, "_new_keys_or_values", staticmethod(
        lambda proj, bias, x, pool: linear(proj, bias, x, "decode").reshape(2, *pool.k.shape[3:])))
    out_plain = jax.jit(lambda c, t: decode_step(model, c, slots, t))(jax.tree.map(jnp.copy, cache), tok)
    _same_trees(out, out_plain)
    assert np.all(np.isfinite(np.asarray(out[0])))


def _closings(proj, hidden, g, bias=None):
    """close_block in decode with hand_on, and the plain block's stream hidden + linear(proj, bias, g)."""
    return close_block(hidden, proj, g, "decode", hand_on=True, bias=bias), hidden + linear(proj, bias, g, "decode")


def _same_settled(pending, plain, splits):
    assert isinstance(pending, PendingResidual) and pending.partials.splits == splits
    assert pending.partials.values.dtype == jnp.float32 or pending.partials.halves
    np.testing.assert_array_equal(np.asarray(settled(pending)), np.asarray(plain))


def test_what_a_block_hands_on(rng):
    """In decode a quantized GEMV hands on its split partials; a dense arm, a biased projection and a LoRA overlay
    their float32 output as one partial; settled() of each is the plain block's stream bit for bit. Prefill and
    hand_on=False return the sum."""
    model = _model("fp8-block", int(rng.integers(1 << 30)), kernels="reference")
    proj = model.layers[0].out_proj
    g = jnp.asarray(rng.standard_normal((3, proj.in_features)), jnp.bfloat16)
    hidden = jnp.asarray(rng.standard_normal((3, proj.out_features)), jnp.bfloat16)
    bias = nnx.Param(jnp.asarray(rng.standard_normal(proj.out_features), jnp.bfloat16))
    assert proj.hands_on_partials("decode", 3) and not proj.hands_on_partials("prefill", 3)
    _same_settled(*_closings(proj, hidden, g), splits=proj.partials(g, phase="decode").splits)
    _same_settled(*_closings(proj, hidden, g, bias), splits=1)
    assert not isinstance(close_block(hidden, proj, g, "decode", hand_on=False), PendingResidual)
    assert not isinstance(close_block(hidden, proj, g, "prefill", hand_on=True), PendingResidual)
    with pytest.raises(ShapeError, match="cannot hand on split partials"):
        proj.partials(g, phase="prefill")
    with pytest.raises(ShapeError, match="input must be"):
        proj.partials(g[:, :8], phase="decode")
    tensors = random_tensors(ALL_KINDS, jax.random.key(1), jnp.bfloat16)
    dense = NemotronH(ALL_KINDS, tensors, dtype=jnp.bfloat16, levers=ModelLevers(kernels="reference"))
    dense_proj = dense.layers[0].out_proj
    assert dense_proj.active_arm("decode", 3) == "dense" and not dense_proj.hands_on_partials("decode", 3)
    _same_settled(*_closings(dense_proj, hidden, g), splits=1)
    model.add_adapter("a", r=2, lora_alpha=4.0, target_modules=["out_proj"], key=jax.random.key(2))
    proj.lora.b.set_value(jnp.asarray(rng.standard_normal(proj.lora.b.shape), proj.lora.b.dtype))  # PEFT's is 0
    assert not proj.hands_on_partials("decode", 3)
    with slot_adapters(jnp.ones(3, jnp.int32)), head_rows(jnp.arange(3)):
        pending, plain = _closings(proj, hidden, g)
        _same_settled(pending, plain, splits=1)
    assert not np.array_equal(np.asarray(plain), np.asarray(hidden + proj(g, phase="decode")))   # delta is live


def test_tensor_parallel_decode_is_bitwise_the_unfused_step(rng):
    """Split over two devices the blocks' all-reduced outputs wait for the next norm as one partial each: the
    same logits and states as with the fused kernel disabled."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    tensors = random_tensors(ALL_KINDS, jax.random.key(int(rng.integers(1 << 30))), jnp.bfloat16)
    model = NemotronH(ALL_KINDS, tensors, dtype=jnp.bfloat16, levers=ModelLevers(kernels="interpret"),
                      mesh=sharding.make_mesh(2))
    (text, out), (text_u, out_u) = _two_sequences_one_step(model, rng, 5)
    assert "add_rmsnorm" in text and "add_rmsnorm" not in text_u
    _same_trees(out, out_u)
