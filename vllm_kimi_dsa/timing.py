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
    timer = GraphTimer(calls)
    try:
        return timer.time_us(reps_time_s=reps_time_s, min_reps=min_reps, max_reps=max_reps)
    finally:
        timer.close()


class GraphTimer:
    """`calls` captured once into a CUDA graph (after one eager run on a side stream); time_us() replays it, as often
    as asked, so several kernels' graphs can be timed in turn (interleaved_us) without capturing them again. The timer
    holds the calls until close(): the graph reads and writes the addresses it was captured with, so what only the
    calls hold (a peer's plan buffers, a kernel's workspace) must not go back to the allocator while it can replay."""

    def __init__(self, calls: Sequence[Callable[[], Any]]) -> None:
        import torch

        if not calls:
            raise ValueError("calls must not be empty")
        self.calls = len(calls)
        self._held: tuple[Callable[[], Any], ...] | None = tuple(calls)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph: Any = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for c in calls:
                c()
        self.graph.replay()
        torch.cuda.synchronize()

    def time_us(self, *, reps_time_s: float = 0.05, min_reps: int = 10, max_reps: int = 200) -> float:
        """Median µs per call: replays for about reps_time_s (min_reps..max_reps), one event pair each."""
        import torch

        t0 = time.perf_counter()
        self.graph.replay()
        torch.cuda.synchronize()
        once = max(time.perf_counter() - t0, 1e-6)
        reps = int(min(max_reps, max(min_reps, reps_time_s / once)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            s.record()
            self.graph.replay()
            e.record()
        torch.cuda.synchronize()
        ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
        return ms * 1e3 / self.calls

    def close(self) -> None:
        self.graph = None
        self._held = None  # after the graph: nothing replays into what the calls held


class HostTimer:
    """GraphTimer's stand-in off CUDA (Triton's interpreter, stand-in peers): the calls run eagerly, timed by the host
    clock, once a time_us(): it checks the plumbing, it measures nothing."""

    def __init__(self, calls: Sequence[Callable[[], Any]]) -> None:
        if not calls:
            raise ValueError("calls must not be empty")
        self.list = list(calls)
        self.calls = len(self.list)
        for c in self.list:
            c()

    def time_us(self, *, reps_time_s: float = 0.05, min_reps: int = 10, max_reps: int = 200) -> float:
        t0 = time.perf_counter()
        for c in self.list:
            c()
        return (time.perf_counter() - t0) * 1e6 / self.calls

    def close(self) -> None:
        self.list = []


def make_timer(calls: Sequence[Callable[[], Any]], device: Any) -> GraphTimer | HostTimer:
    """A GraphTimer on a CUDA device, else a HostTimer."""
    return GraphTimer(calls) if getattr(device, "type", str(device)) == "cuda" else HostTimer(calls)


def interleaved_us(timers: dict[str, GraphTimer | HostTimer], repeats: int, **kw: Any) -> dict[str, list[float]]:
    """µs per call of every timer, `repeats` rounds, each round timing every timer once in turn (the order rotated
    a round, so none always runs first or right after the same neighbour): {name: [round 1, ...]}. kw: time_us's."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(timers)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            out[name].append(timers[name].time_us(**kw))
    return out


def spread(values: Sequence[float]) -> dict[str, Any]:
    """The median of repeated timings and their spread: {us, us_min, us_max, us_iqr, spread (max - min) / median,
    us_repeats}."""
    if not values:
        raise ValueError("values must not be empty")
    v = sorted(float(x) for x in values)
    med = statistics.median(v)
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0], v[0], v[0]]
    return {"us": round(med, 3), "us_min": round(v[0], 3), "us_max": round(v[-1], 3),
            "us_iqr": round(q[2] - q[0], 3), "spread": round((v[-1] - v[0]) / med, 4) if med else 0.0,
            "us_repeats": [round(float(x), 3) for x in values]}


def l2_bytes(device: Any = None) -> int:
    """The device's L2 size in bytes (torch's device properties), L2_BYTES where there is none to ask."""
    try:
        import torch

        if device is not None and getattr(device, "type", str(device)) == "cuda":
            size = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
            if size > 0:
                return size
    except Exception:  # noqa: BLE001 - a device without the property: the documented default
        pass
    return L2_BYTES


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


__all__ = ["L2_BYTES", "GraphTimer", "HostTimer", "ceilings", "cuda_graph_time_us", "interleaved_us", "l2_bytes",
           "make_timer", "rotation_sets", "spread", "wall_time_us"]
