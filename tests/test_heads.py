"""Every query-head count a deployment gives a rank, 1 to 128 (issue 42): served by vLLM's selector, kernel_for, the
core and the Hopper kernel table at compute capability 9.0 and 10.0, and refused above 128 with the TP / DCP change
that fixes it. kernel_for's `dcp` is the seed's flag (a bool) or a DCP size (an int).

CPU only: vLLM's real selector with a mocked capability (tests/vllm_harness.py), the host tables; no kernel runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kimi_dsa.heads import MAX_HEADS, SUPPORTED_HEADS, check_heads, heads_refusal, rank_heads_refusal
from vllm_kimi_dsa.selection import KERNELS, kernel_for

ALL_HEADS = tuple(range(1, MAX_HEADS + 1))
# what fi_kernels offers on each GPU (selection.choice.fi_kernels): Hopper runs only this package's Triton / Gluon
# kernels; Blackwell FlashInfer's (fp8: prims_ts, trtllm, the model's "sparse"; nvfp4_ds_mla: prims_ts)
OFFERED = {9: {"fp8": ("triton",)}, 10: {"fp8": ("prims_ts", "trtllm", "sparse"), "nvfp4_ds_mla": ("prims_ts",)}}


# ---------------------------------------------------------------- the rules


def test_supported_heads_is_every_count_to_128() -> None:
    assert tuple(SUPPORTED_HEADS) == ALL_HEADS and 0 not in SUPPORTED_HEADS and 129 not in SUPPORTED_HEADS
    assert all(check_heads(h) == h for h in ALL_HEADS)
    assert all(heads_refusal("triton", h) is None and heads_refusal("prims_ts", h) is None for h in ALL_HEADS)
    assert [h for h in ALL_HEADS if heads_refusal("trtllm", h)] == list(range(65, 128))


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (129, ValueError), (-3, ValueError), (12.0, TypeError),
                                      ("8", TypeError), (True, TypeError)])
def test_check_heads_names_the_argument(bad, exc) -> None:
    with pytest.raises(exc, match="heads"):
        check_heads(bad)


@pytest.mark.parametrize("heads, dcp, tp, says", [
    (256, 1, 1, "256 query heads a rank: the sparse kernels take 1 to 128; use TP >= 2 (now 1)"),
    (256, 1, None, "use a tensor-parallel size 2x larger"),
    (256, 2, 4, "256 query heads a rank after DCP 2 (128 a TP rank x DCP 2): the sparse kernels take 1 to 128; "
                "use no DCP (DCP 1) or TP >= 8 (now 4) with DCP 2"),
    (192, 4, 2, "after DCP 4 (48 a TP rank x DCP 4): the sparse kernels take 1 to 128; use a DCP size of at most 2 "
                "or TP >= 4 (now 2) with DCP 4"),
    (1024, 8, 1, "(128 a TP rank x DCP 8)"),
])
def test_refusal_above_128_names_the_fix(heads, dcp, tp, says) -> None:
    message = rank_heads_refusal(heads, dcp, tp)
    assert message is not None and says in message, message


def test_no_refusal_from_1_to_128() -> None:
    assert all(rank_heads_refusal(h, d) is None for h in ALL_HEADS for d in (1, 2, 8))


# ---------------------------------------------------------------- kernel_for's dcp and heads


@pytest.mark.parametrize("major", [9, 10])
def test_kernel_for_takes_every_count(major: int) -> None:
    """All 128 counts, tensor parallel and under DCP (every spelling of each), with and without heads: a kernel the
    machine offers, one that takes the count."""
    for fmt, offered in OFFERED[major].items():
        for heads in (*ALL_HEADS, None):
            for dcp in (0, 1, False, 2, 8, True):
                kernel = kernel_for(4, dcp, offered, heads)
                assert kernel in offered and kernel in KERNELS, (fmt, heads, dcp, kernel)
                if heads is not None:
                    assert heads_refusal(kernel, heads) is None, (fmt, heads, dcp, kernel)


def test_kernel_for_reads_dcp_as_the_seeds_flag_or_a_size() -> None:
    """0, 1 and False read "tp"; True and sizes > 1 read "dcp" (FI_KERNEL["dcp" if dcp else "tp"], a DCP size of 1
    being tensor parallel); 128 heads without DCP goes to trtllm."""
    ks = ("prims_ts", "trtllm", "triton")
    table = {"tp": "1-64:triton", "dcp": "1-64:trtllm"}
    assert [kernel_for(4, d, ks, 64, table) for d in (0, 1, False)] == ["triton"] * 3
    assert [kernel_for(4, d, ks, 64, table) for d in (True, 2, 16)] == ["trtllm"] * 3
    assert [kernel_for(4, d, ks, 128, {"tp": "1-64:prims_ts", "dcp": "1-64:prims_ts"}) for d in (0, 1, False, True, 2)] \
        == ["trtllm"] * 3 + ["prims_ts"] * 2
    np = pytest.importorskip("numpy")
    assert kernel_for(4, np.bool_(True), ks, 64, table) == "trtllm"
    assert kernel_for(4, np.int64(1), ks, 64, table) == "triton"


def test_kernel_for_without_heads_skips_the_head_rules() -> None:
    ks = ("prims_ts", "trtllm", "triton")
    # 128 heads would send TP to trtllm, and 96 would exclude it: without heads neither rule applies
    assert kernel_for(4, 1, ks, None, {"tp": "1-8:prims_ts"}) == "prims_ts"
    assert kernel_for(4, 1, ("trtllm",)) == "trtllm"
    assert kernel_for(4, 1, ks) == kernel_for(4, 1, ks, table=None)
    with pytest.raises(ValueError, match=r"trtllm takes at most 64"):
        kernel_for(4, 1, ("trtllm",), 96)


@pytest.mark.parametrize("dcp, exc", [(-1, ValueError), (-8, ValueError), (2.0, TypeError), ("2", TypeError),
                                      (None, TypeError), ([2], TypeError)])
def test_kernel_for_bad_dcp_names_it(dcp, exc) -> None:
    with pytest.raises(exc, match="dcp"):
        kernel_for(4, dcp, ("triton",), 16)


# ---------------------------------------------------------------- the Hopper kernel table


@pytest.mark.parametrize("want", ["", "1"])
def test_hopper_kernel_for_every_count(want: str) -> None:
    """variants.gluon_choice binds a Gluon kernel for every count 1..128 (its table in the module docstring): 8-head
    few-heads blocks at 1..8 heads (fp8, where verified or asked for), one 16-head block to 16, two to 32, 64-head
    blocks above; the plan Config's block is the one the kernel runs."""
    pytest.importorskip("triton")
    from vllm_kimi_dsa.backends.hopper import variants

    h8 = want == "1" or variants.verified("few-fp8-h8")
    for heads in ALL_HEADS:
        for fmt in ("fp8", "nvfp4_ds_mla"):
            choice = variants.gluon_choice(fmt, heads, want)
            assert choice is not None, (fmt, heads)
            name = variants.hopper_kernel(fmt, heads, want)
            if heads > 32:
                assert choice.config.block_h == 64 and name in ("gluon64", "seesaw-nvfp4"), (fmt, heads, name)
            elif fmt == "fp8" and heads <= 8 and h8:
                assert name == "few-fp8-h8" and choice.config.block_h == 8 and choice.params.block_h == 8
                assert all(p.block_h == 8 for p in choice.large)
            else:
                assert choice.config.block_h == 16 and choice.params.block_h == 16, (fmt, heads)
                assert name.startswith("few-") and name.endswith("-multi") == (heads > 16), (fmt, heads, name)
    assert variants.hopper_kernel("fp8", 8, "0") == "tl"


# ---------------------------------------------------------------- vLLM's selector, every count


@pytest.fixture
def registered(monkeypatch):
    pytest.importorskip("vllm.v1.attention.backends.mla.flashinfer_mla_sparse", reason="needs vLLM 0.33")
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    from vllm_kimi_dsa import envs, vllm_glue

    saved = dict(_ATTN_OVERRIDES)
    monkeypatch.delenv(envs.BACKEND, raising=False)
    vllm_glue.register()
    yield
    _ATTN_OVERRIDES.clear()
    _ATTN_OVERRIDES.update(saved)


def test_vllm_selects_the_core_for_every_count(registered, tmp_path: Path) -> None:
    """vLLM 0.33's selector (get_attn_backend for a sparse MLA layer) at SM 9.0 and 10.0, FP8 cache: every heads a rank
    1..128 (a DeepSeek-V3.2-shaped model at TP1, so heads a rank = the model's heads), and under DCP 2 every count
    whose gathered heads stay <= 128 (the model's 2 h heads at TP2: h a rank, 2 h after DCP's gather), picks this
    package's backend, and the core serves it (core_rejects None)."""
    import vllm_harness as vh
    from vllm.platforms.interface import DeviceCapability

    from vllm_kimi_dsa.vllm_backend import KimiDSAFlashInferMLASparseBackend, core_rejects

    walked = 0
    for dcp in (1, 2):
        for heads in ALL_HEADS:
            if heads * dcp > MAX_HEADS:
                continue
            config = vh.vllm_config(tmp_path / f"h{heads}-d{dcp}", vh.DSV32, heads=heads * dcp, dcp=dcp, tp=dcp)
            assert config.model_config.get_num_attention_heads(config.parallel_config) == heads
            for major in (9, 10):
                with vh.gpu_capability(major):
                    assert vh.select_backend(config, "fp8") is KimiDSAFlashInferMLASparseBackend, (heads, dcp, major)
                assert core_rejects(capability=DeviceCapability(major, 0), kv_cache_dtype="fp8", head_size=576,
                                    heads=heads * dcp, dcp=dcp, tp=dcp) is None
                walked += 1
    assert walked == 2 * (128 + 64)


def test_vllm_refuses_above_128_with_the_fix(registered, tmp_path: Path) -> None:
    """256 heads a rank (a 256-head model at TP1; at TP2 under DCP 2; a 512-head model at TP4 under DCP 2, TP unlike
    DCP): refused at selection on SM90 (FP8) and on SM100 where only the core reads the cache (nvfp4_ds_mla), the
    message naming the TP the user runs now and the TP (or DCP) that fits."""
    import vllm_harness as vh

    cases = [(256, 1, 1, "256 query heads a rank: the sparse kernels take 1 to 128; use TP >= 2 (now 1)"),
             (256, 2, 2, "256 query heads a rank after DCP 2 (128 a TP rank x DCP 2): the sparse kernels take 1 to "
                         "128; use no DCP (DCP 1) or TP >= 4 (now 2) with DCP 2"),
             # TP 4 with DCP 2 (TP different from DCP): a 512-head model, 128 heads a TP rank, 256 after the gather
             (512, 2, 4, "256 query heads a rank after DCP 2 (128 a TP rank x DCP 2): the sparse kernels take 1 to "
                         "128; use no DCP (DCP 1) or TP >= 8 (now 4) with DCP 2")]
    for heads, dcp, tp, says in cases:
        for major, fmt in ((9, "fp8"), (10, "nvfp4_ds_mla")):
            config = vh.vllm_config(tmp_path / f"h{heads}-d{dcp}-{fmt}", vh.DSV32, heads=heads, dcp=dcp, tp=tp,
                                    kv_cache_dtype=fmt)
            with vh.gpu_capability(major), pytest.raises(ValueError) as refused:
                vh.select_backend(config, fmt)
            assert says in str(refused.value), str(refused.value)
