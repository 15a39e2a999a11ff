"""vllm_kimi_dsa: the sparse-attention core of Kimi K3.1's DSA layers on vLLM's FLASHINFER_MLA_SPARSE backend.

Public names are loaded on first use, so `import vllm_kimi_dsa` stays cheap and needs neither vLLM nor FlashInfer.
"""

from __future__ import annotations

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
    """A public name, its module imported on first use (plain imports, so the import graph sees every one)."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_kimi_dsa' has no attribute {name!r}")
    if module == "core":
        from vllm_kimi_dsa import core as found
    elif module == "selection":
        from vllm_kimi_dsa import selection as found
    elif module == "backends.flashinfer.plans":
        from vllm_kimi_dsa.backends.flashinfer import plans as found
    elif module == "heads":
        from vllm_kimi_dsa import heads as found
    elif module == "convert":
        from vllm_kimi_dsa import convert as found
    elif module == "reference":
        from vllm_kimi_dsa import reference as found
    elif module == "dcp":
        from vllm_kimi_dsa import dcp as found
    else:  # "vllm_glue"
        from vllm_kimi_dsa import vllm_glue as found
    return getattr(found, name)
