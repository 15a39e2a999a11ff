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
        from vllm_kimi_dsa.kernels.common import gluon_env

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
    for name, only in (("x_sync", 2), ("handoff", 0), ("stream", False), ("split_producer", True), ("qk_f16", False),
                       ("tail_split", True)):
        if fields.get(name, object()) == only:
            fields.pop(name)
    return {"kind": type(params).__name__, **fields}


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
    heads, fmt = spec["heads"], spec.get("fmt", "fp8")
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
    p = spec.get("params")
    try:
        from vllm_kimi_dsa.backends.hopper import variants as v
        return v.compile_spec(spec)
    except ImportError:
        pass
    from vllm_kimi_dsa.kernels import triton_decode as td

    if label == "combine":
        return td._combine_kernel, dict(SPLITS=spec["splits_pow2"], D=512), {"num_warps": 2}, False
    if label == "tl":
        cfg = td.Config(**{k: v for k, v in spec["config"].items() if k != "kind"})
        consts = dict(NVFP4=fmt != "fp8", BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, QK_F16=cfg.qk_f16,
                      IMPRECISE=cfg.imprecise, PREFETCH=cfg.prefetch, LAZY=cfg.lazy, SWAP=cfg.swap, PTX=cfg.ptx,
                      LEAD=spec["lead"])
        return td._decode_kernel, consts, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}, False
    fields = {k: v for k, v in p.items() if k != "kind"}
    if label == "gluon64":
        from vllm_kimi_dsa.kernels import gluon_decode as g
        params = g.GluonParams(**fields)
        return g.gluon_decode_kernel, g.kernel_constexprs(params), {"num_warps": 4}, True
    if label == "seesaw":
        from vllm_kimi_dsa.kernels import gluon_seesaw as g
        params = g.SeesawParams(**fields)
        return g.seesaw_decode_kernel, g.kernel_constexprs(params), {"num_warps": 4}, True
    from vllm_kimi_dsa.kernels import gluon_few_heads as g
    params = g.FewHeadsParams(**fields)
    return g.few_heads_kernel, g.kernel_constexprs(params, heads), {"num_warps": 4, **params.launch_options()}, True


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
        x, y = json.loads(Path(args.a).read_text()), json.loads(Path(args.b).read_text())
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
