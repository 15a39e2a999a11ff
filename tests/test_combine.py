"""The split combine (kernels/common/combine.py) past INLINE_SPLITS splits a row, and the planner that asks for it.

CPU (TRITON_INTERPRET=1) and GPU: random partials merged against float64 (empty splits, rows of no entry, poisoned
outputs), both combine forms on the same partials, a decode split 80 and 128 ways against the reference, and the
split count the plan model picks where a row's tiles fit one wave past 64 of them.
"""

from __future__ import annotations

import pytest
import torch

from vllm_kimi_dsa.formats import LATENT_DIM
from vllm_kimi_dsa.kernels import common as kcommon
from vllm_kimi_dsa.kernels.triton_decode import sparse_mla_decode
from vllm_kimi_dsa.planning import choose_plan, choose_splits, default_config, few_heads_config, gluon_config
from decode_checks import check_decode, random_case

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
LN2 = 0.6931471805599453


def _partials(rows: int, heads: int, splits: int, seed: int) -> tuple[kcommon.Workspace, torch.Tensor, torch.Tensor]:
    """A workspace of random partials (entry (row * splits + split) * H + head): ~1/4 of the splits empty (LSE -inf,
    their partial junk), row 1 with every split empty; returns it and the float64 partials / base-2 LSEs."""
    g = torch.Generator().manual_seed(seed)
    n = rows * splits * heads
    part = torch.randn(n, LATENT_DIM, generator=g).to(kcommon.PARTIAL_DTYPE)
    lse2 = torch.randn(n, generator=g) * 4.0
    empty = torch.rand(n, generator=g) < 0.25
    if rows > 1:
        empty.view(rows, splits, heads)[1] = True
    lse2[empty] = float("-inf")
    part[empty] = (torch.randn(int(empty.sum()), LATENT_DIM, generator=g) * 1e4).to(part.dtype)  # weighs 0
    ws = kcommon.Workspace(part_out=part.reshape(-1).to(DEVICE), part_lse=lse2.to(DEVICE),
                           dummy_lse=torch.empty(1, device=DEVICE), capacity=n, max_rows=rows, heads=heads)
    return ws, part.double().view(rows, splits, heads, LATENT_DIM), lse2.double().view(rows, splits, heads)


def _merged(part: torch.Tensor, lse2: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64: out = sum_s 2^(lse_s - L) o_s * scale, L = log2 sum_s 2^lse_s (natural-log LSE returned)."""
    total = torch.logsumexp(lse2 * LN2, dim=1)  # natural log of sum 2^lse
    w = torch.exp(lse2 * LN2 - total.unsqueeze(1))  # (rows, splits, heads)
    w = torch.nan_to_num(w, nan=0.0)
    out = (part * w.unsqueeze(-1)).sum(1) * scale
    return out, total


@pytest.mark.parametrize("splits", [5, 64, 65, 100, 130])
def test_combine_matches_float64_at_any_split_count(splits):
    """Both forms (inline up to 64, chunks past it): bf16 rounding of the float64 merge, a row of no entry gives out
    0 and LSE -inf, every output element written (NaN-poisoned before)."""
    rows, heads, scale = 3, 4, 0.37
    ws, part, lse2 = _partials(rows, heads, splits, seed=splits)
    out = torch.full((rows, heads, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((rows, heads), float("nan"), device=DEVICE)
    kcommon.combine(ws, out, lse, splits, scale)
    ref_out, ref_lse = _merged(part, lse2, scale)
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all() and (lse[1] == float("-inf")).all()
    live = torch.ones(rows, dtype=torch.bool)
    live[1] = False
    err = (out.double().cpu() - ref_out)[live].abs()
    assert bool((err <= 2.0**-7 * ref_out[live].abs() + 1e-6).all()), err.max()
    assert torch.allclose(lse.double().cpu()[live], ref_lse[live], atol=1e-5, rtol=0)


def test_chunked_form_equals_the_inline_one():
    """At 64 splits both kernels run on the same partials: the same outputs to bf16 rounding (summation order)."""
    rows, heads, splits = 2, 3, 64
    ws, _, _ = _partials(rows, heads, splits, seed=7)
    outs, lses = [], []
    for kernel, const in ((kcommon.combine_kernel, {"SPLITS": 64}),
                          (kcommon.combine_chunks_kernel, {"CHUNK": kcommon.CHUNK_SPLITS})):
        out = torch.full((rows, heads, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        lse = torch.full((rows, heads), float("nan"), device=DEVICE)
        kernel[(heads, rows)](ws.part_out, ws.part_lse, out, lse, heads, splits, out.stride(0), out.stride(1),
                              lse.stride(0), 1.0, D=LATENT_DIM, num_warps=kcommon.combine_warps(ws), **const)
        outs.append(out.float())
        lses.append(lse)
    assert torch.allclose(outs[0], outs[1], rtol=2.0**-7, atol=1e-6)
    assert torch.equal(lses[0] == float("-inf"), lses[1] == float("-inf"))
    fin = torch.isfinite(lses[0])
    assert torch.allclose(lses[0][fin], lses[1][fin], atol=1e-5)


@pytest.mark.parametrize("fmt, splits", [("fp8", 80), ("nvfp4_ds_mla", 128)])
def test_decode_split_past_64_ways(fmt, splits):
    """The plain kernel with 32-token tiles split into 80 / 128 pieces (the chunked combine) against the reference:
    -1 holes, a count-0 row, an all-hole row, junk past the counts, NaN-poisoned outputs."""
    width = 4096 if splits == 128 else 2560
    q, kv, slots, counts, ss, os_ = random_case(5, 12, width, fmt, seed=splits)
    cfg = default_config(16, "nvfp4_ds_mla") if fmt == "nvfp4_ds_mla" else default_config(16, fmt)
    cfg = type(cfg)(**{**cfg.__dict__, "block_n": 32})
    out = torch.full((5, 12, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((5, 12), float("nan"), device=DEVICE)
    seen = []
    real = kcommon.combine

    def spy(ws, o, l, n, scale):
        seen.append(n)
        real(ws, o, l, n, scale)

    import vllm_kimi_dsa.kernels.triton_decode as td
    saved, td.combine = td.combine, spy
    try:
        sparse_mla_decode(q, kv, slots, counts, fmt=fmt, softmax_scale=ss, output_scale=os_, out=out, lse=lse,
                          config=cfg, splits=splits)
    finally:
        td.combine = saved
    assert seen == [splits] and splits > kcommon.INLINE_SPLITS
    check_decode(out, lse, q, kv, slots, counts, fmt, ss, os_, cfg)


def test_one_wave_row_splits_past_64_tiles():
    """A one-wave batch whose rows have more than 64 tiles splits one tile a piece (the model's choice while it fits
    a wave): K = 4096 at 32-token tiles is 128 pieces. The cap of 64 splits gave 64 here."""
    nv = default_config(16, "nvfp4_ds_mla")  # 16-head blocks of 32-token tiles, two CTAs an SM
    assert nv.block_n == 32
    assert choose_splits(1, 16, 4096, nv, 132) == 128
    assert choose_plan(1, 16, 4096, nv, 132) == (0, 128)
    g32 = gluon_config(32)  # the 64-head Gluon kernels' 32-token form: one 64-head block, 132 slots
    assert choose_splits(1, 64, 4096, g32, 132) == 128
    few = few_heads_config()
    assert choose_splits(1, 16, 8192, few, 132) == 128  # 64-token tiles of a wider top-k
    # past one wave the model still balances waves against partials; never more splits than tiles
    for rows in (1, 2, 3, 5, 8):
        s = choose_splits(rows, 16, 4096, nv, 132)
        assert 1 <= s <= 128
