"""vllm_glue: FLASHINFER_MLA_SPARSE detection, the per-model cores on shared buffers, the plugin hook.

vLLM's own classes (FlashInferMLASparseImpl, its plugin loader, its CPU DCP combine) are used where they
import on a CPU; the decode kernel is conftest's reference stand-in (kernel numerics are tested elsewhere).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from vllm_kimi_dsa import vllm_glue
from vllm_kimi_dsa.dcp import LOG2_E
from vllm_kimi_dsa.formats import LATENT_DIM
from vllm_kimi_dsa.reference import reference_decode
from vllm_kimi_dsa.synthetic import StandInImpl, StandInLayer, make_step
from vllm_kimi_dsa.vllm_glue import KimiDSACores, dsa_layers, dsa_on_flashinfer, kernel_table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPL_MODULE = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse"


@pytest.fixture(scope="module")
def fi_impl_cls():
    mod = pytest.importorskip(IMPL_MODULE, reason="vLLM's FLASHINFER_MLA_SPARSE backend does not import here")
    return mod.FlashInferMLASparseImpl


def _vllm_impl(cls, fmt="fp8", **attrs):
    """A FlashInferMLASparseImpl without its __init__ (which needs a live vLLM config), with the attrs the core reads."""
    impl = object.__new__(cls)
    fields = dict(
        scale=0.07, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, kv_cache_dtype=fmt,
        num_heads=16, dcp_world_size=1, dcp_rank=0, _workspace_buffer=None, bmm1_scale=None, bmm2_scale=None,
    )
    fields.update(attrs)
    for k, v in fields.items():
        setattr(impl, k, v)
    return impl


class _Module(torch.nn.Module):
    """An nn.Module with optional attributes, to build vLLM-shaped attention chains."""

    def __init__(self, **children):
        super().__init__()
        for k, v in children.items():
            setattr(self, k, v)


def _generic_chain(impl):
    """DeepseekV2MLAAttention -> .mla_attn (MultiHeadLatentAttentionWrapper) -> .mla_attn (MLAAttention) -> .impl."""
    inner = _Module(impl=impl, _q_scale_float=0.05, _k_scale_float=0.5)
    return _Module(mla_attn=_Module(mla_attn=inner)), inner


# ---------------------------------------------------------------- dsa_on_flashinfer


def test_dsa_on_flashinfer_generic_chain(fi_impl_cls):
    attention, _ = _generic_chain(_vllm_impl(fi_impl_cls))
    assert dsa_on_flashinfer(attention) is True


def test_dsa_on_flashinfer_cuda_v32_chain(fi_impl_cls):
    mla = _Module(impl=_vllm_impl(fi_impl_cls))  # the attention *is* an MLAAttention
    assert dsa_on_flashinfer(mla) is True


def test_dsa_on_flashinfer_false_for_another_backend_impl(fi_impl_cls):
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl

    attention, _ = _generic_chain(object.__new__(FlashMLASparseImpl))
    assert dsa_on_flashinfer(attention) is False
    assert dsa_on_flashinfer(_generic_chain(StandInImpl())[0]) is False  # duck-typed stand-ins are not the backend


@pytest.mark.parametrize(
    "attention",
    [None, object(), SimpleNamespace(mla_attn=None), SimpleNamespace(mla_attn=SimpleNamespace()),
     SimpleNamespace(mla_attn=SimpleNamespace(mla_attn=SimpleNamespace(impl=None))), SimpleNamespace(impl=None)],
    ids=["none", "object", "wrapper-none", "no-inner", "inner-impl-none", "impl-none"],
)
def test_dsa_on_flashinfer_false_when_chain_absent(attention):
    assert dsa_on_flashinfer(attention) is False


def test_dsa_on_flashinfer_false_without_vllm(fi_impl_cls, monkeypatch):
    attention, _ = _generic_chain(_vllm_impl(fi_impl_cls))
    monkeypatch.setitem(sys.modules, IMPL_MODULE, None)  # import of the backend now raises ImportError
    assert dsa_on_flashinfer(attention) is False


def test_glue_import_needs_no_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import vllm_kimi_dsa.vllm_glue as g\n"
        "assert g.dsa_on_flashinfer(object()) is False\n"
        "g.register(); assert g.is_registered()\n"
        "print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_dsa_layers_lists_each_impl_once_in_order(fi_impl_cls):
    a, _ = _generic_chain(_vllm_impl(fi_impl_cls))
    b = _Module(impl=_vllm_impl(fi_impl_cls))
    other, _ = _generic_chain(StandInImpl())
    model = _Module(layers=torch.nn.ModuleList([_Module(self_attn=a), _Module(self_attn=other), _Module(self_attn=b)]))
    assert dsa_layers(model) == [a, b]


# ---------------------------------------------------------------- the plugin


@pytest.fixture
def fresh_plugins(monkeypatch):
    plugins = pytest.importorskip("vllm.plugins")
    monkeypatch.setattr(plugins, "plugins_loaded", False)
    monkeypatch.setattr(vllm_glue, "_registered", False)
    return plugins


def test_vllm_plugin_loader_finds_and_runs_register(fresh_plugins, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "kimi_k3_dsa")  # only ours, not vLLM's LoRA resolvers
    found = fresh_plugins.load_plugins_by_group(fresh_plugins.DEFAULT_PLUGINS_GROUP)
    assert found.get("kimi_k3_dsa") is vllm_glue.register
    assert not vllm_glue.is_registered()
    fresh_plugins.load_general_plugins()
    assert vllm_glue.is_registered()


def test_register_is_idempotent_and_cheap(fresh_plugins, monkeypatch):
    calls = []
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: calls.append(name) or object())
    vllm_glue.register()
    vllm_glue.register()
    assert vllm_glue.is_registered() and calls == [vllm_glue._IMPL_PATH]


def test_register_never_raises_on_a_bad_kernel_table(fresh_plugins, monkeypatch, tmp_path, caplog):
    bad = tmp_path / "table.json"
    bad.write_text("{not json")
    monkeypatch.setenv(vllm_glue.KERNEL_TABLE_ENV, str(bad))
    with caplog.at_level(logging.WARNING, logger="vllm_kimi_dsa.vllm_glue"):
        vllm_glue.register()
    assert vllm_glue.is_registered()
    assert any("registration failed" in r.getMessage() and "table.json" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- kernel table


def test_kernel_table_from_measured_file_and_env(monkeypatch, tmp_path):
    from vllm_kimi_dsa import dispatch

    monkeypatch.setattr(dispatch, "fi_kernels", lambda fmt, device=None: ("prims_ts", "trtllm", "sparse"))
    dispatch.reset_kernel_table_cache()
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tp": "1-3:prims_ts,4-8:trtllm", "dcp": "1-2:trtllm,3-8:prims_ts"}))
    kw = dict(heads=64, kv_cache_dtype="fp8", device="cpu")
    assert kernel_table([1, 3, 4, 8], dcp=1, table=path, **kw) == {1: "prims_ts", 3: "prims_ts", 4: "trtllm", 8: "trtllm"}
    assert kernel_table([1, 3], dcp=2, table=path, **kw) == {1: "trtllm", 3: "prims_ts"}
    monkeypatch.setenv(vllm_glue.KERNEL_TABLE_ENV, str(path))
    assert kernel_table([2, 5], dcp=1, **kw) == {2: "prims_ts", 5: "trtllm"}
    # 96 heads: trtllm cannot take them, whatever the table says
    assert kernel_table([5], dcp=1, heads=96, kv_cache_dtype="fp8", device="cpu") == {5: "prims_ts"}
    dispatch.reset_kernel_table_cache()


def test_kernel_table_explicit_mapping_must_cover_every_batch_size():
    with pytest.raises(ValueError, match=r"kernels: batch sizes \[3\]"):
        kernel_table([1, 3], dcp=1, heads=16, kv_cache_dtype="fp8", device="cpu", table={1: "triton"})


# ---------------------------------------------------------------- KimiDSACores


def _pairs(n, fmt="fp8", impl_cls=None, **impl_attrs):
    out = []
    for i in range(n):
        impl = _vllm_impl(impl_cls, fmt, **impl_attrs) if impl_cls else StandInImpl(kv_cache_dtype=fmt)
        out.append((impl, StandInLayer(_q_scale_float=0.04 + 0.01 * i, _k_scale_float=0.5 + 0.1 * i)))
    return out


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4_ds_mla"])
def test_cores_share_buffers_and_each_layer_gets_its_own_answer(reference_kernels, fmt):
    heads, width, sizes = 16, 256, (1, 3, 5)
    cores = KimiDSACores(_pairs(3, fmt), heads=heads, batch_sizes=sizes, width=width,
                         kernels={r: "triton" for r in sizes}, return_lse=True, device=DEVICE)
    assert len(cores) == 3 and cores.max_rows == 5 and cores.lse_base2 is False  # stand-in impl: natural log
    b = cores.buffers
    assert b.slots.shape == (5, width) and b.latent.numel() == 5 * heads * LATENT_DIM and b.lse.numel() == 5 * heads
    for core in cores.cores:
        assert core.buffers.slots is b.slots and core.buffers.latent is b.latent and core.buffers.lse is b.lse
        assert core.kernels == {1: "triton", 3: "triton", 5: "triton"}
    for rows in sizes:
        step = make_step(rows, heads, width, fmt, device=DEVICE, empty_rows=1, seed=rows)
        for i, core in enumerate(cores.cores):
            b.latent.fill_(float("nan"))
            out, lse = cores.forward(i, step.query, step.cache, step.topk, step.metadata)
            assert out.data_ptr() == b.latent.data_ptr() and out.shape == (rows, heads, LATENT_DIM)
            kv, _ = core.rows(step.cache, 64)
            ref_out, ref_lse = reference_decode(
                step.query, kv, b.slots[:rows], cores.counts(rows),
                fmt=core.fmt, softmax_scale=core.softmax_scale, output_scale=core.output_scale,
            )
            # the stand-in writes the float32 reference into bf16: one bf16 rounding (rel 2**-8)
            torch.testing.assert_close(out.float(), ref_out, atol=1e-3, rtol=2**-8)
            torch.testing.assert_close(lse, ref_lse, atol=0, rtol=0)
            assert int(cores.counts(rows)[0]) == 0
    # layers differ in their scales, so the same step must give different answers per layer
    assert cores.cores[0].softmax_scale != cores.cores[1].softmax_scale


def test_vllm_impl_gets_base2_lse_in_place(reference_kernels, fi_impl_cls):
    heads, width, rows = 16, 128, 4
    cores = KimiDSACores(_pairs(2, impl_cls=fi_impl_cls), heads=heads, batch_sizes=[rows], width=width,
                         kernels={rows: "triton"}, return_lse=True, device=DEVICE)
    assert cores.lse_base2 is True  # FlashInferMLASparseImpl.lse_base_on_e is False
    step = make_step(rows, heads, width, "fp8", device=DEVICE, empty_rows=1, seed=3)
    out, lse = cores.forward(1, step.query, step.cache, step.topk, step.metadata)
    assert lse.data_ptr() == cores.buffers.lse.data_ptr()
    core = cores.cores[1]
    kv, _ = core.rows(step.cache, 64)
    _, ref_lse = reference_decode(step.query, kv, cores.buffers.slots[:rows], cores.counts(rows), fmt="fp8",
                                  softmax_scale=core.softmax_scale, output_scale=core.output_scale)
    assert bool(torch.isneginf(lse[0]).all())
    torch.testing.assert_close(lse, ref_lse * LOG2_E, atol=1e-5, rtol=1e-6)  # one float32 multiply


def test_cores_read_dcp_and_dtype_from_the_vllm_impl(reference_kernels, fi_impl_cls):
    cores = KimiDSACores(_pairs(1, "fp8_e4m3", impl_cls=fi_impl_cls, dcp_world_size=4, dcp_rank=3),
                         heads=16, batch_sizes=[2], width=128, kernels={2: "triton"}, device=DEVICE)
    core = cores.cores[0]
    assert (core.dcp, core.rank, core.fmt) == (4, 3, "fp8")
    assert cores.return_lse and cores.buffers.lse is not None  # DCP needs the LSE


def test_dcp_ranks_through_the_glue_match_vllms_own_combine(reference_kernels, fi_impl_cls):
    """Each rank's glue hands base-2 LSE; vLLM's CPU combine (is_lse_base_on_e=False) must give the TP answer."""
    import test_dcp
    from vllm.v1.attention.ops.dcp import _lse_weighted_combine

    fmt, dcp, interleave, heads, width, rows = "fp8", 2, 64, 16, 128, 4
    (tp_cache, tp_meta), ranks, topk, query = test_dcp.make_case(fmt, dcp, interleave, rows, heads, width, seed=7)
    impl_kw = dict(impl_cls=fi_impl_cls, kv_cache_dtype=fmt)
    tp = KimiDSACores(_pairs(1, **impl_kw), heads=heads, batch_sizes=[rows], width=width,
                      kernels={rows: "triton"}, return_lse=True, device=DEVICE)
    tp_out, _ = tp.forward(0, query, tp_cache, topk, tp_meta)
    tp_out = tp_out.float().clone()
    outs, lses = [], []
    for rank, (cache, meta) in enumerate(ranks):
        g = KimiDSACores(_pairs(1, **impl_kw, dcp_world_size=dcp, dcp_rank=rank), heads=heads,
                         batch_sizes=[rows], width=width, kernels={rows: "triton"}, device=DEVICE)
        out, lse = g.forward(0, query, cache, topk, meta)
        outs.append(out.float().clone())
        lses.append(lse.clone())
    merged = _lse_weighted_combine(torch.stack(outs), torch.stack(lses), is_lse_base_on_e=False)
    scale = tp_out.abs().max().item()
    # bf16 per-rank latents (rel 2**-9) merged vs TP's single rounding: a few bf16 ulps of the output scale
    torch.testing.assert_close(merged, tp_out, atol=4 * 2**-8 * scale, rtol=0)
    # natural-log LSE fed to vLLM as base 2 would be wrong: the test can tell the bases apart
    wrong = _lse_weighted_combine(torch.stack(outs), torch.stack(lses) / LOG2_E, is_lse_base_on_e=False)
    assert (wrong - tp_out).abs().max().item() > 8 * 2**-8 * scale


def test_from_vllm_reads_capture_sizes_max_num_seqs_and_index_topk(reference_kernels, fi_impl_cls, monkeypatch):
    from vllm_kimi_dsa import dispatch

    monkeypatch.setattr(dispatch, "fi_kernels", lambda fmt, device=None: ("triton",))
    attention, _ = _generic_chain(_vllm_impl(fi_impl_cls, num_heads=16))
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=[4, 1, 2]),
        scheduler_config=SimpleNamespace(max_num_seqs=6),
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(index_topk=200)),
        cache_config=SimpleNamespace(cache_dtype="fp8"),
    )
    cores = KimiDSACores.from_vllm([attention, attention], config, device=DEVICE)
    assert cores.batch_sizes == (1, 2, 3, 4, 5, 6) and cores.width == 256 and cores.heads == 16
    core = cores.cores[0]
    assert core.capacities == (1, 2, 4, 6) and set(core.kernels.values()) == {"triton"}
    assert core.softmax_scale == pytest.approx(0.07 * 0.05 * 0.5)  # impl.scale * q_scale * k_scale of the MLAAttention


def test_forward_rejects_a_layer_index_out_of_range(reference_kernels):
    cores = KimiDSACores(_pairs(2), heads=16, batch_sizes=[2], width=128, kernels={2: "triton"}, device=DEVICE)
    step = make_step(2, 16, 128, "fp8", device=DEVICE)
    for bad in (2, -1, "0"):
        with pytest.raises(ValueError, match="layer_index"):
            cores.forward(bad, step.query, step.cache, step.topk, step.metadata)


def test_cores_reject_layers_without_an_impl():
    with pytest.raises(TypeError, match=r"layers\[1\]"):
        KimiDSACores([_pairs(1)[0], object()], heads=16, batch_sizes=[1], width=128, kernels={1: "triton"})
    with pytest.raises(ValueError, match="layers"):
        KimiDSACores([], heads=16, batch_sizes=[1], width=128)


def test_cores_reject_mixed_cache_dtypes(reference_kernels):
    pairs = _pairs(1, "fp8") + _pairs(1, "nvfp4_ds_mla")
    with pytest.raises(ValueError, match=r"layers\[1\]: kv_cache_dtype"):
        KimiDSACores(pairs, heads=16, batch_sizes=[1], width=128, kernels={1: "triton"}, device=DEVICE)
