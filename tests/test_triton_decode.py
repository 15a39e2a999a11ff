"""Tests of the Triton sparse MLA decode (kernels/triton_decode.py) against reference_decode.

CPU (TRITON_INTERPRET=1): a few tiny cases; GPU: every head count, both formats, rows 1..320.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from vllm_kimi_dsa import host_math
from vllm_kimi_dsa.formats import E2M1_VALUES, LATENT_DIM
from vllm_kimi_dsa.kernels.base import DecodeSetup
from vllm_kimi_dsa.kernels import triton_decode
from vllm_kimi_dsa.kernels.triton_decode import sparse_mla_decode
from vllm_kimi_dsa.planning import Config, choose_plan, choose_splits, default_config
from vllm_kimi_dsa.backends.hopper import TritonDecode
from vllm_kimi_dsa.kernels.common import make_workspace
from vllm_kimi_dsa.reference import reference_decode
from vllm_kimi_dsa.kernels import common as kcommon
from conftest import computed_operands, fp8_wgmma_dims

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
FORMATS = ("fp8", "nvfp4_ds_mla")

from decode_checks import (  # noqa: E402, F401  (the shared tolerances and checker; names kept for sibling tests)
    BF16_REL,
    LSE_ATOL,
    NORM_REL,
    OUT_REL,
    P_ERR,
    PARTIAL_ERR,
    SHIPPED_PARTIAL_ERR,
)
from decode_checks import check_decode as _check  # noqa: E402
from decode_checks import fp8_wgmma_for as _fp8_wgmma  # noqa: E402, F401
from decode_checks import random_case as _case  # noqa: E402


def _check_as_computed(kernel, out, lse, q, kv, slots, counts, fmt, softmax_scale, output_scale) -> None:
    """_check against the decode a TritonDecode computes (conftest.computed_operands: a Gluon nvfp4 form's fp8
    rows), with its logit bound."""
    q, kv, fmt_c, ss, os_ = computed_operands(kernel, fmt, q, kv, softmax_scale, output_scale)
    _check(out, lse, q, kv, slots, counts, fmt_c, ss, os_, wgmma=fp8_wgmma_dims(kernel, fmt) or False)


def _run_functional(rows, heads, width, fmt, seed, *, with_lse=True, config=None, splits=None):
    q, kv, slots, counts, ss, os_ = _case(rows, heads, width, fmt, seed=seed)
    out = torch.full((rows, heads, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((rows, heads), float("nan"), device=DEVICE) if with_lse else None
    sparse_mla_decode(
        q, kv, slots, counts, fmt=fmt, softmax_scale=ss, output_scale=os_, out=out, lse=lse,
        config=config, splits=splits,
    )
    if lse is None:
        _, lse = reference_decode(q, kv, slots, counts, fmt=fmt, softmax_scale=ss, output_scale=os_)
    _check(out, lse, q, kv, slots, counts, fmt, ss, os_, config)


# --------------------------------------------------------------------------- CPU + GPU (tiny)

TINY = [  # (rows, heads, width): the interpreter runs each in about a second
    (5, 12, 128),
    (3, 16, 256),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,heads,width", TINY)
def test_tiny(fmt, rows, heads, width):
    _run_functional(rows, heads, width, fmt, seed=rows * 1000 + heads)


# Head counts a rank gets beside K3.1's (issue 42): TP8 of a 64-head model (8), TP16 (4, 6), K3 at TP2 / TP4 (48, 24),
# and 1 / 2; each runs in the block its config pads it to, the padded heads masked at load and store
NEW_HEADS = (1, 2, 4, 6, 8, 24, 48)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads", NEW_HEADS)
def test_tiny_every_head_count(fmt, heads):
    """3 rows (an odd batch: a full row, a count-0 row, a count-1 row, holes, junk past counts), outputs poisoned with
    NaN: the padded heads of the 16- / 32- / 64-head block neither leak into the real ones nor are written."""
    _run_functional(3, heads, 128, fmt, seed=heads * 31 + len(fmt))


@pytest.mark.parametrize("splits", [1, 2], ids=["direct-store", "partials"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads", [1, 2, 6])
def test_head_masks_store_nothing_past_the_last_head(fmt, heads, splits):
    """1, 2 and 6 heads run in a 16-head block whose padded heads are masked at the store. out and lse are views at
    the start of larger buffers filled with a sentinel, so a store past the last head of the last row lands in memory
    the test owns and is seen by value (not by a crash): the tails keep the sentinel, and every row is right, the
    count-0 row exactly 0 with LSE -inf (check_decode), the others against the reference. One split stores out and
    lse directly; two store partials that the combine merges (a padded head's partial would land on the next
    split's entries, seen in the merged values)."""
    rows = 3
    q, kv, slots, counts, ss, os_ = _case(rows, heads, 128, fmt, seed=heads * 17 + len(fmt))
    assert int(counts[1]) == 0
    n_out, n_lse, tail = rows * heads * LATENT_DIM, rows * heads, 16 * LATENT_DIM * 2
    sentinel = 12345.0
    out_buf = torch.full((n_out + tail,), sentinel, dtype=torch.bfloat16, device=DEVICE)
    lse_buf = torch.full((n_lse + 32,), sentinel, dtype=torch.float32, device=DEVICE)
    out = out_buf[:n_out].view(rows, heads, LATENT_DIM)
    lse = lse_buf[:n_lse].view(rows, heads)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    sparse_mla_decode(q, kv, slots, counts, fmt=fmt, softmax_scale=ss, output_scale=os_, out=out, lse=lse,
                      splits=splits)
    assert bool((out_buf[n_out:] == sentinel).all()), "a store past the last head of out"
    assert bool((lse_buf[n_lse:] == sentinel).all()), "a store past the last head of lse"
    assert bool((out[1] == 0).all()) and bool((lse[1] == float("-inf")).all()), "the count-0 row: out 0, LSE -inf"
    _check(out, lse, q, kv, slots, counts, fmt, ss, os_)


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiny_splits_and_128_heads(fmt):
    # H=128 takes the 64-head tile; forcing 3 splits runs the combine on every path.
    _run_functional(2, 128, 256, fmt, seed=7, splits=3)
    _run_functional(3, 16, 256, fmt, seed=8, splits=1, with_lse=False)


@pytest.mark.parametrize("heads", [128, 16])
def test_partial_dtype(heads):
    """Split partials in PARTIAL_DTYPE (fp16): every split writes its partial and the combine reads it back, within
    that dtype's rounding. The scratch is poisoned with NaN first, so an entry the kernel did not write fails."""
    dtype = kcommon.PARTIAL_DTYPE
    q, kv, slots, counts, ss, os_ = _case(3, heads, 256, "fp8", seed=31 + heads)
    ws = make_workspace(DEVICE, heads=heads, max_rows=3, widths=(256,), fmt="fp8", min_entries=3 * 3 * heads)
    assert ws.part_out.dtype == dtype == torch.float16
    ws.part_out.fill_(float("nan"))
    out = torch.full((3, heads, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((3, heads), float("nan"), device=DEVICE)
    sparse_mla_decode(q, kv, slots, counts, fmt="fp8", softmax_scale=ss, output_scale=os_, out=out, lse=lse,
                      workspace=ws, splits=3)
    _check(out, lse, q, kv, slots, counts, "fp8", ss, os_, partial_err=PARTIAL_ERR[dtype])


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_rows_is_a_no_op(fmt):
    """An empty batch launches nothing and needs no workspace (None is not sized for 0 rows)."""
    q, kv, slots, counts, ss, os_ = _case(2, 16, 128, fmt, seed=1)
    out = torch.empty((0, 16, LATENT_DIM), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty((0, 16), device=DEVICE)
    assert sparse_mla_decode(q[:0], kv, slots[:0], counts[:0], fmt=fmt, softmax_scale=ss, output_scale=os_, out=out,
                             lse=lse) is None


def test_bad_input_names_argument():
    q, kv, slots, counts, ss, os_ = _case(2, 16, 128, "fp8", seed=1)
    out = torch.empty((2, 16, LATENT_DIM), dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match="query"):
        sparse_mla_decode(q.float(), kv, slots, counts, fmt="fp8", softmax_scale=ss, output_scale=os_, out=out)
    with pytest.raises(ValueError, match="slots"):
        sparse_mla_decode(q, kv, slots.long(), counts, fmt="fp8", softmax_scale=ss, output_scale=os_, out=out)
    with pytest.raises(TypeError, match="kv_rows"):
        sparse_mla_decode(q, kv, slots, counts, fmt="nvfp4_ds_mla", softmax_scale=ss, output_scale=os_, out=out)
    with pytest.raises(ValueError, match="out"):
        sparse_mla_decode(q, kv, slots, counts, fmt="fp8", softmax_scale=ss, output_scale=os_, out=out.float())


def test_explicit_splits_are_honoured(monkeypatch):
    """A one-off call (no workspace) with more splits than choose_splits would pick sizes its scratch for them and
    runs them all (the combine sees that many), correct against the reference."""
    q, kv, slots, counts, ss, os_ = _case(3, 16, 256, "fp8", seed=21)
    cfg = default_config(16, "fp8")
    asked = choose_splits(3, 16, 256, cfg, kcommon.num_sms(q.device)) + 2
    seen = []
    real = kcommon.combine

    def spy(ws, out, lse_t, splits, output_scale):
        seen.append((splits, ws.capacity))
        real(ws, out, lse_t, splits, output_scale)

    monkeypatch.setattr(triton_decode, "combine", spy)
    out = torch.full((3, 16, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((3, 16), float("nan"), device=DEVICE)
    sparse_mla_decode(q, kv, slots, counts, fmt="fp8", softmax_scale=ss, output_scale=os_, out=out, lse=lse,
                      splits=asked)
    assert seen == [(asked, 3 * asked * 16)]
    _check(out, lse, q, kv, slots, counts, "fp8", ss, os_)


@pytest.mark.parametrize("splits", [0, -1, 2.0, True])
def test_bad_splits_name_the_argument(splits):
    q, kv, slots, counts, ss, os_ = _case(2, 16, 128, "fp8", seed=1)
    out = torch.full((2, 16, LATENT_DIM), 7.0, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="splits"):
        sparse_mla_decode(q, kv, slots, counts, fmt="fp8", softmax_scale=ss, output_scale=os_, out=out,
                          splits=splits)
    assert bool((out == 7.0).all()), "a rejected call wrote into out"


def test_host_cdiv_and_next_pow2_are_tritons():
    """The planner and launchers use plain-Python twins of triton.cdiv / triton.next_power_of_2 (constexpr_functions,
    ~1.7 µs a host call); they must give the same answers wherever the host asks."""
    assert all(host_math.cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 4200) for b in (1, 2, 3, 7, 16, 64, 132))
    assert all(host_math.next_pow2(n) == triton.next_power_of_2(n) for n in range(1, 70000))


def test_split_heuristic_fills_the_chip():
    cfg = default_config(128, "fp8")
    assert choose_splits(320, 128, 2048, cfg, 132) == 1
    s5 = choose_splits(5, 128, 2048, cfg, 132)
    assert 5 * 2 * s5 >= 100, s5  # 5 rows x 2 head tiles x splits must come near 132 SMs
    # the workspace holds every plan's split rows (tail-split plans)
    cfg = default_config(16, "fp8")
    ws = make_workspace("cpu", heads=16, max_rows=64, widths=(2048,), config=cfg)
    plans = [choose_plan(r, 16, 2048, cfg, 4) for r in range(1, 65)]
    assert ws.capacity == max((r - w) * s * 16 for r, (w, s) in enumerate(plans, 1) if s > 1)


def _plan_configs() -> list[tuple[str, int, Config]]:
    """(name, heads, Config) of every kernel's plan: the plain kernel's by (heads, format), the Gluon ones."""
    from vllm_kimi_dsa.planning import few_heads_config, gluon_config

    plain = [(f"plain-{fmt}-{h}", h, default_config(h, fmt)) for fmt in FORMATS for h in (128, 96, 64, 32, 16, 12)]
    return plain + [("gluon-128", 128, gluon_config()), ("gluon-64", 64, gluon_config()),
                    ("few-16", 16, few_heads_config()), ("few-12", 12, few_heads_config())]


@pytest.mark.parametrize("name, heads, cfg", _plan_configs(), ids=[c[0] for c in _plan_configs()])
def test_one_tile_a_split_when_every_split_fits_one_wave(name, heads, cfg):
    """The documented choice (docs/hopper-kernels.md, Plans): the split count minimizes waves x (tiles a split + a
    CTA's fixed cost + split_tiles). While splitting every row into one-tile pieces still fits one wave of the chip's
    CTA slots, the fewest tiles a split (one) wins: every row splits into its tiles, one launch, even pieces. Widths
    of 8 tiles and more (a split pays for its partial there at every config's split_tiles), rows up to that wave."""
    from vllm_kimi_dsa.planning import choose_lead, split_range

    checked = 0
    for sms in (132, 114, 78):
        slots_per_wave = sms * cfg.ctas_per_sm
        for width in (8 * cfg.block_n, 1024, 2048, 4096):
            tiles = -(-width // cfg.block_n)
            head_blocks = -(-heads // cfg.block_h)
            for rows in range(1, slots_per_wave // (head_blocks * tiles) + 1):
                where = dict(rows=rows, width=width, sms=sms)
                assert choose_splits(rows, heads, width, cfg, sms) == tiles, where
                assert choose_plan(rows, heads, width, cfg, sms) == (0, tiles), where
                assert choose_lead(rows, heads, width, cfg, sms) == 0, where
                checked += 1
            pieces = [split_range(width, s, tiles, 0, cfg.block_n) for s in range(tiles)]
            assert pieces == [(s * cfg.block_n, (s + 1) * cfg.block_n) for s in range(tiles)]
    assert checked >= 3  # K3.1's width fits a wave at 1 row on 132 SMs for every config


def _gluon_like() -> Config:
    """The split heuristic's view of the 64-head Gluon kernel (planning.gluon_config), without importing Gluon."""
    return Config(block_h=64, block_n=64, num_warps=12, num_stages=1, ctas_per_sm=1, split_tiles=3.8)


def test_tail_split_plans():
    """Whole rows fill full waves unsplit; only the rest is split (the model's picks for 64-head tiles on 132 SMs)."""
    cfg = _gluon_like()
    assert choose_plan(80, 128, 2048, cfg, 132) == (66, 4)  # 1 wave of 132 CTAs, then 28 CTA pairs x 4 splits
    assert choose_plan(160, 128, 2048, cfg, 132) == (132, 2)
    assert choose_plan(320, 128, 2048, cfg, 132) == (0, 1)  # 4.85 waves unsplit: nothing to gain
    assert choose_plan(20, 128, 2048, cfg, 132) == (0, 3)  # less than a wave: as choose_splits
    for rows in range(1, 400):
        whole, splits = choose_plan(rows, 128, 2048, cfg, 132)
        assert 0 <= whole < rows and splits >= 1
        assert whole * 2 % 132 == 0  # whole rows fill whole waves
        if whole:  # the rows after the whole waves split as choose_splits splits them on their own
            assert choose_splits(rows - whole, 128, 2048, cfg, 132) == splits


@pytest.mark.parametrize("fmt", FORMATS)
def test_tail_split_through_the_kernel_class(fmt, monkeypatch):
    """TritonDecode (tail_split configs, the default): a batch past a full wave runs as two launches on row slices (the whole
    rows unsplit, the rest split and combined); every row matches the reference, the workspace holds the plan.
    This file's kernel on a GPU too (VLLM_KIMI_DSA_GLUON=0): the Gluon kernels' plans are test_gluon_*'s."""
    monkeypatch.setenv("VLLM_KIMI_DSA_GLUON", "0")
    base = default_config(16, fmt)
    slots_per_wave = kcommon.num_sms(DEVICE) * base.ctas_per_sm
    rows, width = slots_per_wave + 3, 256
    setup = DecodeSetup(
        device=DEVICE, fmt=fmt, heads=16, row_counts=(rows,), capacities=(), widths=(width,),
        return_lse=True, softmax_scale=0.04, output_scale=0.37,
    )
    k = TritonDecode(setup)
    whole, splits = k._plans[(rows, width)]
    assert whole == slots_per_wave and splits > 1, (whole, splits)
    assert k.workspace.capacity >= (rows - whole) * splits * 16
    q, kv, slots, counts, _, _ = _case(rows, 16, width, fmt, seed=41)
    counts[whole - 1] = 0  # a count-0 row on each side of the seam
    counts[whole] = 0
    out = torch.full((rows, 16, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((rows, 16), float("nan"), device=DEVICE)
    k(q, kv, slots, counts, out, lse, block_size=64, rows_per_block_stride=64)
    _check_as_computed(k, out, lse, q, kv, slots, counts, fmt, 0.04, 0.37)


def test_kernel_class_protocol():
    setup = DecodeSetup(
        device=DEVICE, fmt="nvfp4_ds_mla", heads=12, row_counts=(1, 5), capacities=(), widths=(128,),
        return_lse=True, softmax_scale=0.04, output_scale=1.0,
    )
    k = TritonDecode(setup)
    assert k.name == "triton"
    q, kv, slots, counts, _, _ = _case(5, 12, 128, "nvfp4_ds_mla", seed=3)
    out = torch.full((5, 12, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((5, 12), float("nan"), device=DEVICE)
    k(q, kv, slots, counts, out, lse, block_size=64, rows_per_block_stride=64)
    # the kernel TritonDecode picked (on Hopper the Gluon nvfp4 form: the fp8 decode of nvfp4_as_fp8 of the rows)
    # sets the reference and the logit bound
    _check_as_computed(k, out, lse, q, kv, slots, counts, "nvfp4_ds_mla", 0.04, 1.0)
    q2, kv2, slots2, counts2, _, _ = _case(5, 12, 256, "nvfp4_ds_mla", seed=4)
    with pytest.raises(ValueError, match="width"):  # a width never planned
        k(q2, kv2, slots2, counts2, out, lse, block_size=64, rows_per_block_stride=64)


# --------------------------------------------------------------------------- GPU sweep

@triton.jit
def _e2m1_kernel(src_ptr, lo_ptr, hi_ptr, N: tl.constexpr, PTX: tl.constexpr):
    offs = tl.arange(0, N)
    packed = tl.load(src_ptr + offs)
    if PTX:
        lo, hi = triton_decode._e2m1_pairs_ptx(packed)
    else:
        lo = triton_decode._e2m1_to_f16(packed.to(tl.int32) & 15)
        hi = triton_decode._e2m1_to_f16(packed.to(tl.int32) >> 4)
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)


@pytest.mark.parametrize("ptx", [False, True] if GPU else [False])
def test_e2m1_decode_every_byte(ptx):
    """Both e2m1 decoders (the inline-PTX one on a GPU, the Triton twin everywhere) on all 256 bytes, bit-exact."""
    n = 1024
    src = torch.randperm(n, generator=torch.Generator().manual_seed(3)).remainder(256).to(torch.uint8).to(DEVICE)
    lo = torch.full((n,), float("nan"), dtype=torch.float16, device=DEVICE)
    hi = torch.full((n,), float("nan"), dtype=torch.float16, device=DEVICE)
    _e2m1_kernel[(1,)](src, lo, hi, N=n, PTX=ptx)
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float16)
    codes = src.cpu().long()
    assert torch.equal(lo.cpu().view(torch.int16), table[codes & 15].view(torch.int16))
    assert torch.equal(hi.cpu().view(torch.int16), table[codes >> 4].view(torch.int16))


gpu = pytest.mark.skipif(not GPU, reason="the full sweep needs a CUDA GPU (the interpreter is too slow)")


@gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads", [128, 96, 64, 32, 16, 12, *NEW_HEADS], ids=lambda h: f"h{h}")
@pytest.mark.parametrize("rows,width", [(1, 2048), (5, 2048), (7, 128), (33, 1024), (320, 2048)])
def test_gpu_sweep(fmt, heads, rows, width):
    _run_functional(rows, heads, width, fmt, seed=rows * 7 + heads * 13 + width)


@gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads", NEW_HEADS, ids=lambda h: f"h{h}")
def test_gpu_every_head_count_through_the_kernel_class(fmt, heads):
    """TritonDecode as the core binds it (on Hopper the Gluon kernel variants.hopper_kernel names for the count) at
    odd batches (1, 7, 33 rows) and 160: holes, count-0 rows, NaN-poisoned outputs, against the reference; then a
    CUDA graph of the same calls replayed on the poisoned buffers equals the eager answers bit for bit."""
    width, row_counts = 2048, (1, 7, 33, 160)
    setup = DecodeSetup(device=DEVICE, fmt=fmt, heads=heads, row_counts=row_counts, capacities=(), widths=(width,),
                        return_lse=True, softmax_scale=1.0 / math.sqrt(576.0) * 0.7, output_scale=0.37)
    k = TritonDecode(setup)
    cases, eager = {}, {}
    for rows in row_counts:
        q, kv, slots, counts, ss, os_ = _case(rows, heads, width, fmt, seed=heads * 100 + rows)
        out = torch.full((rows, heads, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        lse = torch.full((rows, heads), float("nan"), device=DEVICE)
        k(q, kv, slots, counts, out, lse, block_size=64, rows_per_block_stride=64)
        torch.cuda.synchronize()
        _check_as_computed(k, out, lse, q, kv, slots, counts, fmt, ss, os_)
        cases[rows] = (q, kv, slots, counts, out, lse)
        eager[rows] = (out.clone(), lse.clone())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for q, kv, slots, counts, out, lse in cases.values():
            k(q, kv, slots, counts, out, lse, block_size=64, rows_per_block_stride=64)
    for *_, out, lse in cases.values():
        out.fill_(float("nan")), lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for rows, (*_, out, lse) in cases.items():
        assert torch.equal(out, eager[rows][0]) and torch.equal(lse, eager[rows][1]), f"rows={rows}: replay != eager"


@gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_odd_rows_and_repeat_is_deterministic(fmt):
    for rows in (2, 19, 81, 161):
        _run_functional(rows, 128, 2048, fmt, seed=rows)
    # same inputs twice: a race would show as a moving result
    q, kv, slots, counts, ss, os_ = _case(5, 128, 2048, fmt, seed=99)
    outs = []
    for _ in range(2):
        out = torch.full((5, 128, LATENT_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        sparse_mla_decode(q, kv, slots, counts, fmt=fmt, softmax_scale=ss, output_scale=os_, out=out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads", [128, 12])
def test_gpu_cuda_graph_replay(fmt, heads):
    rows, width = 20, 2048
    setup = DecodeSetup(
        device=DEVICE, fmt=fmt, heads=heads, row_counts=(rows,), capacities=(), widths=(width,),
        return_lse=True, softmax_scale=1.0 / math.sqrt(576.0) * 0.7, output_scale=0.37,
    )
    k = TritonDecode(setup)
    q, kv, slots, counts, ss, os_ = _case(rows, heads, width, fmt, seed=5)
    out = torch.empty((rows, heads, LATENT_DIM), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty((rows, heads), device=DEVICE)
    k(q, kv, slots, counts, out, lse, block_size=64, rows_per_block_stride=64)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k(q, kv, slots, counts, out, lse, block_size=64, rows_per_block_stride=64)
    q2, kv2, slots2, counts2, _, _ = _case(rows, heads, width, fmt, seed=6)
    q.copy_(q2), kv.copy_(kv2), slots.copy_(slots2), counts.copy_(counts2)
    out.fill_(float("nan")), lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check_as_computed(k, out, lse, q, kv, slots, counts, fmt, ss, os_)
