"""What the Gluon decode kernels share: Gluon's imports and availability, and their common jit pieces.

Split ranges on a split-major grid (or a scheduled launch's items: work_item), the cp.async gatherer (fp8 and nvfp4 rows), Q into shared memory, the
normalizers and whole-sector latent stores, and the host launch with its combine. Imports on any machine.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from vllm_kimi_dsa.kernels.common.combine import LOG2E, combine, combine_scheduled
from vllm_kimi_dsa.kernels.common.nvfp4 import E2M1_E4M3_PTX, E4M3_BLOCK_TABLE_PTX
from vllm_kimi_dsa.kernels.common.schedule import ScheduleTables, plan_schedule, tables
from vllm_kimi_dsa.kernels.common.workspace import (
    Workspace, check_inputs, check_lead, make_workspace, num_sms, one_off_scratch, scheduled_scratch, scratch,
)
from vllm_kimi_dsa.planning.schedule import schedule_shape

# Triton versions whose Gluon API the kernels are written against: 3.6 and 3.8 both compile them offline for
# sm_90a (warp_specialize's signature moved in 3.6)
SUPPORTED_TRITON = ("3.6", "3.8")

try:  # Gluon is experimental: absent from old Triton, its API moves between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,  # noqa: F401
        mbarrier,
        warpgroup_mma,  # noqa: F401
        warpgroup_mma_init,  # noqa: F401
        warpgroup_mma_wait,  # noqa: F401 - these four: the kernel leaves take them from here
    )
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    # a barrier of the calling warp-specialize partition (a named barrier of its threads): 3.8 names it barrier,
    # 3.6 thread_barrier
    partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    _GLUON_IMPORT_ERROR: str | None = None
except Exception as e:  # noqa: BLE001 - any failure means "no Gluon here"
    gluon = gl = async_copy = mbarrier = fence_async_shared = partition_barrier = None
    warpgroup_mma = warpgroup_mma_init = warpgroup_mma_wait = None
    _GLUON_IMPORT_ERROR = f"{type(e).__name__}: {e}"


def triton_is(versions: tuple[str, ...]) -> bool:
    """Whether this process's Triton is one of these versions ("3.6" matches 3.6.x)."""
    return any(triton.__version__.startswith(v) for v in versions)


def triton_version_supported() -> bool:
    """Whether this Triton is one the Gluon kernels are written against (SUPPORTED_TRITON)."""
    return triton_is(SUPPORTED_TRITON)


def gluon_unavailable_reason(device: torch.device | str | None = None) -> str:
    """Why the Gluon kernels cannot run on `device` (default: the current CUDA device); '' when they can: Gluon
    imports, Triton's version is one they are written against, and the device is a Hopper (sm_90; no wgmma on
    sm_100+)."""
    if _GLUON_IMPORT_ERROR is not None:
        return f"Gluon does not import: {_GLUON_IMPORT_ERROR}"
    if not triton_version_supported():
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


def check_warpgroup_regs(consumer_regs: int, producer_regs: int) -> None:
    """setmaxnreg budgets of a 12-warp kernel (the default partition = consumer WG0, workers consumer WG1 and the
    producer): each request a multiple of 8 in [24, 256], and WG0's 504 - both requests in [consumer_regs, 256]."""
    regs = (consumer_regs, producer_regs)
    if any(r % 8 or not 24 <= r <= 256 for r in regs) or 504 - sum(regs) not in range(consumer_regs, 257):
        raise ValueError(f"consumer_regs, producer_regs must be multiples of 8 in [24, 256] leaving consumer WG0 "
                         f"504 - both, in [consumer_regs, 256], got {regs}")


def e4m3_scale_bytes(block_n: int, k_stages: int) -> int:
    """Shared memory of the e4m3 forms' row-shift state (row_scales): each K stage's rows' fp32 factors 2**s and
    two tiles' (block_n, 32) fp16 shifted scales (by tile parity, so a tile's never overwrite the previous one's)."""
    return k_stages * block_n * 4 + 2 * block_n * 32 * 2


def launch_kernel(kernel: Any, head_blocks: int, query, kv_rows, slots, counts, out, lse, softmax_scale: float,
                  output_scale: float, ws: Workspace, splits: int, constexprs: dict[str, Any],
                  options: dict[str, Any] | None = None, extra_args: dict[str, Any] | None = None,
                  lead_tiles: int = 0, tabs: ScheduleTables | None = None) -> Any:
    """A Gluon decode kernel on grid (head_blocks, splits, rows), then the combine when splits > 1: inputs already
    checked, no allocation, no sync. The kernels share the plain kernel's runtime arguments (extra_args:
    a kernel's own, by name; lead_tiles: planning.choose_lead's); options are compile options (maxnreg) beside
    num_warps. tabs: a scheduled launch instead (splits, lead_tiles unused): the device planner divides the call's
    tiles from the counts, the kernel runs its items on grid (head_blocks, items), the combine its split rows."""
    rows, heads = query.shape[0], query.shape[1]
    if tabs is not None:
        lse_t = scheduled_scratch(ws, tabs, heads, lse)
        plan_schedule(counts, slots.shape[1], tabs)
        compiled = call_kernel(kernel, (head_blocks, tabs.shape.items, 1), query, kv_rows, slots, counts, out, lse_t,
                               softmax_scale, output_scale, ws, 1, constexprs, options, extra_args, 0,
                               items=tabs.items)
        combine_scheduled(ws, out, lse_t, tabs, output_scale)
        return compiled
    splits, lse_t = scratch(ws, rows, heads, splits, lse)
    compiled = call_kernel(kernel, (head_blocks, splits, rows), query, kv_rows, slots, counts, out, lse_t,
                           softmax_scale, output_scale, ws, splits, constexprs, options, extra_args, lead_tiles)
    combine(ws, out, lse_t, splits, output_scale)
    return compiled


def call_kernel(kernel: Any, grid: tuple[int, int, int], query, kv_rows, slots, counts, out, lse_t,
                softmax_scale: float, output_scale: float, ws: Workspace, splits: int,
                constexprs: dict[str, Any], options: dict[str, Any] | None = None,
                extra_args: dict[str, Any] | None = None, lead_tiles: int = 0, items: Any = None) -> Any:
    """One launch of a Gluon decode kernel with the decode kernels' common runtime arguments (lse_t: the LSE
    buffer to write, never None; items: a scheduled launch's item table, SCHEDULED then), no combine."""
    return kernel[grid](
        query, kv_rows, slots, counts, counts if items is None else items,
        out, lse_t, ws.part_out, ws.part_lse,
        query.shape[1], slots.shape[1], splits, lead_tiles if splits > 1 else 0,
        query.stride(0), query.stride(1), kv_rows.stride(0), slots.stride(0),
        out.stride(0), out.stride(1), lse_t.stride(0),
        softmax_scale * LOG2E, output_scale,
        **(extra_args or {}),
        **constexprs,
        SCHEDULED=items is not None,
        num_warps=4,  # the default partition (a consumer warpgroup); warp_specialize adds the workers' warps
        **(options or {}),
    )


def one_off_call(launch: Any, params: Any, fmt: str, bad_heads: Any, query, kv_rows, slots, counts, out, lse,
                 softmax_scale: float, output_scale: float, workspace: Workspace | None, splits: int | None,
                 lead_tiles: int, scheduled: bool = False) -> Any:
    """One call of a Gluon kernel module's launch with these params (tests, benchmarks): lead_tiles, Gluon on this
    device, the inputs and bad_heads(heads) (a message, '' when the kernel takes them) checked, in that order; a
    workspace made for the call when none is given (it allocates: not for the hot path). scheduled: a scheduled
    launch (its shape from params.config(heads) on this device; splits and lead_tiles unused). Returns the compiled
    kernel handle, None for 0 rows."""
    check_lead(lead_tiles)
    reason = gluon_unavailable_reason(query.device)
    if reason:
        raise RuntimeError(f"the Gluon decode kernels cannot run here: {reason}")
    check_inputs(query, kv_rows, slots, counts, fmt, out, lse)
    message = bad_heads(query.shape[1])
    if message:
        raise ValueError(message)
    if query.shape[0] == 0:  # nothing to launch (and no workspace to size)
        return None
    if scheduled:
        rows, heads, width = query.shape[0], query.shape[1], slots.shape[1]
        cfg = params.config(heads)
        shape = schedule_shape(rows, width, heads, cfg, num_sms(query.device))
        if workspace is None or workspace.sched is None:
            workspace = make_workspace(query.device, heads=heads, max_rows=rows, widths=(width,), fmt=fmt, config=cfg,
                                       plans={(rows, width): (0, 1)}, schedules=(shape,))
        return launch(query, kv_rows, slots, counts, out, lse, softmax_scale, output_scale, workspace, 1, params, 0,
                      tables(workspace.sched, shape))
    workspace, splits = one_off_scratch(query, slots, fmt, params.config(), workspace, splits)
    return launch(query, kv_rows, slots, counts, out, lse, softmax_scale, output_scale, workspace, splits, params,
                  lead_tiles)


if gl is not None:
    @gluon.jit
    def normalizers(l_i, m_i):
        """1 / l (0 where l = 0: a count-0 or all-hole split) and the base-2 LSE (-inf there) of the row sums: every
        Gluon epilogue's (as the plain kernel's)."""
        has = l_i > 0.0
        inv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
        return inv, gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))

    @triton.constexpr_function
    def latent_store_layout(dims, heads, thread_dims, elem_bytes):
        """A [dims, heads] layout for storing O in latent order, reached from the thread-native
        BlockedLayout([thread_dims, 2], [8, 4], [4, 1], [0, 1]) (a thread's thread_dims contiguous dims of 2 heads;
        the reg_v / seesaw accumulators' order) by moving data between the lanes of a warp only (shuffles, no shared
        memory): a lane holds 16 contiguous bytes of a head and 8 lanes 128 contiguous bytes, so every store
        instruction writes whole 32-byte sectors. From the thread-native layout a 16-byte store covered half (or a
        quarter) of each sector it touched, and the next instruction the rest: 2-4x the sector writes, paid at the
        end of every split CTA (its partial)."""
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
    def wgmma_store_layout():
        """latent_store_layout's counterpart for fp16 stores straight from the 64-head kernel's wgmma accumulator
        (warps [4, 1], m16: 64 heads on M, 256 dims on N), seen as [dims, heads]. In the accumulator a lane holds 2
        adjacent dims, 4 bytes, half sectors at best; here each lane holds 8 contiguous dims (16 bytes) and 4 lanes a
        head's 64 contiguous bytes; the warps keep their rows, so the conversion is warp shuffles."""
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
    # distinct 16-byte bank groups. Lanes 8 rows x 4 (rows r, r + 1 on the same 64 bytes, an earlier layout) took
    # two wavefronts an access on the 128-byte-swizzled latent gathers and conversion loads: 20% of the few-heads
    # kernel's shared-memory wavefronts, the resource that kernel runs out of first (ncu). Now 8 lanes
    # move 128 contiguous bytes of one row. The RoPE (64-byte rows) is gathered 8 bytes a lane with the same rows
    # a thread, so one slot vector serves both; the conversion reads 8 e4m3 and writes 8 fp16 a lane (16 lanes
    # across a row) so that both its loads and its fp16 stores are conflict-free. tests/test_sm90_compile checks
    # each against its buffer with Gluon's bank_conflicts.
    ROW_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]))
    ROPE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))

    @gluon.jit
    def load_slots(s_base, start, end, t, BLOCK_N: gl.constexpr):
        """Tile t's slots (-1 past `end`), one per gathered row of ROW_LAYOUT."""
        offs = start + t * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, ROW_LAYOUT))
        return gl.load(s_base + offs, mask=offs < end, other=-1)

    @gluon.jit
    def gather_tile(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot, it, stride_kv,
                     K_STAGES: gl.constexpr):
        """cp.async tile it's rows (zero-filled holes and tokens past the split, so V is finite) into its K stage,
        publish its 0 / -inf token bias, and have the gathering warpgroup arrive on k_ready[stage]."""
        stage = it % K_STAGES
        ok = slot >= 0
        row_off = gl.where(ok, slot, 0).to(gl.int64) * stride_kv
        offs_lat = gl.arange(0, 512, gl.SliceLayout(0, ROW_LAYOUT))
        # ROPE_LAYOUT gives a thread the same rows as ROW_LAYOUT: these conversions move nothing
        rope_off = gl.convert_layout(row_off, gl.SliceLayout(1, ROPE_LAYOUT))
        rope_ok = gl.convert_layout(ok, gl.SliceLayout(1, ROPE_LAYOUT))
        offs_rope = 512 + gl.arange(0, 64, gl.SliceLayout(0, ROPE_LAYOUT))
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

    # nvfp4_ds_mla rows (formats.py): 256 packed e2m1 bytes, 64 RoPE e4m3 bytes at 256, 32 e4m3 block scales at 320;
    # scales are gathered 16 rows x 32 bytes a warp instruction (2 lanes a row)
    SC_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0]))

    @gluon.jit
    def copy_nvfp4_rows(pk_dst, sc_dst, rope_dst, kv_ptr, slot, stride_kv):
        """cp.async a tile's nvfp4_ds_mla rows (holes zero-filled): packed bytes, scales and RoPE into their
        buffers. Returns which rows are real (ROW_LAYOUT's slot rows)."""
        ok = slot >= 0
        row_off = gl.where(ok, slot, 0).to(gl.int64) * stride_kv
        offs_pk = gl.arange(0, 256, gl.SliceLayout(0, ROW_LAYOUT))
        rope_off = gl.convert_layout(row_off, gl.SliceLayout(1, ROPE_LAYOUT))  # moves nothing, as in gather_tile
        rope_ok = gl.convert_layout(ok, gl.SliceLayout(1, ROPE_LAYOUT))
        offs_rope = 256 + gl.arange(0, 64, gl.SliceLayout(0, ROPE_LAYOUT))
        sc_slot = gl.convert_layout(slot, gl.SliceLayout(1, SC_LAYOUT))
        sc_ok = sc_slot >= 0
        sc_base = gl.expand_dims(kv_ptr + gl.where(sc_ok, sc_slot, 0).to(gl.int64) * stride_kv, 1)
        offs_sc = 320 + gl.arange(0, 32, gl.SliceLayout(0, SC_LAYOUT))
        async_copy.async_copy_global_to_shared(
            pk_dst, kv_ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(offs_pk, 0), mask=gl.expand_dims(ok, 1))
        rope_ptrs = (kv_ptr + gl.expand_dims(rope_off, 1) + gl.expand_dims(offs_rope, 0)).to(
            gl.pointer_type(gl.float8e4nv), bitcast=True)
        async_copy.async_copy_global_to_shared(rope_dst, rope_ptrs, mask=gl.expand_dims(rope_ok, 1))
        async_copy.async_copy_global_to_shared(sc_dst, sc_base + gl.expand_dims(offs_sc, 0),
                                                  mask=gl.expand_dims(sc_ok, 1))
        return ok

    @gluon.jit
    def gather_tile_nvfp4(pk_s, sc_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot, it, stride_kv,
                           K_STAGES: gl.constexpr):
        """gather_tile for nvfp4_ds_mla rows (gluon_few_heads' nvfp4 path): packed bytes, RoPE and scales into their
        stage buffers."""
        stage = it % K_STAGES
        mbarrier.wait(k_empty.index(stage), ((it // K_STAGES) & 1) ^ 1)
        ok = copy_nvfp4_rows(pk_s.index(stage), sc_s.index(stage), k_rope_s.index(stage), kv_ptr, slot, stride_kv)
        bias_s.index(stage).store(gl.where(ok, 0.0, float("-inf")))
        async_copy.mbarrier_arrive(k_ready.index(stage), increment_count=False)
        mbarrier.arrive(k_ready.index(stage))

    # The nvfp4 conversion's view (rows, r 8, q 4, e 8) of the packed bytes: 16 lanes read 128 contiguous bytes of
    # a row (8 a lane: one 16-value block) and the stores of what they decode are conflict-free too (16 bytes a lane
    # on rows r, r + 1 took two wavefronts a load). tests/test_sm90_compile checks it with Gluon's bank_conflicts.
    PK_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1, 1, 8], [2, 4, 4, 1], [4, 1, 1, 1], [3, 2, 1, 0]))
    # an fp8 K stage's latent seen as 256 e4m3 pairs a row: the same bytes as the 8-bit 128-byte-swizzled layout
    E4M3_PAIRS_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))

    # a tile's (rows, 32) scale bytes as 8 words a row, 2 lanes a row (4 words each; SC_LAYOUT's rows): row_scales
    SCW_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0]))

    @gluon.jit
    def row_scales(sc_stage, scf_buf, fac_stage, BLOCK_N: gl.constexpr):
        """A tile's block scales as fp16 times their row's 2**-s into scf_buf (raw byte order), 2**s into fac_stage
        (fp32, for the consumers), then a barrier of this warpgroup so every thread of convert_tile_e4m3 reads them.
        s = 0..3, the least that keeps 6 x the row's largest |scale| x 2**-s within e4m3's 448 (formats.
        nvfp4_row_shifts: each of the magnitude bytes 0x6A (80), 0x72 (160), 0x7A (320) reached adds one), found
        bytewise on words: (b & 0x7F) + (0x80 - T) sets bit 7 of b's byte iff b >= T, with no carry out of it."""
        plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        m = sc_stage._reinterpret(gl.int32, [BLOCK_N, 8], plain2).load(SCW_LAYOUT) & 0x7F7F7F7F
        top = -0x7F7F7F80  # 0x80808080
        s = (((m + 0x16161616) & top) != 0).to(gl.int32) + (((m + 0x0E0E0E0E) & top) != 0).to(gl.int32) \
            + (((m + 0x06060606) & top) != 0).to(gl.int32)
        s = gl.max(s, axis=1)
        fac_stage.store(((127 + s) << 23).to(gl.float32, bitcast=True))
        # fp16 2**-s from its exponent field; SC_LAYOUT has SCW_LAYOUT's rows (the conversion moves nothing)
        down = gl.convert_layout(((15 - s) << 10).to(gl.int16).to(gl.float16, bitcast=True),
                                 gl.SliceLayout(1, SC_LAYOUT))
        sc = sc_stage.load(SC_LAYOUT).to(gl.float8e4nv, bitcast=True).to(gl.float16)
        scf_buf.store(sc * gl.expand_dims(down, 1))
        partition_barrier()

    @gluon.jit
    def convert_tile_e4m3(pk_stage, sc_stage, k_lat_stage, fac_stage, scf_buf, BLOCK_N: gl.constexpr,
                          CVT_ROWS: gl.constexpr):
        """A tile's nvfp4 latent (packed bytes, scales) into an fp8 K stage in latent order, each e2m1 x scale x 2**-s
        rounded once to e4m3 (nearest even; formats.nvfp4_as_fp8), s its row's shift (row_scales: the scales shifted
        into scf_buf, an fp16 (BLOCK_N, 32) scratch that must not be the previous tile's, and 2**s into fac_stage,
        by which the consumers scale the row's latent logit and P), so no value passes e4m3's 448. CVT_ROWS rows a
        step.

        A row's packed bytes are viewed as (r 8, q 4, e 8): byte 32 r + 8 q + e is in latent block s = 4 r + q,
        whose scale is raw byte 8 q + r, so the (rows, 32) scales viewed (q 4, r 8) and permuted to (r, q) line
        up with the packed view's first two axes. A lane's 8 packed bytes are one block: its table is made once
        (E4M3_BLOCK_TABLE_PTX) and its 16 values looked up in it (E2M1_E4M3_PTX) as 8 e4m3 pairs, one 16-byte
        store."""
        plain4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
        plain3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        pk4 = pk_stage._reinterpret(gl.uint8, [BLOCK_N, 8, 4, 8], plain4)
        sc3 = scf_buf._reinterpret(gl.float16, [BLOCK_N, 4, 8], plain3).permute((0, 2, 1))
        dst = k_lat_stage._reinterpret(gl.uint16, [BLOCK_N, 256], E4M3_PAIRS_LAYOUT)
        row_scales(sc_stage, scf_buf, fac_stage, BLOCK_N)
        for r0 in gl.static_range(0, BLOCK_N, CVT_ROWS):
            pk = pk4.slice(r0, CVT_ROWS, dim=0).load(PK_LAYOUT)
            sc = sc3.slice(r0, CVT_ROWS, dim=0).load(gl.SliceLayout(3, PK_LAYOUT))
            t0, t1 = gl.inline_asm_elementwise(E4M3_BLOCK_TABLE_PTX, "=r,=r,h", [sc],
                                               dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)
            t0 = gl.broadcast(gl.expand_dims(t0, 3), pk)[0]
            t1 = gl.broadcast(gl.expand_dims(t1, 3), pk)[0]
            pairs = gl.inline_asm_elementwise(E2M1_E4M3_PTX, "=r,=r,r,r,r,r,r,r,r,r,r", [pk, t0, t1],
                                              dtype=gl.uint16, is_pure=True, pack=4)
            dst.slice(r0, CVT_ROWS, dim=0).store(gl.reshape(pairs, [CVT_ROWS, 256]))

    @gluon.jit
    def nvfp4_gatherer(
        pk_s, sc_s, rope_s, bias_raw_s, k_lat_s, k_rope_s, bias_s, fac_s, scf_s, r_ready, k_ready, k_empty,
        kv_ptr, slots_ptr, row, start, end, num_tiles, stride_kv, stride_s_row,
        BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, R_STAGES: gl.constexpr, CVT_ROWS: gl.constexpr,
    ):
        """A gatherer warpgroup that also converts (the seesaw kernel's nvfp4 form): cp.async tile j's nvfp4 rows
        into a packed ring of R_STAGES (packed bytes, scales, RoPE, bias: r_ready, the 128 threads' arrivals), then
        turn tile j - R_STAGES + 1 into an fp8 K stage (convert_tile_e4m3: its rows' factors into fac_s, its shifted
        scales into scf_s by tile parity; the RoPE and bias copied) and publish it
        (k_ready counts 1) once the consumers have freed that stage, so the consumers run as on fp8 rows."""
        s_base = slots_ptr + row.to(gl.int64) * stride_s_row
        slot = load_slots(s_base, start, end, 0, BLOCK_N)
        for j in range(num_tiles + R_STAGES - 1):
            if j < num_tiles:
                nxt = load_slots(s_base, start, end, j + 1, BLOCK_N)
                r = j % R_STAGES
                ok = copy_nvfp4_rows(pk_s.index(r), sc_s.index(r), rope_s.index(r), kv_ptr, slot, stride_kv)
                bias_raw_s.index(r).store(gl.where(ok, 0.0, float("-inf")))  # read back by the same threads
                async_copy.mbarrier_arrive(r_ready.index(r), increment_count=False)
                slot = nxt
            t = j - (R_STAGES - 1)
            if t >= 0:
                r = t % R_STAGES
                stage = t % K_STAGES
                mbarrier.wait(r_ready.index(r), (t // R_STAGES) & 1)
                mbarrier.wait(k_empty.index(stage), ((t // K_STAGES) & 1) ^ 1)
                convert_tile_e4m3(pk_s.index(r), sc_s.index(r), k_lat_s.index(stage), fac_s.index(stage),
                                  scf_s.index(t % 2), BLOCK_N, CVT_ROWS)
                k_rope_s.index(stage).store(rope_s.index(r).load(ROPE_LAYOUT))
                bias_s.index(stage).store(bias_raw_s.index(r).load(gl.SliceLayout(1, ROW_LAYOUT)))
                fence_async_shared()
                mbarrier.arrive(k_ready.index(stage))

    @gluon.jit
    def gatherer(
        k_lat_s, k_rope_s, bias_s, k_ready, k_empty,
        kv_ptr, slots_ptr, row, start, end, num_tiles, stride_kv, stride_s_row,
        BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr, sc_s=None, NVFP4: gl.constexpr = False,
    ):
        """A gatherer warpgroup (the few-heads and seesaw kernels'): each tile's cp.async issued as soon as its K stage
        is free (NVFP4: gather_tile_nvfp4's stage buffers, sc_s the scales). Slots come in groups of 4 tiles (4
        registers a tile): a group's loads are issued right after the previous group's first gather, so the first
        use of a group waits on loads ~3 tiles old (loaded a tile ahead, the `slot >= 0` test waited on a load
        scoreboard the newer loads share)."""
        s_base = slots_ptr + row.to(gl.int64) * stride_s_row
        slot0 = load_slots(s_base, start, end, 0, BLOCK_N)
        slot1 = load_slots(s_base, start, end, 1, BLOCK_N)
        slot2 = load_slots(s_base, start, end, 2, BLOCK_N)
        slot3 = load_slots(s_base, start, end, 3, BLOCK_N)
        for g in range(0, num_tiles, 4):
            gather_any(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot0, g, stride_kv, K_STAGES, sc_s,
                        NVFP4)
            next0 = load_slots(s_base, start, end, g + 4, BLOCK_N)
            next1 = load_slots(s_base, start, end, g + 5, BLOCK_N)
            next2 = load_slots(s_base, start, end, g + 6, BLOCK_N)
            next3 = load_slots(s_base, start, end, g + 7, BLOCK_N)
            if g + 1 < num_tiles:
                gather_any(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot1, g + 1, stride_kv, K_STAGES,
                            sc_s, NVFP4)
            if g + 2 < num_tiles:
                gather_any(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot2, g + 2, stride_kv, K_STAGES,
                            sc_s, NVFP4)
            if g + 3 < num_tiles:
                gather_any(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot3, g + 3, stride_kv, K_STAGES,
                            sc_s, NVFP4)
            slot0 = next0
            slot1 = next1
            slot2 = next2
            slot3 = next3

    @gluon.jit
    def gather_any(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot, it, stride_kv, K_STAGES: gl.constexpr,
                    sc_s, NVFP4: gl.constexpr):
        """gather_tile, or gather_tile_nvfp4 (k_lat_s then holds the packed bytes, sc_s the scales)."""
        if NVFP4:
            gather_tile_nvfp4(k_lat_s, sc_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot, it, stride_kv,
                               K_STAGES)
        else:
            gather_tile(k_lat_s, k_rope_s, bias_s, k_ready, k_empty, kv_ptr, slot, it, stride_kv, K_STAGES)

    @gluon.jit
    def alloc_fp8_q_and_ring(BH: gl.constexpr, BLOCK_N: gl.constexpr, K_STAGES: gl.constexpr):
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
    def split_tiles(counts_ptr, row, split, num_splits, lead_tiles, K, BLOCK_N: gl.constexpr):
        """(start, end, tiles) of this split's token range, as the plain kernel's and planning.split_range (lead_tiles > 0: the first
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
    def row_split(num_splits, lead_tiles):
        """(row, split) of this CTA on grid (head blocks, splits, rows), read split-major when lead_tiles > 0, so
        every row's first (long) piece is dispatched before any short one."""
        split = gl.program_id(1)
        row = gl.program_id(2)
        if lead_tiles > 0:
            lin = split + row * num_splits
            rows = gl.num_programs(2)
            split = lin // rows
            row = lin % rows
        return row, split

    @gluon.jit
    def work_item(items_ptr, counts_ptr, num_splits, lead_tiles, K, BLOCK_N: gl.constexpr, SCHEDULED: gl.constexpr):
        """(row, start, end, tiles, part) of this CTA: SCHEDULED, item program_id(1) of the device planner's table
        (common.schedule; row -1: an idle item, which the kernel returns from before anything else); else row_split's
        split of split_tiles' range. part: the entry row of the piece's partial (entries part * H + head), -1 where
        the row is whole (out and LSE stored directly)."""
        if SCHEDULED:
            at = items_ptr + gl.program_id(1) * 4
            row = gl.load(at)
            start = gl.load(at + 1)
            end = gl.load(at + 2)
            part = gl.load(at + 3)
            num_tiles = gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)
        else:
            row, split = row_split(num_splits, lead_tiles)
            start, end, num_tiles = split_tiles(counts_ptr, row, split, num_splits, lead_tiles, K, BLOCK_N)
            part = gl.where(num_splits > 1, row * num_splits + split, -1)
        return row, start, end, num_tiles, part

    @gluon.jit
    def store_q(q_ptr, row, h0, H, stride_q_row, stride_q_head, q_lat_s, q_rope_s, BH: gl.constexpr):
        """Heads h0 .. h0 + BH of a row's query (e4m3 as is; padded heads 0) into q_lat_s / q_rope_s (the caller
        fences before a wgmma reads them)."""
        q_ld: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [4, 1], [1, 0])
        offs_h = h0 + gl.arange(0, BH, gl.SliceLayout(1, q_ld))
        q_row = q_ptr + row.to(gl.int64) * stride_q_row
        q_lat = gl.load(q_row + gl.expand_dims(offs_h * stride_q_head, 1)
                        + gl.expand_dims(gl.arange(0, 512, gl.SliceLayout(0, q_ld)), 0),
                        mask=gl.expand_dims(offs_h < H, 1), other=0.0)
        q_lat_s.store(q_lat)
        store_q_rope(q_row, h0, H, stride_q_head, q_rope_s, BH)

    @gluon.jit
    def store_q_rope(q_row, h0, H, stride_q_head, q_rope_s, BH: gl.constexpr):
        """Heads h0 .. h0 + BH of the query's RoPE part (e4m3 as is; padded heads 0) into q_rope_s."""
        q_rope_ld: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
        offs_h = h0 + gl.arange(0, BH, gl.SliceLayout(1, q_rope_ld))
        q_rope = gl.load(q_row + gl.expand_dims(offs_h * stride_q_head, 1) + 512
                         + gl.expand_dims(gl.arange(0, 64, gl.SliceLayout(0, q_rope_ld)), 0),
                         mask=gl.expand_dims(offs_h < H, 1), other=0.0)
        q_rope_s.store(q_rope)
