"""One vLLM engine (`LLM(...)`) in a process of its own, driven by benchmarks/bench_engine.py over a pipe: a check
that forces every request down the same token trace and records each step's log-probabilities, and decode windows
timed step by step at a fixed batch, with the torch profiler's GPU time by kernel beside them.

What the engine needs on the device (ENGINE_ENV, engine_kwargs), the seeded weights (register_seeded_loader), the
recorder (RecordLogits, a vLLM Model Runner V2 logits processor), the device-side call counters (Coverage), the
attention-logit probe (LogitProbe) and the planted faults of the negative controls (Faults, this backend only, in an
eager engine) are test instruments of the benchmark, not package code: nothing here is imported by vllm_kimi_dsa.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import re
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OURS, FLASHMLA, FLASHINFER_SM90 = "FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM90"
VOCAB = 4096

# vLLM's Model Runner V2 sampler asks FlashInfer whether it can sample (flashinfer_sampler_supported imports
# vllm.v1.attention.backends.flashinfer, which imports flashinfer) unless this is 0, and the device has no FlashInfer.
# Greedy decoding never uses FlashInfer's top-k / top-p sampler.
ENGINE_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}

# Every engine of a run on the same scheduler limits (the timed pair compares like with like): the largest timed
# batch, vLLM's default chunk, and room for the ragged mix's 8,000-token prompts plus their generated tokens.
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN = 128, 8192, 8448

# The seeded weights draw every matrix N(0, 1/fan_in), which gives attention logits of std ~1 (the query's and the
# key's 192 rope + nope dims have unit rms; the softmax scale is 1/sqrt(192)) and a largest probability ~0.01 of 2048:
# a flat softmax, where a 5% scale error moves nothing. q_b_proj (the query's last projection before the absorption)
# drawn QUERY_GAIN times larger scales every logit by QUERY_GAIN: std ~3.5, as trained DSA models' attention has
# (measured in each run by LogitProbe and recorded in the report).
QUERY_GAIN = 3.5
QUERY_PROJECTION = "q_b_proj.weight"

# The negative controls, planted in this backend only (an eager engine: each is switched between checks).
FAULTS = {
    "softmax_scale": "softmax scale 5% high (every call, prefill and decode)",
    "slot_off_by_one": "every selected cache row read one row over (an off-by-one in the flat-row math)",
    "half_topk": "each row's valid count halved (the second half of its top-k dropped)",
    "topk_ignored": "the indexer's choice ignored: each token attends to the first 2048 tokens it can see",
}
SCALE_FAULT = 1.05

# Kernel names by what they do, first match wins (combine before decode: FlashMLA's combine kernel's name holds
# "flash_fwd_mla"). The attention of a step, as the comparison counts it: both sides' decode, combine, metadata
# and query-preparation kernels; vLLM's top-k conversion (the same op on both sides) is reported apart.
KERNEL_CLASSES: tuple[tuple[str, re.Pattern], ...] = (
    ("combine", re.compile(r"combine", re.I)),
    ("metadata", re.compile(r"get_mla_metadata|sched_meta|get_decoding", re.I)),
    ("query", re.compile(r"_fused_q_kernel|concat_mla_q", re.I)),
    ("decode", re.compile(r"few_heads_kernel|seesaw|decode_kernel|splitkv_mla|mla_fp8_sparse|sparse_attn|"
                          r"flash_mla|BatchMLA|mla_sm90", re.I)),
    ("topk_convert", re.compile(r"convert_req_index|index_remap|_pack_topk|clamp_work", re.I)),
)
ATTENTION_CLASSES = ("decode", "combine", "metadata", "query")


def kernel_class(name: str) -> str:
    """The KERNEL_CLASSES class of a CUDA kernel's name, "other" for the rest of the step."""
    for label, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return label
    return "other"


# ------------------------------------------------------------------------------------------ the engine's arguments


def flash_attention_present() -> bool:
    """Whether vLLM's FlashAttention kernels are installed (either library): a user's vLLM wheel has them; the device's
    pack does not (tools/pack_vllm.sh carries no FlashAttention)."""
    for module in ("vllm._vllm_fa2_C", "vllm._vllm_fa3_C"):
        try:
            if importlib.util.find_spec(module) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def prefill_path(force_mqa: bool) -> str:
    """What an engine row says of its prefills (README: "Which batches reach the backend")."""
    if force_mqa:
        return ("sparse: every prefill through the backend (sparse_mla_force_mqa; FlashAttention, vLLM's dense-MHA "
                "prefill of short prompts on SM90, is not installed here)")
    return "vLLM's default: prefills of at most index_topk tokens as dense MHA (FlashAttention), longer ones sparse"


def engine_kwargs(model: str, backend: str, *, force_mqa: bool, eager: bool = False,
                  capture_sizes: list[int] | None = None, gpu_memory_utilization: float = 0.3) -> dict[str, Any]:
    """LLM(...)'s arguments: the seeded weights, no tokenizer, an fp8 cache, `backend`, vLLM's own CUDA graphs
    (breakable, as vLLM sets them for DeepSeek-V3.2) at `capture_sizes` (None: vLLM's), no prefix caching (every run
    prefills), trace replay (vLLM's forced-token decoding, Model Runner V2) and the log-probability recorder.

    force_mqa: every prefill through the sparse backend (attention_config.sparse_mla_force_mqa), for a machine
    without FlashAttention only: where it loads, a user's engine sends short prefills to it, and so does this one.
    """
    attention: dict[str, Any] = {"backend": backend}
    if force_mqa:
        attention["sparse_mla_force_mqa"] = True
    kwargs = dict(model=model, load_format="dsa_seeded", skip_tokenizer_init=True, seed=0, dtype="bfloat16",
                  kv_cache_dtype="fp8", attention_config=attention, max_model_len=MAX_MODEL_LEN,
                  enable_prefix_caching=False, max_num_seqs=MAX_NUM_SEQS,
                  max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, gpu_memory_utilization=gpu_memory_utilization,
                  enforce_eager=eager, enable_trace_replay=True, logits_processors=[RecordLogits])
    if capture_sizes is not None and not eager:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": list(capture_sizes)}
    return kwargs


def greedy(tokens: int, **kwargs: Any) -> Any:
    """vLLM's SamplingParams for `tokens` greedy tokens past any EOS."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, **kwargs)


def token_prompts(batch: list[list[int]]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in batch]


# ------------------------------------------------------------------------------------------ the seeded weights

_LOADERS: dict[str, type] = {}


# A KV-cache scale parameter's value for "not in the checkpoint" (vLLM's KVCacheScaleParameter starts at it); vLLM's
# post-load hook then sets the layer's q / k / v scales to 1.0, as for any checkpoint without FP8 scales.
SCALE_NOT_LOADED = -1.0


def seeded_value(name: str, tensor: Any, generator: Any) -> None:
    """Draw `tensor` (named `name` in the model's state dict) in place as the seeded loader does. 0-d tensors are
    vLLM's per-layer FP8 scales, which its dummy loader draws like weights (uniform +-1e-3: a positive k_scale of 5e-4
    saturates every e4m3 cache value): the KV-cache scale parameters (k_scale, v_scale, q_scale, prob_scale) go back to
    SCALE_NOT_LOADED and the layer's own copies (_k_scale, ...) to 1.0, an unquantized checkpoint's state. Then
    biases 0, 1-d (norm) weights 1, embeddings N(0, 1), q_b_proj N(0, QUERY_GAIN^2 / fan_in), every other matrix
    N(0, 1/fan_in)."""
    if tensor.dim() == 0:
        from vllm.model_executor.layers.quantization.kv_cache import KVCacheScaleParameter

        tensor.fill_(SCALE_NOT_LOADED if isinstance(tensor, KVCacheScaleParameter) else 1.0)
        return
    if name.endswith("bias"):
        tensor.zero_()
    elif tensor.dim() == 1:
        tensor.fill_(1.0)
    elif "embed" in name:
        tensor.normal_(0.0, 1.0, generator=generator)
    else:
        gain = QUERY_GAIN if name.endswith(QUERY_PROJECTION) else 1.0
        tensor.normal_(0.0, gain * tensor.shape[-1] ** -0.5, generator=generator)


def register_seeded_loader() -> type:
    """Registers (once a process) and returns vLLM's dummy loader under load format "dsa_seeded"."""
    if "dsa_seeded" in _LOADERS:
        return _LOADERS["dsa_seeded"]
    import torch
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    @register_model_loader("dsa_seeded")
    class SeededDummyLoader(DummyModelLoader):
        """vLLM's dummy loader, then every floating tensor redrawn from a generator seeded by its name
        (seeded_value), so every engine of a run, in any process, holds the same weights."""

        def load_weights(self, model, model_config) -> None:
            super().load_weights(model, model_config)
            with torch.no_grad():
                for name, tensor in model.state_dict(keep_vars=True).items():
                    if not torch.is_floating_point(tensor) or tensor.dtype.itemsize == 1:
                        continue
                    gen = torch.Generator(device=tensor.device).manual_seed(zlib.crc32(name.encode()))
                    seeded_value(name, tensor, gen)

    _LOADERS["dsa_seeded"] = SeededDummyLoader
    return SeededDummyLoader


# ------------------------------------------------------------------------------------------ the recorder


def _logits_processor_base() -> type:
    try:
        from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor
    except ImportError:  # no vLLM here (a CPU test of the parent's code): the recorder is never built
        return object
    return LogitsProcessor


class RecordLogits(_logits_processor_base()):
    """A Model Runner V2 logits processor that changes nothing and records, for every request whose SamplingParams
    carry extra_args {"record_key": k, "prompt_len": n}, the log-softmax of its raw logits at each output step t
    (t = 0: the token after the prompt; t >= 1: decode steps). The logits it sees are the model's, in float32,
    before temperature (vLLM's raw_logprobs are the same log-softmax); vLLM's trace replay forces the tokens."""

    instances: list["RecordLogits"] = []

    def __init__(self, vllm_config: Any, req_states: Any) -> None:
        self.slots: dict[int, tuple[int, int]] = {}  # request slot -> (record key, prompt length)
        self.steps: dict[int, dict[int, Any]] = {}  # record key -> {t: (VOCAB,) float32 on the CPU}
        RecordLogits.instances.append(self)

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        extra = sampling_params.extra_args or {}
        if "record_key" not in extra:
            self.slots.pop(req_idx, None)
            return False
        self.slots[req_idx] = (int(extra["record_key"]), int(extra["prompt_len"]))
        return True

    def apply(self, logits: Any, ctx: Any) -> Any:
        import torch

        slots = ctx.expanded_idx_mapping.tolist()
        positions = ctx.pos.tolist()
        rows, where = [], []
        for row, (slot, pos) in enumerate(zip(slots, positions)):
            if slot in self.slots:
                key, prompt_len = self.slots[slot]
                step = pos + 1 - prompt_len
                if step >= 0:  # a chunk short of the prompt's end samples nothing
                    rows.append(row)
                    where.append((key, step))
        if rows:
            values = torch.log_softmax(logits[rows].float(), dim=-1).cpu()
            for (key, step), value in zip(where, values):
                self.steps.setdefault(key, {})[step] = value
        return logits

    @classmethod
    def collect(cls, keys: list[int], steps: int) -> Any:
        """(len(keys), steps, vocab) float32 of every instance's records, NaN where a step was not recorded."""
        import torch

        merged: dict[int, dict[int, Any]] = {}
        for inst in cls.instances:
            for key, by_step in inst.steps.items():
                merged.setdefault(key, {}).update(by_step)
        vocab = next((v.shape[0] for d in merged.values() for v in d.values()), VOCAB)
        out = torch.full((len(keys), steps, vocab), float("nan"))
        for i, key in enumerate(keys):
            for step, value in merged.get(key, {}).items():
                if step < steps:
                    out[i, step] = value
        return out

    @classmethod
    def clear(cls) -> None:
        for inst in cls.instances:
            inst.steps.clear()


# ------------------------------------------------------------------------------------------ counters, probe, faults

_PATCHED: list[tuple[type, str, Any]] = []
_ABSENT = object()


def _patch(owner: type, name: str, value: Any) -> None:
    """setattr(owner, name, value), what the class itself held kept for restore()."""
    _PATCHED.append((owner, name, owner.__dict__.get(name, _ABSENT)))
    setattr(owner, name, value)


def restore() -> None:
    """Undo every instrument's patches, newest first (tests; an engine process never needs to)."""
    while _PATCHED:
        owner, name, original = _PATCHED.pop()
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    Coverage.counters.clear()
    LogitProbe.samples.clear()
    Faults.mode = "none"
    QueryRounding.on = False


class Coverage:
    """Calls and rows counted on the device (two int64 adds per call, captured into CUDA graphs with the call, so
    graph replays count too) for every attention impl class's forward_mqa and this package's FlashInferCore.decode:
    proof that a comparison ran through the backend it names, not only that the backend was built."""

    counters: dict[str, Any] = {}

    @classmethod
    def install(cls, device: str = "cuda") -> None:
        import vllm.v1.attention.backends.mla.flashmla_sparse as flashmla_sparse
        from vllm_kimi_dsa import core, vllm_backend

        targets = [(vllm_backend.KimiDSAFlashInferMLASparseImpl, "forward_mqa"),
                   (flashmla_sparse.FlashMLASparseImpl, "forward_mqa"), (core.FlashInferCore, "decode")]
        try:
            import vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 as fi_sm90

            targets.append((fi_sm90.FlashInferMLASparseSM90Impl, "forward_mqa"))
        except ImportError:
            pass
        for owner, method in targets:
            cls._wrap(owner, method, f"{owner.__name__}.{method}", device)

    @classmethod
    def _wrap(cls, owner: type, method: str, name: str, device: str) -> None:
        import torch

        original = getattr(owner, method)
        # made here, before the engine: a counter first made inside a capture would be zeroed by every replay
        counter = cls.counters[name] = torch.zeros(2, dtype=torch.int64, device=device)

        def counted(self, q, *args, **kwargs):
            counter[0].add_(1)
            counter[1].add_(int((q[0] if isinstance(q, tuple) else q).shape[0]))
            return original(self, q, *args, **kwargs)

        _patch(owner, method, counted)

    @classmethod
    def read(cls) -> dict[str, dict[str, int]]:
        return {name: dict(zip(("calls", "rows"), c.tolist())) for name, c in cls.counters.items()}


def _flat_rows(kv_cache: Any, block_size: int) -> Any:
    from vllm.v1.attention.backends.mla.sparse_utils import flat_kv_row_view

    return flat_kv_row_view(kv_cache, block_size)[0]


class LogitProbe:
    """The attention logits this backend computes, sampled from its eager calls (prefill chunks; graph replays run no
    Python): for up to ROWS rows of a call, scale * q.k over the row's selected cache rows in float32 from the FP8
    query and rows at the layer's scales; their std over the row's tokens and the largest softmax probability, per
    head, averaged. The report holds both: the seeded weights are meant to give the logits a trained model's spread."""

    ROWS, LIMIT = 4, 64
    samples: list[tuple[float, float]] = []

    @classmethod
    def install(cls) -> None:
        from vllm_kimi_dsa import vllm_backend

        impl_cls = vllm_backend.KimiDSAFlashInferMLASparseImpl
        kernel = impl_cls._forward_mqa_kernel

        def probed(self, q, kv_cache, topk_indices, seq_lens, *, layer, block_size, is_decode):
            import torch

            whole = torch.cat(q, dim=-1) if isinstance(q, tuple) else q
            capturing = whole.is_cuda and torch.cuda.is_current_stream_capturing()
            if len(cls.samples) < cls.LIMIT and not capturing:
                cls._sample(self, whole, kv_cache, topk_indices, seq_lens, layer, block_size)
            return kernel(self, q, kv_cache, topk_indices, seq_lens, layer=layer, block_size=block_size,
                          is_decode=is_decode)

        _patch(impl_cls, "_forward_mqa_kernel", probed)

    @classmethod
    def _sample(cls, impl, q, kv_cache, slots, counts, layer, block_size) -> None:
        import torch

        rows = _flat_rows(kv_cache, block_size)
        counts_host = counts.tolist()
        for r in range(max(0, q.shape[0] - cls.ROWS), q.shape[0]):
            n = counts_host[r]
            if n < 16:
                continue
            keys = rows[slots[r, :n].long()].view(torch.float8_e4m3fn).float() * float(layer._k_scale_float)
            query = q[r].float() * float(layer._q_scale_float)
            logits = float(impl.scale) * query @ keys.T  # (heads, n)
            std = logits.std(dim=-1).mean().item()
            top = torch.softmax(logits, dim=-1).amax(dim=-1).mean().item()
            cls.samples.append((std, top))

    @classmethod
    def summary(cls) -> dict[str, Any]:
        if not cls.samples:
            return {"rows": 0}
        stds = sorted(s for s, _ in cls.samples)
        tops = sorted(t for _, t in cls.samples)
        mid = len(stds) // 2
        return {"rows": len(stds), "logit_std_median": stds[mid], "logit_std_min": stds[0],
                "logit_std_max": stds[-1], "top_probability_median": tops[mid], "top_probability_max": tops[-1]}


class QueryRounding:
    """vLLM's FLASHINFER_MLA_SPARSE_SM90 (a BF16 query) fed this backend's query: each value rounded to e4m3 at the
    layer's q scale and back, as vLLM's fused_q rounds it for this backend, while `on` (an eager engine: switched
    between checks). Both engines then read the same cache bytes with the same query values, so what is left between
    them is the kernels' own arithmetic; off, their difference is what the FP8 query costs."""

    on = False

    @classmethod
    def install(cls) -> None:
        import torch
        import vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 as fi_sm90

        impl_cls = fi_sm90.FlashInferMLASparseSM90Impl
        forward_mqa = impl_cls.forward_mqa

        def rounded(self, q, kv_cache, attn_metadata, layer):
            if cls.on:
                scale = float(layer._q_scale_float)

                def e4m3(x):
                    values = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
                    return values.float().mul(scale).to(x.dtype)

                q = tuple(e4m3(part) for part in q) if isinstance(q, tuple) else e4m3(q)
            return forward_mqa(self, q, kv_cache, attn_metadata, layer)

        _patch(impl_cls, "forward_mqa", rounded)


class Faults:
    """The planted faults of FAULTS in this backend's impl, switched by `mode` between checks (an eager engine: every
    call runs this Python). The softmax-scale fault drops the layer's step so it is rebuilt at the new scale."""

    mode = "none"

    @classmethod
    def install(cls) -> None:
        import torch
        from vllm_kimi_dsa import vllm_backend

        impl_cls = vllm_backend.KimiDSAFlashInferMLASparseImpl
        forward_mqa, kernel = impl_cls.forward_mqa, impl_cls._forward_mqa_kernel

        def faulty_forward_mqa(self, q, kv_cache, attn_metadata, layer):
            base = self.__dict__.setdefault("_unfaulted_scale", self.scale)
            scale = base * (SCALE_FAULT if cls.mode == "softmax_scale" else 1.0)
            if self.scale != scale:
                self.scale, self._step = scale, None  # the next kernel call rebuilds the step at this scale
            if cls.mode == "topk_ignored":
                n = (q[0] if isinstance(q, tuple) else q).shape[0]
                topk = self.topk_indices_buffer[:n]
                req = attn_metadata.req_id_per_token[:n].long()
                visible = (attn_metadata.seq_lens[req] - attn_metadata.query_start_loc[req + 1]
                           + torch.arange(1, n + 1, device=topk.device))
                ids = torch.arange(topk.shape[1], device=topk.device, dtype=topk.dtype)
                topk.copy_(torch.where(ids[None, :] < visible[:, None], ids[None, :], -1))
            return forward_mqa(self, q, kv_cache, attn_metadata, layer)

        def faulty_kernel(self, q, kv_cache, topk_indices, seq_lens, *, layer, block_size, is_decode):
            if cls.mode == "slot_off_by_one":
                num_rows = _flat_rows(kv_cache, block_size).shape[0]
                topk_indices = torch.where(topk_indices >= 0, (topk_indices + 1) % num_rows, topk_indices)
            elif cls.mode == "half_topk":
                seq_lens = seq_lens // 2
            return kernel(self, q, kv_cache, topk_indices, seq_lens, layer=layer, block_size=block_size,
                          is_decode=is_decode)

        _patch(impl_cls, "forward_mqa", faulty_forward_mqa)
        _patch(impl_cls, "_forward_mqa_kernel", faulty_kernel)


# ------------------------------------------------------------------------------------------ the engine


def install_device_shims() -> dict[str, str]:
    """tools/vllm_device_shims.py where vLLM's own libraries cannot load (the device's torch 2.11); each shim says
    what it hides, and the report goes into the JSON."""
    path = ROOT / "tools" / "vllm_device_shims.py"
    spec = importlib.util.spec_from_file_location("vllm_device_shims", path)
    shims = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shims)
    return dict(shims.install())


def _attention_impls(model) -> list[dict[str, str]]:
    seen = {}
    for module in model.modules():
        impl = getattr(module, "impl", None)
        if impl is not None:
            name = f"{type(impl).__module__}.{type(impl).__name__}"
            seen[name] = {"impl": name, "kv_cache_dtype": str(getattr(impl, "kv_cache_dtype", None))}
    return sorted(seen.values(), key=lambda d: d["impl"])


class EngineServer:
    """An LLM(...) and the commands the parent sends it (each a method returning JSON-able data or tensors)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        from vllm import LLM

        self.spec = spec
        self.info_: dict[str, Any] = {"backend": spec["backend"], "heads": spec["heads"], "eager": spec["eager"],
                                      "prefill_path": prefill_path(spec["force_mqa"])}
        if spec.get("shims"):
            self.info_["shims"] = install_device_shims()
        import importlib.metadata

        plugins = [e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")]
        self.info_["plugins"] = plugins
        if spec["backend"] == OURS and not any(p.startswith("vllm_kimi_dsa") for p in plugins):
            raise RuntimeError("vllm_kimi_dsa's vLLM plugin entry point is not installed (pip install the package; "
                               "on the device, tools/device_run.sh --vllm writes its dist-info): vLLM would run "
                               "its own FLASHINFER_MLA_SPARSE, which refuses SM90")
        register_seeded_loader()
        Coverage.install()
        if spec["backend"] == FLASHINFER_SM90:
            QueryRounding.install()
        if spec["backend"] == OURS:
            LogitProbe.install()
            if spec.get("faults"):
                Faults.install()
        self.info_["gpu"] = torch.cuda.get_device_name()
        start = time.perf_counter()
        self.llm = LLM(**engine_kwargs(spec["model"], spec["backend"], force_mqa=spec["force_mqa"],
                                       eager=spec["eager"], capture_sizes=spec.get("capture_sizes"),
                                       gpu_memory_utilization=spec["gpu_memory_utilization"]))
        self.info_["engine_start_s"] = time.perf_counter() - start
        config = self.llm.llm_engine.vllm_config
        self.info_["config"] = {
            "compilation_mode": str(config.compilation_config.mode),
            "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
            "capture_sizes": list(config.compilation_config.cudagraph_capture_sizes or []),
            "max_num_seqs": int(config.scheduler_config.max_num_seqs),
            "max_num_batched_tokens": int(config.scheduler_config.max_num_batched_tokens),
            "async_scheduling": bool(config.scheduler_config.async_scheduling),
            "model_runner_v2": bool(config.use_v2_model_runner),
            "cache_dtype": str(config.cache_config.cache_dtype),
            "sparse_mla_force_mqa": bool(config.attention_config.sparse_mla_force_mqa),
        }
        self.info_["attention_impls"] = self.llm.apply_model(_attention_impls)[0]
        self.scheduled: list[tuple[int, int, int]] | None = None
        self._hook_scheduler()
        self.requests = 0

    def _hook_scheduler(self) -> None:
        """Record (tokens, requests, new requests) of every step the scheduler makes while self.scheduled is a
        list: a timed window is pure decode iff each of its steps scheduled one token for each of its requests."""
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        schedule = scheduler.schedule
        server = self

        def recorded(*args, **kwargs):
            out = schedule(*args, **kwargs)
            if server.scheduled is not None and out.total_num_scheduled_tokens:
                server.scheduled.append((int(out.total_num_scheduled_tokens), len(out.num_scheduled_tokens),
                                         len(out.scheduled_new_reqs)))
            return out

        scheduler.schedule = recorded

    # ---------------------------------------------------------------- commands

    def info(self) -> dict[str, Any]:
        return self.info_

    def set_fault(self, mode: str) -> str:
        if mode != "none" and mode not in FAULTS:
            raise ValueError(f"fault {mode!r} is none of {sorted(FAULTS)}")
        Faults.mode = mode
        return mode

    def set_query_rounding(self, on: bool) -> bool:
        QueryRounding.on = bool(on)
        return QueryRounding.on

    def check(self, prompts: list[list[int]], traces: list[list[int]]) -> dict[str, Any]:
        """Every request forced down its trace (vLLM's trace replay), the log-probabilities of every output step
        recorded; with the device counters' increase over the run and the logit probe's summary."""
        RecordLogits.clear()
        before = Coverage.read()
        params = [greedy(len(t), trace_decode_token_ids=list(t), extra_args={"record_key": i, "prompt_len": len(p)})
                  for i, (p, t) in enumerate(zip(prompts, traces))]
        start = time.perf_counter()
        outputs = self.llm.generate(token_prompts(prompts), params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        after = Coverage.read()
        delta = {name: {k: after[name][k] - before.get(name, {}).get(k, 0) for k in ("calls", "rows")}
                 for name in after}
        steps = max(len(t) for t in traces)
        return {"logprobs": RecordLogits.collect(list(range(len(prompts))), steps),
                "tokens_follow_trace": all(t == list(trace) for t, trace in zip(tokens, traces)),
                "seconds": seconds, "coverage": delta, "probe": LogitProbe.summary()}

    def start_batch(self, prompts: list[list[int]], tokens: int, warmup: int) -> dict[str, Any]:
        """Adds one request a prompt (greedy, `tokens` tokens) and steps until every request has produced 1 + warmup
        tokens: every prefill done, a few decode steps run at the full batch. The engine is stepped as serving's
        engine-core loop steps it (EngineCore.step_fn, what `vllm serve`'s core process runs): the front end's
        output processing, another process in serving, stays out of the timed loop."""
        engine = self.llm.llm_engine
        self.batch_ids, self.produced = [], {}
        for p in prompts:
            self.requests += 1
            rid = f"b{self.requests}"
            self.produced[engine.add_request(rid, token_prompts([p])[0], greedy(tokens))] = 0
            self.batch_ids.append(rid)
        start = time.perf_counter()
        self._step_until(1 + warmup)
        return {"requests": len(prompts), "prefill_s": time.perf_counter() - start}

    def _step_until(self, produced: int) -> int:
        core, steps = self.llm.llm_engine.engine_core, 0
        while min(self.produced.values()) < produced:
            for out in core.get_output().outputs:
                if out.request_id in self.produced:
                    self.produced[out.request_id] += len(out.new_token_ids)
            steps += 1
            if steps > 100000:
                raise RuntimeError("the batch stopped producing tokens")
        return steps

    def decode_window(self, steps: int, profile: bool = False) -> dict[str, Any]:
        """Times `steps` decode steps of the running batch (each request `steps` more tokens): wall time between the
        first and the last synchronised, the scheduler's steps in between (each must be pure decode: one token for
        every request, none new), and with `profile` the torch profiler's GPU time by kernel over such a window
        instead of the wall time."""
        import torch

        base = min(self.produced.values())
        self.scheduled = []
        if profile:
            from torch.profiler import ProfilerActivity, profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                self._step_until(base + steps)
                torch.cuda.synchronize()
            kernels: dict[str, float] = {}
            for event in prof.key_averages():
                if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
                    kernels[event.key] = kernels.get(event.key, 0.0) + event.device_time_total
            result: dict[str, Any] = {"kernels_us": kernels}
        else:
            torch.cuda.synchronize()
            start = time.perf_counter()
            self._step_until(base + steps)
            torch.cuda.synchronize()
            result = {"seconds": time.perf_counter() - start}
        scheduled, self.scheduled = self.scheduled, None
        requests = len(self.batch_ids)
        impure = [s for s in scheduled if s != (requests, requests, 0)]
        result.update(steps=steps, scheduled_steps=len(scheduled), pure_decode=bool(scheduled) and not impure,
                      impure_steps=impure[:6])
        return result

    def end_batch(self) -> dict[str, Any]:
        engine = self.llm.llm_engine
        engine.abort_request(list(self.batch_ids))
        while engine.has_unfinished_requests():
            engine.step()
        self.batch_ids, self.produced = [], {}
        return {"done": True}

    def close(self) -> None:
        del self.llm
        gc.collect()


def _failure(error: BaseException) -> dict[str, str]:
    """What the parent's report keeps of an exception: its type and message, and the traceback's end."""
    return {"error": f"{type(error).__name__}: {error}"[:4000], "traceback": traceback.format_exc()[-6000:]}


def serve(conn: Any, spec: dict[str, Any]) -> None:
    """The engine process: output to spec["log"], the engine built, then (command, kwargs) pairs answered with
    ("ok", result) or ("error", {"error", "traceback"}) until "stop"."""
    log = open(spec["log"], "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update(ENGINE_ENV)
    if spec.get("fi_site"):  # FlashInfer (vLLM's FLASHINFER_MLA_SPARSE_SM90) for this engine only
        sys.path.insert(0, spec["fi_site"])
    try:
        server = EngineServer(spec)
    except BaseException as e:  # noqa: BLE001  (the exact failure goes back to the parent's report)
        conn.send(("error", _failure(e)))
        return
    conn.send(("ok", server.info()))
    while True:
        command, kwargs = conn.recv()
        if command == "stop":
            break
        try:
            conn.send(("ok", getattr(server, command)(**kwargs)))
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", _failure(e)))
    server.close()
    conn.send(("ok", "stopped"))


__all__ = ["ATTENTION_CLASSES", "ENGINE_ENV", "FAULTS", "FLASHINFER_SM90", "FLASHMLA", "KERNEL_CLASSES",
           "MAX_MODEL_LEN", "MAX_NUM_BATCHED_TOKENS", "MAX_NUM_SEQS", "OURS",
           "QUERY_GAIN", "RecordLogits", "engine_kwargs", "flash_attention_present", "greedy", "kernel_class",
           "prefill_path", "register_seeded_loader", "seeded_value", "serve", "token_prompts"]
