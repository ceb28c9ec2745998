"""nn.py: YaRN RoPE tables and rotation (MODEL.md §6.1) and sampling (§4.2)."""
from __future__ import annotations

import math

import pytest
import torch

from dsv41c.nn import apply_rope, rope_frequencies, rope_table, sample


# ------------------------------------------------------------------ frequencies
def test_released_compressed_table_lo15_hi25(ref):
    d, base, L, factor = 64, 160000.0, 65536, 16.0

    def c(r):
        return d * math.log(L / (2 * math.pi * r)) / (2 * math.log(base))

    assert abs(c(32) - 15.45) < 0.01 and abs(c(1) - 24.71) < 0.01
    lo, hi = max(math.floor(c(32)), 0), min(math.ceil(c(1)), d - 1)
    assert (lo, hi) == (15, 25)

    f = rope_frequencies(d, base, L, factor, 32, 1)
    assert f.dtype == torch.float32 and f.shape == (32,)
    plain = ref.base_freqs(d, base)
    torch.testing.assert_close(f[:16].double(), plain[:16], rtol=1e-6, atol=0)         # pairs 0..15 unchanged
    torch.testing.assert_close(f[25:].double(), plain[25:] / 16, rtol=1e-6, atol=0)   # 25..31 divided by 16
    for i in range(16, 25):                                                              # linear blend
        ramp = (i - 15) / 10
        exp = plain[i].item() / 16 * ramp + plain[i].item() * (1 - ramp)
        assert abs(f[i].item() - exp) <= 1e-6 * exp
    torch.testing.assert_close(f.double(), ref.yarn_freqs(d, base, L, factor, 32, 1), rtol=1e-6, atol=0)


def test_tiny_compressed_table(ref):
    # d=16, base 160000, L=32, factor 4: c(32) < 0 -> lo = 0, c(1) = 1.087 -> hi = 2.
    f = rope_frequencies(16, 160000.0, 32, 4.0, 32, 1)
    plain = ref.base_freqs(16, 160000.0)
    exp = plain.clone()
    exp[1] = plain[1] / 4 * 0.5 + plain[1] * 0.5
    exp[2:] = plain[2:] / 4
    torch.testing.assert_close(f.double(), exp, rtol=1e-6, atol=0)


@pytest.mark.parametrize("d,base", [(16, 10000.0), (64, 10000.0), (32, 40000.0)])
def test_rope_theta_table_without_yarn(ref, d, base):
    f = rope_frequencies(d, base)
    torch.testing.assert_close(f.double(), ref.base_freqs(d, base), rtol=1e-6, atol=0)
    # original_seq_len = 0 disables YaRN whatever the factor
    f0 = rope_frequencies(d, base, 0, 40.0, 32, 1)
    assert torch.equal(f, f0)


def test_rope_table_cos_sin_of_fp32_angle():
    freqs = rope_frequencies(16, 160000.0, 32, 4.0, 32, 1)
    L = 300
    table = rope_table(L, freqs)
    assert table.shape == (L, 8, 2) and table.dtype == torch.float32
    # angle(t, i) = fp32(t) * f_i (fp32 product), table = (cos, sin)
    ang = (torch.arange(L, dtype=torch.float32)[:, None] * freqs[None, :]).double()
    torch.testing.assert_close(table[..., 0].double(), torch.cos(ang), rtol=0, atol=2e-6)
    torch.testing.assert_close(table[..., 1].double(), torch.sin(ang), rtol=0, atol=2e-6)
    assert torch.equal(table[0], torch.tensor([[1.0, 0.0]] * 8))


def test_model_tables_and_layer_bases(tiny_model, tiny_args, ref):
    a = tiny_args
    swa = tiny_model.rope_swa
    comp = tiny_model.rope_compressed
    assert swa.shape[0] >= a.max_seq_len and comp.shape[0] == a.max_seq_len
    for table, freqs in ((swa, ref.base_freqs(a.rope_head_dim, a.rope_theta)),
                         (comp, ref.yarn_freqs(a.rope_head_dim, a.compress_rope_theta, a.original_seq_len,
                                               a.rope_factor, a.beta_fast, a.beta_slow))):
        t = torch.arange(table.shape[0], dtype=torch.float64)[:, None]
        ang = t * freqs[None, :]
        torch.testing.assert_close(table[..., 0].double(), torch.cos(ang), rtol=0, atol=1e-4)
        torch.testing.assert_close(table[..., 1].double(), torch.sin(ang), rtol=0, atol=1e-4)
    # rho > 0 layers (sources and consumers) use the compressed table; rho = 0 and DSpark the swa one
    layers = list(tiny_model.layers) + list(tiny_model.mtp)
    for i, layer in enumerate(layers):
        assert layer.attn.rope_key == ("compressed" if a.compress_ratios[i] > 0 else "swa")


# ------------------------------------------------------------------ rotation
def _random_table(S, half):
    ang = torch.rand(S, half, dtype=torch.float64) * 20 - 10
    return torch.stack([torch.cos(ang), torch.sin(ang)], dim=-1).float()


def _naive_rotate(x, table, inverse=False):
    """Per-pair complex product with Python complex numbers (float64)."""
    x = x.double()
    out = x.clone()
    d = x.shape[-1]
    half = table.shape[-2]
    d_r = 2 * half
    flat_x = out.reshape(-1, d)
    S = table.shape[-3]
    # x: [B, S, (H,) d]; table: [S, half, 2] or [B, S, half, 2]
    B = x.shape[0]
    H = x.shape[2] if x.dim() == 4 else 1
    for b in range(B):
        for s in range(S):
            tab = table[b, s] if table.dim() == 4 else table[s]
            for h in range(H):
                row = (b * S + s) * H + h
                for i in range(half):
                    z = complex(flat_x[row, d - d_r + 2 * i].item(), flat_x[row, d - d_r + 2 * i + 1].item())
                    w = complex(tab[i, 0].item(), tab[i, 1].item())
                    z = z * (w.conjugate() if inverse else w)
                    flat_x[row, d - d_r + 2 * i] = z.real
                    flat_x[row, d - d_r + 2 * i + 1] = z.imag
    return out


def test_apply_rope_heads_fp32_naive():
    B, S, H, d, half = 2, 3, 2, 24, 4
    x = torch.randn(B, S, H, d)
    table = _random_table(S, half)
    out = apply_rope(x, table)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.equal(out[..., :d - 2 * half], x[..., :d - 2 * half])       # untouched head part
    torch.testing.assert_close(out.double(), _naive_rotate(x, table), rtol=0, atol=1e-5)
    back = apply_rope(out, table, inverse=True)
    torch.testing.assert_close(back, x, rtol=0, atol=1e-5)
    torch.testing.assert_close(apply_rope(x, table, inverse=True).double(),
                               _naive_rotate(x, table, inverse=True), rtol=0, atol=1e-5)


def test_apply_rope_vectors_and_per_batch_table():
    B, S, d, half = 2, 4, 16, 8                                        # d_r = d: the whole vector
    x = torch.randn(B, S, d)
    table = torch.stack([_random_table(S, half), _random_table(S, half)])   # [B, S, half, 2]
    out = apply_rope(x, table)
    torch.testing.assert_close(out.double(), _naive_rotate(x, table), rtol=0, atol=1e-5)
    x2 = torch.randn(B, S, 40)                                          # 3-D input, tail of 16
    t2 = _random_table(S, half)
    out2 = apply_rope(x2, t2)
    assert torch.equal(out2[..., :24], x2[..., :24])
    torch.testing.assert_close(out2.double(), _naive_rotate(x2, t2), rtol=0, atol=1e-5)


def test_apply_rope_pairs_are_adjacent_hand_case():
    # tail (re, im) = (1, 0), (0, 2) rotated by +90 degrees -> (0, 1), (-2, 0)
    x = torch.tensor([[[7.0, 1.0, 0.0, 0.0, 2.0]]])
    table = torch.tensor([[[0.0, 1.0], [0.0, 1.0]]])
    out = apply_rope(x, table)
    assert out.view(-1).tolist() == [7.0, 0.0, 1.0, -2.0, 0.0]
    back = apply_rope(out, table, inverse=True)
    assert back.view(-1).tolist() == [7.0, 1.0, 0.0, 0.0, 2.0]


def test_apply_rope_bf16_write_back(ref):
    B, S, H, d, half = 2, 5, 3, 32, 8
    x = torch.randn(B, S, H, d).to(torch.bfloat16)
    table = _random_table(S, half)
    out = apply_rope(x, table)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[..., :d - 2 * half], x[..., :d - 2 * half])
    exact = _naive_rotate(x, table)[..., d - 2 * half:]
    got = out[..., d - 2 * half:].double()
    # fp32 math then one rounding to bf16: within half a bf16 ulp of the exact rotation
    # (plus the fp32 error of the product), i.e. round-to-nearest of the exact value.
    err = (got - exact).abs()
    mag = x[..., d - 2 * half:].double().abs().max()
    bound = 0.5 * ref.bf16_ulp(torch.minimum(got.abs(), exact.abs())) + 1e-6 * mag
    assert (err <= bound).all(), (err / bound).max()
    # inverse then gives back x up to the two bf16 roundings
    back = apply_rope(out, table, inverse=True)
    torch.testing.assert_close(back.double(), x.double(), rtol=2 ** -7, atol=2 ** -7)


# ------------------------------------------------------------------ sampling (§4.2)
def test_sample_temperature_zero_is_argmax():
    logits = torch.randn(7, 50)
    assert torch.equal(sample(logits, 0.0), logits.argmax(dim=-1))
    assert sample(logits, 0).shape == (7,)


def test_sample_gumbel_frequencies_match_softmax():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, 1.5])
    T, N = 0.8, 40000
    gen = torch.Generator().manual_seed(1234)
    ids = sample(logits.expand(N, 5).contiguous(), T, generator=gen)
    assert ids.shape == (N,)
    freq = torch.bincount(ids, minlength=5).double() / N
    p = torch.softmax(logits.double() / T, dim=-1)
    # binomial std <= sqrt(0.25/N) = 0.0025
    assert (freq - p).abs().max() < 0.012, (freq, p)


def test_sample_high_temperature_flattens():
    logits = torch.tensor([0.0, 3.0])
    gen = torch.Generator().manual_seed(7)
    ids = sample(logits.expand(20000, 2).contiguous(), 100.0, generator=gen)
    p1 = torch.softmax(logits.double() / 100.0, dim=-1)[1].item()
    assert abs(ids.double().mean().item() - p1) < 0.02
