"""formats: hand-computed bytes of FP8 and nvfp4_ds_mla rows, round-trip bounds, paged caches, write_tokens.

An independent scalar (pure Python) encoder checks pack_nvfp4 byte for byte on random rows.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_kimi_dsa.formats import (
    FP8_ROW_BYTES,
    HEAD_DIM,
    LATENT_DIM,
    NVFP4_ROPE_OFFSET,
    NVFP4_ROW_BYTES,
    NVFP4_SCALE_OFFSET,
    cache_dtype,
    dequantize_fp8,
    dequantize_rows,
    flat_kv_row_view,
    make_paged_cache,
    normalize_format,
    nvfp4_as_fp8,
    nvfp4_e4m3_values,
    nvfp4_row_shifts,
    pack_nvfp4,
    quantize_fp8,
    quantize_rows,
    row_bytes,
    scale_byte,
    unpack_nvfp4,
    write_tokens,
)

FMTS = ("fp8", "nvfp4_ds_mla")
GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitudes by code


def _bytes(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


# ---------------------------------------------------------------- an independent scalar encoder


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _e4m3(a: float) -> float:
    """Round a >= 0 to the nearest e4m3fn value, ties to even, saturating at 448."""
    if a >= 448.0:
        return 448.0
    if a < 2.0**-6:  # subnormals: multiples of 2**-9
        return round(a / 2.0**-9) * 2.0**-9  # Python's round() ties to even
    ulp = 2.0 ** (math.floor(math.log2(a)) - 3)
    return min(round(a / ulp) * ulp, 448.0)


def _e4m3_byte(v: float) -> int:
    """e4m3fn byte of an exactly representable value."""
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if a < 2.0**-6:
        return sign | int(a / 2.0**-9)
    e = math.floor(math.log2(a))
    return sign | ((e + 7) << 3) | int(a / 2.0**e * 8 - 8)


def _e2m1_code(q: float) -> int:
    mag = min(abs(q), 6.0)
    best = min(range(8), key=lambda c: (abs(GRID[c] - mag), c % 2))  # nearest, ties to the even code
    return best | (8 if q < 0 and best else 0)


def _pack_row_scalar(x: list[float]) -> list[int]:
    """SPEC 3, element by element."""
    out = [0] * NVFP4_ROW_BYTES
    for s in range(32):
        block = x[16 * s : 16 * s + 16]
        scale = _e4m3(max(_f32(_f32(max(abs(v) for v in block)) / 6.0), 2.0**-9))
        out[320 + 8 * (s & 3) + (s >> 2)] = _e4m3_byte(scale)
        codes = [_e2m1_code(_f32(v) / scale) for v in block]
        for i in range(8):
            out[8 * s + i] = codes[2 * i] | (codes[2 * i + 1] << 4)
    for j in range(64):
        v = _f32(x[LATENT_DIM + j])
        out[256 + j] = _e4m3_byte(math.copysign(_e4m3(abs(v)), v))
    return out


# ---------------------------------------------------------------- small helpers


def test_format_names_and_sizes():
    assert normalize_format("fp8") == normalize_format("fp8_e4m3") == "fp8"
    assert normalize_format("nvfp4_ds_mla") == "nvfp4_ds_mla"
    assert (row_bytes("fp8"), row_bytes("nvfp4_ds_mla")) == (FP8_ROW_BYTES, NVFP4_ROW_BYTES) == (576, 352)
    assert cache_dtype("fp8") == torch.float8_e4m3fn and cache_dtype("fp8_e4m3") == torch.float8_e4m3fn
    assert cache_dtype("nvfp4_ds_mla") == torch.uint8
    for bad in ("auto", "bf16", "fp8_ds_mla", "FP8"):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            normalize_format(bad)
        with pytest.raises(ValueError, match=repr(bad)):
            row_bytes(bad)


def test_scale_byte_layout():
    # SPEC 3: block s at 320 + 8 * (s & 3) + (s >> 2)
    assert [scale_byte(s) for s in (0, 1, 2, 3, 4, 5, 30, 31)] == [320, 328, 336, 344, 321, 329, 343, 351]
    assert sorted(scale_byte(s) for s in range(32)) == list(range(320, 352))  # a permutation of the scale bytes


# ---------------------------------------------------------------- FP8 per-tensor


def test_fp8_hand_bytes():
    x = torch.full((HEAD_DIM,), 0.25)  # 0.25 / 0.5 = 0.5 -> 0x30
    head = [0.5, -1.0, 224.0, 1000.0, -1000.0, 0.53125, 0.59375, 2.0**-10, 0.0, 0.15]
    x[: len(head)] = torch.tensor(head)
    got = _bytes(quantize_fp8(x, k_scale=0.5))
    # x / 0.5: 1 -> 0x38; -2 -> 0xC0; 448 -> 0x7E; 2000 saturates to 448; 1.0625 ties to 1.0 (even);
    # 1.1875 ties to 1.25 (even) = 0x3A; 2**-9 is the smallest subnormal 0x01; 0.3 -> 0.3125 = 0x2A
    assert got[: len(head)] == [0x38, 0xC0, 0x7E, 0x7E, 0xFE, 0x38, 0x3A, 0x01, 0x00, 0x2A]
    assert set(got[len(head) :]) == {0x30}
    assert quantize_rows(x, "fp8_e4m3", 0.5).dtype == torch.float8_e4m3fn
    back = dequantize_fp8(quantize_fp8(x, 0.5), 0.5)
    assert back[:4].tolist() == [0.5, -1.0, 224.0, 224.0]  # dequantize multiplies k_scale back in
    assert dequantize_rows(quantize_fp8(x, 0.5), "fp8")[:3].tolist() == [1.0, -2.0, 448.0]  # k_scale default 1


@settings(max_examples=40, deadline=None, derandomize=True)  # reproducible in CI
@given(seed=st.integers(0, 2**31 - 1), log_k=st.floats(-8, 4), log_mag=st.floats(-6, 8))
def test_fp8_round_trip_bound(seed, log_k, log_mag):
    g = torch.Generator().manual_seed(seed)
    k = 2.0**log_k
    x = torch.randn(3, HEAD_DIM, generator=g) * 2.0**log_mag
    back = dequantize_fp8(quantize_fp8(x, k), k)
    a = (x / k).abs()
    normal = (a >= 2.0**-6) & (a <= 448.0)
    err = (back - x).abs()
    # e4m3 keeps 3 mantissa bits: half an ulp is <= 2**-4 of a normal value
    assert torch.all(err[normal] <= 2.0**-4 * x.abs()[normal] * (1 + 1e-6))
    # subnormals are multiples of 2**-9 (times k): at most half a step off
    sub = a < 2.0**-6
    assert torch.all(err[sub] <= 2.0**-10 * k * (1 + 1e-6))
    # past 448 the value saturates
    big = a > 448.0
    assert torch.all(back[big].abs() == torch.tensor(448.0) * k)  # both float32 products


def test_fp8_errors():
    with pytest.raises(TypeError, match="x"):
        quantize_fp8(torch.ones(HEAD_DIM, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="x"):
        quantize_fp8(torch.ones(3, 512), 1.0)
    for k in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="k_scale"):
            quantize_fp8(torch.ones(HEAD_DIM), k)
    with pytest.raises(TypeError, match="rows"):
        dequantize_fp8(torch.ones(HEAD_DIM))
    with pytest.raises(ValueError, match="rows"):
        dequantize_fp8(torch.ones(3, 352).to(torch.float8_e4m3fn))


# ---------------------------------------------------------------- nvfp4_ds_mla


def _hand_row() -> tuple[torch.Tensor, list[int]]:
    """One row whose 352 bytes are worked out by hand below."""
    x = torch.zeros(HEAD_DIM)
    want = [0] * NVFP4_ROW_BYTES
    # block 0: amax 6 -> scale 1.0 (0x38); E2M1 codes straight from the values, ties to even:
    # 0.25->0, 0.75->2 (1.0), 1.25->2, 1.75->4 (2.0), 2.5->4, 3.5->6 (4.0), 5->6; -0.1 rounds to +0
    x[0:16] = torch.tensor([6, -6, 3, 1.5, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -5, -0.1, -2, 0.5, -0.5])
    want[0:8] = [0xF7, 0x35, 0x20, 0x42, 0x64, 0xE6, 0xC0, 0x91]  # even index in the low nibble
    want[320] = 0x38
    # block 1: all zero -> the 2**-9 floor (0x01), codes 0
    want[328] = 0x01
    # block 2: tiny, amax/6 = 5e-4 < 2**-9 -> scale 2**-9; 3e-3 * 512 = 1.536 -> 1.5 (code 3, sign 0xB)
    x[32:48] = torch.tensor([3e-3, -3e-3] * 8)
    want[16:24] = [0xB3] * 8
    want[336] = 0x01
    # block 3: amax 12 -> scale 2.0 (0x40); 12/2 = 6 -> 7, 1/2 = 0.5 -> 1
    x[48:64] = torch.tensor([12.0, 1.0] * 8)
    want[24:32] = [0x17] * 8
    want[344] = 0x40
    # blocks 4..31: scale c_s = the e4m3 value of byte 0x20 + s (all distinct); values 6c, -3c, 0...
    for s in range(4, 32):
        c = torch.tensor([0x20 + s], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()
        x[16 * s] = 6 * c
        x[16 * s + 1] = -3 * c
        want[8 * s] = 0xD7  # 6c -> code 7 (low), -3c -> 0x8 | 5 (high)
        want[320 + 8 * (s & 3) + (s >> 2)] = 0x20 + s
    # RoPE: unscaled e4m3, however the latent blocks are scaled
    x[512:576] = 1.0
    want[256:320] = [0x38] * 64
    x[512:519] = torch.tensor([1.0, -2.0, 448.0, 0.3, 1000.0, -1000.0, 2.0**-9])
    want[256:263] = [0x38, 0xC0, 0x7E, 0x2A, 0x7E, 0xFE, 0x01]
    return x, want


def test_nvfp4_hand_bytes():
    x, want = _hand_row()
    got = pack_nvfp4(x)
    assert got.dtype == torch.uint8 and got.shape == (NVFP4_ROW_BYTES,)
    assert got.tolist() == want
    assert _pack_row_scalar(x.tolist()) == want  # the scalar encoder agrees with the hand bytes
    # and back: block 0 decodes to its E2M1 values (scale 1), the tiny block to 1.5 * 2**-9
    back = unpack_nvfp4(got)
    assert back[0:16].tolist() == [6, -6, 3, 1.5, 0, 1, 1, 2, 2, 4, 4, -4, 0, -2, 0.5, -0.5]
    assert back[16:32].tolist() == [0.0] * 16
    assert back[32:34].tolist() == [1.5 * 2.0**-9, -1.5 * 2.0**-9]
    assert back[512:519].tolist() == [1.0, -2.0, 448.0, 0.3125, 448.0, -448.0, 2.0**-9]


def test_nvfp4_nibble_order_single_values():
    # one nonzero latent value at an even and at an odd index: low vs high nibble of the same byte
    for index, byte in ((10, 0x07), (11, 0x70)):
        x = torch.zeros(HEAD_DIM)
        x[index] = 6.0
        row = pack_nvfp4(x)
        assert row[5].item() == byte
        assert row[:256].count_nonzero().item() == 1
        assert unpack_nvfp4(row)[index].item() == 6.0


def test_nvfp4_matches_scalar_encoder_on_random_rows():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, HEAD_DIM, generator=g)
    x[1] *= 1e-3  # many blocks near or under the 2**-9 floor
    x[2, :LATENT_DIM] *= torch.logspace(-4, 3, LATENT_DIM)  # blocks of very different scales
    # exact E2M1 midpoints times a block's scale: ties must go to the even code
    x[0, 16:32] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2) * torch.tensor([1.0, -1.0]).repeat_interleave(8)
    rows = pack_nvfp4(x)
    for i in range(3):
        assert rows[i].tolist() == _pack_row_scalar(x[i].tolist()), f"row {i}"


def _block_scales(rows: torch.Tensor) -> torch.Tensor:
    """(n, 352) -> (n, 32) decoded e4m3 block scales, block order."""
    idx = torch.tensor([scale_byte(s) for s in range(32)])
    return rows[:, idx].contiguous().view(torch.float8_e4m3fn).float()


@settings(max_examples=40, deadline=None, derandomize=True)  # reproducible in CI
@given(seed=st.integers(0, 2**31 - 1), log_mag=st.floats(-12, 8), spread=st.floats(0, 6))
def test_nvfp4_round_trip_bound(seed, log_mag, spread):
    """|x - x'| <= max(s/4, |x|/4) where |x| <= 6s; saturation (x' = 6s) only when e4m3 rounded s down.

    E2M1 steps are 0.5 on [0,2], 1 on [2,4], 2 on [4,6]: half a step is <= max(1/4, |q|/4) for q = x/s.
    s = e4m3(amax/6) is within 2**-4 relative of amax/6 when normal, so amax <= 6.4 s and the
    saturation error is <= 0.4 s (< |x|/4); with a subnormal scale (steps of 2**-9) it is <= 6 * 2**-10.
    A block with amax > 6 * 448 saturates its scale at 448 and its values at +-2688.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, HEAD_DIM, generator=g) * 2.0**log_mag
    x[:, :LATENT_DIM] *= 2.0 ** (spread * torch.rand(4, 32, 1, generator=g)).expand(4, 32, 16).reshape(4, LATENT_DIM)
    rows = pack_nvfp4(x)
    assert rows.dtype == torch.uint8 and rows.shape == (4, NVFP4_ROW_BYTES)
    back = unpack_nvfp4(rows)
    s = _block_scales(rows)
    blocks = x[:, :LATENT_DIM].reshape(4, 32, 16)
    amax = blocks.abs().amax(-1)
    # the scale: e4m3 of max(amax/6, 2**-9), never below the floor
    want_s = torch.tensor([[_e4m3(max(_f32(a / 6.0), 2.0**-9)) for a in r] for r in amax.tolist()])
    assert torch.equal(s, want_s)
    assert torch.all(s >= 2.0**-9)
    s16 = s.unsqueeze(-1).expand(4, 32, 16)
    err = (back[:, :LATENT_DIM].reshape(4, 32, 16) - blocks).abs()
    inside = blocks.abs() <= 6 * s16
    tol = torch.maximum(s16 / 4, blocks.abs() / 4) * (1 + 1e-6)
    assert torch.all(err[inside] <= tol[inside])
    sat = ~inside
    assert torch.all(back[:, :LATENT_DIM].reshape(4, 32, 16)[sat].abs() == 6 * s16[sat])
    # a normal scale below e4m3's top (amax/6 <= 448; past it the scale itself saturates at 448)
    normal = (s16 >= 2.0**-6) & (amax / 6 <= 448).unsqueeze(-1)
    assert torch.all(blocks.abs()[sat & normal] <= 6.4 * s16[sat & normal] * (1 + 1e-6))
    assert torch.all(err[normal] <= tol[normal])
    subnormal = s16 < 2.0**-6
    assert torch.all(err[sat & subnormal] <= 6 * 2.0**-10 * (1 + 1e-6))
    # RoPE: e4m3 without any scale, same bound as fp8 with k_scale 1
    rope, rope_err = x[:, LATENT_DIM:].abs(), (back[:, LATENT_DIM:] - x[:, LATENT_DIM:]).abs()
    normal_rope = (rope >= 2.0**-6) & (rope <= 448)
    assert torch.all(rope_err[normal_rope] <= 2.0**-4 * rope[normal_rope] * (1 + 1e-6))
    assert torch.all(rope_err[rope < 2.0**-6] <= 2.0**-10 * (1 + 1e-6))
    assert torch.all(back[:, LATENT_DIM:][rope > 448].abs() == 448)


def _e4m3_finite_values() -> torch.Tensor:
    """Every finite e4m3 value (bytes 0x00..0x7e and their negatives), from the bit fields, not torch's cast."""
    vals = []
    for b in range(0x7F):
        e, m = b >> 3, b & 7
        vals.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    v = torch.tensor(vals, dtype=torch.float64)
    return torch.cat([v, -v])


@pytest.mark.parametrize("seed", [0, 1])
def test_nvfp4_as_fp8_rounds_each_value_once_to_nearest_e4m3(seed):
    """nvfp4_as_fp8 (the K rows the e4m3 forms write): each latent value x 2**-s (its row's shift) the e4m3 nearest
    to it (ties to an even mantissa), found here by brute force over every finite e4m3; RoPE bytes as is; s the
    least power that keeps the row within 448, so nothing saturates; nvfp4_e4m3_values scales the latent back.
    Tiny and huge blocks included (scales at the 2**-9 floor and up to 448)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, HEAD_DIM, generator=g) * torch.logspace(-4, 3.4, 64).unsqueeze(1)
    x[3, :16] *= 10.0  # a block whose products pass 448
    rows = pack_nvfp4(x)
    exact = unpack_nvfp4(rows).double()
    shifts = nvfp4_row_shifts(rows)
    scale_max = rows[:, NVFP4_SCALE_OFFSET:].contiguous().view(torch.float8_e4m3fn).float().abs().amax(dim=-1)
    # the least s with scale_max x 2**-s <= 72 (6 x 72 = 432: the largest e4m3 table entry stays below 448)
    want = torch.clamp(torch.ceil(torch.log2(scale_max / 72.0)), min=0).long()
    assert torch.equal(shifts, want) and set(shifts.tolist()) == {0, 1, 2, 3}
    got = nvfp4_as_fp8(rows)
    assert got.dtype == torch.float8_e4m3fn and got.shape == (64, HEAD_DIM)
    grid = _e4m3_finite_values()
    lat = (exact[:, :LATENT_DIM] * torch.pow(2.0, -shifts.double()).unsqueeze(1)).reshape(-1)
    assert lat.abs().max() <= 432
    best = (lat.unsqueeze(1) - grid.unsqueeze(0)).abs().min(dim=1).values
    g_lat = got[:, :LATENT_DIM].double().reshape(-1)
    assert torch.equal((g_lat - lat).abs(), best)
    assert (lat.abs() < 2.0**-6).any()
    values = nvfp4_e4m3_values(rows)
    assert torch.equal(values[:, :LATENT_DIM].double(),
                       got[:, :LATENT_DIM].double() * torch.pow(2.0, shifts.double()).unsqueeze(1))
    # e4m3's rounding, never a clip: half an ulp (2**-4 relative) or, below 2**-6 x 2**s, half the subnormal step
    err = (values.double() - exact).abs()
    assert bool((err <= 2.0**-4 * exact.abs() + 2.0**-10 * 2.0 ** shifts.double().unsqueeze(1)).all())
    # ties go to the even mantissa: scale 1.125 (amax 6.75) x 6 = 6.75 -> 7, x 1.5 = 1.6875 -> 1.75, x 3 -> 3.5
    tie = torch.zeros(1, HEAD_DIM)
    tie[0, :3] = torch.tensor([6.75, 1.6875, -3.375])
    assert nvfp4_as_fp8(pack_nvfp4(tie))[0, :3].float().tolist() == [7.0, 1.75, -3.5]
    assert torch.equal(got[:, LATENT_DIM:].view(torch.uint8), rows[:, NVFP4_ROPE_OFFSET:NVFP4_SCALE_OFFSET])
    assert torch.equal(values[:, LATENT_DIM:], exact[:, LATENT_DIM:].float())


def _row_with_scales(scale_bytes: dict[int, int], full: int, seed: int) -> torch.Tensor:
    """One nvfp4_ds_mla row (1, 352) uint8 from its bytes: block `full` holds every e2m1 code (0..15: each magnitude,
    both signs), the other blocks random codes; block b's scale byte is scale_bytes[b] (default 0x38, 1.0); random
    RoPE bytes (finite e4m3)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (LATENT_DIM,), generator=g, dtype=torch.uint8)
    codes[16 * full:16 * full + 16] = torch.arange(16, dtype=torch.uint8)
    row = torch.zeros(NVFP4_ROW_BYTES, dtype=torch.uint8)
    row[:NVFP4_ROPE_OFFSET] = codes[0::2] | (codes[1::2] << 4)
    row[NVFP4_ROPE_OFFSET:NVFP4_SCALE_OFFSET] = torch.randint(0, 0x7F, (64,), generator=g, dtype=torch.uint8)
    for block in range(32):
        row[scale_byte(block)] = scale_bytes.get(block, 0x38)
    return row.unsqueeze(0)


# A row's shift (the least s with max |scale| x 2**-s <= 72, so 6 x scale x 2**-s <= 432 < 448), by its largest
# scale's magnitude byte: each threshold byte (0x6A 80, 0x72 160, 0x7A 320) takes the next shift, the byte below it
# (0x69 72, 0x71 144, 0x79 288) does not; 0x7E is e4m3's top, 448.
SHIFT_AT_BYTE = {0x69: 0, 0x6A: 1, 0x71: 1, 0x72: 2, 0x79: 2, 0x7A: 3, 0x7E: 3}
THRESHOLD_BYTES = (0x6A, 0x72, 0x7A)


@pytest.mark.parametrize("magnitude", sorted(SHIFT_AT_BYTE), ids=hex)
@pytest.mark.parametrize("sign", [0x00, 0x80], ids=["positive", "negative"])
def test_nvfp4_row_shift_at_each_threshold_byte(magnitude, sign):
    """Rows whose largest scale byte sits exactly at a row-shift threshold or one below it: the documented shift, for
    either sign of the scale. On a threshold the scale (1.25 x 2**e) times each e2m1 magnitude has at most 3
    significant bits, so every value of that block, 6 x scale = 480 / 960 / 1920 (past e4m3's 448) included, comes
    back unchanged through the e4m3 form (a shift one short would saturate it at 448 x 2**s); one below, the values
    round once (<= 2**-4 relative), never clip. At e4m3's top scale, 448 itself (e2m1 1.0) comes back unchanged."""
    scale = _e4m3_finite_values()[magnitude].item()
    want = SHIFT_AT_BYTE[magnitude]
    assert want == max(0, math.ceil(math.log2(scale / 72)))  # the table states the rule
    full = 5
    row = _row_with_scales({full: magnitude | sign, 17: 0x38 | (sign ^ 0x80)}, full, seed=magnitude + sign)
    assert nvfp4_row_shifts(row).tolist() == [want]
    block = unpack_nvfp4(row)[0, 16 * full:16 * full + 16].double()
    assert block.abs().max().item() == 6 * scale and (block < 0).sum() == 7 and (block > 0).sum() == 7
    fp8 = nvfp4_as_fp8(row)[0, 16 * full:16 * full + 16].double()
    got = nvfp4_e4m3_values(row)[0, 16 * full:16 * full + 16].double()
    assert fp8.abs().max().item() <= 448 and torch.equal(got, fp8 * 2.0**want)
    if magnitude in THRESHOLD_BYTES:
        assert torch.equal(got, block), (got - block).abs().max()
    else:
        assert bool(((got - block).abs() <= 2.0**-4 * block.abs()).all())
    if magnitude == 0x7E:
        top = block.abs() == 448
        assert int(top.sum()) == 2 and torch.equal(got[top], block[top])


def test_nvfp4_leading_dims_and_dispatch():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, HEAD_DIM, generator=g, dtype=torch.bfloat16)
    rows = quantize_rows(x, "nvfp4_ds_mla")
    assert rows.shape == (2, 3, NVFP4_ROW_BYTES)
    assert torch.equal(rows.reshape(6, -1), pack_nvfp4(x.reshape(6, HEAD_DIM)))
    assert torch.equal(dequantize_rows(rows, "nvfp4_ds_mla"), unpack_nvfp4(rows))
    assert dequantize_rows(rows, "nvfp4_ds_mla", k_scale=7.0).equal(unpack_nvfp4(rows))  # k_scale: fp8 only


def test_nvfp4_errors():
    with pytest.raises(TypeError, match="x"):
        pack_nvfp4(torch.ones(HEAD_DIM, dtype=torch.int64))
    with pytest.raises(ValueError, match="x"):
        pack_nvfp4(torch.ones(2, 575))
    with pytest.raises(TypeError, match="rows"):
        unpack_nvfp4(torch.ones(2, NVFP4_ROW_BYTES))
    with pytest.raises(ValueError, match="rows"):
        unpack_nvfp4(torch.ones(2, 576, dtype=torch.uint8))


# ---------------------------------------------------------------- paged caches


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("num_blocks, block_size, stride", [(5, 4, None), (3, 5, 9), (1, 3, 4), (4, 1, 2)])
def test_make_paged_cache_and_flat_view(fmt, num_blocks, block_size, stride):
    g = torch.Generator().manual_seed(num_blocks * 100 + block_size)
    cache = make_paged_cache(num_blocks, block_size, fmt, block_stride=stride, generator=g)
    nb = row_bytes(fmt)
    S = block_size if stride is None else stride
    assert cache.shape == (num_blocks, block_size, nb) and cache.dtype == cache_dtype(fmt)
    assert cache.stride() == (S * nb, nb, 1)
    raw = cache.view(torch.uint8)
    assert raw.float().mean() > 40  # random bytes, not zeros
    assert not dequantize_rows(cache, fmt).isnan().any()  # e4m3 parts drawn away from NaN codes
    rows, stride_rows = flat_kv_row_view(cache, block_size)
    assert stride_rows == S
    assert rows.shape == ((num_blocks - 1) * S + block_size, nb) and rows.dtype == cache.dtype
    assert rows.data_ptr() == cache.data_ptr()
    for b in range(num_blocks):
        for o in range(block_size):
            assert torch.equal(rows[b * S + o].view(torch.uint8), raw[b, o]), (b, o)
    # a write through the flat view lands in the block it addresses
    b, o = num_blocks - 1, block_size - 1
    rows.view(torch.uint8)[b * S + o] = 0x11
    assert set(raw[b, o].tolist()) == {0x11}


def test_make_paged_cache_seeded():
    a = make_paged_cache(2, 3, "nvfp4_ds_mla", generator=torch.Generator().manual_seed(1))
    b = make_paged_cache(2, 3, "nvfp4_ds_mla", generator=torch.Generator().manual_seed(1))
    c = make_paged_cache(2, 3, "nvfp4_ds_mla", generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_paged_cache_errors():
    with pytest.raises(ValueError, match="num_blocks"):
        make_paged_cache(0, 4, "fp8")
    with pytest.raises(ValueError, match="block_size"):
        make_paged_cache(2, 0, "fp8")
    with pytest.raises(ValueError, match="block_stride"):
        make_paged_cache(2, 4, "fp8", block_stride=3)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_paged_cache(2, 4, "bf16")  # type: ignore[arg-type]
    cache = make_paged_cache(2, 4, "fp8", block_stride=6)
    with pytest.raises(ValueError, match="block_size"):
        flat_kv_row_view(cache, 5)
    with pytest.raises(ValueError, match="cache"):
        flat_kv_row_view(cache[0], 4)
    with pytest.raises(ValueError, match="cache"):
        flat_kv_row_view(cache[:, :, :300], 4)  # rows not contiguous in the block stride


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("start, n", [(0, 11), (5, 7), (8, 1)])
def test_write_tokens(fmt, start, n):
    B, S, num_blocks = 4, 6, 7
    g = torch.Generator().manual_seed(start * 31 + n)
    cache = make_paged_cache(num_blocks, B, fmt, block_stride=S, generator=g)
    rows_view, _ = flat_kv_row_view(cache, B)
    before = rows_view.view(torch.uint8).clone()
    table = torch.tensor([5, 2, 6, 0], dtype=torch.int32)  # a request's blocks, out of order
    tokens = quantize_rows(torch.randn(n, HEAD_DIM, generator=g), fmt, 0.5)
    write_tokens(cache, table, tokens, start=start)
    after = rows_view.view(torch.uint8)
    touched = set()
    for i in range(n):
        t = start + i
        flat = int(table[t // B]) * S + t % B
        assert torch.equal(after[flat], tokens[i].view(torch.uint8)), t
        assert torch.equal(cache[int(table[t // B]), t % B].view(torch.uint8), tokens[i].view(torch.uint8))
        touched.add(flat)
    others = [r for r in range(after.shape[0]) if r not in touched]
    assert torch.equal(after[others], before[others])  # nothing else, padding rows included


def test_write_tokens_errors():
    cache = make_paged_cache(3, 4, "fp8")
    table = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="rows"):
        write_tokens(cache, table, torch.zeros(2, 576, dtype=torch.uint8))  # wrong dtype
    with pytest.raises(ValueError, match="rows"):
        write_tokens(cache, table, quantize_fp8(torch.ones(2, 576), 1.0)[:, :352].contiguous())
    nv = make_paged_cache(3, 4, "nvfp4_ds_mla")
    with pytest.raises(ValueError, match="rows"):
        write_tokens(nv, table, quantize_fp8(torch.ones(2, 576), 1.0))
