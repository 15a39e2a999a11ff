"""`python -m vllm_kimi_dsa demo|tune|bench`: a synthetic K3.1 decode step through the core, measure the kernel table,
or run the benchmark suite.

On a machine without a CUDA GPU the demo runs small, in Triton's interpreter, and says so; `bench` needs a GPU.
A bad value is a usage error (usage, the message, exit status 2), found before anything runs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Callable, NoReturn

PROG = "python -m vllm_kimi_dsa"
DEMO_BOUND = 2e-2  # the demo's relative L2 error bound vs the float32 reference
TUNE_DTYPES = ("fp8", "fp8_e4m3", "nvfp4_ds_mla")  # what tune.main accepts (fp8_e4m3 is vLLM's alias of fp8)

ErrorFn = Callable[[str], NoReturn]


def _gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


def _interpret_without_gpu() -> bool:
    """Whether a CUDA GPU is here; without one, set TRITON_INTERPRET=1.

    Triton reads it when first imported, and checking the options already imports the kernels
    (the head counts, the kernels this machine runs), so it is set before the parser is built.
    """
    gpu = _gpu_present()
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return gpu


# ---------------------------------------------------------------- option types (argparse `type=`)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None


def _at_least_one(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _head_count(text: str) -> int:
    from vllm_kimi_dsa.heads import SUPPORTED_HEADS

    value = _int(text)
    if value not in SUPPORTED_HEADS:
        raise argparse.ArgumentTypeError(f"must be one of {SUPPORTED_HEADS} (K3.1's heads per rank), got {value}")
    return value


def _top_k_width(text: str) -> int:
    value = _int(text)
    if value < 128 or value % 128:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 128, got {value}")
    return value


def _kernel_names(text: str) -> tuple[str, ...]:
    from vllm_kimi_dsa.selection import KERNELS

    names = tuple(k for k in text.split(",") if k)  # split as tune.main splits it, so both see the same names
    bad = [k for k in names if k not in KERNELS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected comma-separated names among {KERNELS}, got {text!r}")
    return names


# ---------------------------------------------------------------- the parser


def _add_demo(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from vllm_kimi_dsa.selection import KERNELS

    p = sub.add_parser("demo", help="one synthetic K3.1 decode step through the core, checked against the reference",
                       description=run_demo.__doc__)
    p.add_argument("--layers", type=_at_least_one, default=3, help="DSA layers to run (one core each, shared buffers)")
    p.add_argument("--rows", type=_at_least_one, default=None,
                   help="decode tokens in the batch (default 20; 3 on a CPU)")
    p.add_argument("--heads", type=_head_count, default=None,
                   help="query heads per rank (128 = TP1 padded, 12 = TP8; default 128, 16 on a CPU)")
    p.add_argument("--width", type=_top_k_width, default=None,
                   help="top-k width, a multiple of 128 (K3.1: 2048, the default; 256 on a CPU)")
    p.add_argument("--kv-cache-dtype", default="fp8", choices=["fp8", "nvfp4_ds_mla"])
    p.add_argument("--kernel", default=None, choices=KERNELS,
                   help="force a kernel (one this machine runs; default: kernel_for's pick)")
    return p


def _add_tune(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    # The options of tune.main's own parser, with their values checked here (tune.main then runs them): test_cli
    # holds the two option sets equal.
    from vllm_kimi_dsa import bench

    p = sub.add_parser("tune", help="time every kernel this machine runs per batch size, write the kernel table",
                       description="Time each decode kernel per batch size and write the kernel table "
                                   "(point VLLM_KIMI_DSA_KERNEL_TABLE at it).")
    p.add_argument("--rows", type=bench.batch_sizes, default=None, help="batch sizes, comma-separated")
    p.add_argument("--heads", type=_head_count, default=128, help="query heads per rank (128 = TP1 padded, 12 = TP8)")
    p.add_argument("--kv-cache-dtype", default="fp8", choices=TUNE_DTYPES)
    p.add_argument("--dcp", type=_at_least_one, default=1,
                   help="decode context parallel size (> 1 tunes the 'dcp' table)")
    p.add_argument("--width", type=_top_k_width, default=None, help="top-k width (default 2048; 128 on a CPU)")
    p.add_argument("--kernels", type=_kernel_names, default=None, help="comma-separated subset of the kernels to time")
    p.add_argument("--out", default="kernel_table.json", help="table file to write (other topology kept)")
    p.add_argument("--allow-cpu", action="store_true", help="run without a GPU (interpreter, tiny sizes; tests)")
    p.add_argument("--no-progress", action="store_true")
    return p


def _add_bench(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from vllm_kimi_dsa import bench

    p = sub.add_parser("bench", help="the benchmark suite (a CUDA GPU; JSON under --out, benchmarks/plot.py draws it)",
                       description=bench.__doc__.split("\n")[0])
    bench.add_arguments(p)
    return p


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The CLI's parser and its commands' parsers (each command reports its errors with its own usage)."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="{demo,tune,bench}")
    commands = {"demo": _add_demo(sub), "tune": _add_tune(sub), "bench": _add_bench(sub)}
    return p, commands


# ---------------------------------------------------------------- commands


def run_demo(args: argparse.Namespace, gpu: bool, error: ErrorFn) -> int:
    """Run a synthetic K3.1 decode step through FlashInferCore, layer by layer, and compare each with the float32
    reference. On a machine without a CUDA GPU it runs small, in Triton's interpreter."""
    import torch

    from vllm_kimi_dsa.core import FlashInferCore
    from vllm_kimi_dsa.selection import KERNELS, fi_kernels, kernel_for
    from vllm_kimi_dsa.formats import LATENT_DIM
    from vllm_kimi_dsa.reference import reference_decode
    from vllm_kimi_dsa.synthetic import StandInImpl, StandInLayer, make_buffers, make_step

    device = torch.device("cuda" if gpu else "cpu")
    # `is None`, not `or`: a value given is a value checked (the parser refuses 0), never swapped for a default.
    rows = (20 if gpu else 3) if args.rows is None else args.rows
    heads = (128 if gpu else 16) if args.heads is None else args.heads
    width = (2048 if gpu else 256) if args.width is None else args.width
    fmt = args.kv_cache_dtype
    available = fi_kernels(fmt, device=device)
    runs_here = tuple(k for k in KERNELS if k in available)  # "sparse" is the model's kernel, not one the core runs
    if not runs_here:
        error(f"no kernel this package runs decodes {fmt} on this machine ({device.type})")
    if args.kernel is not None and args.kernel not in runs_here:
        error(f"argument --kernel: {args.kernel} does not run {fmt} on this machine; it runs {runs_here}")
    try:
        # A forced kernel goes through kernel_for too: it refuses a head count the kernel cannot take.
        kernel = kernel_for(rows, 1, runs_here if args.kernel is None else (args.kernel,), heads)
    except ValueError as err:
        error(f"argument --heads: {err}")

    where = torch.cuda.get_device_name() if gpu else "CPU (no CUDA GPU): Triton interpreter, small shapes"
    print(f"device: {where}")
    print(f"kernels this machine runs for {fmt}: {available}; picked for {rows} rows: {kernel}")
    print(f"shapes: rows={rows} heads={heads} latent={LATENT_DIM} rope=64 top-k={width} layers={args.layers}")

    impl = StandInImpl(kv_cache_dtype=fmt)
    buffers = make_buffers(rows, heads, width, device)
    # One all-(-1) row exercises count 0, but only beside rows that check something: a lone row stays full.
    empty_rows = min(1, rows - 1)
    print(f"{'layer':>5} {'kernel':>8} {'ms':>9} {'max |err|':>10} {'rel L2 err':>10} {'lse err':>9} {'count-0 rows':>12}")
    rels: list[float] = []
    for layer_id in range(args.layers):
        layer = StandInLayer(_q_scale_float=0.05 + 0.01 * layer_id, _k_scale_float=0.02)
        core = FlashInferCore(impl, layer, heads, buffers, {rows: kernel}, kv_cache_dtype=fmt)
        step = make_step(rows, heads, width, fmt, device=device, empty_rows=empty_rows, seed=layer_id)
        core.run(step.query, step.cache, step.topk, step.metadata)  # warm-up (compiles)
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, lse = core.run(step.query, step.cache, step.topk, step.metadata)
        if gpu:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        kv_rows, _ = core.rows(step.cache, step.metadata.block_size)
        slots, counts = buffers[0][:rows], buffers[1][:rows]
        ref_out, ref_lse = reference_decode(
            step.query, kv_rows, slots, counts,
            fmt=core.fmt, softmax_scale=core.softmax_scale, output_scale=core.output_scale,
        )
        err = (out.float() - ref_out).abs().max().item()
        rel = ((out.float() - ref_out).norm() / ref_out.norm()).item()
        finite = torch.isfinite(ref_lse)
        lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if lse is not None else float("nan")
        empty = int((counts == 0).sum())
        rels.append(rel)
        print(f"{layer_id:>5} {kernel:>8} {ms:>9.3f} {err:>10.3e} {rel:>10.3e} {lse_err:>9.2e} {empty:>12}")
    # NaN-safe: a NaN error (nothing compared, or a NaN output) is a failure, not a pass.
    ok = all(math.isfinite(r) and r < DEMO_BOUND for r in rels)
    worst = max(rels, key=lambda r: r if math.isfinite(r) else math.inf)
    print(f"{'OK' if ok else 'FAIL'}: rows={rows} layers={len(rels)}, worst relative L2 error vs the float32 "
          f"reference {worst:.2e} (bound {DEMO_BOUND:g})")
    return 0 if ok else 1


def run_tune(args: argparse.Namespace, rest: list[str], gpu: bool, error: ErrorFn) -> int:
    """Refuse what tune cannot run here as a usage error, then hand the (checked) command line to tune.main."""
    from vllm_kimi_dsa.formats import normalize_format
    from vllm_kimi_dsa.tune import default_kernels, main as tune_main

    if not gpu and not args.allow_cpu:
        error("no CUDA GPU here: tune times kernels on a GPU (--allow-cpu runs tiny sizes in the Triton "
              "interpreter, for tests)")
    fmt = normalize_format(args.kv_cache_dtype)
    runs_here = default_kernels(fmt, "cuda" if gpu else "cpu")
    if not runs_here:
        error(f"no kernel this package runs decodes {fmt} on this machine")
    if args.kernels is not None and not set(args.kernels) <= set(runs_here):
        error(f"argument --kernels: {','.join(k for k in args.kernels if k not in runs_here)} does not run {fmt} "
              f"on this machine; it runs {','.join(runs_here)}")
    return tune_main(rest)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    gpu = _interpret_without_gpu()
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    error = commands[args.command].error
    if args.command == "demo":
        return run_demo(args, gpu, error)
    if args.command == "tune":
        # The top-level parser takes no values, so the first "tune" is the command and what follows is tune's.
        return run_tune(args, argv[argv.index("tune") + 1:], gpu, error)
    from vllm_kimi_dsa import bench

    return bench.run(args, error)


if __name__ == "__main__":
    sys.exit(main())
