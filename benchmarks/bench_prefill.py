#!/usr/bin/env python3
"""The bench's prefill section alone on one GPU: ceilings, our LayerStep, FlashMLA's sparse prefill (bench_prefill).

    python3 benchmarks/bench_prefill.py --out DIR [--quick] [--no-peer] [--flashmla-prefill DIR]
            [--cases 1x4096,4x1024] [--heads 128,16] [--reps N]

Writes DIR/bench_prefill.json (info, ceilings, the section) first, then DIR/bench_prefill.md (the table). The peer
is built in the background from the harness benchmarks/peers/flashmla_prefill/prepare.sh makes (.carry/
flashmla_prefill, or --flashmla-prefill / $FLASHMLA_PREFILL_DIR; $FLASHMLA_PREFILL_SO: a built extension).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from vllm_kimi_dsa import bench, bench_prefill as bp  # noqa: E402


def _cases(text: str) -> tuple[tuple[int, int], ...]:
    try:
        out = tuple((int(a), int(b)) for a, b in (c.lower().split("x") for c in text.split(",") if c))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected REQUESTSxTOKENS[,...], e.g. 1x4096,4x1024; got {text!r}") from None
    if not out or any(a < 1 or b < 1 for a, b in out):
        raise argparse.ArgumentTypeError(f"expected positive REQUESTSxTOKENS, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="5 reps, 1 warm-up, quick ceilings")
    ap.add_argument("--no-peer", action="store_true", help="skip FlashMLA's sparse prefill")
    ap.add_argument("--flashmla-prefill", default=None, help="the peer's harness folder (default "
                    "$FLASHMLA_PREFILL_DIR, else the checkout's .carry/flashmla_prefill)")
    ap.add_argument("--cases", type=_cases, default=bp.CASES, help="REQUESTSxTOKENS,... (default 1x4096,4x1024)")
    ap.add_argument("--heads", type=lambda s: tuple(int(h) for h in s.split(",") if h), default=bp.HEADS)
    ap.add_argument("--max-rows", type=int, default=bp.MAX_ROWS, help="LayerStep's planned rows (vLLM's)")
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    build, note = (None, "skipped (--no-peer)") if args.no_peer else bp.start_peer_build(args.flashmla_prefill,
                                                                                           args.heads)
    print(f"peer: {note}", flush=True)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    import triton

    ceil = bench.ceilings(dev, True)
    info = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "argv": sys.argv[1:], "peer": note, "ceilings": ceil,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    print(json.dumps(info), flush=True)
    reps = args.reps or (5 if args.quick else 10)
    warmup = 1 if args.quick else 2
    # ours first (the peer's build overlaps it), then the peer on the same data
    section = bp.prefill_suite(dev, ceil, build, cases=args.cases, heads=args.heads, max_rows=args.max_rows,
                               reps=reps, warmup=warmup, log=lambda m: print(m, flush=True))
    info["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "bench_prefill.json").write_text(json.dumps({"info": info, "prefill": section}, indent=1, default=str))
    table = bp.prefill_table(section)
    (out / "bench_prefill.md").write_text(f"# Prefill on {props.name}\n\n{table}\n")
    print(table, flush=True)
    print(f"failures: {len(section['failures'])}; wall {info['wall_s']} s; wrote {out / 'bench_prefill.json'}",
          flush=True)
    return 0 if not section["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
