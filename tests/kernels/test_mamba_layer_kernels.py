"""NemotronMamba2Layer with the Pallas kernels (interpret mode on the CPU, compiled on a GPU) against the same
layer on the jnp references: every entry point's outputs and the whole pool."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import ModelConfig, ModelLevers, NemotronMamba2Layer, SsmPool
from metrale_jax.init import random_norm, random_ssm_weights
from pallas_kernels import registry
from tests.numpy_refs import rel_err

CFG = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="M-M", mamba_num_heads=4,
                               mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16,
                               intermediate_size=48))
KERNELS = ("rmsnorm", "causal_conv1d", "causal_conv1d_update", "causal_conv1d_update_multi", "ssd_scan",
           "state_update_xbc", "state_update_multi_xbc", "gated_rmsnorm")


@pytest.fixture(scope="module")
def layers(interpret):
    key = jax.random.key(int(np.random.SeedSequence().entropy % 2**31))
    k1, k2 = jax.random.split(key)
    norm, ssm = random_norm(CFG, k1, jnp.float32), random_ssm_weights(CFG, k2, jnp.float32)
    mode = "interpret" if interpret else "auto"     # auto on a GPU: Pallas where registered (not dense_matmul)
    make = lambda kernels: NemotronMamba2Layer(norm, ssm, CFG, layer_idx=2, levers=ModelLevers(kernels=kernels))
    return make(mode), make("reference"), mode


def _pool(rng):
    p = SsmPool.for_config(CFG, 5, dtype=jnp.float32)
    return SsmPool(jnp.asarray(rng.standard_normal(p.conv_state.shape), jnp.float32),
                   jnp.asarray(rng.standard_normal(p.ssm_state.shape), jnp.float32))


def _close(a, b, tol=1e-4):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert u.shape == v.shape and u.dtype == v.dtype
        assert np.all(np.isfinite(np.asarray(u)))
        assert rel_err(u, v) <= tol


def test_every_kernel_resolves_to_pallas(layers):
    _, _, mode = layers
    for name in KERNELS:
        default = "mosaic" if registry._KERNELS[name].gpu_default == "mosaic" else "pallas"
        assert registry.resolve(name, mode).impl == ("interpret" if mode == "interpret" else default)


def test_prefill_varlen_and_continuation(rng, layers):
    kern, ref, _ = layers
    lens = [9, 0, 37, 20]
    T = sum(lens) + 2
    x = jnp.asarray(rng.standard_normal((T, CFG.hidden_size)), jnp.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    slots, starts = jnp.asarray([0, 4, 2, 3], jnp.int32), jnp.asarray([0, 0, 5, 11], jnp.int32)
    pool = _pool(rng)
    run = jax.jit(lambda l, p: l.prefill_varlen(p, slots, x, cu, starts, return_chunk_states=True))
    out_k, pool_k, chunks_k = run(kern, pool)
    out_r, pool_r, chunks_r = run(ref, pool)
    _close(out_k[:sum(lens)], out_r[:sum(lens)])
    _close(pool_k, pool_r)
    v = np.asarray(chunks_r.valid)
    assert rel_err(chunks_k.states[v], chunks_r.states[v]) <= 1e-4


def test_decode_multi_seq_and_verify(rng, layers):
    kern, ref, _ = layers
    pool = _pool(rng)
    pad = pool.padding_slot
    slots = jnp.asarray([3, pad, 0], jnp.int32)
    x = jnp.asarray(rng.standard_normal((3, CFG.hidden_size)), jnp.float32)
    run = jax.jit(lambda l, p: l.decode_multi_seq(p, slots, x))
    (out_k, pool_k), (out_r, pool_r) = run(kern, pool), run(ref, pool)
    live = np.asarray([0, 2])
    _close(out_k[live], out_r[live])
    keep = np.asarray([0, 1, 2, 3, 4])                       # every slot but the padding slot
    _close((pool_k.conv_state[:, keep], pool_k.ssm_state[:, keep]), (pool_r.conv_state[:, keep],
                                                                      pool_r.ssm_state[:, keep]))
    k = 3
    xs = jnp.asarray(rng.standard_normal((2 * k, CFG.hidden_size)), jnp.float32)
    vslots = jnp.asarray([1, 4], jnp.int32)
    verify = jax.jit(lambda l, p: l.decode_verify_multi(p, vslots, xs, k))
    _close(verify(kern, pool), verify(ref, pool))


def test_prefill_then_decode_continues_the_scan(rng, layers):
    """Prefill 30 tokens then decode 2 with the kernels equals prefilling all 32 with the references."""
    kern, ref, _ = layers
    x = jnp.asarray(rng.standard_normal((32, CFG.hidden_size)), jnp.float32)
    pool = _pool(rng)
    prefill = jax.jit(lambda l, p, h: l.prefill(p, 1, h, 0))
    decode = jax.jit(lambda l, p, h: l.decode(p, 1, h))
    out, p = prefill(kern, pool, x[:30])
    o1, p = decode(kern, p, x[30])
    o2, p = decode(kern, p, x[31])
    full, p_ref = prefill(ref, pool, x)
    _close(jnp.concatenate([out, o1[None], o2[None]]), full)
    _close((p.conv_state[:, 1], p.ssm_state[:, 1]), (p_ref.conv_state[:, 1], p_ref.ssm_state[:, 1]))
