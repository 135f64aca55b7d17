"""Quick H200 check of the warp-specialized W8A16 GEMV (session 5, one short call): correctness against the
reference and M = 1 vs 16 bit-identity at the 8B in_proj / out_proj shapes, then wall-clock time per call
(8 queued calls over 4 weight copies, so no weight sits in L2) of the default config and the WS configs.
    PYTHONPATH=. python3 tools/ws_gemv_quick.py > $OUT/ws.txt"""
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from pallas_kernels import mgpu_gemv as mg, w8a16
from pallas_kernels.mgpu_gemv import GemvConfig

for name, (N, K), cfgs in [("in_proj", (18560, 4096), [(128, 4, 1), (128, 4, 2), (128, 6, 2), (128, 8, 4)]),
                           ("out_proj", (4096, 8192), [(128, 4, 4), (128, 6, 8)])]:
    kw, kx = jax.random.split(jax.random.key(0))
    ws = []
    for i in range(4):
        w = jax.random.normal(jax.random.fold_in(kw, i), (N, K), jnp.float32)
        b = w.reshape(N // 128, 128, K // 128, 128)
        s = jnp.maximum(jnp.max(jnp.abs(b), axis=(1, 3)), 1e-6) / 448.0
        q = (b / s[:, None, :, None]).reshape(N, K).astype(jnp.float8_e4m3fn)
        ws.append((q, s))
    xs = [jax.random.normal(jax.random.fold_in(kx, i), (16, K), jnp.bfloat16) for i in range(8)]
    ref = w8a16.w8a16_reference(xs[0], *ws[0], out_dtype=jnp.float32)
    for c in [None] + [GemvConfig(*c, warp_specialized=True) for c in cfgs]:
        try:
            y = mg.w8a16_gemv_mosaic(xs[0], *ws[0], out_dtype=jnp.float32, config=c)
            err = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
            y1 = mg.w8a16_gemv_mosaic(xs[0][:1], *ws[0], out_dtype=jnp.float32, config=c)
            same = bool(np.array_equal(np.asarray(y1[0]), np.asarray(y[0])))
            out = {}
            for m in (1, 16):
                f = lambda x, q, s, c=c: mg.w8a16_gemv_mosaic(x, q, s, config=c)
                out[m] = min(timing.queued_wall_us(f, [(xs[i][:m], *ws[i % 4]) for i in range(8)], reps=20))
            print(f"{name} {c} err {err:.2e} M1==M16row {same} us M=1 {out[1]:.1f} M=16 {out[16]:.1f}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name} {c} FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
