"""MoE (MODEL.md §7): router, SwiGLU clamps, routing weight before w2, expert accumulation."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from dsv41c.moe import MoE, Gate, swiglu


def _softplus(v: float) -> float:
    return v if v > 20 else math.log1p(math.exp(v))


def _silu(v: float) -> float:
    return v / (1.0 + math.exp(-v))


# ------------------------------------------------------------------ router
def _gate(args, n, k, weight, bias):
    g = Gate(args, n, k, torch.float32)
    with torch.no_grad():
        g.weight.copy_(weight)
        g.bias.copy_(bias)
    return g


def test_gate_sqrtsoftplus_bias_selects_unbiased_weights_hand_case(tiny_args):
    args = dataclasses.replace(tiny_args, route_scale=1.5, score_func="sqrtsoftplus", norm_topk_prob=True)
    gate = _gate(args, 4, 2, torch.eye(4, args.dim), torch.tensor([0.0, -5.0, 0.0, 10.0]))
    x = torch.zeros(1, args.dim)
    x[0, :4] = torch.tensor([1.0, 3.0, 2.0, -1.0])                  # z = x . W^T = (1, 3, 2, -1)
    w, ids = gate(x)
    sig = [math.sqrt(_softplus(z)) for z in (1.0, 3.0, 2.0, -1.0)]
    # selection by sigma + bias: expert 3 (-1 + 10) first, then expert 2; expert 1 (best raw score)
    # is pushed out by its bias
    assert ids.tolist() == [[3, 2]]
    tot = sig[3] + sig[2] + 1e-20
    exp = [sig[3] / tot * 1.5, sig[2] / tot * 1.5]                  # weights from the UNBIASED scores
    assert w.dtype == torch.float32
    torch.testing.assert_close(w.double(), torch.tensor([exp], dtype=torch.float64), rtol=1e-6, atol=0)


def test_gate_normaliser_constant_is_1e20_not_norm_eps(tiny_args):
    # sigmoid scores ~2e-22: w / (sum w + 1e-20) is far from the plain ratio; norm_eps is set to
    # something else to show it does not enter.
    args = dataclasses.replace(tiny_args, score_func="sigmoid", route_scale=1.0, norm_eps=1e-6)
    gate = _gate(args, 3, 2, torch.eye(3, args.dim), torch.zeros(3))
    x = torch.zeros(1, args.dim)
    x[0, :3] = torch.tensor([-50.0, -51.0, -60.0])
    w, ids = gate(x)
    assert ids.tolist() == [[0, 1]]
    s0, s1 = 1 / (1 + math.exp(50.0)), 1 / (1 + math.exp(51.0))
    exp = torch.tensor([[s0 / (s0 + s1 + 1e-20), s1 / (s0 + s1 + 1e-20)]], dtype=torch.float64)
    torch.testing.assert_close(w.double(), exp, rtol=1e-5, atol=0)
    assert w.sum() < 0.05                                            # not renormalised to 1


def test_gate_no_normalisation_for_k1_and_temperature(tiny_args):
    args = dataclasses.replace(tiny_args, route_scale=2.0, gate_temp=2.0)
    gate = _gate(args, 4, 1, torch.eye(4, args.dim), torch.zeros(4))
    x = torch.zeros(1, args.dim)
    x[0, :4] = torch.tensor([0.5, 4.0, 50.0, -3.0])
    w, ids = gate(x)
    assert ids.tolist() == [[2]]
    # z / gate_temp = 25 (> 20: softplus is linear), k = 1: no renormalisation, times route_scale
    torch.testing.assert_close(w.double(), torch.tensor([[math.sqrt(_softplus(25.0)) * 2.0]],
                                                        dtype=torch.float64), rtol=1e-6, atol=0)


def test_gate_random_against_naive(tiny_args):
    args = tiny_args
    E, k = 8, 3
    weight, bias = torch.randn(E, args.dim) * args.dim ** -0.5, torch.randn(E) * 0.3
    gate = _gate(args, E, k, weight, bias)
    x = torch.randn(10, args.dim).to(torch.bfloat16)                 # router math is fp32 anyway
    w, ids = gate(x)
    for n in range(10):
        z = (weight.double() @ x[n].double()).tolist()
        sig = [math.sqrt(_softplus(v)) for v in z]
        order = sorted(range(E), key=lambda e: -(sig[e] + bias[e].item()))[:k]   # descending
        assert ids[n].tolist() == order
        tot = sum(sig[e] for e in order) + 1e-20
        torch.testing.assert_close(w[n].double(), torch.tensor([sig[e] / tot * args.route_scale for e in order],
                                                               dtype=torch.float64), rtol=1e-5, atol=0)


# ------------------------------------------------------------------ SwiGLU
def test_swiglu_clamps_hand_case():
    g = torch.tensor([20.0, -20.0, 5.0, 12.0, -3.0])
    u = torch.tensor([15.0, -15.0, 3.0, -11.0, 0.5])
    y = swiglu(g, u, 10.0)
    # up clamped to [-10, 10]; gate only from above (min(g, 10)); -20 stays -20
    exp = [_silu(10.0) * 10.0, _silu(-20.0) * -10.0, _silu(5.0) * 3.0, _silu(10.0) * -10.0, _silu(-3.0) * 0.5]
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), torch.tensor(exp, dtype=torch.float64), rtol=1e-6, atol=1e-12)
    y0 = swiglu(g, u, 0.0)                                           # limit 0: no clamp
    exp0 = [_silu(a) * b for a, b in zip(g.tolist(), u.tolist())]
    torch.testing.assert_close(y0.double(), torch.tensor(exp0, dtype=torch.float64), rtol=1e-6, atol=1e-12)
    yb = swiglu(g.bfloat16(), u.bfloat16(), 10.0)                    # bf16 inputs computed in fp32
    assert yb.dtype == torch.float32


# ------------------------------------------------------------------ whole MoE
def _moe(args, dtype, E=4, k=2, big=4.0):
    moe = MoE(args, E, k, dtype)
    D, Fi = args.dim, args.moe_inter_dim
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(E, D) * D ** -0.5)
        moe.gate.bias.copy_(torch.randn(E) * 0.1)
        moe.experts.w1.copy_(torch.randn(E, Fi, D) * big * D ** -0.5)     # large: clamps get hit
        moe.experts.w3.copy_(torch.randn(E, Fi, D) * big * D ** -0.5)
        moe.experts.w2.copy_(torch.randn(E, D, Fi) * Fi ** -0.5)
        moe.shared_experts.w1.weight.copy_(torch.randn(Fi, D) * big * D ** -0.5)
        moe.shared_experts.w3.weight.copy_(torch.randn(Fi, D) * big * D ** -0.5)
        moe.shared_experts.w2.weight.copy_(torch.randn(D, Fi) * Fi ** -0.5)
    return moe


def _naive_moe(moe, args, x):
    """Per-token loop of §7 in float64."""
    L = args.swiglu_limit
    E, k = moe.n_experts, moe.gate.topk
    Wg, bias = moe.gate.weight.double(), moe.gate.bias.double()

    def expert(w1, w3, w2, xv, route=1.0):
        g = w1.double() @ xv
        u = w3.double() @ xv
        if L > 0:
            u = u.clamp(-L, L)
            g = g.clamp(max=L)
        return w2.double() @ (route * F.silu(g) * u)

    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for n in range(x.shape[0]):
        xv = x[n].double()
        sig = [math.sqrt(_softplus(v)) for v in (Wg @ xv).tolist()]
        sel = sorted(range(E), key=lambda e: -(sig[e] + bias[e].item()))[:k]
        tot = sum(sig[e] for e in sel) + 1e-20
        for e in sel:
            out[n] += expert(moe.experts.w1[e], moe.experts.w3[e], moe.experts.w2[e], xv,
                             sig[e] / tot * args.route_scale)
        se = moe.shared_experts
        out[n] += expert(se.w1.weight, se.w3.weight, se.w2.weight, xv)
    return out


@pytest.mark.parametrize("n_tokens", [1, 2, 7])                      # 1, 2: gathered path; 7: per-expert loop
def test_moe_fp32_against_per_token_loop(tiny_args, n_tokens):
    args = tiny_args
    assert args.swiglu_limit == 10.0 and args.route_scale == 1.5
    moe = _moe(args, torch.float32)
    x = torch.randn(1, n_tokens, args.dim)
    with torch.no_grad():
        out = moe(x)
    assert out.shape == x.shape and out.dtype == torch.float32
    exp = _naive_moe(moe, args, x[0])
    torch.testing.assert_close(out[0].double(), exp, rtol=1e-4, atol=1e-4)


def test_moe_clamps_are_exercised(tiny_args):
    moe = _moe(tiny_args, torch.float32)
    x = torch.randn(16, tiny_args.dim)
    g = torch.einsum("efd,nd->nef", moe.experts.w1, x)
    assert (g > 10).any() and (g < -10).any()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_moe_gathered_and_loop_paths_agree(tiny_args, dtype, tol):
    moe = _moe(tiny_args, dtype)
    x = torch.randn(9, tiny_args.dim).to(dtype)
    with torch.no_grad():
        batched = moe(x.view(1, 9, -1))[0]                           # 9*2 > 4 experts: per-expert loop
        singles = torch.cat([moe(x[i].view(1, 1, -1))[0] for i in range(9)])   # 2 <= 4: gathered
        pairs = moe(x[:2].view(1, 2, -1))[0]                          # 2*2 = 4 <= 4: gathered
    scale = batched.float().abs().max()
    assert (singles.float() - batched.float()).abs().max() <= tol * scale
    assert (pairs.float() - batched[:2].float()).abs().max() <= tol * scale


def test_expert_routing_weight_applied_before_w2_bf16(tiny_args):
    """out_e = w2(bf16(route * silu(g) * u)) in bf16: the routing weight multiplies the fp32
    intermediate before the bf16 cast and w2, not the expert output."""
    torch.manual_seed(1234)
    args = tiny_args
    moe = _moe(args, torch.bfloat16)
    ex = moe.experts
    x = torch.randn(6, args.dim).to(torch.bfloat16)
    route = torch.rand(6) * 1.5 + 0.1
    L = args.swiglu_limit
    e = 2
    got = ex.one(e, x, route)
    g = F.linear(x, ex.w1[e]).float().clamp(max=L)
    u = F.linear(x, ex.w3[e]).float().clamp(-L, L)
    h = F.silu(g) * u
    before = F.linear((route[:, None] * h).to(torch.bfloat16), ex.w2[e])
    after = (route[:, None] * F.linear(h.to(torch.bfloat16), ex.w2[e]).float()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, before)
    assert not torch.equal(got, after)


def test_moe_accumulates_in_fp32_expert_order_then_shared(tiny_args):
    """bf16 MoE on many tokens = fp32 acc of the bf16 expert outputs (ascending expert id), plus the
    shared expert, one bf16 rounding at the end."""
    args = tiny_args
    moe = _moe(args, torch.bfloat16)
    x = torch.randn(12, args.dim).to(torch.bfloat16)
    with torch.no_grad():
        out = moe(x.view(1, 12, -1))[0]
        route, ids = moe.gate(x)
        L, ex, se = args.swiglu_limit, moe.experts, moe.shared_experts

        def hidden(w1, w3, xs):
            return F.silu(F.linear(xs, w1).float().clamp(max=L)) * F.linear(xs, w3).float().clamp(-L, L)

        acc = torch.zeros(12, args.dim)
        for e in range(moe.n_experts):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel():
                h = route[tok, slot][:, None] * hidden(ex.w1[e], ex.w3[e], x[tok])
                acc[tok] += F.linear(h.to(torch.bfloat16), ex.w2[e]).float()
        acc += F.linear(hidden(se.w1.weight, se.w3.weight, x).to(torch.bfloat16), se.w2.weight).float()
    assert torch.equal(out, acc.to(torch.bfloat16))
    exp = _naive_moe(moe, args, x)
    assert ((out.double() - exp).abs().max() / exp.abs().max()) < 3e-2


def per_expert_loop(moe, x):
    """§7's combination, one expert at a time through `Experts.one` in increasing id, then the
    shared expert: fp32 [N, D]."""
    route, ids = moe.gate(x)
    acc = torch.zeros(x.shape[0], x.shape[1], device=x.device)
    for e in range(moe.n_experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        acc.index_add_(0, tok, moe.experts.one(e, x[tok], route[tok, slot]).float())
    return acc + moe.shared_experts(x).float()


def test_bf16_grouped_path_equals_per_expert_loop_with_an_empty_expert(tiny_args):
    """bf16 dense experts take the grouped GEMM for every token count; an expert no token picks is
    an empty group. The result equals the per-expert loop (`Experts.one` in increasing expert id)."""
    moe = _moe(tiny_args, torch.bfloat16)
    with torch.no_grad():
        moe.gate.bias[1] = -1e4                                     # expert 1 is never selected
    x = torch.randn(11, tiny_args.dim).to(torch.bfloat16)
    with torch.no_grad():
        assert not (moe.gate(x)[1] == 1).any() and moe.experts.groupable(x)
        loop = per_expert_loop(moe, x)
        for n in (1, 2, 11):                                        # decode-sized and prefill-sized
            assert torch.equal(moe(x[:n].view(1, n, -1))[0], loop[:n].to(torch.bfloat16))


def test_bf16_moe_compiles_without_data_dependent_shapes(tiny_args):
    """The grouped path traces to one graph with no nonzero (no unbacked sizes, no host sync)."""
    moe = _moe(tiny_args, torch.bfloat16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(1, 9, tiny_args.dim).to(torch.bfloat16)
    with torch.no_grad():
        got = torch.compile(moe, backend=backend, fullgraph=True, dynamic=True)(x)
        assert torch.equal(got, moe(x))
    targets = [str(n.target) for n in graphs[0].graph.nodes]
    assert len(graphs) == 1 and not any("nonzero" in t for t in targets)
    assert sum("_grouped_mm" in t for t in targets) == 3
