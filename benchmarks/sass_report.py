#!/usr/bin/env python3
"""Compile the Triton decode kernels for SM90 on any machine (no GPU) and report what the SASS holds.

Registers, spills, shared memory, and the instruction mix that decides speed on Hopper: QGMMA/HGMMA (wgmma),
HMMA (mma.sync), LDGSTS (cp.async), LDG width, LDL/STL (local memory). Costs no device time; use the Triton
version the H200 has (3.6) for numbers that match it:

    python benchmarks/sass_report.py [--sass-dir DIR] [--filter fp8]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
COUNTED = ("QGMMA", "HGMMA", "HMMA", "LDGSTS", "LDG.E.128", "LDG.E.64", "LDG.E", "LDG.E.U8", "LDS", "STS",
           "LDL", "STL", "F2FP", "BAR.SYNC", "WARPGROUP", "SHFL")


def compile_kernel(fn, signature: dict[str, str], constexprs: dict[str, object], num_warps: int, num_stages: int,
                   divisible: tuple[str, ...] | None = None):
    """signature: {arg: "*fp8e4nv" | "i32" | ...}; divisible: args the JIT would see as multiples of 16
    (default: every pointer, as torch allocates, and every stride_*/K, as K3.1's shapes give)."""
    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    if divisible is None:
        divisible = tuple(n for n, t in signature.items() if t.startswith("*") or n.startswith("stride") or n == "K")
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})


def sass_of(cubin: bytes) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        sass = subprocess.run([str(_BIN / "cuobjdump"), "--dump-sass", path], capture_output=True, text=True).stdout
        res = subprocess.run([str(_BIN / "cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    return sass, res


def summarize(kernel) -> dict[str, object]:
    sass, res = sass_of(kernel.asm["cubin"])
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    counts = {}
    for op in COUNTED:
        counts[op] = len(re.findall(r"\b" + re.escape(op) + r"(?=[\s.])", sass)) if op != "LDG.E" else len(
            re.findall(r"\bLDG\.E(\.\w+)*\s", sass))
    return {
        "regs": int(m.group(1)) if m else None,
        "stack": int(m.group(2)) if m else None,
        "shared": kernel.metadata.shared,
        "local": int(m.group(4)) if m else None,
        "ops": counts,
        "sass": sass,
    }


SIGNATURE = dict(
    q_ptr="*fp8e4nv", kv_ptr="*fp8e4nv", slots_ptr="*i32", counts_ptr="*i32", items_ptr="*i32", out_ptr="*bf16",
    lse_ptr="*fp32",
    part_out_ptr="*fp16", part_lse_ptr="*fp32", H="i32", K="i32", num_splits="i32", lead_tiles="i32",  # fp16: kernels.common.PARTIAL_DTYPE
    stride_q_row="i32", stride_q_head="i32", stride_kv="i32", stride_s_row="i32", stride_o_row="i32",
    stride_o_head="i32", stride_lse_row="i32", qk_scale="fp32", out_scale="fp32",
)


def compile_config(fmt: str, cfg, scheduled: bool = False):
    """The decode kernel a `planning.Config` launches (scheduled: its scheduled form), compiled for SM90."""
    from vllm_kimi_dsa.kernels import triton_decode as td

    sig = dict(SIGNATURE, kv_ptr="*u8" if fmt != "fp8" else "*fp8e4nv")
    consts = dict(NVFP4=fmt != "fp8", BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, PREFETCH=cfg.prefetch,
                  LAZY=cfg.lazy, SWAP=cfg.swap, PTX=True, SCHEDULED=scheduled)
    return compile_kernel(td.decode_kernel, sig, consts, cfg.num_warps, cfg.num_stages)


def main() -> None:
    from vllm_kimi_dsa.planning import default_config

    p = argparse.ArgumentParser()
    p.add_argument("--sass-dir", default=None, help="also write each kernel's SASS and PTX here")
    p.add_argument("--filter", default="", help="only cases whose name contains this")
    p.add_argument("--scheduled", action="store_true", help="the scheduled form (a planner's items) of each")
    a = p.parse_args()
    print(f"triton {triton.__version__}, target sm_90 (the default config of each format and head count)")
    print(f"{'case':24s} {'regs':>4s} {'stack':>5s} {'smem':>6s}  ops")
    for fmt in ("fp8", "nvfp4_ds_mla"):
        for heads in (128, 32, 16):
            name = f"{fmt}-H{heads}"
            if a.filter not in name:
                continue
            cfg = default_config(heads, fmt)
            try:
                k = compile_config(fmt, cfg, a.scheduled)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{name:24s} COMPILE FAILED: {str(e).splitlines()[0][:150]}")
                continue
            s = summarize(k)
            ops = " ".join(f"{o}={n}" for o, n in s["ops"].items() if n)
            print(f"{name:24s} {s['regs']!s:>4s} {s['stack']!s:>5s} {s['shared']:>6d}  {ops}")
            if a.sass_dir:
                Path(a.sass_dir).mkdir(parents=True, exist_ok=True)
                (Path(a.sass_dir) / f"{name}.sass").write_text(s["sass"])
                (Path(a.sass_dir) / f"{name}.ptx").write_text(k.asm["ptx"])


if __name__ == "__main__":
    main()
