"""Gradients through every registered Pallas kernel (interpret mode on the CPU) equal the reference's gradients.

Each kernel's backward pass is its reference's VJP (pallas_kernels/autodiff.py), so the gradients differ only
through the forward values the loss feeds back: the loss here is nonlinear in the outputs (sum r * out^2), so a
kernel whose wrapper dropped an operand, passed the wrong argument or returned the wrong structure fails.
Quantized kernels differentiate with respect to their activations; their weights and scales get zero cotangents.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.weights import quant_formats as qf
from pallas_kernels import registry
from pallas_kernels.errors import KernelUnavailableError
from pallas_kernels.autodiff import with_reference_vjp
from pallas_kernels.split_partials import SplitPartials
from pallas_kernels.ssd import ssd_scan_reference
from pallas_kernels.ssd_mgpu import ssd_scan_mosaic
from tests.numpy_refs import rel_err

F32 = jnp.float32
TOL = 5e-5           # float32 gradients summed in another order than the reference path's (seen 1.6e-5)


def _a(rng, *shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, F32)


def _cu(lens):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)


def _ssm(rng, lead, H=4, P=8, G=2, N=8):
    """Decode-recurrence operands for `lead` rows: x, dt, A, B, C and the D / dt_bias keywords."""
    return (dict(x=_a(rng, *lead, H, P), dt=jnp.asarray(rng.uniform(-3, 1, (*lead, H)), F32),
                 A=jnp.asarray(-np.exp(rng.uniform(-1, 1.5, H)), F32), B=_a(rng, *lead, G, N), C=_a(rng, *lead, G, N)),
            dict(D=_a(rng, H), dt_bias=jnp.asarray(rng.uniform(-1, 1, H), F32)))


def _weights(rng, n, k, experts):
    """float32 [n, k] weights (rows of different magnitudes), or [experts] of them."""
    return [(rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0, (n, 1))).astype(np.float32)
            for _ in range(experts or 1)]


def _stack(parts, experts):
    """Per-matrix tuples of quantized arrays -> one tuple of jnp arrays (stacked along experts when given)."""
    return tuple(jnp.asarray(np.stack(a) if experts else a[0]) for a in zip(*parts))


def fp8_block(rng, n, k, experts=None):
    return _stack([qf.quantize_fp8_block(w) for w in _weights(rng, n, k, experts)], experts)


def fp8_rows(rng, n, k):
    return _stack([qf.quantize_fp8_rows(w) for w in _weights(rng, n, k, None)], None)


def nvfp4(rng, n, k, experts=None):
    return _stack([qf.quantize_nvfp4(w) for w in _weights(rng, n, k, experts)], experts)


def _packed(a):
    """x, B, C of `_ssm` packed as the conv output lays them out ([..., H*P + 2*G*N])."""
    lead = a["dt"].shape[:-1]
    return jnp.concatenate([a[k].reshape(*lead, -1) for k in ("x", "B", "C")], axis=-1)


# name -> rng -> (args, kwargs): float32 operands at small ragged sizes
CASES = {
    "rmsnorm": lambda r: ((_a(r, 6, 40), 1 + _a(r, 40, scale=0.1)), dict(eps=1e-5)),
    "add_rmsnorm": lambda r: ((_a(r, 6, 40), SplitPartials(_a(r, 3, 8, 40)), 1 + _a(r, 40, scale=0.1)),
                              dict(eps=1e-5)),
    "gated_rmsnorm": lambda r: ((_a(r, 6, 32), _a(r, 6, 45), 1 + _a(r, 32, scale=0.1)),
                                dict(group_size=16, eps=1e-5, z_col=7)),
    "rmsnorm_fp8": lambda r: ((_a(r, 6, 256), 1 + _a(r, 256, scale=0.1)), dict(eps=1e-5, per_block=True)),
    "add_rmsnorm_fp8": lambda r: ((_a(r, 6, 256), SplitPartials(_a(r, 3, 8, 256)), 1 + _a(r, 256, scale=0.1)),
                                  dict(eps=1e-5, per_block=True)),
    "gated_rmsnorm_fp8": lambda r: ((_a(r, 6, 256), _a(r, 6, 256), 1 + _a(r, 256, scale=0.1)),
                                    dict(group_size=128, eps=1e-5, per_group=True)),
    "causal_conv1d": lambda r: ((_a(r, 19, 24), _a(r, 24, 4), _a(r, 24)),
                                dict(initial_states=_a(r, 3, 24, 3), cu_seqlens=_cu([5, 0, 12]))),
    "causal_conv1d_update": lambda r: ((_a(r, 7, 24, 3), jnp.asarray([5, 0, 3], jnp.int32), _a(r, 3, 30),
                                        _a(r, 24, 4), _a(r, 24)), dict(x_col=4)),
    "causal_conv1d_update_multi": lambda r: ((_a(r, 7, 24, 3), jnp.asarray([5, 0], jnp.int32), _a(r, 2, 3, 24),
                                              _a(r, 24, 4), _a(r, 24)), {}),
    "ssd_scan": lambda r: ((), dict(x=_a(r, 21, 4, 8), dt=jnp.asarray(r.uniform(-3, 1, (21, 4)), F32),
                                    A=jnp.asarray(-np.exp(r.uniform(-1, 1.5, 4)), F32), B=_a(r, 21, 2, 8),
                                    C=_a(r, 21, 2, 8), chunk_size=8, D=_a(r, 4),
                                    dt_bias=jnp.asarray(r.uniform(-1, 1, 4), F32), initial_states=_a(r, 2, 4, 8, 8),
                                    cu_seqlens=_cu([13, 6]), return_chunk_states=True)),
    "state_update": lambda r: (lambda a, kw: ((_a(r, 9, 4, 8, 8), jnp.asarray([4, 8, 1], jnp.int32)), {**a, **kw}))(
        *_ssm(r, (3,))),
    "state_update_multi": lambda r: (lambda a, kw: ((_a(r, 9, 4, 8, 8), jnp.asarray([7, 0], jnp.int32)),
                                                    {**a, **kw}))(*_ssm(r, (2, 3))),
    "state_update_xbc": lambda r: (lambda a, kw: ((_a(r, 9, 4, 8, 8), jnp.asarray([4, 1], jnp.int32), _packed(a),
                                                   a["dt"], a["A"]), kw))(*_ssm(r, (2,))),
    "state_update_multi_xbc": lambda r: (lambda a, kw: ((_a(r, 9, 4, 8, 8), jnp.asarray([4, 1], jnp.int32),
                                                         _packed(a), a["dt"], a["A"]), kw))(*_ssm(r, (2, 3))),
    "decode_attention": lambda r: ((_a(r, 3, 2, 2, 8), _a(r, 2, 4, 10, 2, 8), _a(r, 2, 4, 10, 2, 8),
                                    jnp.asarray([2, 0, 3], jnp.int32), jnp.asarray([10, 1, 7], jnp.int32)),
                                   dict(layer=1, scale=0.35)),
    "w8a16_gemv": lambda r: ((_a(r, 3, 320), *fp8_block(r, 200, 320)), {}),
    "w8a16_gemm": lambda r: ((_a(r, 5, 320), *fp8_block(r, 200, 320)), {}),
    "w8a16_gemm_pipelined": lambda r: ((_a(r, 5, 320), *fp8_block(r, 200, 320)), dict(out_dtype=F32)),
    "w8a8_gemv": lambda r: ((_a(r, 3, 320), *fp8_block(r, 200, 320)), dict(out_dtype=F32)),
    "fp8_gemm_t": lambda r: ((_a(r, 5, 320), *fp8_rows(r, 200, 320)), dict(out_dtype=F32)),
    "w4a16_gemv": lambda r: ((_a(r, 3, 320), *nvfp4(r, 200, 320)), {}),
    "w4a16_gemm": lambda r: ((_a(r, 5, 320), *nvfp4(r, 200, 320)), {}),
    "w4a16_gemm_t": lambda r: (lambda p, s, g: ((_a(r, 5, 320), p.T, s.T, g), {}))(*nvfp4(r, 200, 320)),
    "w4a16_gemm_t_m128": lambda r: (lambda p, s, g: ((_a(r, 5, 320), p.T, s.T, g), {}))(*nvfp4(r, 200, 320)),
    "w4a4_gemm": lambda r: ((_a(r, 5, 320), *nvfp4(r, 200, 320)), dict(out_dtype=F32)),
    "w8a16_grouped": lambda r: ((_a(r, 27, 160), *fp8_block(r, 96, 160, experts=4),
                                 jnp.asarray([3, 0, 21, 1], jnp.int32)), {}),
    "w4a16_grouped": lambda r: ((_a(r, 25, 160), *nvfp4(r, 96, 160, experts=4),
                                 jnp.asarray([3, 0, 21, 1], jnp.int32)), {}),
}
QUANTIZED = {n for n in CASES if registry._KERNELS[n].grad_wrt == registry.ACTIVATIONS}


def _defined(out):
    """The values of an output the loss reads: Fp8Activations dequantized; an SSD scan's chunk states only at real
    chunks (the kernel leaves the padding rows of the chunk table unwritten)."""
    if type(out) is tuple:                                  # several outputs (add_rmsnorm_fp8: stream, E4M3 rows)
        return tuple(_defined(o) for o in out)
    if hasattr(out, "q"):
        return out.dequantize()
    chunks = getattr(out, "chunk_states", None)
    if chunks is not None:
        return out.y, out.final_states, jnp.where(chunks.valid[:, None, None, None], chunks.states, 0.0)
    return out


def _loss(fn, args, kwargs, weights):
    """sum over the floating outputs of weights * out^2 (float32), as a function of the floating operands."""
    def loss(float_args, float_kwargs):
        out = fn(*{**dict(enumerate(args)), **float_args}.values(), **{**kwargs, **float_kwargs})
        out = _defined(out)
        leaves = [o for o in jax.tree.leaves(out) if jnp.issubdtype(o.dtype, jnp.floating)]
        return sum(jnp.sum(w * o.astype(F32) ** 2) for w, o in zip(weights, leaves))
    return loss


def _floating_operands(args, kwargs):
    """The floating array operands: ({position: array}, {keyword: array})."""
    floating = lambda v: isinstance(v, jax.Array) and jnp.issubdtype(v.dtype, jnp.floating)
    return {i: a for i, a in enumerate(args) if floating(a)}, {k: v for k, v in kwargs.items() if floating(v)}


def _compare(name, fn_kernel, fn_ref, args, kwargs, rng):
    out = jax.eval_shape(lambda: _defined(fn_ref(*args, **kwargs)))          # the outputs' shapes only
    weights = [jnp.asarray(rng.standard_normal(o.shape), F32) for o in jax.tree.leaves(out)
               if jnp.issubdtype(o.dtype, jnp.floating)]
    fa, fk = _floating_operands(args, kwargs)
    got = jax.jit(jax.grad(_loss(fn_kernel, args, kwargs, weights), argnums=(0, 1)))(fa, fk)
    want = jax.jit(jax.grad(_loss(fn_ref, args, kwargs, weights), argnums=(0, 1)))(fa, fk)
    flat_got, flat_want = jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)
    assert flat_got, name
    for (path, g), w in zip(flat_got, flat_want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.all(np.isfinite(g)), (name, path)
        which = jax.tree_util.keystr(path)
        if name in QUANTIZED and which not in ("[0][0]", "[1]['x']"):
            assert not np.any(g), (name, which, "a quantized kernel's weights are constants")
        else:
            assert np.any(w), (name, which)                     # the case exercises this operand
            assert rel_err(g, w) <= TOL, (name, which, rel_err(g, w))


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_gradient_equals_reference(rng, name):
    args, kwargs = CASES[name](rng)
    res = registry.resolve(name, "interpret")
    assert res.impl == "interpret" and res.fn is not res.kernel          # the Triton arm, wrapped
    _compare(name, res.fn, registry.get(name, "reference"), args, kwargs, rng)


def test_every_pallas_kernel_has_a_gradient_case():
    """A kernel registered with a Pallas arm has a reference to differentiate and a case above."""
    pallas = {n for n, s in registry._KERNELS.items() if (s.pallas or s.mosaic) and not n.startswith("_test")}
    assert pallas == set(CASES), sorted(pallas ^ set(CASES))
    assert all(registry._KERNELS[n].reference is not None for n in pallas)
    # every GPU arm the registry hands out is the wrapped one
    for n in sorted(pallas):
        for mode in ("triton", "mosaic", "auto"):
            if registry.resolved(n, mode) and registry.resolve(n, mode, platform="gpu").impl != "reference":
                res = registry.resolve(n, mode, platform="gpu")
                assert res.fn is not res.kernel and res.fn.__wrapped__ is res.kernel, (n, mode)


def test_mosaic_arm_gradient(rng):
    """The wrapper is the same for the Mosaic arm: the SSD scan's Mosaic arm in GPU interpret mode."""
    args, kwargs = CASES["ssd_scan"](rng)
    kwargs = {**kwargs, "chunk_size": 16, "return_chunk_states": False}
    kernel = functools.partial(ssd_scan_mosaic, interpret=True)
    _compare("ssd_scan", with_reference_vjp(kernel, ssd_scan_reference), ssd_scan_reference, args, kwargs, rng)


def test_no_gradient_operands_call_the_kernel_directly(rng):
    """Integer-only calls (and calls whose floating operands the kernel does not differentiate) skip the
    custom_vjp: the arm runs exactly as written; a name in grad_wrt the reference lacks is refused."""
    seen = []
    fn = with_reference_vjp(lambda rows, *, interpret=False: seen.append(rows) or rows * 2, lambda rows: rows * 2)
    assert int(fn(jnp.int32(3))) == 6 and len(seen) == 1
    with pytest.raises(ValueError, match="not among its parameters"):
        with_reference_vjp(lambda x: x, lambda x: x, wrt=("w",))


def test_an_arm_without_reference_refuses_gradients_by_name(rng):
    """A Pallas arm registered without a reference runs forward, and jax.grad through it is a typed error naming
    the kernel (not Pallas' bare AssertionError)."""
    name = "_test_grads_no_reference"
    registry.register(name, pallas=lambda x, *, interpret: x * 3.0)
    try:
        fn = registry.get(name, "interpret")
        x = _a(rng, 4)
        np.testing.assert_array_equal(np.asarray(fn(x)), np.asarray(x * 3.0))
        with pytest.raises(KernelUnavailableError, match=f"kernel '{name}' has no jnp reference"):
            jax.grad(lambda v: fn(v).sum())(x)
    finally:
        registry._KERNELS.pop(name)
