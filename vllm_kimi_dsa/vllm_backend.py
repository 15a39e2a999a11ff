"""vLLM's FLASHINFER_MLA_SPARSE backend with this package's core: what the plugin registers in its place.

Supports: DSA models (DeepseekV32, GlmMoeDsa, Kimi K3.1) with 576-wide MLA rows (512 latent + 64 RoPE), FP8
(`fp8` / `fp8_e4m3`, 576 B rows) caches, and `nvfp4_ds_mla` (352 B rows) on SM100/103 (vLLM 0.33 cannot write
nvfp4_ds_mla rows on SM90, so it is refused there at selection), block sizes that are multiples of 32,
query heads per rank (times DCP) from 1 to 128, DCP, CUDA graphs of uniform decode batches.
SM90 (Hopper): every sparse decode runs this package's Triton/Gluon kernels. SM100/103 (Blackwell): the core's
kernel table (FlashInfer prims_ts / trtllm-gen); what the core does not serve there (BF16 caches, other head
counts, HiSparse, NoPE-only models) stays on vLLM's own FlashInferMLASparseImpl code, unchanged.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.config.cache import CacheDType
import vllm.platforms
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionLayer, MLAAttentionImpl
import vllm.v1.attention.backends.mla.flashinfer_mla_sparse as vllm_flashinfer_sparse
from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import (
    FlashInferMLASparseImpl,
    FlashInferMLASparseMetadataBuilder,
    FlashInferMLASparseTRTLLMBackend,
    FlashInferMLASparseTRTLLMMetadataBuilder,
)
from vllm.v1.attention.backends.mla.index_group import HiSparseMLAIndexGroup

from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM
from vllm_kimi_dsa.heads import rank_heads_refusal
from vllm_kimi_dsa.logs import init_logger
from vllm_kimi_dsa.serving import LayerStep, StepShape, planned_layout

logger = init_logger(__name__)

CORE_CACHE_DTYPES: tuple[str, ...] = ("fp8", "fp8_e4m3", "nvfp4_ds_mla")
HOPPER, BLACKWELL = 9, 10
# The core reads nvfp4_ds_mla rows on Hopper, but vLLM 0.33 cannot write them there (tools/e2m1_cvt_probe.py): its
# CUDA writer has only an sm_100 build, and DeepSeek-V3.2's fused Triton insert uses an instruction sm_90 lacks.
NVFP4_WRITER_NEEDS_SM100 = (
    "vLLM 0.33 writes nvfp4_ds_mla rows only on SM100 (its concat_and_cache_nvfp4_ds_mla kernel has no SM90 build "
    "and DeepSeek-V3.2's fused cache insert uses cvt.rn.satfinite.e2m1x2, which SM90 does not assemble); on Hopper "
    "use --kv-cache-dtype fp8"
)


def core_rejects(
    *,
    capability: DeviceCapability,
    kv_cache_dtype: str | None,
    head_size: int,
    heads: int | None,
    hisparse: bool = False,
    dcp: int = 1,
    tp: int | None = None,
) -> str | None:
    """Why this package's core cannot run a layer, or None when it can.

    heads: query heads per row the kernel sees (heads per TP rank times the DCP size); None: not known yet.
    dcp, tp: the DCP and tensor-parallel sizes, for a heads refusal that names the change fixing it.
    """
    if kv_cache_dtype not in CORE_CACHE_DTYPES:
        return (
            f"kv_cache_dtype {kv_cache_dtype!r} is not one the sparse core reads; use --kv-cache-dtype fp8 "
            "(576 B rows) or nvfp4_ds_mla (352 B rows)"
        )
    if head_size != HEAD_DIM:
        return f"head_size {head_size} is not {HEAD_DIM} ({LATENT_DIM} latent + 64 RoPE); NoPE-only MLA is not served"
    too_many = None if heads is None else rank_heads_refusal(heads, dcp, tp)
    if too_many is not None:
        return too_many
    if hisparse:
        return "HiSparse (attention_config.hisparse_config) is not served by the sparse core"
    if capability.major == HOPPER and kv_cache_dtype == "nvfp4_ds_mla":
        return NVFP4_WRITER_NEEDS_SM100
    if capability.major == BLACKWELL and kv_cache_dtype == "nvfp4_ds_mla":
        from vllm_kimi_dsa.backends.flashinfer.features import PRIMS_TS_INSTALL, flashinfer_features

        if not flashinfer_features().prims_ts:
            return f"nvfp4_ds_mla on Blackwell needs FlashInfer's prims_ts (>= 0.7.4): {PRIMS_TS_INSTALL}"
    return None


def vllm_path_takes(capability: DeviceCapability, kv_cache_dtype: str | None) -> bool:
    """Whether vLLM's own FlashInferMLASparseImpl code runs a layer the core refuses: on Blackwell only, and never
    nvfp4_ds_mla, which no FlashInfer-backend kernel but the core's reads. Elsewhere a refusal is an error."""
    return capability.major == BLACKWELL and kv_cache_dtype != "nvfp4_ds_mla"


def _query_heads(vllm_config: Any) -> int | None:
    """Heads per row of the decode query: heads per TP rank, times the DCP size (vLLM gathers heads under DCP)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return None
    parallel = vllm_config.parallel_config
    return int(model_config.get_num_attention_heads(parallel)) * int(parallel.decode_context_parallel_size)


def _parallel_sizes(vllm_config: Any) -> dict[str, int]:
    """{"dcp": DCP size, "tp": tensor-parallel size} of the config (what a heads refusal names), {} without one."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is None:
        return {}
    return {"dcp": int(parallel.decode_context_parallel_size), "tp": int(parallel.tensor_parallel_size)}


def _uses_hisparse(vllm_config: Any) -> bool:
    # read directly (VllmConfig always has an attention_config): a default here would accept HiSparse after a rename
    return vllm_config.attention_config.hisparse_config is not None


STARTUP_PREFIX = "vllm_kimi_dsa"


def _kernel_family(step: LayerStep) -> str:
    """What runs a step's decodes: on Hopper the Triton/Gluon kernel family of each plan, on Blackwell the kernel
    table (which kernel for which rows, and where the table came from)."""
    from vllm_kimi_dsa.envs import KERNEL_TABLE, kernel_table_path

    if set(step.kernels.values()) != {"triton"}:
        runs: list[list] = []  # [first rows, last rows, kernel]: the table as a spec string, "1-32:trtllm,..."
        for rows, name in sorted(step.kernels.items()):
            if runs and runs[-1][2] == name and runs[-1][1] == rows - 1:
                runs[-1][1] = rows
            else:
                runs.append([rows, rows, name])
        spec = ",".join(f"{lo}-{hi}:{name}" if hi > lo else f"{lo}:{name}" for lo, hi, name in runs)
        path = kernel_table_path()
        source = f"{path} (${KERNEL_TABLE})" if path else "the built-in table (unmeasured priors)"
        return f"{spec} from {source}"
    families: set[str] = set()
    kernels = {id(k): k for k in (step.core.decode_kernel(rows) for rows in step.kernels)}
    for kernel in kernels.values():
        for first, tail in getattr(kernel, "plan_params", {}).values():
            families.update((_params_name(first), _params_name(tail)))
    return " + ".join(sorted(families)) + " (this package's Triton kernels)"


def _params_name(params: Any) -> str:
    if params is None:
        return "plain Triton"
    kind = type(params).__name__
    if kind == "SeesawParams":
        form = " e4m3 P.V" if getattr(params, "pv_fp8", False) else ""
        return "Gluon seesaw" + (" nvfp4" if getattr(params, "nvfp4", False) else form)
    if kind == "FewHeadsParams":
        return "Gluon few-heads" + (" nvfp4" if getattr(params, "nvfp4", False) else "")
    if kind == "GluonParams":
        return "Gluon gluon_decode"
    return kind


def worker_ranks(tp_size: int, dcp_size: int, dcp_rank: int) -> str:
    """"TP rank r of T, DCP rank d of D" for the worker this runs in (DCP part only under DCP); the TP rank from
    vLLM's TP group, "?" where that group is not initialized (an impl made outside a vLLM worker)."""
    from vllm.distributed import parallel_state

    try:
        tp_rank: int | str = int(parallel_state.get_tensor_model_parallel_rank())
    except (AssertionError, AttributeError, RuntimeError):
        tp_rank = "?"
    ranks = f"TP rank {tp_rank} of {tp_size}"
    return ranks + (f", DCP rank {dcp_rank} of {dcp_size}" if dcp_size > 1 else "")


def startup_line(step: LayerStep, device: torch.device, ranks: str = "") -> str:
    """The INFO line every worker logs once when the backend serves its DSA layers (README: "Use it in vLLM").

    ranks: the worker's ranks (`worker_ranks`), shown after the GPU; "" leaves them out.
    """
    from vllm_kimi_dsa import __version__

    shape = step.shape
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        gpu = f"{torch.cuda.get_device_name(device)} (SM{major}{minor})"
    else:
        gpu = str(device)
    if ranks:
        gpu = f"{gpu}, {ranks}"
    dcp = f" ({shape.heads // shape.dcp} a rank x DCP {shape.dcp})" if shape.dcp > 1 else ""
    return (
        f"{STARTUP_PREFIX} {__version__} serves FLASHINFER_MLA_SPARSE on {gpu}: {_kernel_family(step)}; "
        f"kv-cache {shape.fmt}; {shape.heads} query heads{dcp}; planned rows 1-{shape.max_rows} "
        f"(larger batches in pieces), top-k width {shape.width}"
    )


class KimiDSAFlashInferMLASparseMetadataBuilder(FlashInferMLASparseTRTLLMMetadataBuilder):
    """vLLM's FLASHINFER_MLA_SPARSE metadata builder, less trtllm-gen's DCP workspace where vLLM's code never runs it.

    vLLM's builder sizes FlashInfer's module-wide workspace under DCP at construction, for trtllm-gen's softmax-stats
    slab at max_num_batched_tokens rows: 394 MiB + 2048 x heads x max_num_batched_tokens bytes (about 2.5 GB at 128
    heads and 8,192 batched tokens). Only vLLM's own impl code (`_forward_mqa_kernel` of a layer the core does not
    serve: a BF16 cache on Blackwell) reads that buffer. A layer the core serves reads none of it: on Hopper no
    trtllm-gen kernel runs; on Blackwell the core's trtllm-gen kernel (where its table names it) sizes its own
    workspace for the rows one launch takes (backends/flashinfer/trtllm.py), and prims_ts plans its own. So the
    buffer is taken only for layers vLLM's code runs. Everything else (metadata, reorder threshold, CUDA-graph
    support) is vLLM's.
    """

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        # vLLM's FlashInferMLASparseTRTLLMMetadataBuilder.__init__ without its unconditional allocation
        FlashInferMLASparseMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)
        self.supports_draft_decode_metadata_update = (
            self.dcp_world_size == 1
            and self.pcp_world_size == 1
            and vllm_config.attention_config.hisparse_config is None
        )
        self.vllm_trtllm_layers = [name for name in layer_names if _vllm_code_runs(vllm_config, name)]
        if self.dcp_world_size > 1 and self.vllm_trtllm_layers:
            heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
            vllm_flashinfer_sparse._get_workspace_buffer(
                device,
                vllm_flashinfer_sparse._required_workspace_bytes(
                    self.dcp_world_size, heads, vllm_config.scheduler_config.max_num_batched_tokens
                ),
            )


def _vllm_code_runs(vllm_config: Any, layer_name: str) -> bool:
    """Whether vLLM's own FlashInferMLASparseImpl code (trtllm-gen on vLLM's workspace) runs layer `layer_name`:
    a layer the core does not serve, or one this module did not build."""
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    impl = getattr(layer, "impl", None)
    return not isinstance(impl, KimiDSAFlashInferMLASparseImpl) or not impl.served_by_core


class KimiDSAFlashInferMLASparseBackend(FlashInferMLASparseTRTLLMBackend):
    """FLASHINFER_MLA_SPARSE on SM90 and SM100/103, with the sparse decode through FlashInferCore.

    Same name, block sizes and CUDA-graph support as vLLM's class (it only adds): SM90, and the nvfp4_ds_mla cache.
    Its metadata builder is vLLM's, less trtllm-gen's DCP workspace where vLLM's code never runs trtllm-gen.
    """

    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        *FlashInferMLASparseTRTLLMBackend.supported_kv_cache_dtypes,
        "nvfp4_ds_mla",
    ]

    @staticmethod
    def get_impl_cls() -> type[MLAAttentionImpl]:
        return KimiDSAFlashInferMLASparseImpl

    @staticmethod
    def get_builder_cls() -> type[KimiDSAFlashInferMLASparseMetadataBuilder]:
        return KimiDSAFlashInferMLASparseMetadataBuilder

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability.major in (HOPPER, BLACKWELL)

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: CacheDType | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: DeviceCapability,
    ) -> str | None:
        reason = super().supports_combination(
            head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse, use_mm_prefix,
            device_capability,
        )
        if reason is not None:
            return reason
        vllm_config = get_current_vllm_config()
        why = core_rejects(
            capability=device_capability,
            kv_cache_dtype=kv_cache_dtype,
            head_size=head_size,
            heads=_query_heads(vllm_config),
            hisparse=_uses_hisparse(vllm_config),
            **_parallel_sizes(vllm_config),
        )
        if why is not None and not vllm_path_takes(device_capability, kv_cache_dtype):
            return f"{cls.get_name()} (vllm_kimi_dsa) on SM{device_capability.to_int()}: {why}"
        return None


class KimiDSAFlashInferMLASparseImpl(FlashInferMLASparseImpl):
    """vLLM's FlashInferMLASparseImpl whose `_forward_mqa_kernel` runs the layer's LayerStep (FlashInferCore.decode).

    vLLM converts the indexer's top-k to flat rows and valid counts before `_forward_mqa_kernel`
    (SparseMLACommonImpl.forward_mqa, DCP included), so the step decodes them as they are and converts nothing.
    The step is built once the weights (and the layer's FP8 scales) are loaded, before any CUDA graph capture.
    Its LSE is natural log, so `lse_base_on_e` is True for the layers it serves (vLLM's DCP combine reads it).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._vllm_config = get_current_vllm_config()
        self._step: LayerStep | None = None
        self._step_scales: tuple[float, float] | None = None
        capability = vllm.platforms.current_platform.get_device_capability()
        if capability is None:
            raise ValueError("FLASHINFER_MLA_SPARSE (vllm_kimi_dsa) needs a CUDA device with a compute capability")
        why = core_rejects(
            capability=capability,
            kv_cache_dtype=self.kv_cache_dtype,
            head_size=self.kv_lora_rank + self.qk_rope_head_dim,
            heads=self.num_heads * self.dcp_world_size,
            hisparse=isinstance(self.index_group, HiSparseMLAIndexGroup),
            **_parallel_sizes(self._vllm_config),
        )
        if why is not None and not vllm_path_takes(capability, self.kv_cache_dtype):
            raise ValueError(f"FLASHINFER_MLA_SPARSE (vllm_kimi_dsa) on SM{capability.to_int()}: {why}")
        self.served_by_core = why is None
        if self.served_by_core:
            self.lse_base_on_e = True

    # ------------------------------------------------------------------ building the step

    def step_shape(self, device: torch.device, width: int | None = None) -> StepShape:
        """The StepShape of this layer under the current vLLM config (every layer of a model gets the same one)."""
        config = self._vllm_config
        if width is None:
            buffer = self.topk_indices_buffer
            width = int(buffer.shape[1]) if buffer is not None else int(config.model_config.hf_text_config.index_topk)
        max_rows, capacities, width = planned_layout(config, width)
        return StepShape(
            device=device,
            heads=self.num_heads * self.dcp_world_size,
            width=width,
            fmt=self.kv_cache_dtype,
            max_rows=max_rows,
            return_lse=self.need_to_return_lse_for_decode,
            dcp=self.dcp_world_size,
            rank=self.dcp_rank,
            capacities=capacities,
        )

    def build_step(self, layer: AttentionLayer, device: torch.device, width: int | None = None) -> LayerStep:
        """Plan and allocate this layer's step (shared buffers, the kernels of every batch size). Not in capture."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "vllm_kimi_dsa: a DSA layer's sparse decode was first called inside CUDA graph capture; it plans "
                "and allocates once, after the weights are loaded (process_weights_after_loading), never in capture"
            )
        self._step = LayerStep(self, layer, self.step_shape(device, width))
        self._step_scales = (float(layer._q_scale_float), float(layer._k_scale_float))
        # Once a process (every layer gives the same line), in every worker: vLLM's default scope ("local") would
        # keep only local rank 0's. The worker's logging is configured by now.
        ranks = worker_ranks(_parallel_sizes(self._vllm_config).get("tp", 1), self.dcp_world_size, self.dcp_rank)
        logger.info_once(startup_line(self._step, device, ranks), scope="process")
        return self._step

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)
        if not self.served_by_core:
            return
        # vLLM's loader finishes every quant method (the layer's FP8 q/k scales) before this hook: build here.
        context = self._vllm_config.compilation_config.static_forward_context
        for layer in context.values():
            if getattr(layer, "impl", None) is self:
                weight = getattr(getattr(layer, "kv_b_proj", None), "weight", None)
                device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cuda")
                self.build_step(layer, device)
                return

    # ------------------------------------------------------------------ the hot path

    def _forward_mqa_kernel(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        topk_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        layer: AttentionLayer,
        block_size: int,
        is_decode: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.served_by_core:
            return super()._forward_mqa_kernel(
                q, kv_cache, topk_indices, seq_lens, layer=layer, block_size=block_size, is_decode=is_decode
            )
        if isinstance(q, tuple):  # a BF16 query: the core's check names it (the FP8 caches quantize the query)
            q = torch.cat(q, dim=-1)
        step = self._step
        if step is None or self._step_scales != (layer._q_scale_float, layer._k_scale_float):
            # Not built by process_weights_after_loading (an impl made outside vLLM's loader), or the scales moved
            # (calculate_kv_scales): plan now, outside capture.
            step = self.build_step(layer, q.device, int(topk_indices.shape[1]))
        return step(q, kv_cache, topk_indices, seq_lens, block_size)


__all__ = [
    "CORE_CACHE_DTYPES",
    "KimiDSAFlashInferMLASparseBackend",
    "KimiDSAFlashInferMLASparseImpl",
    "KimiDSAFlashInferMLASparseMetadataBuilder",
    "NVFP4_WRITER_NEEDS_SM100",
    "STARTUP_PREFIX",
    "core_rejects",
    "startup_line",
    "vllm_path_takes",
    "worker_ranks",
]
