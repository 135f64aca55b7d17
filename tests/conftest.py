"""Shared test set-up: CPU by default (METRALE_TEST_GPU=1 keeps the GPU), fresh random draws per test."""

import os

ON_CPU = not os.environ.get("METRALE_TEST_GPU")
if ON_CPU:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
else:
    # The tests compare float32 paths at 1e-5; a GPU's default float32 matmul rounds its inputs to TF32 (10 mantissa
    # bits, ~5e-4), which two correct paths fused differently do not share. The CPU computes float32 exactly.
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# On the CPU the tests' programs are tiny and compile-bound: LLVM at -O0 (XLA's HLO passes unchanged) saves far
# more compile time than the slower code costs (benchmarks/notes/cpu_suite.md).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4"
                      + (" --xla_backend_optimization_level=0" if ON_CPU else ""))
# On the CPU, one on-disk compilation cache per run, shared by the xdist workers, the notebook kernels and the CLI
# subprocesses (they inherit the variable, so the controller's directory is everyone's): the suite builds the same
# small models in many modules and processes, and each module's end drops the in-memory programs
# (_release_compiled_programs). Only programs that took 0.3 s or more to compile are written (the model's steps, a
# few hundred a run): a write serializes the XLA:CPU executable, and with every program cached (ten thousand
# writes a run) that serialization segfaulted a worker once, not reproduced alone. The process that made the
# directory removes it (pytest_unconfigure). METRALE_TEST_CACHE=1: one cache in .jax_test_cache/ kept for reruns.
_RUN_CACHE = None
if os.environ.get("METRALE_TEST_CACHE"):
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), ".jax_test_cache"))
elif ON_CPU and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _RUN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="metrale-jax-test-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import gc  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng(request):
    """A fresh generator per test; the seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("METRALE_TEST_SEED", np.random.SeedSequence().entropy % (2**31)))
    print(f"seed={seed} ({request.node.name})")
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop JAX's compiled programs and the models they keep alive, so that a worker holds
    one module's executables at a time (a worker aborted inside an XLA compile late in the full suite, twice,
    while holding every earlier module's; the cause was not pinned down)."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """With -n and no --dist: xdist's work-stealing schedule instead of its default 'load'. 'load' deals the first
    quarter of the tests out one at a time, alternating workers, so nearly every module ran on both workers and
    both built its module fixtures and compiled its shared programs; worksteal gives each worker a contiguous half
    and moves tests only when one runs dry."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", None) == "no":
        config.option.dist = "worksteal"


def pytest_collection_finish(session):
    """Python's cyclic GC, tuned for this suite: the objects imported and collected so far are frozen (never scanned
    again) and the youngest generation is collected every 20,000 net allocations instead of 700: JAX's tracing
    allocates heavily, and with the defaults the collector runs thousands of times a run for a few percent of the
    time. Each module's end still collects everything (_release_compiled_programs)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    import jax

    on_gpu = jax.default_backend() == "gpu"
    run_slow = config.getoption("--run-slow")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --run-slow"))


def pytest_unconfigure(config):
    """The process that made this run's compilation cache directory removes it (workers inherit it, never make it)."""
    if _RUN_CACHE is not None:
        import shutil

        shutil.rmtree(_RUN_CACHE, ignore_errors=True)
