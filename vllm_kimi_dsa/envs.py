"""The package's environment variables: names, defaults, parsing, and their registration with vLLM's env validation.

Read without vLLM (the H200 has none); `register_with_vllm` adds them to `vllm.envs` so vLLM neither warns nor fails.
"""

from __future__ import annotations

import os
from typing import Any, Callable

BACKEND = "VLLM_KIMI_DSA_BACKEND"
KERNEL_TABLE = "VLLM_KIMI_DSA_KERNEL_TABLE"
GLUON = "VLLM_KIMI_DSA_GLUON"
FP8_PV = "VLLM_KIMI_DSA_FP8_PV"
SCHEDULE = "VLLM_KIMI_DSA_SCHEDULE"

# name -> (what it does, the values it takes); the README's table is made from the same words.
DOCS: dict[str, tuple[str, str]] = {
    BACKEND: (
        "the plugin overrides vLLM's FLASHINFER_MLA_SPARSE backend with this package's (1, default) or leaves "
        "vLLM's own class in place (0)",
        "`1` (default) or `0`",
    ),
    KERNEL_TABLE: (
        "a kernel-table JSON file written by `python -m vllm_kimi_dsa tune` (which kernel runs each batch size "
        "on Blackwell)",
        "a path; unset: the built-in table",
    ),
    GLUON: (
        "the warp-specialized Gluon kernels on Hopper: where they were verified (unset), on any Triton that "
        "compiles them (1), never (0)",
        "unset (default), `1` or `0`",
    ),
    FP8_PV: (
        "Hopper, fp8 cache, more than 32 heads: P.V on FP8 tensor cores, P rounded to e4m3 (faster at large "
        "batches; adds ~1e-2 relative error against the cache's values, docs/hopper-kernels.md)",
        "`0` (default) or `1`",
    ),
    SCHEDULE: (
        "Hopper: how a decode's KV tiles are divided among CTAs: by plans made at construction for full rows "
        "(static), or at every call on the device from the rows' counts (counts: the time follows the work on ragged "
        "batches; docs/hopper-kernels.md)",
        "`static` (default) or `counts`",
    ),
}

_SWITCHES = {BACKEND: ("0", "1"), GLUON: ("", "0", "1"), FP8_PV: ("0", "1"), SCHEDULE: ("static", "counts")}


def _switch(name: str, default: str) -> str:
    value = os.environ.get(name, default).strip()
    allowed = _SWITCHES[name]
    if value not in allowed:
        shown = " or ".join(repr(a) for a in allowed if a) + (" or unset" if "" in allowed else "")
        raise ValueError(f"{name}={value!r} is not valid; use {shown}")
    return value


def backend_enabled() -> bool:
    """Whether the plugin overrides FLASHINFER_MLA_SPARSE (VLLM_KIMI_DSA_BACKEND, default 1)."""
    return _switch(BACKEND, "1") == "1"


def kernel_table_path() -> str | None:
    """The kernel-table file VLLM_KIMI_DSA_KERNEL_TABLE names, or None."""
    return os.environ.get(KERNEL_TABLE, "").strip() or None


def gluon_choice() -> str:
    """VLLM_KIMI_DSA_GLUON: "" (where verified), "1" (wherever it compiles) or "0" (never)."""
    return _switch(GLUON, "")


def fp8_pv() -> bool:
    """VLLM_KIMI_DSA_FP8_PV: whether the 64-head fp8 decode rounds P to e4m3 for FP8 P.V (default 0)."""
    return _switch(FP8_PV, "0") == "1"


def schedule() -> str:
    """VLLM_KIMI_DSA_SCHEDULE: "static" (plans made at construction, the default) or "counts" (the device planner
    divides each call's tiles from its counts)."""
    return _switch(SCHEDULE, "static")


# vLLM's own format: name -> a function reading the current value.
ENVIRONMENT_VARIABLES: dict[str, Callable[[], Any]] = {
    BACKEND: backend_enabled,
    KERNEL_TABLE: kernel_table_path,
    GLUON: gluon_choice,
    FP8_PV: fp8_pv,
    SCHEDULE: schedule,
}


def register_with_vllm() -> bool:
    """Add the package's variables to `vllm.envs.environment_variables` (what vLLM validates `VLLM_*` against).

    Idempotent; False when vLLM is not importable.
    """
    try:
        from vllm import envs as vllm_envs
    except ImportError:
        return False
    for name, read in ENVIRONMENT_VARIABLES.items():
        vllm_envs.environment_variables.setdefault(name, read)
    return True


__all__ = [
    "BACKEND",
    "DOCS",
    "ENVIRONMENT_VARIABLES",
    "FP8_PV",
    "GLUON",
    "KERNEL_TABLE",
    "SCHEDULE",
    "backend_enabled",
    "fp8_pv",
    "gluon_choice",
    "kernel_table_path",
    "register_with_vllm",
    "schedule",
]
