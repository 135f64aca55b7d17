"""Kernel registry: the two Pallas arms (Triton, Mosaic GPU), gpu_default, and the errors of each mode."""

import os
import pathlib
import subprocess
import sys

import pytest

from metrale_jax import errors
from metrale_jax.errors import KernelUnavailableError
from metrale_jax.weights import quant_formats
from pallas_kernels import errors as kernel_errors
from pallas_kernels import formats, registry


def _ref(x):
    return ("reference", x)


def _triton(x, *, interpret):
    return ("triton", interpret, x)


def _mosaic(x, *, interpret):
    return ("mosaic", interpret, x)


@pytest.fixture
def names():
    made = []

    def make(suffix, **arms):
        name = f"_test_registry_{suffix}"
        registry.register(name, **arms)
        made.append(name)
        return name

    yield make
    for n in made:
        registry._KERNELS.pop(n, None)


def test_two_arms_follow_gpu_default(names):
    tri = names("tri", reference=_ref, pallas=_triton, mosaic=_mosaic)
    mos = names("mos", reference=_ref, pallas=_triton, mosaic=_mosaic, gpu_default="mosaic")
    assert registry.resolve(tri, "auto", platform="gpu").fn(1) == ("triton", False, 1)
    assert registry.resolve(mos, "auto", platform="gpu").fn(2) == ("mosaic", False, 2)
    assert registry.resolve(mos, "pallas", platform="gpu").impl == "mosaic"
    assert registry.resolve(mos, "triton", platform="gpu").fn(3) == ("triton", False, 3)
    assert registry.resolve(tri, "mosaic", platform="gpu").impl == "mosaic"
    # interpret runs the Triton arm; the CPU's auto is the reference whatever the arms
    assert registry.resolve(mos, "interpret", platform="cpu").fn(4) == ("triton", True, 4)
    assert registry.resolve(mos, "auto", platform="cpu").fn(5) == ("reference", 5)


def test_gpu_default_switches_the_arm_inside_its_block_only(names):
    tri = names("switch", reference=_ref, pallas=_triton, mosaic=_mosaic)
    only = names("only_triton", reference=_ref, pallas=_triton)
    with registry.gpu_default(tri, "mosaic"):
        assert registry.resolve(tri, "auto", platform="gpu").fn(1) == ("mosaic", False, 1)
    assert registry.resolve(tri, "auto", platform="gpu").fn(2) == ("triton", False, 2)
    with pytest.raises(KernelUnavailableError, match="no 'mosaic' arm"):
        with registry.gpu_default(only, "mosaic"):
            pass
    with pytest.raises(KernelUnavailableError, match="no kernel named"):
        with registry.gpu_default("_test_registry_nope", "triton"):
            pass
    with pytest.raises(RuntimeError):                    # an error inside the block restores the default too
        with registry.gpu_default(tri, "mosaic"):
            raise RuntimeError
    assert registry._KERNELS[tri].gpu_default == "triton"


@pytest.mark.parametrize("grad_wrt", ["x", "weight", ("x", 3)])
def test_grad_wrt_must_name_arguments(names, grad_wrt):
    """A string grad_wrt was split into its letters ("weight" -> "w", "e", ...), so no argument got a gradient."""
    with pytest.raises(KernelUnavailableError, match="grad_wrt must be a sequence of argument names"):
        names("grad", reference=_ref, grad_wrt=grad_wrt)
    assert "_test_registry_grad" not in registry.names()
    assert registry._KERNELS[names("grad_ok", reference=_ref, grad_wrt=["x"])].grad_wrt == ("x",)


def test_missing_arm_raises_naming_it(names):
    only_tri = names("only_tri", reference=_ref, pallas=_triton)
    only_mos = names("only_mos", reference=_ref, mosaic=_mosaic)
    with pytest.raises(KernelUnavailableError, match="no mosaic implementation"):
        registry.resolve(only_tri, "mosaic", platform="gpu")
    with pytest.raises(KernelUnavailableError, match="no triton implementation"):
        registry.resolve(only_mos, "triton", platform="gpu")
    with pytest.raises(KernelUnavailableError, match="no Pallas implementation.*'cpu'"):
        registry.resolve(only_mos, "pallas", platform="cpu")
    # a Mosaic-only name still serves auto on the GPU, and falls back to the reference in interpret mode
    assert registry.resolve(only_mos, "auto", platform="gpu").impl == "mosaic"
    assert registry.resolve(only_mos, "interpret", platform="cpu").impl == "reference"


def test_extending_keeps_arms_and_checks_default(names):
    n = names("ext", reference=_ref, pallas=_triton)
    registry.register(n, mosaic=_mosaic, gpu_default="mosaic")
    spec = registry._KERNELS[n]
    assert (spec.reference, spec.pallas, spec.mosaic, spec.gpu_default) == (_ref, _triton, _mosaic, "mosaic")
    with pytest.raises(KernelUnavailableError, match="gpu_default must be one of"):
        registry.register(n, gpu_default="cuda")
    with pytest.raises(KernelUnavailableError, match="kernel mode must be one of"):
        registry.resolve(n, "fast")


def test_default_mosaic_arm_hands_unsupported_calls_to_triton(names):
    n = names("sup", reference=_ref, pallas=_triton, mosaic=_mosaic, gpu_default="mosaic",
              mosaic_supports=lambda x: x % 2 == 0)
    fn = registry.resolve(n, "auto", platform="gpu").fn
    assert fn(4) == ("mosaic", False, 4) and fn(3) == ("triton", False, 3)
    assert registry.resolve(n, "pallas", platform="gpu").fn(3) == ("triton", False, 3)
    assert registry.resolve(n, "mosaic", platform="gpu").fn(3) == ("mosaic", False, 3)   # forced: no fallback


def test_mosaic_arms_only_on_hopper(names, monkeypatch):
    n = names("cap", reference=_ref, pallas=_triton, mosaic=_mosaic, gpu_default="mosaic")
    only = names("cap_only", reference=_ref, mosaic=_mosaic)
    monkeypatch.setattr(registry, "gpu_capability", lambda: "8.0")          # an A100: no wgmma
    assert registry.resolve(n, "auto", platform="gpu").fn(1) == ("triton", False, 1)
    assert registry.resolve(n, "pallas", platform="gpu").impl == "pallas"
    assert registry.resolve(only, "auto", platform="gpu").impl == "reference"
    with pytest.raises(KernelUnavailableError, match="compute capability 9.0.*has 8.0"):
        registry.resolve(n, "mosaic", platform="gpu")
    with pytest.raises(KernelUnavailableError, match="no Pallas implementation"):
        registry.resolve(only, "pallas", platform="gpu")
    monkeypatch.setattr(registry, "gpu_capability", lambda: "9.0")
    assert registry.resolve(n, "auto", platform="gpu").impl == "mosaic"


def test_an_untested_jax_runs_the_references_under_auto(names, monkeypatch):
    """On a JAX release the kernels were not tested on, `auto` takes the references (warning once); a mode the
    caller names still takes the kernels."""
    n = names("jaxver", reference=_ref, pallas=_triton, mosaic=_mosaic, gpu_default="mosaic")
    assert registry.resolve(n, "auto", platform="gpu").impl == "mosaic"          # this JAX is a tested one
    monkeypatch.setattr(registry.jax, "__version__", "0.99.0")
    registry._warn_untested_jax.cache_clear()
    with pytest.warns(UserWarning, match="tested on jax 0.11.x, this is jax 0.99.0"):
        assert registry.resolve(n, "auto", platform="gpu").fn(1) == ("reference", 1)
    assert registry.resolve(n, "pallas", platform="gpu").impl == "mosaic"
    assert registry.resolve(n, "interpret", platform="cpu").fn(2) == ("triton", True, 2)
    registry._warn_untested_jax.cache_clear()


def test_kernels_are_the_ground_floor():
    """pallas_kernels imports nothing from metrale_jax, and the errors the kernels raise are the library's own
    classes (one object each), so `except MetraleError` / `except ShapeError` in the library catch them."""
    root = pathlib.Path(__file__).resolve().parents[2]
    code = ("import sys, pallas_kernels; bad = sorted(m for m in sys.modules if m.split('.')[0] == 'metrale_jax'); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root,
                   env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)})
    assert errors.ShapeError is kernel_errors.ShapeError and issubclass(errors.ShapeError, errors.MetraleError)
    assert errors.KernelUnavailableError is kernel_errors.KernelUnavailableError
    assert quant_formats.Fp8Activations is formats.Fp8Activations
