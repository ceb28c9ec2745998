"""mHC (MODEL.md §4.1, §5): Sinkhorn, coefficient mixes, collapse / expand, the delayed pre-mix."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dsv41c import mhc
from dsv41c.config import build_layer_plan
from dsv41c.model import Block

HC_EPS = 1e-6


# ------------------------------------------------------------------ Sinkhorn (§5.2)
def _hand_matrix():
    # row 0 softmax -> [1/4, 3/4], row 1 softmax -> [2/3, 1/3]
    return torch.tensor([[0.0, math.log(3.0)], [math.log(2.0), 0.0]], dtype=torch.float64)


def test_sinkhorn_2x2_one_iteration_by_hand():
    # iters = 1: row softmax (+eps) then ONE column step, no row step.
    out = mhc.sinkhorn(_hand_matrix(), iters=1, eps=0.0)
    expected = torch.tensor([[3 / 11, 9 / 13], [8 / 11, 4 / 13]], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_sinkhorn_2x2_two_iterations_by_hand():
    # iters = 2: softmax, column, then row, column (fractions worked out by hand).
    out = mhc.sinkhorn(_hand_matrix(), iters=2, eps=0.0)
    expected = torch.tensor([[481 / 1677, 1221 / 1727], [1196 / 1677, 506 / 1727]], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    # the other order (row step after the column step) gives something else
    wrong = torch.tensor([[13 / 46, 33 / 46], [26 / 37, 11 / 37]], dtype=torch.float64)
    assert (out - wrong).abs().max() > 1e-2


def test_sinkhorn_eps_placement_by_hand():
    # A large eps makes its placement visible: softmax + eps, then / (column sum + eps).
    e = 0.1
    a = [[1 / 4 + e, 3 / 4 + e], [2 / 3 + e, 1 / 3 + e]]
    c0, c1 = a[0][0] + a[1][0] + e, a[0][1] + a[1][1] + e
    exp1 = [[a[0][0] / c0, a[0][1] / c1], [a[1][0] / c0, a[1][1] / c1]]
    out1 = mhc.sinkhorn(_hand_matrix(), iters=1, eps=e)
    torch.testing.assert_close(out1, torch.tensor(exp1, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # second iteration: row step then column step, each "/ (sum + eps)"
    r0, r1 = exp1[0][0] + exp1[0][1] + e, exp1[1][0] + exp1[1][1] + e
    b = [[exp1[0][0] / r0, exp1[0][1] / r0], [exp1[1][0] / r1, exp1[1][1] / r1]]
    c0, c1 = b[0][0] + b[1][0] + e, b[0][1] + b[1][1] + e
    exp2 = [[b[0][0] / c0, b[0][1] / c1], [b[1][0] / c0, b[1][1] / c1]]
    out2 = mhc.sinkhorn(_hand_matrix(), iters=2, eps=e)
    torch.testing.assert_close(out2, torch.tensor(exp2, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_sinkhorn_20_iterations_columns_sum_to_one(ref):
    c = torch.randn(3, 5, 4, 4) * 3
    out = mhc.sinkhorn(c, iters=20, eps=HC_EPS)
    assert out.dtype == torch.float32 and out.shape == c.shape
    # the last step is a column step: every column sums to colsum/(colsum+eps) ~ 1 - 1e-6
    torch.testing.assert_close(out.sum(dim=-2), torch.ones(3, 5, 4), rtol=0, atol=1e-5)
    assert (out > 0).all()
    for b in range(3):
        for t in range(5):
            exp = torch.tensor(ref.sinkhorn(c[b, t].double().tolist(), 20, HC_EPS), dtype=torch.float64)
            torch.testing.assert_close(out[b, t].double(), exp, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("iters", [1, 2, 3, 7])
def test_sinkhorn_matches_naive_loop(ref, iters):
    c = torch.randn(6, 4, 4, dtype=torch.float64) * 2
    out = mhc.sinkhorn(c, iters=iters, eps=HC_EPS)
    for n in range(6):
        exp = torch.tensor(ref.sinkhorn(c[n].tolist(), iters, HC_EPS), dtype=torch.float64)
        torch.testing.assert_close(out[n], exp, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ mixes (§5.1)
def _random_hc_params(m=4, d=8):
    fn = torch.randn((2 + m) * m, m * d) * (m * d) ** -0.5
    scale = torch.rand(3) + 0.3
    base = torch.randn((2 + m) * m) * 0.5
    return fn, scale, base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_mixes_against_per_token_loop(ref, dtype):
    m, d = 4, 8
    h = (torch.randn(2, 3, m, d) * 2).to(dtype)
    fn, scale, base = _random_hc_params(m, d)
    pre, post, comb = mhc.hc_mixes(h, fn, scale, base, norm_eps=1e-20, hc_eps=HC_EPS, iters=20)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    assert pre.shape == (2, 3, m) and post.shape == (2, 3, m) and comb.shape == (2, 3, m, m)
    epre, epost, ecomb = ref.mixes(h, fn, scale, base, 1e-20, HC_EPS, 20)
    torch.testing.assert_close(pre.double(), epre, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(post.double(), epost, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.double(), ecomb, rtol=1e-5, atol=1e-6)
    assert ((pre > HC_EPS) & (pre < 1 + HC_EPS + 1e-6)).all()
    assert ((post > 0) & (post < 2)).all()


def test_hc_mixes_zero_fn_uses_base_row_major(ref):
    # With Φ = 0, raw = 0: pre = sigmoid(β)+eps, post = 2 sigmoid(β), comb = Sinkhorn(β[8:] row-major).
    m, d = 4, 8
    h = torch.randn(1, 1, m, d)
    fn = torch.zeros(24, m * d)
    scale = torch.tensor([0.7, 1.3, 2.0])
    base = torch.randn(24) * 1.5          # not rank-structured, so Sinkhorn(C) != Sinkhorn(C^T)^T
    pre, post, comb = mhc.hc_mixes(h, fn, scale, base, norm_eps=1e-20, hc_eps=HC_EPS, iters=20)
    b = base.double().tolist()
    torch.testing.assert_close(pre[0, 0].double(), torch.tensor([ref.sigmoid(v) + HC_EPS for v in b[:4]],
                                                                dtype=torch.float64), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(post[0, 0].double(), torch.tensor([2 * ref.sigmoid(v) for v in b[4:8]],
                                                                 dtype=torch.float64), rtol=1e-6, atol=1e-7)
    c = [[b[8 + 4 * i + j] for j in range(4)] for i in range(4)]       # C[i, j] = β[2m + i m + j]
    exp = torch.tensor(ref.sinkhorn(c, 20, HC_EPS), dtype=torch.float64)
    torch.testing.assert_close(comb[0, 0].double(), exp, rtol=1e-5, atol=1e-6)
    # the transposed reading would be different here
    expt = torch.tensor(ref.sinkhorn([list(r) for r in zip(*c)], 20, HC_EPS), dtype=torch.float64)
    assert (comb[0, 0].double() - expt).abs().max() > 1e-2


def test_hc_mixes_normaliser_is_rms_over_all_streams(ref):
    # raw = (Φ s) / sqrt(mean(s^2) + eps) over all m*D entries: scaling the whole token is a no-op,
    # scaling one stream is not (its contribution to the mean changes).
    m, d = 4, 8
    h = torch.randn(1, 1, m, d)
    fn, scale, base = _random_hc_params(m, d)
    p1 = mhc.hc_mixes(h, fn, scale, base, norm_eps=1e-20, hc_eps=HC_EPS, iters=20)
    p2 = mhc.hc_mixes(h * 8.0, fn, scale, base, norm_eps=1e-20, hc_eps=HC_EPS, iters=20)
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    h3 = h.clone()
    h3[0, 0, 2] *= 8.0
    p3 = mhc.hc_mixes(h3, fn, scale, base, norm_eps=1e-20, hc_eps=HC_EPS, iters=20)
    s3 = h3[0, 0].double().reshape(-1)
    raw0 = (fn[0].double() @ s3) / math.sqrt((s3 * s3).mean().item() + 1e-20)
    exp = ref.sigmoid(raw0.item() * scale[0].item() + base[0].item()) + HC_EPS
    assert abs(p3[0][0, 0, 0].item() - exp) < 1e-6
    # hand check of one pre coefficient with the explicit formula
    s = h[0, 0].double().reshape(-1)
    raw0 = (fn[0].double() @ s) / math.sqrt((s * s).mean().item() + 1e-20)
    exp = ref.sigmoid(raw0.item() * scale[0].item() + base[0].item()) + HC_EPS
    assert abs(p1[0][0, 0, 0].item() - exp) < 1e-6


# ------------------------------------------------------------------ collapse / expand (§5.3)
def test_collapse_hand_case():
    h = torch.tensor([1.0, 2.0, 4.0, 8.0]).view(1, 1, 4, 1).expand(1, 1, 4, 3).to(torch.bfloat16)
    w = torch.tensor([1.0, 0.5, 0.25, 2.0]).view(1, 1, 4)
    y = mhc.hc_collapse(h, w)
    assert y.dtype == torch.bfloat16 and y.shape == (1, 1, 3)
    assert torch.equal(y, torch.full((1, 1, 3), 19.0, dtype=torch.bfloat16))   # 1 + 1 + 1 + 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_collapse_fp32_sum_then_one_bf16_rounding(ref, dtype):
    h = torch.randn(2, 5, 4, 64).to(dtype)
    w = torch.rand(2, 5, 4) + 1e-6
    y = mhc.hc_collapse(h, w)
    # fp32 products added in stream order 0..3, then a single rounding to bf16
    hf = h.float()
    acc = w[..., 0, None] * hf[..., 0, :]
    for j in range(1, 4):
        acc = acc + w[..., j, None] * hf[..., j, :]
    assert y.dtype == dtype
    assert torch.equal(y, acc.to(dtype))
    torch.testing.assert_close(y.double(), ref.collapse(h, w), rtol=2 ** -8, atol=1e-6)


def test_expand_first_comb_index_is_source():
    # comb[i, j] = 1 iff j = (i + 1) mod 4: source stream i feeds destination i+1.
    res = torch.tensor([1.0, 10.0, 100.0, 1000.0]).view(1, 1, 4, 1)
    comb = torch.zeros(1, 1, 4, 4)
    for i in range(4):
        comb[0, 0, i, (i + 1) % 4] = 1.0
    post = torch.zeros(1, 1, 4)
    y = torch.full((1, 1, 1), 5.0)
    out = mhc.hc_expand(y, res, post, comb)
    assert out.view(-1).tolist() == [1000.0, 1.0, 10.0, 100.0]
    post = torch.tensor([1.0, 2.0, 0.0, 0.5]).view(1, 1, 4)
    out = mhc.hc_expand(y, res, post, comb)
    assert out.view(-1).tolist() == [1005.0, 11.0, 10.0, 102.5]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expand_broadcast_sum_in_source_order_one_rounding(ref, dtype):
    # with fp32 streams the fp32 addition order is directly visible in the output bits
    y = torch.randn(2, 3, 64).to(dtype)
    res = torch.randn(2, 3, 4, 64).to(dtype)
    post = torch.rand(2, 3, 4) * 2
    comb = torch.rand(2, 3, 4, 4)
    out = mhc.hc_expand(y, res, post, comb)
    assert out.dtype == dtype and out.shape == res.shape
    # [exactness] fp32: four products comb[i,j]*res[i] added in order i = 0..3, plus post[j]*y,
    # one rounding to bf16 at the end.
    rf, yf = res.float(), y.float()
    outs = []
    for j in range(4):
        mixed = comb[..., 0, j, None] * rf[..., 0, :]
        for i in range(1, 4):
            mixed = mixed + comb[..., i, j, None] * rf[..., i, :]
        outs.append(post[..., j, None] * yf + mixed)
    assert torch.equal(out, torch.stack(outs, dim=-2).to(dtype))
    torch.testing.assert_close(out.double(), ref.expand(y, res, post, comb), rtol=2 ** -8, atol=1e-6)


# ------------------------------------------------------------------ delayed pre-mix in Block (§4.1)
class _Recorder(nn.Module):
    """Stands in for a sublayer: records its input, returns a fixed nonlinear function of it."""

    def __init__(self, fn):
        super().__init__()
        self.fn, self.inputs = fn, []

    def forward(self, x, *rest):
        self.inputs.append(x.detach().clone())
        return self.fn(x)


def _block_fp32(tiny_args):
    plan = build_layer_plan(tiny_args)
    block = Block(tiny_args, plan[0], torch.float32, kv_quant=False)
    m, d = tiny_args.hc_mult, tiny_args.dim
    with torch.no_grad():
        for site in ("attn", "ffn"):
            getattr(block, f"hc_{site}_fn").copy_(torch.randn(24, m * d) * (m * d) ** -0.5)
            getattr(block, f"hc_{site}_base").copy_(torch.randn(24) * 0.5)
            getattr(block, f"hc_{site}_scale").copy_(torch.rand(3) + 0.3)
        block.attn_norm.weight.copy_(1 + 0.1 * torch.randn(d))
        block.ffn_norm.weight.copy_(1 + 0.1 * torch.randn(d))
    block.attn = _Recorder(lambda x: torch.tanh(x) * 3.0)
    block.ffn = _Recorder(lambda x: x.flip(-1) - 0.5 * x)
    return block


def test_block_delayed_pre_mix(tiny_args, ref):
    block = _block_fp32(tiny_args)
    m, d, eps = tiny_args.hc_mult, tiny_args.dim, tiny_args.norm_eps
    h = torch.randn(2, 3, m, d)
    pre_in = torch.rand(2, 3, m) + 0.1                # the previous layer's FFN pre (not one-hot)
    with torch.no_grad():
        h_out, pre_out = block(h, pre_in, state=None)

    kw = dict(norm_eps=eps, hc_eps=tiny_args.hc_eps, iters=tiny_args.hc_sinkhorn_iters)
    a_pre, a_post, a_comb = ref.mixes(h, block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base,
                                      kw["norm_eps"], kw["hc_eps"], kw["iters"])
    # attention input: collapse with the INCOMING pre, then attn_norm
    x_attn = ref.rmsnorm(ref.collapse(h, pre_in), block.attn_norm.weight, eps)
    torch.testing.assert_close(block.attn.inputs[0].double(), x_attn, rtol=1e-5, atol=1e-5)
    x_wrong = ref.rmsnorm(ref.collapse(h, a_pre), block.attn_norm.weight, eps)
    assert (block.attn.inputs[0].double() - x_wrong).abs().max() > 1e-2
    h1 = ref.expand(torch.tanh(x_attn) * 3.0, h, a_post, a_comb)

    f_pre, f_post, f_comb = ref.mixes(h1, block.hc_ffn_fn, block.hc_ffn_scale, block.hc_ffn_base,
                                      kw["norm_eps"], kw["hc_eps"], kw["iters"])
    # FFN input: collapse with the ATTENTION sublayer's pre, then ffn_norm
    x_ffn = ref.rmsnorm(ref.collapse(h1, a_pre), block.ffn_norm.weight, eps)
    torch.testing.assert_close(block.ffn.inputs[0].double(), x_ffn, rtol=1e-5, atol=1e-5)
    x_wrong = ref.rmsnorm(ref.collapse(h1, f_pre), block.ffn_norm.weight, eps)
    assert (block.ffn.inputs[0].double() - x_wrong).abs().max() > 1e-2
    h2 = ref.expand(x_ffn.flip(-1) - 0.5 * x_ffn, h1, f_post, f_comb)

    torch.testing.assert_close(h_out.double(), h2, rtol=1e-4, atol=1e-4)
    # Block returns the FFN pre (computed from the stream before the FFN)
    torch.testing.assert_close(pre_out.double(), f_pre, rtol=1e-5, atol=1e-6)


def test_transformer_one_hot_initial_pre_and_final_collapse_with_last_pre(tiny_args, ref):
    """§4 steps 3, 4, 6, 7: h0 expanded to m identical streams, pre one-hot on stream 0, final
    collapse with the last layer's returned pre, norm, head on the last position."""
    from dsv41c.weights import build_model
    args = tiny_args.replace(engram_layer_ids=(), engram_num_embeddings=(), n_layers=2, n_mtp_layers=0,
                             compress_ratios=(0, 0), kv_source_layers=(), index_source_layers=(),
                             candidate_source_layer=-1, dspark_block_size=0, dspark_target_layer_ids=())
    model = build_model(args, seed=1, dtype=torch.float32)
    m = args.hc_mult
    seen, pres = [], []

    class StubBlock(nn.Module):
        def __init__(self, k):
            super().__init__()
            self.k = k

        def forward(self, h, pre, state):
            seen.append((h.clone(), pre.clone()))
            new_pre = torch.rand(pre.shape) + 0.2
            pres.append(new_pre)
            return h * (1.0 + self.k) + self.k, new_pre

    model.layers = nn.ModuleList([StubBlock(1), StubBlock(2)])
    ids = torch.randint(0, args.vocab_size, (2, 5))
    with torch.no_grad():
        logits = model(ids, start_pos=0)
    h0, pre0 = seen[0]
    emb = model.embed.weight[ids]
    assert torch.equal(h0, emb.unsqueeze(2).expand(-1, -1, m, -1))
    assert torch.equal(pre0, torch.tensor([1.0, 0.0, 0.0, 0.0]).expand(2, 5, m))
    assert torch.equal(seen[1][1], pres[0])
    h_final = (emb.unsqueeze(2).expand(-1, -1, m, -1) * 2 + 1) * 3 + 2
    x = ref.rmsnorm(ref.collapse(h_final, pres[1]), model.norm.weight, args.norm_eps)
    exp = x[:, -1] @ model.head.weight.double().T
    assert logits.dtype == torch.float32 and logits.shape == (2, args.vocab_size)
    torch.testing.assert_close(logits.double(), exp, rtol=1e-4, atol=1e-4)
