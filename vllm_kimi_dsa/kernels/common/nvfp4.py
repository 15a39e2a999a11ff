"""The nvfp4_ds_mla latent decode both kernel families share: e2m1 byte pairs to exact fp16 by PRMT table lookups.

The 8 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 are fp16 values whose low byte is 0, so their high bytes form an 8-entry
byte table one `prmt` indexes with 4 nibbles; a second `prmt` moves the sign bits beside them.
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
