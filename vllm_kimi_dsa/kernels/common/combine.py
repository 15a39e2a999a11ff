"""The split combine: merges each row's split partials (base-2 LSE weights) into the output and natural-log LSE.

Every decode kernel writes its partials as combine_kernel reads them (workspace.PARTIAL_DTYPE, entry (row * splits
+ split) * H + head). Up to INLINE_SPLITS splits a row the combine holds every split's dims in its threads at once
(combine_kernel); past that it walks the splits in chunks of CHUNK_SPLITS (combine_chunks_kernel: one pass for the
LSE maximum, one for the weighted sum), so a plan may split a row as far as its tiles go. A scheduled launch's rows
split as its planner decided (combine_scheduled_kernel: the planner's split table, entries (slot + piece) * H + head,
walked SCHEDULED_CHUNK pieces a step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_kimi_dsa.formats import LATENT_DIM
from vllm_kimi_dsa.host_math import next_pow2
from vllm_kimi_dsa.kernels.common.schedule import COMBINE_PROGRAM_ROWS, ScheduleTables
from vllm_kimi_dsa.kernels.common.workspace import Workspace

LOG2E = 1.4426950408889634  # softmax_scale * LOG2E: the kernels' base-2 logits
LN2 = tl.constexpr(0.6931471805599453)  # base-2 LSE * LN2: the natural-log LSE the contract returns
INLINE_SPLITS = 64  # at most this many splits a row: every split's dims in registers at once (combine_kernel)
CHUNK_SPLITS = 32  # past INLINE_SPLITS: splits a step of combine_chunks_kernel's walk
# the scheduled combine's step: a row's pieces vary call to call (1 to the row's tiles), so it always walks them, 8 a
# step (80 registers a thread at 2 warps; holding a 32-piece row's slots at once spilled 184 bytes, Triton 3.6)
SCHEDULED_CHUNK = 8


@triton.jit
def combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    H, num_splits, stride_o_row, stride_o_head, stride_lse_row, out_scale,
    SPLITS: tl.constexpr, D: tl.constexpr,
):
    h = tl.program_id(0)
    row = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS)
    idx = (row * num_splits + offs_s) * H + h
    merge_partials(part_out_ptr, part_lse_ptr, idx, offs_s < num_splits, out_ptr, lse_ptr, row, h,
                    stride_o_row, stride_o_head, stride_lse_row, out_scale, D)


@triton.jit
def merge_partials(part_out_ptr, part_lse_ptr, idx, mask_s, out_ptr, lse_ptr, row, h,
                    stride_o_row, stride_o_head, stride_lse_row, out_scale, D: tl.constexpr):
    """Merge the partials at entries idx (mask_s: which are real) by their base-2 LSEs into out[row, h], lse[row, h]."""
    offs_d = tl.arange(0, D)
    lse2 = tl.load(part_lse_ptr + idx, mask=mask_s, other=float("-inf"))
    m = tl.max(lse2, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse2 - m_use)  # an empty split (lse -inf) weighs 0
    total = tl.sum(w, 0)
    o = tl.load(part_out_ptr + idx.to(tl.int64)[:, None] * D + offs_d[None, :], mask=mask_s[:, None],
                other=0.0).to(tl.float32)
    has = total > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, total, 1.0), 0.0)
    res = tl.sum(o * w[:, None], 0) * (inv * out_scale)
    tl.store(out_ptr + row * stride_o_row + h * stride_o_head + offs_d, res.to(tl.bfloat16))
    lse = tl.where(has, (m_use + tl.log2(tl.where(has, total, 1.0))) * LN2, float("-inf"))
    tl.store(lse_ptr + row * stride_lse_row + h, lse)


@triton.jit
def combine_chunks_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    H, num_splits, stride_o_row, stride_o_head, stride_lse_row, out_scale,
    CHUNK: tl.constexpr, D: tl.constexpr,
):
    """combine_kernel for any number of splits: merge_chunks over the row's num_splits entries."""
    h = tl.program_id(0)
    row = tl.program_id(1)
    merge_chunks(part_out_ptr, part_lse_ptr, row * num_splits * H + h, H, num_splits, out_ptr, lse_ptr, row, h,
                 stride_o_row, stride_o_head, stride_lse_row, out_scale, CHUNK, D)


@triton.jit
def merge_chunks(part_out_ptr, part_lse_ptr, first, step, n, out_ptr, lse_ptr, row, h,
                 stride_o_row, stride_o_head, stride_lse_row, out_scale, CHUNK: tl.constexpr, D: tl.constexpr):
    """merge_partials over the n entries first, first + step, ... : CHUNK splits' dims in registers at a time, two
    passes over the LSEs (their maximum first, so every weight is exp2(lse - max) as in merge_partials)."""
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, D)
    m = tl.full((), float("-inf"), tl.float32)
    for c in range(0, n, CHUNK):
        s = c + offs_c
        lse2 = tl.load(part_lse_ptr + first + s * step, mask=s < n, other=float("-inf"))
        m = tl.maximum(m, tl.max(lse2, 0))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for c in range(0, n, CHUNK):
        s = c + offs_c
        live = s < n
        idx = first + s * step
        lse2 = tl.load(part_lse_ptr + idx, mask=live, other=float("-inf"))
        w = tl.exp2(lse2 - m_use)  # an empty split (lse -inf) weighs 0
        total += tl.sum(w, 0)
        o = tl.load(part_out_ptr + idx.to(tl.int64)[:, None] * D + offs_d[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)
        acc += tl.sum(o * w[:, None], 0)
    has = total > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, total, 1.0), 0.0)
    tl.store(out_ptr + row * stride_o_row + h * stride_o_head + offs_d, (acc * (inv * out_scale)).to(tl.bfloat16))
    lse = tl.where(has, (m_use + tl.log2(tl.where(has, total, 1.0))) * LN2, float("-inf"))
    tl.store(lse_ptr + row * stride_lse_row + h, lse)


@triton.jit
def combine_scheduled_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, splits_ptr, meta_ptr,
    H, stride_o_row, stride_o_head, stride_lse_row, out_scale,
    CHUNK: tl.constexpr, D: tl.constexpr,
):
    """The combine of a scheduled launch: program (h, j) merges head h of split rows j, j + programs, ... of the
    planner's split table (row, first partial slot, pieces; its count in meta[1]); the pieces' entries are
    (slot + s) * H + h, walked CHUNK at a time (merge_chunks)."""
    h = tl.program_id(0)
    n_split = tl.load(meta_ptr + 1)
    for j in range(tl.program_id(1), n_split, tl.num_programs(1)):
        row = tl.load(splits_ptr + j * 4)
        first = tl.load(splits_ptr + j * 4 + 1)
        n = tl.load(splits_ptr + j * 4 + 2)
        merge_chunks(part_out_ptr, part_lse_ptr, first * H + h, H, n, out_ptr, lse_ptr, row, h,
                     stride_o_row, stride_o_head, stride_lse_row, out_scale, CHUNK, D)


def combine(ws: Workspace, out: torch.Tensor, lse_t: torch.Tensor, splits: int, output_scale: float) -> None:
    """Merge the splits' partials (when there are several) into out and lse_t: all at once up to INLINE_SPLITS,
    in chunks of CHUNK_SPLITS past it."""
    if splits > INLINE_SPLITS:
        rows, heads = out.shape[0], out.shape[1]
        combine_chunks_kernel[(heads, rows)](
            ws.part_out, ws.part_lse, out, lse_t,
            heads, splits, out.stride(0), out.stride(1), lse_t.stride(0), output_scale,
            CHUNK=CHUNK_SPLITS, D=LATENT_DIM,
            num_warps=combine_warps(ws),
        )
    elif splits > 1:
        rows, heads = out.shape[0], out.shape[1]
        combine_kernel[(heads, rows)](
            ws.part_out, ws.part_lse, out, lse_t,
            heads, splits, out.stride(0), out.stride(1), lse_t.stride(0), output_scale,
            SPLITS=next_pow2(splits), D=LATENT_DIM,
            num_warps=combine_warps(ws),
        )


def combine_warps(ws: Workspace) -> int:
    """combine_kernel's warps: as many as 16-byte loads cover one split's 512 dims (2 for fp16 partials), so that
    each thread holds the same dims of every split and the sum down the splits stays in the thread (more warps put
    the splits across warps: a shared-memory reduction, 2-4x the time)."""
    return LATENT_DIM * ws.part_out.element_size() // (32 * 16)


def combine_scheduled(ws: Workspace, out: torch.Tensor, lse_t: torch.Tensor, tabs: ScheduleTables,
                      output_scale: float) -> None:
    """Merge a scheduled launch's split rows (the planner's split table) into out and lse_t; nothing to launch when
    its shape can split no row."""
    shape = tabs.shape
    if shape.split_rows < 1:
        return
    heads = out.shape[1]
    combine_scheduled_kernel[(heads, min(shape.split_rows, COMBINE_PROGRAM_ROWS))](
        ws.part_out, ws.part_lse, out, lse_t, tabs.splits, tabs.meta,
        heads, out.stride(0), out.stride(1), lse_t.stride(0), output_scale,
        CHUNK=SCHEDULED_CHUNK, D=LATENT_DIM, num_warps=combine_warps(ws),
    )
