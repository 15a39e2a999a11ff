"""Decode-context-parallel merge of per-rank partial attention (SPEC section 6).

Every LSE in this package is natural log; `to_base2` converts for vLLM's combine,
which reads base 2 when the impl says `lse_base_on_e = False`.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

LOG2_E = 1.0 / math.log(2.0)


def to_base2(lse: torch.Tensor) -> torch.Tensor:
    """Natural-log LSE -> base-2 LSE (log2 sum 2**x), -inf stays -inf."""
    return lse * LOG2_E


def merge_dcp(
    latents: Sequence[torch.Tensor],
    lses: Sequence[torch.Tensor],
    counts: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the ranks' partial outputs into the full attention.

    latents[r]: (rows, H, D) any float; lses[r]: (rows, H) float32 natural log;
    counts[r]: (rows,) int, valid tokens rank r saw for each row. A rank with
    count 0 for a row is dropped by its count, whatever its LSE holds.
    Returns out (rows, H, D) float32 and lse (rows, H) float32; a row no rank
    saw gets out 0 and lse -inf.
    """
    if not (len(latents) == len(lses) == len(counts)) or not latents:
        raise ValueError(
            f"latents, lses and counts must be one per rank, got {len(latents)}, {len(lses)}, {len(counts)}"
        )
    rows, heads = lses[0].shape
    for r, (o, s, c) in enumerate(zip(latents, lses, counts)):
        if o.shape[:2] != (rows, heads) or s.shape != (rows, heads) or c.shape != (rows,):
            raise ValueError(
                f"rank {r}: latent {tuple(o.shape)}, lse {tuple(s.shape)}, counts {tuple(c.shape)} "
                f"do not match ({rows}, {heads})"
            )
    lse_r = torch.stack([s.float() for s in lses])  # (D, rows, H)
    seen = torch.stack([c > 0 for c in counts]).unsqueeze(-1)  # (D, rows, 1)
    lse_r = torch.where(seen, lse_r, torch.full_like(lse_r, float("-inf")))
    lse = torch.logsumexp(lse_r, dim=0)
    empty = torch.isneginf(lse)
    weights = torch.exp(lse_r - torch.where(empty, torch.zeros_like(lse), lse))  # 0 for dropped ranks
    out = torch.zeros(latents[0].shape, dtype=torch.float32, device=lse.device)
    for w, o, s in zip(weights, latents, seen):
        # A dropped rank's latent may be garbage (even NaN): 0 * NaN is NaN, so select, not scale.
        out += torch.where(s.unsqueeze(-1), w.unsqueeze(-1) * o.float(), 0.0)
    return out, lse
