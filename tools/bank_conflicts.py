#!/usr/bin/env python3
"""Shared-memory bank conflicts of the Gluon kernels' gathers and conversions, by Gluon's own count
(`gl.bank_conflicts`: excess accesses a wavefront; 0 is ideal), on any machine (no GPU): each register layout
against the shared buffer it writes or reads, for both row formats, plus the layouts they replaced (NOTES v12) as a
negative control. tests/test_sm90_compile.py runs it.

    python tools/bank_conflicts.py [BLOCK_N [CVT_ROWS]]   # prints "RESULT <access> <excess>" lines
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the counts are printed while compiling: a cached kernel would print nothing
os.environ["TRITON_ALWAYS_COMPILE"] = "1"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from vllm_kimi_dsa.kernels import gluon_decode as gd  # noqa: E402
from vllm_kimi_dsa.kernels.common import gluon as cg  # noqa: E402
from vllm_kimi_dsa.kernels import gluon_few_heads as fh  # noqa: E402

# the layouts before NOTES v12, as the negative control: the check must see their conflicts
OLD_ROWS = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))
OLD_PK = gl.constexpr(gl.BlockedLayout([1, 1, 2, 8], [8, 2, 2, 1], [4, 1, 1, 1], [3, 2, 1, 0]))
LAT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
ROPE = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))
PLAIN4 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0]))
V16 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))  # gluon_decode's


@gluon.jit
def conflicts(p, BN: gl.constexpr, CVT: gl.constexpr):
    lat = gl.allocate_shared_memory(gl.float8e4nv, [BN, 512], LAT)
    rope = gl.allocate_shared_memory(gl.float8e4nv, [BN, 64], ROPE)
    pk = gl.allocate_shared_memory(gl.uint8, [BN, 256], fh._PLAIN2)
    pk4 = gl.allocate_shared_memory(gl.uint8, [CVT, 8, 4, 8], PLAIN4)
    cvt8 = gl.allocate_shared_memory(gl.float8e4nv, [CVT, 256], LAT)
    v16 = gl.allocate_shared_memory(gl.float16, [CVT, 256], V16)
    gl.static_print("RESULT", "lat_gather", gl.bank_conflicts(gl.full([BN, 512], 0, gl.float8e4nv, cg.ROW_LAYOUT).type, lat.type))
    gl.static_print("RESULT", "rope_gather", gl.bank_conflicts(gl.full([BN, 64], 0, gl.float8e4nv, cg.ROPE_LAYOUT).type, rope.type))
    gl.static_print("RESULT", "nvfp4_gather", gl.bank_conflicts(gl.full([BN, 256], 0, gl.uint8, cg.ROW_LAYOUT).type, pk.type))
    gl.static_print("RESULT", "cvt_load", gl.bank_conflicts(gl.full([CVT, 256], 0, gl.float8e4nv, gd._CVT_LAYOUT).type, cvt8.type))
    gl.static_print("RESULT", "cvt_store", gl.bank_conflicts(gl.full([CVT, 256], 0, gl.float16, gd._CVT_LAYOUT).type, v16.type))
    gl.static_print("RESULT", "nvfp4_cvt_load", gl.bank_conflicts(gl.full([CVT, 8, 4, 8], 0, gl.uint8, cg.PK_LAYOUT).type, pk4.type))
    # the e4m3 converter's stores: 8 e4m3 pairs a lane into the fp8 K stage viewed as uint16 pairs
    e4m3 = gl.allocate_shared_memory(gl.uint16, [CVT, 256], cg.E4M3_PAIRS_LAYOUT)
    pairs = gl.reshape(gl.full([CVT, 8, 4, 8], 0, gl.uint16, cg.PK_LAYOUT), [CVT, 256])
    gl.static_print("RESULT", "e4m3_cvt_store", gl.bank_conflicts(pairs.type, e4m3.type))
    # the REG_V consumer's P.V operand loads from a 16-token slice of the K stage
    lat16 = gl.allocate_shared_memory(gl.float8e4nv, [16, 512], LAT)
    gl.static_print("RESULT", "regv_chunk_load", gl.bank_conflicts(gl.full([16, 512], 0, gl.float8e4nv, fh._V_CHUNK_LAYOUT).type, lat16.type))
    gl.static_print("RESULT", "old_lat_gather", gl.bank_conflicts(gl.full([BN, 512], 0, gl.float8e4nv, OLD_ROWS).type, lat.type))
    gl.static_print("RESULT", "old_nvfp4_cvt_load", gl.bank_conflicts(gl.full([CVT, 8, 4, 8], 0, gl.uint8, OLD_PK).type, pk4.type))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("block_n", type=int, nargs="?", default=64, help="KV rows a tile (the gathers)")
    p.add_argument("cvt_rows", type=int, nargs="?", default=32, help="rows a conversion step")
    a = p.parse_args()
    src = GluonASTSource(fn=conflicts, signature={"p": "*i32", "BN": "constexpr", "CVT": "constexpr"},
                         constexprs={"BN": a.block_n, "CVT": a.cvt_rows}, attrs={})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
