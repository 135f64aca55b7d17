"""Elementwise epilogues a projection kernel applies to its float32 result before the output cast.

A decode GEMV that applies the activation of the next op to its complete float32 sum and stores the output dtype
saves the model a separate elementwise kernel (and a float32 round trip through memory). The jnp references apply
the same function to the same float32 values, so an arm with the epilogue in the kernel gives the bits of the
unfused composition `apply(kernel(x, out_dtype=float32), name).astype(out_dtype)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.errors import ShapeError


def relu2(x: jax.Array) -> jax.Array:
    """relu(x)^2: Nemotron-H's MLP activation."""
    r = jnp.maximum(x, 0)
    return r * r


EPILOGUES = {"relu2": relu2}


def check(kernel: str, epilogue: str | None) -> None:
    if epilogue is not None and epilogue not in EPILOGUES:
        raise ShapeError(f"{kernel}: epilogue expected None or one of {sorted(EPILOGUES)}, got {epilogue!r}")


def apply(y: jax.Array, epilogue: str | None) -> jax.Array:
    """y (a complete float32 sum) through the named epilogue, or as it is for None."""
    return y if epilogue is None else EPILOGUES[epilogue](y)
