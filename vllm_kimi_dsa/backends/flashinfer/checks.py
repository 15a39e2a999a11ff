"""Construction-time checks both FlashInfer kernels apply to their DecodeSetup.

FlashInfer rounds host scales to fp32 and rejects non-positive ones at run(): they are refused here, at setup.
"""

from __future__ import annotations

import math

from vllm_kimi_dsa.kernels.base import DecodeSetup


def positive_scale(value: float, name: str) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return value


def check_setup(setup: DecodeSetup) -> None:
    if not setup.row_counts or not setup.widths:
        raise ValueError("setup.row_counts and setup.widths must not be empty")
    for w in setup.widths:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"setup.widths must be positive ints, got {setup.widths}")


__all__ = ["check_setup", "positive_scale"]
