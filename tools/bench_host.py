#!/usr/bin/env python3
"""Eager against CUDA-graph cost of a decode step through the cores (convert + decode, KimiDSACores.forward), per
layer. It asks one question: where the host is the limit. vLLM's FLASHINFER_MLA_SPARSE backend is
AttentionCGSupport.UNIFORM_BATCH. Pure decode batches replay a full graph. A mixed prefill + decode batch runs
attention outside the graph, and then every layer pays the Python launch path: argument checks, plan lookup,
Triton's JIT dispatch of the converter, the main kernel and the combine.

Per (heads, rows), on the same inputs (host cost is the question, not HBM, so nothing is rotated):
  host_us   the host's enqueue time of one layer-step (no sync inside the loop; kept under CUDA's launch queue)
  eager_us  the same loop to completion (synchronized at its end), per layer-step
  graph_us  the layers captured in one graph, the median replay per layer-step (timing.cuda_graph_time_us)
host_us >= graph_us means an eager step is host-bound.

    python3 tools/bench_host.py --out DIR [--heads 128,16] [--rows 1,5,20,80] [--layers 8] [--reps 16]

GPU only. Writes host_bench.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_kimi_dsa.synthetic import StandInImpl, StandInLayer, make_step  # noqa: E402
from vllm_kimi_dsa.timing import cuda_graph_time_us  # noqa: E402
from vllm_kimi_dsa.vllm_glue import KimiDSACores  # noqa: E402

WIDTH = 2048
# CUDA queues about 1024 launches before a launch blocks the host; a layer-step is at most 4 (converter, two
# launches of a tail-split plan, combine), so layers x reps stays under 1024 / 4 and host_us counts only the host.
MAX_STEPS = 240


def measure(heads: int, rows: int, layers: int, reps: int, fmt: str = "fp8") -> dict[str, float | int | str]:
    """host_us / eager_us / graph_us of one layer-step at (heads, rows), as the module docstring defines them."""
    if layers * reps > MAX_STEPS:
        raise ValueError(f"layers x reps = {layers * reps} > {MAX_STEPS}: host_us would count a blocked launch queue")
    dev = torch.device("cuda")
    pairs = [(StandInImpl(kv_cache_dtype=fmt), StandInLayer(_q_scale_float=0.05, _k_scale_float=0.02))
             for _ in range(layers)]
    cores = KimiDSACores(pairs, heads=heads, batch_sizes=(rows,), width=WIDTH, return_lse=True, lse_base2=False,
                         device=dev)
    steps = [make_step(rows, heads, WIDTH, fmt, device=dev, seed=i) for i in range(layers)]
    topk, metadata = steps[0].topk, steps[0].metadata  # one indexer buffer and block table, as vLLM shares them
    calls = [functools.partial(cores.forward, i, step.query, step.cache, topk, metadata)
             for i, step in enumerate(steps)]
    for _ in range(3):  # compiles, lazy inits
        for call in calls:
            call()
    torch.cuda.synchronize()

    t0 = time.perf_counter()
    for _ in range(reps):
        for call in calls:
            call()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()

    per = 1e6 / (layers * reps)
    return {
        "heads": heads, "rows": rows, "fmt": fmt, "layers": layers, "reps": reps,
        "kernel": cores.kernels[rows],
        "host_us": (t1 - t0) * per, "eager_us": (t2 - t0) * per,
        "graph_us": cuda_graph_time_us(calls),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--heads", default="128,16")
    p.add_argument("--rows", default="1,5,20,80")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=16)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_host.py needs a CUDA GPU: it times launches and graph replays")
    results = []
    print(f"{'H':>4} {'rows':>5} {'host µs':>8} {'eager µs':>9} {'graph µs':>9}  per layer-step")
    for heads in (int(h) for h in a.heads.split(",")):
        for rows in (int(r) for r in a.rows.split(",")):
            r = measure(heads, rows, a.layers, a.reps)
            results.append(r)
            bound = "  host-bound" if r["host_us"] >= r["graph_us"] else ""
            print(f"{heads:>4} {rows:>5} {r['host_us']:>8.1f} {r['eager_us']:>9.1f} {r['graph_us']:>9.1f}{bound}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_bench.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "width": WIDTH,
                                                     "results": results}, indent=1))


if __name__ == "__main__":
    main()
