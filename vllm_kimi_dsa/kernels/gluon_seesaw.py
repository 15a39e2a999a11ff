"""The seesaw 64-head Gluon decode for Hopper (sm_90a), FP8 and nvfp4_ds_mla rows: its kernel, params and launch.

Scheduled as FlashMLA's SM90 decode: consumer t % 2 owns tile t (Q.K, softmax, P and the running max published to
the other), both take P.V of every tile for their latent half, the latent read from the K ring through registers;
the running max passes back and forth, one hand-off a tile. A gatherer warpgroup fills the K ring; nvfp4_ds_mla rows
it gathers into a packed ring and converts to e4m3 K stages (formats.nvfp4_as_fp8), so the consumers are fp8's. Same
grid, runtime arguments, split scratch and combine as the plain kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_kimi_dsa.formats import HEAD_DIM, NVFP4_ROW_BYTES
from vllm_kimi_dsa.host_math import cdiv
from vllm_kimi_dsa.kernels.common import LN2, Workspace
from vllm_kimi_dsa.kernels.common.gluon import (
    alloc_fp8_q_and_ring,
    check_warpgroup_regs,
    e4m3_scale_bytes,
    fence_async_shared,
    gatherer,
    gl,
    gluon,
    latent_store_layout,
    launch_kernel,
    mbarrier,
    nvfp4_gatherer,
    one_off_call,
    store_latent,
    store_q,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
    work_item,
)
from vllm_kimi_dsa.planning import Config, gluon_config
from vllm_kimi_dsa.planning.configs import GLUON64_BLOCK_H as BLOCK_H

BLOCK_N = 64  # tokens a tile


if gl is not None:
    _BH = gl.constexpr(BLOCK_H)
    _BN = gl.constexpr(BLOCK_N)
    # S = Q K^T: 64 heads x 64 tokens (a row's max within a lane quad); O^T: 256 latent dims x 64 heads a consumer
    _S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32]))
    _O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_H, 16]))
    _P_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    # PV_FP8: P in e4m3 (64-byte rows), computed as 2**P_LOG2 p (the row sums too) so the smallest p e4m3 keeps
    # is 2**-17, not 2**-9, and the largest, 256, is below its 448
    _P8_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2))
    _P_LOG2 = gl.constexpr(8.0)
    _O8_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_H, 32]))
    _PLAIN = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # Consumer `half` takes latent dims 256 half .. + 255; its O^T row i = 64 m + 16 w + 8 h + r (warp w, lane row r,
    # half h of the fragment, repetition m) holds dim 256 half + 64 w + 8 r + 2 m + h, so a thread's 8 dims of a
    # token are 8 contiguous stage bytes (LDS.64; 16 lanes of a load on 4 rows x 4 chunks x both 8-byte halves:
    # conflict-free under the 128-byte swizzle). Shape [16 tokens, 256 dims].
    _V_HALF_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [8, 0]],
        lane_bases=[[2, 0], [4, 0], [0, 8], [0, 16], [0, 32]],
        warp_bases=[[0, 64], [0, 128]], block_bases=[], shape=[16, 256]))
    # PV_FP8: the same dims a thread, for 8 tokens (4 contiguous, twice 16 apart: the e4m3 A operand's k bits 0, 1
    # and 4) of a 32-token k-step; loaded as 8 LDS.64, then bytes moved in-thread to the operand's order.
    # Shape [32 tokens, 256 dims].
    _V8_HALF_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [16, 0]],
        lane_bases=[[4, 0], [8, 0], [0, 8], [0, 16], [0, 32]],
        warp_bases=[[0, 64], [0, 128]], block_bases=[], shape=[32, 256]))
    # O^T back in latent order for the epilogue: 8 contiguous dims (16-byte bf16 stores) and 2 heads a thread
    _O_STORE_LAYOUT = gl.constexpr(gl.BlockedLayout([8, 2], [8, 4], [4, 1], [0, 1]))

    @gluon.jit
    def _v_half_chunk(k_stage, kk: gl.constexpr, HALF: gl.constexpr):
        """Tokens 16 kk .. 16 kk + 15 of latent half HALF of a K stage as the fp16 A operand of O^T += V^T P^T."""
        x = k_stage.slice(16 * kk, 16, dim=0).slice(256 * HALF, 256, dim=1).load(_V_HALF_LAYOUT).to(gl.float16)
        # dim = 64 w + 8 r + 2 m + h  ->  (m, w, h, r, token)
        x = gl.reshape(gl.permute(gl.reshape(x, [16, 4, 8, 4, 2]), (3, 1, 4, 2, 0)), [256, 16])
        return gl.convert_layout(x, gl.DotOperandLayout(operand_index=0, parent=_O_LAYOUT, k_width=2))

    @gluon.jit
    def _v8_half_chunk(k_stage, kk: gl.constexpr, HALF: gl.constexpr):
        """Tokens 32 kk .. 32 kk + 31 of latent half HALF of a K stage as the e4m3 A operand of O^T += V^T P^T."""
        x = k_stage.slice(32 * kk, 32, dim=0).slice(256 * HALF, 256, dim=1).load(_V8_HALF_LAYOUT)
        x = gl.reshape(gl.permute(gl.reshape(x, [32, 4, 8, 4, 2]), (3, 1, 4, 2, 0)), [256, 32])
        return gl.convert_layout(x, gl.DotOperandLayout(operand_index=0, parent=_O8_LAYOUT, k_width=4))

    @gluon.jit
    def _issue_qk(t, q_lat_s, q_rope_s, k_lat_s, k_rope_s, k_ready, K_STAGES: gl.constexpr, fac_s=None,
                  NVFP4: gl.constexpr = False):
        """Wait for tile t's K stage and issue S_t = Q K_t^T (async; the caller retires it). NVFP4: the latent
        part retired first and its columns scaled by their rows' factors (fac_s: convert_tile_e4m3's 2**s), then
        the RoPE part (never shifted) added."""
        stage = t % K_STAGES
        mbarrier.wait(k_ready.index(stage), (t // K_STAGES) & 1)
        fence_async_shared()
        s_zero = gl.zeros([_BH, _BN], gl.float32, _S_LAYOUT)
        s = warpgroup_mma(q_lat_s, k_lat_s.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if NVFP4:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            s = s * gl.expand_dims(fac_s.index(stage).load(gl.SliceLayout(0, _S_LAYOUT)), 0)
        return warpgroup_mma(q_rope_s, k_rope_s.index(stage).permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _issue_pv(t, acc, k_lat_s, p_s, k_empty, HALF: gl.constexpr, K_STAGES: gl.constexpr,
                  IN_FLIGHT: gl.constexpr, PV_FP8: gl.constexpr = False):
        """Issue O^T[HALF] += V_t^T[HALF] P_t^T (4 k-steps of 16 tokens, PV_FP8: 2 of 32 on e4m3 wgmma; at most
        IN_FLIGHT register operands held by wgmmas in flight), then free tile t's K stage for this consumer (its
        operands are in registers by then). Returns the in-flight accumulator; the caller retires it."""
        stage = t % K_STAGES
        k_stage = k_lat_s.index(stage)
        p_t = p_s.index(t % 2).permute((1, 0))
        a = warpgroup_mma_init(acc)
        KSTEP: gl.constexpr = 32 if PV_FP8 else 16
        for kk in gl.static_range(_BN // KSTEP):
            if kk >= IN_FLIGHT:
                a = warpgroup_mma_wait(num_outstanding=IN_FLIGHT - 1, deps=(a,))
            if PV_FP8:
                v = _v8_half_chunk(k_stage, kk, HALF)
            else:
                v = _v_half_chunk(k_stage, kk, HALF)
            a = warpgroup_mma(v, p_t.slice(KSTEP * kk, KSTEP, dim=0), a, is_async=True)
        mbarrier.arrive(k_empty.index(stage))
        return a

    @gluon.jit
    def _rescale(acc, alpha, PV_FP8: gl.constexpr = False):
        """O^T's columns (heads) times alpha (a head's factor, in S's row layout)."""
        o_layout: gl.constexpr = _O8_LAYOUT if PV_FP8 else _O_LAYOUT
        return acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, o_layout)), 0)

    @gluon.jit
    def _own_tile(t, s, m_i, l_i, acc, k_lat_s, bias_s, p_s, x_s, k_empty, p_ready, p_empty, qk_scale,
                  HALF: gl.constexpr, K_STAGES: gl.constexpr, IN_FLIGHT: gl.constexpr, fac_s=None,
                  NVFP4: gl.constexpr = False, PV_FP8: gl.constexpr = False):
        """Tile t, this consumer's (S_t = s, retired): the online softmax from m_(t-1), P_t and m_t published for the
        other consumer, then this consumer's P.V of the tile, retired. Returns (m_t, l, O^T). NVFP4: P published
        times its rows' factors (their K stage latent holds value x 2**-s)."""
        bias = bias_s.index(t % K_STAGES).load(gl.SliceLayout(0, _S_LAYOUT))
        s = s * qk_scale + gl.expand_dims(bias, 0)
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        if PV_FP8:
            p = gl.exp2(s - gl.expand_dims(m_use - _P_LOG2, 1))
        else:
            p = gl.exp2(s - gl.expand_dims(m_use, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        b = t % 2
        # buffer b is free once the other consumer's P.V of tile t - 2 has retired (and it has read m_(t-2))
        if NVFP4:
            p = p * gl.expand_dims(fac_s.index(t % K_STAGES).load(gl.SliceLayout(0, _S_LAYOUT)), 0)
        mbarrier.wait(p_empty.index(b), ((t // 2) & 1) ^ 1)
        if PV_FP8:
            p_s.index(b).store(p.to(gl.float8e4nv))
        else:
            p_s.index(b).store(p.to(gl.float16))
        x_s.index(b).store(m_new)
        fence_async_shared()
        mbarrier.arrive(p_ready.index(b))
        a = _issue_pv(t, _rescale(acc, alpha, PV_FP8), k_lat_s, p_s, k_empty, HALF, K_STAGES, IN_FLIGHT, PV_FP8)
        return m_new, l_i, warpgroup_mma_wait(num_outstanding=0, deps=(a,))

    @gluon.jit
    def _other_tile(t, m_i, l_i, acc, k_lat_s, p_s, x_s, k_ready, k_empty, p_ready, p_empty,
                    HALF: gl.constexpr, K_STAGES: gl.constexpr, IN_FLIGHT: gl.constexpr,
                    PV_FP8: gl.constexpr = False):
        """Tile t, the other consumer's: take m_t and P_t from the owner, rescale and add this consumer's P.V of the
        tile; retired, the P buffer handed back. Returns (m_t, l, O^T)."""
        # the stage's bytes (read here through registers) are visible after its k_ready phase
        mbarrier.wait(k_ready.index(t % K_STAGES), (t // K_STAGES) & 1)
        b = t % 2
        mbarrier.wait(p_ready.index(b), (t // 2) & 1)
        m_new = x_s.index(b).load(gl.SliceLayout(1, _S_LAYOUT))
        alpha = gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))
        l_i = l_i * alpha
        a = _issue_pv(t, _rescale(acc, alpha, PV_FP8), k_lat_s, p_s, k_empty, HALF, K_STAGES, IN_FLIGHT, PV_FP8)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(a,))
        mbarrier.arrive(p_empty.index(b))
        return m_new, l_i, acc

    @gluon.jit
    def _epilogue(acc, m_i, l_i, l_s, l_ready, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, row, part, hb, H,
                  stride_o_row, stride_o_head, stride_lse_row, out_scale, HALF: gl.constexpr,
                  PV_FP8: gl.constexpr = False):
        """Both consumers' row-sum shares added (l_s, l_ready), then this consumer's 256 latent dims normalized into
        out (bf16) or (part >= 0) the partial (fp16, entries part * H + head), and (consumer 0) the LSE, as the plain
        kernel's epilogue."""
        head_s: gl.constexpr = gl.SliceLayout(1, _S_LAYOUT)
        l_s.index(HALF).store(l_i)
        mbarrier.arrive(l_ready.index(0))
        mbarrier.wait(l_ready.index(0), 0)
        l_i = l_s.index(0).load(head_s) + l_s.index(1).load(head_s)
        # common.gluon.normalizers, written out: the call (inv first) reorders this kernel's SASS
        has = l_i > 0.0
        m_l = m_i - _P_LOG2 if PV_FP8 else m_i  # PV_FP8: l holds 2**P_LOG2 times the row sums
        lse2 = gl.where(has, m_l + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
        inv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
        # row i = 64 m + 16 w + 8 h + r of O^T is dim 64 w + 8 r + 2 m + h of this half: in-thread to latent order
        o = gl.reshape(gl.permute(gl.reshape(acc, [4, 4, 2, 8, _BH]), (1, 3, 0, 2, 4)), [256, _BH])
        o = gl.convert_layout(o, _O_STORE_LAYOUT)
        o = o * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(0, _O_STORE_LAYOUT)), 0)
        offs_h_s = hb * _BH + gl.arange(0, _BH, head_s)
        if part < 0:
            store_latent(o * out_scale, out_ptr + row.to(gl.int64) * stride_o_row + 256 * HALF, stride_o_head,
                            hb * _BH, H, _O_STORE_LAYOUT)
            if HALF == 0:
                gl.store(lse_ptr + row * stride_lse_row + offs_h_s, lse2 * LN2, mask=offs_h_s < H)
        else:
            base = part * H
            store_latent(o, part_out_ptr + base.to(gl.int64) * 512 + 256 * HALF, 512, hb * _BH, H,
                            latent_store_layout(256, _BH, 8, part_out_ptr.dtype.element_ty.primitive_bitwidth // 8))
            if HALF == 0:
                gl.store(part_lse_ptr + base + offs_h_s, lse2, mask=offs_h_s < H)

    @gluon.jit
    def _consumer(
        q_lat_s, q_rope_s, k_lat_s, k_rope_s, bias_s, p_s, x_s, l_s,
        k_ready, k_empty, p_ready, p_empty, l_ready,
        out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
        row, part, hb, num_tiles, H,
        stride_o_row, stride_o_head, stride_lse_row, qk_scale, out_scale,
        HALF: gl.constexpr, K_STAGES: gl.constexpr, IN_FLIGHT: gl.constexpr, fac_s=None, NVFP4: gl.constexpr = False,
        PV_FP8: gl.constexpr = False,
    ):
        """Consumer HALF: owns the tiles t = HALF mod 2 (_own_tile) and takes P.V of the others (_other_tile), in
        tile order. Consumer 0 starts with tile 0; a consumer ends with the last tile when it is the other's.
        NVFP4: the K stages' rows carry factors (fac_s) for their logits and P."""
        m_i = gl.full([_BH], float("-inf"), gl.float32, gl.SliceLayout(1, _S_LAYOUT))
        l_i = gl.zeros([_BH], gl.float32, gl.SliceLayout(1, _S_LAYOUT))
        o_layout: gl.constexpr = _O8_LAYOUT if PV_FP8 else _O_LAYOUT
        acc = gl.zeros([256, _BH], gl.float32, o_layout)
        if HALF == 0:
            if num_tiles > 0:
                s = _issue_qk(0, q_lat_s, q_rope_s, k_lat_s, k_rope_s, k_ready, K_STAGES, fac_s, NVFP4)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                m_i, l_i, acc = _own_tile(0, s, m_i, l_i, acc, k_lat_s, bias_s, p_s, x_s, k_empty, p_ready, p_empty,
                                          qk_scale, HALF, K_STAGES, IN_FLIGHT, fac_s, NVFP4, PV_FP8)
        # the other's tile o - 1, then this consumer's tile o
        for o in range(2 - HALF, num_tiles, 2):
            m_i, l_i, acc = _other_tile(o - 1, m_i, l_i, acc, k_lat_s, p_s, x_s, k_ready, k_empty, p_ready, p_empty,
                                        HALF, K_STAGES, IN_FLIGHT, PV_FP8)
            s = warpgroup_mma_wait(num_outstanding=0,
                                   deps=(_issue_qk(o, q_lat_s, q_rope_s, k_lat_s, k_rope_s, k_ready, K_STAGES,
                                                   fac_s, NVFP4),))
            m_i, l_i, acc = _own_tile(o, s, m_i, l_i, acc, k_lat_s, bias_s, p_s, x_s, k_empty, p_ready, p_empty,
                                      qk_scale, HALF, K_STAGES, IN_FLIGHT, fac_s, NVFP4, PV_FP8)
        if (num_tiles > 0) & ((num_tiles - 1) % 2 != HALF):  # the last tile is the other's
            m_i, l_i, acc = _other_tile(num_tiles - 1, m_i, l_i, acc, k_lat_s, p_s, x_s, k_ready, k_empty, p_ready,
                                        p_empty, HALF, K_STAGES, IN_FLIGHT, PV_FP8)
        _epilogue(acc, m_i, l_i, l_s, l_ready, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, row, part, hb, H,
                  stride_o_row, stride_o_head, stride_lse_row, out_scale, HALF, PV_FP8)

    @gluon.jit(do_not_specialize=["lead_tiles"])  # one compile for every plan's lead
    def seesaw_decode_kernel(
        q_ptr, kv_ptr, slots_ptr, counts_ptr, items_ptr,
        out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
        H, K, num_splits, lead_tiles,
        stride_q_row, stride_q_head, stride_kv, stride_s_row,
        stride_o_row, stride_o_head, stride_lse_row,
        qk_scale, out_scale,
        K_STAGES: gl.constexpr,  # K ring depth (36 KB a stage)
        PV_IN_FLIGHT: gl.constexpr,  # P.V k-steps (of 4) whose register operands are in flight at once
        CONSUMER_REGS: gl.constexpr,  # setmaxnreg of consumer WG1 (WG0 gets 504 - the two requests)
        PRODUCER_REGS: gl.constexpr,  # setmaxnreg of the gatherer
        NVFP4: gl.constexpr = False,  # nvfp4_ds_mla rows: the gatherer converts them to fp8 K stages (e4m3)
        R_STAGES: gl.constexpr = 2,  # NVFP4: the packed ring's depth (22.3 KB a stage)
        CVT_ROWS: gl.constexpr = 8,  # NVFP4: rows a conversion step
        PV_FP8: gl.constexpr = False,  # P.V on e4m3 wgmma: P rounded to e4m3 (fp8 rows only)
        SCHEDULED: gl.constexpr = False,  # grid (head blocks, items): each CTA's piece from items_ptr (work_item)
    ):
        """One (64-head block, KV split, row), as gluon_decode.gluon_decode_kernel. NVFP4: the consumers read the
        e4m3 K stages nvfp4_gatherer writes (formats.nvfp4_as_fp8 of the rows)."""
        hb = gl.program_id(0)
        row, start, end, num_tiles, part = work_item(items_ptr, counts_ptr, num_splits, lead_tiles, K, _BN,
                                                     SCHEDULED)
        if SCHEDULED:
            if row < 0:  # an idle item
                return

        q_lat_s, q_rope_s, k_lat_s, k_rope_s = alloc_fp8_q_and_ring(_BH, _BN, K_STAGES)
        if PV_FP8:
            p_s = gl.allocate_shared_memory(gl.float8e4nv, [2, _BH, _BN], _P8_LAYOUT)
        else:
            p_s = gl.allocate_shared_memory(gl.float16, [2, _BH, _BN], _P_LAYOUT)
        bias_s = gl.allocate_shared_memory(gl.float32, [K_STAGES, _BN], _PLAIN)
        x_s = gl.allocate_shared_memory(gl.float32, [2, _BH], _PLAIN)
        l_s = gl.allocate_shared_memory(gl.float32, [2, _BH], _PLAIN)
        k_ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        l_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(K_STAGES):
            # the gatherer's cp.async arrivals + its bias publish; NVFP4: its one arrive once the stage is written
            mbarrier.init(k_ready.index(i), count=1 if NVFP4 else 129)
            mbarrier.init(k_empty.index(i), count=2)  # both consumers, their P.V operands loaded
        for i in gl.static_range(2):
            mbarrier.init(p_ready.index(i), count=1)  # the tile's owner
            mbarrier.init(p_empty.index(i), count=1)  # the other consumer, P.V retired
        mbarrier.init(l_ready.index(0), count=2)

        # Q (64 heads x 576 e4m3; padded heads 0) into shared memory, by this (default) warpgroup
        store_q(q_ptr, row, hb * _BH, H, stride_q_row, stride_q_head, q_lat_s, q_rope_s, _BH)
        fence_async_shared()

        # one warp_specialize a format: the packed ring exists only for nvfp4 (allocating it for fp8 too would move
        # the fp8 kernel's shared memory), and the partitions' argument tuples cannot be shared (a tuple variable
        # loses its constexprs)
        if NVFP4:  # the packed ring the gatherer converts from (a stage: packed bytes, scales, RoPE, bias)
            plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
            rope_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
            pk_s = gl.allocate_shared_memory(gl.uint8, [R_STAGES, _BN, 256], plain2)
            sc_s = gl.allocate_shared_memory(gl.uint8, [R_STAGES, _BN, 32], plain2)
            rope_s = gl.allocate_shared_memory(gl.float8e4nv, [R_STAGES, _BN, 64], rope_layout)
            bias_raw_s = gl.allocate_shared_memory(gl.float32, [R_STAGES, _BN], _PLAIN)
            fac_s = gl.allocate_shared_memory(gl.float32, [K_STAGES, _BN], _PLAIN)  # a K stage's rows' 2**s
            scf_s = gl.allocate_shared_memory(gl.float16, [2, _BN, 32], plain2)  # shifted scales, by tile parity
            r_ready = gl.allocate_shared_memory(gl.int64, [R_STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(R_STAGES):
                mbarrier.init(r_ready.index(i), count=128)  # the gathering threads' cp.async arrivals
            gl.warp_specialize(
                [
                    (_consumer, (q_lat_s, q_rope_s, k_lat_s, k_rope_s, bias_s, p_s, x_s, l_s,
                                 k_ready, k_empty, p_ready, p_empty, l_ready,
                                 out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                                 row, part, hb, num_tiles, H,
                                 stride_o_row, stride_o_head, stride_lse_row, qk_scale, out_scale,
                                 0, K_STAGES, PV_IN_FLIGHT, fac_s, True)),
                    (_consumer, (q_lat_s, q_rope_s, k_lat_s, k_rope_s, bias_s, p_s, x_s, l_s,
                                 k_ready, k_empty, p_ready, p_empty, l_ready,
                                 out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                                 row, part, hb, num_tiles, H,
                                 stride_o_row, stride_o_head, stride_lse_row, qk_scale, out_scale,
                                 1, K_STAGES, PV_IN_FLIGHT, fac_s, True)),
                    (nvfp4_gatherer, (pk_s, sc_s, rope_s, bias_raw_s, k_lat_s, k_rope_s, bias_s, fac_s, scf_s, r_ready,
                                      k_ready, k_empty, kv_ptr, slots_ptr, row, start, end, num_tiles, stride_kv,
                                      stride_s_row, _BN, K_STAGES, R_STAGES, CVT_ROWS)),
                ],
                [4, 4],
                [CONSUMER_REGS, PRODUCER_REGS],
            )
        else:
            gl.warp_specialize(
                [
                    (_consumer, (q_lat_s, q_rope_s, k_lat_s, k_rope_s, bias_s, p_s, x_s, l_s,
                                 k_ready, k_empty, p_ready, p_empty, l_ready,
                                 out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                                 row, part, hb, num_tiles, H,
                                 stride_o_row, stride_o_head, stride_lse_row, qk_scale, out_scale,
                                 0, K_STAGES, PV_IN_FLIGHT, None, False, PV_FP8)),
                    (_consumer, (q_lat_s, q_rope_s, k_lat_s, k_rope_s, bias_s, p_s, x_s, l_s,
                                 k_ready, k_empty, p_ready, p_empty, l_ready,
                                 out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                                 row, part, hb, num_tiles, H,
                                 stride_o_row, stride_o_head, stride_lse_row, qk_scale, out_scale,
                                 1, K_STAGES, PV_IN_FLIGHT, None, False, PV_FP8)),
                    (gatherer, (k_lat_s, k_rope_s, bias_s, k_ready, k_empty,
                                kv_ptr, slots_ptr, row, start, end, num_tiles, stride_kv, stride_s_row,
                                _BN, K_STAGES)),
                ],
                [4, 4],
                [CONSUMER_REGS, PRODUCER_REGS],
            )


# ----------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class SeesawParams:
    """Compile-time shape of the seesaw kernel."""

    k_stages: int = 4  # K ring depth: 4 x 36 KB (the most that fits beside Q and P)
    # P.V k-steps whose register operands (16 registers each) are in flight at once
    pv_in_flight: int = 2
    # setmaxnreg of consumer WG1; WG0 (the default partition) gets 504 - both requests = 240
    consumer_regs: int = 216
    producer_regs: int = 48  # setmaxnreg of the gatherer (3 registers' worth spilled at 48; 56 was slower)
    # nvfp4_ds_mla rows: the gatherer converts each tile to an fp8 K stage through e4m3 (common.gluon.nvfp4_gatherer)
    nvfp4: bool = False
    r_stages: int = 2  # nvfp4: the packed ring's depth (22.3 KB a stage)
    cvt_rows: int = 8  # nvfp4: rows a conversion step (the gatherer's registers)
    # P.V on e4m3 wgmma (fp8 rows): P rounded to e4m3 (2**-4 relative) instead of fp16
    pv_fp8: bool = False

    def __post_init__(self) -> None:
        if self.pv_in_flight not in ((1, 2) if self.pv_fp8 else (1, 2, 4)):
            raise ValueError(f"pv_in_flight must be 1, 2 or 4 (pv_fp8: 1 or 2), got {self.pv_in_flight}")
        if self.pv_fp8 and self.nvfp4:
            raise ValueError("pv_fp8 takes fp8 rows only (nvfp4's P carries its rows' factors, past e4m3's range)")
        check_warpgroup_regs(self.consumer_regs, self.producer_regs)
        if self.cvt_rows not in (8, 16, 32) or self.r_stages < 1:
            raise ValueError(f"cvt_rows must be 8, 16 or 32 and r_stages >= 1, got {self.cvt_rows}, {self.r_stages}")
        smem = self.smem_bytes()
        if self.k_stages < 2 or smem > 227 * 1024:
            raise ValueError(f"k_stages must be >= 2 and fit 227 KB of shared memory, got {self.k_stages} ({smem} B)")

    def smem_bytes(self) -> int:
        """Q, the K ring, P for two tiles, (nvfp4) the packed ring, the rows' factors a K stage and two tiles'
        shifted fp16 scales, plus ~2 KB (bias, mbarriers, warp-specialize state)."""
        packed = (self.r_stages * BLOCK_N * (NVFP4_ROW_BYTES + 4)
                  + e4m3_scale_bytes(BLOCK_N, self.k_stages)) if self.nvfp4 else 0
        p_bytes = 2 * BLOCK_H * BLOCK_N * (1 if self.pv_fp8 else 2)
        return BLOCK_H * HEAD_DIM + self.k_stages * BLOCK_N * HEAD_DIM + p_bytes + packed + 2048

    def config(self, heads: int | None = None) -> Config:
        """The triton_decode.Config the split heuristic and the workspace see (64-head, 64-token tiles, 1 CTA an
        SM: gluon_decode's)."""
        return gluon_config(BLOCK_N)


def nvfp4_seesaw_params() -> SeesawParams:
    """nvfp4_ds_mla rows: K ring 3 and a packed ring of 2 (the most that fits beside Q and P), 8 rows a conversion
    step (the gatherer's 48 registers). Measured against it at H = 128, 320 rows: packed ring 1 with K ring 4 13%
    slower, packed ring 3 / 4 with K ring 2 22% / 17% slower (docs/history.md v23, v26)."""
    return SeesawParams(k_stages=3, nvfp4=True, r_stages=2, cvt_rows=8)


def pv_fp8_seesaw_params() -> SeesawParams:
    """P.V on e4m3 wgmma: consumers at 232 / 232 registers and the gatherer at 40. The e4m3 P.V operands free
    registers, and at the default 240 / 216 / 48 the second consumer reloads spilled registers every tile on Triton
    3.8 (slower there, level on 3.6); here the gatherer spills a few words instead (docs/history.md v27)."""
    return SeesawParams(pv_fp8=True, consumer_regs=232, producer_regs=40)


def kernel_constexprs(params: SeesawParams) -> dict[str, Any]:
    """seesaw_decode_kernel's compile-time arguments for these params (the launcher's and gluon_report's)."""
    return dict(K_STAGES=params.k_stages, PV_IN_FLIGHT=params.pv_in_flight, CONSUMER_REGS=params.consumer_regs,
                PRODUCER_REGS=params.producer_regs, NVFP4=params.nvfp4, R_STAGES=params.r_stages,
                CVT_ROWS=params.cvt_rows, PV_FP8=params.pv_fp8)


def launch(query, kv_rows, slots, counts, out, lse, softmax_scale: float, output_scale: float,
           ws: Workspace, splits: int, params: SeesawParams, lead_tiles: int = 0, tabs: Any = None) -> Any:
    """The kernel (and the combine when splits > 1) on inputs already checked: no allocation, no sync. tabs: a
    scheduled launch's tables (common.schedule.ScheduleTables) instead of splits."""
    return launch_kernel(seesaw_decode_kernel, cdiv(query.shape[1], BLOCK_H), query, kv_rows, slots,
                            counts, out, lse, softmax_scale, output_scale, ws, splits, kernel_constexprs(params),
                            lead_tiles=lead_tiles, tabs=tabs)


def seesaw_sparse_mla_decode(query, kv_rows, slots, counts, *, softmax_scale: float, output_scale: float, out, lse=None,
                             workspace: Workspace | None = None, splits: int | None = None,
                             params: SeesawParams | None = None, lead_tiles: int = 0, scheduled: bool = False) -> Any:
    """Sparse MLA decode of an fp8 cache (params.nvfp4: an nvfp4_ds_mla one) with the seesaw kernel:
    gluon_decode.gluon_sparse_mla_decode's contract
    (query (rows, H > 32, 576) e4m3, out (rows, H, 512) bf16 written in full, lse natural log or None; workspace
    from triton_decode.make_workspace with params.config(); None allocates one: tests only; lead_tiles as
    triton_decode.sparse_mla_decode's; scheduled: a scheduled launch, as there)."""
    params = params or SeesawParams()
    return one_off_call(launch, params, "nvfp4_ds_mla" if params.nvfp4 else "fp8", _bad_heads, query, kv_rows, slots,
                        counts, out, lse, softmax_scale, output_scale, workspace, splits, lead_tiles, scheduled)


def _bad_heads(heads: int) -> str:
    return "" if heads > 32 else f"query must have > 32 heads for the 64-head seesaw kernel, got {heads}"
