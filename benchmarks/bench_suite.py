#!/usr/bin/env python3
"""One-GPU benchmark of the sparse MLA decode: a thin wrapper of `vllm_kimi_dsa.bench` (python -m vllm_kimi_dsa bench).

The suite itself lives in the package so an installed vllm_kimi_dsa runs it; this script keeps the old command line
and the old import (`from bench_suite import ceilings`, used by the other benchmarks and tests/test_bench_tools.py).

    PYTHONPATH=. python3 benchmarks/bench_suite.py --out DIR [--quick] [--no-peer]
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from anywhere without an install
sys.path.insert(0, str(HERE))  # peer_fa3, as before

from vllm_kimi_dsa.bench import *  # noqa: E402,F401,F403  (every public name of the suite, as before the move)
from vllm_kimi_dsa.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="bench_suite.py"))
