"""benchmarks/timing.py on the CPU: interleaved rounds time every arm once per round, on distinct argument sets."""

import jax.numpy as jnp
import numpy as np

from benchmarks import timing


def test_interleaved_rounds_time_every_arm_each_round(rng):
    sets = [(jnp.asarray(rng.standard_normal((64, 64)), jnp.float32),) for _ in range(3)]
    arms = {"neg": (lambda v: -v, sets), "matmul": (lambda v: v @ v, sets)}
    seen = []
    walls = timing.interleaved_rounds(arms, 4, reps=2, trials=1,
                                      on_round=lambda r, w: seen.append((r, {n: len(v) for n, v in w.items()})))
    assert list(walls) == ["neg", "matmul"] and all(len(v) == 4 and min(v) > 0 for v in walls.values())
    assert seen == [(r, {"neg": r + 1, "matmul": r + 1}) for r in range(4)]      # both arms in every round


def test_queued_calls_fn_once_per_distinct_set(rng):
    sets = [(jnp.asarray(rng.standard_normal(8), jnp.float32),) for _ in range(3)]
    out = timing.queued(lambda v: v * 2.0, len(sets))(sets)
    for (x,), y in zip(sets, out):
        np.testing.assert_array_equal(np.asarray(y), 2.0 * np.asarray(x))


def test_interleaved_rounds_reuse_given_executables(rng):
    """Executables from queued_arms serve the rounds as they are: fn is traced once, not again per round or call."""
    traces = []
    fn = lambda v: (traces.append(1), v + 1.0)[1]
    sets = [(jnp.asarray(rng.standard_normal(16), jnp.float32),) for _ in range(2)]
    arms = {"add": (fn, sets)}
    many = timing.queued_arms(arms)
    jax_out = many["add"](sets)
    np.testing.assert_array_equal(np.asarray(jax_out[1]), np.asarray(sets[1][0]) + 1.0)
    n = len(traces)
    walls = timing.interleaved_rounds(arms, 3, reps=2, trials=1, many=many)
    assert len(walls["add"]) == 3 and len(traces) == n


def _write_trace(tmp_path, events):
    import gzip
    import json
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as fh:
        json.dump({"traceEvents": meta + events}, fh)


def test_kernel_breakdown_from_a_trace(tmp_path):
    """GPU kernels only (host events, copies and memsets left out), summed per class and name per step; the idle
    time is the span the kernels leave uncovered."""
    ev = lambda name, ts, dur, pid=1: {"ph": "X", "name": name, "pid": pid, "ts": ts, "dur": dur}
    _write_trace(tmp_path, [ev("w8a16_gemv", 0, 20), ev("loop_add_fusion", 25, 5), ev("w8a16_gemv", 40, 20),
                            ev("loop_add_fusion", 65, 5), ev("MemcpyDtoD", 70, 50), ev("host_work", 0, 999, pid=2),
                            ev("Memset", 80, 9)])
    events = timing.gpu_kernel_events(str(tmp_path))
    assert [e["name"] for e in events] == ["w8a16_gemv", "loop_add_fusion"] * 2
    b = timing.kernel_breakdown(events, 2, lambda n: "gemv" if "gemv" in n else "xla")
    assert b["kernels_per_step"] == 2 and b["kernel_us_per_step"] == 25
    assert b["traced_span_us_per_step"] == 35 and b["idle_us_per_step"] == 10
    assert b["by_class"] == {"gemv": {"us_per_step": 20, "count_per_step": 1}, "xla": {"us_per_step": 5, "count_per_step": 1}}
    assert list(b["top_kernels"]) == ["w8a16_gemv", "loop_add_fusion"]
    assert timing.gpu_kernel_us(str(tmp_path), 2)[0] == 25


def test_kernel_breakdown_sums_one_kernel_over_layers():
    """Launches named `kernel__N` (one per layer) count as one kernel; XLA's own `_N` fusion names stay apart."""
    events = [{"name": n, "ts": i * 10, "dur": d} for i, (n, d) in enumerate(
        [("ssm_state_update", 4), ("ssm_state_update__1", 6), ("ssm_state_update__12", 5), ("loop_add_fusion_5", 2),
         ("loop_add_fusion_50", 3)])]
    top = timing.kernel_breakdown(events, 1, lambda n: "k")["top_kernels"]
    assert top["ssm_state_update"] == {"us_per_step": 15, "count_per_step": 3, "class": "k"}
    assert set(top) == {"ssm_state_update", "loop_add_fusion_5", "loop_add_fusion_50"}


def test_decode_profile_kernel_classes():
    from benchmarks.bench_runtime import kernel_class
    assert kernel_class("w8a16_gemv_kernel") == "projections (Pallas)"
    assert kernel_class("anonymous_mosaic_gpu_kernel") == "projections (Pallas)"   # how Mosaic GEMVs are traced
    assert kernel_class("ssm_state_update") == "mamba mixer (Pallas)"
    assert kernel_class("nvjet_hsh_128x256") == "XLA matmuls"
    assert kernel_class("wrapped_slice_3") == "XLA slices"
    assert kernel_class("loop_multiply_fusion") == "XLA fusions and other"


def test_gpu_kernel_events_without_a_trace(tmp_path):
    assert timing.gpu_kernel_events(str(tmp_path)) is None
