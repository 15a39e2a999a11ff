"""The project's own Triton sparse MLA decode for Hopper ("triton"): FP8 and nvfp4_ds_mla caches.

Split-KV main kernel (FP8 tensor-core Q.K, fp16 P.V) plus an LSE-weighted combine; scratch made at construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl

from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM, CacheFormat, cache_dtype, normalize_format, row_bytes
from vllm_kimi_dsa.kernels.base import DecodeSetup

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class Config:
    """Tile shape and launch shape of the main kernel (no autotuning: graph capture must not tune)."""

    block_h: int  # heads a program (the MMA M dim; padded heads are masked)
    block_n: int  # KV rows a tile
    num_warps: int
    num_stages: int
    ctas_per_sm: int  # occupancy assumed by the split heuristic


def default_config(heads: int, fmt: CacheFormat) -> Config:
    """A fixed config by (heads, fmt), measured on the H200 (benchmarks/NOTES_triton_decode.md)."""
    block_h = min(64, max(16, triton.next_power_of_2(heads)))
    if block_h == 64:
        return Config(block_h=64, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=1)
    if block_h == 32:
        return Config(block_h=32, block_n=32, num_warps=4, num_stages=2, ctas_per_sm=1)
    # BLOCK_N 64 spilled (184 regs fp8) and ran at 17% of copy; 32 runs spill-free at ~24%.
    return Config(block_h=16, block_n=32, num_warps=4, num_stages=2, ctas_per_sm=2)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits so the combine path is exercised on a CPU too


def choose_splits(rows: int, heads: int, width: int, cfg: Config, sms: int) -> int:
    """KV splits per row: minimize (waves x tiles a split + fixed cost) over the chip's slots."""
    head_blocks = triton.cdiv(heads, cfg.block_h)
    tiles = max(1, triton.cdiv(width, cfg.block_n))
    slots_per_wave = sms * cfg.ctas_per_sm
    best, best_cost = 1, float("inf")
    overhead = 1.5  # tiles' worth: Q load, epilogue, and the combine's extra pass
    for splits in range(1, min(tiles, 64) + 1):
        per = triton.cdiv(tiles, splits)
        used = triton.cdiv(tiles, per)  # splits that get work
        waves = triton.cdiv(rows * head_blocks * used, slots_per_wave)
        cost = waves * (per + overhead) + (0.0 if used == 1 else 0.5)
        if cost < best_cost - 1e-9:
            best, best_cost = used, cost
    return best


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _epilogue(
    acc, m_i, l_i, offs_h, mask_h, row, split, num_splits,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    stride_o_row, stride_o_head, stride_lse_row, H, out_scale,
    BLOCK_H: tl.constexpr, D: tl.constexpr,
):
    offs_d = tl.arange(0, D)
    has = l_i > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    o = acc * inv[:, None]
    if num_splits == 1:
        o_ptrs = out_ptr + row * stride_o_row + offs_h[:, None] * stride_o_head + offs_d[None, :]
        tl.store(o_ptrs, (o * out_scale).to(tl.bfloat16), mask=mask_h[:, None])
        tl.store(lse_ptr + row * stride_lse_row + offs_h, lse2 * 0.6931471805599453, mask=mask_h)
    else:
        base = (row * num_splits + split) * H
        p_ptrs = part_out_ptr + (base + offs_h[:, None]).to(tl.int64) * D + offs_d[None, :]
        tl.store(p_ptrs, o, mask=mask_h[:, None])
        tl.store(part_lse_ptr + base + offs_h, lse2, mask=mask_h)


@triton.jit
def _split_range(counts_ptr, row, split, num_splits, K, BLOCK_N: tl.constexpr):
    count = tl.load(counts_ptr + row)
    count = tl.minimum(tl.maximum(count, 0), K)
    tiles = tl.cdiv(count, BLOCK_N)
    per = tl.cdiv(tiles, num_splits)
    start = split * per * BLOCK_N
    end = tl.minimum(start + per * BLOCK_N, count)
    return start, end


@triton.jit
def _decode_fp8_kernel(
    q_ptr, kv_ptr, slots_ptr, counts_ptr,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    H, K, num_splits,
    stride_q_row, stride_q_head, stride_kv, stride_s_row,
    stride_o_row, stride_o_head, stride_lse_row,
    qk_scale, out_scale,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    hb = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)
    D: tl.constexpr = 512
    R: tl.constexpr = 64

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_d = tl.arange(0, D)
    offs_r = tl.arange(0, R)
    q_base = q_ptr + row.to(tl.int64) * stride_q_row + offs_h[:, None] * stride_q_head
    q_lat = tl.load(q_base + offs_d[None, :], mask=mask_h[:, None], other=0.0)
    q_rope = tl.load(q_base + D + offs_r[None, :], mask=mask_h[:, None], other=0.0)

    start, end = _split_range(counts_ptr, row, split, num_splits, K, BLOCK_N)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    s_base = slots_ptr + row.to(tl.int64) * stride_s_row
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(s_base + offs_n, mask=offs_n < end, other=-1)
        valid = slot >= 0
        k_base = kv_ptr + tl.where(valid, slot, 0).to(tl.int64) * stride_kv
        k_lat = tl.load(k_base[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        k_rope = tl.load(k_base[:, None] + D + offs_r[None, :], mask=valid[:, None], other=0.0)
        # e4m3 x e4m3 products are exact; Hopper's fp8 wgmma accumulates with ~14 bits unless
        # promoted to fp32 every 32 (measured 1e-3 relative LSE error without it).
        s = tl.dot(q_rope, tl.trans(k_rope), max_num_imprecise_acc=32)
        s = tl.dot(q_lat, tl.trans(k_lat), s, max_num_imprecise_acc=32)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # V = the latent part, e4m3 -> fp16 exact; P rounds to fp16 (2**-11 relative; fp16 and
        # bf16 run at one tensor-core rate, and Triton's interpreter mis-multiplies bf16 dots).
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(tl.float16), k_lat.to(tl.float16), acc)
        m_i = m_new

    _epilogue(acc, m_i, l_i, offs_h, mask_h, row, split, num_splits,
              out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
              stride_o_row, stride_o_head, stride_lse_row, H, out_scale, BLOCK_H, D)


@triton.jit
def _e2m1(nib):
    """4-bit E2M1 codes (int32) -> float32 values: 0, .5, 1, 1.5, 2, 3, 4, 6 with bit 3 the sign."""
    code = nib & 7
    # code >= 2: exponent (code >> 1) and one mantissa bit placed into fp32 bits, biased to 2**(e-1).
    bits = ((code << 22) + (126 << 23)).to(tl.uint32)
    big = bits.to(tl.float32, bitcast=True)
    mag = tl.where(code < 2, code.to(tl.float32) * 0.5, big)
    return tl.where((nib & 8) != 0, -mag, mag)


@triton.jit
def _decode_nvfp4_kernel(
    q_ptr, kv_ptr, slots_ptr, counts_ptr,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    H, K, num_splits,
    stride_q_row, stride_q_head, stride_kv, stride_s_row,
    stride_o_row, stride_o_head, stride_lse_row,
    qk_scale, out_scale,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    hb = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)
    D: tl.constexpr = 512
    HALF: tl.constexpr = 256  # packed latent bytes: byte c holds latent 2c (low nibble) and 2c+1
    R: tl.constexpr = 64

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_c = tl.arange(0, HALF)
    offs_r = tl.arange(0, R)
    q_base = q_ptr + row.to(tl.int64) * stride_q_row + offs_h[:, None] * stride_q_head
    # The latent dot runs on even and odd dims separately so the packed bytes need no interleave.
    q_lo = tl.load(q_base + 2 * offs_c[None, :], mask=mask_h[:, None], other=0.0).to(tl.float16)
    q_hi = tl.load(q_base + 2 * offs_c[None, :] + 1, mask=mask_h[:, None], other=0.0).to(tl.float16)
    q_rope = tl.load(q_base + D + offs_r[None, :], mask=mask_h[:, None], other=0.0)

    blk = offs_c >> 3  # the scale block of packed byte c (16 latent values = 8 bytes)
    scale_off = 320 + 8 * (blk & 3) + (blk >> 2)

    start, end = _split_range(counts_ptr, row, split, num_splits, K, BLOCK_N)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_lo = tl.zeros([BLOCK_H, HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_H, HALF], tl.float32)
    s_base = slots_ptr + row.to(tl.int64) * stride_s_row
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(s_base + offs_n, mask=offs_n < end, other=-1)
        valid = slot >= 0
        k_base = kv_ptr + tl.where(valid, slot, 0).to(tl.int64) * stride_kv
        packed = tl.load(k_base[:, None] + offs_c[None, :], mask=valid[:, None], other=0)
        rope = tl.load(k_base[:, None] + HALF + offs_r[None, :], mask=valid[:, None], other=0)
        sc = tl.load(k_base[:, None] + scale_off[None, :], mask=valid[:, None], other=0)
        scale = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        pk = packed.to(tl.int32)
        # e2m1 * e4m3 has at most 6 significant bits, within 2**-10..2688: exact in fp16.
        lo = (_e2m1(pk & 15) * scale).to(tl.float16)
        hi = (_e2m1(pk >> 4) * scale).to(tl.float16)
        k_rope = rope.to(tl.float8e4nv, bitcast=True)
        s = tl.dot(q_rope, tl.trans(k_rope), max_num_imprecise_acc=32)
        s = tl.dot(q_lo, tl.trans(lo), s)
        s = tl.dot(q_hi, tl.trans(hi), s)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pb = p.to(tl.float16)
        acc_lo = tl.dot(pb, lo, acc_lo * alpha[:, None])
        acc_hi = tl.dot(pb, hi, acc_hi * alpha[:, None])
        m_i = m_new

    acc = tl.reshape(tl.join(acc_lo, acc_hi), [BLOCK_H, D])
    _epilogue(acc, m_i, l_i, offs_h, mask_h, row, split, num_splits,
              out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
              stride_o_row, stride_o_head, stride_lse_row, H, out_scale, BLOCK_H, D)


@triton.jit
def _combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    H, num_splits, stride_o_row, stride_o_head, stride_lse_row, out_scale,
    SPLITS: tl.constexpr, D: tl.constexpr,
):
    h = tl.program_id(0)
    row = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS)
    mask_s = offs_s < num_splits
    offs_d = tl.arange(0, D)
    idx = (row * num_splits + offs_s) * H + h
    lse2 = tl.load(part_lse_ptr + idx, mask=mask_s, other=float("-inf"))
    m = tl.max(lse2, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse2 - m_use)  # an empty split (lse -inf) weighs 0
    total = tl.sum(w, 0)
    o = tl.load(part_out_ptr + idx.to(tl.int64)[:, None] * D + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    has = total > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, total, 1.0), 0.0)
    res = tl.sum(o * w[:, None], 0) * (inv * out_scale)
    tl.store(out_ptr + row * stride_o_row + h * stride_o_head + offs_d, res.to(tl.bfloat16))
    lse = tl.where(has, (m_use + tl.log2(tl.where(has, total, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + row * stride_lse_row + h, lse)


# ----------------------------------------------------------------------------- workspace


@dataclass
class Workspace:
    """Split-KV scratch: part_out (capacity*512,) fp32, part_lse (capacity,) fp32, a dummy lse (rows*H,)."""

    part_out: torch.Tensor
    part_lse: torch.Tensor
    dummy_lse: torch.Tensor
    capacity: int  # rows * splits * heads entries the scratch holds
    max_rows: int
    heads: int


def make_workspace(
    device: torch.device | str,
    *,
    heads: int,
    max_rows: int,
    widths: tuple[int, ...] | list[int] = (2048,),
    fmt: CacheFormat = "fp8",
    config: Config | None = None,
) -> Workspace:
    """Scratch for every call with rows <= max_rows, these heads and any of `widths`."""
    device = torch.device(device)
    if heads < 1:
        raise ValueError(f"heads must be >= 1, got {heads}")
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    cfg = config or default_config(heads, normalize_format(fmt))
    sms = num_sms(device)
    need = 1
    for w in widths:
        for r in range(1, max_rows + 1):
            s = choose_splits(r, heads, w, cfg, sms)
            if s > 1:
                need = max(need, r * s * heads)
    return Workspace(
        part_out=torch.empty(need * LATENT_DIM, dtype=torch.float32, device=device),
        part_lse=torch.empty(need, dtype=torch.float32, device=device),
        dummy_lse=torch.empty(max_rows * heads, dtype=torch.float32, device=device),
        capacity=need,
        max_rows=max_rows,
        heads=heads,
    )


# ----------------------------------------------------------------------------- launch


def _check_inputs(query, kv_rows, slots, counts, fmt, out, lse) -> None:
    if query.dtype != torch.float8_e4m3fn:
        raise TypeError(f"query must be float8_e4m3fn, got {query.dtype}")
    if query.dim() != 3 or query.shape[-1] != HEAD_DIM or query.stride(-1) != 1:
        raise ValueError(f"query must be (rows, H, {HEAD_DIM}) with unit last stride, got {tuple(query.shape)}")
    rows, heads = query.shape[0], query.shape[1]
    if kv_rows.dtype != cache_dtype(fmt):
        raise TypeError(f"kv_rows must be {cache_dtype(fmt)} for {fmt}, got {kv_rows.dtype}")
    if kv_rows.dim() != 2 or kv_rows.shape[1] != row_bytes(fmt) or kv_rows.stride(1) != 1:
        raise ValueError(f"kv_rows must be (num_rows, {row_bytes(fmt)}) with unit last stride, got {tuple(kv_rows.shape)}")
    if slots.dtype != torch.int32 or slots.dim() != 2 or slots.shape[0] != rows or slots.stride(1) != 1:
        raise ValueError(f"slots must be (rows={rows}, K) int32 with unit last stride, got {tuple(slots.shape)} {slots.dtype}")
    if counts.dtype != torch.int32 or counts.shape != (rows,) or not counts.is_contiguous():
        raise ValueError(f"counts must be contiguous ({rows},) int32, got {tuple(counts.shape)} {counts.dtype}")
    if out.dtype != torch.bfloat16 or out.shape != (rows, heads, LATENT_DIM) or out.stride(-1) != 1:
        raise ValueError(f"out must be ({rows}, {heads}, {LATENT_DIM}) bf16 with unit last stride, got {tuple(out.shape)} {out.dtype}")
    if lse is not None and (lse.dtype != torch.float32 or lse.shape != (rows, heads) or lse.stride(-1) != 1):
        raise ValueError(f"lse must be ({rows}, {heads}) float32 with unit last stride, got {tuple(lse.shape)} {lse.dtype}")


def _launch(query, kv_rows, slots, counts, out, lse, fmt, softmax_scale, output_scale, ws: Workspace, cfg: Config, splits: int):
    rows, heads = query.shape[0], query.shape[1]
    width = slots.shape[1]
    if rows > ws.max_rows or heads != ws.heads:
        raise ValueError(f"workspace was made for rows <= {ws.max_rows}, heads {ws.heads}; got rows {rows}, heads {heads}")
    if splits > 1 and rows * splits * heads > ws.capacity:
        splits = max(1, ws.capacity // (rows * heads))
    lse_t = lse if lse is not None else ws.dummy_lse[: rows * heads].view(rows, heads)
    kernel = _decode_fp8_kernel if fmt == "fp8" else _decode_nvfp4_kernel
    grid = (triton.cdiv(heads, cfg.block_h), splits, rows)
    compiled = kernel[grid](
        query, kv_rows, slots, counts,
        out, lse_t, ws.part_out, ws.part_lse,
        heads, width, splits,
        query.stride(0), query.stride(1), kv_rows.stride(0), slots.stride(0),
        out.stride(0), out.stride(1), lse_t.stride(0),
        softmax_scale * LOG2E, output_scale,
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _combine_kernel[(heads, rows)](
            ws.part_out, ws.part_lse, out, lse_t,
            heads, splits, out.stride(0), out.stride(1), lse_t.stride(0), output_scale,
            SPLITS=triton.next_power_of_2(splits), D=LATENT_DIM,
            num_warps=4,
        )
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
) -> object:
    """Sparse MLA decode over flat rows into `out` (and `lse`), as reference_decode defines it.

    query: (rows, H, 576) float8_e4m3fn raw values (q_scale folded into softmax_scale).
    kv_rows: (num_rows, 576) float8_e4m3fn or (num_rows, 352) uint8 nvfp4_ds_mla flat rows.
    slots: (rows, K) int32, valid flat rows first; entries past counts and -1 are ignored.
    counts: (rows,) int32.
    out: (rows, H, 512) bfloat16, written in full; lse: (rows, H) float32 natural log or None.
    workspace: from make_workspace (None allocates one: tests and benchmarks only).
    config / splits: override the fixed table and the split heuristic (benchmarks).
    Count 0 -> out 0, lse -inf. Returns the main kernel's compiled handle (registers, asm).
    """
    fmt = normalize_format(fmt)
    _check_inputs(query, kv_rows, slots, counts, fmt, out, lse)
    rows, heads = query.shape[0], query.shape[1]
    cfg = config or default_config(heads, fmt)
    if workspace is None:
        workspace = make_workspace(query.device, heads=heads, max_rows=rows, widths=(slots.shape[1],), fmt=fmt, config=cfg)
    if splits is None:
        splits = choose_splits(rows, heads, slots.shape[1], cfg, num_sms(query.device))
    if rows == 0:
        return None
    return _launch(query, kv_rows, slots, counts, out, lse, fmt, softmax_scale, output_scale, workspace, cfg, splits)


class TritonDecode:
    """DecodeKernel "triton": fixed config by (heads, fmt), splits by (rows, K), scratch made here."""

    name: ClassVar[str] = "triton"

    def __init__(self, setup: DecodeSetup) -> None:
        self.setup = setup
        self.fmt = normalize_format(setup.fmt)
        if setup.heads < 1 or setup.heads > 128:
            raise ValueError(f"heads must be in 1..128 for the triton kernel, got {setup.heads}")
        bad = [w for w in setup.widths if w < 128 or w % 128]
        if bad or not setup.widths:
            raise ValueError(f"widths must be non-empty multiples of 128, got {setup.widths}")
        self.config = default_config(setup.heads, self.fmt)
        sms = num_sms(torch.device(setup.device))
        self.workspace = make_workspace(
            setup.device, heads=setup.heads, max_rows=setup.max_rows, widths=setup.widths, fmt=self.fmt, config=self.config
        )
        self._splits = {
            (r, w): choose_splits(r, setup.heads, w, self.config, sms)
            for r in range(1, setup.max_rows + 1)
            for w in setup.widths
        }

    def __call__(
        self,
        query: torch.Tensor,
        kv_rows: torch.Tensor,
        slots: torch.Tensor,
        counts: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        *,
        block_size: int,
        rows_per_block_stride: int,
    ) -> None:
        _check_inputs(query, kv_rows, slots, counts, self.fmt, out, lse)
        rows, heads = query.shape[0], query.shape[1]
        if heads != self.setup.heads:
            raise ValueError(f"query has {heads} heads, the kernel was set up for {self.setup.heads}")
        key = (rows, slots.shape[1])
        if key not in self._splits:
            raise ValueError(
                f"rows={rows}, width={slots.shape[1]} not planned (max_rows {self.setup.max_rows}, widths {self.setup.widths})"
            )
        if rows == 0:
            return
        _launch(
            query, kv_rows, slots, counts, out, lse, self.fmt,
            self.setup.softmax_scale, self.setup.output_scale, self.workspace, self.config, self._splits[key],
        )


__all__ = ["Config", "TritonDecode", "Workspace", "choose_splits", "default_config", "make_workspace", "sparse_mla_decode"]
