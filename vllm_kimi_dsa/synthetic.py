"""Synthetic K3.1 decode steps: a random paged cache, block tables, top-k ids and FP8 queries.

Shared by the demo, `tune`, the benchmarks and the end-to-end tests, so all of them feed the core the same way vLLM does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM, CacheFormat, make_paged_cache


@dataclass
class StandInImpl:
    """The attributes of vLLM's FlashInferMLASparseImpl that the core reads."""

    scale: float = 1.0 / math.sqrt(192.0)  # 1/sqrt(qk_nope + qk_rope) of K3's MLA heads
    kv_lora_rank: int = LATENT_DIM
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = HEAD_DIM - LATENT_DIM
    kv_cache_dtype: str = "fp8"
    _workspace_buffer: torch.Tensor | None = None
    bmm1_scale: float | None = None
    bmm2_scale: float | None = None


@dataclass
class StandInLayer:
    """The per-layer FP8 scales vLLM keeps on the attention layer."""

    _q_scale_float: float = 0.05
    _k_scale_float: float = 0.02


@dataclass
class Step:
    """One decode step's inputs for one layer (rows = decode tokens, one per request)."""

    query: torch.Tensor  # (rows, H, 576) float8_e4m3fn
    cache: torch.Tensor  # (num_blocks, block_size, row_bytes)
    topk: torch.Tensor  # (rows, K) int32, request-local token ids, -1 holes
    metadata: SimpleNamespace  # req_id_per_token, block_table, block_size, cp_kv_cache_interleave_size
    context_lens: torch.Tensor  # (rows,) tokens of each request


def make_buffers(
    rows: int, heads: int, width: int, device: torch.device | str, lse: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The model's shared buffers for `rows` decode tokens, poisoned so an unwritten element shows."""
    return (
        torch.full((rows, width), -7, dtype=torch.int32, device=device),
        torch.full((rows,), -7, dtype=torch.int32, device=device),
        torch.full((rows * heads * LATENT_DIM,), float("nan"), dtype=torch.bfloat16, device=device),
        torch.full((rows * heads,), float("nan"), dtype=torch.float32, device=device) if lse else None,
    )


def make_step(
    rows: int,
    heads: int,
    width: int,
    fmt: CacheFormat,
    *,
    device: torch.device | str = "cpu",
    block_size: int = 64,
    block_stride: int | None = None,
    context: int | None = None,
    hole_fraction: float = 0.05,
    empty_rows: int = 0,
    dcp: int = 1,
    interleave: int = 1,
    seed: int = 0,
) -> Step:
    """A random decode step at K3.1 shapes.

    Every request (one a row) has `context` tokens (default 2*width, so the
    top-k really selects) spread over the whole cache in shuffled blocks;
    `hole_fraction` of the ids are -1 and the first `empty_rows` rows are all
    -1 (count 0). Under DCP the cache holds this rank's share of each request
    (context // dcp tokens, rounded up), the ids stay global.
    """
    g = torch.Generator().manual_seed(seed)
    context = 2 * width if context is None else context
    local_tokens = -(-context // dcp) + interleave  # enough for this rank's share
    blocks_per_req = -(-local_tokens // block_size)
    num_blocks = rows * blocks_per_req + 3  # a few blocks nobody owns
    cache = make_paged_cache(num_blocks, block_size, fmt, block_stride=block_stride, device="cpu", generator=g)
    perm = torch.randperm(num_blocks, generator=g)[: rows * blocks_per_req].to(torch.int32)
    block_table = perm.view(rows, blocks_per_req)
    # top-k: distinct ids from the request's context, in a random (indexer score) order
    topk = torch.stack([torch.randperm(context, generator=g)[:width] for _ in range(rows)]).to(torch.int32)
    holes = torch.rand((rows, width), generator=g) < hole_fraction
    topk[holes] = -1
    topk[:empty_rows] = -1
    query = (torch.randn((rows, heads, HEAD_DIM), generator=g) * 4).to(torch.float8_e4m3fn)
    metadata = SimpleNamespace(
        req_id_per_token=torch.arange(rows, dtype=torch.int32).to(device),
        block_table=block_table.to(device),
        block_size=block_size,
        cp_kv_cache_interleave_size=interleave,
        num_decode_tokens=rows,
    )
    return Step(
        query=query.to(device),
        cache=cache.to(device) if block_stride is None else _to_device_strided(cache, device),
        topk=topk.to(device),
        metadata=metadata,
        context_lens=torch.full((rows,), context, dtype=torch.int32).to(device),
    )


def _to_device_strided(cache: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Move a strided cache view with its storage, keeping the block stride."""
    rows_per_block = cache.stride(0) // cache.shape[2]
    full = cache.as_strided((cache.shape[0], rows_per_block, cache.shape[2]), (cache.stride(0), cache.shape[2], 1))
    return full.to(device)[:, : cache.shape[1]]
