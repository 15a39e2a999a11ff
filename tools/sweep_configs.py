#!/usr/bin/env python3
"""Sweep the Triton decode's tile configs on one GPU: accuracy against the float32 reference and CUDA-graph time.

Every config of CANDIDATES runs on the same data in one process (so the ratios are fair), K = 2048, inputs rotated
past the L2. The occupancy each compiled kernel gets (registers, shared memory) is printed beside its time.

    PYTHONPATH=. python3 tools/sweep_configs.py --out DIR [--only fp8]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from vllm_kimi_dsa.timing import ceilings  # noqa: E402
from vllm_kimi_dsa.formats import LATENT_DIM, quantize_rows, row_bytes  # noqa: E402
from vllm_kimi_dsa.kernels.common import make_workspace  # noqa: E402
from vllm_kimi_dsa.kernels.triton_decode import sparse_mla_decode  # noqa: E402
from vllm_kimi_dsa.planning import Config, choose_splits  # noqa: E402
from vllm_kimi_dsa.reference import reference_decode  # noqa: E402
from vllm_kimi_dsa.timing import cuda_graph_time_us, rotation_sets  # noqa: E402

K = 2048
CACHE_ROWS = 1 << 20
SCALE = 1.0 / math.sqrt(192.0)


def C(bh, bn, w, st, pf=False, lazy=False, swap=False, cps=1):
    return Config(block_h=bh, block_n=bn, num_warps=w, num_stages=st, ctas_per_sm=cps, prefetch=pf, lazy=lazy,
                  swap=swap)


# The plain kernel's shipped configs (planning.default_config) first, then the tiles next to them. Where it
# still ships: nvfp4_ds_mla at > 32 heads, and everywhere the Gluon kernels do not run. Earlier rounds' candidates
# and results: docs/history.md v3 / v4.
FP8_128 = [C(64, 64, 8, 2), C(64, 64, 16, 2), C(64, 32, 16, 2)]
NV_128 = [C(64, 64, 8, 2), C(64, 32, 8, 3)]
NV_32 = [C(16, 32, 4, 1, pf=True, lazy=True, cps=2), C(32, 32, 8, 1, pf=True, lazy=True)]
NV_12 = [C(16, 32, 4, 1, pf=True, lazy=True, cps=2), C(16, 32, 4, 2, cps=2), C(16, 64, 4, 1, pf=True, lazy=True, cps=2)]
CANDIDATES = {("fp8", 128): FP8_128, ("nvfp4_ds_mla", 128): NV_128, ("nvfp4_ds_mla", 32): NV_32,
              ("nvfp4_ds_mla", 12): NV_12}
ROWS = {128: (5, 20, 80, 320), 96: (5, 80, 320), 32: (5, 80, 320), 16: (5, 80, 320), 12: (5, 80, 320)}


def profile(fmt, heads, ci, rows):
    """Compile, then run one config once at `rows` x K (ncu -k regex:_decode_kernel -s 1 -c 1 profiles the 2nd)."""
    heads, ci, rows = int(heads), int(ci), int(rows)
    dev = torch.device("cuda")
    cfg = CANDIDATES[(fmt, heads)][ci]
    g = torch.Generator(device=dev).manual_seed(1)
    kv = quantize_rows(torch.randn(1 << 19, 576, device=dev, generator=g) * (8 if fmt == "fp8" else 1), fmt)
    q = (torch.randn(rows, heads, 576, device=dev, generator=g) * 4).to(torch.float8_e4m3fn)
    sl = torch.randint(0, 1 << 19, (rows, K), device=dev, generator=g, dtype=torch.int32)
    cs = torch.full((rows,), K, device=dev, dtype=torch.int32)
    out = torch.empty((rows, heads, LATENT_DIM), dtype=torch.bfloat16, device=dev)
    for _ in range(2):
        sparse_mla_decode(q, kv, sl, cs, fmt=fmt, softmax_scale=0.01, output_scale=1.0, out=out, config=cfg, splits=1)
    torch.cuda.synchronize()
    print(f"profiled {fmt} H{heads} {cfg} rows {rows}")


def splits_probe(out_dir):
    """Default config, fp8, 128 and 12 heads, 1-20 rows: µs for each KV split count, beside choose_splits' pick."""
    from vllm_kimi_dsa.planning import default_config

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    g = torch.Generator(device=dev).manual_seed(1)
    kv = quantize_rows(torch.randn(CACHE_ROWS, 576, device=dev, generator=g) * 8, "fp8")
    res = []
    for heads, rows in ((128, 1), (128, 5), (128, 20), (12, 5), (12, 20)):
        cfg = default_config(heads, "fp8")
        pick = choose_splits(rows, heads, K, cfg, sms)
        sets = rotation_sets(rows * K * 576, lo=1, hi=24)
        qs = [(torch.randn(rows, heads, 576, device=dev, generator=g) * 4).to(torch.float8_e4m3fn) for _ in range(sets)]
        ss = [torch.randint(0, CACHE_ROWS, (rows, K), device=dev, generator=g, dtype=torch.int32) for _ in range(sets)]
        cs = torch.full((rows,), K, device=dev, dtype=torch.int32)
        outs = [torch.empty((rows, heads, LATENT_DIM), dtype=torch.bfloat16, device=dev) for _ in range(sets)]
        line = f"H{heads} rows {rows} (pick {pick}):"
        for splits in sorted({1, 2, 4, 6, 8, 11, 16, 22, 32, pick}):
            ws = make_workspace(dev, heads=heads, max_rows=rows, widths=(K,), fmt="fp8", config=cfg)
            if splits > 1 and rows * splits * heads > ws.capacity:
                ws.part_out = torch.empty(rows * splits * heads * LATENT_DIM, dtype=ws.part_out.dtype, device=dev)
                ws.part_lse = torch.empty(rows * splits * heads, device=dev)
                ws.capacity = rows * splits * heads
            fns = [(lambda i=i, ws=ws, sp=splits: sparse_mla_decode(qs[i], kv, ss[i], cs, fmt="fp8", softmax_scale=0.01,
                                                                     output_scale=1.0, out=outs[i], workspace=ws,
                                                                     config=cfg, splits=sp)) for i in range(sets)]
            us = cuda_graph_time_us(fns)
            res.append(dict(heads=heads, rows=rows, splits=splits, pick=pick, us=us))
            line += f" {splits}:{us:.1f}"
        print(line, flush=True)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "splits.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), results=res), indent=1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--only", default="")
    p.add_argument("--profile", default="", help="fmt,heads,config index,rows: one launch only (for ncu)")
    p.add_argument("--defaults", action="store_true", help="time default_config at 128 and 12 heads instead")
    p.add_argument("--splits", action="store_true", help="time default_config at few rows over a range of KV splits")
    a = p.parse_args()
    if a.splits:
        return splits_probe(a.out)
    if a.defaults:
        from vllm_kimi_dsa.planning import default_config

        CANDIDATES.clear()
        CANDIDATES.update({(f, h): [default_config(h, f)] for f in ("fp8", "nvfp4_ds_mla") for h in (128, 12)})
    if a.profile:
        return profile(*a.profile.split(","))
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ceil = ceilings(dev, quick=True)
    print(f"{torch.cuda.get_device_name()} sms={sms} copy {ceil['copy_GBps']:.0f} GB/s, bf16 mm {ceil['bf16_TFLOPs']:.0f} TF/s", flush=True)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(CACHE_ROWS, 576, device=dev, generator=g)
    caches = {"fp8": quantize_rows(x * 8, "fp8"), "nvfp4_ds_mla": quantize_rows(x, "nvfp4_ds_mla")}
    del x
    results = []
    for (fmt, heads), cfgs in CANDIDATES.items():
        if a.only and a.only not in fmt:
            continue
        kv = caches[fmt]
        oscale = 0.125 if fmt == "fp8" else 1.0
        sscale = SCALE * 0.25 * (0.125 if fmt == "fp8" else 1.0)
        # accuracy case: 5 rows, one count 0, holes
        q5 = (torch.randn(5, heads, 576, device=dev, generator=g) * 4).to(torch.float8_e4m3fn)
        s5 = torch.randint(0, CACHE_ROWS, (5, K), device=dev, generator=g, dtype=torch.int32)
        s5[torch.rand(5, K, device=dev, generator=g) < 0.05] = -1
        c5 = torch.tensor([K, 0, 1000, K - 1, 77], device=dev, dtype=torch.int32)
        ref, ref_lse = reference_decode(q5, kv, s5, c5, fmt=fmt, softmax_scale=sscale, output_scale=oscale)
        for ci, cfg in enumerate(cfgs):
            name = f"{fmt}/H{heads}/c{ci}"
            out = torch.full((5, heads, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=dev)
            lse = torch.full((5, heads), float("nan"), device=dev)
            t0 = time.time()
            try:
                h = sparse_mla_decode(q5, kv, s5, c5, fmt=fmt, softmax_scale=sscale, output_scale=oscale, out=out, lse=lse, config=cfg)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                print(f"{name} {cfg} FAILED {str(e)[:200]}", flush=True)
                continue
            comp = time.time() - t0
            fin = torch.isfinite(ref_lse)
            rel = float((out.float() - ref).norm() / ref.norm())
            lse_err = float((lse[fin] - ref_lse[fin]).abs().max())
            ok = bool(torch.isfinite(out).all()) and bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all())
            regs, smem = getattr(h, "n_regs", -1), getattr(h, "metadata", None)
            smem = getattr(smem, "shared", -1) if smem is not None else -1
            spills = getattr(h, "n_spills", -1)
            threads = cfg.num_warps * 32
            occ = min(65536 // max(1, regs * threads), (232448 - 1024) // max(1, smem + 1024)) if regs > 0 else -1
            rec = dict(fmt=fmt, heads=heads, config=cfg.__dict__, rel_l2=rel, lse_err=lse_err, ok=ok, regs=regs,
                       spills=spills, smem=smem, ctas_per_sm=occ, compile_s=comp, times={})
            line = f"{name:22s} bh{cfg.block_h} bn{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} " \
                   f"pf{int(cfg.prefetch)} lz{int(cfg.lazy)} sw{int(cfg.swap)}: " \
                   f"regs {regs} spill {spills} smem {smem // 1024}K occ {occ} | rel {rel:.1e} lse {lse_err:.1e} {'ok' if ok else 'BAD'} |"
            cfg_occ = Config(**{**cfg.__dict__, "ctas_per_sm": max(1, occ)})
            for rows in ROWS[heads]:
                per_call = rows * K * row_bytes(fmt)
                sets = rotation_sets(per_call, lo=1, hi=24)
                qs = [(torch.randn(rows, heads, 576, device=dev, generator=g) * 4).to(torch.float8_e4m3fn) for _ in range(sets)]
                ss = [torch.randint(0, CACHE_ROWS, (rows, K), device=dev, generator=g, dtype=torch.int32) for _ in range(sets)]
                cs = torch.full((rows,), K, device=dev, dtype=torch.int32)
                outs = [torch.empty((rows, heads, LATENT_DIM), dtype=torch.bfloat16, device=dev) for _ in range(sets)]
                lses = [torch.empty((rows, heads), device=dev) for _ in range(sets)]
                splits = choose_splits(rows, heads, K, cfg_occ, sms)
                ws = make_workspace(dev, heads=heads, max_rows=rows, widths=(K,), fmt=fmt, config=cfg_occ)
                fns = [(lambda i=i: sparse_mla_decode(qs[i], kv, ss[i], cs, fmt=fmt, softmax_scale=sscale, output_scale=oscale,
                                                      out=outs[i], lse=lses[i], workspace=ws, config=cfg_occ, splits=splits))
                       for i in range(sets)]
                us = cuda_graph_time_us(fns)
                flops = 2 * rows * heads * K * 1088
                rec["times"][rows] = dict(us=us, splits=splits, tflops=flops / us / 1e6, GBps=per_call / us / 1e3)
                line += f" {rows}:{us:.1f}us/{splits}s"
            print(line, flush=True)
            results.append(rec)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "sweep.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), ceilings=ceil,
                                                            torch=torch.__version__, results=results), indent=1))


if __name__ == "__main__":
    main()
