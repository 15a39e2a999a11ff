"""Which decode kernel runs a batch: kernel_for (the head rules, then the measured table) and fi_kernels (what
this machine runs: FlashInfer's version, the GPU's capability, Triton).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm_kimi_dsa.arguments import dcp_flag, positive_int
from vllm_kimi_dsa.formats import normalize_format
from vllm_kimi_dsa.heads import heads_refusal
from vllm_kimi_dsa.selection.specs import FI_KERNEL, KERNELS, active_kernel_table, check_table, kernel_from_spec


def kernel_for(
    rows: int,
    dcp: bool | int,
    kernels: Sequence[str],
    heads: int | None = None,
    table: Mapping[str, str] | None = None,
) -> str:
    """The kernel (a name in KERNELS) to run a batch of `rows` query rows of `heads` heads.

    dcp: whether the batch runs under decode context parallelism, as the seed's flag
        (`FI_KERNEL["dcp" if dcp else "tp"]`): a bool is the flag; an int is a DCP size, 0 or 1 tensor parallel
        (a DCP of one rank is no DCP: every caller passing vLLM's decode_context_parallel_size, 1 by default, means
        TP by it) and > 1 under DCP. TypeError for a non-int, ValueError below 0.
    kernels: the names this machine may use (e.g. fi_kernels(...)); names outside
        KERNELS ("sparse") are ignored.
    heads: query heads a row (after DCP's gather), 1..128; None: not known, so the rules that need it are
        skipped (every offered kernel stays a candidate, and 128 heads without DCP is not sent to trtllm).
    table: {"tp": spec, "dcp": spec}; None -> active_kernel_table(). A topology
        missing from `table` uses FI_KERNEL's.
    Rules, in order: 64 < heads < 128 excludes trtllm; heads > 128 excludes
    every kernel; heads == 128 without DCP -> trtllm when it is a
    candidate; a single candidate -> it; else the table's choice when it is a
    candidate, else prims_ts when it is one, else the first candidate in KERNELS order.
    """
    positive_int(rows, "rows")
    under_dcp = dcp_flag(dcp, "dcp")
    if heads is not None:
        heads = positive_int(heads, "heads")
    if isinstance(kernels, str):
        raise TypeError(f"kernels must be a sequence of kernel names, not the str {kernels!r}")
    offered = set(kernels)
    candidates = [k for k in KERNELS if k in offered]
    excluded = {} if heads is None else {k: reason for k in candidates if (reason := heads_refusal(k, heads))}
    candidates = [k for k in candidates if k not in excluded]
    if not candidates:
        why = "; ".join(excluded.values())
        raise ValueError(
            f"kernels={tuple(kernels)!r} leaves no kernel this package runs for heads={heads}"
            + (f" ({why})" if why else f"; it runs {KERNELS}")
        )
    # SPEC 5: 128 heads without DCP is the shape vLLM's FLASHINFER_MLA_SPARSE runs on trtllm-gen.
    if heads == 128 and not under_dcp and "trtllm" in candidates:
        return "trtllm"
    if len(candidates) == 1:
        return candidates[0]
    key = "dcp" if under_dcp else "tp"
    source = active_kernel_table() if table is None else check_table(table, "table")
    spec = source.get(key, FI_KERNEL[key])
    choice = kernel_from_spec(spec, rows)
    if choice in candidates:
        return choice
    return "prims_ts" if "prims_ts" in candidates else candidates[0]


# ---------------------------------------------------------------- what this machine runs


def _features() -> Any | None:
    """FlashInfer's feature probe (version, prims_ts, trtllm_mla), or None when it cannot be imported."""
    try:
        from vllm_kimi_dsa.backends.flashinfer.features import flashinfer_features
    except ImportError:
        return None
    return flashinfer_features()


def _is_blackwell(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        from vllm_kimi_dsa.backends.flashinfer.features import device_runs_blackwell
    except ImportError:
        major, _ = torch.cuda.get_device_capability(device)
        return major == 10
    return bool(device_runs_blackwell(device))


def triton_runs(device: torch.device) -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def fi_kernels(kv_cache_dtype: str, device: torch.device | str | None = None) -> tuple[str, ...]:
    """Kernels able to decode a `kv_cache_dtype` cache on `device` (default: the current CUDA device, else CPU).

    nvfp4_ds_mla -> prims_ts only (no trtllm kernel reads it); fp8 -> prims_ts,
    trtllm and the model's own "sparse". Dropped where this machine cannot run
    them: prims_ts needs FlashInfer with prims_ts (0.7.4+) and a Blackwell GPU,
    trtllm needs FlashInfer's trtllm-gen MLA and a Blackwell GPU, and "sparse"
    (itself a Blackwell kernel) needs a Blackwell GPU. "triton" is added where
    neither prims_ts nor trtllm remains and Triton runs (a CUDA GPU, or
    TRITON_INTERPRET=1 on a CPU).
    """
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype must be a str, got {type(kv_cache_dtype).__name__}")
    fmt = normalize_format(kv_cache_dtype)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    wanted = ("prims_ts",) if fmt == "nvfp4_ds_mla" else ("prims_ts", "trtllm", "sparse")
    blackwell = _is_blackwell(device)
    features = _features() if blackwell else None
    runs = {
        "prims_ts": blackwell and bool(getattr(features, "prims_ts", False)),
        "trtllm": blackwell and bool(getattr(features, "trtllm_mla", False)),
        "sparse": blackwell,
    }
    found = [k for k in wanted if runs[k]]
    if not any(k in found for k in ("prims_ts", "trtllm")) and triton_runs(device):
        found.append("triton")
    return tuple(found)


__all__ = ["fi_kernels", "kernel_for", "triton_runs"]
