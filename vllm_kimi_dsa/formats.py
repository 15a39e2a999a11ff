"""KV-cache row formats of K3.1's DSA layers: FP8 per-tensor and nvfp4_ds_mla.

Pack (quantize) and unpack (dequantize) rows in plain torch, and build paged
caches `[num_blocks, block_size, row_bytes]` (block stride may exceed block_size).
"""

from __future__ import annotations

from typing import Literal

import torch

LATENT_DIM = 512
ROPE_DIM = 64
HEAD_DIM = LATENT_DIM + ROPE_DIM  # 576: the width of a query head and a key row

FP8_ROW_BYTES = HEAD_DIM  # 576 e4m3 values
NVFP4_BLOCK = 16  # latent values per e4m3 scale
NVFP4_SCALES = LATENT_DIM // NVFP4_BLOCK  # 32
NVFP4_LATENT_BYTES = LATENT_DIM // 2  # 256: two E2M1 values a byte
NVFP4_ROPE_OFFSET = NVFP4_LATENT_BYTES  # 256
NVFP4_SCALE_OFFSET = NVFP4_ROPE_OFFSET + ROPE_DIM  # 320
NVFP4_ROW_BYTES = NVFP4_SCALE_OFFSET + NVFP4_SCALES  # 352
NVFP4_SCALE_FLOOR = 2.0**-9  # smallest block scale (an e4m3 subnormal)
# vLLM's own Hopper format, which this package never reads (FLASHMLA_SPARSE's rows; the suite's peer and prefill
# floor count them): 512 e4m3 latent values, 4 fp32 tile scales, 64 bf16 RoPE values
FP8_DS_MLA_ROW_BYTES = LATENT_DIM + 4 * 4 + 2 * ROPE_DIM  # 656

CacheFormat = Literal["fp8", "nvfp4_ds_mla"]
FORMATS: tuple[CacheFormat, ...] = ("fp8", "nvfp4_ds_mla")

_KV_CACHE_DTYPES: dict[str, CacheFormat] = {
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "nvfp4_ds_mla": "nvfp4_ds_mla",
}

# E2M1 magnitudes by 3-bit code; bit 3 of a nibble is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def normalize_format(kv_cache_dtype: str) -> CacheFormat:
    """vLLM's kv_cache_dtype string -> "fp8" or "nvfp4_ds_mla"."""
    try:
        return _KV_CACHE_DTYPES[kv_cache_dtype]
    except KeyError:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not a DSA cache format this package reads; "
            f"expected one of {sorted(_KV_CACHE_DTYPES)}"
        ) from None


def row_bytes(fmt: CacheFormat) -> int:
    """Bytes of one cache row: 576 (fp8) or 352 (nvfp4_ds_mla)."""
    return {"fp8": FP8_ROW_BYTES, "nvfp4_ds_mla": NVFP4_ROW_BYTES}[normalize_format(fmt)]


def cache_dtype(fmt: CacheFormat) -> torch.dtype:
    """Element dtype of a cache of this format: float8_e4m3fn or uint8."""
    return torch.float8_e4m3fn if normalize_format(fmt) == "fp8" else torch.uint8


def scale_byte(block: int) -> int:
    """Byte offset in a row of the e4m3 scale of latent block `block` (0..31)."""
    return NVFP4_SCALE_OFFSET + 8 * (block & 3) + (block >> 2)


# scale_order[k] = the latent block whose scale sits at byte 320 + k.
_SCALE_ORDER = torch.tensor(
    sorted(range(NVFP4_SCALES), key=lambda s: scale_byte(s)), dtype=torch.long
)


def _check_rows_input(x: torch.Tensor, name: str) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
    if x.shape[-1:] != (HEAD_DIM,):
        raise ValueError(f"{name} must end in {HEAD_DIM} values, got shape {tuple(x.shape)}")


# ---------------------------------------------------------------- FP8 per-tensor


def quantize_fp8(x: torch.Tensor, k_scale: float) -> torch.Tensor:
    """x: (..., 576) float -> (..., 576) float8_e4m3fn holding x / k_scale."""
    _check_rows_input(x, "x")
    if not k_scale > 0:
        raise ValueError(f"k_scale must be > 0, got {k_scale}")
    return (x.float() / k_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def dequantize_fp8(rows: torch.Tensor, k_scale: float = 1.0) -> torch.Tensor:
    """rows: (..., 576) float8_e4m3fn -> (..., 576) float32 = e4m3 * k_scale."""
    if rows.dtype != torch.float8_e4m3fn:
        raise TypeError(f"rows must be float8_e4m3fn, got {rows.dtype}")
    if rows.shape[-1:] != (FP8_ROW_BYTES,):
        raise ValueError(f"rows must end in {FP8_ROW_BYTES}, got shape {tuple(rows.shape)}")
    return rows.float() * k_scale


# ---------------------------------------------------------------- nvfp4_ds_mla


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already divided by their scale) to E2M1 nibbles, ties to even."""
    mag = v.abs().clamp(max=6.0)
    # Midpoints between neighbouring E2M1 magnitudes; a tie goes to the even code.
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=v.device)
    code = torch.bucketize(mag, bounds, right=False)  # value == bound -> lower code
    on_bound = (code < 7) & (mag == bounds[code.clamp(max=6)])
    # bucketize(right=False) puts a tie in the lower bucket; move it up when that is odd.
    code = torch.where(on_bound & (code % 2 == 1), code + 1, code)
    sign = (v < 0) & (code > 0)
    return (code | (sign.to(code.dtype) << 3)).to(torch.uint8)


def pack_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """x: (..., 576) float -> (..., 352) uint8 nvfp4_ds_mla rows (SPEC section 3).

    Latent blocks of 16 get scale e4m3(max(amax / 6, 2**-9)) and E2M1 values
    x / scale (round to nearest even); RoPE is stored as unscaled e4m3.
    """
    _check_rows_input(x, "x")
    lead = x.shape[:-1]
    xf = x.float().reshape(-1, HEAD_DIM)
    latent = xf[:, :LATENT_DIM].reshape(-1, NVFP4_SCALES, NVFP4_BLOCK)
    amax = latent.abs().amax(dim=-1)
    # saturate at e4m3's largest (CUDA's cast makes NaN past it; the CPU's rounds to 448)
    scale = (amax / 6.0).clamp(min=NVFP4_SCALE_FLOOR, max=448.0).to(torch.float8_e4m3fn)
    codes = _e2m1_codes(latent / scale.float().unsqueeze(-1)).reshape(-1, LATENT_DIM)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # even index in the low nibble
    rope = xf[:, LATENT_DIM:].clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = scale.view(torch.uint8)[:, _SCALE_ORDER.to(x.device)]
    out = torch.cat([packed, rope, scales], dim=1)
    return out.reshape(*lead, NVFP4_ROW_BYTES)


def unpack_nvfp4(rows: torch.Tensor) -> torch.Tensor:
    """rows: (..., 352) uint8 nvfp4_ds_mla -> (..., 576) float32 (e2m1 * scale, RoPE as is)."""
    if rows.dtype != torch.uint8:
        raise TypeError(f"rows must be uint8, got {rows.dtype}")
    if rows.shape[-1:] != (NVFP4_ROW_BYTES,):
        raise ValueError(f"rows must end in {NVFP4_ROW_BYTES}, got shape {tuple(rows.shape)}")
    lead = rows.shape[:-1]
    r = rows.reshape(-1, NVFP4_ROW_BYTES)
    packed = r[:, :NVFP4_LATENT_BYTES]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(-1, LATENT_DIM).long()
    table = torch.tensor(E2M1_VALUES, device=rows.device)
    mag = table[codes & 7]
    vals = torch.where((codes & 8) != 0, -mag, mag)
    scale_bytes = torch.empty_like(r[:, NVFP4_SCALE_OFFSET:])
    scale_bytes[:, _SCALE_ORDER.to(rows.device)] = r[:, NVFP4_SCALE_OFFSET:]
    scales = scale_bytes.contiguous().view(torch.float8_e4m3fn).float()
    latent = (vals.reshape(-1, NVFP4_SCALES, NVFP4_BLOCK) * scales.unsqueeze(-1)).reshape(-1, LATENT_DIM)
    rope = r[:, NVFP4_ROPE_OFFSET:NVFP4_SCALE_OFFSET].contiguous().view(torch.float8_e4m3fn).float()
    return torch.cat([latent, rope], dim=1).reshape(*lead, HEAD_DIM)


# A row's shift s (0..3) for the e4m3 forms: each of these scale magnitude bytes (80, 160, 320) that the row's
# largest |scale| reaches adds one, so 6 x scale x 2**-s stays within e4m3's 448 (scale x 2**-s <= 72)
NVFP4_SHIFT_BYTES = (0x6A, 0x72, 0x7A)


def nvfp4_row_shifts(rows: torch.Tensor) -> torch.Tensor:
    """rows: (..., 352) uint8 nvfp4_ds_mla -> (...,) int64 s = 0..3: the power of two the Gluon kernels' e4m3 forms
    divide a row's latent by before rounding it to e4m3 (0 for every row of block scales <= 72, i.e. values <= 432)."""
    if rows.dtype != torch.uint8 or rows.shape[-1:] != (NVFP4_ROW_BYTES,):
        raise ValueError(f"rows must be (..., {NVFP4_ROW_BYTES}) uint8, got {tuple(rows.shape)} {rows.dtype}")
    mag = (rows[..., NVFP4_SCALE_OFFSET:] & 0x7F).amax(dim=-1)
    return sum((mag >= t).long() for t in NVFP4_SHIFT_BYTES)


def _nvfp4_e4m3(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """nvfp4_as_fp8 of the rows and their factors 2**s ((..., 1) float32)."""
    values = unpack_nvfp4(rows)
    factor = torch.pow(2.0, nvfp4_row_shifts(rows).float()).unsqueeze(-1)
    values[..., :LATENT_DIM] /= factor
    return quantize_fp8(values, 1.0), factor


def nvfp4_as_fp8(rows: torch.Tensor) -> torch.Tensor:
    """rows: (..., 352) uint8 nvfp4_ds_mla -> (..., 576) float8_e4m3fn: the K rows the Gluon kernels' e4m3 forms
    write: each latent value (e2m1 x its block's scale, exact) times 2**-s (nvfp4_row_shifts) rounded once to e4m3
    (nearest even), the RoPE as is. For rows with s = 0 (block scales <= 72) this is the cache's fp8 decode."""
    return _nvfp4_e4m3(rows)[0]


def nvfp4_e4m3_values(rows: torch.Tensor) -> torch.Tensor:
    """rows: (..., 352) uint8 nvfp4_ds_mla -> (..., 576) float32: the values the Gluon kernels' e4m3 forms compute
    with, nvfp4_as_fp8's latent times 2**s (their consumers scale each row's latent logit and P by it), the RoPE as
    is: each value within e4m3's relative rounding of the exact one (2**-4; below 2**-6 x 2**s, e4m3's subnormal
    step 2**-9 x 2**s), never saturated."""
    fp8, factor = _nvfp4_e4m3(rows)
    values = fp8.float()
    values[..., :LATENT_DIM] *= factor
    return values


# ---------------------------------------------------------------- either format


def quantize_rows(x: torch.Tensor, fmt: CacheFormat, k_scale: float = 1.0) -> torch.Tensor:
    """x: (..., 576) float -> cache rows of `fmt` (k_scale is used by fp8 only)."""
    return quantize_fp8(x, k_scale) if normalize_format(fmt) == "fp8" else pack_nvfp4(x)


def dequantize_rows(rows: torch.Tensor, fmt: CacheFormat, k_scale: float = 1.0) -> torch.Tensor:
    """Cache rows of `fmt` -> (..., 576) float32 (k_scale is applied to fp8 only)."""
    if normalize_format(fmt) == "fp8":
        return dequantize_fp8(rows, k_scale)
    return unpack_nvfp4(rows)


def make_paged_cache(
    num_blocks: int,
    block_size: int,
    fmt: CacheFormat,
    *,
    block_stride: int | None = None,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """A paged cache `[num_blocks, block_size, row_bytes]` of random bytes.

    block_stride: rows between consecutive blocks in memory (>= block_size);
    the result is then a strided view, as vLLM's hybrid caches are. Random
    bytes (not zeros) so a kernel that reads an unwritten row is noticed;
    e4m3 bytes (fp8 rows; nvfp4 RoPE and scales) are drawn away from NaN codes.
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
    stride = block_size if block_stride is None else block_stride
    if stride < block_size:
        raise ValueError(f"block_stride={stride} must be >= block_size={block_size}")
    nbytes = row_bytes(fmt)
    raw = torch.randint(0, 256, (num_blocks, stride, nbytes), dtype=torch.uint8, generator=generator)
    if normalize_format(fmt) == "fp8":
        raw &= 0xF7  # clears exponent bit 0 of every byte: 0x7F/0xFF (NaN) cannot occur
        storage = raw.view(torch.float8_e4m3fn)
    else:
        raw[..., NVFP4_ROPE_OFFSET:] &= 0xF7  # the e4m3 RoPE and scale bytes: no NaN codes either
        storage = raw
    return storage.to(device)[:, :block_size]


def flat_kv_row_view(cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """`[num_blocks, block_size, row_bytes]` (block stride S rows) -> (rows `[num_blocks*S, row_bytes]`, S).

    Block b, offset o is flat row b * S + o. Like vLLM's helper of that name.
    """
    if cache.dim() != 3:
        raise ValueError(f"cache must be [num_blocks, block_size, row_bytes], got shape {tuple(cache.shape)}")
    if cache.shape[1] != block_size:
        raise ValueError(f"cache has {cache.shape[1]} rows a block but block_size={block_size}")
    if cache.stride(2) != 1 or cache.stride(1) != cache.shape[2] or cache.stride(0) % cache.shape[2]:
        raise ValueError(f"cache rows must be contiguous; strides {cache.stride()}")
    stride_rows = cache.stride(0) // cache.shape[2]
    num_rows = (cache.shape[0] - 1) * stride_rows + block_size
    rows = cache.as_strided((num_rows, cache.shape[2]), (cache.shape[2], 1))
    return rows, stride_rows


def write_tokens(
    cache: torch.Tensor,
    block_table_row: torch.Tensor,
    rows: torch.Tensor,
    start: int = 0,
) -> None:
    """Write quantized rows (n, row_bytes) as tokens start..start+n-1 of one request.

    Token t lives in block block_table_row[t // block_size], offset t % block_size.
    """
    block_size = cache.shape[1]
    if rows.dtype != cache.dtype or rows.shape[-1] != cache.shape[-1]:
        raise ValueError(
            f"rows {tuple(rows.shape)} {rows.dtype} do not match cache rows {cache.shape[-1]} {cache.dtype}"
        )
    t = torch.arange(start, start + rows.shape[0], device=cache.device)
    blocks = block_table_row.to(cache.device).long()[t // block_size]
    cache.view(torch.uint8)[blocks, t % block_size] = rows.to(cache.device).view(torch.uint8)
