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
                                                                  "SparseMLACommonMetadataBuilder"],
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
                 "get_kv_cache_spec"):
        assert hasattr(layer, name), f"MLAAttention has no {name}"
    assert config.compilation_config.static_forward_context["model.layers.0.pin.mla_attn"] is layer
