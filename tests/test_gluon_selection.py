"""Which kernel TritonDecode runs: on Hopper the Gluon ones (fp8 at > 32 heads; at <= 32 heads the few-heads kernel
for the formats and head counts it was verified for), this package's Triton one elsewhere.

Runs everywhere: on a CPU (CI) it checks the fallback and GluonParams' argument rules; on a Hopper GPU also that
the Gluon kernel is picked, and that VLLM_KIMI_DSA_GLUON=0 turns it off.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from vllm_kimi_dsa.kernels.base import DecodeSetup
from vllm_kimi_dsa.kernels import gluon_decode
from vllm_kimi_dsa.kernels.gluon_decode import GluonParams
from vllm_kimi_dsa.kernels.common.gluon import gluon_available
from vllm_kimi_dsa.planning import gluon_config
from vllm_kimi_dsa.kernels.gluon_few_heads import FewHeadsParams, nvfp4_params, reg_v_params
from vllm_kimi_dsa.kernels.gluon_seesaw import SeesawParams, pv_fp8_seesaw_params
from vllm_kimi_dsa.backends.hopper.variants import seesaw_takes
from vllm_kimi_dsa.backends.hopper import TritonDecode
from vllm_kimi_dsa.planning import choose_splits, default_config, plan_cost
from vllm_kimi_dsa.backends.hopper import variants
from vllm_kimi_dsa import planning
from vllm_kimi_dsa.backends.hopper import dispatch as hopper_dispatch
from vllm_kimi_dsa.kernels.common import gluon as glcommon

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HOPPER = gluon_available(DEVICE)
AUTO = HOPPER and variants.verified("gluon64")  # picked without being asked for


def _setup(fmt: str, heads: int) -> DecodeSetup:
    return DecodeSetup(
        device=DEVICE, fmt=fmt, heads=heads, row_counts=(4,), capacities=(), widths=(2048,),
        return_lse=True, softmax_scale=1.0 / math.sqrt(576.0), output_scale=1.0,
    )


def test_gluon_params_reject_bad_shapes() -> None:
    GluonParams()  # the defaults fit
    with pytest.raises(ValueError, match="block_n"):
        GluonParams(block_n=48)
    with pytest.raises(ValueError, match="shared memory"):
        GluonParams(block_n=64, k_stages=3, v_slots=4)  # 36 + 108 + 128 KB > 227 KB
    with pytest.raises(ValueError, match="v_slots"):
        GluonParams(v_slots=1)
    with pytest.raises(ValueError, match="k_stages"):
        GluonParams(k_stages=1)
    with pytest.raises(ValueError, match="cvt_rows"):
        GluonParams(cvt_rows=24)
    with pytest.raises(ValueError, match="cvt_rows"):
        GluonParams(block_n=32, cvt_rows=64)
    GluonParams(consumer_regs=232, producer_regs=40)
    GluonParams()  # 36 + 72 + 96 + 16 KB (the P halves) + 2 KB fits
    GluonParams(block_n=32, k_stages=5, v_slots=5)  # 36 + 90 + 80 + 8 + 2 KB
    with pytest.raises(ValueError, match="shared memory"):
        GluonParams(block_n=32, k_stages=5, v_slots=6)  # + 16 KB
    with pytest.raises(ValueError, match="producer_regs"):
        GluonParams(consumer_regs=232, producer_regs=60)
    with pytest.raises(ValueError, match="producer_regs"):
        GluonParams(consumer_regs=248, producer_regs=40)  # WG0 would get 216 < 248


def test_gluon_never_on_cpu() -> None:
    assert not gluon_available("cpu")


# The plain kernel's tile configs, written out (test_kernel_choice compares with default_config itself): 64-head tiles
# above heads.FEW_HEADS_MAX (32); at most 32, fp8 on the transposed kernel (32-head tiles above 16 heads) and nvfp4 in
# 16-head blocks of 32-token tiles.
PLAIN_64 = planning.Config(block_h=64, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=1)
PLAIN_FP8_32 = planning.Config(block_h=32, block_n=64, num_warps=8, num_stages=3, ctas_per_sm=1, swap=True)
PLAIN_FP8_16 = planning.Config(block_h=16, block_n=64, num_warps=4, num_stages=3, ctas_per_sm=2, swap=True)
PLAIN_NVFP4_16 = planning.Config(block_h=16, block_n=32, num_warps=4, num_stages=1, ctas_per_sm=2, prefetch=True,
                                 lazy=True)


@pytest.mark.parametrize("fmt,heads,want", [
    ("fp8", 32, PLAIN_FP8_32),  # DeepSeek-V3.2 (128 heads) at TP 4, GLM-5 at TP 2
    ("fp8", 17, PLAIN_FP8_32), ("fp8", 33, PLAIN_64), ("fp8", 16, PLAIN_FP8_16), ("fp8", 128, PLAIN_64),
    ("nvfp4_ds_mla", 32, PLAIN_NVFP4_16), ("nvfp4_ds_mla", 33, PLAIN_64),
])
def test_the_plain_kernels_tile_config_at_the_head_split(fmt: str, heads: int, want, monkeypatch) -> None:
    """VLLM_KIMI_DSA_GLUON=0 (and every GPU without Gluon): TritonDecode binds the plain kernel's config for the
    heads of a rank; 32 heads a rank take the 32-head config, not the 64-head tiles of 33 and more."""
    monkeypatch.setenv("VLLM_KIMI_DSA_GLUON", "0")
    k = TritonDecode(_setup(fmt, heads))
    assert k.gluon is None and k.config == want
    assert all(pair == (None, None) for pair in k.plan_params.values())  # every launch on the plain kernel


@pytest.mark.parametrize("fmt,heads", [("fp8", 128), ("fp8", 64), ("fp8", 32), ("fp8", 16), ("fp8", 12),
                                       ("nvfp4_ds_mla", 128), ("nvfp4_ds_mla", 32), ("nvfp4_ds_mla", 12)])
def test_kernel_choice(fmt: str, heads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_KIMI_DSA_GLUON", raising=False)  # the choice without being asked (the env forces it)
    k = TritonDecode(_setup(fmt, heads))
    if heads <= 32:
        want = HOPPER and variants.verified(("few-fp8" if fmt == "fp8" else "few-nvfp4") + ("-multi" if heads > 16 else ""))
    else:
        want = AUTO and (fmt == "fp8" or variants.verified("seesaw-nvfp4"))
    assert (k.gluon is not None) == want
    if k.gluon is None:
        assert k.config == default_config(heads, fmt)
    elif heads > 32 and fmt != "fp8":  # nvfp4: every launch on the seesaw kernel's nvfp4 form
        assert isinstance(k.gluon, SeesawParams) and k.gluon.nvfp4 and not k.gluon_large
        assert all(pair == (k.gluon, k.gluon) for pair in k.plan_params.values())
        return
    elif heads > 32:
        assert k.config.block_h == 64 and k.config.block_n == k.gluon.block_n
    else:
        assert isinstance(k.gluon, FewHeadsParams) and k.config.block_h == 16 and k.config.swap
        assert k.gluon.nvfp4 == (fmt == "nvfp4_ds_mla") and k.gluon.reg_v == (fmt == "fp8")
    if heads > 32:  # fp8: the seesaw kernel for launches of whole long rows, on the same tiles and plans
        assert k.gluon_large == ((SeesawParams(),) if want and variants.verified("seesaw") else ())
        assert all(p.config(heads) == k.config for p in k.gluon_large)
        if not k.gluon_large:
            assert all(pair == (k.gluon, k.gluon) for pair in k.plan_params.values())
        return
    if fmt != "fp8":  # nvfp4 few heads; 17..32 heads: the seesaw nvfp4 form from NVFP4_SEESAW_MIN_ROWS rows
        assert k.gluon_large == ((SeesawParams(k_stages=3, nvfp4=True, r_stages=2, cvt_rows=8),)
                                 if want and heads > 16 else ())
        for (rows, _), pair in k.plan_params.items():
            seesaw = want and heads > 16 and rows >= variants.NVFP4_SEESAW_MIN_ROWS
            assert pair == ((k.gluon_large[0],) * 2 if seesaw else (k.gluon, k.gluon)), (rows, pair)
        return
    # fp8 few heads: every batch on reg_v, at one or two CTAs an SM, with the same tile shape
    assert bool(k.gluon_large) == want
    assert [p.ctas_per_sm for p in k.gluon_large] == ([1, 2] if k.gluon_large else [])
    for p in k.gluon_large:
        assert p.reg_v and p.config(heads) == dataclasses.replace(k.config, ctas_per_sm=p.ctas_per_sm,
                                                                   tile_cost=p.config(heads).tile_cost,
                                                                   lead_split=True)
    assert all(first is tail for first, tail in k.plan_params.values())
    assert {r for (r, _), (p, _) in k.plan_params.items() if getattr(p, "reg_v", False)} == (
        {r for r, _ in k.plan_params} if k.gluon_large else set())


# The H200's tail-split times at K = 2048, µs at one / two CTAs an SM (reg_v_params() / reg_v_params(2)), fp16 split
# partials, one run (NOTES v21; results/h200-2026-12-04/plan-sweep/fit_plan_cost.json, what TWO_CTA_TILE_COST is
# fitted to). The v15 / v16 tables (fp32 partials, before the whole-sector stores) are in NOTES v15 / v16.
MEASURED_REG_V_US = {
    12: {1: (8.2, 8.0), 5: (11.2, 10.8), 8: (11.8, 11.9), 16: (15.3, 15.4), 20: (17.6, 16.9), 32: (20.2, 19.8),
         40: (24.2, 24.0), 48: (30.1, 25.8), 64: (31.8, 29.9), 80: (44.8, 35.5), 100: (49.4, 44.1), 120: (51.3, 47.3),
         140: (64.5, 62.7), 160: (72.1, 65.3), 200: (94.8, 75.3), 240: (98.2, 77.7), 264: (98.9, 82.8),
         320: (129.3, 110.6)},
    16: {1: (8.2, 8.1), 5: (11.2, 11.0), 8: (12.0, 12.1), 16: (15.5, 15.7), 20: (17.7, 17.2), 32: (20.6, 20.2),
         40: (24.5, 24.0), 48: (30.3, 26.1), 64: (32.0, 30.6), 80: (45.1, 36.2), 100: (49.4, 44.7), 120: (51.1, 48.8),
         140: (64.5, 64.0), 160: (72.2, 67.2), 200: (95.1, 75.4), 240: (98.4, 78.4), 264: (99.0, 82.9),
         320: (129.9, 110.6)},
    32: {1: (8.6, 8.4), 5: (12.3, 12.7), 8: (13.7, 13.6), 16: (18.6, 17.6), 20: (22.5, 21.5), 32: (29.6, 25.8),
         40: (42.0, 32.3), 48: (48.3, 42.0), 64: (48.8, 43.2), 80: (67.1, 59.6), 100: (89.3, 72.7), 120: (95.6, 73.8),
         140: (110.6, 88.7), 160: (125.7, 100.3), 200: (152.4, 131.7), 240: (183.7, 143.0), 264: (187.7, 142.9),
         320: (232.5, 188.8)},
}
# A pick may be this much slower than the faster form: the spread of one run at 1-16 rows (0.1-0.2 µs of ~8-16 µs)
PICK_SLACK = 0.03


def _picked_us(heads: int, rows: int) -> tuple[float, float]:
    """(µs of the form plan_cost picks, µs of the faster form) at a measured point."""
    one, two = MEASURED_REG_V_US[heads][rows]
    costs = {c: plan_cost(rows, heads, 2048, reg_v_params(c).config(heads), 132) for c in (1, 2)}
    return (one, two)[min(costs, key=costs.get) - 1], min(one, two)


@pytest.mark.parametrize("heads,rows", [(h, r) for h, times in MEASURED_REG_V_US.items() for r in times])
def test_plan_cost_picks_the_measured_faster_reg_v_occupancy(heads: int, rows: int) -> None:
    """plan_cost with TWO_CTA_TILE_COST picks the form (one or two CTAs an SM) the H200 ran faster, or one within
    PICK_SLACK of it."""
    picked, fastest = _picked_us(heads, rows)
    assert picked <= fastest * (1 + PICK_SLACK), (picked, fastest)


def test_plan_cost_loses_little_over_the_measured_points() -> None:
    """Over all 54 points the picks cost at most 2 µs in all (1.0 with the fitted factors; v15's lost 39.7)."""
    lost = sum(p - f for p, f in (_picked_us(h, r) for h, times in MEASURED_REG_V_US.items() for r in times))
    assert lost <= 2.0, lost


def test_few_heads_params_reject_bad_shapes() -> None:
    assert FewHeadsParams().smem_bytes() <= 227 * 1024
    assert 2 * (reg_v_params(2).smem_bytes() + 1024) <= 228 * 1024
    assert reg_v_params(2).launch_options() == {"maxnreg": 128} and reg_v_params().launch_options() == {}
    with pytest.raises(ValueError, match="ctas_per_sm=2 needs reg_v"):
        FewHeadsParams(ctas_per_sm=2, k_stages=2)
    with pytest.raises(ValueError, match="ctas_per_sm=2 needs reg_v"):
        FewHeadsParams(reg_v=True, k_stages=2, ctas_per_sm=2)  # 4 P.V chunks in flight need > 128 registers
    with pytest.raises(ValueError, match="ctas_per_sm=2 needs reg_v"):
        FewHeadsParams(reg_v=True, k_stages=3, pv_in_flight=2, ctas_per_sm=2)  # 2 x 124 KB > 228 KB
    with pytest.raises(ValueError, match="ctas_per_sm"):
        FewHeadsParams(reg_v=True, k_stages=2, pv_in_flight=2, ctas_per_sm=3)
    with pytest.raises(ValueError, match="pv_in_flight"):
        FewHeadsParams(reg_v=True, pv_in_flight=0)
    with pytest.raises(ValueError, match="exactly one"):
        FewHeadsParams(nvfp4=True)
    with pytest.raises(ValueError, match="k_stages"):
        FewHeadsParams(k_stages=1)
    with pytest.raises(ValueError, match="cvt_rows"):
        FewHeadsParams(cvt_rows=64)
    with pytest.raises(ValueError, match="producer_regs"):
        FewHeadsParams(producer_regs=50)
    assert nvfp4_params().smem_bytes() <= 227 * 1024 and nvfp4_params().nvfp4
    with pytest.raises(ValueError, match="shared memory"):
        FewHeadsParams(k_stages=4, nvfp4=True, reg_v=False)  # 4 x (36 + 18) KB + Q and P > 227 KB
    with pytest.raises(ValueError, match="converter_regs"):
        FewHeadsParams(nvfp4=True, reg_v=False, converter_regs=300)


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel runs on Hopper (sm_90) only")
def test_env_turns_gluon_off_and_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KIMI_DSA_GLUON", "0")
    assert TritonDecode(_setup("fp8", 128)).gluon is None
    assert TritonDecode(_setup("fp8", 16)).gluon is None
    monkeypatch.setenv("VLLM_KIMI_DSA_GLUON", "1")
    assert TritonDecode(_setup("fp8", 128)).gluon is not None
    assert isinstance(TritonDecode(_setup("fp8", 12)).gluon, FewHeadsParams)
    assert isinstance(TritonDecode(_setup("fp8", 32)).gluon, FewHeadsParams)  # 16-head blocks, asked for
    assert TritonDecode(_setup("nvfp4_ds_mla", 12)).gluon.nvfp4
    assert TritonDecode(_setup("nvfp4_ds_mla", 128)).gluon.nvfp4  # the seesaw kernel's nvfp4 form


def test_env_cannot_force_gluon_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KIMI_DSA_GLUON", "1")
    assert (TritonDecode(_setup("fp8", 128)).gluon is not None) == HOPPER


def test_seesaw_runs_the_launches_of_whole_long_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs on a CPU too (the binding, not the kernels): TritonDecode at 128 heads, fp8, bound as on the H200's 132
    SMs, runs a one-launch plan (split or not) and each unsplit launch of rows of >= SEESAW_MIN_TILES tiles on the
    seesaw kernel and a split tail after whole rows on gluon_decode's kernel; the plans are the 64-head kernel's
    either way."""

    monkeypatch.setenv("VLLM_KIMI_DSA_GLUON", "1")
    monkeypatch.setattr(hopper_dispatch, "gluon_available", lambda device=None: True)
    monkeypatch.setattr(hopper_dispatch, "num_sms", lambda device: 132)
    setup = DecodeSetup(device=DEVICE, fmt="fp8", heads=128, row_counts=(320,), capacities=(), widths=(512, 1024, 2048),
                        return_lse=True, softmax_scale=0.04, output_scale=1.0)
    k = TritonDecode(setup)
    assert isinstance(k.gluon, GluonParams) and k.gluon_large == (SeesawParams(),)
    for (rows, width), (first, tail) in k.plan_params.items():
        whole, splits = k._plans[rows, width]
        assert (whole, splits) == planning.choose_plan(rows, 128, width, gluon_config(), 132)
        assert isinstance(first, SeesawParams) == seesaw_takes(width, 1 if whole else splits, alone=not whole)
        assert isinstance(first, SeesawParams)  # widths 512 .. 2048: 8 .. 32 tiles, all >= SEESAW_MIN_TILES
        assert tail is first if not whole else isinstance(tail, SeesawParams) == seesaw_takes(width, splits)
        assert all(isinstance(p, (GluonParams, SeesawParams)) for p in (first, tail))
    kinds = {rows: tuple(type(p).__name__[0] for p in k.plan_params[rows, 2048]) for rows in (5, 20, 64, 80, 200, 320)}
    # 5 / 20 rows: one launch split 11 / 3 ways; 64 and 320 rows unsplit; 80 and 200 rows: whole rows, then a split
    # tail (the tail on the 64-head kernel)
    assert kinds == {5: ("S", "S"), 20: ("S", "S"), 64: ("S", "S"), 80: ("S", "G"), 200: ("S", "G"),
                     320: ("S", "S")}, kinds
    assert k._plans[64, 1024] == (0, 1) and all(isinstance(p, SeesawParams) for p in k.plan_params[64, 1024])
    # width 512 (8 tiles): whole rows on the seesaw kernel too, the split tail after them on the 64-head kernel
    for r in range(1, 321):
        whole = k._plans[r, 512][0]
        assert isinstance(k.plan_params[r, 512][0], SeesawParams), r
        assert isinstance(k.plan_params[r, 512][1], SeesawParams) == (not whole), r


@pytest.mark.parametrize("heads", [128, 96, 64])
def test_fp8_pv_opt_in_runs_every_launch_on_the_e4m3_form(heads: int, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Runs on a CPU too (the binding): VLLM_KIMI_DSA_FP8_PV=1 at > 32 heads (fp8) binds the seesaw kernel's
    P.V-on-e4m3 form to both launches of every plan (split tails included: it is faster than the default pair there,
    docs/hopper-kernels.md), on the 64-head kernel's plans; nvfp4 and <= 32 heads are unchanged; where the form is
    not verified on this Triton, a warning and the default kernels."""
    monkeypatch.setenv("VLLM_KIMI_DSA_FP8_PV", "1")
    monkeypatch.delenv("VLLM_KIMI_DSA_GLUON", raising=False)
    monkeypatch.setattr(hopper_dispatch, "gluon_available", lambda device=None: True)
    monkeypatch.setattr(hopper_dispatch, "num_sms", lambda device: 132)
    monkeypatch.setattr(variants, "verified", lambda v: True)
    setup = DecodeSetup(device=DEVICE, fmt="fp8", heads=heads, row_counts=(320,), capacities=(), widths=(512, 2048),
                        return_lse=True, softmax_scale=0.04, output_scale=1.0)
    k = TritonDecode(setup)
    assert k.gluon == pv_fp8_seesaw_params() and not k.gluon_large and k.config == gluon_config()
    for (rows, width), pair in k.plan_params.items():
        assert pair == (k.gluon, k.gluon), (rows, width, pair)
        assert k._plans[rows, width] == planning.choose_plan(rows, heads, width, gluon_config(), 132)
    assert not TritonDecode(dataclasses.replace(setup, fmt="nvfp4_ds_mla")).gluon.pv_fp8
    assert isinstance(TritonDecode(dataclasses.replace(setup, heads=32)).gluon, FewHeadsParams)
    # not verified on this Triton: the default pair, and a warning naming the switch
    monkeypatch.setattr(variants, "verified", lambda v: v != "seesaw-pv-fp8")
    with caplog.at_level("WARNING"):
        k = TritonDecode(setup)
    assert isinstance(k.gluon, GluonParams) and k.gluon_large == (SeesawParams(),)
    assert "VLLM_KIMI_DSA_FP8_PV" in caplog.text
    monkeypatch.setenv("VLLM_KIMI_DSA_GLUON", "1")  # ... unless forced
    assert TritonDecode(setup).gluon == pv_fp8_seesaw_params()


def test_fp8_pv_switch_rejects_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_kimi_dsa import envs

    monkeypatch.setenv("VLLM_KIMI_DSA_FP8_PV", "yes")
    with pytest.raises(ValueError, match="VLLM_KIMI_DSA_FP8_PV='yes'"):
        envs.fp8_pv()
    monkeypatch.delenv("VLLM_KIMI_DSA_FP8_PV")
    assert envs.fp8_pv() is False


@pytest.mark.parametrize("heads", [17, 24, 32, 16])
def test_nvfp4_seesaw_form_runs_the_larger_batches_of_17_to_32_heads(heads: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs on a CPU too (the binding): nvfp4 at 17..32 heads runs plans of >= NVFP4_SEESAW_MIN_ROWS rows on the
    seesaw kernel's nvfp4 form (both launches, the plan the 64-head config makes) and smaller ones on the few-heads
    form (its own plans); at 16 heads every plan stays on the few-heads form."""
    from vllm_kimi_dsa.planning import choose_plan

    monkeypatch.setenv("VLLM_KIMI_DSA_GLUON", "1")
    monkeypatch.setattr(hopper_dispatch, "gluon_available", lambda device=None: True)
    monkeypatch.setattr(hopper_dispatch, "num_sms", lambda device: 132)
    setup = DecodeSetup(device=DEVICE, fmt="nvfp4_ds_mla", heads=heads, row_counts=(40,), capacities=(),
                        widths=(512, 2048), return_lse=True, softmax_scale=0.04, output_scale=1.0)
    k = TritonDecode(setup)
    assert isinstance(k.gluon, FewHeadsParams) and k.gluon.nvfp4
    seesaw_rows = set()
    for (rows, width), (first, tail) in k.plan_params.items():
        seesaw = heads > 16 and rows >= variants.NVFP4_SEESAW_MIN_ROWS
        assert first is tail and isinstance(first, SeesawParams) == seesaw and first.nvfp4, (rows, first)
        config = first.config(heads) if seesaw else k.config
        assert k._plans[rows, width] == choose_plan(rows, heads, width, config, 132)
        seesaw_rows |= {rows} if seesaw else set()
    assert seesaw_rows == (set(range(variants.NVFP4_SEESAW_MIN_ROWS, 41)) if heads > 16 else set())
    # the workspace holds every plan's splits (made after the binding re-made the seesaw plans)
    from vllm_kimi_dsa.kernels.common.workspace import split_entries
    assert k.workspace.capacity >= split_entries(k._plans, heads)


def test_run_plan_runs_split_rows_on_split_launch() -> None:
    """run_plan: a one-launch plan on launch; a tail-split plan's whole rows on launch (unsplit), the rest on
    split_launch, each on its row slice."""
    from vllm_kimi_dsa.kernels.common import run_plan

    calls: list[tuple[str, int, int]] = []

    def recorder(name: str):
        return lambda q, kv, s, c, o, lse, splits: calls.append((name, q.shape[0], splits))

    q, out = torch.zeros(10, 2, 3), torch.zeros(10, 2, 4)
    slots, counts = torch.zeros(10, 8, dtype=torch.int32), torch.zeros(10, dtype=torch.int32)
    run_plan(recorder("a"), (0, 3), q, None, slots, counts, out, None, split_launch=recorder("b"))
    run_plan(recorder("a"), (7, 4), q, None, slots, counts, out, None, split_launch=recorder("b"))
    run_plan(recorder("a"), (7, 4), q, None, slots, counts, out, None)
    assert calls == [("a", 10, 3), ("a", 7, 1), ("b", 3, 4), ("a", 7, 1), ("a", 3, 4)]


def test_gluon_split_picks_match_the_h200_probe() -> None:
    """choose_splits with gluon_config picks the split count the H200 measured fastest (bench_gluon --splits,
    results/h200-2026-12-03/gluon-v7/splits_probe.json): 11 at 5 rows, 3 at 20, 2-3 at 80 (4 was 8% slower), 1 at 320;
    the plain Triton kernel's configs do not carry the partial-traffic term."""
    cfg = gluon_config()
    picks = {rows: choose_splits(rows, 128, 2048, cfg, 132) for rows in (5, 20, 80, 320)}
    assert picks[5] == 11 and picks[20] == 3 and picks[80] in (2, 3) and picks[320] == 1, picks
    assert default_config(128, "fp8").split_tiles == 0.0


def test_few_heads_split_picks_match_the_h200_probe() -> None:
    """choose_splits with few_heads_config picks what the H200 probe (bench_few_heads --splits, H = 16, results/
    h200-2026-12-03/few-heads-v1/few_heads_bench.json) and the bench beside it measured fastest: 16 at 5 rows
    (11.3 µs vs 14.2 at 8 and 15.6 at 32), 3 at 80 (53.0 vs 57.5 at 1, 67.0 at 2, 59.7 at 4), 2 at 320 (167.5 vs
    170.3 at 1 and 185.9 at 3)."""
    from vllm_kimi_dsa.planning import few_heads_config

    for heads in (16, 12):
        picks = {rows: choose_splits(rows, heads, 2048, few_heads_config(), 132) for rows in (5, 80, 320)}
        assert picks == {5: 16, 80: 3, 320: 2}, picks


@pytest.mark.skipif(glcommon.gl is None, reason=glcommon.gluon_unavailable_reason() or "Gluon unavailable")
@pytest.mark.parametrize("scheduled", [False, True], ids=["static", "scheduled"])
@pytest.mark.parametrize("which", ["gluon", "seesaw", "few", "few-nvfp4", "few-32"])
def test_launchers_pass_every_kernel_argument(which: str, scheduled: bool) -> None:
    """Runs on CPU: each launcher hands its kernel exactly the kernel's parameters (runtime ones positionally, the
    constexprs by name), on the grid (head blocks, splits, rows), or a scheduled launch's (head blocks, items, 1) with
    its item table and SCHEDULED. A GPU is needed for everything else."""
    from vllm_kimi_dsa.kernels.common import schedule as ksched
    from vllm_kimi_dsa.planning.schedule import schedule_shape
    from vllm_kimi_dsa.formats import LATENT_DIM
    from vllm_kimi_dsa.kernels import gluon_few_heads
    from vllm_kimi_dsa.kernels.common import make_workspace

    seen: dict = {}

    class FakeKernel:
        def __init__(self, fn) -> None:
            self.arg_names = fn.arg_names

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.update(grid=grid, args=args, kwargs=kwargs)
            return run

    rows, heads = 3, {"gluon": 128, "seesaw": 128, "few-32": 32}.get(which, 12)
    q = torch.zeros(rows, heads, 576, dtype=torch.float8_e4m3fn)
    kv = (torch.zeros(8, 352, dtype=torch.uint8) if which == "few-nvfp4" else torch.zeros(8, 576, dtype=torch.float8_e4m3fn))
    slots = torch.zeros(rows, 128, dtype=torch.int32)
    counts = torch.zeros(rows, dtype=torch.int32)
    out = torch.zeros(rows, heads, LATENT_DIM, dtype=torch.bfloat16)
    if which == "gluon":
        fn, params, mod = gluon_decode.gluon_decode_kernel, GluonParams(), gluon_decode
    elif which == "seesaw":
        from vllm_kimi_dsa.kernels import gluon_seesaw

        fn, params, mod = gluon_seesaw.seesaw_decode_kernel, SeesawParams(), gluon_seesaw
    else:
        params = nvfp4_params() if which == "few-nvfp4" else FewHeadsParams()
        fn, mod = gluon_few_heads.few_heads_kernel, gluon_few_heads
    shape = schedule_shape(rows, 128, heads, params.config(heads), 4)
    ws = make_workspace("cpu", heads=heads, max_rows=rows, widths=(128,), config=params.config(),
                        schedules=(shape,) if scheduled else ())
    tabs = ksched.tables(ws.sched, shape) if scheduled else None
    real = getattr(mod, fn.__name__)
    setattr(mod, fn.__name__, FakeKernel(fn))
    try:
        mod.launch(q, kv, slots, counts, out, None, 0.1, 1.0, ws, 1, params, 0, tabs)
    finally:
        setattr(mod, fn.__name__, real)
    names = list(fn.arg_names)
    consts = set(seen["kwargs"]) - {"num_warps"}  # num_warps is a launch option, not a parameter
    assert seen["kwargs"]["SCHEDULED"] is scheduled
    assert seen["args"][names.index("items_ptr")] is (tabs.items if scheduled else counts)
    assert seen["grid"] == ((1 if heads <= 16 else 2), shape.items if scheduled else 1, 1 if scheduled else rows)
    assert len(seen["args"]) + len(consts) == len(names), (len(seen["args"]), sorted(consts), names)
    assert consts == set(names[len(seen["args"]):])


def test_verified_variants() -> None:
    """The Triton versions each Gluon variant passed its GPU tests on (the nvfp4 forms' current code on the H100);
    no other version is listed. The 8-head few-heads blocks (issue 42) are not GPU-tested yet: none."""
    assert variants.VERIFIED_TRITON == dict.fromkeys(
        ("gluon64", "seesaw", "seesaw-pv-fp8", "seesaw-nvfp4", "few-fp8", "few-fp8-multi", "few-nvfp4",
         "few-nvfp4-multi", "pv_early"), ("3.6", "3.8")) | {"few-fp8-h8": ()}
