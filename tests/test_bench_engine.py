"""benchmarks/bench_engine.py on a CPU: the comparison rule, the workload, the model's config through vLLM's own
EngineArgs (at a mocked SM 9.0), and the table. The engines themselves run on a GPU (tests/test_vllm_engine_gpu.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "benchmarks" / "bench_engine.py")
be = importlib.util.module_from_spec(spec)
sys.modules["bench_engine"] = be
spec.loader.exec_module(be)


def _run(tokens, logprobs=None):
    return {"tokens": tokens, "logprobs": logprobs}


def _rows(*peaks, vocab=8, gap=3.0):
    """One log-probability row a step: token `p` on top by `gap`, the rest flat."""
    return [[0.0 if t == p else -gap for t in range(vocab)] for p in peaks]


def test_compare_accepts_the_same_run():
    ref = [_run([1, 2, 3], _rows(1, 2, 3))]
    result = be.compare(ref, ref)
    assert result["ok"] and result["max_logprob_diff"] == 0.0


def test_compare_fails_a_logprob_difference_past_the_bound():
    ref = [_run([1, 2], _rows(1, 2))]
    shifted = _rows(1, 2)
    shifted[1][5] += 2 * be.LOGPROB_BOUND
    result = be.compare(ref, [_run([1, 2], shifted)])
    assert not result["ok"] and result["first_decode_diff"] == pytest.approx(2 * be.LOGPROB_BOUND)


def test_compare_fails_a_different_token_where_the_reference_is_sure():
    ref = [_run([1, 2, 3], _rows(1, 2, 3))]
    result = be.compare(ref, [_run([1, 4, 3], _rows(1, 2, 3))])
    assert not result["ok"] and result["requests"][0]["diverged_at"] == 1


def test_compare_accepts_a_different_token_at_a_near_tie_and_stops_there():
    tie = _rows(1, 2, 3)
    tie[1][4] = tie[1][2] - be.TIE_MARGIN / 2  # tokens 2 and 4 within the margin at step 1
    other = [list(row) for row in tie[:2]] + _rows(6)  # the same step-1 values (inputs equal), then its own
    other[1][4] += be.LOGPROB_BOUND / 2  # which tips it to token 4
    result = be.compare([_run([1, 2, 3], tie)], [_run([1, 4, 6], other)])
    row = result["requests"][0]
    assert result["ok"] and row["diverged_at"] == 1 and row["near_tie"]


def test_compare_checks_tokens_alone_when_the_other_has_no_logprobs():
    ref = [_run([1, 2, 3], _rows(1, 2, 3))]
    assert be.compare(ref, [_run([1, 2, 3])])["ok"]
    assert not be.compare(ref, [_run([1, 5, 3])])["ok"]


def test_workload_spans_100_to_6000_tokens_and_is_seeded():
    lengths = be.prompt_lengths(32, seed=3)
    assert min(lengths) == 100 and max(lengths) == 6000 and lengths == be.prompt_lengths(32, seed=3)
    batch = be.prompts(lengths[:3], seed=3, repeat=be.CHECK_REPEAT)
    assert [len(p) for p in batch] == lengths[:3]
    assert all(2 <= t < be.VOCAB for p in batch for t in p)
    assert batch[0][: be.CHECK_REPEAT] == batch[0][be.CHECK_REPEAT: 2 * be.CHECK_REPEAT]


def test_model_is_deepseek_v32_attention_as_released():
    config = be.model_config(128)
    assert (config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]) == (1536, 512, 64)
    assert (config["index_topk"], config["index_n_heads"], config["index_head_dim"]) == (2048, 64, 128)
    assert config["first_k_dense_replace"] == config["num_hidden_layers"]  # dense MLP in every layer


@pytest.mark.parametrize("backend", [be.OURS, be.FLASHMLA])
def test_vllm_builds_the_engine_config_at_sm90(tmp_path, backend, monkeypatch):
    """vLLM's own EngineArgs takes the model and the engine arguments the bench passes, with breakable CUDA graphs
    (compilation mode NONE) as vLLM turns them on for DeepSeek-V3.2, and index_topk 2048."""
    pytest.importorskip("vllm")
    sys.path.insert(0, str(ROOT / "tests"))
    import vllm_harness as vh
    from unittest.mock import patch
    from vllm.engine import arg_utils
    from vllm.engine.arg_utils import EngineArgs

    # create_engine_config sets VLLM_USE_BREAKABLE_CUDAGRAPH=1 for DeepSeek-V3.2 when unset: unset here, then undone
    # (monkeypatch.delenv of an absent variable records nothing to restore)
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "")
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH")
    model = be.write_model(tmp_path / "model", 16)
    with vh.gpu_capability(9, 0), patch.object(arg_utils, "current_platform", vh.cuda_platform_class()()):
        config = EngineArgs(**be.engine_kwargs(str(model), backend, max_num_seqs=128)).create_engine_config()
    assert config.attention_config.backend.name == backend
    assert config.cache_config.cache_dtype == "fp8"
    assert int(config.compilation_config.mode) == 0
    assert config.model_config.hf_text_config.index_topk == 2048
    assert config.model_config.get_num_attention_heads(config.parallel_config) == 16


def test_table_gives_the_ratio_per_point():
    rows = [{"backend": be.OURS, "heads": 128, "requests": 32, "tokens_per_s": 1500.0, "attention_share": 0.4},
            {"backend": be.FLASHMLA, "heads": 128, "requests": 32, "tokens_per_s": 1000.0, "attention_share": 0.5}]
    text = be.table(rows)
    assert "| 128 | 32 | 1500 (0.40) | 1000 (0.50) | 1.50x |" in text


def test_seeded_loader_gives_trained_sizes_the_same_in_every_engine():
    """The 'dsa_seeded' weights: matrices N(0, 1/fan_in), embeddings N(0, 1), norms 1, biases 0, drawn from each
    tensor's name, so two engines of a run (two processes) hold the same weights; vLLM's own dummy values are +-1e-3."""
    pytest.importorskip("vllm")
    import torch
    from vllm.config.load import LoadConfig

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(64, 256)
            self.proj = torch.nn.Linear(256, 512)
            self.proj2 = torch.nn.Linear(256, 512)  # same shape, another name: other values
            self.norm = torch.nn.LayerNorm(256)

    loader = be._register_seeded_loader()(LoadConfig(load_format="dsa_seeded"))
    a, b = Toy(), Toy()
    loader.load_weights(a, None)
    loader.load_weights(b, None)
    assert torch.equal(a.proj.weight, b.proj.weight) and torch.equal(a.embed_tokens.weight, b.embed_tokens.weight)
    assert a.proj.weight.std().item() == pytest.approx(256 ** -0.5, rel=0.05)
    assert a.embed_tokens.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert torch.all(a.norm.weight == 1) and torch.all(a.norm.bias == 0) and torch.all(a.proj.bias == 0)
    assert not torch.equal(a.proj.weight, a.proj2.weight)


def test_greedy_params_and_prompts_are_vllms_own():
    """What every engine of the run is asked: greedy, past EOS, the full vocabulary's log-probabilities when asked,
    token-id prompts (no tokenizer)."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    params = be._greedy(12, logprobs=-1)
    assert isinstance(params, SamplingParams)
    assert (params.temperature, params.max_tokens, params.ignore_eos, params.logprobs) == (0.0, 12, True, -1)
    (prompt,) = be._token_prompts([[5, 6, 7]])
    assert prompt["prompt_token_ids"] == [5, 6, 7]
