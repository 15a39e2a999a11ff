#!/usr/bin/env python3
"""What the few-heads kernel's gather ring alone can read: the decode's pipeline with its math taken out.

bench_gather_floor.py shows the H200 reads random 576-byte rows at ~0.92-1.04 of the copy bandwidth with plain
loads and many CTAs an SM. The few-heads kernel (one CTA an SM, common.gluon.gatherer's cp.async into a K ring of
K_STAGES x 36 KB) reached ~0.67 (docs/history.md v12). This kernel runs the very same gatherer (and, in "convert"
mode, the 64-head kernel's e4m3 -> fp16 conversion step `_convert_tile` into a V16 ring, in a warpgroup of its own)
against a default partition that only waits for each tile and frees it at once:

- mode "gather": the ring alone, K_STAGES 2..6 (fp8, 36 KB a stage) or 3..9 (nvfp4_ds_mla, 22.5 KB a stage);
- mode "convert": gathers + the e4m3 -> fp16 conversion (K ring 4, V16 2 halves);
- "few": the shipped few-heads kernel (H = 16, reg_v_params() / nvfp4_params()) on the same batch, in the same run.

So the gap between the real kernel and "gather" is the consumer's, between "convert" and "gather" the conversion's,
and "gather" vs its stage count says how the rate grows with the bytes in flight (Little's law: rate = bytes in
flight / latency). One CTA a (split, row), the grid and split ranges of the real kernel.

    PYTHONPATH=. python3 tools/bench_ring_floor.py --out DIR [--rows 264] [--splits 1] [--only NAMES]
    python3 tools/bench_ring_floor.py --compile-only     # any machine: each variant compiled for sm_90a
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "benchmarks"))  # bench_gluon

from vllm_kimi_dsa.formats import quantize_rows, row_bytes  # noqa: E402
from vllm_kimi_dsa.kernels import gluon_decode as gd  # noqa: E402
from vllm_kimi_dsa.kernels.common import gluon as cg  # noqa: E402
from vllm_kimi_dsa.kernels import gluon_few_heads as gfh  # noqa: E402

BLOCK_N = gfh.BLOCK_N

if gd.gl is not None:
    gl = gd.gl
    gluon = gd.gluon
    mbarrier = gd.mbarrier
    _BN = gl.constexpr(BLOCK_N)
    _CVT_ROWS = gl.constexpr(gd.DEFAULT_CVT_ROWS)

    @gluon.jit
    def _releaser(bias_s, k_ready, k_empty, v_ready, v_empty, out_ptr, pid, num_tiles,
                  K_STAGES: gl.constexpr, V_SLOTS: gl.constexpr, CONVERT: gl.constexpr):
        """Wait for each tile (and its V16 halves in CONVERT mode) and free it at once; store the bias sums (one
        per token of a tile: a cross-warp gl.sum here wrote its scratch past the allocation on Triton 3.6 when the
        ring's size was not a power of 2, memcheck: 0x1b800 of 111548 B)."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        acc = gl.zeros([_BN], gl.float32, layout)
        for it in range(num_tiles):
            stage = it % K_STAGES
            mbarrier.wait(k_ready.index(stage), (it // K_STAGES) & 1)
            acc += bias_s.index(stage).load(layout)
            mbarrier.arrive(k_empty.index(stage))
            if CONVERT:
                for half in gl.static_range(2):
                    u = 2 * it + half
                    mbarrier.wait(v_ready.index(u % V_SLOTS), (u // V_SLOTS) & 1)
                    mbarrier.arrive(v_empty.index(u % V_SLOTS))
        gl.store(out_ptr + pid * _BN + gl.arange(0, _BN, layout), acc)

    @gluon.jit
    def _converter(k_lat_s, v16_s, k_ready, k_empty, v_ready, v_empty, num_tiles,
                   K_STAGES: gl.constexpr, V_SLOTS: gl.constexpr):
        """The 64-head kernel's conversion step (gluon_decode._convert_tile) over the tiles, as soon as each lands."""
        for j in range(num_tiles):
            gd._convert_tile(k_lat_s, v16_s, k_ready, k_empty, v_ready, v_empty, j, _BN, K_STAGES, V_SLOTS, _CVT_ROWS)

    @gluon.jit
    def ring_kernel(kv_ptr, slots_ptr, counts_ptr, out_ptr, K, num_splits, stride_kv, stride_s_row,
                    K_STAGES: gl.constexpr, V_SLOTS: gl.constexpr, CONVERT: gl.constexpr, NVFP4: gl.constexpr):
        """One (split, row): the few-heads kernel's gather ring (and converter) with no consumer math."""
        split = gl.program_id(1)
        row = gl.program_id(2)
        start, end, num_tiles = cg.split_tiles(counts_ptr, row, split, num_splits, 0, K, _BN)  # even splits
        lat_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        rope_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        v16_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        if NVFP4:
            k_lat_s = gl.allocate_shared_memory(gl.uint8, [K_STAGES, _BN, 256], plain)
            sc_s = gl.allocate_shared_memory(gl.uint8, [K_STAGES, _BN, 32], plain)
        else:
            k_lat_s = gl.allocate_shared_memory(gl.float8e4nv, [K_STAGES, _BN, 512], lat_layout)
        k_rope_s = gl.allocate_shared_memory(gl.float8e4nv, [K_STAGES, _BN, 64], rope_layout)
        bias_s = gl.allocate_shared_memory(gl.float32, [K_STAGES, _BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [V_SLOTS, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [V_SLOTS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(K_STAGES):
            mbarrier.init(k_ready.index(i), count=129)
            mbarrier.init(k_empty.index(i), count=2 if CONVERT else 1)
        for i in gl.static_range(V_SLOTS):
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=1)
        pid = row * num_splits + split
        if CONVERT:
            v16_s = gl.allocate_shared_memory(gl.float16, [V_SLOTS, _BN, 256], v16_layout)
            gl.warp_specialize(
                [
                    (_releaser, (bias_s, k_ready, k_empty, v_ready, v_empty, out_ptr, pid, num_tiles,
                                 K_STAGES, V_SLOTS, True)),
                    (cg.gatherer, (k_lat_s, k_rope_s, bias_s, k_ready, k_empty,
                                    kv_ptr, slots_ptr, row, start, end, num_tiles, stride_kv, stride_s_row,
                                    _BN, K_STAGES)),
                    (_converter, (k_lat_s, v16_s, k_ready, k_empty, v_ready, v_empty, num_tiles,
                                  K_STAGES, V_SLOTS)),
                ],
                [4, 4],
                [120, 128],
            )
        elif NVFP4:
            gl.warp_specialize(
                [
                    (_releaser, (bias_s, k_ready, k_empty, v_ready, v_empty, out_ptr, pid, num_tiles,
                                 K_STAGES, V_SLOTS, False)),
                    (cg.gatherer, (k_lat_s, k_rope_s, bias_s, k_ready, k_empty,
                                    kv_ptr, slots_ptr, row, start, end, num_tiles, stride_kv, stride_s_row,
                                    _BN, K_STAGES, sc_s, True)),
                ],
                [4],
                [120],
            )
        else:
            gl.warp_specialize(
                [
                    (_releaser, (bias_s, k_ready, k_empty, v_ready, v_empty, out_ptr, pid, num_tiles,
                                 K_STAGES, V_SLOTS, False)),
                    (cg.gatherer, (k_lat_s, k_rope_s, bias_s, k_ready, k_empty,
                                    kv_ptr, slots_ptr, row, start, end, num_tiles, stride_kv, stride_s_row,
                                    _BN, K_STAGES)),
                ],
                [4],
                [120],
            )


def variants() -> list[dict]:
    """(name, mode, format, K ring, V16) of each timed kernel; the smem of each fits 227 KB."""
    out = [dict(name=f"gather-k{k}", mode="gather", fmt="fp8", k_stages=k, v_slots=1) for k in range(2, 7)]
    out += [dict(name=f"gather-k{k}-nvfp4", mode="gather", fmt="nvfp4_ds_mla", k_stages=k, v_slots=1)
            for k in (3, 4, 6, 9)]
    out += [dict(name="convert-k4v2", mode="convert", fmt="fp8", k_stages=4, v_slots=2),
            dict(name="few", mode="few", fmt="fp8", k_stages=3, v_slots=0),
            dict(name="few-nvfp4", mode="few", fmt="nvfp4_ds_mla", k_stages=3, v_slots=0)]
    return out


def ring_constexprs(v: dict) -> dict[str, Any]:
    """ring_kernel's compile-time arguments for variant `v` (its launch's and compile_variant's)."""
    return dict(K_STAGES=v["k_stages"], V_SLOTS=max(v["v_slots"], 1), CONVERT=v["mode"] == "convert",
                NVFP4=v["fmt"] != "fp8")


def compile_variant(v: dict) -> Any:
    """ring_kernel of variant `v` compiled for sm_90a on any machine (no GPU): the launch's signature, with the
    16-divisibility the JIT sees from torch allocations."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    consts = ring_constexprs(v)
    sig = dict(kv_ptr="*u8" if consts["NVFP4"] else "*fp8e4nv", slots_ptr="*i32", counts_ptr="*i32",
               out_ptr="*fp32", K="i32", num_splits="i32", stride_kv="i32", stride_s_row="i32")
    sig.update({k: "constexpr" for k in consts})
    fn = ring_kernel
    divisible = ("kv_ptr", "slots_ptr", "counts_ptr", "out_ptr", "K", "stride_kv", "stride_s_row")
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--rows", default="264,320")
    p.add_argument("--splits", type=int, default=1)
    p.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    p.add_argument("--compile-only", action="store_true", help="compile each ring variant for sm_90a (no GPU)")
    a = p.parse_args()
    chosen = [v for v in variants() if not a.only or v["name"] in a.only.split(",")]
    if a.compile_only:
        for v in chosen:
            if v["mode"] != "few":
                print(f"RESULT {v['name']} shared {compile_variant(v).metadata.shared}")
        return
    from bench_gluon import CACHE_ROWS, K, OSCALE, SSCALE, time_rotated
    from vllm_kimi_dsa.timing import ceilings

    dev = torch.device("cuda")
    ceil = ceilings(dev, quick=True)
    copy = ceil["copy_GBps"]
    print(f"copy {copy:.0f} GB/s (read + written)", flush=True)
    g = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(CACHE_ROWS, 576, device=dev, generator=g) * 8
    caches = {fmt: quantize_rows(x, fmt) for fmt in ("fp8", "nvfp4_ds_mla")}
    del x
    res = []
    splits = a.splits
    for rows in (int(r) for r in a.rows.split(",")):
        for v in chosen:
            kv = caches[v["fmt"]]
            rb = row_bytes(v["fmt"])
            if v["mode"] == "few":
                params = gfh.nvfp4_params() if v["fmt"] != "fp8" else gfh.reg_v_params()

                def make_call(q, s, c, o, lse, ws, kv=kv, params=params):
                    return lambda: gfh.few_heads_sparse_mla_decode(
                        q, kv, s, c, softmax_scale=SSCALE, output_scale=OSCALE, out=o, lse=lse, workspace=ws,
                        splits=splits, params=params)
            else:  # the same rotated slots; the queries and outputs time_rotated makes go unused
                sink = torch.empty(rows * splits * BLOCK_N, device=dev)

                def make_call(q, s, c, o, lse, ws, kv=kv, sink=sink, consts=ring_constexprs(v)):
                    return lambda: ring_kernel[(1, splits, rows)](kv, s, c, sink, K, splits, kv.stride(0), s.stride(0),
                                                                   **consts, num_warps=4)
            try:
                us = time_rotated(make_call, rows, gfh.BLOCK_H, splits, rb, dev, g)[0]
            except Exception as e:  # noqa: BLE001 - record and go on: one variant must not cost the others
                print(f"{v['name']:>22} rows {rows}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                res.append(dict(v, rows=rows, splits=splits, error=f"{type(e).__name__}: {e}"))
                continue
            gbps = rows * K * rb / us / 1e3
            stage_kb = BLOCK_N * rb / 1024
            rec = dict(v, rows=rows, splits=splits, us=us, GBps=gbps, copy_frac=gbps / copy,
                       ring_kb=v["k_stages"] * stage_kb)
            res.append(rec)
            print(f"{v['name']:>22} rows {rows}: {us:8.1f} µs {gbps:7.0f} GB/s {gbps / copy:5.2f} of copy "
                  f"(K ring {rec['ring_kb']:.0f} KB)", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    name = "ring_floor" + (f"_{a.only.replace(',', '_')}" if a.only else "")
    (Path(a.out) / f"{name}.json").write_text(json.dumps(dict(copy_GBps=copy, K=K, cache_rows=CACHE_ROWS,
                                                                  results=res), indent=1))


if __name__ == "__main__":
    main()
