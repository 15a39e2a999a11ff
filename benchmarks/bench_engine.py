"""vLLM's engine end to end, this backend beside vLLM's Hopper default: `LLM(...)` through FLASHINFER_MLA_SPARSE
(this package) and FLASHMLA_SPARSE on the same small DeepSeek-V3.2, same weights, same prompts; the check, then timing.

    python benchmarks/bench_engine.py check --out DIR [--heads 16] [--layers 1] [--seeds 7,8] [--faults ...]
    python benchmarks/bench_engine.py time --out DIR --heads 16 [--layers auto] [--requests 1,8,32,128] ...
    python benchmarks/bench_engine.py bounds DIR/engine_check.json ...  (a CPU: the bounds check runs give)
    (on the device: bash tools/device_run.sh --vllm --fi py benchmarks/bench_engine.py check --out $OUT/check ...)

Each engine lives in a process of its own (benchmarks/engine_worker.py), driven over a pipe, so two engines never
share a CUDA context, and a failed start is reported with its error.

**The check** (`check`). CHECK_REQUESTS requests with prompts in CHECK_CONTEXT (past index_topk, so the indexer's
choice matters; spaced so that a token's position names its request and step) are forced down one random token
trace in every engine (vLLM's trace replay) for CHECK_STEPS decode steps, each seed a workload of its own. Every
engine records each step's full-vocabulary log-probabilities and layer 0's attention output; one engine runs at a
time. The engines: FLASHMLA_SPARSE (the reference) and this backend under CUDA graphs; vLLM's
FLASHINFER_MLA_SPARSE_SM90 (eager, where FlashInfer is carried) on its own BF16 query, on this backend's FP8 query
(engine_check.SAME_INPUTS, the denominator) and on that query with its keys reversed (engine_check.KEYS_REVERSED);
and one CUDA-graph engine of this backend per planted fault (engine_worker.FAULTS), the fault in its decode rows
only. engine_check's docstring says what is computed, how its bounds are set and what passes. At CHECK_LAYERS
(one layer: no layer re-rounds another's output into its FP8 cache) the check is judged; at more layers the run is
a smoke test: every engine starts, follows the trace, records every step and runs its own backend, nothing more.

**The timing** (`time`). Two engines, this backend and FLASHMLA_SPARSE, without instruments, up at once on a model
of as many layers as the card holds for both (engine_timing.fit_layers, at most 61). At each (requests, context mix)
both prefill the same prompts, run WARMUP decode steps at the full batch, then `windows` interleaved windows of
`steps` decode steps each (ours, FlashMLA, FlashMLA, ours, ...) and one more each under the torch profiler. A window
is wall time between synchronised ends; each step's GPU span comes from CUDA events around it; nvidia-smi's clocks
follow each window; every scheduler step in a window must be pure decode of the whole batch (engine_timing.
window_checks). Per decode step: wall µs, GPU span µs, summed kernel µs and attention µs (engine_timing.
ATTENTION_KERNELS, every kernel of both sides in the row), tokens/s, and the attention floor.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
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
import engine_check as ec  # noqa: E402
import engine_timing as et  # noqa: E402
import engine_worker as ew  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OURS, FLASHMLA, FLASHINFER_SM90, VOCAB = ew.OURS, ew.FLASHMLA, ew.FLASHINFER_SM90, ew.VOCAB
SAME_INPUTS, KEYS_REVERSED = ec.SAME_INPUTS, ec.KEYS_REVERSED

CHECK_LAYERS = 1  # the judged check; any other layer count is a smoke test
CHECK_REQUESTS, CHECK_STEPS = 64, 64
CHECK_CONTEXT = (2100, 8000)
REQUESTS = (1, 8, 32, 128)
MIXES = ("uniform-4096", "ragged-100-8000")
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # every timed batch and the check's 64 (both engines alike)
WARMUP = 4
WINDOWS, STEPS = 10, 64
TOPK = et.TOPK


def model_config(heads: int, layers: int) -> dict[str, Any]:
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


def write_model(directory: Path, heads: int, layers: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_config(heads, layers), indent=1))
    return directory


# ---------------------------------------------------------------------------------------------------- workloads


def random_tokens(lengths: list[int], seed: int) -> list[list[int]]:
    """One list of token ids (2..VOCAB-1: no BOS / EOS) per length, seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in lengths]


def check_workload(seed: int, requests: int = CHECK_REQUESTS, steps: int = CHECK_STEPS,
                   context: tuple[int, int] = CHECK_CONTEXT) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, traces) of one seed: `requests` prompts of lengths in `context`, at least steps + 2 apart (so the
    positions of one request's decode steps are no other's), and a forced trace of 1 + steps tokens each (the token
    after the prompt, then `steps` decode steps). Lengths, prompts and traces are drawn from three streams of `seed`."""
    width = steps + 2
    slots = (context[1] - context[0]) // width + 1
    if slots < requests:
        raise ValueError(f"context {context} holds {slots} prompts {width} tokens apart, fewer than requests "
                         f"({requests})")
    rng = random.Random(1000 * seed)
    lengths = [context[0] + width * slot for slot in rng.sample(range(slots), requests)]
    return random_tokens(lengths, 1000 * seed + 1), random_tokens([1 + steps] * requests, 1000 * seed + 2)


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
                eager: bool = False, fault: str = "none", fi_site: str | None = None, instruments: bool = True,
                gpu_memory_utilization: float | None = None, record_rows: int = 0) -> dict[str, Any]:
    """An engine's spec (engine_worker.serve): a checked engine carries the instruments (record_rows: the capacity of
    layer 0's recorder), a timed one none."""
    return {"backend": backend, "heads": heads, "model": str(model), "log": str(out_dir / f"{name}.log"),
            "eager": eager, "fault": fault, "fi_site": fi_site, "shims": args.shims, "instruments": instruments,
            "record_rows": record_rows, "force_mqa": not ew.flash_attention_present(),
            "capture_sizes": list(args.capture_sizes),
            "gpu_memory_utilization": gpu_memory_utilization or args.gpu_memory_utilization}


def _engine_summary(engine: EngineProcess) -> dict[str, Any]:
    info = dict(engine.info)
    info["startup_line"] = engine.startup_line()
    if engine.error:
        info["log_tail"] = engine.log_tail()
    return info


# ---------------------------------------------------------------------------------------------------- the check


class Workload:
    """One seed's prompts and traces, and the reference's and the denominator's recordings once they ran."""

    def __init__(self, seed: int, requests: int, steps: int) -> None:
        self.seed, self.steps = seed, steps
        self.prompts, self.traces = check_workload(seed, requests, steps)
        self.prompt_lens = [len(p) for p in self.prompts]
        self.logprobs: dict[str, Any] = {}
        self.layer0: dict[str, Any] = {}


def digest(tensor: Any) -> str:
    """sha256 of a tensor's bytes: engines of two device calls compare only where their references are the same."""
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def measure(name: str, got: dict[str, Any], work: Workload) -> dict[str, Any]:
    """One engine's check (engine_worker's `check` answer) against the workload's reference and, where it ran, the
    denominator: per request the mean KL from FLASHMLA_SPARSE and layer 0's relative L2 against each."""
    logprobs = got.pop("logprobs")
    recorded = got.pop("layer0")
    out: dict[str, Any] = {"logprobs_sha256": digest(logprobs), **got}
    layer0 = None
    if recorded is not None:
        layer0, dropped = ec.layer0_by_step(recorded["rows"], recorded["positions"], work.prompt_lens, work.steps)
        out["layer0_rows"] = {"recorded": int(recorded["rows"].shape[0]), "off_step": dropped,
                              "overflow": recorded["overflow"]}
    if name in (FLASHMLA, SAME_INPUTS):
        work.logprobs[name], work.layer0[name] = logprobs, layer0
    reference = work.logprobs[FLASHMLA] if name != FLASHMLA else logprobs
    kl = ec.step_kl(reference, logprobs)
    out["kl"], out["missing_steps"] = ec.request_means(kl)
    out["kl_steps"] = [[round(float(v), 6) for v in row] for row in kl]
    for key, ref in (("layer0", FLASHMLA), ("layer0_same_inputs", SAME_INPUTS)):
        if layer0 is not None and work.layer0.get(ref) is not None:
            out[key], out[f"{key}_missing_steps"] = ec.layer0_errors(work.layer0[ref], layer0)
    return out


def _check_engine(engine: EngineProcess, label: str, switches: list[tuple[str, dict[str, Any]]],
                  works: list[Workload], summary: dict[str, Any]) -> None:
    """One engine: each switch (the name its recordings go under, and the commands setting it) checked on every
    workload, then the engine stopped."""
    summary["engines"][label] = _engine_summary(engine)
    try:
        for name, commands in switches:
            if engine.error:
                summary.setdefault("errors", {})[name] = engine.error["error"][:4000]
                break
            for command, kwargs in commands.items():
                engine.call(command, **kwargs)
            for work in works:
                got = engine.call("check", prompts=work.prompts, traces=work.traces)
                summary["seeds"][str(work.seed)]["measured"][name] = measure(name, got, work)
    except RuntimeError as e:
        summary.setdefault("errors", {})[label] = str(e)[:4000]
    finally:
        engine.stop()


def check_engines(faults: list[str], fi_site: str | None) -> list[tuple[str, str, dict[str, Any], list]]:
    """(label, backend, spec options, switches) of every engine of a check, in the order they run: the reference
    first, FlashInfer (the denominator) second, then this backend and each fault."""
    plan: list[tuple[str, str, dict[str, Any], list]] = [("flashmla", FLASHMLA, {}, [(FLASHMLA, {})])]
    if fi_site:
        off = {"set_query_rounding": {"on": False}, "set_key_order": {"reversed_": False}}
        plan.append(("fi_sm90", FLASHINFER_SM90, {"eager": True, "fi_site": fi_site}, [
            (FLASHINFER_SM90, off),
            (SAME_INPUTS, {**off, "set_query_rounding": {"on": True}}),
            (KEYS_REVERSED, {"set_query_rounding": {"on": True}, "set_key_order": {"reversed_": True}})]))
    plan.append(("ours", OURS, {}, [(OURS, {})]))
    plan += [(f"fault_{f}", OURS, {"fault": f}, [(ec.FAULT_PREFIX + f, {})]) for f in faults]
    return plan


def smoke_verdict(measured: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A smoke test's verdict: every engine followed the trace, recorded every step with finite KL, and ran its own
    backend (its impl's forward_mqa counted rows, this backend's FlashInferCore.decode too)."""
    own = {OURS: ("KimiDSAFlashInferMLASparseImpl.forward_mqa", "FlashInferCore.decode"),
           FLASHMLA: ("FlashMLASparseImpl.forward_mqa",),
           FLASHINFER_SM90: ("FlashInferMLASparseSM90Impl.forward_mqa",)}
    out = {}
    for name, m in measured.items():
        backend = OURS if name == OURS or name.startswith(ec.FAULT_PREFIX) else \
            FLASHINFER_SM90 if name.startswith(FLASHINFER_SM90) else FLASHMLA
        counted = all(m.get("coverage", {}).get(c, {}).get("rows", 0) > 0 for c in own[backend])
        finite = all(math.isfinite(v) for v in m["kl"])
        out[name] = {"passes": m["tokens_follow_trace"] and m["missing_steps"] == 0 and finite and counted,
                     "tokens_follow_trace": m["tokens_follow_trace"], "missing_steps": m["missing_steps"],
                     "kl_finite": finite, "own_backend_counted": counted}
    return {"kind": "smoke", "engines": out, "ok": bool(out) and all(v["passes"] for v in out.values())}


def judge_seed(measured: dict[str, dict[str, Any]], seed: int, judged: bool) -> dict[str, Any]:
    """One seed's statistics (engine_check) and verdicts: at the module's bounds when the check is judged, a smoke
    test's otherwise. Without the denominator (FlashInfer not carried) nothing is judged and the seed fails."""
    if not judged:
        return {"verdicts": smoke_verdict(measured)}
    if SAME_INPUTS not in measured or FLASHMLA not in measured:
        return {"verdicts": {"kind": "check", "ok": False,
                             "judged": f"nothing: the check needs {FLASHMLA} and {SAME_INPUTS} (FlashInfer carried, "
                                       "--fi-site); no other pair stands in for them"}}
    stats = ec.engine_statistics({n: m for n, m in measured.items() if n != FLASHMLA}, seed=seed)
    missing = {n: m["missing_steps"] for n, m in measured.items()}
    return {"statistics": stats, "verdicts": {"kind": "check", **ec.verdicts(stats, ec.module_bounds(), missing)}}


def run_check(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    judged = args.layers == CHECK_LAYERS
    report = new_report(args, kind="check" if judged else "smoke", layers=args.layers, seeds=args.seeds,
                        faults=args.faults, bounds=ec.module_bounds(), requests=args.check_requests,
                        steps=args.check_steps, context=list(CHECK_CONTEXT), query_gain=ew.QUERY_GAIN)
    record_rows = 2 * args.check_requests * args.check_steps + 1024
    ok = True
    for heads in args.heads:
        if past_budget(report, heads, start, args.budget):
            ok = False
            continue
        model = write_model(out_dir / f"model_h{heads}", heads, args.layers)
        works = [Workload(seed, args.check_requests, args.check_steps) for seed in args.seeds]
        summary: dict[str, Any] = {"engines": {}, "seeds": {str(w.seed): {"measured": {}} for w in works}}
        report["heads"][heads] = summary
        for label, backend, options, switches in check_engines(args.faults, args.fi_site):
            if time.monotonic() - start > args.budget:
                summary.setdefault("errors", {})[label] = f"not started: past the budget of {args.budget} s"
                continue
            spec = engine_spec(out_dir, f"h{heads}_{label}", model, backend, heads, args, record_rows=record_rows,
                               **options)
            _check_engine(EngineProcess(spec), label, switches, works, summary)
            _save(out_dir / "engine_check.json", report)
        for work in works:
            seed = summary["seeds"][str(work.seed)]
            seed.update(judge_seed(seed["measured"], work.seed, judged))
            ok &= bool(seed["verdicts"]["ok"]) or seed["verdicts"]["ok"] is None
            ok &= all(m["tokens_follow_trace"] for m in seed["measured"].values())
        ok &= not summary.get("errors") and not any(e.get("error") for e in summary["engines"].values())
        _save(out_dir / "engine_check.json", report)
    print(json.dumps(check_lines(report), indent=1))
    return 0 if ok else 1


def check_lines(report: dict[str, Any]) -> dict[str, Any]:
    """The short form of a check report: per heads and seed, each engine's ratios (interval) and the verdict."""
    out: dict[str, Any] = {"kind": report["kind"], "bounds": report["bounds"]}
    for heads, s in report["heads"].items():
        per_seed = {}
        for seed, data in s.get("seeds", {}).items():
            stats = data.get("statistics", {})
            per_seed[seed] = {
                "ratios": {n: {k: round(v[f"{k}_interval"]["ratio"], 3) for k in ("kl", "layer0")
                               if f"{k}_interval" in v} for n, v in stats.items()},
                "ok": data.get("verdicts", {}).get("ok"),
                "bounds_from_null_pairs": data.get("verdicts", {}).get("bounds_from_null_pairs")}
        out[str(heads)] = {"seeds": per_seed, "errors": {k: v[:300] for k, v in s.get("errors", {}).items()}}
    return out


def merged_statistics(reports: list[dict[str, Any]], heads: int, seed: int) -> dict[str, dict[str, Any]]:
    """One seed's statistics over several check reports (the faults split across device calls), each report's
    reference and denominator the same bytes (their log-probabilities' sha256), else a ValueError naming them."""
    merged: dict[str, dict[str, Any]] = {}
    digests: dict[str, str] = {}
    for i, report in enumerate(reports):
        if report.get("kind") != "check":
            raise ValueError(f"reports[{i}] is a {report.get('kind')!r} run; bounds come from judged (one-layer) "
                             "checks")
        data = report["heads"].get(str(heads), {}).get("seeds", {}).get(str(seed), {})
        if "statistics" not in data:
            raise ValueError(f"reports[{i}] holds no statistics of seed {seed} at {heads} heads")
        for name in (FLASHMLA, SAME_INPUTS):
            digest_ = data["measured"][name]["logprobs_sha256"]
            if digests.setdefault(name, digest_) != digest_:
                raise ValueError(f"reports[{i}]'s {name} differs from the first report's (seed {seed}): the ratios "
                                 "of two calls compare only over the same reference and denominator")
        merged.update(data["statistics"])
    return merged


def bounds_from_reports(reports: list[dict[str, Any]], heads: int = 16, calibration: int = ec.CALIBRATION_SEED,
                        validation: int = ec.VALIDATION_SEED) -> dict[str, Any]:
    """What check reports give for the bounds: set_bounds on the calibration seed's statistics (the null pairs
    alone), validate on the validation seed's, with every fault the reports ran."""
    bounds = ec.set_bounds(merged_statistics(reports, heads, calibration))
    faults = sorted({f for r in reports for f in r["faults"]})
    check = ec.validate(merged_statistics(reports, heads, validation), bounds, faults)
    return {"heads": heads, "calibration_seed": calibration, "validation_seed": validation, "faults": faults,
            "bounds": bounds, "validation": check}


def new_report(args: argparse.Namespace, **fields: Any) -> dict[str, Any]:
    """A run's report: the date, `fields`, the device shims installed (--shims, decided once here; the engines and
    vLLM's own child processes apply the same), and an empty per-heads part."""
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **fields,
              "heads": {}}
    if args.shims:
        report["shims"] = ew.install_device_shims()
    return report


def past_budget(report: dict[str, Any], heads: int, start: float, budget: float) -> bool:
    """Whether the run is past its budget; if so the head count is marked skipped in the report."""
    if time.monotonic() - start <= budget:
        return False
    report["heads"][heads] = {"skipped": f"past the budget of {budget} s"}
    return True


def _save(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))


# ---------------------------------------------------------------------------------------------------- the timing


def attention_floor_us(lengths: list[int], backend: str, layers: int, copy_gbps: float | None) -> float | None:
    """µs a decode step's attention needs at least: every selected KV row (min(context, TOPK) a request, each layer,
    in the backend's own row format) moved once at the machine's measured copy rate (timing.ceilings: bytes read +
    written a second), as the suite's floors count bytes."""
    if not copy_gbps or backend not in et.ROW_BYTES:
        return None
    rows = sum(min(n, TOPK) for n in lengths) * layers
    return rows * et.ROW_BYTES[backend] / (copy_gbps * 1e9) * 1e6


def point_tokens(requests: int, mix: str, windows: int, steps: int) -> tuple[list[int], int]:
    """A timing point's prompt lengths and its requests' max_tokens, refused when they pass max_model_len."""
    lengths = context_lengths(mix, requests, seed=1000 + requests)
    tokens = et.batch_tokens(lengths, windows, steps, WARMUP, ew.MAX_NUM_BATCHED_TOKENS)
    if max(lengths) + tokens > ew.MAX_MODEL_LEN:
        raise ValueError(f"windows x steps ({windows} x {steps}) at {mix} need {max(lengths) + tokens} tokens a "
                         f"request, past max_model_len {ew.MAX_MODEL_LEN}")
    return lengths, tokens


def time_point(engines: dict[str, EngineProcess], heads: int, layers: int, requests: int, mix: str,
               args: argparse.Namespace, copy_gbps: float | None) -> list[dict[str, Any]]:
    """One (heads, requests, mix) point on both engines: the same prompts prefilled in each, then `windows` timed
    windows each, in turn, and one profiled window each; one row per backend."""
    lengths, tokens = point_tokens(requests, mix, args.windows, args.steps)
    prompts = random_tokens(lengths, seed=2000 + requests)
    names = list(engines)
    prefill = {n: engines[n].call("start_batch", prompts=prompts, tokens=tokens, warmup=WARMUP) for n in names}
    windows: dict[str, list[dict]] = {n: [] for n in names}
    try:
        for rep in range(args.windows):
            for n in (names if rep % 2 == 0 else names[::-1]):
                windows[n].append(engines[n].call("decode_window", steps=args.steps))
        profiled = {n: engines[n].call("decode_window", steps=args.steps, profile=True) for n in names}
    finally:
        for n in names:
            engines[n].call("end_batch")
    kernels = {n: et.classify(profiled[n]["kernels_us"], profiled[n]["steps"], n, heads) for n in names}
    unmatched = et.unmatched_other(*(kernels[n]["kernels"] for n in names)) if len(names) == 2 else []
    rows = []
    for n in names:
        every = [*windows[n], profiled[n]]
        step_us = [w["seconds"] / w["steps"] * 1e6 for w in windows[n]]
        spans = [s for w in windows[n] for s in w["step_gpu_span_us"]]
        median = statistics.median(step_us)
        gpu = kernels[n]
        floor = attention_floor_us(lengths, n, layers, copy_gbps)
        fraction = floor / gpu["attention_us"] if floor and gpu["attention_us"] else None
        sm_clocks = [int(g["clocks.sm"]) for w in windows[n] for g in w["clocks"].get("gpus", [])
                     if g.get("clocks.sm", "").isdigit()]
        rows.append({
            "backend": n, "heads": heads, "layers": layers, "requests": requests, "context_mix": mix,
            "decode_step_us": round(median, 2), "gpu_span_us": round(statistics.median(spans), 2) if spans else 0.0,
            "kernel_us": round(gpu["kernel_us"], 2), "attention_us": round(gpu["attention_us"], 2),
            "tokens_per_s": round(requests / (median * 1e-6), 1), "gpu": engines[n].info.get("gpu"),
            "prefill_path": engines[n].info.get("prefill_path"),
            "decode_step_us_windows": [round(v, 2) for v in step_us],
            "decode_step_spread": round((max(step_us) - min(step_us)) / median, 4),
            "window_gpu_span_us": [round(w["window_gpu_span_us"], 1) for w in windows[n]],
            "by_class_us": gpu["by_class_us"], "kernels": gpu["kernels"], "unmatched_other": unmatched,
            "attention_floor_us": None if floor is None else round(floor, 2),
            "attention_floor_fraction": None if fraction is None else round(fraction, 3),
            **et.window_checks(every, requests, fraction),
            "sm_clock_mhz": [min(sm_clocks), max(sm_clocks)] if sm_clocks else None,
            "clocks_first_last": [windows[n][0]["clocks"], windows[n][-1]["clocks"]],
            "prompt_tokens": sum(lengths), "max_tokens": tokens, "prefill_s": round(prefill[n]["prefill_s"], 3),
        })
    return rows


def timing_layers(args: argparse.Namespace, heads: int, card_bytes: int | None) -> dict[str, Any]:
    """The timed model's layers: args.layers, or (auto) engine_timing.fit_layers for the largest point's tokens among
    every point of the issue's set (REQUESTS x MIXES) and the run's own, so that every call at a head count on one
    card times the same model whichever points it holds."""
    tokens = max(sum(lengths) + requests * n_tokens for requests in {*REQUESTS, *args.requests}
                 for mix in {*MIXES, *args.mixes}
                 for lengths, n_tokens in [point_tokens(requests, mix, args.windows, args.steps)])
    if args.layers != "auto":
        return {"layers": int(args.layers), "tokens": tokens, "gpu_memory_utilization": args.gpu_memory_utilization}
    if card_bytes is None:
        raise ValueError("--layers auto needs the card's memory (a CUDA device)")
    return et.fit_layers(model_config(heads, 1), card_bytes, tokens)


def run_time(args: argparse.Namespace) -> int:
    import torch
    from vllm_kimi_dsa.timing import ceilings

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    report = new_report(args, windows=args.windows, steps=args.steps, warmup=WARMUP,
                        attention_kernels={b: [[c, p.pattern] for c, p in kernels]
                                           for b, kernels in et.ATTENTION_KERNELS.items()})
    report["ceilings"] = ceilings(torch.device("cuda"), quick=True)
    report["clocks_before"] = ew.gpu_clocks()
    card_bytes = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    rows: list[dict] = []
    ok = True
    for heads in args.heads:
        if past_budget(report, heads, start, args.budget):
            ok = False
            continue
        size = timing_layers(args, heads, card_bytes)
        summary: dict[str, Any] = report["heads"].setdefault(heads, {"model": size})
        model = write_model(out_dir / f"model_h{heads}", heads, size["layers"])
        engines = {name: EngineProcess(engine_spec(out_dir, f"h{heads}_{label}", model, name, heads, args,
                                                   instruments=False,
                                                   gpu_memory_utilization=size["gpu_memory_utilization"]))
                   for name, label in ((OURS, "ours"), (FLASHMLA, "flashmla"))}
        summary["engines"] = {n: _engine_summary(e) for n, e in engines.items()}
        try:
            if any(e.error for e in engines.values()):
                ok = False
                continue
            configs = {n: {k: e.info["config"][k] for k in ("max_num_seqs", "capture_sizes", "cudagraph_mode",
                                                           "compilation_mode", "async_scheduling",
                                                           "num_hidden_layers")}
                       for n, e in engines.items()}
            summary["same_engine_config"] = configs[OURS] == configs[FLASHMLA]
            for requests in args.requests:
                for mix in args.mixes:
                    if time.monotonic() - start > args.budget:
                        summary.setdefault("skipped", []).append(f"{requests}x{mix}")
                        ok = False
                        continue
                    try:
                        point = time_point(engines, heads, size["layers"], requests, mix, args,
                                           report["ceilings"]["copy_GBps"])
                        rows.extend(point)
                        ok &= all(r["full_batch"] for r in point)
                    except RuntimeError as e:
                        summary.setdefault("errors", {})[f"{requests}x{mix}"] = str(e)[:4000]
                        ok = False
                    _save_timing(out_dir, report, rows)
        finally:
            for e in engines.values():
                e.stop()
        _save_timing(out_dir, report, rows)
    report["clocks_after"] = ew.gpu_clocks()
    _save_timing(out_dir, report, rows)
    print(et.table(rows))
    return 0 if ok else 1


def _save_timing(out_dir: Path, report: dict[str, Any], rows: list[dict]) -> None:
    _save(out_dir / "engine_report.json", report)
    _save(out_dir / "engine.json", rows)
    (out_dir / "engine.md").write_text(et.table(rows) + "\n")


# ---------------------------------------------------------------------------------------------------- the command line


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _words(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _faults(text: str) -> list[str]:
    names = list(ew.FAULTS) if text == "all" else _words(text)
    unknown = [n for n in names if n not in ew.FAULTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"faults {unknown} are none of {sorted(ew.FAULTS)}")
    return names


def _layers(text: str) -> int | str:
    return text if text == "auto" else int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", required=True)
    common.add_argument("--heads", type=_ints, default=[16])
    common.add_argument("--capture-sizes", type=_ints, default=list(CAPTURE_SIZES))
    common.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    common.add_argument("--budget", type=float, default=math.inf, help="seconds: nothing new starts past it")
    common.add_argument("--shims", action="store_true", help="tools/vllm_device_shims.py first (the device)")
    c = sub.add_parser("check", parents=[common], help="the check: every engine on forced traces, one at a time")
    c.add_argument("--layers", type=int, default=CHECK_LAYERS,
                   help=f"{CHECK_LAYERS}: the judged check; more: a smoke test")
    c.add_argument("--seeds", type=_ints, default=[ec.CALIBRATION_SEED, ec.VALIDATION_SEED])
    c.add_argument("--faults", type=_faults, default=list(ew.FAULTS), help="'all', or a comma list ('' : none)")
    c.add_argument("--fi-site", default=os.environ.get("KIMI_DSA_FI_SITE"),
                   help="FlashInfer's site (tools/device_run.sh --fi unpacks .carry/fi and sets $KIMI_DSA_FI_SITE)")
    c.add_argument("--check-requests", type=int, default=CHECK_REQUESTS)
    c.add_argument("--check-steps", type=int, default=CHECK_STEPS)
    t = sub.add_parser("time", parents=[common], help="decode timing of this backend and FLASHMLA_SPARSE")
    t.add_argument("--layers", type=_layers, default="auto", help="'auto': as many as the card holds (at most 61)")
    t.add_argument("--requests", type=_ints, default=list(REQUESTS))
    t.add_argument("--mixes", type=_words, default=list(MIXES))
    t.add_argument("--windows", type=int, default=WINDOWS)
    t.add_argument("--steps", type=int, default=STEPS, help="decode steps a timed window")
    b = sub.add_parser("bounds", help="the bounds check reports' null pairs give, validated (no GPU)")
    b.add_argument("reports", nargs="+", help="engine_check.json of one or more judged check runs")
    b.add_argument("--heads", type=int, default=16)
    args = parser.parse_args(argv)
    if args.command == "check":
        return run_check(args)
    if args.command == "time":
        if args.windows < 10 or args.steps < 64:
            parser.error("time needs --windows >= 10 and --steps >= 64")
        return run_time(args)
    reports = [json.loads(Path(path).read_text()) for path in args.reports]
    print(json.dumps(bounds_from_reports(reports, args.heads), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
