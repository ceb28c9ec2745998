"""Mixture of experts (spec §7): the fp32 router with a selection-only bias, SwiGLU experts with
clamps, the routing weight applied before w2, and the fp32 accumulation in expert order.

Routed experts are stored stacked ([E, out, in] per projection): bf16 models run them as one
grouped GEMM per projection over the tokens sorted by expert, other dtypes gather the active
experts' weights for a few tokens or loop over the experts. The state dict still uses the official
names `experts.{e}.w1.weight` etc.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv41c.config import ModelArgs
from dsv41c.nn import BYTE_STORED, Linear, batched_linear, frozen_param, linear, linear_storage, weight_format

PROJECTIONS = ("w1", "w2", "w3")


@torch.library.custom_op("dsv41c::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(a [M, K], b [G, K, N], offs=offs)` -> [M, N] as an op of our own, opaque to
    Inductor: an exported package calls it through AOTInductor's proxy executor. For a torch whose
    AOTInductor has no C shim for `_grouped_mm` on the device (torch 2.11 on CUDA), so that an export
    keeps the experts' grouped GEMMs instead of tracing one GEMM per expert."""
    return torch._grouped_mm(a, b, offs=offs)


@grouped_mm.register_fake
def _grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(g) * u in fp32; with a limit, u is clamped both sides and g from above only."""
    g, u = g.float(), u.float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return F.silu(g) * u


class Gate(nn.Module):
    def __init__(self, args: ModelArgs, n_experts: int, topk: int, dtype: torch.dtype):
        super().__init__()
        self.topk, self.score_func = topk, args.score_func
        self.temp, self.route_scale, self.norm_topk = args.gate_temp, args.route_scale, args.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(n_experts, args.dim, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> routing weights [N, k] fp32 and expert ids [N, k] (descending score + bias)."""
        z = F.linear(x.float(), self.weight.float()) / self.temp
        if self.score_func == "sqrtsoftplus":
            scores = F.softplus(z).sqrt()
        elif self.score_func == "sigmoid":
            scores = torch.sigmoid(z)
        else:
            scores = torch.softmax(z, dim=-1)
        ids = (scores + self.bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk and self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, ids


class Expert(nn.Module):
    """The shared expert: a SwiGLU MLP with Q-Linear weights and no routing weight."""

    def __init__(self, dim: int, inter: int, fmt: str, dtype: torch.dtype, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = Linear(dim, inter, fmt, dtype)
        self.w2 = Linear(inter, dim, fmt, dtype)
        self.w3 = Linear(dim, inter, fmt, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit).to(x.dtype))


class Experts(nn.Module):
    """E routed experts, each projection stacked: `w1` [E, F, D], `w3` [E, F, D], `w2` [E, D, F]
    (plus `*_scale` for fp8/fp4 storage; fp4 weights hold two values per byte)."""

    def __init__(self, n: int, dim: int, inter: int, fmt: str, dtype: torch.dtype, limit: float):
        super().__init__()
        self.n, self.fmt, self.limit = n, fmt, limit
        self.logical: dict[str, torch.dtype] = {}      # byte-stored tensors and their own dtype
        for name, (out_f, in_f) in {"w1": (inter, dim), "w2": (dim, inter), "w3": (inter, dim)}.items():
            if fmt == "dense":
                self.register_parameter(name, nn.Parameter(torch.empty(n, out_f, in_f, dtype=dtype)))
                self.register_parameter(f"{name}_scale", None)
                continue
            storage = linear_storage(fmt, in_f, out_f)
            for part, key in (("weight", name), ("scale", f"{name}_scale")):
                shape, sdtype = storage[part]
                self.register_parameter(key, frozen_param((n, *shape), sdtype))
                if sdtype in BYTE_STORED:
                    self.logical[key] = sdtype
        self.register_state_dict_post_hook(_split_experts)
        self.register_load_state_dict_pre_hook(_stack_experts)

    def _proj(self, name: str, e) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, scale = getattr(self, name), getattr(self, f"{name}_scale")
        return weight[e], None if scale is None else scale[e]

    def one(self, e: int, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        """Expert e on its tokens x [n, D] with routing weights [n] fp32."""
        h = swiglu(linear(x, *self._proj("w1", e), self.fmt), linear(x, *self._proj("w3", e), self.fmt), self.limit)
        return linear((route.unsqueeze(-1) * h).to(x.dtype), *self._proj("w2", e), self.fmt)

    def gathered(self, x: torch.Tensor, route: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every (token, slot) pair with its own gathered expert weights: x [N, D], ids [N, k]
        -> [N, k, D]. Cost grows with the active experts only, with no data-dependent shapes."""
        n, k = ids.shape
        xs = x.unsqueeze(1).expand(n, k, -1).reshape(n * k, -1)
        flat = ids.reshape(-1)

        def proj(name, inp):
            return batched_linear(inp, *self._proj(name, flat), self.fmt)

        h = swiglu(proj("w1", xs), proj("w3", xs), self.limit)
        out = proj("w2", (route.reshape(-1, 1) * h).to(x.dtype))
        return out.view(n, k, -1)

    # True while C++ wrapper code is traced (`dsv41c.export`, `dsv41c.compile(cpp_wrapper=True)`) for a
    # device whose C shims lack `_grouped_mm`: the same GEMMs through the opaque `dsv41c::grouped_mm`
    # (`compiler.opaque_grouped_mm`)
    opaque_grouped_mm = False

    def groupable(self, x: torch.Tensor) -> bool:
        """Whether `grouped` applies: dense bf16 weights and input (the grouped GEMM's one dtype)."""
        return self.fmt == "dense" and x.dtype == self.w1.dtype == torch.bfloat16

    def grouped(self, x: torch.Tensor, route: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same as `gathered` through one grouped GEMM per projection: the (token, slot) pairs
        sorted by expert, each group against its expert's weight. No weight copies, no
        data-dependent shapes and no host synchronisation, for any number of tokens."""
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        experts = torch.arange(self.n, device=ids.device, dtype=flat.dtype)
        ends = torch.searchsorted(flat[order], experts, right=True).to(torch.int32)   # group e = rows < ends[e]

        mm = torch.ops.dsv41c.grouped_mm if self.opaque_grouped_mm else torch._grouped_mm

        def proj(name, inp):
            # torch._grouped_mm: the op behind torch 2.13's F.grouped_mm, present across the pinned range
            return mm(inp, getattr(self, name).transpose(-2, -1), offs=ends)

        xs = x[order // k]
        h = swiglu(proj("w1", xs), proj("w3", xs), self.limit)
        y = proj("w2", (route.reshape(-1)[order].unsqueeze(-1) * h).to(x.dtype))
        out = torch.empty_like(y).index_copy_(0, order, y)            # back to (token, slot) order
        return out.view(n, k, -1)


def _split_experts(module: Experts, state_dict, prefix, local_metadata) -> None:
    for name in PROJECTIONS:
        for suffix, key in (("weight", name), ("scale", f"{name}_scale")):
            stacked = state_dict.pop(prefix + key, None)
            if stacked is not None:
                if key in module.logical:
                    stacked = stacked.view(module.logical[key])
                for e in range(module.n):
                    state_dict[f"{prefix}{e}.{name}.{suffix}"] = stacked[e]


def _stack_experts(module: Experts, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    for name in PROJECTIONS:
        for suffix, key in (("weight", name), ("scale", f"{name}_scale")):
            keys = [f"{prefix}{e}.{name}.{suffix}" for e in range(module.n)]
            if all(k in state_dict for k in keys):
                parts = [state_dict.pop(k) for k in keys]
                if key in module.logical:
                    parts = [p.view(torch.uint8) for p in parts]
                state_dict[prefix + key] = torch.stack(parts)


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, n_experts: int, topk: int, dtype: torch.dtype):
        super().__init__()
        fmt, expert_fmt = weight_format(args.dtype), weight_format(args.expert_dtype or args.dtype)
        self.n_experts = n_experts
        self.gate = Gate(args, n_experts, topk, dtype)
        self.experts = Experts(n_experts, args.dim, args.moe_inter_dim, expert_fmt, dtype, args.swiglu_limit)
        self.shared_experts = Expert(args.dim, args.moe_inter_dim, fmt, dtype, args.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        route, ids = self.gate(x)
        ids, order = ids.sort(dim=-1)              # each token's experts in increasing id: the §7 order
        route = route.gather(1, order)
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        # bf16: grouped GEMMs; few tokens (decode): gathered weights; otherwise one expert at a time.
        if self.experts.groupable(x):
            outs = self.experts.grouped(x, route, ids)
        elif ids.numel() <= self.n_experts:
            outs = self.experts.gathered(x, route, ids)
        else:
            outs = None
            for e in range(self.n_experts):
                token, slot = torch.nonzero(ids == e, as_tuple=True)     # may be empty: a 0-row GEMM
                acc.index_add_(0, token, self.experts.one(e, x[token], route[token, slot]).float())
        if outs is not None:
            # slot j holds each token's j-th expert in increasing id: adding the slots in turn is the
            # per-expert order
            for j in range(ids.shape[1]):
                acc = acc + outs[:, j].float()
        acc = acc + self.shared_experts(x).float()
        return acc.to(x.dtype).view(shape)
