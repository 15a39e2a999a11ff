"""The top-k -> flat-cache-rows converter (SPEC 4): a Triton kernel writing into caller buffers.

Also its plain-torch twin `convert_topk_reference`, used by the tests and as a CPU fallback.
"""

from __future__ import annotations

import operator

import torch
import triton
import triton.language as tl

from vllm_kimi_dsa.host_math import next_pow2
from vllm_kimi_dsa.widths import check_width

__all__ = ["convert_topk", "convert_topk_reference", "default_tile"]

_MAX_TILE = 512
_INT32_MAX = 2**31 - 1


def default_tile(width: int) -> int:
    """The tile width the kernel uses for a top-k width: min(512, next power of two >= width).

    512 at K = 2048 gives 4 loop iterations of 4 ids per thread (4 warps): few enough dependent
    (topk -> block_table) load round trips to keep a one-row launch short (decode runs with few
    rows, so per-program latency, not throughput, is what counts), small enough that the
    per-tile scan and the int64 temporaries stay in registers.
    """
    return min(_MAX_TILE, next_pow2(max(int(width), 1)))


@triton.jit
def _add(a, b):
    return a + b


# tl.sum/tl.cumsum with Triton's own combine: identical code on a GPU, but the interpreter runs them
# in numpy only for that combine, and each call of the tl.sum/tl.cumsum wrappers costs it ~2 ms per
# program (half the CPU time of the tests). _add is the fallback should Triton rename it.
_SUM_COMBINE = getattr(getattr(tl, "standard", None), "_sum_combine", _add)


# num_reqs and max_blocks change from step to step: specializing on them (== 1, % 16) would
# recompile mid-serving.
@triton.jit(do_not_specialize=["num_reqs", "max_blocks", "dcp_rank"])
def _convert_topk_kernel(
    topk_ptr,
    req_ptr,
    bt_ptr,
    slots_ptr,
    counts_ptr,
    topk_s0,
    topk_s1,
    req_s0,
    bt_s0,
    bt_s1,
    slots_s0,
    counts_s0,
    num_reqs,
    max_blocks,
    rows_per_block_stride,
    dcp_rank,
    K: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DCP_SIZE: tl.constexpr,
    INTERLEAVE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    req = tl.load(req_ptr + row * req_s0)
    # An out-of-range request id (a stale padded row) must not read outside the block table.
    req_ok = (req >= 0) & (req < num_reqs)
    bt_row = bt_ptr + tl.where(req_ok, req, 0).to(tl.int64) * bt_s0
    topk_row = topk_ptr + row * topk_s0
    slots_row = slots_ptr + row * slots_s0

    cols = tl.arange(0, TILE)
    n_valid = tl.full((), 0, tl.int32)  # valid ids written so far, at the front of the row
    for start in tl.range(0, K, TILE):
        col = start + cols
        in_row = col < K
        t = tl.load(topk_row + col * topk_s1, mask=in_row, other=-1)
        # Negative ids are invalid whatever their quotient; clamp so the math below stays
        # non-negative (Triton divides toward zero, torch floors).
        tc = tl.maximum(t, 0)
        if DCP_SIZE == 1:
            owned = True
            local = tc
        else:
            owned = (tc // INTERLEAVE) % DCP_SIZE == dcp_rank
            if INTERLEAVE == 1:
                local = tc // DCP_SIZE
            else:
                local = (tc // (DCP_SIZE * INTERLEAVE)) * INTERLEAVE + tc % INTERLEAVE
        blk = local // BLOCK_SIZE
        off = local % BLOCK_SIZE
        valid = (t >= 0) & (blk < max_blocks) & owned & req_ok
        base = tl.load(bt_row + blk.to(tl.int64) * bt_s1, mask=valid, other=0)
        # int64 product: block id * stride can pass 2**31 even when the row id the cache can
        # hold cannot; the int32 result is exact for every cache under 2**31 rows (SPEC: vLLM's
        # slot ids are int32; 2**31 rows of 352 bytes would be a 755 GB cache).
        flat = (base.to(tl.int64) * rows_per_block_stride + off).to(tl.int32)

        # Stable partition: valid ids to the front in top-k order, invalid ones to the back, so
        # every position of the row is written exactly once in one pass (no -1 prefill, no
        # atomics). Lanes past K are a suffix of the last tile, so the invalid ones before a lane
        # number (lane - valid before it), and start - n_valid before the tile.
        v = valid.to(tl.int32)
        before_v = tl.associative_scan(v, 0, _SUM_COMBINE) - v
        dest = tl.where(valid, n_valid + before_v, (K - 1 - start + n_valid) - (cols - before_v))
        tl.store(slots_row + dest, tl.where(valid, flat, -1), mask=in_row)
        n_valid += tl.reduce(v, 0, _SUM_COMBINE)
    tl.store(counts_ptr + row * counts_s0, n_valid)


# Triton decides at decoration time whether a kernel runs in its interpreter (CPU tensors).
_INTERPRETED = not isinstance(_convert_topk_kernel, triton.runtime.JITFunction)


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _check_int32(name: str, x: object, ndim: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    return x


def _check_scalars(
    topk: torch.Tensor,
    block_size: object,
    rows_per_block_stride: object,
    dcp_size: object,
    dcp_rank: object,
    interleave: object,
    rows: object,
) -> tuple[int, int, int, int, int, int]:
    B = _as_int("block_size", block_size)
    S = _as_int("rows_per_block_stride", rows_per_block_stride)
    D = _as_int("dcp_size", dcp_size)
    r = _as_int("dcp_rank", dcp_rank)
    I = _as_int("interleave", interleave)  # noqa: E741
    n = topk.shape[0] if rows is None else _as_int("rows", rows)
    if B < 1:
        raise ValueError(f"block_size must be >= 1, got {B}")
    if S < B:
        raise ValueError(f"rows_per_block_stride must be >= block_size ({B}), got {S}")
    if S > _INT32_MAX:
        raise ValueError(f"rows_per_block_stride must fit int32, got {S}")
    if D < 1:
        raise ValueError(f"dcp_size must be >= 1, got {D}")
    if not 0 <= r < D:
        raise ValueError(f"dcp_rank must be in [0, dcp_size={D}), got {r}")
    if I < 1:
        raise ValueError(f"interleave must be >= 1, got {I}")
    if D * I > _INT32_MAX or B > _INT32_MAX:
        raise ValueError(f"dcp_size * interleave and block_size must fit int32, got {D}*{I} and {B}")
    if n < 0:
        raise ValueError(f"rows must be >= 0, got {n}")
    check_width(topk.shape[1], "topk width")
    return B, S, D, r, I, n


def convert_topk(
    topk: torch.Tensor,
    req_id_per_token: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    rows_per_block_stride: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
    slots: torch.Tensor,
    counts: torch.Tensor,
    rows: int | None = None,
    tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k token ids -> this DCP rank's flat cache rows, compacted in top-k order, into `slots`.

    topk: (>= rows, K) int32, K a multiple of 128; any negative id means "no token".
    req_id_per_token: (>= rows,) int32, the block-table row of each top-k row.
    block_table: (num_reqs, max_blocks) int32, any strides.
    slots: (>= rows, K) int32 output, last dim contiguous; row i gets its valid flat rows
        (block_table[req, blk] * rows_per_block_stride + off) first, in top-k order, then -1.
    counts: (>= rows,) int32 output, the number of valid ids per row.
    rows: rows to convert (default topk.shape[0]); buffer rows past it are left untouched.
    tile: kernel tile width override (power of two >= 16), for tests; default `default_tile(K)`.
    Returns (slots[:rows], counts[:rows]).

    An id t is valid iff t >= 0, this rank owns it ((t // I) % D == r), its block
    local // B is inside block_table, and the row's request id is in [0, num_reqs) (a guard
    against stale padded rows). No allocation and no host sync: only shapes, dtypes, strides and
    devices are checked, never values, so it can be captured in a CUDA graph.
    """
    topk = _check_int32("topk", topk, 2)
    req_id_per_token = _check_int32("req_id_per_token", req_id_per_token, 1)
    block_table = _check_int32("block_table", block_table, 2)
    slots = _check_int32("slots", slots, 2)
    counts = _check_int32("counts", counts, 1)
    B, S, D, r, I, n = _check_scalars(
        topk, block_size, rows_per_block_stride, dcp_size, dcp_rank, interleave, rows
    )
    K = topk.shape[1]
    if slots.shape[1] != K:
        raise ValueError(f"slots width {slots.shape[1]} != topk width {K}")
    if slots.stride(1) != 1 and K > 1:
        raise ValueError(f"slots must have a contiguous last dim, got strides {slots.stride()}")
    for name, x in (
        ("topk", topk),
        ("req_id_per_token", req_id_per_token),
        ("slots", slots),
        ("counts", counts),
    ):
        if x.shape[0] < n:
            raise ValueError(f"rows={n} exceeds {name}'s {x.shape[0]} rows")
    device = topk.device
    for name, x in (
        ("req_id_per_token", req_id_per_token),
        ("block_table", block_table),
        ("slots", slots),
        ("counts", counts),
    ):
        if x.device != device:
            raise ValueError(f"{name} is on {x.device}, topk is on {device}")
    if device.type == "cpu" and not _INTERPRETED:
        raise ValueError(
            "topk is on the CPU but the Triton kernel is compiled, not interpreted: set "
            "TRITON_INTERPRET=1 before importing vllm_kimi_dsa.convert, or use convert_topk_reference"
        )
    if tile is None:
        tile_w = default_tile(K)
    else:
        tile_w = _as_int("tile", tile)
        if tile_w < 16 or tile_w & (tile_w - 1):
            raise ValueError(f"tile must be a power of two >= 16, got {tile_w}")
    out_slots, out_counts = slots[:n], counts[:n]
    if n == 0:
        return out_slots, out_counts
    _convert_topk_kernel[(n,)](
        topk,
        req_id_per_token,
        block_table,
        slots,
        counts,
        topk.stride(0),
        topk.stride(1),
        req_id_per_token.stride(0),
        block_table.stride(0),
        block_table.stride(1),
        slots.stride(0),
        counts.stride(0),
        block_table.shape[0],
        block_table.shape[1],
        S,
        r,
        K=K,
        TILE=tile_w,
        BLOCK_SIZE=B,
        DCP_SIZE=D,
        INTERLEAVE=I,
        num_warps=max(1, min(8, tile_w // 128)),
    )
    return out_slots, out_counts


def convert_topk_reference(
    topk: torch.Tensor,
    req_id_per_token: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    rows_per_block_stride: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
    rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-torch twin of `convert_topk` (same arguments and math; allocates).

    Returns (slots (rows, K) int32: valid flat rows first in top-k order, then -1; counts (rows,) int32).
    """
    topk = _check_int32("topk", topk, 2)
    req_id_per_token = _check_int32("req_id_per_token", req_id_per_token, 1)
    block_table = _check_int32("block_table", block_table, 2)
    B, S, D, r, I, n = _check_scalars(
        topk, block_size, rows_per_block_stride, dcp_size, dcp_rank, interleave, rows
    )
    for name, x in (("topk", topk), ("req_id_per_token", req_id_per_token)):
        if x.shape[0] < n:
            raise ValueError(f"rows={n} exceeds {name}'s {x.shape[0]} rows")
    for name, x in (("req_id_per_token", req_id_per_token), ("block_table", block_table)):
        if x.device != topk.device:
            raise ValueError(f"{name} is on {x.device}, topk is on {topk.device}")
    t = topk[:n].long()
    req = req_id_per_token[:n].long()
    num_reqs, max_blocks = block_table.shape
    tc = t.clamp(min=0)
    owner = (tc // I) % D
    local = (tc // (D * I)) * I + tc % I
    blk = local // B
    off = local % B
    req_ok = (req >= 0) & (req < num_reqs)
    valid = (t >= 0) & (blk < max_blocks) & (owner == r) & req_ok[:, None]
    if num_reqs and max_blocks:
        bt = block_table[torch.where(req_ok, req, 0)].long()
        base = torch.gather(bt, 1, torch.where(valid, blk, 0))
    else:
        base = torch.zeros_like(t)
    flat = torch.where(valid, base * S + off, -1).to(torch.int32)
    # A stable sort on "invalid" keeps the valid ids' top-k order; the invalid ones are all -1.
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    return torch.gather(flat, 1, order), valid.sum(dim=1, dtype=torch.int32)
