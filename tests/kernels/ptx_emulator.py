"""A small PTX emulator for the inline-PTX decoders of the Mosaic kernels (tests only), and a numpy mirror of
Mosaic's register layouts, so decoders and their register plans are checked on the CPU.

Values are uint32 numpy arrays, one element per lane. With `threads`, axis 0 is the thread index of a warpgroup
(128 lanes): %laneid and the warp shuffles (shfl.sync bfly / idx) read across that axis."""

import numpy as np


def run_ptx(asm: str, outs: int, *ins, threads: int | None = None):
    """Run `asm` with outputs $0..$(outs-1) and inputs $outs.. = ins. Ops: mov, prmt (default mode with
    msb-replicating selectors, immediate or register selector), shl / shr, and, mul.lo.u32, fma.rn.bf16x2
    (float64 math rounded once to bf16, subnormals kept, as the GPU's bf16 FMA does), setp.ne.u32, selp.b32,
    and with `threads`: mov %laneid, shfl.sync.bfly.b32 / shfl.sync.idx.b32 (full member mask)."""
    import ml_dtypes
    regs = {f"${i + outs}": np.asarray(v, np.uint64) for i, v in enumerate(ins)}
    nd = max([np.ndim(v) for v in ins] + [1])
    lane = None if threads is None else (np.arange(threads, dtype=np.uint64) % 32).reshape(-1, *[1] * (nd - 1))

    def val(t):
        if t == "%laneid":
            return lane
        return regs[t] if t in regs else np.uint64(int(t, 0))

    bf = lambda u: (u & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    to_bits = lambda f: f.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint64)

    def shfl(v, src_lane):
        v = np.broadcast_to(np.asarray(v, np.uint64), np.broadcast_shapes(np.shape(v), np.shape(src_lane)))
        t = np.arange(threads).reshape(-1, *[1] * (v.ndim - 1))
        src = (t & ~31) | src_lane.astype(np.int64)                     # same warp
        return np.take_along_axis(v, np.broadcast_to(src, v.shape), axis=0)

    for line in asm.replace("{", "").replace("}", "").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *a = [t.strip() for t in args.split(",")]
        if op in ("mov.b32", "mov.u32"):
            r = val(a[0])
        elif op == "prmt.b32":
            src = val(a[0]) | (val(a[1]) << np.uint64(32))
            sel, r = val(a[2]), np.uint64(0)
            for k in range(4):
                nib = (sel >> np.uint64(4 * k)) & np.uint64(0xF)
                byte = (src >> (np.uint64(8) * (nib & np.uint64(7)))) & np.uint64(0xFF)
                byte = np.where(nib & np.uint64(8), np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)),
                                byte)
                r = r | (byte << np.uint64(8 * k))
        elif op == "shl.b32":
            r = val(a[0]) << np.uint64(int(a[1]))
        elif op == "shr.b32":
            r = val(a[0]) >> np.uint64(int(a[1]))
        elif op == "and.b32":
            r = val(a[0]) & val(a[1])
        elif op == "mul.lo.u32":
            r = val(a[0]) * val(a[1])
        elif op == "fma.rn.bf16x2":
            x, y, z = np.broadcast_arrays(*(np.asarray(val(t), np.uint64) for t in a))
            r = sum(to_bits(bf(x >> np.uint64(16 * h)) * bf(y >> np.uint64(16 * h)) + bf(z >> np.uint64(16 * h)))
                    << np.uint64(16 * h) for h in range(2))
        elif op == "setp.ne.u32":
            regs[d] = val(a[0]) != val(a[1])
            continue
        elif op == "selp.b32":
            r = np.where(regs[a[2]], val(a[0]), val(a[1])).astype(np.uint64)
        elif op in ("shfl.sync.bfly.b32", "shfl.sync.idx.b32"):
            assert threads is not None and a[3] == "0xffffffff", line
            b, c = int(a[1], 0), int(a[2], 0)
            seg = (c >> 8) & 31
            src_lane = (lane ^ np.uint64(b)) if op.endswith("bfly.b32") else (lane & np.uint64(seg)) | np.uint64(b & ~seg & 31)
            assert (c & 31) | seg == 31, "clamp values other than the full segment are not emulated"
            r = shfl(val(a[0]), src_lane)
        else:
            raise AssertionError(f"emulator lacks {op}")
        regs[d] = np.asarray(r, np.uint64) & np.uint64(0xFFFFFFFF)
    return [regs[f"${i}"] for i in range(outs)]


def bf16_pairs(u):
    """uint32 words -> [..., 2] float64: the two bf16 halves, low half first."""
    import ml_dtypes
    u = np.asarray(u, np.uint32)
    return np.stack([u & 0xFFFF, u >> 16], -1).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)


def element_map(layout, shape):
    """[128 threads, *registers_shape, vector] -> linear element index: a numpy mirror of Mosaic's
    TiledLayout.thread_idxs (the map a layout's loads and stores use; replicated dimensions give several threads
    the same elements)."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    contig = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    strides = layout.tiling.tile_strides(contig)
    tshape, tstr = layout.tiled_tiling_shape, strides[-layout.tiled_tiling_rank:]

    def offset(idx, dims):
        sizes = [d.times if isinstance(d, fa.Replicated) else tshape[d] for d in dims]
        out = 0
        for j, (d, size) in enumerate(zip(dims, sizes)):
            if not isinstance(d, fa.Replicated):
                out += (idx // int(np.prod(sizes[j + 1:]))) % size * tstr[d]
        return out

    rs = layout.registers_shape(shape)
    res = np.zeros((128, *rs, layout.vector_length), np.int64)
    for t in range(128):
        base = offset(t // 32, layout.warp_dims) + offset(t % 32, layout.lane_dims)
        for ridx in np.ndindex(rs):
            start = base + sum(i * st for i, st in zip(ridx, strides))
            res[(t, *ridx)] = start + np.arange(layout.vector_length) * tstr[layout.vector_dim]
    reps = int(np.prod([d.times for d in (*layout.warp_dims, *layout.lane_dims) if isinstance(d, fa.Replicated)]))
    assert np.array_equal(np.bincount(res.ravel(), minlength=int(np.prod(shape))),
                          np.full(int(np.prod(shape)), reps))      # every element held by `reps` threads (replicated)
    return res
