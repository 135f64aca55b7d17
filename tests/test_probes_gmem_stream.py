"""benchmarks/probes/gmem_stream_probe.py: the direct-load stream kernel reads every byte once (GPU interpret mode
on the CPU)."""

import jax.numpy as jnp
import pytest

from benchmarks.probes.gmem_stream_probe import stream_xor, stream_xor_reference


@pytest.fixture(autouse=True)
def _reset_interpreter():
    yield
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    ipc.reset_gpu_interpret_mode_state()


@pytest.mark.parametrize("rows,step,unroll,split", [(64, 256, 2, 1), (128, 256, 1, 2)])
def test_stream_xor_matches_the_reference(rng, rows, step, unroll, split):
    w = jnp.asarray(rng.integers(0, 256, (128, 1024)), jnp.uint8)
    got = stream_xor(w, rows=rows, step=step, unroll=unroll, split=split, interpret=True)
    assert got.shape == (128 // rows, split, rows, step)
    assert jnp.array_equal(got, stream_xor_reference(w, rows, step, split))
    w2 = w.at[5, 700].set(w[5, 700] ^ 1)                       # one flipped bit shows in its block and split
    got2 = stream_xor(w2, rows=rows, step=step, unroll=unroll, split=split, interpret=True)
    at = (0, 700 * split // 1024, 5, 700 % step)                # row block 0, its K split, row 5, column in the step
    assert jnp.sum(got2 != got) == 1 and got2[at] != got[at]
