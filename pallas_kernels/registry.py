"""Kernel registry: one name, a jnp reference and (optionally) a Pallas kernel; resolved per backend.

Modes (ModelLevers.kernels / METRALE_KERNELS):
  auto       GPU: the Pallas kernel where one is registered, else the reference. CPU: the reference.
  pallas     the Pallas kernel only; a name without one does not resolve.
  interpret  the Pallas kernel in interpret mode (CPU tests), else the reference.
  reference  the jnp reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator

import jax

from metrale_jax.errors import KernelUnavailableError

MODES = ("auto", "pallas", "interpret", "reference")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str
    reference: Callable | None
    pallas: Callable | None = None      # takes interpret: bool as a keyword
    platforms: tuple[str, ...] = ("gpu",)  # where the compiled Pallas kernel runs


@dataclasses.dataclass(frozen=True)
class Resolution:
    """What a name resolved to: impl is 'pallas', 'interpret' or 'reference'."""

    name: str
    impl: str
    fn: Callable


_KERNELS: dict[str, KernelSpec] = {}
_DISABLED: set[str] = set()


def register(name: str, *, reference: Callable | None = None, pallas: Callable | None = None,
             platforms: tuple[str, ...] = ("gpu",)) -> None:
    """Add or extend a kernel entry (reference and Pallas halves may register separately)."""
    old = _KERNELS.get(name)
    if old is not None:
        reference = reference or old.reference
        pallas = pallas or old.pallas
    _KERNELS[name] = KernelSpec(name, reference, pallas, platforms)


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
    platform = platform or jax.default_backend()
    spec = _KERNELS.get(name)
    if spec is None:
        raise KernelUnavailableError(f"no kernel named {name!r} is registered (known: {names()})")
    if name in _DISABLED:
        raise KernelUnavailableError(f"kernel {name!r} is disabled on this backend")
    runs_here = spec.pallas is not None and platform in spec.platforms
    if mode == "pallas":
        if not runs_here:
            raise KernelUnavailableError(
                f"kernel {name!r} has no Pallas implementation for platform {platform!r} (mode 'pallas')")
        return Resolution(name, "pallas", functools.partial(spec.pallas, interpret=False))
    if mode == "interpret" and spec.pallas is not None:
        return Resolution(name, "interpret", functools.partial(spec.pallas, interpret=True))
    if mode == "auto" and runs_here:
        return Resolution(name, "pallas", functools.partial(spec.pallas, interpret=False))
    if spec.reference is None:
        raise KernelUnavailableError(f"kernel {name!r} has no reference and no Pallas kernel for {platform!r}")
    return Resolution(name, "reference", spec.reference)


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


def _load_all() -> None:
    """Import every kernel module so that each registers itself."""
    import pallas_kernels  # noqa: F401  (its __init__ imports the kernel modules)
