"""Every kernel's plan Config: the plain kernel's fixed table by (heads, format) and the Gluon kernels' tiles.

The split costs here (SPLIT_TILES, TWO_CTA_TILE_COST) are fitted constants of the plan model (history: docs/).
"""

from __future__ import annotations

import dataclasses

from vllm_kimi_dsa.formats import CacheFormat, normalize_format
from vllm_kimi_dsa.heads import FEW_HEADS_MAX
from vllm_kimi_dsa.planning.cost import Config

# The 64-head Gluon kernels: a split CTA's 64 x 512 partial written and read back by the combine, in tiles' worth
GLUON64_BLOCK_H = 64
GLUON64_BLOCK_N = 64
GLUON64_SPLIT_TILES = 3.8
# The few-heads Gluon kernel: 16-head blocks of 64-token tiles; its split partial (16 x 512) in tiles' worth
FEW_BLOCK_H = 16
FEW_BLOCK_N = 64
FEW_SPLIT_TILES = 2.0
# A tile's time a CTA at two CTAs an SM over one CTA an SM (reg_v), by 16-head blocks a row (two: sibling CTAs gather
# the same rows, the second from L2); fitted by benchmarks/fit_plan_cost.py
TWO_CTA_TILE_COST = {1: 1.15, 2: 1.3}


def qk_on_fp8_wgmma(config: Config, fmt: CacheFormat) -> bool:
    """Whether a config's Q.K runs on Hopper's fp8 wgmma without promotion (64-head tiles or transposed dots on an
    fp8 cache): its logits then carry the wgmma accumulator's rounding, which tests and checks bound."""
    return normalize_format(fmt) == "fp8" and (config.block_h >= 64 or config.swap)


def default_config(heads: int, fmt: CacheFormat) -> Config:
    """The plain `tl` kernel's fixed config by (heads, fmt).

    > 32 heads: 64-head tiles on wgmma (fp8 Q.K without promotion). <= 32 heads: fp8 runs the transposed kernel;
    nvfp4 16-head blocks of the head-major one with register prefetch and lazy rescaling.
    """
    fmt = normalize_format(fmt)
    if heads > FEW_HEADS_MAX:
        return Config(block_h=64, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=1)
    if fmt == "fp8":
        if heads > 16:
            return Config(block_h=32, block_n=64, num_warps=8, num_stages=3, ctas_per_sm=1, swap=True)
        return Config(block_h=16, block_n=64, num_warps=4, num_stages=3, ctas_per_sm=2, swap=True)
    return Config(block_h=16, block_n=32, num_warps=4, num_stages=1, ctas_per_sm=2, prefetch=True, lazy=True)


def gluon_config(block_n: int = GLUON64_BLOCK_N) -> Config:
    """The plan Config of both 64-head Gluon kernels (gluon_decode's and the seesaw kernel): 64-head tiles, one CTA an
    SM, lead plans at any modelled gain (the model understates them at 128 heads)."""
    return Config(block_h=GLUON64_BLOCK_H, block_n=block_n, num_warps=12, num_stages=1, ctas_per_sm=1,
                  split_tiles=GLUON64_SPLIT_TILES * block_n / GLUON64_BLOCK_N, lead_split=True, lead_min_gain=0.0)


def few_heads_config(block_h: int = FEW_BLOCK_H) -> Config:
    """The few-heads Gluon kernel's plan Config at one CTA an SM, even plans (its params' config() adds occupancy and
    lead plans); block_h: heads a CTA (16; 8 for the 8-head form, 32 for two 16-head consumers)."""
    return Config(block_h=block_h, block_n=FEW_BLOCK_N, num_warps=12, num_stages=1, ctas_per_sm=1, swap=True,
                  split_tiles=FEW_SPLIT_TILES * block_h / FEW_BLOCK_H)


def few_heads_params_config(heads: int, reg_v: bool, ctas_per_sm: int, block_h: int = FEW_BLOCK_H) -> Config:
    """The plan Config of the few-heads kernel's params (block_h heads a CTA): lead plans with reg_v; at two CTAs an
    SM the tile cost of this head count's head blocks."""
    cfg = dataclasses.replace(few_heads_config(block_h), lead_split=reg_v)
    if ctas_per_sm == 1:
        return cfg
    return dataclasses.replace(cfg, ctas_per_sm=2, tile_cost=TWO_CTA_TILE_COST[min(-(-heads // block_h), 2)])
