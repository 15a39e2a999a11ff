"""Decode-context-parallel test cases: one global cache split over simulated ranks (SPEC 4, 6).

make_case builds the TP cache and each rank's own share of it, the top-k ids and the query; tests of the merge
(test_dcp), the vLLM backend and the glue share it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_kimi_dsa.formats import HEAD_DIM, make_paged_cache, quantize_rows, write_tokens

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
BLOCK = 64


def owner_and_local(t: torch.Tensor, dcp: int, interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC 4: token t lives on rank (t // I) % D at local index (t // (D*I)) * I + t % I."""
    return (t // interleave) % dcp, (t // (dcp * interleave)) * interleave + t % interleave


def _paged(tokens: list[torch.Tensor], fmt: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged cache holding tokens[req] (n_req, row_bytes) through a shuffled block table (+ spare blocks)."""
    per_req = max(1, max(-(-t.shape[0] // BLOCK) for t in tokens))
    num_blocks = len(tokens) * per_req + 3
    cache = make_paged_cache(num_blocks, BLOCK, fmt, device="cpu", generator=g)
    table = torch.randperm(num_blocks, generator=g)[: len(tokens) * per_req].to(torch.int32).view(len(tokens), per_req)
    for req, rows in enumerate(tokens):
        if rows.shape[0]:
            write_tokens(cache, table[req], rows)
    return cache.to(DEVICE), table.to(DEVICE)


def make_case(fmt: str, dcp: int, interleave: int, rows: int, heads: int, width: int, seed: int,
              only: dict[int, tuple[int, ...]] | None = None):
    """Global per-request tokens, top-k ids, queries. Row 0 is all -1; row r in `only` picks its ids only among
    the tokens of ranks only[r] (default: row 1 only rank 0's), so it is count 0 on every other rank; the other
    rows pick at random (with -1 holes).

    Returns the TP (cache, metadata) and per-rank [(cache, metadata)], the topk and the query.
    """
    only = {1: (0,)} if only is None else only
    assert 0 not in only and max(only) < rows
    g = torch.Generator().manual_seed(seed)
    context = max(2 * width, 2 * dcp * interleave) + 37  # odd: the last block and group are partial
    x = torch.randn((rows, context, HEAD_DIM), generator=g) * 2
    tokens = quantize_rows(x, fmt, 0.5)  # (rows, context, row_bytes): one set of bytes for TP and all ranks
    t = torch.arange(context)
    owner, local = owner_and_local(t, dcp, interleave)

    topk = torch.stack([torch.randperm(context, generator=g)[:width] for _ in range(rows)]).to(torch.int32)
    topk[torch.rand((rows, width), generator=g) < 0.1] = -1
    topk[0] = -1  # count 0 on every rank
    for row, live in only.items():
        mine = t[torch.isin(owner, torch.tensor(live))]
        pick = mine[torch.randperm(mine.numel(), generator=g)[: min(width, mine.numel())]].to(torch.int32)
        topk[row] = -1
        topk[row, : pick.numel()] = pick
    query = (torch.randn((rows, heads, HEAD_DIM), generator=g) * 3).to(torch.float8_e4m3fn)

    def meta(table: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(
            req_id_per_token=torch.arange(rows, dtype=torch.int32, device=DEVICE),
            block_table=table,
            block_size=BLOCK,
            cp_kv_cache_interleave_size=interleave,
            num_decode_tokens=rows,
        )

    tp_cache, tp_table = _paged([tokens[r] for r in range(rows)], fmt, g)
    ranks = []
    for rank in range(dcp):
        own = owner == rank
        # local indices of rank's tokens are 0..n-1 in increasing t, so a masked select is the local order
        assert torch.equal(local[own], torch.arange(int(own.sum())))
        cache, table = _paged([tokens[r][own] for r in range(rows)], fmt, g)
        ranks.append((cache, meta(table)))
    return (tp_cache, meta(tp_table)), ranks, topk.to(DEVICE), query.to(DEVICE)
