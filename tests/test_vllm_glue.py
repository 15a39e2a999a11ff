"""vllm_glue against vLLM 0.33's real classes, on a CPU: FLASHINFER_MLA_SPARSE detection, the per-model cores on
shared buffers (KimiDSACores), the plugin hook's failure modes.

Every impl and attention module here is made by vLLM's own constructors (tests/vllm_harness.py: a real VllmConfig of
a tiny DeepSeek-V3.2 / GLM-5 config.json, vLLM's selector under a CUDA platform with a mocked compute capability, as
vLLM's selector tests do): MLAAttention, DeepseekV2MLAAttention (whose chain is .mla_attn (vLLM's
MultiHeadLatentAttentionWrapper) .mla_attn (MLAAttention) .impl) and DeepseekV32Attention (an MLAAttention). With the
plugin registered FLASHINFER_MLA_SPARSE builds KimiDSAFlashInferMLASparseImpl; with it switched off, vLLM's own
FlashInferMLASparseImpl. DCP is emulated as tests/test_vllm_backend.py does it (vLLM's
get_dcp_world_size_and_rank, read by the impl's constructor, patched before construction). The decode kernel is
conftest's float32 reference stand-in where a test is about the glue's wiring (kernel numerics are tested elsewhere;
test_vllm_backend.py runs the real kernels through vLLM's forward_mqa). The plugin loader and env validation are
tested in test_vllm_backend.py.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.mla.flashinfer_mla_sparse", reason="needs vLLM 0.33")

import vllm.models.deepseek_v32.attention  # noqa: E402,F401  (imported as on a CPU, before any platform patch)
import vllm_harness as vh  # noqa: E402

from vllm_kimi_dsa import envs, vllm_glue  # noqa: E402
from vllm_kimi_dsa.formats import LATENT_DIM  # noqa: E402
from vllm_kimi_dsa.reference import reference_decode  # noqa: E402
from vllm_kimi_dsa.synthetic import make_step  # noqa: E402
from vllm_kimi_dsa.vllm_backend import KimiDSAFlashInferMLASparseImpl  # noqa: E402
from vllm_kimi_dsa.vllm_glue import (  # noqa: E402
    BACKEND_CLASS,
    KimiDSACores,
    dsa_layers,
    dsa_on_flashinfer,
    kernel_table,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPL_MODULE = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse"
LOG2_E = math.log2(math.e)  # written out here, not the package's constant
TOPK = 128  # the configs' index_topk: the width of the indexer's top-k buffer
# The GPU each cache format's impl is built for: FP8 on Hopper, nvfp4_ds_mla on Blackwell (vLLM 0.33 writes its rows
# only there, so the backend refuses it on SM90); either way the core runs here on the CPU.
CAPABILITY = {"fp8": 9, "fp8_e4m3": 9, "nvfp4_ds_mla": 10}


@pytest.fixture(autouse=True)
def plugin(monkeypatch):
    """The plugin registered, as vLLM's loader leaves it; vLLM's backend overrides restored after each test."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    saved = dict(_ATTN_OVERRIDES)
    monkeypatch.delenv(envs.BACKEND, raising=False)
    monkeypatch.delenv(envs.KERNEL_TABLE, raising=False)
    monkeypatch.setattr(vllm_glue, "_registered", vllm_glue._registered)  # restored after the test
    vllm_glue.register()
    yield
    _ATTN_OVERRIDES.clear()
    _ATTN_OVERRIDES.update(saved)


class _Models:
    """Real VllmConfigs, each made once per module (one takes about a second), and a fresh layer number per module
    built (vLLM refuses two layers of one name in a config's forward context)."""

    def __init__(self, root) -> None:
        self.root = root
        self.configs: dict = {}
        self.numbers = itertools.count()

    def config(self, arch: str = vh.DSV32, **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in self.configs:
            self.configs[key] = vh.vllm_config(self.root / f"model{len(self.configs)}", arch, **kw)
        return self.configs[key]

    def mla(self, config, *, heads: int = 16, capability: int | None = None,
            scales: tuple[float, float] = (0.05, 0.5)):
        """An MLAAttention built by vLLM's constructor (selector -> backend -> impl), its FP8 scales set as vLLM's
        KV-cache quant method sets them after loading."""
        if capability is None:
            capability = CAPABILITY[config.cache_config.cache_dtype]
        with vh.gpu_capability(capability):
            layer = vh.build_mla_layer(config, heads=heads, topk_buffer=_topk_buffer(),
                                       prefix=f"model.layers.{next(self.numbers)}.self_attn.mla_attn")
        layer._q_scale_float, layer._k_scale_float = scales
        return layer

    def attention(self, config, *, cuda_v32: bool = False, capability: int = 9,
                  scales: tuple[float, float] = (0.05, 0.5)):
        """vLLM's DeepseekV2MLAAttention (generic chain) or DeepseekV32Attention (cuda_v32), scales set likewise."""
        with vh.gpu_capability(capability):
            attention = vh.build_dsa_attention(config, topk_buffer=_topk_buffer(), cuda_v32=cuda_v32,
                                               prefix=f"model.layers.{next(self.numbers)}.self_attn")
        mla = attention if cuda_v32 else attention.mla_attn.mla_attn
        mla._q_scale_float, mla._k_scale_float = scales
        return attention


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _Models(tmp_path_factory.mktemp("vllm_glue_models"))


def _topk_buffer() -> torch.Tensor:
    """The model's indexer top-k buffer, [max_num_batched_tokens (64), index_topk] int32, as vLLM allocates it."""
    return torch.full((64, TOPK), -1, dtype=torch.int32)


def _vllms_own_layer(models, monkeypatch, **kw):
    """An MLAAttention on vLLM's own FlashInferMLASparseImpl (the plugin switched off, SM100): base-2 LSE."""
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseImpl

    monkeypatch.setenv(envs.BACKEND, "0")
    vllm_glue.register()  # clears the package's override: vLLM's own class comes back
    layer = models.mla(models.config(), capability=10, **kw)
    assert type(layer.impl) is FlashInferMLASparseImpl and layer.impl.lse_base_on_e is False
    return layer


# ---------------------------------------------------------------- dsa_on_flashinfer, dsa_layers


@pytest.mark.parametrize("cuda_v32", [False, True], ids=["generic-chain", "cuda-v32-chain"])
@pytest.mark.parametrize("arch", [vh.DSV32, vh.GLM_DSA])
def test_dsa_on_flashinfer_follows_both_of_vllms_chains(models, arch, cuda_v32):
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    attention = models.attention(models.config(arch), cuda_v32=cuda_v32)
    if cuda_v32:  # SPEC 8: the CUDA V3.2 path's attention is an MLAAttention subclass
        assert isinstance(attention, MLAAttention)
        impl = attention.impl
    else:  # SPEC 8: the generic path's chain, as vLLM builds it
        assert isinstance(attention.mla_attn, MultiHeadLatentAttentionWrapper)
        assert isinstance(attention.mla_attn.mla_attn, MLAAttention)
        impl = attention.mla_attn.mla_attn.impl
    assert isinstance(impl, KimiDSAFlashInferMLASparseImpl)
    assert dsa_on_flashinfer(attention) is True


def test_dsa_on_flashinfer_holds_for_vllms_own_impl(models, monkeypatch):
    """With the plugin off, vLLM's own FlashInferMLASparseImpl is still FLASHINFER_MLA_SPARSE."""
    assert dsa_on_flashinfer(_vllms_own_layer(models, monkeypatch)) is True


@pytest.mark.parametrize(
    "backend, kv_cache_dtype",
    [("FLASHMLA_SPARSE", "fp8_ds_mla"), ("FLASHINFER_MLA_SPARSE_SM90", "fp8")],
    ids=["flashmla-sparse", "flashinfer-sm90"],  # the SM90 fa3 path: a sibling class, not a subclass
)
def test_dsa_on_flashinfer_false_for_another_backend(models, backend, kv_cache_dtype):
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseImpl

    attention = models.attention(models.config(backend=backend, kv_cache_dtype=kv_cache_dtype))
    assert attention.mla_attn.mla_attn.impl is not None
    assert not isinstance(attention.mla_attn.mla_attn.impl, FlashInferMLASparseImpl)
    assert dsa_on_flashinfer(attention) is False


@pytest.mark.parametrize("part", ["none", "object", "wrapper", "indexer-cache", "projection"])
def test_dsa_on_flashinfer_false_where_the_chain_is_absent(models, part):
    """Objects without the chain, among them vLLM modules of a DSA attention that are not it: False, never raises."""
    attention = models.attention(models.config())
    obj = {
        "none": None,
        "object": object(),
        "wrapper": attention.mla_attn,  # MultiHeadLatentAttentionWrapper: .mla_attn has no .mla_attn, no .impl
        "indexer-cache": attention.indexer.k_cache,  # an AttentionLayerBase with no impl
        "projection": attention.kv_b_proj,
    }[part]
    assert dsa_on_flashinfer(obj) is False


def test_dsa_on_flashinfer_false_without_vllm(models, monkeypatch):
    attention = models.attention(models.config())
    assert dsa_on_flashinfer(attention) is True
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


def test_dsa_layers_lists_each_impl_once_in_order(models):
    """A model of three DSA attention modules built by vLLM: the FLASHINFER_MLA_SPARSE ones are listed, each once,
    as its outermost module (not the wrapper or the MLAAttention inside it), in model order."""
    a = models.attention(models.config())
    other = models.attention(models.config(backend="FLASHMLA_SPARSE", kv_cache_dtype="fp8_ds_mla"))
    b = models.attention(models.config(), cuda_v32=True)
    # The model around them is a plain module tree: vLLM's decoder layers hold a FusedMoE, which does not construct
    # on a CPU (its backend oracle finds none), and dsa_layers only walks model.modules().
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for attention in (a, other, b):
        decoder = torch.nn.Module()
        decoder.self_attn = attention
        model.layers.append(decoder)
    found = dsa_layers(model)
    assert len(found) == 2 and found[0] is a and found[1] is b


# ---------------------------------------------------------------- the plugin hook (loader and env: test_vllm_backend)


def test_register_records_the_class_path_and_imports_no_backend_code(monkeypatch):
    """register() runs in every vLLM process; it hands vLLM the class path and leaves the import to the selector."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    member = AttentionBackendEnum.FLASHINFER_MLA_SPARSE
    member.clear_override()
    monkeypatch.delitem(sys.modules, "vllm_kimi_dsa.vllm_backend", raising=False)  # restored after the test
    for _ in range(2):
        vllm_glue.register()
        assert member.get_path() == BACKEND_CLASS
    assert "vllm_kimi_dsa.vllm_backend" not in sys.modules


@pytest.mark.parametrize("content", [None, "{not json", "[]"], ids=["missing", "not-json", "not-an-object"])
def test_a_kernel_table_file_that_does_not_load_stops_register_naming_the_variable(monkeypatch, tmp_path, content):
    """A bad configuration stops vLLM's startup: ValueError naming the variable and the file, nothing registered.
    (test_vllm_backend covers a file that loads but names an unknown kernel.)"""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    path = tmp_path / "table.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv(envs.KERNEL_TABLE, str(path))
    member = AttentionBackendEnum.FLASHINFER_MLA_SPARSE
    member.clear_override()
    monkeypatch.setattr(vllm_glue, "_registered", False)
    with pytest.raises(ValueError, match=envs.KERNEL_TABLE) as raised:
        vllm_glue.register()
    assert str(path) in str(raised.value)
    assert not member.is_overridden() and not vllm_glue.is_registered()


# ---------------------------------------------------------------- kernel table


def test_kernel_table_from_measured_file_and_env(monkeypatch, tmp_path):
    from vllm_kimi_dsa import selection

    monkeypatch.setattr(selection, "fi_kernels", lambda fmt, device=None: ("prims_ts", "trtllm", "sparse"))
    selection.reset_kernel_table_cache()
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tp": "1-3:prims_ts,4-8:trtllm", "dcp": "1-2:trtllm,3-8:prims_ts"}))
    kw = dict(heads=64, kv_cache_dtype="fp8", device="cpu")
    assert kernel_table([1, 3, 4, 8], dcp=1, table=path, **kw) == {1: "prims_ts", 3: "prims_ts", 4: "trtllm", 8: "trtllm"}
    assert kernel_table([1, 3], dcp=2, table=path, **kw) == {1: "trtllm", 3: "prims_ts"}
    monkeypatch.setenv(vllm_glue.KERNEL_TABLE_ENV, str(path))
    assert kernel_table([2, 5], dcp=1, **kw) == {2: "prims_ts", 5: "trtllm"}
    # 96 heads: trtllm cannot take them, whatever the table says
    assert kernel_table([5], dcp=1, heads=96, kv_cache_dtype="fp8", device="cpu") == {5: "prims_ts"}
    selection.reset_kernel_table_cache()


def test_kernel_table_explicit_mapping_must_cover_every_batch_size():
    with pytest.raises(ValueError, match=r"kernels: batch sizes \[3\]"):
        kernel_table([1, 3], dcp=1, heads=16, kv_cache_dtype="fp8", device="cpu", table={1: "triton"})


# ---------------------------------------------------------------- KimiDSACores over vLLM-built impls


def _layers(models, n: int, fmt: str = "fp8"):
    """n MLAAttention layers of one model built by vLLM, each with its own FP8 scales."""
    config = models.config(kv_cache_dtype=fmt)
    return [models.mla(config, scales=(0.04 + 0.01 * i, 0.5 + 0.1 * i)) for i in range(n)]


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4_ds_mla"])
def test_cores_share_buffers_and_each_layer_gets_its_own_answer(models, reference_kernels, fmt):
    heads, width, sizes = 16, 256, (1, 3, 5)
    layers = _layers(models, 3, fmt)
    assert all(isinstance(layer.impl, KimiDSAFlashInferMLASparseImpl) for layer in layers)
    cores = KimiDSACores(layers, heads=heads, batch_sizes=sizes, width=width,
                         kernels={r: "triton" for r in sizes}, return_lse=True, device=DEVICE)
    # the package's impl declares natural-log LSE (lse_base_on_e True): the glue leaves it as the core hands it
    assert len(cores) == 3 and cores.max_rows == 5 and cores.lse_base2 is False
    b = cores.buffers
    assert b.slots.shape == (5, width) and b.latent.numel() == 5 * heads * LATENT_DIM and b.lse.numel() == 5 * heads
    for core, layer in zip(cores.cores, layers):
        assert core.buffers.slots is b.slots and core.buffers.latent is b.latent and core.buffers.lse is b.lse
        assert core.kernels == {1: "triton", 3: "triton", 5: "triton"}
        # each core folds its own MLAAttention's scales into vLLM's softmax scale
        k_fold = layer._k_scale_float if fmt == "fp8" else 1.0
        assert core.softmax_scale == pytest.approx(layer.impl.scale * layer._q_scale_float * k_fold)
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
    assert len({core.softmax_scale for core in cores.cores}) == 3


def test_vllms_own_impl_gets_base2_lse_in_place(models, reference_kernels, monkeypatch):
    """vLLM's own FlashInferMLASparseImpl declares base-2 LSE (lse_base_on_e False): the glue converts the core's
    natural log in place, in the shared buffer."""
    heads, width, rows = 16, 128, 4
    layers = [_vllms_own_layer(models, monkeypatch, scales=(0.04 + 0.01 * i, 0.5)) for i in range(2)]
    cores = KimiDSACores(layers, heads=heads, batch_sizes=[rows], width=width,
                         kernels={rows: "triton"}, return_lse=True, device=DEVICE)
    assert cores.lse_base2 is True
    step = make_step(rows, heads, width, "fp8", device=DEVICE, empty_rows=1, seed=3)
    out, lse = cores.forward(1, step.query, step.cache, step.topk, step.metadata)
    assert lse.data_ptr() == cores.buffers.lse.data_ptr()
    core = cores.cores[1]
    kv, _ = core.rows(step.cache, 64)
    _, ref_lse = reference_decode(step.query, kv, cores.buffers.slots[:rows], cores.counts(rows), fmt="fp8",
                                  softmax_scale=core.softmax_scale, output_scale=core.output_scale)
    assert bool(torch.isneginf(lse[0]).all())
    torch.testing.assert_close(lse, ref_lse * LOG2_E, atol=1e-5, rtol=1e-6)  # one float32 multiply


def _dcp_layer(models, monkeypatch, config, *, dcp: int, rank: int, heads: int, scales=(0.05, 0.5)):
    """An MLAAttention of DCP rank `rank` of `dcp`: vLLM's impl reads (size, rank) from this function in its
    constructor, and this process has no DCP group of that size."""
    import vllm.distributed.parallel_state as parallel_state

    with monkeypatch.context() as patch:  # only this construction sees the emulated group
        patch.setattr(parallel_state, "get_dcp_world_size_and_rank", lambda enabled=True: (dcp, rank))
        layer = models.mla(config, heads=heads, scales=scales)
    assert (layer.impl.dcp_world_size, layer.impl.dcp_rank) == (dcp, rank)
    return layer


def test_cores_read_dcp_and_dtype_from_the_vllm_impl(models, reference_kernels, monkeypatch):
    layer = _dcp_layer(models, monkeypatch, models.config(kv_cache_dtype="fp8_e4m3"), dcp=4, rank=3, heads=4)
    assert layer.impl.kv_cache_dtype == "fp8_e4m3"
    cores = KimiDSACores([layer], heads=16, batch_sizes=[2], width=128, kernels={2: "triton"}, device=DEVICE)
    core = cores.cores[0]
    assert (core.dcp, core.rank, core.fmt) == (4, 3, "fp8")
    assert cores.return_lse and cores.buffers.lse is not None  # DCP needs the LSE


def test_dcp_ranks_through_the_glue_match_vllms_own_combine(models, reference_kernels, monkeypatch):
    """Each rank's glue hands the LSE in the base its impl declares; vLLM's CPU combine, told that base
    (is_lse_base_on_e=impl.lse_base_on_e), must give the TP answer, and told the other base must not."""
    from dcp_cases import make_case
    from vllm.v1.attention.ops.dcp import _lse_weighted_combine

    fmt, dcp, interleave, heads, width, rows = "fp8", 2, 64, 16, 128, 4
    scales = (0.04, 0.5)
    config = models.config()
    (tp_cache, tp_meta), ranks, topk, query = make_case(fmt, dcp, interleave, rows, heads, width, seed=7)
    tp_layer = models.mla(config, heads=heads, scales=scales)
    tp = KimiDSACores([tp_layer], heads=heads, batch_sizes=[rows], width=width,
                      kernels={rows: "triton"}, return_lse=True, device=DEVICE)
    tp_out, _ = tp.forward(0, query, tp_cache, topk, tp_meta)
    tp_out = tp_out.float().clone()
    outs, lses, impls = [], [], []
    for rank, (cache, meta) in enumerate(ranks):
        layer = _dcp_layer(models, monkeypatch, config, dcp=dcp, rank=rank, heads=heads // dcp, scales=scales)
        g = KimiDSACores([layer], heads=heads, batch_sizes=[rows], width=width, kernels={rows: "triton"},
                         device=DEVICE)
        assert g.return_lse and g.lse_base2 is (not layer.impl.lse_base_on_e)
        out, lse = g.forward(0, query, cache, topk, meta)
        outs.append(out.float().clone())
        lses.append(lse.clone())
        impls.append(layer.impl)
    base_e = impls[0].lse_base_on_e
    assert base_e is True and all(impl.lse_base_on_e is base_e for impl in impls)  # the package's impl: natural log
    merged = _lse_weighted_combine(torch.stack(outs), torch.stack(lses), is_lse_base_on_e=base_e)
    scale = tp_out.abs().max().item()
    # bf16 per-rank latents (rel 2**-9) merged vs TP's single rounding: a few bf16 ulps of the output scale
    torch.testing.assert_close(merged, tp_out, atol=4 * 2**-8 * scale, rtol=0)
    # the same LSEs read in the other base give a wrong answer: the check can tell the bases apart
    wrong = _lse_weighted_combine(torch.stack(outs), torch.stack(lses), is_lse_base_on_e=not base_e)
    assert (wrong - tp_out).abs().max().item() > 8 * 2**-8 * scale


def test_from_vllm_reads_capture_sizes_max_num_seqs_and_index_topk(models, reference_kernels, monkeypatch):
    from vllm_kimi_dsa import selection

    monkeypatch.setattr(selection, "fi_kernels", lambda fmt, device=None: ("triton",))
    config = models.config(capture_sizes=(4, 1, 2), max_num_seqs=6, topk=200)
    model = torch.nn.Module()  # dsa_layers walks modules(): a plain tree of vLLM's attention modules
    model.layers = torch.nn.ModuleList(
        [models.attention(config, scales=(0.04 + 0.01 * i, 0.5 + 0.1 * i)) for i in range(2)]
    )
    layers = dsa_layers(model)
    assert layers == list(model.layers)
    cores = KimiDSACores.from_vllm(layers, config, device=DEVICE)
    assert cores.batch_sizes == (1, 2, 3, 4, 5, 6) and cores.width == 256 and cores.heads == 16
    assert cores.fmt == "fp8" and cores.lse_base2 is False
    for core, attention in zip(cores.cores, layers):
        mla = attention.mla_attn.mla_attn
        assert core.capacities == (1, 2, 4, 6) and set(core.kernels.values()) == {"triton"}
        # impl.scale (DeepseekV2MLAAttention's 1/sqrt(qk_head_dim)) * q_scale * k_scale of that layer's MLAAttention
        assert mla.impl.scale == pytest.approx(attention.scaling)
        assert core.softmax_scale == pytest.approx(mla.impl.scale * mla._q_scale_float * mla._k_scale_float)


def test_from_vllm_reads_the_padded_heads_and_top_k_off_vllms_objects(models, reference_kernels, monkeypatch):
    """The heads of the decode query are the MLAAttention's q_pad_num_heads (vLLM 0.33 copies it from the impl; None
    for FlashInfer's sparse impl, which pads nothing: heads x DCP then), and the top-k width is the model's
    index_topk: both read off vLLM's objects directly, a missing one refused naming it (no default width or heads)."""
    from vllm_kimi_dsa import selection

    monkeypatch.setattr(selection, "fi_kernels", lambda fmt, device=None: ("triton",))
    config = models.config(capture_sizes=(1, 2), max_num_seqs=2, topk=200)
    attention = models.attention(config)
    mla = attention.mla_attn.mla_attn
    assert mla.q_pad_num_heads is None and not hasattr(mla.impl, "q_pad_num_heads")
    assert KimiDSACores.from_vllm([attention], config, device=DEVICE).heads == 16
    monkeypatch.setattr(mla, "q_pad_num_heads", 32, raising=False)  # an impl that pads the query to 32 heads
    assert KimiDSACores.from_vllm([attention], config, device=DEVICE).heads == 32
    monkeypatch.delattr(mla, "q_pad_num_heads")
    with pytest.raises(TypeError, match="MLAAttention.q_pad_num_heads is missing"):
        KimiDSACores.from_vllm([attention], config, device=DEVICE)
    monkeypatch.setattr(mla, "q_pad_num_heads", None, raising=False)
    monkeypatch.delattr(config.model_config.hf_text_config, "index_topk")
    with pytest.raises(TypeError, match="hf_text_config.index_topk is missing"):
        KimiDSACores.from_vllm([attention], config, device=DEVICE)


def test_forward_rejects_a_layer_index_out_of_range(models, reference_kernels):
    cores = KimiDSACores(_layers(models, 2), heads=16, batch_sizes=[2], width=128, kernels={2: "triton"},
                         device=DEVICE)
    step = make_step(2, 16, 128, "fp8", device=DEVICE)
    for bad in (2, -1, "0"):
        with pytest.raises(ValueError, match="layer_index"):
            cores.forward(bad, step.query, step.cache, step.topk, step.metadata)


def test_cores_reject_layers_without_an_impl(models):
    attention = models.attention(models.config())
    with pytest.raises(TypeError, match=r"layers\[1\].*MultiHeadLatentAttentionWrapper"):
        KimiDSACores([attention, attention.mla_attn], heads=16, batch_sizes=[1], width=128, kernels={1: "triton"})
    with pytest.raises(TypeError, match=r"layers\[1\]"):
        KimiDSACores([attention, object()], heads=16, batch_sizes=[1], width=128, kernels={1: "triton"})
    with pytest.raises(ValueError, match="layers"):
        KimiDSACores([], heads=16, batch_sizes=[1], width=128)


def test_cores_reject_mixed_cache_dtypes(models, reference_kernels):
    layers = _layers(models, 1, "fp8") + _layers(models, 1, "nvfp4_ds_mla")
    with pytest.raises(ValueError, match=r"layers\[1\]: kv_cache_dtype"):
        KimiDSACores(layers, heads=16, batch_sizes=[1], width=128, kernels={1: "triton"}, device=DEVICE)
