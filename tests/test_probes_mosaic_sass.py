"""benchmarks/probes/mosaic_sass.py: the cubin is recovered byte for byte from an MLIR dump (escapes, quotes,
backslashes), and loops are counted between a label and its last backward branch."""

from benchmarks.probes import mosaic_sass


def _mlir_escape(data: bytes) -> str:
    out = []
    for b in data:
        c = chr(b)
        if c in '\\"':
            out.append("\\" + c)
        elif 32 <= b < 127:
            out.append(c)
        else:
            out.append(f"\\{b:02X}")
    return "".join(out)


def test_cubins_round_trip_the_escaped_payload(rng):
    data = b"\x7fELF" + bytes(rng.integers(0, 256, 3000, dtype="uint8")) + b'\\"\\\\"'
    text = ('gpu.binary @k_kernel [#gpu.object<#nvvm.target, bin = "junk">] ... '
            f'gpu.binary @k_kernel  [#gpu.object<#nvvm.target<O = 3>, bin = "{_mlir_escape(data)}", x = 1>]')
    assert mosaic_sass.cubins(text) == {"k_kernel": data}      # the non-ELF one is skipped, the ELF one exact


def test_loops_count_the_body_between_label_and_back_branch():
    sass = "\n".join([".L_x_1:", "        /*0010*/                   LOP3.LUT R1, R2, 0xf, RZ, 0xc0, !PT ;",
                      "        /*0020*/               @!P0 SHFL.BFLY PT, R3, R1, 0x1, 0x1f ;",
                      "        /*0030*/               @P0 BRA `(.L_x_1) ;", "        /*0040*/                   EXIT ;"])
    (label, n, ops), = mosaic_sass.loops(sass, 1)
    assert (label, n) == (".L_x_1", 3) and ops == {"LOP3": 1, "SHFL": 1, "BRA": 1}


def test_control_bits_decode_scoreboards_and_waits():
    """Two instructions from the SASS of the w4 GEMV with a global-load prefetch (5b594f4): a global load that sets
    scoreboard 5 (stall 4) and the decode instruction at the loop head that waits on scoreboards 1 and 5."""
    hexed = "\n".join([
        "        /*0540*/                   LD.E.64 R98, desc[UR30][R20.64] ;       /* 0x0000001e14627980 */",
        "                                                                           /* 0x000f68000c101b00 */",
        "        /*0e10*/                   SHF.R.U32.HI R32, RZ, 0x4, R18 ;        /* 0x00000004ff207819 */",
        "                                                                           /* 0x022fe20000011612 */"])
    ld, shf = mosaic_sass.control(hexed)
    assert (ld["addr"], ld["insn"], ld["wb"], ld["rb"], ld["wait"], ld["stall"]) == (
        0x540, "LD.E.64 R98, desc[UR30][R20.64]", 5, 7, set(), 4)
    assert shf["wait"] == {1, 5} and shf["wb"] == 7
    assert "wait 1,5" in mosaic_sass.control_listing([shf]) and "wb 5 rb - wait -" in mosaic_sass.control_listing([ld])
