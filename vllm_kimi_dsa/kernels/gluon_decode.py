"""Warp-specialized sparse MLA decode in Gluon for Hopper (sm_90a: wgmma): FP8 cache, > 32 heads in 64-head tiles.

Computes what `triton_decode._decode_kernel` computes for NVFP4=False, SWAP=False, BLOCK_H=64 (same grid, same
runtime arguments, same split scratch and `_combine_kernel`), but with producer and consumer warpgroups. Not for
nvfp4 caches, <= 32 heads, or sm_100+ (no wgmma there): `gluon_available()` says whether this process can run it.

Design (12 warps = 3 warpgroups a CTA, 1 CTA an SM; smem 36 KB Q + K_STAGES x BLOCK_N x 576 B K ring
+ V_SLOTS x BLOCK_N / 2 KB V16, at most 227 KB):
- Before the fork the default warpgroup stores Q (64 heads x 576 e4m3, padded heads 0) into NVMMA-swizzled shared
  memory (latent and RoPE apart) and initializes the mbarriers.
- WG2, the producer (56 registers via setmaxnreg): per tile it gathers the 576-byte rows of the BLOCK_N slots (loaded
  a tile ahead) with cp.async (16-byte chunks, 8 lanes on 128 contiguous bytes of a row: conflict-free in the
  swizzle, _ROW_LAYOUT; rows of holes / tokens past the split are zero-filled, so V is finite) into stage
  it % K_STAGES of the K ring, and has every thread `cp.async.mbarrier.arrive.noinc` on k_ready[stage]. Then it
  converts the previous tile's latent e4m3 -> fp16 (exact) from shared memory into the V16 ring, a half (BLOCK_N x
  256 fp16, one consumer's columns) at a time: tile i's half h is use u = 2 i + h of slot u % V_SLOTS (3 slots: the
  producer converts a half ahead of the consumers' P.V), fences for the async proxy and arrives on v_ready[slot].
- WG0 (default partition) and WG1 (worker), the consumers (224 registers each; `_consumer`): each computes the
  logits S = Q K^T for its BLOCK_N / 2 tokens of a tile (fp8 wgmma from shared memory, K = 512 + 64, no accumulator
  promotion, as the default Triton config), the two exchange row maxima (x_s, x_ready) and P halves (p_s, p_ready)
  through shared memory, and each owns half of O: acc (64 x 256 fp32) += P . V16[:, half] over all BLOCK_N tokens.
  Iteration `it` issues P.V of tile it - 1 and Q.K of tile it back to back, retires P.V first (its V16 slot goes
  back to the producer), then Q.K, then does the softmax of tile it (base 2, as `_softmax`). (Both consumers
  computing all of S, with no exchange, measured 3-4% slower on the H200 -- gluon-v8 -- and ran out of registers on
  Triton 3.8: removed, NOTES v13.)
- mbarriers: k_ready[s] (count 129: producer threads via cp.async + one arrive publishing the stage's 0 / -inf
  token bias, which the consumers add to S instead of loading the slots), k_empty[s] (3: both consumers after their Q.K,
  the producer after reading the stage), v_ready[slot] (1: the producer), v_empty[slot] (1: the consumer of
  that use, after its P.V), p_ready[2] (2: both consumers). The row maxima / sums: stored to x_s, then a named
  barrier of both consumers (`bar.sync 15, 256`; GluonParams.x_sync: x_ready mbarriers in the other forms).
- Epilogue as `_epilogue`: each consumer stores its 256 columns (bf16 out, or the fp32 split partial), WG0 the LSE.

The producer is built from helpers (`_load_slots`, `_gather_tile`, `_convert_tile`) that gluon_few_heads.py's
kernel also runs as two warpgroups (`_gatherer`, `_converter`); `_row_split`, `_split_tiles` (even pieces, or a
lead plan's first piece of lead_tiles tiles on a split-major grid) and `launch_kernel` serve all three Gluon kernels.

Written against Gluon's 3.6 API (`gl.warp_specialize([(fn, args), ...], worker_warps, worker_regs)`); 3.8 compiles and runs
it too. The module imports on any machine (CPU, no Gluon) without error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton

from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM
from vllm_kimi_dsa.host_math import cdiv
from vllm_kimi_dsa.kernels import triton_decode as td

LOG2E = td.LOG2E
BLOCK_H = 64  # heads a CTA (the wgmma M of one warpgroup)
DEFAULT_BLOCK_N = 64
DEFAULT_K_STAGES = 2
DEFAULT_V_SLOTS = 3
# A split CTA's 64 x 512 fp32 partial is 128 KB written and read back by the combine: at the H200's bandwidth
# share of an SM about 3.8 tiles of this kernel (~2.6 µs a 64-token tile). Fitted to bench_gluon --splits on
# the H200 (results/h200-2026-12-03/gluon-v7/splits_probe.json): at 80 rows 2-3 splits take 146 µs, the 4 picked
# without this term 158; the picks at 5, 20 and 320 rows (the fastest probed) stay. Fitted with fp32 partials; fp16
# (triton_decode.PARTIAL_DTYPE) halves the bytes, not yet refitted (NOTES v19).
SPLIT_TILES = 3.8
DEFAULT_CVT_ROWS = 32  # rows the producer converts a step: each step ends in a WAW barrier (Triton's membar)
# Register budget (setmaxnreg): 12 warps start at 65536 / 384 = 168 registers a thread. Triton's AllocateWarpGroups
# gives each worker what it requests and the default partition (consumer WG0) 504 - the two requests, so the
# producer's small share goes to the consumers (224 + 224 + 56 = 504).
DEFAULT_CONSUMER_REGS = 224
DEFAULT_PRODUCER_REGS = 56
# Triton versions whose Gluon API this file is written against: 3.6 (the H200's) and 3.8 both compile it offline
# for sm_90a (benchmarks/gluon_report.py); others may have moved the API (warp_specialize's signature did in 3.6).
SUPPORTED_TRITON = ("3.6", "3.8")
# Versions on which the kernel has passed its GPU tests on the H200: 3.6 (its image's) and 3.8 (vLLM 0.33's, carried
# there by benchmarks/device_triton38.sh; results/h200-2026-12-03/triton38, the current kernel in triton38-v2).
# TritonDecode picks the kernel by itself only on these; VLLM_KIMI_DSA_GLUON=1 asks for it on any SUPPORTED_TRITON
# version.
VERIFIED_TRITON = ("3.6", "3.8")

try:  # Gluon is experimental: absent from old Triton, its API moves between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    _GLUON_IMPORT_ERROR: str | None = None
except Exception as e:  # noqa: BLE001 - any failure means "no Gluon here"
    gluon = None
    gl = None
    _GLUON_IMPORT_ERROR = f"{type(e).__name__}: {e}"


def _triton_is(versions: tuple[str, ...]) -> bool:
    return any(triton.__version__.startswith(v) for v in versions)


def _triton_version_supported() -> bool:
    return _triton_is(SUPPORTED_TRITON)


def gluon_verified() -> bool:
    """Whether this Triton version is one the kernel has passed its GPU tests on (VERIFIED_TRITON)."""
    return _triton_is(VERIFIED_TRITON)


def gluon_unavailable_reason(device: torch.device | str | None = None) -> str:
    """Why the Gluon kernel cannot run on `device` (default: the current CUDA device); '' when it can: Gluon
    imports, Triton's version is one this file targets, and the device is a Hopper (sm_90; no wgmma on sm_100+)."""
    if _GLUON_IMPORT_ERROR is not None:
        return f"Gluon does not import: {_GLUON_IMPORT_ERROR}"
    if not _triton_version_supported():
        return f"triton {triton.__version__} is not one of {SUPPORTED_TRITON} (the Gluon API this kernel is written for)"
    try:
        if device is not None and torch.device(device).type != "cuda":
            return f"device {device} is not a CUDA device"
        if not torch.cuda.is_available():
            return "no CUDA device"
        cap = torch.cuda.get_device_capability(device)
    except Exception as e:  # noqa: BLE001
        return f"CUDA query failed: {e}"
    if cap[0] != 9:
        return f"device is sm_{cap[0]}{cap[1]}, the kernel needs Hopper (sm_90) wgmma"
    return ""


def gluon_available(device: torch.device | str | None = None) -> bool:
    """Whether this process can run the Gluon kernel on `device` (gluon_unavailable_reason is ''). Never raises."""
    return gluon_unavailable_reason(device) == ""


# ----------------------------------------------------------------------------- kernel

if gl is not None:
    _BH = gl.constexpr(BLOCK_H)
    _ONE_A_THREAD = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))  # a warpgroup's 128 threads
    _D = gl.constexpr(LATENT_DIM)

    @gluon.jit
    def _online_softmax(s, m_tile, m_i, l_i, acc, head_o_layout: gl.constexpr):
        """One tile of the online softmax in base 2 (as triton_decode._softmax) given the tile's row maxima:
        (P, new running max, new running sum, the rescaled accumulator)."""
        m_new = gl.maximum(m_i, m_tile)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - gl.expand_dims(m_use, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, head_o_layout), 1)
        return p, m_new, l_i, acc

    @gluon.jit
    def _exchange():
        """The two consumers' rendezvous after each stored its share in x_s: a named barrier of both warpgroups
        (bar.sync 15, 256; Triton's own barriers take the low ids), which racecheck follows."""
        gl.inline_asm_elementwise("bar.sync 15, 256;\n\tmov.u32 $0, 0;", "=r,r",
                                  [gl.arange(0, 128, _ONE_A_THREAD)], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _consumer(
        q_lat_s, q_rope_s, k_lat_s, k_rope_s, v16_s, bias_s, p_s, x_s,
        k_ready, k_empty, v_ready, v_empty, x_ready, p_ready,
        out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
        row, split, hb, num_tiles, H, num_splits,
        stride_o_row, stride_o_head, stride_lse_row,
        qk_scale, out_scale,
        HALF: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, V_SLOTS: gl.constexpr,
    ):
        """A consumer warpgroup: S = Q K^T for this warpgroup's BLOCK_N / 2 tokens only (no redundant Q.K); the row
        maxima go through x_s (x_ready: count 1, the other consumer waits) so both scale by the same max, and the
        P halves through p_s (p_ready: count 2), so each consumer's acc (64 x 256) += P V16[:, HALF*256 ...] sees
        all BLOCK_N tokens. l_i is this consumer's tokens' share until the end, where the two shares are summed.
        P.V of tile it - 1 is issued and retired before Q.K of tile it."""
        DH: gl.constexpr = 256
        NH: gl.constexpr = BLOCK_N // 2  # tokens a consumer
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DH, 16])
        tok_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        head_s_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        head_o_layout: gl.constexpr = gl.SliceLayout(1, o_layout)

        m_i = gl.full([_BH], float("-inf"), gl.float32, head_s_layout)
        l_i = gl.full([_BH], 0.0, gl.float32, head_s_layout)
        acc = gl.zeros([_BH, DH], gl.float32, o_layout)
        s_zero = gl.zeros([_BH, NH], gl.float32, s_layout)
        for it in range(num_tiles):
            stage = it % K_STAGES
            mbarrier.wait(k_ready.index(stage), (it // K_STAGES) & 1)
            bias = bias_s.index(stage).slice(HALF * NH, NH).load(tok_layout)
            fence_async_shared()
            u = 2 * (it - 1) + HALF
            vslot = (u + 2 * V_SLOTS) % V_SLOTS
            pb = (it + 1) % 2  # tile it - 1's P buffer
            acc_t = warpgroup_mma_init(acc)
            if it > 0:
                mbarrier.wait(v_ready.index(vslot), (u // V_SLOTS) & 1)
                mbarrier.wait(p_ready.index(pb), ((it - 1) // 2) & 1)
                v_cur = v16_s.index(vslot)
                acc_t = warpgroup_mma(p_s.index(pb * 2), v_cur.slice(0, NH, dim=0), acc, is_async=True)
                acc_t = warpgroup_mma(p_s.index(pb * 2 + 1), v_cur.slice(NH, NH, dim=0), acc_t, is_async=True)
            k_lat = k_lat_s.index(stage).slice(HALF * NH, NH, dim=0)
            k_rope = k_rope_s.index(stage).slice(HALF * NH, NH, dim=0)
            s = warpgroup_mma(q_lat_s, k_lat.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma(q_rope_s, k_rope.permute((1, 0)), s, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc_t,))
            mbarrier.arrive(v_empty.index(vslot), pred=it > 0)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            mbarrier.arrive(k_empty.index(stage))

            s = s * qk_scale + gl.expand_dims(bias, 0)
            # both consumers must scale by one max: exchange the tile's row maxima (buffers by tile parity; the
            # other consumer has read tile it - 2's before it published tile it - 1's)
            xb = it % 2
            x_s.index(xb * 2 + HALF).store(gl.max(s, axis=1))
            _exchange()
            m_tile = gl.maximum(x_s.index(xb * 2).load(head_s_layout), x_s.index(xb * 2 + 1).load(head_s_layout))
            p, m_i, l_i, acc = _online_softmax(s, m_tile, m_i, l_i, acc, head_o_layout)
            # this consumer's P half for both consumers' P.V (wgmma reads it through the async proxy); buffer
            # it % 2 is free: both consumers retired tile it - 2's P.V before this tile's max exchange
            p_s.index(xb * 2 + HALF).store(p.to(gl.float16))
            fence_async_shared()
            mbarrier.arrive(p_ready.index(xb))
        if num_tiles > 0:
            last = num_tiles - 1
            u = 2 * last + HALF
            pb = last % 2
            mbarrier.wait(v_ready.index(u % V_SLOTS), (u // V_SLOTS) & 1)
            mbarrier.wait(p_ready.index(pb), (last // 2) & 1)
            v_cur = v16_s.index(u % V_SLOTS)
            acc = warpgroup_mma(p_s.index(pb * 2), v_cur.slice(0, NH, dim=0), acc, is_async=True)
            acc = warpgroup_mma(p_s.index(pb * 2 + 1), v_cur.slice(NH, NH, dim=0), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        # the row sum over both consumers' tokens (one more use of the max exchange's buffers and barriers)
        xb = num_tiles % 2
        x_s.index(xb * 2 + HALF).store(l_i)
        _exchange()
        l_i = x_s.index(xb * 2).load(head_s_layout) + x_s.index(xb * 2 + 1).load(head_s_layout)

        _store_result(acc, m_i, l_i, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, row, split, hb, H, num_splits,
                      stride_o_row, stride_o_head, stride_lse_row, out_scale, HALF, s_layout, o_layout)

    @gluon.jit
    def normalizers(l_i, m_i):
        """1 / l (0 where l = 0: a count-0 or all-hole split) and the base-2 LSE (-inf there) of the row sums: every
        Gluon epilogue's (as triton_decode._epilogue's)."""
        has = l_i > 0.0
        inv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
        return inv, gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))

    @gluon.jit
    def _store_result(
        acc, m_i, l_i, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, row, split, hb, H, num_splits,
        stride_o_row, stride_o_head, stride_lse_row, out_scale,
        HALF: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
    ):
        """Epilogue, as triton_decode._epilogue: a consumer's 256 columns (bf16 out, or the fp32 split partial);
        consumer 0 also the LSE."""
        DH: gl.constexpr = 256
        head_s_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        head_o_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        inv, lse2 = normalizers(l_i, m_i)
        o = acc * gl.expand_dims(gl.convert_layout(inv, head_o_layout), 1)
        offs_h = hb * _BH + gl.arange(0, _BH, head_o_layout)
        mask_h = offs_h < H
        offs_d = HALF * DH + gl.arange(0, DH, gl.SliceLayout(0, o_layout))
        offs_h_s = hb * _BH + gl.arange(0, _BH, head_s_layout)
        mask_h_s = offs_h_s < H
        mask_o = gl.expand_dims(mask_h, 1) & gl.expand_dims(offs_d < _D, 0)
        if num_splits == 1:
            o_ptrs = (out_ptr + row.to(gl.int64) * stride_o_row + gl.expand_dims(offs_h * stride_o_head, 1)
                      + gl.expand_dims(offs_d, 0))
            gl.store(o_ptrs, (o * out_scale).to(gl.bfloat16), mask=mask_o)
            if HALF == 0:
                gl.store(lse_ptr + row * stride_lse_row + offs_h_s, lse2 * 0.6931471805599453, mask=mask_h_s)
        else:
            base = (row * num_splits + split) * H
            # fp16 partials: 4 bytes a lane from the accumulator's layout (half sectors); stored from whole sectors
            store_latent(gl.permute(o, (1, 0)), part_out_ptr + base.to(gl.int64) * _D + HALF * DH, _D, hb * _BH,
                         H, wgmma_store_layout(False))
            if HALF == 0:
                gl.store(part_lse_ptr + base + offs_h_s, lse2, mask=mask_h_s)

    @triton.constexpr_function
    def latent_store_layout(dims, heads, thread_dims, elem_bytes):
        """A [dims, heads] layout for storing O in latent order, reached from the thread-native
        BlockedLayout([thread_dims, 2], [8, 4], [4, 1], [0, 1]) (a thread's thread_dims contiguous dims of 2 heads;
        the reg_v / seesaw accumulators' order) by moving data between the lanes of a warp only (shuffles, no shared
        memory): a lane holds 16 contiguous bytes of a head and 8 lanes 128 contiguous bytes, so every store
        instruction writes whole 32-byte sectors. From the thread-native layout a 16-byte store covered half (or a
        quarter) of each sector it touched, and the next instruction the rest: 2-4x the sector writes, paid at the
        end of every split CTA (its fp32 partial; NOTES v18)."""
        vec = 16 // elem_bytes
        if heads < 8 or thread_dims % vec:
            raise ValueError(f"latent_store_layout: heads {heads} < 8 or thread_dims {thread_dims} not a multiple "
                             f"of {vec}")
        reg = [[1 << i, 0] for i in range(vec.bit_length() - 1)] + [[0, 1]]
        reg += [[8 * vec << i, 0] for i in range((thread_dims // vec).bit_length() - 1)]
        reg += [[0, 8 << i] for i in range((heads // 8).bit_length() - 1)]
        lane = [[vec << i, 0] for i in range(3)] + [[0, 2], [0, 4]]
        warp = [[8 * thread_dims << i, 0] for i in range(2)]
        return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[],
                                          shape=[dims, heads])

    @triton.constexpr_function
    def wgmma_store_layout(dims_on_m):
        """latent_store_layout's counterpart for fp16 stores straight from a wgmma accumulator (warps [4, 1], m16),
        seen as [dims, heads]: the 64-head kernel's O (64 heads on M, 256 dims on N; transposed) or the few-heads
        kernel's O^T (dims_on_m: 256 dims on M, 16 heads on N). In the accumulator a lane holds 2 adjacent dims
        (heads on M) or 1 (dims on M): 4 or 2 bytes a lane, half sectors at best. Here each lane holds 8 contiguous
        dims (16 bytes) and 4 (2) lanes a head's 64 (32) contiguous bytes; the warps keep their rows, so the
        conversion is warp shuffles."""
        if dims_on_m:  # source: reg [0,1] [8,0] [0,8] [64,0] [128,0], lanes [0,2] [0,4] [1,0] [2,0] [4,0]
            return gl.DistributedLinearLayout(
                reg_bases=[[1, 0], [2, 0], [4, 0], [64, 0], [128, 0]],
                lane_bases=[[8, 0], [0, 1], [0, 2], [0, 4], [0, 8]],
                warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[256, 16])
        # source: reg [1,0] [0,8] [8,0] [16,0] [32,0] [64,0] [128,0], lanes [2,0] [4,0] [0,1] [0,2] [0,4]
        return gl.DistributedLinearLayout(
            reg_bases=[[1, 0], [2, 0], [4, 0], [0, 8], [32, 0], [64, 0], [128, 0]],
            lane_bases=[[8, 0], [16, 0], [0, 1], [0, 2], [0, 4]],
            warp_bases=[[0, 16], [0, 32]], block_bases=[], shape=[256, 64])

    @gluon.jit
    def store_latent(o, base_ptr, head_stride, h0, H, layout: gl.constexpr):
        """o [dims, heads] (fp32, latent order, normalized) into base_ptr + head * head_stride + dim (heads h0..,
        masked to H) as base_ptr's dtype, stored from `layout` (latent_store_layout)."""
        o = gl.convert_layout(o, layout)
        offs_h = h0 + gl.arange(0, o.shape[1], gl.SliceLayout(0, layout))
        offs_d = gl.arange(0, o.shape[0], gl.SliceLayout(1, layout))
        ptrs = base_ptr + gl.expand_dims(offs_h.to(gl.int64) * head_stride, 0) + gl.expand_dims(offs_d, 1)
        mask = gl.expand_dims(offs_h < H, 0) & gl.expand_dims(offs_d < o.shape[0], 1)
        gl.store(ptrs, o.to(base_ptr.dtype.element_ty), mask=mask)

    # Shared-memory wavefronts of 16-byte accesses are served 8 lanes at a time: those 8 lanes must hit 8
    # distinct 16-byte bank groups. Lanes 8 rows x 4 (rows r, r + 1 on the same 64 bytes, the layout before NOTES
    # v12) took two wavefronts an access on the 128-byte-swizzled latent gathers and conversion loads: 20% of the
    # few-heads kernel's shared-memory wavefronts, the resource that kernel runs out of first (ncu). Now 8 lanes
    # move 128 contiguous bytes of one row. The RoPE (64-byte rows) is gathered 8 bytes a lane with the same rows
    # a thread, so one slot vector serves both; the conversion reads 8 e4m3 and writes 8 fp16 a lane (16 lanes
    # across a row) so that both its loads and its fp16 stores are conflict-free. tests/test_sm90_compile checks
    # each against its buffer with Gluon's bank_conflicts.
    _ROW_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))
    _ROPE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
    _CVT_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))

    @gluon.jit
    def _load_slots(s_base, start, end, t, BLOCK_N: gl.constexpr):
        """Tile t's slots (-1 past `end`), one per gathered row of _ROW_LAYOUT."""
        offs = start + t * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, _ROW_LAYOUT))
        return gl.load(s_base + offs, mask=offs < end, other=-1)

    @gluon.jit
    def _gather_tile(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot, it, stride_kv,
                     K_STAGES: gl.constexpr):
        """cp.async tile it's rows (zero-filled holes and tokens past the split, so V is finite) into its K stage,
        publish its 0 / -inf token bias, and have the gathering warpgroup arrive on k_ready[stage]."""
        stage = it % K_STAGES
        ok = slot >= 0
        row_off = gl.where(ok, slot, 0).to(gl.int64) * stride_kv
        offs_lat = gl.arange(0, 512, gl.SliceLayout(0, _ROW_LAYOUT))
        # _ROPE_LAYOUT gives a thread the same rows as _ROW_LAYOUT: these conversions move nothing
        rope_off = gl.convert_layout(row_off, gl.SliceLayout(1, _ROPE_LAYOUT))
        rope_ok = gl.convert_layout(ok, gl.SliceLayout(1, _ROPE_LAYOUT))
        offs_rope = 512 + gl.arange(0, 64, gl.SliceLayout(0, _ROPE_LAYOUT))
        # the stage is free once the consumers' Q.K and the conversion of tile it - K_STAGES are done
        mbarrier.wait(k_empty.index(stage), ((it // K_STAGES) & 1) ^ 1)
        async_copy.async_copy_global_to_shared(
            k_lat_s.index(stage), kv_ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(offs_lat, 0),
            mask=gl.expand_dims(ok, 1))
        async_copy.async_copy_global_to_shared(
            k_rope_s.index(stage), kv_ptr + gl.expand_dims(rope_off, 1) + gl.expand_dims(offs_rope, 0),
            mask=gl.expand_dims(rope_ok, 1))
        # the consumers add this 0 / -inf to the logits instead of loading the slots themselves
        bias_s.index(stage).store(gl.where(ok, 0.0, float("-inf")))
        # every thread arrives (count 128) once its copies have landed; one more, ordinary arrive (release: after
        # the partition's barrier) publishes the bias store
        async_copy.mbarrier_arrive(k_ready.index(stage), increment_count=False)
        mbarrier.arrive(k_ready.index(stage))

    @gluon.jit
    def _convert_tile(k_lat_s, v16_s, k_ready, k_empty, v_ready, v_empty, j,
                      BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, V_SLOTS: gl.constexpr, CVT_ROWS: gl.constexpr):
        """Tile j's latent e4m3 -> fp16 (exact) into the V16 ring, a half (BLOCK_N x 256, one consumer's columns) at
        a time: half h is use u = 2 j + h of slot u % V_SLOTS; then release the K stage (k_empty)."""
        # a lane reads 8 contiguous e4m3 and writes 8 fp16, both conflict-free in _CVT_LAYOUT
        cvt_layout: gl.constexpr = _CVT_LAYOUT
        cstage = j % K_STAGES
        mbarrier.wait(k_ready.index(cstage), (j // K_STAGES) & 1)
        k_cur = k_lat_s.index(cstage)
        for half in gl.static_range(2):
            # each half has its own barriers: consumer WG0 need not wait for WG1's P.V to get its half
            u = 2 * j + half
            mbarrier.wait(v_empty.index(u % V_SLOTS), ((u // V_SLOTS) & 1) ^ 1)
            v_dst = v16_s.index(u % V_SLOTS)
            for r0 in gl.static_range(0, BLOCK_N, CVT_ROWS):
                x = k_cur.slice(half * 256, 256, dim=1).slice(r0, CVT_ROWS, dim=0).load(cvt_layout)
                v_dst.slice(r0, CVT_ROWS, dim=0).store(x.to(gl.float16))
            fence_async_shared()
            mbarrier.arrive(v_ready.index(u % V_SLOTS))
        mbarrier.arrive(k_empty.index(cstage))

    @gluon.jit
    def _producer(
        k_lat_s, k_rope_s, v16_s, bias_s, k_ready, k_empty, v_ready, v_empty,
        kv_ptr, slots_ptr, row, start, end, num_tiles, stride_kv, stride_s_row,
        BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, V_SLOTS: gl.constexpr, CVT_ROWS: gl.constexpr,
    ):
        """The producer warpgroup: iteration it gathers tile it into the K ring, then converts tile it - 1's
        latent e4m3 -> fp16 into V16. (Converting further behind, or loading the slots two tiles ahead after the
        conversion, measured slower: NOTES v8.)"""
        s_base = slots_ptr + row.to(gl.int64) * stride_s_row
        # slots of the next tile to gather, loaded a tile ahead so the load's latency hides behind a conversion
        slot = _load_slots(s_base, start, end, 0, BLOCK_N)
        for it in range(num_tiles + 1):
            if it < num_tiles:
                _gather_tile(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot, it, stride_kv, K_STAGES)
                slot = _load_slots(s_base, start, end, it + 1, BLOCK_N)
            if it > 0:
                _convert_tile(k_lat_s, v16_s, k_ready, k_empty, v_ready, v_empty, it - 1,
                              BLOCK_N, K_STAGES, V_SLOTS, CVT_ROWS)

    # nvfp4_ds_mla rows (formats.py): 256 packed e2m1 bytes (latent 2 b in byte b's low nibble, 2 b + 1 in its high
    # one), 64 RoPE e4m3 bytes at 256, 32 e4m3 block scales at 320 (block s at 320 + 8 (s & 3) + (s >> 2)).
    # Scales are gathered 16 rows x 32 bytes a warp instruction (2 lanes a row)
    _SC_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0]))

    @gluon.jit
    def _gather_tile_nvfp4(pk_s, sc_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot, it, stride_kv,
                           K_STAGES: gl.constexpr):
        """_gather_tile for nvfp4_ds_mla rows (gluon_few_heads' nvfp4 path): packed bytes, RoPE and scales into their
        stage buffers."""
        stage = it % K_STAGES
        ok = slot >= 0
        row_off = gl.where(ok, slot, 0).to(gl.int64) * stride_kv
        offs_pk = gl.arange(0, 256, gl.SliceLayout(0, _ROW_LAYOUT))
        rope_off = gl.convert_layout(row_off, gl.SliceLayout(1, _ROPE_LAYOUT))  # moves nothing, as in _gather_tile
        rope_ok = gl.convert_layout(ok, gl.SliceLayout(1, _ROPE_LAYOUT))
        offs_rope = 256 + gl.arange(0, 64, gl.SliceLayout(0, _ROPE_LAYOUT))
        sc_slot = gl.convert_layout(slot, gl.SliceLayout(1, _SC_LAYOUT))
        sc_ok = sc_slot >= 0
        sc_base = gl.expand_dims(kv_ptr + gl.where(sc_ok, sc_slot, 0).to(gl.int64) * stride_kv, 1)
        offs_sc = 320 + gl.arange(0, 32, gl.SliceLayout(0, _SC_LAYOUT))
        mbarrier.wait(k_empty.index(stage), ((it // K_STAGES) & 1) ^ 1)
        async_copy.async_copy_global_to_shared(
            pk_s.index(stage), kv_ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(offs_pk, 0),
            mask=gl.expand_dims(ok, 1))
        rope_ptrs = (kv_ptr + gl.expand_dims(rope_off, 1) + gl.expand_dims(offs_rope, 0)).to(
            gl.pointer_type(gl.float8e4nv), bitcast=True)
        async_copy.async_copy_global_to_shared(k_rope_s.index(stage), rope_ptrs, mask=gl.expand_dims(rope_ok, 1))
        async_copy.async_copy_global_to_shared(sc_s.index(stage), sc_base + gl.expand_dims(offs_sc, 0),
                                                  mask=gl.expand_dims(sc_ok, 1))
        bias_s.index(stage).store(gl.where(ok, 0.0, float("-inf")))
        async_copy.mbarrier_arrive(k_ready.index(stage), increment_count=False)
        mbarrier.arrive(k_ready.index(stage))

    @gluon.jit
    def _gatherer(
        k_lat_s, k_rope_s, bias_s, k_ready, k_empty,
        kv_ptr, slots_ptr, row, start, end, num_tiles, stride_kv, stride_s_row,
        BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, sc_s=None, NVFP4: gl.constexpr = False,
    ):
        """The gathers of _producer in a warpgroup of their own (the conversions in _converter's), each tile's
        cp.async issued as soon as its K stage is free. Slots come in groups of 4 tiles (4 registers a tile): a
        group's loads are issued right after the previous group's first gather, so the first use of a group waits
        on loads ~3 tiles old. Loaded one tile at a time (4 ahead, in rotation), the first use of each tile's slots
        waited on the load issued one iteration before (SASS waits on a load scoreboard the newer loads share):
        the `slot >= 0` test took most of the kernel's stall samples.)"""
        s_base = slots_ptr + row.to(gl.int64) * stride_s_row
        slot0 = _load_slots(s_base, start, end, 0, BLOCK_N)
        slot1 = _load_slots(s_base, start, end, 1, BLOCK_N)
        slot2 = _load_slots(s_base, start, end, 2, BLOCK_N)
        slot3 = _load_slots(s_base, start, end, 3, BLOCK_N)
        for g in range(0, num_tiles, 4):
            _gather_any(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot0, g, stride_kv, K_STAGES, sc_s,
                        NVFP4)
            next0 = _load_slots(s_base, start, end, g + 4, BLOCK_N)
            next1 = _load_slots(s_base, start, end, g + 5, BLOCK_N)
            next2 = _load_slots(s_base, start, end, g + 6, BLOCK_N)
            next3 = _load_slots(s_base, start, end, g + 7, BLOCK_N)
            if g + 1 < num_tiles:
                _gather_any(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot1, g + 1, stride_kv, K_STAGES,
                            sc_s, NVFP4)
            if g + 2 < num_tiles:
                _gather_any(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot2, g + 2, stride_kv, K_STAGES,
                            sc_s, NVFP4)
            if g + 3 < num_tiles:
                _gather_any(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot3, g + 3, stride_kv, K_STAGES,
                            sc_s, NVFP4)
            slot0 = next0
            slot1 = next1
            slot2 = next2
            slot3 = next3

    @gluon.jit
    def _gather_any(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot, it, stride_kv, K_STAGES: gl.constexpr,
                    sc_s, NVFP4: gl.constexpr):
        """_gather_tile, or _gather_tile_nvfp4 (k_lat_s then holds the packed bytes, sc_s the scales)."""
        if NVFP4:
            _gather_tile_nvfp4(k_lat_s, sc_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot, it, stride_kv,
                               K_STAGES)
        else:
            _gather_tile(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot, it, stride_kv, K_STAGES)

    @gluon.jit
    def _alloc_fp8_q_and_ring(BH: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr):
        """Q (BH heads: latent, RoPE) and the K ring's stages (BLOCK_N rows) for fp8 rows, as wgmma operands (128- /
        64-byte swizzles); both Gluon kernels' first shared-memory buffers."""
        lat_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        rope_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
        q_lat_s = gl.allocate_shared_memory(gl.float8e4nv, [BH, 512], lat_layout)
        q_rope_s = gl.allocate_shared_memory(gl.float8e4nv, [BH, 64], rope_layout)
        k_lat_s = gl.allocate_shared_memory(gl.float8e4nv, [K_STAGES, BLOCK_N, 512], lat_layout)
        k_rope_s = gl.allocate_shared_memory(gl.float8e4nv, [K_STAGES, BLOCK_N, 64], rope_layout)
        return q_lat_s, q_rope_s, k_lat_s, k_rope_s

    @gluon.jit
    def _split_tiles(counts_ptr, row, split, num_splits, lead_tiles, K, BLOCK_N: gl.constexpr):
        """(start, end, tiles) of this split's token range, as triton_decode._split_range (lead_tiles > 0: the first
        piece takes that many tiles, the other num_splits - 1 the rest evenly)."""
        count = gl.load(counts_ptr + row)
        count = gl.minimum(gl.maximum(count, 0), K)
        tiles = gl.cdiv(count, BLOCK_N)
        if lead_tiles > 0:
            first = gl.minimum(tiles, lead_tiles)
            per = gl.cdiv(tiles - first, gl.maximum(num_splits - 1, 1))
            t0 = gl.where(split == 0, 0, first + (split - 1) * per)
            t1 = gl.where(split == 0, first, t0 + per)
        else:
            per = gl.cdiv(tiles, num_splits)
            t0 = split * per
            t1 = t0 + per
        start = t0 * BLOCK_N
        end = gl.minimum(t1 * BLOCK_N, count)
        return start, end, gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)

    @gluon.jit
    def _row_split(num_splits, lead_tiles):
        """(row, split) of this CTA on grid (head blocks, splits, rows), as triton_decode._row_split: split-major
        when lead_tiles > 0, so every row's first (long) piece is dispatched before any short one."""
        split = gl.program_id(1)
        row = gl.program_id(2)
        if lead_tiles > 0:
            lin = split + row * num_splits
            rows = gl.num_programs(2)
            split = lin // rows
            row = lin % rows
        return row, split

    @gluon.jit(do_not_specialize=["lead_tiles"])  # one compile for every plan's lead
    def gluon_decode_kernel(
        q_ptr, kv_ptr, slots_ptr, counts_ptr,
        out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
        H, K, num_splits, lead_tiles,
        stride_q_row, stride_q_head, stride_kv, stride_s_row,
        stride_o_row, stride_o_head, stride_lse_row,
        qk_scale, out_scale,
        BLOCK_N: gl.constexpr,  # KV rows a tile
        K_STAGES: gl.constexpr,  # K ring depth
        V_SLOTS: gl.constexpr,  # fp16 V16 ring of half tiles (BLOCK_N x 256): tile i's half h is use 2 i + h
        CVT_ROWS: gl.constexpr,  # rows the producer converts a step (register use vs. loads in flight)
        CONSUMER_REGS: gl.constexpr,  # setmaxnreg of consumer WG1 (WG0 gets 504 - the two requests)
        PRODUCER_REGS: gl.constexpr,  # setmaxnreg of the producer
    ):
        """One (64-head block, KV split, row), as triton_decode._decode_kernel with BLOCK_H=64, fp8, SWAP=False."""
        hb = gl.program_id(0)
        row, split = _row_split(num_splits, lead_tiles)

        start, end, num_tiles = _split_tiles(counts_ptr, row, split, num_splits, lead_tiles, K, BLOCK_N)

        v16_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_lat_s, q_rope_s, k_lat_s, k_rope_s = _alloc_fp8_q_and_ring(_BH, BLOCK_N, K_STAGES)
        v16_s = gl.allocate_shared_memory(gl.float16, [V_SLOTS, BLOCK_N, 256], v16_layout)
        bias_s = gl.allocate_shared_memory(gl.float32, [K_STAGES, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [V_SLOTS, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [V_SLOTS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(K_STAGES):
            # cp.async.mbarrier.arrive.noinc from each producer thread + the producer's arrive after the bias store
            mbarrier.init(k_ready.index(i), count=129)
            mbarrier.init(k_empty.index(i), count=3)  # consumer WG0, WG1, the producer's conversion
        for i in gl.static_range(V_SLOTS):
            mbarrier.init(v_ready.index(i), count=1)  # the producer
            mbarrier.init(v_empty.index(i), count=1)  # that half's consumer
        # P halves (buffer by tile parity, half by consumer) as wgmma A operands; row maxima / sums exchanged
        p_layout_s: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=BLOCK_N, element_bitwidth=16, rank=2)
        p_s = gl.allocate_shared_memory(gl.float16, [4, _BH, BLOCK_N // 2], p_layout_s)
        x_s = gl.allocate_shared_memory(gl.float32, [4, _BH], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        x_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            # unused since the consumers meet at a named barrier; kept: dropping it changes the GPU-verified SASS
            mbarrier.init(x_ready.index(i), count=1)
            mbarrier.init(p_ready.index(i), count=2)  # both consumers, after storing their P halves

        # Q (64 heads x 576 e4m3; padded heads 0) into shared memory, by this (default) warpgroup
        q_layout: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [4, 1], [1, 0])
        q_rope_ld: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
        offs_h = hb * _BH + gl.arange(0, _BH, gl.SliceLayout(1, q_layout))
        q_base = q_ptr + row.to(gl.int64) * stride_q_row + gl.expand_dims(offs_h * stride_q_head, 1)
        q_lat = gl.load(q_base + gl.expand_dims(gl.arange(0, 512, gl.SliceLayout(0, q_layout)), 0),
                        mask=gl.expand_dims(offs_h < H, 1), other=0.0)
        q_lat_s.store(q_lat)
        offs_hr = hb * _BH + gl.arange(0, _BH, gl.SliceLayout(1, q_rope_ld))
        q_rope = gl.load(q_ptr + row.to(gl.int64) * stride_q_row + gl.expand_dims(offs_hr * stride_q_head, 1) + 512
                         + gl.expand_dims(gl.arange(0, 64, gl.SliceLayout(0, q_rope_ld)), 0),
                         mask=gl.expand_dims(offs_hr < H, 1), other=0.0)
        q_rope_s.store(q_rope)
        fence_async_shared()

        gl.warp_specialize(
            [
                (_consumer, (q_lat_s, q_rope_s, k_lat_s, k_rope_s, v16_s, bias_s, p_s, x_s,
                             k_ready, k_empty, v_ready, v_empty, x_ready, p_ready,
                             out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                             row, split, hb, num_tiles, H, num_splits,
                             stride_o_row, stride_o_head, stride_lse_row, qk_scale, out_scale,
                             0, BLOCK_N, K_STAGES, V_SLOTS)),
                (_consumer, (q_lat_s, q_rope_s, k_lat_s, k_rope_s, v16_s, bias_s, p_s, x_s,
                             k_ready, k_empty, v_ready, v_empty, x_ready, p_ready,
                             out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                             row, split, hb, num_tiles, H, num_splits,
                             stride_o_row, stride_o_head, stride_lse_row, qk_scale, out_scale,
                             1, BLOCK_N, K_STAGES, V_SLOTS)),
                (_producer, (k_lat_s, k_rope_s, v16_s, bias_s, k_ready, k_empty, v_ready, v_empty,
                             kv_ptr, slots_ptr, row, start, end, num_tiles, stride_kv, stride_s_row,
                             BLOCK_N, K_STAGES, V_SLOTS, CVT_ROWS)),
            ],
            [4, 4],
            [CONSUMER_REGS, PRODUCER_REGS],
        )


# ----------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class GluonParams:
    """Compile-time shape of the Gluon kernel (defaults: the fastest measured on the H200, NOTES_triton_decode.md)."""

    block_n: int = DEFAULT_BLOCK_N  # tokens a tile: 64 or 32
    k_stages: int = DEFAULT_K_STAGES  # K ring depth
    v_slots: int = DEFAULT_V_SLOTS  # fp16 V16 ring of half tiles (2: one tile; 3: the producer converts a half ahead)
    cvt_rows: int = DEFAULT_CVT_ROWS  # rows the producer converts a step: 8, 16 or 32, at most block_n
    consumer_regs: int = DEFAULT_CONSUMER_REGS  # setmaxnreg of consumer WG1 (WG0: 504 - the two)
    producer_regs: int = DEFAULT_PRODUCER_REGS  # setmaxnreg of the producer

    def __post_init__(self) -> None:
        if self.block_n not in (32, 64):
            raise ValueError(f"block_n must be 32 or 64, got {self.block_n}")
        if self.cvt_rows not in (8, 16, 32) or self.cvt_rows > self.block_n:
            raise ValueError(f"cvt_rows must be 8, 16 or 32 and at most block_n, got {self.cvt_rows}")
        check_warpgroup_regs(self.consumer_regs, self.producer_regs)
        smem = BLOCK_H * HEAD_DIM + self.k_stages * self.block_n * HEAD_DIM + self.v_slots * self.block_n * LATENT_DIM
        smem += 2 * BLOCK_H * self.block_n * 2  # the P halves, two tiles
        smem += 2048  # the token bias, the row-max exchange, mbarriers and Triton's warp-specialize state
        if self.k_stages < 2 or self.v_slots < 2 or smem > 227 * 1024:
            raise ValueError(f"k_stages >= 2 and v_slots >= 2 must fit 227 KB of shared memory, got "
                             f"{self.k_stages}, {self.v_slots} ({smem} B)")

    def config(self) -> td.Config:
        """The triton_decode.Config the split heuristic and the workspace see (64-head tiles, 1 CTA an SM)."""
        return gluon_config(self.block_n)


def check_warpgroup_regs(consumer_regs: int, producer_regs: int) -> None:
    """setmaxnreg budgets of a 12-warp kernel (the default partition = consumer WG0, workers consumer WG1 and the
    producer): each request a multiple of 8 in [24, 256], and WG0's 504 - both requests in [consumer_regs, 256]."""
    regs = (consumer_regs, producer_regs)
    if any(r % 8 or not 24 <= r <= 256 for r in regs) or 504 - sum(regs) not in range(consumer_regs, 257):
        raise ValueError(f"consumer_regs, producer_regs must be multiples of 8 in [24, 256] leaving consumer WG0 "
                         f"504 - both, in [consumer_regs, 256], got {regs}")


def gluon_config(block_n: int = DEFAULT_BLOCK_N) -> td.Config:
    """The triton_decode.Config the split heuristic and the workspace see for this kernel (64-head tiles, 1 CTA/SM).

    Its tail-split plans (td.Config.tail_split): H200, H = 128, 115.6 vs 140.3 µs at 80 rows, 211.5 vs 232.4 at 160
    (NOTES v11)."""
    return td.Config(block_h=BLOCK_H, block_n=block_n, num_warps=12, num_stages=1, ctas_per_sm=1,
                     split_tiles=SPLIT_TILES * block_n / DEFAULT_BLOCK_N, lead_split=True, lead_min_gain=0.0)


def kernel_constexprs(params: GluonParams) -> dict[str, Any]:
    """gluon_decode_kernel's compile-time arguments for these params (the launcher's and gluon_report's)."""
    return dict(BLOCK_N=params.block_n, K_STAGES=params.k_stages, V_SLOTS=params.v_slots, CVT_ROWS=params.cvt_rows,
                CONSUMER_REGS=params.consumer_regs, PRODUCER_REGS=params.producer_regs)


def launch_kernel(kernel: Any, head_blocks: int, query, kv_rows, slots, counts, out, lse, softmax_scale: float,
                  output_scale: float, ws: td.Workspace, splits: int, constexprs: dict[str, Any],
                  options: dict[str, Any] | None = None, extra_args: dict[str, Any] | None = None,
                  lead_tiles: int = 0) -> Any:
    """A Gluon decode kernel on grid (head_blocks, splits, rows), then the combine when splits > 1: inputs already
    checked, no allocation, no sync. The kernels share triton_decode._decode_kernel's runtime arguments (extra_args:
    a kernel's own, by name; lead_tiles: triton_decode.choose_lead's); options are compile options (maxnreg) beside
    num_warps."""
    rows, heads = query.shape[0], query.shape[1]
    splits, lse_t = td.scratch(ws, rows, heads, splits, lse)
    compiled = call_kernel(kernel, (head_blocks, splits, rows), query, kv_rows, slots, counts, out, lse_t,
                           softmax_scale, output_scale, ws, splits, constexprs, options, extra_args, lead_tiles)
    td.combine(ws, out, lse_t, splits, output_scale)
    return compiled


def call_kernel(kernel: Any, grid: tuple[int, int, int], query, kv_rows, slots, counts, out, lse_t,
                softmax_scale: float, output_scale: float, ws: td.Workspace, splits: int,
                constexprs: dict[str, Any], options: dict[str, Any] | None = None,
                extra_args: dict[str, Any] | None = None, lead_tiles: int = 0) -> Any:
    """One launch of a Gluon decode kernel with triton_decode._decode_kernel's runtime arguments (lse_t: the LSE
    buffer to write, never None), no combine."""
    return kernel[grid](
        query, kv_rows, slots, counts,
        out, lse_t, ws.part_out, ws.part_lse,
        query.shape[1], slots.shape[1], splits, lead_tiles if splits > 1 else 0,
        query.stride(0), query.stride(1), kv_rows.stride(0), slots.stride(0),
        out.stride(0), out.stride(1), lse_t.stride(0),
        softmax_scale * LOG2E, output_scale,
        **(extra_args or {}),
        **constexprs,
        num_warps=4,  # the default partition (a consumer warpgroup); warp_specialize adds the workers' warps
        **(options or {}),
    )


def launch(query, kv_rows, slots, counts, out, lse, softmax_scale: float, output_scale: float,
           ws: td.Workspace, splits: int, params: GluonParams, lead_tiles: int = 0) -> Any:
    """The main kernel (and the combine when splits > 1) on inputs already checked: no allocation, no sync."""
    return launch_kernel(gluon_decode_kernel, cdiv(query.shape[1], BLOCK_H), query, kv_rows, slots, counts,
                         out, lse, softmax_scale, output_scale, ws, splits, kernel_constexprs(params),
                         lead_tiles=lead_tiles)


def gluon_sparse_mla_decode(
    query: torch.Tensor,
    kv_rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    *,
    softmax_scale: float,
    output_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
    workspace: td.Workspace | None = None,
    splits: int | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    k_stages: int = DEFAULT_K_STAGES,
    v_slots: int = DEFAULT_V_SLOTS,
    cvt_rows: int = DEFAULT_CVT_ROWS,
    consumer_regs: int = DEFAULT_CONSUMER_REGS,
    producer_regs: int = DEFAULT_PRODUCER_REGS,
    lead_tiles: int = 0,
) -> Any:
    """Sparse MLA decode of an fp8 cache with the warp-specialized Gluon kernel, as triton_decode.sparse_mla_decode.

    query: (rows, H, 576) float8_e4m3fn raw values (q_scale folded into softmax_scale), H > 32 (64-head tiles).
    kv_rows: (num_rows, 576) float8_e4m3fn flat rows.
    slots: (rows, K) int32, valid flat rows first; entries past counts and -1 are ignored.
    counts: (rows,) int32.
    out: (rows, H, 512) bfloat16, written in full; lse: (rows, H) float32 natural log or None.
    workspace: triton_decode.make_workspace(..., config=gluon_config(block_n)) (None allocates one: tests only).
    splits: KV splits a row (None: triton_decode.choose_splits with gluon_config(block_n)).
    block_n .. producer_regs: GluonParams' fields; lead_tiles: as triton_decode.sparse_mla_decode's.
    Count 0 -> out 0, lse -inf. Returns the compiled kernel handle (registers, asm).
    """
    td.check_lead(lead_tiles)
    reason = gluon_unavailable_reason(query.device)
    if reason:
        raise RuntimeError(f"the Gluon decode kernel cannot run here: {reason}")
    td._check_inputs(query, kv_rows, slots, counts, "fp8", out, lse)
    rows, heads = query.shape[0], query.shape[1]
    if heads <= 32:
        raise ValueError(f"query must have > 32 heads for the 64-head Gluon kernel, got {heads}")
    params = GluonParams(block_n=block_n, k_stages=k_stages, v_slots=v_slots, cvt_rows=cvt_rows,
                         consumer_regs=consumer_regs, producer_regs=producer_regs)
    cfg = params.config()
    if rows == 0:  # nothing to launch (and no workspace to size)
        return None
    workspace, splits = td.one_off_scratch(query, slots, "fp8", cfg, workspace, splits)
    return launch(query, kv_rows, slots, counts, out, lse, softmax_scale, output_scale, workspace, splits, params,
                  lead_tiles)
