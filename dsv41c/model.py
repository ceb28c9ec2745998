"""The eager reference model (spec §4): embedding, hc expansion, Engram, blocks with the delayed
mHC pre-mix, final collapse, norm and head. DSpark stages live in `dspark.py`.

Public call surface (kept stable; a checker drives it):
    logits = model(input_ids [B, S], start_pos=0, full_logits=True)   -> [B, S, V] fp32
    logits = model(next_ids [B, 1], start_pos=S)                      -> [B, V] fp32
"""
from __future__ import annotations

import torch
from torch import nn

from dsv41c import mhc
from dsv41c.attention import Attention, CallState, DSparkAttention
from dsv41c.cache import ModelCache
from dsv41c.config import LayerRole, ModelArgs, build_layer_plan
from dsv41c.engram_hash import EngramLayout, engram_hash_ids
from dsv41c.errors import InputError
from dsv41c.moe import MoE
from dsv41c.nn import (Linear, RMSNorm, frozen_param, rope_frequencies, rope_table, show_logical_dtypes,
                       uninitialised, weight_format)
from dsv41c.quant import dequant_fp8_rows
from dsv41c.tokenizer import Tokenizer


class Engram(nn.Module):
    """Gated n-gram memory injected into every stream before the block (spec §8.5)."""

    def __init__(self, args: ModelArgs, rows: int, dtype: torch.dtype):
        super().__init__()
        m, d, e_d = args.hc_mult, args.dim, args.engram_head_dim
        self.eps = args.norm_eps
        self.embed = nn.Module()
        self.embed.weight = frozen_param((rows, e_d), torch.float8_e4m3fn)
        self.embed.scale = frozen_param((rows, e_d // 32), torch.float8_e8m0fnu)
        show_logical_dtypes(self.embed, {"scale": torch.float8_e8m0fnu})
        self.wkv = Linear(args.engram_n_hash_cols * e_d, d * (m + 1), weight_format(args.dtype), dtype)
        self.q_weight = nn.Parameter(torch.empty(m, d, dtype=dtype))
        self.k_weight = nn.Parameter(torch.empty(m, d, dtype=dtype))

    def forward(self, h: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        """h [B,S,m,D], hash_ids [B,S,C] -> h with gate_j * value added to every stream j."""
        b, s, m, d = h.shape
        # gather raw bytes: the float8 storage dtypes have no indexing/codegen support everywhere
        values, scales = self.embed.weight.view(torch.uint8), self.embed.scale.view(torch.uint8)
        rows = dequant_fp8_rows(values[hash_ids], scales[hash_ids]).to(h.dtype)
        kv = self.wkv(rows.flatten(-2))
        key = kv[..., :m * d].float().unflatten(-1, (m, d))
        value = kv[..., m * d:].float()
        omega = self.q_weight.float() * self.k_weight.float()
        hf = h.float()
        r = torch.rsqrt(hf.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (hf * omega * key).sum(-1) * r * d ** -0.5
        gate = torch.sigmoid(dot.sign() * dot.abs().clamp(min=1e-6).sqrt())
        return (hf + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(h.dtype)


class Block(nn.Module):
    """One layer: attention and MoE sublayers, each wrapped in mHC with a delayed pre-mix (§4.1)."""

    def __init__(self, args: ModelArgs, role: LayerRole, dtype: torch.dtype, kv_quant: bool):
        super().__init__()
        mix, flat = args.hc_mix_dim, args.hc_mult * args.dim
        self.hc = dict(norm_eps=args.norm_eps, hc_eps=args.hc_eps, iters=args.hc_sinkhorn_iters)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.empty(mix, flat, dtype=torch.float32)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.empty(mix, dtype=torch.float32)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32)))
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.attn = (DSparkAttention if role.is_mtp else Attention)(args, role, dtype, kv_quant)
        n_exp = (args.dspark_n_routed_experts or args.n_routed_experts) if role.is_mtp else args.n_routed_experts
        k = (args.dspark_n_activated_experts or args.n_activated_experts) if role.is_mtp else args.n_activated_experts
        self.ffn = MoE(args, n_exp, k, dtype)

    def mixes(self, site: str, h: torch.Tensor):
        return mhc.hc_mixes(h, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_scale"),
                            getattr(self, f"hc_{site}_base"), **self.hc)

    def forward(self, h: torch.Tensor, pre: torch.Tensor, state: CallState) -> tuple[torch.Tensor, torch.Tensor]:
        a_pre, a_post, a_comb = self.mixes("attn", h)
        x = self.attn(self.attn_norm(mhc.hc_collapse(h, pre)), state)
        h = mhc.hc_expand(x, h, a_post, a_comb)
        f_pre, f_post, f_comb = self.mixes("ffn", h)
        x = self.ffn(self.ffn_norm(mhc.hc_collapse(h, a_pre)))
        h = mhc.hc_expand(x, h, f_post, f_comb)
        return h, f_pre


def check_token_range(ids: torch.Tensor, start_pos: int, vocab_size: int) -> None:
    """InputError for a token id outside 0..vocab_size-1. Reading the ids back from a device waits
    for the work queued before them, so a decode step's ids on the device (the previous step's
    argmax, in range by construction) are not read; host ids and every prefill are."""
    if ids.numel() and (ids.device.type == "cpu" or start_pos == 0):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise InputError(f"input_ids: token id {lo if lo < 0 else hi} outside the vocabulary "
                             f"0..{vocab_size - 1}")


class Transformer(nn.Module):
    """DeepSeek-V4.1-Flash backbone plus DSpark stages, with every cache owned by `self.cache`.

    dtype: torch.bfloat16 follows the reference rounding points; torch.float32 is the exact twin.
    kv_quant: apply the official KV fake-quantisation (FP8 window, FP4 compressed KV, MXFP4 index
    q/k). GEMM input quantisation follows the weight storage (`dtype: "fp8"`) regardless.
    kv_storage: "plain" caches hold compute-dtype rows; "packed" holds the deployment byte formats
    (needs kv_quant; the logits are identical, the cache is ~3.6x smaller).
    """

    def __init__(self, args: ModelArgs, tokenizer: Tokenizer | None = None, *,
                 dtype: torch.dtype = torch.float32, kv_quant: bool = False, kv_storage: str = "plain"):
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16):
            raise InputError(f"dtype: expected torch.float32 or torch.bfloat16, found {dtype}")
        if kv_storage == "packed" and not kv_quant:
            raise InputError("kv_storage='packed' stores the quantised formats: it needs kv_quant=True")
        self.args, self.dtype, self.kv_quant = args, dtype, kv_quant
        self.plan = build_layer_plan(args)
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer.byte_level()
        self.embed = uninitialised(nn.Embedding, args.vocab_size, args.dim, dtype=dtype)
        self.layers = nn.ModuleList(Block(args, self.plan[i], dtype, kv_quant) for i in range(args.n_layers))
        self.engram_layer_ids = list(args.engram_layer_ids)
        if self.engram_layer_ids:
            with torch.device("cpu"):
                self.engram_layout = EngramLayout(args, self.tokenizer)
            for i, rows in zip(self.engram_layer_ids, args.engram_num_embeddings):
                self.layers[i].engram = Engram(args, rows, dtype)
        self.norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.head = uninitialised(nn.Linear, args.dim, args.vocab_size, bias=False, dtype=torch.float32)
        self.mtp = nn.ModuleList()
        if args.n_mtp_layers:
            from dsv41c.dspark import DSparkStage
            self.mtp = nn.ModuleList(DSparkStage(args, self.plan[args.n_layers + j], j, dtype, kv_quant)
                                     for j in range(args.n_mtp_layers))
        self.cache = ModelCache(args, self.plan, dtype, kv_storage)
        half = args.rope_head_dim // 2
        self.register_buffer("rope_swa", torch.empty(args.max_seq_len + args.dspark_block_size, half, 2),
                             persistent=False)
        self.register_buffer("rope_compressed", torch.empty(args.max_seq_len, half, 2), persistent=False)
        self.init_buffers()

    def init_buffers(self) -> None:
        """(Re)compute the RoPE tables and clear every cache, e.g. after `to_empty`."""
        if self.device.type == "meta":
            return
        a = self.args
        with torch.device("cpu"):
            swa = rope_table(self.rope_swa.shape[0], rope_frequencies(a.rope_head_dim, a.rope_theta))
            comp = rope_table(a.max_seq_len, rope_frequencies(a.rope_head_dim, a.compress_rope_theta,
                              a.original_seq_len, a.rope_factor, a.beta_fast, a.beta_slow))
        self.rope_swa.copy_(swa)
        self.rope_compressed.copy_(comp)
        self.cache.reset()
        if self.engram_layer_ids:
            self.engram_layout.to(self.device).reset()

    # ---------------------------------------------------------------- checks
    def check_inputs(self, ids: torch.Tensor, start_pos: int) -> None:
        a = self.args
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise InputError(f"input_ids: expected an int64 tensor [B, S], found "
                             f"{getattr(ids, 'dtype', type(ids))} {tuple(getattr(ids, 'shape', ()))}")
        b, s = ids.shape
        if not 1 <= b <= a.max_batch_size:
            raise InputError(f"input_ids: batch {b} outside 1..max_batch_size={a.max_batch_size}")
        if s < 1:
            raise InputError("input_ids: empty sequence")
        if start_pos < 0 or (start_pos > 0 and s != 1):
            raise InputError(f"start_pos={start_pos} with {s} tokens: calls are a prefill (start_pos=0) "
                             "or a one-token decode step (start_pos>0)")
        if start_pos + s > a.max_seq_len:
            raise InputError(f"sequence of {start_pos + s} tokens exceeds max_seq_len={a.max_seq_len}")
        if not torch.compiler.is_compiling():
            check_token_range(ids, start_pos, a.vocab_size)

    def call_state(self, batch: int, seqlen: int, start_pos: int) -> CallState:
        return CallState(start_pos, seqlen, batch, {"swa": self.rope_swa, "compressed": self.rope_compressed},
                         self.cache)

    # ---------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, start_pos: int = 0, full_logits: bool = False,
                return_hidden: bool = False):
        """Logits of the last position [B, V] (or all positions [B, S, V] with full_logits), fp32.

        With return_hidden, also the DSpark input: the concatenated stream means of the target
        layers' inputs [B, S, D*T] (None without DSpark targets).
        """
        self.check_inputs(input_ids, start_pos)
        b, s = input_ids.shape
        ids = input_ids.to(self.device).long()          # host ids (a tokenizer's) run on the model's device
        state = self.call_state(b, s, start_pos)
        hashes = None
        if self.engram_layer_ids:
            hashes = engram_hash_ids(self.engram_layout, ids, start_pos, self.cache.ngram[:b])
        h = self.embed(ids).unsqueeze(2).expand(-1, -1, self.args.hc_mult, -1)
        pre = self.one_hot_pre(b, s, h.device)
        targets = []
        for i, layer in enumerate(self.layers):
            if hasattr(layer, "engram"):
                h = layer.engram(h, hashes[:, :, self.engram_layer_ids.index(i)])
            if i in self.args.dspark_target_layer_ids:
                targets.append(h.mean(dim=2))
            h, pre = layer(h, pre, state)
        x = self.norm(mhc.hc_collapse(h, pre))
        logits = self.head((x if full_logits else x[:, -1]).float())
        if not return_hidden:
            return logits
        return logits, torch.cat(targets, dim=-1) if targets else None

    def one_hot_pre(self, b: int, s: int, device) -> torch.Tensor:
        pre = torch.zeros(b, s, self.args.hc_mult, dtype=torch.float32, device=device)
        pre[..., 0] = 1.0
        return pre

    @torch.no_grad()
    def draft(self, ids: torch.Tensor, main_hidden: torch.Tensor, start_pos: int,
              generator: torch.Generator | None = None):
        """DSpark draft pass (spec §9). See `dspark.draft`."""
        from dsv41c.dspark import draft
        return draft(self, ids, main_hidden, start_pos, generator)

    def reset_cache(self) -> None:
        self.cache.reset()

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def num_parameters(self) -> int:
        return sum(t.numel() * (2 if t.dtype == torch.float4_e2m1fn_x2 else 1) for t in self.state_dict().values())

