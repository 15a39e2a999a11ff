"""prims_ts and trtllm-gen numerics against the float32 reference, on an SM100/SM103 GPU only.

Count-0 rows, -1 holes (inside the prefix for prims_ts; trtllm reads a compacted prefix), natural-log
LSE, the no-allocation rule and CUDA graph replay. Skipped elsewhere (CPU CI, the H200).
"""

from __future__ import annotations

import pytest
import torch

from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM, flat_kv_row_view, make_paged_cache
from vllm_kimi_dsa.kernels.base import DecodeSetup
from vllm_kimi_dsa.reference import reference_decode


def _blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


pytestmark = pytest.mark.skipif(not _blackwell(), reason="FlashInfer's prims_ts / trtllm-gen kernels need an SM100/SM103 GPU")

if _blackwell():
    fi_prims_ts = pytest.importorskip("vllm_kimi_dsa.backends.flashinfer.prims_ts")
    fi_trtllm = pytest.importorskip("vllm_kimi_dsa.backends.flashinfer.trtllm")
    pytest.importorskip("flashinfer", reason="FlashInfer is not installed")

DEVICE = torch.device("cuda", 0)
SOFTMAX_SCALE = 0.06
OUTPUT_SCALE = 0.8
CAPACITIES = (8, 32, 128)
# Tolerances: both kernels quantize P to e4m3 for the PV MMA (~3 significant bits; errors
# average out over hundreds of tokens) and write bf16 output, so out is held to 4% of the
# row scale at the worst element and 1% on average; LSE comes from fp32 logits of exact
# e4m3 products, so 2e-2 absolute plus 1e-4 relative for fp32 summation-order differences on
# large logits (a base-2 LSE would be off by 44%).
OUT_MAX_REL, OUT_MEAN_REL, LSE_ATOL, LSE_RTOL = 4e-2, 1e-2, 2e-2, 1e-4


def _case(fmt, rows, heads, width, *, holes_in_prefix, block_size=64, block_stride=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = make_paged_cache(40, block_size, fmt, block_stride=block_stride, device=DEVICE, generator=gen)
    kv_rows, stride_rows = flat_kv_row_view(cache, block_size)
    valid_rows = torch.tensor(
        [b * stride_rows + o for b in range(40) for o in range(block_size)], dtype=torch.int32
    )
    query = (torch.randn(rows, heads, HEAD_DIM, generator=gen) * 2).to(torch.float8_e4m3fn).to(DEVICE)
    counts = torch.randint(1, width + 1, (rows,), generator=gen, dtype=torch.int32)
    counts[0] = 0  # an empty row
    if rows > 2:
        counts[1] = width  # a full row
    slots = valid_rows[torch.randint(0, valid_rows.numel(), (rows, width), generator=gen)]
    slots[torch.arange(width)[None, :] >= counts[:, None]] = -1
    if holes_in_prefix:
        holes = (torch.rand(rows, width, generator=gen) < 0.2) & (torch.arange(width)[None, :] < counts[:, None])
        slots[holes] = -1
    out = torch.full((rows, heads, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((rows, heads), float("nan"), device=DEVICE)
    return query, kv_rows, slots.to(DEVICE), counts.to(DEVICE), out, lse, stride_rows


def _setup(fmt, heads, rows, width, capacities=CAPACITIES):
    return DecodeSetup(
        device=DEVICE, fmt=fmt, heads=heads, row_counts=(rows,), capacities=capacities, widths=(width,),
        return_lse=True, softmax_scale=SOFTMAX_SCALE, output_scale=OUTPUT_SCALE, impl=None,
    )


def _check(query, kv_rows, slots, counts, out, lse, fmt):
    ref_out, ref_lse = reference_decode(
        query, kv_rows, slots, counts, fmt=fmt, softmax_scale=SOFTMAX_SCALE, output_scale=OUTPUT_SCALE
    )
    empty = (counts == 0).cpu()
    got, got_lse = out.float().cpu(), lse.cpu()
    ref_out, ref_lse = ref_out.cpu(), ref_lse.cpu()
    assert bool((got[empty] == 0).all()), "count-0 rows must give output 0"
    assert bool((got_lse[empty] == float("-inf")).all()), "count-0 rows must give LSE -inf"
    live = ~empty
    assert torch.isfinite(got[live]).all() and torch.isfinite(got_lse[live]).all()
    scale = ref_out[live].abs().amax(dim=-1, keepdim=True).clamp_min(1e-3)
    err = (got[live] - ref_out[live]).abs() / scale
    assert err.max() <= OUT_MAX_REL, f"max rel err {err.max():.3g}"
    assert err.mean() <= OUT_MEAN_REL, f"mean rel err {err.mean():.3g}"
    torch.testing.assert_close(got_lse[live], ref_lse[live], atol=LSE_ATOL, rtol=LSE_RTOL)


def _run_checked(kernel, args, fmt, block_size):
    query, kv_rows, slots, counts, out, lse, stride_rows = args
    kernel(query, kv_rows, slots, counts, out, lse, block_size=block_size, rows_per_block_stride=stride_rows)
    torch.cuda.synchronize()
    _check(query, kv_rows, slots, counts, out, lse, fmt)
    # After the warm-up call: no allocation, and a CUDA graph of the call replays the same answer.
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    kernel(query, kv_rows, slots, counts, out, lse, block_size=block_size, rows_per_block_stride=stride_rows)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before, "the call allocated"
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel(query, kv_rows, slots, counts, out, lse, block_size=block_size, rows_per_block_stride=stride_rows)
    graph.replay()
    torch.cuda.synchronize()
    _check(query, kv_rows, slots, counts, out, lse, fmt)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4_ds_mla"])
@pytest.mark.parametrize("heads", [128, 64, 16, 12])
@pytest.mark.parametrize("rows", [1, 5, 20, 80])
def test_prims_ts_matches_reference(fmt, heads, rows):
    args = _case(fmt, rows, heads, 2048, holes_in_prefix=True, seed=rows * 131 + heads)
    kernel = fi_prims_ts.PrimsTsDecode(_setup(fmt, heads, rows, 2048))
    _run_checked(kernel, args, fmt, 64)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4_ds_mla"])
def test_prims_ts_width_128_and_no_capacities(fmt):
    args = _case(fmt, 7, 64, 128, holes_in_prefix=True, seed=7)
    kernel = fi_prims_ts.PrimsTsDecode(_setup(fmt, 64, 7, 128, capacities=()))
    _run_checked(kernel, args, fmt, 64)


@pytest.mark.parametrize("heads", [128, 64, 16, 12])  # 12: TP8's heads, never run on trtllm yet
@pytest.mark.parametrize("rows", [1, 5, 20, 80])
@pytest.mark.parametrize("block_stride", [64, 96])  # pages of 64, then of 32 rows
def test_trtllm_matches_reference(heads, rows, block_stride):
    args = _case("fp8", rows, heads, 2048, holes_in_prefix=False, block_stride=block_stride, seed=rows + heads)
    kernel = fi_trtllm.TrtllmDecode(_setup("fp8", heads, rows, 2048, capacities=()))
    _run_checked(kernel, args, "fp8", 64)
