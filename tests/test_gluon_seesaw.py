"""GPU tests of the seesaw Gluon decode (kernels/gluon_seesaw.py) against reference_decode.

Hopper only (wgmma): the GPU tests skip with the reason where gluon_available() is False (CPU CI, other GPUs, other
Triton versions); the checks of the params run everywhere. Inputs are test_gluon_decode's: fresh random fp8 rows,
-1 holes, junk past counts, a count-0 row, a 1-token row and an all-holes row, so rows (and splits) of 0, 1, odd and
even tile counts (which consumer owns the last tile, and who takes it as the other's); odd row counts; 64 / 96 / 128
heads (96: a half-empty second head block); widths 128 / 1024 / 2048; one split and several (the combine); K rings of
2-4; one, two (the default) or four P.V register operands in flight; P.V on e4m3 (pv_fp8, VLLM_KIMI_DSA_FP8_PV=1);
outputs poisoned with NaN; the kernel choice (TritonDecode: launches of whole long rows). test_gluon_decode.py runs its lse=None, CUDA-graph replay, tail-split and
few-heads-rejection tests on this kernel too. Tolerance: test_triton_decode's check for the 64-head fp8 config (bf16
output rounding, fp16 P, the fp8 wgmma's logits within conftest.wgmma_logit_bound): the same arithmetic as
gluon_decode's kernel; pv_fp8 with P_ERR_E4M3 for P's rounding (decode_checks). NaN never passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conftest import GLUON_GPU, VALUES
from decode_checks import P_ERR, P_ERR_E4M3
from test_gluon_decode import _case, _check, _poisoned, assert_agree
from vllm_kimi_dsa.kernels.gluon_decode import gluon_sparse_mla_decode
from vllm_kimi_dsa.formats import nvfp4_e4m3_values
from vllm_kimi_dsa.kernels.gluon_seesaw import (SeesawParams, nvfp4_seesaw_params, pv_fp8_seesaw_params,
                                               seesaw_sparse_mla_decode)
from vllm_kimi_dsa.reference import reference_decode
from vllm_kimi_dsa.backends.hopper import dispatch as hopper_dispatch
from vllm_kimi_dsa.backends import hopper

GPU = GLUON_GPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class Case:
    rows: int
    heads: int
    width: int
    splits: int | None = None  # None: the heuristic; 1: no combine
    k_stages: int = 4
    pv_in_flight: int = 2  # SeesawParams' default
    nvfp4: bool = False  # nvfp4_ds_mla rows, converted to e4m3 by the gatherer
    r_stages: int = 2
    cvt_rows: int = 8
    pv_fp8: bool = False  # P.V on e4m3 wgmma
    consumer_regs: int = SeesawParams.consumer_regs  # SeesawParams' defaults
    producer_regs: int = SeesawParams.producer_regs

    def params(self) -> SeesawParams:
        return SeesawParams(k_stages=self.k_stages, pv_in_flight=self.pv_in_flight, nvfp4=self.nvfp4,
                            r_stages=self.r_stages, cvt_rows=self.cvt_rows, pv_fp8=self.pv_fp8,
                            consumer_regs=self.consumer_regs, producer_regs=self.producer_regs)


def nvfp4_case(rows: int, heads: int, width: int, **kw) -> Case:
    """An nvfp4_ds_mla case on nvfp4_seesaw_params()'s rings unless kw says otherwise."""
    return Case(rows, heads, width, **{"k_stages": 3, "nvfp4": True, **kw})


def pv8_case(rows: int, heads: int, width: int, **kw) -> Case:
    """A P.V-on-e4m3 case on pv_fp8_seesaw_params()'s register budget unless kw says otherwise."""
    shipped = pv_fp8_seesaw_params()
    return Case(rows, heads, width, **{"pv_fp8": True, "consumer_regs": shipped.consumer_regs,
                                       "producer_regs": shipped.producer_regs, **kw})


CASES = [
    Case(1, 128, 2048, splits=1),
    Case(2, 64, 128, splits=1),  # one tile a row: consumer 0 owns it, consumer 1 takes it as the other's
    Case(5, 128, 2048, splits=1),
    Case(5, 128, 2048, splits=3),
    Case(7, 96, 1024),
    Case(7, 96, 1024, splits=1),
    Case(7, 64, 128, splits=1),
    Case(19, 128, 2048, splits=2),
    Case(33, 64, 128),
    Case(33, 128, 1024, splits=1),
    Case(320, 128, 2048),
    Case(320, 128, 2048, splits=1),
    # rings and P.V operands in flight
    Case(7, 128, 2048, splits=1, k_stages=2),
    Case(19, 96, 2048, splits=2, k_stages=3),
    Case(33, 128, 1024, splits=1, pv_in_flight=1),
    Case(5, 128, 2048, splits=11, pv_in_flight=4),
    Case(37, 64, 2048, splits=1, k_stages=3),
    Case(7, 96, 1024, splits=1, pv_in_flight=1),
    Case(2, 64, 128, splits=1, pv_in_flight=1),
    # an even and an odd tile count a split (8 and 5 of 64 tokens)
    Case(3, 128, 2048, splits=4),
    Case(6, 96, 1024, splits=3),
    # issue 42: 33..63 heads in one 64-head block (48: a quarter of it padded, 33: all but one head), odd batches
    Case(7, 48, 2048),
    Case(19, 48, 1024, splits=2),
    Case(320, 48, 2048),
    Case(5, 33, 2048, splits=3),
    # nvfp4_ds_mla through e4m3: held to the fp8 tolerance against formats.nvfp4_e4m3_values of the cache
    nvfp4_case(1, 128, 2048, splits=1),
    nvfp4_case(2, 64, 128, splits=1),
    nvfp4_case(5, 128, 2048, splits=3),
    nvfp4_case(7, 96, 1024),
    nvfp4_case(19, 128, 2048, splits=2),
    nvfp4_case(33, 64, 128),
    nvfp4_case(320, 128, 2048),
    nvfp4_case(320, 64, 2048, splits=1),
    nvfp4_case(3, 128, 2048, splits=4, r_stages=3, k_stages=2),
    nvfp4_case(6, 96, 1024, splits=3, cvt_rows=16),
    nvfp4_case(7, 128, 2048, splits=1, r_stages=1),
    nvfp4_case(5, 64, 2048, splits=2, pv_in_flight=1),
    nvfp4_case(7, 48, 2048),
    nvfp4_case(320, 48, 2048, splits=1),
    # P.V on e4m3 wgmma: held to P_ERR_E4M3 for P
    pv8_case(1, 128, 2048, splits=1),
    pv8_case(2, 64, 128, splits=1),
    pv8_case(5, 128, 2048, splits=3),
    pv8_case(7, 96, 1024, pv_in_flight=1),
    pv8_case(33, 128, 1024, splits=1),
    pv8_case(320, 128, 2048),
    pv8_case(9, 128, 2048, consumer_regs=SeesawParams.consumer_regs,  # the default partition budget
             producer_regs=SeesawParams.producer_regs),
]


def _case_id(c: Case) -> str:
    nv = f"-nvfp4-rs{c.r_stages}-cvt{c.cvt_rows}" if c.nvfp4 else ""
    pv8 = f"-pvfp8-c{c.consumer_regs}-p{c.producer_regs}" if c.pv_fp8 else ""
    return f"r{c.rows}-h{c.heads}-k{c.width}-s{c.splits}-ks{c.k_stages}-pv{c.pv_in_flight}{nv}{pv8}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_cases_are_valid_params(case: Case) -> None:
    """Runs on CPU too: a case the kernel cannot take would otherwise surface only on the GPU."""
    assert case.params().config().block_h == 64


def test_rejects_bad_params() -> None:
    with pytest.raises(ValueError, match="pv_in_flight"):
        SeesawParams(pv_in_flight=3)
    with pytest.raises(ValueError, match="k_stages"):
        SeesawParams(k_stages=6)
    with pytest.raises(ValueError, match="consumer_regs"):
        SeesawParams(consumer_regs=240, producer_regs=56)  # WG0 would get 208 < 240
    with pytest.raises(ValueError, match="pv_fp8"):
        SeesawParams(pv_fp8=True, nvfp4=True)
    with pytest.raises(ValueError, match="pv_in_flight"):
        SeesawParams(pv_fp8=True, pv_in_flight=4)  # two k-steps a tile


@GPU
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_reference(case: Case) -> None:
    fmt = "nvfp4_ds_mla" if case.nvfp4 else "fp8"
    q, kv, slots, counts, ss, os_ = _case(case.rows, case.heads, case.width, seed=case.rows * 11 + case.heads,
                                          fmt=fmt)
    out, lse = _poisoned(case.rows, case.heads)
    seesaw_sparse_mla_decode(q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out, lse=lse,
                             splits=case.splits, params=case.params())
    torch.cuda.synchronize()
    # nvfp4: the consumers compute on nvfp4_e4m3_values of the rows (fp8 K stages, shifted rows scaled back)
    if case.nvfp4:
        _check(out, lse, q, nvfp4_e4m3_values(kv), slots, counts, ss, os_, fmt=VALUES)
    else:
        _check(out, lse, q, kv, slots, counts, ss, os_, p_err=P_ERR_E4M3 if case.pv_fp8 else P_ERR)


@GPU
@pytest.mark.parametrize("splits", [1, 3])
def test_nvfp4_cuda_graph_replay(splits: int) -> None:
    """nvfp4 rows: capture once (workspace made before capture), replay on new inputs copied into the captured
    buffers, equal to eager and within tolerance."""
    from test_gluon_decode import replay_on_new_inputs
    from vllm_kimi_dsa.kernels import common as kcommon

    rows, width, heads, fmt = 7, 1024, 128, "nvfp4_ds_mla"
    params = nvfp4_seesaw_params()
    q, kv, slots, counts, ss, os_ = _case(rows, heads, width, seed=31, fmt=fmt)
    ws = kcommon.make_workspace(DEVICE, heads=heads, max_rows=rows, widths=(width,), fmt=fmt, config=params.config())
    out, lse = _poisoned(rows, heads)

    def call() -> None:
        seesaw_sparse_mla_decode(q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out, lse=lse,
                                 workspace=ws, splits=splits, params=params)

    replay_on_new_inputs(call, (q, kv, slots, counts), _case(rows, heads, width, seed=32, fmt=fmt)[:4], out, lse)
    _check(out, lse, q, nvfp4_e4m3_values(kv), slots, counts, ss, os_, fmt=VALUES)


@GPU
@pytest.mark.parametrize("heads", [128, 32, 24, 48])
def test_kernel_class_runs_nvfp4_on_seesaw(heads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """TritonDecode (nvfp4_ds_mla): at > 32 heads every launch on the seesaw kernel's nvfp4 form (where verified),
    split and tail-split plans included; at 17..32 heads the batches of NVFP4_SEESAW_MIN_ROWS rows or more (heads
    past H masked), the 5-row one on the few-heads form; all match the reference on nvfp4_e4m3_values of the cache."""
    from vllm_kimi_dsa.kernels.base import DecodeSetup

    monkeypatch.delenv("VLLM_KIMI_DSA_GLUON", raising=False)
    monkeypatch.setattr(hopper_dispatch, "num_sms", lambda device: 132)
    rows_list, width, fmt = (5, 9, 64, 80), 2048, "nvfp4_ds_mla"
    q, kv, slots, counts, ss, os_ = _case(max(rows_list), heads, width, seed=67, fmt=fmt)
    setup = DecodeSetup(device=DEVICE, fmt=fmt, heads=heads, row_counts=rows_list, capacities=(),
                        widths=(width,), return_lse=True, softmax_scale=ss, output_scale=os_)
    k = hopper.TritonDecode(setup)
    if k.gluon is None:
        pytest.skip("the seesaw kernel's nvfp4 form is not verified on this Triton")
    assert all(p.nvfp4 for r in rows_list for p in k.plan_params[r, width]), k.plan_params
    seesaw = {r for r in rows_list if all(isinstance(p, SeesawParams) for p in k.plan_params[r, width])}
    assert seesaw == ({9, 64, 80} if heads <= 32 else set(rows_list)), k.plan_params
    for rows in rows_list:
        out, lse = _poisoned(rows, heads)
        k(q[:rows], kv, slots[:rows], counts[:rows], out, lse, block_size=1, rows_per_block_stride=1)
        torch.cuda.synchronize()
        _check(out, lse, q[:rows], nvfp4_e4m3_values(kv), slots[:rows], counts[:rows], ss, os_, fmt=VALUES)


@GPU
@pytest.mark.parametrize("heads", [128, 64, 96])
def test_fp8_pv_kernel_class_and_graph_replay(heads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_KIMI_DSA_FP8_PV=1 (fp8, > 32 heads): TritonDecode runs every launch on the P.V-on-e4m3 form (where
    verified, or forced), one-launch, split, tail-split and whole-row plans all within P_ERR_E4M3 of the reference;
    a CUDA-graph replay on new inputs equals an eager call on them bit for bit."""
    from test_gluon_decode import replay_on_new_inputs
    from vllm_kimi_dsa.kernels.base import DecodeSetup

    monkeypatch.setenv("VLLM_KIMI_DSA_FP8_PV", "1")
    monkeypatch.setenv("VLLM_KIMI_DSA_GLUON", "1")
    monkeypatch.setattr(hopper_dispatch, "num_sms", lambda device: 132)
    rows_list, width = (1, 5, 9, 80, 133), 2048
    q, kv, slots, counts, ss, os_ = _case(max(rows_list), heads, width, seed=71)
    setup = DecodeSetup(device=DEVICE, fmt="fp8", heads=heads, row_counts=rows_list, capacities=(),
                        widths=(width,), return_lse=True, softmax_scale=ss, output_scale=os_)
    k = hopper.TritonDecode(setup)
    assert k.gluon == pv_fp8_seesaw_params()
    for rows in rows_list:
        out, lse = _poisoned(rows, heads)
        k(q[:rows], kv, slots[:rows], counts[:rows], out, lse, block_size=1, rows_per_block_stride=1)
        torch.cuda.synchronize()
        _check(out, lse, q[:rows], kv, slots[:rows], counts[:rows], ss, os_, p_err=P_ERR_E4M3)
    rows = 80  # whole rows and a split tail
    ins = tuple(t[:rows] for t in (q, slots, counts))
    q2, kv2, slots2, counts2, *_ = _case(rows, heads, width, seed=72)
    out, lse = _poisoned(rows, heads)

    def call() -> None:
        k(ins[0], kv, ins[1], ins[2], out, lse, block_size=1, rows_per_block_stride=1)

    replay_on_new_inputs(call, (ins[0], kv, ins[1], ins[2]), (q2, kv2, slots2, counts2), out, lse)
    out_g, lse_g = out.clone(), lse.clone()
    call()
    torch.cuda.synchronize()
    assert torch.equal(out_g, out) and torch.equal(lse_g.isfinite(), lse.isfinite())
    assert torch.equal(lse_g[lse_g.isfinite()], lse[lse.isfinite()])
    _check(out, lse, q2, kv2, slots2, counts2, ss, os_, p_err=P_ERR_E4M3)


@GPU
def test_agrees_with_gluon_kernel() -> None:
    """The same batch through gluon_decode's kernel: the two differ by no more than their errors allow."""
    q, kv, slots, counts, ss, os_ = _case(9, 128, 1024, seed=17)
    out_s, lse_s = _poisoned(9, 128)
    out_g, lse_g = _poisoned(9, 128)
    seesaw_sparse_mla_decode(q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out_s, lse=lse_s, splits=2)
    gluon_sparse_mla_decode(q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out_g, lse=lse_g, splits=2)
    torch.cuda.synchronize()
    _check(out_s, lse_s, q, kv, slots, counts, ss, os_)
    assert torch.equal(torch.isfinite(lse_s), torch.isfinite(lse_g))
    assert_agree(out_s, out_g, reference_decode(q, kv, slots, counts, fmt="fp8", softmax_scale=ss,
                                                output_scale=os_)[0])


@GPU
def test_kernel_class_runs_seesaw_on_whole_long_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """TritonDecode (fp8, 128 heads, K = 2048): 5 rows (split) on gluon_decode's kernel, 64 rows (unsplit) on the
    seesaw kernel (where verified), 80 rows on both (66 whole rows on the seesaw kernel, 14 split on the other) as
    on 132 SMs; all match the reference, one workspace for all."""
    from vllm_kimi_dsa.kernels.base import DecodeSetup
    from vllm_kimi_dsa.kernels.gluon_decode import GluonParams
    from vllm_kimi_dsa.backends.hopper import verified

    monkeypatch.delenv("VLLM_KIMI_DSA_GLUON", raising=False)
    monkeypatch.setattr(hopper_dispatch, "num_sms", lambda device: 132)  # the H200's plans on any Hopper part
    rows_list, width, heads = (5, 64, 80), 2048, 128
    q, kv, slots, counts, ss, os_ = _case(max(rows_list), heads, width, seed=61)
    setup = DecodeSetup(device=DEVICE, fmt="fp8", heads=heads, row_counts=rows_list, capacities=(),
                        widths=(width,), return_lse=True, softmax_scale=ss, output_scale=os_)
    k = hopper.TritonDecode(setup)
    if k.gluon is None or not verified("seesaw"):
        pytest.skip("the Gluon kernels or the seesaw kernel are not verified on this Triton")
    kinds = {r: tuple(type(p) for p in k.plan_params[r, width]) for r in rows_list}
    assert kinds == {5: (SeesawParams, SeesawParams), 64: (SeesawParams, SeesawParams),
                     80: (SeesawParams, GluonParams)}, kinds
    for rows in rows_list:
        out, lse = _poisoned(rows, heads)
        k(q[:rows], kv, slots[:rows], counts[:rows], out, lse, block_size=1, rows_per_block_stride=1)
        torch.cuda.synchronize()
        _check(out, lse, q[:rows], kv, slots[:rows], counts[:rows], ss, os_)
