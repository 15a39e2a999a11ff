"""The nvfp4_ds_mla latent decodes: e2m1 nibbles by PRMT table lookups (one `prmt` indexes an 8-entry byte table
with 4 nibbles; a second moves the sign bits beside them).

- To exact fp16 (the plain Triton kernel): the 8 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 are fp16 values whose low byte is
  0, so their high bytes are the table.
- To e4m3 (the Gluon kernels' nvfp4 forms, common.gluon.convert_tile_e4m3): the table is the block's own, the 8
  magnitudes times the block scale (and its row's power-of-two shift) rounded once to e4m3 (E4M3_BLOCK_TABLE_PTX,
  once a 16-value block), so a byte's two values cost ~5 instructions.
"""

from __future__ import annotations

import triton.language as tl

# 4 packed e2m1 bytes ($4) -> 4 low-nibble fp16 ($0, $1: two fp16x2) and 4 high-nibble fp16 ($2, $3), exact: the
# plain kernel's and the few-heads kernel's nvfp4 decode. pack=4, constraints "=r,=r,=r,=r,r"
E2M1_PAIRS_PTX = tl.constexpr("""
        {
        .reg .b32 m, mh, tlo, thi, l1, l2, se, so, g1, g2;
        and.b32 m, $4, 0x77777777;
        shr.u32 mh, m, 16;
        mov.b32 tlo, 0x3E3C3800;
        mov.b32 thi, 0x46444240;
        prmt.b32 l1, tlo, thi, m;
        prmt.b32 l2, tlo, thi, mh;
        shl.b32 se, $4, 4;
        and.b32 se, se, 0x80808080;
        and.b32 so, $4, 0x80808080;
        prmt.b32 g1, se, so, 0x5140;
        prmt.b32 g2, se, so, 0x7362;
        or.b32 l1, l1, g1;
        or.b32 l2, l2, g2;
        prmt.b32 $0, l1, 0, 0x2404;
        prmt.b32 $1, l2, 0, 0x2404;
        prmt.b32 $2, l1, 0, 0x3414;
        prmt.b32 $3, l2, 0, 0x3414;
        }
        """)

# a block scale (fp16, exact from e4m3, times its row's 2**-s: $2) -> its e4m3 table: $0 = e4m3(0, .5, 1, 1.5 x
# scale), $1 = e4m3(2, 3, 4, 6 x scale), byte 0 first. The products are exact in fp16 (<= 6 significant bits within
# 2**-13 .. 432: the row shift keeps the scale <= 72); cvt rounds each to nearest even. pack=1, constraints "=r,=r,h"
E4M3_BLOCK_TABLE_PTX = tl.constexpr("""
        {
        .reg .b32 s2, k, c01, c23, c45, c67;
        .reg .b16 e01, e23, e45, e67;
        mov.b32 s2, {$2, $2};
        mov.b32 k, 0x38000000;
        mul.rn.f16x2 c01, s2, k;
        mov.b32 k, 0x3E003C00;
        mul.rn.f16x2 c23, s2, k;
        mov.b32 k, 0x42004000;
        mul.rn.f16x2 c45, s2, k;
        mov.b32 k, 0x46004400;
        mul.rn.f16x2 c67, s2, k;
        cvt.rn.satfinite.e4m3x2.f16x2 e01, c01;
        cvt.rn.satfinite.e4m3x2.f16x2 e23, c23;
        cvt.rn.satfinite.e4m3x2.f16x2 e45, c45;
        cvt.rn.satfinite.e4m3x2.f16x2 e67, c67;
        mov.b32 $0, {e01, e23};
        mov.b32 $1, {e45, e67};
        }
        """)

# 4 packed e2m1 bytes ($2) of one block and its table ($3, $4 ... the first of each operand's 4 copies: $3 and $7)
# -> 8 e4m3 in latent order, byte i's low nibble then its high nibble ($0: bytes 0, 1; $1: bytes 2, 3). The e2m1
# sign flips the table entry's (xor: a negative block scale's entries carry its sign). pack=4,
# constraints "=r,=r,r,r,r,r,r,r,r,r,r"
E2M1_E4M3_PTX = tl.constexpr("""
        {
        .reg .b32 m, mh, o0, o1, se, so, g1, g2;
        and.b32 m, $2, 0x77777777;
        shr.u32 mh, m, 16;
        prmt.b32 o0, $3, $7, m;
        prmt.b32 o1, $3, $7, mh;
        shl.b32 se, $2, 4;
        and.b32 se, se, 0x80808080;
        and.b32 so, $2, 0x80808080;
        prmt.b32 g1, se, so, 0x5140;
        prmt.b32 g2, se, so, 0x7362;
        xor.b32 $0, o0, g1;
        xor.b32 $1, o1, g2;
        }
        """)
