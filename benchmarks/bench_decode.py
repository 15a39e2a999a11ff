"""Benchmark of the Triton sparse MLA decode (kernels/triton_decode.py) on one GPU, with ceilings.

CUDA-graph replay over rotated input sets (past the L2); writes JSON and prints a table.
Usage: python3 benchmarks/bench_decode.py --out DIR [--quick] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_kimi_dsa.formats import LATENT_DIM, quantize_rows, row_bytes  # noqa: E402
from vllm_kimi_dsa.kernels.triton_decode import (  # noqa: E402
    Config,
    choose_splits,
    default_config,
    make_workspace,
    num_sms,
    sparse_mla_decode,
)

# FlashInfer fa3 (BatchMLAPagedAttentionWrapper) on the H200, H=128, K=2048 (SPEC 2.3), µs.
FA3_BF16 = {5: 21.0, 20: 40.9, 80: 138.0, 160: 208.0, 320: 366.0}
FA3_FP8 = {5: 48.7, 20: 113.0, 80: 469.0, 160: 704.0, 320: 1238.0}
ROWS = (1, 2, 4, 8, 16, 32, 64, 5, 20, 80, 160, 320)
K = 2048
L2_BYTES = 60e6


def _time_graph(fn, n_inner: int, reps: int = 30) -> float:
    """Median µs of one fn() call: graph of n_inner calls, replayed reps times."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_inner):
            fn(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n_inner)
    return statistics.median(times)


def ceilings() -> dict:
    dev = "cuda"
    n = 1 << 30  # 1 GiB each way
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    copy_bw = 2 * n / statistics.median(ts)
    del src, dst
    m = 8192
    x = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=dev, dtype=torch.bfloat16)

    def rate(f) -> float:
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            f()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e-3)
        return 2 * m**3 / statistics.median(ts)

    bf16 = rate(lambda: x @ y)
    x8 = x.to(torch.float8_e4m3fn)
    y8 = y.t().contiguous().to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    try:
        fp8 = rate(lambda: torch._scaled_mm(x8, y8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    except Exception as e:  # noqa: BLE001
        print("fp8 matmul failed:", e)
        fp8 = float("nan")
    return {"copy_GBps": copy_bw / 1e9, "bf16_TFLOPs": bf16 / 1e12, "fp8_TFLOPs": fp8 / 1e12}


class Problem:
    """Rotated input sets for one (fmt, heads, rows): one big cache, n_sets slot/query sets."""

    def __init__(self, fmt: str, heads: int, rows: int, cache: torch.Tensor, *, seed: int = 0):
        self.fmt, self.heads, self.rows = fmt, heads, rows
        g = torch.Generator(device="cuda").manual_seed(seed)
        kv_bytes = rows * K * row_bytes(fmt)
        self.n_sets = int(min(32, max(2, math.ceil(3 * L2_BYTES / kv_bytes))))
        n = cache.shape[0]
        self.cache = cache
        self.slots = [torch.randint(0, n, (rows, K), device="cuda", generator=g, dtype=torch.int32) for _ in range(self.n_sets)]
        self.counts = torch.full((rows,), K, dtype=torch.int32, device="cuda")
        self.q = [
            torch.randn(rows, heads, 576, device="cuda", generator=g).to(torch.float8_e4m3fn) for _ in range(self.n_sets)
        ]
        self.out = torch.empty(rows, heads, LATENT_DIM, dtype=torch.bfloat16, device="cuda")
        self.lse = torch.empty(rows, heads, dtype=torch.float32, device="cuda")

    def run(self, cfg: Config | None = None, splits: int | None = None) -> dict:
        cfg = cfg or default_config(self.heads, self.fmt)
        ws = make_workspace("cuda", heads=self.heads, max_rows=self.rows, widths=(K,), fmt=self.fmt, config=cfg)
        if splits is None:
            splits = choose_splits(self.rows, self.heads, K, cfg, num_sms(torch.device("cuda")))
        ss = 1.0 / math.sqrt(576.0)
        info = {}

        def call(i: int = 0):
            h = sparse_mla_decode(
                self.q[i], self.cache, self.slots[i], self.counts, fmt=self.fmt, softmax_scale=ss, output_scale=1.0,
                out=self.out, lse=self.lse, workspace=ws, config=cfg, splits=splits,
            )
            if not info and h is not None:
                info["n_regs"] = getattr(h, "n_regs", None)
                info["n_spills"] = getattr(h, "n_spills", None)
                try:
                    ptx = h.asm.get("ptx", "")
                    info["wgmma"] = "wgmma" in ptx
                    info["mma_sync"] = "mma.sync" in ptx
                    info["cp_async"] = "cp.async" in ptx
                except Exception:  # noqa: BLE001
                    pass
                info["shared"] = getattr(h.metadata, "shared", None) if hasattr(h, "metadata") else None

        us = _time_graph(call, self.n_sets)
        us2 = _time_graph(call, self.n_sets)
        flops = 2 * self.rows * self.heads * K * (576 + 512)
        kv_bytes = self.rows * K * row_bytes(self.fmt)
        io_bytes = kv_bytes + self.rows * self.heads * (576 + 2 * 512 + 4) + self.rows * K * 4
        return dict(
            fmt=self.fmt, heads=self.heads, rows=self.rows, us=us, us_repeat=us2, splits=splits,
            config=cfg.__dict__, n_sets=self.n_sets,
            TFLOPs=flops / us / 1e6, kv_GBps=kv_bytes / us / 1e3, io_GBps=io_bytes / us / 1e3, **info,
        )


def make_cache(fmt: str, num_rows: int) -> torch.Tensor:
    out = []
    step = 1 << 18
    for i in range(0, num_rows, step):
        n = min(step, num_rows - i)
        out.append(quantize_rows(torch.randn(n, 576, device="cuda"), fmt))
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="fewer points")
    ap.add_argument("--sweep", action="store_true", help="also time a few configs at key points")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    ceil = ceilings()
    print("ceilings:", {k: round(v, 1) for k, v in ceil.items()}, flush=True)
    results = []
    num_rows = 1 << 21  # 1.2 GB of fp8 rows: random slots touch far more than the L2
    heads_list = (128, 16, 12)
    rows_list = (5, 20, 80, 320) if args.quick else ROWS
    for fmt in ("fp8", "nvfp4_ds_mla"):
        cache = make_cache(fmt, num_rows)
        for heads in heads_list:
            for rows in rows_list:
                p = Problem(fmt, heads, rows, cache, seed=rows * 131 + heads)
                try:
                    r = p.run()
                except Exception as e:  # noqa: BLE001
                    r = dict(fmt=fmt, heads=heads, rows=rows, error=repr(e)[:300])
                results.append(r)
                print(json.dumps(r), flush=True)
                del p
        if args.sweep:
            variants = [
                Config(16, 64, 8, 2, 1), Config(16, 32, 8, 2, 2), Config(16, 32, 4, 3, 2), Config(16, 16, 4, 3, 2),
            ]
            for heads, rows in ((12, 320), (12, 20)):
                p = Problem(fmt, heads, rows, cache, seed=7)
                for cfg in variants:
                    if (cfg.block_h == 64) != (heads > 16):
                        continue
                    try:
                        r = p.run(cfg)
                    except Exception as e:  # noqa: BLE001
                        r = dict(fmt=fmt, heads=heads, rows=rows, config=cfg.__dict__, error=repr(e)[:300])
                    r["sweep"] = True
                    results.append(r)
                    print(json.dumps(r), flush=True)
                del p
        del cache
        torch.cuda.empty_cache()
    doc = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, K=K, ceilings=ceil, results=results,
               seconds=time.time() - t0)
    import triton

    doc["triton"] = triton.__version__
    with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print_table(doc)


def print_table(doc: dict) -> None:
    c = doc["ceilings"]
    print(f"\ncopy {c['copy_GBps']:.0f} GB/s, bf16 {c['bf16_TFLOPs']:.0f} TFLOP/s, fp8 {c['fp8_TFLOPs']:.0f} TFLOP/s")
    print(f"{'fmt':6} {'H':>3} {'rows':>4} {'sp':>3} {'us':>8} {'rep':>8} {'TF/s':>6} {'GB/s':>6} {'%copy':>5} {'fa3bf16':>7} {'fa3fp8/4':>8} cfg")
    for r in doc["results"]:
        if "error" in r:
            print(r["fmt"][:6], r["heads"], r["rows"], "ERROR", r["error"][:120])
            continue
        ref16 = FA3_BF16.get(r["rows"]) if r["heads"] == 128 else None
        ref8 = FA3_FP8.get(r["rows"]) if r["heads"] == 128 else None
        cfg = r["config"]
        print(
            f"{r['fmt'][:6]:6} {r['heads']:>3} {r['rows']:>4} {r['splits']:>3} {r['us']:8.1f} {r['us_repeat']:8.1f} "
            f"{r['TFLOPs']:6.0f} {r['kv_GBps']:6.0f} {100 * r['kv_GBps'] / c['copy_GBps']:5.0f} "
            f"{ref16 or '':>7} {(ref8 / 4 if ref8 else ''):>8} "
            f"{cfg['block_h']}/{cfg['block_n']}/{cfg['num_warps']}w/{cfg['num_stages']}s{' S' if r.get('sweep') else ''}"
            f" r{r.get('n_regs')} sp{r.get('n_spills')} wg{int(bool(r.get('wgmma')))}"
        )


if __name__ == "__main__":
    main()
