"""GPU tests of the few-heads Gluon decode (kernels/gluon_few_heads.py: fp8 and nvfp4_ds_mla, <= 32 heads) against
reference_decode.

Hopper only: the GPU tests skip with the reason where gluon_available() is False (CPU CI, other GPUs, other Triton
versions); the check that every case is a valid FewHeadsParams runs everywhere. Inputs are test_gluon_decode's:
fresh random fp8 or nvfp4_ds_mla rows, -1 holes, junk past counts, a count-0 row and an all-holes row; odd row
counts, 1 / 12 / 16 heads (12 and 1 pad the 16-wide MMA; 20, 24 and 32 run as 16-head blocks), widths 128 / 1024 /
2048, one split and several (the combine), K rings of 2-5, one and two CTAs an SM, nvfp4 conversion steps of 8 / 16
/ 32 rows, outputs poisoned with NaN, a CUDA-graph capture / replay. Tolerance: test_triton_decode's check with this
kernel's config (bf16 output rounding, fp16 P, fp8 wgmma logits within conftest.wgmma_logit_bound over all 576 dims);
nvfp4 rows are held to it against nvfp4_as_fp8 of the cache, what the e4m3 form computes with. NaN never passes.
test_nvfp4_check_catches_planted_faults (CPU) shows that check fails on the faults a wrong nvfp4 layout would make,
test_nvfp4_check_sees_the_e4m3_rounding that it tells the e4m3 answer from the exact one.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conftest import GLUON_GPU, VALUES, decode_reference
from test_gluon_decode import _case, _poisoned, assert_agree, replay_on_new_inputs, run_tail_split_plan
from test_triton_decode import _check as triton_check
from vllm_kimi_dsa.kernels import triton_decode
from vllm_kimi_dsa.formats import nvfp4_as_fp8, nvfp4_e4m3_values, nvfp4_row_shifts
from vllm_kimi_dsa.kernels.gluon_few_heads import FewHeadsParams, few_heads_sparse_mla_decode, nvfp4_params, reg_v_params
from vllm_kimi_dsa.planning import few_heads_config
from vllm_kimi_dsa.reference import reference_decode
from vllm_kimi_dsa.kernels import common as kcommon

GPU = GLUON_GPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class Case:
    rows: int
    heads: int
    width: int
    splits: int | None = None  # None: the heuristic; 1: no combine
    k_stages: int = 4
    cvt_rows: int = 32
    nvfp4: bool = False
    reg_v: bool = True
    pv_in_flight: int = 4
    ctas_per_sm: int = 1
    pv_early: bool = False
    block_h: int = 16  # heads a CTA (8: the 8-head blocks of 1..8 heads, fp8)

    def params(self) -> FewHeadsParams:
        # two CTAs an SM leave the gatherer 56 registers (the consumer 200)
        return FewHeadsParams(k_stages=self.k_stages, cvt_rows=self.cvt_rows,
                              nvfp4=self.nvfp4, reg_v=self.reg_v,
                              pv_in_flight=self.pv_in_flight, ctas_per_sm=self.ctas_per_sm, pv_early=self.pv_early,
                              producer_regs=56 if self.ctas_per_sm == 2 else 96, block_h=self.block_h)


def _case_id(c: Case) -> str:
    regv = f"-regv-pv{c.pv_in_flight}-cta{c.ctas_per_sm}{'-early' if c.pv_early else ''}" if c.reg_v else ""
    return (f"{'nvfp4' if c.nvfp4 else 'fp8'}-r{c.rows}-h{c.heads}-k{c.width}-s{c.splits}-ks{c.k_stages}"
            f"-cvt{c.cvt_rows}{regv}" + (f"-bh{c.block_h}" if c.block_h != 16 else ""))


def nvfp4_case(rows: int, heads: int, width: int, **kw) -> Case:
    """An nvfp4_ds_mla case, on nvfp4_params()'s ring shape unless kw says otherwise."""
    return Case(rows, heads, width, **{"k_stages": 3, "nvfp4": True, "reg_v": False, **kw})


CASES = [
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
    # issue 42's head counts: 1..8 heads in one 16-head block (the verified form) and in 8-head blocks (block_h 8,
    # one and two CTAs an SM), 24 heads as two 16-head blocks (the second half padded); odd batches, 1 / several
    # splits, a tail-split-sized batch
    *(Case(r, h, w, splits=s, reg_v=True, k_stages=3, block_h=b)
      for b in (16, 8) for r, h, w, s in ((7, 1, 2048, None), (5, 2, 1024, 3), (33, 4, 128, 1), (19, 6, 2048, 2),
                                          (320, 8, 2048, None), (1, 8, 2048, 1))),
    *(Case(r, h, w, splits=s, reg_v=True, k_stages=2, pv_in_flight=2, ctas_per_sm=2, pv_early=True, block_h=8)
      for r, h, w, s in ((7, 1, 2048, None), (5, 4, 1024, 3), (19, 6, 2048, 2), (320, 8, 2048, None),
                         (1, 8, 2048, 1))),
    Case(320, 24, 2048, reg_v=True, k_stages=3),
    Case(7, 24, 1024, splits=2, reg_v=True, k_stages=2, pv_in_flight=2, ctas_per_sm=2, pv_early=True),
]

# nvfp4_ds_mla (through e4m3): held to the fp8 tolerance against formats.nvfp4_as_fp8 of the cache
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
    nvfp4_case(7, 16, 2048, splits=1, k_stages=2),
    nvfp4_case(5, 32, 2048, splits=1),
    nvfp4_case(19, 20, 1024, splits=2),
    # issue 42's head counts (one 16-head block; 24: two, the second half padded)
    *(nvfp4_case(r, h, w, splits=s) for r, h, w, s in ((7, 1, 2048, None), (5, 2, 1024, 3), (33, 4, 128, 1),
                                                       (19, 6, 2048, 2), (320, 8, 2048, None), (7, 24, 1024, 2))),
]


def _params(fmt: str, reg_v: int = 1, block_h: int = 16) -> FewHeadsParams:
    """The params of a format: nvfp4_params(), or (fp8) reg_v at one CTA an SM (reg_v 1: K ring 3) or two (2), with
    block_h heads a CTA."""
    if fmt == "nvfp4_ds_mla":
        return nvfp4_params()
    return reg_v_params(int(reg_v), block_h=block_h)


def _check(out, lse, q, kv, slots, counts, ss, os_, fmt: str = "fp8") -> None:
    # nvfp4 rows: the kernel computes on nvfp4_e4m3_values of the rows, as fp8 does (fp8 wgmma logits)
    if fmt == "nvfp4_ds_mla":
        kv, fmt = nvfp4_e4m3_values(kv), VALUES
    triton_check(out, lse, q, kv, slots, counts, fmt, ss, os_, config=few_heads_config(), wgmma=True)


def _planted(fault: str, out: torch.Tensor, lse: torch.Tensor):
    """The reference's answer with one fault of the kind a wrong nvfp4 layout or scale would make."""
    out, lse = out.clone(), lse.clone()
    if fault == "even_odd_swapped":
        out[..., 0::2], out[..., 1::2] = out[..., 1::2].clone(), out[..., 0::2].clone()
    elif fault == "halves_swapped":
        out[..., :256], out[..., 256:] = out[..., 256:].clone(), out[..., :256].clone()
    elif fault == "one_scale_block_zero":
        out[..., 32:48] = 0
    return out, lse


@pytest.mark.parametrize("fault", ["even_odd_swapped", "halves_swapped", "one_scale_block_zero"])
def test_nvfp4_check_catches_planted_faults(fault: str) -> None:
    """Runs on CPU: the nvfp4 tolerance (fp8's, against nvfp4_e4m3_values of the cache) passes that cache's
    reference answer and fails each fault a wrong conversion layout or scale would make, so the GPU cases can fail."""
    q, kv, slots, counts, ss, os_ = _case(5, 12, 256, seed=3, fmt="nvfp4_ds_mla")
    ref_out, ref_lse = decode_reference(q, nvfp4_e4m3_values(kv), slots, counts, fmt=VALUES, softmax_scale=ss,
                                        output_scale=os_)
    _check(ref_out.to(torch.bfloat16), ref_lse, q, kv, slots, counts, ss, os_, fmt="nvfp4_ds_mla")
    out, lse = _planted(fault, ref_out.to(torch.bfloat16), ref_lse)
    with pytest.raises(AssertionError):
        _check(out, lse, q, kv, slots, counts, ss, os_, fmt="nvfp4_ds_mla")


def test_nvfp4_check_sees_the_e4m3_rounding() -> None:
    """Runs on CPU: the exact nvfp4 answer (no e4m3 rounding) is outside the e4m3 form's tolerance on these inputs,
    so the GPU cases tell the converter's rounding from none (a converter that skipped it would fail)."""
    q, kv, slots, counts, ss, os_ = _case(5, 12, 256, seed=3, fmt="nvfp4_ds_mla")
    out, lse = reference_decode(q, kv, slots, counts, fmt="nvfp4_ds_mla", softmax_scale=ss, output_scale=os_)
    with pytest.raises(AssertionError):
        _check(out.to(torch.bfloat16), lse, q, kv, slots, counts, ss, os_, fmt="nvfp4_ds_mla")


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
    """Same inputs through the plain-Triton kernel: they differ by no more than their own errors allow. nvfp4: the
    plain kernel decodes the rows exactly, so it gets nvfp4_as_fp8 of them (what this kernel computes with)."""
    q, kv, slots, counts, ss, os_ = _case(20, 12, 2048, seed=11, fmt=fmt, shifted=False)
    if fmt == "nvfp4_ds_mla":  # nvfp4_as_fp8 is then the rows' fp8 decode (no row shifted)
        assert not nvfp4_row_shifts(kv).any()
    out_g, lse_g = _poisoned(20, 12)
    out_t, lse_t = _poisoned(20, 12)
    params = nvfp4_params() if fmt == "nvfp4_ds_mla" else reg_v_params()
    few_heads_sparse_mla_decode(q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out_g, lse=lse_g,
                                params=params)
    kv8 = nvfp4_as_fp8(kv) if fmt == "nvfp4_ds_mla" else kv
    triton_decode.sparse_mla_decode(q, kv8, slots, counts, fmt="fp8", softmax_scale=ss, output_scale=os_, out=out_t,
                                    lse=lse_t)
    torch.cuda.synchronize()
    _check(out_g, lse_g, q, kv, slots, counts, ss, os_, fmt=fmt)
    assert torch.equal(torch.isfinite(lse_t), torch.isfinite(lse_g))
    assert_agree(out_g, out_t, reference_decode(q, kv8, slots, counts, fmt="fp8", softmax_scale=ss,
                                                output_scale=os_)[0])


@GPU
@pytest.mark.parametrize("fmt,splits,heads,reg_v,block_h", [
    pytest.param(f, s, h, r, b, id=f"{f}-s{s}-h{h}{f'-regv{int(r)}' if r else ''}{f'-bh{b}' if b != 16 else ''}")
    for f, s, h, r, b in (("nvfp4_ds_mla", 3, 12, False, 16), ("nvfp4_ds_mla", 1, 24, False, 16),
                          ("fp8", 1, 12, True, 16), ("fp8", 4, 12, True, 16),
                          ("fp8", 2, 24, True, 16), ("fp8", 4, 12, 2, 16), ("fp8", 2, 24, 2, 16),
                          ("nvfp4_ds_mla", 2, 6, False, 16), ("fp8", 3, 8, True, 8), ("fp8", 2, 1, 2, 8),
                          ("fp8", 1, 4, 2, 8), ("fp8", 2, 6, True, 16))])
def test_cuda_graph_replay(fmt: str, splits: int, heads: int, reg_v: bool | int, block_h: int) -> None:
    """Capture once (workspace made before capture), replay on new inputs copied into the captured buffers."""
    rows, width = 7, 1024
    q, kv, slots, counts, ss, os_ = _case(rows, heads, width, seed=21, fmt=fmt)
    params = _params(fmt, reg_v, block_h)
    ws = kcommon.make_workspace(DEVICE, heads=heads, max_rows=rows, widths=(width,), fmt=fmt,
                                      config=params.config(heads))
    out, lse = _poisoned(rows, heads)

    def call() -> None:
        few_heads_sparse_mla_decode(q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out, lse=lse,
                                    workspace=ws, splits=splits, params=params)

    replay_on_new_inputs(call, (q, kv, slots, counts), _case(rows, heads, width, seed=22, fmt=fmt)[:4], out, lse)
    _check(out, lse, q, kv, slots, counts, ss, os_, fmt=fmt)


@GPU
@pytest.mark.parametrize("fmt,heads,rows,reg_v,block_h", [
    pytest.param(f, h, r, v, b, id=f"{f}-h{h}-r{r}-regv{int(v)}-bh{b}")
    for f, h, r, v, b in (("nvfp4_ds_mla", 12, 320, False, 16), ("nvfp4_ds_mla", 32, 160, False, 16),
                          ("fp8", 12, 320, True, 16), ("fp8", 12, 320, 2, 16), ("fp8", 32, 160, 2, 16),
                          ("fp8", 8, 320, True, 8), ("fp8", 6, 300, 2, 8), ("fp8", 24, 160, 2, 16),
                          ("nvfp4_ds_mla", 4, 320, False, 16))])
def test_tail_split_plan(fmt: str, heads: int, rows: int, reg_v: bool | int, block_h: int) -> None:
    """A tail-split plan (choose_plan with tail_split): the rows of full waves unsplit, the rest split and combined,
    as two launches on row slices; count-0 rows at the seam."""
    from vllm_kimi_dsa.kernels import gluon_few_heads

    params = _params(fmt, reg_v, block_h)
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
@pytest.mark.parametrize("heads", [12, 32, 6, 24])
def test_kernel_class_runs_reg_v(heads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """TritonDecode (fp8, few heads): every batch on reg_v (where verified), one or two CTAs an SM by plan cost; all
    match the reference, one workspace for all."""
    from vllm_kimi_dsa.kernels.base import DecodeSetup
    from vllm_kimi_dsa.backends.hopper import TritonDecode

    monkeypatch.delenv("VLLM_KIMI_DSA_GLUON", raising=False)
    width = 1024
    setup = DecodeSetup(device=DEVICE, fmt="fp8", heads=heads, row_counts=(5, 18, 81), capacities=(),
                        widths=(width,), return_lse=True, softmax_scale=0.04, output_scale=0.37)
    k = TritonDecode(setup)
    if not k.gluon_large:
        pytest.skip("the few-heads Gluon kernel is not verified on this Triton")
    assert all(k.plan_params[rows, width][0] is k.plan_params[rows, width][1] for rows in (5, 18, 81))
    assert all(k.plan_params[rows, width][0].reg_v for rows in (5, 18, 81))
    # the 2-CTA form somewhere in 1..81 rows (the model's pick; 80 rows at 16 heads on the H200)
    assert any(k.plan_params[r, width][0].ctas_per_sm == 2 for r in (5, 18, 81))
    for rows in (5, 18, 81):
        q, kv, slots, counts, _, _ = _case(rows, heads, width, seed=3 + rows)
        counts[1] = 0
        out, lse = _poisoned(rows, heads)
        k(q, kv, slots, counts, out, lse, block_size=64, rows_per_block_stride=64)
        torch.cuda.synchronize()
        _check(out, lse, q, kv, slots, counts, 0.04, 0.37)


@GPU
@pytest.mark.parametrize("heads", [1, 4, 8])
def test_kernel_class_runs_8_head_blocks(heads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """TritonDecode (fp8, 1..8 heads) with the 8-head variant asked for (VLLM_KIMI_DSA_GLUON=1, as where
    "few-fp8-h8" is verified): every batch on reg_v with block_h 8, one or two CTAs an SM, its plans on 8-head
    blocks; all match the reference on NaN-poisoned outputs with count-0 rows."""
    from vllm_kimi_dsa.backends.hopper import TritonDecode, variants
    from vllm_kimi_dsa.kernels.base import DecodeSetup

    monkeypatch.setenv("VLLM_KIMI_DSA_GLUON", "1")
    width = 2048
    setup = DecodeSetup(device=DEVICE, fmt="fp8", heads=heads, row_counts=(1, 5, 33, 200), capacities=(),
                        widths=(width,), return_lse=True, softmax_scale=0.04, output_scale=0.37)
    k = TritonDecode(setup)
    assert variants.hopper_kernel("fp8", heads, "1") == "few-fp8-h8"
    assert k.config.block_h == 8 and all(p.block_h == 8 for p in k.gluon_large)
    assert all(k.plan_params[rows, width][0].block_h == 8 for rows in (1, 5, 33, 200))
    for rows in (1, 5, 33, 200):
        q, kv, slots, counts, _, _ = _case(rows, heads, width, seed=7 + rows + heads)
        if rows > 2:
            counts[rows // 2] = 0
        out, lse = _poisoned(rows, heads)
        k(q, kv, slots, counts, out, lse, block_size=64, rows_per_block_stride=64)
        torch.cuda.synchronize()
        _check(out, lse, q, kv, slots, counts, 0.04, 0.37)
