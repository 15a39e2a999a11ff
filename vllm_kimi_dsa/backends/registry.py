"""The kernel registry: each kernel name of selection.KERNELS -> the backend class that runs it as a DecodeKernel.

The one place the package imports through a string: each class is imported when its name is first built, so a
machine without FlashInfer still runs "triton" (the Hopper dispatcher). Every entry is a backend of this layer.
"""

from __future__ import annotations

from importlib import import_module

from vllm_kimi_dsa.kernels.base import DecodeKernel, DecodeSetup

# name -> "module:Class"; every class follows the DecodeKernel protocol (kernels/base.py).
_KERNEL_CLASSES: dict[str, str] = {
    "prims_ts": "vllm_kimi_dsa.backends.flashinfer.prims_ts:PrimsTsDecode",
    "trtllm": "vllm_kimi_dsa.backends.flashinfer.trtllm:TrtllmDecode",
    "triton": "vllm_kimi_dsa.backends.hopper.dispatch:TritonDecode",
}


def kernel_class(name: str) -> type[DecodeKernel]:
    """The DecodeKernel class of a kernel name in KERNELS."""
    try:
        module, cls = _KERNEL_CLASSES[name].split(":")
    except KeyError:
        raise ValueError(f"kernel {name!r} is not one this package runs; known: {sorted(_KERNEL_CLASSES)}") from None
    return getattr(import_module(module), cls)


def build_kernel(name: str, setup: DecodeSetup) -> DecodeKernel:
    """Construct (and so plan / allocate for) kernel `name` for `setup`."""
    return kernel_class(name)(setup)


__all__ = ["build_kernel", "kernel_class"]
