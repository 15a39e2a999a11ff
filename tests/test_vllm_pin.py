"""Every vLLM name, attribute and signature the backend relies on (pyproject pins vllm==0.33.0 for these).

The backend subclasses vLLM's FlashInferMLASparseTRTLLMBackend, its metadata builder and FlashInferMLASparseImpl,
overrides their methods, and reads fields of vLLM's config, impl, layer and metadata. A vLLM release that moves
any of them breaks the backend silently or at startup; this module names each one, so the next release shows at
once what moved (README: "Why vLLM is pinned"). Checked against the installed vLLM, on a CPU.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.mla.flashinfer_mla_sparse", reason="needs vLLM 0.33")

import vllm_harness as vh  # noqa: E402

FMS = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse"

# module -> names the package imports or calls from it
NAMES = {
    "vllm.config": ["get_current_vllm_config", "set_current_vllm_config", "VllmConfig"],
    "vllm.config.cache": ["CacheDType"],
    "vllm.platforms": ["current_platform"],
    "vllm.platforms.interface": ["DeviceCapability"],
    "vllm.v1.attention.backend": ["AttentionLayer", "MLAAttentionImpl"],
    FMS: ["FlashInferMLASparseImpl", "FlashInferMLASparseMetadataBuilder", "FlashInferMLASparseTRTLLMBackend",
          "FlashInferMLASparseTRTLLMMetadataBuilder", "FlashInferMLASparseMetadata", "_get_workspace_buffer",
          "_required_workspace_bytes"],
    "vllm.v1.attention.backends.mla.index_group": ["HiSparseMLAIndexGroup"],
    "vllm.v1.attention.backends.registry": ["AttentionBackendEnum", "register_backend"],
    "vllm.distributed.parallel_state": ["get_tensor_model_parallel_rank", "get_dcp_world_size_and_rank"],
    "vllm.logger": ["init_logger", "LogScope"],
    "vllm.envs": ["environment_variables"],
    "vllm.model_executor.layers.attention.sparse_mla_attention": ["SparseMLACommonImpl",
                                                                  "SparseMLACommonMetadataBuilder",
                                                                  "SparseMLACommonMetadata"],
    # formats.flat_kv_row_view re-implements it (test_flat_kv_row_view_is_vllms below)
    "vllm.v1.attention.backends.mla.sparse_utils": ["flat_kv_row_view", "align_blocks_to_rows"],
    # the bench's FlashMLA peers call vLLM's _flashmla_C through these wrappers, as FLASHMLA_SPARSE imports them
    "vllm.v1.attention.ops.flashmla": ["get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd",
                                       "is_flashmla_sparse_supported", "FlashMLASchedMeta"],
    "vllm.v1.attention.backends.mla.flashmla_sparse": ["FlashMLASparseImpl", "MIN_HEADS_FOR_BF16_PREFILL"],
}

# (module, qualified name) -> the parameters, in order, the package calls or overrides it with
SIGNATURES = {
    (FMS, "FlashInferMLASparseImpl._forward_mqa_kernel"): [
        "self", "q", "kv_cache", "topk_indices", "seq_lens", "layer", "block_size", "is_decode"],
    (FMS, "FlashInferMLASparseImpl._prepare_mqa_kernel"): ["self", "layer", "device"],
    (FMS, "FlashInferMLASparseImpl.process_weights_after_loading"): ["self", "act_dtype"],
    (FMS, "FlashInferMLASparseTRTLLMBackend.supports_combination"): [
        "head_size", "dtype", "kv_cache_dtype", "block_size", "use_mla", "has_sink", "use_sparse", "use_mm_prefix",
        "device_capability"],
    (FMS, "FlashInferMLASparseTRTLLMBackend.supports_compute_capability"): ["capability"],
    (FMS, "FlashInferMLASparseTRTLLMMetadataBuilder.__init__"): [
        "self", "kv_cache_spec", "layer_names", "vllm_config", "device"],
    (FMS, "FlashInferMLASparseMetadataBuilder.__init__"): [
        "self", "kv_cache_spec", "layer_names", "vllm_config", "device"],
    (FMS, "_get_workspace_buffer"): ["device", "min_bytes"],
    (FMS, "_required_workspace_bytes"): ["dcp_world_size", "num_heads_per_rank", "max_num_batched_tokens"],
    ("vllm.model_executor.layers.attention.sparse_mla_attention", "SparseMLACommonImpl.forward_mqa"): [
        "self", "q", "kv_c_and_k_pe_cache", "attn_metadata", "layer"],
    ("vllm.config.model", "ModelConfig.get_num_attention_heads"): ["self", "parallel_config", "arch_config"],
    (FMS, "FlashInferMLASparseTRTLLMBackend.get_supported_kernel_block_sizes"): ["kv_cache_spec"],
    (FMS, "FlashInferMLASparseTRTLLMBackend.customize_spec"): ["spec"],
    ("vllm.v1.attention.backends.mla.sparse_utils", "flat_kv_row_view"): ["kv_cache", "block_size"],
    ("vllm.v1.attention.backends.mla.flashmla_sparse", "FlashMLASparseImpl._compute_fp8_decode_padded_heads"): [
        "num_heads"],
}


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("module", sorted(NAMES))
def test_names_the_backend_imports_exist(module):
    mod = importlib.import_module(module)
    missing = [name for name in NAMES[module] if not hasattr(mod, name)]
    assert not missing, f"vLLM moved {module}.{missing}"


@pytest.mark.parametrize("where", sorted(SIGNATURES), ids=lambda w: w[1])
def test_signatures_the_backend_calls_or_overrides(where):
    params = list(inspect.signature(_resolve(*where)).parameters)
    assert params == SIGNATURES[where], f"{where[1]}: vLLM has {params}, the backend was written against " \
                                        f"{SIGNATURES[where]}"


def test_the_facts_the_backend_builds_on():
    """Class-level facts: the classes it subclasses, the LSE flag vLLM's DCP combine reads, the names the builder
    override skips past, the log scope it uses, the keywords vLLM calls `_forward_mqa_kernel` with."""
    from vllm.logger import LogScope, init_logger
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonImpl
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.mla import flashinfer_mla_sparse as fms
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_kimi_dsa.vllm_backend import (
        KimiDSAFlashInferMLASparseBackend,
        KimiDSAFlashInferMLASparseImpl,
        KimiDSAFlashInferMLASparseMetadataBuilder,
    )

    assert fms.FlashInferMLASparseTRTLLMBackend.get_name() == "FLASHINFER_MLA_SPARSE"
    assert fms.FlashInferMLASparseTRTLLMBackend.get_builder_cls() is fms.FlashInferMLASparseTRTLLMMetadataBuilder
    assert fms.FlashInferMLASparseTRTLLMMetadataBuilder.__mro__[1] is fms.FlashInferMLASparseMetadataBuilder
    assert fms.FlashInferMLASparseTRTLLMMetadataBuilder._cudagraph_support == AttentionCGSupport.UNIFORM_BATCH
    assert fms.FlashInferMLASparseImpl.lse_base_on_e is False and fms.FlashInferMLASparseImpl.supports_dcp
    assert issubclass(KimiDSAFlashInferMLASparseBackend, fms.FlashInferMLASparseTRTLLMBackend)
    assert issubclass(KimiDSAFlashInferMLASparseImpl, fms.FlashInferMLASparseImpl)
    assert issubclass(KimiDSAFlashInferMLASparseMetadataBuilder, fms.FlashInferMLASparseTRTLLMMetadataBuilder)
    assert "FLASHINFER_MLA_SPARSE" in AttentionBackendEnum.__members__
    for method in ("is_overridden", "get_path", "clear_override", "get_class"):
        assert hasattr(AttentionBackendEnum.FLASHINFER_MLA_SPARSE, method), method
    assert "process" in LogScope.__args__
    assert "scope" in inspect.signature(init_logger("vllm.kimi_dsa.pin").info_once).parameters
    # the builder override repeats what vLLM's TRT-LLM builder __init__ does besides its allocation
    source = inspect.getsource(fms.FlashInferMLASparseTRTLLMMetadataBuilder.__init__)
    for piece in ("supports_draft_decode_metadata_update", "_required_workspace_bytes", "_get_workspace_buffer"):
        assert piece in source, piece
    # vLLM's forward_mqa calls the kernel with these keywords
    call = inspect.getsource(SparseMLACommonImpl.forward_mqa)
    for keyword in ("layer=layer", "block_size=block_size", "is_decode="):
        assert keyword in call, keyword


def test_fields_of_vllms_objects_the_backend_reads(tmp_path, monkeypatch):
    """The fields the backend reads of vLLM's config, impl and layer, on objects vLLM itself builds."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    from vllm_kimi_dsa import envs, vllm_glue

    monkeypatch.delenv(envs.BACKEND, raising=False)
    monkeypatch.setattr("vllm.v1.attention.backends.registry._ATTN_OVERRIDES", dict(_ATTN_OVERRIDES))
    vllm_glue.register()
    config = vh.vllm_config(tmp_path / "pin", vh.DSV32)
    for path in ("compilation_config.static_forward_context", "compilation_config.cudagraph_capture_sizes",
                 "parallel_config.decode_context_parallel_size", "parallel_config.tensor_parallel_size",
                 "parallel_config.prefill_context_parallel_size", "scheduler_config.max_num_seqs",
                 "scheduler_config.max_num_batched_tokens", "speculative_config", "attention_config.hisparse_config",
                 "model_config.hf_text_config.index_topk", "cache_config.cache_dtype"):
        obj = config
        for part in path.split("."):
            assert hasattr(obj, part), f"VllmConfig has no {path}"
            obj = getattr(obj, part)
    buffer = torch.full((4, 128), -1, dtype=torch.int32)
    with vh.gpu_capability(9):
        layer = vh.build_mla_layer(config, heads=16, topk_buffer=buffer, prefix="model.layers.0.pin.mla_attn")
    impl = layer.impl
    for name in ("kv_cache_dtype", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "num_heads",
                 "dcp_world_size", "dcp_rank", "index_group", "lse_base_on_e", "need_to_return_lse_for_decode",
                 "topk_indices_buffer", "scale", "_workspace_buffer", "bmm1_scale", "bmm2_scale"):
        assert hasattr(impl, name), f"FlashInferMLASparseImpl has no {name}"
    for name in ("_q_scale_float", "_k_scale_float", "kv_b_proj", "impl", "layer_name", "attn_backend",
                 "get_kv_cache_spec", "q_pad_num_heads"):  # q_pad_num_heads: vllm_glue.KimiDSACores.from_vllm
        assert hasattr(layer, name), f"MLAAttention has no {name}"
    assert config.compilation_config.static_forward_context["model.layers.0.pin.mla_attn"] is layer


def test_fields_read_directly_with_no_default():
    """The fields the package reads directly, with no default (a missing one raises, naming it): the metadata the
    core converts with (core.FlashInferCore.run / convert), the speculative tokens the planned rows count
    (serving.planned_rows), the padded heads and top-k width of a model's cores (vllm_glue.KimiDSACores.from_vllm)."""
    import dataclasses

    from vllm.config import SpeculativeConfig
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonMetadata

    fields = {f.name for f in dataclasses.fields(SparseMLACommonMetadata)}
    for name in ("req_id_per_token", "block_table", "block_size", "cp_kv_cache_interleave_size"):
        assert name in fields, f"SparseMLACommonMetadata has no {name}"
    assert "num_speculative_tokens" in {f.name for f in dataclasses.fields(SpeculativeConfig)}
    # MLAAttention copies q_pad_num_heads from its impl (None where the impl pads nothing, as FlashInfer's sparse)
    source = inspect.getsource(importlib.import_module(
        "vllm.model_executor.layers.attention.mla_attention").MLAAttention.__init__)
    assert 'self.q_pad_num_heads = getattr(self.impl, "q_pad_num_heads", None)' in source


def test_the_block_size_rule_and_the_cache_dtypes_the_backend_keeps(tmp_path):
    """README: block sizes a multiple of 32. vLLM's rule (one MultipleOf(32)) and its customize_spec (a cache's blocks
    whole 32-row pages apart, so trtllm-gen's page gcd(rows_per_block_stride, block_size, 64) is at least 32) reach
    this backend unchanged; its cache dtypes are vLLM's plus nvfp4_ds_mla."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.mla import flashinfer_mla_sparse as fms

    from vllm_kimi_dsa.vllm_backend import CORE_CACHE_DTYPES, KimiDSAFlashInferMLASparseBackend as Ours

    vllms = fms.FlashInferMLASparseTRTLLMBackend
    (rule,) = vllms.get_supported_kernel_block_sizes()
    assert isinstance(rule, MultipleOf) and rule.base == 32
    assert Ours.get_supported_kernel_block_sizes() == vllms.get_supported_kernel_block_sizes()
    assert Ours.customize_spec.__func__ is fms._FlashInferMLASparseBackendBase.customize_spec.__func__
    assert "align_blocks_to_rows(spec, page.base)" in inspect.getsource(Ours.customize_spec)
    config = vh.vllm_config(tmp_path / "blocks", vh.DSV32)
    with vh.gpu_capability(10):  # vLLM's own class or this one (registered or not): the spec is the same
        layer = vh.build_mla_layer(config, heads=16, topk_buffer=torch.full((4, 128), -1, dtype=torch.int32),
                                   prefix="model.layers.0.blocks.mla_attn")
    spec = layer.get_kv_cache_spec(config)
    assert Ours.customize_spec(spec).block_stride_alignment == 32 * spec.state_content_size_bytes
    assert vllms.supported_kv_cache_dtypes == ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]
    assert Ours.supported_kv_cache_dtypes == [*vllms.supported_kv_cache_dtypes, "nvfp4_ds_mla"]
    assert set(CORE_CACHE_DTYPES) <= set(Ours.supported_kv_cache_dtypes)


def test_the_reorder_thresholds_the_readme_quotes():
    """README ("Which batches reach the backend"): extends up to the builder's reorder threshold count as decodes,
    128 query tokens a request at 8-32 heads a TP rank, 256 at 64, 1024 at 128 and other counts; speculative rows
    too."""
    import ast
    import re
    from pathlib import Path

    from vllm.v1.attention.backends.mla import flashinfer_mla_sparse as fms

    source = inspect.getsource(fms.FlashInferMLASparseMetadataBuilder.__init__)
    found = re.search(r"threshold = (\{[^}]*\})\.get\(\s*num_q_heads, (\d+)\s*\)", source)
    assert found, "vLLM's FLASHINFER_MLA_SPARSE builder no longer sets its reorder threshold from a head table"
    table, default = ast.literal_eval(found.group(1)), int(found.group(2))
    assert table == {8: 128, 16: 128, 32: 128, 64: 256, 128: 1024} and default == 1024
    assert "supports_spec_as_decode=True" in source
    assert "get_num_attention_heads(" in source  # keyed on the heads of a TP rank
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert "(query tokens a request: 128 at 8-32 heads a TP rank, 256 at 64, 1024 at 128 and other counts)" in readme


def test_flat_kv_row_view_is_vllms():
    """formats.flat_kv_row_view re-implements vLLM's sparse_utils.flat_kv_row_view (the core imports no vLLM): the
    same rows view and rows_per_block_stride, on a cache whose blocks sit further apart than their rows."""
    from vllm.v1.attention.backends.mla.sparse_utils import flat_kv_row_view as vllms

    from vllm_kimi_dsa.formats import flat_kv_row_view as ours

    storage = torch.arange(5 * 96 * 576, dtype=torch.int32).view(torch.uint8).view(torch.float8_e4m3fn)
    cache = storage[: 5 * 96 * 576].view(5, 96, 576)[:, :64]  # 64 rows a block, blocks 96 rows apart
    for block_size, c in ((64, cache), (96, storage[: 5 * 96 * 576].view(5, 96, 576))):
        (theirs, their_stride), (mine, my_stride) = vllms(c, block_size), ours(c, block_size)
        assert my_stride == their_stride and mine.shape == theirs.shape and mine.stride() == theirs.stride()
        assert mine.data_ptr() == theirs.data_ptr() and mine.view(torch.uint8).equal(theirs.view(torch.uint8))
    assert ours(cache, 64)[1] == 96


def _calls(tree, name: str) -> list:
    import ast

    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and getattr(n.func, "attr", getattr(n.func, "id", None)) == name]


def test_the_flashmla_wrappers_the_bench_peers_call():
    """The bench's FlashMLA peers (bench/peers/flashmla.py, flashmla_prefill.py) call vLLM's _flashmla_C as vLLM 0.33's
    FlashMLASparseImpl does: flash_mla_with_kvcache with the keywords `_fp8_flash_mla_kernel` passes, the query padded
    as `_compute_fp8_decode_padded_heads` pads it, the mixed route below MIN_HEADS_FOR_BF16_PREFILL heads,
    flash_mla_sparse_fwd's parameters, and the compiled op's positional order (the harness calls it directly). The
    wrappers' module imports _flashmla_C at its top (no CPU import): read as source."""
    import ast
    from pathlib import Path

    import vllm
    from vllm.v1.attention.backends.mla import flashmla_sparse

    from vllm_kimi_dsa.bench.peers import flashmla as peer, flashmla_prefill as prefill_peer

    interface = ast.parse((Path(vllm.__file__).parent / "third_party" / "flashmla" / "flash_mla_interface.py")
                          .read_text())
    functions = {n.name: n for n in interface.body if isinstance(n, ast.FunctionDef)}
    params = {name: [a.arg for a in functions[name].args.args] for name in
              ("get_mla_metadata", "flash_mla_with_kvcache", "flash_mla_sparse_fwd")}
    assert params["flash_mla_sparse_fwd"] == ["q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length",
                                              "out"]
    (op,) = _calls(functions["flash_mla_sparse_fwd"], "sparse_prefill_fwd")  # what prefill_peer.load calls by position
    assert [a.id for a in op.args] == params["flash_mla_sparse_fwd"]
    assert functions["get_mla_metadata"].args.vararg is not None  # called with no argument
    vllms_call, = _calls(ast.parse(inspect.getsource(flashmla_sparse.FlashMLASparseImpl._fp8_flash_mla_kernel)
                                   .lstrip()), "flash_mla_with_kvcache")
    peers_call, = _calls(ast.parse(inspect.getsource(peer.VllmFlashMLA.run).lstrip()), "flash_mla_with_kvcache")
    assert {k.arg for k in peers_call.keywords} == {k.arg for k in vllms_call.keywords}
    assert {k.arg for k in peers_call.keywords} <= set(params["flash_mla_with_kvcache"])
    for heads in range(1, 129):
        assert peer.padded_heads(heads) == flashmla_sparse.FlashMLASparseImpl._compute_fp8_decode_padded_heads(heads)
    assert peer.MIN_HEADS_FOR_BF16_PREFILL == flashmla_sparse.MIN_HEADS_FOR_BF16_PREFILL
    assert "self.prefill_padding = 64" in inspect.getsource(flashmla_sparse.FlashMLASparseImpl.__init__)
    assert prefill_peer.HEAD_PAD == 64


def test_vllms_hopper_sparse_backends_the_readme_compares():
    """README, "vLLM's sparse MLA backends on Hopper": vLLM 0.33's SM90 order (FLASHINFER_MLA_SPARSE_SM90 first only at
    head size 512), what each backend takes (FLASH_ATTN_MLA_SPARSE: BF16 / FP16 caches, no DCP;
    FLASHINFER_MLA_SPARSE_SM90: FP8 or BF16 rows, a BF16 query, FlashInfer's fa3 wrapper, no DCP; FLASHMLA_SPARSE:
    DCP), that vLLM's own FLASHINFER_MLA_SPARSE refuses SM90, and the routing note on PCP + DCP (no dense MHA prefill;
    refused at selection, by vLLM's check this backend keeps)."""
    import importlib.util
    from pathlib import Path

    vh.cuda_platform_class()  # vllm.platforms.cuda importable on a CPU
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonMetadataBuilder
    from vllm.platforms.cuda import _get_backend_priorities
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla import flashinfer_mla_sparse as fms
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as Backend

    from vllm_kimi_dsa.vllm_backend import KimiDSAFlashInferMLASparseBackend as Ours

    sm90 = DeviceCapability(9, 0)
    sparse = [Backend.FLASH_ATTN_MLA_SPARSE, Backend.FLASHMLA_SPARSE, Backend.FLASHINFER_MLA_SPARSE_SM90]
    assert _get_backend_priorities(True, sm90, kv_cache_dtype="fp8", head_size=576)[-3:] == sparse
    assert _get_backend_priorities(True, sm90, kv_cache_dtype="fp8", head_size=512)[-3:] == [sparse[2], *sparse[:2]]
    flashinfer_sm90 = Backend.FLASHINFER_MLA_SPARSE_SM90.get_class()
    assert {"fp8", "fp8_e4m3", "bfloat16"} <= set(flashinfer_sm90.supported_kv_cache_dtypes)
    assert flashinfer_sm90.supports_compute_capability(sm90) and not flashinfer_sm90.get_impl_cls().supports_dcp
    sm90_source = inspect.getsource(importlib.import_module(flashinfer_sm90.__module__))
    assert 'backend="fa3"' in sm90_source and "self.supports_quant_query_input = False" in sm90_source
    flashmla = Backend.FLASHMLA_SPARSE.get_class()
    assert flashmla.supports_compute_capability(sm90) and flashmla.get_impl_cls().supports_dcp
    # FLASH_ATTN_MLA_SPARSE imports FlashAttention's compiled library at its top: read as source
    module, _ = Backend.FLASH_ATTN_MLA_SPARSE.get_path().rsplit(".", 1)
    fa_source = Path(importlib.util.find_spec(module).origin).read_text()
    assert 'supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [\n        "auto",\n        "float16",\n        ' \
           '"bfloat16",\n    ]' in fa_source
    for piece in ("does not support DCP", "block_table=topk_indices", "fa_version=3"):
        assert piece in fa_source, piece
    assert not fms.FlashInferMLASparseTRTLLMBackend.supports_compute_capability(sm90)
    build = inspect.getsource(SparseMLACommonMetadataBuilder.build)
    assert "and not (self.use_pcp and self.dcp_world_size > 1)" in build  # use_dense_mha off under PCP + DCP
    assert "treat_short_extends_as_decodes=not self.use_pcp" in build
    config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2,
                                                       prefill_context_parallel_size=2),
                        device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        why = Ours.supports_combination(576, torch.bfloat16, "fp8", 64, True, False, True, False, sm90)
    assert why is not None and "PCP+DCP" in why
