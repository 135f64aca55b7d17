"""The residual add + RMSNorm between blocks (`norms.add_rmsnorm`, and `norm_fp8.add_rmsnorm_fp8` with E4M3
output) and the unreduced GEMV output they read (`split_partials`): bitwise against the unfused composition,
every GEMV arm's partials against its own sum."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import ShapeError
from pallas_kernels import mgpu_gemv_w4 as w4m
from pallas_kernels import mgpu_gemv_w8 as w8m
from pallas_kernels import norm_fp8, norms, w4a16, w8a16
from pallas_kernels.mgpu_gemv import GemvConfig
from pallas_kernels.split_partials import SplitPartials, chain_sum, join_halves, split_halves
from tests.kernels.test_mgpu_gemv import _fp8, _nvfp4

BF16, F32 = jnp.bfloat16, jnp.float32


@pytest.fixture(autouse=True)
def _reset_interpreter():
    """The GPU interpreter keeps global state that an exception leaves dirty."""
    yield
    if jax.default_backend() != "gpu":
        from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
        reset_gpu_interpret_mode_state()


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_halves_round_trip_every_float32_class(rng):
    x = np.concatenate([rng.standard_normal(4096) * 10.0 ** rng.integers(-40, 38, 4096),
                        [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38]]).astype(np.float32)
    hi, lo = split_halves(jnp.asarray(x))
    assert hi.dtype == lo.dtype == jnp.uint16
    _same(join_halves(hi, lo), x)


def _partials(rng, S, R, D, M, halves):
    """Random float32 partials with the padding rows past M poisoned (NaN): a kernel that reads them fails."""
    p = (rng.standard_normal((S, R, D)) * rng.uniform(0.1, 4.0, (S, 1, D))).astype(np.float32)
    p[:, M:] = np.nan
    p = jnp.asarray(p)
    return p, SplitPartials(jnp.stack(split_halves(p)) if halves else p)


@pytest.mark.parametrize("halves", [False, True])
@pytest.mark.parametrize("M,R,S,D", [(1, 8, 8, 256), (3, 8, 1, 384), (5, 16, 3, 256), (17, 24, 2, 128),
                                     (64, 64, 2, 4096)])
def test_fused_equals_the_unfused_composition_bitwise(rng, interpret, halves, M, R, S, D):
    """h = hidden + bf16(p0 + p1 + ...) and rmsnorm(h) as the Pallas norm computes it: the same bits, whatever
    the layout of the partials (D = 384: a width that is not a power of two, masked). 64 rows of the 8B width:
    on the GPU a row sum in another order than the plain norm's (another tile or warp count) flips some of its
    262,144 outputs."""
    hidden = jnp.asarray(rng.standard_normal((M, D)) * 3, BF16)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, D), BF16)
    raw, parts = _partials(rng, S, R, D, M, halves)
    y = raw[0, :M]
    for s in range(1, S):
        y = y + raw[s, :M]
    h_want = hidden + y.astype(BF16)
    x_want = norms.rmsnorm_pallas(h_want, weight, eps=1e-5, interpret=interpret)
    h, x = norms.add_rmsnorm_pallas(hidden, parts, weight, eps=1e-5, interpret=interpret)
    assert h.dtype == x.dtype == BF16 and h.shape == x.shape == (M, D)
    _same(h, h_want)
    _same(x, x_want)
    h_ref, x_ref = norms.add_rmsnorm_reference(hidden, parts, weight, eps=1e-5)
    _same(h_ref, h_want)
    _same(x_ref, norms.rmsnorm_reference(h_want, weight, eps=1e-5))
    assert np.abs(np.asarray(x, F32) - np.asarray(x_ref, F32)).max() <= 2 ** -6 * np.abs(np.asarray(x_ref, F32)).max()


@pytest.mark.parametrize("per_block", [True, False])
@pytest.mark.parametrize("halves,M,R,S,D", [(False, 1, 8, 8, 256), (True, 5, 16, 3, 512), (True, 64, 64, 8, 4096)])
def test_fp8_form_equals_the_unfused_composition_bitwise(rng, interpret, per_block, halves, M, R, S, D):
    """add_rmsnorm_fp8: the stream and the E4M3 rows with their scales, bit for bit as the partials' sum + residual
    add and then rmsnorm_fp8 (its launch, its row sums); the reference agrees with its own composition."""
    hidden = jnp.asarray(rng.standard_normal((M, D)) * 3, BF16)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, D), BF16)
    _, parts = _partials(rng, S, R, D, M, halves)
    h_want = hidden + chain_sum(parts, M).astype(BF16)
    q_want = norm_fp8.rmsnorm_fp8_pallas(h_want, weight, eps=1e-5, per_block=per_block, interpret=interpret)
    h, q = norm_fp8.add_rmsnorm_fp8_pallas(hidden, parts, weight, eps=1e-5, per_block=per_block, interpret=interpret)
    _same(h, h_want)
    _same(q.q, q_want.q)
    _same(q.scale, q_want.scale)
    assert q.q.dtype == jnp.float8_e4m3fn and q.scale.shape == ((M, D // 128) if per_block else (M,))
    h_ref, q_ref = norm_fp8.add_rmsnorm_fp8_reference(hidden, parts, weight, eps=1e-5, per_block=per_block)
    _same(h_ref, h_want)
    want_ref = norm_fp8.rmsnorm_fp8_reference(h_want, weight, eps=1e-5, per_block=per_block)
    _same(q_ref.q, want_ref.q)
    deq, deq_ref = np.asarray(q.dequantize(), F32), np.asarray(q_ref.dequantize(), F32)
    assert np.all(np.isfinite(deq)) and np.abs(deq - deq_ref).max() <= 2 ** -3 * np.abs(deq_ref).max()


def test_fp8_form_refuses_what_its_launch_does_not_take(rng):
    hidden = jnp.asarray(rng.standard_normal((3, 384)), BF16)
    parts = SplitPartials(jnp.asarray(rng.standard_normal((2, 8, 384)), F32))
    with pytest.raises(ValueError, match="power-of-two width"):
        norm_fp8.add_rmsnorm_fp8_pallas(hidden, parts, jnp.ones(384, BF16), eps=1e-5, per_block=True, interpret=True)
    with pytest.raises(ShapeError, match="partials expected"):
        norm_fp8.add_rmsnorm_fp8_pallas(hidden[:, :256], SplitPartials(parts.values[:, :2, :256]), jnp.ones(256, BF16),
                                        eps=1e-5, per_block=True, interpret=True)


def test_output_dtype_and_float64_check(rng, interpret):
    """The normalised rows take out_dtype (float32 here) and agree with a float64 numpy recurrence."""
    M, D, S = 2, 256, 4
    hidden = jnp.asarray(rng.standard_normal((M, D)), BF16)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, D), F32)
    raw, parts = _partials(rng, S, 8, D, M, True)
    h, x = norms.add_rmsnorm_pallas(hidden, parts, weight, eps=1e-6, out_dtype=F32, interpret=interpret)
    assert x.dtype == F32
    y = np.asarray(raw[:, :M], np.float64).sum(0)
    h64 = np.asarray(hidden, np.float64) + y
    assert np.abs(np.asarray(h, np.float64) - h64).max() <= 2 ** -7 * np.abs(h64).max()
    hb = np.asarray(h, np.float64)
    x64 = hb / np.sqrt((hb * hb).mean(-1, keepdims=True) + 1e-6) * np.asarray(weight, np.float64)
    np.testing.assert_allclose(np.asarray(x), x64, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_shape_errors(rng):
    hidden = jnp.asarray(rng.standard_normal((3, 256)), BF16)
    w = jnp.ones(256, BF16)
    good = SplitPartials(jnp.asarray(rng.standard_normal((2, 8, 256)), F32))
    fn = functools.partial(norms.add_rmsnorm_pallas, eps=1e-5, interpret=True)
    with pytest.raises(ShapeError, match="partials expected"):
        fn(hidden, SplitPartials(good.values[:, :2]), w)                   # fewer rows than hidden
    with pytest.raises(ShapeError, match="partials expected"):
        fn(hidden, SplitPartials(good.values[..., :128]), w)               # another width
    with pytest.raises(ShapeError, match="partials expected"):
        fn(hidden, SplitPartials(good.values.astype(BF16)), w)             # neither float32 nor uint16 halves
    with pytest.raises(ShapeError, match="partials expected"):
        fn(hidden, SplitPartials(jnp.zeros((3, 2, 8, 256), jnp.uint16)), w)   # halves need a leading 2
    with pytest.raises(ShapeError, match="weight"):
        fn(hidden, good, jnp.ones(128, BF16))
    with pytest.raises(ShapeError, match="hidden expected"):
        fn(hidden[None], good, w)


# ---- every decode GEMV arm hands on partials whose chain sum is its own output, bit for bit ----------------
ARMS = {
    "w8a16 triton": (_fp8, lambda x, *w, **kw: w8a16.w8a16_gemv_pallas(x, *w, **kw)),
    "w8a16 mosaic split": (_fp8, lambda x, *w, **kw: w8m.w8a16_gemv_mosaic(x, *w, config=GemvConfig(64, 2, 4), **kw)),
    "w8a16 mosaic unsplit": (_fp8, lambda x, *w, **kw: w8m.w8a16_gemv_mosaic(x, *w, config=GemvConfig(64, 2, 1),
                                                                              **kw)),
    "w8a8 triton": (_fp8, lambda x, *w, **kw: w8a16.w8a8_gemv_pallas(x, *w, **kw)),
    "w8a8 mosaic": (_fp8, lambda x, *w, **kw: w8m.w8a8_gemv_mosaic(x, *w, config=GemvConfig(64, 2, 2), **kw)),
    "w4a16 triton": (_nvfp4, lambda x, *w, **kw: w4a16.w4a16_gemv_pallas(x, *w, **kw)),
    "w4a16 mosaic": (_nvfp4, lambda x, *w, **kw: w4m.w4a16_gemv_mosaic(x, *w, config=GemvConfig(64, 3, 2), **kw)),
}


@pytest.mark.parametrize("arm", list(ARMS))
@pytest.mark.parametrize("M", [1, 5, 17])      # 17: x rows padded to 24, 16-row x tiles
def test_unreduced_partials_sum_to_the_output(rng, interpret, arm, M):
    make, fn = ARMS[arm]
    N, K = 128, 1024
    w = make(rng, N, K)
    x = jnp.asarray(rng.standard_normal((M, K)), BF16)
    call = functools.partial(fn, interpret=interpret) if "mosaic" in arm or interpret else fn
    parts = call(x, *w, unreduced=True)
    assert isinstance(parts, SplitPartials) and parts.rows >= M and parts.width == N
    _same(chain_sum(parts, M).astype(BF16), call(x, *w))
    _same(chain_sum(parts, M), call(x, *w, out_dtype=F32))


def test_unreduced_takes_no_epilogue_and_no_other_dtype(rng):
    q, s = _fp8(rng, 128, 256)
    x = jnp.asarray(rng.standard_normal((1, 256)), BF16)
    with pytest.raises(ShapeError, match="unreduced=True"):
        w8a16.w8a16_gemv_pallas(x, q, s, unreduced=True, epilogue="relu2", interpret=True)
    with pytest.raises(ShapeError, match="unreduced=True"):
        w8m.w8a16_gemv_mosaic(x, q, s, unreduced=True, out_dtype=BF16, interpret=True)
    ref = w8a16.w8a16_reference(x, q, s, unreduced=True)
    _same(chain_sum(ref, 1), w8a16.w8a16_reference(x, q, s, out_dtype=F32))
