"""vLLM's engine end to end, this backend beside vLLM's Hopper default: `LLM(...)` generating through
FLASHINFER_MLA_SPARSE (this package) and FLASHMLA_SPARSE on the same small DeepSeek-V3.2, same weights, same prompts.

    python benchmarks/bench_engine.py run --out DIR [--heads 128,16] [--batches 1,8,32,128] [--check-only]
    (on the device: bash tools/device_run.sh --vllm py benchmarks/bench_engine.py run --out $OUT ...)

Each engine runs in a child process of its own (`worker`), so two engines never share a CUDA context and a failed
start is reported with its exact error instead of ending the run. Per head count the parent starts:

- FLASHINFER_MLA_SPARSE and FLASHMLA_SPARSE: correctness prompts (greedy, full-vocabulary log-probabilities of
  every generated token), then the throughput batches;
- FLASHINFER_MLA_SPARSE with its softmax scale 5% off (a test-only hook in the worker, `--scale-error`): the
  comparison must fail it;
- FLASHINFER_MLA_SPARSE with n-gram speculative decoding (2 draft tokens): its tokens against the plain engine's.

The model (`write_model`): DeepSeek-V3.2's attention as released (q_lora_rank 1536, kv_lora_rank 512, 128 nope +
64 rope, v 128, an indexer in every layer: 64 heads of 128, index_topk 2048), `num_attention_heads` the heads a rank
runs, 4 layers, a dense MLP, hidden 2048, vocabulary 4096. Weights: vLLM's dummy loader, then each tensor drawn again
from a generator seeded by its name (`SeededDummyLoader`, load format "dsa_seeded"): vLLM's dummy values (+-1e-3)
make every attention softmax flat, so neither the indexer's choice nor a wrong softmax scale would change a token.

Correctness (`compare`): per request, the generated tokens must be equal up to the first step where the reference's
top-2 log-probabilities are within the bound of each other (past that, a tie may go either way and the sequences
part); over those shared steps, the largest log-probability difference across the whole vocabulary must stay under
LOGPROB_BOUND. The bound comes from the caches: both backends store K/V as e4m3 (ours per-tensor 576 B rows, e4m3
query; FlashMLA's 656 B fp8_ds_mla rows with tile scales, BF16 query and rope), each value off by up to 2^-4 of
itself; over 576-long dot products of independent rounding errors that is a few 1e-3 of a logit of size ~1, and
through 4 layers and the LM head (sensitivity ~1 for these weights) about 0.02-0.05 in a log-probability. The bound
is 0.25 (5x that); a 5% softmax-scale error moves every attention logit by 5% of its size (~0.05-0.3) in every layer
and the output far past it, which the run shows by the wrong engine's row.

Throughput (`bench_batch`): prompts of 100 to 6,000 tokens (seeded), greedy, ignore_eos; decode tokens/s =
requests x 63 / (time of 64 tokens - time of 1 token), each after a warm-up at the same batch. The attention share:
a torch profiler over a 17-token and a 1-token generation, GPU kernel time of the attention kernels (ATTENTION_KERNELS:
the sparse decode and its combine, vLLM's top-k conversion) over all GPU kernel time, the 1-token run subtracted so
only decode steps count.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OURS, FLASHMLA = "FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"
VOCAB = 4096
LAYERS = 4
LOGPROB_BOUND = 0.25
TIE_MARGIN = 2 * LOGPROB_BOUND  # top-2 closer than this: the step may go either way
OUTPUT_TOKENS = 64
CHECK_REPEAT = 37
ATTENTION_KERNELS = re.compile(
    r"mla|flash_fwd|sparse_attn|decode_kernel|seesaw|few_heads|combine_kernel|convert_req_index", re.I
)


def model_config(heads: int, layers: int = LAYERS) -> dict[str, Any]:
    """config.json of a small DeepSeek-V3.2: its released attention and indexer shapes, a small dense MLP."""
    return dict(
        architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
        hidden_size=2048, intermediate_size=4096, moe_intermediate_size=512, num_hidden_layers=layers,
        first_k_dense_replace=layers, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_topk=2048, index_n_heads=64,
        index_head_dim=128, vocab_size=VOCAB, max_position_embeddings=16384, rope_theta=10000.0,
        rms_norm_eps=1e-6, torch_dtype="bfloat16", n_group=1, topk_group=1, routed_scaling_factor=1.0,
        scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1,
    )


def write_model(directory: Path, heads: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_config(heads), indent=1))
    return directory


def prompt_lengths(requests: int, seed: int, low: int = 100, high: int = 6000) -> list[int]:
    """`requests` prompt lengths spread over [low, high] (seeded; both ends included from 2 requests on)."""
    import random

    rng = random.Random(seed)
    if requests == 1:
        return [rng.randint(low, high)]
    lengths = [low, high] + [rng.randint(low, high) for _ in range(requests - 2)]
    rng.shuffle(lengths)
    return lengths


def prompts(lengths: list[int], seed: int, repeat: int = 0) -> list[list[int]]:
    """Token-id prompts (ids 2..VOCAB-1: no BOS / EOS); repeat > 0 builds each from one block of that many ids
    repeated, so n-gram speculation finds matches."""
    import random

    rng = random.Random(seed)
    out = []
    for n in lengths:
        if repeat:
            block = [rng.randrange(2, VOCAB) for _ in range(repeat)]
            out.append((block * (n // repeat + 1))[:n])
        else:
            out.append([rng.randrange(2, VOCAB) for _ in range(n)])
    return out


# ---------------------------------------------------------------------------------------------------- comparison


def compare(reference: list[dict], other: list[dict], bound: float = LOGPROB_BOUND) -> dict[str, Any]:
    """Per request, step by step while the two sequences agree (so both engines saw the same tokens): the largest
    |log-probability difference| over the vocabulary must stay within `bound`, and the tokens must be equal, except
    at a step where the reference's top-2 log-probabilities lie within TIE_MARGIN (either choice is right there);
    the comparison of that request ends at its first differing token.

    Each item: {"tokens": [...], "logprobs": [[VOCAB floats] per step] or None (tokens only)}.
    Returns {"ok", "bound", "max_logprob_diff", "first_decode_diff" (step 1, the first decode step), "requests"}."""
    rows, worst, first_decode, ok = [], 0.0, 0.0, True
    for i, (ref, got) in enumerate(zip(reference, other, strict=True)):
        diverged_at, near_tie, diff = None, False, 0.0
        for t, token in enumerate(ref["tokens"]):
            lp_ref, lp_got = ref.get("logprobs"), got.get("logprobs")
            if lp_ref and lp_got:
                step = max(abs(a - b) for a, b in zip(lp_ref[t], lp_got[t]))
                diff = max(diff, step)
                if t == 1:
                    first_decode = max(first_decode, step)
            if got["tokens"][t] != token:
                diverged_at = t
                if lp_ref:
                    first, second = sorted(lp_ref[t], reverse=True)[:2]
                    near_tie = first - second < TIE_MARGIN
                break
        request_ok = (diverged_at is None or near_tie) and diff <= bound
        ok &= request_ok
        worst = max(worst, diff)
        rows.append({"request": i, "ok": request_ok, "diverged_at": diverged_at, "near_tie": near_tie,
                     "max_logprob_diff": diff, "steps": len(ref["tokens"])})
    return {"ok": ok, "bound": bound, "max_logprob_diff": worst, "first_decode_diff": first_decode,
            "requests": rows}


# ---------------------------------------------------------------------------------------------------- worker


def _install_device_shims() -> dict[str, str]:
    """tools/vllm_device_shims.py where vLLM's own libraries cannot load (the device's torch 2.11); each shim says
    what it hides, and the report goes into the JSON."""
    path = ROOT / "tools" / "vllm_device_shims.py"
    spec = importlib.util.spec_from_file_location("vllm_device_shims", path)
    shims = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shims)
    return dict(shims.install())


def _register_seeded_loader() -> type:
    """Registers (once a process) and returns vLLM's dummy loader under load format "dsa_seeded"."""
    if "dsa_seeded" in _LOADERS:
        return _LOADERS["dsa_seeded"]
    import torch
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    @register_model_loader("dsa_seeded")
    class SeededDummyLoader(DummyModelLoader):
        """vLLM's dummy loader, then every floating tensor redrawn from a generator seeded by its name: matrices
        N(0, 1/fan_in), embeddings N(0, 1), norm weights 1, biases 0, so activations and attention logits have
        the sizes of a trained model's (the same weights in every engine of a run)."""

        def load_weights(self, model, model_config) -> None:
            super().load_weights(model, model_config)
            with torch.no_grad():
                for name, tensor in model.state_dict(keep_vars=True).items():
                    if not torch.is_floating_point(tensor) or tensor.dtype.itemsize == 1:
                        continue
                    gen = torch.Generator(device=tensor.device).manual_seed(zlib.crc32(name.encode()))
                    if name.endswith("bias"):
                        tensor.zero_()
                    elif tensor.dim() == 1:
                        tensor.fill_(1.0)
                    elif "embed" in name:
                        tensor.normal_(0.0, 1.0, generator=gen)
                    else:
                        tensor.normal_(0.0, tensor.shape[-1] ** -0.5, generator=gen)

    _LOADERS["dsa_seeded"] = SeededDummyLoader
    return SeededDummyLoader


_LOADERS: dict[str, type] = {}


def _scale_error_hook(factor: float) -> None:
    """Test-only: this backend's softmax scale times `factor` (the wrong engine the comparison must fail)."""
    from vllm_kimi_dsa import vllm_backend

    cls = vllm_backend.KimiDSAFlashInferMLASparseImpl
    init = cls.__init__

    def wrong_scale_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.scale *= factor

    cls.__init__ = wrong_scale_init


def _logprob_rows(output, vocab: int) -> list[list[float]]:
    rows = []
    for position in output.logprobs or []:
        row = [-math.inf] * vocab
        for token, lp in position.items():
            row[token] = float(lp.logprob)
        rows.append(row)
    return rows


def _greedy(tokens: int, **kwargs: Any) -> Any:
    """vLLM's SamplingParams for `tokens` greedy tokens past any EOS."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, **kwargs)


def _token_prompts(batch: list[list[int]]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in batch]


def _profile_decode(llm, inputs: list[Any]) -> dict[str, Any]:
    """GPU kernel time by kernel over a 17-token and a 1-token generation; the attention share of the difference."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def kernel_times(tokens: int) -> dict[str, float]:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(inputs, _greedy(tokens), use_tqdm=False)
            torch.cuda.synchronize()
        times: dict[str, float] = {}
        for event in prof.key_averages():
            if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
                times[event.key] = times.get(event.key, 0.0) + event.device_time_total
        return times

    long, short = kernel_times(17), kernel_times(1)
    decode = {k: long.get(k, 0.0) - short.get(k, 0.0) for k in long}
    total = sum(v for v in decode.values() if v > 0)
    attention = sum(v for k, v in decode.items() if v > 0 and ATTENTION_KERNELS.search(k))
    top = sorted(((v, k) for k, v in decode.items() if v > 0), reverse=True)[:12]
    return {"attention_share": attention / total if total else None, "decode_gpu_us": total,
            "attention_us": attention, "top_kernels": [{"kernel": k[:120], "us": round(v, 1)} for v, k in top]}


def _attention_impls(model) -> list[str]:
    return sorted({f"{type(m.impl).__module__}.{type(m.impl).__name__}" for m in model.modules() if hasattr(m, "impl")})


def bench_batch(llm, requests: int, seed: int, profile: bool) -> dict[str, Any]:
    import torch

    batch = prompts(prompt_lengths(requests, seed), seed)
    inputs = _token_prompts(batch)

    def timed(tokens: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(inputs, _greedy(tokens), use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(4)  # warm-up at this batch
    t1 = min(timed(1), timed(1))
    t64 = min(timed(OUTPUT_TOKENS), timed(OUTPUT_TOKENS))
    row = {"requests": requests, "prompt_tokens": sum(map(len, batch)), "t1_s": t1, "t64_s": t64,
           "tokens_per_s": requests * (OUTPUT_TOKENS - 1) / (t64 - t1) if t64 > t1 else None}
    if profile:
        row.update(_profile_decode(llm, inputs))
    return row


def engine_kwargs(model: str, backend: str, **overrides: Any) -> dict[str, Any]:
    """LLM(...)'s arguments: the seeded weights, no tokenizer, an fp8 cache, `backend`, the engine's own CUDA graphs
    (breakable, as vLLM sets them for DeepSeek-V3.2), no prefix caching (every run prefills), every log-probability."""
    return dict(model=model, load_format="dsa_seeded", skip_tokenizer_init=True, seed=0, dtype="bfloat16",
                kv_cache_dtype="fp8", attention_config={"backend": backend}, max_model_len=8192,
                enable_prefix_caching=False, max_logprobs=-1, **overrides)


def worker(args: argparse.Namespace) -> int:
    """One engine: build, correctness prompts, throughput batches; everything into args.out (JSON)."""
    result: dict[str, Any] = {"backend": args.backend, "heads": args.heads, "scale_error": args.scale_error,
                              "speculative_tokens": args.spec, "stage": "start"}
    out = Path(args.out)

    def save() -> None:
        out.write_text(json.dumps(result, indent=1))

    try:
        if args.shims:
            result["shims"] = _install_device_shims()
        save()
        import torch
        from vllm import LLM

        _register_seeded_loader()
        if args.scale_error != 1.0:
            _scale_error_hook(args.scale_error)
        result["gpu"] = torch.cuda.get_device_name()
        kwargs = engine_kwargs(args.model, args.backend, max_num_seqs=args.max_num_seqs,
                               max_num_batched_tokens=args.max_num_batched_tokens,
                               gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.eager)
        if args.spec:
            kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.spec,
                                            "prompt_lookup_min": 2, "prompt_lookup_max": 4}
        plugins = [e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")]
        result["plugins"] = plugins
        if args.backend == OURS and not any(p.startswith("vllm_kimi_dsa") for p in plugins):
            raise RuntimeError("vllm_kimi_dsa's vLLM plugin entry point is not installed (pip install the package; "
                               "on the device, tools/device_run.sh --vllm writes its dist-info): vLLM would run "
                               "its own FLASHINFER_MLA_SPARSE, which refuses SM90")
        result["stage"] = "engine"
        save()
        start = time.perf_counter()
        llm = LLM(**kwargs)
        result["engine_start_s"] = time.perf_counter() - start
        config = llm.llm_engine.vllm_config
        result["compilation"] = {"mode": str(config.compilation_config.mode),
                                 "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
                                 "capture_sizes": list(config.compilation_config.cudagraph_capture_sizes or [])}
        try:  # which impl class vLLM built for the attention layers (ours: KimiDSAFlashInferMLASparseImpl)
            result["attention_impls"] = llm.apply_model(_attention_impls)[0]
        except Exception as e:  # noqa: BLE001  (reported, not fatal: the startup line also names the backend)
            result["attention_impls"] = f"unknown ({type(e).__name__}: {e})"[:300]
        result["stage"] = "correctness"
        save()
        # blocks of 37 ids repeated: n-gram speculation finds drafts in them, and every engine gets the same prompts
        batch = prompts(prompt_lengths(args.check_requests, seed=7), seed=7, repeat=CHECK_REPEAT)
        outputs = llm.generate(_token_prompts(batch), _greedy(args.check_tokens, logprobs=None if args.spec else -1),
                               use_tqdm=False)
        result["check"] = [
            {"prompt_len": len(p), "tokens": list(o.outputs[0].token_ids),
             "logprobs": _logprob_rows(o.outputs[0], VOCAB) if not args.spec else None}
            for p, o in zip(batch, outputs)
        ]
        save()
        result["stage"] = "throughput"
        result["throughput"] = []
        for requests in args.batches:
            result["throughput"].append(bench_batch(llm, requests, seed=100 + requests, profile=args.profile))
            save()
        result["stage"] = "done"
        save()
        del llm
        gc.collect()
        return 0
    except BaseException as e:  # noqa: BLE001  (the exact failure goes into the JSON for the report)
        import traceback

        result["error"] = f"{type(e).__name__}: {e}"[:4000]
        result["traceback"] = traceback.format_exc()[-6000:]
        save()
        return 1


# ---------------------------------------------------------------------------------------------------- parent


def run_worker(out_dir: Path, name: str, model: Path, backend: str, heads: int, *, batches: list[int],
               scale_error: float = 1.0, spec: int = 0, timeout: float = 1200, extra: list[str] = ()) -> dict:
    """One engine in a child process; its JSON plus the startup line and the log's tail."""
    path, log = out_dir / f"{name}.json", out_dir / f"{name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--backend", backend, "--heads", str(heads),
           "--model", str(model), "--out", str(path), "--scale-error", str(scale_error), "--spec", str(spec),
           "--batches", ",".join(map(str, batches)), *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    try:
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    result = json.loads(path.read_text()) if path.exists() else {"error": "no JSON written"}
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if "vllm_kimi_dsa" in line and "serves" in line]
    result.update(rc=rc, wall_s=time.perf_counter() - start, startup_line=lines[0] if lines else None,
                  log_tail=text[-3000:] if rc != 0 else None)
    return result


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "bound": LOGPROB_BOUND, "heads": {}}
    rows: list[dict] = []
    extra = ["--check-requests", str(args.check_requests), "--check-tokens", str(args.check_tokens)]
    if args.profile:
        extra.append("--profile")
    if args.shims:  # decided once here; the workers (and vLLM's own child processes) apply the same shims
        report["shims"] = _install_device_shims()
        extra.append("--shims")
    ok = True
    for heads in args.heads:
        model = write_model(out_dir / f"model_h{heads}", heads)
        runs = {
            OURS: run_worker(out_dir, f"h{heads}_ours", model, OURS, heads, batches=args.batches, extra=extra),
            FLASHMLA: run_worker(out_dir, f"h{heads}_flashmla", model, FLASHMLA, heads, batches=args.batches,
                                 extra=extra),
        }
        if args.negative:
            runs["wrong_scale"] = run_worker(out_dir, f"h{heads}_wrong", model, OURS, heads, batches=[],
                                             scale_error=1.05, extra=extra)
        if args.spec:
            runs["ngram"] = run_worker(out_dir, f"h{heads}_ngram", model, OURS, heads, batches=[],
                                       spec=args.spec, extra=extra)
        summary: dict[str, Any] = {k: {key: v.get(key) for key in ("rc", "stage", "error", "engine_start_s",
                                                                     "startup_line", "compilation", "shims",
                                                                     "wall_s")}
                                   for k, v in runs.items()}
        if runs[OURS].get("check") and runs[FLASHMLA].get("check"):
            summary["ours_vs_flashmla"] = compare(runs[FLASHMLA]["check"], runs[OURS]["check"])
            ok &= summary["ours_vs_flashmla"]["ok"]
            if args.negative:  # the wrong engine must fail the comparison that ours passes
                wrong = runs["wrong_scale"].get("check")
                summary["wrong_vs_flashmla"] = compare(runs[FLASHMLA]["check"], wrong) if wrong else None
                ok &= bool(wrong) and not summary["wrong_vs_flashmla"]["ok"]
            if args.spec:  # speculative decoding: the plain engine's tokens (its log-probabilities name the ties)
                spec = runs["ngram"].get("check")
                summary["ngram_vs_ours"] = compare(runs[OURS]["check"], spec) if spec else None
                ok &= bool(spec) and summary["ngram_vs_ours"]["ok"]
        else:
            ok = False
        for backend in (OURS, FLASHMLA):
            for row in runs[backend].get("throughput") or []:
                # the row {backend, heads, requests, tokens_per_s, attention_share, gpu}, then the rest
                rows.append({"backend": backend, "heads": heads, "attention_share": None,
                             "gpu": runs[backend].get("gpu"), **row})
        report["heads"][heads] = summary
        (out_dir / "engine_report.json").write_text(json.dumps(report, indent=1))
        (out_dir / "engine.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    print(json.dumps({h: {k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "requests"})
                          for k, v in s.items()} for h, s in report["heads"].items()}, indent=1)[:6000])
    return 0 if ok else 1


def table(rows: list[dict]) -> str:
    """Markdown: per (heads, requests), each backend's decode tokens/s and attention share, and the ratio."""
    by = {(r["heads"], r["requests"], r["backend"]): r for r in rows}
    lines = ["| heads | requests | FLASHINFER_MLA_SPARSE tok/s (attn share) | FLASHMLA_SPARSE tok/s (attn share) | "
             "ratio |", "|---|---|---|---|---|"]
    for heads, requests in sorted({(h, q) for h, q, _ in by}):
        cells = []
        for backend in (OURS, FLASHMLA):
            r = by.get((heads, requests, backend))
            share = r and r.get("attention_share")
            cells.append("-" if not r or not r["tokens_per_s"] else
                         f"{r['tokens_per_s']:.0f}" + (f" ({share:.2f})" if share is not None else ""))
        a, b = by.get((heads, requests, OURS)), by.get((heads, requests, FLASHMLA))
        ratio = (f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x" if a and b and a["tokens_per_s"]
                 and b["tokens_per_s"] else "-")
        lines.append(f"| {heads} | {requests} | {cells[0]} | {cells[1]} | {ratio} |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="every engine of the comparison, each in a child process")
    p_run.add_argument("--out", required=True)
    p_run.add_argument("--heads", type=_ints, default=[128, 16])
    p_run.add_argument("--batches", type=_ints, default=[1, 8, 32, 128])
    p_run.add_argument("--check-requests", type=int, default=6)
    p_run.add_argument("--check-tokens", type=int, default=12)
    p_run.add_argument("--spec", type=int, default=2, help="n-gram draft tokens of the speculative run (0: none)")
    p_run.add_argument("--no-negative", dest="negative", action="store_false")
    p_run.add_argument("--profile", action="store_true", help="attention share by the torch profiler")
    p_run.add_argument("--shims", action="store_true", help="tools/vllm_device_shims.py first (the device)")
    p_worker = sub.add_parser("worker", help="one engine (run starts these)")
    p_worker.add_argument("--backend", required=True)
    p_worker.add_argument("--heads", type=int, required=True)
    p_worker.add_argument("--model", required=True)
    p_worker.add_argument("--out", required=True)
    p_worker.add_argument("--batches", type=_ints, default=[])
    p_worker.add_argument("--scale-error", type=float, default=1.0)
    p_worker.add_argument("--spec", type=int, default=0)
    p_worker.add_argument("--check-requests", type=int, default=6)
    p_worker.add_argument("--check-tokens", type=int, default=12)
    p_worker.add_argument("--max-num-seqs", type=int, default=128)
    p_worker.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p_worker.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p_worker.add_argument("--eager", action="store_true")
    p_worker.add_argument("--profile", action="store_true")
    p_worker.add_argument("--shims", action="store_true")
    args = parser.parse_args(argv)
    return run(args) if args.command == "run" else worker(args)


if __name__ == "__main__":
    sys.exit(main())
