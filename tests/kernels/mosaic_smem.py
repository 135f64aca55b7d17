"""The shared-memory layout of a Mosaic GPU kernel, read on the CPU from its lowering for CUDA.

A kernel lowered with `lowering_platforms=("cuda",)` carries its Mosaic module (MLIR bytecode) in the
`mosaic_gpu_v2` custom call; its `memref.view`s of the dynamic shared memory give each buffer's byte offset and
shape. TMA copies need 128-byte aligned shared-memory destinations, and a pipeline's buffer is [stages, ...tile],
so every stage of it must start on 128 bytes too: a 32-byte stage of float32 x scales made every GPU test of
w8a8_gemv fail with a misaligned address, which interpret mode cannot see (benchmarks/notes/gemv.md). These
helpers let the lowering tests check it without a GPU."""

from __future__ import annotations

import dataclasses
import re

from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import mosaic_gpu_dialect
from jax._src.lib.mlir import ir

TMA_ALIGN = 128
_BITS = {"f32": 32, "i32": 32, "bf16": 16, "f16": 16, "i16": 16, "f8E4M3FN": 8, "f8E5M2": 8, "i8": 8, "ui8": 8}


@dataclasses.dataclass(frozen=True)
class SharedBuffer:
    offset: int                 # bytes from the start of the dynamic shared memory
    shape: tuple[int, ...]
    dtype: str                  # the MLIR element type, e.g. "f32", "f8E4M3FN"

    @property
    def stage_bytes(self) -> int | None:
        """Bytes of one entry along the leading axis (a pipeline's stage), None for a barrier array."""
        bits = _BITS.get(self.dtype)
        if bits is None or len(self.shape) < 2:
            return None
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n * bits // 8


def _walk(op, visit):
    for region in op.regions:
        for block in region:
            for o in block.operations:
                visit(o)
                _walk(o.operation, visit)


def mosaic_modules(lowered) -> list[bytes]:
    """The serialized Mosaic modules of every mosaic_gpu custom call in a jax Lowered."""
    found = []

    def visit(o):
        if o.operation.name == "stablehlo.custom_call" and "mosaic_gpu" in str(o.attributes["call_target_name"]):
            found.append(ir.StringAttr(ir.DictAttr(o.attributes["mhlo.backend_config"])["module"]).value_bytes)

    _walk(lowered.compiler_ir("stablehlo").operation, visit)
    return found


# in the module's generic form (its ops carry a versioned dialect prefix, hence no dialect names here)
_FUNC = re.compile(r'func\.func"')
_CONST = re.compile(r'(%[\w#]+) = "[\w.]*arith\.constant"\(\) <?\{value = (-?\d+) : index\}')
_VIEW = re.compile(r'= "[\w.]*memref\.view"\(%[\w#]+, (%[\w#]+)\).*-> memref<((?:\d+x)+)(\w+), '
                   r'#gpu\.address_space<workgroup>>')


def shared_buffers(module: bytes) -> list[SharedBuffer]:
    """Every view of the dynamic shared memory in a serialized Mosaic module, from its printed generic form (a
    Python walk over the ops takes seconds on a pipelined kernel; the text, milliseconds). A view at an offset
    that is not a constant of its function raises (the checks need constants)."""
    ctx = jax_mlir.make_ir_context()
    ctx.allow_unregistered_dialects = True           # the versioned op names; Mosaic's own types need its dialect
    mosaic_gpu_dialect.register_dialect(ctx)
    with ctx:
        text = ir.Module.parse(module).operation.get_asm(print_generic_op_form=True)
    out, consts = [], {}
    for line in text.splitlines():
        if _FUNC.search(line):
            consts = {}                                  # value names are scoped per function
        if m := _CONST.search(line):
            consts[m.group(1)] = int(m.group(2))
        elif m := _VIEW.search(line):
            offset, dims, dtype = m.groups()
            if offset not in consts:
                raise AssertionError(f"a shared-memory view at a computed offset: {line.strip()[:200]}")
            out.append(SharedBuffer(consts[offset], tuple(int(d) for d in dims[:-1].split("x")), dtype))
    return out


def check_lowered(lowered) -> list[SharedBuffer]:
    """A Lowered holds a Mosaic kernel whose shared-memory buffers, and each stage of them, start on TMA_ALIGN bytes;
    returns the buffers (AssertionError naming the first that does not)."""
    modules = mosaic_modules(lowered)
    assert modules, "no mosaic_gpu custom call in the lowering"
    buffers = [b for m in modules for b in shared_buffers(m)]
    for b in buffers:
        if b.stage_bytes is None:
            continue
        assert b.offset % TMA_ALIGN == 0, f"shared buffer {b} starts off {TMA_ALIGN}-byte alignment"
        assert b.stage_bytes % TMA_ALIGN == 0, f"shared buffer {b}: a stage of {b.stage_bytes} bytes breaks alignment"
    return buffers
