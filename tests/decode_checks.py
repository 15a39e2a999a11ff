"""The decode kernels' shared test pieces: random inputs, the tolerances and the checker against reference_decode.

Every kernel test (plain Triton, Gluon, the core, the vLLM backend) checks its output with `check_decode`.
"""

from __future__ import annotations

import math

import torch

from vllm_kimi_dsa.formats import LATENT_DIM, quantize_rows
from vllm_kimi_dsa.planning import default_config
from vllm_kimi_dsa.kernels import common as kcommon
from conftest import ALL_DIMS, decode_reference, float_rows, fp8_wgmma, wgmma_logit_bound

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")

# Tolerances. The kernel's own arithmetic: e4m3 x e4m3 (and e2m1*scale x e4m3, exact in fp16)
# products are exact in the fp32 accumulator, so logits and LSE differ from float32 only by
# summation order (LSE_ATOL). P is rounded to fp16 (2**-11 relative) before the P.V dot and the
# result to bf16 (8-bit significand, RNE: <= 2**-8 relative): per element
# |out - ref| <= 2**-8 |ref| + the P error, which is <= 2**-11 * sum_j p_j |v_j| / l
# <= 2**-11 * max|v| * output_scale. So:
# Triton's interpreter (CPU) truncates fp32 -> bf16 instead of rounding: one ulp, 2**-7 relative.
BF16_REL = 2.0**-8 if GPU else 2.0**-7
OUT_REL = BF16_REL + 2.0**-12  # of |ref|: the bf16 rounding, plus slack for fp32 summation order
P_ERR = 2.0**-10  # of max_j |v_j| * output_scale (the fp16 P bound doubled for the split combine)
# P.V on e4m3 wgmma (the seesaw kernel's pv_fp8): each p_j, kept as 256 p_j <= 256, rounded to e4m3: 2**-4 relative
# while normal (>= 2**-6), at most 2**-10 absolute below; with l >= 256 and <= 2048 entries a row the error is
# <= (2**-4 + 2048 * 2**-10 / 256) max|v| = (2**-4 + 2**-7) max|v|, plus P_ERR's slack for the split combine
P_ERR_E4M3 = 2.0**-4 + 2.0**-7 + P_ERR
NORM_REL = BF16_REL + 2.0**-10  # ||out - ref|| / ||ref|| per (row, head): worst-case rounding + P
# The split partials' rounding, of max_j |v_j| * output_scale: each partial is a convex mix of the v_j (and so is the
# combine's sum of them), stored in kcommon.PARTIAL_DTYPE (fp16: 2^-11 relative; fp32: nothing at this scale)
PARTIAL_ERR = {torch.float16: 2.0**-11, torch.float32: 0.0}
SHIPPED_PARTIAL_ERR = PARTIAL_ERR[kcommon.PARTIAL_DTYPE]
LSE_ATOL = 2e-4  # mma.sync / interpreter paths (H <= 32): fp32 accumulation, ~1e-5 seen
# fp8 Q.K on Hopper's wgmma (64-head tiles, the transposed kernel) sums with ~14 bits: the bound is
# conftest.wgmma_logit_bound, per row, applied to the LSE and (times 2 max|v|) to the output.


def random_case(rows: int, heads: int, width: int, fmt: str, *, seed: int, holes: bool = True, num_rows: int = 4099):
    """Fresh random inputs: rows of N(0,1) quantized (with a few large ones), e4m3 queries,
    compacted slots with -1 holes and out-of-range junk past counts, count-0 and odd counts."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, 576, generator=g)
    x[::7] *= 8.0  # some rows with large values: exercises nvfp4 scales and peaked softmax
    kv = quantize_rows(x, fmt)
    q = (torch.randn(rows, heads, 576, generator=g) * 1.5).to(torch.float8_e4m3fn)
    slots = torch.randint(0, num_rows, (rows, width), generator=g, dtype=torch.int32)
    counts = torch.randint(0, width + 1, (rows,), generator=g, dtype=torch.int32)
    counts[0] = width
    if rows > 1:
        counts[1] = 0
    if rows > 2:
        counts[2] = 1
    if rows > 3:
        counts[3] = width - 1
    pos = torch.arange(width).expand(rows, width)
    past = pos >= counts.long().unsqueeze(1)
    # Entries past the count are garbage: far out of range, so reading one faults / sanitizer fires.
    junk = torch.randint(1 << 28, 1 << 30, (rows, width), generator=g, dtype=torch.int32)
    slots = torch.where(past, junk, slots)
    if holes:
        hole = (torch.rand(rows, width, generator=g) < 0.1) & ~past
        slots = torch.where(hole, torch.full_like(slots, -1), slots)
        if rows > 4:
            slots[4, : counts[4]] = -1  # a row whose every entry is a hole: out 0, LSE -inf
    softmax_scale = 1.0 / math.sqrt(576.0) * 0.7
    output_scale = 0.37
    dev = DEVICE
    return (q.to(dev), kv.to(dev), slots.to(dev), counts.to(dev), softmax_scale, output_scale)


def fp8_wgmma_for(heads, fmt, config=None):
    return fp8_wgmma(config or default_config(heads, fmt), fmt)


def check_decode(out, lse, q, kv, slots, counts, fmt, softmax_scale, output_scale, config=None, wgmma=None,
                 partial_err=SHIPPED_PARTIAL_ERR, p_err=P_ERR):
    """kv: rows of `fmt`, or conftest.VALUES rows. wgmma: the head dims whose logits come from fp8 wgmma without
    promotion (a slice, e.g. conftest.ALL_DIMS), True for all, False for none; None: from the config. partial_err:
    the split partials' rounding (PARTIAL_ERR of the workspace's dtype; by default the shipped one's). p_err: P's
    rounding before P.V (P_ERR: fp16; P_ERR_E4M3: e4m3)."""
    if wgmma is None:
        wgmma = fp8_wgmma_for(q.shape[1], fmt, config)  # nvfp4 runs every dot in fp16 (exact sums)
    dims = ALL_DIMS if wgmma is True else wgmma
    logit_err = (wgmma_logit_bound(q, kv, slots, counts, fmt, softmax_scale, dims).view(-1, 1, 1) if dims
                 else torch.zeros(1, 1, 1, device=q.device))
    ref_out, ref_lse = decode_reference(
        q, kv, slots, counts, fmt=fmt, softmax_scale=softmax_scale, output_scale=output_scale
    )
    assert torch.isfinite(out).all(), "NaN/inf (or the poison) left in out"
    o = out.float()
    valid = (torch.arange(slots.shape[1], device=slots.device) < counts.long().unsqueeze(1)) & (slots >= 0)
    empty = ~valid.any(dim=1)
    assert (o[empty] == 0).all(), "a row with no valid entry must give out 0"
    if lse is not None:  # None: a call without DCP, which returns no LSE
        assert (lse[empty] == float("-inf")).all(), "a row with no valid entry must give LSE -inf exactly"
        assert torch.isfinite(lse[~empty]).all(), "finite LSE expected where a row has entries"
        lse_err = (lse - ref_lse).abs()[~empty]
        lse_bound = (LSE_ATOL + logit_err.view(-1, 1).expand_as(lse))[~empty]
        assert bool((lse_err <= lse_bound).all()), f"LSE error {lse_err.max().item():.3e} over its bound"
    # max |v| of the selected rows, per row, bounds the fp16-P error term
    vmax = torch.zeros(slots.shape[0], device=o.device)
    for i in range(slots.shape[0]):
        ids = slots[i][valid[i]].long()
        if ids.numel():
            vmax[i] = float_rows(kv[ids], fmt)[:, :LATENT_DIM].abs().max()
    bound = OUT_REL * ref_out.abs() + (p_err + partial_err + 2 * logit_err) * (vmax * output_scale).view(-1, 1, 1)
    err = (o - ref_out).abs()
    worst = (err - bound).max().item()
    assert worst <= 0, f"|out - ref| exceeds the bound by {worst}"
    nz = ~empty
    num = (o - ref_out)[nz].norm(dim=-1)
    den = ref_out[nz].norm(dim=-1).clamp_min(1e-30)
    # the norm check only where the logits are exact to fp32 (the wgmma error is bounded above)
    if not dims and bool(nz.any()):  # (a batch of count-0 rows only: checked above, out 0 and LSE -inf)
        assert (num / den).max().item() <= NORM_REL + 2 * partial_err
