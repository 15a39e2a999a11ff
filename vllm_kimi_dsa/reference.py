"""The float32 sparse MLA decode that defines the answer for every kernel.

Plain torch, vectorized: gather the selected rows, dequantize in float32,
softmax over the valid ones, natural-log LSE; count 0 -> output 0, LSE -inf.
"""

from __future__ import annotations

import torch

from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM, CacheFormat, dequantize_rows, row_bytes


def reference_decode(
    query: torch.Tensor,
    kv_rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    *,
    fmt: CacheFormat,
    softmax_scale: float,
    output_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode over flat rows, in float32.

    query: (rows, H, 576), any float dtype (e4m3 on the FlashInfer path: its raw values).
    kv_rows: (num_rows, 576) float8_e4m3fn or (num_rows, 352) uint8, the flat rows view.
    slots: (rows, K) int, flat row ids; only the first counts[i] of row i are read.
    counts: (rows,) int.
    softmax_scale, output_scale: as the kernels take them (SPEC 2.1): logits are
        softmax_scale * q_raw . k_raw, out = output_scale * sum_j p_j v_raw_j,
        where k_raw is the row dequantized without k_scale.
    Returns out (rows, H, 512) float32 and lse (rows, H) float32 (natural log
    of sum_j exp(logit_j)); a row with count 0 gets out 0 and lse -inf.
    """
    if query.dim() != 3 or query.shape[-1] != HEAD_DIM:
        raise ValueError(f"query must be (rows, H, {HEAD_DIM}), got {tuple(query.shape)}")
    if kv_rows.dim() != 2 or kv_rows.shape[-1] != row_bytes(fmt):
        raise ValueError(f"kv_rows must be (num_rows, {row_bytes(fmt)}) for {fmt}, got {tuple(kv_rows.shape)}")
    rows, width = slots.shape
    if query.shape[0] != rows or counts.shape != (rows,):
        raise ValueError(
            f"query {tuple(query.shape)}, slots {tuple(slots.shape)} and counts {tuple(counts.shape)} disagree on rows"
        )
    return _attend(query, kv_rows, slots, counts, lambda r: dequantize_rows(r, fmt), softmax_scale, output_scale)


def source_reference_decode(
    query: torch.Tensor,
    source_rows: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    *,
    softmax_scale: float,
    output_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference_decode on the unquantized rows a cache was made from ((num_rows, 576) float): the answer without
    the cache format's quantization error, so that error can be reported (not hidden by a reference that shares it)."""
    if (source_rows.dim() != 2 or source_rows.shape[-1] != HEAD_DIM
            or source_rows.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64)):
        raise ValueError(f"source_rows must be (num_rows, {HEAD_DIM}) float, got {tuple(source_rows.shape)} "
                         f"{source_rows.dtype}")
    return _attend(query, source_rows, slots, counts, lambda r: r.float(), softmax_scale, output_scale)


def _attend(query, kv_rows, slots, counts, to_float, softmax_scale: float, output_scale: float):
    """Gather the valid rows of each query row, to float32 (to_float), attend; see reference_decode."""
    rows, width = slots.shape
    position = torch.arange(width, device=slots.device)
    valid = (position < counts.long().unsqueeze(1)) & (slots >= 0)
    ids = torch.where(valid, slots.long(), torch.zeros_like(slots, dtype=torch.long))
    if valid.any() and int(ids[valid].max()) >= kv_rows.shape[0]:
        raise ValueError(f"slots index past the cache ({kv_rows.shape[0]} rows)")
    kv = to_float(kv_rows[ids.reshape(-1)]).reshape(rows, width, HEAD_DIM)
    # Unused entries read row 0 as a placeholder; its bytes may decode to NaN, and 0 * NaN is NaN.
    kv = kv.masked_fill(~valid.unsqueeze(-1), 0.0)
    q = query.float()
    logits = torch.einsum("rhd,rkd->rhk", q, kv) * softmax_scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    empty = ~valid.any(dim=1)
    shift = lse.masked_fill(empty.view(rows, 1), 0.0)  # exp(-inf - 0) = 0 for empty rows, never NaN
    probs = torch.exp(logits - shift.unsqueeze(-1))
    probs = probs.masked_fill(~valid.unsqueeze(1), 0.0)
    out = torch.einsum("rhk,rkd->rhd", probs, kv[..., :LATENT_DIM]) * output_scale
    out = out.masked_fill(empty.view(rows, 1, 1), 0.0)
    lse = lse.masked_fill(empty.view(rows, 1), float("-inf"))
    return out, lse
