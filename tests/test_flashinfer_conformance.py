"""Every FlashInfer call of backends/flashinfer/, checked against the installed FlashInfer's own rules on a CPU.

FlashInfer's Python (plan, workspace sizing, run's checks, trtllm's dispatch) runs for real;
only the GPU boundary is replaced: the prims_ts JIT (`mla_decode._get_compiled_mla_decode`)
and the trtllm-gen C++ op (`trtllm_gen_backend.get_trtllm_gen_fmha_module`) become recorders.
FlashInfer insists on CUDA tensors and a Blackwell device, so tensors are CPU tensors of a
subclass that reports device cuda:0, `torch.cuda` answers as a 148-SM SM100, and the torch
factories FlashInfer (and this package) call with device="cuda" make such tensors.
CPU time: about 10 s on 2 cores (FlashInfer import ~5 s; plans ~1 ms each).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import types

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip(
        "the pretend-Blackwell harness replaces torch.cuda; on a GPU run test_flashinfer_gpu.py",
        allow_module_level=True,
    )
fi = pytest.importorskip("flashinfer", reason="FlashInfer is not installed")
mla_decode = pytest.importorskip(
    "flashinfer.attention.prims_ts.mla_decode", reason="this FlashInfer has no prims_ts (needs 0.7.4+)"
)

import flashinfer.attention.prims_ts as prims_ts_pkg  # noqa: E402
import flashinfer.attention.prims_ts._hardware as prims_hw  # noqa: E402
import flashinfer.decode as fi_decode  # noqa: E402
from flashinfer.attention.prims_ts.kernels.mla_decode.helpers.nvfp4_kv import (  # noqa: E402
    cache_record_size,
    validate_nvfp4_kv_formats,
)
from flashinfer.mla._batch_mla._backends import trtllm_gen_backend  # noqa: E402
import flashinfer.utils as fi_utils  # noqa: E402
from flashinfer.utils import get_trtllm_gen_multi_ctas_kv_counter_bytes, log2e  # noqa: E402

import vllm_kimi_dsa.backends.flashinfer.features as fi_features  # noqa: E402
import vllm_kimi_dsa.backends.flashinfer.prims_ts as fi_prims_ts  # noqa: E402
import vllm_kimi_dsa.backends.flashinfer.trtllm as fi_trtllm  # noqa: E402
from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM, make_paged_cache, flat_kv_row_view  # noqa: E402
from vllm_kimi_dsa.kernels.base import DecodeSetup  # noqa: E402
from vllm_kimi_dsa.backends.flashinfer.plans import PLANS, PRIMS_TS_FORMAT, PlanKey  # noqa: E402

CUDA0 = torch.device("cuda", 0)
# The real entry points, taken before any test spies on them.
WRAPPER = prims_ts_pkg.BatchSparseMLADecodePagedTSWrapper
ORIG_PLAN = WRAPPER.plan
ORIG_RUN = WRAPPER.run
ORIG_WORKSPACE_SIZE = prims_ts_pkg.get_prims_ts_sparse_mla_decode_workspace_size
ORIG_TRTLLM = fi_decode.trtllm_batch_decode_with_kv_cache_mla
SM_COUNT = 148
# The C++ entry's parameters, in order (flashinfer/data/csrc/trtllm_fmha_kernel_launcher.cu,
# trtllm_paged_attention_decode), so positional calls can be named and checked.
TRTLLM_DECODE_PARAMS = (
    "out out_scale_factor query key_cache value_cache workspace_buffer multi_ctas_kv_counter_buffer "
    "block_tables seq_lens max_q_len max_kv_len bmm1_scale bmm2_scale o_sf_scale o_sf_vec_size "
    "o_sf_start_index batch_size window_left sparse_mla_top_k sm_count enable_pdl workspace_size "
    "attention_sinks cum_seq_lens_q key_block_scales value_block_scales "
    "skip_softmax_threshold_scale_factor uses_shared_paged_kv_idx lse lse_scale lse_stride_tokens "
    "lse_stride_heads enable_block_sparse_attention sparse_mla_top_k_lens bf16q_fp8kv_transform_mode "
    "use_fp16_softmax"
).split()
# The compiled prims_ts kernel's positional arguments (mla_decode.py, _launch_mla_decode).
COMPILED_PARAMS = (
    "q_latent q_rope c_latent c_rope page_offsets out lse workspace split_kv seq_lens qo_indptr "
    "sparse_inputs softmax_scale output_scale output_quant_args max_q_len"
).split()


class FakeCuda(torch.Tensor):
    """A CPU tensor that tells FlashInfer it lives on cuda:0."""

    @property
    def device(self):  # type: ignore[override]
        return CUDA0

    @property
    def is_cuda(self):  # type: ignore[override]
        return True


def fake(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(FakeCuda)


class Recorder:
    def __init__(self) -> None:
        self.calls: dict[str, list] = {}
        self.cuda_allocations = 0

    def add(self, name: str, *args, **kwargs) -> None:
        self.calls.setdefault(name, []).append((args, kwargs))


@pytest.fixture
def fake_blackwell(monkeypatch):
    """A pretend SM100 (148 SMs): FlashInfer's Python runs, its GPU launches are recorded."""
    rec = Recorder()
    props = types.SimpleNamespace(major=10, minor=0, multi_processor_count=SM_COUNT, name="NVIDIA B200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (10, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(prims_hw, "get_max_active_clusters", lambda *a, **k: SM_COUNT)

    for name in ("zeros", "empty", "full", "arange", "ones"):
        real = getattr(torch, name)

        def factory(*args, _real=real, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                rec.cuda_allocations += 1
                kwargs["device"] = "cpu"
                return fake(_real(*args, **kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, factory)

    # --- the GPU boundary: prims_ts JIT compile + launch
    def compile_spec(spec):
        def compiled(*args):
            assert len(args) == len(COMPILED_PARAMS)
            rec.add("compiled", spec, **dict(zip(COMPILED_PARAMS, args)))
        return compiled

    monkeypatch.setattr(mla_decode, "_get_compiled_mla_decode", compile_spec)

    # --- the GPU boundary: trtllm-gen's C++ op
    def native_decode(*args):
        assert len(args) == len(TRTLLM_DECODE_PARAMS), "the C++ entry takes exactly these parameters"
        named = dict(zip(TRTLLM_DECODE_PARAMS, args))
        rec.add("native", **named)
        # Pretend the kernel wrote everything, count-0 rows included (trtllm leaves them garbage).
        named["out"].fill_(7.0)
        if named["lse"] is not None:
            named["lse"].fill_(3.0)

    monkeypatch.setattr(
        trtllm_gen_backend,
        "get_trtllm_gen_fmha_module",
        lambda: types.SimpleNamespace(trtllm_paged_attention_decode=native_decode),
    )

    # --- spies on every public FlashInfer entry the kernels call (they pass through)
    wrapper_cls = prims_ts_pkg.BatchSparseMLADecodePagedTSWrapper
    for method in ("plan", "run"):
        real = getattr(wrapper_cls, method)

        def spy(self, *args, _real=real, _name=method, **kwargs):
            rec.add(_name, self, *args, **kwargs)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(wrapper_cls, method, spy)
    real_ws = prims_ts_pkg.get_prims_ts_sparse_mla_decode_workspace_size

    def ws_spy(*args, **kwargs):
        size = real_ws(*args, **kwargs)
        rec.add("workspace_size", *args, result=size, **kwargs)
        return size

    monkeypatch.setattr(prims_ts_pkg, "get_prims_ts_sparse_mla_decode_workspace_size", ws_spy)
    real_trt = fi_decode.trtllm_batch_decode_with_kv_cache_mla

    def trt_spy(*args, **kwargs):
        rec.add("trtllm", *args, **kwargs)
        return real_trt(*args, **kwargs)

    monkeypatch.setattr(fi_decode, "trtllm_batch_decode_with_kv_cache_mla", trt_spy)
    monkeypatch.setattr(fi_trtllm, "_TRTLLM_COUNTERS", {})
    monkeypatch.setattr(fi_trtllm, "_TRTLLM_WORKSPACES", {})
    PLANS.clear()
    yield rec
    PLANS.clear()
    # FlashInfer caches device facts per device: drop the pretend SM100's.
    for cached in (fi_utils.get_device_properties, fi_utils.get_compute_capability, fi_utils.get_device_sm_count):
        cached.cache_clear()


def _setup(fmt="fp8", heads=128, row_counts=(1, 5, 20), capacities=(8, 32), widths=(128, 2048), lse=True, impl=None):
    return DecodeSetup(
        device=CUDA0, fmt=fmt, heads=heads, row_counts=row_counts, capacities=capacities, widths=widths,
        return_lse=lse, softmax_scale=0.043, output_scale=0.75, impl=impl,
    )


def _inputs(fmt, rows, heads, width, gen, block_size=64, stride=None, count0=(0,)):
    """Poisoned outputs and random inputs on the fake device; slots a compacted prefix then -1."""
    cache = make_paged_cache(6, block_size, fmt, block_stride=stride, device="cpu", generator=gen)
    kv_rows, stride_rows = flat_kv_row_view(cache, block_size)
    query = torch.randn(rows, heads, HEAD_DIM, generator=gen).to(torch.float8_e4m3fn)
    counts = torch.randint(1, width + 1, (rows,), generator=gen, dtype=torch.int32)
    for r in count0:
        if r < rows:
            counts[r] = 0
    slots = torch.randint(0, kv_rows.shape[0], (rows, width), generator=gen, dtype=torch.int32)
    slots[torch.arange(width) >= counts[:, None]] = -1
    out = torch.full((rows, heads, LATENT_DIM), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((rows, heads), float("nan"))
    return [fake(t) for t in (query, kv_rows, slots, counts, out, lse)] + [stride_rows]


def _bound(fn, args, kwargs):
    """Bind a recorded call to the real function's signature (raises TypeError on any mismatch)."""
    return inspect.signature(fn).bind(*args, **kwargs).arguments


# ------------------------------------------------------------------ prims_ts


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4_ds_mla"])
@pytest.mark.parametrize("heads", [128, 64, 16, 12])
def test_prims_ts_calls_follow_flashinfer(fake_blackwell, fmt, heads):
    rec = fake_blackwell
    setup = _setup(fmt, heads)
    kernel = fi_prims_ts.PrimsTsDecode(setup)

    # One plan per (plan rows, width), one workspace-size query per plan, nothing planned twice.
    plan_rows = {1: 8, 5: 8, 20: 32}
    assert kernel.plan_rows == plan_rows
    expected = {(c, w) for c in set(plan_rows.values()) for w in setup.widths}
    plans = rec.calls["plan"]
    assert len(plans) == len(expected) == len(rec.calls["workspace_size"])
    workspace = PLANS.workspace(CUDA0)
    seen = set()
    for (wrapper, *args), kwargs in plans:
        b = _bound(ORIG_PLAN, (wrapper, *args), kwargs)
        seen.add((b["batch_size"], b["max_topk"]))
        assert b["num_qo_heads"] == heads <= 128
        assert b["max_q_len"] == 1 and b["packed_query"] is True
        assert b["q_dtype"] == torch.float8_e4m3fn and b["qk_rope_head_dim"] == 64
        assert b["kv_cache_format"] == PRIMS_TS_FORMAT[fmt]
        # FlashInfer's own format rule (raises on a pair it rejects) and row size.
        validate_nvfp4_kv_formats(b["kv_cache_format"], b["kv_cache_format"], 64, "e4m3", 1)
        assert cache_record_size(b["kv_cache_format"], 64) == (576 if fmt == "fp8" else 352)
        assert b["return_lse"] is True
        assert wrapper._workspace_buffer is workspace  # the shared one, not a private allocation
    assert seen == expected
    sizes = []
    for args, kwargs in rec.calls["workspace_size"]:
        kwargs = dict(kwargs)
        sizes.append(kwargs.pop("result"))
        _bound(ORIG_WORKSPACE_SIZE, args, kwargs)
        _bound(ORIG_PLAN, (None, *args), kwargs)  # "takes the same arguments as plan" (SPEC 2.1)
    # One workspace: the max over the plans, rounded up to whole MiB.
    assert workspace.dtype == torch.uint8 and workspace.numel() == -(-max(sizes) // (1 << 20)) * (1 << 20)

    gen = torch.Generator().manual_seed(heads)
    for rows in (1, 5, 20):
        for width in setup.widths:
            query, kv_rows, slots, counts, out, lse, stride = _inputs(fmt, rows, heads, width, gen)
            rec.calls.pop("run", None)
            rec.calls.pop("compiled", None)
            allocations = rec.cuda_allocations
            kernel(query, kv_rows, slots, counts, out, lse, block_size=64, rows_per_block_stride=stride)
            assert rec.cuda_allocations == allocations, "run() allocated on the device"
            ((wrapper, *args), kwargs), = rec.calls["run"]
            b = _bound(ORIG_RUN, (wrapper, *args), kwargs)
            cap = plan_rows[rows]
            assert wrapper._state["batch_size"] == cap and wrapper._state["max_topk"] == width
            assert b["validate"] is False
            assert b["query"] is query and b["indices"] is slots and b["lengths"] is counts
            assert b["out"] is out and b["lse"] is lse
            assert b["kv_cache"].dtype == (torch.float8_e4m3fn if fmt == "fp8" else torch.uint8)
            assert (b["softmax_scale"], b["output_scale"]) == (setup.softmax_scale, setup.output_scale)
            assert "kv_cache_scale" not in b  # descales are folded into the two scales
            qo = b["qo_indptr"]
            assert qo.dtype == torch.int32 and qo.numel() == cap + 1
            # FlashInfer's validate=True check of the offsets, run here on the host.
            longest, total, _ = mla_decode._derive_max_seq_len_q(qo, batch_size=cap)
            assert total == rows and longest <= 1
            assert qo.tolist() == list(range(rows + 1)) + [rows] * (cap - rows)
            # The launch writes straight into the given buffers and reads the given indices.
            ((spec,), launch), = rec.calls["compiled"]
            assert launch["out"].data_ptr() == out.data_ptr()
            assert launch["lse"].data_ptr() == lse.data_ptr()
            assert launch["page_offsets"].data_ptr() == slots.data_ptr()
            assert launch["seq_lens"].data_ptr() == counts.data_ptr()


def test_prims_ts_without_lse_uses_plan_scratch(fake_blackwell):
    rec = fake_blackwell
    kernel = fi_prims_ts.PrimsTsDecode(_setup(lse=False, row_counts=(3,), capacities=(), widths=(256,)))
    gen = torch.Generator().manual_seed(3)
    query, kv_rows, slots, counts, out, _, stride = _inputs("fp8", 3, 128, 256, gen)
    allocations = rec.cuda_allocations
    kernel(query, kv_rows, slots, counts, out, None, block_size=64, rows_per_block_stride=stride)
    assert rec.cuda_allocations == allocations
    ((_, *args), kwargs), = rec.calls["plan"]
    assert _bound(ORIG_PLAN, (None, *args), kwargs)["return_lse"] is False
    ((_, launch),) = rec.calls["compiled"]
    # lse=None with return_lse=False: FlashInfer writes into its workspace section, not a new tensor.
    ws = PLANS.workspace(CUDA0)
    assert ws.data_ptr() <= launch["lse"].data_ptr() < ws.data_ptr() + ws.numel()


def test_prims_ts_rejects_unplanned_calls(fake_blackwell):
    kernel = fi_prims_ts.PrimsTsDecode(_setup(row_counts=(4,), capacities=(), widths=(128,)))
    gen = torch.Generator().manual_seed(4)
    query, kv_rows, slots, counts, out, lse, stride = _inputs("fp8", 4, 128, 128, gen)
    with pytest.raises(ValueError, match="width=256"):
        kernel(query, kv_rows, fake(torch.zeros(4, 256, dtype=torch.int32)), counts, out, lse,
               block_size=64, rows_per_block_stride=stride)
    with pytest.raises(ValueError, match="rows=2"):
        kernel(query[:2], kv_rows, slots[:2], counts[:2], out[:2], lse[:2], block_size=64, rows_per_block_stride=stride)
    with pytest.raises(ValueError, match="heads=129"):
        fi_prims_ts.PrimsTsDecode(_setup(heads=129))


def test_prims_ts_missing_in_0_7_2(fake_blackwell, monkeypatch):
    """vLLM's pin (0.7.2.post1) has no prims_ts: construction says what to install; trtllm still builds."""
    monkeypatch.setattr(fi_features, "flashinfer_features", lambda: fi_features.FlashInferFeatures("0.7.2.post1", False, True))
    with pytest.raises(ImportError, match=r"pip install --no-deps flashinfer-python==0\.7\.4"):
        fi_prims_ts.PrimsTsDecode(_setup())
    with pytest.raises(ImportError, match="0.7.2.post1"):
        PLANS.plan([PlanKey(CUDA0, 1, 128, True, "fp8", 128)])
    fi_trtllm.TrtllmDecode(_setup(row_counts=(1, 4), capacities=()))


def test_flashinfer_features_of_the_installed_version():
    f = fi_features.flashinfer_features()
    assert f.version == fi.__version__
    assert f.prims_ts and f.trtllm_mla  # this CI installs 0.7.4
    assert not fi_features.device_runs_blackwell("cpu")


# ------------------------------------------------------------------ trtllm-gen


@pytest.mark.parametrize("heads", [128, 64, 16])
@pytest.mark.parametrize("block_size,stride", [(64, None), (64, 96), (32, None)])
def test_trtllm_calls_follow_flashinfer(fake_blackwell, heads, block_size, stride):
    rec = fake_blackwell
    impl = types.SimpleNamespace(_workspace_buffer=None, qk_nope_head_dim=128)
    setup = _setup("fp8", heads, row_counts=(1, 5, 20), capacities=(), widths=(128, 2048), impl=impl)
    kernel = fi_trtllm.TrtllmDecode(setup)
    gen = torch.Generator().manual_seed(heads + block_size)
    for rows in (1, 5, 20):
        for width in setup.widths:
            query, kv_rows, slots, counts, out, lse, stride_rows = _inputs(
                "fp8", rows, heads, width, gen, block_size=block_size, stride=stride, count0=(0, 3)
            )
            rec.calls.clear()
            allocations = rec.cuda_allocations
            kernel(query, kv_rows, slots, counts, out, lse, block_size=block_size, rows_per_block_stride=stride_rows)
            assert rec.cuda_allocations == allocations, "the trtllm call allocated on the device"
            (args, kwargs), = rec.calls["trtllm"]
            b = _bound(ORIG_TRTLLM, args, kwargs)
            page = math.gcd(stride_rows, block_size, 64)
            assert b["kv_cache"].shape == (kv_rows.shape[0] // page, 1, page, HEAD_DIM)
            assert b["kv_cache"].data_ptr() == kv_rows.data_ptr()
            assert b["block_tables"].shape == (rows, 1, width) and b["block_tables"].data_ptr() == slots.data_ptr()
            assert b["seq_lens"] is counts
            assert b["max_seq_len"] == b["sparse_mla_top_k"] == width
            assert (b["kv_lora_rank"], b["qk_rope_head_dim"]) == (512, 64)
            assert (b["bmm1_scale"], b["bmm2_scale"]) == (setup.softmax_scale, setup.output_scale)
            assert b["backend"] == "trtllm-gen" and b["return_lse"] is True
            assert b["return_lse_base"] == "basee"  # FlashInfer accepts 'basee' | 'base2' | None
            assert b["workspace_buffer"] is kernel.workspace

            (_, native), = rec.calls["native"]
            # The C++ rules (trtllm_fmha_kernel_launcher.cu, kernelParams.h) on what reaches it.
            assert native["query"].shape == (rows, heads, HEAD_DIM) and native["query"].dtype == torch.float8_e4m3fn
            assert native["key_cache"] is native["value_cache"]
            assert native["key_cache"].shape[-2] in (32, 64) and native["key_cache"].shape[-1] == 576
            assert native["out"].data_ptr() == out.data_ptr() and native["out"].shape[-1] == 512
            assert native["sparse_mla_top_k"] % 4 == 0 and native["max_kv_len"] == width
            assert native["batch_size"] == rows and native["max_q_len"] == 1
            counter = native["multi_ctas_kv_counter_buffer"]
            assert counter is kernel.counter and counter.data_ptr() % 16 == 0
            assert counter.numel() >= get_trtllm_gen_multi_ctas_kv_counter_bytes(rows, heads, SM_COUNT)
            assert native["workspace_size"] == kernel.workspace.numel() * kernel.workspace.element_size()
            assert native["workspace_size"] >= fi_trtllm.trtllm_lse_slab_bytes(rows, heads)
            assert native["lse"].data_ptr() == lse.data_ptr() and native["lse"].dim() == 2
            assert native["lse"].dtype == torch.float32
            assert native["lse_scale"] == pytest.approx(1.0 / log2e)  # natural-log LSE
            assert native["sparse_mla_top_k_lens"] is None and native["cum_seq_lens_q"] is None

            # Count-0 rows are forced to out 0 / LSE -inf; the others keep what the kernel wrote.
            empty = counts == 0
            assert bool((out[empty] == 0).all()) and bool((lse[empty] == float("-inf")).all())
            assert bool((out[~empty] == 7.0).all()) and bool((lse[~empty] == 3.0).all())


def test_trtllm_argument_rules(fake_blackwell):
    for heads in (96, 129):
        with pytest.raises(ValueError, match=f"heads={heads}"):
            fi_trtllm.TrtllmDecode(_setup("fp8", heads))
    with pytest.raises(ValueError, match="nvfp4_ds_mla"):
        fi_trtllm.TrtllmDecode(_setup("nvfp4_ds_mla"))
    with pytest.raises(ValueError, match="multiple of 4"):
        fi_trtllm.TrtllmDecode(_setup(widths=(130,)))
    kernel = fi_trtllm.TrtllmDecode(_setup(row_counts=(2,), capacities=(), widths=(128,)))
    gen = torch.Generator().manual_seed(5)
    query, kv_rows, slots, counts, out, lse, _ = _inputs("fp8", 2, 128, 128, gen, block_size=48)
    with pytest.raises(ValueError, match="block_size=48"):
        kernel(query, kv_rows, slots, counts, out, lse, block_size=48, rows_per_block_stride=48)
    wide = fake(torch.zeros(2, 256, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        kernel(query, kv_rows, wide[:, :128], counts, out, lse, block_size=64, rows_per_block_stride=64)


def test_trtllm_uses_vllms_workspace_when_large_enough(fake_blackwell):
    big = fake(torch.zeros(fi_trtllm.TRTLLM_BASE_WORKSPACE_BYTES + fi_trtllm.trtllm_lse_slab_bytes(8, 64), dtype=torch.int8))
    impl = types.SimpleNamespace(_workspace_buffer=big, qk_nope_head_dim=128)
    assert fi_trtllm.TrtllmDecode(_setup(heads=64, row_counts=(8,), capacities=(), impl=impl)).workspace is big
    # Too small for the LSE slab of 128 heads x 8 rows: a workspace of its own.
    assert fi_trtllm.TrtllmDecode(_setup(heads=128, row_counts=(8,), capacities=(), impl=impl)).workspace is not big
