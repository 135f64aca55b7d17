import jax, jax.numpy as jnp
from pallas_kernels import mgpu_gemv as mg
from pallas_kernels.mgpu_gemv import GemvConfig
N, K = 18560, 4096
x = jnp.ones((1, K), jnp.bfloat16)
p = jnp.zeros((N, K // 2), jnp.uint8)
s = jnp.ones((N, K // 16), jnp.float8_e4m3fn)
cfg = GemvConfig(64, 3, 1, widen="perm", load="gmem", prefetch=2)
jax.block_until_ready(mg.w4a16_gemv_mosaic(x, p, s, jnp.float32(1.0), config=cfg))
print("done")
