"""vLLM's engine end to end, this backend beside vLLM's Hopper default: `LLM(...)` through FLASHINFER_MLA_SPARSE
(this package) and FLASHMLA_SPARSE on the same small DeepSeek-V3.2, same weights, same prompts.

    python benchmarks/bench_engine.py run --out DIR [--heads 16,64,128] [--requests 1,8,32,128] ...
    (on the device: bash tools/device_run.sh --vllm [--fi] py benchmarks/bench_engine.py run --out $OUT/engine ...)

Each engine lives in a process of its own (benchmarks/engine_worker.py), driven over a pipe, so two engines never
share a CUDA context, both stay up while they are timed in turn, and a failed start is reported with its error.

**The check.** CHECK_REQUESTS requests with contexts in CHECK_CONTEXT (all past index_topk, so the indexer's choice
matters) are forced down the same random token trace in every engine (vLLM's trace replay) for CHECK_STEPS decode
steps, and every step's full-vocabulary log-probabilities are recorded. Against FLASHMLA_SPARSE (the reference):
per decode step the largest |log-probability difference| over the vocabulary; an engine passes when every step is
within LOGPROB_BOUND and, wherever the reference's top two log-probabilities are TIE_MARGIN or more apart, both
pick the same token. The correct engines: this backend (CUDA graphs, and eager), and vLLM's FLASHINFER_MLA_SPARSE_SM90
where FlashInfer is carried (FlashInfer's fa3 on the same 576 B per-tensor FP8 rows with a BF16 query: what the FP8
query costs apart from the cache format). The negative controls (engine_worker.FAULTS, planted in this backend) must
each exceed the bound on most requests (the softmax-scale fault at the first decode step too).

**The bound and the tie margin, from measurement.** LOGPROB_BOUND is BOUND_FACTOR times the largest per-step
difference any correct engine showed against the reference in the committed run (benchmarks/results/, the
report's "spread"), rounded up to two significant digits; every run recomputes that figure ("measured_bound"), so a
run whose correct engines spread further shows it. TIE_MARGIN is 2 x LOGPROB_BOUND: an engine within the bound moves
each log-probability by at most the bound, so the gap between the top two by at most twice it; a wider gap cannot
flip.

**The timing.** At each (heads, requests, context mix) both engines prefill the same prompts (every request), run
WARMUP decode steps at the full batch, then time windows of `steps` decode steps each, in turn (ours, FlashMLA,
FlashMLA, ours, ...), `repeats` windows each, and one more window each under the torch profiler. A window is wall
time between synchronised ends over the tokens every request gained; the scheduler's own steps in it are recorded
and each must be pure decode (one token for every request, none new). Per decode step: wall µs, GPU µs by kernel
class (engine_worker.KERNEL_CLASSES; attention = decode + combine + metadata + query kernels of each side), tokens/s,
and the attention floor (each selected KV row read once at the machine's measured copy rate). Both engines run the
same max_num_seqs, capture sizes and graph mode (recorded and compared).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_worker as ew  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OURS, FLASHMLA, FLASHINFER_SM90, VOCAB = ew.OURS, ew.FLASHMLA, ew.FLASHINFER_SM90, ew.VOCAB
LAYERS = 4

BOUND_FACTOR = 1.5
LOGPROB_BOUND = 0.25  # BOUND_FACTOR x the committed run's largest correct-engine step difference, rounded up
TIE_MARGIN = 2 * LOGPROB_BOUND
MOST = 0.5  # a negative control must exceed the bound on more than this fraction of the requests

CHECK_REQUESTS, CHECK_STEPS = 64, 64
CHECK_CONTEXT = (2100, 6000)
REQUESTS = (1, 8, 32, 128)
MIXES = ("uniform-4096", "ragged-100-8000")
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # every timed batch and the check's 64 (both engines alike)
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 128, 8192
SIDE_MEMORY = 0.2  # fraction of the GPU for an engine beside the two timed ones (0.3 each by default)
WARMUP = 4
TOPK = 2048
ROW_BYTES = {OURS: 576, FLASHMLA: 656}  # a KV row as each backend stores it (fp8 per-tensor; fp8_ds_mla)


def model_config(heads: int, layers: int = LAYERS) -> dict[str, Any]:
    """config.json of a small DeepSeek-V3.2: its released attention and indexer shapes, a small dense MLP."""
    return dict(
        architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
        hidden_size=2048, intermediate_size=4096, moe_intermediate_size=512, num_hidden_layers=layers,
        first_k_dense_replace=layers, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_topk=TOPK, index_n_heads=64,
        index_head_dim=128, vocab_size=VOCAB, max_position_embeddings=16384, rope_theta=10000.0,
        rms_norm_eps=1e-6, torch_dtype="bfloat16", n_group=1, topk_group=1, routed_scaling_factor=1.0,
        scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1,
    )


def write_model(directory: Path, heads: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_config(heads), indent=1))
    return directory


# ---------------------------------------------------------------------------------------------------- workloads


def random_tokens(lengths: list[int], seed: int) -> list[list[int]]:
    """One list of token ids (2..VOCAB-1: no BOS / EOS) per length, seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


def check_workload(requests: int = CHECK_REQUESTS, steps: int = CHECK_STEPS, seed: int = 7,
                   context: tuple[int, int] = CHECK_CONTEXT) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, traces): `requests` prompts of lengths in `context` (seeded) and a forced trace of 1 + steps tokens
    each (the token after the prompt, then `steps` decode steps)."""
    rng = random.Random(seed)
    lengths = [rng.randint(*context) for _ in range(requests)]
    return random_tokens(lengths, seed), random_tokens([1 + steps] * requests, seed + 1)


def context_lengths(mix: str, requests: int, seed: int) -> list[int]:
    """Prompt lengths of a timing point: "uniform-N" all N; "ragged-LO-HI" log-uniform in [LO, HI] (seeded; both
    ends included from 2 requests on), the spread of contexts a serving batch holds."""
    kind, *bounds = mix.split("-")
    if kind == "uniform" and len(bounds) == 1:
        return [int(bounds[0])] * requests
    if kind == "ragged" and len(bounds) == 2:
        lo, hi = int(bounds[0]), int(bounds[1])
        rng = random.Random(seed)
        lengths = [round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(requests)]
        if requests > 1:
            lengths[0], lengths[1] = lo, hi
            rng.shuffle(lengths)
        return lengths
    raise ValueError(f"context mix {mix!r} is neither uniform-N nor ragged-LO-HI")


# ---------------------------------------------------------------------------------------------------- comparison


def compare(reference: Any, other: Any, *, bound: float = LOGPROB_BOUND, tie_margin: float = TIE_MARGIN) -> dict:
    """Two engines' log-probabilities on the same forced traces, (requests, 1 + steps, vocab) float32 each (step 0:
    the token after the prompt; NaN: not recorded). Per decode step (1..), the largest |difference| over the
    vocabulary; `ok` when every one is within `bound`, every step was recorded, and no token differs where the
    reference's top two are `tie_margin` or more apart. The rest describes the spread: its quantiles, each request's
    largest, the first decode step's, and the fraction of requests past the bound (what a fault must exceed)."""
    import torch

    if reference.shape != other.shape:
        raise ValueError(f"reference {tuple(reference.shape)} and other {tuple(other.shape)} differ in shape")
    missing = int((torch.isnan(reference).any(-1) | torch.isnan(other).any(-1))[:, 1:].sum())
    diff = (other - reference).abs().amax(-1).nan_to_num(nan=math.inf)[:, 1:]  # (requests, steps)
    top2 = reference.nan_to_num(nan=-math.inf).topk(2, dim=-1).values[:, 1:]
    sure = (top2[..., 0] - top2[..., 1]) >= tie_margin
    flipped = (reference.nan_to_num(nan=-math.inf).argmax(-1) != other.nan_to_num(nan=-math.inf).argmax(-1))[:, 1:]
    per_request = diff.amax(1)
    first = diff[:, 0]
    flat = diff.flatten().sort().values
    finite = flat[torch.isfinite(flat)]

    def q(p: float) -> float:
        return float(finite[min(len(finite) - 1, int(p * len(finite)))]) if len(finite) else math.inf

    confident_flips = int((sure & flipped).sum())
    worst = float(per_request.max())
    return {
        "ok": worst <= bound and confident_flips == 0 and missing == 0,
        "bound": bound, "tie_margin": tie_margin,
        "requests": int(diff.shape[0]), "decode_steps": int(diff.numel()), "missing_steps": missing,
        "max": worst, "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
        "first_decode_max": float(first.max()),
        "over_bound": float((per_request > bound).float().mean()),
        "first_decode_over_bound": float((first > bound).float().mean()),
        "margin_median": float(per_request.median()) / bound,
        "confident_token_flips": confident_flips, "near_tie_steps": int((~sure).sum()),
        "per_request_max": [round(float(v), 5) for v in per_request],
        "first_decode": [round(float(v), 5) for v in first],
    }


def fault_caught(result: dict, fault: str) -> bool:
    """A negative control is caught when more than MOST of its requests exceed the bound, and the softmax-scale fault
    also at the first decode step (not only through a cache its prefill wrote)."""
    caught = result["over_bound"] > MOST
    if fault == "softmax_scale":
        caught &= result["first_decode_over_bound"] > MOST
    return caught


def derive_bound(spreads: list[float], factor: float = BOUND_FACTOR) -> float:
    """factor x the largest correct-engine step difference, rounded up to two significant digits."""
    worst = max(spreads)
    if not worst > 0:
        raise ValueError(f"spreads must hold a positive difference, got {spreads}")
    value = factor * worst
    step = 10 ** (math.floor(math.log10(value)) - 1)
    return math.ceil(value / step - 1e-9) * step


# ---------------------------------------------------------------------------------------------------- engines


class EngineProcess:
    """One engine_worker.serve process: built at construction (its info, or its error), then call()ed."""

    def __init__(self, spec: dict[str, Any], timeout: float = 600) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.spec, self.timeout = spec, timeout
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=ew.serve, args=(child, spec), daemon=True)
        self.process.start()
        child.close()
        status, self.info = self._answer(timeout)
        self.error = None if status == "ok" else self.info
        if self.error:
            self.info = {"backend": spec["backend"], "heads": spec["heads"], **self.error}

    def _answer(self, timeout: float) -> tuple[str, Any]:
        if not self.conn.poll(timeout):
            return "error", {"error": f"no answer in {timeout:.0f} s", "traceback": self.log_tail()}
        try:
            return self.conn.recv()
        except EOFError:
            return "error", {"error": f"the engine process ended (exit code {self.process.exitcode})",
                             "traceback": self.log_tail()}

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return Path(self.spec["log"]).read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def startup_line(self) -> str | None:
        lines = [line for line in self.log_tail(10**7).splitlines() if "vllm_kimi_dsa" in line and "serves" in line]
        return lines[0] if lines else None

    def call(self, command: str, **kwargs: Any) -> Any:
        if self.error:
            raise RuntimeError(f"{self.spec['backend']} did not start: {self.error['error']}")
        self.conn.send((command, kwargs))
        status, value = self._answer(self.timeout)
        if status != "ok":
            raise RuntimeError(f"{self.spec['backend']} {command}: {value['error']}\n{value.get('traceback', '')}")
        return value

    def stop(self) -> None:
        if self.process.is_alive() and not self.error:
            try:
                self.conn.send(("stop", {}))
                self._answer(120)
            except (BrokenPipeError, OSError):
                pass
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def engine_spec(out_dir: Path, name: str, model: Path, backend: str, heads: int, args: argparse.Namespace, *,
                eager: bool = False, faults: bool = False, fi_site: str | None = None,
                side: bool = False) -> dict[str, Any]:
    """An engine's spec (engine_worker.serve). side: an engine started beside the two timed ones (the faults' and
    FlashInfer's), given SIDE_MEMORY of the GPU instead of the run's share."""
    return {"backend": backend, "heads": heads, "model": str(model), "log": str(out_dir / f"{name}.log"),
            "eager": eager, "faults": faults, "fi_site": fi_site, "shims": args.shims,
            "force_mqa": not ew.flash_attention_present(), "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "capture_sizes": list(args.capture_sizes),
            "gpu_memory_utilization": SIDE_MEMORY if side else args.gpu_memory_utilization}


# ---------------------------------------------------------------------------------------------------- timing


def attention_floor_us(lengths: list[int], backend: str, copy_gbps: float | None) -> float | None:
    """µs a decode step's attention needs at least: every selected KV row (min(context, TOPK) a request, each layer,
    in the backend's own row format) moved once at the machine's measured copy rate (timing.ceilings: bytes read +
    written a second), as the suite's floors count bytes."""
    if not copy_gbps or backend not in ROW_BYTES:
        return None
    rows = sum(min(n, TOPK) for n in lengths) * LAYERS
    return rows * ROW_BYTES[backend] / (copy_gbps * 1e9) * 1e6


def classify(kernels_us: dict[str, float], steps: int) -> dict[str, Any]:
    """A profiled window's GPU µs by kernel class, per decode step, and its largest kernels."""
    by: dict[str, float] = {}
    for name, us in kernels_us.items():
        label = ew.kernel_class(name)
        by[label] = by.get(label, 0.0) + us / steps
    top = sorted(kernels_us.items(), key=lambda kv: -kv[1])[:16]
    return {"gpu_us": sum(by.values()), "attention_us": sum(by.get(c, 0.0) for c in ew.ATTENTION_CLASSES),
            "by_class_us": {k: round(v, 2) for k, v in sorted(by.items())},
            "top_kernels": [{"kernel": k[:120], "class": ew.kernel_class(k), "us_per_step": round(v / steps, 2)}
                            for k, v in top]}


def time_point(engines: dict[str, EngineProcess], heads: int, requests: int, mix: str, args: argparse.Namespace,
               copy_gbps: float | None) -> list[dict[str, Any]]:
    """One (heads, requests, mix) point on both engines: the same prompts prefilled in each, then `repeats` timed
    windows each, in turn, and one profiled window each; one row per backend."""
    lengths = context_lengths(mix, requests, seed=1000 + requests)
    prompts = random_tokens(lengths, seed=2000 + requests)
    tokens = 1 + WARMUP + (args.repeats + 1) * args.steps + 8
    names = list(engines)
    prefill = {n: engines[n].call("start_batch", prompts=prompts, tokens=tokens, warmup=WARMUP) for n in names}
    windows: dict[str, list[dict]] = {n: [] for n in names}
    try:
        for rep in range(args.repeats):
            for n in (names if rep % 2 == 0 else names[::-1]):
                windows[n].append(engines[n].call("decode_window", steps=args.steps))
        profiled = {n: engines[n].call("decode_window", steps=args.steps, profile=True) for n in names}
    finally:
        for n in names:
            engines[n].call("end_batch")
    rows = []
    for n in names:
        step_us = [w["seconds"] / w["steps"] * 1e6 for w in windows[n]]
        median = statistics.median(step_us)
        gpu = classify(profiled[n]["kernels_us"], profiled[n]["steps"])
        floor = attention_floor_us(lengths, n, copy_gbps)
        rows.append({
            "backend": n, "heads": heads, "requests": requests, "context_mix": mix,
            "decode_step_us": round(median, 2), "attention_us": round(gpu["attention_us"], 2),
            "tokens_per_s": round(requests / (median * 1e-6), 1), "gpu": engines[n].info.get("gpu"),
            "prefill_path": engines[n].info.get("prefill_path"),
            "decode_step_us_repeats": [round(v, 2) for v in step_us],
            "decode_step_spread": round((max(step_us) - min(step_us)) / median, 4),
            "gpu_us": round(gpu["gpu_us"], 2), "by_class_us": gpu["by_class_us"],
            "attention_floor_us": None if floor is None else round(floor, 2),
            "attention_floor_fraction": None if not floor else round(floor / gpu["attention_us"], 3),
            "pure_decode": all(w["pure_decode"] for w in [*windows[n], profiled[n]]),
            "scheduled_steps": [w["scheduled_steps"] for w in [*windows[n], profiled[n]]],
            "prompt_tokens": sum(lengths), "prefill_s": round(prefill[n]["prefill_s"], 3),
            "top_kernels": gpu["top_kernels"],
        })
    return rows


# ---------------------------------------------------------------------------------------------------- the run


def _save(out_dir: Path, report: dict, rows: list[dict]) -> None:
    (out_dir / "engine_report.json").write_text(json.dumps(report, indent=1, default=str))
    (out_dir / "engine.json").write_text(json.dumps(rows, indent=1))
    (out_dir / "engine.md").write_text(table(rows) + "\n")


def _engine_summary(engine: EngineProcess) -> dict[str, Any]:
    info = dict(engine.info)
    info["startup_line"] = engine.startup_line()
    if engine.error:
        info["log_tail"] = engine.log_tail()
    return info


def _checks(engines: dict[str, EngineProcess], prompts, traces, summary: dict, logprobs: dict) -> None:
    for name, engine in engines.items():
        try:
            got = engine.call("check", prompts=prompts, traces=traces)
        except RuntimeError as e:
            summary.setdefault("errors", {})[name] = str(e)[:4000]
            continue
        logprobs[name] = got.pop("logprobs")
        summary.setdefault("checks", {})[name] = got


def _fault_checks(out_dir: Path, model: Path, heads: int, args: argparse.Namespace, prompts, traces, summary: dict,
                  logprobs: dict) -> None:
    """This backend in an eager engine, unfaulted ("eager:none", a correct engine) then with each planted fault."""
    faulty = EngineProcess(engine_spec(out_dir, f"h{heads}_faults", model, OURS, heads, args, eager=True, faults=True,
                                       side=True))
    summary["engines"]["faults"] = _engine_summary(faulty)
    try:
        for mode in ("none", *ew.FAULTS):
            if faulty.error:
                break
            faulty.call("set_fault", mode=mode)
            got = faulty.call("check", prompts=prompts, traces=traces)
            logprobs[f"eager:{mode}"] = got.pop("logprobs")
            summary.setdefault("checks", {})[f"eager:{mode}"] = got
    except RuntimeError as e:
        summary.setdefault("errors", {})["faults"] = str(e)[:4000]
    finally:
        faulty.stop()


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "bound": LOGPROB_BOUND, "tie_margin": TIE_MARGIN, "bound_factor": BOUND_FACTOR, "most": MOST,
        "query_gain": ew.QUERY_GAIN, "faults": ew.FAULTS, "check_requests": args.check_requests,
        "check_steps": args.check_steps, "check_context": list(CHECK_CONTEXT), "heads": {},
    }
    rows: list[dict] = []
    if args.shims:  # decided once here; the engines (and vLLM's own child processes) apply the same shims
        report["shims"] = ew.install_device_shims()
    copy_gbps = None
    if args.requests:
        import torch
        from vllm_kimi_dsa.timing import ceilings

        report["ceilings"] = ceilings(torch.device("cuda"), quick=True)
        copy_gbps = report["ceilings"]["copy_GBps"]
        torch.cuda.empty_cache()
    prompts, traces = check_workload(args.check_requests, args.check_steps)
    ok = True
    for heads in args.heads:
        if time.monotonic() - start > args.budget:
            report["heads"][heads] = {"skipped": f"past the budget of {args.budget} s"}
            ok = False
            continue
        model = write_model(out_dir / f"model_h{heads}", heads)
        summary: dict[str, Any] = report["heads"].setdefault(heads, {})
        logprobs: dict[str, Any] = {}
        engines = {name: EngineProcess(engine_spec(out_dir, f"h{heads}_{label}", model, name, heads, args))
                   for name, label in ((OURS, "ours"), (FLASHMLA, "flashmla"))}
        summary["engines"] = {n: _engine_summary(e) for n, e in engines.items()}
        try:
            if any(e.error for e in engines.values()):
                ok = False
                continue
            configs = {n: {k: e.info["config"][k] for k in ("max_num_seqs", "capture_sizes", "cudagraph_mode",
                                                           "compilation_mode", "async_scheduling")}
                       for n, e in engines.items()}
            summary["same_engine_config"] = configs[OURS] == configs[FLASHMLA]
            if heads in args.check_heads:  # correctness first: the other engines start beside these two
                _checks(engines, prompts, traces, summary, logprobs)
                if heads in args.fault_heads:
                    _fault_checks(out_dir, model, heads, args, prompts, traces, summary, logprobs)
                if heads in args.fi_heads and args.fi_site:
                    fi = EngineProcess(engine_spec(out_dir, f"h{heads}_fi_sm90", model, FLASHINFER_SM90, heads, args,
                                                   fi_site=args.fi_site, side=True))
                    summary["engines"][FLASHINFER_SM90] = _engine_summary(fi)
                    try:
                        if not fi.error:
                            _checks({FLASHINFER_SM90: fi}, prompts, traces, summary, logprobs)
                    finally:
                        fi.stop()
                ok &= _verdicts(summary, logprobs)
            _save(out_dir, report, rows)
            for requests in args.requests:
                for mix in args.mixes:
                    try:
                        rows.extend(time_point(engines, heads, requests, mix, args, copy_gbps))
                    except RuntimeError as e:
                        summary.setdefault("errors", {})[f"{requests}x{mix}"] = str(e)[:4000]
                        ok = False
                    _save(out_dir, report, rows)
        finally:
            for e in engines.values():
                e.stop()
        _save(out_dir, report, rows)
    correct = [s["compare"][n]["max"] for s in report["heads"].values() for n in s.get("compare", {})
               if not n.startswith("eager:") or n == "eager:none"]
    if correct:
        report["spread"] = max(correct)
        report["measured_bound"] = derive_bound(correct)
    _save(out_dir, report, rows)
    print(table(rows))
    print(json.dumps(verdict_lines(report), indent=1))
    return 0 if ok else 1


def _verdicts(summary: dict, logprobs: dict) -> bool:
    """Every engine against FLASHMLA_SPARSE: the correct ones must pass, every planted fault must be caught."""
    reference = logprobs.get(FLASHMLA)
    if reference is None:
        summary["verdict"] = "no reference log-probabilities"
        return False
    ok = True
    summary["compare"] = {}
    for name, values in logprobs.items():
        if name == FLASHMLA:
            continue
        result = compare(reference, values)
        fault = name.removeprefix("eager:") if name.startswith("eager:") and name != "eager:none" else None
        result["fault"] = fault
        result["passes"] = fault_caught(result, fault) if fault else result["ok"]
        ok &= result["passes"]
        summary["compare"][name] = result
    ok &= OURS in summary["compare"]
    return ok


def verdict_lines(report: dict) -> dict:
    """The short form of the report: per heads and engine, max / p99 difference, bound fraction and verdict."""
    out: dict[str, Any] = {"bound": report["bound"], "measured_bound": report.get("measured_bound")}
    for heads, s in report["heads"].items():
        out[str(heads)] = {n: {k: c[k] for k in ("max", "p99", "over_bound", "first_decode_over_bound", "passes")}
                           for n, c in s.get("compare", {}).items()}
        if s.get("errors"):
            out[str(heads)]["errors"] = {k: v[:300] for k, v in s["errors"].items()}
    return out


def table(rows: list[dict]) -> str:
    """Markdown: per (heads, requests, mix), each backend's decode step and attention µs per step (its floor
    fraction), the ratios ours / FlashMLA, and tokens/s ratio."""
    by = {(r["heads"], r["requests"], r["context_mix"], r["backend"]): r for r in rows}
    lines = ["| heads | requests | contexts | step µs ours / FlashMLA | attention µs ours / FlashMLA (floor frac.) | "
             "attention ratio | tokens/s ratio | spread ours / FlashMLA |", "|---|---|---|---|---|---|---|---|"]
    for heads, requests, mix in sorted({k[:3] for k in by}, key=lambda k: (k[0], k[1], k[2])):
        a, b = by.get((heads, requests, mix, OURS)), by.get((heads, requests, mix, FLASHMLA))
        if not a or not b:
            continue

        def frac(r: dict) -> str:
            return f" ({r['attention_floor_fraction']:.2f})" if r.get("attention_floor_fraction") else ""

        lines.append(
            f"| {heads} | {requests} | {mix} | {a['decode_step_us']:.0f} / {b['decode_step_us']:.0f} | "
            f"{a['attention_us']:.0f}{frac(a)} / {b['attention_us']:.0f}{frac(b)} | "
            f"{a['attention_us'] / b['attention_us']:.2f}x | {a['tokens_per_s'] / b['tokens_per_s']:.2f}x | "
            f"{a['decode_step_spread']:.1%} / {b['decode_step_spread']:.1%} |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _words(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="the check, the negative controls and the decode timing, engine by engine")
    p.add_argument("--out", required=True)
    p.add_argument("--heads", type=_ints, default=[16, 64, 128])
    p.add_argument("--requests", type=_ints, default=list(REQUESTS), help="timed batch sizes ('' : no timing)")
    p.add_argument("--mixes", type=_words, default=list(MIXES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=32, help="decode steps a timed window")
    p.add_argument("--check-heads", type=_ints, default=[16, 64, 128])
    p.add_argument("--fault-heads", type=_ints, default=[16])
    p.add_argument("--fi-heads", type=_ints, default=[16])
    p.add_argument("--fi-site", default=os.environ.get("KIMI_DSA_FI_SITE"),
                   help="FlashInfer's site (tools/device_run.sh --fi unpacks .carry/fi and sets $KIMI_DSA_FI_SITE)")
    p.add_argument("--check-requests", type=int, default=CHECK_REQUESTS)
    p.add_argument("--check-steps", type=int, default=CHECK_STEPS)
    p.add_argument("--capture-sizes", type=_ints, default=list(CAPTURE_SIZES))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--budget", type=float, default=math.inf, help="seconds: no new head count starts past it")
    p.add_argument("--shims", action="store_true", help="tools/vllm_device_shims.py first (the device)")
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
