"""Query head counts: the ones K3.1 runs, and the one copy of which kernel takes which.

Read by selection (kernel_for), the core, the backends and the CLI; nothing else restates these rules.
"""

from __future__ import annotations

# TP1 pads K3's 96 heads to 128 for the FlashInfer kernels; TP8 gives 12 a rank; DCP's query mailbox is 128 wide.
SUPPORTED_HEADS: tuple[int, ...] = (128, 96, 64, 32, 16, 12)

# Heads each kernel takes (SPEC 2): prims_ts at most 128; trtllm-gen at most 64 or exactly 128; ours 1 to 128.
_RULES: dict[str, tuple[str, object]] = {
    "prims_ts": ("takes at most 128 heads", lambda h: 1 <= h <= 128),
    "trtllm": ("takes at most 64 heads or exactly 128", lambda h: 1 <= h <= 64 or h == 128),
    "triton": ("takes 1 to 128 heads", lambda h: 1 <= h <= 128),
}


def heads_refusal(kernel: str, heads: int) -> str | None:
    """Why `kernel` cannot take `heads` query heads ("trtllm takes at most 64 heads or exactly 128"), or None."""
    if kernel not in _RULES:
        raise ValueError(f"kernel={kernel!r} has no head rule; known: {sorted(_RULES)}")
    reason, takes = _RULES[kernel]
    return None if takes(heads) else f"{kernel} {reason}"  # type: ignore[operator]


__all__ = ["SUPPORTED_HEADS", "heads_refusal"]
