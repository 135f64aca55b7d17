"""Build notebooks/*.ipynb from the cell sources in this file, with outputs cleared; or check them.

  python tools/make_notebooks.py           write notebooks/{quickstart,kernels,quantization,lora}.ipynb
  python tools/make_notebooks.py --check   exit 1 if a committed notebook differs from what this file builds

The notebooks are edited here (plain Python strings, reviewable as a diff) and never by hand;
tests/test_notebooks.py runs each one top to bottom on the CPU and fails on a stale or edited file.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "notebooks"


def md(text: str) -> tuple[str, str]:
    return "markdown", textwrap.dedent(text).strip("\n")


def code(text: str) -> tuple[str, str]:
    return "code", textwrap.dedent(text).strip("\n")


# ================================================================================================
# quickstart.ipynb
# ================================================================================================
QUICKSTART = [
    md("""
    # metrale-jax quickstart

    A tour of the library on the CPU, in well under a minute:

    1. the built-in model (a tiny byte-level Nemotron-H trained on the King James Bible, shipped in the package),
       and your own HF-layout checkpoint if `CHECKPOINT_DIR` below names one;
    2. `generate` and `score`;
    3. `prefill` / `decode` on the model's cache by hand;
    4. one Mamba-2 layer on its own: prefill, decode, the slot-indexed `SsmPool` and its allocator;
    5. a look inside the state with [treescope](https://treescope.readthedocs.io).

    Open it in Jupyter from a checkout (`jupyter lab notebooks/`); the tests run it headless.
    """),
    code("""
    import collections
    import os
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import treescope

    import metrale_jax as mj
    from metrale_jax.builtin import checkpoint_dtype
    from pallas_kernels import registry

    # An HF-layout Nemotron-H checkpoint directory to load as well; None skips that part.
    CHECKPOINT_DIR = os.environ.get("METRALE_NOTEBOOK_CHECKPOINT") or None

    print(f"metrale-jax {mj.__version__}, jax {jax.__version__}, backend {jax.default_backend()}")
    print("kernel implementations here:", dict(collections.Counter(registry.report().values())))
    """),
    md("""
    ## 1. The built-in model

    `load_builtin()` reads `metrale_jax/assets/tiny/` with `NemotronH.from_pretrained`, the same loader as any
    checkpoint. The pattern string has one character per block: `M` Mamba-2, `*` attention, `-` MLP, `E` MoE.
    """),
    code("""
    t0 = time.perf_counter()
    model = mj.load_builtin()
    c = model.config
    n_params = model.num_params
    print(f"loaded in {time.perf_counter() - t0:.2f} s from {mj.builtin_model_dir()}")
    print(f"{n_params / 1e6:.2f}M parameters, dtype {model.dtype}, vocab {c.vocab_size}, hidden {c.hidden_size}, "
          f"pattern {c.hybrid_override_pattern!r}")
    print(f"Mamba-2: {c.mamba_num_heads} heads x {c.mamba_head_dim}, state {c.ssm_state_size}, "
          f"groups {c.n_groups}, conv {c.conv_kernel}, SSD chunk {c.chunk_size}")
    for i, layer in enumerate(model.layers):
        print(f"  block {i} {c.hybrid_override_pattern[i]!r} {type(layer).__name__:24s} "
              f"ssm={layer.is_ssm_layer!s:5} replay_tail_split={layer.supports_replay_tail_split}")
    print(model.capabilities)
    """),
    md("""
    ## 2. Generate and score

    `generate` takes strings (the model has a tokenizer) or token-id lists; greedy at temperature 0, else top-p
    sampling. Each call compiles once per (batch, length) bucket, so the second call below reuses the first's
    executables.
    """),
    code("""
    prompts = ["And God said unto Moses,", "In the beginning"]
    t0 = time.perf_counter()
    greedy = model.generate(prompts, max_new_tokens=48)
    t1 = time.perf_counter()
    sampled = model.generate(prompts, max_new_tokens=48, temperature=0.8, top_p=0.9, seed=0)
    t2 = time.perf_counter()
    for p, g, s in zip(prompts, greedy, sampled):
        print(f"{p!r}\\n  greedy : {g.text!r} ({g.finish_reason})\\n  sampled: {s.text!r}")
    print(f"first call {t1 - t0:.1f} s (compiles), second {t2 - t1:.2f} s")
    """),
    md("""
    `score(ids, lengths)` gives `log p(ids[t+1] | ids[:t+1])` for right-padded rows, zero past each row's length.
    The byte-level model's bits per byte tell text it knows from text it has never seen.
    """),
    code("""
    texts = ["And God said, Let there be light: and there was light.",
             "And the LORD spake unto Moses, saying,",
             "The quick brown fox jumps over the lazy dog.",
             "qwzx vbnm kjhg fdsa"]
    rows = [model.tokenizer.encode(t) for t in texts]          # bos + one token per byte
    lengths = np.array([len(r) for r in rows])
    ids = np.zeros((len(rows), lengths.max()), np.int32)       # right-padded [B, T]
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    logprobs = np.asarray(model.score(ids, lengths))           # [B, T-1]
    assert np.all(logprobs[np.arange(ids.shape[1] - 1)[None, :] >= lengths[:, None] - 1] == 0)
    bits = -logprobs.sum(axis=1) / np.log(2) / (lengths - 1)
    for t, b in zip(texts, bits):
        print(f"{b:5.2f} bits/byte  {t!r}")
    assert bits[0] < bits[-1]
    """),
    md("""
    ### Your own checkpoint (optional)

    Set `CHECKPOINT_DIR` at the top (or the environment variable `METRALE_NOTEBOOK_CHECKPOINT`) to a directory
    holding `config.json` and `model.safetensors` (or shards with an index); quantized checkpoints (FP8, NVFP4) load
    the same way. It loads in its saved dtype; mind the memory of a large model on the CPU.
    """),
    code("""
    if CHECKPOINT_DIR is None:
        print("CHECKPOINT_DIR is not set: skipped (set METRALE_NOTEBOOK_CHECKPOINT=/path/to/checkpoint to run it)")
    else:
        t0 = time.perf_counter()
        ckpt = mj.NemotronH.from_pretrained(CHECKPOINT_DIR, dtype=checkpoint_dtype(CHECKPOINT_DIR))
        cc = ckpt.config
        print(f"{CHECKPOINT_DIR}: loaded in {time.perf_counter() - t0:.1f} s, {cc.num_hidden_layers} blocks "
              f"{cc.hybrid_override_pattern!r}, hidden {cc.hidden_size}, vocab {cc.vocab_size}, dtype {ckpt.dtype}")
        for note in ckpt.load_notes:
            print("  note:", note)
        prompt = prompts if ckpt.tokenizer is not None else [[cc.bos_token_id or 1]]
        for p, out in zip(prompt, ckpt.generate(prompt, max_new_tokens=48)):
            print(f"  {p!r} -> {out.text if out.text is not None else out.tokens!r} ({out.finish_reason})")
    """),
    md("""
    ## 3. Prefill and decode by hand

    `new_cache(max_slots, max_len)` makes a `ModelCache`: one pytree with the Mamba layers' `SsmPool`, the attention
    layers' `KvPool` and each slot's length. Slot `max_slots` is the padding slot. `prefill` takes right-padded
    rows; `decode` one token per sequence; both return the new cache (the old one is donated: do not reuse it).
    """),
    code("""
    from metrale_jax.runtime import bucket

    rows = [model.tokenizer.encode(p) for p in prompts]
    lengths = np.array([len(r) for r in rows])
    # the power-of-two shapes generate() pads to, so these calls reuse its compiled steps (any shape works)
    cache = model.new_cache(max_slots=2, max_len=bucket(lengths.max() + 48, 16))
    ids = np.zeros((2, bucket(lengths.max(), 8)), np.int32)     # right-padded [B, T]
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    slots = np.array([0, 1])
    logits, cache = model.prefill(cache, slots, ids, lengths)    # logits of each row's last token [B, V]
    out = [[] for _ in prompts]
    for _ in range(24):
        tok = np.asarray(jnp.argmax(logits, axis=-1))
        for o, t in zip(out, tok):
            o.append(int(t))
        logits, cache = model.decode(cache, slots, tok)
    for p, o, g in zip(prompts, out, greedy):
        print(f"{p!r} -> {model.tokenizer.decode(o)!r}")
        assert o == g.tokens[:24]                                # the same tokens as generate's greedy run
    print("seq_lens:", np.asarray(cache.seq_lens), "| cache bytes:", cache.nbytes)
    """),
    md("""
    ### Inside the cache

    `treescope.render_to_text` summarizes every array (dtype, shape, mean, spread, range, zeros) without a browser;
    in Jupyter, `treescope.display(cache)` shows the same tree as an interactive, foldable view. The padding slot
    (the last one) and every row past a sequence's length stay zero.
    """),
    code("""
    print(treescope.render_to_text(cache))
    treescope.display(cache)
    """),
    md("""
    ## 4. One Mamba-2 layer on its own

    A layer's entry points are pure functions of (its weights, an `SsmPool`, inputs) that return the new pool.
    The pool holds `conv_state [L, S, conv_dim, K-1]` and `ssm_state [L, S, H, P, N]` (float32) for L Mamba layers
    and S slots; `SlotAllocator.alloc` hands out a zeroed slot. Here the input is the embedding of two prompts,
    which is what block 0 sees inside the model.
    """),
    code("""
    layer = model.layers[0]
    assert isinstance(layer, mj.NemotronMamba2Layer)
    # Entry points are pure functions of (layer, pool, inputs): they jit like any JAX function, the layer (an NNX
    # module, hence a pytree) going in as an argument. Called directly (layer.prefill(...)) they run op by op.
    prefill = jax.jit(mj.NemotronMamba2Layer.prefill)
    decode = jax.jit(mj.NemotronMamba2Layer.decode)
    decode_multi_seq = jax.jit(mj.NemotronMamba2Layer.decode_multi_seq)

    pool = mj.SsmPool.for_config(c, max_slots=3, dtype=model.dtype)     # 3 slots + the padding slot
    alloc = mj.SlotAllocator(pool.num_slots)
    a, pool = alloc.alloc(pool)
    b, pool = alloc.alloc(pool)
    print(f"slots {a}, {b}; free {alloc.free_count}; padding slot {alloc.padding_slot}; pool {pool.nbytes} bytes")

    emb = model.embeddings[...]
    ha = emb[jnp.asarray(model.tokenizer.encode("In the beginning God created"))]    # [T, D]
    hb = emb[jnp.asarray(model.tokenizer.encode("And the LORD said unto Moses"))]   # same length: one compile

    # prefill all but the last token of each sequence, then decode both last tokens in one batched call
    ya, pool = prefill(layer, pool, a, ha[:-1])
    yb, pool = prefill(layer, pool, b, hb[:-1])
    y_last, pool = decode_multi_seq(layer, pool, jnp.array([a, b]), jnp.stack([ha[-1], hb[-1]]))

    # the same sequence prefilled in one call, in a fresh pool
    ref, ref_pool = prefill(layer, mj.SsmPool.for_config(c, max_slots=1, dtype=model.dtype), 0, ha)
    f32 = lambda x: np.asarray(x, np.float32)
    d_out = np.abs(f32(y_last[0]) - f32(ref[-1])).max()
    d_state = np.abs(f32(pool.ssm_state[0, a]) - f32(ref_pool.ssm_state[0, 0])).max()
    print(f"prefill T-1 + decode vs prefill T: max |diff| output {d_out:.2e}, state {d_state:.2e}")
    assert d_out < 0.05 and d_state < 1e-4
    """),
    md("""
    Snapshots copy one slot's rows (every Mamba layer); `restore` writes them back. This is how the prefix cache
    and speculative rollback rewind a sequence.
    """),
    code("""
    snap = pool.snapshot(a)                                   # SlotState(conv [L, C, K-1], ssm [L, H, P, N])
    y1, pool = decode(layer, pool, a, hb[-1])                 # advance slot a by one more token ...
    pool = pool.restore(a, snap)                              # ... and rewind it
    y2, pool = decode(layer, pool, a, hb[-1])
    assert np.array_equal(f32(y1), f32(y2))
    alloc.release(b)
    print("after release:", alloc.free_count, "free; in use", sorted(alloc.in_use))
    print(treescope.render_to_text(snap))
    """),
    md("""
    ### Inside the pool and the layer

    The layer is a Flax NNX module (so a pytree); treescope shows its weights and which projection arms are
    installed (`dense` here; see `quantization.ipynb` for the others). `render_array` draws one slot's SSM
    state (heads x head_dim, first state column) as a heat map.
    """),
    code("""
    print(treescope.render_to_text(pool))
    print("arms:", layer.active_arm("decode", 1), layer.active_arm("prefill", 64))
    treescope.display(layer)
    treescope.render_array(pool.ssm_state[0, a, :, :, 0], axis_labels={0: "head", 1: "head_dim"})
    """),
]


# ================================================================================================
# kernels.ipynb
# ================================================================================================
KERNELS = [
    md("""
    # Kernels: each Pallas kernel against its reference, and the H200 numbers

    Every kernel in `pallas_kernels/` is a Pallas (Triton) kernel with a plain-jnp reference beside it, registered
    under one name. Here, on the CPU:

    1. which implementation each name resolves to, per mode and platform;
    2. each Mamba-2 kernel in **interpret mode** (the Pallas program run by the CPU) against its reference on
       small shapes, and the SSD scan against a float64 numpy recurrence;
    3. the quantized projection kernels the same way;
    4. the benchmark results of `benchmarks/results/*.json` (NVIDIA H200) as plots.
    """),
    code("""
    import glob
    import json
    import os
    import time
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    import matplotlib.pyplot as plt
    import numpy as np

    from metrale_jax.errors import KernelUnavailableError
    from metrale_jax.weights import quant_formats as qf
    from pallas_kernels import registry

    # this checkout's benchmark results, from the repository root (the tests) or notebooks/ (where Jupyter starts)
    RESULTS = next((str(p) for p in (Path("benchmarks/results"), Path("../benchmarks/results")) if p.is_dir()), None)
    assert RESULTS is not None, f"benchmarks/results not found from {os.getcwd()}: run from a checkout of the repo"
    rng = np.random.default_rng(0)


    def rel_err(a, b):
        \"\"\"||a - b|| / ||b|| in float64.\"\"\"
        a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
        b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


    def normal(*shape, dtype=jnp.float32):
        return jnp.asarray(rng.standard_normal(shape), dtype)


    print(f"jax {jax.__version__}, backend {jax.default_backend()}")
    """),
    md("""
    ## 1. The registry

    `registry.resolve(name, mode, platform)` picks an implementation; the mode comes from `ModelLevers.kernels` or
    `METRALE_KERNELS` (`auto | pallas | interpret | reference`). `auto` takes the compiled Pallas kernel on the GPU
    where one is registered and the reference elsewhere; `pallas` insists on the kernel; `interpret` runs the
    Pallas program on any backend (slow, for tests). A name that does not resolve is a `KernelUnavailableError`
    at install time (see `quantization.ipynb`), never at the first token.
    """),
    code("""
    def impl(name, mode, platform):
        try:
            return registry.resolve(name, mode, platform=platform).impl
        except KernelUnavailableError:
            return "-"

    columns = [("auto", "cpu"), ("auto", "gpu"), ("pallas", "cpu"), ("pallas", "gpu"), ("interpret", "cpu"),
               ("reference", "gpu")]
    print(f"{'kernel':22s}" + "".join(f"{m + '@' + p:>14s}" for m, p in columns))
    for name in registry.names():
        print(f"{name:22s}" + "".join(f"{impl(name, m, p):>14s}" for m, p in columns))
    here = registry.report()                 # this machine, mode from METRALE_KERNELS (default auto)
    print(f"\\nhere ({jax.default_backend()}, mode {registry.default_mode()}):",
          {impl: sum(v == impl for v in here.values()) for impl in sorted(set(here.values()))})
    """),
    md("""
    ## 2. Mamba-2 kernels in interpret mode

    Small shapes, float32 inputs, three packed sequences of which one is empty (`cu_seqlens`), random initial
    states. Each line prints the relative error `||pallas - reference|| / ||reference||` of every output.
    """),
    code("""
    def check(name, ref_out, pallas_out, labels):
        ref_out = ref_out if isinstance(ref_out, tuple) else (ref_out,)
        pallas_out = pallas_out if isinstance(pallas_out, tuple) else (pallas_out,)
        errs = {l: rel_err(p, r) for l, p, r in zip(labels, pallas_out, ref_out)}
        print(f"{name:22s} " + "  ".join(f"{l} {e:.1e}" for l, e in errs.items()))
        assert all(e < 1e-5 for e in errs.values()), errs
        return errs


    def both(name, *args, **kw):
        \"\"\"(reference under jit, Pallas kernel in interpret mode) on the same inputs.\"\"\"
        ref = registry.get(name, "reference")
        return jax.jit(lambda *a: ref(*a, **kw))(*args), registry.get(name, "interpret")(*args, **kw)


    H, P, G, N, K = 4, 16, 2, 16, 4                     # heads, head dim, groups, state size, conv width
    lens = [37, 0, 50]
    T, S = sum(lens), len(lens)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    A = jnp.asarray(-np.exp(rng.uniform(-1.0, 1.5, H)), jnp.float32)
    D, dt_bias = normal(H), 0.5 * normal(H)

    # SSD chunked scan (prefill): x [T, H, P], dt [T, H], B/C [T, G, N] -> y [T, H, P], final states [S, H, P, N]
    x, dt = normal(T, H, P), jnp.asarray(rng.uniform(-4.0, 1.0, (T, H)), jnp.float32)
    Bm, Cm, h0 = normal(T, G, N), normal(T, G, N), normal(S, H, P, N)
    ssd_kw = dict(A=A, B=Bm, C=Cm, D=D, dt_bias=dt_bias, initial_states=h0, cu_seqlens=cu, chunk_size=16)
    t0 = time.perf_counter()
    r, p = both("ssd_scan", x, dt, **ssd_kw)
    check("ssd_scan", (r.y, r.final_states), (p.y, p.final_states), ("y", "final_state"))

    # decode state update: one token for each of 3 sequences, state rows gathered from / scattered to a pool
    pool = normal(6, H, P, N)
    rows = jnp.asarray([3, 0, 5], jnp.int32)
    step = dict(x=normal(3, H, P), dt=jnp.asarray(rng.uniform(-3.0, 1.0, (3, H)), jnp.float32), A=A,
                B=normal(3, G, N), C=normal(3, G, N), D=D, dt_bias=dt_bias)
    check("state_update", *both("state_update", pool, rows, **step), ("y", "pool"))

    # k = 4 tokens per sequence with the state after each (speculative verify)
    steps = dict(x=normal(3, 4, H, P), dt=jnp.asarray(rng.uniform(-3.0, 1.0, (3, 4, H)), jnp.float32), A=A,
                 B=normal(3, 4, G, N), C=normal(3, 4, G, N), D=D, dt_bias=dt_bias)
    check("state_update_multi", *both("state_update_multi", pool, rows, **steps), ("y", "states", "pool"))

    # causal conv1d + silu over packed sequences from their conv states, and its one-token update on pool rows
    C = 40
    w, bias = normal(C, K), normal(C)
    check("causal_conv1d", *both("causal_conv1d", normal(T, C), w, bias, initial_states=normal(S, C, K - 1),
                                 cu_seqlens=cu), ("y", "final_state"))
    check("causal_conv1d_update", *both("causal_conv1d_update", normal(6, C, K - 1), rows, normal(3, C), w, bias),
          ("y", "pool"))

    # RMSNorm and the gated group RMSNorm (rmsnorm_group(y * silu(z)) * w)
    check("rmsnorm", *both("rmsnorm", normal(7, 48), normal(48), eps=1e-5), ("y",))
    check("gated_rmsnorm", *both("gated_rmsnorm", normal(7, 48), normal(7, 48), normal(48), group_size=16,
                                 eps=1e-5), ("y",))

    # decode attention: one query per sequence over the positions its slot holds in a key/value pool
    # [layers, slots, max_len, KV heads, head dim] (the kernel reads those only; the reference gathers the slot)
    kv = normal(2, 6, 40, 2, 16), normal(2, 6, 40, 2, 16)
    check("decode_attention", *both("decode_attention", normal(3, 2, 2, 16), *kv, rows,
                                    jnp.asarray([40, 1, 17], jnp.int32), layer=1, scale=0.25), ("out",))
    print(f"({time.perf_counter() - t0:.1f} s)")
    """),
    md("""
    ### The SSD scan against the recurrence it stands for

    Per head, with `dt' = softplus(dt + dt_bias)`: `S_t = exp(dt'_t A) S_{t-1} + dt'_t x_t B_t^T`,
    `y_t = S_t C_t + D x_t`. Written token by token in float64 numpy, for each sequence from its initial state:
    """),
    code("""
    def recurrence(x, dt, A, B, C, D, dt_bias, h):
        x, dt, B, C, h = (np.asarray(v, np.float64) for v in (x, dt, B, C, h))
        rep = x.shape[1] // B.shape[1]
        B, C = np.repeat(B, rep, axis=1), np.repeat(C, rep, axis=1)            # groups -> heads
        d = np.logaddexp(0.0, dt + np.asarray(dt_bias, np.float64))            # softplus
        y = np.zeros_like(x)
        for t in range(x.shape[0]):
            h = np.exp(d[t] * np.asarray(A, np.float64))[:, None, None] * h + \\
                d[t][:, None, None] * x[t][:, :, None] * B[t][:, None, :]
            y[t] = np.einsum("hpn,hn->hp", h, C[t]) + np.asarray(D, np.float64)[:, None] * x[t]
        return y, h


    for s, (lo, hi) in enumerate(zip(np.asarray(cu[:-1]), np.asarray(cu[1:]))):
        y64, h64 = recurrence(x[lo:hi], dt[lo:hi], A, Bm[lo:hi], Cm[lo:hi], D, dt_bias, h0[s])
        e_y = rel_err(p.y[lo:hi], y64) if hi > lo else 0.0
        e_h = rel_err(p.final_states[s], h64)
        print(f"sequence {s} ({hi - lo:2d} tokens): pallas vs float64  y {e_y:.1e}  final state {e_h:.1e}")
        assert e_y < 1e-5 and e_h < 1e-5
    """),
    md("""
    ## 3. Quantized projection kernels

    The same check for the kernels behind the projection arms (`quantization.ipynb` shows which arm serves which
    call). Weights quantized with the library's own recipes: block FP8 (128 x 128 scales), FP8 per row (the
    pre-dequantized prefill copy) and NVFP4 (E2M1 with an E4M3 scale per 16 and a global scale). The last column is
    the reference against the unquantized product: the quantization error itself, not a kernel error.
    """),
    code("""
    M, Nq, Kq = 4, 192, 256
    xq = normal(M, Kq, dtype=jnp.bfloat16)
    wq = rng.standard_normal((Nq, Kq)).astype(np.float32)
    exact = np.asarray(xq, np.float32) @ wq.T
    fp8_block = tuple(map(jnp.asarray, qf.quantize_fp8_block(wq)))        # E4M3 [N, K], scale [N/128, K/128]
    fp8_rows = tuple(map(jnp.asarray, qf.quantize_fp8_rows(wq)))          # E4M3 [N, K], scale [N]
    packed, scale, gscale = map(jnp.asarray, qf.quantize_nvfp4(wq))       # u8 [N, K/2], E4M3 [N, K/16], f32
    cases = {
        "w8a16_gemv": fp8_block, "w8a16_gemm": fp8_block, "w8a16_gemm_pipelined": fp8_block,
        "fp8_gemm_t": fp8_rows,
        "w4a16_gemv": (packed, scale, gscale), "w4a16_gemm": (packed, scale, gscale),
        "w4a16_gemm_t": (packed.T, scale.T, gscale), "w4a16_gemm_t_m128": (packed.T, scale.T, gscale),
        "w4a4_gemm": (packed, scale, gscale),
    }
    t0 = time.perf_counter()
    print(f"{'kernel':22s} {'pallas vs ref':>14s} {'ref vs exact':>14s}")
    for name, args in cases.items():
        ref = registry.get(name, "reference")(xq, *args, out_dtype=jnp.float32)
        out = registry.get(name, "interpret")(xq, *args, out_dtype=jnp.float32)
        e = rel_err(out, ref)
        print(f"{name:22s} {e:14.1e} {rel_err(ref, exact):14.1e}")
        assert e < 1e-5
    print(f"({time.perf_counter() - t0:.1f} s)")
    """),
    md("""
    ## 4. Benchmark results (NVIDIA H200)

    The JSON files under `benchmarks/results/` are written by `benchmarks/bench_*.py` on the GPU machine; the plots
    below read whatever fields they hold. Times are GPU kernel time from the profiler (`gpu_us`) where recorded,
    else wall clock.
    """),
    code("""
    def load(*patterns):
        \"\"\"{file name: contents} of the files matching the patterns (one per benchmark variant), oldest first
        by the date each holds.\"\"\"
        files = {os.path.basename(f): json.load(open(f)) for p in patterns for f in glob.glob(os.path.join(RESULTS, p))}
        return dict(sorted(files.items(), key=lambda item: str(item[1].get("date", ""))))


    def latest(results):
        return list(results.items())[-1] if results else ("none", {})


    mamba = load("mamba.json", "mamba_*.json")  # bench_mamba.py: every section, and runs of some (--only)
    quant = load("quant*.json")
    runtime = load("runtime_*.json")
    tp = load("tp*.json")
    for name, d in {**mamba, **quant, **runtime, **tp}.items():
        versions = d.get("versions") or {k: d[k] for k in ("jax", "triton") if k in d}
        print(f"{name:34s} {d.get('device', '?'):12s} {str(d.get('date', '?'))[:19]:20s} {versions}")


    def t_us(arm):
        return arm.get("gpu_us") or arm.get("us")
    """),
    md("""
    ### SSD prefill: time per arm

    Each shape's arms from the newest run that measured them (a baseline only found in an older run is labelled
    with it). `pallas:*` are variants of the Pallas kernel (in the 2026-11-30 runs, `pallas:default` is the
    previous default and `cb_pre_fast_exp` today's: `benchmarks/notes/ssd_scan.md`); `xla_ref` is
    the jnp reference under `jax.jit` (HIGHEST / DEFAULT matmul precision), `jla.mamba2_ssd` the
    jax-linear-attention package's Mosaic GPU kernel. The dotted lines are the floors: bytes moved at the measured
    copy bandwidth, and FLOPs at the measured bf16 matmul rate.
    """),
    code("""
    runs = list(mamba.items())
    newest_name, newest = latest(mamba)
    shapes = list(newest.get("ssd", {}))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.2 * len(shapes), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        arms = {}
        for fname, run in runs:                                  # older first: newer runs overwrite
            tag = fname.removesuffix(".json")
            for arm, v in run.get("ssd", {}).get(shape, {}).get("arms", {}).items():
                if t_us(v):                                      # arms that failed hold an "error" instead
                    arms[arm] = (t_us(v) / 1e3, tag)
        newest_tag = newest_name.removesuffix(".json")
        keep = {a: v for a, v in arms.items() if v[1] == newest_tag or not a.startswith("pallas")}
        names = sorted(keep, key=lambda a: keep[a][0])
        colors = ["tab:blue" if a.startswith("pallas") else "tab:gray" if a.startswith("xla") else "tab:green"
                  for a in names]
        ax.barh(range(len(names)), [keep[a][0] for a in names], color=colors)
        ax.set_yticks(range(len(names)),
                      [a if keep[a][1] == newest_tag else f"{a} ({keep[a][1]})" for a in names], fontsize=8)
        info, ceil = newest["ssd"][shape], newest.get("ceilings", {})
        if "bytes" in info and "copy_bw_Bps" in ceil:
            ax.axvline(info["bytes"] / ceil["copy_bw_Bps"] * 1e3, ls=":", c="k", label="bytes floor")
        if "flops" in info and "bf16_flops" in ceil:
            ax.axvline(info["flops"] / ceil["bf16_flops"] * 1e3, ls=":", c="r", label="bf16 FLOP floor")
        ax.set_xscale("log")
        ax.set_xlabel("ms (log)")
        ax.set_title(f"SSD prefill (B, T) = ({info.get('B')}, {info.get('T')})")
        ax.legend(fontsize=7, loc="lower right")
    shp = newest.get("shapes", {})
    fig.suptitle(f"{newest.get('device')}: H={shp.get('H')} P={shp.get('P')} N={shp.get('N')} G={shp.get('G')}, "
                 f"chunk {shp.get('chunk')} ({newest_name})")
    fig.tight_layout()
    plt.show()
    """),
    md("""
    ### Decode state update: bandwidth against batch

    Bytes read and written per call (the state rows of the batch, f32) over GPU time, against the copy ceiling
    measured in the same run.
    """),
    code("""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    su_name, su_run = latest({name: run for name, run in mamba.items() if run.get("state_update")})
    su = su_run.get("state_update", {})
    by_arm = {}
    for entry in su.values():
        for arm, v in entry.get("arms", {}).items():
            if t_us(v):
                by_arm.setdefault(arm, []).append((entry["batch"], entry["bytes"] / (t_us(v) * 1e-6) / 1e9))
    for arm, pts in sorted(by_arm.items()):
        pts.sort()
        ax.plot([b for b, _ in pts], [g for _, g in pts], "o-", label=arm)
    ceil = su_run.get("ceilings", {}).get("copy_bw_Bps")
    if ceil:
        ax.axhline(ceil / 1e9, ls=":", c="k", label=f"copy ceiling {ceil / 1e12:.2f} TB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("GB/s (GPU time)")
    ax.set_title(f"state_update, {su_run.get('device')} ({su_name})")
    ax.legend(fontsize=8)
    plt.show()
    for arm, pts in sorted(by_arm.items()):
        print(f"{arm:18s}", "  ".join(f"B={b}: {g:6.0f} GB/s" for b, g in pts))
    """),
    md("""
    ### Quantized GEMV / GEMM against XLA BF16

    `bench_quant.py` times each kernel at the Nemotron-H-8B Mamba projections (`in_proj` N=18560 K=4096, `out_proj`
    N=4096 K=8192) for decode (M = 1) and prefill (M = 4096), with XLA's BF16 matmul (`xla_bf16`) measured in the
    same run as the baseline. Bars left of the baseline's line are faster than BF16.
    """),
    code("""
    q_name, q = latest(quant)
    items = [it for it in q.get("items", []) if it.get("kind") in ("baseline", "decode", "prefill", "context")]
    proj_shapes = sorted({it["shape"] for it in items})
    fig, axes = plt.subplots(len(proj_shapes), 2, figsize=(12, 3.6 * len(proj_shapes)), squeeze=False)
    for row, shape in zip(axes, proj_shapes):
        for ax, M in zip(row, (1, 4096)):
            sel = [it for it in items if it["shape"] == shape and it["M"] == M]
            base = [it for it in sel if it["kind"] == "baseline"]
            sel.sort(key=lambda it: it["us"])
            ax.barh(range(len(sel)), [it["us"] for it in sel],
                    color=["tab:gray" if it["kind"] == "baseline" else "tab:orange" if it["format"] == "fp8" or
                           it["format"] == "fp8_rows" else "tab:purple" for it in sel])
            ax.set_yticks(range(len(sel)), [f"{it['kernel']} [{it['format']}]" for it in sel], fontsize=8)
            if base:
                ax.axvline(base[0]["us"], ls=":", c="k")
            if sel:
                ax.set_title(f"{shape} N={sel[0]['N']} K={sel[0]['K']}, M={M}", fontsize=10)
            ax.set_xlabel("us")
    fig.suptitle(f"quantized projections, {q.get('device')} ({q_name})")
    fig.tight_layout()
    plt.show()
    for it in items:
        if "speedup_vs_xla_bf16" in it and it["M"] in (1, 4096):
            print(f"{it['shape']:8s} M={it['M']:<5d} {it['kernel']:48s} {it['us']:8.1f} us  "
                  f"x{it['speedup_vs_xla_bf16']:.2f} vs XLA BF16")
    """),
    md("""
    ### Tensor-parallel scaling and the whole model

    `bench_tp.py`: the Nemotron-H-8B shapes with random BF16 weights on 1 and 2 GPUs (one all-reduce per block).
    `bench_e2e_decode.py`: one GPU, decode throughput against batch: what `Engine.generate` delivers, the compiled
    decode step chained on the device, and the bytes floor (float32 Mamba state here; `e2e_decode.json` also holds
    the bfloat16-state rows).
    """),
    code("""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    t_name, t = latest(tp)
    workloads = {}
    for run in t.get("runs", []):
        for d in run.get("decode", []):
            workloads.setdefault(f"decode B={d['batch']}", {})[run["tp"]] = d["tokens_per_s"]
        for p in run.get("prefill", []):
            workloads.setdefault(f"prefill {p['batch']}x{p['length']}", {})[run["tp"]] = p["tokens_per_s"]
    tps = sorted({run["tp"] for run in t.get("runs", [])})
    width = 0.8 / max(len(tps), 1)
    for i, n in enumerate(tps):
        vals = [workloads[w].get(n, np.nan) for w in workloads]
        ax1.bar(np.arange(len(workloads)) + i * width, vals, width, label=f"{n} GPU" + ("s" if n > 1 else ""))
    for j, w in enumerate(workloads):
        if 1 in workloads[w] and 2 in workloads[w]:
            ax1.text(j + width, workloads[w][2], f"x{workloads[w][2] / workloads[w][1]:.2f}", ha="center",
                     va="bottom", fontsize=8)
    ax1.set_xticks(np.arange(len(workloads)) + width * (len(tps) - 1) / 2, list(workloads))
    ax1.set_yscale("log")
    ax1.set_ylabel("tokens/s (log)")
    ax1.set_title(f"tensor parallel, {t.get('device')} ({t.get('dtype')})")
    ax1.legend()

    e2e_path = os.path.join(RESULTS, "e2e_decode.json")
    e2e = json.load(open(e2e_path)) if os.path.exists(e2e_path) else {"rows": []}
    rows = [row for row in e2e["rows"] if row["state_dtype"] == "float32"]
    for i, w in enumerate(dict.fromkeys(row["weights"] for row in rows)):
        mine = sorted((row for row in rows if row["weights"] == w), key=lambda row: row["batch"])
        b = [row["batch"] for row in mine]
        ax2.plot(b, [row["engine_tok_s"] for row in mine], "o-", color=f"C{i}", label=f"{w}: Engine")
        ax2.plot(b, [row["device_tok_s"] for row in mine], "x--", color=f"C{i}", label=f"{w}: device step")
        ax2.plot(b, [row["floor_tok_s"] for row in mine], ":", color=f"C{i}", label=f"{w}: bytes floor")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("batch")
    ax2.set_ylabel("tokens/s (log)")
    ax2.set_title(f"decode, 1 GPU, float32 Mamba state ({str(e2e.get('date', 'no run'))[:10]})", fontsize=10)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    plt.show()
    print("tensor-parallel speedups:", t.get("ratios"))
    """),
]


# ================================================================================================
# quantization.ipynb
# ================================================================================================
QUANTIZATION = [
    md("""
    # Quantization: FP8 and NVFP4 on the built-in model

    1. `quantize_checkpoint` writes the built-in model as block FP8, ModelOpt per-tensor FP8 and ModelOpt NVFP4;
    2. what each file holds, and how far each weight moved;
    3. logits of the quantized weights against the original ones;
    4. which projection arm (and kernel) serves which call on a Mamba-2 layer, and each arm's output against BF16;
    5. the install-time checks (wrong FP8 tag, a kernel that does not resolve);
    6. `NemotronH.from_pretrained` on the quantized directories, where it is supported.

    On the CPU every arm runs its jnp reference (dequantize, then matmul); on a GPU the same calls run the Pallas
    kernels. Runs in well under a minute.
    """),
    code("""
    import dataclasses
    import os
    import tempfile
    import time
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    import numpy as np

    import metrale_jax as mj
    from metrale_jax.config import ModelConfig
    from metrale_jax.layers.projection import Projection
    from metrale_jax.weights.checkpoint import expected_tensors
    from metrale_jax.weights.containers import fp8_prefill_copy
    from metrale_jax.weights.quant_config import load_linear, read_quant_config
    from metrale_jax.weights.quantize import LINEAR_MODULES, quantize_checkpoint
    from metrale_jax.weights.safetensors_io import CheckpointReader
    from pallas_kernels import registry


    def rel_err(a, b):
        a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
        b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


    src = mj.builtin_model_dir()
    work = Path(tempfile.mkdtemp(prefix="metrale-quant-"))
    print(f"source {src}\\nwriting to {work}")
    """),
    md("""
    ## 1. Quantize

    Linear layers (`in_proj`, `out_proj`, `q/k/v/o_proj`, `up/down_proj` of MLPs and experts) are quantized; the
    embeddings, `lm_head` (excluded by default), norms, conv, router and `A_log` / `D` / `dt_bias` are copied. The
    config says what the files hold: `config.json`'s `quantization_config`, plus `hf_quant_config.json` for the
    ModelOpt formats.
    """),
    code("""
    FORMATS = ("fp8-block", "fp8", "nvfp4")
    qdirs = {}
    for fmt in FORMATS:
        summary = quantize_checkpoint(src, work / fmt, fmt)
        qdirs[fmt] = work / fmt
        print(f"{fmt:10s} {summary['quantized_modules']} modules, excluded {summary['exclude_modules']}, "
              f"files {sorted(p.name for p in qdirs[fmt].iterdir())}")
        print(f"{'':10s} read back as {read_quant_config(qdirs[fmt])}")
    """),
    md("""
    ## 2. What the files hold
    """),
    code("""
    module = "backbone.layers.0.mixer.in_proj"
    for name, d in {"original": src, **qdirs}.items():
        r = CheckpointReader(d)
        size = sum(p.stat().st_size for p in Path(d).glob("*.safetensors"))
        tensors = ", ".join(f"{k.removeprefix(module)} {r.info(k)[0]}{list(r.info(k)[1])}"
                            for k in sorted(r.keys()) if k.startswith(module + "."))
        print(f"{name:10s} {size / 1e6:5.2f} MB | {module}: {tensors}")
        r.close()
    """),
    md("""
    `load_linear` turns one module's tensors into its weight container (`DenseWeight`, `Fp8Weight` tagged
    `FP8_BLOCK_SCALED` or `FP8_PER_TENSOR`, `Nvfp4Weight`), checked against the config; `dequantize()` gives the
    matrix it stands for. The relative error of each linear weight against the original:
    """),
    code("""
    config = ModelConfig.from_hf(src)
    reader = CheckpointReader(src)
    original = {n: np.asarray(reader.get(n), np.float32) for n in expected_tensors(config)}
    reader.close()


    def is_linear(name):
        return name.endswith(".weight") and name[:-len(".weight")].rsplit(".", 1)[-1] in LINEAR_MODULES


    dequantize = jax.jit(lambda w: w.dequantize(jnp.float32))         # containers are pytrees


    def dequantized_tensors(d):
        \"\"\"Every tensor of checkpoint d under its HF name, quantized linear weights dequantized to float32.\"\"\"
        r, qcfg = CheckpointReader(d), read_quant_config(d)
        out = {n: np.asarray(dequantize(load_linear(r, n[:-len(".weight")], None, qcfg)))
               if is_linear(n) else np.asarray(r.get(n), np.float32) for n in expected_tensors(config)}
        r.close()
        return out


    dequantized = {fmt: dequantized_tensors(d) for fmt, d in qdirs.items()}
    linear = [n for n in original if is_linear(n)]
    print(f"{'format':10s} {'median':>8s} {'max':>8s}   (relative error of the {len(linear)} linear weights)")
    for fmt, t in dequantized.items():
        errs = [rel_err(t[n], original[n]) for n in linear]
        print(f"{fmt:10s} {np.median(errs):8.4f} {np.max(errs):8.4f}")
    """),
    md("""
    ## 3. Logits

    To see what the weights' quantization alone does to the model, each dequantized checkpoint is built as a float32
    `NemotronH` and compared with the original weights in float32 (the BF16 model as loaded is shown for scale:
    its error is bf16 rounding of weights and activations). Top-1 agreement is the share of positions whose most
    likely next byte is unchanged; bits per byte are the model's on this text.
    """),
    code("""
    text = ("And it came to pass, when the men of the city saw it, that they arose and went out against the "
            "house of the LORD; and the LORD was with them.")
    tok = mj.load_tokenizer(src, config)
    ids = np.array([tok.encode(text)])


    def report(name, logits, ref):
        logits = np.asarray(logits, np.float64)
        m = logits.max(-1, keepdims=True)
        lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))          # log-softmax
        bits = -lp[0, np.arange(ids.shape[1] - 1), ids[0, 1:]].mean() / np.log(2)
        agree = (logits.argmax(-1) == ref.argmax(-1)).mean()
        print(f"{name:14s} logits rel err {rel_err(logits, ref):.4f}   top-1 agreement {agree:6.1%}   "
              f"{bits:.3f} bits/byte")


    t0 = time.perf_counter()
    ref = np.asarray(mj.NemotronH(config, original, dtype=jnp.float32).forward(ids), np.float64)
    report("original f32", ref, ref)
    report("original bf16", mj.load_builtin().forward(ids), ref)
    for fmt, t in dequantized.items():
        report(fmt, mj.NemotronH(config, t, dtype=jnp.float32).forward(ids), ref)
    print(f"({time.perf_counter() - t0:.1f} s)")
    """),
    md("""
    ## 4. Which arm serves which call

    A `Projection` holds whichever weight copies (arms) were installed and takes the first that applies, in a fixed
    order per phase (`docs/API.md` has the table):

    * decode: `dense` > `fp8_native` > `w4a4` > `nvfp4`
    * prefill: `dense` > `fp8_native` (if installed with prefill=True) > `w4a4` > `fp8_prefill` >
      `nvfp4_t` > `nvfp4`

    Here Mamba-2 block 0 is rebuilt from each checkpoint's containers (the rest of its weights as in the original).
    The constructor installs each container in the arm its type names. The layer's input is the text's embedding,
    exactly what block 0 sees inside the model; errors are of the mixer's output (layer output minus the residual)
    against the BF16 layer.
    """),
    code("""
    model = mj.load_builtin()
    bf16_layer = model.layers[0]
    hidden = model.embeddings[...][jnp.asarray(ids[0])]                   # [T, D] bf16


    def containers(fmt, layer_idx=0, fp8_to_block=False):
        r, qcfg = CheckpointReader(qdirs[fmt]), read_quant_config(qdirs[fmt])
        p = f"backbone.layers.{layer_idx}.mixer."
        out = {k: load_linear(r, p + k, None, qcfg, fp8_to_block=fp8_to_block) for k in ("in_proj", "out_proj")}
        r.close()
        return out


    def mamba_layer(w, levers=None):
        weights = dataclasses.replace(bf16_layer.ssm_weights(), in_proj=w["in_proj"], out_proj=w["out_proj"])
        return mj.NemotronMamba2Layer(bf16_layer.input_norm[...], weights, config, 0, levers=levers)


    def run(layer):
        \"\"\"(prefill of all tokens but the last, then decode of the last): the mixer's outputs.\"\"\"
        pool = mj.SsmPool.for_config(config, max_slots=1, dtype=model.dtype)
        y, pool = layer.prefill(pool, 0, hidden[:-1])
        y_dec, pool = layer.decode(pool, 0, hidden[-1])
        return y - hidden[:-1], y_dec - hidden[-1]


    def serving(layer, phase, tokens):
        return " / ".join(f"{p.active_arm(phase, tokens)} ({p.active_kernel(phase, tokens)})"
                          for p in (layer.in_proj, layer.out_proj))


    def show(label, layer):
        y, y_dec = run(layer)
        print(f"{label}\\n  decode      : {serving(layer, 'decode', 1)}\\n"
              f"  prefill 64  : {serving(layer, 'prefill', 64)}\\n  prefill 256 : {serving(layer, 'prefill', 256)}\\n"
              f"  mixer rel err vs BF16: prefill {rel_err(y, y_ref):.4f}, decode {rel_err(y_dec, y_dec_ref):.4f}")


    y_ref, y_dec_ref = run(bf16_layer)
    show("bf16 (as loaded)   [in_proj / out_proj]", bf16_layer)
    for fmt in FORMATS:
        w = containers(fmt, fp8_to_block=fmt == "fp8")        # per-tensor FP8 expanded to the 128x128 grid
        print(f"\\n{fmt}: {type(w['in_proj']).__name__} {getattr(w['in_proj'], 'format', '')}")
        show(f"{fmt} layer", mamba_layer(w))
    """),
    md("""
    ### Adding arms to an NVFP4 layer

    Each setter installs one more copy; the dispatch order decides which serves. The transposed NVFP4 copy takes
    prefill (and `w4a16_gemm_t_m128` above 128 tokens), a pre-dequantized FP8 copy takes it over, W4A4 (4-bit
    activations too) beats both and also takes decode, and a BF16 copy wins everything.
    """),
    code("""
    nv = containers("nvfp4")
    layer = mamba_layer(nv)
    show("nvfp4 (w4a16)", layer)
    layer.set_prefill_weights(nv["in_proj"], nv["out_proj"])           # Nvfp4Weight -> transposed copy
    show("+ set_prefill_weights (transposed NVFP4)", layer)
    layer.set_fp8_prefill_weights(fp8_prefill_copy(nv["in_proj"]), fp8_prefill_copy(nv["out_proj"]))
    show("+ set_fp8_prefill_weights (FP8 per row)", layer)
    for proj, w in ((layer.in_proj, nv["in_proj"]), (layer.out_proj, nv["out_proj"])):
        proj.set_w4a4(w)
    show("+ set_w4a4", layer)
    layer.set_bf16_weights(bf16_layer.in_proj.dense_weight(), bf16_layer.out_proj.dense_weight())
    show("+ set_bf16_weights", layer)
    assert all(rel_err(a, b) == 0 for a, b in zip(run(layer), (y_ref, y_dec_ref)))   # BF16 serves every call
    print("installed:", layer.in_proj.installed_arms())
    """),
    md("""
    ### Decode-only FP8

    `ModelLevers(native_fp8_ssm="decode")` (env `METRALE_NEMOTRON_NATIVE_FP8_SSM=decode`) installs block FP8 for
    decode only: prefill then needs another arm, here a pre-dequantized FP8 copy.
    """),
    code("""
    fp8 = containers("fp8-block")
    layer = mamba_layer(fp8, levers=mj.ModelLevers(native_fp8_ssm="decode"))
    print("decode:", serving(layer, "decode", 1))
    try:
        serving(layer, "prefill", 64)
    except mj.WeightFormatError as e:
        print("prefill:", e)
    layer.set_fp8_prefill_weights(fp8_prefill_copy(fp8["in_proj"]), fp8_prefill_copy(fp8["out_proj"]))
    show("decode-only FP8 + FP8 prefill copy", layer)
    """),
    md("""
    ## 5. Checks at install time

    The FP8 arm takes only `FP8_BLOCK_SCALED` weights with the exact 128 x 128 scale grid; a ModelOpt per-tensor
    weight is refused with the tensor's name, and `Projection.set_weight` expands its scale (exactly) first. A
    kernel an arm needs that does not resolve is an error when the weights are installed, not at the first token.
    """),
    code("""
    per_tensor = containers("fp8")                                     # as stored: one scale per tensor
    print(per_tensor["in_proj"].format.name, "scale shape", per_tensor["in_proj"].scale.shape)
    try:
        mamba_layer(per_tensor)
    except mj.WeightFormatError as e:
        print("WeightFormatError:", e)

    proj = Projection("backbone.layers.0.mixer.in_proj", *per_tensor["in_proj"].shape)
    arm = proj.set_weight(per_tensor["in_proj"])
    w = proj.arm_weight(arm)
    print(f"set_weight -> {arm}: {w.format.name}, scale {tuple(w.scale.shape)}; same numbers:",
          rel_err(w.dequantize(), per_tensor["in_proj"].dequantize()) == 0)

    with registry.disabled("w8a16_gemv"):
        try:
            Projection("demo.in_proj", *per_tensor["in_proj"].shape).set_weight(per_tensor["in_proj"])
        except mj.KernelUnavailableError as e:
            print("KernelUnavailableError:", e)
    """),
    md("""
    ## 6. The whole quantized model with `NemotronH.from_pretrained`

    **Guarded cell.** Loading a quantized checkpoint as a whole model goes through `NemotronH.from_pretrained`.
    Where this version cannot load a format it raises `CheckpointError`, and the cell says so and goes on; where it
    can, the cell compares the model's logits with the original float32 ones and shows the arms block 0 serves with.
    """),
    code("""
    for fmt, d in qdirs.items():
        try:
            qmodel = mj.NemotronH.from_pretrained(d)
        except mj.CheckpointError as e:
            print(f"{fmt}: from_pretrained does not load this checkpoint here: {' '.join(str(e).split())}")
            continue
        report(fmt + " model", qmodel.forward(ids), ref)
        block0 = qmodel.layers[0]
        print(f"  block 0 decode: {block0.active_arm('decode', 1)}, prefill: {block0.active_arm('prefill', 64)}")
    """),
]

# ================================================================================================
# lora.ipynb
# ================================================================================================
LORA = [
    md("""
    # LoRA fine-tuning of the built-in model

    A LoRA adapter trained in JAX on one book of the King James Bible, in under a minute on the CPU:

    1. the built-in model and a fresh adapter on every projection that takes one (`model.add_adapter`: A random,
       B zero, as PEFT starts them), its factors (`LoraParam`) the only trainable state;
    2. a short fine-tune with optax on the Psalms (`data/kjv/`), through the model's own `forward_step` and its
       kernels (each kernel's backward pass is its reference's VJP);
    3. the loss curve, the held-out loss before and after, greedy samples before and after;
    4. the adapter saved as a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`) and read
       back with `load_adapter` onto a fresh copy of the model.
    """),
    code("""
    import json
    import os
    import tempfile
    import time
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    import matplotlib.pyplot as plt
    import numpy as np
    import optax
    from flax import nnx

    import metrale_jax as mj
    from metrale_jax.adapters import slot_table
    from metrale_jax.layers.lora import LoraParam
    from metrale_jax.model import forward_step

    # 30 steps keep the test suite's run short; LORA_STEPS=300 trains as long as the issue's "few hundred"
    BOOK, WINDOW, BATCH, LR = "Psalms", 128, 8, 3e-3
    STEPS = int(os.environ.get("LORA_STEPS", 30))
    tok = mj.ByteTokenizer()


    def book(path, name):
        \"\"\"The chapters of one book (each starts with a heading line such as 'Psalms 23').\"\"\"
        chapters = Path(path).read_text().split("\\n\\n")
        return "\\n\\n".join(c for c in chapters if c.startswith(name + " ")) + "\\n"


    def windows(ids, starts):
        \"\"\"Rows [BOS, ids[s], ..., ids[s + WINDOW - 1]] for each start s.\"\"\"
        return np.stack([np.concatenate([[tok.bos_id], ids[s:s + WINDOW]]) for s in starts]).astype(np.int32)


    train_ids = np.asarray(tok.encode(book("data/kjv/train.txt", BOOK), add_bos=False), np.int32)
    held_ids = np.asarray(tok.encode(book("data/kjv/heldout.txt", BOOK), add_bos=False), np.int32)
    held = windows(held_ids, np.linspace(0, len(held_ids) - WINDOW - 1, 16).astype(int))   # fixed held-out rows
    print(f"{BOOK}: {len(train_ids):,} training bytes, {len(held_ids):,} held-out bytes "
          f"(chapters the built-in model never saw), {held.shape[0]} held-out windows")
    """),
    md("""
    ## 1. The model and a fresh adapter

    The built-in model is loaded in float32 (the CPU runs it faster than bfloat16). `add_adapter` installs an
    overlay on each targeted projection: the base weights stay as they are and the low-rank term
    `scale * B (A x)` runs beside them. `nnx.split(model, LoraParam, ...)` separates the adapter's factors, the
    state to train, from everything else.
    """),
    code("""
    model = mj.load_builtin(dtype=jnp.float32)
    targets = ["in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    model.add_adapter(BOOK.lower(), r=8, lora_alpha=16, target_modules=targets, key=jax.random.key(0))
    graph, params, rest = nnx.split(model, LoraParam, ...)
    trainable = sum(x.size for x in jax.tree.leaves(params))
    total = sum(x.size for x in jax.tree.leaves(rest) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating))
    print(f"adapter {model.active_adapter!r} on {len(model.adapters[0].modules)} projections: "
          f"{trainable:,} trainable parameters beside {total:,} frozen ones")
    """),
    md("""
    ## 2. Fine-tuning

    The loss is the next-byte cross-entropy through `forward_step`, whose `adapters` argument gives each row's
    adapter (here every row the one adapter). Only the LoRA factors are differentiated and updated.
    """),
    code("""
    table = slot_table(model, BATCH)


    def loss_fn(p, rows):
        logits = forward_step(nnx.merge(graph, p, rest), rows[:, :-1], jnp.full((rows.shape[0],), table[0]))
        return optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:]).mean() / np.log(2)   # bits


    opt = optax.adam(LR)
    opt_state = opt.init(params)


    @jax.jit
    def train_step(p, s, rows):
        loss, grads = jax.value_and_grad(loss_fn)(p, rows)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss


    held_loss = jax.jit(loss_fn)
    before_bits = float(held_loss(params, held))
    rng = np.random.default_rng(0)
    t0, curve = time.perf_counter(), []
    for step in range(STEPS):
        rows = windows(train_ids, rng.integers(0, len(train_ids) - WINDOW - 1, BATCH))
        params, opt_state, loss = train_step(params, opt_state, jnp.asarray(rows))
        curve.append(float(loss))
    after_bits = float(held_loss(params, held))
    nnx.update(model, params)                                   # the trained factors into the model
    print(f"{STEPS} steps in {time.perf_counter() - t0:.1f} s; held-out {BOOK}: {before_bits:.3f} -> "
          f"{after_bits:.3f} bits/byte")
    assert after_bits < before_bits, "the fine-tune did not lower the held-out loss"
    """),
    code("""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(np.arange(1, STEPS + 1), curve, lw=1, label="training batch")
    ax.axhline(before_bits, color="gray", ls="--", label=f"held-out before ({before_bits:.3f})")
    ax.axhline(after_bits, color="green", ls="--", label=f"held-out after ({after_bits:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("bits / byte")
    ax.set_title(f"LoRA fine-tune of the built-in model on {BOOK}")
    ax.legend()
    plt.show()
    """),
    md("""
    ## 3. Samples before and after

    `set_adapter(None)` serves the base model (the overlay adds nothing); `set_adapter(name)` the fine-tune. An
    `Engine` takes the adapter per request (`submit(..., adapter=name)`, None: the base), so the base and the
    fine-tune sample side by side in one batch, one compiled program for both.
    """),
    code("""
    prompt = "The LORD is my"
    engine = mj.Engine(model, max_slots=2, max_len=144)
    rids = {name: engine.submit(tok.encode(prompt), max_new_tokens=120, adapter=name) for name in (None, BOOK.lower())}
    engine.run()
    for name, rid in rids.items():
        print(f"--- {name or 'base'} ---\\n{prompt}{tok.decode(engine.pop(rid).tokens)}\\n")
    """),
    md("""
    ## 4. A PEFT adapter on disk

    `save_adapter` writes the adapter in PEFT's layout (`base_model.model.model.layers.<i>.mixer.<module>.lora_A`
    / `lora_B`); `load_adapter` reads it back (checking every tensor against the model) onto a fresh copy of the
    built-in model, which then gives the same logits.
    """),
    code("""
    out = Path(tempfile.mkdtemp()) / f"{BOOK.lower()}-lora"
    files = model.save_adapter(out)
    print({f.name: f.stat().st_size for f in files})
    print({k: v for k, v in json.loads((out / "adapter_config.json").read_text()).items()
           if k in ("peft_type", "r", "lora_alpha", "target_modules")})
    fresh = mj.load_builtin(dtype=jnp.float32)
    print("loaded as", fresh.load_adapter(out, name=BOOK.lower()))    # the trained model's adapter name
    model.set_adapter(BOOK.lower())
    diff = np.abs(np.asarray(fresh.forward(held[:2])) - np.asarray(model.forward(held[:2]))).max()
    print(f"largest logit difference, reloaded vs trained: {diff:.2e}")
    assert diff < 1e-4
    """),
]

NOTEBOOKS = {"quickstart": QUICKSTART, "kernels": KERNELS, "quantization": QUANTIZATION, "lora": LORA}


def build(name: str) -> nbformat.NotebookNode:
    """The notebook `name` with deterministic cell ids and no outputs."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                   "language_info": {"name": "python"}}
    for i, (kind, src) in enumerate(NOTEBOOKS[name]):
        cell = nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
        cell.id = f"{name}-{i:02d}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(name: str) -> str:
    return nbformat.writes(build(name)) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed notebooks, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for name in NOTEBOOKS:
        path = OUT_DIR / f"{name}.ipynb"
        text = render(name)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            OUT_DIR.mkdir(exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)} ({len(NOTEBOOKS[name])} cells)")
    if stale:
        print(f"stale (run python tools/make_notebooks.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
