"""The plain Triton split-KV decode kernel (`tl`): FP8 and nvfp4_ds_mla rows, any head count, any CUDA GPU and the
interpreter; its launch over a planning.Config and the one-off sparse_mla_decode.

Many heads: 64-head tiles (fp8 Q.K on wgmma, fp16 P.V). Few heads, fp8: the transposed form (tokens on the MMA's M,
heads on N). nvfp4 rows are dequantized to exact fp16 in the kernel. Splits are even (the lead plans are the Gluon
kernels'), or a scheduled launch's pieces (launch_scheduled: the device planner's items).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_kimi_dsa.formats import CacheFormat, normalize_format
from vllm_kimi_dsa.host_math import cdiv
from vllm_kimi_dsa.kernels.common import LN2, LOG2E, Workspace, check_inputs, combine, one_off_scratch, scratch
from vllm_kimi_dsa.kernels.common.combine import combine_scheduled
from vllm_kimi_dsa.kernels.common.schedule import ScheduleTables, plan_schedule, tables
from vllm_kimi_dsa.kernels.common.workspace import make_workspace, num_sms, scheduled_scratch
from vllm_kimi_dsa.planning.schedule import schedule_shape
from vllm_kimi_dsa.kernels.common.nvfp4 import E2M1_PAIRS_PTX
from vllm_kimi_dsa.planning import Config, default_config


@triton.jit
def _epilogue(
    acc, m_i, l_i, offs_h, mask_h, row, part,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    stride_o_row, stride_o_head, stride_lse_row, H, out_scale,
    BLOCK_H: tl.constexpr, D: tl.constexpr,
):
    """Normalize and store the output and LSE (part < 0: the row is whole), or the piece's partial and base-2 LSE
    at entries part * H + head."""
    has = l_i > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    o = acc * inv[:, None]
    offs_d = tl.arange(0, D)
    if part < 0:
        o_ptrs = out_ptr + row * stride_o_row + offs_h[:, None] * stride_o_head + offs_d[None, :]
        tl.store(o_ptrs, (o * out_scale).to(tl.bfloat16), mask=mask_h[:, None])
        tl.store(lse_ptr + row * stride_lse_row + offs_h, lse2 * LN2, mask=mask_h)
    else:
        base = part * H
        p_ptrs = part_out_ptr + (base + offs_h[:, None]).to(tl.int64) * D + offs_d[None, :]
        tl.store(p_ptrs, o.to(part_out_ptr.dtype.element_ty), mask=mask_h[:, None])
        tl.store(part_lse_ptr + base + offs_h, lse2, mask=mask_h)


@triton.jit
def _work(items_ptr, counts_ptr, num_splits, K, BLOCK_N: tl.constexpr, SCHEDULED: tl.constexpr):
    """(row, start, end, part) of this program: SCHEDULED, item program_id(1) of the planner's table (grid (head
    blocks, items); row -1: idle); else split program_id(1) of row program_id(2) (grid (head blocks, splits, rows)),
    even pieces. part: the piece's partial entry row (entries part * H + head), -1 where the row is whole."""
    if SCHEDULED:  # item program_id(1): (row, start, end, part)
        item = items_ptr + tl.program_id(1) * 4
        row, start, end, part = tl.load(item), tl.load(item + 1), tl.load(item + 2), tl.load(item + 3)
    else:
        split = tl.program_id(1)
        row = tl.program_id(2)
        start, end = _split_range(counts_ptr, row, split, num_splits, K, BLOCK_N)
        part = tl.where(num_splits > 1, row * num_splits + split, -1)
    return row, start, end, part


@triton.jit
def _split_range(counts_ptr, row, split, num_splits, K, BLOCK_N: tl.constexpr):
    """[start, end) tokens of this split of the row: `num_splits` even pieces of its tiles."""
    count = tl.load(counts_ptr + row)
    count = tl.minimum(tl.maximum(count, 0), K)
    tiles = tl.cdiv(count, BLOCK_N)
    per = tl.cdiv(tiles, num_splits)
    t0 = split * per
    t1 = t0 + per
    start = t0 * BLOCK_N
    end = tl.minimum(t1 * BLOCK_N, count)
    return start, end


@triton.jit
def _e2m1_to_f16(nib):
    """4-bit E2M1 codes (int32, bit 3 the sign) -> exact float16 values 0, .5, 1, 1.5, 2, 3, 4, 6.

    Placing the 3 magnitude bits at fp16 bits 9..11 gives value * 2**-14 for every code (code 1 lands
    on the subnormal 2**-15, the rest on normals), so one multiply by 2**14 restores it exactly.
    """
    bits = ((nib & 7) << 9) | ((nib & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True) * 16384.0


@triton.jit
def _slots(s_base, n0, end, BLOCK_N: tl.constexpr):
    """Flat rows of tile [n0, n0 + BLOCK_N) of a split ending at `end` (-1 past it)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(s_base + offs_n, mask=offs_n < end, other=-1)


@triton.jit
def _gather_fp8(kv_ptr, slot, stride_kv):
    """The rows `slot` (-1: none) of an fp8 cache: latent (BLOCK_N, 512) and RoPE (BLOCK_N, 64) e4m3."""
    valid = slot >= 0
    k_base = kv_ptr + tl.where(valid, slot, 0).to(tl.int64) * stride_kv
    k_lat = tl.load(k_base[:, None] + tl.arange(0, 512)[None, :], mask=valid[:, None], other=0.0)
    k_rope = tl.load(k_base[:, None] + 512 + tl.arange(0, 64)[None, :], mask=valid[:, None], other=0.0)
    return k_lat, k_rope, valid


@triton.jit
def _gather_nvfp4(kv_ptr, slot, stride_kv):
    """The rows `slot` of an nvfp4_ds_mla cache, raw: packed (BLOCK_N, 32, 8), scales (BLOCK_N, 32), RoPE bytes.

    Packed byte 8 s + b holds latent 16 s + 2 b (low nibble) and 16 s + 2 b + 1; block s's scale is at byte
    320 + 8 * (s & 3) + (s >> 2). The (rows, 32 blocks, 8 bytes) shape keeps 8-byte vector loads and makes the
    scale a broadcast over the last axis: 32 one-byte loads a row instead of one per packed byte.
    """
    valid = slot >= 0
    k_base = kv_ptr + tl.where(valid, slot, 0).to(tl.int64) * stride_kv
    offs_s = tl.arange(0, 32)
    packed = tl.load(
        k_base[:, None, None] + (offs_s * 8)[None, :, None] + tl.arange(0, 8)[None, None, :],
        mask=valid[:, None, None], other=0,
    )
    sc = tl.load(k_base[:, None] + (320 + 8 * (offs_s & 3) + (offs_s >> 2))[None, :], mask=valid[:, None], other=0)
    rope = tl.load(k_base[:, None] + 256 + tl.arange(0, 64)[None, :], mask=valid[:, None], other=0)
    return packed, sc, rope, valid


@triton.jit
def _e2m1_pairs_ptx(packed):
    """Packed e2m1 bytes -> (low nibble, high nibble) as exact float16, 4 bytes per PRMT table lookup (SM80+).

    The 8 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 are float16 values whose low byte is 0, so their high bytes
    (00 38 3C 3E 40 42 44 46) form an 8-entry byte table that one `prmt` indexes with 4 magnitude nibbles;
    the sign bits are moved beside them with a second `prmt`, and a third spreads the bytes into fp16 halves.
    ~2 instructions a value where the bit arithmetic of `_e2m1_to_f16` takes ~15 (SASS).
    `_e2m1_to_f16` is the twin the interpreter runs; tests compare both on all 256 bytes.
    """
    return tl.inline_asm_elementwise(
        asm=E2M1_PAIRS_PTX,
        constraints="=r,=r,=r,=r,r",
        args=[packed],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _dequant_nvfp4(packed, sc, BLOCK_N: tl.constexpr, PTX: tl.constexpr):
    """Raw nvfp4 latent -> (even dims, odd dims) as (BLOCK_N, 256) float16, exact.

    e2m1 * e4m3 has at most 6 significant bits within 2**-10..2688: exact in fp16.
    """
    if PTX:
        lo, hi = _e2m1_pairs_ptx(packed)
    else:
        pk = packed.to(tl.int32)
        lo = _e2m1_to_f16(pk & 15)
        hi = _e2m1_to_f16(pk >> 4)
    scale = sc.to(tl.float8e4nv, bitcast=True).to(tl.float16)[:, :, None]
    return tl.reshape(lo * scale, [BLOCK_N, 256]), tl.reshape(hi * scale, [BLOCK_N, 256])


@triton.jit
def _qk(q, k, acc, SWAP: tl.constexpr):
    """acc + q k^T (BLOCK_H, BLOCK_N), or with SWAP its transpose k q^T (BLOCK_N, BLOCK_H); fp8 operands sum on
    Hopper's wgmma without accumulator promotion (within the tests' fp8-wgmma bound)."""
    if SWAP:
        a = k
        b = tl.trans(q)
    else:
        a = q
        b = tl.trans(k)
    return tl.dot(a, b, acc)


@triton.jit
def _pv(p, v, acc, SWAP: tl.constexpr):
    """acc + p v (BLOCK_H, D), or with SWAP (p being P^T) its transpose v^T p (D, BLOCK_H)."""
    if SWAP:
        return tl.dot(tl.trans(v), p, acc)
    else:
        return tl.dot(p, v, acc)


@triton.jit
def _per_head(x, SWAP: tl.constexpr):
    """A (BLOCK_H,) vector broadcast along the tokens / dims axis of the (transposed) tiles."""
    if SWAP:
        return x[None, :]
    else:
        return x[:, None]


@triton.jit
def _per_token(x, SWAP: tl.constexpr):
    """A (BLOCK_N,) vector broadcast along the heads axis of the (transposed) logits."""
    if SWAP:
        return x[:, None]
    else:
        return x[None, :]


@triton.jit
def _softmax(s, valid, m_i, l_i, acc, acc2, qk_scale, SWAP: tl.constexpr, LAZY: tl.constexpr):
    """Online-softmax update for one tile of logits: (P as fp16, m, l, acc, acc2 rescaled).

    s is (BLOCK_H, BLOCK_N), or (BLOCK_N, BLOCK_H) with SWAP; the accumulators likewise. LAZY keeps a stale
    running max until a row's max grows by more than 2**8 (P <= 256 stays exact enough in fp16 and finite),
    so the (BLOCK_H, 512) accumulator is rescaled on a few tiles only; the result is the same up to rounding.
    """
    AXIS: tl.constexpr = 0 if SWAP else 1
    s = tl.where(_per_token(valid, SWAP), s * qk_scale, float("-inf"))
    m_tile = tl.max(s, AXIS)
    if LAZY:
        grow = tl.max((m_tile > m_i + 8.0).to(tl.int32), 0)
        if grow > 0:
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
            acc = acc * _per_head(alpha, SWAP)
            acc2 = acc2 * _per_head(alpha, SWAP)
            l_i = l_i * alpha
            m_i = m_new
        p = tl.exp2(s - _per_head(tl.where(m_i == float("-inf"), 0.0, m_i), SWAP))
        l_i = l_i + tl.sum(p, AXIS)
    else:
        m_new = tl.maximum(m_i, m_tile)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - _per_head(m_use, SWAP))
        l_i = l_i * alpha + tl.sum(p, AXIS)
        acc = acc * _per_head(alpha, SWAP)
        acc2 = acc2 * _per_head(alpha, SWAP)
        m_i = m_new
    # P rounds to fp16 (2**-11 relative); V (e4m3 or e2m1 * e4m3) is exact in fp16. fp16, not bf16: one
    # tensor-core rate, and Triton's interpreter mis-multiplies bf16 dots.
    return p.to(tl.float16), m_i, l_i, acc, acc2


@triton.jit
def _acc_zeros(COLS: tl.constexpr, BLOCK_H: tl.constexpr, SWAP: tl.constexpr):
    if SWAP:
        return tl.zeros([COLS, BLOCK_H], tl.float32)
    else:
        return tl.zeros([BLOCK_H, COLS], tl.float32)


@triton.jit
def _head_major(acc, SWAP: tl.constexpr):
    if SWAP:
        return tl.trans(acc)
    else:
        return acc


@triton.jit(do_not_specialize=["lead_tiles"])
def decode_kernel(
    q_ptr, kv_ptr, slots_ptr, counts_ptr, items_ptr,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    H, K, num_splits, lead_tiles,
    stride_q_row, stride_q_head, stride_kv, stride_s_row,
    stride_o_row, stride_o_head, stride_lse_row,
    qk_scale, out_scale,
    NVFP4: tl.constexpr,  # False: 576 e4m3 bytes a row; True: 352-byte nvfp4_ds_mla rows
    BLOCK_H: tl.constexpr,  # heads a program (padded heads are masked)
    BLOCK_N: tl.constexpr,  # KV rows a tile
    PREFETCH: tl.constexpr,  # nvfp4: gather tile i + 1 into registers while tile i computes (slots 2 ahead)
    LAZY: tl.constexpr,  # rescale the accumulator only when the running max grows by > 2**8
    SWAP: tl.constexpr,  # transposed dots: S^T = K Q^T, O^T = V^T P^T
    PTX: tl.constexpr,  # inline PTX where it helps (a GPU); False: the pure-Triton twin (the interpreter)
    SCHEDULED: tl.constexpr = False,  # grid (head blocks, items): each program's piece from items_ptr's table
):
    """One (head block, KV split, row): online softmax over the split's tiles of gathered rows.

    SWAP puts the tile's tokens and the 512 latent dims on the MMA's M and the heads on its N: Hopper's wgmma
    needs M = 64 a warpgroup but takes N = 16, where the head-major form pads 12 or 16 heads to an M of 64 or
    falls back to mma.sync.
    """
    hb = tl.program_id(0)
    # lead_tiles: the decode kernels' common arguments; this one splits evenly
    row, start, end, part = _work(items_ptr, counts_ptr, num_splits, K, BLOCK_N, SCHEDULED)
    if row < 0:  # an idle item of a scheduled launch
        return
    D: tl.constexpr = 512

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    q_base = q_ptr + row.to(tl.int64) * stride_q_row + offs_h[:, None] * stride_q_head
    q_rope = tl.load(q_base + D + tl.arange(0, 64)[None, :], mask=mask_h[:, None], other=0.0)
    s_base = slots_ptr + row.to(tl.int64) * stride_s_row
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)

    if NVFP4:
        # the latent dot runs on even and odd dims apart, so the packed bytes need no interleave
        offs_c = tl.arange(0, 256)
        q_lo = tl.load(q_base + 2 * offs_c[None, :], mask=mask_h[:, None], other=0.0).to(tl.float16)
        q_hi = tl.load(q_base + 2 * offs_c[None, :] + 1, mask=mask_h[:, None], other=0.0).to(tl.float16)
        q_rope = q_rope.to(tl.float16)
        acc = _acc_zeros(256, BLOCK_H, SWAP)
        acc2 = _acc_zeros(256, BLOCK_H, SWAP)
        slot_n = _slots(s_base, start, end, BLOCK_N)
        if PREFETCH:
            packed, sc, rope, valid = _gather_nvfp4(kv_ptr, slot_n, stride_kv)
            slot_n = _slots(s_base, start + BLOCK_N, end, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            if PREFETCH:
                slot_nn = _slots(s_base, n0 + 2 * BLOCK_N, end, BLOCK_N)
                packed_n, sc_n, rope_n, valid_n = _gather_nvfp4(kv_ptr, slot_n, stride_kv)
            else:
                packed, sc, rope, valid = _gather_nvfp4(kv_ptr, _slots(s_base, n0, end, BLOCK_N), stride_kv)
            lo, hi = _dequant_nvfp4(packed, sc, BLOCK_N, PTX)
            k_rope = rope.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            s = _qk(q_rope, k_rope, _acc_zeros(BLOCK_N, BLOCK_H, SWAP), SWAP)
            s = _qk(q_lo, lo, s, SWAP)
            s = _qk(q_hi, hi, s, SWAP)
            pb, m_i, l_i, acc, acc2 = _softmax(s, valid, m_i, l_i, acc, acc2, qk_scale, SWAP, LAZY)
            acc = _pv(pb, lo, acc, SWAP)
            acc2 = _pv(pb, hi, acc2, SWAP)
            if PREFETCH:
                packed, sc, rope, valid = packed_n, sc_n, rope_n, valid_n
                slot_n = slot_nn
        # (even, odd) pairs -> latent order
        acc = tl.reshape(tl.join(_head_major(acc, SWAP), _head_major(acc2, SWAP)), [BLOCK_H, D])
    else:
        q_lat = tl.load(q_base + tl.arange(0, D)[None, :], mask=mask_h[:, None], other=0.0)
        acc = _acc_zeros(D, BLOCK_H, SWAP)
        acc2 = _acc_zeros(1, BLOCK_H, SWAP)  # a placeholder: _softmax rescales two accumulators
        slot_n = _slots(s_base, start, end, BLOCK_N)
        for n0 in range(start, end, BLOCK_N):
            k_lat, k_rope, valid = _gather_fp8(kv_ptr, _slots(s_base, n0, end, BLOCK_N), stride_kv)
            v = k_lat.to(tl.float16)
            # e4m3 x e4m3 products are exact; Hopper's fp8 wgmma sums them with fewer bits than fp32 (mma.sync, at
            # BLOCK_H 16, sums in fp32)
            s = _qk(q_rope, k_rope, _acc_zeros(BLOCK_N, BLOCK_H, SWAP), SWAP)
            s = _qk(q_lat, k_lat, s, SWAP)
            pb, m_i, l_i, acc, acc2 = _softmax(s, valid, m_i, l_i, acc, acc2, qk_scale, SWAP, LAZY)
            acc = _pv(pb, v, acc, SWAP)
        acc = _head_major(acc, SWAP)

    _epilogue(acc, m_i, l_i, offs_h, mask_h, row, part,
              out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
              stride_o_row, stride_o_head, stride_lse_row, H, out_scale, BLOCK_H, D)


def launch(query, kv_rows, slots, counts, out, lse, fmt, softmax_scale, output_scale, ws: Workspace, cfg: Config,
           splits: int):
    """decode_kernel over (head blocks, splits, rows), then the combine when splits > 1: inputs already checked, no
    allocation, no sync. Returns the compiled kernel handle."""
    rows, heads = query.shape[0], query.shape[1]
    splits, lse_t = scratch(ws, rows, heads, splits, lse)
    compiled = decode_kernel[(cdiv(heads, cfg.block_h), splits, rows)](
        query, kv_rows, slots, counts, counts,  # (items_ptr: unread by an unscheduled launch)
        out, lse_t, ws.part_out, ws.part_lse,
        heads, slots.shape[1], splits, 0,
        query.stride(0), query.stride(1), kv_rows.stride(0), slots.stride(0),
        out.stride(0), out.stride(1), lse_t.stride(0),
        softmax_scale * LOG2E, output_scale,
        NVFP4=fmt != "fp8", BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        PREFETCH=cfg.prefetch, LAZY=cfg.lazy, SWAP=cfg.swap, PTX=query.is_cuda, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    combine(ws, out, lse_t, splits, output_scale)
    return compiled


def launch_scheduled(query, kv_rows, slots, counts, out, lse, fmt, softmax_scale, output_scale, ws: Workspace,
                     cfg: Config, tabs: ScheduleTables):
    """A scheduled launch: the planner (common.schedule) divides this call's tiles from the counts, decode_kernel runs
    its items (grid head blocks x tabs.shape.items; idle items return at once), the combine merges its split rows.
    Inputs already checked, no allocation, no sync. Returns the decode kernel's compiled handle."""
    heads = query.shape[1]
    lse_t = scheduled_scratch(ws, tabs, heads, lse)
    plan_schedule(counts, slots.shape[1], tabs)
    compiled = decode_kernel[(cdiv(heads, cfg.block_h), tabs.shape.items, 1)](
        query, kv_rows, slots, counts, tabs.items,
        out, lse_t, ws.part_out, ws.part_lse,
        heads, slots.shape[1], 1, 0,
        query.stride(0), query.stride(1), kv_rows.stride(0), slots.stride(0),
        out.stride(0), out.stride(1), lse_t.stride(0),
        softmax_scale * LOG2E, output_scale,
        NVFP4=fmt != "fp8", BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        PREFETCH=cfg.prefetch, LAZY=cfg.lazy, SWAP=cfg.swap, PTX=query.is_cuda, SCHEDULED=True,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    combine_scheduled(ws, out, lse_t, tabs, output_scale)
    return compiled


def sparse_mla_decode(
    query: torch.Tensor,
    kv_rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    *,
    fmt: CacheFormat,
    softmax_scale: float,
    output_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    config: Config | None = None,
    splits: int | None = None,
    scheduled: bool = False,
) -> object:
    """Sparse MLA decode over flat rows into `out` (and `lse`) with the plain kernel, as reference_decode defines it.

    query: (rows, H, 576) float8_e4m3fn raw values (q_scale folded into softmax_scale).
    kv_rows: (num_rows, 576) float8_e4m3fn or (num_rows, 352) uint8 nvfp4_ds_mla flat rows.
    slots: (rows, K) int32, valid flat rows first; entries past counts and -1 are ignored.
    counts: (rows,) int32.
    out: (rows, H, 512) bfloat16, written in full; lse: (rows, H) float32 natural log or None.
    workspace: from make_workspace (None allocates one: tests and benchmarks only).
    config / splits: override the fixed table and the split heuristic (benchmarks); splits are even.
    scheduled: a scheduled launch (launch_scheduled: the device planner divides the tiles from the counts; splits
    unused); a given workspace must hold its shape (make_workspace(schedules=...)).
    Count 0 -> out 0, lse -inf. Returns the main kernel's compiled handle (registers, asm).
    """
    fmt = normalize_format(fmt)
    check_inputs(query, kv_rows, slots, counts, fmt, out, lse)
    rows, heads = query.shape[0], query.shape[1]
    cfg = config or default_config(heads, fmt)
    if rows == 0:  # nothing to launch (and no workspace to size)
        return None
    if scheduled:
        width = slots.shape[1]
        shape = schedule_shape(rows, width, heads, cfg, num_sms(query.device))
        if workspace is None:
            workspace = make_workspace(query.device, heads=heads, max_rows=rows, widths=(width,), fmt=fmt, config=cfg,
                                       plans={(rows, width): (0, 1)}, schedules=(shape,))
        return launch_scheduled(query, kv_rows, slots, counts, out, lse, fmt, softmax_scale, output_scale, workspace,
                                cfg, tables(workspace.sched, shape))
    workspace, splits = one_off_scratch(query, slots, fmt, cfg, workspace, splits)
    return launch(query, kv_rows, slots, counts, out, lse, fmt, softmax_scale, output_scale, workspace, cfg, splits)


__all__ = ["decode_kernel", "launch", "launch_scheduled", "sparse_mla_decode"]
