"""Every kernel form the Hopper dispatcher (TritonDecode) can launch, enumerated from the dispatcher itself, and each
compiled offline for sm_90a exactly as Triton's JIT compiles it at that launch (its own binder: the same arguments'
specializations -- an int of 1 becomes a constant, multiples of 16 get divisibility -- and the same options).

The dispatcher is built as on an H100 / H200 (Gluon available, 132 SMs) for every head count 1..128, both cache
formats, with and without the LSE, VLLM_KIMI_DSA_GLUON unset and 0 (the plain kernel), VLLM_KIMI_DSA_FP8_PV 0 and 1
and VLLM_KIMI_DSA_SCHEDULE static and counts; every plan of batch sizes 1..MAX_ROWS is called once with Triton's
launch recorded instead of run. Forms are keyed as the JIT keys its cache, so two launches with one key are one
compile. CPU tests compile every form (test_sm90_compile.py::test_every_served_form_compiles_for_sm90); the GPU smoke
part runs every form once against the float32 reference.

    python tests/served_forms.py [--compile] [--heads 64,128] [--shard I/N]   # (TRITON_INTERPRET unset)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

MAX_ROWS = 512  # vLLM's planned rows a step (the startup line's "planned rows 1-512")
WIDTH = 2048  # K3.1's / V3.2's index_topk; K is a multiple of 128 (one specialization for every width)
HOPPER_SMS = 132  # H100 SXM and H200
TARGET = GPUTarget("cuda", 90, 32)
FORMATS = ("fp8", "nvfp4_ds_mla")
GLUON_SWITCH = ("", "0")  # VLLM_KIMI_DSA_GLUON as served: unset (the verified Gluon kernels) and 0 (the plain kernel)
FP8_PV_SWITCH = ("0", "1")
SCHEDULE_SWITCH = ("static", "counts")


@dataclass
class Launch:
    """One recorded launch: the jit function, its arguments and grid, and where the dispatcher made it."""

    fn: Any
    args: tuple
    kwargs: dict
    grid: tuple
    where: dict = field(default_factory=dict)


@dataclass
class Form:
    """One compiled form: its JIT key, the first launch that made it, and every (setup, rows) that launches it."""

    key: str
    launch: Launch
    users: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.launch.fn.__name__


@contextlib.contextmanager
def recorded_launches(sink: list[Launch], run: bool = False) -> Iterator[None]:
    """Triton's launches (plain and Gluon jit functions) recorded into sink instead of compiled and run (run: and
    then compiled and run as usual)."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        sink.append(Launch(self, args, dict(kwargs), tuple(grid) if not callable(grid) else grid))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs) if run else None

    with mock.patch.object(JITFunction, "run", record):
        yield


@contextlib.contextmanager
def as_on_hopper(gluon: str, fp8_pv: str, schedule: str) -> Iterator[None]:
    """The dispatcher's view of an H100 / H200 on this machine: Gluon available, HOPPER_SMS SMs, the switches set."""
    from vllm_kimi_dsa import envs
    from vllm_kimi_dsa.backends.hopper import dispatch

    env = {envs.GLUON: gluon, envs.FP8_PV: fp8_pv, envs.SCHEDULE: schedule}
    with mock.patch.object(dispatch, "gluon_available", lambda device=None: True), \
            mock.patch.object(dispatch, "num_sms", lambda device: HOPPER_SMS), \
            mock.patch.dict(os.environ, env):
        yield


def _inputs(fmt: str, heads: int, rows: int, lse: bool) -> tuple[torch.Tensor, ...]:
    """Uninitialized operands of one call, shaped and typed as vLLM's (nothing runs on them)."""
    from vllm_kimi_dsa.formats import HEAD_DIM, LATENT_DIM, row_bytes

    query = torch.empty(rows, heads, HEAD_DIM, dtype=torch.float8_e4m3fn)
    kv = torch.empty(64, HEAD_DIM, dtype=torch.float8_e4m3fn) if fmt == "fp8" else \
        torch.empty(64, row_bytes(fmt), dtype=torch.uint8)
    slots = torch.zeros(rows, WIDTH, dtype=torch.int32)
    counts = torch.zeros(rows, dtype=torch.int32)
    out = torch.empty(rows, heads, LATENT_DIM, dtype=torch.bfloat16)
    return query, kv, slots, counts, out, (torch.empty(rows, heads) if lse else None)


def setups(heads_list: tuple[int, ...] = tuple(range(1, 129))) -> Iterator[dict]:
    """Every served (fmt, heads, lse, GLUON, FP8_PV, SCHEDULE); FP8_PV only changes fp8 above 32 heads."""
    from vllm_kimi_dsa.heads import FEW_HEADS_MAX

    for fmt in FORMATS:
        for heads in heads_list:
            for gluon in GLUON_SWITCH:
                pv_values = FP8_PV_SWITCH if fmt == "fp8" and heads > FEW_HEADS_MAX and gluon != "0" else ("0",)
                for fp8_pv in pv_values:
                    for lse in (False, True):
                        for schedule in SCHEDULE_SWITCH:
                            yield dict(fmt=fmt, heads=heads, lse=lse, gluon=gluon, fp8_pv=fp8_pv,
                                       schedule=schedule)


def dispatcher_launches(fmt: str, heads: int, lse: bool, gluon: str, fp8_pv: str, schedule: str,
                        max_rows: int = MAX_ROWS) -> list[Launch]:
    """The launches TritonDecode makes for one setup: one call for each distinct bound plan of rows 1..max_rows."""
    from vllm_kimi_dsa.backends.hopper import TritonDecode
    from vllm_kimi_dsa.kernels.base import DecodeSetup

    setup = DecodeSetup(device=torch.device("cpu"), fmt=fmt, heads=heads, row_counts=tuple(range(1, max_rows + 1)),
                        capacities=(), widths=(WIDTH,), return_lse=lse, softmax_scale=0.1, output_scale=1.0)
    launches: list[Launch] = []
    with as_on_hopper(gluon, fp8_pv, schedule):
        kernel = TritonDecode(setup)
        seen = set()
        for rows in range(1, max_rows + 1):
            whole, splits = kernel._plans[rows, WIDTH]
            first, tail = kernel.plan_params[rows, WIDTH]
            shape = (id(first), id(tail), bool(whole), whole == rows, splits > 1, kernel.plan_leads[rows, WIDTH] > 0)
            if shape in seen:
                continue
            seen.add(shape)
            sink: list[Launch] = []
            with recorded_launches(sink):
                kernel(*_inputs(fmt, heads, rows, lse), block_size=64, rows_per_block_stride=64)
            for launch in sink:
                launch.where = dict(fmt=fmt, heads=heads, lse=lse, gluon=gluon, fp8_pv=fp8_pv, schedule=schedule,
                                    rows=rows)
            launches += sink
    return launches


@functools.cache
def _binder(fn: Any) -> tuple[Any, Any]:
    """(backend, binder) of a jit function for TARGET, made once: Triton's own, as its JIT makes them per device."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(TARGET)
    return backend, create_function_from_signature(fn.signature, fn.params, backend)


def _binding(launch: Launch) -> tuple[Any, ...]:
    """Triton's own binding of a launch for TARGET: (backend, kwargs, bound args, specialization, options)."""
    backend, binder = _binder(launch.fn)
    kwargs = dict(launch.kwargs)
    kwargs.setdefault("debug", False)
    bound, specialization, options = binder(*launch.args, **kwargs)
    return backend, kwargs, bound, specialization, options


def form_key(launch: Launch) -> str:
    """The JIT's cache key of a launch on TARGET (its function, the arguments' specialization and the options)."""
    _, _, _, specialization, options = _binding(launch)
    return f"{launch.fn.__module__}.{launch.fn.__name__}|{specialization}|{options}"


def served_forms(heads_list: tuple[int, ...] = tuple(range(1, 129)), max_rows: int = MAX_ROWS) -> dict[str, Form]:
    """Every distinct form the dispatcher launches over setups(heads_list), by JIT key."""
    forms: dict[str, Form] = {}
    for s in setups(heads_list):
        for launch in dispatcher_launches(**s, max_rows=max_rows):
            key = form_key(launch)
            forms.setdefault(key, Form(key, launch)).users.append(launch.where)
    return forms


def compile_form(form: Form) -> Any:
    """Compile a form for sm_90a as the JIT would at its launch (Triton's compile, its ASTSource with the binder's
    signature, constexprs and attributes)."""
    from triton.compiler import ASTSource

    launch = form.launch
    backend, kwargs, bound, specialization, options = _binding(launch)
    fn = launch.fn
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    source_cls = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source_cls
    return triton.compile(source_cls(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def describe(form: Form) -> dict:
    """A form in a line of JSON: the kernel, its constexprs, the int arguments specialized to 1, and its users."""
    users = form.users
    heads = sorted({u["heads"] for u in users})
    return dict(kernel=form.name, heads=f"{heads[0]}..{heads[-1]}" if len(heads) > 1 else heads[0],
                users=len(users), first=form.launch.where,
                constexprs={k: v for k, v in form.launch.kwargs.items() if k != "num_warps" and not callable(v)},
                specialization=form.key.split("|")[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=lambda s: tuple(int(x) for x in s.split(",")), default=tuple(range(1, 129)))
    ap.add_argument("--max-rows", type=int, default=MAX_ROWS)
    ap.add_argument("--compile", action="store_true", help="compile every form for sm_90a (no GPU needed)")
    ap.add_argument("--shard", type=lambda s: tuple(int(x) for x in s.split("/")), default=(0, 1),
                    help="I/N: only the forms i with i %% N == I (N processes compile in parallel)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    forms = served_forms(args.heads, args.max_rows)
    shard, shards = args.shard
    failed = 0
    for form in list(forms.values())[shard::shards]:
        line = describe(form)
        if args.compile:
            t0 = time.perf_counter()
            try:
                compile_form(form)
                line["compiled"] = "ok"
            except Exception as e:  # noqa: BLE001 - reported per form, the exit status says any failed
                failed += 1
                line["compiled"] = f"FAILED: {type(e).__name__}: {str(e)[-300:]}"
            line["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(line, default=str), flush=True)
    print(json.dumps({"forms": len(forms), "shard": f"{shard}/{shards}", "failed": failed,
                      "triton": triton.__version__}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
