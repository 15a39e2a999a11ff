#!/usr/bin/env python3
"""The floor of the decode's memory access: how fast can the H200 read randomly gathered cache rows at all?

A Triton kernel that only gathers (16 rows a program, 16-byte loads, an xor-reduction so nothing is written but one
word a program) times reading rows x K rows of `row_bytes` at random slots of a 1 Mi-row cache, and the same rows
in order, against the copy bandwidth of the same run (bytes read + written / s, vllm_kimi_dsa.timing.ceilings). No MMA, no
shared memory, many CTAs an SM: what a decode kernel could reach if its gathers were all it did.

    PYTHONPATH=. python3 tools/bench_gather_floor.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from vllm_kimi_dsa.timing import ceilings  # noqa: E402

from vllm_kimi_dsa.timing import cuda_graph_time_us, rotation_sets  # noqa: E402

K = 2048
CACHE_ROWS = 1 << 20


@triton.jit
def _gather_xor(kv_ptr, slots_ptr, out_ptr, stride_kv, WORDS: tl.constexpr, WORDS_P2: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """xor of the BLOCK_N rows (WORDS int32 each) at slots[pid * BLOCK_N ...]."""
    pid = tl.program_id(0)
    slot = tl.load(slots_ptr + pid * BLOCK_N + tl.arange(0, BLOCK_N))
    offs = tl.arange(0, WORDS_P2)
    x = tl.load(kv_ptr + slot.to(tl.int64)[:, None] * stride_kv + offs[None, :], mask=offs[None, :] < WORDS, other=0)
    tl.store(out_ptr + pid, tl.reduce(tl.reduce(x, 1, _xor), 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--rows", default="80,320")
    a = p.parse_args()
    dev = torch.device("cuda")
    ceil = ceilings(dev, quick=True)
    print(f"copy {ceil['copy_GBps']:.0f} GB/s (read + written)", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    res = []
    for row_bytes in (576, 352, 1152):
        words = row_bytes // 4
        kv = torch.randint(-(1 << 30), 1 << 30, (CACHE_ROWS, words), device=dev, generator=g, dtype=torch.int32)
        for rows in (int(r) for r in a.rows.split(",")):
            n = rows * K
            sets = rotation_sets(n * row_bytes, lo=1, hi=24)
            for order in ("random", "in order"):
                if order == "random":
                    slots = [torch.randint(0, CACHE_ROWS, (n,), device=dev, generator=g, dtype=torch.int32)
                             for _ in range(sets)]
                else:
                    slots = [((torch.arange(n, device=dev) + i * n) % CACHE_ROWS).to(torch.int32) for i in range(sets)]
                outs = [torch.empty(n // 16, device=dev, dtype=torch.int32) for _ in range(sets)]
                calls = [lambda i=i: _gather_xor[(n // 16,)](kv, slots[i], outs[i], kv.stride(0), WORDS=words,
                                                               WORDS_P2=triton.next_power_of_2(words), BLOCK_N=16,
                                                               num_warps=4)
                         for i in range(sets)]
                us = cuda_graph_time_us(calls)
                gbps = n * row_bytes / us / 1e3
                res.append(dict(row_bytes=row_bytes, rows=rows, order=order, us=us, GBps=gbps,
                                copy_frac=gbps / ceil["copy_GBps"]))
                print(f"{row_bytes:5d} B rows, {rows:4d} x {K} {order:8s}: {us:8.1f} us {gbps:7.0f} GB/s "
                      f"{gbps / ceil['copy_GBps']:.2f} of copy", flush=True)
        del kv
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gather_floor.json").write_text(json.dumps(
        dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, K=K,
             cache_rows=CACHE_ROWS, ceilings=ceil, results=res), indent=1))


if __name__ == "__main__":
    main()
