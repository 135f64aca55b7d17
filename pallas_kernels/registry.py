"""Kernel registry: one name, a jnp reference and (optionally) a Pallas kernel; resolved per backend.

A name may carry two Pallas arms: the Triton one (`pallas`, portable) and a Mosaic GPU one (`mosaic`,
Hopper wgmma/TMA). `gpu_default` says which one `auto` and `pallas` pick on the GPU; the benchmark decides.
A Mosaic arm that takes only some shapes registers `mosaic_supports(*args, **kwargs) -> bool`: as the
default it then serves the calls it supports and hands the others to the Triton arm (decided at trace
time, from static shapes); mode `mosaic` calls it unconditionally (it raises on what it cannot take).
The Mosaic arms use Hopper instructions (wgmma, TMA): on a GPU of another compute capability the default falls
back to the Triton arm, and mode `mosaic` does not resolve.

Modes (ModelLevers.kernels / METRALE_KERNELS):
  auto       GPU: the default Pallas arm where one is registered, else the reference. CPU: the reference.
  pallas     the default Pallas arm only; a name without one does not resolve.
  triton     the Triton arm only.
  mosaic     the Mosaic GPU arm only.
  interpret  the Triton arm in interpret mode (CPU tests), else the reference.
  reference  the jnp reference.

Every Pallas arm `resolve` returns is differentiable: its backward pass is the reference's VJP, recomputed
(autodiff.with_reference_vjp). `grad_wrt` names the arguments that get a cotangent (None: every floating
operand); the quantized kernels name their activations only, so their weights and scales are constants.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import warnings
from collections.abc import Callable, Iterator

import jax

from pallas_kernels.autodiff import with_reference_vjp, without_gradient
from pallas_kernels.errors import KernelUnavailableError

MODES = ("auto", "pallas", "triton", "mosaic", "interpret", "reference")
# JAX releases the Pallas arms are tested on: Pallas' Triton and Mosaic GPU APIs change between releases, so on
# another JAX `auto` resolves to the references (with one warning); an explicit mode still takes the kernels.
TESTED_JAX = ("0.11.",)
MOSAIC_CAPABILITIES = ("9.0",)   # compute capabilities the Mosaic GPU arms are written for (Hopper)
GPU_ARMS = ("triton", "mosaic")
# grad_wrt of the quantized kernels: gradients flow to the activations; the weights and scales are constants
ACTIVATIONS = ("x",)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str
    reference: Callable | None
    pallas: Callable | None = None      # Triton arm; takes interpret: bool as a keyword
    platforms: tuple[str, ...] = ("gpu",)  # where the compiled Pallas kernels run
    mosaic: Callable | None = None      # Mosaic GPU arm; takes interpret: bool as a keyword
    gpu_default: str = "triton"         # the arm `auto` / `pallas` pick: "triton" or "mosaic"
    mosaic_supports: Callable[..., bool] | None = None   # the calls the Mosaic arm takes (None: all)
    grad_wrt: tuple[str, ...] | None = None   # the reference's arguments that get cotangents (None: all floating)

    def arm(self, which: str) -> Callable | None:
        return self.mosaic if which == "mosaic" else self.pallas


@dataclasses.dataclass(frozen=True)
class Resolution:
    """What a name resolved to: impl is 'pallas' (Triton), 'mosaic', 'interpret' or 'reference'. `fn` is what
    callers call (a Pallas arm wrapped for gradients); `kernel` the arm itself, unwrapped."""

    name: str
    impl: str
    fn: Callable
    kernel: Callable | None = None


_KERNELS: dict[str, KernelSpec] = {}
_DISABLED: set[str] = set()


def register(name: str, *, reference: Callable | None = None, pallas: Callable | None = None,
             mosaic: Callable | None = None, gpu_default: str | None = None,
             mosaic_supports: Callable[..., bool] | None = None, platforms: tuple[str, ...] = ("gpu",),
             grad_wrt: tuple[str, ...] | None = None) -> None:
    """Add or extend a kernel entry (reference, Triton and Mosaic arms may register separately).
    grad_wrt: the reference's arguments that get cotangents (None: every floating operand)."""
    old = _KERNELS.get(name)
    if old is not None:
        reference = reference or old.reference
        pallas = pallas or old.pallas
        mosaic = mosaic or old.mosaic
        gpu_default = gpu_default or old.gpu_default
        mosaic_supports = mosaic_supports or old.mosaic_supports
        grad_wrt = grad_wrt or old.grad_wrt
    gpu_default = gpu_default or "triton"
    if grad_wrt is not None and (isinstance(grad_wrt, (str, bytes)) or not all(isinstance(a, str) for a in grad_wrt)):
        # a string would be taken letter by letter: "weight" -> ("w", "e", ...), none of them an argument
        raise KernelUnavailableError(f"kernel {name!r}: grad_wrt must be a sequence of argument names, "
                                     f"got {grad_wrt!r:.60}")
    if gpu_default not in GPU_ARMS:
        raise KernelUnavailableError(f"kernel {name!r}: gpu_default must be one of {GPU_ARMS}, got {gpu_default!r}")
    _KERNELS[name] = KernelSpec(name, reference, pallas, platforms, mosaic, gpu_default, mosaic_supports,
                                tuple(grad_wrt) if grad_wrt is not None else None)


def _mosaic_or_triton(spec: KernelSpec) -> Callable:
    """The default Mosaic arm, handing the calls it does not support to the Triton arm."""
    mosaic, triton = (functools.partial(f, interpret=False) for f in (spec.mosaic, spec.pallas))

    @functools.wraps(spec.mosaic)
    def call(*args, **kwargs):
        return (mosaic if spec.mosaic_supports(*args, **kwargs) else triton)(*args, **kwargs)

    return call


def names() -> list[str]:
    return sorted(_KERNELS)


def default_mode() -> str:
    mode = os.environ.get("METRALE_KERNELS", "auto").strip().lower()
    if mode not in MODES:
        raise KernelUnavailableError(f"METRALE_KERNELS: expected one of {MODES}, got {mode!r}")
    return mode


def resolve(name: str, mode: str | None = None, platform: str | None = None) -> Resolution:
    """Resolve `name` for `mode` on `platform` (default: jax's default backend); raise if nothing fits."""
    _load_all()
    mode = mode or default_mode()
    if mode not in MODES:
        raise KernelUnavailableError(f"kernel mode must be one of {MODES}, got {mode!r}")
    if mode == "auto" and not jax.__version__.startswith(TESTED_JAX):
        _warn_untested_jax()
        mode = "reference"
    platform = platform or jax.default_backend()
    spec = _KERNELS.get(name)
    if spec is None:
        raise KernelUnavailableError(f"no kernel named {name!r} is registered (known: {names()})")
    if name in _DISABLED:
        raise KernelUnavailableError(f"kernel {name!r} is disabled on this backend")
    on_gpu = platform in spec.platforms
    triton_ok = on_gpu and spec.pallas is not None
    mosaic_ok = on_gpu and spec.mosaic is not None and gpu_capability() in MOSAIC_CAPABILITIES
    if mode == "interpret" and spec.pallas is not None:
        return _arm(spec, "interpret", functools.partial(spec.pallas, interpret=True))
    if mode == "triton" and not triton_ok:
        raise KernelUnavailableError(f"kernel {name!r} has no triton implementation for platform {platform!r}")
    if mode == "mosaic" and not mosaic_ok:
        why = (f"needs compute capability {' or '.join(MOSAIC_CAPABILITIES)} (Hopper), this GPU has "
               f"{gpu_capability()}" if on_gpu and spec.mosaic is not None else f"has none for platform {platform!r}")
        raise KernelUnavailableError(f"kernel {name!r}: no mosaic implementation here: the Mosaic GPU arm {why}")
    use_mosaic = mode == "mosaic" or (mode in ("auto", "pallas") and mosaic_ok
                                      and (spec.gpu_default == "mosaic" or not triton_ok))
    if use_mosaic:
        if mode != "mosaic" and spec.mosaic_supports is not None and triton_ok:
            return _arm(spec, "mosaic", _mosaic_or_triton(spec))
        return _arm(spec, "mosaic", functools.partial(spec.mosaic, interpret=False))
    if mode in ("auto", "pallas", "triton") and triton_ok:
        return _arm(spec, "pallas", functools.partial(spec.pallas, interpret=False))
    if mode == "pallas":
        raise KernelUnavailableError(
            f"kernel {name!r} has no Pallas implementation for platform {platform!r} (mode 'pallas')")
    if spec.reference is None:
        raise KernelUnavailableError(f"kernel {name!r} has no reference and no Pallas kernel for {platform!r}")
    return Resolution(name, "reference", spec.reference, spec.reference)


def _arm(spec: KernelSpec, impl: str, kernel: Callable) -> Resolution:
    """A Pallas arm's resolution: called through the reference's VJP for gradients (a name without a reference has
    none: differentiating it is a KernelUnavailableError naming it)."""
    fn = (without_gradient(spec.name, kernel) if spec.reference is None else
          with_reference_vjp(kernel, spec.reference, spec.grad_wrt))
    return Resolution(spec.name, impl, fn, kernel)


@functools.cache
def _warn_untested_jax() -> None:
    warnings.warn(f"pallas_kernels: the Pallas kernels are tested on jax {' / '.join(v + 'x' for v in TESTED_JAX)}, "
                  f"this is jax {jax.__version__}: mode 'auto' runs the jnp references (set METRALE_KERNELS=pallas "
                  "to use the kernels anyway)", stacklevel=3)


def gpu_capability() -> str | None:
    """The default device's compute capability ("9.0" on an H100/H200). Where jax's backend is not a GPU (the
    CPU tests asking what would resolve on one) the answer is the Hopper this project targets."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return MOSAIC_CAPABILITIES[0]
    return getattr(device, "compute_capability", None)


def get(name: str, mode: str | None = None) -> Callable:
    return resolve(name, mode).fn


def resolved(name: str, mode: str | None = None) -> bool:
    try:
        resolve(name, mode)
    except KernelUnavailableError:
        return False
    return True


def report(mode: str | None = None) -> dict[str, str]:
    """Which implementation each registered kernel resolves to ('unavailable' where none)."""
    _load_all()
    out = {}
    for name in names():
        try:
            out[name] = resolve(name, mode).impl
        except KernelUnavailableError:
            out[name] = "unavailable"
    return out


@contextlib.contextmanager
def disabled(*kernel_names: str) -> Iterator[None]:
    """Make kernels unresolvable inside the block (tests of install-time errors)."""
    added = set(kernel_names) - _DISABLED
    _DISABLED.update(added)
    try:
        yield
    finally:
        _DISABLED.difference_update(added)


@contextlib.contextmanager
def gpu_default(name: str, arm: str) -> Iterator[None]:
    """Make `arm` ("triton" or "mosaic") the GPU default of kernel `name` inside the block: timing an arm that is not
    the default yet against the one that is, in one process (benchmarks' --gpu-default)."""
    _load_all()
    spec = _KERNELS.get(name)
    if spec is None:
        raise KernelUnavailableError(f"no kernel named {name!r} is registered (known: {names()})")
    if arm not in GPU_ARMS or spec.arm(arm) is None:
        raise KernelUnavailableError(f"kernel {name!r} has no {arm!r} arm to make its GPU default "
                                     f"(arms: {[a for a in GPU_ARMS if spec.arm(a) is not None]})")
    _KERNELS[name] = dataclasses.replace(spec, gpu_default=arm)
    try:
        yield
    finally:
        _KERNELS[name] = spec


def _load_all() -> None:
    """Import every kernel module so that each registers itself."""
    import pallas_kernels  # noqa: F401  (its __init__ imports the kernel modules)
