"""mHC hyper-connections in plain eager ops (spec §5): the coefficient mixes, Sinkhorn,
collapse (hc_pre) and expand (hc_post).

These are the reference forms that the `lower_mhc` pass later pattern-matches and replaces.
"""
from __future__ import annotations

import torch


def sinkhorn(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax + eps, then alternate column / row normalisation: columns sum to ~1.

    c: [..., m, m] with c[i, j] = source i, destination j. Column sums run over i.
    """
    c = torch.softmax(c, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *,
             norm_eps: float, hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coefficients of one sublayer from the streams h [B, S, m, D].

    Returns pre [B, S, m], post [B, S, m] and comb [B, S, m, m] (source, destination), all fp32.
    """
    m = h.shape[-2]
    s = h.flatten(-2).float()
    rstd = torch.rsqrt(s.square().mean(dim=-1, keepdim=True) + norm_eps)
    raw = torch.nn.functional.linear(s, fn) * rstd
    pre = torch.sigmoid(raw[..., :m] * scale[0] + base[:m]) + hc_eps
    post = 2 * torch.sigmoid(raw[..., m:2 * m] * scale[1] + base[m:2 * m])
    comb = (raw[..., 2 * m:] * scale[2] + base[2 * m:]).unflatten(-1, (m, m))
    return pre, post, sinkhorn(comb, iters, hc_eps)


def hc_collapse(h: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y = sum_j w[j] * h[j] in fp32, rounded once to h.dtype.  h [B,S,m,D], w [B,S,m]."""
    return (weights.unsqueeze(-1) * h.float()).sum(dim=-2).to(h.dtype)


def hc_expand(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """h_new[j] = post[j] * y + sum_i comb[i, j] * res[i] in fp32, rounded once to res.dtype.

    The sum over the source stream i is an explicit broadcast product and sum (not a matmul):
    that fixes the fp32 addition order the reference uses.
    """
    mixed = (comb.unsqueeze(-1) * res.float().unsqueeze(-2)).sum(dim=-3)
    return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(res.dtype)

