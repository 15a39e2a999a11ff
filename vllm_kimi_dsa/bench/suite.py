"""`python -m vllm_kimi_dsa bench --out DIR`: the one-GPU benchmark suite of the sparse MLA decode.

Our Triton kernel (FP8, nvfp4_ds_mla; FP8 with VLLM_KIMI_DSA_FP8_PV=1 at > 32 heads: triton-pv8/fp8) vs the Hopper
peers -- FlashInfer's SM90 fa3 (vLLM's FLASHINFER_MLA_SPARSE_SM90) and FlashMLA's sparse FP8 decode as vLLM's default
FLASHMLA_SPARSE runs it (vLLM's own _flashmla_C through its wrappers where the vLLM pack is carried, the call shapes
and query padding of FlashMLASparseImpl) -- also a plain-torch baseline, the top-k converter vs a same-bytes copy,
convert+decode in one graph, and the machine's copy / matmul ceilings every result is reported against. At every
point ours and each peer are timed in turn, --repeats rounds (median and spread; ratios with each side's fraction of
its own floor); accuracy on BF16 source data, each kernel on its own quantization, with stated tolerances. JSON first
(DIR/bench_suite.json); bench.plot draws it.

    python -m vllm_kimi_dsa bench --out DIR [--quick] [--no-peer] [--peers fa3,flashmla] [--flashmla DIR]

Same data for every kernel: one fp8 cache of e4m3(8 x) rows (k_scale 1/8), its nvfp4_ds_mla packing of x, its exact
BF16 dequantization (fa3) and that packed as 656 B fp8_ds_mla rows (FlashMLA); per (rows, H) the same slots and
queries (q_scale 1/4). Each row is a request of 2K tokens in its own random 64-row blocks and selects K = 2048 of
them, as the indexer does. Timing: a CUDA graph of calls over several input sets (queries, outputs, cache windows)
so one replay reads > 2x the 60 MB L2, median over replays; the peers are planned outside the graph (fa3's plan
syncs; FlashMLA's scheduler metadata is made once a batch shape).

The prefill section (bench.prefill, `--sections prefill` alone): 1 x 4096 and 4 x 1024 query tokens at H = 128 / 16
through serving.LayerStep as vLLM calls it, against FlashMLA's sparse prefill as vLLM runs it (with --peers flashmla;
benchmarks/peers/flashmla_prefill/prepare.sh makes its harness); the JSON's "prefill" key, bench_prefill.md.

The peers (bench.peers: fa3, flashmla, flashmla_prefill) install with the package; each runs where its library
(FlashInfer) or harness (FlashMLA's, unpacked into .carry/ by its prepare.sh) is found, and the JSON's info says why
one was skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from unittest import mock
from typing import Any, Callable, Iterator, NoReturn

import torch

from vllm_kimi_dsa import cli_types, envs
from vllm_kimi_dsa.bench import prefill as bench_prefill
from vllm_kimi_dsa.bench.peers import fa3, flashmla
from vllm_kimi_dsa.formats import (
    FP8_DS_MLA_ROW_BYTES, FP8_ROW_BYTES, HEAD_DIM, LATENT_DIM, NVFP4_ROW_BYTES, pack_nvfp4,
)
from vllm_kimi_dsa.heads import FEW_HEADS_MAX
from vllm_kimi_dsa.timing import (
    L2_BYTES, ceilings, cuda_graph_time_us, interleaved_us, l2_bytes, make_timer, spread,
)

PEER_KV = tuple(fa3.KV_DTYPES)  # the KV dtypes the fa3 peer builds
PEERS = ("fa3", "flashmla")  # fa3: FlashInfer's SM90 MLA wrapper; flashmla: FlashMLA's sparse FP8 decode (vLLM's)
FLASHMLA_KIND = "flashmla/fp8_ds_mla"

K = 2048
BLOCK = 64
SCALE = 1.0 / math.sqrt(192.0)  # K3's 1/sqrt(qk_nope + qk_rope)
Q_SCALE, K_SCALE = 0.25, 0.125  # query e4m3(4 z), cache e4m3(8 x): powers of two so BF16 copies are exact
FULL_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 20, 32, 64, 80, 160, 320)
FULL_HEADS = (128, 64, 32, 24, 16, 12, 8, 4)
QUICK_ROWS = (1, 5, 64, 320)
QUICK_HEADS = (128, 12)
ERROR_SIZES = ((1, 128), (5, 128), (320, 128), (20, 64), (160, 64), (80, 24), (64, 16), (20, 12), (5, 8), (64, 8),
               (20, 4))
QUICK_ERROR_SIZES = ((5, 128),)
TORCH_SIZES = ((1, 128), (5, 128), (20, 128), (80, 128), (5, 16), (80, 16))
FUSED_SIZES = ((1, 128), (5, 128), (20, 128), (80, 128), (320, 128), (5, 12), (80, 12))
ROW_BYTES = {"fp8": FP8_ROW_BYTES, "nvfp4_ds_mla": NVFP4_ROW_BYTES, "bf16": 2 * HEAD_DIM,
             "fp8_ds_mla": FP8_DS_MLA_ROW_BYTES}
MAX_SETS = 64  # input sets a pool: the cache windows (Data's shifted copies) one slot pool rotates through
MAX_POOLS = 8  # slot pools: past MAX_SETS sets a point draws another pool of slots over the same windows
REPEATS = 3  # timings of every kernel at a point, taken in turn (timing.interleaved_us)
# our kernel's rows of the tables: as the core binds it, with even plans only (--even), with VLLM_KIMI_DSA_FP8_PV=1
OUR_FAMILIES = ("triton", "triton-even", "triton-pv8")


def log(*a: Any) -> None:
    print(*a, flush=True)


# ---------------------------------------------------------------- data


class Data:
    """The shared caches: fp8 rows, their nvfp4 packing, BF16 dequantization and fp8_ds_mla packing of that (the
    last two for the peers), each with room for windows."""

    def __init__(self, device: torch.device, base_rows: int, shift: int, with_bf16: bool,
                 fp8_ds_mla: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """fp8_ds_mla: the packer of (n, 576) rows into 656-byte ones (peers.flashmla.quantize_fp8_ds_mla), or None."""
        self.device, self.base_rows, self.shift = device, base_rows, shift
        total = base_rows + shift * (MAX_SETS - 1)
        g = torch.Generator(device=device).manual_seed(2026)
        self.fp8 = torch.empty((total, HEAD_DIM), dtype=torch.float8_e4m3fn, device=device)
        self.nvfp4 = torch.empty((total, NVFP4_ROW_BYTES), dtype=torch.uint8, device=device)
        self.bf16 = torch.empty((total, HEAD_DIM), dtype=torch.bfloat16, device=device) if with_bf16 else None
        self.fmla = (torch.empty((total, ROW_BYTES["fp8_ds_mla"]), dtype=torch.uint8, device=device)
                     if fp8_ds_mla is not None else None)
        chunk = 65536
        for s in range(0, total, chunk):
            e = min(total, s + chunk)
            x = torch.randn((e - s, HEAD_DIM), device=device, generator=g)
            self.fp8[s:e] = (x / K_SCALE).to(torch.float8_e4m3fn)
            x = self.fp8[s:e].float() * K_SCALE  # the values all the caches hold (nvfp4, fp8_ds_mla up to rounding)
            self.nvfp4[s:e] = pack_nvfp4(x)
            if self.bf16 is not None:
                self.bf16[s:e] = x.to(torch.bfloat16)  # exact: e4m3 * 2^-3 fits BF16
            if self.fmla is not None and fp8_ds_mla is not None:
                self.fmla[s:e] = fp8_ds_mla(x.to(torch.bfloat16))  # the BF16 rows, as vLLM's writer packs them
        self.total = total

    def window(self, kind: str, s: int) -> torch.Tensor:
        """Rows [s*shift, s*shift + base_rows) of a cache: the same slots land on other rows per set."""
        t = {"fp8": self.fp8, "nvfp4_ds_mla": self.nvfp4, "bf16": self.bf16, "fp8_ds_mla": self.fmla}[kind]
        assert t is not None
        return t[s * self.shift: s * self.shift + self.base_rows]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.fp8, self.nvfp4, self.bf16, self.fmla)
                   if t is not None)


def n_sets(rows: int, l2: int = L2_BYTES) -> int:
    """Input sets per graph: one replay must read > 2x L2 (`l2`: the device's, timing.l2_bytes) even in the smallest
    format, at least 4. Past MAX_SETS the sets come from more slot pools (pool_of), up to MAX_POOLS of them."""
    per_call = rows * K * NVFP4_ROW_BYTES
    return int(min(MAX_SETS * MAX_POOLS, max(4, math.ceil(2 * l2 / per_call))))


def pool_of(s: int) -> tuple[int, int]:
    """(slot pool, cache window) of input set s: pool s // MAX_SETS over window s % MAX_SETS, so two sets never
    share both their slots and their window."""
    return s // MAX_SETS, s % MAX_SETS


def request_slots(rows: int, g: torch.Generator, device: torch.device, base_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows laid out as vLLM's: each row a request of 2K tokens in its own random 64-row blocks (distinct blocks
    across rows while the cache has enough), its K slots a random K of its 2K tokens in top-k (random) order.
    Returns (block_table (rows, 2K/64) int32, slots (rows, K) int32)."""
    blocks_per_row = 2 * K // BLOCK
    base_blocks = base_rows // BLOCK
    if rows * blocks_per_row <= base_blocks:
        bt = torch.randperm(base_blocks, device=device, generator=g)[: rows * blocks_per_row].view(rows, -1)
    else:
        bt = torch.randint(0, base_blocks, (rows, blocks_per_row), device=device, generator=g)
    bt = bt.to(torch.int32)
    pos = torch.rand((rows, 2 * K), device=device, generator=g).argsort(dim=1)[:, :K]
    slots = bt.gather(1, pos // BLOCK) * BLOCK + (pos % BLOCK).to(torch.int32)
    return bt, slots.to(torch.int32).contiguous()


def config_inputs(rows: int, heads: int, sets: int, device: torch.device, base_rows: int,
                  bf16: bool) -> dict[str, Any]:
    """The (rows, H) inputs every kernel gets: slots (one pool per MAX_SETS sets: "pools"; "slots" the first), full
    counts, `sets` queries (fp8 and the same in BF16) and outputs."""
    g = torch.Generator(device=device).manual_seed(rows * 1000 + heads)
    pools = [request_slots(rows, g, device, base_rows)[1] for _ in range(pool_of(sets - 1)[0] + 1)]
    slots = pools[0]
    counts = torch.full((rows,), K, dtype=torch.int32, device=device)
    q8 = [(torch.randn((rows, heads, HEAD_DIM), device=device, generator=g) / Q_SCALE).to(torch.float8_e4m3fn)
          for _ in range(sets)]
    q16 = [q.to(torch.bfloat16) for q in q8] if bf16 else []  # exact: e4m3 fits BF16
    outs = [torch.empty((rows, heads, LATENT_DIM), dtype=torch.bfloat16, device=device) for _ in range(sets)]
    return {"slots": slots, "pools": pools, "counts": counts, "q8": q8, "q16": q16, "outs": outs}


def set_slots(inp: dict[str, Any], s: int) -> torch.Tensor:
    """The slots of input set s (its pool's)."""
    return inp["pools"][pool_of(s)[0]]


def error_inputs(rows: int, heads: int, device: torch.device, base_rows: int) -> dict[str, Any]:
    """Ragged counts in [1, K] (the peer cannot take 0), -1 past each count, one query."""
    g = torch.Generator(device=device).manual_seed(rows * 7 + heads)
    _, slots = request_slots(rows, g, device, base_rows)
    counts = torch.randint(1, K + 1, (rows,), dtype=torch.int32, device=device, generator=g)
    counts[0] = K
    if rows > 1:
        counts[1] = 1
    slots[torch.arange(K, device=device) >= counts.unsqueeze(1)] = -1
    q8 = (torch.randn((rows, heads, HEAD_DIM), device=device, generator=g) / Q_SCALE).to(torch.float8_e4m3fn)
    return {"slots": slots, "counts": counts, "q8": q8, "q16": q8.to(torch.bfloat16)}


# ---------------------------------------------------------------- kernels under test


def scales(fmt: str) -> tuple[float, float]:
    """(softmax_scale, output_scale) in reference_decode's convention (SPEC 2.1)."""
    return (SCALE * Q_SCALE * K_SCALE, K_SCALE) if fmt == "fp8" else (SCALE * Q_SCALE, 1.0)


@contextlib.contextmanager
def even_plans() -> Iterator[None]:
    """Kernel objects built inside plan without lead plans (planning.choose_lead): the A/B of --even."""
    from vllm_kimi_dsa.planning import cost

    saved = cost.best_lead
    cost.best_lead = lambda *args: (1, 0, float("inf"))  # no uneven plan anywhere
    cost.plan_and_cost.cache_clear()
    try:
        yield
    finally:
        cost.best_lead = saved
        cost.plan_and_cost.cache_clear()


def triton_kernel(fmt: str, heads: int, rows: int, device: torch.device, lead: bool = True,
                  fp8_pv: bool = False, kernel_scales: tuple[float, float] | None = None,
                  schedule: str = "static") -> Callable[..., None]:
    """Our kernel as the core binds it; lead False: even plans only (--even); fp8_pv: VLLM_KIMI_DSA_FP8_PV=1;
    kernel_scales: (softmax_scale, output_scale) (default: scales(fmt), the timing data's); schedule:
    VLLM_KIMI_DSA_SCHEDULE ("counts": the scheduled launches)."""
    from vllm_kimi_dsa.kernels.base import DecodeSetup
    from vllm_kimi_dsa.backends.hopper import TritonDecode

    sm, osc = kernel_scales or scales(fmt)
    setup = DecodeSetup(device=device, fmt=fmt, heads=heads, row_counts=(rows,), capacities=(), widths=(K,),
                        return_lse=False, softmax_scale=sm, output_scale=osc)
    with contextlib.nullcontext() if lead else even_plans(), \
            mock.patch.dict(os.environ, {envs.FP8_PV: "1" if fp8_pv else "0", envs.SCHEDULE: schedule}):
        kernel = TritonDecode(setup)

    def call(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, out: torch.Tensor) -> None:
        kernel(q, kv, slots, counts, out, None, block_size=BLOCK, rows_per_block_stride=BLOCK)

    # which implementation each launch of this batch's plan runs: a Gluon kernel's params class, or the plain `tl`
    # kernel ("SeesawParams+GluonParams": whole rows on the seesaw kernel, the split rest on the 64-head kernel)
    picked = dict.fromkeys("tl" if p is None else type(p).__name__ for p in kernel.plan_params[rows, K])
    lead_tiles = kernel.plan_leads[rows, K]
    call.impl = "+".join(picked) + (f" lead {lead_tiles}" if lead_tiles else "") + (  # type: ignore[attr-defined]
        " scheduled" if kernel.scheduled else "")
    return call


def torch_decode(q16: torch.Tensor, kv_fp8: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                 out: torch.Tensor) -> None:
    """Plain torch: gather the fp8 rows, dequantize to BF16, two BF16 batched matmuls, float32 softmax."""
    rows = slots.shape[0]
    ids = slots.clamp(min=0).reshape(-1).long()
    kv = kv_fp8.view(torch.uint8)[ids].view(torch.float8_e4m3fn).view(rows, K, HEAD_DIM).to(torch.bfloat16)
    kv = kv * K_SCALE
    logits = torch.bmm(q16.view(rows, -1, HEAD_DIM), kv.transpose(1, 2)).float() * (SCALE * Q_SCALE)
    live = torch.arange(K, device=slots.device) < counts.unsqueeze(1)
    logits = logits.masked_fill(~live.unsqueeze(1), float("-inf"))
    p = torch.softmax(logits, dim=-1).to(torch.bfloat16)
    out.copy_(torch.bmm(p, kv[..., :LATENT_DIM]))


# ---------------------------------------------------------------- ceilings


def metrics(rows: int, heads: int, us: float, kv_kind: str, q_bytes: int, compute: str,
            ceil: dict[str, Any], heads_run: int | None = None) -> dict[str, Any]:
    """TFLOP/s-equivalent, KV GB/s and the floor max(bytes / copy bandwidth, flops / matmul rate).

    compute: "bf16", "fp8" (all flops at that matmul rate) or "fp8qk" (Q.K at the FP8 rate, P.V at the BF16 rate).
    q_bytes: bytes per query element (1 for e4m3, 2 for BF16).
    heads_run: the heads the kernel computes (FlashMLA: the query padded to 64 / 128 as vLLM runs it): the floor
    counts their flops, query and output; TFLOP/s-eq counts the `heads` a caller asked for (the useful work).
    """
    run = heads if heads_run is None else heads_run
    flops = 2.0 * rows * heads * K * (HEAD_DIM + LATENT_DIM)
    kv_bytes = rows * K * ROW_BYTES[kv_kind]
    io_bytes = rows * run * HEAD_DIM * q_bytes + rows * run * LATENT_DIM * 2  # query in, latent out
    bf16_rate = ceil["bf16_TFLOPs"]
    fp8_rate = ceil.get("fp8_TFLOPs") or bf16_rate
    flops_run = flops * run / heads
    if compute == "fp8qk":  # our Triton kernel: Q.K on FP8 tensor cores, P.V in fp16 (the BF16 rate)
        qk = 2.0 * rows * run * K * HEAD_DIM
        floor_fl = (qk / fp8_rate + (flops_run - qk) / bf16_rate) / 1e12 * 1e6
    else:
        floor_fl = flops_run / ((fp8_rate if compute == "fp8" else bf16_rate) * 1e12) * 1e6
    floor_bw = (kv_bytes + io_bytes) / (ceil["copy_GBps"] * 1e9) * 1e6
    floor = max(floor_bw, floor_fl)
    t = us * 1e-6
    return {
        "us": round(us, 3), "tflops": round(flops / t / 1e12, 2), "kv_GBps": round(kv_bytes / t / 1e9, 1),
        "floor_us": round(floor, 3), "floor_bw_us": round(floor_bw, 3), "floor_flops_us": round(floor_fl, 3),
        "floor_bound": "bandwidth" if floor_bw >= floor_fl else "compute", "of_floor": round(floor / us, 3),
        "compute": compute, "kv_bytes": kv_bytes, "flops": flops, "heads_run": run,
    }


# ---------------------------------------------------------------- the peers (background builds)


class PeerBuilds:
    """Builds of the peers in child processes (they overlap the Triton runs), plus small checks per head count:
    fa3's JIT module per KV dtype ("fa3/bf16", "fa3/fp8"), FlashMLA's extension (FLASHMLA_KIND, from flashmla_dir)."""

    def __init__(self, kinds: list[str], probe_heads: list[int], flashmla_dir: str | None = None) -> None:
        self.procs: dict[str, tuple[subprocess.Popen[bytes], Any, float]] = {}
        heads = ",".join(map(str, probe_heads))
        for kind in kinds:
            family, kv = kind.split("/", 1)
            if family == "fa3":
                cmd = [sys.executable, "-m", fa3.__name__, "--build", kv, "--probe-heads", heads]
            else:
                cmd = [sys.executable, "-m", flashmla.__name__, "--build", flashmla_dir or "auto",
                       "--build-dir", os.path.join(tempfile.gettempdir(), "fmla_build"), "--probe-heads", heads]
            f = tempfile.NamedTemporaryFile(prefix=f"peer_build_{family}_{kv}_", suffix=".log", delete=False)
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
            self.procs[kind] = (p, f, time.perf_counter())

    def wait(self, timeout_s: float = 300.0) -> dict[str, Any]:
        res: dict[str, Any] = {}
        for kind, (p, f, t0) in self.procs.items():
            try:
                rc = p.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                rc = -9
            f.close()
            text = Path(f.name).read_text(errors="replace")
            Path(f.name).unlink(missing_ok=True)  # what the run needs of it is kept in res ("tail", records)
            lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
            res[kind] = {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "records": lines,
                         "tail": text[-1500:] if rc else ""}
        return res


def peer_heads_ok(build: dict[str, Any], heads: int) -> bool:
    return any(r.get("heads") == heads and r.get("ok") for r in build.get("records", []))


_FLASHMLA_SOURCES: dict[str, Any] = {}


def flashmla_source(build: dict[str, Any]) -> tuple[str, Any]:
    """The FlashMLA the build child found (peers.flashmla.open_source of its first record), opened once a process:
    vLLM's own wrappers, or the harness's extension."""
    first = next(r for r in build["records"] if r.get("source") or r.get("so"))
    key = json.dumps({k: first.get(k) for k in ("source", "so")}, sort_keys=True)
    if key not in _FLASHMLA_SOURCES:
        _FLASHMLA_SOURCES[key] = flashmla.open_source(first)
    return _FLASHMLA_SOURCES[key]


def flashmla_route(build: dict[str, Any]) -> str:
    """Where the FlashMLA peer came from, for the JSON (vLLM's module, or the harness's .so)."""
    first = next((r for r in build.get("records", []) if r.get("source") or r.get("so")), {})
    return str(first.get("route") or first.get("so") or "?")


def make_peer_calls(kind: str, build: dict[str, Any], data: Data, heads: int, rows: int,
                    inp: dict[str, Any]) -> tuple[list[Callable[[], Any]], str, dict[str, Any]]:
    """One planned peer call per input set of `inp` (config_inputs'), the cache kind they read and what the record
    says about them. fa3: one planned wrapper per slot pool (its plan takes the slots); FlashMLA: one step's
    metadata for the batch shape, the query padded inside every call as vLLM pads it."""
    family, kv = kind.split("/", 1)
    sets = len(inp["q16"])
    if family == "flashmla":
        source = flashmla_source(build)
        p = flashmla.make_peer(source, heads, rows, K, sm_scale=SCALE * Q_SCALE, device=inp["slots"].device)
        p.plan(inp["q16"][0], data.window("fp8_ds_mla", 0), inp["slots"])  # the step's metadata, outside the graph
        shape = flashmla.vllm_shape(heads, rows)
        extra = {"impl": (p.describe() if hasattr(p, "describe") else
                          f"FlashMLA harness, query padded {heads} -> {p.padded} heads"),
                 "padded_heads": p.padded, "call_shape": list(shape["q"][:2]) + [p.padded],
                 "vllm_path": shape["path"], "source": source[0]}
        calls = [lambda s=s: p.run(inp["q16"][s], data.window("fp8_ds_mla", pool_of(s)[1]), set_slots(inp, s))
                 for s in range(sets)]
        return calls, "fp8_ds_mla", extra
    wrappers = []
    for pool in inp["pools"]:
        f = fa3.make_peer(kv, heads, rows, K, sm_scale=SCALE * Q_SCALE, kv_scale=K_SCALE if kv == "fp8" else 1.0,
                          device=pool.device)
        f.plan(pool, [K] * rows)
        wrappers.append(f)
    kv_kind = "bf16" if kv == "bf16" else "fp8"
    calls = [lambda s=s: wrappers[pool_of(s)[0]].run(inp["q16"][s], data.window(kv_kind, pool_of(s)[1]),
                                                     inp["outs"][s]) for s in range(sets)]
    return calls, kv_kind, {}


# ---------------------------------------------------------------- sections


class Suite:
    def __init__(self, args: argparse.Namespace, device: torch.device | str = "cuda") -> None:
        self.args = args
        self.device = torch.device(device)
        self.repeats = int(getattr(args, "repeats", None) or REPEATS)
        self.l2 = l2_bytes(self.device)
        self.ratios: list[dict[str, Any]] = []  # (ours, peer) per point: decode_section's pair_ratio
        self.out_dir = Path(args.out)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.results: list[dict[str, Any]] = []
        self.accuracy: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.info: dict[str, Any] = {}
        self.prefill: dict[str, Any] | None = None  # bench_prefill's section, when it ran
        self.serving: dict[str, Any] | None = None  # bench.serving's section ({"records", "ratios"}), when it ran
        self.t0 = time.perf_counter()

    def dump(self) -> None:
        payload = {"info": self.info, "results": self.results, "ratios": self.ratios, "accuracy": self.accuracy,
                   "failures": self.failures}
        if self.prefill is not None:
            payload["prefill"] = self.prefill
        if self.serving is not None:
            payload["serving"] = self.serving
        tmp = self.out_dir / "bench_suite.json.tmp"
        tmp.write_text(json.dumps(payload, indent=1))
        os.replace(tmp, self.out_dir / "bench_suite.json")

    def elapsed(self) -> str:
        return f"+{time.perf_counter() - self.t0:6.1f}s"

    def guarded(self, what: dict[str, Any], fn: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
        """Run one measurement; a failure is recorded (with its traceback) and the suite goes on."""
        try:
            return fn()
        except Exception as err:
            rec = {**what, "error": f"{type(err).__name__}: {err}"[:600], "trace": traceback.format_exc()[-1500:]}
            self.failures.append(rec)
            log(f"{self.elapsed()} FAILED {what}: {rec['error']}")
            try:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
            except Exception:  # a sticky device fault: later steps fail on their own and say so
                pass
            return None

    def record(self, rec: dict[str, Any]) -> None:
        self.results.append(rec)
        log(f"{self.elapsed()} {rec['section']:>7} {rec['kernel']:<22} rows={rec['rows']:<4} H={rec.get('heads', '-'):<4} "
            f"{rec['us']:9.2f} us  {rec.get('tflops', 0):7.1f} TF/s  {rec.get('kv_GBps', 0):7.0f} GB/s  "
            f"floor {rec.get('floor_us', 0):8.2f} us ({rec.get('of_floor', 0):.2f})"
            + (f"  [{rec['us_min']:.2f}-{rec['us_max']:.2f} over {rec['repeats']}]" if "repeats" in rec else ""))


# what each kernel computes with, for the floor: (q bytes a value, compute dtype) by family
OUR_COMPUTE = {"triton": "fp8qk", "triton-even": "fp8qk", "triton-pv8": "fp8"}
# the kernel each of ours is compared with the peers as (the ratios table): ours as the core binds it, and the opt-in
RATIO_OURS = ("triton/fp8", "triton-pv8/fp8")


def point_kernels(suite: Suite, data: Data, rows: int, heads: int, kinds: list[str], inp: dict[str, Any],
                  peer: dict[str, Any] | None) -> dict[str, tuple[list[Callable[[], Any]], dict[str, Any]]]:
    """The calls (one per input set) of every kernel that runs at (rows, H), with its record's fields: ours as the
    core binds it per format, each usable peer planned on the same slots and queries. A kernel that fails to build
    is recorded in suite.failures and left out."""
    dev = suite.device
    out: dict[str, tuple[list[Callable[[], Any]], dict[str, Any]]] = {}
    sets = len(inp["q8"])
    for kind in kinds:
        what = {"section": "decode", "kernel": kind, "rows": rows, "heads": heads}
        if kind.startswith(OUR_FAMILIES):
            family, fmt = kind.split("/", 1)
            if family == "triton-pv8" and heads <= FEW_HEADS_MAX:  # the opt-in changes nothing there
                continue

            def build_ours(fmt: str = fmt, family: str = family) -> dict[str, Any]:
                call = triton_kernel(fmt, heads, rows, dev, family != "triton-even", family == "triton-pv8")
                calls = [lambda s=s: call(inp["q8"][s], data.window(fmt, pool_of(s)[1]), set_slots(inp, s),
                                          inp["counts"], inp["outs"][s]) for s in range(sets)]
                return {"calls": calls, "rec": {"fmt": fmt, "impl": call.impl, "q_bytes": 1,
                                                "compute": OUR_COMPUTE[family], "kv_kind": fmt}}

            built = suite.guarded(what, build_ours)
        else:
            if peer is None or not peer.get(kind, {}).get("usable_heads", {}).get(heads, False):
                continue

            def build_peer(kind: str = kind) -> dict[str, Any]:
                calls, kv_kind, extra = make_peer_calls(kind, peer[kind], data, heads, rows, inp)
                return {"calls": calls, "rec": {"fmt": kv_kind, **extra, "q_bytes": 2, "compute": "bf16",
                                                "kv_kind": kv_kind}}

            built = suite.guarded(what, build_peer)
        if built is not None:
            out[kind] = (built["calls"], built["rec"])
    return out


def decode_section(suite: Suite, data: Data, ceil: dict[str, Any], rows_list: tuple[int, ...],
                   heads_list: tuple[int, ...], kinds: list[str], peer: dict[str, Any] | None) -> None:
    """Every (rows, H): every kernel (ours per format, each peer) built on the same inputs and captured, then timed
    in turn, suite.repeats rounds (timing.interleaved_us): each record has the median and the spread of its rounds,
    and each (ours, peer) pair a ratio (median, min, max over the rounds) with both sides' fraction of their own
    floor (suite.ratios)."""
    dev = suite.device
    for heads in heads_list:
        for rows in rows_list:
            sets = n_sets(rows, suite.l2)
            inp = config_inputs(rows, heads, sets, dev, data.base_rows, bf16=peer is not None)
            built = point_kernels(suite, data, rows, heads, kinds, inp, peer)
            timers: dict[str, Any] = {}
            for kind, (calls, _) in built.items():
                what = {"section": "decode", "kernel": kind, "rows": rows, "heads": heads}
                timer = suite.guarded(what, lambda calls=calls: make_timer(calls, dev))
                if timer is not None:
                    timers[kind] = timer
            times: dict[str, list[float]] = {}
            if timers:
                what = {"section": "decode", "kernel": "+".join(timers), "rows": rows, "heads": heads}
                times = suite.guarded(what, lambda: interleaved_us(timers, suite.repeats,
                                                                   reps_time_s=suite.args.reps_time)) or {}
            for timer in timers.values():
                timer.close()
            recs: dict[str, dict[str, Any]] = {}
            for kind, values in times.items():
                info = built[kind][1]
                st = spread(values)
                rec = {"section": "decode", "kernel": kind, "rows": rows, "heads": heads, "sets": sets,
                       "pools": len(inp["pools"]), "repeats": len(values),
                       **{k: v for k, v in info.items() if k not in ("q_bytes", "compute", "kv_kind")},
                       **metrics(rows, heads, st["us"], info["kv_kind"], info["q_bytes"], info["compute"], ceil,
                                 heads_run=info.get("padded_heads")),
                       **st}
                rec["replay_bytes"] = sets * rows * K * ROW_BYTES[info["kv_kind"]]
                recs[kind] = rec
                suite.record(rec)
            for ours in RATIO_OURS:
                for kind in recs:
                    if ours in recs and not kind.startswith(OUR_FAMILIES):
                        suite.ratios.append(pair_ratio(recs[ours], recs[kind]))
                        r = suite.ratios[-1]
                        log(f"{' ' * 9}{ours} / {kind} = {r['ratio']:.3f} [{r['ratio_min']:.3f}, {r['ratio_max']:.3f}]"
                            f"; of own floor {r['ours_of_floor']:.2f} vs {r['peer_of_floor']:.2f}")
            del inp, built, timers
        suite.dump()


def warm_ours(suite: Suite, data: Data, rows_list: tuple[int, ...], heads_list: tuple[int, ...],
              ours: list[str]) -> None:
    """One eager call of each of our kernels at every point (Triton compiles it), while the peers build: the
    decode section then starts on warm kernels. Failures are left for the decode section to record."""
    dev = suite.device
    for heads in heads_list:
        for rows in rows_list:
            inp = config_inputs(rows, heads, 1, dev, data.base_rows, bf16=False)
            for kind in ours:
                family, fmt = kind.split("/", 1)
                if family == "triton-pv8" and heads <= FEW_HEADS_MAX:
                    continue
                try:
                    triton_kernel(fmt, heads, rows, dev, family != "triton-even", family == "triton-pv8")(
                        inp["q8"][0], data.window(fmt, 0), inp["slots"], inp["counts"], inp["outs"][0])
                except Exception:  # noqa: BLE001 - recorded where it is measured
                    pass
    if dev.type == "cuda":
        torch.cuda.synchronize()
    log(f"{suite.elapsed()} ours compiled at every point")


def pair_ratio(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """Our time over the peer's at one point: the median of the per-round ratios (the rounds took both in turn) and
    their range, each side's median µs and fraction of its own floor (ours: 576 B rows and an e4m3 query; FlashMLA:
    656 B rows, BF16 query, the padded heads it runs; fa3: its cache's rows, BF16 query)."""
    per_round = [a / b for a, b in zip(ours["us_repeats"], peer["us_repeats"])]
    return {"rows": ours["rows"], "heads": ours["heads"], "ours": ours["kernel"], "peer": peer["kernel"],
            "ratio": round(float(statistics.median(per_round)), 4), "ratio_min": round(min(per_round), 4),
            "ratio_max": round(max(per_round), 4), "ours_us": ours["us"], "peer_us": peer["us"],
            "ours_of_floor": ours["of_floor"], "peer_of_floor": peer["of_floor"],
            "ours_spread": ours["spread"], "peer_spread": peer["spread"]}


# ---------------------------------------------------------------- accuracy

# The error each kernel's formats allow against float32 on the BF16 source values, from the rounding they do to
# this very data. out = sum_j p_j v_j: the query's and keys' rounding moves each logit by d_j = softmax_scale *
# (q^.k^_j - q.k_j), measured here (eps_r: its rms about each head's mean over row r's heads and selections: a shift
# common to a head's logits cancels in the softmax), which moves row r's output by
# about eps_r of its own norm; the values' rounding (u_v: the selected latent rows' rel L2 change, measured), P's
# rounding before P.V (u_p, the format's rms: 2^-(m+1) / sqrt(3) for m mantissa bits) and the output's BF16 rounding
# add in quadrature, and the rows weigh by their reference norm as in the rel L2:
#   predicted^2 = sum_r |ref_r|^2 (eps_r^2 + u_v^2 + u_p^2 + u_out^2) / sum_r |ref_r|^2;   tolerance = 2 x predicted.
E4M3_U = 2.0**-4 / math.sqrt(3.0)  # 3 mantissa bits
BF16_U = 2.0**-8 / math.sqrt(3.0)  # 7 mantissa bits
FP16_U = 2.0**-11 / math.sqrt(3.0)  # 10 mantissa bits
P_ROUNDING = {"triton": FP16_U, "triton-even": FP16_U, "triton-pv8": E4M3_U, "fa3": BF16_U, "flashmla": BF16_U}
HOLDS = {
    "triton/fp8": "e4m3 rows (per-tensor amax / 448 scale) + e4m3 query (amax / 448), fp16 P",
    "triton-even/fp8": "e4m3 rows (per-tensor amax / 448 scale) + e4m3 query (amax / 448), fp16 P",
    "triton-pv8/fp8": "e4m3 rows + e4m3 query (amax / 448 scales), P rounded to e4m3 before P.V",
    "triton/nvfp4_ds_mla": "nvfp4_ds_mla rows (e2m1 latent, e4m3 block scales and RoPE) + e4m3 query",
    "flashmla/fp8_ds_mla": "fp8_ds_mla rows (e4m3 latent, vLLM's power-of-two fp32 tile scales, BF16 RoPE) + BF16 "
                           "query, BF16 P",
    "fa3/bf16": "BF16 rows and query (the source's own values), BF16 P",
    "fa3/fp8": "e4m3 rows (per-tensor amax / 448 scale) + BF16 query, BF16 P",
}


def held_values(kind: str, src: dict[str, Any], qz: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(query, rows) as `kind` computes with them, in float32: the source after that kernel's quantization."""
    from vllm_kimi_dsa.formats import dequantize_rows

    family, fmt = kind.split("/", 1)
    if family in OUR_FAMILIES:
        q = qz["q8"].float() * qz["q_scale"]
        rows = qz["fp8"].float() * qz["k_scale"] if fmt == "fp8" else dequantize_rows(qz[fmt], fmt)
        return q, rows
    if family == "flashmla":
        return src["q"].float(), flashmla.dequantize_fp8_ds_mla(qz["fp8_ds_mla"])
    return src["q"].float(), (src["kv"].float() if fmt == "bf16" else qz["fp8"].float() * qz["k_scale"])


def rounding_errors(src: dict[str, Any], q_held: torch.Tensor, rows_held: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, float]:
    """(eps (rows,), u_v) of one quantization of the source: each row's rms logit change softmax_scale * (q^.k^ -
    q.k) about each head's mean over its valid selections, and the selected latent rows' rel L2 change."""
    slots, counts = src["slots"], src["counts"]
    valid = (torch.arange(slots.shape[1], device=slots.device) < counts.unsqueeze(1)) & (slots >= 0)
    ids = slots.clamp(min=0).long()
    k, kh = src["kv"].float()[ids], rows_held[ids]  # (rows, K, 576)
    d = torch.einsum("rhd,rkd->rhk", q_held, kh) - torch.einsum("rhd,rkd->rhk", src["q"].float(), k)
    live = valid.unsqueeze(1).expand_as(d).float()
    n = live.sum(dim=2, keepdim=True).clamp(min=1)
    d = (d - (d * live).sum(dim=2, keepdim=True) / n) * live  # a shift common to a row's logits changes nothing
    eps = scale * d.pow(2).sum(dim=(1, 2)).div(n.sum(dim=(1, 2))).sqrt()
    m = valid.unsqueeze(-1)
    num = (kh - k)[..., :LATENT_DIM].masked_select(m).norm()
    den = k[..., :LATENT_DIM].masked_select(m).norm()
    return eps, float(num / den)


def tolerance_of(kind: str, eps_rows: torch.Tensor, u_v: float, ref: torch.Tensor) -> dict[str, Any]:
    """The predicted rel L2 of `kind` from its measured rounding of the data (rounding_errors) with the rows weighed
    by the reference's norm (ref (rows, H, 512)), its tolerance (twice that), and why."""
    u_p = P_ROUNDING[kind.split("/", 1)[0]]
    w = ref.float().pow(2).sum(dim=(1, 2))
    w = w / w.sum().clamp(min=1e-30)
    eps = float((w * eps_rows.to(w.device).pow(2)).sum().sqrt())
    predicted = math.sqrt(eps**2 + u_v**2 + u_p**2 + BF16_U**2)
    return {"predicted": round(predicted, 5), "tolerance": round(2 * predicted, 5),
            "rounding": {"logits_rms": round(eps, 5), "values_rel_l2": round(u_v, 5), "p_rms": round(u_p, 6)},
            "tolerance_why": (f"{HOLDS.get(kind, kind)}: its rounding of this data moves the logits by {eps:.3g} rms "
                              f"and the latent rows by {u_v:.3g} (rel L2), P by {u_p:.2g}, the BF16 output by "
                              f"{BF16_U:.2g}: predicted rel L2 {predicted:.3g} (their quadrature sum), tolerance 2x")}


PV_RULE = 1.05  # FP8 P.V may be the default only where its error stays within 5% of the BF16 P.V error everywhere
ACCURACY_ROWS = 1 << 17  # cache rows of the accuracy data (a multiple of 64: FlashMLA's pages)
OUTLIER_DIMS = list(range(0, LATENT_DIM, 64))  # latent channels 4x the others in the accuracy data


def accuracy_inputs(rows: int, heads: int, device: torch.device, num_rows: int | None = None) -> dict[str, Any]:
    """BF16 source data on no quantized format's grid: rows N(0, 1) with 8 outlier latent channels x 4 (they set the
    per-tensor amax scale, as outlier channels of real caches do), a BF16 query N(0, 1) (logits spread ~2); ragged
    counts in [1, K] (row 0 full, row 1 one
    entry), -1 holes (10%) inside the counts and -1 past them. Each kernel then quantizes the source its own way."""
    num_rows = ACCURACY_ROWS if num_rows is None else num_rows
    g = torch.Generator(device=device).manual_seed(rows * 31 + heads)
    x = torch.randn((num_rows, HEAD_DIM), device=device, generator=g)
    x[:, OUTLIER_DIMS] *= 4.0
    kv = x.to(torch.bfloat16)
    q = torch.randn((rows, heads, HEAD_DIM), device=device, generator=g).to(torch.bfloat16)
    slots = torch.stack([torch.randperm(num_rows, device=device, generator=g)[:K] for _ in range(rows)]).int()
    counts = torch.randint(1, K + 1, (rows,), dtype=torch.int32, device=device, generator=g)
    counts[0] = K
    if rows > 1:
        counts[1] = 1
    pos = torch.arange(K, device=device)
    hole = (torch.rand((rows, K), device=device, generator=g) < 0.1) & (pos > 0)
    slots = torch.where(hole | (pos >= counts.unsqueeze(1)), torch.full_like(slots, -1), slots)
    return {"kv": kv, "q": q, "slots": slots.contiguous(), "counts": counts}


def compacted(slots: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, counts) with each row's valid entries (inside its count, not -1) first in their order, -1 after, and
    their number: what a page-table peer (fa3) takes for the same selection."""
    valid = (torch.arange(slots.shape[1], device=slots.device) < counts.unsqueeze(1)) & (slots >= 0)
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    packed = torch.where(valid.gather(1, order), slots.gather(1, order), torch.full_like(slots, -1))
    return packed.contiguous(), valid.sum(dim=1).to(torch.int32)


def quantized(src: dict[str, Any], want: set[str]) -> dict[str, Any]:
    """The source as each kernel's format holds it: per-tensor e4m3 rows and query with amax scales (ours, fa3's
    fp8), nvfp4_ds_mla rows, fp8_ds_mla rows (vLLM's writer's tile scales)."""
    kv = src["kv"].float()
    out: dict[str, Any] = {}
    k_scale = float(kv.abs().amax()) / 448.0
    q_scale = float(src["q"].float().abs().amax()) / 448.0
    out["k_scale"], out["q_scale"] = k_scale, q_scale
    out["fp8"] = (kv / k_scale).to(torch.float8_e4m3fn)
    out["q8"] = (src["q"].float() / q_scale).to(torch.float8_e4m3fn)
    if "nvfp4_ds_mla" in want:
        out["nvfp4_ds_mla"] = pack_nvfp4(kv)
    if "fp8_ds_mla" in want:
        out["fp8_ds_mla"] = flashmla.quantize_fp8_ds_mla(src["kv"])
    return out


def accuracy_section(suite: Suite, sizes: tuple[tuple[int, int], ...], kinds: list[str],
                     peer: dict[str, Any] | None) -> None:
    """rel L2 of every kernel against float32 on the BF16 source values (accuracy_inputs), each kernel on its own
    quantization (quantized), with its tolerance (TOLERANCE) and, where it quantizes, its error against float32 on
    the values it holds (its own arithmetic alone); then the FP8 P.V default rule (PV_RULE) over every size."""
    from vllm_kimi_dsa.reference import reference_decode, source_reference_decode

    dev = suite.device
    for rows, heads in sizes:
        src = accuracy_inputs(rows, heads, dev)
        fmts = {k.split("/", 1)[1] for k in kinds}
        qz = quantized(src, fmts)
        ref, _ = source_reference_decode(src["q"].float(), src["kv"], src["slots"], src["counts"],
                                         softmax_scale=SCALE, output_scale=1.0)
        for kind in kinds:
            what = {"section": "accuracy", "kernel": kind, "rows": rows, "heads": heads}

            def check(kind: str = kind) -> dict[str, Any] | None:
                family, fmt = kind.split("/", 1)
                out = torch.full((rows, heads, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=dev)
                own = None
                if family in OUR_FAMILIES:
                    if family == "triton-pv8" and heads <= FEW_HEADS_MAX:
                        return None
                    if fmt == "fp8":
                        sc = (SCALE * qz["q_scale"] * qz["k_scale"], qz["k_scale"])
                    else:
                        sc = (SCALE * qz["q_scale"], 1.0)
                    triton_kernel(fmt, heads, rows, dev, family != "triton-even", family == "triton-pv8",
                                  kernel_scales=sc)(qz["q8"], qz[fmt], src["slots"], src["counts"], out)
                    own, _ = reference_decode(qz["q8"], qz[fmt], src["slots"], src["counts"], fmt=fmt,
                                              softmax_scale=sc[0], output_scale=sc[1])
                    held = f"{fmt} rows + e4m3 query (k_scale {qz['k_scale']:.3g}, q_scale {qz['q_scale']:.3g})"
                else:
                    if peer is None or not peer.get(kind, {}).get("usable_heads", {}).get(heads, False):
                        return None
                    if family == "flashmla":
                        p = flashmla.make_peer(flashmla_source(peer[kind]), heads, rows, K, sm_scale=SCALE,
                                               device=dev)
                        out.copy_(p.run(src["q"], qz["fp8_ds_mla"], src["slots"]))
                        rows_held = flashmla.dequantize_fp8_ds_mla(qz["fp8_ds_mla"])
                        own, _ = source_reference_decode(src["q"].float(), rows_held, src["slots"], src["counts"],
                                                         softmax_scale=SCALE, output_scale=1.0)
                        held = "fp8_ds_mla rows (vLLM's tile scales) + BF16 query"
                    else:
                        f = fa3.make_peer(fmt, heads, rows, K, sm_scale=SCALE,
                                          kv_scale=qz["k_scale"] if fmt == "fp8" else 1.0, device=dev)
                        f.plan(*compacted(src["slots"], src["counts"]))  # a page table holds no -1
                        f.run(src["q"], src["kv"] if fmt == "bf16" else qz["fp8"], out)
                        held = "BF16 rows + BF16 query (the source)" if fmt == "bf16" else \
                            f"fp8 rows (k_scale {qz['k_scale']:.3g}) + BF16 query"
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                o = out.float()
                err = float((o - ref).norm() / ref.norm())
                tol = tolerance_of(kind, *rounding_errors(src, *held_values(kind, src, qz), SCALE), ref)
                rec = {**what, "rel_l2": err, "max_abs": float((o - ref).abs().max()),
                       "nonfinite": int((~torch.isfinite(o)).sum()), **tol,
                       "within_tolerance": bool(err <= tol["tolerance"] and torch.isfinite(o).all()), "holds": held,
                       "against": "float32 on the BF16 source values"}
                tol = tol["tolerance"]
                if own is not None:
                    rec["rel_l2_own"] = float((o - own).norm() / own.norm())
                log(f"{suite.elapsed()} accuracy {kind:<22} rows={rows:<4} H={heads:<4} rel L2 {err:.3e} "
                    f"(tolerance {tol:.2e}{'' if rec['within_tolerance'] else ' EXCEEDED'})"
                    + (f"; vs its own values {rec['rel_l2_own']:.3e}" if own is not None else ""))
                return rec

            rec = suite.guarded(what, check)
            if rec is not None:
                suite.accuracy.append(rec)
        del src, qz, ref
    suite.info["fp8_pv_default"] = fp8_pv_decision(suite.accuracy)
    suite.dump()


def fp8_pv_decision(accuracy: list[dict[str, Any]]) -> dict[str, Any]:
    """The FP8 P.V default from one run's accuracy: default-able only where, at every size both ran, its error
    (triton-pv8/fp8) stays within PV_RULE x the BF16 P.V error (triton/fp8); else it stays opt-in."""
    fp8 = {(a["rows"], a["heads"]): a["rel_l2"] for a in accuracy if a["kernel"] == "triton/fp8"}
    pv8 = {(a["rows"], a["heads"]): a["rel_l2"] for a in accuracy if a["kernel"] == "triton-pv8/fp8"}
    shapes = [{"rows": r, "heads": h, "bf16_pv": fp8[r, h], "fp8_pv": pv8[r, h], "over": round(pv8[r, h] / fp8[r, h], 4),
               "ok": pv8[r, h] <= PV_RULE * fp8[r, h]} for (r, h) in sorted(set(fp8) & set(pv8))]
    ok = bool(shapes) and all(x["ok"] for x in shapes)
    return {"rule": f"FP8 P.V's rel L2 <= {PV_RULE} x BF16 P.V's at every size", "shapes": shapes,
            "default_ok": ok, "verdict": ("may be the default" if ok else "stays opt-in") if shapes else "not measured"}


def torch_section(suite: Suite, data: Data, ceil: dict[str, Any], sizes: tuple[tuple[int, int], ...]) -> None:
    dev = suite.device
    for rows, heads in sizes:
        sets = min(n_sets(rows, suite.l2), 8)  # the baseline's gathered copy is itself far larger than L2
        inp = config_inputs(rows, heads, sets, dev, data.base_rows, bf16=True)
        what = {"section": "torch", "kernel": "torch/fp8->bf16", "rows": rows, "heads": heads}

        def run() -> dict[str, Any]:
            calls = [lambda s=s: torch_decode(inp["q16"][s], data.window("fp8", s), inp["slots"], inp["counts"],
                                              inp["outs"][s]) for s in range(sets)]
            us = cuda_graph_time_us(calls, reps_time_s=suite.args.reps_time, min_reps=5)
            return {**what, "fmt": "fp8", "sets": sets, **metrics(rows, heads, us, "fp8", 2, "bf16", ceil)}

        rec = suite.guarded(what, run)
        if rec is not None:
            suite.record(rec)
        del inp
        torch.cuda.empty_cache()
    suite.dump()


def convert_inputs(rows: int, sets: int, device: torch.device, base_rows: int) -> dict[str, Any]:
    """Top-k ids of 2K-token requests (5% holes) and their block table (as request_slots lays them out)."""
    g = torch.Generator(device=device).manual_seed(rows + 99)
    bt, _ = request_slots(rows, g, device, base_rows)
    req = torch.arange(rows, dtype=torch.int32, device=device)
    topks = []
    for _ in range(sets):
        t = torch.rand((rows, 2 * K), device=device, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
        t[torch.rand((rows, K), device=device, generator=g) < 0.05] = -1
        topks.append(t)
    slots = [torch.empty((rows, K), dtype=torch.int32, device=device) for _ in range(sets)]
    counts = [torch.empty((rows,), dtype=torch.int32, device=device) for _ in range(sets)]
    return {"bt": bt, "req": req, "topk": topks, "slots": slots, "counts": counts}


def convert_section(suite: Suite, data: Data, ceil: dict[str, Any], rows_list: tuple[int, ...]) -> None:
    """The converter vs a device copy of the same bytes (rows*K int32 read + written)."""
    from vllm_kimi_dsa.convert import convert_topk

    dev = suite.device
    for rows in rows_list:
        sets = 4
        inp = convert_inputs(rows, sets, dev, data.base_rows)
        what = {"section": "convert", "kernel": "convert", "rows": rows}

        def run() -> dict[str, Any]:
            calls = [lambda s=s: convert_topk(inp["topk"][s], inp["req"], inp["bt"], block_size=BLOCK,
                                              rows_per_block_stride=BLOCK, slots=inp["slots"][s],
                                              counts=inp["counts"][s]) for s in range(sets)]
            us = cuda_graph_time_us(calls, reps_time_s=suite.args.reps_time)
            copies = [lambda s=s: inp["slots"][s].copy_(inp["topk"][s]) for s in range(sets)]
            us_copy = cuda_graph_time_us(copies, reps_time_s=suite.args.reps_time)
            nbytes = rows * K * 4 * 2
            return {**what, "us": round(us, 3), "copy_us": round(us_copy, 3), "vs_copy": round(us / us_copy, 2),
                    "bytes": nbytes, "GBps": round(nbytes / (us * 1e-6) / 1e9, 1),
                    "floor_us": round(nbytes / (ceil["copy_GBps"] * 1e9) * 1e6, 3)}

        rec = suite.guarded(what, run)
        if rec is not None:
            suite.results.append(rec)
            log(f"{suite.elapsed()} convert rows={rows:<4} {rec['us']:8.2f} us vs copy {rec['copy_us']:8.2f} us "
                f"(x{rec['vs_copy']})")
        del inp
    suite.dump()


def fused_section(suite: Suite, data: Data, ceil: dict[str, Any], sizes: tuple[tuple[int, int], ...]) -> None:
    """convert_topk + triton fp8 decode in one CUDA graph vs the decode alone (same slots)."""
    from vllm_kimi_dsa.convert import convert_topk

    dev = suite.device
    for rows, heads in sizes:
        sets = n_sets(rows, suite.l2)
        inp = convert_inputs(rows, sets, dev, data.base_rows)
        qin = config_inputs(rows, heads, sets, dev, data.base_rows, bf16=False)
        what = {"section": "fused", "kernel": "convert+triton/fp8", "rows": rows, "heads": heads}

        def run() -> dict[str, Any]:
            call = triton_kernel("fp8", heads, rows, dev)

            def both(s: int) -> None:
                convert_topk(inp["topk"][s], inp["req"], inp["bt"], block_size=BLOCK, rows_per_block_stride=BLOCK,
                             slots=inp["slots"][s], counts=inp["counts"][s])
                call(qin["q8"][s], data.window("fp8", pool_of(s)[1]), inp["slots"][s], inp["counts"][s],
                     qin["outs"][s])

            us_both = cuda_graph_time_us([lambda s=s: both(s) for s in range(sets)], reps_time_s=suite.args.reps_time)
            us_dec = cuda_graph_time_us(
                [lambda s=s: call(qin["q8"][s], data.window("fp8", pool_of(s)[1]), inp["slots"][s],
                                  inp["counts"][s], qin["outs"][s]) for s in range(sets)],
                reps_time_s=suite.args.reps_time)
            m = metrics(rows, heads, us_both, "fp8", 1, "fp8qk", ceil)
            return {**what, "fmt": "fp8", "sets": sets, **m, "decode_us": round(us_dec, 3),
                    "convert_overhead_us": round(us_both - us_dec, 3)}

        rec = suite.guarded(what, run)
        if rec is not None:
            suite.record(rec)
            log(f"{' ' * 9}decode alone {rec['decode_us']:.2f} us; convert adds {rec['convert_overhead_us']:.2f} us")
        del inp, qin
    suite.dump()


# ---------------------------------------------------------------- summary


def ratio_table(ratios: list[dict[str, Any]]) -> str:
    """One line per (ours, peer, H): at each rows, our time over the peer's (median of the rounds [min-max]) and
    each side's fraction of its own floor."""
    lines = []
    for key in sorted({(r["ours"], r["peer"], r["heads"]) for r in ratios}, key=lambda k: (-k[2], k[0], k[1])):
        ours, peer, heads = key
        cells = [f"{r['rows']}: {r['ratio']:.2f} [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}] "
                 f"({r['ours_of_floor']:.2f} vs {r['peer_of_floor']:.2f})"
                 for r in sorted((r for r in ratios if (r["ours"], r["peer"], r["heads"]) == key),
                                 key=lambda r: r["rows"])]
        lines.append(f"H={heads} {ours} / {peer} (of own floor): " + "; ".join(cells))
    return "\n".join(lines)


def summary_table(results: list[dict[str, Any]], rows_show: tuple[int, ...] = (1, 5, 20, 80, 320)) -> str:
    dec = [r for r in results if r.get("section") == "decode"]
    kernels = sorted({r["kernel"] for r in dec})
    lines = []
    for heads in sorted({r["heads"] for r in dec}, reverse=True):
        lines.append(f"H={heads}: µs per call (TFLOP/s-eq)")
        lines.append(f"  {'kernel':<22}" + "".join(f"{r:>16}" for r in rows_show))
        for k in kernels:
            cells = []
            for rw in rows_show:
                hit = [r for r in dec if r["kernel"] == k and r["heads"] == heads and r["rows"] == rw]
                cells.append(f"{hit[0]['us']:>8.1f} ({hit[0]['tflops']:>5.0f})" if hit else f"{'-':>16}")
            lines.append(f"  {k:<22}" + "".join(cells))
    return "\n".join(lines)


def _peer_kvs(text: str) -> tuple[str, ...]:
    """A comma-separated list of the peer's KV dtypes (argparse type)."""
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    if not values or any(v not in PEER_KV for v in values):
        raise argparse.ArgumentTypeError(f"expected KV dtypes among {PEER_KV}, got {text!r}")
    return values


def _peer_names(text: str) -> tuple[str, ...]:
    """A comma-separated list of peers (argparse type)."""
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    if not values or any(v not in PEERS for v in values):
        raise argparse.ArgumentTypeError(f"expected peers among {PEERS}, got {text!r}")
    return values


# torch and prefill: not in --quick; serving: bench.serving's, run by `python -m vllm_kimi_dsa bench` (run's `extra`)
SECTIONS = ("decode", "torch", "convert", "fused", "accuracy", "prefill", "serving")


def _section_names(text: str) -> tuple[str, ...]:
    """A comma-separated list of suite sections (argparse type)."""
    values = tuple(x.strip() for x in text.split(",") if x.strip())
    if not values or any(v not in SECTIONS for v in values):
        raise argparse.ArgumentTypeError(f"expected sections among {SECTIONS}, got {text!r}")
    return values


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The suite's options, on `ap` (its own parser, or the `bench` subcommand of python -m vllm_kimi_dsa)."""
    ap.add_argument("--out", required=True, help="directory for bench_suite.json")
    ap.add_argument("--quick", action="store_true", help="a subset (< 60 s on an H200)")
    ap.add_argument("--no-peer", action="store_true", help="skip every peer (FlashInfer's fa3, FlashMLA)")
    ap.add_argument("--peers", type=_peer_names, default=PEERS,
                    help=f"the peers to run where they are found (default {','.join(PEERS)})")
    ap.add_argument("--peer-kv", type=_peer_kvs, default=None,
                    help="fa3 peer KV dtypes (default bf16,fp8; quick: bf16)")
    ap.add_argument("--flashmla", default=None,
                    help="the FlashMLA harness folder (flashmla_bench, FlashMLA's sources beside it as flashmla; "
                         "default $FLASHMLA_PEER_DIR, else ./.carry/flashmla_bench)")
    ap.add_argument("--flashmla-prefill", default=None,
                    help="the prefill peer's harness folder (objs/, api_prefill.cpp; default $FLASHMLA_PREFILL_DIR, "
                         "else ./.carry/flashmla_prefill)")
    ap.add_argument("--sections", type=_section_names, default=SECTIONS,
                    help=f"the suite's sections to run (default {','.join(SECTIONS)})")
    ap.add_argument("--rows", type=cli_types.batch_sizes, default=None, help="override the batch sizes, comma-separated")
    ap.add_argument("--heads", type=cli_types.head_counts, default=None, help="override the head counts, comma-separated")
    ap.add_argument("--reps-time", type=_positive_float, default=None,
                    help="seconds of graph replays per timing of a kernel at a point")
    ap.add_argument("--repeats", type=cli_types.at_least_one, default=REPEATS,
                    help=f"timings of every kernel at a point, taken in turn with the others' (default {REPEATS})")
    ap.add_argument("--even", action="store_true",
                    help="also triton-even/fp8: the same kernel objects planned without lead plans (an A/B)")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    add_arguments(ap)
    return ap


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse the suite's options and run it (without the serving section: `python -m vllm_kimi_dsa bench` runs it);
    exit status 2 (argparse's usage error) without a CUDA GPU."""
    ap = build_parser(prog)
    return run(ap.parse_args(argv), ap.error)


# A section above the suite (bench.serving): points(quick, rows, heads) -> (rows, heads) it runs,
# section(suite, data, ceil, peer, rows, heads) -> None, run after the accuracy section with the peers built for its
# head counts too, and warm(suite, data, rows, heads) -> None, run while the peers build.
Extra = tuple[Callable[..., tuple[tuple[int, ...], tuple[int, ...]]], Callable[..., None], Callable[..., None]]


def run(args: argparse.Namespace, error: Callable[[str], NoReturn], extra: dict[str, Extra] | None = None) -> int:
    """Run the suite for parsed options; `error` is the parser's (usage + message, exit 2); extra: the sections
    above this module by name (what `python -m vllm_kimi_dsa bench` hands in: "serving")."""
    if not torch.cuda.is_available():
        # A usage error rather than a failure: the suite times CUDA graphs, there is nothing to measure here.
        error("needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False); "
              "run it on a GPU machine")
    if args.reps_time is None:
        args.reps_time = 0.03 if args.quick else 0.06
    suite = Suite(args)
    dev = suite.device
    rows_list = (QUICK_ROWS if args.quick else FULL_ROWS) if args.rows is None else args.rows
    heads_list = (QUICK_HEADS if args.quick else FULL_HEADS) if args.heads is None else args.heads
    rows_list = tuple(sorted(set(rows_list)))
    extra = {name: fns for name, fns in (extra or {}).items() if name in args.sections}
    for name in set(args.sections) & set(SECTIONS) - {"decode", "torch", "convert", "fused", "accuracy", "prefill"}:
        if name not in extra:
            log(f"section {name}: not run here (python -m vllm_kimi_dsa bench runs it)")
    extra_points = {name: fns[0](args.quick, args.rows, args.heads) for name, fns in extra.items()}
    peer_heads = sorted(set(heads_list).union(*(h for _, h in extra_points.values())), reverse=True)

    # The peers: start their builds first so they overlap everything else.
    peers = () if args.no_peer else args.peers
    default_kv = ("bf16",) if args.quick else PEER_KV
    peer_kinds: list[str] = []
    peer_note = "skipped (--no-peer / --peers)" if "fa3" not in peers else ""
    if "fa3" in peers:
        ok, why = fa3.available()
        if ok:
            peer_kinds += [f"fa3/{kv}" for kv in (default_kv if args.peer_kv is None else args.peer_kv)]
            peer_note = f"flashinfer {why}"
        else:
            peer_note = f"skipped: FlashInfer not importable here ({why})"
            log(f"peer: {peer_note}")
    flashmla_note = "skipped (--no-peer / --peers)" if "flashmla" not in peers else ""
    if "flashmla" in peers:
        ok, why = flashmla.available(args.flashmla)
        if ok:
            peer_kinds.append(FLASHMLA_KIND)
            flashmla_note = (f"FlashMLA's sparse FP8 decode from {why}: vLLM 0.33's _flashmla_C through its own "
                             "wrappers" if why == flashmla.SOURCE_VLLM else f"FlashMLA harness {why}") + \
                " (called as FlashMLASparseImpl: (1, T, H) mixed batch below 32 heads, else (rows, 1, H); query " \
                "padded to 64 / 128 heads in every call)"
        else:
            flashmla_note = f"skipped: {why}"
            log(f"peer flashmla: {flashmla_note}")
    # the prefill section: in the full suite, or asked for by --sections (quick or not); its peer builds meanwhile
    want_prefill = "prefill" in args.sections and (not args.quick or args.sections != SECTIONS)
    prefill_heads = bench_prefill.HEADS if args.heads is None else args.heads
    prefill_build, prefill_note = None, "skipped (--no-peer / --peers)" if "flashmla" not in peers else ""
    if want_prefill and "flashmla" in peers:
        prefill_build, prefill_note = bench_prefill.start_peer_build(args.flashmla_prefill, prefill_heads)
    decode_data = bool(set(args.sections) - {"prefill"})  # --sections prefill alone: no decode data, no decode peers
    fmla_where = None
    if FLASHMLA_KIND in peer_kinds:
        fmla_where = "auto" if flashmla.available(args.flashmla)[1] == flashmla.SOURCE_VLLM else \
            str(flashmla.harness_dir(args.flashmla))
    builds = PeerBuilds(peer_kinds, peer_heads, fmla_where) if peer_kinds and decode_data else None

    import triton

    props = torch.cuda.get_device_properties(dev)
    suite.info = {
        "gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "flashinfer": peer_note, "flashmla": flashmla_note,
        "flashmla_prefill": prefill_note if want_prefill else "skipped (section not run)",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(
            timespec="seconds"), "argv": sys.argv[1:], "quick": args.quick, "K": K, "block_size": BLOCK,
        "scales": {"scale": SCALE, "q_scale": Q_SCALE, "k_scale": K_SCALE},
        "timing": "CUDA graph over `sets` input sets (queries, outputs, cache windows; past 64 sets more slot "
                  "pools), one replay reading > 2x the device's L2; every kernel at a point captured, then timed in "
                  "turn `repeats` rounds (median replay / sets each); us = median of the rounds, us_min / us_max / "
                  "us_iqr their spread; ratios: per-round ours / peer",
        "repeats": suite.repeats, "l2_bytes": suite.l2,
        "floor": "max((KV + query + latent bytes) / copy_GBps, flops / matmul rate of the kernel's compute dtype: "
                 "triton = Q.K at the FP8 rate + P.V at the BF16 rate; peers and torch = BF16)",
        "tflops": "2*rows*H*K*(576+512)/t", "kv_GBps": "rows*K*row_bytes/t",
    }
    log(json.dumps(suite.info))
    ceil = ceilings(dev, args.quick)
    suite.info["ceilings"] = ceil
    log(f"{suite.elapsed()} ceilings: copy {ceil['copy_GBps']:.0f} GB/s (read+write), bf16 {ceil['bf16_TFLOPs']:.0f} "
        f"TFLOP/s, fp8 {ceil['fp8_TFLOPs'] or float('nan'):.0f} TFLOP/s")

    base_rows = (1 << 20) if args.quick else (1 << 21)  # 2^21 rows: 320 requests' 2K tokens in distinct blocks
    if decode_data:
        data = Data(dev, base_rows, shift=4096, with_bf16=any(k.startswith("fa3/") for k in peer_kinds),
                    fp8_ds_mla=flashmla.quantize_fp8_ds_mla if FLASHMLA_KIND in peer_kinds else None)
        suite.info["cache"] = {"base_rows": base_rows, "shift_rows": data.shift, "total_rows": data.total,
                               "bytes": data.nbytes()}
        log(f"{suite.elapsed()} data: {data.total} rows per format, {data.nbytes() / 2**30:.2f} GiB")
    suite.dump()

    ours = ["triton/fp8", "triton/nvfp4_ds_mla", "triton-pv8/fp8"] + (["triton-even/fp8"] if args.even else [])
    sections = set(args.sections)
    # the sections without peers first, while the peers build
    if not args.quick and "torch" in sections:
        torch_section(suite, data, ceil, TORCH_SIZES)
    if "convert" in sections:
        convert_section(suite, data, ceil, rows_list if not args.quick else (5, 320))
    if "fused" in sections:
        fused_section(suite, data, ceil, FUSED_SIZES if not args.quick else ((5, 128), (320, 128)))

    peer: dict[str, Any] | None = None
    kinds = list(ours)
    if builds is not None:  # every kernel of a point is timed in turn with the others: the peers must be ready
        if "decode" in sections:  # meanwhile compile ours at every point (one eager call each)
            warm_ours(suite, data, rows_list, heads_list, ours)
        for name, fns in extra.items():
            fns[2](suite, data, *extra_points[name])
        log(f"{suite.elapsed()} waiting for the peer builds")
        b = builds.wait()
        peer = {}
        for kind, res in b.items():
            res["usable_heads"] = {h: peer_heads_ok(res, h) for h in peer_heads}
            peer[kind] = res
            log(f"{suite.elapsed()} peer {kind}: rc={res['rc']} wall={res['wall_s']}s usable heads "
                f"{[h for h, ok in res['usable_heads'].items() if ok]} {res['tail'][-300:]}")
        suite.info["peer_builds"] = {kind: {k: v for k, v in res.items()} for kind, res in peer.items()}
        suite.info["peer_builds"] = json.loads(json.dumps(suite.info["peer_builds"], default=str))
        suite.dump()
        peer_kinds_ok = [kind for kind in peer if any(peer[kind]["usable_heads"].values())]
        if FLASHMLA_KIND in peer:
            suite.info["flashmla_route"] = flashmla_route(peer[FLASHMLA_KIND])
        kinds += peer_kinds_ok
    if "decode" in sections:
        decode_section(suite, data, ceil, rows_list, heads_list, kinds, peer)
    if "accuracy" in sections:
        sizes = QUICK_ERROR_SIZES if args.quick else ERROR_SIZES
        if args.heads is not None:  # the error sizes of the head counts asked for
            sizes = tuple(sz for sz in sizes if sz[1] in heads_list) or sizes[:1]
        accuracy_section(suite, sizes, kinds, peer)
    for name, fns in extra.items():
        fns[1](suite, data, ceil, peer, *extra_points[name])

    if want_prefill:
        reps, warmup = (5, 1) if args.quick else (10, 2)
        suite.prefill = bench_prefill.prefill_suite(dev, ceil, prefill_build, heads=prefill_heads, reps=reps,
                                                    warmup=warmup, log=lambda m: log(f"{suite.elapsed()} {m}"))
        (suite.out_dir / "bench_prefill.md").write_text(bench_prefill.prefill_table(suite.prefill) + "\n")

    suite.info["wall_s"] = round(time.perf_counter() - suite.t0, 1)
    suite.dump()
    log(summary_table(suite.results))
    log(ratio_table(suite.ratios))
    if suite.prefill is not None:
        log(bench_prefill.prefill_table(suite.prefill))
    for a in suite.accuracy:
        log(f"accuracy {a['kernel']:<22} rows={a['rows']:<4} H={a['heads']:<4} rel L2 {a['rel_l2']:.2e} "
            f"(tolerance {a['tolerance']:.2e}: {'ok' if a['within_tolerance'] else 'EXCEEDED'})")
    if "fp8_pv_default" in suite.info:
        log(f"FP8 P.V: {suite.info['fp8_pv_default']['verdict']} ({suite.info['fp8_pv_default']['rule']})")
    failed = len(suite.failures) + len(suite.prefill["failures"] if suite.prefill else [])
    log(f"failures: {failed}; wall {suite.info['wall_s']} s; wrote {suite.out_dir / 'bench_suite.json'}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
