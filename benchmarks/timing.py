"""Wall-clock timing shared by the benchmarks: calls queued inside one executable, so host dispatch is paid once.

Every queued call must get its own inputs: XLA merges identical computations in one executable, and a call
repeated on the same arguments is timed as if it were free (seen on the H200, 2026-11-30: two benchmarks read
1.7-10x too fast that way).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import tempfile
import time

import jax


def queued(fn, n: int):
    """A jitted function of `sets` (n argument tuples, all distinct) that calls fn once per set."""
    return jax.jit(lambda sets: [fn(*sets[i]) for i in range(n)])


def wall_us(many, arg_sets, *, reps: int, trials: int = 3) -> list[float]:
    """us per queued call of `many` (from `queued`): warmed up, then `reps` executions back to back per trial."""
    jax.block_until_ready(many(arg_sets))             # compile + warm
    jax.block_until_ready(many(arg_sets))
    walls = []
    for _ in range(trials):
        t = time.perf_counter()
        jax.block_until_ready([many(arg_sets) for _ in range(reps)])
        walls.append((time.perf_counter() - t) / (reps * len(arg_sets)) * 1e6)
    return walls


def queued_wall_us(fn, arg_sets, *, reps: int, trials: int = 3) -> list[float]:
    """`wall_us` of fn called once per (distinct) entry of arg_sets."""
    return wall_us(queued(fn, len(arg_sets)), arg_sets, reps=reps, trials=trials)


def queued_arms(arms: dict) -> dict:
    """{name: `queued` executable} for arms {name: (fn, arg_sets)}: built once, shared by the timings of an arm."""
    return {n: queued(fn, len(sets)) for n, (fn, sets) in arms.items()}


def interleaved_rounds(arms: dict, rounds: int, *, reps: int = 6, trials: int = 3, on_round=None,
                       many: dict | None = None) -> dict:
    """{name: [us per call, one per round]} for arms {name: (fn, arg_sets)}: each compiled once (or given as `many`,
    from `queued_arms`), then every arm timed once per round (best of `trials`), round after round, so all see the
    same GPU state (clocks, the power cap: benchmarks/notes/quant_prefill.md s8-4). on_round(r, walls) runs after
    each round (progress lines)."""
    many = many or queued_arms(arms)
    for n, (_, sets) in arms.items():
        jax.block_until_ready(many[n](sets))             # compile + warm
    walls = {n: [] for n in arms}
    for r in range(rounds):
        for n, (_, sets) in arms.items():
            walls[n].append(min(wall_us(many[n], sets, reps=reps, trials=trials)))
        if on_round is not None:
            on_round(r, walls)
    return walls


def gpu_kernel_events(trace_dir: str) -> list[dict] | None:
    """The GPU kernel events (perfetto "X" events of a GPU process, copies and memsets left out) of the first
    trace under trace_dir, sorted by start; None if no trace was written."""
    files = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
        return None
    with gzip.open(files[0], "rt") as fh:
        tr = json.load(fh)
    events = tr["traceEvents"] if isinstance(tr, dict) else tr
    names = {e["pid"]: str(e.get("args", {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {pid for pid, n in names.items() if "gpu" in n.lower()}
    if not gpu_pids:
        raise RuntimeError(f"no GPU process in the trace; processes: {sorted(names.values())[:10]}")
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids
               and "memcpy" not in str(e.get("name", "")).lower() and "memset" not in str(e.get("name", "")).lower()]
    return sorted(kernels, key=lambda e: e.get("ts", 0))


def kernel_family(name: str) -> str:
    """A kernel's name without the `__N` suffix that tells apart launches of one kernel (each layer's
    `ssm_state_update__7`), cut to 100 characters."""
    return re.sub(r"__\d+$", "", name[:100])


def kernel_breakdown(events: list[dict], steps: int, classify, top: int = 25) -> dict:
    """Per step of a traced run of `steps` steps: kernel time and count per class (classify(name)) and for the
    `top` longest kernels (by `kernel_family`: the launches of one kernel in every layer together), the busy
    time, the trace span from the first kernel's start to the last one's end, and the span's idle part (launch
    gaps, host waits). events: gpu_kernel_events' list."""
    names, classes = {}, {}
    for e in events:
        n, us = str(e.get("name", "")), e.get("dur", 0) / steps
        k = names.setdefault(kernel_family(n), {"us_per_step": 0.0, "count_per_step": 0.0, "class": classify(n)})
        c = classes.setdefault(k["class"], {"us_per_step": 0.0, "count_per_step": 0.0})
        for row in (k, c):
            row["us_per_step"] += us
            row["count_per_step"] += 1 / steps
    busy = sum(c["us_per_step"] for c in classes.values())
    span = (max(e["ts"] + e.get("dur", 0) for e in events) - min(e["ts"] for e in events)) / steps
    return {"traced_span_us_per_step": span, "kernel_us_per_step": busy, "idle_us_per_step": span - busy,
            "kernels_per_step": len(events) / steps,
            "by_class": dict(sorted(classes.items(), key=lambda kv: -kv[1]["us_per_step"])),
            "top_kernels": dict(sorted(names.items(), key=lambda kv: -kv[1]["us_per_step"])[:top])}


def wall_and_traced_us(fn, arg_sets, *, reps: int, trace: bool = True) -> dict:
    """fn queued once per (distinct) entry of arg_sets in one executable: us per call by wall clock ("wall_us", best
    of the trials in "wall_us_all") and, with trace, by GPU kernel time from a profiler trace of the same executable
    (`traced_gpu_us`); "us" is the GPU time where traced, else the wall time."""
    many = queued(fn, len(arg_sets))
    walls = wall_us(many, arg_sets, reps=reps)
    res = {"wall_us": min(walls), "wall_us_all": walls}
    if trace:
        res.update(traced_gpu_us(many, arg_sets))
    res["us"] = res.get("gpu_us") or res["wall_us"]
    return res


def gpu_kernel_us(trace_dir: str, calls: int) -> tuple[float | None, dict]:
    """Sum of GPU kernel durations in the perfetto trace per call, and the largest kernels (name -> us per call):
    the Mosaic kernel apart from XLA's small ones around it (x permutation, split-K sum)."""
    events = gpu_kernel_events(trace_dir)
    if events is None:
        return None, {}
    kernels = {}
    for e in events:
        name = str(e.get("name", ""))
        kernels[name] = kernels.get(name, 0.0) + e.get("dur", 0) / calls
    total = sum(kernels.values())
    return (total or None), {k[:80]: round(v, 3) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:6]}


def traced_gpu_us(many, arg_sets, *, runs: int = 2) -> dict:
    """GPU kernel us per queued call of `many` from a profiler trace of `runs` executions (host dispatch and
    launch gaps excluded, which wall times of ~20 us kernels are not); {"gpu_us": None, "profile_error"} if the
    profiler fails."""
    try:
        d = tempfile.mkdtemp()
        jax.block_until_ready(many(arg_sets))
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready([many(arg_sets) for _ in range(runs)])
        t = time.perf_counter()
        us, kernels = gpu_kernel_us(d, runs * len(arg_sets))
        return {"gpu_us": us, "gpu_kernels_us": kernels, "trace_parse_s": time.perf_counter() - t}
    except Exception as e:  # noqa: BLE001  (the profiler is optional)
        return {"gpu_us": None, "profile_error": repr(e)[:200]}
