"""Query head counts: the range the core serves (1 to 128 a rank, after DCP's head gather), which kernel takes which,
and the refusal above it that names the TP / DCP change fixing it.

Read by selection (kernel_for), the core, the backends, the vLLM backend and the CLI; nothing else restates these
rules. Which Hopper kernel runs a count is backends/hopper/variants.hopper_kernel's (padding inside its launch).
"""

from __future__ import annotations

from vllm_kimi_dsa.arguments import positive_int

# Every DSA layout gives 1 to 128 heads a rank: DeepSeek-V3.2 (128 heads) 128..8 at TP1..TP16, GLM-5 (64) 64..4,
# K3 (96) 96..6; TP1 pads K3's 96 to 128 for the FlashInfer kernels; DCP's query mailbox is at most 128 wide.
MAX_HEADS = 128
SUPPORTED_HEADS: range = range(1, MAX_HEADS + 1)
# The split of the Hopper kernels: at most this many heads a rank run in 16- (or 8-) head blocks (the few-heads Gluon
# kernel, the plain kernel's 16 / 32-head configs); above it, in 64-head blocks (seesaw / gluon_decode, 64-head tiles).
FEW_HEADS_MAX = 32

# Heads each kernel takes (SPEC 2): prims_ts at most 128; trtllm-gen at most 64 or exactly 128; ours 1 to 128.
_RULES: dict[str, tuple[str, object]] = {
    "prims_ts": (f"takes at most {MAX_HEADS} heads", lambda h: 1 <= h <= MAX_HEADS),
    "trtllm": ("takes at most 64 heads or exactly 128", lambda h: 1 <= h <= 64 or h == 128),
    "triton": (f"takes 1 to {MAX_HEADS} heads", lambda h: 1 <= h <= MAX_HEADS),
}


def heads_refusal(kernel: str, heads: int) -> str | None:
    """Why `kernel` cannot take `heads` query heads ("trtllm takes at most 64 heads or exactly 128"), or None."""
    if kernel not in _RULES:
        raise ValueError(f"kernel={kernel!r} has no head rule; known: {sorted(_RULES)}")
    reason, takes = _RULES[kernel]
    return None if takes(heads) else f"{kernel} {reason}"  # type: ignore[operator]


def check_heads(heads: object, name: str = "heads") -> int:
    """`heads` as an int in 1..MAX_HEADS; TypeError for a non-int, ValueError outside the range, naming `name`."""
    value = positive_int(heads, name)
    if value > MAX_HEADS:
        raise ValueError(f"{name}={value}: the sparse kernels take 1 to {MAX_HEADS} query heads a rank")
    return value


def rank_heads_refusal(heads: int, dcp: int = 1, tp: int | None = None) -> str | None:
    """Why `heads` query heads a rank after DCP's gather (heads a TP rank x `dcp`) cannot be served, or None.

    The message names the change that fixes it: a smaller DCP where the TP rank's own heads fit, else a larger TP
    (TP >= the size that fits, when `tp`, the current tensor-parallel size, is known).
    """
    heads, dcp = int(heads), max(1, int(dcp))
    if 1 <= heads <= MAX_HEADS:
        return None
    if heads < 1:
        return f"{heads} query heads a rank: the sparse kernels take 1 to {MAX_HEADS}"
    per_tp = -(-heads // dcp)  # heads of one TP rank, before DCP gathers dcp of them
    where = f"{heads} query heads a rank" + (f" after DCP {dcp} ({per_tp} a TP rank x DCP {dcp})" if dcp > 1 else "")
    fixes = []
    if dcp > 1 and per_tp <= MAX_HEADS:
        most = MAX_HEADS // per_tp
        fixes.append(f"a DCP size of at most {most}" if most > 1 else "no DCP (DCP 1)")
    fit = MAX_HEADS // dcp  # heads a TP rank may keep under this DCP
    if fit >= 1:
        factor = -(-per_tp // fit)
        grow = f"TP >= {tp * factor} (now {tp})" if tp else f"a tensor-parallel size {factor}x larger"
        fixes.append(grow + (f" with DCP {dcp}" if dcp > 1 else ""))
    return f"{where}: the sparse kernels take 1 to {MAX_HEADS}; use " + " or ".join(fixes)


__all__ = ["FEW_HEADS_MAX", "MAX_HEADS", "SUPPORTED_HEADS", "check_heads", "heads_refusal", "rank_heads_refusal"]
