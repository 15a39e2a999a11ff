"""The split combine: merges each row's split partials (base-2 LSE weights) into the output and natural-log LSE.

Every decode kernel writes its partials as combine_kernel reads them (workspace.PARTIAL_DTYPE, entry (row * splits
+ split) * H + head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_kimi_dsa.formats import LATENT_DIM
from vllm_kimi_dsa.host_math import next_pow2
from vllm_kimi_dsa.kernels.common.workspace import Workspace

LOG2E = 1.4426950408889634  # softmax_scale * LOG2E: the kernels' base-2 logits
LN2 = tl.constexpr(0.6931471805599453)  # base-2 LSE * LN2: the natural-log LSE the contract returns


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


def combine(ws: Workspace, out: torch.Tensor, lse_t: torch.Tensor, splits: int, output_scale: float) -> None:
    """Merge the splits' partials (when there are several) into out and lse_t."""
    if splits > 1:
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
