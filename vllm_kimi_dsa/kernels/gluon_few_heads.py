"""The few-heads warp-specialized Gluon decode for Hopper (sm_90a), <= 32 heads in 16- or 8-head blocks: kernel,
params, launch.

Tokens and latent dims on the wgmma's M, heads on its N = 16 or 8 (the transposed form). fp8 rows (reg_v): one
gatherer warpgroup fills a K ring; the consumer loads P.V's latent from the K stage straight into registers, at one
or two CTAs an SM. nvfp4_ds_mla rows: a gatherer moves them into a packed ring and a converter warpgroup writes each
tile as e4m3 into an fp8 K ring (formats.nvfp4_as_fp8), so the same consumer runs at one CTA an SM. Heads past H in a
block are zero queries, masked at the store (no copy of the query). Same grid, runtime arguments, split scratch and
combine as the plain kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton

from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM, NVFP4_ROW_BYTES, ROPE_DIM
from vllm_kimi_dsa.kernels.common import LN2, Workspace
from vllm_kimi_dsa.kernels.common.gluon import (
    alloc_fp8_q_and_ring,
    convert_tile_e4m3,
    e4m3_scale_bytes,
    fence_async_shared,
    gatherer,
    gl,
    gluon,
    latent_store_layout,
    launch_kernel,
    mbarrier,
    normalizers,
    one_off_call,
    store_latent,
    store_q,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
    work_item,
)
from vllm_kimi_dsa.planning import Config
from vllm_kimi_dsa.planning.configs import FEW_BLOCK_H as BLOCK_H
from vllm_kimi_dsa.planning.configs import FEW_BLOCK_N as BLOCK_N
from vllm_kimi_dsa.planning.configs import few_heads_params_config

# 17..32 heads run as 16-head blocks (MULTI_HB), each CTA gathering the rows again (from L2 when its sibling
# runs beside it); a 32-head consumer would spill
MAX_HEADS = 2 * BLOCK_H
# the wgmma N a consumer may take: 16 (12..16 heads pad to it) or 8 (1..8 heads: half the consumer's MMA and softmax
# work of a 16-head block); Triton shapes are powers of two
BLOCK_HS = (8, 16)
# Hopper's per-SM budgets (sm_90): shared memory a CTA may take in all (228 KB less 1 KB a CTA), 32-bit registers
SMEM_PER_SM = 228 * 1024
REGS_PER_SM = 65536
DEFAULT_CVT_ROWS = 32


if gl is not None:
    _D = gl.constexpr(LATENT_DIM)
    _BN = gl.constexpr(BLOCK_N)

    @triton.constexpr_function
    def _mma_layout(BH, k):
        """The wgmma accumulator layout of a (tokens or latent dims) x BH-heads tile, instruction K k: 32 for S^T
        on fp8 operands, 16 for O^T (and nvfp4's fp16 latent logits)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BH, k])

    @gluon.jit
    def _consumer_state(BH: gl.constexpr):
        """A consumer's starting softmax state and accumulators: the running max, per-thread shares of the row sums
        (summed down the tokens once, after the loop: no reduction a tile), O^T as two 256-row halves (latent dims
        0..255 / 256..511; nvfp4: even / odd; reg_v: _V_CHUNK_LAYOUT's rows), and Q.K's zero accumulator."""
        s_layout: gl.constexpr = _mma_layout(BH, 32)
        o_layout: gl.constexpr = _mma_layout(BH, 16)
        m_i = gl.full([BH], float("-inf"), gl.float32, gl.SliceLayout(0, s_layout))
        l_acc = gl.zeros([_BN, BH], gl.float32, s_layout)
        acc0 = gl.zeros([256, BH], gl.float32, o_layout)
        acc1 = gl.zeros([256, BH], gl.float32, o_layout)
        s_zero = gl.zeros([_BN, BH], gl.float32, s_layout)
        return m_i, l_acc, acc0, acc1, s_zero

    # REG_V: the latent of a 16-token k-step as P.V's A operand straight from the K stage into registers. Row i of
    # O^T (the wgmma M: i = 64 m + 16 w + 8 h + r for warp w, lane row r, half h, repetition m) holds latent dim
    # 16 (8 w + r) + 2 m + h (+ 8 in acc1), so a thread's 16 dims of a token are 16 contiguous stage bytes (one
    # LDS.128; 8 lanes of a load on 4 rows x 2 chunks: conflict-free under the 128-byte swizzle) and the register
    # shuffle into the wgmma fragment stays inside the thread. Shape [16 tokens, 512 dims].
    _V_CHUNK_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [8, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 16], [0, 32], [0, 64]],
        warp_bases=[[0, 128], [0, 256]], block_bases=[], shape=[16, 512]))

    # O^T in latent order for the REG_V epilogue: a thread's own 16 contiguous dims (and 2 heads, twice), reached
    # in the thread; stored from latent_store_layout
    _O_STORE_LAYOUT = gl.constexpr(gl.BlockedLayout([16, 2], [8, 4], [4, 1], [0, 1]))

    @gluon.jit
    def _v_chunk(k_stage, kk: gl.constexpr, BH: gl.constexpr):
        """Tokens 16 kk .. 16 kk + 15 of a K stage's latent as the two fp16 A operands (acc0's rows, acc1's) of
        O^T += V^T P^T, in the REG_V row order above (exact: e4m3 -> fp16)."""
        x = k_stage.slice(16 * kk, 16, dim=0).load(_V_CHUNK_LAYOUT).to(gl.float16)
        # dim = 128 w + 16 r + 8 half + 2 m + h  ->  (m, w, h, r, token, half)
        x = gl.permute(gl.reshape(x, [16, 4, 8, 2, 4, 2]), (4, 1, 5, 2, 0, 3))
        lo, hi = gl.split(gl.reshape(x, [256, 16, 2]))
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_mma_layout(BH, 16), k_width=2)
        return gl.convert_layout(lo, a_layout), gl.convert_layout(hi, a_layout)

    @gluon.jit
    def _regv_pv(k_stage, p_t, a0, a1, BH: gl.constexpr, IN_FLIGHT: gl.constexpr):
        """Issue O^T += V^T P^T for one tile, its latent from k_stage through registers (_v_chunk), into the
        in-flight accumulators a0 / a1 (REG_V row order); the caller waits. At most IN_FLIGHT of the 4 chunks'
        register operands (32 registers each) are held by wgmmas in flight."""
        for kk in gl.static_range(4):
            if kk >= IN_FLIGHT:
                a0, a1 = warpgroup_mma_wait(num_outstanding=2 * (IN_FLIGHT - 1), deps=(a0, a1))
            a_lo, a_hi = _v_chunk(k_stage, kk, BH)
            a0 = warpgroup_mma(a_lo, p_t.slice(16 * kk, 16, dim=0), a0, is_async=True)
            a1 = warpgroup_mma(a_hi, p_t.slice(16 * kk, 16, dim=0), a1, is_async=True)
        return a0, a1

    @gluon.jit
    def _regv_tiles(
        q_lat_s, q_rope_s, k_lat_s, k_rope_s, bias_s, p_s, k_ready, k_empty, j0, num_tiles, qk_scale,
        BH: gl.constexpr, K_STAGES: gl.constexpr, PV_IN_FLIGHT: gl.constexpr, PV_EARLY: gl.constexpr,
        c_ready=None, c_empty=None, CONVERTED: gl.constexpr = False, fac_s=None,
    ):
        """REG_V's tile loop over K-ring uses j0 .. j0 + num_tiles - 1 (a split's tiles): Q.K, the online softmax and
        P.V with the latent from the K stage through registers (_v_chunk), so no fp16 copy of it (a V16 ring) is
        written or read (64 KB of shared-memory traffic a tile each way). Tile it - 1's stage is held until its P.V
        operands are loaded in iteration it, then released (k_empty counts 1). Returns (acc0, acc1, m_i, l_acc), every
        wgmma retired.

        CONVERTED (nvfp4 rows, _e4m3_converter): the stage's latent is the converter's (c_ready); the gathered RoPE
        and bias are released after Q.K (k_empty counts the converter too), the latent after P.V's loads (c_empty).
        Its rows' factors (fac_s, 2**s: the latent holds value x 2**-s) scale the latent logits (the RoPE part, never
        shifted, added after) and P."""
        s_layout: gl.constexpr = _mma_layout(BH, 32)
        o_layout: gl.constexpr = _mma_layout(BH, 16)
        tok_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        head_o_layout: gl.constexpr = gl.SliceLayout(0, o_layout)
        m_i, l_acc, acc0, acc1, s_zero = _consumer_state(BH)
        q_lat_t = q_lat_s.permute((1, 0))
        q_rope_t = q_rope_s.permute((1, 0))
        p_t = p_s.permute((1, 0))
        for it in range(num_tiles):
            j = j0 + it
            stage = j % K_STAGES
            if not PV_EARLY:
                mbarrier.wait(k_ready.index(stage), (j // K_STAGES) & 1)
                fence_async_shared()
            a0 = warpgroup_mma_init(acc0)
            a1 = warpgroup_mma_init(acc1)
            if CONVERTED:
                mbarrier.wait(c_ready.index(stage), (j // K_STAGES) & 1)
            if it > 0:
                a0, a1 = _regv_pv(k_lat_s.index((j + K_STAGES - 1) % K_STAGES), p_t, a0, a1, BH, PV_IN_FLIGHT)
                if CONVERTED:
                    mbarrier.arrive(c_empty.index((j + K_STAGES - 1) % K_STAGES))
                else:
                    mbarrier.arrive(k_empty.index((j + K_STAGES - 1) % K_STAGES))
            if PV_EARLY:  # tile it - 1's stage is free before the wait for tile it
                mbarrier.wait(k_ready.index(stage), (j // K_STAGES) & 1)
                fence_async_shared()
            bias = bias_s.index(stage).load(tok_layout)
            s = warpgroup_mma(k_lat_s.index(stage), q_lat_t, s_zero, use_acc=False, is_async=True)
            if CONVERTED:  # the RoPE part in an accumulator of its own (8 registers), so neither waits for the other
                s_rope = warpgroup_mma(k_rope_s.index(stage), q_rope_t, s_zero, use_acc=False, is_async=True)
                s, s_rope, acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(s, s_rope, a0, a1))
                fac = gl.expand_dims(fac_s.index(stage).load(tok_layout), 1)
                s = s * fac + s_rope
                mbarrier.arrive(k_empty.index(stage))  # the gathered RoPE and bias of this stage are read
            else:
                s = warpgroup_mma(k_rope_s.index(stage), q_rope_t, s, is_async=True)
                s, acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(s, a0, a1))
            p, m_i, l_acc, acc0, acc1 = _softmax_step(s, bias, m_i, l_acc, acc0, acc1, qk_scale, head_o_layout)
            if CONVERTED:
                p = p * fac
            p_s.store(gl.permute(p.to(gl.float16), (1, 0)))
            fence_async_shared()
        if num_tiles > 0:
            last = (j0 + num_tiles - 1) % K_STAGES
            a0, a1 = _regv_pv(k_lat_s.index(last), p_t, warpgroup_mma_init(acc0), warpgroup_mma_init(acc1), BH,
                              PV_IN_FLIGHT)
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(a0, a1))
        return acc0, acc1, m_i, l_acc

    @gluon.jit
    def _regv_epilogue(acc0, acc1, m_i, l_acc, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                       row, part, h0, H, stride_o_row, stride_o_head, stride_lse_row, out_scale,
                       BH: gl.constexpr):
        """The epilogue for REG_V's accumulators, as the plain kernel's: O^T back to latent order in the thread (row i = 64 m
        + 16 w + 8 h + r of acc0 / acc1 (half) is dim 128 w + 16 r + 8 half + 2 m + h), then stored in whole
        sectors (latent_store_layout: the MMA order wrote 8x the sectors, the in-thread order 2-4x); part >= 0: the
        partial at entries part * H + head."""
        l_i = gl.sum(l_acc, axis=0)
        o = gl.reshape(gl.join(acc0, acc1), [4, 4, 2, 8, BH, 2])
        o = gl.convert_layout(gl.reshape(gl.permute(o, (1, 3, 5, 0, 2, 4)), [512, BH]), _O_STORE_LAYOUT)
        inv, lse2 = normalizers(l_i, m_i)
        o = o * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(0, _O_STORE_LAYOUT)), 0)
        if part < 0:
            store_latent(o * out_scale, out_ptr + row.to(gl.int64) * stride_o_row, stride_o_head, h0, H,
                            latent_store_layout(512, BH, 16, 2))
        else:
            store_latent(o, part_out_ptr + (part * H).to(gl.int64) * _D, _D, h0, H,
                            latent_store_layout(512, BH, 16, part_out_ptr.dtype.element_ty.primitive_bitwidth // 8))
        _store_lse(lse2, lse_ptr, part_lse_ptr, row, part, h0, H, stride_lse_row, BH)

    @gluon.jit
    def _regv_consumer(
        q_lat_s, q_rope_s, k_lat_s, k_rope_s, bias_s, p_s, k_ready, k_empty,
        out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
        row, part, h0, num_tiles, H,
        stride_o_row, stride_o_head, stride_lse_row,
        qk_scale, out_scale,
        BH: gl.constexpr, K_STAGES: gl.constexpr, PV_IN_FLIGHT: gl.constexpr, PV_EARLY: gl.constexpr,
        c_ready=None, c_empty=None, CONVERTED: gl.constexpr = False, fac_s=None,
    ):
        """The REG_V consumer (fp8 rows, or nvfp4 rows CONVERTED to e4m3): _regv_tiles over this piece's tiles, then
        the epilogue."""
        acc0, acc1, m_i, l_acc = _regv_tiles(q_lat_s, q_rope_s, k_lat_s, k_rope_s, bias_s, p_s, k_ready, k_empty,
                                             0, num_tiles, qk_scale, BH, K_STAGES, PV_IN_FLIGHT, PV_EARLY,
                                             c_ready, c_empty, CONVERTED, fac_s)
        _regv_epilogue(acc0, acc1, m_i, l_acc, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                       row, part, h0, H, stride_o_row, stride_o_head, stride_lse_row, out_scale, BH)

    @gluon.jit
    def _softmax_step(s, bias, m_i, l_acc, acc0, acc1, qk_scale, head_o_layout: gl.constexpr):
        """Online softmax in base 2 down the tokens (axis 0), as the plain kernel's with SWAP: the tile's P,
        the new running max, the per-thread row-sum shares and O^T rescaled."""
        s = s * qk_scale + gl.expand_dims(bias, 1)
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - gl.expand_dims(m_use, 0))
        l_acc = l_acc * gl.expand_dims(alpha, 0) + p
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, head_o_layout), 0)
        return p, m_new, l_acc, acc0 * alpha_o, acc1 * alpha_o

    @gluon.jit
    def _store_lse(lse2, lse_ptr, part_lse_ptr, row, part, h0, H, stride_lse_row, BH: gl.constexpr):
        """The LSE (natural log) of a whole row (part < 0), or a piece's base-2 LSE beside its partial."""
        offs_h = h0 + gl.arange(0, BH, gl.SliceLayout(0, _mma_layout(BH, 32)))
        if part < 0:
            gl.store(lse_ptr + row * stride_lse_row + offs_h, lse2 * LN2, mask=offs_h < H)
        else:
            gl.store(part_lse_ptr + part * H + offs_h, lse2, mask=offs_h < H)

    _PLAIN2 = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    # P (heads x 64 tokens, fp16) as the wgmma's B operand
    _P_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))

    @gluon.jit
    def _alloc_k_ring(BH: gl.constexpr, K_STAGES: gl.constexpr, K_EMPTY: gl.constexpr):
        """P (heads x tokens, read as P^T), the token bias, and the K ring's mbarriers, initialized: k_ready (the
        gatherer's cp.async arrivals + its bias publish), k_empty (K_EMPTY arrivals free a stage)."""
        p_s = gl.allocate_shared_memory(gl.float16, [BH, _BN], _P_LAYOUT)
        bias_s = gl.allocate_shared_memory(gl.float32, [K_STAGES, _BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(K_STAGES):
            mbarrier.init(k_ready.index(i), count=129)
            mbarrier.init(k_empty.index(i), count=K_EMPTY)
        return p_s, bias_s, k_ready, k_empty

    @gluon.jit
    def _e4m3_converter(
        pk_s, sc_s, k_lat_s, fac_s, scf_s, k_ready, k_empty, c_ready, c_empty, num_tiles,
        BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, CVT_ROWS: gl.constexpr,
    ):
        """Tile j's latent through e4m3 (common.gluon.convert_tile_e4m3; its rows' factors into fac_s, its shifted
        scales into scf_s by tile parity) into the fp8 K stage the REG_V consumer reads (c_ready); then release the
        packed stage."""
        for j in range(num_tiles):
            stage = j % K_STAGES
            mbarrier.wait(k_ready.index(stage), (j // K_STAGES) & 1)
            mbarrier.wait(c_empty.index(stage), ((j // K_STAGES) & 1) ^ 1)
            convert_tile_e4m3(pk_s.index(stage), sc_s.index(stage), k_lat_s.index(stage), fac_s.index(stage),
                              scf_s.index(j % 2), BLOCK_N, CVT_ROWS)
            fence_async_shared()
            mbarrier.arrive(c_ready.index(stage))
            mbarrier.arrive(k_empty.index(stage))

    @gluon.jit
    def _nvfp4_e4m3_body(
        q_ptr, kv_ptr, slots_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
        row, part, h0, start, end, num_tiles, H,
        stride_q_row, stride_q_head, stride_kv, stride_s_row,
        stride_o_row, stride_o_head, stride_lse_row, qk_scale, out_scale,
        BH: gl.constexpr, K_STAGES: gl.constexpr, CVT_ROWS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        CVT_REGS: gl.constexpr, PV_IN_FLIGHT: gl.constexpr,
    ):
        """few_heads_kernel for nvfp4_ds_mla rows through e4m3: the gatherer moves packed bytes and scales into a
        packed ring and the RoPE and bias into the fp8 ring's stage, _e4m3_converter writes the stage's latent as
        e4m3, and the fp8 REG_V consumer runs as on an fp8 cache (fp8 Q, both GEMMs as there)."""
        q_lat_s, q_rope_s, k_lat_s, k_rope_s = alloc_fp8_q_and_ring(BH, _BN, K_STAGES)
        pk_s = gl.allocate_shared_memory(gl.uint8, [K_STAGES, _BN, 256], _PLAIN2)
        sc_s = gl.allocate_shared_memory(gl.uint8, [K_STAGES, _BN, 32], _PLAIN2)
        fac_s = gl.allocate_shared_memory(gl.float32, [K_STAGES, _BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        scf_s = gl.allocate_shared_memory(gl.float16, [2, _BN, 32], _PLAIN2)  # the converter's, by tile parity
        p_s, bias_s, k_ready, k_empty = _alloc_k_ring(BH, K_STAGES, 2)  # k_empty: the converter and the consumer
        c_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        c_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(K_STAGES):
            mbarrier.init(c_ready.index(i), count=1)
            mbarrier.init(c_empty.index(i), count=1)
        store_q(q_ptr, row, h0, H, stride_q_row, stride_q_head, q_lat_s, q_rope_s, BH)
        fence_async_shared()

        gl.warp_specialize(
            [
                (_regv_consumer, (q_lat_s, q_rope_s, k_lat_s, k_rope_s, bias_s, p_s, k_ready, k_empty,
                                  out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                                  row, part, h0, num_tiles, H,
                                  stride_o_row, stride_o_head, stride_lse_row, qk_scale, out_scale,
                                  BH, K_STAGES, PV_IN_FLIGHT, False, c_ready, c_empty, True, fac_s)),
                (gatherer, (pk_s, k_rope_s, bias_s, k_ready, k_empty,
                            kv_ptr, slots_ptr, row, start, end, num_tiles, stride_kv, stride_s_row,
                            _BN, K_STAGES, sc_s, True)),
                (_e4m3_converter, (pk_s, sc_s, k_lat_s, fac_s, scf_s, k_ready, k_empty, c_ready, c_empty, num_tiles,
                                   _BN, K_STAGES, CVT_ROWS)),
            ],
            [4, 4],
            [PRODUCER_REGS, CVT_REGS],
        )

    @gluon.jit(do_not_specialize=["lead_tiles"])  # one compile for every plan's lead
    def few_heads_kernel(
        q_ptr, kv_ptr, slots_ptr, counts_ptr, items_ptr,
        out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
        H, K, num_splits, lead_tiles,
        stride_q_row, stride_q_head, stride_kv, stride_s_row,
        stride_o_row, stride_o_head, stride_lse_row,
        qk_scale, out_scale,
        BH: gl.constexpr,  # heads a CTA, the wgmma N (8 or 16; padded heads are zero queries, masked at the store)
        K_STAGES: gl.constexpr,
        CVT_ROWS: gl.constexpr,  # nvfp4: rows the converter decodes a step
        PRODUCER_REGS: gl.constexpr,  # reg_v: setmaxnreg of the gatherer
        NVFP4: gl.constexpr,  # nvfp4_ds_mla rows (352 B): _nvfp4_e4m3_body; else fp8 rows
        MULTI_HB: gl.constexpr,  # H > BH: program_id(0) is the head block (each gathers the rows: L2 hits)
        PV_IN_FLIGHT: gl.constexpr = 4,  # REG_V: P.V chunks (of 4) whose register operands are in flight at once
        PV_EARLY: gl.constexpr = False,  # REG_V: P.V of tile it - 1 issued before the wait for tile it
        CVT_REGS: gl.constexpr = 136,  # nvfp4: setmaxnreg of the converter
        SCHEDULED: gl.constexpr = False,  # grid (head blocks, items): each CTA's piece from items_ptr (work_item)
    ):
        """One (head block, split, row): triton_decode.decode_kernel with SWAP and BLOCK_H = BH."""
        row, start, end, num_tiles, part = work_item(items_ptr, counts_ptr, num_splits, lead_tiles, K, _BN,
                                                     SCHEDULED)
        if SCHEDULED:
            if row < 0:  # an idle item
                return
        if MULTI_HB:
            h0 = gl.program_id(0) * BH
        else:
            h0 = 0

        if NVFP4:
            _nvfp4_e4m3_body(q_ptr, kv_ptr, slots_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                             row, part, h0, start, end, num_tiles, H,
                             stride_q_row, stride_q_head, stride_kv, stride_s_row,
                             stride_o_row, stride_o_head, stride_lse_row, qk_scale, out_scale,
                             BH, K_STAGES, CVT_ROWS, PRODUCER_REGS, CVT_REGS, PV_IN_FLIGHT)
            return

        # fp8 (REG_V): the consumer alone frees a stage
        q_lat_s, q_rope_s, k_lat_s, k_rope_s = alloc_fp8_q_and_ring(BH, _BN, K_STAGES)
        p_s, bias_s, k_ready, k_empty = _alloc_k_ring(BH, K_STAGES, 1)

        # Q into shared memory, by this (consumer) warpgroup
        store_q(q_ptr, row, h0, H, stride_q_row, stride_q_head, q_lat_s, q_rope_s, BH)
        fence_async_shared()

        # (the consumer's arguments are spelled out: a tuple variable loses its constexprs)
        gl.warp_specialize(
            [
                (_regv_consumer, (q_lat_s, q_rope_s, k_lat_s, k_rope_s, bias_s, p_s, k_ready, k_empty,
                                  out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                                  row, part, h0, num_tiles, H,
                                  stride_o_row, stride_o_head, stride_lse_row, qk_scale, out_scale,
                                  BH, K_STAGES, PV_IN_FLIGHT, PV_EARLY)),
                (gatherer, (k_lat_s, k_rope_s, bias_s, k_ready, k_empty,
                                kv_ptr, slots_ptr, row, start, end, num_tiles, stride_kv, stride_s_row,
                                _BN, K_STAGES)),
            ],
            [4],
            [PRODUCER_REGS],
        )


# ----------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class FewHeadsParams:
    """Compile-time shape of the few-heads Gluon kernel (16 or 8 heads a consumer: at 32 the consumer spills,
    gluon_report): fp8 rows with P.V's latent through registers (reg_v), or nvfp4_ds_mla rows (nvfp4) converted to
    e4m3 for the same consumer."""

    k_stages: int = 3  # K ring depth (the gathers in flight)
    cvt_rows: int = DEFAULT_CVT_ROWS  # nvfp4: rows the converter decodes a step
    producer_regs: int = 96  # setmaxnreg of the gatherer
    # nvfp4_ds_mla rows: _nvfp4_e4m3_body (the gatherer fills a packed ring, the converter warpgroup writes each tile
    # as e4m3 into the fp8 K ring: rounds each e2m1 x scale product to e4m3's 3 mantissa bits)
    nvfp4: bool = False
    # fp8 rows: the gatherer is the one producer warpgroup; the consumer loads P.V's latent from the K stage into
    # registers (_regv_consumer; the nvfp4 form's consumer too)
    reg_v: bool = True
    # P.V chunks (16 tokens, 32 registers of A operand each) in flight at once; fewer fit a smaller register budget
    # (ptxas serializes the wgmmas when they do not fit)
    pv_in_flight: int = 4
    # CTAs an SM the kernel is compiled for (maxnreg 65536 / (256 threads x this)); 2 needs reg_v and K ring 2
    ctas_per_sm: int = 1
    # reg_v: issue P.V of tile it - 1 (and free its stage) before waiting for tile it to land, not after
    pv_early: bool = False
    converter_regs: int = 136  # nvfp4: setmaxnreg of the converter (at 128 it spills 8 B)
    # heads a CTA, the wgmma N (BLOCK_HS): 16, or (fp8, reg_v) 8 for 1..8 heads, not padded to 16
    block_h: int = BLOCK_H

    def __post_init__(self) -> None:
        if self.reg_v == self.nvfp4:
            raise ValueError("exactly one of reg_v (fp8 rows) and nvfp4 (nvfp4_ds_mla rows) must be set")
        if self.block_h not in BLOCK_HS or (self.block_h != BLOCK_H and not self.reg_v):
            raise ValueError(f"block_h must be one of {BLOCK_HS} (8: fp8 rows, reg_v), got {self.block_h}")
        if self.converter_regs % 8 or not 56 <= self.converter_regs <= 256:
            raise ValueError(f"converter_regs must be a multiple of 8 in [56, 256], got {self.converter_regs}")
        if self.cvt_rows not in (8, 16, 32):
            raise ValueError(f"cvt_rows must be 8, 16 or 32, got {self.cvt_rows}")
        if self.producer_regs % 8 or not 56 <= self.producer_regs <= 256:
            raise ValueError(f"producer_regs must be a multiple of 8 in [56, 256], got {self.producer_regs}")
        if self.pv_in_flight not in (1, 2, 3, 4):
            raise ValueError(f"pv_in_flight must be in 1..4, got {self.pv_in_flight}")
        if self.ctas_per_sm not in (1, 2):
            raise ValueError(f"ctas_per_sm must be 1 or 2, got {self.ctas_per_sm}")
        if self.ctas_per_sm == 2 and not (self.reg_v and self.pv_in_flight <= 2
                                          and self.smem_bytes() <= SMEM_PER_SM // 2 - 1024):
            raise ValueError("ctas_per_sm=2 needs reg_v, pv_in_flight <= 2 (128 registers a thread at launch) and "
                             f"half an SM's shared memory (k_stages=2), got {self}")
        if self.k_stages < 2 or self.smem_bytes() > 227 * 1024:
            raise ValueError(f"k_stages >= 2 must fit 227 KB of shared memory, got {self.k_stages} "
                             f"({self.smem_bytes()} B)")

    def smem_bytes(self) -> int:
        """Q, the K ring (nvfp4: and the packed ring, the rows' factors, two tiles' fp16 scales), P, plus ~2 KB
        (bias, mbarriers, warp-specialize state)."""
        stage = BLOCK_N * HEAD_DIM  # 576 e4m3 a row (latent + RoPE)
        scales = 0
        if self.nvfp4:  # + 256 packed and 32 scale bytes a row
            stage += BLOCK_N * (NVFP4_ROW_BYTES - ROPE_DIM)
            scales = e4m3_scale_bytes(BLOCK_N, self.k_stages)
        bh = self.block_h
        return bh * HEAD_DIM + self.k_stages * stage + scales + bh * BLOCK_N * 2 + 2048

    def config(self, heads: int | None = None) -> Config:
        """The triton_decode.Config the split heuristic and the workspace see (block_h-head blocks, ctas_per_sm; at
        two CTAs an SM the tile cost of this head count's blocks; reg_v: uneven one-launch plans allowed). heads: the
        layer's (default: one block's)."""
        return few_heads_params_config(heads or self.block_h, self.reg_v, self.ctas_per_sm, self.block_h)

    def launch_options(self) -> dict[str, Any]:
        """Compile options beside the constexprs: two CTAs an SM get half the register file each (reg_v: 8 warps)."""
        return {"maxnreg": REGS_PER_SM // (8 * 32 * self.ctas_per_sm)} if self.ctas_per_sm > 1 else {}


def nvfp4_params() -> FewHeadsParams:
    """nvfp4_ds_mla: K ring 3 (a stage 36 KB fp8 + 18 KB packed), the gatherer 96 registers, the converter 136."""
    return FewHeadsParams(k_stages=3, nvfp4=True, reg_v=False, producer_regs=96, converter_regs=136)


def reg_v_params(ctas_per_sm: int = 1, block_h: int = BLOCK_H) -> FewHeadsParams:
    """fp8 with P.V's latent through registers: one CTA an SM (K ring 3), or two CTAs an SM (K ring 2 each, two P.V
    chunks in flight, the gatherer 56 registers and the consumer 200, P.V issued before the wait for the next tile).
    block_h: heads a consumer (8: 1..8 heads without padding to 16)."""
    if ctas_per_sm == 2:
        return FewHeadsParams(reg_v=True, k_stages=2, pv_in_flight=2, ctas_per_sm=2, producer_regs=56, pv_early=True,
                              block_h=block_h)
    return FewHeadsParams(reg_v=True, k_stages=3, block_h=block_h)


def kernel_constexprs(params: FewHeadsParams, heads: int = BLOCK_H) -> dict[str, Any]:
    """few_heads_kernel's compile-time arguments for these params and head count (MULTI_HB above one block)."""
    return dict(MULTI_HB=heads > params.block_h, BH=params.block_h, K_STAGES=params.k_stages,
                CVT_ROWS=params.cvt_rows, PRODUCER_REGS=params.producer_regs, NVFP4=params.nvfp4,
                PV_IN_FLIGHT=params.pv_in_flight, PV_EARLY=params.pv_early, CVT_REGS=params.converter_regs)


def launch(query, kv_rows, slots, counts, out, lse, softmax_scale: float, output_scale: float,
           ws: Workspace, splits: int, params: FewHeadsParams, lead_tiles: int = 0, tabs: Any = None) -> Any:
    """The main kernel (params.block_h-head blocks) and the combine when splits > 1: inputs already checked, no
    allocation, no sync. tabs: a scheduled launch's tables (common.schedule.ScheduleTables) instead of splits."""
    heads = query.shape[1]
    return launch_kernel(few_heads_kernel, -(-heads // params.block_h), query, kv_rows, slots, counts, out, lse,
                            softmax_scale, output_scale, ws, splits, kernel_constexprs(params, heads),
                            params.launch_options(), lead_tiles=lead_tiles, tabs=tabs)


def few_heads_sparse_mla_decode(
    query: torch.Tensor,
    kv_rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    *,
    softmax_scale: float,
    output_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
    workspace: Workspace | None = None,
    splits: int | None = None,
    params: FewHeadsParams | None = None,
    lead_tiles: int = 0,
    scheduled: bool = False,
) -> Any:
    """Sparse MLA decode for <= 32 heads with this file's kernel, as gluon_sparse_mla_decode: an fp8 cache, or an
    nvfp4_ds_mla one with params=nvfp4_params() (or any FewHeadsParams with nvfp4=True).

    query: (rows, H, 576) float8_e4m3fn, 1 <= H <= 32 (MAX_HEADS; above params.block_h, blocks of that many).
    Other arguments (lead_tiles, scheduled too) as triton_decode.sparse_mla_decode; workspace from
    make_workspace(config=params.config()). Returns the compiled kernel handle.
    """
    params = params or reg_v_params()
    return one_off_call(launch, params, "nvfp4_ds_mla" if params.nvfp4 else "fp8", _bad_heads, query, kv_rows, slots,
                        counts, out, lse, softmax_scale, output_scale, workspace, splits, lead_tiles, scheduled)


def _bad_heads(heads: int) -> str:
    if heads <= MAX_HEADS:
        return ""
    return f"query must have at most {MAX_HEADS} heads for the few-heads Gluon kernel, got {heads}"
