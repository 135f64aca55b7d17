"""The Mosaic GPU SSD scan (GPU interpret mode on the CPU) against the jnp reference and the float64 recurrence.

Interpret mode takes only SMEM left operands for wgmma, so the CPU runs the `a_regs=False` form; the GPU tests
run both forms at the model's shapes. Outputs start as NaN in interpret mode (uninitialized_memory="nan"), so an
unwritten row fails the finite checks.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from metrale_jax.errors import ShapeError
from pallas_kernels import registry, ssd, ssd_mgpu
from pallas_kernels.ssd_mgpu import ssd_scan_mosaic
from tests.kernels.ssd_checks import (call_ssd as _call, check_offsets_past_4gib, compare_ssd as _compare,
                                      cu_seqlens as _cu, ssd_inputs)
from tests.kernels.mosaic_smem import check_lowered
from tests.numpy_refs import rel_err, ssm_recurrence

reference = jax.jit(ssd.ssd_scan_reference, static_argnames=(
    "chunk_size", "dt_softplus", "dt_limit", "return_chunk_states", "precision"))
BF16_TOL = 1e-2


@pytest.fixture
def interp():
    """GPU interpret mode; its global state is reset if a kernel raised."""
    try:
        yield plgpu.InterpretGPUParams(detect_races=True)
    finally:
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, interpret_pallas_call
        races = gpu_callbacks._races
        interpret_pallas_call.reset_gpu_interpret_mode_state()
        assert races is None or not races.races_found, "interpret mode found a data race"


def _inputs(rng, T, S, H=2, P=64, G=1, N=64, dtype=jnp.bfloat16):
    return ssd_inputs(rng, T, S, H, P, G, N, dtype)


@pytest.mark.parametrize("lens,chunk,H,G,P,N", [
    ([70, 0, 130, 1, 64], 128, 2, 1, 64, 64),       # ragged last steps, an empty and a 1-token sequence
    ([150, 29], 64, 4, 2, 128, 128),                # two P-blocks, two groups, N=128, chunk = one step
])
def test_varlen_matches_reference(rng, interp, lens, chunk, H, G, P, N):
    T = sum(lens) + 67                              # trailing pad rows must come out zero
    inp = _inputs(rng, T, len(lens), H=H, P=P, G=G, N=N)
    kw = dict(chunk_size=chunk, cu_seqlens=_cu(lens), return_chunk_states=True)
    out = _call(functools.partial(ssd_scan_mosaic, interpret=interp), inp, **kw)
    _compare(out, _call(reference, inp, **kw), BF16_TOL, chunks=True)
    assert np.all(np.asarray(out.y, np.float32)[sum(lens):] == 0)


def test_single_sequence_matches_float64_recurrence(rng, interp):
    T = 150
    inp = _inputs(rng, T, 1, dtype=jnp.float16)
    out = _call(functools.partial(ssd_scan_mosaic, interpret=interp), inp, chunk_size=64)
    assert out.y.dtype == jnp.float16
    i = {k: np.asarray(v, np.float64) for k, v in inp.items()}
    y, h = ssm_recurrence(i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["dt_bias"], h0=i["initial_states"][0])
    assert rel_err(out.y, y) <= BF16_TOL and rel_err(out.final_states[0], h) <= BF16_TOL


def test_optional_arguments_and_dt_limit(rng, interp):
    """No D, no dt_bias, no initial state, no softplus, a dt clamp: each flag path of the kernel."""
    inp = _inputs(rng, 100, 1)
    for k in ("D", "dt_bias", "initial_states"):
        inp.pop(k)
    inp["dt"] = jnp.abs(inp["dt"])
    kw = dict(chunk_size=64, dt_softplus=False, dt_limit=(0.05, 0.5))
    _compare(_call(functools.partial(ssd_scan_mosaic, interpret=interp), inp, **kw), _call(reference, inp, **kw),
             BF16_TOL)


def test_uncovered_calls_run_the_triton_arm(rng):
    """f32 inputs and a chunk that is not a multiple of 64 go to the Triton arm, with its f32 accuracy."""
    assert not ssd_mgpu.mosaic_supports(jnp.float32, jnp.float32, jnp.float32, 64, 64, 64)
    assert not ssd_mgpu.mosaic_supports(jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, 64, 64, 48)
    assert not ssd_mgpu.mosaic_supports(jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, 32, 64, 64)
    lens = [20, 13]
    inp = _inputs(rng, sum(lens), 2, P=16, N=16, dtype=jnp.float32)
    kw = dict(chunk_size=16, cu_seqlens=_cu(lens))
    _compare(_call(functools.partial(ssd_scan_mosaic, interpret=True), inp, **kw), _call(reference, inp, **kw), 1e-4)


def test_step_table_tiles_each_sequence(rng):
    """Steps cover every token of every sequence once, in order, within one chunk and one 8-aligned 64-row box."""
    lens = [int(v) for v in rng.integers(0, 300, 6)] + [0, 1, 128]
    T, chunk = sum(lens) + 5, 128
    cu = np.concatenate([[0], np.cumsum(lens)])
    lo, hi, step_cu = (np.asarray(a) for a in ssd_mgpu.step_table(T, jnp.asarray(cu, jnp.int32), chunk)[:3])
    for s in range(len(lens)):
        a, b = lo[step_cu[s]:step_cu[s + 1]], hi[step_cu[s]:step_cu[s + 1]]
        covered = np.concatenate([np.arange(u, v) for u, v in zip(a, b)]) if len(a) else np.zeros(0)
        np.testing.assert_array_equal(covered, np.arange(cu[s], cu[s + 1]))
        assert np.all(b - (a - a % 8) <= 64) and np.all(b > a)
        assert np.all((a - cu[s]) // chunk == (b - 1 - cu[s]) // chunk)          # no step crosses a chunk end
        if cu[s] % 8 == 0:
            assert np.all(b - a == np.minimum(64, cu[s + 1] - a))               # aligned: plain 64-token steps


@pytest.mark.parametrize("a_regs", [True, False])
def test_lowers_to_mosaic_gpu(a_regs):
    """Lower the kernel for CUDA on the CPU (Pallas -> Mosaic GPU, layout inference included): the compile errors
    interpret mode cannot see (e.g. an SMEM ref loaded in two layouts, TMA rows not provably 8-aligned)."""
    T, H, P, G, N, S = 643, 16, 64, 2, 128, 3      # T not a multiple of 8
    sd = jax.ShapeDtypeStruct
    args = (sd((T, H, P), jnp.bfloat16), sd((T, H), jnp.bfloat16), sd((H,), jnp.float32), sd((T, G, N), jnp.bfloat16),
            sd((T, G, N), jnp.bfloat16))
    kw = dict(D=sd((H,), jnp.float32), dt_bias=sd((H,), jnp.float32), initial_states=sd((S, H, P, N), jnp.float32),
              cu_seqlens=sd((S + 1,), jnp.int32))
    fn = jax.jit(functools.partial(ssd_scan_mosaic, chunk_size=128, return_chunk_states=True, a_regs=a_regs))
    lowered = fn.trace(*args, **kw).lower(lowering_platforms=("cuda",))
    assert "ssd_scan_mgpu" in lowered.as_text()
    check_lowered(lowered)


def test_registered_and_resolves():
    assert registry.resolve("ssd_scan", "mosaic", platform="gpu").impl == "mosaic"
    assert registry.resolve("ssd_scan", "auto", platform="gpu").impl == "mosaic"      # the GPU default
    assert registry.resolve("ssd_scan", "auto", platform="cpu").impl == "reference"
    assert registry.resolve("ssd_scan", "triton", platform="gpu").impl == "pallas"
    assert registry.resolve("ssd_scan", "mosaic", platform="gpu").kernel.func is ssd_scan_mosaic


def test_bad_shapes_raise(rng):
    inp = _inputs(rng, 10, 1)
    fn = functools.partial(ssd_scan_mosaic, interpret=True, chunk_size=64)
    with pytest.raises(ShapeError, match="dt"):
        _call(fn, {**inp, "dt": inp["dt"][:5]})
    with pytest.raises(ShapeError, match="C"):
        _call(fn, {**inp, "C": inp["C"][:, :, :32]})
    with pytest.raises(ShapeError, match="initial_states"):
        _call(fn, {**inp, "initial_states": inp["initial_states"][:, :1]})


# ---- GPU: the model's shapes (both operand forms), and offsets past 2**31 elements ------------------------------
NEMOTRON = dict(H=128, P=64, G=8, N=128)


@pytest.mark.gpu
@pytest.mark.parametrize("a_regs", [True, False])
@pytest.mark.parametrize("chunk", [128, 256])
def test_nemotron_shapes_ragged(rng, a_regs, chunk):
    lens = [700, 1, 129, 0, 300, 64]
    inp = _inputs(rng, sum(lens) + 5, len(lens), **NEMOTRON)
    kw = dict(chunk_size=chunk, cu_seqlens=_cu(lens), return_chunk_states=True)
    out = _call(functools.partial(ssd_scan_mosaic, a_regs=a_regs), inp, **kw)
    _compare(out, _call(reference, inp, **kw), BF16_TOL, chunks=True)
    assert np.all(np.asarray(out.y, np.float32)[sum(lens):] == 0)


@pytest.mark.gpu
def test_nemotron_no_options(rng):
    inp = _inputs(rng, 1000, 1, **NEMOTRON)
    for k in ("D", "dt_bias", "initial_states"):
        inp.pop(k)
    _compare(_call(ssd_scan_mosaic, inp, chunk_size=128), _call(reference, inp, chunk_size=128), BF16_TOL)


@pytest.mark.gpu
def test_offsets_past_4gib(rng):
    """x and y over 4 GiB: the second sequence lies past element 2**31 and must match its own scan."""
    check_offsets_past_4gib(rng, ssd_scan_mosaic, reference, NEMOTRON, BF16_TOL)
