"""Timing of GPU calls for the user commands (tune, bench) and the developer benchmarks: CUDA-graph replays over
rotated inputs, the host clock off CUDA, how many input sets a graph rotates through to read past L2, and the
machine's copy / matmul ceilings every benchmark result is reported against.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

L2_BYTES = 60 * 2**20  # H200 / B200 L2: the rotation must read more than this per replay


def cuda_graph_time_us(calls: Sequence[Callable[[], Any]], *, reps_time_s: float = 0.05,
                       min_reps: int = 10, max_reps: int = 200) -> float:
    """Median µs per call of `calls`, run back to back inside one CUDA graph replayed many times.

    Each call is run once eagerly on a side stream first (compiles, allocates what it allocates),
    then all are captured into one graph; the graph is replayed and timed with CUDA events, one
    pair per replay, and the median replay time is divided by len(calls). Rotating over several
    calls that read different data keeps the KV reads out of L2.
    """
    import torch

    if not calls:
        raise ValueError("calls must not be empty")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    once = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max_reps, max(min_reps, reps_time_s / once)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
    del graph
    return ms * 1e3 / len(calls)


def wall_time_us(calls: Sequence[Callable[[], Any]], reps: int = 2) -> float:
    """Host wall µs per call (CPU / interpreter runs, where only the plumbing is being checked)."""
    for c in calls:
        c()
    t0 = time.perf_counter()
    for _ in range(reps):
        for c in calls:
            c()
    return (time.perf_counter() - t0) * 1e6 / (reps * len(calls))


def rotation_sets(bytes_per_call: int, *, lo: int = 2, hi: int = 32) -> int:
    """How many different input sets a graph rotates through so one replay reads > 2x L2."""
    return int(min(hi, max(lo, math.ceil(2 * L2_BYTES / max(bytes_per_call, 1)))))



# ---------------------------------------------------------------- the machine's ceilings


def _event_time_ms(fn: Callable[[], Any], reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def ceilings(device: torch.device, quick: bool) -> dict[str, Any]:
    """Copy bandwidth (bytes read + written / s), BF16 and FP8 dense matmul rates."""
    import torch

    res: dict[str, Any] = {}
    n = (1 << 30) if not quick else (1 << 29)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = _event_time_ms(lambda: dst.copy_(src), 10)
    res["copy_GBps"] = 2 * n / (ms * 1e-3) / 1e9
    res["copy_bytes"] = n
    del src, dst
    m = 8192
    a = torch.randn(m, m, device=device).to(torch.bfloat16)
    b = torch.randn(m, m, device=device).to(torch.bfloat16)
    ms = _event_time_ms(lambda: torch.mm(a, b), 10)
    res["bf16_TFLOPs"] = 2 * m**3 / (ms * 1e-3) / 1e12
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major second operand
        one = torch.ones((), device=device)
        ms = _event_time_ms(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 10)
        res["fp8_TFLOPs"] = 2 * m**3 / (ms * 1e-3) / 1e12
    except Exception as err:  # older torch / no fp8 GEMM: fp8 floors fall back to the BF16 rate
        res["fp8_TFLOPs"] = None
        res["fp8_error"] = repr(err)[:300]
    del a, b
    torch.cuda.empty_cache()
    return res


__all__ = ["L2_BYTES", "ceilings", "cuda_graph_time_us", "rotation_sets", "wall_time_us"]
