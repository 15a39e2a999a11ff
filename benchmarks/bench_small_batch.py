#!/usr/bin/env python3
"""Where a small batch's time goes (H = 128, FP8 cache, K = 2048, the 64-head Gluon kernel at choose_splits' split
count): the whole call, the main kernel alone, the combine alone (as shipped, and at the --warps counts), each
timed in a CUDA graph over inputs rotated past the L2 (bench_gluon.time_rotated).
Prints a line a row count and writes small_batch.json.

    python3 benchmarks/bench_small_batch.py --out DIR [--rows 1,5,8,20,32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_gluon import CACHE_ROWS, HEADS, K, OSCALE, SSCALE, time_rotated  # noqa: E402

from vllm_kimi_dsa.formats import LATENT_DIM, quantize_rows, row_bytes  # noqa: E402
from vllm_kimi_dsa.kernels import gluon_decode as gd  # noqa: E402
from vllm_kimi_dsa import planning  # noqa: E402
from vllm_kimi_dsa.kernels import common as kcommon  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--rows", default="1,5,8,20,32")
    p.add_argument("--warps", default="2,4", help="the combine's num_warps to time too (empty: none)")
    a = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    kv = quantize_rows(torch.randn(CACHE_ROWS, 576, device=dev, generator=g) * 8, "fp8")
    params = gd.GluonParams()
    cfg = params.config()
    sms = kcommon.num_sms(dev)
    consts = gd.kernel_constexprs(params)
    blocks = triton.cdiv(HEADS, gd.BLOCK_H)
    dtype = kcommon.PARTIAL_DTYPE
    results = []
    for rows in (int(r) for r in a.rows.split(",")):
        splits = planning.choose_splits(rows, HEADS, K, cfg, sms)

        def full(q, s, c, o, lse, ws):
            return lambda: gd.launch(q, kv, s, c, o, lse, SSCALE, OSCALE, ws, splits, params)

        def main_only(q, s, c, o, lse, ws):
            return lambda: gd.call_kernel(gd.gluon_decode_kernel, (blocks, splits, rows), q, kv, s, c, o, lse,
                                          SSCALE, OSCALE, ws, splits, consts)

        def combine(nw):
            def make(q, s, c, o, lse, ws):
                return lambda: kcommon.combine_kernel[(HEADS, rows)](
                    ws.part_out, ws.part_lse, o, lse, HEADS, splits, o.stride(0), o.stride(1), lse.stride(0), OSCALE,
                    SPLITS=triton.next_power_of_2(splits), D=LATENT_DIM, num_warps=nw)
            return make

        def combine_now(q, s, c, o, lse, ws):
            return lambda: kcommon.combine(ws, o, lse, splits, OSCALE)

        rec = {"rows": rows, "splits": splits, "partial_dtype": str(dtype).removeprefix("torch."),
               "partial_MB": rows * splits * HEADS * LATENT_DIM * dtype.itemsize / 1e6 if splits > 1 else 0.0,
               "kv_MB": rows * K * row_bytes("fp8") / 1e6}
        rec["full_us"] = time_rotated(full, rows, HEADS, splits, row_bytes("fp8"), dev, g)[0]
        rec["main_us"] = time_rotated(main_only, rows, HEADS, splits, row_bytes("fp8"), dev, g)[0]
        if splits > 1:
            rec["combine_us"] = time_rotated(combine_now, rows, HEADS, splits, row_bytes("fp8"), dev, g)[0]
            for nw in (int(w) for w in filter(None, a.warps.split(","))):
                rec[f"combine_w{nw}_us"] = time_rotated(combine(nw), rows, HEADS, splits, row_bytes("fp8"), dev, g)[0]
        results.append(rec)
        print(" ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "small_batch.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "heads": HEADS, "K": K,
         "results": results}, indent=1))


if __name__ == "__main__":
    main()
