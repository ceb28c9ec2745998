"""Shared fixtures for the component tests, plus naive float64 re-statements of spec formulas.

The helpers in `ref` are written from MODEL.md directly (per-token / per-element loops or plain
float64 tensor algebra); they never call the dsv41c function they are used to check.
"""
from __future__ import annotations

import json
import math
import pathlib
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv41c.config import ModelArgs

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The tiny models are all small ops: extra intra-op threads only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def record_tiny_cut(root: pathlib.Path, name: str, decode_steps: int, **overrides) -> pathlib.Path:
    """A golden recorded from tiny.json with `overrides` (a smaller model that still compiles in
    about a minute on one core): writes root/<name>.json and returns the golden file's path."""
    from dsv41c import golden
    raw = json.loads((ROOT / "configs" / "tiny.json").read_text())
    raw.update(overrides)
    config = root / f"{name}.json"
    config.write_text(json.dumps(raw))
    return golden.record(config, root / "golden", decode_steps=decode_steps)


# One layer of each compressed kind (Full, Reindex, Reuse at ratio 1, with the candidate funnel),
# 2 experts, no DSpark: the compile of the prefill graph grows with every layer and expert.
THREE_KINDS = dict(n_layers=3, n_mtp_layers=0, compress_ratios=[1, 1, 1], kv_source_layers=[0],
                   index_source_layers=[0, 1], candidate_source_layer=0, n_routed_experts=2,
                   n_activated_experts=1, dspark_block_size=0, dspark_target_layer_ids=[])
# every graph pass, in the order the compiled-model tests and benchmarks run them
EVERY_PASS = ("fuse_wqa_wkv", "lower_mhc", "fp4_kv", "lower_indexer", "lower_sparse_attn")
# tiny's first four layers, as tiny.json has them (its ratio-2 kv source and the layer reusing it,
# an Engram layer)
FIRST_FOUR = dict(n_layers=4, n_mtp_layers=0, compress_ratios=[0, 2, 2, 1], kv_source_layers=[1, 3],
                  index_source_layers=[1, 3], candidate_source_layer=3, dspark_block_size=0,
                  dspark_target_layer_ids=[], hc_sinkhorn_iters=1, engram_layer_ids=[0], engram_num_embeddings=[1000])


def first_four_args(widths: str = "tiny") -> ModelArgs:
    """FIRST_FOUR at tiny.json's widths, or at bench.json's ("bench": dim 5120, 64 heads of 512, 32
    experts, its vocabulary, and its Sinkhorn iterations and an Engram table of its size, on layer 1)."""
    raw = json.loads((ROOT / "configs" / f"{widths}.json").read_text())
    own = dict(hc_sinkhorn_iters=raw["hc_sinkhorn_iters"], engram_layer_ids=[1],
               engram_num_embeddings=raw["engram_num_embeddings"][:1])
    raw.update(FIRST_FOUR)
    if widths == "bench":
        raw.update(own)
    return ModelArgs.from_dict(raw)


@pytest.fixture(scope="session")
def tiny_args() -> ModelArgs:
    """configs/tiny.json (dim 64, 4 heads of 64, d_r 16, W 16, 8 layers + 2 DSpark stages)."""
    return ModelArgs.from_json(ROOT / "configs" / "tiny.json")


@pytest.fixture(scope="session")
def tiny_model(tiny_args):
    """An fp32 tiny model without KV fake-quant (the exact debug twin), random weights, seed 0.

    Tests that use it may overwrite its caches but must not change its parameters or modules.
    """
    from dsv41c.weights import build_model
    return build_model(tiny_args, seed=0, dtype=torch.float32, kv_quant=False)


# ------------------------------------------------------------------ naive references (float64)
def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def base_freqs(d: int, base: float) -> torch.Tensor:
    """f_i = 1 / base^(2i/d), i = 0..d/2-1 (float64)."""
    return torch.tensor([1.0 / base ** (2 * i / d) for i in range(d // 2)], dtype=torch.float64)


def yarn_freqs(d: int, base: float, L: int, factor: float, beta_fast: int, beta_slow: int) -> torch.Tensor:
    """Spec §6.1 with the YaRN blend (lo/hi compared with the pair index), float64."""
    f = base_freqs(d, base)
    if L <= 0:
        return f

    def c(r):
        return d * math.log(L / (2 * math.pi * r)) / (2 * math.log(base))

    lo = max(math.floor(c(beta_fast)), 0)
    hi = min(math.ceil(c(beta_slow)), d - 1)
    out = []
    for i in range(d // 2):
        ramp = min(max((i - lo) / max(hi - lo, 0.001), 0.0), 1.0)
        out.append(f[i].item() / factor * ramp + f[i].item() * (1 - ramp))
    return torch.tensor(out, dtype=torch.float64)


def rope(x: torch.Tensor, pos, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*len(freqs) entries of x [..., T, (H,) d] as adjacent (re, im) pairs by
    exp(i * pos * f) (its conjugate for inverse). pos: sequence of T positions, for axis `-2` when
    x is [.., T, d] or axis -3 when x is [..., T, H, d] (pass heads=True via shape)."""
    x = x.double().clone()
    d_r = 2 * len(freqs)
    pos = torch.as_tensor(pos, dtype=torch.float64)
    ang = pos[:, None] * freqs[None, :]                       # [T, d_r/2]
    if x.dim() == 4:                                          # [B, T, H, d]
        ang = ang[:, None, :]
    z = torch.complex(x[..., -d_r::2], x[..., -d_r + 1::2])
    rot = torch.polar(torch.ones_like(ang), -ang if inverse else ang)
    z = z * rot
    x[..., -d_r::2] = z.real
    x[..., -d_r + 1::2] = z.imag
    return x


def sinkhorn(c, iters: int, eps: float):
    """Python-float Sinkhorn on one m x m matrix (list of lists), exactly the §5.2 recipe."""
    m = len(c)
    out = []
    for i in range(m):
        mx = max(c[i])
        e = [math.exp(v - mx) for v in c[i]]
        s = sum(e)
        out.append([v / s + eps for v in e])

    def col(a):
        sums = [sum(a[i][j] for i in range(m)) for j in range(m)]
        return [[a[i][j] / (sums[j] + eps) for j in range(m)] for i in range(m)]

    def row(a):
        sums = [sum(a[i]) for i in range(m)]
        return [[a[i][j] / (sums[i] + eps) for j in range(m)] for i in range(m)]

    out = col(out)
    for _ in range(iters - 1):
        out = col(row(out))
    return out


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def mixes(h: torch.Tensor, fn, scale, base, norm_eps: float, hc_eps: float, iters: int):
    """Per-token loop of §5.1 + §5.2. h [B,S,m,D] -> pre [B,S,m], post [B,S,m], comb [B,S,m,m] (f64)."""
    B, S, m, D = h.shape
    fn, scale, base = fn.double(), scale.double().tolist(), base.double().tolist()
    pre = torch.zeros(B, S, m, dtype=torch.float64)
    post = torch.zeros(B, S, m, dtype=torch.float64)
    comb = torch.zeros(B, S, m, m, dtype=torch.float64)
    for b in range(B):
        for t in range(S):
            s = h[b, t].double().reshape(-1)                  # stream-major
            mu = (s * s).mean().item()
            raw = (fn @ s).tolist()
            r = 1.0 / math.sqrt(mu + norm_eps)
            raw = [v * r for v in raw]
            for j in range(m):
                pre[b, t, j] = sigmoid(raw[j] * scale[0] + base[j]) + hc_eps
                post[b, t, j] = 2 * sigmoid(raw[m + j] * scale[1] + base[m + j])
            c = [[raw[2 * m + i * m + j] * scale[2] + base[2 * m + i * m + j] for j in range(m)]
                 for i in range(m)]
            comb[b, t] = torch.tensor(sinkhorn(c, iters, hc_eps), dtype=torch.float64)
    return pre, post, comb


def collapse(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = sum_j w[j] h[j] (f64). h [B,S,m,D], w [B,S,m]."""
    return sum(w[..., j, None].double() * h[..., j, :].double() for j in range(h.shape[-2]))


def expand(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """h_new[j] = post[j] y + sum_i comb[i,j] res[i] (f64); comb's first index is the source."""
    m = res.shape[-2]
    outs = []
    for j in range(m):
        acc = post[..., j, None].double() * y.double()
        for i in range(m):
            acc = acc + comb[..., i, j, None].double() * res[..., i, :].double()
        outs.append(acc)
    return torch.stack(outs, dim=-2)


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of bfloat16 numbers at |v| (8 significant bits), float64."""
    a = v.double().abs().clamp_min(2.0 ** -126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


@pytest.fixture(scope="session")
def ref():
    return SimpleNamespace(rmsnorm=rmsnorm, base_freqs=base_freqs, yarn_freqs=yarn_freqs, rope=rope,
                           sinkhorn=sinkhorn, sigmoid=sigmoid, mixes=mixes, collapse=collapse,
                           expand=expand, bf16_ulp=bf16_ulp)


def cache_read(rows: torch.Tensor, capacity: int, batch_max: int) -> torch.Tensor:
    """Packed rows [B, n, c] (uint8) as a cache read sees them: `buf[:B, :n]` of a [batch_max,
    capacity, c] buffer whose other rows hold random bytes (a strided view, like `RowStore.read`'s)."""
    b, n, c = rows.shape
    buf = torch.randint(0, 256, (batch_max, capacity, c), dtype=torch.uint8, device=rows.device)
    buf[:b, :n] = rows
    return buf[:b, :n]


class CopyRecorder(TorchDispatchMode):
    """Records the aten ops that copy tensor data (clone, copy_, _to_copy) run under it."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).split(".")[1] in ("clone", "copy_", "_to_copy"):
            self.copies.append(str(func))
        return func(*args, **(kwargs or {}))
