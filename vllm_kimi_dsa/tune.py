"""`python -m vllm_kimi_dsa tune`: time every decode kernel this machine runs per batch size, write the kernel table.

The fastest kernel per batch size becomes one spec string per topology ("tp" / "dcp"), saved with selection.save_kernel_table.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

from vllm_kimi_dsa import cli_types
from vllm_kimi_dsa.timing import cuda_graph_time_us, rotation_sets, wall_time_us
from vllm_kimi_dsa.widths import check_width

# Batch sizes measured by default: every small batch (where the kernels differ most), then the
# CUDA-graph sizes vLLM captures up to K3.1's decode batch.
DEFAULT_ROWS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320)


@dataclass(frozen=True)
class TuneConfig:
    """What one `tune` run measures (all of it lands in the table's metadata).

    rows: batch sizes, ascending. heads: query heads per rank. width: top-k K.
    kv_cache_dtype: "fp8" or "nvfp4_ds_mla". dcp: decode-context-parallel size (> 1 -> "dcp" table,
    rows then carry ceil(K/dcp) valid slots as a rank sees them). device: "cuda" or "cpu".
    cache_blocks: blocks (of 64 rows) in the synthetic cache. reps_time_s: replay time per point.
    """

    rows: tuple[int, ...]
    heads: int
    width: int
    kv_cache_dtype: str
    dcp: int
    device: str
    block_size: int = 64
    cache_blocks: int = 4096
    reps_time_s: float = 0.05

    @property
    def topology(self) -> str:
        return "dcp" if self.dcp > 1 else "tp"


# measure(kernel, rows, config) -> microseconds per decode call
Measure = Callable[[str, int, TuneConfig], float]


# ---------------------------------------------------------------- spec strings


def merge_spec(choices: Mapping[int, str]) -> str:
    """{rows: kernel} at the measured batch sizes -> a spec string with equal neighbours merged.

    A measured size r_i stands for every batch in (r_{i-1}, r_i] (the first one from 1), because
    vLLM pads a batch up to the next captured size: {1: a, 8: a, 16: b, 320: b} -> "1-8:a,9-320:b".
    Batches above the largest measured size are left to kernel_for's default.
    """
    if not choices:
        raise ValueError("choices must name at least one batch size")
    runs: list[list[Any]] = []  # [lo, hi, kernel]
    prev = 0
    for rows in sorted(choices):
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"choices: batch size {rows!r} must be a positive int")
        name = choices[rows]
        if runs and runs[-1][2] == name:
            runs[-1][1] = rows
        else:
            runs.append([prev + 1, rows, name])
        prev = rows
    return ",".join(f"{lo}:{k}" if lo == hi else f"{lo}-{hi}:{k}" for lo, hi, k in runs)


def fastest(us: Mapping[str, Mapping[int, float]], rows: Iterable[int]) -> dict[int, str]:
    """{kernel: {rows: µs}} -> {rows: the kernel with the least finite µs}; rows nobody measured are left out.

    Ties go to the kernel named first in `us` (callers pass KERNELS order).
    """
    choice: dict[int, str] = {}
    for r in rows:
        best: tuple[float, str] | None = None
        for kernel, per_rows in us.items():
            t = per_rows.get(r)
            if t is None or not math.isfinite(t):
                continue
            if best is None or t < best[0]:
                best = (t, kernel)
        if best is not None:
            choice[r] = best[1]
    return choice


class CoreTimer:
    """The default `measure`: FlashInferCore.decode with a one-kernel table, on synthetic data.

    One core per kernel (its table maps every tuned batch size to that kernel, so plans are made
    once); per batch size a CUDA graph of several decode calls over different queries, slots and
    cache windows (so the KV reads come from HBM, not L2); on a CPU an eager wall-clock loop.
    """

    def __init__(self, config: TuneConfig) -> None:
        import torch

        from vllm_kimi_dsa.formats import cache_dtype, normalize_format, row_bytes
        from vllm_kimi_dsa.synthetic import StandInImpl, StandInLayer, make_buffers

        self.config = config
        self.device = torch.device(config.device)
        self.fmt = normalize_format(config.kv_cache_dtype)
        self.row_bytes = row_bytes(self.fmt)
        c = config
        self.max_sets = 32 if self.device.type == "cuda" else 1  # rows=1: 32 x 1.2 MB of fp8 rows > 2 x L2
        self.shift_blocks = max(1, c.cache_blocks // 16)  # window offset between rotation sets
        total = c.cache_blocks + self.shift_blocks * (self.max_sets - 1)
        g = torch.Generator(device=self.device).manual_seed(1234)
        raw = torch.randint(0, 256, (total, c.block_size, self.row_bytes), dtype=torch.uint8,
                            device=self.device, generator=g)
        if self.fmt == "fp8":
            raw &= 0xF7  # no NaN codes (0x7F / 0xFF), as formats.make_paged_cache
        self.cache = raw.view(cache_dtype(self.fmt)) if self.fmt == "fp8" else raw
        self.num_rows = c.cache_blocks * c.block_size
        self.generator = g
        self.impl = StandInImpl(kv_cache_dtype=self.fmt)
        self.layer = StandInLayer()
        self.buffers = make_buffers(max(c.rows), c.heads, c.width, self.device, lse=c.dcp > 1)
        self._cores: dict[str, Any] = {}

    def _core(self, kernel: str) -> Any:
        from vllm_kimi_dsa.core import FlashInferCore

        if kernel not in self._cores:
            c = self.config
            self._cores[kernel] = FlashInferCore(
                self.impl, self.layer, c.heads, self.buffers, {r: kernel for r in c.rows},
                dcp=c.dcp, rank=0, kv_cache_dtype=self.fmt,
            )
        return self._cores[kernel]

    def __call__(self, kernel: str, rows: int, config: TuneConfig) -> float:
        import torch

        from vllm_kimi_dsa.formats import HEAD_DIM

        c, dev, g = config, self.device, self.generator
        core = self._core(kernel)
        valid = -(-c.width // c.dcp)  # a DCP rank sees about K / dcp of a row's ids
        sets = min(self.max_sets, rotation_sets(rows * valid * self.row_bytes))
        calls = []
        for s in range(sets):
            q = (torch.randn((rows, c.heads, HEAD_DIM), device=dev, generator=g) * 4).to(torch.float8_e4m3fn)
            slots = torch.randint(0, self.num_rows, (rows, c.width), dtype=torch.int32, device=dev, generator=g)
            slots[:, valid:] = -1
            counts = torch.full((rows,), valid, dtype=torch.int32, device=dev)
            window = self.cache[s * self.shift_blocks: s * self.shift_blocks + c.cache_blocks]
            calls.append(lambda q=q, w=window, sl=slots, n=counts: core.decode(q, w, sl, n, c.block_size))
        if dev.type == "cuda":
            return cuda_graph_time_us(calls, reps_time_s=c.reps_time_s)
        return wall_time_us(calls)


# ---------------------------------------------------------------- tune


def _progress(items: list[tuple[str, int]], enabled: bool) -> Iterable[tuple[str, int]]:
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a bench extra; without it, one line per point
        return _plain_progress(items)
    return tqdm(items, desc="tune", unit="point", file=sys.stderr)


def _plain_progress(items: list[tuple[str, int]]) -> Iterable[tuple[str, int]]:
    for i, item in enumerate(items):
        print(f"tune {i + 1}/{len(items)}: {item[0]} rows={item[1]}", file=sys.stderr, flush=True)
        yield item


def _machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        from importlib.metadata import version

        info["flashinfer"] = version("flashinfer-python")
    except Exception:  # not installed: the table then only holds triton
        info["flashinfer"] = None
    info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return info


def _existing(path: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The topologies (and their metadata) an existing table file already holds; a fresh file -> empty."""
    from vllm_kimi_dsa.selection import TOPOLOGIES

    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}, {}
    if not isinstance(data, dict):
        return {}, {}
    specs = {k: v for k, v in data.items() if k in TOPOLOGIES and isinstance(v, str)}
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
    return specs, {k: v for k, v in meta.items() if k in TOPOLOGIES}


def default_kernels(kv_cache_dtype: str, device: str) -> tuple[str, ...]:
    """Kernels this machine runs for the format: selection.fi_kernels minus "sparse", plus "triton" where Triton runs."""
    from vllm_kimi_dsa.selection import KERNELS, fi_kernels, triton_runs

    import torch

    dev = torch.device(device)
    found = [k for k in fi_kernels(kv_cache_dtype, device=dev) if k in KERNELS]
    if "triton" not in found and triton_runs(dev):
        found.append("triton")
    return tuple(k for k in KERNELS if k in found)


def tune(
    rows: Sequence[int] = DEFAULT_ROWS,
    *,
    heads: int = 128,
    kv_cache_dtype: str = "fp8",
    dcp: int = 1,
    width: int = 2048,
    out: str | os.PathLike[str] | None = "kernel_table.json",
    kernels: Sequence[str] | None = None,
    measure: Measure | None = None,
    allow_cpu: bool = False,
    cache_blocks: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Measure `kernels` (default: all this machine runs) at every batch size; write the fastest as a table.

    rows: batch sizes to time (positive ints). heads: query heads per rank (1..128).
    width: top-k K (multiple of 128). dcp: 1 -> the "tp" spec, > 1 -> the "dcp" spec.
    out: the table file (an existing file keeps its other topology); None writes nothing.
    measure: (kernel, rows, TuneConfig) -> µs; default CoreTimer (FlashInferCore.decode in CUDA graphs).
    allow_cpu: without a CUDA GPU, run anyway (Triton interpreter, tiny sizes: for tests).
    Returns {"topology", "spec", "choices" {rows: kernel}, "us" {kernel: {rows: µs}},
    "errors" {kernel: {rows: message}}, "kernels", "meta", "path"}.
    """
    import torch

    from vllm_kimi_dsa.selection import KERNELS, save_kernel_table
    from vllm_kimi_dsa.formats import normalize_format

    rows_t = tuple(sorted(set(int(r) for r in rows)))
    if not rows_t or rows_t[0] < 1:
        raise ValueError(f"rows must be positive batch sizes, got {tuple(rows)}")
    check_width(width, "width")
    if dcp < 1:
        raise ValueError(f"dcp must be >= 1, got {dcp}")
    fmt = normalize_format(kv_cache_dtype)
    gpu = torch.cuda.is_available()
    if not gpu and not allow_cpu:
        raise ValueError("no CUDA GPU: tune times kernels on a GPU (allow_cpu=True / --allow-cpu runs tiny sizes "
                         "in the Triton interpreter, for tests)")
    device = "cuda" if gpu else "cpu"
    config = TuneConfig(rows=rows_t, heads=int(heads), width=int(width), kv_cache_dtype=fmt, dcp=int(dcp),
                        device=device, cache_blocks=cache_blocks or (4096 if gpu else 8))
    names = tuple(kernels) if kernels is not None else default_kernels(fmt, device)
    bad = [k for k in names if k not in KERNELS]
    if bad:
        raise ValueError(f"kernels {bad} are not ones this package runs; expected names in {KERNELS}")
    if not names:
        raise ValueError(f"no kernel runs {fmt} on this machine ({device})")
    timer: Measure = measure if measure is not None else CoreTimer(config)

    us: dict[str, dict[int, float]] = {k: {} for k in names}
    errors: dict[str, dict[int, str]] = {}
    points = [(k, r) for k in names for r in rows_t]
    for kernel, r in _progress(points, progress):
        try:
            us[kernel][r] = float(timer(kernel, r, config))
        except Exception as err:  # one kernel failing at one size must not lose the rest of the run
            errors.setdefault(kernel, {})[r] = f"{type(err).__name__}: {err}"[:500]
    choices = fastest(us, rows_t)
    if not choices:
        raise RuntimeError(f"no kernel could be measured; errors: {errors}")
    spec = merge_spec(choices)
    meta = {
        **_machine(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "config": {k: v for k, v in asdict(config).items()},
        "kernels": list(names),
        "choices": {str(r): k for r, k in choices.items()},
        "us": {k: {str(r): round(t, 3) for r, t in v.items()} for k, v in us.items()},
        "errors": {k: {str(r): m for r, m in v.items()} for k, v in errors.items()},
        "timing": "median of CUDA-graph replays, per decode call" if gpu else "host wall clock (CPU, not a timing)",
    }
    result: dict[str, Any] = {
        "topology": config.topology, "spec": spec, "choices": choices, "us": us, "errors": errors,
        "kernels": names, "meta": meta, "path": None,
    }
    if out is not None:
        path = Path(out)
        specs, old_meta = _existing(path)
        specs[config.topology] = spec
        old_meta[config.topology] = meta
        save_kernel_table(path, specs, old_meta)
        result["path"] = str(path)
    return result


def _report(result: Mapping[str, Any]) -> str:
    names = list(result["us"])
    lines = [f"{'rows':>6} " + " ".join(f"{k + ' µs':>12}" for k in names) + f" {'pick':>10}"]
    for r in sorted({r for v in result["us"].values() for r in v}):
        cells = []
        for k in names:
            t = result["us"][k].get(r)
            cells.append(f"{t:12.2f}" if t is not None else f"{'-':>12}")
        lines.append(f"{r:>6} " + " ".join(cells) + f" {result['choices'].get(r, '-'):>10}")
    lines.append(f"{result['topology']}: {result['spec']}")
    return "\n".join(lines)


TUNE_DTYPES = ("fp8", "fp8_e4m3", "nvfp4_ds_mla")  # fp8_e4m3 is vLLM's alias of fp8
DESCRIPTION = "Time each decode kernel per batch size and write the kernel table (point VLLM_KIMI_DSA_KERNEL_TABLE at it)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """tune's options, on `p` (its own parser, or the `tune` subcommand of python -m vllm_kimi_dsa)."""
    p.add_argument("--rows", type=cli_types.batch_sizes, default=DEFAULT_ROWS, help="batch sizes, comma-separated")
    p.add_argument("--heads", type=cli_types.head_count, default=128,
                   help="query heads per rank (128 = TP1 padded, 12 = TP8)")
    p.add_argument("--kv-cache-dtype", default="fp8", choices=TUNE_DTYPES)
    p.add_argument("--dcp", type=cli_types.at_least_one, default=1,
                   help="decode context parallel size (> 1 tunes the 'dcp' table)")
    p.add_argument("--width", type=cli_types.top_k_width, default=None, help="top-k width (default 2048; 128 on a CPU)")
    p.add_argument("--kernels", type=cli_types.kernel_names, default=None,
                   help="comma-separated subset of the kernels to time")
    p.add_argument("--out", default="kernel_table.json", help="table file to write (other topology kept)")
    p.add_argument("--allow-cpu", action="store_true", help="run without a GPU (interpreter, tiny sizes; tests)")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace, error: Callable[[str], NoReturn]) -> int:
    """Run tune with parsed options; what cannot run here is a usage error (`error`: the parser's, exits 2)."""
    import torch

    gpu = torch.cuda.is_available()
    if not gpu:
        if not args.allow_cpu:
            error("no CUDA GPU here: tune times kernels on a GPU (--allow-cpu runs tiny sizes in the Triton "
                  "interpreter, for tests)")
        if os.environ.get("TRITON_INTERPRET") != "1":
            if "triton" in sys.modules:
                error("Triton was imported before TRITON_INTERPRET=1 could be set; set it in the environment")
            os.environ["TRITON_INTERPRET"] = "1"
    from vllm_kimi_dsa.formats import normalize_format

    fmt = normalize_format(args.kv_cache_dtype)
    runs_here = default_kernels(fmt, "cuda" if gpu else "cpu")
    if not runs_here:
        error(f"no kernel this package runs decodes {fmt} on this machine")
    if args.kernels is not None and not set(args.kernels) <= set(runs_here):
        error(f"argument --kernels: {','.join(k for k in args.kernels if k not in runs_here)} does not run {fmt} "
              f"on this machine; it runs {','.join(runs_here)}")
    width = args.width if args.width is not None else (2048 if gpu else 128)
    try:
        result = tune(list(args.rows), heads=args.heads, kv_cache_dtype=args.kv_cache_dtype, dcp=args.dcp,
                      width=width, out=args.out, kernels=list(args.kernels) if args.kernels else None,
                      allow_cpu=args.allow_cpu, progress=not args.no_progress)
    except (ValueError, TypeError, RuntimeError) as err:
        error(str(err))
    print(_report(result))
    for kernel, per_rows in result["errors"].items():
        for r, msg in per_rows.items():
            print(f"  {kernel} rows={r} failed: {msg}")
    print(f"wrote {result['path']}; use it with: export VLLM_KIMI_DSA_KERNEL_TABLE={result['path']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: python -m vllm_kimi_dsa tune [--rows 1,2,4] [--heads N] [--kv-cache-dtype fp8|nvfp4_ds_mla] [--dcp N] [--out PATH]."""
    p = argparse.ArgumentParser(prog="python -m vllm_kimi_dsa tune", description=DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(list(sys.argv[1:] if argv is None else argv)), p.error)


if __name__ == "__main__":
    sys.exit(main())
