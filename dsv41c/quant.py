"""Block quantisation formats of DeepSeek-V4.1-Flash (MODEL.md §10), in plain torch.

Scalar formats
  * E4M3 (``float8_e4m3fn``): max 448, subnormal step 2^-9; torch's fp32 cast is round-to-nearest-even.
  * UE8M0 (``float8_e8m0fnu``): byte e is 2^(e-127); byte 255 is NaN.
  * E2M1: codes 0..7 are the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; ``code | 8`` is the negative.
    Two codes per byte: element 2i in the low nibble, 2i+1 in the high nibble (``float4_e2m1fn_x2``).

Block scale rules (a = max|x| over a block, computed in fp32)
  * FP8 / act_quant, 32 wide:  s = 2^ceil(log2(max(a, 1e-4) * (1/448))),   q = e4m3(clamp(x/s, +-448))
  * FP4 UE8M0 (MXFP4), 32 wide: s = 2^ceil(log2(max(a, 6*2^-126) * (1/6))), q = e2m1(clamp(x/s, +-6))
  * FP4 E4M3 scale, 16 wide:   s = e4m3(max(a, 6*2^-9) / 6),               q = e2m1(clamp(x/s, +-6))
  The power-of-two ceiling is read from the IEEE bits of the fp32 product, as the kernels do:
  its exponent, plus one if any mantissa bit is set.  The E4M3 scale is clamped to 448 before the
  cast, so it saturates like the GPU's ``satfinite`` conversion; x/s may then exceed 6 and saturates.

Non-finite policy (our choice; the spec is silent): a block whose amax is NaN or +-inf gets a NaN
scale (UE8M0 byte 0xFF, E4M3 byte 0x7F), so the whole block dequantises to NaN; other blocks are
unaffected.  NaN is never silently turned into a number.  All-zero blocks dequantise to exact zeros.
Finite inputs saturate; for |x| <= 2^127 every output is finite (beyond that, q*s may round up past
the fp32 maximum to inf, as the same fp32 product would in a kernel).

Every dequantised value q*s is exact in fp32 and in bf16, so the fake quantisers (fp32 maths, result
cast back to ``x.dtype``) are exact functions of their fp32 input, and ``*_dequant_ref(*_quant_ref(x))``
equals the matching fake quantiser bit for bit.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_F8 = torch.float8_e4m3fn
_E8 = torch.float8_e8m0fnu
_F4X2 = torch.float4_e2m1fn_x2
_R448 = 1.0 / 448.0  # the kernels multiply by the fp32 reciprocal (1/448 and 1/6 cast to fp32)
_R6 = 1.0 / 6.0
_FP8_FLOOR = 1e-4
_MX_FLOOR = 6.0 * 2.0**-126
_E4M3_SCALE_FLOOR = 6.0 * 2.0**-9
# Decision points between consecutive E2M1 codes; True means a tie goes up (the upper code is even).
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
               (2.5, False), (3.5, True), (5.0, False))
_ROW_FORMATS = {"fp8": (1.0, 32), "fp4_e4m3": (0.5, 16), "mxfp4": (0.5, 32)}


# --------------------------------------------------------------------------- helpers

def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 view [..., n/block, block] of x; ValueError unless the last dim divides by block."""
    if block < 1 or x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(f"quant: last dim of shape {tuple(x.shape)} must be a multiple of block={block}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _amax(xb: torch.Tensor) -> torch.Tensor:
    """Block amax [..., nb, 1]; NaN anywhere in the block gives NaN."""
    return xb.abs().amax(dim=-1, keepdim=True)


def _ue8m0_scale(a: torch.Tensor, floor: float, recip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s fp32, UE8M0 byte uint8) with s = 2^ceil(log2(max(a, floor) * recip)); non-finite a -> (NaN, 255).

    The ceiling is taken from the IEEE bits of the fp32 product (exponent, +1 if any mantissa bit
    is set).  The floors keep the product a normal number and the exponent in [-126, 127].
    """
    t = torch.clamp_min(a, floor) * recip
    bits = t.view(torch.int32)
    k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    ok = torch.isfinite(a)
    k = torch.where(ok, k, torch.full_like(k, 128))
    byte = (k + 127).to(torch.uint8)
    s = ((k + 127) << 23).view(torch.float32)  # 2^k, exact
    return torch.where(ok, s, torch.full_like(s, float("nan"))), byte


def _e4m3_scale(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s fp32, raw E4M3 byte) with s = e4m3(min(max(a, 6*2^-9) / 6, 448)); non-finite a -> (NaN, 0x7F)."""
    se = torch.clamp(torch.clamp_min(a, _E4M3_SCALE_FLOOR) / 6.0, max=E4M3_MAX).to(_F8)
    ok = torch.isfinite(a)
    byte = torch.where(ok, se.view(torch.uint8), torch.full_like(se.view(torch.uint8), 0x7F))
    s = se.float()
    return torch.where(ok, s, torch.full_like(s, float("nan"))), byte


def _e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (uint8 or float8_e8m0fnu) -> fp32: 0 -> 2^-127, 255 -> NaN."""
    b = scale.view(torch.uint8).to(torch.int32)
    s = torch.where(b == 0, torch.full_like(b, 0x400000), b << 23).view(torch.float32)
    return torch.where(b == 255, torch.full_like(s, float("nan")), s)


def _e2m1_mag_code(m: torch.Tensor) -> torch.Tensor:
    """|v| (fp32) -> E2M1 magnitude code 0..7, round-to-nearest-even on the code; >= 6 -> 7, NaN -> 0."""
    code = torch.zeros(m.shape, dtype=torch.int32, device=m.device)
    for t, tie_up in _E2M1_STEPS:  # seven constant thresholds, elementwise comparisons
        code = code + ((m >= t) if tie_up else (m > t)).to(torch.int32)
    return code


def _e2m1_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def _e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 values -> uint8 E2M1 codes (sign bit 8 from the sign of v, also for -0)."""
    return (_e2m1_mag_code(v.abs()) | (torch.signbit(v).to(torch.int32) << 3)).to(torch.uint8)


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (low nibble) -> fp32 values; code 8 is -0.0."""
    c = codes.to(torch.int64)
    mag = _e2m1_table(codes.device)[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def _apply_scale(vals: torch.Tensor, s: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """vals fp32 [..., n] times per-block scales s fp32 [..., n/block], cast to dtype."""
    if s.shape != vals.shape[:-1] + (vals.shape[-1] // block,) or vals.shape[-1] % block:
        raise ValueError(f"quant: scales {tuple(s.shape)} do not match values {tuple(vals.shape)} "
                         f"with blocks of {block}")
    out = vals.reshape(*vals.shape[:-1], vals.shape[-1] // block, block) * s.unsqueeze(-1)
    return out.reshape(vals.shape).to(dtype)


def _fp8_core(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks [..., nb, b] -> (e4m3 q, fp32 s [..., nb, 1], UE8M0 byte [..., nb, 1])."""
    s, byte = _ue8m0_scale(_amax(xb), _FP8_FLOOR, _R448)
    return torch.clamp(xb / s, -E4M3_MAX, E4M3_MAX).to(_F8), s, byte


def _fp4_ue8m0_core(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks -> (v = clamp(x/s, +-6) fp32, s fp32, UE8M0 byte)."""
    s, byte = _ue8m0_scale(_amax(xb), _MX_FLOOR, _R6)
    return torch.clamp(xb / s, -E2M1_MAX, E2M1_MAX), s, byte


def _fp4_e4m3_core(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks -> (v = clamp(x/s, +-6) fp32, s fp32, raw E4M3 scale byte)."""
    s, byte = _e4m3_scale(_amax(xb))
    return torch.clamp(xb / s, -E2M1_MAX, E2M1_MAX), s, byte


def _lead(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Reshape block-shaped t [..., nb, k] to x's leading dims [..., nb*k] (also for empty x)."""
    return t.flatten(-2).reshape(*x.shape[:-1], t.shape[-2] * t.shape[-1])


# --------------------------------------------------------------------------- E2M1 scalars

def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of fp32 v (meant for [-6, 6]; |v| >= 6 gives 6), as fp32.

    Round-to-nearest-even on the code: ties 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4,
    5->4.  The sign is kept (also on zero); NaN stays NaN.  Elementwise torch ops only.
    """
    v = v.float()
    out = torch.copysign(_e2m1_table(v.device)[_e2m1_mag_code(v.abs()).to(torch.int64)], v)
    return torch.where(torch.isnan(v), v, out)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (n even) -> uint8 [..., n/2]: element 2i low nibble, 2i+1 high nibble."""
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dim of {tuple(codes.shape)} must be even")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 (or float4_e2m1fn_x2) [..., m] -> uint8 codes [..., 2m]; inverse of pack_e2m1."""
    p = packed.view(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


# --------------------------------------------------------------------------- fake quantisers

def fp8_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 act-quant round trip: E4M3 values, one UE8M0 scale per `block` along the last dim."""
    q, s, _ = _fp8_core(_blocked(x, block))
    return (q.float() * s).reshape(x.shape).to(x.dtype)


def fp4_ue8m0_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 (E2M1) round trip with one UE8M0 scale per `block` (index queries/keys, MXFP4)."""
    v, s, _ = _fp4_ue8m0_core(_blocked(x, block))
    return (e2m1_round(v) * s).reshape(x.shape).to(x.dtype)


def fp4_e4m3_fake_quant(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """FP4 (E2M1) round trip with one E4M3 scale per `block` (compressed KV entries)."""
    v, s, _ = _fp4_e4m3_core(_blocked(x, block))
    return (e2m1_round(v) * s).reshape(x.shape).to(x.dtype)


# --------------------------------------------------------------------------- weight / table formats

def quantize_fp8_rows(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., n] -> (float8_e4m3fn [..., n], float8_e8m0fnu [..., n/block]) (Engram table format)."""
    q, _, byte = _fp8_core(_blocked(w, block))
    return _lead(w, q), _lead(w, byte).view(_E8)


def dequant_fp8_rows(values: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """E4M3 [..., n] x UE8M0 [..., n/block] -> fp32 [..., n]."""
    return _apply_scale(values.view(_F8).float(), _e8m0_to_float(scale), block, torch.float32)


def quantize_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/32), ceil(in/32)]).

    One UE8M0 scale per 32x32 tile, s = 2^ceil(log2(max(amax, 1e-4) * (1/448))); edge tiles are
    partial (their amax covers only the real elements).
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_weight: expected a 2-D weight, got shape {tuple(w.shape)}")
    out, inn = w.shape
    po, pi = -(-out // 32) * 32, -(-inn // 32) * 32
    t = torch.nn.functional.pad(w.float(), (0, pi - inn, 0, po - out)).reshape(po // 32, 32, pi // 32, 32)
    s, byte = _ue8m0_scale(t.abs().amax(dim=(1, 3), keepdim=True), _FP8_FLOOR, _R448)
    q = torch.clamp(t / s, -E4M3_MAX, E4M3_MAX).to(_F8).reshape(po, pi)[:out, :inn].contiguous()
    return q, byte.reshape(po // 32, pi // 32).view(_E8)


def dequant_fp8_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 [out, in] x UE8M0 per 32x32 tile [ceil(out/32), ceil(in/32)] -> fp32 [out, in]."""
    out, inn = weight.shape
    if tuple(scale.shape) != (-(-out // 32), -(-inn // 32)):
        raise ValueError(f"dequant_fp8_weight: scale {tuple(scale.shape)} does not tile weight {(out, inn)}")
    s = _e8m0_to_float(scale).repeat_interleave(32, 0)[:out].repeat_interleave(32, 1)[:, :inn]
    return weight.view(_F8).float() * s


def quantize_fp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (float4_e2m1fn_x2 [out, in/2], float8_e8m0fnu [out, in/32]) (MXFP4 experts)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_fp4_weight: expected a 2-D weight, got shape {tuple(w.shape)}")
    packed, byte = mxfp4_quant_ref(w)
    return packed.view(_F4X2), byte.view(_E8)


def dequant_fp4_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 [out, in/2] (float4_e2m1fn_x2 or uint8) x UE8M0 [out, in/32] -> fp32 [out, in]."""
    return mxfp4_dequant_ref(weight.view(torch.uint8), scale.view(torch.uint8), torch.float32)


# --------------------------------------------------------------------------- packed KV codecs

def fp8_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n] -> (E4M3 bytes uint8 [..., n], UE8M0 bytes uint8 [..., n/32]); 512 -> 528 B (SWA KV)."""
    q, byte = quantize_fp8_rows(x, 32)
    return q.view(torch.uint8), byte.view(torch.uint8)


def fp8_dequant_ref(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of fp8_quant_ref, returned in `dtype`."""
    return dequant_fp8_rows(codes, scales, 32).to(dtype)


def fp4_e4m3_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n] -> (packed E2M1 uint8 [..., n/2], raw E4M3 scale bytes uint8 [..., n/16]); 512 -> 288 B."""
    v, _, byte = _fp4_e4m3_core(_blocked(x, 16))
    return pack_e2m1(_lead(x, _e2m1_encode(v))), _lead(x, byte)


def fp4_e4m3_dequant_ref(packed: torch.Tensor, scales: torch.Tensor,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of fp4_e4m3_quant_ref, returned in `dtype`."""
    s = scales.view(torch.uint8).view(_F8).float()
    return _apply_scale(_e2m1_decode(unpack_e2m1(packed)), s, 16, dtype)


def mxfp4_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., n] -> (packed E2M1 uint8 [..., n/2], UE8M0 bytes uint8 [..., n/32]); 128 -> 68 B (index K)."""
    v, _, byte = _fp4_ue8m0_core(_blocked(x, 32))
    return pack_e2m1(_lead(x, _e2m1_encode(v))), _lead(x, byte)


def mxfp4_dequant_ref(packed: torch.Tensor, scales: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of mxfp4_quant_ref, returned in `dtype`."""
    return _apply_scale(_e2m1_decode(unpack_e2m1(packed)), _e8m0_to_float(scales), 32, dtype)


def packed_row_bytes(fmt: str, n: int) -> int:
    """Bytes of one packed row of n values: fp8 n + n/32, fp4_e4m3 n/2 + n/16, mxfp4 n/2 + n/32."""
    if fmt not in _ROW_FORMATS:
        raise ValueError(f"packed_row_bytes: unknown format {fmt!r}; expected one of {sorted(_ROW_FORMATS)}")
    per_value, block = _ROW_FORMATS[fmt]
    if n <= 0 or n % block:
        raise ValueError(f"packed_row_bytes: n={n} must be a positive multiple of {block} for {fmt}")
    return int(n * per_value) + n // block
