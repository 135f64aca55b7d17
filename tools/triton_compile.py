"""Compile the Pallas Triton kernels for a Hopper GPU without one: a check before device time is spent.

Two steps, two environments:
  1. `dump` (the project venv, CPU): every registered kernel with a Triton arm is lowered for CUDA on the operands of
     its gradient-test case (tests/kernels/test_kernel_grads.py), decode_attention also at the 8B shapes with its
     slot whole and in pieces (and appending a step's keys and values), the Mamba conv and state updates at the 8B shapes with a row offset and a
     skipped (padding) row, the E4M3 activation quantizers, with jax's GPU query stubbed to compute capability
     9.0; each pallas_call's Triton IR is written to DIR/<case>.<n>.w<warps>s<stages>.ttir.
  2. `compile` (a venv with the `triton` package, which has its own LLVM and ptxas; no GPU needed): each .ttir is
     compiled to a cubin for sm_90; a kernel that fails prints Triton's error. The fused block-boundary norms are
     also checked to sum their rows over the plain norms' register layouts (`SAME_ROW_SUMS`: Triton's reduction
     order follows the layout, and the fused kernels promise the plain kernels' bits). Exit status 1 if any
     failed.

    JAX_PLATFORMS=cpu PYTHONPATH=. .venv/bin/python tools/triton_compile.py dump /tmp/ttir
    python3.12 -m venv /tmp/tv && /tmp/tv/bin/pip install triton
    /tmp/tv/bin/python tools/triton_compile.py compile /tmp/ttir

What this proves: the kernel lowers through Pallas and Triton's passes and fits the SM (registers, shared memory).
What it does not: that it runs correctly or fast (the interpret-mode tests and the GPU do that). It uses jax's
private lowering hooks (jax 0.11.2) and a triton release whose IR dialect may differ from jaxlib's.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]


def dump(out: pathlib.Path) -> int:
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax._src.pallas.triton import gpu_info, lowering, pallas_call_registration

    from pallas_kernels import attention, conv1d, mgpu_gemm, registry, state_update
    from tests.kernels.test_kernel_grads import CASES

    gpu_info.get_gpu_info = lambda *a, **k: types.SimpleNamespace(compute_capability=90)
    modules: list[str] = []
    lower = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = lower(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
    registry._load_all()
    cases = {}
    for name in sorted(CASES):
        spec = registry._KERNELS[name]
        if spec.pallas is not None:
            cases[name] = (spec.pallas, *CASES[name](np.random.default_rng(0)))
    from pallas_kernels.split_partials import SplitPartials

    B, L = 4, 2112                                       # 8B decode attention: 8 kv heads x 4, head_dim 128
    q = jnp.zeros((B, 8, 4, 128), jnp.bfloat16)
    pool = jnp.zeros((4, B, L, 8, 128), jnp.bfloat16)
    rows = jnp.arange(B, dtype=jnp.int32)
    for tag, config in (("pieces", attention.CONFIG), ("whole", attention.DecodeAttentionConfig(split_positions=None))):
        cases[f"decode_attention_8b_{tag}"] = (attention.decode_attention_pallas, (q, pool, pool, rows, rows),
                                               dict(layer=1, scale=0.1, config=config))
        new = jnp.zeros((B, 8, 128), jnp.bfloat16)          # a decode step's keys / values, appended in place
        cases[f"decode_attention_8b_{tag}_append"] = (attention.decode_attention_pallas, (q, pool, pool, rows, rows),
                                                      dict(layer=1, scale=0.1, config=config, new_kv=(new, new),
                                                           out_dtype=jnp.bfloat16))
        # the keys / values as their GEMVs' split partials (uint16 halves, 8 splits, rows padded to 8)
        parts = tuple(SplitPartials(jnp.zeros((2, 8, 8, 8 * 128), jnp.uint16)) for _ in range(2))
        cases[f"decode_attention_8b_{tag}_partials"] = (attention.decode_attention_pallas, (q, pool, pool, rows, rows),
                                                        dict(layer=1, scale=0.1, config=config, new_kv=parts,
                                                             out_dtype=jnp.bfloat16))
    # the 8B Mamba decode kernels as a layer calls them: slots plus its block's row_offset, with skip_row (the
    # padding slot's row neither read nor written)
    H, P, N, C = 128, 64, 128, 8192 + 2 * 8 * 128          # heads, head dim, state size, conv channels (8 groups)
    zxbcdt = jnp.zeros((B, 8192 + C + H), jnp.bfloat16)
    cases["causal_conv1d_update_8b_skip"] = (conv1d.causal_conv1d_update_pallas, (
        jnp.zeros((8, C, 3), jnp.bfloat16), rows, zxbcdt, jnp.zeros((C, 4), jnp.bfloat16)), dict(x_col=8192, skip_row=7,
                                                                             row_offset=4))
    cases["state_update_xbc_8b_skip"] = (state_update.state_update_xbc_pallas, (
        jnp.zeros((8, H, P, N), jnp.float32), rows, zxbcdt[:, 8192:8192 + C], zxbcdt), dict(
        dt_col=8192 + C, A_log=jnp.zeros((H,), jnp.float32), D=jnp.zeros((H,), jnp.float32),
        dt_bias=jnp.zeros((H,), jnp.float32), skip_row=7, row_offset=4))
    # the norms at a block boundary, 64 rows of the 8B width: plain, and fused with 8 split partials (halves)
    from pallas_kernels import norm_fp8, norms
    from pallas_kernels.split_partials import SplitPartials
    h, w = jnp.zeros((64, 4096), jnp.bfloat16), jnp.ones((4096,), jnp.bfloat16)
    halves = SplitPartials(jnp.zeros((2, 8, 64, 4096), jnp.uint16))
    cases["norm_8b"] = (norms.rmsnorm_pallas, (h, w), dict(eps=1e-5))
    cases["add_norm_8b"] = (norms.add_rmsnorm_pallas, (h, halves, w), dict(eps=1e-5))
    cases["norm_fp8_8b"] = (norm_fp8.rmsnorm_fp8_pallas, (h, w), dict(eps=1e-5, per_block=True))
    cases["add_norm_fp8_8b"] = (norm_fp8.add_rmsnorm_fp8_pallas, (h, halves, w), dict(eps=1e-5, per_block=True))
    # the E4M3 activation quantizers of the FP8-matrix-unit arms: decode's any-M one at down_proj's 21504 columns (1
    # and 8 rows), the fused per-row and per-block ones at a prefill shape
    for m in (1, 8):
        cases[f"quantize_blocks_any_rows_m{m}"] = (mgpu_gemm.quantize_blocks_any_rows,
                                                   (jnp.zeros((m, 21504), jnp.bfloat16),), {})
    for fn in (mgpu_gemm.quantize_rows_fused, mgpu_gemm.quantize_blocks_fused_t):
        cases[fn.__name__] = (fn, (jnp.zeros((256, 4096), jnp.bfloat16),), {})
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name, (fn, args, kwargs) in cases.items():
        modules.clear()
        try:
            hlo = jax.jit(lambda *a, fn=fn, kw=kwargs: fn(*a, **kw, interpret=False)).trace(*args).lower(
                lowering_platforms=("cuda",)).as_text()
        except Exception as e:  # noqa: BLE001  (report every kernel, then fail)
            failed += 1
            print(f"{name}: lowering FAILED: {type(e).__name__}: {str(e)[:500]}")
            continue
        # each custom call's launch, in the order the modules were lowered: num_stages, then num_warps
        launches = re.findall(r"num_stages = (\d+)[^}]*?num_warps = (\d+)", hlo)
        if len(launches) != len(modules):
            failed += 1
            print(f"{name}: {len(modules)} Triton modules but {len(launches)} launches in the HLO")
            continue
        for i, (text, (stages, warps)) in enumerate(zip(modules, launches)):
            (out / f"{name}.{i}.w{warps}s{stages}.ttir").write_text(text)
        print(f"{name}: {len(modules)} Triton module(s), (stages, warps) {launches}")
    return int(failed > 0)


# fused kernel -> the plain kernel whose row sums (the layouts its reductions run over) it must share
SAME_ROW_SUMS = {"add_norm_8b": "norm_8b", "add_norm_fp8_8b": "norm_fp8_8b"}


def reduce_layouts(ttgir: str) -> list[str]:
    """The register layout of each tt.reduce operand in a compiled kernel's TTGIR, in program order."""
    layouts = dict(re.findall(r"^(#[\w]+) = (#ttg\.blocked<[^>]*>)", ttgir, re.M))
    operands = re.findall(r'"tt\.reduce"\([^)]*\).*?\) : \(tensor<[^,>]*, (#[\w]+)>', ttgir, re.S)
    return [layouts.get(name, name) for name in operands]


def compile_all(directory: pathlib.Path) -> int:
    import triton
    from triton.backends.compiler import GPUTarget

    failed = 0
    reductions = {}
    for path in sorted(directory.glob("*.ttir")):
        warps, stages = re.search(r"\.w(\d+)s(\d+)\.ttir$", path.name).groups()
        try:
            kernel = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": int(warps), "num_stages": int(stages)})
            meta = kernel.metadata
            print(f"{path.name}: OK (shared memory {meta.shared} bytes, {len(kernel.asm['cubin'])} bytes of cubin)")
            reductions[path.name.split(".")[0]] = reduce_layouts(kernel.asm["ttgir"])
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(f"{path.name}: FAILED: {type(e).__name__}: {str(e)[:1500]}")
    for fused, plain in SAME_ROW_SUMS.items():
        if fused in reductions and plain in reductions:
            same = reductions[fused] == reductions[plain]
            failed += not same
            print(f"{fused} sums rows as {plain}: {'yes' if same else 'NO'} ({reductions[fused]} / {reductions[plain]})")
    return int(failed > 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("step", choices=("dump", "compile"))
    ap.add_argument("directory", type=pathlib.Path)
    args = ap.parse_args()
    return dump(args.directory) if args.step == "dump" else compile_all(args.directory)


if __name__ == "__main__":
    sys.exit(main())
