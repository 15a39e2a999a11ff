#!/usr/bin/env python3
"""Link the prefill peer's torch extension from the prebuilt sm_90a objects (build_objs.sh) and the generated API
(make_api.py), against whatever torch runs it (the device's); ~30-60 s: one host .cpp compile plus the link.

    python3 build_ext.py HARNESS_DIR BUILD_DIR      (HARNESS_DIR: objs/ and api_prefill.cpp, FlashMLA's tree beside
                                                     it as ../flashmla; prints the built .so's path last)
As a module: load_ext(harness_dir, build_dir) -> the extension (sparse_prefill_fwd).
"""

from __future__ import annotations

import os
import sys
import time

NAME = "flash_mla_sm90_sparse_prefill"
OBJS = ("phase1_k576_topklen.o", "phase1_k576.o")


def include_dirs(root: str) -> list[str]:
    inc = [f"{root}/csrc", f"{root}/csrc/kerutils/include", f"{root}/csrc/sm90", f"{root}/csrc/cutlass/include",
           f"{root}/csrc/cutlass/tools/util/include"]
    # ATen/cuda/CUDAContext.h includes cusparse.h / cublas_v2.h / cusolverDn.h: where CUDA_HOME lacks them, take them
    # from the nvidia-* pip packages torch depends on.
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "include", "cusparse.h")):
        try:
            import nvidia

            for base in nvidia.__path__:
                for sub in ("cu13/include", "cusparse/include", "cublas/include", "cusolver/include"):
                    if os.path.isdir(os.path.join(base, sub)):
                        inc.append(os.path.join(base, sub))
        except ImportError:
            pass
    return inc


def load_ext(harness_dir: str, build_dir: str, verbose: bool = False):
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")  # no .cu source here; set so a GPU-less machine links too
    from torch.utils.cpp_extension import load

    harness_dir = os.path.abspath(harness_dir)
    root = os.path.join(os.path.dirname(harness_dir), "flashmla")
    api = os.path.join(harness_dir, "api_prefill.cpp")
    objs = [os.path.join(harness_dir, "objs", o) for o in OBJS]
    missing = [p for p in [api, os.path.join(root, "csrc"), *objs] if not os.path.exists(p)]
    if missing:
        raise FileNotFoundError(f"prefill peer harness incomplete (run prepare.sh): missing {missing}")
    os.makedirs(build_dir, exist_ok=True)
    cflags = ["-O3", "-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"]
    return load(name=NAME, sources=[api], extra_cflags=cflags, extra_ldflags=objs,
                extra_include_paths=include_dirs(root), build_directory=build_dir, with_cuda=True, verbose=verbose)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    t0 = time.time()
    ext = load_ext(sys.argv[1], sys.argv[2], verbose=True)
    print(f"built+loaded in {time.time() - t0:.1f}s", flush=True)
    print(ext.__file__, flush=True)
