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

from vllm_kimi_dsa import cli_types

PROG = "python -m vllm_kimi_dsa"
DEMO_BOUND = 2e-2  # the demo's relative L2 error bound vs the float32 reference

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


# ---------------------------------------------------------------- the parser


def _add_demo(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from vllm_kimi_dsa.selection import KERNELS

    p = sub.add_parser("demo", help="one synthetic K3.1 decode step through the core, checked against the reference",
                       description=run_demo.__doc__)
    p.add_argument("--layers", type=cli_types.at_least_one, default=3, help="DSA layers to run (one core each, shared buffers)")
    p.add_argument("--rows", type=cli_types.at_least_one, default=None,
                   help="decode tokens in the batch (default 20; 3 on a CPU)")
    p.add_argument("--heads", type=cli_types.head_count, default=None,
                   help="query heads per rank (128 = TP1 padded, 12 = TP8; default 128, 16 on a CPU)")
    p.add_argument("--width", type=cli_types.top_k_width, default=None,
                   help="top-k width, a multiple of 128 (K3.1: 2048, the default; 256 on a CPU)")
    p.add_argument("--kv-cache-dtype", default="fp8", choices=["fp8", "nvfp4_ds_mla"])
    p.add_argument("--kernel", default=None, choices=KERNELS,
                   help="force a kernel (one this machine runs; default: kernel_for's pick)")
    return p


def _add_tune(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from vllm_kimi_dsa import tune

    p = sub.add_parser("tune", help="time every kernel this machine runs per batch size, write the kernel table",
                       description=tune.DESCRIPTION)
    tune.add_arguments(p)
    return p


def _add_bench(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from vllm_kimi_dsa.bench import suite

    p = sub.add_parser("bench", help="the benchmark suite (a CUDA GPU; JSON under --out, vllm_kimi_dsa.bench.plot "
                       "draws it)", description=suite.__doc__.split("\n")[0])
    suite.add_arguments(p)
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    gpu = _interpret_without_gpu()
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    error = commands[args.command].error
    if args.command == "demo":
        return run_demo(args, gpu, error)
    if args.command == "tune":
        from vllm_kimi_dsa import tune

        return tune.run(args, error)
    from vllm_kimi_dsa.bench import serving, suite

    return suite.run(args, error, extra={"serving": (serving.points, serving.serving_section, serving.warm)})


if __name__ == "__main__":
    sys.exit(main())
