"""The project's own Triton sparse MLA decode for Hopper ("triton"): FP8 and nvfp4_ds_mla caches, any head count.

Split-KV main kernel plus an LSE-weighted combine; configs fixed per (heads, format) from H200 sweeps; plans
(choose_plan, choose_lead) and scratch made at construction. A split launch cuts each row into even pieces, or (a
lead plan) into a first piece of lead_tiles tiles, dispatched first, and even pieces of the rest. Many heads:
64-head tiles (fp8 Q.K on wgmma, fp16 P.V). Few heads, fp8: the transposed kernel (tokens on the MMA's M, heads on
N). nvfp4 rows are dequantized to exact fp16 in the kernel.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import triton
import triton.language as tl

from vllm_kimi_dsa import envs
from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM, CacheFormat, cache_dtype, normalize_format, row_bytes
from vllm_kimi_dsa.host_math import cdiv, next_pow2
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
    prefetch: bool = False  # gather the next tile into registers while this one computes
    lazy: bool = False  # rescale the accumulator only when the running max grows by > 2**8
    swap: bool = False  # transposed dots (tokens and dims as the MMA's M, heads as N): for few heads
    split_tiles: float = 0.0  # split heuristic: tiles' worth a CTA's partial costs (its write + the combine's read)
    # a tile's time at this config's occupancy, in tiles of the same kernel run one CTA an SM: what plan_cost weighs a
    # plan's model cost by to choose between one kernel's occupancies (gluon_few_heads.TWO_CTA_TILE_COST)
    tile_cost: float = 1.0
    # one-launch plans may split each row unevenly (choose_lead): the first piece of every row lead tiles, dispatched
    # first, the rest in smaller pieces on the SMs the first pieces leave idle. For the Gluon kernels, where it was
    # measured (NOTES v21); this file's kernel computes it too (its tests) but its configs keep it off.
    lead_split: bool = False
    # ... and takes one only when the model costs it this fraction below every even plan (the note above _lead_makespan)
    lead_min_gain: float = 0.05


def default_config(heads: int, fmt: CacheFormat) -> Config:
    """A fixed config by (heads, fmt), from the H200 sweeps of benchmarks/NOTES_triton_decode.md (rounds 1-5).

    >= 64 heads: 64-head tiles on wgmma (fp8 Q.K without promotion: 10-13% faster than promoting every 32,
    within the tests' fp8-wgmma bound). <= 32 heads: fp8 runs the transposed kernel (1.5x the head-major
    one at 12 heads); nvfp4 16-head blocks of the head-major one with register prefetch and lazy rescaling.
    """
    fmt = normalize_format(fmt)
    if heads > 32:
        return Config(block_h=64, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=1)
    if fmt == "fp8":
        if heads > 16:  # round 4: 360 µs at 320 rows, vs 364 for 16-head blocks x 2 and 375 for a 64-head tile
            return Config(block_h=32, block_n=64, num_warps=8, num_stages=3, ctas_per_sm=1, swap=True)
        return Config(block_h=16, block_n=64, num_warps=4, num_stages=3, ctas_per_sm=2, swap=True)
    # nvfp4, <= 32 heads: 16-head blocks (at 32 heads two of them: 932 vs 1026 µs for one 32-head tile, round 5)
    return Config(block_h=16, block_n=32, num_warps=4, num_stages=1, ctas_per_sm=2, prefetch=True, lazy=True)


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits so the combine path is exercised on a CPU too


_OVERHEAD = 1.5  # tiles' worth a CTA costs beyond its tiles: Q load, epilogue, the combine's extra pass
_LAUNCH_GAP = 1.0  # tiles' worth a second launch costs: its start and the first launch's tail


def _split_cost(rows: int, head_blocks: int, tiles: int, splits: int, cfg: Config, slots_per_wave: int) -> tuple[float, int]:
    """(cost in tiles' worth, splits that get work) of one launch over `rows` rows, each split `splits` ways."""
    per = cdiv(tiles, splits)
    used = cdiv(tiles, per)  # splits that get work
    waves = cdiv(rows * head_blocks * used, slots_per_wave)
    split = used > 1  # a split CTA also writes a partial the combine reads back
    return waves * (per + _OVERHEAD + split * cfg.split_tiles) + split * 0.5, used


# Plans are pure functions of small integers and a frozen Config; every layer's kernel object asks for the same ones
# (and choose_plan asks _best_splits again for each wave count), so they are worked out once a process.
@functools.lru_cache(maxsize=1 << 16)
def _best_splits(rows: int, head_blocks: int, tiles: int, cfg: Config, slots_per_wave: int) -> tuple[int, float]:
    best, best_cost = 1, float("inf")
    for splits in range(1, min(tiles, 64) + 1):
        cost, used = _split_cost(rows, head_blocks, tiles, splits, cfg, slots_per_wave)
        if cost < best_cost - 1e-9:
            best, best_cost = used, cost
    return best, best_cost


# Config.lead_min_gain: a lead plan is taken only when the model costs it this much below the best even plan. On the
# H200 the model overstated its gains at few heads (H = 16, two CTAs an SM: 8-12% modelled, 4.5-6% measured at
# 140-180 rows; at 200 rows 4% modelled, 3% slower measured): 5% there. At 128 heads it understated them at every
# measured size (34-48 rows: 2-12% modelled, 5-9% measured; 50-56 rows: a loss modelled, 0-2% gain measured), so the
# 64-head configs take any modelled gain (gluon_decode.gluon_config; NOTES v21).


def _lead_makespan(busy: int, free: int, big: float, small: float, pieces: int) -> float:
    """Greedy dispatch of a split-major grid: `busy` slots run a first piece of cost `big` from t = 0, `free` slots
    are idle; `pieces` later pieces of cost `small` each start on the earliest-free slot. Returns when the last piece
    (or first piece) ends. The pieces start in order of the times {k small (free times each), big + j small (busy
    times each)}: before `big` only the free slots' (`before` of them), after it each period of `small` holds the
    busy slots' start at big + j small, then the free slots' `phase` later."""
    if pieces == 0:
        return big
    rounds_before = math.ceil(big / small - 1e-9)  # the free slots' starts before big
    before = free * rounds_before
    if pieces <= before:
        last_start = (math.ceil(pieces / free) - 1) * small
    else:
        period, index = divmod(pieces - before - 1, busy + free)
        phase = rounds_before * small - big  # the free slots' start after big + j small, within [0, small)
        last_start = big + period * small + (phase if index >= busy else 0.0)
    return max(big, last_start + small)


@functools.lru_cache(maxsize=1 << 16)
def _best_lead(rows: int, head_blocks: int, tiles: int, cfg: Config, slots_per_wave: int) -> tuple[int, int, float]:
    """(splits, lead, cost in tiles' worth) of the best uneven one-launch plan (lead 0: none). Only a batch whose
    first pieces leave slots idle (rows x head blocks < slots) gains: those slots take the rows' other pieces."""
    units = rows * head_blocks
    best = (1, 0, float("inf"))
    if not cfg.lead_split or units >= slots_per_wave or tiles < 2:
        return best
    piece_cost = _OVERHEAD + cfg.split_tiles  # every piece of a split row writes a partial
    for splits in range(2, min(tiles, 8) + 1):
        for lead in range(1, tiles - splits + 2):
            rest = tiles - lead
            used = cdiv(rest, cdiv(rest, splits - 1))  # pieces after the first that get work
            per = cdiv(rest, used)  # as the kernels split the rest over used pieces
            cost = _lead_makespan(units, slots_per_wave - units, lead + piece_cost, per + piece_cost,
                                  units * used) + 0.5
            if cost < best[2] - 1e-9:
                best = (used + 1, lead, cost)
    return best


def choose_splits(rows: int, heads: int, width: int, cfg: Config, sms: int) -> int:
    """KV splits per row: minimize (waves x tiles a split + fixed cost) over the chip's slots."""
    tiles = max(1, cdiv(width, cfg.block_n))
    return _best_splits(rows, cdiv(heads, cfg.block_h), tiles, cfg, sms * cfg.ctas_per_sm)[0]


def choose_lead(rows: int, heads: int, width: int, cfg: Config, sms: int) -> int:
    """Tiles of each row's first piece in choose_plan's plan (0: its splits are even). Non-zero only for a one-launch
    plan of a cfg.lead_split config whose uneven form the model costs cfg.lead_min_gain below every even plan: e.g. H =
    128 at 40 rows, 64-token tiles of width 2048: 23 tiles, then 9 (80 first pieces on 132 SMs; the other 52 run the
    9-tile pieces in two rounds meanwhile) instead of every row split 3 ways (240 CTAs: two waves)."""
    return _plan_and_cost(rows, heads, width, cfg, sms)[2]


def choose_plan(rows: int, heads: int, width: int, cfg: Config, sms: int) -> tuple[int, int]:
    """(whole_rows, splits): the first whole_rows rows run unsplit in one launch, the others split `splits` ways in
    a second (whole_rows 0: one launch, as choose_splits). With cfg.tail_split, whole_rows may fill k full waves
    of the chip, so that only the last partial wave's rows pay for split partials and the combine: at 80 rows of
    64-head tiles on 132 SMs, 66 whole rows then 14 rows split 4 ways (40 tiles on the critical path, partials for
    28 CTA pairs) instead of every row split twice (48 tiles, partials for all 160)."""
    return _plan_and_cost(rows, heads, width, cfg, sms)[0]


def plan_cost(rows: int, heads: int, width: int, cfg: Config, sms: int) -> float:
    """choose_plan's model cost of its plan in tiles of the kernel run one CTA an SM (cfg.tile_cost a tile): comparable
    across occupancies of one kernel."""
    return _plan_and_cost(rows, heads, width, cfg, sms)[1] * cfg.tile_cost


@functools.lru_cache(maxsize=1 << 16)
def _plan_and_cost(rows: int, heads: int, width: int, cfg: Config, sms: int) -> tuple[tuple[int, int], float, int]:
    """(plan, its model cost, its lead): choose_plan's, plan_cost's (before tile_cost) and choose_lead's answers."""
    head_blocks = cdiv(heads, cfg.block_h)
    tiles = max(1, cdiv(width, cfg.block_n))
    slots_per_wave = sms * cfg.ctas_per_sm
    plan, cost = _even_plan_and_cost(rows, head_blocks, tiles, cfg, slots_per_wave)
    lead_splits, lead, lead_cost = _best_lead(rows, head_blocks, tiles, cfg, slots_per_wave)
    if lead and lead_cost < cost * (1 - cfg.lead_min_gain) - 1e-9:
        return (0, lead_splits), lead_cost, lead
    return plan, cost, 0


def _even_plan_and_cost(rows: int, head_blocks: int, tiles: int, cfg: Config,
                        slots_per_wave: int) -> tuple[tuple[int, int], float]:
    splits, best_cost = _best_splits(rows, head_blocks, tiles, cfg, slots_per_wave)
    best = (0, splits)
    for waves in range(1, rows * head_blocks // slots_per_wave + 1):
        whole = waves * slots_per_wave // head_blocks  # rows whose head blocks fill `waves` waves, unsplit
        if not 0 < whole < rows:
            continue
        whole_cost, _ = _split_cost(whole, head_blocks, tiles, 1, cfg, slots_per_wave)
        tail_splits, tail_cost = _best_splits(rows - whole, head_blocks, tiles, cfg, slots_per_wave)
        cost = whole_cost + tail_cost + _LAUNCH_GAP
        if cost < best_cost - 1e-9:
            best, best_cost = (whole, tail_splits), cost
    return best, best_cost


def plan_table(max_rows: int, heads: int, widths, cfg: Config, sms: int) -> dict[tuple[int, int], tuple[int, int]]:
    """choose_plan for every (rows, width) with 1 <= rows <= max_rows: what a kernel object plans at construction."""
    return {(r, w): choose_plan(r, heads, w, cfg, sms) for r in range(1, max_rows + 1) for w in widths}


def run_plan(launch: Any, plan: tuple[int, int], query, kv_rows, slots, counts, out, lse, *args: Any,
             split_launch: Any = None) -> None:
    """launch(query, kv_rows, slots, counts, out, lse, *args, splits) over a choose_plan plan: the whole rows unsplit,
    then the rest (row slices: views, nothing allocated) through split_launch (default: launch). A one-launch plan
    runs on launch."""
    whole, splits = plan
    if not whole:  # one launch over the batch (no slicing: the common plan, kept cheap on the host)
        launch(query, kv_rows, slots, counts, out, lse, *args, splits)
        return
    launch(query[:whole], kv_rows, slots[:whole], counts[:whole], out[:whole],
           None if lse is None else lse[:whole], *args, 1)
    if whole < query.shape[0]:  # choose_plan keeps whole < rows; a caller's plan may not
        (split_launch or launch)(query[whole:], kv_rows, slots[whole:], counts[whole:], out[whole:],
                                 None if lse is None else lse[whole:], *args, splits)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _epilogue(
    acc, m_i, l_i, offs_h, mask_h, row, split, num_splits,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    stride_o_row, stride_o_head, stride_lse_row, H, out_scale,
    BLOCK_H: tl.constexpr, D: tl.constexpr,
):
    """Normalize and store the output and LSE (or, with several splits, the split's partial and base-2 LSE)."""
    has = l_i > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    o = acc * inv[:, None]
    offs_d = tl.arange(0, D)
    if num_splits == 1:
        o_ptrs = out_ptr + row * stride_o_row + offs_h[:, None] * stride_o_head + offs_d[None, :]
        tl.store(o_ptrs, (o * out_scale).to(tl.bfloat16), mask=mask_h[:, None])
        tl.store(lse_ptr + row * stride_lse_row + offs_h, lse2 * 0.6931471805599453, mask=mask_h)
    else:
        base = (row * num_splits + split) * H
        p_ptrs = part_out_ptr + (base + offs_h[:, None]).to(tl.int64) * D + offs_d[None, :]
        tl.store(p_ptrs, o.to(part_out_ptr.dtype.element_ty), mask=mask_h[:, None])
        tl.store(part_lse_ptr + base + offs_h, lse2, mask=mask_h)


@triton.jit
def _row_split():
    """(row, split) of this program on grid (head blocks, splits, rows)."""
    split = tl.program_id(1)
    row = tl.program_id(2)
    return row, split


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


# 4 packed e2m1 bytes ($4) -> 4 low-nibble fp16 ($0, $1: two fp16x2) and 4 high-nibble fp16 ($2, $3), exact; the
# byte-table decode of _e2m1_pairs_ptx (also gluon_few_heads' nvfp4 converter): pack=4, constraints "=r,=r,=r,=r,r"
E2M1_PAIRS_PTX = tl.constexpr("""
        {
        .reg .b32 m, mh, tlo, thi, l1, l2, se, so, g1, g2;
        and.b32 m, $4, 0x77777777;
        shr.u32 mh, m, 16;
        mov.b32 tlo, 0x3E3C3800;
        mov.b32 thi, 0x46444240;
        prmt.b32 l1, tlo, thi, m;
        prmt.b32 l2, tlo, thi, mh;
        shl.b32 se, $4, 4;
        and.b32 se, se, 0x80808080;
        and.b32 so, $4, 0x80808080;
        prmt.b32 g1, se, so, 0x5140;
        prmt.b32 g2, se, so, 0x7362;
        or.b32 l1, l1, g1;
        or.b32 l2, l2, g2;
        prmt.b32 $0, l1, 0, 0x2404;
        prmt.b32 $1, l2, 0, 0x2404;
        prmt.b32 $2, l1, 0, 0x3414;
        prmt.b32 $3, l2, 0, 0x3414;
        }
        """)


@triton.jit
def _e2m1_pairs_ptx(packed):
    """Packed e2m1 bytes -> (low nibble, high nibble) as exact float16, 4 bytes per PRMT table lookup (SM80+).

    The 8 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 are float16 values whose low byte is 0, so their high bytes
    (00 38 3C 3E 40 42 44 46) form an 8-entry byte table that one `prmt` indexes with 4 magnitude nibbles;
    the sign bits are moved beside them with a second `prmt`, and a third spreads the bytes into fp16 halves.
    ~2 instructions a value where the bit arithmetic of `_e2m1_to_f16` takes ~15 (SASS, benchmarks/NOTES).
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
def _decode_kernel(
    q_ptr, kv_ptr, slots_ptr, counts_ptr,
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
):
    """One (head block, KV split, row): online softmax over the split's tiles of gathered rows.

    SWAP puts the tile's tokens and the 512 latent dims on the MMA's M and the heads on its N: Hopper's wgmma
    needs M = 64 a warpgroup but takes N = 16, where the head-major form pads 12 or 16 heads to an M of 64 or
    falls back to mma.sync.
    """
    hb = tl.program_id(0)
    row, split = _row_split()  # lead_tiles: the decode kernels' common arguments; this one splits evenly
    D: tl.constexpr = 512

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    q_base = q_ptr + row.to(tl.int64) * stride_q_row + offs_h[:, None] * stride_q_head
    q_rope = tl.load(q_base + D + tl.arange(0, 64)[None, :], mask=mask_h[:, None], other=0.0)
    start, end = _split_range(counts_ptr, row, split, num_splits, K, BLOCK_N)
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
    idx = (row * num_splits + offs_s) * H + h
    _merge_partials(part_out_ptr, part_lse_ptr, idx, offs_s < num_splits, out_ptr, lse_ptr, row, h,
                    stride_o_row, stride_o_head, stride_lse_row, out_scale, D)


@triton.jit
def _merge_partials(part_out_ptr, part_lse_ptr, idx, mask_s, out_ptr, lse_ptr, row, h,
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
    lse = tl.where(has, (m_use + tl.log2(tl.where(has, total, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + row * stride_lse_row + h, lse)


# ----------------------------------------------------------------------------- workspace


# The split partials' dtype make_workspace gives by default (TritonDecode's, and the one-off calls'). fp16 halves
# what the splits write and the combine reads: H200, H = 128, µs at 1 / 5 / 8 / 20 / 32 rows, fp32 13.0 / 19.4 / 23.2 /
# 36.7 / 49.4, fp16 12.1 / 17.6 / 20.2 / 34.5 / 46.0 (results/h200-2026-12-04/small-batch, NOTES v19); H = 16 two-CTA
# reg_v 11.6 / 13.1 / 37.2 / 70.1 -> 11.0 / 12.1 / 35.5 / 66.0 at 5 / 8 / 80 / 160 rows. Its rounding, 2^-11 of the
# largest |v| (a partial is a convex mix of the v), is below the bf16 output's 2^-8.
PARTIAL_DTYPE = torch.float16


@dataclass
class Workspace:
    """Split-KV scratch: part_out (capacity*512,) fp32 or fp16 (make_workspace's partial_dtype), part_lse
    (capacity,) fp32, a dummy lse (rows*H,)."""

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
    plans: dict[tuple[int, int], tuple[int, int]] | None = None,
    min_entries: int = 0,
) -> Workspace:
    """Scratch for every call with rows <= max_rows, these heads and any of `widths`; plans: plan_table's for
    them when the caller has it already (else made here); min_entries: at least this many partial entries (a larger
    shared scratch). Partials are PARTIAL_DTYPE (the combine reads them in fp32). A normalized partial is a convex mix of the cache's values before the output scale (applied in the combine): |o|
    <= 448 for e4m3 rows, <= 6 x 448 for nvfp4_ds_mla, inside fp16's range, rounded to 2^-11 of the largest."""
    device = torch.device(device)
    if heads < 1:
        raise ValueError(f"heads must be >= 1, got {heads}")
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if plans is None:
        cfg = config or default_config(heads, normalize_format(fmt))
        plans = plan_table(max_rows, heads, widths, cfg, num_sms(device))
    need = max(1, min_entries)
    for (r, _), (whole, s) in plans.items():
        if s > 1:
            need = max(need, (r - whole) * s * heads)
    return Workspace(
        part_out=torch.empty(need * LATENT_DIM, dtype=PARTIAL_DTYPE, device=device),
        part_lse=torch.empty(need, dtype=torch.float32, device=device),
        dummy_lse=torch.empty(max_rows * heads, dtype=torch.float32, device=device),
        capacity=need,
        max_rows=max_rows,
        heads=heads,
    )


# (device, heads, partial dtype) -> the largest workspace made for it. Every layer's kernel runs on one stream, one
# after another, so all of them can share one scratch, as FlashInfer's plans share one workspace.
_SHARED_WORKSPACES: dict[tuple[str, int, torch.dtype], Workspace] = {}


def shared_workspace(
    device: torch.device | str,
    *,
    heads: int,
    max_rows: int,
    widths: tuple[int, ...] | list[int],
    fmt: CacheFormat,
    config: Config,
    plans: dict[tuple[int, int], tuple[int, int]],
) -> Workspace:
    """make_workspace's scratch, shared by every caller of this device and head count that it is large enough for.

    A caller needing more gets a new, larger one, which later callers then share; callers already holding the
    smaller one keep it (it still fits them).
    """
    device = torch.device(device)
    key = (str(device), int(heads), PARTIAL_DTYPE)
    need = max([1] + [(r - whole) * s * heads for (r, _), (whole, s) in plans.items() if s > 1])
    held = _SHARED_WORKSPACES.get(key)
    if held is not None and held.capacity >= need and held.max_rows >= max_rows:
        return held
    made = make_workspace(device, heads=heads, max_rows=max(max_rows, held.max_rows if held else 0), widths=widths,
                          fmt=fmt, config=config, plans=plans, min_entries=max(need, held.capacity if held else 0))
    _SHARED_WORKSPACES[key] = made
    return made


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


def scratch(ws: Workspace, rows: int, heads: int, splits: int, lse: torch.Tensor | None) -> tuple[int, torch.Tensor]:
    """(splits the workspace holds, the LSE buffer to write: `lse` or the workspace's dummy) for one call."""
    if rows > ws.max_rows or heads != ws.heads:
        raise ValueError(f"workspace was made for rows <= {ws.max_rows}, heads {ws.heads}; got rows {rows}, heads {heads}")
    if splits > 1 and rows * splits * heads > ws.capacity:
        splits = max(1, ws.capacity // (rows * heads))
    return splits, (lse if lse is not None else ws.dummy_lse[: rows * heads].view(rows, heads))


def combine(ws: Workspace, out: torch.Tensor, lse_t: torch.Tensor, splits: int, output_scale: float) -> None:
    """Merge the splits' partials (when there are several) into out and lse_t."""
    if splits > 1:
        rows, heads = out.shape[0], out.shape[1]
        _combine_kernel[(heads, rows)](
            ws.part_out, ws.part_lse, out, lse_t,
            heads, splits, out.stride(0), out.stride(1), lse_t.stride(0), output_scale,
            SPLITS=next_pow2(splits), D=LATENT_DIM,
            num_warps=combine_warps(ws),
        )


def combine_warps(ws: Workspace) -> int:
    """_combine_kernel's warps: as many as 16-byte loads cover one split's 512 dims
    (4 for fp32 partials, 2 for fp16), so that each thread holds the same dims of every split and the sum down the
    splits stays in the thread. With 4 warps on fp16 partials Triton put the splits across 2 warps (a shared-memory
    reduction): 3.6 -> 7.3 µs at 8 rows, 3.9 -> 14.9 at 20 (H = 128, NOTES v19)."""
    return LATENT_DIM * ws.part_out.element_size() // (32 * 16)


def _launch(query, kv_rows, slots, counts, out, lse, fmt, softmax_scale, output_scale, ws: Workspace, cfg: Config,
            splits: int):
    rows, heads = query.shape[0], query.shape[1]
    splits, lse_t = scratch(ws, rows, heads, splits, lse)
    compiled = _decode_kernel[(cdiv(heads, cfg.block_h), splits, rows)](
        query, kv_rows, slots, counts,
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


def one_off_scratch(query: torch.Tensor, slots: torch.Tensor, fmt: str, config: Config,
                    workspace: Workspace | None, splits: int | None) -> tuple[Workspace, int]:
    """The workspace and split count of a single call (tests, benchmarks): `splits` as given, else as choose_splits
    picks; with no workspace, one sized for exactly this call and split count (one launch, every row split alike).
    Not for the hot path (it allocates). A given workspace too small for `splits` lowers them (scratch)."""
    rows, heads, width = query.shape[0], query.shape[1], slots.shape[1]
    if splits is None:
        splits = choose_splits(rows, heads, width, config, num_sms(query.device))
    elif isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits must be an int >= 1 (or None: choose_splits), got {splits!r}")
    if workspace is None:
        workspace = make_workspace(query.device, heads=heads, max_rows=rows, widths=(width,), fmt=fmt,
                                   config=config, plans={(rows, width): (0, splits)})
    return workspace, splits


def check_lead(lead_tiles: int) -> int:
    """A one-off call's lead_tiles (choose_lead's form: 0 for even splits), checked."""
    if isinstance(lead_tiles, bool) or not isinstance(lead_tiles, int) or lead_tiles < 0:
        raise ValueError(f"lead_tiles must be an int >= 0 (0: even splits), got {lead_tiles!r}")
    return lead_tiles


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
    config / splits: override the fixed table and the split heuristic (benchmarks); splits are even.
    Count 0 -> out 0, lse -inf. Returns the main kernel's compiled handle (registers, asm).
    """
    fmt = normalize_format(fmt)
    _check_inputs(query, kv_rows, slots, counts, fmt, out, lse)
    rows, heads = query.shape[0], query.shape[1]
    cfg = config or default_config(heads, fmt)
    if rows == 0:  # nothing to launch (and no workspace to size)
        return None
    workspace, splits = one_off_scratch(query, slots, fmt, cfg, workspace, splits)
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
        # fp8, > 32 heads, on Hopper: the warp-specialized Gluon kernel (gluon_decode.py; 1.1-1.25x this file's
        # kernel on the H200) on the Triton versions it was verified on; VLLM_KIMI_DSA_GLUON=1 asks for it on any
        # version it compiles with, =0 never. Everywhere else (the interpreter, other GPUs, other Triton versions)
        # this file's kernel, which computes the same thing.
        # <= 32 heads on Hopper: gluon_few_heads' kernel (transposed MMAs, a deep gather ring; 16-head blocks), fp8 or
        # nvfp4_ds_mla, under the same rules, with its own verified versions per format and head count.
        # Elsewhere (nvfp4 at > 32 heads, unverified versions) this file's kernel.
        # fp8 few heads from gluon_few_heads.REG_V_MIN_ROWS rows: its reg_v params at one or two CTAs an SM (same
        # tile shape; one workspace sized from all the plans), on the Triton versions reg_v was verified on (or when
        # asked for with VLLM_KIMI_DSA_GLUON=1). fp8 > 32 heads: the seesaw kernel (same tiles and plans), where it was
        # verified, for one-launch plans and the launches of unsplit rows of enough tiles (gluon_seesaw.seesaw_takes).
        self.gluon: Any = None
        self.gluon_large: tuple[Any, ...] = ()
        want = envs.gluon_choice()
        few = setup.heads <= 32
        large, large_launch, seesaw_takes = (), None, None
        if want != "0" and ((self.fmt == "fp8" and setup.heads > 32) or few):
            from vllm_kimi_dsa.kernels import gluon_decode, gluon_few_heads

            if not few:
                from vllm_kimi_dsa.kernels import gluon_seesaw

                params, verified, launch = gluon_decode.GluonParams(), gluon_decode.gluon_verified(), gluon_decode.launch
                if want == "1" or gluon_seesaw.seesaw_verified():
                    large, large_launch = (gluon_seesaw.SeesawParams(),), gluon_seesaw.launch
                    seesaw_takes = gluon_seesaw.seesaw_takes
            elif self.fmt == "fp8":  # every batch on reg_v, one or two CTAs an SM by plan cost
                params = gluon_few_heads.reg_v_params()
                verified = gluon_few_heads.few_heads_verified(self.fmt, setup.heads)
                launch = gluon_few_heads.launch
                large = (gluon_few_heads.reg_v_params(), gluon_few_heads.reg_v_params(ctas_per_sm=2))
            else:
                params = gluon_few_heads.nvfp4_params()
                verified = gluon_few_heads.few_heads_verified(self.fmt, setup.heads)
                launch = gluon_few_heads.launch
            if gluon_decode.gluon_available(setup.device) and (want == "1" or verified):

                self.gluon, self.gluon_large = params, large
                # fp8 few heads: each plan's config is its reg_v params'; this one sizes nothing (plans are given)
                self.config = gluon_few_heads.few_heads_config() if few and self.fmt == "fp8" else params.config()
                self._gluon_launch = launch
        sms = num_sms(torch.device(setup.device))
        self._plans = plan_table(setup.max_rows, setup.heads, setup.widths, self.config, sms)
        # the implementation each launch of each (rows, width) plan runs is bound here, once: the call path does not
        # branch on it. plan_params[rows, width] says which: (the first launch's params, the split rows' launch's);
        # None: this file's kernel. Few heads from large_from rows: the large params (reg_v at one or two CTAs an SM)
        # whose plan the model costs least, for both launches. > 32 heads: a one-launch plan, and the whole rows'
        # launch of a two-launch plan when its rows have enough tiles, on the seesaw kernel
        # (gluon_seesaw.seesaw_takes); a split tail after whole rows on the small params.
        # (params, kernel module launch): None params = this file's kernel; a one-launch plan's lead (choose_lead,
        # where its config allows one) is bound into its launch too. plan_leads[rows, width]: that lead, 0 if none.
        small = (self.gluon, None)
        large = [(p, large_launch) for p in self.gluon_large]
        large_configs = [p.config(setup.heads) for p in self.gluon_large]
        seesaw = large[0] if seesaw_takes is not None and large else None
        self._launches: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.plan_params: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.plan_leads: dict[tuple[int, int], int] = {}
        bound: dict[tuple[int, Any, int], Any] = {}  # one launch callable per (params, module, lead)
        for (rows, width), (whole, splits) in self._plans.items():
            first = tail = small
            plan_config = self.config
            if few and self.gluon_large:
                costs = [plan_cost(rows, setup.heads, width, c, sms) for c in large_configs]
                best = costs.index(min(costs))
                plan_config = large_configs[best]
                self._plans[rows, width] = choose_plan(rows, setup.heads, width, plan_config, sms)
                first = tail = large[best]
            elif seesaw is not None:
                first = seesaw if seesaw_takes(width, 1 if whole else splits, alone=not whole) else small
                tail = seesaw if seesaw_takes(width, splits) else small
                if not whole:  # no second launch: bound as the first, for the record (plan_params)
                    tail = first
            lead = choose_lead(rows, setup.heads, width, plan_config, sms) if self.gluon is not None else 0
            self._launches[rows, width] = (self._bound(bound, first, lead), self._bound(bound, tail, 0))
            self.plan_params[rows, width] = (first[0], tail[0])
            self.plan_leads[rows, width] = lead
        self.workspace = shared_workspace(setup.device, heads=setup.heads, max_rows=setup.max_rows,
                                          widths=setup.widths, fmt=self.fmt, config=self.config, plans=self._plans)

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
        if key not in self._plans:
            raise ValueError(
                f"rows={rows}, width={slots.shape[1]} not planned (max_rows {self.setup.max_rows}, widths {self.setup.widths})"
            )
        if rows == 0:
            return
        launch, split_launch = self._launches[key]
        run_plan(launch, self._plans[key], query, kv_rows, slots, counts, out, lse, split_launch=split_launch)

    def _launch_tl(self, query, kv_rows, slots, counts, out, lse, splits: int) -> None:
        _launch(query, kv_rows, slots, counts, out, lse, self.fmt,
                self.setup.softmax_scale, self.setup.output_scale, self.workspace, self.config, splits)

    def _bound(self, cache: dict[tuple[int, Any, int], Any], kernel: tuple[Any, Any], lead_tiles: int) -> Any:
        """The launch run_plan calls for (params, module launch) with this lead, made once per distinct triple."""
        params, module_launch = kernel
        key = (id(params), module_launch, lead_tiles)
        if key not in cache:
            cache[key] = self._launch_tl if params is None else self._gluon_call(params, module_launch, lead_tiles)
        return cache[key]

    def _gluon_call(self, params: Any, module_launch: Any = None, lead_tiles: int = 0) -> Any:
        """The Gluon kernel's launch with these params (module_launch: another kernel module's launch, e.g. the
        seesaw kernel's; default: the one chosen for this head count) and lead (choose_lead), as run_plan calls it."""
        kernel_launch = module_launch or self._gluon_launch

        def launch(query, kv_rows, slots, counts, out, lse, splits: int) -> None:
            kernel_launch(query, kv_rows, slots, counts, out, lse, self.setup.softmax_scale,
                          self.setup.output_scale, self.workspace, splits, params, lead_tiles)
        return launch


__all__ = ["Config", "TritonDecode", "Workspace", "choose_lead", "choose_plan", "choose_splits", "default_config",
           "make_workspace", "run_plan", "shared_workspace", "sparse_mla_decode"]
