"""One vLLM engine (`LLM(...)`) in a process of its own, driven by benchmarks/bench_engine.py over a pipe: forced-trace
checks with their recordings and planted faults, or timed decode windows (wall clock, CUDA-event spans, kernels).

A checked engine carries the instruments: the recorder (RecordLogits, a vLLM Model Runner V2 logits processor), the
device-side call counters (Coverage), layer 0's output recorder (LayerZeroRecord), the attention-logit probe
(LogitProbe), FlashInfer's query rounding and key order (QueryRounding, KeyOrder) and a planted fault (Faults), chosen
when the engine starts. A timed engine carries none of them. They are test instruments of the benchmark, not package
code: nothing here is imported by vllm_kimi_dsa.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import re
import subprocess
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Any, Mapping

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_timing as et  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OURS, FLASHMLA, FLASHINFER_SM90 = "FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM90"
VOCAB = 4096

# vLLM's Model Runner V2 sampler asks FlashInfer whether it can sample (flashinfer_sampler_supported imports
# vllm.v1.attention.backends.flashinfer, which imports flashinfer) unless this is 0, and the device has no FlashInfer.
# Greedy decoding never uses FlashInfer's top-k / top-p sampler.
ENGINE_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}

# Every engine of a run on the same scheduler limits (the timed pair compares like with like): the largest timed
# batch, vLLM's default chunk, and room for the ragged mix's 8,000-token prompts plus ten 64-step windows.
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAX_MODEL_LEN = 128, 8192, 9216

# The seeded weights draw every matrix N(0, 1/fan_in), which gives attention logits of std ~1 (the query's and the
# key's 192 rope + nope dims have unit rms; the softmax scale is 1/sqrt(192)) and a largest probability ~0.01 of 2048:
# a flat softmax, where a 5% scale error moves nothing. q_b_proj (the query's last projection before the absorption)
# drawn QUERY_GAIN times larger scales every logit by QUERY_GAIN: std ~3.5, as trained DSA models' attention has
# (measured in each run by LogitProbe and recorded in the report).
QUERY_GAIN = 3.5
QUERY_PROJECTION = "q_b_proj.weight"

# The negative controls, planted in this backend's decode rows only (a prefill chunk runs unfaulted), one a CUDA-graph
# engine, chosen when it starts and in place before its graphs are captured.
FAULTS = {
    "softmax_scale": "softmax scale 5% high",
    "slot_off_by_one": "every selected cache row read one row over (an off-by-one in the flat-row math)",
    "half_topk": "each row's valid count halved (the second half of its top-k dropped)",
    "topk_ignored": "the indexer's choice ignored: each token attends to the first 2048 tokens it can see",
}
SCALE_FAULT = 1.05
LAYER0 = re.compile(r"(^|\.)layers\.0\.")  # the name of layer 0's attention (vLLM's prefix "model.layers.0....")


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
                  capture_sizes: list[int] | None = None, gpu_memory_utilization: float = 0.3,
                  record: bool = True) -> dict[str, Any]:
    """LLM(...)'s arguments: the seeded weights, no tokenizer, an fp8 cache, `backend`, vLLM's own CUDA graphs
    (breakable, as vLLM sets them for DeepSeek-V3.2) at `capture_sizes` (None: vLLM's), no prefix caching (every run
    prefills); with `record` (a checked engine) trace replay (vLLM's forced-token decoding, Model Runner V2) and the
    log-probability recorder, without (a timed engine) neither.

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
                  enforce_eager=eager)
    if record:
        kwargs.update(enable_trace_replay=True, logits_processors=[RecordLogits])
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

_PATCHED: list[tuple[Any, str, Any]] = []
_ABSENT = object()


def _patch(owner: Any, name: str, value: Any) -> None:
    """setattr(owner, name, value) on a class or module, what it held itself kept for restore()."""
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
    LayerZeroRecord.buffers = None
    Faults.mode = "none"
    QueryRounding.on = KeyOrder.on = False
    StepEvents.pool, StepEvents.starts, StepEvents.ends = [], [], []


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


class LayerZeroRecord:
    """Layer 0's attention output (forward_mqa's latent, its first HEADS heads at most) of every single-token decode
    row, with the row's position, copied into buffers made before the engine at a device-side cursor: the copy is
    captured into the CUDA graphs with the call, so replays record too, and nothing is allocated outside their pool.

    Rows past the capacity go to a sink row (the cursor still counts them). A padded row of a captured batch may
    write a position its request reaches later; that step's own row, written later, replaces it (read_positions'
    callers keep the last row of a position)."""

    HEADS = 16
    LATENT = 512
    buffers: dict[str, Any] | None = None

    @classmethod
    def install(cls, capacity: int, heads: int, device: str = "cuda") -> None:
        import torch
        import vllm.v1.attention.backends.mla.flashmla_sparse as flashmla_sparse
        from vllm_kimi_dsa import vllm_backend

        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        recorded = min(heads, cls.HEADS)
        cls.buffers = {"rows": torch.zeros(capacity + 1, recorded, cls.LATENT, dtype=torch.bfloat16, device=device),
                       "positions": torch.full((capacity + 1,), -1, dtype=torch.int64, device=device),
                       "cursor": torch.zeros((), dtype=torch.int64, device=device),
                       "order": torch.arange(MAX_NUM_BATCHED_TOKENS, dtype=torch.int64, device=device)}
        targets = [vllm_backend.KimiDSAFlashInferMLASparseImpl, flashmla_sparse.FlashMLASparseImpl]
        try:
            import vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 as fi_sm90

            targets.append(fi_sm90.FlashInferMLASparseSM90Impl)
        except ImportError:
            pass
        for owner in targets:
            cls._wrap(owner)

    @classmethod
    def _wrap(cls, owner: type) -> None:
        original = owner.forward_mqa

        def recorded(self, q, kv_cache, attn_metadata, layer):
            out = original(self, q, kv_cache, attn_metadata, layer)
            if LAYER0.search(getattr(layer, "layer_name", "")):
                cls.copy(out[0] if isinstance(out, tuple) else out, attn_metadata)
            return out

        _patch(owner, "forward_mqa", recorded)

    @classmethod
    def copy(cls, latent: Any, metadata: Any) -> None:
        """Write the decode rows of one layer-0 call: latent (tokens, H, 512) or (tokens, H * 512); metadata: vLLM's
        sparse MLA metadata (num_decode_tokens, req_id_per_token, query_start_loc, seq_lens)."""
        import torch

        b = cls.buffers
        n = int(metadata.num_decode_tokens)
        if b is None or n == 0:
            return
        capacity = b["rows"].shape[0] - 1
        rows = latent[:n].reshape(n, -1, cls.LATENT)[:, : b["rows"].shape[1]]
        req = metadata.req_id_per_token[:n].long()
        qsl = metadata.query_start_loc.long()
        single = (qsl[req + 1] - qsl[req]) == 1
        position = metadata.seq_lens.long()[req] - qsl[req + 1] + b["order"][:n]
        slot = torch.where(single, (b["cursor"] + torch.cumsum(single, 0) - 1).clamp(max=capacity), capacity)
        b["rows"].index_copy_(0, slot, rows.to(torch.bfloat16))
        b["positions"].index_copy_(0, slot, position)
        b["cursor"].add_(single.sum())

    @classmethod
    def reset(cls) -> None:
        if cls.buffers is not None:
            cls.buffers["cursor"].zero_()

    @classmethod
    def read(cls) -> dict[str, Any] | None:
        """{"rows": (n, HEADS, 512) bf16, "positions": (n,) int64, in the order written, "overflow": rows lost}."""
        b = cls.buffers
        if b is None:
            return None
        capacity = b["rows"].shape[0] - 1
        written = int(b["cursor"])
        n = min(written, capacity)
        return {"rows": b["rows"][:n].cpu(), "positions": b["positions"][:n].cpu(), "overflow": written - n}


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


class KeyOrder:
    """vLLM's FLASHINFER_MLA_SPARSE_SM90 with each row's selected keys in reverse order while `on` (an eager engine:
    switched between checks): the same attention over the same keys and values, summed in another order (FlashInfer
    splits a row's keys into work items in the order given). One of the check's null pairs (engine_check.NULL_PAIRS).
    It reverses the valid prefix vLLM's conversion compacts to the front of each row (return_valid_counts)."""

    on = False

    @classmethod
    def install(cls) -> None:
        import torch
        import vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 as fi_sm90

        convert = fi_sm90.triton_convert_req_index_to_global_index

        def reordered(*args, **kwargs):
            slots, counts = convert(*args, **kwargs)
            if cls.on:
                slots = reverse_prefix(slots, counts)
            return slots, counts

        def reverse_prefix(slots, counts):
            position = torch.arange(slots.shape[1], device=slots.device)
            last = counts.long()[:, None] - 1
            return slots.gather(1, torch.where(position <= last, last - position, position))

        _patch(fi_sm90, "triton_convert_req_index_to_global_index", reordered)


class Faults:
    """One planted fault of FAULTS in this backend's impl, chosen at install (an engine's start; an engine never
    switches it), acting on the decode rows of each call only (vLLM puts them first: attn_metadata.num_decode_tokens),
    through device operations that a CUDA graph captures with the call. The softmax-scale fault decodes those rows
    with a second step planned at the high scale when the weights are loaded, before any capture. The patched calls
    read `mode` when they run, so a test on one layer may set it between calls."""

    mode = "none"

    @classmethod
    def install(cls, mode: str) -> None:
        import torch
        from vllm_kimi_dsa import vllm_backend

        if mode not in FAULTS:
            raise ValueError(f"mode {mode!r} is none of {sorted(FAULTS)}")
        cls.mode = mode
        impl_cls = vllm_backend.KimiDSAFlashInferMLASparseImpl
        forward_mqa, kernel = impl_cls.forward_mqa, impl_cls._forward_mqa_kernel
        after_loading = impl_cls.process_weights_after_loading

        def faulty_forward_mqa(self, q, kv_cache, attn_metadata, layer):
            n = self._fault_decode_rows = int(attn_metadata.num_decode_tokens)  # a Python int, baked into a capture
            if cls.mode == "topk_ignored" and n:
                topk = self.topk_indices_buffer[:n]
                req = attn_metadata.req_id_per_token[:n].long()
                visible = (attn_metadata.seq_lens[req] - attn_metadata.query_start_loc[req + 1]
                           + torch.arange(1, n + 1, device=topk.device))
                ids = torch.arange(topk.shape[1], device=topk.device, dtype=topk.dtype)
                topk.copy_(torch.where(ids[None, :] < visible[:, None], ids[None, :], -1))
            return forward_mqa(self, q, kv_cache, attn_metadata, layer)

        def faulty_kernel(self, q, kv_cache, topk_indices, seq_lens, *, layer, block_size, is_decode):
            rows = seq_lens.shape[0]
            n = min(getattr(self, "_fault_decode_rows", rows), rows)
            decode = torch.arange(rows, device=seq_lens.device) < n
            if cls.mode == "slot_off_by_one":
                num_rows = _flat_rows(kv_cache, block_size).shape[0]
                moved = (topk_indices >= 0) & decode[:, None]
                topk_indices = torch.where(moved, (topk_indices + 1) % num_rows, topk_indices)
            elif cls.mode == "half_topk":
                seq_lens = torch.where(decode, seq_lens // 2, seq_lens)
            elif cls.mode == "softmax_scale" and n:
                return cls._high_scale(self, kernel, q, kv_cache, topk_indices, seq_lens, n, layer=layer,
                                       block_size=block_size, is_decode=is_decode)
            return kernel(self, q, kv_cache, topk_indices, seq_lens, layer=layer, block_size=block_size,
                          is_decode=is_decode)

        def planned(self, act_dtype):
            after_loading(self, act_dtype)
            if cls.mode == "softmax_scale" and self.served_by_core:
                for layer in self._vllm_config.compilation_config.static_forward_context.values():
                    if getattr(layer, "impl", None) is self:
                        cls.plan_high_scale(self, layer)

        _patch(impl_cls, "forward_mqa", faulty_forward_mqa)
        _patch(impl_cls, "_forward_mqa_kernel", faulty_kernel)
        _patch(impl_cls, "process_weights_after_loading", planned)

    @staticmethod
    def plan_high_scale(impl: Any, layer: Any) -> None:
        """impl._fault_step: a LayerStep of impl's shape planned at SCALE_FAULT x its softmax scale (the core reads the
        scale when it plans), the impl's own scale left as it was."""
        import torch
        from vllm_kimi_dsa.serving import LayerStep

        weight = getattr(getattr(layer, "kv_b_proj", None), "weight", None)
        device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cuda")
        scale = impl.scale
        impl.scale = scale * SCALE_FAULT
        try:
            impl._fault_step = LayerStep(impl, layer, impl.step_shape(device))
        finally:
            impl.scale = scale

    @staticmethod
    def _high_scale(impl, kernel, q, kv_cache, topk_indices, seq_lens, n, **kwargs):
        """The first n rows (the decodes) through impl._fault_step, the rest (a mixed batch's prefill, eager) through
        the unfaulted kernel."""
        import torch

        whole = torch.cat(q, dim=-1) if isinstance(q, tuple) else q
        rows = whole.shape[0]
        if n >= rows:
            return impl._fault_step(whole, kv_cache, topk_indices, seq_lens, kwargs["block_size"])
        out, lse = kernel(impl, q, kv_cache, topk_indices, seq_lens, **kwargs)
        out = out.clone()
        lse = None if lse is None else lse.clone()
        fault_out, fault_lse = impl._fault_step(whole[:n], kv_cache, topk_indices[:n], seq_lens[:n],
                                                kwargs["block_size"])
        out[:n].copy_(fault_out)
        if lse is not None and fault_lse is not None:
            lse[:n].copy_(fault_lse)
        return out, lse


class StepEvents:
    """CUDA events on the model's stream around each step while armed: recorded when vLLM's Model Runner V2 starts a
    step (GPUModelRunner.execute_model, dummy runs aside) and when it has launched the step's sampling
    (sample_tokens), from a pool made before the window. A step's GPU span is the time between its two events: its
    kernels and any gap in which the GPU waited for the host."""

    pool: list[Any] = []
    starts: list[Any] = []
    ends: list[Any] = []

    @classmethod
    def install(cls) -> None:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        execute, sample = GPUModelRunner.execute_model, GPUModelRunner.sample_tokens

        def execute_timed(self, *args, **kwargs):
            if cls.pool and not kwargs.get("dummy_run", False):
                if len(cls.starts) > len(cls.ends):  # the last step sampled nothing: its start pairs with no end
                    cls.starts.pop()
                event = cls.pool.pop()
                event.record()
                cls.starts.append(event)
            return execute(self, *args, **kwargs)

        def sample_timed(self, *args, **kwargs):
            out = sample(self, *args, **kwargs)
            if cls.pool and len(cls.ends) < len(cls.starts):
                event = cls.pool.pop()
                event.record()
                cls.ends.append(event)
            return out

        _patch(GPUModelRunner, "execute_model", execute_timed)
        _patch(GPUModelRunner, "sample_tokens", sample_timed)

    @classmethod
    def arm(cls, steps: int) -> None:
        """Events for `steps` steps and some to spare, made now (outside the window)."""
        import torch

        cls.pool = [torch.cuda.Event(enable_timing=True) for _ in range(2 * steps + 16)]
        cls.starts, cls.ends = [], []

    @classmethod
    def disarm(cls) -> dict[str, Any]:
        """After a synchronize: every step's GPU span (µs) and the span from the first step's start to the last's
        end."""
        pairs = list(zip(cls.starts, cls.ends))
        cls.pool, cls.starts, cls.ends = [], [], []
        spans = [1e3 * a.elapsed_time(b) for a, b in pairs]
        whole = 1e3 * pairs[0][0].elapsed_time(pairs[-1][1]) if pairs else 0.0
        return {"step_gpu_span_us": spans, "window_gpu_span_us": whole}


def scheduled_step(output: Any, prompt_lens: Mapping[str, int]) -> dict[str, int]:
    """What one scheduler step (vLLM's SchedulerOutput) held: its tokens, its requests, the new ones, the ones still
    prefilling (a request of `prompt_lens` whose computed tokens had not reached its prompt, or one not in it), and
    the ones given more than one token."""
    cached = output.scheduled_cached_reqs
    computed = dict(zip(cached.req_ids, cached.num_computed_tokens))
    prefilling = sum(1 for rid in output.num_scheduled_tokens
                     if rid in computed and computed[rid] < prompt_lens.get(rid, sys.maxsize))
    return {"tokens": int(output.total_num_scheduled_tokens), "requests": len(output.num_scheduled_tokens),
            "new": len(output.scheduled_new_reqs), "prefilling": prefilling,
            "multi_token": sum(1 for n in output.num_scheduled_tokens.values() if n > 1)}


CLOCK_FIELDS = ("clocks.sm", "clocks.mem", "clocks.max.sm", "temperature.gpu", "power.draw")
THROTTLE_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")  # newer, older drivers


def gpu_clocks() -> dict[str, Any]:
    """nvidia-smi's clocks, temperature, power and active throttle reasons of every GPU now, or the error."""
    for throttle in (*THROTTLE_FIELDS, None):
        fields = ("index", "name", *CLOCK_FIELDS, *((throttle,) if throttle else ()))
        try:
            done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"error": f"{type(e).__name__}: {e}"}
        if done.returncode == 0:
            return {"gpus": [dict(zip(fields, (v.strip() for v in line.split(","))))
                             for line in done.stdout.strip().splitlines()]}
    return {"error": (done.stderr or done.stdout).strip()[:300]}


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


def install_instruments(spec: Mapping[str, Any]) -> list[str]:
    """The instruments of a checked engine (spec["instruments"]), innermost first so the outer ones see the fault;
    a timed engine gets none. The step events (timing) go into every engine. Returns their names."""
    installed = []
    if spec.get("instruments", True):
        if spec["backend"] == OURS and spec.get("fault", "none") != "none":
            Faults.install(spec["fault"])
            installed.append(f"Faults({spec['fault']})")
        if spec["backend"] == FLASHINFER_SM90:
            QueryRounding.install()
            KeyOrder.install()
            installed += ["QueryRounding", "KeyOrder"]
        if spec["backend"] == OURS:
            LogitProbe.install()
            installed.append("LogitProbe")
        Coverage.install()
        LayerZeroRecord.install(spec["record_rows"], spec["heads"])
        installed += ["Coverage", "LayerZeroRecord", "RecordLogits"]
    StepEvents.install()
    return installed


class EngineServer:
    """An LLM(...) and the commands the parent sends it (each a method returning JSON-able data or tensors)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        from vllm import LLM

        self.spec = spec
        self.info_: dict[str, Any] = {"backend": spec["backend"], "heads": spec["heads"], "eager": spec["eager"],
                                      "fault": spec.get("fault", "none"),
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
        self.info_["instruments"] = install_instruments(spec)
        self.info_["gpu"] = torch.cuda.get_device_name()
        start = time.perf_counter()
        self.llm = LLM(**engine_kwargs(spec["model"], spec["backend"], force_mqa=spec["force_mqa"],
                                       eager=spec["eager"], capture_sizes=spec.get("capture_sizes"),
                                       gpu_memory_utilization=spec["gpu_memory_utilization"],
                                       record=spec.get("instruments", True)))
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
            "num_hidden_layers": int(config.model_config.hf_text_config.num_hidden_layers),
            "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        }
        self.info_["attention_impls"] = self.llm.apply_model(_attention_impls)[0]
        self.scheduled: list[dict[str, int]] | None = None
        self.prompt_lens: dict[str, int] = {}
        self._hook_scheduler()
        self.requests = 0

    def _hook_scheduler(self) -> None:
        """Record what every scheduler step holds (scheduled_step) while self.scheduled is a list: a timed window is
        pure decode iff each of its steps is one token for every request of the batch, none new, none prefilling."""
        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        schedule = scheduler.schedule
        server = self

        def recorded(*args, **kwargs):
            out = schedule(*args, **kwargs)
            if server.scheduled is not None and out.total_num_scheduled_tokens:
                server.scheduled.append(scheduled_step(out, server.prompt_lens))
            return out

        scheduler.schedule = recorded

    # ---------------------------------------------------------------- commands

    def info(self) -> dict[str, Any]:
        return self.info_

    def set_query_rounding(self, on: bool) -> bool:
        QueryRounding.on = bool(on)
        return QueryRounding.on

    def set_key_order(self, reversed_: bool) -> bool:
        KeyOrder.on = bool(reversed_)
        return KeyOrder.on

    def clocks(self) -> dict[str, Any]:
        return gpu_clocks()

    def check(self, prompts: list[list[int]], traces: list[list[int]]) -> dict[str, Any]:
        """Every request forced down its trace (vLLM's trace replay), the log-probabilities of every output step and
        layer 0's attention output of every decode step recorded; with the device counters' increase over the run
        and the logit probe's summary of this check alone."""
        RecordLogits.clear()
        LogitProbe.samples.clear()
        LayerZeroRecord.reset()
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
        return {"logprobs": RecordLogits.collect(list(range(len(prompts))), steps), "layer0": LayerZeroRecord.read(),
                "tokens_follow_trace": all(t == list(trace) for t, trace in zip(tokens, traces)),
                "seconds": seconds, "coverage": delta, "probe": LogitProbe.summary()}

    def start_batch(self, prompts: list[list[int]], tokens: int, warmup: int) -> dict[str, Any]:
        """Adds one request a prompt (greedy, `tokens` tokens) and steps until every request has produced 1 + warmup
        tokens: every prefill done, a few decode steps run at the full batch. The engine is stepped as serving's
        engine-core loop steps it (EngineCore.step_fn, what `vllm serve`'s core process runs): the front end's
        output processing, another process in serving, stays out of the timed loop."""
        engine = self.llm.llm_engine
        self.batch_ids, self.produced, self.prompt_lens = [], {}, {}
        for p in prompts:
            self.requests += 1
            rid = f"b{self.requests}"
            self.produced[engine.add_request(rid, token_prompts([p])[0], greedy(tokens))] = 0
            self.batch_ids.append(rid)
        self.prompt_lens = {rid: len(p) for rid, p in zip(self.produced, prompts)}
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
        """`steps` decode steps of the running batch (each request `steps` more tokens): the wall time between the
        first and the last synchronised, each step's GPU span from CUDA events, what every scheduler step in between
        held and whether each was pure decode of the whole batch, the clocks after; with `profile` the torch
        profiler's GPU time by kernel over such a window instead of the wall time."""
        import torch

        base = min(self.produced.values())
        self.scheduled = []
        StepEvents.arm(steps)
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
        result.update(StepEvents.disarm())
        scheduled, self.scheduled = self.scheduled, None
        requests = len(self.batch_ids)
        result.update(steps=steps, scheduled=scheduled, clocks=gpu_clocks(),
                      pure_decode=bool(scheduled) and all(et.step_is_decode(s, requests) for s in scheduled))
        return result

    def end_batch(self) -> dict[str, Any]:
        engine = self.llm.llm_engine
        engine.abort_request(list(self.batch_ids))
        while engine.has_unfinished_requests():
            engine.step()
        self.batch_ids, self.produced, self.prompt_lens = [], {}, {}
        return {"done": True}

    def close(self) -> None:
        del self.llm
        gc.collect()


def _failure(error: BaseException) -> dict[str, str]:
    """What the parent's report keeps of an exception: its type and message, and the traceback's end."""
    return {"error": f"{type(error).__name__}: {error}"[:4000], "traceback": traceback.format_exc()[-6000:]}


def serve(conn: Any, spec: dict[str, Any]) -> None:
    """The engine process: ENGINE_ENV set in this process, output to spec["log"], the engine built, then (command,
    kwargs) pairs answered with ("ok", result) or ("error", {"error", "traceback"}) until "stop"."""
    os.environ.update(ENGINE_ENV)
    log = open(spec["log"], "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
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


__all__ = ["ENGINE_ENV", "FAULTS", "FLASHINFER_SM90", "FLASHMLA", "MAX_MODEL_LEN", "MAX_NUM_BATCHED_TOKENS",
           "MAX_NUM_SEQS", "OURS", "QUERY_GAIN", "RecordLogits", "engine_kwargs", "flash_attention_present", "greedy",
           "gpu_clocks", "install_instruments", "prefill_path", "register_seeded_loader", "scheduled_step",
           "seeded_value", "serve", "token_prompts"]
