#!/usr/bin/env python3
"""Compile a Gluon decode kernel (kernels/gluon_decode.py, kernels/gluon_few_heads.py) for sm_90 on any machine (no
GPU) and report its SASS.

Per config: shared memory, the setmaxnreg budget of each partition, ptxas' spill and wgmma-serialization notes,
and each hot loop (a backward branch over > 50 instructions: the two consumers' tile loops hold QGMMA, the
producer's holds LDGSTS) with its length, spills inside it and its instruction mix. Costs no device time; use the
Triton the H200 runs (3.6) for numbers that match it:

    /tmp/t36/bin/python benchmarks/gluon_report.py [--kernel gluon|few|seesaw] [--config k=v,...] [--sass-dir DIR]
"""

from __future__ import annotations

import argparse
import collections
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

TARGET = GPUTarget("cuda", 90, 32)
# the split partials' pointer type TritonDecode's workspace gives the kernels (kernels.common.PARTIAL_DTYPE)
_PARTIAL_SIG = "*fp16"
_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SIGNATURE = dict(
    q_ptr="*fp8e4nv", kv_ptr="*fp8e4nv", slots_ptr="*i32", counts_ptr="*i32", items_ptr="*i32", out_ptr="*bf16",
    lse_ptr="*fp32",
    part_out_ptr="*fp32", part_lse_ptr="*fp32", H="i32", K="i32", num_splits="i32", lead_tiles="i32",
    stride_q_row="i32", stride_q_head="i32", stride_kv="i32", stride_s_row="i32", stride_o_row="i32",
    stride_o_head="i32", stride_lse_row="i32", qk_scale="fp32", out_scale="fp32",
)
# GluonParams overrides: the default, then one field changed at a time
FEW_CONFIGS = [{}, {"ctas_per_sm": 2, "k_stages": 2, "pv_in_flight": 2, "producer_regs": 56, "pv_early": 1},
               {"nvfp4": 1, "reg_v": 0, "k_stages": 3}]
SEESAW_CONFIGS = [{}, {"pv_in_flight": 1}, {"k_stages": 3}, {"nvfp4": 1, "k_stages": 3}]
CONFIGS = [{}, {"v_slots": 2}, {"cvt_rows": 16}, {"block_n": 32, "k_stages": 4, "v_slots": 4}]
LOOP_OPS = ("QGMMA", "HGMMA", "LDGSTS", "LDS", "STS", "LDG", "LDL", "STL", "F2FP", "MUFU", "FMUL", "FADD", "FFMA",
            "BAR", "SYNCS", "WARPGROUP", "SHFL", "MEMBAR")


def compile_gluon(kernel: str = "gluon", **overrides):
    """Compile a Gluon decode kernel for sm_90a: "gluon" (gluon_decode_kernel with GluonParams(**overrides)) or
    "few" (gluon_few_heads.few_heads_kernel with FewHeadsParams(**overrides)) or "seesaw" (gluon_seesaw's kernel with
    SeesawParams(**overrides))."""
    from triton.experimental.gluon._runtime import GluonASTSource

    if kernel == "few":
        from vllm_kimi_dsa.kernels import gluon_few_heads as g

        fn, params_cls = g.few_heads_kernel, g.FewHeadsParams
    elif kernel == "seesaw":
        from vllm_kimi_dsa.kernels import gluon_seesaw as g

        fn, params_cls = g.seesaw_decode_kernel, g.SeesawParams
    else:
        from vllm_kimi_dsa.kernels import gluon_decode as g

        fn, params_cls = g.gluon_decode_kernel, g.GluonParams
    heads = overrides.pop("heads", None)  # the few-heads kernel: > 16 heads compile its head-block variant
    scheduled = bool(overrides.pop("scheduled", False))  # the scheduled form (grid head blocks x planner items)
    base = params_cls()
    overrides = {k: bool(v) if isinstance(getattr(base, k), bool) else v for k, v in overrides.items()}
    params = params_cls(**overrides)
    consts = g.kernel_constexprs(params, heads) if heads else g.kernel_constexprs(params)
    consts = {**consts, "SCHEDULED": scheduled}
    sig = dict(SIGNATURE)
    if overrides.get("nvfp4"):
        sig["kv_ptr"] = "*u8"  # nvfp4_ds_mla rows are uint8
    sig["part_out_ptr"] = _PARTIAL_SIG
    sig.update({k: "constexpr" for k in consts})
    # what the JIT sees from torch allocations and K3.1's shapes: pointers, strides and K multiples of 16
    divisible = [n for n, t in SIGNATURE.items() if t.startswith("*") or n.startswith("stride") or n == "K"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    extra = params.launch_options() if hasattr(params, "launch_options") else {}
    return triton.compile(src, target=TARGET, options={"num_warps": 4, **extra})


def analyze(kernel) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        ptx = os.path.join(d, "k.ptx")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        Path(ptx).write_text(kernel.asm["ptx"])
        sass = subprocess.run([str(_BIN / "cuobjdump"), "--dump-sass", cubin], capture_output=True, text=True).stdout
        res = subprocess.run([str(_BIN / "cuobjdump"), "--dump-resource-usage", cubin], capture_output=True,
                             text=True).stdout
        # ptxas -v on the same PTX: spill bytes and the wgmma serialization notes (C7514, C7515: every wgmma then
        # waits for the one before) Triton does not show
        pv = subprocess.run([str(_BIN / "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(d, "x.cubin")],
                            capture_output=True, text=True)
        ptxas = pv.stdout + pv.stderr
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    ins = []
    for line in sass.splitlines():
        mm = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if mm:
            ins.append((int(mm.group(1), 16), mm.group(2)))
    setmaxnreg = [int(x, 16) for x in re.findall(r"USETMAXREG\.\S+\s+(?:UP0, )?(0x[0-9a-f]+)", sass)]
    loops = []
    for addr, text in ins:
        b = re.search(r"BRA (0x[0-9a-f]+)", text)
        if not b or text.startswith("BRA"):  # unconditional back branches are the wait retries / WS dispatch
            continue
        target = int(b.group(1), 16)
        if target < addr and (addr - target) // 16 > 50:
            body = [t for a, t in ins if target <= a <= addr]
            mix = collections.Counter()
            for t in body:
                op = t.split()[1] if t.startswith("@") else t.split()[0]
                mix[op.split(".")[0]] += 1
            if mix["QGMMA"] and mix["LDGSTS"]:
                continue  # a branch around several partitions (the warp-specialize dispatch), not a tile loop
            kind = ("consumer" if mix["QGMMA"] else "producer" if mix["LDGSTS"] else "converter" if mix["F2FP"]
                    else "other")
            loops.append({"kind": kind, "start": hex(target), "len": len(body),
                          "ops": {o: mix[o] for o in LOOP_OPS if mix[o]}})
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    return {
        "regs_launch": int(m.group(1)) if m else None,
        "stack": int(m.group(2)) if m else None,
        "shared": kernel.metadata.shared,
        "setmaxnreg": setmaxnreg,
        "spill_stores": int(spill.group(1)) if spill else None,
        "spill_loads": int(spill.group(2)) if spill else None,
        # C7510-C7515: ptxas serialized the wgmmas (a whole kernel's worth); C7516-C7519: it injected a warpgroup
        # wait / arrive at a few places (registers an in-flight wgmma defines or reads)
        "wgmma_serialized": bool(re.search(r"C751[0-5]", ptxas)),
        "wgmma_injected": len(re.findall(r"C751[6-9]", ptxas)),
        "loops": loops,
        "sass": sass,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sass-dir", default=None, help="also write each config's SASS, PTX and TTGIR here")
    p.add_argument("--kernel", choices=("gluon", "few", "seesaw"), default="gluon",
                   help="gluon_decode_kernel (64 heads a CTA) or gluon_few_heads.few_heads_kernel (<= 16 heads)")
    p.add_argument("--config", action="append", default=[],
                   help="GluonParams / FewHeadsParams overrides as field=value,... e.g. v_slots=2,cvt_rows=16 "
                        "(repeatable; default: a list)")
    a = p.parse_args()
    what = ("few_heads_kernel (reg_v: consumer WG0, gatherer WG1; nvfp4: + converter WG2)" if a.kernel == "few"
            else "gluon_decode_kernel (12 warps: WG0 + WG1 consumers, WG2 producer)")
    print(f"triton {triton.__version__}, target sm_90a, {what}")
    given = [{kv.split("=")[0]: int(kv.split("=")[1]) for kv in c.split(",") if kv} for c in a.config]
    for cfg in given or {"few": FEW_CONFIGS, "seesaw": SEESAW_CONFIGS}.get(a.kernel, CONFIGS):
        name = ",".join(f"{k}={v}" for k, v in cfg.items()) or "default"
        try:
            k = compile_gluon(a.kernel, **cfg)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name}: COMPILE FAILED: {str(e).splitlines()[-1][:200]}")
            continue
        s = analyze(k)
        print(f"{name}: smem {s['shared']} B, launch regs {s['regs_launch']}, stack {s['stack']} B, "
              f"spills st/ld {s['spill_stores']}/{s['spill_loads']} B, wgmma serialized: {s['wgmma_serialized']} (injected waits {s['wgmma_injected']}), "
              f"setmaxnreg {s['setmaxnreg']}")
        for lp in s["loops"]:
            ops = " ".join(f"{o}={n}" for o, n in lp["ops"].items())
            print(f"    {lp['kind']:8s} loop @{lp['start']}: {lp['len']} instrs  {ops}")
        if a.sass_dir:
            out = Path(a.sass_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{name.replace('/', '_')}.sass").write_text(s["sass"])
            (out / f"{name.replace('/', '_')}.ptx").write_text(k.asm["ptx"])
            (out / f"{name.replace('/', '_')}.ttgir").write_text(k.asm["ttgir"])


if __name__ == "__main__":
    main()
