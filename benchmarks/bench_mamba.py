"""Mamba-2 kernels on the GPU: correctness at the real shapes, then time against baselines measured in the same
run (device copy bandwidth, bf16 matmul rate, the plain-XLA chunked SSD, jax-linear-attention if installed).

Shapes: Nemotron-H 8B mixer, H=128, P=64, N=128, G=8, chunk 128, bf16 activations, f32 SSM state.
- SSD prefill (B, T) = (1, 8192), (1, 32768), (8, 4096): the Mosaic GPU arm (pallas_kernels/ssd_mgpu.py, variants
  MOSAIC_VARIANTS) and the Triton arm (variants SSD_VARIANTS) vs the jnp reference under jit at precision HIGHEST
  and DEFAULT vs jla.layers.ssm.mamba2_ssd; a markdown summary against the issue #9 targets.
- Decode state update, pool of 512 slots, batch 1, 8, 64, 256 (rows rotated so repeated calls do not run from
  L2): fraction of the copy bandwidth (state bytes read + written).
- Whole layer decode step (bf16 weights), batch 1 and 64: Pallas path vs XLA reference path, with the
  weight-bytes floor.
Times: wall clock around block_until_ready; several calls queued per measurement, median of the repeats.

    PYTHONPATH=. python benchmarks/bench_mamba.py --out DIR [--deadline SECONDS] [--quick] [--only SECTIONS]
writes DIR/mamba.json (every section: ceil,ssd,update,layer) or, with --only a subset, DIR/mamba_<sections>.json
(e.g. --only ssd: mamba_ssd.json), so a partial run does not replace the other sections' latest numbers; the date
is in the JSON. The CPU dry run (--tiny) writes mamba[_<sections>]_tiny.json. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import glob
import gzip
import json
import math
import os
import platform
import statistics
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import ssd as ssd_mod
from pallas_kernels import ssd_mgpu
from pallas_kernels import state_update as su_mod
from pallas_kernels.ssd import SsdBlocks

H, P, N, G, Q = 128, 64, 128, 8, 128
SLOTS, HIDDEN = 512, 4096
I = False          # --tiny: small shapes, kernels in interpret mode (a CPU dry run of this script)
T0 = time.time()
DEADLINE = [float("inf")]


class Deadline(Exception):
    pass


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def check_deadline():
    if time.time() - T0 > DEADLINE[0]:
        raise Deadline()


def rel_err(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def timeit(fn, *args, reps: int = 7, calls: int = 3) -> float:
    """Median over reps of (calls queued back to back, then block) / calls, in microseconds."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        out = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(ts)


PROFILE_OK = [True]


def gpu_kernels(fn, *args) -> tuple[object, dict[str, float] | None]:
    """Run fn(*args) once under the profiler: (its output, {kernel name: GPU microseconds}) or None where the
    trace holds no GPU activity."""
    if not PROFILE_OK[0]:
        return fn(*args), None
    with tempfile.TemporaryDirectory() as d:
        try:
            jax.profiler.start_trace(d, create_perfetto_trace=True)
            out = fn(*args)
            jax.block_until_ready(out)
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        if not files:
            return out, None
        with gzip.open(files[0], "rt") as fh:
            tr = json.load(fh)
    events = tr["traceEvents"] if isinstance(tr, dict) else tr
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    times = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu:
            times[str(e.get("name", "?"))[:80]] += float(e.get("dur", 0.0))
    return out, (dict(times) if times else None)


def per_call(times: dict | None, calls: int, match: str | None = None) -> float | None:
    if not times:
        return None
    return sum(v for k, v in times.items() if match is None or match in k) / calls


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


# ---- ceilings -----------------------------------------------------------------------------------------------
def ceilings() -> dict:
    n = 1 << (16 if I else 29)                                      # 2 GiB of f32
    a = jnp.asarray(np.random.default_rng(0).standard_normal(n, np.float32))
    methods = {"xla_scale": jax.jit(lambda v: v * jnp.float32(1.0000001))}
    if not I:
        from jax.experimental import pallas as pl
        blk = 1 << 14
        methods["pallas_copy"] = jax.jit(lambda v: pl.pallas_call(
            _copy_kernel, out_shape=jax.ShapeDtypeStruct(v.shape, v.dtype), grid=(v.shape[0] // blk,),
            in_specs=[pl.BlockSpec((blk,), lambda i: (i,))], out_specs=pl.BlockSpec((blk,), lambda i: (i,)))(v))
    copies = {}
    for name, fn in methods.items():
        try:
            us = timeit(fn, a, reps=9, calls=4)
            _, t = gpu_kernels(fn, a)
            copies[name] = dict(wall_us=us, gpu_us=per_call(t, 1), wall_Bps=2 * a.nbytes / (us * 1e-6))
            if copies[name]["gpu_us"]:
                copies[name]["gpu_Bps"] = 2 * a.nbytes / (copies[name]["gpu_us"] * 1e-6)
        except Exception as e:  # noqa: BLE001
            copies[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    bw = max(max(c.get("wall_Bps", 0), c.get("gpu_Bps", 0)) for c in copies.values())
    us = min(c.get("wall_us", float("inf")) for c in copies.values())
    k = jax.random.split(jax.random.key(0))
    m = 256 if I else 8192
    x = jax.random.normal(k[0], (m, m), jnp.bfloat16)
    y = jax.random.normal(k[1], (m, m), jnp.bfloat16)
    mm = jax.jit(lambda u, v: jnp.dot(u, v, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    us_mm = timeit(mm, x, y, reps=5, calls=3)
    del a, x, y
    return dict(copy_bytes=2 * 4 * n, copy_us=us, copy_bw_Bps=bw, copies=copies, matmul_shape=[m, m, m],
                matmul_us=us_mm,
                bf16_flops=2 * m ** 3 / (us_mm * 1e-6))


# ---- SSD prefill --------------------------------------------------------------------------------------------
def ssd_inputs(Bt: int, L: int, key):
    T = Bt * L
    k = jax.random.split(key, 6)
    return dict(
        x=jax.random.normal(k[0], (T, H, P), jnp.bfloat16),
        dt=(jax.random.normal(k[1], (T, H), jnp.float32) - 2.0).astype(jnp.bfloat16),
        A=-jnp.exp(jax.random.uniform(k[2], (H,), jnp.float32, 0.0, math.log(16.0))),
        B=jax.random.normal(k[3], (T, G, N), jnp.bfloat16),
        C=jax.random.normal(k[4], (T, G, N), jnp.bfloat16),
        D=1.0 + 0.1 * jax.random.normal(k[5], (H,), jnp.float32),
        dt_bias=jnp.full((H,), -2.0, jnp.float32),
        cu=jnp.arange(Bt + 1, dtype=jnp.int32) * L,
    )


def ssd_bytes(Bt: int, L: int) -> int:
    T = Bt * L
    return T * (H * P * 2 * 2 + 2 * G * N * 2 + H * 2) + Bt * H * P * N * 4


def ssd_flops(Bt: int, L: int) -> int:
    """bf16 matmul FLOPs of the chunked form: C B^T per (chunk, group); per (chunk, head) intra, inter, state."""
    nc = Bt * (L // Q)
    return nc * (G * 2 * Q * Q * N + H * (2 * Q * Q * P + 2 * Q * N * P + 2 * P * Q * N))


def bench_ssd(results: dict, shapes, variants: dict, quick: bool, mosaic_variants: dict | None = None,
              xla_default: bool = True) -> None:
    try:
        import jla.layers.ssm as jla_ssm
        results["jla"] = "jax-linear-attention available"
    except Exception as e:  # noqa: BLE001
        jla_ssm = None
        results["jla"] = f"not available: {type(e).__name__}: {e}"
    for Bt, L in shapes:
        check_deadline()
        key = f"B{Bt}_T{L}"
        inp = ssd_inputs(Bt, L, jax.random.key(Bt * 100003 + L))
        row = dict(B=Bt, T=L, bytes=ssd_bytes(Bt, L), flops=ssd_flops(Bt, L), arms={})
        results["ssd"][key] = row
        common = dict(chunk_size=Q, D=inp["D"], dt_bias=inp["dt_bias"], cu_seqlens=inp["cu"],
                      initial_states=None)

        def run(scan, x, dt, A, B, C, **kw):
            out = scan(x, dt, A, B, C, **kw)
            return out.y, out.final_states

        ref_fn = jax.jit(functools.partial(run, ssd_mod.ssd_scan_reference, **common,
                                           precision=jax.lax.Precision.HIGHEST))
        args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"])
        y_ref, h_ref = ref_fn(*args)
        arms = {}
        for name, opts in (mosaic_variants or {}).items():
            arms[f"mosaic:{name}"] = jax.jit(functools.partial(run, ssd_mgpu.ssd_scan_mosaic, **common, **opts,
                                                                interpret=I))
        for name, blk in variants.items():
            arms[f"pallas:{name}"] = jax.jit(functools.partial(run, ssd_mod.ssd_scan_pallas, **common, blocks=blk,
                                                                interpret=I))
        arms["xla_ref:HIGHEST"] = ref_fn
        if not quick and xla_default:
            arms["xla_ref:DEFAULT"] = jax.jit(functools.partial(run, ssd_mod.ssd_scan_reference, **common,
                                                                precision=jax.lax.Precision.DEFAULT))
        if jla_ssm is not None:
            dtp = ssd_mod.process_dt(inp["dt"], inp["dt_bias"], True, (0.0, math.inf))

            def jla_run(x, dt, A, B, C):
                r = lambda v: v.reshape(Bt, L, *v.shape[1:])
                y, st = jla_ssm.mamba2_ssd(r(x), r(dtp), A, r(B), r(C), d=inp["D"], output_final_state=True)
                return y.reshape(Bt * L, H, P), None if st is None else jnp.swapaxes(st, -1, -2)   # [B, H, N, P]

            arms["jla.mamba2_ssd"] = jax.jit(jla_run)
        for name, fn in arms.items():
            check_deadline()
            try:
                y, h = fn(*args)
                err = rel_err(y, y_ref)
                err_h = rel_err(h, h_ref) if h is not None and h.shape == h_ref.shape else None
                us = timeit(fn, *args, reps=5 if L * Bt >= 32768 else 7)
                _, kt = gpu_kernels(fn, *args)
                row["arms"][name] = dict(us=us, rel_err_y=err, rel_err_final=err_h, gpu_us=per_call(kt, 1),
                                         kernels=kt, GBps=row["bytes"] / us * 1e-3, TFLOPs=row["flops"] / us * 1e-6)
                log(f"ssd {key} {name:28s} {us:10.1f} us (gpu {per_call(kt, 1)})  err_y={err:.2e} err_h={err_h}")
                if kt and name.startswith(("pallas", "mosaic")):
                    log("    " + ", ".join(f"{k}: {v:.0f}" for k, v in sorted(kt.items(), key=lambda kv: -kv[1])[:5]))
            except Deadline:
                raise
            except Exception as e:  # noqa: BLE001
                row["arms"][name] = dict(error=f"{type(e).__name__}: {str(e)[:2000]}",
                                         traceback=traceback.format_exc()[-6000:])
                log(f"ssd {key} {name} FAILED: {type(e).__name__}: {str(e)[:400]}")
                traceback.print_exc()
        del inp, y_ref, h_ref


# ---- decode state update ------------------------------------------------------------------------------------
def bench_state_update(results: dict, batches, variants: dict, copy_bw: float, state_dtype=jnp.float32) -> None:
    """One row per batch (key B<batch>, with the state dtype's name after it when it is not float32)."""
    slots = SLOTS
    k = jax.random.split(jax.random.key(7), 6)
    pool0 = jax.random.normal(k[0], (slots, H, P, N), jnp.float32).astype(state_dtype)
    suffix = "" if state_dtype == jnp.float32 else "_" + jnp.dtype(state_dtype).name
    rng = np.random.default_rng(1)
    n_rot = 8
    for Bt in batches:
        check_deadline()
        rows = jnp.asarray(np.stack([rng.permutation(slots - 1)[:Bt] for _ in range(n_rot)]), jnp.int32)
        x = jax.random.normal(k[1], (n_rot, Bt, H, P), jnp.bfloat16)
        dt = (jax.random.normal(k[2], (n_rot, Bt, H), jnp.float32) - 2).astype(jnp.bfloat16)
        B = jax.random.normal(k[3], (n_rot, Bt, G, N), jnp.bfloat16)
        C = jax.random.normal(k[4], (n_rot, Bt, G, N), jnp.bfloat16)
        A = -jnp.exp(jax.random.uniform(k[5], (H,), jnp.float32, 0.0, 2.7))
        D, bias = jnp.ones((H,), jnp.float32), jnp.full((H,), -2.0, jnp.float32)
        nbytes = Bt * H * P * N * jnp.dtype(state_dtype).itemsize * 2
        row = dict(batch=Bt, state_dtype=jnp.dtype(state_dtype).name, bytes=nbytes, arms={})
        results["state_update"][f"B{Bt}{suffix}"] = row
        # correctness once, on a copy of the pool
        y_ref, s_ref = su_mod.state_update_reference(pool0, rows[0], x[0], dt[0], A, B[0], C[0], D=D, dt_bias=bias)
        ref_rows = s_ref[rows[0]]
        del s_ref
        arms = {f"pallas:{n}": functools.partial(su_mod.state_update_pallas, blocks=b, interpret=I)
                for n, b in variants.items()}
        arms["xla_ref"] = su_mod.state_update_reference
        for name, upd in arms.items():
            check_deadline()
            calls = 16
            many = _many_updates(upd, calls, n_rot, A, D, bias)
            try:
                one = jax.jit(functools.partial(upd, D=D, dt_bias=bias), donate_argnums=0)
                y1, s1 = one(jnp.copy(pool0), rows[0], x[0], dt[0], A, B[0], C[0])
                err = rel_err(y1, y_ref)
                err_s = rel_err(s1[rows[0]], ref_rows)
                del s1
                pool = jnp.copy(pool0)
                pool, acc = many(pool, rows, x, dt, B, C)
                jax.block_until_ready(pool)
                ts = []
                for _ in range(7):
                    t = time.perf_counter()
                    pool, acc = many(pool, rows, x, dt, B, C)
                    jax.block_until_ready(pool)
                    ts.append((time.perf_counter() - t) / calls * 1e6)
                us = statistics.median(ts)
                (pool, acc), kt = gpu_kernels(many, pool, rows, x, dt, B, C)
                del pool
                gus = per_call(kt, calls)
                row["arms"][name] = dict(us=us, gpu_us=gus, kernels=kt, rel_err_y=err, rel_err_state=err_s,
                                         GBps=nbytes / us * 1e-3, frac_copy_bw=nbytes / (us * 1e-6) / copy_bw)
                if gus:
                    row["arms"][name]["frac_copy_bw_gpu"] = nbytes / (gus * 1e-6) / copy_bw
                log(f"state_update B={Bt:4d}{suffix} {name:26s} {us:9.2f} us (gpu {gus}) {nbytes / us * 1e-3:8.1f} GB/s "
                    f"({nbytes / (us * 1e-6) / copy_bw:5.1%} of copy)  err={err:.1e}/{err_s:.1e}")
            except Deadline:
                raise
            except Exception as e:  # noqa: BLE001
                row["arms"][name] = dict(error=f"{type(e).__name__}: {str(e)[:2000]}")
                log(f"state_update B={Bt} {name} FAILED: {type(e).__name__}: {str(e)[:400]}")


def _many_updates(upd, calls, n_rot, A, D, bias):
    """`calls` updates in one executable (rows and inputs rotated), the pool donated and threaded through."""

    @functools.partial(jax.jit, donate_argnums=0)
    def many(pool, rows, x, dt, B, C):
        y = None
        for i in range(calls):
            j = i % n_rot
            y, pool = upd(pool, rows[j], x[j], dt[j], A, B[j], C[j], D=D, dt_bias=bias)
        return pool, y

    return many


# ---- whole layer decode step --------------------------------------------------------------------------------
def bench_layer_decode(results: dict, batches, copy_bw: float) -> None:
    from metrale_jax import ModelConfig, ModelLevers, NemotronMamba2Layer, SsmPool
    from metrale_jax.init import random_norm, random_ssm_weights

    cfg = ModelConfig.from_hf(dict(vocab_size=1024, hidden_size=HIDDEN, hybrid_override_pattern="M",
                                   mamba_num_heads=H, mamba_head_dim=P, ssm_state_size=N, n_groups=G,
                                   chunk_size=Q, conv_kernel=4, intermediate_size=4096))
    k1, k2 = jax.random.split(jax.random.key(3))
    norm, w = random_norm(cfg, k1, jnp.bfloat16), random_ssm_weights(cfg, k2, jnp.bfloat16)
    wbytes = w.in_proj.weight.nbytes + w.out_proj.weight.nbytes
    for Bt in batches:
        check_deadline()
        row = dict(batch=Bt, weight_bytes=wbytes, state_bytes=Bt * (H * P * N * 4 * 2 + cfg.conv_dim * 3 * 2 * 2),
                   arms={})
        row["floor_weights_us"] = wbytes / copy_bw * 1e6
        row["floor_weights_state_us"] = (wbytes + row["state_bytes"]) / copy_bw * 1e6
        results["layer_decode"][f"B{Bt}"] = row
        pool0 = SsmPool.for_config(cfg, max(Bt, 8), dtype=jnp.bfloat16)
        pool0 = SsmPool(jax.random.normal(k1, pool0.conv_state.shape, jnp.bfloat16),
                        jax.random.normal(k2, pool0.ssm_state.shape, jnp.float32))
        hidden = jax.random.normal(jax.random.key(5), (8, Bt, cfg.hidden_size), jnp.bfloat16)
        slots = jnp.arange(Bt, dtype=jnp.int32)
        outs = {}
        for mode in ("auto", "reference"):
            check_deadline()
            try:
                layer = NemotronMamba2Layer(norm, w, cfg, layer_idx=0, levers=ModelLevers(kernels=mode))
                calls = 8
                many = _many_decodes(slots, calls)
                pool = jax.tree.map(jnp.copy, pool0)
                out, pool = many(layer, pool, hidden)
                outs[mode] = np.asarray(out, np.float32)
                ts = []
                for _ in range(7):
                    t = time.perf_counter()
                    out, pool = many(layer, pool, hidden)
                    jax.block_until_ready(pool)
                    ts.append((time.perf_counter() - t) / calls * 1e6)
                us = statistics.median(ts)
                (out, pool), kt = gpu_kernels(many, layer, pool, hidden)
                del pool
                row["arms"][mode] = dict(us=us, gpu_us=per_call(kt, calls),
                                         frac_weight_floor=row["floor_weights_us"] / us,
                                         frac_weight_state_floor=row["floor_weights_state_us"] / us,
                                         kernels_per_call={k: v / calls for k, v in (kt or {}).items()})
                if kt:
                    log(f"    gpu {per_call(kt, calls):.1f} us/step: " + ", ".join(
                        f"{k}: {v / calls:.1f}" for k, v in sorted(kt.items(), key=lambda kv: -kv[1])[:10]))
                log(f"layer decode B={Bt:3d} {mode:10s} {us:9.1f} us  weight floor {row['floor_weights_us']:.1f} us "
                    f"({row['floor_weights_us'] / us:5.1%})")
            except Deadline:
                raise
            except Exception as e:  # noqa: BLE001
                row["arms"][mode] = dict(error=f"{type(e).__name__}: {str(e)[:2000]}")
                log(f"layer decode B={Bt} {mode} FAILED: {type(e).__name__}: {str(e)[:400]}")
                traceback.print_exc()
        if len(outs) == 2:
            row["rel_err_pallas_vs_reference"] = rel_err(outs["auto"], outs["reference"])


def _many_decodes(slots, calls):
    @functools.partial(jax.jit, donate_argnums=1)
    def many(layer, pool, hidden):
        out = None
        for i in range(calls):
            out, pool = layer.decode_multi_seq(pool, slots, hidden[i])
        return out, pool

    return many


# ---- report -------------------------------------------------------------------------------------------------
def _t(r: dict, key: str = "us") -> str:
    return "failed" if "error" in r else f"{r[key]:.1f}" if r.get(key) is not None else "-"


def table(results: dict) -> str:
    """Markdown tables: wall-clock and summed GPU kernel time per call, rates, errors vs the f32 reference."""
    bw = results.get("ceilings", {}).get("copy_bw_Bps", 4.3e12)
    out = [f"device {results.get('device')}, jax {results.get('jax')}, triton {results.get('triton')}, "
           f"copy ceiling {bw / 1e12:.2f} TB/s, {results.get('date')}", "",
           "| SSD prefill (B, T) | arm | wall (us) | GPU (us) | rel err y | rel err final |", "|---|---|---|---|---|---|"]
    for key, row in results["ssd"].items():
        for arm, r in row["arms"].items():
            err = "" if "error" in r else f"{r['rel_err_y']:.1e}"
            errh = "" if "error" in r or r.get("rel_err_final") is None else f"{r['rel_err_final']:.1e}"
            out.append(f"| ({row['B']}, {row['T']}) | {arm} | {_t(r)} | {_t(r, 'gpu_us')} | {err} | {errh} |")
    targets = {(1, 8192): 570.0, (1, 32768): 1620.0, (8, 4096): 1520.0}      # issue #9, microseconds
    out += ["", "| SSD (B, T) | target (us) | best mosaic (wall / GPU) | triton default | xla HIGHEST | jla |",
            "|---|---|---|---|---|---|"]
    for key, row in results["ssd"].items():
        arms = row["arms"]
        ok = {k: r for k, r in arms.items() if "error" not in r}
        mos = min((k for k in ok if k.startswith("mosaic")), key=lambda k: ok[k]["us"], default=None)
        cell = lambda k: "-" if k not in arms else _t(arms[k]) + (f" / {_t(arms[k], 'gpu_us')}" if k in ok else "")
        out.append(f"| ({row['B']}, {row['T']}) | {targets.get((row['B'], row['T']), '-')} | "
                   f"{mos or '-'}: {cell(mos) if mos else 'failed'} | {cell('pallas:default')} | "
                   f"{cell('xla_ref:HIGHEST')} | {cell('jla.mamba2_ssd')} |")
    out += ["", "| state update (512 slots) | arm | wall (us) | GPU (us) | GPU GB/s | of copy (GPU) |",
            "|---|---|---|---|---|---|"]
    for key, row in results["state_update"].items():
        for arm, r in row["arms"].items():
            g = r.get("gpu_us")
            rate = f"{row['bytes'] / g * 1e-3:.0f}" if g else "-"
            frac = f"{row['bytes'] / (g * 1e-6) / bw:.1%}" if g else "-"
            out.append(f"| batch {row['batch']}, {row.get('state_dtype', 'float32')} state | {arm} | {_t(r)} | "
                       f"{_t(r, 'gpu_us')} | {rate} | {frac} |")
    out += ["", "| layer decode step (bf16 weights) | arm | wall (us) | GPU (us) | weight floor (us) | of floor (wall) |",
            "|---|---|---|---|---|---|"]
    for key, row in results["layer_decode"].items():
        for arm, r in row["arms"].items():
            frac = "" if "error" in r else f"{row['floor_weights_us'] / r['us']:.0%}"
            out.append(f"| batch {row['batch']} | {arm} | {_t(r)} | {_t(r, 'gpu_us')} | "
                       f"{row['floor_weights_us']:.1f} | {frac} |")
    return "\n".join(out)


SSD_VARIANTS = {   # run 3's sweep, renamed for the default it led to (q64 p64 w4 s2 seg2048 cb_pre fast_exp)
    "default": None,
    "kernel_cb_exact_exp": SsdBlocks(cb_precomputed=False, fast_exp=False),
    "kernel_cb": SsdBlocks(cb_precomputed=False),
    "exact_exp": SsdBlocks(fast_exp=False),
    "q128_noseg": SsdBlocks(block_q=128, segment_tokens=0),
    "seg4096": SsdBlocks(segment_tokens=4096),
}
# the Mosaic GPU arm: left operands of the y and state products from registers (default) or via SMEM
MOSAIC_VARIANTS = {"regs": dict(a_regs=True), "smem": dict(a_regs=False)}
# run 2 swept UpdateBlocks(block_p 4..32, 2..8 warps) on the f32 state: all within 1% in GPU time, so only the
# default is timed unless --update-blocks names others (block_p x num_warps, e.g. 32x4,32x8)
UPDATE_VARIANTS = {"default": None}


def update_variants(spec: str) -> dict:
    """{"default": None} plus one UpdateBlocks per 'BPxW' item of spec."""
    variants = dict(UPDATE_VARIANTS)
    for item in filter(None, spec.split(",")):
        bp, w = (int(v) for v in item.split("x"))
        variants[f"p{bp}w{w}"] = su_mod.UpdateBlocks(block_p=bp, num_warps=w)
    return variants


SECTIONS = ("ceil", "ssd", "update", "layer")


def result_name(only: set, tiny: bool) -> str:
    """mamba.json for a run of every section, mamba_<sections>.json for a subset (mamba_ssd.json); _tiny for the
    CPU dry run."""
    unknown = only - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--only: unknown sections {sorted(unknown)} (known: {','.join(SECTIONS)})")
    subset = "" if only == set(SECTIONS) else "_" + "-".join(s for s in SECTIONS if s in only)
    return f"mamba{subset}{'_tiny' if tiny else ''}.json"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--deadline", type=float, default=float("inf"), help="seconds; later sections are skipped")
    ap.add_argument("--quick", action="store_true", help="one SSD shape, fewer variants")
    ap.add_argument("--only", default=",".join(SECTIONS), help="sections to run (a subset names the JSON)")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: small shapes, interpret mode")
    ap.add_argument("--triton-variants", default=",".join(SSD_VARIANTS),
                    help="SSD Triton variants to time (names of SSD_VARIANTS)")
    ap.add_argument("--mosaic-variants", default=",".join(MOSAIC_VARIANTS),
                    help="SSD Mosaic GPU variants to time (names of MOSAIC_VARIANTS; empty: none)")
    ap.add_argument("--state-dtypes", default="float32", help="update section: the pool dtypes, e.g. float32,bfloat16")
    ap.add_argument("--update-blocks", default="", help="update section: block_p x num_warps variants beside the "
                    "default, e.g. 32x4,32x8,64x8")
    ap.add_argument("--no-xla-default", action="store_true", help="skip the XLA reference at DEFAULT precision")
    ap.add_argument("--render", nargs="+", help="print the tables of saved JSON files and exit")
    args = ap.parse_args()
    if args.render:
        for path in args.render:
            with open(path) as fh:
                print(f"### {os.path.basename(path)}\n\n{table(json.load(fh))}\n")
        return
    global H, P, N, G, Q, SLOTS, HIDDEN, I
    ssd_shapes, batches = [(1, 8192), (1, 32768), (8, 4096)], (1, 8, 64, 256)
    if args.tiny:
        H, P, N, G, Q, SLOTS, HIDDEN, I = 8, 16, 16, 2, 16, 16, 64, True
        ssd_shapes, batches = [(1, 64), (2, 32)], (1, 4)
    DEADLINE[0] = args.deadline
    dev = jax.devices()[0]
    results = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=str(dev.device_kind),
                   platform=dev.platform, jax=jax.__version__, python=platform.python_version(),
                   shapes=dict(H=H, P=P, N=N, G=G, chunk=Q), method="wall clock around block_until_ready, "
                   "several calls queued per repeat, median of repeats", ssd={}, state_update={}, layer_decode={})
    try:
        import triton
        results["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    only = set(args.only.split(","))
    name = result_name(only, args.tiny)
    copy_bw = 4.2e12
    try:
        if "ceil" in only:
            results["ceilings"] = ceilings()
            copy_bw = results["ceilings"]["copy_bw_Bps"]
            log(f"copy {copy_bw / 1e12:.2f} TB/s, bf16 matmul {results['ceilings']['bf16_flops'] / 1e12:.0f} TF/s")
        if "update" in only:
            for dtype in args.state_dtypes.split(","):
                bench_state_update(results, batches, update_variants(args.update_blocks), copy_bw, jnp.dtype(dtype))
        if "layer" in only:
            bench_layer_decode(results, batches[:1] + batches[2:3], copy_bw)
        if "ssd" in only:
            shapes = ssd_shapes[:1] if args.quick else ssd_shapes
            tv = {"default": None} if args.quick else {k: SSD_VARIANTS[k] for k in args.triton_variants.split(",") if k}
            mv = {k: MOSAIC_VARIANTS[k] for k in args.mosaic_variants.split(",") if k}
            if I:      # interpret mode takes only SMEM left operands
                mv = {k: v for k, v in mv.items() if not v.get("a_regs")}
            bench_ssd(results, shapes, tv, args.quick, mv, xla_default=not args.no_xla_default)
    except Deadline:
        results["deadline_hit"] = True
        log("deadline reached: later sections skipped")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, name)
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    log(f"wrote {path}")
    print(table(results))


if __name__ == "__main__":
    main()
