"""The Pallas SSD scan against the jnp chunked reference (and once against the float64 recurrence)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import ShapeError
from pallas_kernels import registry, ssd
from pallas_kernels.ssd import SsdBlocks, ssd_scan_pallas
from tests.kernels.ssd_checks import (call_ssd as _call, check_offsets_past_4gib, compare_ssd as _compare,
                                      cu_seqlens as _cu, ssd_inputs)
from tests.numpy_refs import rel_err, ssm_recurrence

reference = jax.jit(ssd.ssd_scan_reference, static_argnames=(
    "chunk_size", "dt_softplus", "dt_limit", "return_chunk_states", "precision"))


def _inputs(rng, T, S, H=4, P=8, G=2, N=16, dtype=np.float32):
    return ssd_inputs(rng, T, S, H, P, G, N, dtype)


@pytest.mark.parametrize("chunk,blocks,P", [
    (16, None, 8),                                                  # P padded to a 16-wide block; one segment
    (24, SsdBlocks(block_p=16, segment_tokens=48, cb_precomputed=False), 32),  # chunk not a power of 2; 2 P-blocks
    (48, SsdBlocks(block_q=16, block_p=16, segment_tokens=32), 16),  # 3 steps a chunk; segments cut chunks
    (32, SsdBlocks(block_q=16, segment_tokens=48, cb_precomputed=True, fast_exp=True), 16),  # C B^T launch
])
def test_varlen_matches_reference(rng, interpret, chunk, blocks, P):
    lens = [5, 0, 70, 33, 1]
    T = sum(lens) + 3                                               # trailing pad rows must come out zero
    inp = _inputs(rng, T, len(lens), P=P)
    kw = dict(chunk_size=chunk, cu_seqlens=_cu(lens), return_chunk_states=True)
    out = _call(functools.partial(ssd_scan_pallas, interpret=interpret, blocks=blocks), inp, **kw)
    _compare(out, _call(reference, inp, **kw), 1e-4, chunks=True)
    assert np.all(np.asarray(out.y)[sum(lens):] == 0)


def test_single_sequence_matches_float64_recurrence(rng, interpret):
    T = 77
    inp = _inputs(rng, T, 1, N=12)                                  # N padded to a 16-wide block
    out = _call(functools.partial(ssd_scan_pallas, interpret=interpret), inp, chunk_size=32)
    i = {k: np.asarray(v) for k, v in inp.items()}
    y, h = ssm_recurrence(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"], h0=i["initial_states"][0])
    assert rel_err(out.y, y) <= 1e-5 and rel_err(out.final_states[0], h) <= 1e-5


def test_optional_arguments_and_dt_limit(rng, interpret):
    """No D, no dt_bias, no initial state, no softplus, a dt clamp: each flag path of the kernel."""
    T = 40
    inp = _inputs(rng, T, 1)
    for k in ("D", "dt_bias", "initial_states"):
        inp.pop(k)
    inp["dt"] = jnp.abs(inp["dt"])
    kw = dict(chunk_size=16, dt_softplus=False, dt_limit=(0.05, 0.5))
    out = _call(functools.partial(ssd_scan_pallas, interpret=interpret), inp, **kw)
    _compare(out, _call(reference, inp, **kw), 1e-4)


def test_bf16_inputs(rng, interpret):
    lens = [50, 19]
    inp = _inputs(rng, sum(lens), 2, H=4, P=16, G=1, N=32, dtype=jnp.bfloat16)
    kw = dict(chunk_size=16, cu_seqlens=_cu(lens))
    out = _call(functools.partial(ssd_scan_pallas, interpret=interpret), inp, **kw)
    assert out.y.dtype == jnp.bfloat16
    _compare(out, _call(reference, inp, **kw), 1e-2)


def test_registered_and_resolves():
    assert registry.resolve("ssd_scan", "interpret").impl == "interpret"
    assert registry.resolve("ssd_scan", "auto", platform="gpu").impl == "mosaic"     # gpu_default (ssd_mgpu)
    assert registry.resolve("ssd_scan", "triton", platform="gpu").impl == "pallas"
    assert registry.resolve("ssd_scan", "auto", platform="cpu").impl == "reference"


def test_bad_shapes_raise(rng, interpret):
    inp = _inputs(rng, 10, 1)
    fn = functools.partial(ssd_scan_pallas, interpret=interpret, chunk_size=16)
    with pytest.raises(ShapeError, match="dt"):
        _call(fn, {**inp, "dt": inp["dt"][:5]})
    with pytest.raises(ShapeError, match="C"):
        _call(fn, {**inp, "C": inp["C"][:, :1]})
    with pytest.raises(ShapeError, match="initial_states"):
        _call(fn, {**inp, "initial_states": inp["initial_states"][:, :2]})
    three = _inputs(rng, 10, 1, H=4, G=3)
    with pytest.raises(ShapeError, match="3 groups.*4 heads"):
        _call(fn, three)


# ---- GPU: the model's shapes, and offsets past 2**31 elements ------------------------------------------------
NEMOTRON = dict(H=128, P=64, G=8, N=128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol,blocks", [
    (jnp.bfloat16, 1e-2, None), (jnp.float32, 1e-4, None),
    (jnp.bfloat16, 1e-2, SsdBlocks(segment_tokens=256, cb_precomputed=False, fast_exp=False)),
    (jnp.bfloat16, 1e-2, SsdBlocks(block_q=128, segment_tokens=0)),
])
def test_nemotron_shapes_ragged(rng, dtype, tol, blocks):
    lens = [700, 1, 129, 0, 300]
    inp = _inputs(rng, sum(lens) + 5, len(lens), dtype=dtype, **NEMOTRON)
    kw = dict(chunk_size=128, cu_seqlens=_cu(lens), return_chunk_states=True)
    _compare(_call(functools.partial(ssd_scan_pallas, blocks=blocks), inp, **kw), _call(reference, inp, **kw), tol,
             chunks=True)


@pytest.mark.gpu
def test_offsets_past_4gib(rng):
    """x and y over 4 GiB: the second sequence lies past element 2**31 and must match its own scan."""
    check_offsets_past_4gib(rng, ssd_scan_pallas, reference, NEMOTRON, 1e-2)
