"""vLLM's engine end to end, this backend beside vLLM's Hopper default: `LLM(...)` through FLASHINFER_MLA_SPARSE
(this package) and FLASHMLA_SPARSE on the same small DeepSeek-V3.2, same weights, same prompts.

    python benchmarks/bench_engine.py run --out DIR [--heads 16,64,128] [--requests 1,8,32,128] ...
    (on the device: bash tools/device_run.sh --vllm [--fi] py benchmarks/bench_engine.py run --out $OUT/engine ...)

Each engine lives in a process of its own (benchmarks/engine_worker.py), driven over a pipe, so two engines never
share a CUDA context, both stay up while they are timed in turn, and a failed start is reported with its error.

**The check.** CHECK_REQUESTS requests with contexts in CHECK_CONTEXT (all past index_topk, so the indexer's choice
matters) are forced down the same random token trace in every engine (vLLM's trace replay) for CHECK_STEPS decode
steps, and every step's full-vocabulary log-probabilities are recorded (engine_worker.RecordLogits). Two engines
compare (`compare`, `judge`) by the largest |log-probability difference| over the vocabulary at each decode step: a
correct engine stays within the bound at every step and, wherever the reference's top two are 2 x the bound or more
apart, picks the same token (within the bound each log-probability moves at most the bound, so the top-two gap at
most twice it: a wider gap cannot flip). The engines: FLASHMLA_SPARSE (vLLM's Hopper default, the reference); this
backend under CUDA graphs and eager; vLLM's FLASHINFER_MLA_SPARSE_SM90 where FlashInfer is carried, on its own BF16
query and on this backend's FP8-rounded query (SAME_INPUTS: the same cache bytes and query values as this backend);
and the negative controls (engine_worker.FAULTS) planted in this backend's eager engine.

**The bounds, from measurement** (`measured_bounds`, each BOUND_FACTOR x a measured spread, rounded up to two
digits; the module's FORMAT_BOUND and SAME_INPUTS_BOUND are those of the committed run, every run reports its own):
- against FLASHMLA_SPARSE, from vLLM's own FLASHINFER_MLA_SPARSE_SM90 against it: what the 576 B per-tensor cache's
  rounding alone moves (the FP8 cache, not this backend, sets it). This backend must stay within it.
- against SAME_INPUTS, from this backend's engines against it: what two kernels move on identical inputs. Every
  planted fault must exceed it on most requests (the softmax-scale fault at the first decode step too); whether the
  format bound alone catches each is reported beside.

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
# |log-probability difference| a decode step may show: measured_bounds of the committed run
# (benchmarks/results/2026-12-07-h100-engine/h16, held equal by tests/test_bench_engine.py): against FLASHMLA_SPARSE
# (its 656 B fp8_ds_mla rows against the 576 B per-tensor ones) and against FLASHINFER_MLA_SPARSE_SM90 fed this
# backend's FP8 query (the same cache bytes).
FORMAT_BOUND = 3.4
SAME_INPUTS_BOUND = 2.9


def module_bounds() -> dict[str, float]:
    """{"format": FORMAT_BOUND, "same_inputs": SAME_INPUTS_BOUND}, the bounds assess and the report use by default."""
    return {"format": FORMAT_BOUND, "same_inputs": SAME_INPUTS_BOUND}


MOST = 0.5  # a negative control must exceed the bound on more than this fraction of the requests
SAME_INPUTS = f"{ew.FLASHINFER_SM90}+fp8q"  # vLLM's FLASHINFER_MLA_SPARSE_SM90 on this backend's rounded query

CHECK_REQUESTS, CHECK_STEPS = 64, 64
CHECK_CONTEXT = (2100, 6000)
REQUESTS = (1, 8, 32, 128)
MIXES = ("uniform-4096", "ragged-100-8000")
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # every timed batch and the check's 64 (both engines alike)
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


def write_model(directory: Path, heads: int, layers: int = LAYERS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_config(heads, layers), indent=1))
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


def compare(reference: Any, other: Any) -> dict:
    """Two engines' log-probabilities on the same forced traces, (requests, 1 + steps, vocab) float32 each (step 0:
    the token after the prompt; NaN: not recorded), per decode step (1..): the largest |difference| over the
    vocabulary (`diffs`), the reference's gap between its top two (`gaps`) and whether the two engines' top tokens
    differ (`flipped`), with the spread's quantiles. `judge` reads them at a bound."""
    import torch

    if reference.shape != other.shape:
        raise ValueError(f"reference {tuple(reference.shape)} and other {tuple(other.shape)} differ in shape")
    missing = int((torch.isnan(reference).any(-1) | torch.isnan(other).any(-1))[:, 1:].sum())
    diff = (other - reference).abs().amax(-1).nan_to_num(nan=math.inf)[:, 1:]  # (requests, steps)
    ref = reference.nan_to_num(nan=-math.inf)
    top2 = ref.topk(2, dim=-1).values[:, 1:]
    flipped = (ref.argmax(-1) != other.nan_to_num(nan=-math.inf).argmax(-1))[:, 1:]
    finite = diff[torch.isfinite(diff)].sort().values

    def q(p: float) -> float:
        return float(finite[min(len(finite) - 1, int(p * len(finite)))]) if len(finite) else math.inf

    return {
        "requests": int(diff.shape[0]), "decode_steps": int(diff.numel()), "missing_steps": missing,
        "max": float(diff.max()), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99),
        "diffs": [[round(float(v), 4) for v in row] for row in diff],
        "gaps": [[round(float(v), 4) for v in row] for row in (top2[..., 0] - top2[..., 1])],
        "flipped": [[int(v) for v in row] for row in flipped],
    }


def judge(result: dict, bound: float, fault: str | None = None) -> dict:
    """`result` (compare's) at `bound`, with the tie margin 2 x bound. A correct engine `passes` when every decode
    step is within the bound, none is missing, and no token flips where the reference's top two are the margin or
    more apart. A planted fault `passes` (is caught) when more than MOST of its requests exceed the bound, and the
    softmax-scale fault also at the first decode step (not only through a cache its prefill wrote)."""
    diffs, gaps, flipped = result["diffs"], result["gaps"], result["flipped"]
    margin = 2 * bound
    per_request = [max(row) for row in diffs]
    first = [row[0] for row in diffs]
    flips = sum(f and g >= margin for fr, gr in zip(flipped, gaps) for f, g in zip(fr, gr))
    over = sum(v > bound for v in per_request) / len(per_request)
    first_over = sum(v > bound for v in first) / len(first)
    ok = max(per_request) <= bound and flips == 0 and result["missing_steps"] == 0
    if fault is None:
        passes = ok
    else:
        passes = over > MOST and (fault != "softmax_scale" or first_over > MOST)
    return {"bound": bound, "tie_margin": margin, "ok": ok, "passes": passes, "fault": fault,
            "confident_token_flips": flips, "over_bound": over, "first_decode_over_bound": first_over,
            "margin_median": statistics.median(per_request) / bound}


def derive_bound(spreads: list[float], factor: float = BOUND_FACTOR) -> float:
    """factor x the largest correct-engine step difference, rounded up to two significant digits."""
    worst = max(spreads)
    if not worst > 0:
        raise ValueError(f"spreads must hold a positive difference, got {spreads}")
    value = float(f"{factor * worst:.4g}")  # float32 sums' last bits must not push it up a whole step
    step = 10 ** (math.floor(math.log10(value)) - 1)
    return round(math.ceil(value / step) * step, 10)


def pair(other: str, reference: str) -> str:
    return f"{other} vs {reference}"


def comparisons(logprobs: dict[str, Any]) -> dict[str, dict]:
    """Every pair the report holds (compare's results), where both engines ran: each engine against FLASHMLA_SPARSE
    (the cache format's cost and more), this backend's engines and faults against FLASHINFER_MLA_SPARSE_SM90 on the
    same query (the kernels' own arithmetic), FLASHINFER_MLA_SPARSE_SM90 against itself on that query (the FP8
    query's cost), and CUDA graphs against eager."""
    wanted = [(name, FLASHMLA) for name in logprobs if name != FLASHMLA]
    wanted += [(name, SAME_INPUTS) for name in logprobs if name == OURS or name.startswith("eager:")]
    wanted += [(FLASHINFER_SM90, SAME_INPUTS), (OURS, "eager:none")]
    return {pair(a, b): compare(logprobs[b], logprobs[a]) for a, b in wanted if a in logprobs and b in logprobs}


def measured_bounds(compared: dict[str, dict]) -> dict[str, float]:
    """The bounds this run's spreads give (derive_bound): against FLASHMLA_SPARSE from vLLM's own
    FLASHINFER_MLA_SPARSE_SM90 against it (either query: the 576 B per-tensor cache's rounding, never this backend's
    numbers); on the same inputs from this backend's engines against FLASHINFER_MLA_SPARSE_SM90 fed their query."""
    out = {}
    fmt = [compared[k]["max"] for k in (pair(FLASHINFER_SM90, FLASHMLA), pair(SAME_INPUTS, FLASHMLA)) if k in compared]
    same = [compared[k]["max"] for k in (pair(OURS, SAME_INPUTS), pair("eager:none", SAME_INPUTS)) if k in compared]
    if fmt:
        out["format"] = derive_bound(fmt)
    if same:
        out["same_inputs"] = derive_bound(same)
    return out


def assess(compared: dict[str, dict], bounds: dict[str, float] | None = None) -> dict[str, dict]:
    """The verdicts at `bounds` (default the module's FORMAT_BOUND / SAME_INPUTS_BOUND): this backend's engines
    (graphs, eager) within the format bound of FLASHMLA_SPARSE and within the same-input bound of
    FLASHINFER_MLA_SPARSE_SM90 fed their query; each planted fault caught at the same-input bound (at the format bound
    when FlashInfer did not run), and, reported beside, whether the format bound alone catches it."""
    bounds = {**module_bounds(), **(bounds or {})}
    out: dict[str, dict] = {}
    for name in (OURS, "eager:none"):
        for ref, bound in ((FLASHMLA, bounds["format"]), (SAME_INPUTS, bounds["same_inputs"])):
            if pair(name, ref) in compared:
                out[pair(name, ref)] = judge(compared[pair(name, ref)], bound)
    for fault in ew.FAULTS:
        name = f"eager:{fault}"
        ref, bound = (SAME_INPUTS, bounds["same_inputs"]) if pair(name, SAME_INPUTS) in compared else \
            (FLASHMLA, bounds["format"])
        if pair(name, ref) in compared:
            out[pair(name, ref)] = judge(compared[pair(name, ref)], bound, fault)
        if ref != FLASHMLA and pair(name, FLASHMLA) in compared:
            out[pair(name, FLASHMLA)] = {**judge(compared[pair(name, FLASHMLA)], bounds["format"], fault),
                                         "informational": True}
    return out


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
            "force_mqa": not ew.flash_attention_present(), "capture_sizes": list(args.capture_sizes),
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


def batch_tokens(lengths: list[int], repeats: int, steps: int) -> int:
    """max_tokens of a timed batch: every window's steps (repeats + the profiled one) past the warm-up, plus one token
    a prefill step, since the first requests decode while chunked prefill still feeds the later ones: without it they
    reach max_tokens inside the last windows and the batch shrinks under the timing."""
    prefill_steps = math.ceil(sum(lengths) / ew.MAX_NUM_BATCHED_TOKENS) + len(lengths)
    return 1 + WARMUP + (repeats + 1) * steps + prefill_steps + 16


def time_point(engines: dict[str, EngineProcess], heads: int, requests: int, mix: str, args: argparse.Namespace,
               copy_gbps: float | None) -> list[dict[str, Any]]:
    """One (heads, requests, mix) point on both engines: the same prompts prefilled in each, then `repeats` timed
    windows each, in turn, and one profiled window each; one row per backend."""
    lengths = context_lengths(mix, requests, seed=1000 + requests)
    prompts = random_tokens(lengths, seed=2000 + requests)
    tokens = batch_tokens(lengths, args.repeats, args.steps)
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
        every = [*windows[n], profiled[n]]
        step_us = [w["seconds"] / w["steps"] * 1e6 for w in windows[n]]
        median = statistics.median(step_us)
        gpu = classify(profiled[n]["kernels_us"], profiled[n]["steps"])
        floor = attention_floor_us(lengths, n, copy_gbps)
        rows.append({
            "backend": n, "heads": heads, "requests": requests, "context_mix": mix,
            "decode_step_us": round(median, 2), "attention_us": round(gpu["attention_us"], 2),
            "tokens_per_s": round(requests / (median * 1e-6), 1), "gpu": engines[n].info.get("gpu"),
            "gpu_bound_tokens_per_s": round(requests / (gpu["gpu_us"] * 1e-6), 1),
            "prefill_path": engines[n].info.get("prefill_path"),
            "decode_step_us_repeats": [round(v, 2) for v in step_us],
            "decode_step_spread": round((max(step_us) - min(step_us)) / median, 4),
            "gpu_us": round(gpu["gpu_us"], 2), "by_class_us": gpu["by_class_us"],
            "attention_floor_us": None if floor is None else round(floor, 2),
            "attention_floor_fraction": None if not floor else round(floor / gpu["attention_us"], 3),
            "pure_decode": all(w["pure_decode"] for w in every),
            "scheduled_steps": [w["scheduled_steps"] for w in every],
            "impure_steps": [s for w in every for s in w.get("impure_steps", [])][:6],
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


def _record(name: str, got: dict, summary: dict, logprobs: dict) -> None:
    logprobs[name] = got.pop("logprobs")
    summary.setdefault("checks", {})[name] = got


def _checks(engines: dict[str, EngineProcess], prompts, traces, summary: dict, logprobs: dict) -> None:
    for name, engine in engines.items():
        try:
            _record(name, engine.call("check", prompts=prompts, traces=traces), summary, logprobs)
        except RuntimeError as e:
            summary.setdefault("errors", {})[name] = str(e)[:4000]


def _switched_checks(engine: EngineProcess, label: str, switches: list[tuple[str, str, dict]], prompts, traces,
                     summary: dict, logprobs: dict) -> None:
    """One eager engine beside the timed two, checked once per switch (the name its log-probabilities go under, the
    command that sets it and its arguments), then stopped."""
    summary["engines"][label] = _engine_summary(engine)
    try:
        for name, command, kwargs in switches:
            if engine.error:
                break
            engine.call(command, **kwargs)
            _record(name, engine.call("check", prompts=prompts, traces=traces), summary, logprobs)
    except RuntimeError as e:
        summary.setdefault("errors", {})[label] = str(e)[:4000]
    finally:
        engine.stop()


def _fault_checks(out_dir: Path, model: Path, heads: int, args: argparse.Namespace, prompts, traces, summary: dict,
                  logprobs: dict) -> None:
    """This backend in an eager engine, unfaulted ("eager:none", a correct engine) then with each planted fault."""
    faulty = EngineProcess(engine_spec(out_dir, f"h{heads}_faults", model, OURS, heads, args, eager=True, faults=True,
                                       side=True))
    switches = [(f"eager:{mode}", "set_fault", {"mode": mode}) for mode in ("none", *ew.FAULTS)]
    _switched_checks(faulty, "faults", switches, prompts, traces, summary, logprobs)


def _flashinfer_checks(out_dir: Path, model: Path, heads: int, args: argparse.Namespace, prompts, traces,
                       summary: dict, logprobs: dict) -> None:
    """vLLM's FLASHINFER_MLA_SPARSE_SM90 in an eager engine: on its own BF16 query, then on this backend's query
    (engine_worker.QueryRounding)."""
    fi = EngineProcess(engine_spec(out_dir, f"h{heads}_fi_sm90", model, FLASHINFER_SM90, heads, args, eager=True,
                                   fi_site=args.fi_site, side=True))
    switches = [(name, "set_query_rounding", {"on": on})
                for name, on in ((FLASHINFER_SM90, False), (SAME_INPUTS, True))]
    _switched_checks(fi, FLASHINFER_SM90, switches, prompts, traces, summary, logprobs)


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "bounds": module_bounds(), "bound_factor": BOUND_FACTOR, "most": MOST,
        "query_gain": ew.QUERY_GAIN, "faults": ew.FAULTS, "check_requests": args.check_requests,
        "check_steps": args.check_steps, "check_context": list(CHECK_CONTEXT), "layers": args.layers, "heads": {},
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
        model = write_model(out_dir / f"model_h{heads}", heads, args.layers)
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
                    _flashinfer_checks(out_dir, model, heads, args, prompts, traces, summary, logprobs)
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
    per_heads = [s["measured_bounds"] for s in report["heads"].values() if s.get("measured_bounds")]
    report["measured_bounds"] = {k: max(b[k] for b in per_heads if k in b) for k in ("format", "same_inputs")
                                 if any(k in b for b in per_heads)}
    _save(out_dir, report, rows)
    print(table(rows))
    print(json.dumps(verdict_lines(report), indent=1))
    return 0 if ok else 1


def _verdicts(summary: dict, logprobs: dict) -> bool:
    """Every comparison of the engines that ran (comparisons), the bounds their spreads give, and the verdicts at the
    module's bounds (assess) and at the measured ones: this backend must pass, every planted fault must be caught."""
    if FLASHMLA not in logprobs or OURS not in logprobs:
        summary["verdicts"] = {"missing": "no log-probabilities of FLASHMLA_SPARSE or of this backend"}
        return False
    summary["compare"] = comparisons(logprobs)
    summary["measured_bounds"] = measured_bounds(summary["compare"])
    summary["verdicts"] = assess(summary["compare"])
    summary["verdicts_at_measured_bounds"] = assess(summary["compare"], summary["measured_bounds"])
    return all(v["passes"] for v in summary["verdicts"].values() if not v.get("informational"))


def verdict_lines(report: dict) -> dict:
    """The short form of the report: per heads, each comparison's max / p50 difference and its verdict."""
    out: dict[str, Any] = {"bounds": module_bounds()}
    for heads, s in report["heads"].items():
        lines = {name: {"max": round(c["max"], 4), "p50": round(c["p50"], 4)}
                 for name, c in s.get("compare", {}).items()}
        for name, v in s.get("verdicts", {}).items():
            lines.setdefault(name, {}).update(passes=v["passes"], over_bound=round(v["over_bound"], 3))
        out[str(heads)] = {"compare": lines, "measured_bounds": s.get("measured_bounds")}
        if s.get("errors"):
            out[str(heads)]["errors"] = {k: v[:300] for k, v in s["errors"].items()}
    return out


def table(rows: list[dict]) -> str:
    """Markdown: per (heads, requests, mix), both backends' wall µs and GPU µs a decode step, attention µs a step
    (its floor fraction), the ratios ours / FlashMLA of attention, wall tokens/s and GPU-bound tokens/s (requests /
    GPU µs: what a step whose GPU work outlasts the engine's CPU work gives), and whether every window was pure
    decode."""
    by = {(r["heads"], r["requests"], r["context_mix"], r["backend"]): r for r in rows}
    lines = ["| heads | requests | contexts | wall µs a step, ours / FlashMLA | GPU µs a step | attention µs (floor "
             "fraction) | attention ratio | tokens/s ratio (wall) | tokens/s ratio (GPU-bound) | pure decode |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for heads, requests, mix in sorted({k[:3] for k in by}):
        a, b = by.get((heads, requests, mix, OURS)), by.get((heads, requests, mix, FLASHMLA))
        if not a or not b:
            continue

        def frac(r: dict) -> str:
            return f" ({r['attention_floor_fraction']:.2f})" if r.get("attention_floor_fraction") else ""

        pure = "yes" if a["pure_decode"] and b["pure_decode"] else "no (batch shrank)"
        lines.append(
            f"| {heads} | {requests} | {mix} | {a['decode_step_us']:.0f} / {b['decode_step_us']:.0f} | "
            f"{a['gpu_us']:.0f} / {b['gpu_us']:.0f} | {a['attention_us']:.0f}{frac(a)} / {b['attention_us']:.0f}"
            f"{frac(b)} | {a['attention_us'] / b['attention_us']:.2f}x | "
            f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x | "
            f"{b['gpu_us'] / a['gpu_us']:.2f}x | {pure} |")
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
    p.add_argument("--layers", type=int, default=LAYERS,
                   help="DSA layers of the model (1: no layer re-rounds another's output into its FP8 cache)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--budget", type=float, default=math.inf, help="seconds: no new head count starts past it")
    p.add_argument("--shims", action="store_true", help="tools/vllm_device_shims.py first (the device)")
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
