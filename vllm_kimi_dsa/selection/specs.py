"""Kernel tables: spec strings ("1-8:trtllm,16-64:prims_ts", later entries win), the built-in FI_KERNEL, table files.

`tune` writes a table file; VLLM_KIMI_DSA_KERNEL_TABLE names the one kernel_for reads (each path read once).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_kimi_dsa import envs

# Kernels this package runs itself (kernels/); "sparse" is the model's own FP8 decode.
KERNELS: tuple[str, ...] = ("prims_ts", "trtllm", "triton")
SPEC_KERNELS: tuple[str, ...] = KERNELS + ("sparse",)  # names a spec string may use
TOPOLOGIES: tuple[str, ...] = ("tp", "dcp")

# Batch size -> kernel, per topology. UNMEASURED PRIORS: no Blackwell GPU was available when this
# was written, so these are guesses (trtllm-gen for small TP batches, prims_ts otherwise) to be
# replaced by the output of `python -m vllm_kimi_dsa tune` (a file named by KERNEL_TABLE_ENV).
FI_KERNEL: dict[str, str] = {
    "tp": "1-32:trtllm,33-4096:prims_ts",
    "dcp": "1-4096:prims_ts",
}

KERNEL_TABLE_ENV = envs.KERNEL_TABLE


# ---------------------------------------------------------------- spec strings


@functools.lru_cache(maxsize=256)
def _parse(spec: str) -> tuple[tuple[int, int, str], ...]:
    entries: list[tuple[int, int, str]] = []
    if not spec.strip():
        return ()
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            raise ValueError(f"spec={spec!r} has an empty entry (stray comma?)")
        bounds, colon, name = entry.partition(":")
        name = name.strip()
        if not colon or not name:
            raise ValueError(f"spec entry {entry!r} must be 'lo-hi:kernel' or 'n:kernel' (spec={spec!r})")
        lo_text, dash, hi_text = bounds.partition("-")
        try:
            lo = int(lo_text.strip())
            hi = int(hi_text.strip()) if dash else lo
        except ValueError:
            raise ValueError(f"spec entry {entry!r} has non-integer bounds (spec={spec!r})") from None
        if lo < 1:
            raise ValueError(f"spec entry {entry!r}: batch sizes start at 1 (spec={spec!r})")
        if lo > hi:
            raise ValueError(f"spec entry {entry!r}: lo {lo} > hi {hi} (spec={spec!r})")
        if name not in SPEC_KERNELS:
            raise ValueError(f"spec entry {entry!r}: unknown kernel {name!r}; expected one of {SPEC_KERNELS}")
        entries.append((lo, hi, name))
    return tuple(entries)


def parse_kernel_spec(spec: str) -> tuple[tuple[int, int, str], ...]:
    """'1-8:trtllm,16-64:prims_ts' -> ((1, 8, 'trtllm'), (16, 64, 'prims_ts')).

    Ranges are inclusive; 'n:kernel' is the range n-n; later entries override
    earlier ones where they overlap. A blank spec has no entries. Kernel names:
    SPEC_KERNELS. Malformed text -> ValueError quoting the entry.
    """
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str, got {type(spec).__name__}")
    return _parse(spec)


def kernel_from_spec(spec: str, rows: int) -> str | None:
    """The kernel `spec` names for batch size `rows` (the last matching entry), or None."""
    choice = None
    for lo, hi, name in parse_kernel_spec(spec):
        if lo <= rows <= hi:
            choice = name
    return choice


# ---------------------------------------------------------------- kernel tables (tune output)


def check_table(table: Mapping[str, str], name: str) -> dict[str, str]:
    if not isinstance(table, Mapping):
        raise TypeError(f"{name} must be a mapping {{'tp': spec, 'dcp': spec}}, got {type(table).__name__}")
    unknown = sorted(set(table) - set(TOPOLOGIES))
    if unknown:
        raise ValueError(f"{name} has keys {unknown}; the topologies are {TOPOLOGIES}")
    out: dict[str, str] = {}
    for key, spec in table.items():
        try:
            parse_kernel_spec(spec)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{name}[{key!r}]: {err}") from None
        out[key] = spec
    return out


def load_kernel_table(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read a kernel-table JSON file {"tp": spec, "dcp": spec, "meta": {...}} -> {"tp": spec, "dcp": spec}.

    Each spec is validated. A topology the file does not name keeps the
    built-in prior (FI_KERNEL). Keys other than "tp"/"dcp" are metadata and ignored.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as err:
        raise ValueError(f"path={str(p)!r}: cannot read kernel table ({err})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"path={str(p)!r} is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"path={str(p)!r} must hold a JSON object, got {type(data).__name__}")
    specs = check_table({k: v for k, v in data.items() if k in TOPOLOGIES}, f"kernel table {str(p)!r}")
    if not specs:
        raise ValueError(f"path={str(p)!r} names neither 'tp' nor 'dcp'")
    return {**FI_KERNEL, **specs}


def save_kernel_table(
    path: str | os.PathLike[str],
    table: Mapping[str, str],
    meta: Mapping[str, Any] | None = None,
) -> None:
    """Write {"tp": spec, "dcp": spec, "meta": meta} as JSON (validated first; written atomically)."""
    specs = check_table(table, "table")
    if not specs:
        raise ValueError("table must name at least one of 'tp', 'dcp'")
    if meta is not None and not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a mapping, got {type(meta).__name__}")
    payload: dict[str, Any] = dict(specs)
    payload["meta"] = dict(meta or {})
    try:
        text = json.dumps(payload, indent=2, sort_keys=True) + "\n"
    except TypeError as err:
        raise TypeError(f"meta must be JSON-serializable: {err}") from None
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, p)  # a reader never sees half a file


_active: dict[str, dict[str, str]] = {}  # env path -> loaded table: each file is read once


def active_kernel_table() -> dict[str, str]:
    """The table kernel_for uses when given none: the file named by $VLLM_KIMI_DSA_KERNEL_TABLE
    (read once per path, cached; a bad file raises), else the built-in FI_KERNEL."""
    path = envs.kernel_table_path()
    if not path:
        return FI_KERNEL
    if path not in _active:
        try:
            _active[path] = load_kernel_table(path)
        except ValueError as err:
            raise ValueError(f"{KERNEL_TABLE_ENV}: {err}") from None
    return _active[path]


def reset_kernel_table_cache() -> None:
    """Forget the tables read by active_kernel_table (tests; a rewritten file)."""
    _active.clear()


__all__ = [
    "FI_KERNEL",
    "KERNELS",
    "KERNEL_TABLE_ENV",
    "SPEC_KERNELS",
    "TOPOLOGIES",
    "active_kernel_table",
    "check_table",
    "kernel_from_spec",
    "load_kernel_table",
    "parse_kernel_spec",
    "reset_kernel_table_cache",
    "save_kernel_table",
]
