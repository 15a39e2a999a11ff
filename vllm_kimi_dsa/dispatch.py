"""Which decode kernel runs a batch: KERNELS, the FI_KERNEL spec-string tables, kernel_for, fi_kernels.

Also plan_rows_for (prims_ts plan capacity of a batch) and the kernel-table files `tune` writes.
"""

from __future__ import annotations

import functools
import json
import operator
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_kimi_dsa import envs
from vllm_kimi_dsa.formats import normalize_format

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


def _check_table(table: Mapping[str, str], name: str) -> dict[str, str]:
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
    specs = _check_table({k: v for k, v in data.items() if k in TOPOLOGIES}, f"kernel table {str(p)!r}")
    if not specs:
        raise ValueError(f"path={str(p)!r} names neither 'tp' nor 'dcp'")
    return {**FI_KERNEL, **specs}


def save_kernel_table(
    path: str | os.PathLike[str],
    table: Mapping[str, str],
    meta: Mapping[str, Any] | None = None,
) -> None:
    """Write {"tp": spec, "dcp": spec, "meta": meta} as JSON (validated first; written atomically)."""
    specs = _check_table(table, "table")
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


# ---------------------------------------------------------------- kernel choice


def _check_positive_int(value: Any, name: str) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)  # numpy ints too
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def kernel_for(
    rows: int,
    dcp: int,
    kernels: Sequence[str],
    heads: int,
    table: Mapping[str, str] | None = None,
) -> str:
    """The kernel (a name in KERNELS) to run a batch of `rows` query rows of `heads` heads.

    kernels: the names this machine may use (e.g. fi_kernels(...)); names outside
        KERNELS ("sparse") are ignored.
    dcp: decode-context-parallel size; > 1 reads the table's "dcp" spec, else "tp".
    table: {"tp": spec, "dcp": spec}; None -> active_kernel_table(). A topology
        missing from `table` uses FI_KERNEL's.
    Rules, in order: 64 < heads < 128 excludes trtllm; heads > 128 excludes
    prims_ts and trtllm; heads == 128 without DCP -> trtllm when it is a
    candidate; a single candidate -> it; else the table's choice when it is a
    candidate, else prims_ts when it is one, else the first candidate in KERNELS order.
    """
    _check_positive_int(rows, "rows")
    _check_positive_int(dcp, "dcp")
    _check_positive_int(heads, "heads")
    if isinstance(kernels, str):
        raise TypeError(f"kernels must be a sequence of kernel names, not the str {kernels!r}")
    offered = set(kernels)
    candidates = [k for k in KERNELS if k in offered]
    excluded: dict[str, str] = {}
    if 64 < heads < 128 and "trtllm" in candidates:
        excluded["trtllm"] = "takes at most 64 heads or exactly 128"
    if heads > 128:
        for k in ("prims_ts", "trtllm"):
            if k in candidates:
                excluded[k] = "takes at most 128 heads"
    candidates = [k for k in candidates if k not in excluded]
    if not candidates:
        why = "; ".join(f"{k} {reason}" for k, reason in excluded.items())
        raise ValueError(
            f"kernels={tuple(kernels)!r} leaves no kernel this package runs for heads={heads}"
            + (f" ({why})" if why else f"; it runs {KERNELS}")
        )
    # SPEC 5: 128 heads without DCP is the shape vLLM's FLASHINFER_MLA_SPARSE runs on trtllm-gen.
    if heads == 128 and dcp == 1 and "trtllm" in candidates:
        return "trtllm"
    if len(candidates) == 1:
        return candidates[0]
    key = "dcp" if dcp > 1 else "tp"
    source = active_kernel_table() if table is None else _check_table(table, "table")
    spec = source.get(key, FI_KERNEL[key])
    choice = kernel_from_spec(spec, rows)
    if choice in candidates:
        return choice
    return "prims_ts" if "prims_ts" in candidates else candidates[0]


def plan_rows_for(rows: int, capacities: Sequence[int] | None) -> int:
    """The prims_ts plan batch size for `rows` rows: the smallest capacity >= rows (rows when none given).

    capacities: ascending positive ints without repeats, or None / empty.
    """
    _check_positive_int(rows, "rows")
    if not capacities:
        return rows
    caps = tuple(capacities)
    for c in caps:
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"capacities must be positive ints, got {caps}")
    if any(a >= b for a, b in zip(caps, caps[1:])):
        raise ValueError(f"capacities must be sorted ascending without repeats, got {caps}")
    for c in caps:
        if c >= rows:
            return c
    raise ValueError(f"rows={rows} exceeds every plan capacity in capacities={caps}")


# ---------------------------------------------------------------- what this machine runs


def _features() -> Any | None:
    """FlashInfer's feature probe (version, prims_ts, trtllm_mla), or None when it cannot be imported."""
    try:
        from vllm_kimi_dsa.kernels.flashinfer import flashinfer_features
    except ImportError:
        return None
    return flashinfer_features()


def _is_blackwell(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        from vllm_kimi_dsa.kernels.flashinfer import device_runs_blackwell
    except ImportError:
        major, _ = torch.cuda.get_device_capability(device)
        return major == 10
    return bool(device_runs_blackwell(device))


def _triton_runs(device: torch.device) -> bool:
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
    if not any(k in found for k in ("prims_ts", "trtllm")) and _triton_runs(device):
        found.append("triton")
    return tuple(found)


__all__ = [
    "FI_KERNEL",
    "KERNELS",
    "KERNEL_TABLE_ENV",
    "SPEC_KERNELS",
    "active_kernel_table",
    "fi_kernels",
    "kernel_for",
    "kernel_from_spec",
    "load_kernel_table",
    "parse_kernel_spec",
    "plan_rows_for",
    "reset_kernel_table_cache",
    "save_kernel_table",
]
