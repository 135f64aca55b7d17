"""Gradients through the Pallas kernels: every arm the registry hands out runs forward as written and
differentiates as its jnp reference.

Pallas kernels have no JVP rule of their own (`jax.grad` through a `pallas_call` stops at a bare
AssertionError), so `with_reference_vjp(kernel, reference, wrt)` wraps an arm in a `jax.custom_vjp`: the forward
pass is the kernel; the backward pass recomputes the reference on the saved inputs and pulls the cotangent back
through it (`jax.vjp`). Nothing is saved but the inputs, so the wrapper costs no memory beyond them, and a
kernel's gradient is exactly the reference's gradient at the same inputs.

Which operands get a cotangent:
  - array leaves of floating dtype, of the arguments named in `wrt` (None: of every argument);
  - every other array leaf (integer indices, slots, packed codes; and the operands `wrt` leaves out, such as a
    quantized kernel's weights and scales, which are constants) gets a zero cotangent (float0 for integers);
  - everything that is not an array (shapes, flags, dtypes, block configs, None) is static: closed over.
The argument names are the reference's parameter names. A call through the registry is valid for either arm
(the mode picks one), so the backward pass calls the reference with the kernel's own arguments.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.errors import KernelUnavailableError


def with_reference_vjp(kernel: Callable, reference: Callable, wrt: Sequence[str] | None = None) -> Callable:
    """`kernel` with the reference's VJP as its backward pass (see the module doc)."""
    params = list(inspect.signature(reference).parameters)
    wrt = None if wrt is None else frozenset(wrt)
    unknown = set(wrt or ()) - set(params)
    if unknown:
        raise ValueError(f"{getattr(reference, '__name__', reference)}: wrt names {sorted(unknown)}, which are not "
                         f"among its parameters {params}")

    @functools.wraps(kernel)
    def call(*args, **kwargs):
        flat, tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
        paths, leaves = [p for p, _ in flat], [v for _, v in flat]
        dynamic = [i for i, v in enumerate(leaves) if isinstance(v, jax.Array)]
        grads = [i for i in dynamic if _floating(leaves[i]) and (wrt is None or _arg_name(paths[i], params) in wrt)]
        if not grads:
            return kernel(*args, **kwargs)          # nothing to differentiate

        def rebuild(values: Sequence) -> tuple[tuple, dict]:
            """(args, kwargs) with the dynamic leaves replaced by `values` (one per dynamic leaf, in order)."""
            full = list(leaves)
            for i, v in zip(dynamic, values):
                full[i] = v
            return jax.tree_util.tree_unflatten(tree, full)

        @jax.custom_vjp
        def run(*values):
            a, k = rebuild(values)
            return kernel(*a, **k)

        def fwd(*values):
            return run(*values), values

        def bwd(values, ct):
            slots = [dynamic.index(i) for i in grads]

            def through_reference(*diff):
                full = list(values)
                for s, v in zip(slots, diff):
                    full[s] = v
                a, k = rebuild(full)
                return reference(*a, **k)

            out, pull = jax.vjp(through_reference, *(values[s] for s in slots))
            got = dict(zip(slots, pull(_like(ct, out))))
            return tuple(got[s] if s in got else _zero_cotangent(v) for s, v in enumerate(values))

        run.defvjp(fwd, bwd)
        return run(*(leaves[i] for i in dynamic))

    return call


def without_gradient(name: str, kernel: Callable) -> Callable:
    """`kernel` (an arm with no reference) made to fail with a typed error naming it when differentiated, instead of
    Pallas' bare AssertionError."""
    @functools.wraps(kernel)
    def call(*args, **kwargs):
        flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = [i for i, v in enumerate(flat) if isinstance(v, jax.Array)]
        if not dynamic:
            return kernel(*args, **kwargs)

        @jax.custom_vjp
        def run(*values):
            full = list(flat)
            for i, v in zip(dynamic, values):
                full[i] = v
            a, k = jax.tree_util.tree_unflatten(tree, full)
            return kernel(*a, **k)

        def refuse(*_):
            raise KernelUnavailableError(f"kernel {name!r} has no jnp reference, so its Pallas arm has no gradient; "
                                         f"differentiate with kernels='reference' or register a reference")

        run.defvjp(lambda *values: (run(*values), None), refuse)
        return run(*(flat[i] for i in dynamic))

    return call


def _arg_name(path, params: list[str]) -> str | None:
    """The argument a leaf belongs to: path[0] is 0 (positional, path[1] its index) or 1 (keyword, its key)."""
    where, key = path[0].idx, path[1]
    if where == 0:
        return params[key.idx] if key.idx < len(params) else None
    return key.key


def _floating(v) -> bool:
    return jnp.issubdtype(v.dtype, jnp.floating)


def _zero_cotangent(v):
    """The cotangent of an operand that gets none: float0 zeros for integer / boolean arrays, else zeros."""
    if _floating(v) or jnp.issubdtype(v.dtype, jnp.complexfloating):
        return jnp.zeros_like(v)
    return np.zeros(v.shape, jax.dtypes.float0)


def _like(ct, out):
    """The kernel output's cotangent in the dtypes of the reference's output (they may round differently);
    float0 cotangents of integer outputs pass as they are."""
    def cast(c, o):
        if not _floating(o) or getattr(c, "dtype", None) == jax.dtypes.float0:
            return np.zeros(o.shape, jax.dtypes.float0) if not _floating(o) else c
        return c.astype(o.dtype)

    return jax.tree.map(cast, ct, out)
