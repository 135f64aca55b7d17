"""Hostile configuration arguments to the public kernel wrappers (ssd, state_update, conv1d): a ShapeError naming the
kernel and the field, raised where the value is given. Without these checks a zero block size or chunk_size was a
ZeroDivisionError inside the launch, a negative one a broadcast error or a silently wrong grid, a float chunk_size a
fori_loop type error, and a row past the pool was read and written out of bounds by the kernels (clamped by the
references' gather, dropped by their scatter)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import conv1d, ssd, state_update as su
from pallas_kernels.errors import ShapeError

T, H, P, G, N = 8, 2, 16, 1, 16
_r = np.random.default_rng(0)
_f = lambda *s: jnp.asarray(_r.standard_normal(s), jnp.float32)
X, DT, A, B, C = _f(T, H, P), _f(T, H), -jnp.ones(H), _f(T, G, N), _f(T, G, N)
STATE, XS, DTS, BS, CS = _f(6, H, P, N), _f(2, H, P), _f(2, H), _f(2, G, N), _f(2, G, N)
POOL, W, XC = _f(6, 64, 3), _f(64, 4), _f(2, 64)


@pytest.mark.parametrize("chunk_size", [0, -4, 2.5, True, "8"])
@pytest.mark.parametrize("scan", ["reference", "pallas"])
def test_ssd_chunk_size_must_be_a_positive_int(scan, chunk_size, interpret):
    kw = dict(interpret=interpret) if scan == "pallas" else {}
    with pytest.raises(ShapeError, match=r"ssd: chunk_size expected an int >= 1"):
        getattr(ssd, f"ssd_scan_{scan}")(X, DT, A, B, C, chunk_size=chunk_size, **kw)


@pytest.mark.parametrize("make, message", [
    (lambda: ssd.SsdBlocks(block_q=0), r"ssd: blocks\.block_q expected an int >= 1, got 0"),
    (lambda: ssd.SsdBlocks(block_q=-1), r"blocks\.block_q"),
    (lambda: ssd.SsdBlocks(block_p=8), r"ssd: blocks\.block_p expected a power of two >= 16, got 8"),
    (lambda: ssd.SsdBlocks(block_p=48), r"blocks\.block_p expected a power of two"),
    (lambda: ssd.SsdBlocks(segment_tokens=-5), r"blocks\.segment_tokens expected an int >= 0"),
    (lambda: su.UpdateBlocks(block_p=0), r"state_update: blocks\.block_p expected a power of two >= 1, got 0"),
    (lambda: su.UpdateBlocks(block_p=3), r"blocks\.block_p"),
    (lambda: su.UpdateBlocks(num_warps=-2), r"blocks\.num_warps"),
    (lambda: conv1d.ConvBlocks(block_t=0), r"causal_conv1d: blocks\.block_t expected a power of two >= 1, got 0"),
    (lambda: conv1d.ConvBlocks(block_c=-1), r"blocks\.block_c"),
    (lambda: conv1d.ConvBlocks(block_t=2.0), r"blocks\.block_t"),
])
def test_block_configs_are_checked_when_built(make, message):
    with pytest.raises(ShapeError, match=message):
        make()


def test_good_block_configs_still_build():
    assert ssd.SsdBlocks(block_q=3, block_p=16, segment_tokens=0).block_q == 3
    assert su.UpdateBlocks(block_p=4, num_warps=2).block_p == 4
    assert conv1d.ConvBlocks(block_t=8, block_c=16).block_c == 16


@pytest.mark.parametrize("rows, offset, bad", [([0, 6], 0, 6), ([0, -1], 0, -1), ([0, 3], 3, 6)])
def test_decode_kernel_rows_past_the_pool_are_refused(rows, offset, bad, interpret):
    """Known rows (an eager call) plus row_offset must be pool rows, in the references and the kernels alike."""
    rows = jnp.asarray(rows, jnp.int32)
    calls = [lambda: su.state_update_reference(STATE, rows, XS, DTS, A, BS, CS, row_offset=offset),
             lambda: su.state_update_pallas(STATE, rows, XS, DTS, A, BS, CS, row_offset=offset, interpret=interpret),
             lambda: conv1d.causal_conv1d_update_reference(POOL, rows, XC, W, row_offset=offset),
             lambda: conv1d.causal_conv1d_update_pallas(POOL, rows, XC, W, row_offset=offset, interpret=interpret)]
    for call in calls:
        with pytest.raises(ShapeError, match=rf"rows expected pool rows in \[0, 6\) after row_offset {offset}, "
                                             rf"got row {bad}"):
            call()


def test_state_update_rows_of_a_float_dtype_are_a_shape_error(interpret):
    with pytest.raises(ShapeError, match="state_update: rows expected an integer dtype, got float32"):
        su.state_update_pallas(STATE, jnp.array([0.0, 1.0]), XS, DTS, A, BS, CS, interpret=interpret)
