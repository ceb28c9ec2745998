"""The Engram module (MODEL.md §8.5): table rows -> wkv -> per-stream keys + one shared value,
gate = sigmoid(signed sqrt of a per-(token, stream) normalised dot product)."""
from __future__ import annotations

import math

import torch
from torch import nn

from dsv41c.model import Engram

ROWS = 50


def _engram(args, dtype):
    eg = Engram(args, ROWS, dtype)
    m, d, e_d = args.hc_mult, args.dim, args.engram_head_dim
    with torch.no_grad():
        eg.embed.weight.copy_(torch.randn(ROWS, e_d).to(torch.float8_e4m3fn))
        eg.embed.scale.copy_(torch.randint(122, 131, (ROWS, e_d // 32), dtype=torch.uint8)
                             .view(torch.float8_e8m0fnu))
        n_in = args.engram_n_hash_cols * e_d
        eg.wkv.weight.copy_(torch.randn(d * (m + 1), n_in) * n_in ** -0.5)
        eg.q_weight.copy_(1 + 0.3 * torch.randn(m, d))
        eg.k_weight.copy_(1 + 0.3 * torch.randn(m, d))
    return eg


def _naive_engram(eg, args, h, hash_ids):
    """Per (token, stream) loop of §8.5 in float64."""
    B, S, m, D = h.shape
    eps = args.norm_eps
    e_d = args.engram_head_dim
    vals = eg.embed.weight.float().double()                            # e4m3 values
    scale = torch.exp2(eg.embed.scale.view(torch.uint8).double() - 127)   # UE8M0: 2^(e-127)
    deq = vals * scale.repeat_interleave(32, dim=-1)                   # [rows, e_d]
    omega = eg.q_weight.double() * eg.k_weight.double()
    Wkv = eg.wkv.weight.double()
    out = h.double().clone()
    gates = torch.zeros(B, S, m, dtype=torch.float64)
    for b in range(B):
        for t in range(S):
            flat = torch.cat([deq[int(c)] for c in hash_ids[b, t]])   # hash column c's row at c*e_d
            assert flat.numel() == args.engram_n_hash_cols * e_d
            kv = Wkv @ flat
            value = kv[m * D:]
            for j in range(m):
                key = kv[j * D:(j + 1) * D]
                hj = h[b, t, j].double()
                r = 1 / math.sqrt((hj * hj).mean().item() + eps) / math.sqrt((key * key).mean().item() + eps)
                dot = (hj * omega[j] * key).sum().item() * r / math.sqrt(D)
                sgn = (dot > 0) - (dot < 0)
                gate = 1 / (1 + math.exp(-sgn * math.sqrt(max(abs(dot), 1e-6))))
                gates[b, t, j] = gate
                out[b, t, j] = hj + gate * value
    return out, gates


def test_engram_fp32_against_naive_loop(tiny_args):
    args = tiny_args
    eg = _engram(args, torch.float32)
    h = torch.randn(2, 3, args.hc_mult, args.dim) * torch.tensor([1.0, 3.0, 0.2, 5.0]).view(1, 1, 4, 1)
    hash_ids = torch.randint(0, ROWS, (2, 3, args.engram_n_hash_cols))
    with torch.no_grad():
        out = eg(h, hash_ids)
    assert out.shape == h.shape and out.dtype == torch.float32
    exp, gates = _naive_engram(eg, args, h, hash_ids)
    torch.testing.assert_close(out.double(), exp, rtol=1e-4, atol=1e-4)
    assert ((gates > 0.05) & (gates < 0.95)).any()                     # a non-trivial gate range


def test_engram_bf16_against_naive_loop(tiny_args):
    args = tiny_args
    eg = _engram(args, torch.bfloat16)
    h = torch.randn(2, 4, args.hc_mult, args.dim).to(torch.bfloat16)
    hash_ids = torch.randint(0, ROWS, (2, 4, args.engram_n_hash_cols))
    with torch.no_grad():
        out = eg(h, hash_ids)
    assert out.dtype == torch.bfloat16
    exp, _ = _naive_engram(eg, args, h, hash_ids)
    assert ((out.double() - exp).abs().max() / exp.abs().max()) < 2e-2


class _FixedKV(nn.Module):
    def __init__(self, kv):
        super().__init__()
        self.kv = kv

    def forward(self, rows):
        return self.kv.expand(*rows.shape[:-1], -1)


def test_engram_gate_hand_case_signed_sqrt_per_stream_norms(tiny_args):
    """key_j = t_j * 1, h_j = s_j * 1, omega_j = c_j * 1: with per-(token, stream) RMS normalisation
    dot_j = sum(1 * c_j * 1) / sqrt(D) = 8 c_j (D = 64), independent of s_j and t_j."""
    args = tiny_args
    m, D = args.hc_mult, args.dim
    assert D == 64 and m == 4
    eg = _engram(args, torch.float32)
    dots = [0.25, -0.25, 1e-8, 0.0]
    s_scale = [1.0, 5.0, 0.5, 2.0]
    t_scale = [3.0, 0.1, 1.0, 7.0]
    value = torch.linspace(-1, 1, D)
    kv = torch.cat([torch.full((D,), t) for t in t_scale] + [value])
    eg.wkv = _FixedKV(kv)                                                 # instrument the projection
    with torch.no_grad():
        eg.q_weight.copy_(torch.tensor([d / 8 for d in dots])[:, None].expand(m, D))
        eg.k_weight.fill_(1.0)
    h = torch.tensor(s_scale)[None, None, :, None].expand(1, 1, m, D).contiguous()
    hash_ids = torch.zeros(1, 1, args.engram_n_hash_cols, dtype=torch.long)
    with torch.no_grad():
        out = eg(h, hash_ids)
    sig = lambda v: 1 / (1 + math.exp(-v))                                 # noqa: E731
    gates = [sig(math.sqrt(0.25)), sig(-math.sqrt(0.25)), sig(math.sqrt(1e-6)), 0.5]
    for j in range(m):
        exp = s_scale[j] + gates[j] * value.double()                      # the same value for every stream
        torch.testing.assert_close(out[0, 0, j].double(), exp, rtol=1e-6, atol=1e-6)
