"""vLLM 0.33's own DeepSeek-V3.2 attention layer (DeepseekV32Attention), built and fed as vLLM does, and its checks.

The config comes from EngineArgs(...).create_engine_config() (FLASHINFER_MLA_SPARSE, an fp8 cache); the layer from
DeepseekV32Attention's constructor with the model's top-k buffer and index-group builder; the cache from the layer's
KV-cache spec and the backend's shape, bound with the layer's bind_kv_cache; the metadata from the backend's own
builder over a CommonAttentionMetadata, as the model runner makes it. The layer is a shared-top-k layer
(index_topk_pattern "S": no indexer of its own, DeepGEMM's MQA logits do not load on the device): known top-k ids
go where the indexer writes them, the model's top-k buffer. Everything else in its forward is vLLM's: fused_norm_rope
writes the cache, fused_q quantizes the query, the index group converts the ids on its side stream, and
SparseMLACommonImpl.forward_mqa calls this package's _forward_mqa_kernel.

The float32 references take the weights, the cache rows the layer wrote and the query vLLM quantized (captured on
their way into forward_mqa) and redo the layer's math: `check_step`, for tests/test_vllm_gpu.py (CUDA) and
tests/test_vllm_layer_cpu.py (the same forward on a CPU, Triton's interpreter).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from conftest import computed_operands, fp8_wgmma_dims
from decode_checks import check_decode
import vllm_harness
from vllm_harness import init_vllm

from vllm_kimi_dsa.convert import convert_topk_reference
from vllm_kimi_dsa.formats import flat_kv_row_view
from vllm_kimi_dsa.reference import reference_decode

# The cache writer's one e4m3 rounding (3 mantissa bits, round to nearest): half a step, 2^-4 of |x|, plus the bf16
# rounding of the normed latent / RoPE'd key on its way in (2^-9, doubled), and e4m3's subnormal spacing: a writer 5%
# off its scale fails it (4.8% plus its rounding), which the whole step (2^-3) let through.
CACHE_REL = 2.0**-4 + 2.0**-8
E4M3_REL = 2.0**-3  # fused_q's: a whole e4m3 step (its inputs also differ from float32 by QUERY_ABS, see below)
E4M3_SUB = 2.0**-9  # e4m3's subnormal spacing
# The query's float32 chain differs from vLLM's bf16 one by roundings of 2^-9 relative at q_a RMSNorm's output,
# q_b_proj's and the absorption's outputs; through the fan-in-256 and -128 dot products that is < 2^-7 of the row's
# rms in any element (5 sigma of each); three of them, doubled: 2^-5.
QUERY_ABS = 2.0**-5
# The layer past the decode: latent to bf16 (2^-9), the decode's own bound (< 2^-8 in norm), W_UV's and o_proj's
# bf16 outputs (2^-9 each): < 2^-7 per token in norm; doubled.
LAYER_REL = 2.0**-6
# Triton 3.8's interpreter drops the mantissa carry when it rounds float32 to e4m3 (7.9 -> 4, 1.97 -> 1, 31.9 -> 16;
# seen 2026-12-07): on a CPU, vLLM's writer and fused_q give 2^floor(log2 |x|) there, which the checks accept.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
E2E_REL = 0.15  # the FP8 query's own rounding through softmax: reported; the bound only catches gross errors

LAYER_PREFIX = "model.layers.0.self_attn"
LAYER_NAME = f"{LAYER_PREFIX}.attn"  # DeepseekV32Attention names its MLAAttention `<prefix>.attn`
BLOCK = 64
TOPK = 2048  # DeepSeek-V3.2's index_topk
HIDDEN = 256  # small: the attention's geometry is the model's, the projections around it are not
Q_LORA = 256


def model_config_json(heads: int, *, spec_tokens: int = 0) -> dict[str, Any]:
    """A DeepSeek-V3.2-shaped config.json (vllm_harness's, MLA 512 + 64, nope 128, v 128) at the model's index_topk
    2048 and 64 indexer heads, one layer, q_lora_rank Q_LORA."""
    config = vllm_harness.model_config_json(vllm_harness.DSV32, heads=heads, topk=TOPK)
    assert config["hidden_size"] == HIDDEN
    config.update(
        num_hidden_layers=1, q_lora_rank=Q_LORA, index_n_heads=64, max_position_embeddings=16384,
        # layer 0 reads the top-k ids of an indexer before it (vLLM's shared-top-k layers), see the module docstring
        index_topk_pattern="S",
    )
    if spec_tokens:
        config["num_nextn_predict_layers"] = 1  # DeepSeek-V3.2's MTP head
    return config


def engine_config(directory: Path, *, heads: int, spec_tokens: int = 0, max_num_seqs: int = 8,
                  max_num_batched_tokens: int = 4096, kv_cache_dtype: str = "fp8") -> Any:
    """The VllmConfig `vllm serve <model> --attention-backend FLASHINFER_MLA_SPARSE --kv-cache-dtype fp8` makes."""
    from vllm.engine.arg_utils import EngineArgs

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model_config_json(heads, spec_tokens=spec_tokens)))
    speculative = {"method": "mtp", "num_speculative_tokens": spec_tokens} if spec_tokens else None
    args = EngineArgs(
        model=str(directory), skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
        kv_cache_dtype=kv_cache_dtype, attention_backend="FLASHINFER_MLA_SPARSE", block_size=BLOCK,
        max_model_len=8192, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        speculative_config=speculative,
    )
    return args.create_engine_config()


@dataclass
class Request:
    """One request of a batch: `context` tokens already in the cache, `query` new tokens this step."""

    context: int
    query: int

    @property
    def seq_len(self) -> int:
        return self.context + self.query


@dataclass
class Batch:
    """A step's requests (decodes first, as vLLM orders them) and its tensors, on the GPU."""

    requests: list[Request]
    positions: torch.Tensor  # (T,) int64
    hidden: torch.Tensor  # (T, HIDDEN) bf16
    topk: torch.Tensor  # (T, TOPK) int32 ids in each request's own numbering, -1 holes
    block_table: torch.Tensor  # (num_reqs, max_blocks) int32
    slot_mapping: torch.Tensor  # (T,) int64
    query_start_loc: torch.Tensor  # (num_reqs + 1,) int32
    seq_lens: torch.Tensor  # (num_reqs,) int32
    req_of_token: torch.Tensor  # (T,) int64

    @property
    def tokens(self) -> int:
        return int(self.positions.shape[0])


def random_topk(positions: torch.Tensor, g: torch.Generator, *, empty_rows: tuple[int, ...] = ()) -> torch.Tensor:
    """Top-k ids as an indexer gives them: distinct causal ids (<= the token's position), every token when there
    are fewer than TOPK, in a random order, padded with -1; about 5% of the counted prefix punched to -1 holes, and
    the rows in `empty_rows` all -1 (a row with nothing to attend: output 0)."""
    rows = positions.shape[0]
    out = torch.full((rows, TOPK), -1, dtype=torch.int32)
    for i, p in enumerate(positions.tolist()):
        n = min(p + 1, TOPK)
        ids = torch.randperm(p + 1, generator=g)[:n]
        out[i, :n] = ids.to(torch.int32)
    hole = (torch.rand(rows, TOPK, generator=g) < 0.05) & (out >= 0)
    out[hole] = -1
    for i in empty_rows:
        out[i] = -1
    return out


class LayerRig:
    """A DeepseekV32Attention layer of vLLM with this package's backend, its KV cache and metadata builder.

    heads: query heads of the layer (the heads a TP rank sees). q_scale, k_scale: the layer's FP8 scales (as a
    checkpoint's quantization sets them), set before vLLM's post-load hook builds the step.
    """

    def __init__(self, directory: Path, *, heads: int, spec_tokens: int = 0, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 4096, num_blocks: int = 256, q_scale: float = 0.125,
                 k_scale: float = 0.25, seed: int = 0, device: str = "cuda") -> None:
        from vllm.config import set_current_vllm_config
        from vllm.models.deepseek_v32.attention import DeepseekV32Attention
        from vllm.utils.torch_utils import set_default_torch_dtype
        from vllm.v1.attention.backends.mla.index_group import (
            SparseMLAIndexGroupBuilder,
            get_sparse_mla_index_group_max_rows,
        )

        self.device = torch.device(device)
        if self.device.type == "cuda":
            init_vllm(self.device)
        self.config = engine_config(directory, heads=heads, spec_tokens=spec_tokens, max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=max_num_batched_tokens)
        self.heads = heads
        self.q_scale, self.k_scale = q_scale, k_scale
        self.gen = torch.Generator().manual_seed(seed)
        hf = self.config.model_config.hf_text_config
        with set_current_vllm_config(self.config), set_default_torch_dtype(torch.bfloat16), self.device:
            # As DeepseekV32Model makes them: one top-k buffer a model, one index-group builder
            self.topk_buffer = torch.empty(self.config.scheduler_config.max_num_batched_tokens, hf.index_topk,
                                           dtype=torch.int32, device=self.device)
            builder = SparseMLAIndexGroupBuilder(self.topk_buffer, get_sparse_mla_index_group_max_rows(self.config))
            self.layer = DeepseekV32Attention(self.config, hf, prefix=LAYER_PREFIX,
                                              topk_indices_buffer=self.topk_buffer, index_group_builder=builder)
        assert self.layer.indexer is None and self.layer.layer_name == LAYER_NAME
        self._init_weights()
        with set_current_vllm_config(self.config):
            self.layer.process_weights_after_loading(torch.bfloat16)  # vLLM's loader: builds the step
        # An unquantized checkpoint leaves the scales at 1.0 (set_default_quant_scales); calibrated FP8 scales
        # (a checkpoint's, or calculate_kv_scales) arrive as here, and the backend replans on its next call.
        self.layer._q_scale.fill_(q_scale)
        self.layer._k_scale.fill_(k_scale)
        self.layer._q_scale_float, self.layer._k_scale_float = q_scale, k_scale
        self.impl = self.layer.impl
        spec = self.layer.get_kv_cache_spec(self.config)
        self._bind_cache(spec, num_blocks)
        with set_current_vllm_config(self.config):
            self.builder = self.layer.attn_backend.get_builder_cls()(spec, [LAYER_NAME], self.config, self.device)
        self.captured: list[dict[str, Any]] = []
        self.spying = True
        self._spy()

    # ---------------------------------------------------------------- construction

    def _init_weights(self) -> None:
        """Random weights scaled so each projection's output is O(1) (fresh data, never zeros)."""
        g = torch.Generator(device="cpu").manual_seed(int(torch.randint(0, 2**31, (1,), generator=self.gen)))
        for name, param in self.layer.named_parameters():
            if name.endswith("layernorm.weight"):
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=g)
            else:
                fan_in = param.shape[-1]
                values = torch.randn(param.shape, generator=g) / math.sqrt(fan_in)
            with torch.no_grad():
                param.copy_(values.to(param.dtype))

    def _bind_cache(self, spec: Any, num_blocks: int) -> None:
        """The layer's cache as vLLM's runner makes it (a 4-d [blocks, 1, 64, bytes] view of raw bytes in the spec's
        dtype, kv_cache_interface.compute_layer_kv_cache_shape_bytes), every row random e4m3 bytes (past tokens'
        rows; never zeros), bound with the layer's own bind_kv_cache."""
        from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

        shape = compute_layer_kv_cache_shape_bytes(spec, num_blocks)
        values = torch.randn(shape, generator=self.gen) / self.k_scale
        raw = values.to(torch.float8_e4m3fn).view(torch.uint8).to(self.device)
        self.layer.bind_kv_cache(raw.view(spec.dtype))
        self.num_blocks = num_blocks

    def _spy(self) -> None:
        """Record what vLLM hands forward_mqa (the FP8 query) and what the backend returns to it (latent, LSE),
        with the flat rows and counts vLLM's converter made: calls pass through unchanged."""
        impl = self.impl
        forward_mqa = impl.forward_mqa
        kernel = impl._forward_mqa_kernel
        rig = self

        def spy_forward_mqa(q, kv_cache, attn_metadata, layer):
            if not rig.spying:  # off under graph capture: the copies would allocate in the graph's pool
                return forward_mqa(q, kv_cache, attn_metadata, layer)
            rig.captured.append({"query": q.clone() if isinstance(q, torch.Tensor) else q})
            return forward_mqa(q, kv_cache, attn_metadata, layer)

        def spy_kernel(q, kv_cache, topk_indices, seq_lens, **kw):
            out, lse = kernel(q, kv_cache, topk_indices, seq_lens, **kw)
            if not rig.spying:
                return out, lse
            record = rig.captured[-1] if rig.captured else {}
            record.setdefault("pieces", []).append({
                "slots": topk_indices.clone(), "counts": seq_lens.clone(), "out": out.clone(),
                "lse": None if lse is None else lse.clone(), "is_decode": kw.get("is_decode"),
            })
            return out, lse

        impl.forward_mqa = spy_forward_mqa
        impl._forward_mqa_kernel = spy_kernel

    # ---------------------------------------------------------------- batches

    def batch(self, requests: list[Request], *, empty_rows: tuple[int, ...] = ()) -> Batch:
        """Fresh random inputs for a step: hidden states, positions, a shuffled block table, slots, top-k ids."""
        g = self.gen
        positions = torch.cat([torch.arange(r.context, r.seq_len) for r in requests])
        req_of_token = torch.cat([torch.full((r.query,), i) for i, r in enumerate(requests)])
        max_blocks = max(-(-r.seq_len // BLOCK) for r in requests)
        needed = sum(-(-r.seq_len // BLOCK) for r in requests)
        if needed > self.num_blocks:
            raise ValueError(f"the batch needs {needed} blocks, the cache has {self.num_blocks}")
        perm = torch.randperm(self.num_blocks, generator=g).to(torch.int32)
        table = torch.zeros((len(requests), max_blocks), dtype=torch.int32)
        used = 0
        for i, r in enumerate(requests):
            n = -(-r.seq_len // BLOCK)
            table[i, :n] = perm[used: used + n]
            used += n
        slot_mapping = table[req_of_token, positions // BLOCK].long() * BLOCK + positions % BLOCK
        qsl = torch.zeros(len(requests) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor([r.query for r in requests]), 0)
        dev = self.device
        return Batch(
            requests=list(requests), positions=positions.to(dev),
            hidden=torch.randn(positions.shape[0], HIDDEN, generator=g).to(torch.bfloat16).to(dev),
            topk=random_topk(positions, g, empty_rows=empty_rows).to(dev), block_table=table.to(dev),
            slot_mapping=slot_mapping.to(dev), query_start_loc=qsl.to(dev),
            seq_lens=torch.tensor([r.seq_len for r in requests], dtype=torch.int32).to(dev),
            req_of_token=req_of_token.to(dev),
        )

    def common_metadata(self, batch: Batch) -> Any:
        """The CommonAttentionMetadata the model runner hands the builders for this batch."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        qsl_cpu = batch.query_start_loc.cpu()
        seq_lens_cpu = batch.seq_lens.cpu()
        return CommonAttentionMetadata(
            query_start_loc=batch.query_start_loc, query_start_loc_cpu=qsl_cpu, seq_lens=batch.seq_lens,
            num_reqs=len(batch.requests), num_actual_tokens=batch.tokens,
            max_query_len=max(r.query for r in batch.requests), max_seq_len=int(seq_lens_cpu.max()),
            block_table_tensor=batch.block_table, slot_mapping=batch.slot_mapping, positions=batch.positions,
            seq_lens_cpu_upper_bound=seq_lens_cpu,
            is_prefilling=torch.tensor([r.query > 1 and r.context == 0 for r in batch.requests]),
        )

    def metadata(self, batch: Batch) -> Any:
        """The backend's metadata for `batch`, from its own builder."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.config):
            return self.builder.build(common_prefix_len=0, common_attn_metadata=self.common_metadata(batch))

    @contextlib.contextmanager
    def forward_context(self, batch: Batch, metadata: Any, *, mode: Any = None,
                        descriptor: Any = None) -> Iterator[None]:
        from vllm.config import CUDAGraphMode, set_current_vllm_config
        from vllm.forward_context import set_forward_context

        with set_current_vllm_config(self.config), set_forward_context(
            {LAYER_NAME: metadata}, self.config, num_tokens=batch.tokens,
            cudagraph_runtime_mode=mode if mode is not None else CUDAGraphMode.NONE,
            batch_descriptor=descriptor, slot_mapping={LAYER_NAME: batch.slot_mapping},
        ):
            yield

    def forward(self, batch: Batch) -> torch.Tensor:
        """One eager step of the layer: the indexer's ids into the model's top-k buffer, then vLLM's forward."""
        self.topk_buffer[: batch.tokens].copy_(batch.topk)
        self.captured.clear()
        metadata = self.metadata(batch)
        with self.forward_context(batch, metadata):
            return self.layer(batch.positions, batch.hidden)

    # ---------------------------------------------------------------- the float32 references

    def kv_rows(self) -> torch.Tensor:
        """The cache as flat (num_rows, 576) e4m3 rows (what the decode reads)."""
        cache = self.layer.kv_cache
        return cache.view(torch.float8_e4m3fn).reshape(-1, cache.shape[-1])

    def reference_inputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The layer's math up to the attention, in float32 from the same bf16 projections vLLM ran:
        the cache row each new token must have (512 normed latent + 64 RoPE'd key, before the k_scale) and the
        MQA query (512 absorbed nope + 64 RoPE'd, before the q_scale)."""
        layer = self.layer
        with torch.no_grad():
            qkv = layer.fused_qkv_a_proj(batch.hidden)[0]
            q_c, kv_c, k_pe = qkv.split([layer.q_lora_rank, layer.kv_lora_rank, layer.qk_rope_head_dim], dim=-1)
            q_norm = rms_norm(q_c.float(), layer.q_a_layernorm.weight.float(), layer.q_a_layernorm.variance_epsilon)
            kv_norm = rms_norm(kv_c.float(), layer.kv_a_layernorm.weight.float(),
                               layer.kv_a_layernorm.variance_epsilon)
            cos_sin = layer.rotary_emb.cos_sin_cache.float()
            k_rope = rope_interleaved(k_pe.float(), cos_sin, batch.positions)
            q = (q_norm @ layer.q_b_proj.weight.float().t()).view(-1, self.heads, layer.qk_head_dim)
            q_nope, q_pe = q.split([layer.qk_nope_head_dim, layer.qk_rope_head_dim], dim=-1)
            w_uk = layer.W_UK_T.float()  # (H, nope, 512)
            ql_nope = torch.einsum("thn,hnl->thl", q_nope, w_uk)
            q_rope = rope_interleaved(q_pe, cos_sin, batch.positions)
        return {"kv": torch.cat([kv_norm, k_rope], dim=-1), "query": torch.cat([ql_nope, q_rope], dim=-1)}

    def layer_output(self, latent: torch.Tensor) -> torch.Tensor:
        """The rest of the layer in float32: latent (T, H, 512) -> W_UV -> o_proj (T, HIDDEN)."""
        layer = self.layer
        v = torch.einsum("thl,hlv->thv", latent.float(), layer.W_UV.float())
        return v.reshape(latent.shape[0], -1) @ layer.o_proj.weight.float().t()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_interleaved(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """GPT-J style RoPE (is_neox_style=False, as DeepSeek-V3.2's MLA uses): pairs (x[2i], x[2i+1]) turned by the
    position's angle i; cos_sin rows are [cos (d/2) | sin (d/2)]. x (T, d) or (T, H, d)."""
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[positions, :half], cos_sin[positions, half:]
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out


@dataclass(eq=False)  # hashable by identity: vLLM caches workspaces per group
class RankGroup:
    """An in-process stand-in for a DCP group of `world_size` ranks, one thread a rank (a real NCCL group cannot put
    two ranks on one GPU): all_gather and reduce_scatter exchange tensors through a barrier. It implements what
    vLLM's cp_lse_ag_out_rs (MLADCPManager's combine) calls of a GroupCoordinator."""

    world_size: int
    _local: Any = field(default=None)
    _slots: list = field(default_factory=list)
    _barrier: Any = field(default=None)

    def __post_init__(self) -> None:
        import threading

        self._local = threading.local()
        self._slots = [None] * self.world_size
        self._barrier = threading.Barrier(self.world_size)

    def bind(self, rank: int) -> None:
        self._local.rank = rank

    @property
    def rank_in_group(self) -> int:
        return self._local.rank

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        torch.cuda.synchronize()
        self._slots[self.rank_in_group] = tensor
        self._barrier.wait()
        got = list(self._slots)
        self._barrier.wait()
        return got

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(tensor), dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        total = torch.stack(self._exchange(tensor)).sum(0)
        return total.chunk(self.world_size, dim=dim)[self.rank_in_group].contiguous()


# ---------------------------------------------------------------- the checks


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def e4m3_close(got: torch.Tensor, want: torch.Tensor, slack, rel: float = E4M3_REL) -> bool:
    """got: e4m3 values; want: their float32 reference: `rel` of |want| apart, plus `slack` (the interpreter's carry
    drop allowed on a CPU, see INTERPRETED)."""
    ok = (got - want).abs() <= rel * want.abs() + slack
    if INTERPRETED:
        power = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2.0**-10))))
        ok |= (got.abs() == power) | (got.abs() == power / 2)
    return bool(ok.all())


def check_step(r: "LayerRig", batch: Batch, out: torch.Tensor) -> dict:
    """Every check of tests/test_vllm_gpu.py's docstring for one step of `r`; returns the measured errors."""
    tokens, heads = batch.tokens, r.heads
    assert out.shape == (tokens, HIDDEN) and torch.isfinite(out).all()
    assert len(r.captured) == 1, "forward_mqa runs once a step"
    record = r.captured[0]
    query = record["query"]
    assert query.dtype == torch.float8_e4m3fn and query.shape == (tokens, heads, 576)
    (piece,) = record["pieces"]
    ref = r.reference_inputs(batch)
    kv_rows = r.kv_rows()
    found = {"tokens": tokens, "heads": heads, "is_decode": piece["is_decode"]}

    # the scales the answer must have, from the layer's own q / k scales and softmax scale, not from the core
    # (SPEC 2.1: softmax scale x q_scale x k_scale, and k_scale out of P.V)
    softmax_scale = r.impl.scale * r.q_scale * r.k_scale
    output_scale = r.k_scale

    # the cache rows vLLM wrote
    got = kv_rows[batch.slot_mapping].float()
    want = ref["kv"] / r.k_scale
    assert e4m3_close(got, want, E4M3_SUB, CACHE_REL), "cache rows off e4m3's rounding"
    found["cache_rel_l2"] = rel_l2(got, want)

    # the FP8 query vLLM made
    got_q = query.float()
    want_q = ref["query"] / r.q_scale
    rms = want_q.pow(2).mean(-1, keepdim=True).sqrt()
    assert e4m3_close(got_q, want_q, QUERY_ABS * rms + E4M3_SUB), "the FP8 query off one e4m3 step"
    found["query_rel_l2"] = rel_l2(got_q, want_q)

    # vLLM's flat rows and counts, then the latent the backend returned
    step = r.impl._step
    _, stride = flat_kv_row_view(r.layer.kv_cache, BLOCK)
    slots, counts = convert_topk_reference(
        batch.topk, batch.req_of_token.to(torch.int32), batch.block_table, block_size=BLOCK,
        rows_per_block_stride=stride,
    )
    assert torch.equal(piece["counts"], counts), "vLLM's valid counts differ from the converter's"
    position = torch.arange(slots.shape[1], device=slots.device)
    live = position < counts.long().unsqueeze(1)
    theirs = torch.where(live, piece["slots"], torch.full_like(slots, -2)).sort(dim=1).values
    ours = torch.where(live, slots, torch.full_like(slots, -2)).sort(dim=1).values
    assert torch.equal(theirs, ours), "vLLM's flat rows are not the rows the ids name"
    core = step.core
    kernel = core.decode_kernel(min(tokens, step.shape.max_rows))
    latent = piece["out"]
    for start in range(0, tokens, 64):  # the float32 reference in slices (a prefill's rows x 2048 x 576)
        sl = slice(start, min(tokens, start + 64))
        q, kv, fmt, ss, os_ = computed_operands(kernel, core.fmt, query[sl], kv_rows, softmax_scale, output_scale)
        check_decode(latent[sl], None, q, kv, piece["slots"][sl], piece["counts"][sl], fmt, ss, os_,
                     config=getattr(kernel, "config", None), wgmma=fp8_wgmma_dims(kernel, core.fmt) or False)

    # the layer's output, and the whole layer against a query never rounded to e4m3
    ref_latent = torch.cat([
        reference_decode(query[s: s + 64], kv_rows, piece["slots"][s: s + 64], piece["counts"][s: s + 64],
                         fmt="fp8", softmax_scale=softmax_scale, output_scale=output_scale)[0]
        for s in range(0, tokens, 64)])
    want_out = r.layer_output(ref_latent)
    empty = counts == 0
    assert (out[empty] == 0).all(), "a token with nothing selected must give output 0"
    per_token = (out.float() - want_out).norm(dim=-1) / want_out.norm(dim=-1).clamp_min(1e-30)
    assert per_token[~empty].max().item() <= LAYER_REL, f"layer output off by {per_token.max().item():.3e}"
    found["layer_rel_l2"] = rel_l2(out, want_out)
    unrounded = torch.cat([
        reference_decode(ref["query"][s: s + 64], kv_rows, piece["slots"][s: s + 64], piece["counts"][s: s + 64],
                         fmt="fp8", softmax_scale=r.impl.scale * r.k_scale, output_scale=output_scale)[0]
        for s in range(0, tokens, 64)])
    found["e2e_rel_l2_unquantized_query"] = e2e = rel_l2(out, r.layer_output(unrounded))
    assert e2e <= E2E_REL
    # last, the core's own scales (a wrong one has failed the value checks above already)
    assert core.softmax_scale == pytest.approx(softmax_scale) and core.output_scale == pytest.approx(output_scale)
    return found


# ---------------------------------------------------------------- planted faults (the checks' negative controls)

# fault -> the check that must catch it (a regex of check_step's assertion message)
FAULTS = {
    "dropped_slot": "exceeds the bound|layer output off",  # the backend skips each row's first selected token
    "softmax_scale_5pct": "exceeds the bound|layer output off",  # the step planned at a softmax scale 5% high
    "output_scale_10pct": "exceeds the bound|layer output off",  # the step's output scale 10% high
    "cache_writer_scale_5pct": "cache rows off",  # vLLM's writer at a k scale 5% high (2^-3 cannot see it)
}


class _ScaledLayer:
    """A layer whose FP8 scales read `q_factor` / `k_factor` times the real ones (everything else passes through)."""

    def __init__(self, layer: Any, q_factor: float = 1.0, k_factor: float = 1.0) -> None:
        self.__dict__["_layer"], self.__dict__["_q"], self.__dict__["_k"] = layer, q_factor, k_factor

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.__dict__["_layer"], name)
        if name == "_q_scale_float":
            return value * self.__dict__["_q"]
        if name == "_k_scale_float":
            return value * self.__dict__["_k"]
        return value


@contextlib.contextmanager
def planted(r: "LayerRig", fault: str) -> Iterator[None]:
    """Run the layer with `fault` (a key of FAULTS) planted in the backend or in vLLM's writer; the step is rebuilt
    on the way in and out, so the fault lasts exactly the block."""
    import vllm.models.deepseek_v32.attention as v32

    from vllm_kimi_dsa import serving

    if fault not in FAULTS:
        raise ValueError(f"fault={fault!r}; known: {sorted(FAULTS)}")
    with pytest.MonkeyPatch.context() as mp:
        if fault == "dropped_slot":
            call = serving.LayerStep.__call__

            def dropping(self, query, kv_cache, slots, counts, block_size):
                slots = slots.clone()
                slots[:, 0] = torch.where(counts >= 1, torch.full_like(slots[:, 0], -1), slots[:, 0])
                return call(self, query, kv_cache, slots, counts, block_size)

            mp.setattr(serving.LayerStep, "__call__", dropping)
        elif fault in ("softmax_scale_5pct", "output_scale_10pct"):
            core_cls = serving.FlashInferCore
            # 5% on q moves only the softmax scale; k x 1.1 with q / 1.1 moves only the output scale (k_scale)
            factors = {"softmax_scale_5pct": (1.05, 1.0), "output_scale_10pct": (1 / 1.1, 1.1)}[fault]

            def misbuilt(impl, layer, *args, **kwargs):
                return core_cls(impl, _ScaledLayer(layer, *factors), *args, **kwargs)

            mp.setattr(serving, "FlashInferCore", misbuilt)
        elif fault == "cache_writer_scale_5pct":
            writer = v32.fused_norm_rope

            def off_scale(*args, mla_k_scale=None, skip_scale=False, **kwargs):
                return writer(*args, mla_k_scale=mla_k_scale * 1.05, skip_scale=False, **kwargs)

            mp.setattr(v32, "fused_norm_rope", off_scale)
        r.impl._step = None  # rebuilt on the next call, with the fault in place
        try:
            yield
        finally:
            r.impl._step = None  # and rebuilt clean after it
