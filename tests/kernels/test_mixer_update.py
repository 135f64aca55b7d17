"""The fused Mamba decode step (conv update + SiLU + state update, `mixer_update`) against the two kernels it
replaces, its reference, a float64 numpy rendering, and through a layer's decode with the lever on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import ConfigError, ModelConfig, ModelLevers, NemotronMamba2Layer, SsmPool
from metrale_jax.errors import ShapeError
from metrale_jax.init import random_norm, random_ssm_weights
from pallas_kernels import registry
from pallas_kernels.conv1d import causal_conv1d_update_pallas
from pallas_kernels.mixer_update import UpdateBlocks, mixer_update_pallas, mixer_update_reference
from pallas_kernels.state_update import state_update_xbc_pallas
from tests.numpy_refs import rel_err

R, H, P, G, N, K = 11, 4, 8, 2, 16, 4          # pool rows, heads, head dim, groups, state size, conv taps
C = H * P + 2 * G * N                           # conv channels (x | B | C)
I = H * P                                       # z columns in front of the conv input (in_proj order z|xBC|dt)
PAD = R - 1


def _operands(rng, batch, dtype=jnp.float32, state_dtype=jnp.float32, conv_bias=True):
    a = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    conv = jnp.asarray(rng.standard_normal((R, C, K - 1)), dtype)
    ssm = jnp.asarray(rng.standard_normal((R, H, P, N)), state_dtype)
    zx = jnp.asarray(rng.standard_normal((batch, I + C + H)), dtype)
    weights = (jnp.asarray(rng.standard_normal((C, K)) * 0.5, dtype), a(C).astype(dtype) if conv_bias else None)
    kw = dict(x_col=I, dt_col=I + C, A_log=jnp.asarray(rng.uniform(-1, 1.5, H), jnp.float32), D=a(H),
              dt_bias=jnp.asarray(rng.uniform(-1, 1, H), jnp.float32))
    return conv, ssm, zx, weights, kw


def _unfused(conv, ssm, slots, zx, w, b, *, x_col, dt_col, interpret, **kw):
    """The two kernels the fused one replaces, in turn."""
    at = {k: kw.pop(k) for k in ("skip_row", "row_offset") if k in kw}
    xbc, conv = causal_conv1d_update_pallas(conv, slots, zx, w, b, x_col=x_col, interpret=interpret, **at)
    y, ssm = state_update_xbc_pallas(ssm, slots, xbc, zx, dt_col=dt_col, interpret=interpret, **at, **kw)
    return y, conv, ssm


@pytest.mark.parametrize("dtype,state_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
                                               (jnp.bfloat16, jnp.bfloat16)])
def test_equals_the_two_kernels_it_replaces(rng, interpret, dtype, state_dtype):
    """Same arithmetic: the conv pool bit for bit (every window, the B / C ones written by the group's last reader),
    y and the SSM state to float32 rounding (interpreted on the CPU, XLA compiles the SiLU's exp of a 64-channel
    conv block and of the fused kernel's 8 / 16 channels differently), every row the step does not name
    untouched."""
    conv, ssm, zx, (w, b), kw = _operands(rng, 5, dtype, state_dtype)
    slots, at = jnp.asarray([2, 4, 0, 4, 3], jnp.int32), dict(row_offset=6, skip_row=PAD)   # rows 8, 10 (x2), 6, 9
    conv = conv.at[PAD].set(jnp.nan)                                  # a read of the skipped row would show
    ssm = ssm.at[PAD].set(jnp.nan)
    got = mixer_update_pallas(conv, ssm, slots, zx, w, b, **kw, **at, interpret=interpret)
    want = _unfused(conv, ssm, slots, zx, w, b, **kw, **at, interpret=interpret)
    y, new_conv, new_ssm = (np.asarray(v, np.float32) for v in got)
    y2, conv2, ssm2 = (np.asarray(v, np.float32) for v in want)
    np.testing.assert_array_equal(new_conv, conv2)
    assert np.isnan(new_conv[PAD]).all() and np.isnan(new_ssm[PAD]).all()
    live_rows, live = [8, 6, 9], np.asarray([0, 2, 4])
    tol = 1e-6 if dtype == jnp.float32 and state_dtype == jnp.float32 else 1e-2
    assert rel_err(new_ssm[live_rows], ssm2[live_rows]) <= tol
    assert rel_err(y[live], y2[live]) <= tol and np.isfinite(y).all()
    keep = [r for r in range(R) if r not in (8, 6, 9, PAD)]
    np.testing.assert_array_equal(new_conv[keep], np.asarray(conv, np.float32)[keep])
    np.testing.assert_array_equal(new_ssm[keep], np.asarray(ssm, np.float32)[keep])
    assert not np.array_equal(new_conv[live_rows], np.asarray(conv, np.float32)[live_rows])


def _numpy_step(conv, ssm, slot_rows, zx, w, b, A_log, D, dt_bias):
    """A float64 rendering of one decode token: conv (SiLU) then the SSM recurrence, per row."""
    f = lambda v: np.asarray(v, np.float64)
    conv, ssm, zx, w = f(conv).copy(), f(ssm).copy(), f(zx), f(w)
    A = -np.exp(f(A_log))
    ys = []
    for i, r in enumerate(slot_rows):
        window = np.concatenate([conv[r], zx[i, I:I + C, None]], axis=1)                  # [C, K]
        pre = (window * w).sum(1) + f(b)
        xbc = pre / (1 + np.exp(-pre))
        conv[r] = window[:, 1:]
        x, Bm, Cm = xbc[:I].reshape(H, P), xbc[I:I + G * N].reshape(G, N), xbc[I + G * N:].reshape(G, N)
        dt = zx[i, I + C:] + f(dt_bias)
        dt = np.log1p(np.exp(dt))
        rep = H // G
        y = np.empty((H, P))
        for h in range(H):
            g = h // rep
            ssm[r, h] = ssm[r, h] * np.exp(dt[h] * A[h]) + dt[h] * np.outer(x[h], Bm[g])
            y[h] = ssm[r, h] @ Cm[g] + f(D)[h] * x[h]
        ys.append(y)
    return np.stack(ys), conv, ssm


def test_matches_float64_numpy_and_the_reference(rng, interpret):
    conv, ssm, zx, (w, b), kw = _operands(rng, 3)
    slots = jnp.asarray([1, 0, 2], jnp.int32)
    got = mixer_update_pallas(conv, ssm, slots, zx, w, b, **kw, row_offset=4, interpret=interpret)
    ref = mixer_update_reference(conv, ssm, slots, zx, w, b, **kw, row_offset=4)
    y64, conv64, ssm64 = _numpy_step(conv, ssm, [5, 4, 6], zx, w, b, kw["A_log"], kw["D"], kw["dt_bias"])
    for g, r, n64 in zip(got, ref, (y64, conv64, ssm64)):
        assert rel_err(np.asarray(g), n64) <= 1e-5 and rel_err(np.asarray(r), n64) <= 1e-5


@pytest.mark.parametrize("blocks", [UpdateBlocks(block_p=4, num_warps=2), UpdateBlocks(block_p=16, num_warps=4)])
def test_block_sizes_and_no_conv_bias(rng, interpret, blocks):
    """Several P-blocks per head (more programs count in per group) and one block wider than P (masked)."""
    conv, ssm, zx, (w, _), kw = _operands(rng, 2, conv_bias=False)
    slots = jnp.asarray([3, 1], jnp.int32)
    got = mixer_update_pallas(conv, ssm, slots, zx, w, None, **kw, interpret=interpret, blocks=blocks)
    want = _unfused(conv, ssm, slots, zx, w, None, **kw, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    for g, v in zip(got[::2], want[::2]):
        assert rel_err(np.asarray(g), np.asarray(v)) <= 1e-6


def test_registered_and_bad_inputs_raise(rng):
    assert registry.resolve("mixer_update", "interpret").impl == "interpret"
    conv, ssm, zx, (w, b), kw = _operands(rng, 2)
    slots = jnp.asarray([0, 1], jnp.int32)
    cases = [
        (dict(conv=conv[:5]), "rows"),                                       # pools of different rows
        (dict(row_offset=R), "row_offset"),
        (dict(zx=zx[:, :-1]), "dt"),                                         # dt columns past the end
        (dict(w=w[:, :3]), "pool"),                                          # taps do not match the windows
        (dict(ssm=ssm[:, :, :, :5]), "xbc"),                                 # B / C columns do not fit N
        (dict(slots=slots[:1]), "rows"),
    ]
    for change, match in cases:
        args = dict(conv=conv, ssm=ssm, slots=slots, zx=zx, w=w) | change
        extra = {k: v for k, v in change.items() if k == "row_offset"}
        args.pop("row_offset", None)
        with pytest.raises(ShapeError, match=match):
            mixer_update_pallas(args["conv"], args["ssm"], args["slots"], args["zx"], args["w"], b, **kw, **extra,
                                interpret=True)


CFG = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="-M", mamba_num_heads=4,
                               mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=8, intermediate_size=48))


def test_a_layers_decode_with_the_fused_mixer_equals_the_two_kernels(rng):
    """decode_mixer='fused' (the lever) through NemotronMamba2Layer.decode_multi_seq for three tokens on interpret-mode
    kernels: outputs and pools as with 'separate', the padding slot untouched by both."""
    k1, k2 = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    norm, weights = random_norm(CFG, k1, jnp.float32), random_ssm_weights(CFG, k2, jnp.float32)
    layers = {m: NemotronMamba2Layer(norm, weights, CFG, layer_idx=1,
                                     levers=ModelLevers(kernels="interpret", decode_mixer=m))
              for m in ("separate", "fused")}
    p = SsmPool.for_config(CFG, 4, dtype=jnp.float32)
    pool = SsmPool(jnp.asarray(rng.standard_normal(p.conv_state.shape), jnp.float32),
                   jnp.asarray(rng.standard_normal(p.ssm_state.shape), jnp.float32))
    slots = jnp.asarray([2, 0, p.padding_slot], jnp.int32)
    step = jax.jit(lambda layer, pool, h: layer.decode_multi_seq(pool, slots, h, skip_padding_slot=True))
    pools = {m: pool for m in layers}
    for _ in range(3):
        h = jnp.asarray(rng.standard_normal((3, CFG.hidden_size)), jnp.float32)
        outs = {}
        for m, layer in layers.items():
            outs[m], pools[m] = step(layer, pools[m], h)
        assert rel_err(np.asarray(outs["fused"])[:2], np.asarray(outs["separate"])[:2]) <= 1e-5
    np.testing.assert_array_equal(np.asarray(pools["fused"].conv_state), np.asarray(pools["separate"].conv_state))
    assert rel_err(np.asarray(pools["fused"].ssm_state), np.asarray(pools["separate"].ssm_state)) <= 1e-5
    pad = p.padding_slot
    np.testing.assert_array_equal(np.asarray(pools["fused"].ssm_state[:, pad]), np.asarray(pool.ssm_state[:, pad]))
    assert not np.array_equal(np.asarray(pools["fused"].conv_state[:, 2]), np.asarray(pool.conv_state[:, 2]))


def test_the_lever_is_checked():
    assert ModelLevers().decode_mixer == "separate"
    assert ModelLevers.from_env({"METRALE_DECODE_MIXER": "fused"}).decode_mixer == "fused"
    with pytest.raises(ConfigError, match="decode_mixer"):
        ModelLevers(decode_mixer="one")


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [2, 64])
def test_bitwise_the_two_kernels_at_8b_shapes_on_gpu(rng, batch):
    """On the GPU both programs compile the same arithmetic the same way: y, the conv and the SSM pool bit for bit
    against the two kernels at Nemotron-H-8B's Mamba shapes (128 heads x 64, 8 groups x 128, bf16 in_proj output,
    f32 state), with the padding slot skipped and a layer's row offset; the group counters work across CTAs (every
    B / C window written once, after all of its group's reads)."""
    Hb, Pb, Gb, Nb = 128, 64, 8, 128
    Cb = Hb * Pb + 2 * Gb * Nb
    slots_n, layers = batch + 1, 3
    rows = layers * slots_n
    conv = jnp.asarray(rng.standard_normal((rows, Cb, K - 1)), jnp.bfloat16)
    ssm = jnp.asarray(rng.standard_normal((rows, Hb, Pb, Nb)), jnp.float32)
    zx = jnp.asarray(rng.standard_normal((batch, Hb * Pb + Cb + Hb)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((Cb, K)) * 0.5, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(Cb), jnp.bfloat16)
    kw = dict(x_col=Hb * Pb, dt_col=Hb * Pb + Cb, A_log=jnp.asarray(rng.uniform(-1, 1.5, Hb), jnp.float32),
              D=jnp.asarray(rng.standard_normal(Hb), jnp.float32),
              dt_bias=jnp.asarray(rng.uniform(-1, 1, Hb), jnp.float32))
    slots = jnp.asarray(np.concatenate([rng.permutation(batch - 1), [batch]]), jnp.int32)    # the last: padding
    at = dict(row_offset=slots_n, skip_row=slots_n + batch)
    got = mixer_update_pallas(conv, ssm, slots, zx, w, b, **kw, **at)
    want = _unfused(conv, ssm, slots, zx, w, b, **kw, **at, interpret=False)
    for g, v in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(v, np.float32))
