#!/usr/bin/env python3
"""Every kernel configuration TritonDecode ships, enumerated from its plan tables and compiled offline for sm_90.

`plans OUT.json`: TritonDecode's plan tables (plans, plan_params, leads, config) for every heads x format x width x
rows, with the Gluon kernels available (Hopper, 132 SMs) and without (the plain `tl` kernel), plus the distinct
compile specs they launch. `sass DIR`: one SASS file per spec (instructions only) and the combines.
`compare A.json B.json`: equal plan tables, or the first differences. No GPU needed:

    /tmp/t36/bin/python tools/sass_shipped.py sass /tmp/sass-36   # PYTHONPATH=. for the package
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

HEADS = (128, 96, 64, 32, 16, 12)
FORMATS = ("fp8", "nvfp4_ds_mla")
WIDTHS = tuple(range(128, 4097, 128))
MAX_ROWS = 1024
SMS = 132  # H100 SXM / H200

SIGNATURE = dict(
    q_ptr="*fp8e4nv", kv_ptr="*fp8e4nv", slots_ptr="*i32", counts_ptr="*i32", out_ptr="*bf16", lse_ptr="*fp32",
    part_out_ptr="*fp16", part_lse_ptr="*fp32", H="i32", K="i32", num_splits="i32", lead_tiles="i32",
    stride_q_row="i32", stride_q_head="i32", stride_kv="i32", stride_s_row="i32", stride_o_row="i32",
    stride_o_head="i32", stride_lse_row="i32", qk_scale="fp32", out_scale="fp32",
)


# ----------------------------------------------------------------------------- the package, old layout or new


def _api():
    """(TritonDecode, the module holding num_sms, a function patching Gluon availability, describe(params))."""
    try:
        from vllm_kimi_dsa.backends.hopper import dispatch as hop

        def patch_gluon(on: bool) -> None:
            hop.gluon_available = (lambda device=None: True) if on else (lambda device=None: False)

        return hop.TritonDecode, hop, patch_gluon
    except ImportError:
        from vllm_kimi_dsa.kernels import gluon_decode as gd
        from vllm_kimi_dsa.kernels import triton_decode as td

        def patch_gluon(on: bool) -> None:
            gd.gluon_available = (lambda device=None: True) if on else (lambda device=None: False)

        return td.TritonDecode, td, patch_gluon


def describe(params) -> dict | None:
    """A params / Config object as {kind, its fields}: the same before and after a refactor that keeps the values
    (fields no shipped value uses, deleted since, are dropped when they hold their only shipped value)."""
    if params is None:
        return None
    fields = dataclasses.asdict(params)
    # fields removed with the variants nobody shipped (x_sync 2, handoff 0, stream/split_producer/nvfp4 folded)
    return {"kind": type(params).__name__, **_drop_retired(fields)}


# fields deleted with the variants no shipped plan chose, at the one value every shipped object held; `imprecise`
# at any value: every fp8 config held 0 and the nvfp4 kernel never read it
RETIRED = (("x_sync", 2), ("handoff", 0), ("stream", False), ("split_producer", True), ("qk_f16", False),
           ("tail_split", True), ("ptx", True), ("imprecise", None))


def _drop_retired(obj):
    if isinstance(obj, dict):
        return {k: _drop_retired(v) for k, v in obj.items()
                if not any(k == name and (only is None or v == only) for name, only in RETIRED)}
    if isinstance(obj, list):
        return [_drop_retired(v) for v in obj]
    return obj


def _label(params, fmt: str, heads: int) -> str:
    """A stable file-name label for the kernel a params object runs."""
    kind = type(params).__name__
    if params is None:
        return "tl"
    if kind == "GluonParams":
        return "gluon64"
    if kind == "SeesawParams":
        return "seesaw"
    if getattr(params, "nvfp4", False) or kind == "Nvfp4FewHeadsParams":
        return "few-nvfp4"
    return f"few-regv{params.ctas_per_sm}" + ("-pvearly" if getattr(params, "pv_early", False) else "")


def enumerate_shipped(gluon: bool) -> dict:
    TritonDecode, mod, patch_gluon = _api()
    import torch

    from vllm_kimi_dsa.kernels.base import DecodeSetup

    patch_gluon(gluon)
    mod.num_sms = lambda device=None: SMS
    tables, specs = {}, {}
    for fmt in FORMATS:
        for heads in HEADS:
            setup = DecodeSetup(device=torch.device("cpu"), fmt=fmt, heads=heads,
                                row_counts=tuple(range(1, MAX_ROWS + 1)), capacities=(), widths=WIDTHS,
                                return_lse=True, softmax_scale=0.1, output_scale=1.0)
            k = TritonDecode(setup)
            key = f"{fmt}/H{heads}"
            plans, params, leads = {}, {}, {}
            for (rows, width), plan in sorted(k._plans.items()):
                first, tail = k.plan_params[rows, width]
                lead = k.plan_leads[rows, width]
                plans[f"{rows},{width}"] = list(plan)
                params[f"{rows},{width}"] = [describe(first), describe(tail)]
                leads[f"{rows},{width}"] = lead
                whole, splits = plan
                launches = [(first, splits)] if not whole else [(first, 1)] + ([(tail, splits)] if whole < rows else [])
                for p, s in launches:
                    cfg = k.config if p is None else None
                    spec = dict(label=_label(p, fmt, heads), fmt=fmt, heads=heads, hdiv=heads % 16 == 0,
                                split1=s == 1, params=describe(p), config=describe(cfg))
                    name = "{label}-{fmt}-H{h}-{s}".format(label=spec["label"], fmt=fmt, s="s1" if s == 1 else "sN",
                                                          h=heads if (p is not None and heads <= 32) or p is None
                                                          else ("div16" if heads % 16 == 0 else heads))
                    spec["lead"] = bool(lead) and s > 1 and p is None
                    specs.setdefault(name, spec)
                    if s > 1:
                        comb = f"combine-S{1 << (s - 1).bit_length()}-{'div16' if heads % 16 == 0 else f'H{heads}'}"
                        specs.setdefault(comb, dict(label="combine", splits_pow2=1 << (s - 1).bit_length(),
                                                    heads=heads, hdiv=heads % 16 == 0))
            tables[key] = dict(config=describe(k.config), plans=plans, plan_params=params, plan_leads=leads)
    return {"tables": tables, "specs": specs}


# ----------------------------------------------------------------------------- compiling


def _compile(name: str, spec: dict) -> tuple[str, str]:
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    fmt = spec.get("fmt", "fp8")
    fn, consts, options, gluon = _kernel_of(spec)
    sig = dict(SIGNATURE)
    if fmt != "fp8":
        sig["kv_ptr"] = "*u8"
    sig = {n: sig.get(n, "i32") for n in fn.arg_names if n in sig or n in ("U", "TPC")} if not spec["label"] == "combine" else None
    if spec["label"] == "combine":
        sig = dict(part_out_ptr="*fp16", part_lse_ptr="*fp32", out_ptr="*bf16", lse_ptr="*fp32", H="i32",
                   num_splits="i32", stride_o_row="i32", stride_o_head="i32", stride_lse_row="i32", out_scale="fp32")
    divisible = [n for n, t in sig.items() if t.startswith("*") or n.startswith("stride") or n == "K"
                 or n in ("U", "TPC")]
    if not spec["hdiv"]:
        divisible = [n for n in divisible if n != "stride_lse_row"]
    else:
        divisible.append("H")
    if spec.get("split1"):
        consts = dict(consts, num_splits=1)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible if n not in consts}
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Src
    else:
        from triton.compiler import ASTSource as Src
    src = Src(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=target, options=options)
    return name, _instructions(k.asm["cubin"])


def _instructions(cubin: bytes) -> str:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([str(bin_dir / "cuobjdump"), "--dump-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            lines.append(m.group(1))
    return "\n".join(lines) + "\n"


def _kernel_of(spec: dict):
    """(jit fn, constexprs, compile options, is_gluon) of a spec, from whichever layout the package has."""
    label, heads, fmt = spec["label"], spec["heads"], spec.get("fmt", "fp8")
    k = _kernels()
    if label == "combine":
        return k["combine"], dict(SPLITS=spec["splits_pow2"], D=512), {"num_warps": 2}, False
    if label == "tl":
        c, fn = spec["config"], k["tl"]
        consts = dict(NVFP4=fmt != "fp8", BLOCK_H=c["block_h"], BLOCK_N=c["block_n"], PREFETCH=c["prefetch"],
                      LAZY=c["lazy"], SWAP=c["swap"], PTX=True, QK_F16=False, IMPRECISE=c.get("imprecise", 0),
                      LEAD=spec["lead"])
        consts = {n: v for n, v in consts.items() if n in fn.arg_names}
        return fn, consts, {"num_warps": c["num_warps"], "num_stages": c["num_stages"]}, False
    cls, fn, constexprs = k[label.split("-")[0]]
    names = {f.name for f in dataclasses.fields(cls)}
    params = cls(**{n: v for n, v in spec["params"].items() if n in names})
    consts = constexprs(params, heads) if label.startswith("few") else constexprs(params)
    options = {"num_warps": 4, **(params.launch_options() if hasattr(params, "launch_options") else {})}
    return fn, consts, options, True


def _kernels() -> dict:
    """name -> the jit fn (tl, combine) or (params class, jit fn, constexprs(params[, heads])) of each kernel."""
    from vllm_kimi_dsa.kernels import gluon_decode as gluon64, gluon_few_heads as few, gluon_seesaw as seesaw
    from vllm_kimi_dsa.kernels import triton_decode as decode_tl
    try:
        combine = importlib.import_module("vllm_kimi_dsa.kernels.common.combine")
    except ImportError:
        combine = decode_tl
    return {
        "tl": decode_tl._decode_kernel if hasattr(decode_tl, "_decode_kernel") else decode_tl.decode_kernel,
        "combine": combine._combine_kernel if hasattr(combine, "_combine_kernel") else combine.combine_kernel,
        "gluon64": (gluon64.GluonParams, gluon64.gluon_decode_kernel, gluon64.kernel_constexprs),
        "seesaw": (seesaw.SeesawParams, seesaw.seesaw_decode_kernel, seesaw.kernel_constexprs),
        "few": (few.FewHeadsParams, few.few_heads_kernel, few.kernel_constexprs),
    }


def write_sass(out_dir: Path, specs: dict, jobs: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(jobs) as pool:
        for name, text in pool.map(_compile, specs.keys(), specs.values()):
            (out_dir / f"{name}.sass").write_text(text)
            print(name, len(text.splitlines()), "instructions", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("plans")
    a.add_argument("out")
    b = sub.add_parser("sass")
    b.add_argument("out_dir")
    b.add_argument("--jobs", type=int, default=1)
    b.add_argument("--filter", default="")
    b.add_argument("--plans", default=None, help="the specs of a `plans` run's JSON (else enumerated here)")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "plans":
        data = {"gluon": enumerate_shipped(True), "tl": enumerate_shipped(False)}
        Path(args.out).write_text(json.dumps(data, sort_keys=True))
        specs = {**data["gluon"]["specs"], **data["tl"]["specs"]}
        print(len(specs), "compile specs:", *sorted(specs), sep="\n  ")
    elif args.cmd == "sass":
        if args.plans:
            data = json.loads(Path(args.plans).read_text())
        else:
            data = {"gluon": enumerate_shipped(True), "tl": enumerate_shipped(False)}
        specs = {k: v for k, v in {**data["gluon"]["specs"], **data["tl"]["specs"]}.items() if args.filter in k}
        write_sass(Path(args.out_dir), specs, args.jobs)
    else:
        x, y = (_drop_retired(json.loads(Path(f).read_text())) for f in (args.a, args.b))
        if x == y:
            n = sum(len(t["plans"]) for side in x.values() for t in side["tables"].values())
            print(f"equal: {n} (rows, width) plans over {sum(len(s['tables']) for s in x.values())} tables, "
                  f"{len({**x['gluon']['specs'], **x['tl']['specs']})} compile specs")
            return
        for side in x:
            for key in x[side]["tables"]:
                for field in x[side]["tables"][key]:
                    u, v = x[side]["tables"][key][field], y[side]["tables"].get(key, {}).get(field)
                    if u != v:
                        diff = [kk for kk in u if not isinstance(u, dict) or u.get(kk) != (v or {}).get(kk)][:5] \
                            if isinstance(u, dict) else (u, v)
                        print("DIFF", side, key, field, diff)
            if x[side]["specs"] != y[side]["specs"]:
                print("DIFF specs", side, set(x[side]["specs"]) ^ set(y[side]["specs"]))
        sys.exit(1)


if __name__ == "__main__":
    main()
