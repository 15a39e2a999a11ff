#!/usr/bin/env python3
"""Multi-GPU DCP: one process a GPU, a K3.1-shaped cache split over the ranks, each rank's decode merged == one GPU.

    torchrun --nproc-per-node D benchmarks/bench_dcp.py --out DIR [--interleave 1,64] [--rows 5,20,80,160,320]
        [--heads 128] [--width 2048] [--fmt fp8] [--iters 50]
    python3 benchmarks/bench_dcp.py --out DIR ...            # no torchrun: one process, D = 1 (a sanity run)
    ... --backend gloo --device cpu --heads 16 --width 128 --rows 3,5   # CPU (Triton's interpreter; the tests)

Every rank builds the SAME global data from one seed (its digest is compared across ranks): per request (one a
decode row) `context` FP8 token rows, top-k ids with -1 holes (row 0 all -1; row 1's ids all owned by rank 0 under
every interleave asked for, so every other rank has count 0 there), FP8 queries (rows, H, 576). For each interleave
I a rank keeps only its own tokens (SPEC 4/6: token t lives on rank (t // I) % D at local index
(t // (D*I)) * I + t % I) in its own paged cache and block table. Per rank, what the vLLM backend runs: the top-k
ids converted by the package's converter (`convert.convert_topk`, dcp_size/dcp_rank/interleave; vLLM runs its own
converter there, this mirrors it), then `serving.LayerStep` (StepShape(dcp=D, rank=r, return_lse=True), the
"triton" kernel for every batch size: on Hopper the Gluon/Triton kernels) -> bf16 latent and natural-log LSE.
Latents, LSEs and counts are all-gathered and merged by `dcp.merge_dcp` (count-0 ranks dropped by their count).
Rank 0 checks the merge against the single-GPU result (the same LayerStep with D = 1 on the whole cache) and that
against the float32 `reference.reference_decode`, with the bounds stated at `Tolerances` below, count-0 rows
included, and checks that the bound rejects broken merges (uniform weights, count-0 ranks kept, base-2 weights).

Timing (CUDA only): each rank's decode (the LayerStep call) and its converter, each captured in a CUDA graph and
replayed `--iters` times after a write of 4x the L2 (cold L2, as the suite's rotation), median of CUDA-event pairs;
the single-GPU decode of the same rows on rank 0 the same way; the merge (all_gather of latent/LSE/counts + merge_dcp,
eager) after a barrier, median per rank. NCCL_NVLS_ENABLE=0 (no NVLink multicast) is set before the process group.
Rank 0 writes DIR/bench_dcp.json and prints a table; the exit status is 1 when any check fails.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BLOCK = 64
SEED = 2026
# The layer's scales and the data's spread (as tests/test_dcp.py): logits of std ~3 at 576 dims, a peaked softmax,
# so the ranks' LSEs differ and a merge with wrong weights (uniform, base 2) lands far outside the bound.
Q_SCALE = 0.3
K_SCALE = 0.5
X_STD = 2.0  # token rows N(0, 2^2), quantized with k_scale 0.5
Q_STD = 3.0  # query values N(0, 3^2) in e4m3
HOLE_FRACTION = 0.1

# ---------------------------------------------------------------- Tolerances
# (the style of tests/decode_checks.py and tests/test_dcp.py; copied, not imported: a bench does not import tests)
#
# Every bound is per element and scales with the values the row actually selected, never the whole cache:
# vmax = max |v| over the latent of the rows TP's row i selected (the union of every rank's) * output_scale.
#
# One GPU (TP) against the float32 reference (decode_checks.check_decode):
#   the kernel's e4m3 x e4m3 products are exact in fp32, so logits and LSE differ by summation order (LSE_ATOL);
#   P is rounded to fp16 before P.V (<= 2^-11 sum_j p_j |v_j| <= 2^-11 vmax, doubled for the split combine: P_ERR);
#   split partials stored in kernels.common.PARTIAL_DTYPE (fp16: 2^-11 vmax, fp32: 0: PARTIAL_ERR);
#   the output rounded to bf16 once (BF16_REL |ref|, RNE 2^-8 on a GPU, 2^-7 in the interpreter, which truncates)
#   plus 2^-12 |ref| for fp32 summation order. On Hopper's fp8 wgmma (the H >= 64 fp8 kernels, no promotion), the
#   accumulator keeps ~14 bits: per 32-dim k-step 2^-14 of sum_d |q_d k_d| (WGMMA_STEP_REL), a logit error e per row
#   (`logit` below) that moves the LSE by e and the output by 2 e vmax.
#   |tp - ref| <= (BF16_REL + 2^-12) |ref| + (P_ERR + PARTIAL_ERR + 2 logit) vmax;  |lse - ref| <= LSE_ATOL + logit.
#
# The merge against TP (test_dcp.tp_check), with w_r the merge weights and mix = sum_r w_r |o_r| over live ranks:
#   each rank's latent is rounded to bf16 before the merge (BF16_REL mix after weighting), TP's once (BF16_REL |tp|);
#   2^-12 mix for fp32 summation order (kernels and merge); each side's LSE is within lse_tol = 2 LSE_ATOL of the
#   other's exact value, and e^{d_r - d} moves each weight by <= 2 lse_tol relative (2 lse_tol mix); the kernel terms
#   (P_ERR + PARTIAL_ERR) vmax on either side (2x); the logit error on each side: 2e vmax per output, and the merge
#   weights by 2e: 6 logit vmax in all.
#   |merged - tp| <= (BF16_REL + 2^-12 + 2 lse_tol) mix + BF16_REL |tp| + (2 (P_ERR + PARTIAL_ERR) + 6 logit) vmax
#   |merged_lse - tp_lse| <= lse_tol + 2 logit + 1e-5 |tp_lse|   (float32 logsumexp of |LSE| < 2^5)
# The merge against the reference: the sum of the two bounds (triangle inequality).
# A row no rank saw (count 0 everywhere): out exactly 0, LSE exactly -inf, on every rank and after the merge.
P_ERR = 2.0**-10
LSE_ATOL = 2e-4
SUM_REL = 2.0**-12
WGMMA_STEP_REL = 2.0**-14


def bf16_rel(device: torch.device) -> float:
    return 2.0**-8 if device.type == "cuda" else 2.0**-7


def partial_err() -> float:
    from vllm_kimi_dsa.kernels.common import PARTIAL_DTYPE

    return {torch.float16: 2.0**-11, torch.float32: 0.0}[PARTIAL_DTYPE]


# ---------------------------------------------------------------- the split (SPEC 4 / 6)


def owner_and_local(t: torch.Tensor, dcp: int, interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token t lives on rank (t // I) % D at local index (t // (D*I)) * I + t % I."""
    return (t // interleave) % dcp, (t // (dcp * interleave)) * interleave + t % interleave


def rank0_only_ids(context: int, dcp: int, interleaves: Sequence[int]) -> torch.Tensor:
    """Token ids rank 0 owns under every interleave asked for (row 1 picks only these: count 0 on other ranks)."""
    t = torch.arange(context)
    keep = torch.ones(context, dtype=torch.bool)
    for i in interleaves:
        keep &= owner_and_local(t, dcp, i)[0] == 0
    return t[keep]


# ---------------------------------------------------------------- global data (identical on every rank)


@dataclass
class GlobalData:
    tokens: torch.Tensor  # (reqs, context, row_bytes) in the cache's dtype, CPU
    topk: torch.Tensor  # (reqs, K) int32 request-local token ids, -1 holes, CPU
    query: torch.Tensor  # (reqs, H, 576) float8_e4m3fn, CPU
    context: int

    def digest(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for t in (self.tokens, self.topk, self.query):
            h.update(t.contiguous().view(torch.uint8).numpy().data)
        return h.hexdigest()


def make_global(reqs: int, heads: int, width: int, fmt: str, dcp: int, interleaves: Sequence[int],
                seed: int = SEED) -> GlobalData:
    """reqs requests of `context` tokens each (> 2 K and > 2 D I, odd: partial last blocks and groups), their top-k
    ids in random (indexer) order with HOLE_FRACTION -1 holes, row 0 all -1, row 1 rank 0's tokens only."""
    from vllm_kimi_dsa.formats import HEAD_DIM, quantize_rows

    if reqs < 2:
        raise ValueError(f"need >= 2 rows (row 0 all -1, row 1 rank 0 only), got {reqs}")
    g = torch.Generator().manual_seed(seed)
    context = max(2 * width, 2 * dcp * max(interleaves)) + 37
    first = quantize_rows(torch.randn((context, HEAD_DIM), generator=g) * X_STD, fmt, K_SCALE)
    tokens = torch.empty((reqs, *first.shape), dtype=first.dtype)
    tokens[0] = first
    for r in range(1, reqs):  # a request at a time: the float32 draw of all of them would be 4x the bytes
        tokens[r] = quantize_rows(torch.randn((context, HEAD_DIM), generator=g) * X_STD, fmt, K_SCALE)
    topk = torch.stack([torch.randperm(context, generator=g)[:width] for _ in range(reqs)]).to(torch.int32)
    topk[torch.rand((reqs, width), generator=g) < HOLE_FRACTION] = -1
    topk[0] = -1
    mine = rank0_only_ids(context, dcp, interleaves)
    pick = mine[torch.randperm(mine.numel(), generator=g)[: min(width, mine.numel())]].to(torch.int32)
    topk[1] = -1
    topk[1, : pick.numel()] = pick
    query = (torch.randn((reqs, heads, HEAD_DIM), generator=g) * Q_STD).to(torch.float8_e4m3fn)
    return GlobalData(tokens, topk, query, context)


@dataclass
class RankCache:
    """One rank's paged cache (num_blocks, BLOCK, row_bytes) and block table (reqs, blocks_per_req) int32."""

    cache: torch.Tensor
    block_table: torch.Tensor
    tokens_per_req: int


def rank_cache(data: GlobalData, fmt: str, dcp: int, rank: int, interleave: int, seed: int,
               device: torch.device) -> RankCache:
    """Rank's share of every request (its tokens in local order) through a shuffled block table; spare blocks hold
    random bytes (make_paged_cache), so a read of a row the rank does not own is noticed."""
    from vllm_kimi_dsa.formats import make_paged_cache, write_tokens

    owner, local = owner_and_local(torch.arange(data.context), dcp, interleave)
    own = owner == rank
    n = int(own.sum())
    # local indices of the rank's tokens are 0..n-1 in increasing t: a masked select is the local order
    assert torch.equal(local[own], torch.arange(n)), "the split's local indices must be dense"
    reqs = data.tokens.shape[0]
    per_req = max(1, -(-n // BLOCK))
    num_blocks = reqs * per_req + 3
    g = torch.Generator().manual_seed(seed * 1000003 + 7919 * dcp + 131 * rank + interleave)
    cache = make_paged_cache(num_blocks, BLOCK, fmt, device="cpu", generator=g)
    table = torch.randperm(num_blocks, generator=g)[: reqs * per_req].to(torch.int32).view(reqs, per_req)
    for req in range(reqs):
        if n:
            write_tokens(cache, table[req], data.tokens[req][own])
    return RankCache(cache.to(device), table.to(device), n)


# ---------------------------------------------------------------- per-rank pieces


def layer_step(device: torch.device, heads: int, width: int, fmt: str, max_rows: int, dcp: int, rank: int):
    """The backend's per-layer step (serving.LayerStep) with the K3.1 stand-in impl/layer and "triton" everywhere."""
    from vllm_kimi_dsa.serving import LayerStep, StepShape
    from vllm_kimi_dsa.synthetic import StandInImpl, StandInLayer

    shape = StepShape(device=device, heads=heads, width=width, fmt=fmt, max_rows=max_rows, return_lse=True,
                      dcp=dcp, rank=rank)
    return LayerStep(StandInImpl(kv_cache_dtype=fmt), StandInLayer(_q_scale_float=Q_SCALE, _k_scale_float=K_SCALE),
                     shape, dict.fromkeys(range(1, max_rows + 1), "triton"))


class RankDecode:
    """Convert (the package's converter, as vLLM's does) into this rank's slot/count buffers, then LayerStep."""

    def __init__(self, step: Any, rc: RankCache, topk: torch.Tensor, query: torch.Tensor, dcp: int, rank: int,
                 interleave: int, max_rows: int) -> None:
        self.step, self.rc, self.topk, self.query = step, rc, topk, query
        self.dcp, self.rank, self.interleave = dcp, rank, interleave
        dev = topk.device
        # vLLM's own buffers for the converted rows (the backend decodes them as they are)
        self.slots = torch.full((max_rows, topk.shape[1]), -1, dtype=torch.int32, device=dev)
        self.counts = torch.zeros((max_rows,), dtype=torch.int32, device=dev)
        self.req_ids = torch.arange(max_rows, dtype=torch.int32, device=dev)  # one request a decode row
        _, self.stride_rows = step.core.rows(rc.cache, BLOCK)

    def convert(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm_kimi_dsa.convert import convert_topk

        # made once: a call allocates nothing, so it is captured in a CUDA graph as vLLM's step is
        return convert_topk(
            self.topk[:rows], self.req_ids[:rows], self.rc.block_table, block_size=BLOCK,
            rows_per_block_stride=self.stride_rows, dcp_size=self.dcp, dcp_rank=self.rank,
            interleave=self.interleave, slots=self.slots, counts=self.counts, rows=rows,
        )

    def decode(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.step(self.query[:rows], self.rc.cache, self.slots[:rows], self.counts[:rows], BLOCK)

    def run(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(latent (rows, H, 512) bf16, lse (rows, H) fp32 natural log, counts (rows,) int32), cloned out of the
        shared buffers (every LayerStep of this shape writes the same ones)."""
        self.convert(rows)
        out, lse = self.decode(rows)
        return out.clone(), lse.clone(), self.counts[:rows].clone()


# ---------------------------------------------------------------- distributed helpers


class World:
    def __init__(self, rank: int, size: int, device: torch.device, dist_on: bool) -> None:
        self.rank, self.size, self.device, self.dist_on = rank, size, device, dist_on

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if not self.dist_on:
            return [t]
        import torch.distributed as dist

        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t.contiguous())
        return out

    def gather_latent(self, t: torch.Tensor) -> list[torch.Tensor]:
        """bf16 latents travel as int32 pairs (bit-exact on NCCL and gloo alike)."""
        return [x.view(torch.bfloat16) for x in self.gather(t.contiguous().view(torch.int32))]

    def gather_object(self, obj: Any) -> list[Any]:
        if not self.dist_on:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.dist_on:
            import torch.distributed as dist

            dist.barrier()


def init_world(args: argparse.Namespace) -> World:
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but no CUDA GPU (use --device cpu --backend gloo)")
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    launched = "MASTER_ADDR" in os.environ and "RANK" in os.environ
    if size > 1 and not launched:
        raise SystemExit("WORLD_SIZE > 1 needs torchrun (or MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)")
    if launched:
        import torch.distributed as dist

        kw = {"device_id": device} if args.backend == "nccl" else {}
        # a rank that dies leaves the others in a collective: give up after 5 minutes (torchrun also ends them)
        dist.init_process_group(backend=args.backend, rank=rank, world_size=size,
                                timeout=datetime.timedelta(minutes=5), **kw)
    return World(rank, size, device, launched)


# ---------------------------------------------------------------- timing (CUDA)


class Timer:
    """Median µs of a call captured in a CUDA graph, each replay after a write of 4x the L2 (cold L2)."""

    def __init__(self, device: torch.device, iters: int) -> None:
        self.device, self.iters = device, iters
        l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 * 2**20)
        self.flush = torch.empty(max(4 * l2, 256 * 2**20), dtype=torch.uint8, device=device)

    def graph_us(self, fn: Callable[[], Any]) -> float:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize(self.device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for s, e in zip(starts, ends):
            self.flush.zero_()  # ~70 µs of memset: also the host's head start to enqueue the replay
            s.record()
            graph.replay()
            e.record()
        torch.cuda.synchronize(self.device)
        del graph
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def time_merge(world: World, lat: torch.Tensor, lse: torch.Tensor, cnt: torch.Tensor,
               iters: int) -> tuple[float, float]:
    """(median µs of all_gather(latent, LSE, counts) + merge_dcp, median µs of the all_gathers alone) on this rank,
    each iteration after a barrier (so the ranks start together)."""
    from vllm_kimi_dsa.dcp import merge_dcp

    def once() -> None:
        merge_dcp(world.gather_latent(lat), world.gather(lse), world.gather(cnt))

    for _ in range(3):
        once()
    torch.cuda.synchronize(world.device)
    total, gather = [], []
    for _ in range(iters):
        world.barrier()
        torch.cuda.synchronize(world.device)
        s, m, e = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        s.record()
        lats, lses, cnts = world.gather_latent(lat), world.gather(lse), world.gather(cnt)
        m.record()
        merge_dcp(lats, lses, cnts)
        e.record()
        torch.cuda.synchronize(world.device)
        total.append(s.elapsed_time(e) * 1e3)
        gather.append(s.elapsed_time(m) * 1e3)
    return statistics.median(total), statistics.median(gather)


# ---------------------------------------------------------------- checks (rank 0)


def selected_bounds(query: torch.Tensor, kv_rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                    fmt: str, softmax_scale: float, output_scale: float, wgmma: bool,
                    chunk: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(vmax (rows,): max |v| * output_scale over the latent of the rows each row selected; logit (rows,): the
    fp8-wgmma logit error bound steps * 2^-14 * scale * max_j sum_d |q_d k_jd| over all 576 dims, 0 when not wgmma)."""
    from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM, dequantize_rows

    rows, width = slots.shape
    vmax = torch.zeros(rows, device=query.device)
    logit = torch.zeros(rows, device=query.device)
    pos = torch.arange(width, device=slots.device)
    steps = -(-HEAD_DIM // 32)
    for s in range(0, rows, chunk):
        e = min(rows, s + chunk)
        valid = (pos < counts[s:e].long().unsqueeze(1)) & (slots[s:e] >= 0)
        ids = torch.where(valid, slots[s:e].long(), torch.zeros_like(slots[s:e], dtype=torch.long))
        kv = dequantize_rows(kv_rows[ids.reshape(-1)], fmt).view(e - s, width, HEAD_DIM)
        kv = kv.masked_fill(~valid.unsqueeze(-1), 0.0).abs()  # placeholders (row 0) may decode to NaN: replaced
        vmax[s:e] = kv[..., :LATENT_DIM].amax(dim=(1, 2)) * abs(output_scale)
        if wgmma:
            dot = torch.einsum("rhd,rkd->rhk", query[s:e].float().abs(), kv).amax(dim=(1, 2))
            logit[s:e] = dot * abs(softmax_scale) * steps * WGMMA_STEP_REL
    return vmax, logit


def uses_fp8_wgmma(kernel: Any, fmt: str, device: torch.device) -> bool:
    """Whether the "triton" DecodeKernel runs Q.K on Hopper's fp8 wgmma (tests/conftest.fp8_wgmma_dims): fp8, on a
    GPU, a config planning.qk_on_fp8_wgmma names (tiles of >= 64 heads or transposed dots); the Gluon nvfp4 kernel runs its RoPE
    dims there (bounded here over all dims: looser, still valid)."""
    if device.type != "cuda":
        return False  # the interpreter sums in fp32
    if getattr(getattr(kernel, "gluon", None), "nvfp4", False):
        return True
    config = getattr(kernel, "config", None)
    from vllm_kimi_dsa.planning import qk_on_fp8_wgmma

    return config is not None and qk_on_fp8_wgmma(config, fmt)


def hand_weights(lses: Sequence[torch.Tensor], counts: Sequence[torch.Tensor]) -> torch.Tensor:
    """(D, rows, H) float64 merge weights e^{l_r} / sum_{live r'} e^{l_r'}, 0 where count_r is 0 (written out here,
    never merge_dcp)."""
    live = torch.stack([c > 0 for c in counts]).unsqueeze(-1)
    lv = torch.where(live, torch.stack([s.double() for s in lses]), -math.inf)
    m = lv.max(dim=0).values
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    ex = torch.exp(lv - m)
    return ex / ex.sum(dim=0).clamp_min(1e-300)


def _live(counts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([c > 0 for c in counts]).view(len(counts), -1, 1, 1)


def merge_uniform(latents, lses, counts):
    """BROKEN: live ranks averaged with equal weights."""
    live = _live(counts)
    o = torch.stack([x.double() for x in latents])
    return (torch.where(live, o, 0.0).sum(dim=0) / live.sum(dim=0).clamp_min(1)).float(), None


def merge_keeping_count0(latents, lses, counts):
    """BROKEN: the LSE-weighted merge over every rank, counts ignored."""
    lv = torch.stack([s.double() for s in lses])
    lse = torch.logsumexp(lv, dim=0)
    w = torch.exp(lv - torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)).unsqueeze(-1)
    return (w * torch.stack([x.double() for x in latents])).sum(dim=0).float(), None


def merge_base2(latents, lses, counts):
    """BROKEN: natural-log LSEs weighed as base 2."""
    live = _live(counts)
    p = torch.where(live[..., 0], torch.pow(2.0, torch.stack([s.double() for s in lses])), 0.0)
    w = (p / p.sum(dim=0).clamp_min(1e-300)).unsqueeze(-1)
    return torch.where(live, w * torch.stack([x.double() for x in latents]), 0.0).sum(dim=0).float(), None


BROKEN_MERGES = {"uniform weights": merge_uniform, "count-0 ranks kept": merge_keeping_count0,
                 "base-2 weights on natural LSEs": merge_base2}


def poison_count0(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], counts: Sequence[torch.Tensor],
                  seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copies with finite garbage in every (rank, row) of count 0 (trtllm-gen's kind: an LSE 1..10 above every live
    LSE of the row, a large latent), so keeping such a rank would dominate the merge."""
    g = torch.Generator().manual_seed(seed)
    live_max = torch.stack([torch.where(torch.isfinite(s), s, -1e30) for s in lses]).amax(dim=0)
    live_max = torch.where(live_max < -1e29, torch.zeros_like(live_max), live_max)
    po, pl = [], []
    for o, s, c in zip(outs, lses, counts):
        o, s = o.clone(), s.clone()
        dead = (c == 0).nonzero().flatten().tolist()
        for row in dead:
            s[row] = live_max[row] + (1 + 9 * torch.rand(s.shape[1], generator=g)).to(s.device)
            o[row] = (torch.randn(o[row].shape, generator=g) * 50).to(o.dtype).to(o.device)
        po.append(o)
        pl.append(s)
    return po, pl


def worst(err: torch.Tensor, bound: torch.Tensor) -> dict[str, float]:
    """max |err|, and at the element where err / bound is largest: the bound and the ratio (NaN err: ratio inf)."""
    err, bound = err.double(), bound.double()
    ratio = torch.where(bound > 0, err / bound, torch.where(err > 0, math.inf, 0.0))
    ratio = torch.where(torch.isnan(err), math.inf, ratio)
    i = int(ratio.reshape(-1).argmax()) if ratio.numel() else 0
    return {
        "max_err": float(err.nan_to_num(math.inf).max()) if err.numel() else 0.0,
        "bound": float(bound.reshape(-1)[i]) if bound.numel() else 0.0,
        "err_over_bound": float(ratio.reshape(-1)[i]) if ratio.numel() else 0.0,
    }


def check_rows(rows: int, world_size: int, outs: list[torch.Tensor], lses: list[torch.Tensor],
               counts: list[torch.Tensor], merged: torch.Tensor, merged_lse: torch.Tensor, tp: Any,
               tp_out: torch.Tensor, tp_lse: torch.Tensor, tp_counts: torch.Tensor, tp_slots: torch.Tensor,
               query: torch.Tensor, tp_cache: torch.Tensor, fmt: str, device: torch.device,
               seed: int) -> dict[str, Any]:
    """Every check of one (interleave, rows) on rank 0; returns the JSON fields."""
    from vllm_kimi_dsa.dcp import merge_dcp
    from vllm_kimi_dsa.reference import reference_decode

    core = tp.core
    kv_rows, _ = core.rows(tp_cache, BLOCK)
    wgmma = uses_fp8_wgmma(core.decode_kernel(rows), fmt, device)
    vmax, logit = selected_bounds(query, kv_rows, tp_slots, tp_counts, fmt, core.softmax_scale, core.output_scale,
                                  wgmma)
    bf16, kern = bf16_rel(device), P_ERR + partial_err()
    checks: dict[str, bool] = {}

    # the split: every valid id counted on exactly one rank; row 0 nobody's, row 1 rank 0's only
    checks["counts_partition_tp"] = bool(torch.equal(sum(c.long() for c in counts), tp_counts.long()))
    checks["row0_count0_everywhere"] = int(tp_counts[0]) == 0 and all(int(c[0]) == 0 for c in counts)
    checks["row1_rank0_only"] = int(counts[0][1]) > 0 and all(int(c[1]) == 0 for c in counts[1:])

    # one GPU against the float32 reference (chunks of rows: the reference gathers rows x K x 576 floats)
    ref_out = torch.empty_like(tp_out, dtype=torch.float32)
    ref_lse = torch.empty_like(tp_lse)
    for s in range(0, rows, 32):
        e = min(rows, s + 32)
        ref_out[s:e], ref_lse[s:e] = reference_decode(
            query[s:e], kv_rows, tp_slots[s:e], tp_counts[s:e], fmt=fmt,
            softmax_scale=core.softmax_scale, output_scale=core.output_scale)
    v, lg = vmax.view(-1, 1, 1), logit.view(-1, 1, 1)
    tp_ref_bound = (bf16 + SUM_REL) * ref_out.abs() + (kern + 2 * lg) * v
    tp_ref = worst((tp_out.float() - ref_out).abs(), tp_ref_bound)
    empty = torch.isneginf(ref_lse)
    tp_lse_err = (tp_lse - ref_lse).abs().masked_fill(empty, 0.0)
    tp_ref_lse = worst(tp_lse_err, (LSE_ATOL + logit.view(-1, 1)).expand_as(tp_lse))
    checks["tp_matches_reference"] = tp_ref["err_over_bound"] <= 1
    checks["tp_lse_matches_reference"] = (tp_ref_lse["err_over_bound"] <= 1
                                         and bool(torch.equal(torch.isneginf(tp_lse), empty)))

    # the merge against one GPU
    w = hand_weights(lses, counts)
    mix = sum(wr.unsqueeze(-1) * torch.where(wr.unsqueeze(-1) > 0, o.double(), 0.0).abs()
              for wr, o in zip(w, outs)).float()
    lse_tol = 2 * LSE_ATOL
    bound = (bf16 + SUM_REL + 2 * lse_tol) * mix + bf16 * tp_out.float().abs() + (2 * kern + 6 * lg) * v
    finite = torch.isfinite(tp_lse)
    lse_bound = lse_tol + 2 * logit.view(-1, 1) + 1e-5 * tp_lse.abs().nan_to_num(posinf=0, neginf=0)

    def out_ok(out: torch.Tensor) -> bool:
        return bool(((out.float() - tp_out.float()).abs() <= bound).all())  # NaN compares False

    def lse_ok(lse: torch.Tensor) -> bool:
        return (bool(torch.equal(finite, torch.isfinite(lse))) and bool(torch.isneginf(lse[~finite]).all())
                and bool(((lse - tp_lse).abs()[finite] <= lse_bound[finite]).all()))

    main = worst((merged.float() - tp_out.float()).abs(), bound)
    lse_w = worst((merged_lse - tp_lse).abs().masked_fill(~finite, 0.0), lse_bound)
    checks["merged_matches_tp"] = out_ok(merged)
    checks["merged_lse_matches_tp"] = lse_ok(merged_lse)
    no_rank = tp_counts == 0
    checks["merged_count0_rows_zero"] = (bool((merged[no_rank] == 0).all())
                                         and bool(torch.isneginf(merged_lse[no_rank]).all()))
    checks["tp_count0_rows_zero"] = (bool((tp_out[no_rank] == 0).all())
                                     and bool(torch.isneginf(tp_lse[no_rank]).all()))
    mref = worst((merged.float() - ref_out).abs(), bound + tp_ref_bound)
    checks["merged_matches_reference"] = mref["err_over_bound"] <= 1

    # count-0 ranks carrying garbage are dropped by their count; the bound rejects broken merges
    p_outs, p_lses = poison_count0(outs, lses, counts, seed)
    p_out, p_lse = merge_dcp(p_outs, p_lses, counts)
    checks["poisoned_count0_dropped"] = out_ok(p_out) and lse_ok(p_lse)
    rejects = None
    if world_size > 1:
        rejects = {name: not out_ok(broken(p_outs, p_lses, counts)[0]) for name, broken in BROKEN_MERGES.items()}
        checks["bound_rejects_broken_merges"] = all(rejects.values())

    return {
        **main,
        "lse_max_err": lse_w["max_err"],
        "lse_err_over_bound": lse_w["err_over_bound"],
        "tp_vs_reference": {**tp_ref, "lse_err_over_bound": tp_ref_lse["err_over_bound"]},
        "merged_vs_reference": mref,
        "fp8_wgmma_bound": wgmma,
        "logit_bound_max": float(logit.max()),
        "vmax_max": float(vmax.max()),
        "broken_merges_rejected": rejects,
        "checks": checks,
    }


# ---------------------------------------------------------------- main


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return vals


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for bench_dcp.json (rank 0 writes it)")
    ap.add_argument("--interleave", type=_ints, default=(1, 64), help="DCP interleave sizes (default 1,64)")
    ap.add_argument("--rows", type=_ints, default=(5, 20, 80, 160, 320), help="decode rows (batch sizes), >= 2")
    ap.add_argument("--heads", type=int, default=128, help="query heads a rank decodes (after DCP's head gather)")
    ap.add_argument("--width", type=int, default=2048, help="top-k width K (a multiple of 128)")
    ap.add_argument("--fmt", default="fp8", choices=("fp8", "nvfp4_ds_mla"), help="KV cache format (default fp8)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: nccl on cuda, gloo on cpu")
    ap.add_argument("--iters", type=int, default=50, help="timed iterations per measurement (CUDA)")
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.backend == "nccl" and args.device != "cuda":
        ap.error("--backend nccl needs --device cuda")
    if min(args.rows) < 2:
        ap.error("--rows must be >= 2 (row 0 is all -1, row 1 rank 0's only)")
    if args.width < 128 or args.width % 128:
        ap.error("--width must be a positive multiple of 128")
    args.rows = tuple(sorted(set(args.rows)))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Set before the process group and before Triton / the package's kernels are imported. No NVLink multicast
    # (NCCL, PyTorch's symmetric memory, NVSHMEM): the device machines require it off.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    world = init_world(args)
    # torchrun sets OMP_NUM_THREADS=1; the global data is drawn on the CPU, so share the host's cores out
    if world.size > 1 or "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, min(16, (os.cpu_count() or 1) // world.size)))
    try:
        rc = run(args, world)
        # Every rank past its last collective before any tears the group down: rank 0 (which hosts the store)
        # finishing first and destroying its gloo group while rank 1 was still talking to it aborted rank 0 at exit
        # once in a full CPU run ("terminate called without an active exception", rc -6, its report already written).
        world.barrier()
        return rc
    finally:
        if world.dist_on:
            import torch.distributed as dist

            dist.destroy_process_group()


def log(world: World, *a: Any) -> None:
    if world.rank == 0:
        print(*a, flush=True)


def run(args: argparse.Namespace, world: World) -> int:
    import triton

    from vllm_kimi_dsa.dcp import merge_dcp

    D, r, dev = world.size, world.rank, world.device
    cuda = dev.type == "cuda"
    max_rows = max(args.rows)
    log(world, f"bench_dcp: D={D} backend={args.backend} device={dev.type} H={args.heads} K={args.width} "
               f"fmt={args.fmt} rows={list(args.rows)} interleave={list(args.interleave)}")

    data = make_global(max_rows, args.heads, args.width, args.fmt, D, args.interleave, args.seed)
    digests = world.gather_object(data.digest())
    same_data = len(set(digests)) == 1
    topk = data.topk.to(dev)
    query = data.query.to(dev)

    step = layer_step(dev, args.heads, args.width, args.fmt, max_rows, D, r)
    tp_step = tp_rc = tp_dec = None
    if r == 0:  # the single-GPU result: the same step with D = 1 on the whole cache
        tp_step = step if D == 1 else layer_step(dev, args.heads, args.width, args.fmt, max_rows, 1, 0)
        tp_rc = rank_cache(data, args.fmt, 1, 0, 1, args.seed, dev)
        tp_dec = RankDecode(tp_step, tp_rc, topk, query, 1, 0, 1, max_rows)
    timer = Timer(dev, args.iters) if cuda else None
    tp_us: dict[int, float] = {}

    results = []
    for interleave in args.interleave:
        rc = rank_cache(data, args.fmt, D, r, interleave, args.seed, dev)
        dec = RankDecode(step, rc, topk, query, D, r, interleave, max_rows)
        for rows in args.rows:
            out, lse, cnt = dec.run(rows)
            # each rank: a row it saw none of gives latent exactly 0 and LSE -inf; the rows it saw, finite values
            dead = cnt == 0
            local_ok = (bool((out[dead] == 0).all()) and bool(torch.isneginf(lse[dead]).all())
                        and bool(torch.isfinite(out[~dead]).all()) and bool(torch.isfinite(lse[~dead]).all()))
            outs, lses, counts = world.gather_latent(out), world.gather(lse), world.gather(cnt)
            merged, merged_lse = merge_dcp(outs, lses, counts)

            decode_us = convert_us = merge_us = gather_us = None
            if cuda:
                dec.convert(rows)
                decode_us = timer.graph_us(functools.partial(dec.decode, rows))
                convert_us = timer.graph_us(functools.partial(dec.convert, rows))
                merge_us, gather_us = time_merge(world, out, lse, cnt, args.iters)
            per_rank = world.gather_object({
                "decode_us": decode_us, "convert_us": convert_us, "merge_us": merge_us, "gather_us": gather_us,
                "local_ok": local_ok, "tokens": int(cnt.long().sum()), "count0_rows": int(dead.sum()),
                "kernel": kernel_name(step, rows),
            })

            if r == 0:
                tp_out, tp_lse, tp_counts = tp_dec.run(rows)
                tp_slots = tp_dec.slots[:rows].clone()
                if cuda and rows not in tp_us:
                    tp_us[rows] = timer.graph_us(functools.partial(tp_dec.decode, rows))
                res = check_rows(rows, D, outs, lses, counts, merged, merged_lse, tp_step, tp_out, tp_lse,
                                 tp_counts, tp_slots, query[:rows], tp_rc.cache, args.fmt, dev,
                                 args.seed + rows + interleave)
                res["checks"]["same_global_data_on_every_rank"] = same_data
                res["checks"]["ranks_count0_rows_zero_and_live_rows_finite"] = all(p["local_ok"] for p in per_rank)
                ok = all(res["checks"].values())
                results.append({
                    "rows": rows,
                    "interleave": interleave,
                    "decode_us_per_rank": [p["decode_us"] for p in per_rank],
                    "convert_us_per_rank": [p["convert_us"] for p in per_rank],
                    "tp_decode_us": tp_us.get(rows),
                    "merge_us": max(p["merge_us"] for p in per_rank) if cuda else None,
                    "merge_us_per_rank": [p["merge_us"] for p in per_rank],
                    "gather_us_per_rank": [p["gather_us"] for p in per_rank],
                    "tokens_per_rank": [p["tokens"] for p in per_rank],
                    "tp_tokens": int(tp_counts.long().sum()),
                    "count0_rows_per_rank": [p["count0_rows"] for p in per_rank],
                    "kernel_per_rank": [p["kernel"] for p in per_rank],
                    **res,
                    "ok": ok,
                })
                bad = [k for k, v in res["checks"].items() if not v]
                log(world, f"  I={interleave:<3d} rows={rows:<4d} err/bound={res['err_over_bound']:.3f} "
                           f"{'ok' if ok else 'FAILED: ' + ', '.join(bad)}")

    gpus = world.gather_object(torch.cuda.get_device_name(dev) if cuda else "cpu")
    if r != 0:
        return 0
    meta = {
        "gpus": gpus,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "D": D,
        "interleave": list(args.interleave),
        "H": args.heads,
        "K": args.width,
        "rows": list(args.rows),
        "fmt": args.fmt,
        "backend": args.backend,
        "device": dev.type,
        "block_size": BLOCK,
        "context": data.context,
        "seed": args.seed,
        "scales": {"q_scale": Q_SCALE, "k_scale": K_SCALE, "softmax_scale": step.core.softmax_scale,
                   "output_scale": step.core.output_scale},
        "data_digest": digests[0],
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
        "argv": sys.argv[1:],
        "timing": ("decode/convert: one LayerStep / convert_topk call in a CUDA graph, replayed --iters times, each "
                   "after a write of 4x L2 (cold L2), median CUDA-event µs; tp_decode_us: the same for D=1 on the "
                   "whole cache (rank 0); merge: all_gather(latent as int32, LSE, counts) + merge_dcp, eager, "
                   "after a barrier, median per rank; merge_us = the slowest rank's"),
        "tolerance": ("|merged - tp| <= (bf16 + 2^-12 + 4 LSE_ATOL) sum_r w_r|o_r| + bf16 |tp| + "
                      "(2 (P_ERR + PARTIAL_ERR) + 6 logit) vmax; vmax = max|v| of the rows each row selected * "
                      "output_scale (see the script's Tolerances comment)"),
        "iters": args.iters,
    }
    report = {"meta": meta, "ok": bool(results) and all(x["ok"] for x in results), "results": results}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_dcp.json").write_text(json.dumps(report, indent=1))
    print(table(report), flush=True)
    print(f"wrote {out_dir / 'bench_dcp.json'}: {'ok' if report['ok'] else 'FAILED'}", flush=True)
    return 0 if report["ok"] else 1


def kernel_name(step: Any, rows: int) -> str:
    k = step.core.decode_kernel(rows)
    gluon = getattr(k, "gluon", None)
    return f"{k.name}" + (f"/{type(gluon).__name__}" if gluon is not None else "")


def _fmt_us(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def table(report: dict[str, Any]) -> str:
    m = report["meta"]
    lines = [f"DCP {m['D']} x {m['gpus'][0]}, H={m['H']}, K={m['K']}, {m['fmt']}  (µs; decode per rank, cold L2)",
             (f"{'I':>3} {'rows':>5} {'decode/rank':>22} {'1-GPU':>8} {'convert/rank':>18} {'merge':>8} "
              f"{'gather':>8} {'err/bound':>9}  ok")]
    for x in report["results"]:
        dec = "/".join(_fmt_us(v) for v in x["decode_us_per_rank"])
        conv = "/".join(_fmt_us(v) for v in x["convert_us_per_rank"])
        g = [v for v in x["gather_us_per_rank"] if v is not None]
        lines.append(f"{x['interleave']:>3} {x['rows']:>5} {dec:>22} {_fmt_us(x['tp_decode_us']):>8} {conv:>18} "
                     f"{_fmt_us(x['merge_us']):>8} {_fmt_us(max(g) if g else None):>8} "
                     f"{x['err_over_bound']:>9.3f}  {'ok' if x['ok'] else 'FAILED'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
