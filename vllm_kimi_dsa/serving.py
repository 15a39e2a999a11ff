"""The per-step body of the vLLM backend, without vLLM: a layer's flat KV rows and valid counts -> latent (and LSE).

One LayerStep per DSA layer, every layer on one set of shared buffers; batches above the planned rows (prefill
chunks, mixed and speculative batches) run in pieces of planned size. The H200 runs this without vLLM installed.
`build_layers` is the one construction of DSA layers (kernel table, trtllm workspace, shared buffers, one core a
layer) that LayerStep (vLLM's backend) and vllm_glue.KimiDSACores (a model's cores) both call; `planned_layout` is
how a vLLM config plans them (rows, capacities, width).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

from vllm_kimi_dsa.arguments import required_field
from vllm_kimi_dsa.core import FlashInferCore
from vllm_kimi_dsa.formats import LATENT_DIM, CacheFormat, normalize_format
from vllm_kimi_dsa.widths import check_width, round_width


def kernel_table(
    batch_sizes: Iterable[int],
    *,
    dcp: int,
    heads: int,
    kv_cache_dtype: str,
    device: torch.device | str,
    table: str | os.PathLike[str] | Mapping[int, str] | None = None,
) -> dict[int, str]:
    """{rows: kernel name} for every batch size, as the core wants it.

    table: a {rows: name} mapping used as is; or a measured table file
        (`selection.load_kernel_table`: {"tp": spec, "dcp": spec}); None: the file named by
        env VLLM_KIMI_DSA_KERNEL_TABLE, else the built-in FI_KERNEL (selection.kernel_for).
        Either way `kernel_for` picks among what `fi_kernels` says this machine runs.
    """
    from vllm_kimi_dsa import selection

    sizes = sorted({int(r) for r in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch_sizes must be positive ints, got {sizes}")
    if isinstance(table, Mapping):
        missing = [r for r in sizes if r not in table]
        if missing:
            raise ValueError(f"kernels: batch sizes {missing} have no kernel in the given table")
        return {r: str(table[r]) for r in sizes}
    measured = selection.load_kernel_table(table) if table is not None else None
    available = selection.fi_kernels(kv_cache_dtype, device=torch.device(device))
    return {r: selection.kernel_for(r, dcp, available, heads, table=measured) for r in sizes}


@dataclass(frozen=True)
class SharedBuffers:
    """The buffers every layer's core writes into, sized for the largest batch R.

    slots (R, K) int32, counts (R,) int32, latent (R*H*512,) bf16, lse (R*H,) fp32 or None.
    """

    slots: torch.Tensor
    counts: torch.Tensor
    latent: torch.Tensor
    lse: torch.Tensor | None

    @classmethod
    def make(cls, rows: int, heads: int, width: int, return_lse: bool, device: torch.device) -> "SharedBuffers":
        # Initial contents are never read (the core writes before anything reads); filled for determinism.
        return cls(
            slots=torch.full((rows, width), -1, dtype=torch.int32, device=device),
            counts=torch.zeros((rows,), dtype=torch.int32, device=device),
            latent=torch.zeros((rows * heads * LATENT_DIM,), dtype=torch.bfloat16, device=device),
            lse=torch.zeros((rows * heads,), dtype=torch.float32, device=device) if return_lse else None,
        )

    def as_tuple(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.slots, self.counts, self.latent, self.lse


@dataclass(frozen=True)
class StepShape:
    """What every layer of a model shares: the layout of one decode step on one rank.

    heads: query heads per row as the kernel sees them (vLLM's num_heads, times dcp under DCP).
    width: top-k width K (the model's top-k buffer width, a multiple of 128).
    max_rows: rows one launch takes (the largest decode batch); larger batches run in pieces of it.
    capacities: prims_ts plan capacities (sorted; empty: one plan per batch size).
    """

    device: torch.device
    heads: int
    width: int
    fmt: CacheFormat
    max_rows: int
    return_lse: bool
    dcp: int = 1
    rank: int = 0
    capacities: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows}")
        check_width(self.width, "width")
        object.__setattr__(self, "fmt", normalize_format(self.fmt))
        object.__setattr__(self, "device", torch.device(self.device))


def planned_rows(vllm_config: Any) -> tuple[int, tuple[int, ...]]:
    """(max_rows, capacities) for a vLLM config: one launch takes every decode batch vLLM may run.

    max_rows: max(max_num_seqs * (1 + speculative tokens), the largest CUDA-graph capture size), at most
    max_num_batched_tokens; larger (prefill, mixed) batches run in pieces of it. capacities: the capture sizes up
    to max_rows and max_rows itself (the prims_ts plans). Reads only attributes, so any config-shaped object works;
    each is read directly (a missing one raises, naming it: a default would under-plan MTP rows after a rename).
    """
    scheduler = required_field(vllm_config, "scheduler_config", "vllm_config")
    compilation = required_field(vllm_config, "compilation_config", "vllm_config")
    capture = sorted(int(s) for s in (required_field(compilation, "cudagraph_capture_sizes",
                                                     "vllm_config.compilation_config") or ()))
    speculative = required_field(vllm_config, "speculative_config", "vllm_config")  # None: no speculative decoding
    drafts = 0 if speculative is None else int(
        required_field(speculative, "num_speculative_tokens", "vllm_config.speculative_config"))
    max_num_seqs = required_field(scheduler, "max_num_seqs", "vllm_config.scheduler_config")
    decode_rows = max([int(max_num_seqs) * (1 + drafts), *capture])
    limit = int(required_field(scheduler, "max_num_batched_tokens", "vllm_config.scheduler_config"))
    max_rows = max(1, min(limit, decode_rows))
    return max_rows, tuple(sorted({c for c in capture if c <= max_rows} | {max_rows}))


def planned_layout(vllm_config: Any, width: int) -> tuple[int, tuple[int, ...], int]:
    """(max_rows, capacities, width) of a vLLM model's DSA layers: planned_rows, and the model's top-k width (its
    index_topk or top-k buffer's) rounded up to a multiple of 128 (widths.round_width)."""
    max_rows, capacities = planned_rows(vllm_config)
    return max_rows, capacities, round_width(width)


def prepare_trtllm_workspace(impl: Any, layer: Any, kernels: Mapping[int, str], device: torch.device) -> None:
    """Set the impl's trtllm-gen workspace now when the table runs trtllm (vLLM sets it on the first forward)."""
    if "trtllm" in kernels.values() and getattr(impl, "_workspace_buffer", None) is None:
        if hasattr(impl, "_prepare_mqa_kernel"):
            impl._prepare_mqa_kernel(layer, device)


_BUFFERS: dict[tuple[Any, ...], SharedBuffers] = {}


def shared_buffers(shape: StepShape) -> SharedBuffers:
    """The one set of buffers of every layer with this shape (made on first use, then reused)."""
    key = (str(shape.device), shape.heads, shape.width, shape.max_rows, shape.return_lse)
    if key not in _BUFFERS:
        _BUFFERS[key] = SharedBuffers.make(shape.max_rows, shape.heads, shape.width, shape.return_lse, shape.device)
    return _BUFFERS[key]


@dataclass(frozen=True)
class Layers:
    """What build_layers made: the kernel table {rows: name}, the buffers every core writes, one core a layer."""

    kernels: dict[int, str]
    buffers: SharedBuffers
    cores: list[FlashInferCore]


def build_layers(
    pairs: Sequence[tuple[Any, Any]],
    shape: StepShape,
    *,
    kernels: str | os.PathLike[str] | Mapping[int, str] | None = None,
    batch_sizes: Iterable[int] | None = None,
    buffers: SharedBuffers | None = None,
    validate: bool = False,
) -> Layers:
    """The one construction of DSA layers on `shape`: the kernel table, each impl's trtllm-gen workspace when the
    table runs trtllm, the shared buffers, and one FlashInferCore per (impl, layer) pair, all planned here.

    pairs: (impl, layer) per layer (impl: vLLM's FlashInferMLASparseImpl or a stand-in; layer: has _q_scale_float,
        _k_scale_float). kernels: kernel_table's `table` (a {rows: name} mapping, a table file, None: this
        machine's). batch_sizes: the batch sizes the cores run (default 1..shape.max_rows). buffers: the buffers to
        write (default shared_buffers(shape), one set a process for this shape). validate: the cores' debug checks.
    """
    sizes = range(1, shape.max_rows + 1) if batch_sizes is None else batch_sizes
    table = kernel_table(sizes, dcp=shape.dcp, heads=shape.heads, kv_cache_dtype=shape.fmt, device=shape.device,
                         table=kernels)
    for impl, layer in pairs:
        prepare_trtllm_workspace(impl, layer, table, shape.device)
    buffers = shared_buffers(shape) if buffers is None else buffers
    cores = [
        FlashInferCore(
            impl, layer, shape.heads, buffers.as_tuple(), table, dcp=shape.dcp, rank=shape.rank,
            capacities=shape.capacities or None, widths=(shape.width,), kv_cache_dtype=shape.fmt, validate=validate,
        )
        for impl, layer in pairs
    ]
    return Layers(table, buffers, cores)


class LayerStep:
    """One DSA layer's sparse MLA decode as vLLM's backend calls it (SparseMLACommonImpl._forward_mqa_kernel).

    impl: the layer's attention impl (vLLM's FlashInferMLASparseImpl subclass, or any object with scale,
        kv_lora_rank, qk_rope_head_dim, and _workspace_buffer for trtllm-gen).
    layer: has _q_scale_float and _k_scale_float (final: build after the weights are loaded).
    kernels: {rows: name} for 1..max_rows; None: kernel_table's choice for this machine.
    Everything is planned and allocated here; a call of <= max_rows rows allocates nothing and syncs nothing.
    """

    def __init__(
        self,
        impl: Any,
        layer: Any,
        shape: StepShape,
        kernels: Mapping[int, str] | None = None,
    ) -> None:
        self.shape = shape
        built = build_layers([(impl, layer)], shape, kernels=kernels)
        self.kernels, self.buffers, self.core = built.kernels, built.buffers, built.cores[0]

    def __call__(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        slots: torch.Tensor,
        counts: torch.Tensor,
        block_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """query (rows, H, 576) e4m3; kv_cache (num_blocks, block_size, row_bytes); slots (rows, K) int32 flat rows
        (only the first counts[i] of row i are read, -1 holes skipped); counts (rows,) int32.

        Returns latent (rows, H, 512) bf16 and lse (rows, H) fp32 natural log (None without DCP). Up to max_rows
        rows they are views of the shared buffers, valid until the next layer's call; above, new tensors.
        """
        rows = query.shape[0]
        if not query.is_contiguous():
            query = query.contiguous()
        if rows <= self.shape.max_rows:
            return self._decode(query, kv_cache, slots, counts, block_size)
        # A prefill chunk or a mixed batch: never captured in a graph (vLLM's FLASHINFER_MLA_SPARSE graphs are
        # uniform decode batches), so the result may be allocated here.
        heads = self.shape.heads
        out = torch.empty((rows, heads, LATENT_DIM), dtype=torch.bfloat16, device=query.device)
        lse = torch.empty((rows, heads), dtype=torch.float32, device=query.device) if self.shape.return_lse else None
        step = self.shape.max_rows
        for start in range(0, rows, step):
            end = min(rows, start + step)
            piece_out, piece_lse = self._decode(
                query[start:end], kv_cache, slots[start:end], counts[start:end], block_size
            )
            out[start:end].copy_(piece_out)
            if lse is not None and piece_lse is not None:
                lse[start:end].copy_(piece_lse)
        return out, lse

    def _decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = query.shape[0]
        if rows == 0:
            lse = None if self.buffers.lse is None else self.buffers.lse[:0].view(0, self.shape.heads)
            return self.buffers.latent[:0].view(0, self.shape.heads, LATENT_DIM), lse
        # Every kernel gives a row with no valid token latent 0 and LSE -inf (trtllm-gen's is masked after its call),
        # which vLLM's DCP combine weighs as nothing.
        return self.core.decode(query, kv_cache, slots, counts, block_size)


__all__ = ["LayerStep", "Layers", "SharedBuffers", "StepShape", "build_layers", "kernel_table", "planned_layout",
           "planned_rows", "prepare_trtllm_workspace", "shared_buffers"]
