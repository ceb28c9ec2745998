"""Basic layers: RMSNorm, the quantisation-aware Linear, RoPE tables and rotation, sampling.

Dtype policy (spec §14, §16): a model is built with a compute dtype `dtype` (bfloat16 follows the
reference rounding points; float32 is the exact debug twin). Parameters the spec keeps in fp32 are
always fp32; the rest are created in `dtype`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsv41c import quant


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) in fp32, times the weight (cast up), rounded once to x.dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def dequant_weight(weight: torch.Tensor, scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """fp32 values of an "fp8" ([out, in] + 32x32 tile scales) or "fp4" (packed + per-32 scales) weight.
    Leading dims are allowed (stacked experts) when `out` is a multiple of 32."""
    lead = weight.shape[:-2]
    w2d, s2d = weight.flatten(0, -2), scale.flatten(0, -2)
    w = quant.dequant_fp8_weight(w2d, s2d) if fmt == "fp8" else quant.dequant_fp4_weight(w2d, s2d)
    return w.view(*lead, -1, w.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """One projection in one of the storage formats (spec §10.3).

    fmt "dense": plain F.linear in the weight's dtype (the input is cast to it).
    fmt "fp8" / "fp4": the input is FP8-act-quantised per 32 channels, the weight dequantised with
    its block scales, one fp32 matmul, rounded once to the input's dtype.
    """
    if fmt == "dense":
        return F.linear(x.to(weight.dtype), weight)
    xq = quant.fp8_fake_quant(x.float(), 32)
    return F.linear(xq, dequant_weight(weight, scale, fmt)).to(x.dtype)


def batched_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """Row p of x [P, in] through its own weight [P, out, in]: the same numerics as `linear`."""
    if fmt == "dense":
        return torch.einsum("pi,poi->po", x.to(weight.dtype), weight)
    xq = quant.fp8_fake_quant(x.float(), 32)
    return torch.einsum("pi,poi->po", xq, dequant_weight(weight, scale, fmt)).to(x.dtype)


def weight_format(storage: str | None) -> str:
    """The `linear` format of a config storage name: "fp8", "fp4", or "dense" (bf16 / None)."""
    return storage if storage in ("fp8", "fp4") else "dense"


# Packed dtypes without indexing or Inductor codegen support are held as raw bytes.
BYTE_STORED = (torch.float8_e8m0fnu, torch.float4_e2m1fn_x2)


def frozen_param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """A weight of a storage dtype (no gradients); BYTE_STORED dtypes are held as uint8."""
    return nn.Parameter(torch.empty(shape, dtype=torch.uint8 if dtype in BYTE_STORED else dtype),
                        requires_grad=False)


def uninitialised(module_cls: type[nn.Module], *args, **kwargs) -> nn.Module:
    """A torch.nn layer (nn.Linear, nn.Embedding) with its parameters left uninitialised, like
    `frozen_param`'s: `init_weights` or a checkpoint fills them, so torch's default init (kaiming,
    normal) over a large head or embedding would be wasted work. On the current default device."""
    return nn.utils.skip_init(module_cls, *args, device=torch.get_default_device(), **kwargs)


def show_logical_dtypes(module: nn.Module, names: dict[str, torch.dtype]) -> None:
    """Make `state_dict` show the byte-stored parameters `names` in their own dtype, and
    `load_state_dict` accept them in that dtype (or as uint8)."""

    def to_logical(mod, state_dict, prefix, local_metadata):
        for name, dtype in names.items():
            if prefix + name in state_dict:
                state_dict[prefix + name] = state_dict[prefix + name].view(dtype)

    def to_bytes(mod, state_dict, prefix, *unused):
        for name, dtype in names.items():
            t = state_dict.get(prefix + name)
            if t is not None and t.dtype == dtype:
                state_dict[prefix + name] = t.view(torch.uint8)

    module.register_state_dict_post_hook(to_logical)
    module.register_load_state_dict_pre_hook(to_bytes)


def linear_storage(fmt: str, in_features: int, out_features: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of a quantised linear's `weight` and `scale` (spec §3, §10)."""
    if fmt == "fp8":
        return {"weight": ((out_features, in_features), torch.float8_e4m3fn),
                "scale": ((-(-out_features // 32), -(-in_features // 32)), torch.float8_e8m0fnu)}
    return {"weight": ((out_features, in_features // 2), torch.float4_e2m1fn_x2),
            "scale": ((out_features, in_features // 32), torch.float8_e8m0fnu)}


class Linear(nn.Module):
    """A Linear without bias whose storage follows the config (`dtype` / `expert_dtype`).

    "dense": `weight` [out, in] in `dtype`.  "fp8": `weight` float8_e4m3fn [out, in] and `scale`
    float8_e8m0fnu [ceil(out/32), ceil(in/32)].  "fp4": `weight` float4_e2m1fn_x2 [out, in/2] and
    `scale` float8_e8m0fnu [out, in/32].
    """

    def __init__(self, in_features: int, out_features: int, fmt: str = "dense",
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        if fmt == "dense":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
            self.register_parameter("scale", None)
        elif fmt in ("fp8", "fp4"):
            storage = linear_storage(fmt, in_features, out_features)
            for name, (shape, sdtype) in storage.items():
                self.register_parameter(name, frozen_param(shape, sdtype))
            show_logical_dtypes(self, {n: d for n, (_, d) in storage.items() if d in BYTE_STORED})
        else:
            raise ValueError(f"unknown linear format {fmt!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.scale, self.fmt)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt}"


# ------------------------------------------------------------------------------------ RoPE
def rope_frequencies(dim: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
                     beta_fast: int = 32, beta_slow: int = 1) -> torch.Tensor:
    """Per-pair frequencies f_i, with the YaRN blend when original_seq_len > 0 (spec §6.1)."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        def corr(r: float) -> float:
            return dim * math.log(original_seq_len / (r * 2 * math.pi)) / (2 * math.log(base))
        lo = max(math.floor(corr(beta_fast)), 0)
        hi = min(math.ceil(corr(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / max(hi - lo, 0.001)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return freqs


def rope_table(max_seq_len: int, freqs: torch.Tensor) -> torch.Tensor:
    """cos and sin of t * f_i, stacked: [max_seq_len, dim/2, 2] fp32."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*table.shape[-2] entries of x as complex pairs (real, imag) by `table`.

    x: [B, S, d] or [B, S, H, d]; table: [S, d_r/2, 2] (rows for x's positions) or [B, S, d_r/2, 2].
    Math in fp32, the rotated tail written back in x.dtype; the first d - d_r entries are untouched.
    """
    d_r = table.shape[-2] * 2
    tail = x[..., -d_r:].float().unflatten(-1, (-1, 2))
    if table.dim() == 3:
        table = table.unsqueeze(0)
    if x.dim() == 4:
        table = table.unsqueeze(2)
    cos, sin = table[..., 0], table[..., 1]
    if inverse:
        sin = -sin
    re, im = tail[..., 0], tail[..., 1]
    rotated = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-d_r], rotated.to(x.dtype)], dim=-1)


# ------------------------------------------------------------------------------------ sampling
def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Greedy for temperature 0, else Gumbel-max: argmax(softmax(l / T) / Exp(1)) (spec §4.2)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / max(temperature, 1e-5), dim=-1)
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(dim=-1)
