"""vllm_kimi_dsa: the sparse-attention core of Kimi K3.1's DSA layers on vLLM's FLASHINFER_MLA_SPARSE backend.

Public names are loaded on first use, so `import vllm_kimi_dsa` stays cheap and needs neither vLLM nor FlashInfer.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "FlashInferCore": "core",
    "KERNELS": "selection",
    "FI_KERNEL": "selection",
    "kernel_for": "selection",
    "fi_kernels": "selection",
    "plan_rows_for": "selection",
    "parse_kernel_spec": "selection",
    "PLANS": "backends.flashinfer.plans",
    "_Plans": "backends.flashinfer.plans",
    "_offsets": "backends.flashinfer.plans",
    "SUPPORTED_HEADS": "heads",
    "convert_topk": "convert",
    "convert_topk_reference": "convert",
    "reference_decode": "reference",
    "merge_dcp": "dcp",
    "dsa_on_flashinfer": "vllm_glue",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_kimi_dsa' has no attribute {name!r}")
    return getattr(import_module(f"vllm_kimi_dsa.{module}"), name)
