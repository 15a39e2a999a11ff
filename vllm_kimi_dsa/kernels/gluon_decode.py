"""The 64-head warp-specialized Gluon decode for Hopper (sm_90a), FP8 rows: its kernel, params and launch.

Two consumer warpgroups split each tile's tokens for Q.K and share the row maxima through shared memory (a named
barrier); each owns half of O (P . V16). A producer warpgroup gathers rows with cp.async into a K ring and converts
the latent to fp16 into a V16 ring. Same grid, runtime arguments, split scratch and combine as the plain kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM
from vllm_kimi_dsa.heads import FEW_HEADS_MAX
from vllm_kimi_dsa.host_math import cdiv
from vllm_kimi_dsa.kernels.common import LN2, Workspace
from vllm_kimi_dsa.kernels.common.gluon import (
    alloc_fp8_q_and_ring,
    check_warpgroup_regs,
    fence_async_shared,
    gather_tile,
    gl,
    gluon,
    launch_kernel,
    load_slots,
    mbarrier,
    normalizers,
    one_off_call,
    store_latent,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
    wgmma_store_layout,
    work_item,
)
from vllm_kimi_dsa.planning import Config, gluon_config
from vllm_kimi_dsa.planning.configs import GLUON64_BLOCK_H as BLOCK_H
from vllm_kimi_dsa.planning.configs import GLUON64_BLOCK_N as DEFAULT_BLOCK_N

DEFAULT_K_STAGES = 2
DEFAULT_V_SLOTS = 3
DEFAULT_CVT_ROWS = 32  # rows the producer converts a step: each step ends in a WAW barrier (Triton's membar)
# Register budget (setmaxnreg): 12 warps start at 65536 / 384 = 168 registers a thread; the default partition
# (consumer WG0) gets 504 - the two requests, so the producer's small share goes to the consumers (224 + 224 + 56).
DEFAULT_CONSUMER_REGS = 224
DEFAULT_PRODUCER_REGS = 56


if gl is not None:
    _BH = gl.constexpr(BLOCK_H)
    _ONE_A_THREAD = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))  # a warpgroup's 128 threads
    _D = gl.constexpr(LATENT_DIM)

    @gluon.jit
    def _online_softmax(s, m_tile, m_i, l_i, acc, head_o_layout: gl.constexpr):
        """One tile of the online softmax in base 2 (as the plain kernel's) given the tile's row maxima:
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
        row, part, hb, num_tiles, H,
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

        _store_result(acc, m_i, l_i, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, row, part, hb, H,
                      stride_o_row, stride_o_head, stride_lse_row, out_scale, HALF, s_layout, o_layout)

    @gluon.jit
    def _store_result(
        acc, m_i, l_i, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr, row, part, hb, H,
        stride_o_row, stride_o_head, stride_lse_row, out_scale,
        HALF: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
    ):
        """Epilogue, as the plain kernel's: a consumer's 256 columns (bf16 out; part >= 0: the fp16 partial at entries
        part * H + head); consumer 0 also the LSE."""
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
        if part < 0:
            o_ptrs = (out_ptr + row.to(gl.int64) * stride_o_row + gl.expand_dims(offs_h * stride_o_head, 1)
                      + gl.expand_dims(offs_d, 0))
            gl.store(o_ptrs, (o * out_scale).to(gl.bfloat16), mask=mask_o)
            if HALF == 0:
                gl.store(lse_ptr + row * stride_lse_row + offs_h_s, lse2 * LN2, mask=mask_h_s)
        else:
            base = part * H
            # fp16 partials: 4 bytes a lane from the accumulator's layout (half sectors); stored from whole sectors
            store_latent(gl.permute(o, (1, 0)), part_out_ptr + base.to(gl.int64) * _D + HALF * DH, _D, hb * _BH,
                         H, wgmma_store_layout())
            if HALF == 0:
                gl.store(part_lse_ptr + base + offs_h_s, lse2, mask=mask_h_s)

    # the conversion reads 8 e4m3 and writes 8 fp16 a lane (16 lanes across a row): conflict-free loads and stores
    _CVT_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))

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
        conversion, was slower.)"""
        s_base = slots_ptr + row.to(gl.int64) * stride_s_row
        # slots of the next tile to gather, loaded a tile ahead so the load's latency hides behind a conversion
        slot = load_slots(s_base, start, end, 0, BLOCK_N)
        for it in range(num_tiles + 1):
            if it < num_tiles:
                gather_tile(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot, it, stride_kv, K_STAGES)
                slot = load_slots(s_base, start, end, it + 1, BLOCK_N)
            if it > 0:
                _convert_tile(k_lat_s, v16_s, k_ready, k_empty, v_ready, v_empty, it - 1,
                              BLOCK_N, K_STAGES, V_SLOTS, CVT_ROWS)

    @gluon.jit(do_not_specialize=["lead_tiles"])  # one compile for every plan's lead
    def gluon_decode_kernel(
        q_ptr, kv_ptr, slots_ptr, counts_ptr, items_ptr,
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
        SCHEDULED: gl.constexpr = False,  # grid (head blocks, items): each CTA's piece from items_ptr (work_item)
    ):
        """One (64-head block, KV split, row), as triton_decode.decode_kernel with BLOCK_H=64, fp8, SWAP=False."""
        hb = gl.program_id(0)
        row, start, end, num_tiles, part = work_item(items_ptr, counts_ptr, num_splits, lead_tiles, K, BLOCK_N,
                                                     SCHEDULED)
        if SCHEDULED:
            if row < 0:  # an idle item
                return

        v16_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_lat_s, q_rope_s, k_lat_s, k_rope_s = alloc_fp8_q_and_ring(_BH, BLOCK_N, K_STAGES)
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
                             row, part, hb, num_tiles, H,
                             stride_o_row, stride_o_head, stride_lse_row, qk_scale, out_scale,
                             0, BLOCK_N, K_STAGES, V_SLOTS)),
                (_consumer, (q_lat_s, q_rope_s, k_lat_s, k_rope_s, v16_s, bias_s, p_s, x_s,
                             k_ready, k_empty, v_ready, v_empty, x_ready, p_ready,
                             out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
                             row, part, hb, num_tiles, H,
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
    """Compile-time shape of the 64-head Gluon kernel (the defaults are the shipped shape)."""

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

    def config(self, heads: int | None = None) -> Config:
        """The triton_decode.Config the split heuristic and the workspace see (64-head tiles, 1 CTA an SM; any head
        count: the few-heads params' signature)."""
        return gluon_config(self.block_n)


def kernel_constexprs(params: GluonParams) -> dict[str, Any]:
    """gluon_decode_kernel's compile-time arguments for these params (the launcher's and gluon_report's)."""
    return dict(BLOCK_N=params.block_n, K_STAGES=params.k_stages, V_SLOTS=params.v_slots, CVT_ROWS=params.cvt_rows,
                CONSUMER_REGS=params.consumer_regs, PRODUCER_REGS=params.producer_regs)


def launch(query, kv_rows, slots, counts, out, lse, softmax_scale: float, output_scale: float,
           ws: Workspace, splits: int, params: GluonParams, lead_tiles: int = 0, tabs: Any = None) -> Any:
    """The main kernel (and the combine when splits > 1) on inputs already checked: no allocation, no sync. tabs: a
    scheduled launch's tables (common.schedule.ScheduleTables) instead of splits."""
    return launch_kernel(gluon_decode_kernel, cdiv(query.shape[1], BLOCK_H), query, kv_rows, slots, counts,
                         out, lse, softmax_scale, output_scale, ws, splits, kernel_constexprs(params),
                         lead_tiles=lead_tiles, tabs=tabs)


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
    workspace: Workspace | None = None,
    splits: int | None = None,
    block_n: int = DEFAULT_BLOCK_N,
    k_stages: int = DEFAULT_K_STAGES,
    v_slots: int = DEFAULT_V_SLOTS,
    cvt_rows: int = DEFAULT_CVT_ROWS,
    consumer_regs: int = DEFAULT_CONSUMER_REGS,
    producer_regs: int = DEFAULT_PRODUCER_REGS,
    lead_tiles: int = 0,
    scheduled: bool = False,
) -> Any:
    """Sparse MLA decode of an fp8 cache with the warp-specialized Gluon kernel, as triton_decode.sparse_mla_decode.

    query: (rows, H, 576) float8_e4m3fn raw values (q_scale folded into softmax_scale), H > 32 (64-head tiles).
    kv_rows: (num_rows, 576) float8_e4m3fn flat rows.
    slots: (rows, K) int32, valid flat rows first; entries past counts and -1 are ignored.
    counts: (rows,) int32.
    out: (rows, H, 512) bfloat16, written in full; lse: (rows, H) float32 natural log or None.
    workspace: make_workspace(..., config=gluon_config(block_n)) (None allocates one: tests only).
    splits: KV splits a row (None: triton_decode.choose_splits with gluon_config(block_n)).
    block_n .. producer_regs: GluonParams' fields; lead_tiles, scheduled: as triton_decode.sparse_mla_decode's.
    Count 0 -> out 0, lse -inf. Returns the compiled kernel handle (registers, asm).
    """
    params = GluonParams(block_n=block_n, k_stages=k_stages, v_slots=v_slots, cvt_rows=cvt_rows,
                         consumer_regs=consumer_regs, producer_regs=producer_regs)
    return one_off_call(launch, params, "fp8", _bad_heads, query, kv_rows, slots, counts, out, lse, softmax_scale,
                        output_scale, workspace, splits, lead_tiles, scheduled)


def _bad_heads(heads: int) -> str:
    return "" if heads > FEW_HEADS_MAX else (f"query must have > {FEW_HEADS_MAX} heads for the 64-head Gluon kernels, "
                                             f"got {heads}")
