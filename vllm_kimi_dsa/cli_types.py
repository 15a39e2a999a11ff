"""argparse value types of the CLI's commands (demo, tune, bench): each refuses a bad value with a usage error.

Used as `type=` so argparse prints usage and the offending option and exits 2; nothing here runs a kernel.
"""

from __future__ import annotations

import argparse


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def at_least_one(text: str) -> int:
    """An int >= 1."""
    values = _ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}")
    if values[0] < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {values[0]}")
    return values[0]


def batch_sizes(text: str) -> tuple[int, ...]:
    """A comma-separated list of batch sizes: each an int >= 1, at least one."""
    values = _ints(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected batch sizes >= 1, got {text!r}")
    return values


def head_counts(text: str) -> tuple[int, ...]:
    """A comma-separated list of head counts, each one the kernels take (1 to heads.MAX_HEADS a rank)."""
    from vllm_kimi_dsa.heads import MAX_HEADS, SUPPORTED_HEADS

    values = _ints(text)
    if not values or any(h not in SUPPORTED_HEADS for h in values):
        raise argparse.ArgumentTypeError(f"must be query heads a rank in 1..{MAX_HEADS}, got {text!r}")
    return values


def head_count(text: str) -> int:
    """One head count the kernels take."""
    values = head_counts(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one head count, got {text!r}")
    return values[0]


def top_k_width(text: str) -> int:
    """A top-k width: a positive multiple of 128 (widths.WIDTH_MULTIPLE)."""
    from vllm_kimi_dsa.widths import WIDTH_MULTIPLE, is_width

    value = at_least_one(text)
    if not is_width(value):
        raise argparse.ArgumentTypeError(f"must be a positive multiple of {WIDTH_MULTIPLE}, got {value}")
    return value


def kernel_names(text: str) -> tuple[str, ...]:
    """A comma-separated list of kernel names this package runs (selection.KERNELS)."""
    from vllm_kimi_dsa.selection import KERNELS

    names = tuple(k for k in text.split(",") if k)
    if not names or any(k not in KERNELS for k in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated names among {KERNELS}, got {text!r}")
    return names


__all__ = ["at_least_one", "batch_sizes", "head_count", "head_counts", "kernel_names", "top_k_width"]
