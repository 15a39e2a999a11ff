"""GPU tests of the warp-specialized Gluon decode (kernels/gluon_decode.py) against reference_decode.

Hopper only (wgmma): every test but the check that each case is a valid GluonParams skips, with the reason, where
gluon_available() is False (CPU CI, other GPUs, Triton versions the kernel is not written for). Cases: fresh random fp8 rows, -1 holes, junk past counts, a count-0
row and an all-holes row, odd row counts, 64 / 96 / 128 heads, widths 128 / 1024 / 2048, one split and several
(the combine), BLOCK_N 64 and 32, K rings of 2-4, V16 rings of 2-4 half tiles, conversion steps of 8 / 16 / 32
rows, and a CUDA-graph capture / replay.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch

from conftest import GLUON_GPU
from vllm_kimi_dsa.formats import LATENT_DIM, NVFP4_SCALE_OFFSET, quantize_rows
from vllm_kimi_dsa.kernels import gluon_decode, gluon_seesaw, triton_decode
from vllm_kimi_dsa.kernels.gluon_decode import GluonParams, gluon_sparse_mla_decode
from vllm_kimi_dsa.planning import gluon_config
from vllm_kimi_dsa.kernels.gluon_seesaw import SeesawParams, seesaw_sparse_mla_decode
from vllm_kimi_dsa.reference import reference_decode
from vllm_kimi_dsa import planning
from vllm_kimi_dsa.kernels import common as kcommon
from test_triton_decode import _check as triton_check

GPU = GLUON_GPU
# The two 64-head kernels (one contract, one config): the tests below that are not about a kernel's own params run
# both; test_gluon_seesaw.py has the seesaw kernel's own cases
DECODES = {"gluon": gluon_sparse_mla_decode, "seesaw": seesaw_sparse_mla_decode}
LAUNCHES = {"gluon": lambda *a: gluon_decode.launch(*a, GluonParams()),
            "seesaw": lambda *a: gluon_seesaw.launch(*a, SeesawParams())}

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Tolerances: tests/test_triton_decode.py's, for the same arithmetic as its 64-head fp8 kernel (bf16 output
# rounding, fp16 P, and the fp8 wgmma's ~14-bit accumulation bounded by conftest.wgmma_logit_bound); see _check.


@dataclass(frozen=True)
class Case:
    rows: int
    heads: int
    width: int
    splits: int | None = None  # None: the heuristic; 1: no combine
    block_n: int = 64
    k_stages: int = 2
    v_slots: int = 3
    cvt_rows: int = 32

    def params(self) -> GluonParams:
        """The kernel's compile-time shape for this case (raises ValueError for one it cannot take)."""
        return GluonParams(block_n=self.block_n, k_stages=self.k_stages, v_slots=self.v_slots, cvt_rows=self.cvt_rows)


CASES = [
    Case(1, 128, 2048, splits=1),
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
    # issue 42: 33..63 heads in one 64-head block (the split tail after whole rows runs here at those counts)
    Case(7, 48, 2048, splits=3),
    Case(19, 33, 1024, splits=2),
    # K and V16 rings, 32-token tiles
    Case(7, 128, 2048, splits=1, k_stages=3, v_slots=2),
    Case(7, 128, 2048, splits=1, v_slots=2),
    Case(33, 96, 1024, splits=1, v_slots=2),
    Case(320, 128, 2048, v_slots=2),
    Case(5, 128, 2048, splits=1, block_n=32, k_stages=4),
    Case(7, 96, 1024, splits=2, block_n=32, k_stages=4),
    Case(5, 128, 2048, splits=1, block_n=32, k_stages=4, v_slots=4),
    Case(19, 128, 2048, splits=2, block_n=32, k_stages=4, v_slots=4),
    Case(33, 96, 1024, splits=1, block_n=32, k_stages=3, v_slots=4),
    Case(33, 96, 1024, splits=1, block_n=32, k_stages=4, v_slots=4),
    Case(19, 96, 1024, splits=2, block_n=32, k_stages=4, v_slots=3),
    Case(320, 128, 2048, block_n=32, k_stages=4, v_slots=4),
    # conversion steps
    Case(7, 96, 1024, splits=1, cvt_rows=8),
    Case(19, 128, 2048, splits=2, cvt_rows=16),
    Case(33, 64, 256, splits=1, block_n=32, k_stages=4, v_slots=4, cvt_rows=16),
    Case(5, 128, 2048, splits=11),
    Case(19, 96, 1024, splits=2, block_n=32, k_stages=4, v_slots=4),
]


def _case(rows: int, heads: int, width: int, *, seed: int, num_rows: int = 4099, fmt: str = "fp8",
          shifted: bool = True):
    """Fresh random inputs: N(0,1) rows (every 7th x8) quantized to fp8, e4m3 queries, slots with -1 holes and far
    out-of-range junk past counts; row 1 count 0, row 2 count 1, row 3 width - 1, row 4 all holes. nvfp4: every
    31st row's block scales negated; unless not `shifted`, every 29th row x200, x450 or x3000 too, block scales past
    72, so the e4m3 forms shift those rows (formats.nvfp4_row_shifts 1, 2, 3)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, 576, generator=g)
    x[::7] *= 8.0
    if fmt == "nvfp4_ds_mla" and shifted:  # row maxima ~600 / ~1300 / past 2688: shifts 1, 2, 3
        big = x[3::29, :LATENT_DIM]
        big *= torch.tensor([200.0, 450.0, 3000.0]).repeat(-(-big.shape[0] // 3))[: big.shape[0], None]
    kv = quantize_rows(x, fmt)
    if fmt == "nvfp4_ds_mla":  # negative block scales (the layout allows them; random-byte caches have them)
        kv[5::31, NVFP4_SCALE_OFFSET:] ^= 0x80
    q = (torch.randn(rows, heads, 576, generator=g) * 1.5).to(torch.float8_e4m3fn)
    slots = torch.randint(0, num_rows, (rows, width), generator=g, dtype=torch.int32)
    counts = torch.randint(0, width + 1, (rows,), generator=g, dtype=torch.int32)
    counts[0] = width
    for i, c in ((1, 0), (2, 1), (3, width - 1)):
        if rows > i:
            counts[i] = c
    past = torch.arange(width).expand(rows, width) >= counts.long().unsqueeze(1)
    junk = torch.randint(1 << 28, 1 << 30, (rows, width), generator=g, dtype=torch.int32)
    slots = torch.where(past, junk, slots)
    hole = (torch.rand(rows, width, generator=g) < 0.1) & ~past
    slots = torch.where(hole, torch.full_like(slots, -1), slots)
    if rows > 4:
        slots[4, : counts[4]] = -1
    softmax_scale = 1.0 / math.sqrt(576.0) * 0.7
    output_scale = 0.37
    return q.to(DEVICE), kv.to(DEVICE), slots.to(DEVICE), counts.to(DEVICE), softmax_scale, output_scale


def _check(out, lse, q, kv, slots, counts, softmax_scale, output_scale, fmt: str = "fp8", **kw) -> None:
    """test_triton_decode's check (bf16 rounding, fp16 P, the fp8-wgmma logit bound) with the Gluon kernel's config;
    kv: fp8 rows, or (fmt conftest.VALUES) the values an e4m3 form computes with."""
    triton_check(out, lse, q, kv, slots, counts, fmt, softmax_scale, output_scale, config=gluon_config(),
                 wgmma=True, **kw)


def test_nvfp4_case_has_every_row_shift_and_negative_scales() -> None:
    """Runs on CPU: the nvfp4 cases every Gluon test draws hold rows of each e4m3 shift (0..3) and rows whose block
    scales are negative, so the GPU cases exercise both."""
    from vllm_kimi_dsa.formats import nvfp4_row_shifts

    _, kv, *_ = _case(5, 16, 256, seed=3, fmt="nvfp4_ds_mla")
    kv = kv.cpu()
    assert (torch.bincount(nvfp4_row_shifts(kv), minlength=4) > 20).all()
    assert bool((kv[:, NVFP4_SCALE_OFFSET:] >= 0x80).all(dim=1).any())


def _poisoned(rows: int, heads: int):
    out = torch.full((rows, heads, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((rows, heads), float("nan"), device=DEVICE)
    return out, lse


@GPU
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c.rows}-h{c.heads}-k{c.width}-s{c.splits}-bn{c.block_n}-ks{c.k_stages}-vs{c.v_slots}-cvt{c.cvt_rows}")
def test_matches_reference(case: Case) -> None:
    q, kv, slots, counts, ss, os_ = _case(case.rows, case.heads, case.width, seed=case.rows * 7 + case.heads)
    out, lse = _poisoned(case.rows, case.heads)
    gluon_sparse_mla_decode(q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out, lse=lse,
                            splits=case.splits, **dataclasses.asdict(case.params()))
    torch.cuda.synchronize()
    _check(out, lse, q, kv, slots, counts, ss, os_)


@GPU
@pytest.mark.parametrize("kernel", DECODES)
def test_without_lse(kernel: str) -> None:
    """lse=None: the kernel writes the workspace's dummy LSE; out must still match."""
    q, kv, slots, counts, ss, os_ = _case(5, 128, 1024, seed=3)
    out, _ = _poisoned(5, 128)
    DECODES[kernel](q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out, lse=None, splits=2)
    torch.cuda.synchronize()
    _, ref_lse = reference_decode(q, kv, slots, counts, fmt="fp8", softmax_scale=ss, output_scale=os_)
    _check(out, ref_lse, q, kv, slots, counts, ss, os_)


@GPU
def test_agrees_with_triton_kernel() -> None:
    """Same inputs through the plain-Triton 64-head kernel: the two differ by no more than their own errors allow."""
    q, kv, slots, counts, ss, os_ = _case(20, 128, 2048, seed=11)
    out_g, lse_g = _poisoned(20, 128)
    out_t, lse_t = _poisoned(20, 128)
    gluon_sparse_mla_decode(q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out_g, lse=lse_g)
    triton_decode.sparse_mla_decode(q, kv, slots, counts, fmt="fp8", softmax_scale=ss, output_scale=os_, out=out_t,
                                    lse=lse_t)
    torch.cuda.synchronize()
    _check(out_g, lse_g, q, kv, slots, counts, ss, os_)
    assert torch.equal(torch.isfinite(lse_t), torch.isfinite(lse_g))
    assert_agree(out_g, out_t, reference_decode(q, kv, slots, counts, fmt="fp8", softmax_scale=ss, output_scale=os_)[0])


def assert_agree(out_a: torch.Tensor, out_b: torch.Tensor, ref: torch.Tensor) -> None:
    """Two kernels' outputs differ by no more than their own errors against the reference allow (rel L2)."""
    err_a = ((out_a.float() - ref).norm() / ref.norm()).item()
    err_b = ((out_b.float() - ref).norm() / ref.norm()).item()
    between = ((out_a.float() - out_b.float()).norm() / ref.norm()).item()
    assert between <= err_a + err_b + 1e-4, f"kernels differ by {between:.2e} (errors {err_a:.2e}, {err_b:.2e})"


@GPU
@pytest.mark.parametrize("kernel", DECODES)
@pytest.mark.parametrize("splits", [1, 4])
def test_cuda_graph_replay(splits: int, kernel: str) -> None:
    """Capture once (workspace made before capture), replay on new inputs copied into the captured buffers."""
    rows, heads, width = 7, 128, 1024
    q, kv, slots, counts, ss, os_ = _case(rows, heads, width, seed=21)
    ws = kcommon.make_workspace(DEVICE, heads=heads, max_rows=rows, widths=(width,), fmt="fp8",
                                      config=gluon_config())
    out, lse = _poisoned(rows, heads)

    def call() -> None:
        DECODES[kernel](q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out, lse=lse, workspace=ws,
                        splits=splits)

    replay_on_new_inputs(call, (q, kv, slots, counts), _case(rows, heads, width, seed=22)[:4], out, lse)
    _check(out, lse, q, kv, slots, counts, ss, os_)


def replay_on_new_inputs(call, inputs, new_inputs, out, lse) -> None:
    """Run `call` once outside a capture (compiles), capture it in a CUDA graph, copy `new_inputs` into `inputs`,
    poison out / lse with NaN and replay: the caller then checks out / lse against the new inputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for dst, src in zip(inputs, new_inputs):
        dst.copy_(src)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()


def run_tail_split_plan(launch, cfg: planning.Config, rows: int, heads: int, seed: int, fmt: str = "fp8"):
    """Inputs of `rows` rows (count-0 rows on both sides of the seam) through choose_plan's tail-split plan for cfg,
    by `launch` (a kernel module's launch with its params bound); returns (out, lse, q, kv, slots, counts, ss, os_)."""
    width = 2048
    plan = planning.choose_plan(rows, heads, width, cfg, kcommon.num_sms(DEVICE))
    whole, splits = plan
    assert 0 < whole < rows and splits > 1, plan
    q, kv, slots, counts, ss, os_ = _case(rows, heads, width, seed=seed, fmt=fmt)
    counts[whole - 1] = 0
    counts[whole] = 0
    ws = kcommon.make_workspace(DEVICE, heads=heads, max_rows=rows, widths=(width,), fmt=fmt, config=cfg)
    out, lse = _poisoned(rows, heads)
    kcommon.run_plan(launch, plan, q, kv, slots, counts, out, lse, ss, os_, ws)
    torch.cuda.synchronize()
    return out, lse, q, kv, slots, counts, ss, os_


@GPU
@pytest.mark.parametrize("kernel", LAUNCHES)
@pytest.mark.parametrize("rows", [80, 160])
def test_tail_split_plan(rows: int, kernel: str) -> None:
    """A tail-split plan (choose_plan with tail_split): the rows of full waves unsplit, the rest split and combined,
    as two launches on row slices (80 rows on 132 SMs: 66 whole, 14 split 4 ways); count-0 rows at the seam."""
    _check(*run_tail_split_plan(LAUNCHES[kernel], gluon_config(), rows, 128, seed=31 + rows))


@GPU
@pytest.mark.parametrize("kernel", DECODES)
def test_rejects_few_heads(kernel: str) -> None:
    q, kv, slots, counts, ss, os_ = _case(3, 32, 128, seed=5)
    out, lse = _poisoned(3, 32)
    with pytest.raises(ValueError, match="heads"):
        DECODES[kernel](q, kv, slots, counts, softmax_scale=ss, output_scale=os_, out=out, lse=lse)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"r{c.rows}-bn{c.block_n}-ks{c.k_stages}-vs{c.v_slots}")
def test_cases_are_valid_params(case: Case) -> None:
    """Runs on CPU too: a case the kernel cannot take would otherwise surface only on the GPU (it did once)."""
    case.params()
