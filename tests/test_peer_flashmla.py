"""The FlashMLA peer of the benchmark suite (vllm_kimi_dsa.bench.peers.flashmla), on a CPU: its fp8_ds_mla packing of the
suite's rows, the query padding vLLM 0.33 does (64 / 128 heads), the call it makes, where it finds the harness, and
the suite's options and tables around it (copy-bandwidth fraction, FlashMLA over our FP8). The kernel itself runs
only on the device (the suite's build child checks it there against a float64 reference).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from vllm_kimi_dsa.bench import plot
from vllm_kimi_dsa.bench import suite as bs
from vllm_kimi_dsa.bench.peers import flashmla as pf


def test_fp8_ds_mla_rows_are_656_bytes_and_round_trip() -> None:
    """512 e4m3 values in 4 tiles of 128 with an fp32 power-of-two scale each (vLLM's writer: 2^ceil(log2(amax /
    448))), 4 scales, 64 BF16 RoPE values: the layout vLLM's FLASHMLA_SPARSE reads. The suite's rows (e4m3 x 2^-3,
    exact in BF16) come back within e4m3's rounding of their tile's scale; the RoPE part exactly."""
    g = torch.Generator().manual_seed(3)
    x = ((torch.randn(257, 576, generator=g) * 8).to(torch.float8_e4m3fn).float() / 8).to(torch.bfloat16)
    rows = pf.quantize_fp8_ds_mla(x)
    assert rows.dtype == torch.uint8 and rows.shape == (257, pf.ROW_BYTES) and pf.ROW_BYTES == 656
    back = pf.dequantize_fp8_ds_mla(rows)
    xf = x.float()
    assert torch.equal(back[:, 512:], xf[:, 512:])
    scale = rows[:, 512:528].contiguous().view(torch.float32)
    amax = xf[:, :512].reshape(257, 4, 128).abs().amax(-1)
    assert torch.equal(scale, torch.exp2(torch.ceil(torch.log2(amax / 448.0))))
    assert bool((scale >= amax / 448.0).all()) and bool((scale < amax / 224.0).all())
    err = (back[:, :512] - xf[:, :512]).reshape(257, 4, 128).abs()
    assert bool((err <= amax.unsqueeze(-1) * 2.0**-4 + 1e-6).all())  # e4m3: 3 mantissa bits
    assert float((back[:, :512] - xf[:, :512]).norm() / xf[:, :512].norm()) < 3e-2


@pytest.mark.parametrize("heads, padded", [(1, 64), (4, 64), (8, 64), (24, 64), (64, 64), (65, 128), (96, 128),
                                           (128, 128)])
def test_query_is_padded_as_vllm_pads_it(heads: int, padded: int) -> None:
    assert pf.padded_heads(heads) == padded


def test_padded_heads_rejects_what_vllm_cannot_run() -> None:
    for bad in (0, 129):
        with pytest.raises(ValueError, match="heads"):
            pf.padded_heads(bad)


class _FakeExt:
    """sparse_decode_fwd's signature (flash_mla's): records the call, returns (out, lse, meta, num_splits)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def sparse_decode_fwd(self, q, kv, idx, topk_length, attn_sink, meta, nsplits, extra_kv, extra_idx,
                          extra_len, d_v, sm_scale):
        self.calls.append(dict(q=q.clone(), kv_shape=tuple(kv.shape), idx=idx, meta=meta, d_v=d_v, sm=sm_scale,
                               rest=(topk_length, attn_sink, extra_kv, extra_idx, extra_len)))
        b, s_q, h, _ = q.shape
        out = torch.arange(b * s_q * h * d_v, dtype=torch.float32).view(b, s_q, h, d_v).to(torch.bfloat16)
        return out, torch.zeros(b, h, s_q), meta if meta is not None else torch.ones(3), torch.ones(b + 1)


def test_peer_pads_the_query_and_reuses_its_metadata() -> None:
    ext = _FakeExt()
    rows, heads, width = 3, 8, 128
    peer = pf.FlashMLAPeer(ext, heads, rows, width, sm_scale=0.1)
    q = torch.randn(rows, heads, 576).to(torch.bfloat16)
    kv = torch.zeros(256, 656, dtype=torch.uint8)
    slots = torch.randint(0, 256, (rows, width), dtype=torch.int32)
    peer.plan(q, kv, slots)
    out = peer.run(q, kv, slots)
    first, second = ext.calls
    assert first["meta"] is None and second["meta"] is not None  # the scheduler metadata made once
    assert first["q"].shape == (1, rows, 64, 576)  # below 32 heads vLLM's mixed batch: (1, T, 64)
    assert torch.equal(first["q"][0, :, :heads], q) and not first["q"][0, :, heads:].any()  # zero padding
    assert first["kv_shape"] == (4, 64, 1, 656) and first["idx"].shape == (1, rows, width)
    assert first["d_v"] == 512 and first["sm"] == 0.1 and all(r is None for r in first["rest"])
    assert out.shape == (rows, heads, 512)  # the real heads' slice, as vLLM slices it
    # no padding at 64 / 128 heads
    full = pf.FlashMLAPeer(ext, 64, rows, width, sm_scale=0.1)
    full.run(torch.randn(rows, 64, 576).to(torch.bfloat16), kv, slots)
    assert ext.calls[-1]["q"].shape == (rows, 1, 64, 576) and ext.calls[-1]["idx"].shape == (rows, 1, width)


class _StandInOps:
    """vLLM's flashmla ops module as FlashMLA's C++ checks its arguments (sparse FP8 decode: q (b, s_q, 64 | 128,
    576) bf16, k_cache (blocks, 64, 1, 656) uint8, indices (b, s_q, topk) int32, cache_seqlens / block_table of b),
    computing the float64 reference of the packed rows; records each call."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def get_mla_metadata(self, *args, **kwargs):
        return {"initialized": False}, None

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
                               indices=None, **rest):
        b, s_q, h_q, d = q.shape
        assert q.dtype == torch.bfloat16 and d == 576 and h_q in (64, 128) and q.is_contiguous()
        assert k_cache.dtype == torch.uint8 and k_cache.shape[1:] == (64, 1, 656) and is_fp8_kvcache
        assert indices.shape == (b, s_q, indices.shape[-1]) and indices.dtype == torch.int32
        assert cache_seqlens.shape == (b,) and block_table.shape == (b, 1) and head_dim_v == 512 and not causal
        self.calls.append(dict(q=q.clone(), idx=indices, meta=dict(tile_scheduler_metadata), sm=softmax_scale))
        tile_scheduler_metadata["initialized"] = True
        kv = pf.dequantize_fp8_ds_mla(k_cache.view(-1, 656))
        ref = pf.reference(q.reshape(b * s_q, h_q, d), kv, indices.reshape(b * s_q, -1), softmax_scale)
        return ref.view(b, s_q, h_q, 512).to(torch.bfloat16), torch.zeros(b, h_q, s_q)


@pytest.mark.parametrize("heads, rows, shape", [(8, 5, (1, 5, 64)), (24, 3, (1, 3, 64)), (16, 1, (1, 1, 64)),
                                                (32, 4, (4, 1, 64)), (64, 2, (2, 1, 64)), (96, 3, (3, 1, 128)),
                                                (128, 1, (1, 1, 128))])
def test_vllm_peer_calls_flashmla_as_vllm_033_does(heads, rows, shape) -> None:
    """Through vLLM's wrappers (a stand-in here): below 32 heads the mixed batch (1, T, 64), else (rows, 1, 64 |
    128); the query zero-padded in every call; the step's metadata object filled by the first call and reused;
    the output the real heads of the padded call, against the float64 reference of the packed rows."""
    ops = _StandInOps()
    g = torch.Generator().manual_seed(heads + rows)
    kv = pf.quantize_fp8_ds_mla(torch.randn(256, 576, generator=g))
    slots = torch.randint(0, 256, (rows, 128), dtype=torch.int32, generator=g)
    slots[0, 5:9] = -1
    q = torch.randn(rows, heads, 576, generator=g).to(torch.bfloat16)
    peer = pf.VllmFlashMLA(ops, heads, rows, sm_scale=0.07, device="cpu")
    assert peer.shape["mixed"] == (heads < 32) and peer.padded == shape[2]
    peer.plan(q, kv, slots)
    out = peer.run(q, kv, slots)
    first, second = ops.calls
    assert first["meta"] == {"initialized": False} and second["meta"] == {"initialized": True}
    assert tuple(first["q"].shape[:3]) == shape and first["idx"].shape == (shape[0], shape[1], 128)
    flat = first["q"].reshape(rows, shape[2], 576)
    assert torch.equal(flat[:, :heads], q) and not flat[:, heads:].any()
    ref = pf.reference(q, pf.dequantize_fp8_ds_mla(kv), slots, 0.07)
    assert out.shape == (rows, heads, 512)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2
    assert ("(1, " in peer.describe()) == peer.shape["mixed"] or rows == 1


def test_vllm_route_is_the_default_where_vllm_has_flashmla(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """available(): vLLM's own FlashMLA first (even with a harness at hand), the harness only where vLLM's is not
    here or a harness folder is named."""
    bench_dir = tmp_path / "flashmla_bench"
    (bench_dir / "objs").mkdir(parents=True)
    (bench_dir / "build_ext.py").write_text("")
    (tmp_path / "flashmla" / "csrc").mkdir(parents=True)
    monkeypatch.setenv(pf.ENV_DIR, str(bench_dir))
    monkeypatch.setattr(pf, "vllm_available", lambda: (True, "vLLM 0.33.0"))
    assert pf.available() == (True, pf.SOURCE_VLLM)
    assert pf.available(bench_dir) == (True, str(bench_dir.resolve()))
    monkeypatch.setattr(pf, "vllm_available", lambda: (False, "no vLLM"))
    assert pf.available() == (True, str(bench_dir.resolve()))


def test_vllm_ops_on_this_machine() -> None:
    """Where vLLM is installed (CI's venv) the wrappers resolve to vLLM's own module or the interface it re-exports;
    on a machine without CUDA the compiled library cannot load, which is reported, not hidden."""
    ok, why = pf.vllm_available()
    if not ok:
        pytest.skip(why)
    try:
        ops, route = pf.vllm_ops()
    except ImportError as err:  # a CPU: _flashmla_C needs libcuda
        assert "libcuda" in str(err) or "_flashmla_C" in str(err) or "CUDA" in str(err), err
        return
    assert callable(ops.flash_mla_with_kvcache) and callable(ops.get_mla_metadata)
    assert route.startswith(("vllm.v1.attention.ops.flashmla", "vllm.third_party.flashmla.flash_mla_interface"))


def test_reference_ignores_holes() -> None:
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(40, 576, generator=g)
    q = torch.randn(2, 3, 576, generator=g)
    slots = torch.tensor([[1, 2, -1, 3], [-1, 5, 5, -1]], dtype=torch.int32)
    out = pf.reference(q, kv, slots, 0.05)
    p = torch.softmax(q[1].double() @ kv[[5, 5]].double().T * 0.05, dim=-1)
    assert torch.allclose(out[1], p @ kv[[5, 5], :512].double())


def test_harness_is_found_from_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pf.ENV_DIR, raising=False)
    monkeypatch.setattr(pf, "CARRY_DIR", tmp_path / "none")
    monkeypatch.setattr(pf, "vllm_available", lambda: (False, "no vLLM here"))
    ok, why = pf.available()
    assert not ok and "prepare.sh" in why
    bench_dir = tmp_path / "flashmla_bench"
    (bench_dir / "objs").mkdir(parents=True)
    (bench_dir / "build_ext.py").write_text("")
    ok, why = pf.available(bench_dir)
    assert not ok and "FlashMLA's sources" in why
    (tmp_path / "flashmla" / "csrc").mkdir(parents=True)
    assert pf.available(bench_dir) == (True, str(bench_dir.resolve()))
    monkeypatch.setenv(pf.ENV_DIR, str(bench_dir))
    assert pf.harness_dir() == bench_dir.resolve()


def test_build_child_reports_a_missing_harness(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert pf.main(["--build", str(tmp_path)]) == 3
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec == {"kind": "flashmla", "available": False, "why": rec["why"]} and "prepare.sh" in rec["why"]


def test_suite_options() -> None:
    ap = bs.build_parser()
    args = ap.parse_args(["--out", "x"])
    assert args.peers == ("fa3", "flashmla") and args.sections == bs.SECTIONS and args.flashmla is None
    args = ap.parse_args(["--out", "x", "--peers", "flashmla", "--sections", "decode,accuracy", "--heads", "8,24,4",
                          "--flashmla", ".carry/flashmla_bench"])
    assert args.peers == ("flashmla",) and args.sections == ("decode", "accuracy") and args.heads == (8, 24, 4)
    for bad in (["--peers", "flashinfer"], ["--sections", "decode,plots"], ["--heads", "129"]):
        with pytest.raises(SystemExit):
            ap.parse_args(["--out", "x", *bad])
    assert {8, 24, 4} <= set(bs.FULL_HEADS) and bs.ROW_BYTES["fp8_ds_mla"] == 656


def test_tables_show_the_targets_ratios(tmp_path: Path) -> None:
    """At 8 heads the md table has our FP8's fraction of the copy bandwidth (bytes = rows + query + output) and
    FlashMLA padded over our FP8 (the >= 2x target), FlashMLA counted among the peers, and a plot for 24 / 8 / 4."""
    ceil = {"copy_GBps": 3000.0, "bf16_TFLOPs": 780.0, "fp8_TFLOPs": 1400.0}
    recs = []
    for kernel, fmt, qb, compute, speed in (("triton/fp8", "fp8", 1, "fp8qk", 1.0), ("fa3/bf16", "bf16", 2, "bf16", 1.5),
                                            (plot.FLASHMLA, "fp8_ds_mla", 2, "bf16", 2.5)):
        for heads in (24, 8, 4):
            for rows in (1, 320):
                us = speed * 130.0 * rows / 320 + 8.0
                recs.append({"section": "decode", "kernel": kernel, "fmt": fmt, "rows": rows, "heads": heads,
                             **bs.metrics(rows, heads, us, fmt, qb, compute, ceil)})
    src = tmp_path / "bench_suite.json"
    src.write_text(json.dumps({"info": {"gpu": "NVIDIA H100", "flashmla": "FlashMLA (query padded)", "ceilings": ceil},
                               "results": recs, "accuracy": [], "failures": []}))
    assert plot.main([str(src), "--out-dir", str(tmp_path), "--rows", "1,320"]) == 0
    md = (tmp_path / "bench_suite.md").read_text()
    assert (tmp_path / "bench_H24_H8_H4.png").read_bytes()[:4] == b"\x89PNG"
    assert "FlashMLA: FlashMLA (query padded)" in md
    rec = next(r for r in recs if r["kernel"] == "triton/fp8" and r["heads"] == 8 and r["rows"] == 320)
    frac = rec["floor_bw_us"] / rec["us"]
    assert math.isclose(frac, (320 * 2048 * 576 + 320 * 8 * 576 + 320 * 8 * 1024) / 3000e9 * 1e6 / rec["us"],
                        rel_tol=1e-3)
    one = next(r for r in recs if r["kernel"] == "triton/fp8" and r["heads"] == 8 and r["rows"] == 1)
    assert f"| fp8 of copy bandwidth (rows + query + output) | {one['floor_bw_us'] / one['us']:.2f} | {frac:.2f} |" in md
    fmla = next(r for r in recs if r["kernel"] == plot.FLASHMLA and r["heads"] == 8 and r["rows"] == 320)
    assert f"| FlashMLA padded / fp8 (time) | " in md and f"{fmla['us'] / rec['us']:.2f} |" in md
    assert "| fp8 / best peer (time) | " in md  # fa3 is the faster peer here
