"""The contract every decode kernel of the core keeps: one setup, one call.

A kernel is built once per layer from a `DecodeSetup` (everything known at
construction) and then called per step with views of the model's buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from vllm_kimi_dsa.formats import HEAD_DIM, CacheFormat


@dataclass(frozen=True)
class DecodeSetup:
    """What a kernel may rely on, fixed at the core's construction.

    device: the CUDA (or CPU, for the interpreter) device of every tensor.
    fmt: "fp8" (576 e4m3 bytes a row) or "nvfp4_ds_mla" (352 uint8 a row).
    heads: query heads H of every call (1..128, heads.MAX_HEADS).
    row_counts: every batch size (rows) the core will run, sorted.
    capacities: prims_ts plan capacities, sorted (empty: plan each row count).
    widths: every top-k width K a call may see, sorted, multiples of 128.
    return_lse: whether calls pass an `lse` buffer.
    softmax_scale: logits = softmax_scale * (q_raw . k_raw), the per-tensor
        descales folded in (SPEC 2.1): scale*q_scale*k_scale for fp8,
        scale*q_scale for nvfp4_ds_mla.
    output_scale: out = output_scale * sum_j p_j v_raw_j (k_scale or 1.0).
    impl: vLLM's FlashInferMLASparseImpl (or a stand-in): workspace, bmm scales.
    """

    device: torch.device
    fmt: CacheFormat
    heads: int
    row_counts: tuple[int, ...]
    capacities: tuple[int, ...]
    widths: tuple[int, ...]
    return_lse: bool
    softmax_scale: float
    output_scale: float
    impl: Any = None

    @property
    def max_rows(self) -> int:
        return max(self.row_counts)


class DecodeKernel(Protocol):
    """A sparse MLA decode kernel as the core calls it.

    __call__ arguments (no allocation, no host sync inside):
      query: (rows, H, 576) float8_e4m3fn, contiguous.
      kv_rows: (num_rows, 576) float8_e4m3fn or (num_rows, 352) uint8, the
          cache's flat rows view (may have a row stride > row bytes? no:
          rows are contiguous; block stride is folded into flat ids).
      slots: (rows, K) int32, compacted valid flat rows then -1; K in widths.
      counts: (rows,) int32, valid entries of each slots row.
      out: (rows, H, 512) bfloat16, written in full.
      lse: (rows, H) float32 natural-log LSE, or None when return_lse is False.
      block_size, rows_per_block_stride: the paged layout (trtllm pages).
    """

    name: ClassVar[str]

    def __call__(
        self,
        query: torch.Tensor,
        kv_rows: torch.Tensor,
        slots: torch.Tensor,
        counts: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        *,
        block_size: int,
        rows_per_block_stride: int,
    ) -> None: ...


def check_query(query: Any, heads: int | None = None, device: torch.device | None = None) -> int:
    """The decode query's contract, checked in this one place: a contiguous (rows, H, 576) float8_e4m3fn tensor (H =
    `heads` and on `device` when given). Returns rows; TypeError / ValueError naming `query`.

    The core checks it once a decode (before its kernel runs, which trusts it); one-off kernel calls check it with the
    rest of their arguments (kernels.common.check_inputs)."""
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"query must be a torch.Tensor, got {type(query).__name__}")
    if query.dtype != torch.float8_e4m3fn:
        raise TypeError(f"query must be {torch.float8_e4m3fn}, got {query.dtype}")
    if device is not None and query.device != device:
        raise ValueError(f"query is on {query.device}, the core's buffers are on {device}")
    if query.dim() != 3 or query.shape[-1] != HEAD_DIM or (heads is not None and query.shape[1] != heads):
        raise ValueError(f"query must be (rows, {'H' if heads is None else heads}, {HEAD_DIM}), got {tuple(query.shape)}")
    if not query.is_contiguous():
        raise ValueError("query must be contiguous")
    return query.shape[0]
