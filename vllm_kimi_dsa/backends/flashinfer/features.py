"""What the installed FlashInfer offers (prims_ts, trtllm-gen MLA) and whether a device is Blackwell.

FlashInfer is imported lazily and probed once; nothing here raises for a missing or broken install.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

PRIMS_TS_INSTALL = "pip install --no-deps flashinfer-python==0.7.4"


@dataclass(frozen=True)
class FlashInferFeatures:
    """What the installed FlashInfer offers (version None: not installed)."""

    version: str | None
    prims_ts: bool
    trtllm_mla: bool


@functools.cache
def flashinfer_features() -> FlashInferFeatures:
    """Probe the installed FlashInfer once; never raises."""
    try:
        import flashinfer
    except Exception:  # noqa: BLE001 - a broken install is as good as none here
        return FlashInferFeatures(None, False, False)
    version = getattr(flashinfer, "__version__", None)
    try:
        from flashinfer.attention.prims_ts import BatchSparseMLADecodePagedTSWrapper  # noqa: F401

        prims_ts = True
    except Exception:  # noqa: BLE001
        prims_ts = False
    try:
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache_mla  # noqa: F401

        trtllm = True
    except Exception:  # noqa: BLE001
        trtllm = False
    return FlashInferFeatures(None if version is None else str(version), prims_ts, trtllm)


def device_runs_blackwell(device: torch.device | str | int) -> bool:
    """True for a CUDA device of compute capability major 10 (SM100 / SM103)."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] == 10


def require_prims_ts() -> None:
    """Raise ImportError saying what to install when prims_ts is missing."""
    features = flashinfer_features()
    if not features.prims_ts:
        found = "no flashinfer" if features.version is None else f"flashinfer-python {features.version}"
        raise ImportError(
            "the prims_ts kernel needs flashinfer.attention.prims_ts.BatchSparseMLADecodePagedTSWrapper "
            f"(flashinfer-python >= 0.7.4); found {found}. vLLM 0.33 pins 0.7.2.post1, so install over it: "
            f"{PRIMS_TS_INSTALL}"
        )


def require_trtllm() -> None:
    """Raise ImportError saying what to install when trtllm-gen's MLA decode is missing."""
    features = flashinfer_features()
    if not features.trtllm_mla:
        raise ImportError(
            "the trtllm kernel needs flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla; "
            f"found flashinfer {features.version!r}. Install flashinfer-python (vLLM 0.33 pins 0.7.2.post1)"
        )


__all__ = [
    "FlashInferFeatures",
    "PRIMS_TS_INSTALL",
    "device_runs_blackwell",
    "flashinfer_features",
    "require_prims_ts",
    "require_trtllm",
]
