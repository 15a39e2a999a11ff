"""The prefill section of the benchmark suite: long prefill chunks through `serving.LayerStep` as vLLM calls it.
Owns the prefill cases, their inputs (as vLLM hands them to `_forward_mqa_kernel`), floor, timing and accuracy.

A prefill chunk reaches this package's backend as one batch of `rows` query tokens (FP8 query (rows, H, 576), flat
cache rows with -1 past each count, the counts), larger than the planned decode batch, so LayerStep runs it in
pieces of `max_rows` and copies each piece's latent into a new output. The peer on the same data is FlashMLA's SM90
sparse prefill (`flash_mla_sparse_fwd`), the kernel vLLM 0.33's FLASHMLA_SPARSE runs for a prefill chunk on an FP8
cache at >= 32 heads a rank, on the BF16 workspace vLLM gathers and upconverts the context into (its glue:
bench.peers.flashmla_prefill; its harness: benchmarks/peers/flashmla_prefill/prepare.sh; the section runs without
it).

Cases: 1 request x 4096 query tokens and 4 x 1024, H = 128 and 16, K = 2048. Each request has `prior` = K tokens of
context before the chunk, so every query token selects K rows (causally: token t sees the prior and chunk tokens up
to itself); with a shorter prior a token's ids end in -1 past its count, as the indexer gives them.
Timing: eager (vLLM runs prefill outside CUDA graphs), CUDA events around each call, median of `reps` after
`warmup` calls. No L2 rotation: one call writes rows*H*1 KiB of latent and reads rows*H*576 B of query, far past L2,
and the context (<= 12288 rows, 7 MiB) is re-read from L2 within every call by design.

The section alone on one GPU (ceilings, our LayerStep, the peer):

    python -m vllm_kimi_dsa.bench.prefill --out DIR [--quick] [--no-peer] [--flashmla-prefill DIR]
            [--cases 1x4096,4x1024] [--heads 128,16] [--reps N]

writes DIR/bench_prefill.json (info, ceilings, the section) first, then DIR/bench_prefill.md (the table). The peer is
built in the background from the harness benchmarks/peers/flashmla_prefill/prepare.sh makes (.carry/flashmla_prefill,
or --flashmla-prefill / $FLASHMLA_PREFILL_DIR; $FLASHMLA_PREFILL_SO: a built extension).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from vllm_kimi_dsa.bench.peers import flashmla as decode_peer
from vllm_kimi_dsa.bench.peers import flashmla_prefill as prefill_peer
from vllm_kimi_dsa.formats import FP8_DS_MLA_ROW_BYTES, FP8_ROW_BYTES, HEAD_DIM, LATENT_DIM, flat_kv_row_view
from vllm_kimi_dsa.heads import check_heads
from vllm_kimi_dsa.reference import reference_decode
from vllm_kimi_dsa.serving import LayerStep, StepShape
from vllm_kimi_dsa.synthetic import StandInImpl, StandInLayer
from vllm_kimi_dsa.widths import check_width

K = 2048
BLOCK = 64
SCALE = 1.0 / math.sqrt(192.0)  # K3's 1/sqrt(qk_nope + qk_rope), as the decode suite
Q_SCALE, K_SCALE = 0.25, 0.125  # powers of two, so the peer's BF16 query and rows hold the FP8 values exactly
CASES = ((1, 4096), (4, 1024))  # (requests, query tokens each)
HEADS = (128, 16)
MAX_ROWS = 512  # vLLM's planned decode batch (serving.planned_rows: the largest capture size, 512 by default)
SAMPLE_ROWS = 48  # query tokens checked against the float32 reference, besides each piece's first and last
PEER_KINDS = {"flashmla-9241ae3": "flashmla/bf16", "vllm-0.33": "flashmla-vllm/bf16"}  # build source -> kernel name
OURS = "layerstep/fp8"
# FlashMLA's FP8 sparse decode kernel over the whole chunk: what vLLM runs for a prefill chunk below 32 heads a rank
# (FlashMLASparseImpl's mixed batch, (1, T, 64) on the fp8_ds_mla cache, no gather); from vLLM's pack only
DECODE_KIND = "flashmla-vllm/fp8_ds_mla"


@dataclass(frozen=True)
class PrefillCase:
    """One prefill chunk: `requests` requests of `tokens` query tokens each, `prior` context tokens before it.

    heads: query heads a rank; width: top-k K (a multiple of 128); max_rows: LayerStep's piece size.
    """

    requests: int
    tokens: int
    heads: int
    width: int = K
    prior: int = K
    block_size: int = BLOCK
    max_rows: int = MAX_ROWS

    def __post_init__(self) -> None:
        for name in ("requests", "tokens", "heads", "block_size", "max_rows"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_heads(self.heads, "heads")
        check_width(self.width, "width")
        if self.prior < 0:
            raise ValueError(f"prior must be >= 0, got {self.prior}")

    @property
    def rows(self) -> int:
        """Query tokens of the chunk (LayerStep's rows)."""
        return self.requests * self.tokens

    @property
    def seq_len(self) -> int:
        """Tokens of each request once the chunk is written: its context (vLLM's prefill seq_len)."""
        return self.prior + self.tokens

    @property
    def pieces(self) -> int:
        return -(-self.rows // self.max_rows)

    @property
    def name(self) -> str:
        return f"{self.requests}x{self.tokens}"


@dataclass
class PrefillInputs:
    """What vLLM hands `_forward_mqa_kernel` for the chunk, and how the tokens lie in the cache.

    query (rows, H, 576) e4m3 (scale Q_SCALE); cache (num_blocks, block_size, 576) e4m3 (scale K_SCALE);
    slots (rows, K) int32 flat rows, valid ones first, -1 after; counts (rows,) int32;
    topk (rows, K) int32 request-local token ids (-1 where slots are); req_id (rows,) int32;
    block_table (requests, blocks a request) int32.
    """

    case: PrefillCase
    query: torch.Tensor
    cache: torch.Tensor
    slots: torch.Tensor
    counts: torch.Tensor
    topk: torch.Tensor
    req_id: torch.Tensor
    block_table: torch.Tensor

    @property
    def kv_rows(self) -> torch.Tensor:
        return flat_kv_row_view(self.cache, self.case.block_size)[0]


def make_prefill_inputs(case: PrefillCase, device: torch.device | str, seed: int = 0) -> PrefillInputs:
    """A random prefill chunk: each request's `seq_len` tokens in its own shuffled blocks of a cache of e4m3(8 x)
    rows; token t of a request selects min(K, prior + t + 1) distinct ids among tokens 0..prior+t in random (score)
    order, -1 after them (the indexer's causal top-k); vLLM's converter makes them flat rows, -1 kept, and counts."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    bs, width = case.block_size, case.width
    blocks_per_req = -(-case.seq_len // bs)
    num_blocks = case.requests * blocks_per_req + 3  # a few blocks no request owns
    x = torch.randn((num_blocks * bs, HEAD_DIM), device=device, generator=g)
    cache = (x / K_SCALE).to(torch.float8_e4m3fn).view(num_blocks, bs, HEAD_DIM)
    del x
    perm = torch.randperm(num_blocks, device=device, generator=g)[: case.requests * blocks_per_req]
    block_table = perm.to(torch.int32).view(case.requests, blocks_per_req)
    req_id = torch.arange(case.requests, dtype=torch.int32, device=device).repeat_interleave(case.tokens)
    # causal top-k: random keys, the tokens a query cannot see pushed past every visible one
    visible = case.prior + torch.arange(case.tokens, device=device) + 1  # tokens 0..prior+t
    topk = torch.empty((case.rows, width), dtype=torch.int32, device=device)
    pos = torch.arange(case.seq_len, device=device)
    for r in range(case.requests):
        keys = torch.rand((case.tokens, case.seq_len), device=device, generator=g)
        keys.masked_fill_(pos.unsqueeze(0) >= visible.unsqueeze(1), 2.0)
        order = keys.argsort(dim=1)[:, :width]
        if order.shape[1] < width:  # a context shorter than K: nothing past it
            order = torch.cat([order, order.new_full((case.tokens, width - order.shape[1]), -1)], dim=1)
        order = order.masked_fill(torch.arange(width, device=device).unsqueeze(0) >= visible.unsqueeze(1), -1)
        topk[r * case.tokens:(r + 1) * case.tokens] = order.to(torch.int32)
    valid = topk >= 0
    ids = topk.clamp(min=0).long()
    blocks = block_table[req_id.long()].gather(1, ids // bs)
    slots = torch.where(valid, blocks * bs + (ids % bs).to(torch.int32), torch.full_like(topk, -1))
    counts = valid.sum(dim=1).to(torch.int32)
    query = (torch.randn((case.rows, case.heads, HEAD_DIM), device=device, generator=g) / Q_SCALE).to(
        torch.float8_e4m3fn)
    return PrefillInputs(case=case, query=query, cache=cache, slots=slots.contiguous(), counts=counts, topk=topk,
                         req_id=req_id, block_table=block_table)


def context_rows(inp: PrefillInputs) -> torch.Tensor:
    """(requests * seq_len,) int64 flat cache rows of every request's tokens in order: what vLLM's prefill gather
    (`cp_gather_and_upconvert_fp8_kv_cache`) reads into its BF16 workspace, request r at offset r * seq_len."""
    case = inp.case
    t = torch.arange(case.seq_len, device=inp.cache.device)
    blocks = inp.block_table.long()[:, t // case.block_size]  # (requests, seq_len)
    return (blocks * case.block_size + t % case.block_size).reshape(-1)


def workspace_indices(inp: PrefillInputs) -> torch.Tensor:
    """(rows, K) int32: the top-k ids as offsets into that workspace (vLLM's converter with HAS_PREFILL_WORKSPACE),
    -1 kept."""
    start = inp.req_id * inp.case.seq_len
    return torch.where(inp.topk >= 0, inp.topk + start.unsqueeze(1), torch.full_like(inp.topk, -1))


def gather_ds_workspace(ds_rows: torch.Tensor, ctx: torch.Tensor, workspace: torch.Tensor) -> torch.Tensor:
    """vLLM's prefill gather (`cp_gather_and_upconvert_fp8_kv_cache`: the context's fp8_ds_mla rows dequantized into
    the BF16 workspace) as torch ops: rows `ctx` of the 656 B rows, each latent tile times its fp32 scale, the BF16
    RoPE copied. A stand-in (several passes where vLLM's op makes one): its time bounds vLLM's from above."""
    r = ds_rows.index_select(0, ctx)
    n = r.shape[0]
    lat = r[:, :LATENT_DIM].view(torch.float8_e4m3fn).float().view(n, 4, LATENT_DIM // 4)
    scale = r[:, LATENT_DIM:LATENT_DIM + 16].view(torch.float32)
    workspace[:, :LATENT_DIM] = (lat * scale.unsqueeze(-1)).view(n, LATENT_DIM)
    workspace[:, LATENT_DIM:] = r[:, LATENT_DIM + 16:].view(torch.bfloat16)
    return workspace


def gather_workspace(kv_rows: torch.Tensor, ctx: torch.Tensor, workspace: torch.Tensor) -> torch.Tensor:
    """The peer's BF16 workspace: rows `ctx` of the fp8 cache, dequantized (x K_SCALE, exact in BF16). A torch
    stand-in for vLLM's one-kernel gather + upconvert (three passes here)."""
    workspace.copy_(kv_rows.index_select(0, ctx))
    return workspace.mul_(K_SCALE)


# ---------------------------------------------------------------- floor


def prefill_floor(case: PrefillCase, ceil: dict[str, Any], *, q_bytes: int, kv_row_bytes: int,
                  compute: str) -> dict[str, Any]:
    """The least time one chunk can take: max(bytes / copy bandwidth, flops / matmul rate).

    flops = 2 * rows * H * K * (576 + 512) (Q.K over 576 dims, P.V over 512): the useful heads, no padding.
    bytes = query in (q_bytes a value) + latent out (BF16) + each request's context read once (kv_row_bytes a row):
    every query token's K selected rows are context rows, so re-reads of them can come from L2.
    gathered_bytes (reported, not in the floor): the selected rows as if each token read its K from memory.
    compute: "bf16" (every flop at the BF16 rate), "fp8" or "fp8qk" (Q.K at the FP8 rate, P.V at the BF16 rate).
    ceil: copy_GBps (bytes read + written per s), bf16_TFLOPs, fp8_TFLOPs (None: the BF16 rate).
    """
    if compute not in ("bf16", "fp8", "fp8qk"):
        raise ValueError(f"compute must be bf16, fp8 or fp8qk, got {compute!r}")
    rows, heads, width = case.rows, case.heads, case.width
    flops = 2.0 * rows * heads * width * (HEAD_DIM + LATENT_DIM)
    qk = 2.0 * rows * heads * width * HEAD_DIM
    io_bytes = rows * heads * HEAD_DIM * q_bytes + rows * heads * LATENT_DIM * 2
    kv_bytes = case.requests * case.seq_len * kv_row_bytes
    gathered = rows * width * kv_row_bytes
    bf16 = float(ceil["bf16_TFLOPs"]) * 1e12
    fp8 = float(ceil.get("fp8_TFLOPs") or ceil["bf16_TFLOPs"]) * 1e12
    if compute == "fp8qk":
        floor_fl = qk / fp8 + (flops - qk) / bf16
    else:
        floor_fl = flops / (fp8 if compute == "fp8" else bf16)
    floor_bw = (io_bytes + kv_bytes) / (float(ceil["copy_GBps"]) * 1e9)
    return {"flops": flops, "bytes": io_bytes + kv_bytes, "gathered_bytes": gathered, "compute": compute,
            "floor_flops_us": round(floor_fl * 1e6, 3), "floor_bw_us": round(floor_bw * 1e6, 3),
            "floor_us": round(max(floor_fl, floor_bw) * 1e6, 3),
            "floor_bound": "compute" if floor_fl >= floor_bw else "bandwidth"}


def with_time(rec: dict[str, Any], us: float) -> dict[str, Any]:
    """rec (prefill_floor's keys) plus us, TFLOP/s-eq of the useful flops and the fraction of the floor."""
    return {**rec, "us": round(us, 3), "tflops": round(rec["flops"] / (us * 1e-6) / 1e12, 2),
            "of_floor": round(rec["floor_us"] / us, 3)}


# ---------------------------------------------------------------- timing and accuracy


def time_us(fn: Callable[[], Any], device: torch.device, *, reps: int, warmup: int) -> dict[str, Any]:
    """Median (min, max) µs of `fn` over `reps` eager calls after `warmup`: CUDA events around each call, or the
    host clock off CUDA (the interpreter: a smoke test, not a measurement)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) * 1e3 for s, e in events]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return {"us": times[len(times) // 2], "us_min": round(times[0], 3), "us_max": round(times[-1], 3), "reps": reps}


def sample_rows(rows: int, max_rows: int, n: int = SAMPLE_ROWS) -> torch.Tensor:
    """Query tokens to check: the first and last of every LayerStep piece, and n spread over the chunk."""
    picks = {0, rows - 1}
    for start in range(0, rows, max_rows):
        picks |= {start, min(rows, start + max_rows) - 1}
    picks |= {int(round(i * (rows - 1) / max(1, n - 1))) for i in range(n)}
    return torch.tensor(sorted(picks), dtype=torch.long)


def reference_rows(inp: PrefillInputs, rows: torch.Tensor) -> torch.Tensor:
    """float32 reference latent (len(rows), H, 512) of the sampled query tokens (reference_decode)."""
    idx = rows.to(inp.query.device)
    out, _ = reference_decode(inp.query[idx], inp.kv_rows, inp.slots[idx], inp.counts[idx], fmt="fp8",
                              softmax_scale=SCALE * Q_SCALE * K_SCALE, output_scale=K_SCALE)
    return out


def accuracy(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor) -> dict[str, Any]:
    """rel L2 and max |error| of out's sampled rows vs the reference; non-finite values counted over all of out."""
    o = out[rows.to(out.device)].float()
    return {"rel_l2": float((o - ref).norm() / ref.norm()), "max_abs": float((o - ref).abs().max()),
            "nonfinite": int((~torch.isfinite(out)).sum()), "sample_rows": int(rows.numel())}


def poison_next_output(shape: tuple[int, ...], device: torch.device) -> None:
    """Hand the caching allocator a NaN block of the output's size, so the next allocation of that size (the call's
    new output) starts poisoned and an unwritten element shows as non-finite."""
    t = torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)
    del t


def layer_step(heads: int, width: int, max_rows: int, device: torch.device,
               kernels: dict[int, str] | None = None) -> LayerStep:
    """The layer's step as the backend builds it (kernels None: the machine's kernel table for 1..max_rows)."""
    shape = StepShape(device=device, heads=heads, width=width, fmt="fp8", max_rows=max_rows, return_lse=False)
    impl = StandInImpl(scale=SCALE, kv_cache_dtype="fp8")
    return LayerStep(impl, StandInLayer(_q_scale_float=Q_SCALE, _k_scale_float=K_SCALE), shape, kernels=kernels)


def step_impl(step: LayerStep, rows: int) -> str:
    """Which kernel a piece of `rows` runs: the table's name and, for our Triton kernel, its plan's implementations."""
    name = step.kernels[rows]
    try:
        kernel = step.core.decode_kernel(rows)
        params = getattr(kernel, "plan_params", {}).get((rows, step.shape.width))
        if params is not None:
            name += ":" + "+".join(dict.fromkeys("tl" if p is None else type(p).__name__ for p in params))
    except Exception:  # a description only
        pass
    return name


# ---------------------------------------------------------------- the peer


class PeerBuild:
    """peers.flashmla_prefill --build in a child process (the extension's ~45 s compile overlaps our measurements); wait() gives
    {kernel name: (fwd, probe records)} for every build of the kernel whose small cases all passed, and the log."""

    def __init__(self, harness: str | None, build_dir: str, probe_heads: Sequence[int]) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="prefill_peer_", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", prefill_peer.__name__, "--build", *([harness] if harness else []),
               "--build-dir", build_dir, "--probe-heads", ",".join(map(str, probe_heads))]
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait(self, timeout_s: float = 300.0) -> tuple[dict[str, tuple[Callable[..., Any], list[dict]]], dict]:
        try:
            rc = self.proc.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - self.t0)))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = -9
        self.log.close()
        text = Path(self.log.name).read_text(errors="replace")
        Path(self.log.name).unlink(missing_ok=True)  # what the run needs of it is kept in info ("tail", records)
        records = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
        info = {"rc": rc, "wall_s": round(time.perf_counter() - self.t0, 1), "records": records,
                "tail": text[-1500:] if rc else ""}
        found: dict[str, tuple[Any, list[dict]]] = {}
        for source, kind in PEER_KINDS.items():
            probes = [r for r in records if r.get("step") == "probe" and r.get("source") == source]
            if probes and all(r.get("ok") for r in probes):
                try:
                    if probes[0].get("route"):  # vLLM's pack: its wrappers, and its decode kernel for H < 32
                        found[kind] = (prefill_peer.vllm_fwd()[0], probes)
                        found[DECODE_KIND] = (decode_peer.vllm_ops()[0], probes)
                    else:
                        found[kind] = (prefill_peer.load(probes[0]["so"]), probes)
                except Exception as err:
                    info.setdefault("load_errors", {})[kind] = f"{type(err).__name__}: {err}"[:500]
        return found, info


# ---------------------------------------------------------------- the section


def run_prefill_section(device: torch.device | str, ceil: dict[str, Any], *,
                        cases: Sequence[tuple[int, int]] = CASES, heads: Sequence[int] = HEADS, width: int = K,
                        prior: int = K, max_rows: int = MAX_ROWS, reps: int = 10, warmup: int = 2,
                        peers: dict[str, Callable[..., Any]] | None = None, ours: bool = True,
                        kernels: dict[int, str] | None = None, log: Callable[..., None] = print) -> dict[str, Any]:
    """Every (case, H): our LayerStep (unless ours is False), then each peer, on the same data (seeded by the case:
    a second call makes the same inputs); accuracy before timing.

    ceil: the machine's ceilings (bench.ceilings). peers: {kernel name: flash_mla_sparse_fwd-like function}.
    kernels: LayerStep's table (None: the machine's). Returns {"info", "results", "accuracy", "failures", "ratios"}.
    """
    device = torch.device(device)
    peers = peers or {}
    section: dict[str, Any] = {"results": [], "accuracy": [], "failures": [], "info": {
        "cases": [list(c) for c in cases], "heads": list(heads), "K": width, "prior": prior, "max_rows": max_rows,
        "reps": reps, "warmup": warmup, "block_size": BLOCK,
        "scales": {"scale": SCALE, "q_scale": Q_SCALE, "k_scale": K_SCALE},
        "timing": "eager calls, CUDA events around each, median of reps after warmup; no L2 rotation (outputs and "
                  "queries far past L2, the context is re-read from L2 within a call anyway)",
        "ours": "serving.LayerStep(query e4m3, cache, flat rows, counts): pieces of max_rows through the core's "
                "decode, each piece's latent copied into the chunk's new output",
        "peer": "as vLLM 0.33's FlashMLASparseImpl runs a prefill chunk on an fp8_ds_mla cache: at >= 32 heads "
                "the gather of the context into a BF16 workspace (a torch stand-in for "
                "cp_gather_and_upconvert_fp8_kv_cache; gather_us alone, gather_floor_us its floor) then "
                "flash_mla_sparse_fwd (BF16 query padded to a multiple of 64 heads, workspace offsets, topk_length, "
                "out= its padded buffer, the first H heads copied out): us includes the gather, kernel_us does not; "
                "below 32 heads the chunk through FlashMLA's FP8 decode kernel as one mixed batch ((1, T, 64), "
                "no gather; " + DECODE_KIND + "); vllm_runs_it says which one vLLM runs at each head count",
        "floor": "max(flops / matmul rate, (query + latent + each request's context once) / copy_GBps)",
        "vllm_h_below_32": "vLLM runs FLASHMLA_SPARSE's mixed batch below 32 heads a rank (FlashMLA's FP8 "
                           "sparse decode kernel over the whole chunk), not this peer",
    }}

    def guarded(what: dict[str, Any], fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as err:
            section["failures"].append({**what, "error": f"{type(err).__name__}: {err}"[:600],
                                        "trace": traceback.format_exc()[-1500:]})
            log(f"prefill FAILED {what}: {type(err).__name__}: {err}"[:400])
            if device.type == "cuda":
                try:
                    torch.cuda.synchronize(device)
                except Exception:  # a sticky fault: the next steps fail on their own
                    pass
            return None

    steps: dict[int, LayerStep] = {}
    for h in heads:
        for requests, tokens in cases:
            base = {"section": "prefill", "case": f"{requests}x{tokens}", "requests": requests, "tokens": tokens,
                    "rows": requests * tokens, "heads": h, "K": width, "prior": prior}
            setup = {**base, "kernel": "inputs"}
            case = guarded(setup, lambda: PrefillCase(requests, tokens, h, width=width, prior=prior,
                                                      max_rows=max_rows))
            seed = requests * 1000 + tokens + h
            inp = None if case is None else guarded(setup, lambda: make_prefill_inputs(case, device, seed=seed))
            rows = sample_rows(requests * tokens, max_rows)
            ref = None if inp is None else guarded(setup, lambda: reference_rows(inp, rows))
            if ref is None:
                continue

            def run_ours() -> None:
                if h not in steps:
                    steps[h] = layer_step(h, width, max_rows, device, kernels)
                step = steps[h]
                call = lambda: step(inp.query, inp.cache, inp.slots, inp.counts, case.block_size)  # noqa: E731
                if case.rows <= max_rows:
                    step.buffers.latent.fill_(float("nan"))
                else:
                    poison_next_output((case.rows, h, LATENT_DIM), device)
                out, _ = call()
                acc = {**base, "kernel": OURS, **accuracy(out, ref, rows)}
                section["accuracy"].append(acc)
                del out
                t = time_us(call, device, reps=reps, warmup=warmup)
                fl = prefill_floor(case, ceil, q_bytes=1, kv_row_bytes=FP8_ROW_BYTES, compute="fp8qk")
                copy_bytes = 2 * case.rows * h * LATENT_DIM * 2 if case.rows > max_rows else 0
                rec = {**base, "kernel": OURS, "impl": step_impl(step, min(case.rows, max_rows)),
                       "pieces": case.pieces, "max_rows": max_rows, **with_time(fl, t["us"]),
                       "us_min": t["us_min"], "us_max": t["us_max"], "reps": t["reps"],
                       "piece_copy_floor_us": round(copy_bytes / (float(ceil["copy_GBps"]) * 1e9) * 1e6, 3)}
                section["results"].append(rec)
                log(f"prefill {OURS:<20} {case.name:>7} H={h:<4} {rec['us']:10.1f} us {rec['tflops']:7.1f} TF/s "
                    f"floor {rec['floor_us']:9.1f} us ({rec['of_floor']:.2f}) rel L2 {acc['rel_l2']:.2e} "
                    f"[{rec['impl']}]")

            if ours:
                guarded({**base, "kernel": OURS}, run_ours)

            if peers:
                def peer_data() -> dict[str, Any]:
                    ctx = context_rows(inp)
                    # the cache as FLASHMLA_SPARSE holds it: the same values as 656 B fp8_ds_mla rows (vLLM's scales)
                    ds = decode_peer.quantize_fp8_ds_mla(inp.kv_rows.float() * K_SCALE)
                    ws = torch.empty((ctx.numel(), HEAD_DIM), dtype=torch.bfloat16, device=device)
                    gather_ds_workspace(ds, ctx, ws)
                    g = time_us(lambda: gather_ds_workspace(ds, ctx, ws), device, reps=reps, warmup=1)
                    gather_floor = ctx.numel() * (FP8_DS_MLA_ROW_BYTES + 2 * HEAD_DIM) / (float(ceil["copy_GBps"]) * 1e9)
                    return {"ws": ws, "ds": ds, "ctx": ctx, "idx": workspace_indices(inp),
                            "q16": inp.query.to(torch.bfloat16) * Q_SCALE,
                            "gather_us": round(g["us"], 3), "gather_floor_us": round(gather_floor * 1e6, 3)}

                pdata = guarded({**base, "kernel": "peer data"}, peer_data)
                for kind, fwd in (peers.items() if pdata is not None else ()):
                    def run_decode_kernel(kind: str = kind, ops: Any = fwd) -> None:
                        """vLLM below 32 heads: the whole chunk through FlashMLA's FP8 decode kernel (1, T, 64)."""
                        their = decode_peer.VllmFlashMLA(ops, h, case.rows, sm_scale=SCALE, device=device)
                        call = lambda: their.run(pdata["q16"], pdata["ds"], inp.slots)  # noqa: E731
                        their.plan(pdata["q16"], pdata["ds"], inp.slots)  # the step's metadata, outside the timing
                        poison_next_output((1, case.rows, their.padded, LATENT_DIM), device)
                        out = call()
                        acc = {**base, "kernel": kind, **accuracy(out, ref, rows)}
                        section["accuracy"].append(acc)
                        t = time_us(call, device, reps=reps, warmup=warmup)
                        fl = prefill_floor(case, ceil, q_bytes=2, kv_row_bytes=FP8_DS_MLA_ROW_BYTES, compute="bf16")
                        rec = {**base, "kernel": kind, "padded_heads": their.padded, **with_time(fl, t["us"]),
                               "us_min": t["us_min"], "us_max": t["us_max"], "reps": t["reps"],
                               "kernel_us": round(t["us"], 3), "gather_us": 0.0, "gather_floor_us": 0.0,
                               "call": their.describe(), "vllm_runs_it": h < decode_peer.MIN_HEADS_FOR_BF16_PREFILL}
                        section["results"].append(rec)
                        log(f"prefill {kind:<20} {case.name:>7} H={h:<4} {rec['us']:10.1f} us "
                            f"{rec['tflops']:7.1f} TF/s floor {rec['floor_us']:9.1f} us ({rec['of_floor']:.2f}) "
                            f"rel L2 {acc['rel_l2']:.2e} ({rec['call']}; vLLM runs it: {rec['vllm_runs_it']})")

                    def run_peer(kind: str = kind, fwd: Callable[..., Any] = fwd) -> None:
                        """vLLM at >= 32 heads: the gather into the BF16 workspace, then flash_mla_sparse_fwd."""
                        their = prefill_peer.PrefillPeer(fwd, h, case.rows, sm_scale=SCALE, device=device)
                        kernel = lambda: their.run(pdata["q16"], pdata["ws"], pdata["idx"], inp.counts)  # noqa: E731

                        def call() -> torch.Tensor:  # what vLLM does per chunk: gather, pad, kernel, copy out
                            gather_ds_workspace(pdata["ds"], pdata["ctx"], pdata["ws"])
                            return kernel()

                        poison_next_output((case.rows, their.padded, LATENT_DIM), device)
                        their.out.fill_(float("nan"))
                        out = call()
                        acc = {**base, "kernel": kind, **accuracy(out, ref, rows)}
                        section["accuracy"].append(acc)
                        t = time_us(call, device, reps=reps, warmup=warmup)
                        tk = time_us(kernel, device, reps=reps, warmup=warmup)
                        fl = prefill_floor(case, ceil, q_bytes=2, kv_row_bytes=2 * HEAD_DIM, compute="bf16")
                        rec = {**base, "kernel": kind, "padded_heads": their.padded, **with_time(fl, t["us"]),
                               "us_min": t["us_min"], "us_max": t["us_max"], "reps": t["reps"],
                               "kernel_us": round(tk["us"], 3), "gather_us": pdata["gather_us"],
                               "gather_floor_us": pdata["gather_floor_us"],
                               "kernel_plus_gather_floor_us": round(tk["us"] + pdata["gather_floor_us"], 3),
                               "vllm_runs_it": h >= decode_peer.MIN_HEADS_FOR_BF16_PREFILL}
                        section["results"].append(rec)
                        log(f"prefill {kind:<20} {case.name:>7} H={h:<4} {rec['us']:10.1f} us with the gather "
                            f"({rec['kernel_us']:.1f} kernel) {rec['tflops']:7.1f} TF/s floor {rec['floor_us']:9.1f} "
                            f"us ({rec['of_floor']:.2f}) rel L2 {acc['rel_l2']:.2e} (heads padded to {their.padded}; "
                            f"gather {pdata['gather_us']:.1f} us, floor {pdata['gather_floor_us']:.1f}; vLLM runs it: "
                            f"{rec['vllm_runs_it']})")

                    if kind == DECODE_KIND:
                        if h < decode_peer.MIN_HEADS_FOR_BF16_PREFILL:
                            guarded({**base, "kernel": kind}, run_decode_kernel)
                    else:
                        guarded({**base, "kernel": kind}, run_peer)
                del pdata
            del inp, ref
            if device.type == "cuda":
                torch.cuda.empty_cache()
    section["ratios"] = ratios(section["results"])
    return section


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Our time over each peer's per (case, H): over the peer's whole call as vLLM makes it (us: the gather stand-in
    included where vLLM gathers), and over its kernel plus the gather's floor (the least vLLM's one-kernel gather
    could take): kernel_us (the call less its gather: us - gather_us in a record without it) + gather_floor_us, so
    the gather is counted once, at its floor; vllm_runs_it: whether vLLM runs that peer at this head count."""
    out = []
    ours = {(r["case"], r["heads"]): r for r in results if r["kernel"] == OURS}
    for r in results:
        mine = ours.get((r["case"], r["heads"]))
        if r["kernel"] == OURS or mine is None:
            continue
        low = r.get("kernel_us", r["us"] - r.get("gather_us", 0.0)) + r.get("gather_floor_us", 0.0)
        out.append({"case": r["case"], "heads": r["heads"], "peer": r["kernel"],
                    "ours_over_peer": round(mine["us"] / r["us"], 3),
                    "ours_over_peer_with_gather": round(mine["us"] / low, 3),
                    "vllm_runs_it": r.get("vllm_runs_it")})
    return out


def prefill_table(section: dict[str, Any]) -> str:
    """Markdown: one column per (case, H), a row per kernel, cells `µs (TFLOP/s-eq; fraction of the floor)`, then
    the time ratios and the accuracy."""
    res = section.get("results", [])
    cols = sorted({(r["heads"], r["case"]) for r in res}, key=lambda c: (-c[0], c[1]))
    if not cols:
        return "(no prefill results)"
    kinds = [OURS] + sorted({r["kernel"] for r in res} - {OURS})
    head = "| kernel | " + " | ".join(f"{c} H={h}" for h, c in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    for k in kinds:
        cells = []
        for h, c in cols:
            hit = [r for r in res if r["kernel"] == k and r["heads"] == h and r["case"] == c]
            cells.append(f"{hit[0]['us']:.1f} ({hit[0]['tflops']:.0f}; {hit[0]['of_floor']:.2f})" if hit else "-")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    for k in kinds[1:]:
        cells = []
        for h, c in cols:
            hit = [r for r in res if r["kernel"] == k and r["heads"] == h and r["case"] == c]
            cells.append(("yes" if hit[0].get("vllm_runs_it") else "no") if hit else "-")
        lines.append(f"| {k}: vLLM runs it here | " + " | ".join(cells) + " |")
    for peer in sorted({q["peer"] for q in section.get("ratios", [])}):
        cells = []
        for h, c in cols:
            hit = [q for q in section["ratios"] if q["peer"] == peer and q["heads"] == h and q["case"] == c]
            cells.append(f"{hit[0]['ours_over_peer']:.2f} ({hit[0]['ours_over_peer_with_gather']:.2f})" if hit
                         else "-")
        lines.append(f"| ours / {peer} (time, its gather included; over its kernel + the gather's floor) | "
                     + " | ".join(cells) + " |")
    for k in kinds:
        cells = []
        for h, c in cols:
            hit = [a for a in section.get("accuracy", []) if a["kernel"] == k and a["heads"] == h and a["case"] == c]
            cells.append(f"{hit[0]['rel_l2']:.1e}" + (f" ({hit[0]['nonfinite']} non-finite)" if hit[0]["nonfinite"]
                                                      else "") if hit else "-")
        lines.append(f"| rel L2 {k} | " + " | ".join(cells) + " |")
    gathers = [f"{r['case']} H={r['heads']} {r['gather_us']:.1f} µs (floor {r['gather_floor_us']:.1f})"
               for r in res if r["kernel"] != OURS and r.get("gather_us")]
    if gathers:
        lines.append("")
        lines.append("The BF16 prefill peer's gather (vLLM's cp_gather_and_upconvert_fp8_kv_cache as a torch stand-in, "
                     "in its time): " + "; ".join(dict.fromkeys(gathers)))
    return "\n".join(lines)


def prefill_suite(device: torch.device | str, ceil: dict[str, Any], build: PeerBuild | None, *,
                  cases: Sequence[tuple[int, int]] = CASES, heads: Sequence[int] = HEADS, width: int = K,
                  prior: int = K, max_rows: int = MAX_ROWS, reps: int = 10, warmup: int = 2,
                  kernels: dict[int, str] | None = None, log: Callable[..., None] = print) -> dict[str, Any]:
    """The section as the bench runs it: our side first (while the peer's build, started earlier, goes on), then
    each peer build whose small cases passed, on the same inputs (remade from the same seeds). The build's report
    lands in the section's info.peer_build. build: start_peer_build's (anything with PeerBuild.wait) or None."""
    kw = dict(cases=cases, heads=heads, width=width, prior=prior, max_rows=max_rows, reps=reps, warmup=warmup,
              kernels=kernels, log=log)
    section = run_prefill_section(device, ceil, **kw)
    if build is not None:
        found, info = build.wait()
        section["info"]["peer_build"] = json.loads(json.dumps(info, default=str))
        log(f"prefill peer build: rc={info['rc']} {info['wall_s']} s, usable {sorted(found)} {info['tail'][-400:]}")
        if found:
            theirs = run_prefill_section(device, ceil, peers={k: f for k, (f, _) in found.items()}, ours=False, **kw)
            for key in ("results", "accuracy", "failures"):
                section[key] += theirs[key]
            section["ratios"] = ratios(section["results"])
    return section


def start_peer_build(harness: str | None, heads: Sequence[int]) -> tuple[PeerBuild | None, str]:
    """The background build of the peer when its harness is here: (PeerBuild or None, a note for the JSON)."""
    if not harness and decode_peer.vllm_available()[0]:
        build_dir = os.path.join(tempfile.gettempdir(), "fmla_prefill_build")
        return PeerBuild(None, build_dir, heads), ("vLLM 0.33's _flashmla_C from the vLLM pack: flash_mla_sparse_fwd "
                                                  "(>= 32 heads) and the FP8 decode kernel's mixed batch (< 32)")
    ok, where = prefill_peer.available(harness)
    if not ok:
        return None, f"skipped: {where}"
    build_dir = os.environ.get("FLASHMLA_PREFILL_BUILD", os.path.join(tempfile.gettempdir(), "fmla_prefill_build"))
    return PeerBuild(where if not where.endswith(".so") else None, build_dir, heads), f"building from {where}"


# ---------------------------------------------------------------- the section alone (python -m vllm_kimi_dsa.bench.prefill)


def _cases(text: str) -> tuple[tuple[int, int], ...]:
    """REQUESTSxTOKENS[,...] (argparse type)."""
    try:
        out = tuple((int(a), int(b)) for a, b in (c.lower().split("x") for c in text.split(",") if c))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected REQUESTSxTOKENS[,...], e.g. 1x4096,4x1024; got {text!r}") from None
    if not out or any(a < 1 or b < 1 for a, b in out):
        raise argparse.ArgumentTypeError(f"expected positive REQUESTSxTOKENS, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    """The prefill section alone on one GPU: ceilings, our LayerStep, FlashMLA's sparse prefill (module docstring)."""
    from vllm_kimi_dsa import cli_types
    from vllm_kimi_dsa.timing import ceilings

    ap = argparse.ArgumentParser(prog="python -m vllm_kimi_dsa.bench.prefill",
                                 description="The bench's prefill section alone on one GPU.")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="5 reps, 1 warm-up, quick ceilings")
    ap.add_argument("--no-peer", action="store_true", help="skip FlashMLA's sparse prefill")
    ap.add_argument("--flashmla-prefill", default=None, help="the peer's harness folder (default "
                    "$FLASHMLA_PREFILL_DIR, else ./.carry/flashmla_prefill)")
    ap.add_argument("--cases", type=_cases, default=CASES, help="REQUESTSxTOKENS,... (default 1x4096,4x1024)")
    ap.add_argument("--heads", type=cli_types.head_counts, default=HEADS)
    ap.add_argument("--max-rows", type=cli_types.at_least_one, default=MAX_ROWS,
                    help="LayerStep's planned rows (vLLM's)")
    ap.add_argument("--reps", type=cli_types.at_least_one, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    build, note = (None, "skipped (--no-peer)") if args.no_peer else start_peer_build(args.flashmla_prefill,
                                                                                        args.heads)
    print(f"peer: {note}", flush=True)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    import triton

    ceil = ceilings(dev, True)
    info = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "argv": sys.argv[1:], "peer": note, "ceilings": ceil,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    print(json.dumps(info), flush=True)
    reps = args.reps or (5 if args.quick else 10)
    warmup = 1 if args.quick else 2
    # ours first (the peer's build overlaps it), then the peer on the same data
    section = prefill_suite(dev, ceil, build, cases=args.cases, heads=args.heads, max_rows=args.max_rows,
                            reps=reps, warmup=warmup, log=lambda m: print(m, flush=True))
    info["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "bench_prefill.json").write_text(json.dumps({"info": info, "prefill": section}, indent=1, default=str))
    table = prefill_table(section)
    (out / "bench_prefill.md").write_text(f"# Prefill on {props.name}\n\n{table}\n")
    print(table, flush=True)
    print(f"failures: {len(section['failures'])}; wall {info['wall_s']} s; wrote {out / 'bench_prefill.json'}",
          flush=True)
    return 0 if not section["failures"] else 1


__all__ = [
    "CASES", "HEADS", "MAX_ROWS", "PrefillCase", "PrefillInputs", "context_rows", "gather_workspace",
    "make_prefill_inputs", "prefill_floor", "prefill_suite", "prefill_table", "run_prefill_section", "sample_rows",
    "main", "start_peer_build", "workspace_indices",
]


if __name__ == "__main__":
    sys.exit(main())
