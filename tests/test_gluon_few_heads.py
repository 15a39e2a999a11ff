"""GPU tests of the few-heads Gluon decode (kernels/gluon_few_heads.py: fp8 and nvfp4_ds_mla, <= 32 heads) against
reference_decode.

Hopper only: the GPU tests skip with the reason where gluon_available() is False (CPU CI, other GPUs, other Triton
versions); the check that every case is a valid FewHeadsParams runs everywhere. Inputs are test_gluon_decode's:
fresh random fp8 rows, -1 holes, junk past counts, a count-0 row and an all-holes row; odd row counts, 1 / 12 / 16
heads (12 and 1 pad the 16-wide MMA; 20, 24 and 32 run as 16-head blocks), widths 128 / 1024 / 2048, one split and several (the combine), K rings of
2-4 and V16 rings of 2-4 half tiles, gathers and conversions in two producer warpgroups or one, conversion steps of 16 / 32 rows, outputs poisoned with NaN, a CUDA-graph
capture / replay. Tolerance: test_triton_decode's check with this kernel's config (bf16 output rounding, fp16 P,
fp8 wgmma logits within conftest.wgmma_logit_bound: all 576 dims for fp8, the 64 RoPE dims for nvfp4, whose latent
dot is exact fp16 products); NaN never passes. test_nvfp4_check_catches_planted_faults (CPU) shows that check fails
on the faults a wrong nvfp4 layout would make.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from conftest import GLUON_GPU, ROPE_DIMS
from test_gluon_decode import _case, _poisoned, assert_agree, replay_on_new_inputs, run_tail_split_plan
from test_triton_decode import _check as triton_check
from vllm_kimi_dsa.kernels import triton_decode
from vllm_kimi_dsa.kernels.gluon_few_heads import (
    FewHeadsParams,
    few_heads_config,
    few_heads_sparse_mla_decode,
    launch_stream,
    nvfp4_params,
    reg_v_params,
    stream_entries,
)
from vllm_kimi_dsa.reference import reference_decode

GPU = GLUON_GPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class Case:
    rows: int
    heads: int
    width: int
    splits: int | None = None  # None: the heuristic; 1: no combine
    k_stages: int = 4
    v_slots: int = 2
    cvt_rows: int = 32
    split_producer: bool = True
    nvfp4: bool = False
    reg_v: bool = False
    pv_in_flight: int = 4
    ctas_per_sm: int = 1
    pv_early: bool = False

    def params(self) -> FewHeadsParams:
        # two CTAs an SM leave the gatherer 56 registers (the consumer 200)
        return FewHeadsParams(k_stages=self.k_stages, v_slots=self.v_slots, cvt_rows=self.cvt_rows,
                              split_producer=self.split_producer, nvfp4=self.nvfp4, reg_v=self.reg_v,
                              pv_in_flight=self.pv_in_flight, ctas_per_sm=self.ctas_per_sm, pv_early=self.pv_early,
                              producer_regs=56 if self.ctas_per_sm == 2 else 96)


def _case_id(c: Case) -> str:
    regv = f"-regv-pv{c.pv_in_flight}-cta{c.ctas_per_sm}{'-early' if c.pv_early else ''}" if c.reg_v else ""
    return (f"{'nvfp4' if c.nvfp4 else 'fp8'}-r{c.rows}-h{c.heads}-k{c.width}-s{c.splits}-ks{c.k_stages}-vs{c.v_slots}"
            f"-cvt{c.cvt_rows}-sp{int(c.split_producer)}{regv}")


def nvfp4_case(rows: int, heads: int, width: int, **kw) -> Case:
    """An nvfp4_ds_mla case, on nvfp4_params()'s ring shape unless kw says otherwise."""
    return Case(rows, heads, width, **{"k_stages": 3, "v_slots": 4, "nvfp4": True, **kw})


CASES = [
    Case(1, 16, 2048, splits=1),
    Case(5, 16, 2048, splits=1),
    Case(5, 12, 2048, splits=3),
    Case(7, 12, 1024),
    Case(7, 16, 1024, splits=1),
    Case(33, 12, 128),
    Case(33, 16, 2048, splits=1),
    Case(19, 1, 1024, splits=2),
    Case(320, 16, 2048),
    Case(320, 12, 2048, splits=1),
    Case(7, 16, 2048, splits=1, k_stages=3, v_slots=3),
    Case(19, 12, 2048, splits=2, k_stages=3, v_slots=3),
    Case(7, 16, 2048, splits=1, k_stages=2, v_slots=4),
    Case(33, 12, 1024, splits=1, k_stages=2, v_slots=2),
    Case(5, 16, 2048, splits=1, cvt_rows=16),
    Case(320, 16, 2048, k_stages=3, v_slots=3),
    # one producer warpgroup (gathers and conversions interleaved)
    Case(5, 16, 2048, splits=1, split_producer=False),
    Case(320, 12, 2048, split_producer=False),
    Case(19, 12, 2048, splits=2, k_stages=3, v_slots=3, split_producer=False),
    Case(33, 12, 128, splits=1, k_stages=2, v_slots=4, split_producer=False),
    # 17..32 heads as 16-head blocks
    Case(5, 32, 2048, splits=1),
    Case(7, 24, 1024, splits=3),
    Case(33, 20, 128),
    Case(320, 32, 2048),
    Case(19, 32, 2048, splits=2, split_producer=False),
    # P.V's latent through registers (reg_v): no converter, no V16 ring
    Case(1, 16, 2048, splits=1, reg_v=True, k_stages=5),
    Case(5, 12, 2048, splits=3, reg_v=True, k_stages=5),
    Case(7, 16, 1024, reg_v=True),
    Case(33, 12, 128, splits=1, reg_v=True, k_stages=2),
    Case(19, 1, 1024, splits=2, reg_v=True, k_stages=3),
    Case(320, 16, 2048, reg_v=True, k_stages=5),
    Case(320, 12, 2048, splits=1, reg_v=True, k_stages=5),
    Case(320, 12, 2048, reg_v=True, k_stages=3),
    Case(5, 32, 2048, splits=1, reg_v=True, k_stages=5),
    Case(33, 20, 128, reg_v=True, k_stages=5),
    Case(7, 12, 2048, splits=2, reg_v=True, k_stages=3, pv_in_flight=2),
    # reg_v at two CTAs an SM (K ring 2, two P.V chunks in flight, 128 registers a thread at launch)
    *(Case(r, h, w, splits=s, reg_v=True, k_stages=2, pv_in_flight=2, ctas_per_sm=2, pv_early=e)
      for r, h, w, s, e in ((1, 16, 2048, 1, True), (5, 12, 2048, 3, True), (7, 16, 1024, None, True),
                            (33, 12, 128, 1, True), (19, 1, 1024, 2, True), (320, 16, 2048, None, True),
                            (320, 12, 2048, 1, True), (5, 32, 2048, 1, True), (33, 20, 128, None, True),
                            (7, 16, 1024, None, False), (320, 12, 2048, 1, False))),
    Case(19, 12, 2048, splits=2, reg_v=True, k_stages=3, pv_early=True),
]

# nvfp4_ds_mla
NVFP4_CASES = [
    nvfp4_case(1, 16, 2048, splits=1),
    nvfp4_case(5, 12, 2048, splits=3),
    nvfp4_case(7, 16, 1024),
    nvfp4_case(33, 12, 128, splits=1),
    nvfp4_case(19, 1, 1024, splits=2),
    nvfp4_case(320, 16, 2048),
    nvfp4_case(320, 12, 2048, splits=1),
    nvfp4_case(5, 16, 2048, splits=1, cvt_rows=16),
    nvfp4_case(7, 12, 2048, splits=1, cvt_rows=8),
    nvfp4_case(7, 16, 2048, splits=1, k_stages=2, v_slots=5),  # an odd V16 ring: a tile's halves straddle slots
    nvfp4_case(5, 32, 2048, splits=1),
    nvfp4_case(19, 20, 1024, splits=2),
]


def _params(fmt: str, reg_v: bool | int = False) -> FewHeadsParams:
    """The default params of a format, or (fp8) the reg_v option at one CTA an SM (reg_v True or 1: K ring 3) or
    two (reg_v 2)."""
    if fmt == "nvfp4_ds_mla":
        return nvfp4_params()
    return reg_v_params(int(reg_v)) if reg_v else FewHeadsParams()


def _check(out, lse, q, kv, slots, counts, ss, os_, fmt: str = "fp8") -> None:
    # nvfp4: latent logits in fp16 (exact products, fp32 sums), only the RoPE logits on fp8 wgmma (2 k-steps)
    wgmma = ROPE_DIMS if fmt == "nvfp4_ds_mla" else True
    triton_check(out, lse, q, kv, slots, counts, fmt, ss, os_, config=few_heads_config(), wgmma=wgmma)


def _planted(fault: str, out: torch.Tensor, lse: torch.Tensor, q, kv, slots, counts, ss, os_):
    """The reference's answer with one fault of the kind a wrong nvfp4 layout or scale would make."""
    out, lse = out.clone(), lse.clone()
    if fault == "even_odd_swapped":
        out[..., 0::2], out[..., 1::2] = out[..., 1::2].clone(), out[..., 0::2].clone()
    elif fault == "halves_swapped":
        out[..., :256], out[..., 256:] = out[..., 256:].clone(), out[..., :256].clone()
    elif fault == "one_scale_block_zero":
        out[..., 32:48] = 0
    elif fault == "rope_halved":  # the RoPE logits at half weight: a wrong RoPE scale
        q_half = q.float()
        q_half[..., 512:] *= 0.5
        ref = reference_decode(q_half.to(q.dtype), kv, slots, counts, fmt="nvfp4_ds_mla", softmax_scale=ss,
                               output_scale=os_)
        out, lse = ref[0].to(out.dtype), ref[1]
    elif fault == "lse_row0_off_by_0.05":  # inside the full 576-dim fp8 bound of row 0 (0.16), outside the RoPE one
        lse[0] += 0.05
    return out, lse


@pytest.mark.parametrize("fault", ["even_odd_swapped", "halves_swapped", "one_scale_block_zero", "rope_halved",
                                   "lse_row0_off_by_0.05"])
def test_nvfp4_check_catches_planted_faults(fault: str) -> None:
    """Runs on CPU: the nvfp4 tolerance (fp8 wgmma bound on the RoPE dims only) passes the reference's own answer and
    fails each planted fault, so the GPU cases above can fail."""
    fmt = "nvfp4_ds_mla"
    q, kv, slots, counts, ss, os_ = _case(5, 12, 256, seed=3, fmt=fmt)
    ref_out, ref_lse = reference_decode(q, kv, slots, counts, fmt=fmt, softmax_scale=ss, output_scale=os_)
    _check(ref_out.to(torch.bfloat16), ref_lse, q, kv, slots, counts, ss, os_, fmt=fmt)
    out, lse = _planted(fault, ref_out.to(torch.bfloat16), ref_lse, q, kv, slots, counts, ss, os_)
    with pytest.raises(AssertionError):
        _check(out, lse, q, kv, slots, counts, ss, os_, fmt=fmt)


@GPU
@pytest.mark.parametrize("case", CASES + NVFP4_CASES, ids=_case_id)
def test_matches_reference(case: Case) -> None:
    fmt = "nvfp4_ds_mla" if case.nvfp4 else "fp8"
    q, kv, slots, counts, ss, os_ = _case(case.rows, case.heads, case.width, seed=case.rows * 5 + case.heads, fmt=fmt)
    out, lse = _poisoned(case.rows, case.heads)
    few_heads_sparse_mla_decode(q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out, lse=lse,
                                splits=case.splits, params=case.params())
    torch.cuda.synchronize()
    _check(out, lse, q, kv, slots, counts, ss, os_, fmt=fmt)


@GPU
def test_without_lse() -> None:
    q, kv, slots, counts, ss, os_ = _case(5, 16, 1024, seed=3)
    out, _ = _poisoned(5, 16)
    few_heads_sparse_mla_decode(q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out, lse=None, splits=2)
    torch.cuda.synchronize()
    _, ref_lse = reference_decode(q, kv, slots, counts, fmt="fp8", softmax_scale=ss, output_scale=os_)
    _check(out, ref_lse, q, kv, slots, counts, ss, os_)


@GPU
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4_ds_mla"])
def test_agrees_with_triton_kernel(fmt: str) -> None:
    """Same inputs through the plain-Triton kernel (its nvfp4 decode is GPU-tested on its own): they differ by no
    more than their own errors allow."""
    q, kv, slots, counts, ss, os_ = _case(20, 12, 2048, seed=11, fmt=fmt)
    out_g, lse_g = _poisoned(20, 12)
    out_t, lse_t = _poisoned(20, 12)
    params = nvfp4_params() if fmt == "nvfp4_ds_mla" else FewHeadsParams()
    few_heads_sparse_mla_decode(q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out_g, lse=lse_g,
                                params=params)
    triton_decode.sparse_mla_decode(q, kv, slots, counts, fmt=fmt, softmax_scale=ss, output_scale=os_, out=out_t,
                                    lse=lse_t)
    torch.cuda.synchronize()
    _check(out_g, lse_g, q, kv, slots, counts, ss, os_, fmt=fmt)
    assert torch.equal(torch.isfinite(lse_t), torch.isfinite(lse_g))
    assert_agree(out_g, out_t, reference_decode(q, kv, slots, counts, fmt=fmt, softmax_scale=ss, output_scale=os_)[0])


@GPU
@pytest.mark.parametrize("fmt,splits,heads,reg_v", [
    pytest.param(f, s, h, r, id=f"{f}-s{s}-h{h}{f'-regv{int(r)}' if r else ''}")
    for f, s, h, r in (("fp8", 1, 12, False), ("fp8", 4, 12, False), ("nvfp4_ds_mla", 3, 12, False),
                       ("fp8", 2, 24, False), ("fp8", 4, 12, True), ("fp8", 2, 24, True), ("fp8", 4, 12, 2),
                       ("fp8", 2, 24, 2))])
def test_cuda_graph_replay(fmt: str, splits: int, heads: int, reg_v: bool | int) -> None:
    """Capture once (workspace made before capture), replay on new inputs copied into the captured buffers."""
    rows, width = 7, 1024
    q, kv, slots, counts, ss, os_ = _case(rows, heads, width, seed=21, fmt=fmt)
    ws = triton_decode.make_workspace(DEVICE, heads=heads, max_rows=rows, widths=(width,), fmt=fmt,
                                      config=few_heads_config())
    out, lse = _poisoned(rows, heads)
    params = _params(fmt, reg_v)

    def call() -> None:
        few_heads_sparse_mla_decode(q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out, lse=lse,
                                    workspace=ws, splits=splits, params=params)

    replay_on_new_inputs(call, (q, kv, slots, counts), _case(rows, heads, width, seed=22, fmt=fmt)[:4], out, lse)
    _check(out, lse, q, kv, slots, counts, ss, os_, fmt=fmt)


def _stream_pieces(rows: int, tiles: int, ctas: int):
    """The segments a stream-K launch's CTAs take, as _regv_stream_consumer walks them: (cta, row, first tile, end
    tile, whole row, piece 0 / 1)."""
    units = rows * tiles
    per = -(-units // ctas)
    for cta in range(ctas):
        u, end = cta * per, min(units, (cta + 1) * per)
        first_row = u // tiles
        while u < end:
            row = u // tiles
            seg_end = min(end, (row + 1) * tiles)
            yield cta, row, u - row * tiles, seg_end - row * tiles, seg_end - u == tiles, int(row != first_row)
            u = seg_end


@pytest.mark.parametrize("ctas", [5, 13, 30])
def test_stream_combine_merges_the_pieces(ctas: int) -> None:
    """triton_decode.stream_combine (the interpreter on a CPU) against the reference: each CTA's piece of a row as the
    stream-K kernel writes it (the reference over the piece's tiles: normalized O and base-2 LSE at entry
    2 cta + piece), whole rows written to out directly. 6 rows of 4 tiles over 5 / 13 / 30 CTAs: pieces misaligned
    with the rows, two a row, four a row (one tile each); count-0, 1-token and all-hole rows among them."""
    rows, heads, width = 6, 12, 256
    tiles = width // 64
    q, kv, slots, counts, ss, os_ = _case(rows, heads, width, seed=31)
    ws = triton_decode.make_workspace(DEVICE, heads=heads, max_rows=rows, widths=(width,),
                                      config=few_heads_config(), min_entries=2 * ctas * heads)
    ws.part_out.fill_(float("nan"))
    out, lse = _poisoned(rows, heads)
    for cta, row, t0, t1, whole, piece in _stream_pieces(rows, tiles, ctas):
        seg_count = (counts[row:row + 1] - 64 * t0).clamp(0, 64 * (t1 - t0))
        o, l_nat = reference_decode(q[row:row + 1], kv, slots[row:row + 1, 64 * t0:64 * t1].contiguous(), seg_count,
                                    fmt="fp8", softmax_scale=ss, output_scale=os_)
        if whole:
            out[row], lse[row] = o[0].to(out.dtype), l_nat[0]
        else:
            entry = (2 * cta + piece) * heads
            ws.part_out.view(-1, 512)[entry:entry + heads] = o[0] / os_
            ws.part_lse[entry:entry + heads] = l_nat[0] / math.log(2.0)
    triton_decode.stream_combine(ws, out, lse, tiles, -(-rows * tiles // ctas), os_)
    triton_check(out, lse, q, kv, slots, counts, "fp8", ss, os_, wgmma=False)


@GPU
@pytest.mark.parametrize("rows,heads,width,ctas_per_sm", [
    (1, 16, 2048, 2), (5, 12, 2048, 2), (7, 16, 1024, 2), (33, 12, 128, 2), (19, 1, 1024, 2), (80, 16, 2048, 2),
    (160, 32, 2048, 2), (264, 16, 2048, 2), (320, 12, 2048, 2), (37, 16, 2048, 1), (45, 24, 1024, 1)])
def test_stream_matches_reference(rows: int, heads: int, width: int, ctas_per_sm: int) -> None:
    """The stream-K form (launch_stream, reg_v at one or two CTAs an SM) against the reference: rows split between
    CTAs at every alignment, holes, count-0 / 1-token / all-hole rows, poisoned outputs (passed on the H200, Triton
    3.6 and 3.8: results/h200-2026-12-04/stream-k)."""
    import dataclasses

    params = dataclasses.replace(reg_v_params(ctas_per_sm), stream=True)
    q, kv, slots, counts, ss, os_ = _case(rows, heads, width, seed=40 + rows)
    ws = triton_decode.make_workspace(DEVICE, heads=heads, max_rows=rows, widths=(width,), config=params.config(heads),
                                      min_entries=stream_entries(heads, params, triton_decode.num_sms(DEVICE)))
    out, lse = _poisoned(rows, heads)
    launch_stream(q, kv, slots, counts, out, lse, ss, os_, ws, params)
    torch.cuda.synchronize()
    _check(out, lse, q, kv, slots, counts, ss, os_)


@GPU
@pytest.mark.parametrize("fmt,heads,rows,reg_v", [("fp8", 16, 160, False), ("fp8", 32, 80, False),
                                                  ("nvfp4_ds_mla", 12, 320, False), ("fp8", 12, 320, True),
                                                  ("fp8", 12, 320, 2), ("fp8", 32, 160, 2)])
def test_tail_split_plan(fmt: str, heads: int, rows: int, reg_v: bool | int) -> None:
    """A tail-split plan (choose_plan with tail_split): the rows of full waves unsplit, the rest split and combined,
    as two launches on row slices; count-0 rows at the seam."""
    from vllm_kimi_dsa.kernels import gluon_few_heads

    params = _params(fmt, reg_v)
    _check(*run_tail_split_plan(lambda *a: gluon_few_heads.launch(*a, params), params.config(heads), rows, heads,
                                seed=7 + rows, fmt=fmt), fmt=fmt)


@GPU
def test_rejects_many_heads() -> None:
    q, kv, slots, counts, ss, os_ = _case(3, 33, 128, seed=5)
    out, lse = _poisoned(3, 33)
    with pytest.raises(ValueError, match="heads"):
        few_heads_sparse_mla_decode(q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out, lse=lse)


@pytest.mark.parametrize("case", CASES + NVFP4_CASES, ids=_case_id)
def test_cases_are_valid_params(case: Case) -> None:
    """Runs on CPU too: a case the kernel cannot take would otherwise surface only on the GPU."""
    assert case.params().nvfp4 == case.nvfp4


@GPU
@pytest.mark.parametrize("heads", [12, 32])
def test_kernel_class_runs_reg_v_from_its_row_threshold(heads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """TritonDecode (fp8, few heads): batches below REG_V_MIN_ROWS (none now: it is 1) on the default params, from it
    on reg_v (where verified); all match the reference, one workspace for all."""
    from vllm_kimi_dsa.kernels.base import DecodeSetup
    from vllm_kimi_dsa.kernels.gluon_few_heads import REG_V_MIN_ROWS, reg_v_verified

    monkeypatch.delenv("VLLM_KIMI_DSA_GLUON", raising=False)
    small, large, width = 5, REG_V_MIN_ROWS + 17, 1024
    setup = DecodeSetup(device=DEVICE, fmt="fp8", heads=heads, row_counts=(small, large, 81), capacities=(),
                        widths=(width,), return_lse=True, softmax_scale=0.04, output_scale=0.37)
    k = triton_decode.TritonDecode(setup)
    if k.gluon is None or not reg_v_verified():
        pytest.skip("the few-heads Gluon kernel or its reg_v params are not verified on this Triton")
    assert k.gluon_large
    assert all(k.plan_params[rows, width][0] is k.plan_params[rows, width][1] for rows in (small, large, 81))
    picked = {rows: k.plan_params[rows, width][0] for rows in (small, large, 81)}
    assert all(p.reg_v == (rows >= REG_V_MIN_ROWS) for rows, p in picked.items())
    # the 2-CTA form somewhere in 20..81 rows (the model's pick; 80 rows at 16 heads on the H200)
    assert any(k.plan_params[r, width][0].ctas_per_sm == 2 for r in range(REG_V_MIN_ROWS, 82))
    for rows in (small, large, 81):
        q, kv, slots, counts, _, _ = _case(rows, heads, width, seed=3 + rows)
        counts[1] = 0
        out, lse = _poisoned(rows, heads)
        k(q, kv, slots, counts, out, lse, block_size=64, rows_per_block_stride=64)
        torch.cuda.synchronize()
        _check(out, lse, q, kv, slots, counts, 0.04, 0.37)
