"""The suite's Hopper peers, each run as a child (`python -m vllm_kimi_dsa.bench.peers.<peer> --build ...`) that
builds and checks it while our kernels are measured: fa3 (FlashInfer's SM90 MLA), flashmla (FlashMLA's sparse FP8
decode), flashmla_prefill (FlashMLA's sparse prefill).

FlashMLA's harnesses are not part of the package: prepare scripts (`/work/shared/device/flashmla-sm90/prepare.sh`,
`benchmarks/peers/flashmla_prefill/prepare.sh`) unpack them into a `.carry/` folder. A peer finds its harness through
its option (--flashmla, --flashmla-prefill), its environment variable, else `.carry/<harness>` under the current
directory (CARRY, where the device runner runs); it builds the extension by running the harness's own build_ext.py
and loads what that built with `load_extension`.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

CARRY = Path(".carry")  # the prepare scripts' default destination, relative to the current directory


def load_extension(name: str, so_path: str | Path) -> ModuleType:
    """A compiled extension module (a built .so, not Python source) loaded from its file; torch imported first.

    The one place the package loads a module from a path: a peer's extension is built at run time, outside any
    package (torch.utils.cpp_extension's build folder)."""
    import torch  # noqa: F401  (the extension links against libtorch)

    spec = importlib.util.spec_from_file_location(name, str(so_path))
    if spec is None or spec.loader is None:
        raise ImportError(f"{so_path} is not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_build_script(script: Path, *args: str) -> str:
    """Run a harness's build_ext.py in a child process (python3 build_ext.py ARGS...) and return its output; a
    failed build raises RuntimeError with the output's tail."""
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{script} exited {proc.returncode}: {out[-1500:]}")
    return proc.stdout


__all__ = ["CARRY", "load_extension", "run_build_script"]
