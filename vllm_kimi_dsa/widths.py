"""The top-k width K: every width the package takes is a positive multiple of WIDTH_MULTIPLE (128).

check_width refuses any other, naming the argument; round_width rounds a model's index_topk up to one (the width of
the buffers). The one statement of the rule: the core, the converter, the kernels, serving, vLLM's glue and backend,
tune, the bench and the CLI read it here.
"""

from __future__ import annotations

from typing import Any

WIDTH_MULTIPLE = 128  # every top-k width K3.1's indexer emits is a multiple of this (SPEC 1)


def is_width(width: Any) -> bool:
    """Whether `width` is a top-k width the package takes: an int (no bool), positive, a multiple of 128."""
    return isinstance(width, int) and not isinstance(width, bool) and width > 0 and width % WIDTH_MULTIPLE == 0


def check_width(width: Any, name: str = "width") -> int:
    """`width` when it is a top-k width (is_width); else ValueError naming `name`."""
    if not is_width(width):
        raise ValueError(f"{name} must be a positive multiple of {WIDTH_MULTIPLE}, got {width!r}")
    return int(width)


def round_width(width: int) -> int:
    """The smallest top-k width >= `width` (a model's index_topk -> the buffers' K)."""
    return -(-int(width) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE


__all__ = ["WIDTH_MULTIPLE", "check_width", "is_width", "round_width"]
