"""vLLM 0.33's real classes on a CPU: a VllmConfig from a tiny config.json, MLAAttention layers built by vLLM's
own constructor (selector, backend, impl), under a CUDA platform whose compute capability is mocked.

How vLLM's own selector tests mock a GPU: `vllm.platforms.current_platform` patched to a `CudaPlatform()` whose
`get_device_capability` returns the capability under test. Importing `vllm.platforms.cuda` loads the compiled op
library `vllm._C_stable_libtorch`, which links libcuda.so.1, absent on a CPU machine; a placeholder module takes
its place (no op of it runs on this path). vLLM modules are imported before the patch, as on a CPU, so none of
them loads CUDA extensions.
"""

from __future__ import annotations

import contextlib
import json
import sys
import types
from pathlib import Path
from typing import Any, Iterator
from unittest.mock import patch

import torch

DSV32 = "DeepseekV32ForCausalLM"
GLM_DSA = "GlmMoeDsaForCausalLM"


def model_config_json(arch: str, *, heads: int = 16, topk: int = 128) -> dict[str, Any]:
    """A tiny config.json of a DeepSeek-V3.2- or GLM-5-DSA-shaped model (MLA 512 + 64, an indexer of `topk`)."""
    common = dict(
        architectures=[arch], hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads, kv_lora_rank=512,
        q_lora_rank=128, qk_rope_head_dim=64, v_head_dim=128, index_topk=topk, index_n_heads=4,
        index_head_dim=128, vocab_size=1024, max_position_embeddings=8192, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, rope_theta=10000.0,
        rms_norm_eps=1e-6, torch_dtype="bfloat16", n_group=1, topk_group=1, routed_scaling_factor=1.0,
        scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, tie_word_embeddings=False,
    )
    if arch == DSV32:
        return {**common, "model_type": "deepseek_v32", "qk_nope_head_dim": 128}
    if arch == GLM_DSA:
        return {**common, "model_type": "glm_moe_dsa", "qk_nope_head_dim": 192}
    raise ValueError(f"arch {arch!r}: expected {DSV32} or {GLM_DSA}")


def vllm_config(
    directory: Path,
    arch: str,
    *,
    kv_cache_dtype: str = "fp8",
    heads: int = 16,
    topk: int = 128,
    backend: str | None = "FLASHINFER_MLA_SPARSE",
    dcp: int = 1,
    tp: int = 1,
    block_size: int = 64,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 64,
    capture_sizes: tuple[int, ...] = (1, 2, 4),
    speculative_tokens: int = 0,
) -> Any:
    """A real VllmConfig of the model written to `directory` (the device left as vLLM infers it on a CPU); tp: the
    tensor-parallel size it says (vLLM wants it divisible by dcp; nothing is launched, so any size builds here);
    speculative_tokens: > 0 adds vLLM's n-gram speculative decoding with that many draft tokens (no draft model)."""
    from vllm.config import (
        AttentionConfig, CacheConfig, CompilationConfig, DeviceConfig, ModelConfig, ParallelConfig,
        SchedulerConfig, SpeculativeConfig, VllmConfig,
    )

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_config_json(arch, heads=heads, topk=topk)))
    model = ModelConfig(model=str(directory), tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16",
                        max_model_len=4096)
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(cache_dtype=kv_cache_dtype, block_size=block_size),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=4096,
            is_encoder_decoder=False,
        ),
        compilation_config=CompilationConfig(cudagraph_capture_sizes=list(capture_sizes)),
        attention_config=AttentionConfig(backend=backend),
        device_config=DeviceConfig(device="cpu"),
        speculative_config=SpeculativeConfig(
            method="ngram", num_speculative_tokens=speculative_tokens, prompt_lookup_min=1, prompt_lookup_max=3
        ) if speculative_tokens else None,
    )


_initialized = False


def init_vllm(device: torch.device | str = "cpu") -> None:
    """Once per process: vLLM's single-rank distributed groups (gloo on a CPU, NCCL on a GPU) and its workspace
    manager on `device`."""
    global _initialized
    if _initialized:
        return
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.v1.worker.workspace import init_workspace_manager

    import socket

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="nccl" if device.type == "cuda" else "gloo",
        )
        initialize_model_parallel(1, 1)
    init_workspace_manager(device)
    _initialized = True


def init_vllm_cpu() -> None:
    init_vllm("cpu")


def cuda_platform_class() -> type:
    """vLLM's CudaPlatform class, importable on a CPU (see the module docstring)."""
    import vllm.model_executor.layers.attention.mla_attention  # noqa: F401  (imported as on a CPU, first)
    import vllm.model_executor.layers.linear  # noqa: F401
    import vllm.model_executor.layers.quantization.online.fp8  # noqa: F401  (ColumnParallelLinear's lazy import)

    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    from vllm.platforms.cuda import CudaPlatform

    return CudaPlatform


@contextlib.contextmanager
def gpu_capability(major: int, minor: int = 0) -> Iterator[None]:
    """vLLM's current platform as CUDA with this compute capability, and a fresh selector cache."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import _cached_get_attn_backend

    cls = cuda_platform_class()
    _cached_get_attn_backend.cache_clear()
    with (
        patch("vllm.platforms.current_platform", cls()),
        patch.object(cls, "get_device_capability", return_value=DeviceCapability(major, minor)),
    ):
        yield
    _cached_get_attn_backend.cache_clear()


def select_backend(config: Any, kv_cache_dtype: str, *, head_size: int = 576) -> type:
    """vLLM's selector (get_attn_backend) for a sparse MLA layer of `config`, as MLAAttention calls it."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    with set_current_vllm_config(config):
        return get_attn_backend(head_size, torch.bfloat16, kv_cache_dtype, use_mla=True, use_sparse=True)


def build_mla_layer(
    config: Any, *, heads: int, topk_buffer: torch.Tensor, prefix: str = "model.layers.0.self_attn.mla_attn",
    qk_nope_head_dim: int = 128,
) -> Any:
    """An MLAAttention made by vLLM's constructor (selector, backend, impl) for `config`, as a DSA model makes it."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    device = topk_buffer.device
    init_vllm(device)
    with set_current_vllm_config(config), device:
        kv_b_proj = ColumnParallelLinear(512, heads * (qk_nope_head_dim + 128), bias=False, params_dtype=torch.bfloat16)
        with torch.no_grad():
            kv_b_proj.weight.normal_(0.0, 512 ** -0.5)  # fresh values (the impl's decode reads none of them)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # vLLM builds models under the model dtype
    try:
        with set_current_vllm_config(config), device:
            return MLAAttention(
                num_heads=heads, scale=192 ** -0.5, qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=64,
                v_head_dim=128, q_lora_rank=128, kv_lora_rank=512, kv_b_proj=kv_b_proj,
                cache_config=config.cache_config, prefix=prefix, use_sparse=True, topk_indices_buffer=topk_buffer,
            )
    finally:
        torch.set_default_dtype(default)


def build_dsa_attention(
    config: Any, *, topk_buffer: torch.Tensor, prefix: str = "model.layers.0.self_attn", cuda_v32: bool = False
) -> Any:
    """A DSA model's attention module, made by vLLM's own class for `config` as its decoder layer makes it.

    cuda_v32 False: DeepseekV2MLAAttention (the generic model path, GLM-5's), whose chain is
    `.mla_attn` (MultiHeadLatentAttentionWrapper) `.mla_attn` (MLAAttention, prefix `<prefix>.attn`) `.impl`.
    cuda_v32 True: DeepseekV32Attention (vLLM's CUDA DeepSeek-V3.2 path): the attention is an MLAAttention (`.impl`).
    Both build the indexer too. Call under gpu_capability; vllm.models.deepseek_v32.attention is best imported
    before its patch, as on a CPU (like the modules cuda_platform_class imports first).
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLAAttention
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention

    init_vllm_cpu()
    hf = config.model_config.hf_text_config
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # vLLM builds models under the model dtype
    try:
        with set_current_vllm_config(config):
            if cuda_v32:
                return DeepseekV32Attention(config, hf, prefix=prefix, topk_indices_buffer=topk_buffer)
            return DeepseekV2MLAAttention(
                vllm_config=config, config=hf, hidden_size=hf.hidden_size, num_heads=hf.num_attention_heads,
                qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
                v_head_dim=hf.v_head_dim, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
                max_position_embeddings=hf.max_position_embeddings, cache_config=config.cache_config,
                quant_config=config.quant_config, prefix=prefix, topk_indices_buffer=topk_buffer,
            )
    finally:
        torch.set_default_dtype(default)
