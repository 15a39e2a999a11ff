"""The engine timing's bookkeeping: which kernels count as each backend's attention, a window's full-batch check, the
GPU-bound model's size from a memory estimate, and the rows and table of the report.

**Attention counted alike** (ATTENTION_KERNELS): for each backend, the named kernels of its sparse decode: the decode
and combine kernels, FlashMLA's scheduler metadata, the query's concatenation and head padding (FlashMLA concatenates
a BF16 query and pads it to 64 heads; this backend's FP8 query comes out of vLLM's `_fused_q_kernel`, which also
does the RoPE and the indexer's query on both sides and so counts on neither), and vLLM's top-k conversion, which
both sides run. Everything else is "other", and the report lists every kernel of both sides per step, with "other"
kernels whose time differs between the engines named (`unmatched_other`): the same model runs the same other work.

**The GPU-bound model** (`fit_layers`): as many layers of the small DeepSeek-V3.2 as two engines hold at once on the
card, at most MAX_LAYERS (the released model's 61): per engine its weights (`layer_weight_bytes`), the KV cache of
every timed token in its own row format plus the indexer's keys, and ENGINE_OVERHEAD_BYTES for the rest.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping, Sequence

OURS, FLASHMLA = "FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"

TOPK = 2048
MAX_LAYERS = 61
ROW_BYTES = {OURS: 576, FLASHMLA: 656}  # a KV row as each backend stores it (fp8 per-tensor; fp8_ds_mla)
INDEXER_ROW_BYTES = 132  # the indexer's cached key a token and layer: 128 e4m3 values and a float32 scale
ENGINE_OVERHEAD_BYTES = 6 << 30  # CUDA context, activations of an 8,192-token chunk, graphs, workspaces (estimate)
FLASHMLA_PADDED_HEADS = 64  # FlashMLA's FP8 decode takes 64 or 128 query heads; fewer are padded

# vLLM's top-k conversion (sparse_utils.py), the same on both sides.
_TOPK_CONVERT = ("topk_convert", re.compile(r"sparse_mla_index_remap_kernel|convert_req_index_to_global_index"))
ATTENTION_KERNELS: dict[str, tuple[tuple[str, re.Pattern], ...]] = {
    OURS: (
        ("combine", re.compile(r"^combine_kernel$|^combine_chunks_kernel$")),
        ("decode", re.compile(r"^(few_heads_kernel|seesaw_decode_kernel|gluon_decode_kernel|decode_kernel)$")),
        _TOPK_CONVERT,
    ),
    FLASHMLA: (
        ("combine", re.compile(r"flash_fwd_mla_combine_kernel")),
        ("metadata", re.compile(r"get_mla_metadata_kernel|get_decoding_sched_meta")),
        ("decode", re.compile(r"flash_fwd_splitkv_mla_fp8_sparse_kernel")),
        ("query", re.compile(r"ConcatMLAQKernel")),
        _TOPK_CONVERT,
    ),
}
# FlashMLA below FLASHMLA_PADDED_HEADS: the query zero-padded to 64 heads (q.new_zeros, then a copy into it).
_FLASHMLA_PADDING = ("query_padding", re.compile(r"FillFunctor<c10::BFloat16>|direct_copy_kernel_cuda"))


def attention_kernels(backend: str, heads: int) -> tuple[tuple[str, re.Pattern], ...]:
    """The (class, pattern) list of the kernels counted as `backend`'s attention at `heads` query heads."""
    if backend not in ATTENTION_KERNELS:
        raise ValueError(f"backend {backend!r} is none of {sorted(ATTENTION_KERNELS)}")
    kernels = ATTENTION_KERNELS[backend]
    if backend == FLASHMLA and heads < FLASHMLA_PADDED_HEADS:
        kernels = (*kernels, _FLASHMLA_PADDING)
    return kernels


def kernel_class(backend: str, heads: int, name: str) -> str:
    """The attention class of a kernel's name on `backend` (first match), "other" for the rest of the step."""
    for label, pattern in attention_kernels(backend, heads):
        if pattern.search(name):
            return label
    return "other"


def classify(kernels_us: Mapping[str, float], steps: int, backend: str, heads: int) -> dict[str, Any]:
    """A profiled window's kernels (name -> summed µs over `steps` steps), per decode step: the summed kernel time,
    the attention's, by class, and every kernel with its class (largest first)."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    table = sorted(({"kernel": name, "class": kernel_class(backend, heads, name), "us_per_step": us / steps}
                    for name, us in kernels_us.items()), key=lambda r: -r["us_per_step"])
    by: dict[str, float] = {}
    for row in table:
        by[row["class"]] = by.get(row["class"], 0.0) + row["us_per_step"]
    return {"kernel_us": sum(by.values()), "attention_us": sum(v for k, v in by.items() if k != "other"),
            "by_class_us": {k: round(v, 2) for k, v in sorted(by.items())},
            "kernels": [{**r, "us_per_step": round(r["us_per_step"], 3)} for r in table]}


def unmatched_other(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]], *, floor_us: float = 2.0,
                    relative: float = 0.05) -> list[dict[str, Any]]:
    """The "other" kernels (classify's `kernels`) whose µs a step differ between two engines by more than floor_us
    and `relative` of the larger: work one side does and the other does not, which a reader must see."""
    other_a = {r["kernel"]: r["us_per_step"] for r in a if r["class"] == "other"}
    other_b = {r["kernel"]: r["us_per_step"] for r in b if r["class"] == "other"}
    out = []
    for name in sorted(set(other_a) | set(other_b)):
        x, y = other_a.get(name, 0.0), other_b.get(name, 0.0)
        if abs(x - y) > max(floor_us, relative * max(x, y)):
            out.append({"kernel": name, "us_per_step": [round(x, 2), round(y, 2)]})
    return out


# ---------------------------------------------------------------------------------------------------- windows


def step_is_decode(step: Mapping[str, int], requests: int) -> bool:
    """Whether one scheduler step (engine_worker.scheduled_step's record) is pure decode of the whole batch: every
    request scheduled, one token each, none new, none still prefilling."""
    return (step["tokens"] == step["requests"] == requests and step["new"] == 0 and step["prefilling"] == 0
            and step["multi_token"] == 0)


def window_checks(windows: Sequence[Mapping[str, Any]], requests: int,
                  floor_fraction: float | None) -> dict[str, Any]:
    """Whether every window held the full batch: each scheduler step pure decode of `requests` requests (the count
    constant), as many steps as the window asked, and the attention floor fraction at most 1 (a larger one means the
    batch the floor counts was not the one timed)."""
    counts = sorted({s["requests"] for w in windows for s in w["scheduled"]})
    impure = [s for w in windows for s in w["scheduled"] if not step_is_decode(s, requests)]
    short = [i for i, w in enumerate(windows) if len(w["scheduled"]) < w["steps"]]
    floor_ok = floor_fraction is None or floor_fraction <= 1.0
    return {"full_batch": bool(windows) and not impure and not short and counts == [requests] and floor_ok,
            "request_counts": counts, "impure_steps": impure[:6], "short_windows": short,
            "floor_fraction_at_most_1": floor_ok}


def batch_tokens(lengths: Sequence[int], windows: int, steps: int, warmup: int, max_num_batched_tokens: int) -> int:
    """max_tokens of a timed batch's requests: the token after the prompt, the warm-up steps, every window's steps
    (the `windows` timed ones and the profiled one), one step more a window and the warm-up (async scheduling keeps a
    step in flight past the one that reached the count), one token a prefill step (the first requests decode while
    chunked prefill still feeds the later ones), and 16 spare."""
    if windows < 1 or steps < 1:
        raise ValueError(f"windows and steps must be at least 1, got {windows} and {steps}")
    prefill_steps = math.ceil(sum(lengths) / max_num_batched_tokens) + len(lengths)
    return 1 + warmup + (windows + 1) * steps + (windows + 2) + prefill_steps + 16


# ---------------------------------------------------------------------------------------------------- the model's size


def layer_weight_bytes(config: Mapping[str, Any]) -> int:
    """BF16 bytes of one layer of model_config's DeepSeek-V3.2 (dense MLP), with vLLM's absorbed W_UK / W_UV copies."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    q_lora, kv_lora, rope = config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    index_heads, index_dim = config["index_n_heads"], config["index_head_dim"]
    params = (h * (q_lora + kv_lora + rope) + q_lora + kv_lora  # fused q/kv down-projection and its norms
              + q_lora * heads * (nope + rope) + 2 * kv_lora * heads * (nope + v) + heads * v * h  # q_b, kv_b x2, o
              + q_lora * index_heads * index_dim + h * index_dim + h * index_heads + 2 * index_dim  # the indexer
              + 3 * h * config["intermediate_size"] + 2 * h)  # the dense MLP and the layer's norms
    return 2 * params


def engine_bytes(config: Mapping[str, Any], layers: int, tokens: int, backend: str) -> int:
    """An engine's memory at `layers` layers holding `tokens` tokens in its KV cache."""
    embeddings = 2 * 2 * config["vocab_size"] * config["hidden_size"]
    per_layer = layer_weight_bytes(config) + tokens * (ROW_BYTES[backend] + INDEXER_ROW_BYTES)
    return ENGINE_OVERHEAD_BYTES + embeddings + layers * per_layer


def fit_layers(config: Mapping[str, Any], card_bytes: int, tokens: int, *, engines: Iterable[str] = (OURS, FLASHMLA),
               headroom: float = 0.9) -> dict[str, Any]:
    """The most layers (at most MAX_LAYERS) at which every engine of `engines`, up at once, holds `tokens` tokens
    within `headroom` of the card, each in an equal share; with the estimate per engine."""
    names = list(engines)
    share = headroom * card_bytes / len(names)
    layers = MAX_LAYERS
    while layers > 1 and max(engine_bytes(config, layers, tokens, n) for n in names) > share:
        layers -= 1
    estimate = {n: engine_bytes(config, layers, tokens, n) for n in names}
    return {"layers": layers, "fits": max(estimate.values()) <= share, "share_bytes": int(share),
            "gpu_memory_utilization": round(headroom / len(names), 3), "engine_bytes": estimate, "tokens": tokens}


# ---------------------------------------------------------------------------------------------------- the table


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown, one line per (heads, requests, mix) with both backends: wall µs a step and the GPU span a step
    (CUDA events), summed kernel µs a step, attention µs a step (floor fraction), the ratios ours / FlashMLA, and
    whether every window held the full batch."""
    by = {(r["heads"], r["requests"], r["context_mix"], r["backend"]): r for r in rows}
    lines = ["| heads | layers | requests | contexts | wall µs a step, ours / FlashMLA | GPU span µs | kernel µs | "
             "attention µs (floor fraction) | attention ratio | tokens/s ratio (wall) | full batch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for heads, requests, mix in sorted({k[:3] for k in by}):
        a, b = by.get((heads, requests, mix, OURS)), by.get((heads, requests, mix, FLASHMLA))
        if not a or not b:
            continue

        def frac(r: Mapping[str, Any]) -> str:
            return f" ({r['attention_floor_fraction']:.2f})" if r.get("attention_floor_fraction") else ""

        full = "yes" if a["full_batch"] and b["full_batch"] else "no"
        lines.append(
            f"| {heads} | {a['layers']} | {requests} | {mix} | {a['decode_step_us']:.0f} / {b['decode_step_us']:.0f} | "
            f"{a['gpu_span_us']:.0f} / {b['gpu_span_us']:.0f} | {a['kernel_us']:.0f} / {b['kernel_us']:.0f} | "
            f"{a['attention_us']:.0f}{frac(a)} / {b['attention_us']:.0f}{frac(b)} | "
            f"{a['attention_us'] / b['attention_us']:.2f}x | {b['decode_step_us'] / a['decode_step_us']:.2f}x | "
            f"{full} |")
    return "\n".join(lines)


__all__ = ["ATTENTION_KERNELS", "ENGINE_OVERHEAD_BYTES", "INDEXER_ROW_BYTES", "MAX_LAYERS", "ROW_BYTES",
           "attention_kernels", "batch_tokens", "classify", "engine_bytes", "fit_layers", "kernel_class",
           "layer_weight_bytes", "step_is_decode", "table", "unmatched_other", "window_checks"]
