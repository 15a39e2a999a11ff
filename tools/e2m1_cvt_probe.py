#!/usr/bin/env python3
"""Which GPUs assemble `cvt.rn.satfinite.e2m1x2.f32`, the instruction vLLM 0.33's nvfp4_ds_mla cache writers use.

vLLM writes nvfp4_ds_mla rows with it (the CUDA concat_and_cache_nvfp4_ds_mla, built for sm_100 only, and
DeepSeek-V3.2's fused Triton insert). Compiled offline with Triton's own ptxas, no GPU needed:

    python tools/e2m1_cvt_probe.py            # one line per arch: "assembles" or ptxas' error
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _pack_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    even = tl.load(x_ptr + 2 * offs)
    odd = tl.load(x_ptr + 2 * offs + 1)
    packed = tl.inline_asm_elementwise(
        "{ .reg .b8 t; cvt.rn.satfinite.e2m1x2.f32 t, $2, $1; cvt.u32.u8 $0, t; }",
        "=r,f,f", [even, odd], dtype=tl.int32, is_pure=True, pack=1,
    )
    tl.store(out_ptr + offs, packed)


def assembles(arch: int) -> tuple[bool, str]:
    """(whether ptxas assembles the instruction for sm_<arch>, ptxas' last error line or "")."""
    source = ASTSource(fn=_pack_kernel, signature={"x_ptr": "*fp32", "out_ptr": "*i32", "N": "constexpr"},
                       constexprs={"N": 4})
    try:
        triton.compile(source, target=GPUTarget("cuda", arch, 32))
    except Exception as err:  # ptxas' message is the result
        lines = [line for line in str(err).splitlines() if "ptxas" in line and ("error" in line or "fatal" in line)]
        return False, (lines[0] if lines else str(err).strip().splitlines()[-1])[:300]
    return True, ""


def main() -> None:
    for arch in (90, 100):
        ok, why = assembles(arch)
        print(f"sm_{arch}: " + ("assembles" if ok else f"does not assemble ({why})"))


if __name__ == "__main__":
    main()
