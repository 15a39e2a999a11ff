"""vLLM glue: the plugin hook, FLASHINFER_MLA_SPARSE detection, and one FlashInferCore per layer for a model that
hands the indexer's top-k ids itself (KimiDSACores). Imports vLLM only inside functions: it loads without vLLM.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Sequence

import torch

from vllm_kimi_dsa import envs
from vllm_kimi_dsa.arguments import required_field
from vllm_kimi_dsa.dcp import LOG2_E
from vllm_kimi_dsa.formats import normalize_format
from vllm_kimi_dsa.logs import init_logger
from vllm_kimi_dsa.widths import check_width
from vllm_kimi_dsa.serving import SharedBuffers, StepShape, build_layers, kernel_table, planned_layout

logger = init_logger(__name__)

KERNEL_TABLE_ENV = envs.KERNEL_TABLE
BACKEND_CLASS = "vllm_kimi_dsa.vllm_backend.KimiDSAFlashInferMLASparseBackend"

_registered = False


# ---------------------------------------------------------------------- detection


def _flashinfer_sparse_impl_cls() -> type | None:
    """vLLM's FlashInferMLASparseImpl, or None when vLLM (or that backend) cannot be imported."""
    try:
        from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseImpl

        return FlashInferMLASparseImpl
    except Exception:  # vLLM missing, or broken on this machine: not our path, never an error
        return None


def _impl_and_layer(attention: Any) -> tuple[Any, Any] | None:
    """(impl, MLAAttention layer) of a DSA attention module, following both chains of SPEC 8.

    Generic path: attention.mla_attn (MultiHeadLatentAttentionWrapper).mla_attn (MLAAttention).impl;
    CUDA V3.2 path: attention is the MLAAttention itself (attention.impl).
    """
    wrapper = getattr(attention, "mla_attn", None)
    inner = getattr(wrapper, "mla_attn", None) if wrapper is not None else None
    impl = getattr(inner, "impl", None) if inner is not None else None
    if impl is not None:
        return impl, inner
    impl = getattr(attention, "impl", None)
    if impl is not None:
        return impl, attention
    return None


def dsa_on_flashinfer(attention: Any) -> bool:
    """True when `attention` runs on vLLM's FLASHINFER_MLA_SPARSE impl (SPEC 5, 8).

    attention: a DSA attention module (`.mla_attn.mla_attn.impl`) or an MLAAttention (`.impl`).
    False, never an exception, when vLLM is missing or the chain is absent.
    """
    found = _impl_and_layer(attention)
    if found is None:
        return False
    cls = _flashinfer_sparse_impl_cls()
    return cls is not None and isinstance(found[0], cls)


def dsa_layers(model: Any) -> list[Any]:
    """The attention modules of `model` (an nn.Module) whose impl is FlashInferMLASparseImpl, in order.

    A wrapper and the MLAAttention inside it share one impl; each impl is listed once (the outer module).
    """
    seen: set[int] = set()
    found: list[Any] = []
    for module in model.modules():
        if not dsa_on_flashinfer(module):
            continue
        impl = _impl_and_layer(module)[0]  # type: ignore[index]
        if id(impl) not in seen:
            seen.add(id(impl))
            found.append(module)
    return found


# ---------------------------------------------------------------------- the model's cores


class KimiDSACores:
    """One FlashInferCore per Kimi K3.1 DSA layer, all on one set of shared buffers.

    layers: per DSA layer, a vLLM attention module (see `dsa_on_flashinfer`) or an
        `(impl, layer)` pair (impl: FlashInferMLASparseImpl or a stand-in; layer: has
        `_q_scale_float`, `_k_scale_float`). Build after the weights are loaded: the
        FP8 scales are read here and folded into the plans.
    heads: query heads H per row as the decode query carries them (padded mailbox).
    batch_sizes: every decode batch size (rows) the model runs (cudagraph capture
        sizes and every eager size); R = max(batch_sizes) sizes the buffers.
    width: top-k width K (K3.1: 2048; the indexer's topk_indices_buffer width).
    kv_cache_dtype: "fp8"/"fp8_e4m3"/"nvfp4_ds_mla"; default the impls' kv_cache_dtype.
    dcp, rank: default the impl's dcp_world_size / dcp_rank (1 / 0 when absent).
    kernels: {rows: name} to force, else `table` / env / selection picks (see kernel_table).
    capacities: prims_ts plan capacities (sorted); None plans each batch size.
    return_lse: default dcp > 1 (vLLM's DCP combine needs the LSE).
    lse_base2: hand back base-2 LSE (converted in place in the shared buffer);
        default `not impl.lse_base_on_e` (vLLM's FlashInferMLASparseImpl: base 2).
    """

    def __init__(
        self,
        layers: Sequence[Any],
        *,
        heads: int,
        batch_sizes: Iterable[int],
        width: int = 2048,
        kv_cache_dtype: str | None = None,
        dcp: int | None = None,
        rank: int | None = None,
        device: torch.device | str | None = None,
        kernels: Mapping[int, str] | None = None,
        table: str | os.PathLike[str] | None = None,
        capacities: Sequence[int] | None = None,
        return_lse: bool | None = None,
        lse_base2: bool | None = None,
        validate: bool = False,
    ) -> None:
        if not layers:
            raise ValueError("layers must hold at least one DSA layer")
        pairs = []
        for i, item in enumerate(layers):
            pair = item if isinstance(item, tuple) and len(item) == 2 else _impl_and_layer(item)
            if pair is None:
                raise TypeError(f"layers[{i}] ({type(item).__name__}) has no .mla_attn.mla_attn.impl or .impl")
            pairs.append(pair)
        impl0 = pairs[0][0]
        fmt_name = kv_cache_dtype if kv_cache_dtype is not None else getattr(impl0, "kv_cache_dtype", "fp8")
        self.fmt = normalize_format(fmt_name)
        for i, (impl, _) in enumerate(pairs):
            if kv_cache_dtype is None and normalize_format(getattr(impl, "kv_cache_dtype", "fp8")) != self.fmt:
                raise ValueError(f"layers[{i}]: kv_cache_dtype {impl.kv_cache_dtype!r} differs from layer 0's {fmt_name!r}")
        self.dcp = int(dcp if dcp is not None else getattr(impl0, "dcp_world_size", 1) or 1)
        self.rank = int(rank if rank is not None else getattr(impl0, "dcp_rank", 0) or 0)
        self.heads = int(heads)
        self.width = check_width(width, "width")
        self.batch_sizes = tuple(sorted({int(r) for r in batch_sizes}))
        if not self.batch_sizes or self.batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes must be positive ints, got {self.batch_sizes}")
        self.max_rows = self.batch_sizes[-1]
        if device is None:
            ws = getattr(impl0, "_workspace_buffer", None)
            device = ws.device if isinstance(ws, torch.Tensor) else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        self.return_lse = self.dcp > 1 if return_lse is None else bool(return_lse)
        self.lse_base2 = (not getattr(impl0, "lse_base_on_e", True)) if lse_base2 is None else bool(lse_base2)
        if lse_base2 is None:
            for i, (impl, _) in enumerate(pairs):
                if getattr(impl, "lse_base_on_e", True) != getattr(impl0, "lse_base_on_e", True):
                    raise ValueError(f"layers[{i}]: lse_base_on_e differs from layer 0's (one LSE base for all layers)")

        shape = StepShape(device=self.device, heads=self.heads, width=self.width, fmt=self.fmt,
                          max_rows=self.max_rows, return_lse=self.return_lse, dcp=self.dcp, rank=self.rank,
                          capacities=tuple(capacities) if capacities else ())
        # this model's own buffers (not serving's process-wide set): KimiDSACores of two models never share them
        built = build_layers(pairs, shape, kernels=kernels if kernels is not None else table,
                             batch_sizes=self.batch_sizes, validate=validate,
                             buffers=SharedBuffers.make(self.max_rows, self.heads, self.width, self.return_lse,
                                                        self.device))
        self.kernels, self.buffers, self.cores = built.kernels, built.buffers, built.cores

    @classmethod
    def from_vllm(cls, layers: Sequence[Any], vllm_config: Any, **overrides: Any) -> "KimiDSACores":
        """Cores for a vLLM model: every decode batch 1..R, R and the capacities from `serving.planned_rows`.

        layers: the DSA attention modules (e.g. `dsa_layers(model)`); vllm_config: vLLM's VllmConfig.
        R = max(max_num_seqs * (1 + speculative tokens), largest capture size), at most max_num_batched_tokens;
        the capture sizes up to R, and R, become the prims_ts plan capacities.
        heads: the MLAAttention's q_pad_num_heads (the heads vLLM pads the decode query to; vLLM 0.33 copies it from
        the impl, None where the impl pads nothing), else impl.num_heads x impl.dcp_world_size. Each field is read
        directly: a missing one raises TypeError naming it.
        overrides: any keyword of KimiDSACores (heads, width, kernels, table, ...).
        """
        if not layers:
            raise ValueError("layers must hold at least one DSA layer")
        pair = layers[0] if isinstance(layers[0], tuple) else _impl_and_layer(layers[0])
        if pair is None:
            raise TypeError(f"layers[0] ({type(layers[0]).__name__}) has no .mla_attn.mla_attn.impl or .impl")
        impl, layer = pair
        padded = required_field(layer, "q_pad_num_heads", "layers[0]'s MLAAttention")
        if padded is None:
            padded = int(required_field(impl, "num_heads", "layers[0]'s impl")) * int(
                required_field(impl, "dcp_world_size", "layers[0]'s impl"))
        hf = required_field(required_field(vllm_config, "model_config", "vllm_config"), "hf_text_config",
                            "vllm_config.model_config")
        topk = required_field(hf, "index_topk", "vllm_config.model_config.hf_text_config")
        max_rows, capacities, width = planned_layout(vllm_config, int(topk))
        kw: dict[str, Any] = dict(
            heads=int(padded),
            batch_sizes=range(1, max_rows + 1),
            width=width,
            kv_cache_dtype=vllm_config.cache_config.cache_dtype if vllm_config.cache_config.cache_dtype != "auto" else None,
            capacities=list(capacities),
        )
        kw.update(overrides)
        return cls(layers, **kw)

    def __len__(self) -> int:
        return len(self.cores)

    def forward(
        self,
        layer_index: int,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        topk: torch.Tensor,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One layer's decode: convert the indexer's top-k and run the sparse MLA kernel.

        query: (rows, H, 576) float8_e4m3fn, the decode tokens (vLLM's mqa_q).
        kv_cache: (num_blocks, block_size, row_bytes), this layer's paged cache.
        topk: (>= rows, K) int32, the indexer's topk_indices_buffer (request-local ids, -1 holes).
        attn_metadata: vLLM's SparseMLACommonMetadata (req_id_per_token, block_table,
            block_size, cp_kv_cache_interleave_size).
        Returns latent (rows, H, 512) bf16 and lse (rows, H) fp32 (base 2 when lse_base2,
        else natural; None without return_lse): views of the shared buffers, valid
        until the next layer's forward.
        """
        if not isinstance(layer_index, int) or not 0 <= layer_index < len(self.cores):
            raise ValueError(f"layer_index={layer_index!r} must be an int in [0, {len(self.cores)})")
        out, lse = self.cores[layer_index].run(query, kv_cache, topk, attn_metadata)
        if lse is not None and self.lse_base2:
            lse.mul_(LOG2_E)  # in place: no allocation, graph-safe; -inf stays -inf
        return out, lse

    __call__ = forward

    def counts(self, rows: int) -> torch.Tensor:
        """(rows,) int32: the last forward's valid-token count per row on this rank."""
        return self.buffers.counts[:rows]


# ---------------------------------------------------------------------- plugin


def register() -> None:
    """vLLM general-plugin entry point (`vllm.general_plugins`: kimi_k3_dsa), run in every vLLM process.

    Adds the package's VLLM_KIMI_DSA_* variables to vLLM's env validation, and, unless VLLM_KIMI_DSA_BACKEND=0,
    overrides FLASHINFER_MLA_SPARSE with this package's backend (vllm_backend.py), so `--attention-backend
    FLASHINFER_MLA_SPARSE` runs every DSA layer's sparse decode through FlashInferCore. With the switch at 0 it
    clears its own override, and vLLM's class comes back. Idempotent. A bad VLLM_KIMI_DSA_* value, or (with the
    backend on) a kernel-table file that does not load, raises ValueError naming it: vLLM stops at startup.
    """
    global _registered
    envs.register_with_vllm()
    enabled = envs.backend_enabled()
    envs.gluon_choice()  # a bad value raises here, at startup, not in the first decode step
    envs.fp8_pv()
    if enabled:
        from vllm_kimi_dsa import selection

        selection.active_kernel_table()  # reads the VLLM_KIMI_DSA_KERNEL_TABLE file once; a bad one raises, naming it
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError:  # called outside vLLM (vLLM itself only calls it where it is installed)
        logger.info("vLLM is not installed: no backend to override")
        _registered = True
        return
    member = AttentionBackendEnum.FLASHINFER_MLA_SPARSE
    if enabled:
        register_backend(member, BACKEND_CLASS)
        if not _registered:
            logger.info("FLASHINFER_MLA_SPARSE runs vllm_kimi_dsa's sparse decode (%s=0 turns it off)", envs.BACKEND)
    elif member.is_overridden() and member.get_path() == BACKEND_CLASS:
        member.clear_override()
        logger.info("%s=0: FLASHINFER_MLA_SPARSE is vLLM's own backend", envs.BACKEND)
    _registered = True


def is_registered() -> bool:
    """Whether register() ran in this process."""
    return _registered


__all__ = [
    "BACKEND_CLASS",
    "KERNEL_TABLE_ENV",
    "KimiDSACores",
    "SharedBuffers",
    "dsa_layers",
    "dsa_on_flashinfer",
    "is_registered",
    "kernel_table",
    "register",
]
