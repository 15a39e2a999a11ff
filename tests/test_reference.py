"""reference_decode against an independent float64 loop (per row, per head, over the valid slots).

Both formats; -1 holes inside the prefix, ids past counts ignored, count-0 rows, LSE base, scale semantics, errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from vllm_kimi_dsa.formats import (
    HEAD_DIM,
    LATENT_DIM,
    flat_kv_row_view,
    make_paged_cache,
    quantize_rows,
    scale_byte,
)
from vllm_kimi_dsa.reference import reference_decode, source_reference_decode

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e4m3_value(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 7
    if exp == 15 and man == 7:
        return math.nan
    return sign * (man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))


def _decode_row(row: torch.Tensor, fmt: str) -> torch.Tensor:
    """One cache row -> (576,) float64, without k_scale; nvfp4 decoded byte by byte from SPEC 3."""
    if fmt == "fp8":
        return row.double()
    b = row.tolist()
    vals = []
    for i in range(LATENT_DIM):
        nib = (b[i // 2] >> (4 * (i % 2))) & 0xF  # even index in the low nibble
        scale = _e4m3_value(b[320 + 8 * ((i // 16) & 3) + ((i // 16) >> 2)])
        vals.append((-1.0 if nib & 8 else 1.0) * GRID[nib & 7] * scale)
    vals += [_e4m3_value(x) for x in b[256:320]]
    return torch.tensor(vals, dtype=torch.float64)


def loop_reference(query, kv_rows, slots, counts, fmt, softmax_scale, output_scale):
    """float64, one (row, head) at a time: out = output_scale * sum_j p_j v_j, lse = ln sum_j exp(logit_j)."""
    rows, heads, _ = query.shape
    out = torch.zeros(rows, heads, LATENT_DIM, dtype=torch.float64)
    lse = torch.full((rows, heads), -math.inf, dtype=torch.float64)
    for i in range(rows):
        ids = [int(s) for s in slots[i, : int(counts[i])].tolist() if s >= 0]
        if not ids:
            continue
        keys = torch.stack([_decode_row(kv_rows[j], fmt) for j in ids])
        for h in range(heads):
            q = query[i, h].double()
            logits = [softmax_scale * float(q @ k) for k in keys]
            m = max(logits)
            total = m + math.log(sum(math.exp(v - m) for v in logits))
            lse[i, h] = total
            acc = torch.zeros(LATENT_DIM, dtype=torch.float64)
            for v, k in zip(logits, keys):
                acc += math.exp(v - total) * k[:LATENT_DIM]
            out[i, h] = output_scale * acc
    return out, lse


@dataclass(frozen=True)
class Case:
    fmt: str
    rows: int
    heads: int
    width: int
    block_size: int = 5
    stride: int | None = None
    q_dtype: torch.dtype = torch.float32
    seed: int = 0


CASES = [
    Case("fp8", rows=4, heads=3, width=16),
    Case("fp8", rows=3, heads=2, width=24, block_size=4, stride=7, q_dtype=torch.float8_e4m3fn, seed=1),
    Case("fp8", rows=2, heads=5, width=8, q_dtype=torch.bfloat16, seed=2),
    Case("nvfp4_ds_mla", rows=4, heads=3, width=16, seed=3),
    Case("nvfp4_ds_mla", rows=3, heads=2, width=20, block_size=3, stride=8, q_dtype=torch.float8_e4m3fn, seed=4),
]
NUM_BLOCKS = 6
GARBAGE_BLOCK = NUM_BLOCKS - 1  # never written: raw random bytes, read only by a wrong reference


def _build(case: Case):
    g = torch.Generator().manual_seed(case.seed)
    B = case.block_size
    cache = make_paged_cache(NUM_BLOCKS, B, case.fmt, block_stride=case.stride, generator=g)
    kv_rows, S = flat_kv_row_view(cache, B)
    data = quantize_rows(torch.randn(kv_rows.shape[0], HEAD_DIM, generator=g) * 0.7, case.fmt, 1.0)
    written = [b * S + o for b in range(GARBAGE_BLOCK) for o in range(B)]
    garbage = [GARBAGE_BLOCK * S + o for o in range(B)]
    kv_rows[written] = data[written]
    slots = torch.tensor(written)[torch.randint(len(written), (case.rows, case.width), generator=g)]
    counts = torch.randint(1, case.width + 1, (case.rows,), generator=g)
    counts[-1] = case.width  # a full row (unless rows == 2: then row 1 is the count-0 one)
    counts[1] = 0  # a count-0 row, its slots full of real rows
    if case.rows > 2:
        counts[2] = 3
        slots[2, :3] = -1  # count > 0 but only holes
    # -1 holes inside the prefix, and real or garbage ids past counts (all must be skipped)
    slots[0, 1] = -1
    slots[case.rows - 1 if case.rows > 2 else 0, case.width // 2] = -1
    slots[-1, 0] = -1
    c0 = int(counts[0])
    slots[0, c0:] = torch.tensor(garbage)[torch.arange(case.width - c0) % B]
    if case.width > c0 + 1:
        slots[0, c0 + 1] = 10**6  # past the cache, but past counts too: ignored, no error
    query = (torch.randn(case.rows, case.heads, HEAD_DIM, generator=g) * 2).to(case.q_dtype)
    return query, kv_rows, slots.to(torch.int32), counts.to(torch.int32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.fmt}-r{c.rows}-h{c.heads}-k{c.width}-{c.q_dtype}".replace("torch.", ""))
def test_matches_loop(case):
    query, kv_rows, slots, counts = _build(case)
    softmax_scale, output_scale = 0.7 / math.sqrt(HEAD_DIM), 1.3
    out, lse = reference_decode(
        query, kv_rows, slots, counts, fmt=case.fmt, softmax_scale=softmax_scale, output_scale=output_scale
    )
    assert out.dtype == torch.float32 and out.shape == (case.rows, case.heads, LATENT_DIM)
    assert lse.dtype == torch.float32 and lse.shape == (case.rows, case.heads)
    want_out, want_lse = loop_reference(query, kv_rows, slots, counts, case.fmt, softmax_scale, output_scale)
    # float32 dot products over 576 terms of O(1) values vs float64: a few 1e-6 relative; 1e-4 leaves room
    torch.testing.assert_close(out.double(), want_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-4)
    # count 0 -> out 0, lse -inf (also a row with count 3 of only -1s)
    empty = [1] + ([2] if case.rows > 2 else [])
    for i in empty:
        assert torch.equal(out[i], torch.zeros_like(out[i]))
        assert torch.all(lse[i] == -math.inf)
    assert torch.isfinite(lse[0]).all() and torch.isfinite(out).all()


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"{c.fmt}-r{c.rows}-h{c.heads}")
def test_source_reference_is_the_loop_on_float_rows(case):
    """source_reference_decode on the float rows a cache decodes to is reference_decode on the cache; on the rows the
    cache was quantized from it differs by the format's quantization error (nonzero), not by a layout fault."""
    from vllm_kimi_dsa.formats import dequantize_rows

    query, kv_rows, slots, counts = _build(case)
    ss, os_ = 0.7 / math.sqrt(HEAD_DIM), 1.3
    want = reference_decode(query, kv_rows, slots, counts, fmt=case.fmt, softmax_scale=ss, output_scale=os_)
    got = source_reference_decode(query, dequantize_rows(kv_rows, case.fmt), slots, counts, softmax_scale=ss,
                                  output_scale=os_)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    g = torch.Generator().manual_seed(case.seed + 100)  # seeded; unseeded, 3000 draws a case gave rel <= 0.019
    noisy = dequantize_rows(kv_rows, case.fmt) * (1 + 0.01 * torch.randn(kv_rows.shape[0], HEAD_DIM, generator=g))
    off = source_reference_decode(query, noisy, slots, counts, softmax_scale=ss, output_scale=os_)[0]
    assert 0 < float((off - want[0]).norm() / want[0].norm()) < 0.05
    with pytest.raises(ValueError, match="source_rows"):
        source_reference_decode(query, kv_rows, slots, counts, softmax_scale=ss, output_scale=os_)


def test_ids_past_counts_and_holes_matter():
    """Rewriting ignored slots changes nothing; moving counts over a real id changes the answer."""
    case = CASES[0]
    query, kv_rows, slots, counts = _build(case)
    kw = dict(fmt=case.fmt, softmax_scale=0.05, output_scale=1.0)
    out, lse = reference_decode(query, kv_rows, slots, counts, **kw)
    other = slots.clone()
    c0 = int(counts[0])
    other[0, c0:] = slots[3, 0]  # a real, written row, but past counts
    other[1, :] = slots[3, 0]  # count-0 row
    out2, lse2 = reference_decode(query, kv_rows, other, counts, **kw)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    filled = slots.clone()
    filled[0, 1] = slots[3, 1]  # fill the -1 hole inside the prefix: row 0 must change
    out3, _ = reference_decode(query, kv_rows, filled, counts, **kw)
    assert not torch.allclose(out3[0], out[0])
    assert torch.equal(out3[1:], out[1:])


def test_lse_is_natural_log_and_uniform_softmax():
    """n identical keys with q.k = L: lse = scale*L + ln n, out = output_scale * v."""
    cache = make_paged_cache(1, 8, "fp8", generator=torch.Generator().manual_seed(5))
    kv_rows, _ = flat_kv_row_view(cache, 8)
    key = torch.zeros(HEAD_DIM)
    key[:LATENT_DIM] = torch.linspace(-2, 2, LATENT_DIM)
    key[LATENT_DIM] = 1.0
    kv_rows[:] = quantize_rows(key.expand(8, HEAD_DIM), "fp8", 1.0)
    v = kv_rows[0].float()[:LATENT_DIM]
    query = torch.zeros(1, 2, HEAD_DIM)
    query[0, 0, LATENT_DIM] = 3.0  # q.k = 3
    query[0, 1, LATENT_DIM] = -1.0  # q.k = -1
    slots = torch.tensor([[0, 2, 4, 6, 1, -1, -1, -1]], dtype=torch.int32)
    out, lse = reference_decode(
        query, kv_rows, slots, torch.tensor([5], dtype=torch.int32), fmt="fp8", softmax_scale=0.5, output_scale=2.0
    )
    torch.testing.assert_close(lse[0], torch.tensor([1.5 + math.log(5), -0.5 + math.log(5)]), rtol=0, atol=1e-6)
    torch.testing.assert_close(out[0], (2.0 * v).expand(2, LATENT_DIM), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4_ds_mla"])
def test_scale_semantics(fmt):
    """softmax_scale multiplies the raw logits, output_scale the raw output; for fp8 the
    per-tensor k_scale folded into both (SPEC 2.1) equals attention over k_scale * raw rows."""
    case = Case(fmt, rows=3, heads=2, width=12, seed=9)
    query, kv_rows, slots, counts = _build(case)
    base_out, base_lse = reference_decode(query, kv_rows, slots, counts, fmt=fmt, softmax_scale=0.04, output_scale=1.0)
    out, lse = reference_decode(query, kv_rows, slots, counts, fmt=fmt, softmax_scale=0.04, output_scale=-2.5)
    torch.testing.assert_close(out, -2.5 * base_out, rtol=1e-6, atol=0)  # one float32 multiply
    assert torch.equal(lse, base_lse)  # output_scale never touches the LSE
    if fmt != "fp8":
        return
    scale, k_scale = 0.04, 0.3
    folded_out, folded_lse = reference_decode(
        query, kv_rows, slots, counts, fmt=fmt, softmax_scale=scale * k_scale, output_scale=k_scale
    )
    # the loop over k_scale-dequantized rows with the plain scale, in float64
    scaled_rows = (kv_rows.double() * k_scale)
    rows, heads = query.shape[:2]
    for i in range(rows):
        ids = [int(s) for s in slots[i, : int(counts[i])].tolist() if s >= 0]
        if not ids:
            continue
        keys = scaled_rows[ids]
        logits = scale * (query[i].double() @ keys.T)  # (heads, n)
        torch.testing.assert_close(folded_lse[i].double(), torch.logsumexp(logits, -1), rtol=1e-5, atol=1e-5)
        want = torch.softmax(logits, -1) @ keys[:, :LATENT_DIM]
        torch.testing.assert_close(folded_out[i].double(), want, rtol=1e-4, atol=1e-5)


def test_bad_input():
    case = CASES[0]
    query, kv_rows, slots, counts = _build(case)
    kw = dict(fmt="fp8", softmax_scale=0.1, output_scale=1.0)
    with pytest.raises(ValueError, match="query"):
        reference_decode(query[0], kv_rows, slots, counts, **kw)
    with pytest.raises(ValueError, match="query"):
        reference_decode(query[..., :LATENT_DIM], kv_rows, slots, counts, **kw)
    with pytest.raises(ValueError, match="kv_rows"):
        reference_decode(query, kv_rows, slots, counts, fmt="nvfp4_ds_mla", softmax_scale=0.1, output_scale=1.0)
    with pytest.raises(ValueError, match="kv_rows"):
        reference_decode(query, kv_rows[None], slots, counts, **kw)
    with pytest.raises(ValueError, match="slots"):
        reference_decode(query, kv_rows, slots[:-1], counts, **kw)
    with pytest.raises(ValueError, match="counts"):
        reference_decode(query, kv_rows, slots, counts[:-1], **kw)
    bad = slots.clone()
    bad[0, 0] = kv_rows.shape[0]  # one past the last row, inside the prefix
    with pytest.raises(ValueError, match="slots"):
        reference_decode(query, kv_rows, bad, counts, **kw)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        reference_decode(query, kv_rows, slots, counts, fmt="bf16", softmax_scale=0.1, output_scale=1.0)


def test_nvfp4_loop_decoder_is_sane():
    """The test's own byte decoder agrees with the packer's values on a known row (it checks the checker)."""
    x = torch.zeros(HEAD_DIM)
    x[0], x[17], x[LATENT_DIM] = 6.0, -3.0, 0.5
    row = quantize_rows(x, "nvfp4_ds_mla")
    assert scale_byte(1) == 328
    dec = _decode_row(row, "nvfp4_ds_mla")
    assert dec[0] == 6.0 and dec[17] == -3.0 and dec[LATENT_DIM] == 0.5
    assert dec.abs().sum() == 9.5
