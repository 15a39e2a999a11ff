"""`python -m vllm_kimi_dsa demo|tune`: a synthetic K3.1 decode step through the core, or measure the kernel table.

On a machine without a CUDA GPU the demo runs small, in Triton's interpreter, and says so.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


def demo(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_kimi_dsa demo", description=demo.__doc__)
    p.add_argument("--layers", type=int, default=3, help="DSA layers to run (one core each, shared buffers)")
    p.add_argument("--rows", type=int, default=None, help="decode tokens in the batch")
    p.add_argument("--heads", type=int, default=None, help="query heads per rank (128 = TP1 padded, 12 = TP8)")
    p.add_argument("--width", type=int, default=None, help="top-k width (K3.1: 2048)")
    p.add_argument("--kv-cache-dtype", default="fp8", choices=["fp8", "nvfp4_ds_mla"])
    p.add_argument("--kernel", default=None, help="force a kernel (prims_ts, trtllm, triton)")
    args = p.parse_args(argv)

    gpu = _gpu_present()
    if not gpu:
        # Triton must see this before it is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from vllm_kimi_dsa.core import FlashInferCore
    from vllm_kimi_dsa.dispatch import fi_kernels, kernel_for
    from vllm_kimi_dsa.formats import LATENT_DIM
    from vllm_kimi_dsa.reference import reference_decode
    from vllm_kimi_dsa.synthetic import StandInImpl, StandInLayer, make_buffers, make_step

    device = torch.device("cuda" if gpu else "cpu")
    rows = args.rows or (20 if gpu else 3)
    heads = args.heads or (128 if gpu else 16)
    width = args.width or (2048 if gpu else 256)
    where = torch.cuda.get_device_name() if gpu else "CPU (no CUDA GPU): Triton interpreter, small shapes"
    print(f"device: {where}")
    available = fi_kernels(args.kv_cache_dtype, device=device)
    kernel = args.kernel or kernel_for(rows, 1, available, heads)
    print(f"kernels this machine runs for {args.kv_cache_dtype}: {available}; picked for {rows} rows: {kernel}")
    print(f"shapes: rows={rows} heads={heads} latent={LATENT_DIM} rope=64 top-k={width} layers={args.layers}")

    impl = StandInImpl(kv_cache_dtype=args.kv_cache_dtype)
    buffers = make_buffers(rows, heads, width, device)
    print(f"{'layer':>5} {'kernel':>8} {'ms':>9} {'max |err|':>10} {'rel L2 err':>10} {'lse err':>9} {'count-0 rows':>12}")
    worst = 0.0
    for layer_id in range(args.layers):
        layer = StandInLayer(_q_scale_float=0.05 + 0.01 * layer_id, _k_scale_float=0.02)
        core = FlashInferCore(impl, layer, heads, buffers, {rows: kernel}, kv_cache_dtype=args.kv_cache_dtype)
        step = make_step(rows, heads, width, args.kv_cache_dtype, device=device, empty_rows=1, seed=layer_id)
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
        worst = max(worst, rel)
        print(f"{layer_id:>5} {kernel:>8} {ms:>9.3f} {err:>10.3e} {rel:>10.3e} {lse_err:>9.2e} {empty:>12}")
    ok = worst < 2e-2
    print(f"{'OK' if ok else 'FAIL'}: worst relative L2 error vs the float32 reference {worst:.2e} (bound 2e-2)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in {"-h", "--help"}:
        print(__doc__)
        print("commands: demo [--layers N --rows R --heads H --width K --kv-cache-dtype fp8|nvfp4_ds_mla]; tune --help")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        return demo(rest)
    if command == "tune":
        from vllm_kimi_dsa.tune import main as tune_main

        return tune_main(rest)
    print(f"unknown command {command!r}; expected demo or tune", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
