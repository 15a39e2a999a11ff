"""FlashInferCore: one DSA layer's sparse-attention core (convert top-k, then decode).

Everything is checked, planned and allocated at construction; `decode`/`run`
only validate host metadata (shapes, dtypes) and launch, so they replay in a CUDA graph.
The class keeps the seed's name, FlashInferCore, so code written for the seed drops it in unchanged: it serves vLLM's
FLASHINFER_MLA_SPARSE backend, though on Hopper it runs this package's Gluon / Triton kernels, not FlashInfer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from vllm_kimi_dsa.arguments import required_field
from vllm_kimi_dsa.backends.registry import build_kernel
from vllm_kimi_dsa.convert import convert_topk
from vllm_kimi_dsa.formats import (
    HEAD_DIM,
    LATENT_DIM,
    CacheFormat,
    cache_dtype,
    flat_kv_row_view,
    normalize_format,
    row_bytes,
)
from vllm_kimi_dsa.heads import check_heads, heads_refusal
from vllm_kimi_dsa.kernels.base import DecodeKernel, DecodeSetup, check_query
from vllm_kimi_dsa.selection import KERNELS, plan_rows_for
from vllm_kimi_dsa.widths import check_width

@dataclass(frozen=True)
class Buffers:
    """The model's buffers, shared by every layer; sized for the largest batch R.

    slots: (R, K) int32; counts: (R,) int32; latent: (R*H*512,) bf16;
    lse: (R*H,) float32 or None.
    """

    slots: torch.Tensor
    counts: torch.Tensor
    latent: torch.Tensor
    lse: torch.Tensor | None


def _require(t: Any, name: str, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the core's buffers are on {device}")
    return t


class FlashInferCore:
    """The sparse MLA core of one DSA layer on the FLASHINFER_MLA_SPARSE backend.

    impl: vLLM's FlashInferMLASparseImpl or a stand-in with `scale`,
        `kv_lora_rank` (512), `qk_rope_head_dim` (64), `kv_cache_dtype`,
        and for trtllm-gen `_workspace_buffer`.
    layer: has `_q_scale_float` and `_k_scale_float`.
    heads: query heads H of this rank after DCP's gather, 1..128 (heads.MAX_HEADS).
    buffers: (slots (R, K) int32, counts (R,) int32, latent (R*H*512,) bf16,
        lse (R*H,) float32 or None); R is the largest batch, K the top-k width.
    kernels: {rows: kernel name} for every batch size the model runs.
    dcp, rank: decode context parallel size and this rank.
    capacities: prims_ts plan row capacities (sorted); None plans each batch size.
    widths: every top-k width `decode` may see (default (K,)).
    kv_cache_dtype: overrides impl.kv_cache_dtype ("fp8", "fp8_e4m3", "nvfp4_ds_mla").
    validate: check slot ids against the cache on every call (host sync; debug only).
    """

    def __init__(
        self,
        impl: Any,
        layer: Any,
        heads: int,
        buffers: Sequence[torch.Tensor | None],
        kernels: Mapping[int, str],
        dcp: int = 1,
        rank: int = 0,
        capacities: Sequence[int] | None = None,
        widths: Sequence[int] = (),
        *,
        kv_cache_dtype: str | None = None,
        validate: bool = False,
    ) -> None:
        self.fmt: CacheFormat = normalize_format(
            kv_cache_dtype if kv_cache_dtype is not None else getattr(impl, "kv_cache_dtype", "fp8")
        )
        self.heads = check_heads(heads, "heads")
        if getattr(impl, "kv_lora_rank", LATENT_DIM) != LATENT_DIM:
            raise ValueError(f"impl.kv_lora_rank must be {LATENT_DIM}, got {impl.kv_lora_rank}")
        if getattr(impl, "qk_rope_head_dim", HEAD_DIM - LATENT_DIM) != HEAD_DIM - LATENT_DIM:
            raise ValueError(f"impl.qk_rope_head_dim must be {HEAD_DIM - LATENT_DIM}, got {impl.qk_rope_head_dim}")
        if dcp < 1 or not 0 <= rank < dcp:
            raise ValueError(f"rank={rank} must be in [0, dcp={dcp})")
        self.dcp, self.rank = int(dcp), int(rank)
        self.validate = validate

        self.buffers = self._check_buffers(buffers)
        self.device = self.buffers.slots.device
        self.max_rows, self.width = self.buffers.slots.shape
        self.widths = tuple(sorted(set(widths) or {self.width}))
        for w in self.widths:
            check_width(w, "widths")

        self.capacities = tuple(capacities) if capacities else ()
        if self.capacities and max(self.capacities) > self.max_rows:
            raise ValueError(
                f"capacities {self.capacities} exceed the buffers' {self.max_rows} rows"
            )
        self.kernels = self._check_kernels(kernels)

        q_scale = float(layer._q_scale_float)
        k_scale = float(layer._k_scale_float)
        scale = float(impl.scale)
        # SPEC 2.1: a per-tensor fp8 cache folds k_scale into both scales; nvfp4 rows carry their own.
        if self.fmt == "fp8":
            softmax_scale, output_scale = scale * q_scale * k_scale, k_scale
        else:
            softmax_scale, output_scale = scale * q_scale, 1.0
        self.softmax_scale, self.output_scale = softmax_scale, output_scale

        self._kernel_by_rows: dict[int, DecodeKernel] = {}
        for name in sorted(set(self.kernels.values())):
            rows_of = tuple(sorted(r for r, k in self.kernels.items() if k == name))
            setup = DecodeSetup(
                device=self.device,
                fmt=self.fmt,
                heads=self.heads,
                row_counts=rows_of,
                capacities=self.capacities,
                widths=self.widths,
                return_lse=self.buffers.lse is not None,
                softmax_scale=softmax_scale,
                output_scale=output_scale,
                impl=impl,
            )
            kernel = build_kernel(name, setup)
            for r in rows_of:
                self._kernel_by_rows[r] = kernel

        # Views of the model's buffers per batch size, made once.
        h = self.heads
        self._out_views = {
            r: self.buffers.latent[: r * h * LATENT_DIM].view(r, h, LATENT_DIM) for r in self.kernels
        }
        self._lse_views = {
            r: (None if self.buffers.lse is None else self.buffers.lse[: r * h].view(r, h)) for r in self.kernels
        }

    # ------------------------------------------------------------------ checks

    def _check_buffers(self, buffers: Sequence[torch.Tensor | None]) -> Buffers:
        if len(buffers) != 4:
            raise ValueError(f"buffers must be (slots, counts, latent, lse), got {len(buffers)} items")
        slots, counts, latent, lse = buffers
        slots = _require(slots, "buffers[0] (slots)", torch.int32)
        device = slots.device
        if slots.dim() != 2 or not slots.is_contiguous():
            raise ValueError(f"slots must be a contiguous (R, K) tensor, got {tuple(slots.shape)}")
        rows, width = slots.shape
        check_width(width, "slots width K")
        counts = _require(counts, "buffers[1] (counts)", torch.int32, device)
        if counts.shape != (rows,):
            raise ValueError(f"counts must be ({rows},), got {tuple(counts.shape)}")
        latent = _require(latent, "buffers[2] (latent)", torch.bfloat16, device)
        if latent.dim() != 1 or latent.numel() < rows * self.heads * LATENT_DIM or not latent.is_contiguous():
            raise ValueError(
                f"latent must be a contiguous 1-d tensor of >= {rows}*{self.heads}*{LATENT_DIM} bf16, "
                f"got {tuple(latent.shape)}"
            )
        if lse is not None:
            lse = _require(lse, "buffers[3] (lse)", torch.float32, device)
            if lse.dim() != 1 or lse.numel() < rows * self.heads or not lse.is_contiguous():
                raise ValueError(f"lse must be a contiguous 1-d tensor of >= {rows}*{self.heads} float32")
        return Buffers(slots, counts, latent, lse)

    def _check_kernels(self, kernels: Mapping[int, str]) -> dict[int, str]:
        if not kernels:
            raise ValueError("kernels must map at least one batch size to a kernel")
        table: dict[int, str] = {}
        for rows, name in kernels.items():
            if not isinstance(rows, int) or not 1 <= rows <= self.max_rows:
                raise ValueError(f"kernels: batch size {rows!r} must be an int in [1, {self.max_rows}]")
            if name not in KERNELS:
                raise ValueError(f"kernels[{rows}]={name!r} is not a kernel this core runs; expected one of {KERNELS}")
            refusal = heads_refusal(name, self.heads)
            if refusal:
                raise ValueError(f"kernels[{rows}]={name!r} cannot take heads={self.heads}: {refusal}")
            if name == "trtllm" and self.fmt != "fp8":
                raise ValueError(f"kernels[{rows}]='trtllm' reads only the fp8 cache, not {self.fmt}")
            if name == "prims_ts":
                plan_rows_for(rows, self.capacities or None)  # raises when no capacity holds rows
            table[rows] = name
        return table

    # ------------------------------------------------------------------ surface

    def rows(self, cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
        """cache (num_blocks, block_size, row_bytes) -> (flat rows (num_rows, row_bytes), rows_per_block_stride)."""
        if not isinstance(cache, torch.Tensor):
            raise TypeError(f"cache must be a torch.Tensor, got {type(cache).__name__}")
        want = cache_dtype(self.fmt)
        if cache.dtype != want and not (self.fmt == "nvfp4_ds_mla" and cache.element_size() == 1):
            raise TypeError(f"cache must be {want} for {self.fmt}, got {cache.dtype}")
        if cache.dim() != 3 or cache.shape[-1] != row_bytes(self.fmt):
            raise ValueError(
                f"cache must be (num_blocks, block_size, {row_bytes(self.fmt)}) for {self.fmt}, got {tuple(cache.shape)}"
            )
        if cache.device != self.device:
            raise ValueError(f"cache is on {cache.device}, the core is on {self.device}")
        if cache.dtype != want:
            cache = cache.view(want)
        return flat_kv_row_view(cache, block_size)

    def convert(
        self,
        topk: torch.Tensor,
        metadata: Any,
        rows: int,
        stride_rows: int,
        interleave: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """topk (>= rows, K) int32 ids -> this rank's (slots (rows, K), counts (rows,)) in the model's buffers.

        metadata: has req_id_per_token, block_table and block_size (vLLM's sparse metadata); a missing one raises
            TypeError naming it.
        """
        if rows not in self.kernels:
            raise ValueError(f"rows={rows} has no kernel in this core's table {sorted(self.kernels)}")
        if isinstance(topk, torch.Tensor) and topk.dim() == 2 and topk.shape[1] != self.width:
            raise ValueError(f"topk width {topk.shape[1]} != the slots buffer's width {self.width}")
        return convert_topk(
            topk,
            required_field(metadata, "req_id_per_token", "metadata"),
            required_field(metadata, "block_table", "metadata"),
            block_size=int(required_field(metadata, "block_size", "metadata")),
            rows_per_block_stride=int(stride_rows),
            dcp_size=self.dcp,
            dcp_rank=self.rank,
            interleave=int(interleave),
            slots=self.buffers.slots,
            counts=self.buffers.counts,
            rows=rows,
        )

    def decode(
        self,
        query: torch.Tensor,
        cache: torch.Tensor,
        slots: torch.Tensor,
        counts: torch.Tensor,
        block_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sparse MLA decode into the model's buffers.

        query: (rows, H, 576) float8_e4m3fn (per-tensor q_scale of the layer).
        cache: (num_blocks, block_size, row_bytes) paged cache of this core's format.
        slots: (rows, K) int32 flat rows (compacted prefix, -1 tail), K in widths.
        counts: (rows,) int32.
        Returns latent (rows, H, 512) bf16 and lse (rows, H) float32 natural log
        (None without an lse buffer): views of the model's buffers.
        """
        return self._decode(check_query(query, self.heads, self.device), query, cache, slots, counts, block_size)

    def _decode(
        self, rows: int, query: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
        block_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """decode for a query check_query has passed (`rows` its rows): the other arguments checked, the kernel run."""
        kernel = self._kernel_by_rows.get(rows)
        if kernel is None:
            raise ValueError(f"query has {rows} rows; the kernel table has only {sorted(self.kernels)}")
        _require(slots, "slots", torch.int32, self.device)
        if slots.dim() != 2 or slots.shape[0] != rows:
            raise ValueError(f"slots must be ({rows}, K), got {tuple(slots.shape)}")
        if slots.shape[1] not in self.widths:
            raise ValueError(f"slots width {slots.shape[1]} was never planned; widths {self.widths}")
        if slots.stride(1) != 1:
            raise ValueError("slots must have a contiguous last dimension")
        _require(counts, "counts", torch.int32, self.device)
        if counts.shape != (rows,):
            raise ValueError(f"counts must be ({rows},), got {tuple(counts.shape)}")
        kv_rows, stride_rows = self.rows(cache, block_size)
        if self.validate:
            self._validate_slots(slots, counts, kv_rows.shape[0])
        out, lse = self._out_views[rows], self._lse_views[rows]
        kernel(query, kv_rows, slots, counts, out, lse, block_size=block_size, rows_per_block_stride=stride_rows)
        return out, lse

    def run(
        self, query: torch.Tensor, cache: torch.Tensor, topk: torch.Tensor, metadata: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """convert then decode: topk (>= rows, K) ids -> latent (rows, H, 512), lse (rows, H).

        metadata: vLLM's SparseMLACommonMetadata or any object with its req_id_per_token, block_table, block_size and
        cp_kv_cache_interleave_size (1 without DCP); a missing one raises TypeError naming it (no default: a DCP
        interleave read as 1 would pick another rank's tokens).
        """
        # Checked before convert writes the model's slots/counts: a rejected call leaves them as they were.
        rows = check_query(query, self.heads, self.device)
        block_size = int(required_field(metadata, "block_size", "metadata"))
        _, stride_rows = self.rows(cache, block_size)
        interleave = int(required_field(metadata, "cp_kv_cache_interleave_size", "metadata"))
        slots, counts = self.convert(topk, metadata, rows, stride_rows, interleave)
        return self._decode(rows, query, cache, slots, counts, block_size)

    @property
    def counts(self) -> torch.Tensor:
        """The counts buffer (R,) int32; rows [:rows] hold the last convert's counts (DCP merge input)."""
        return self.buffers.counts

    def decode_kernel(self, rows: int) -> DecodeKernel:
        """The DecodeKernel object that runs a batch of `rows` (its plans, config and workspace)."""
        if rows not in self._kernel_by_rows:
            raise ValueError(f"rows={rows} has no kernel in this core's table {sorted(self.kernels)}")
        return self._kernel_by_rows[rows]

    # ------------------------------------------------------------------ debug

    @staticmethod
    def _validate_slots(slots: torch.Tensor, counts: torch.Tensor, num_rows: int) -> None:
        width = slots.shape[1]
        if bool(((counts < 0) | (counts > width)).any()):
            raise ValueError(f"counts must be in [0, {width}]")
        position = torch.arange(width, device=slots.device)
        live = position < counts.unsqueeze(1)
        ids = slots[live]
        if ids.numel() and bool(((ids < -1) | (ids >= num_rows)).any()):
            raise ValueError(f"slots index past the cache: valid flat rows are [0, {num_rows})")
