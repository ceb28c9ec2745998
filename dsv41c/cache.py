"""Every piece of inference state, in one place (spec §3.5).

`ModelCache` is owned by the model and holds, per layer, the sliding-window ring and, at kv
sources, the compressed KV, the index keys and the ratio>=2 partial-group state; plus the
per-sequence n-gram history for Engram. All are non-persistent buffers sized by
`max_batch_size` and `max_seq_len`, so they never appear in checkpoints.

Storage is plain (the compute dtype, fake-quantised values when `kv_quant` is on). Keeping all
reads and writes behind this module is what lets a later pass switch the storage to packed FP8/FP4,
save/restore it, or fill the decoder part from a bounded replay.
"""
from __future__ import annotations

import torch
from torch import nn

from dsv41c.config import LayerRole, ModelArgs


class LayerCache(nn.Module):
    """State of one attention layer.

    window       [B, W, d_h]        ring: position t lives in slot t mod W
    kv           [B, L/rho, d_h]    compressed KV rows (kv sources)
    index_keys   [B, L/rho, d_I]    index keys (kv sources that are also index sources)
    group_kv     [B, rho, d_h] fp32 partial group values (kv sources with rho >= 2)
    group_score  [B, rho, d_h] fp32 partial group scores, -inf when empty
    """

    def __init__(self, args: ModelArgs, role: LayerRole, dtype: torch.dtype):
        super().__init__()
        b, w, d = args.max_batch_size, args.window_size, args.head_dim
        self.register_buffer("window", torch.zeros(b, w, d, dtype=dtype), persistent=False)
        self.has_kv = role.is_kv_source
        self.has_index_keys = role.owns_index_keys
        self.has_group = role.is_kv_source and role.ratio >= 2
        if self.has_kv:
            rows = args.max_seq_len // role.ratio
            self.register_buffer("kv", torch.zeros(b, rows, d, dtype=dtype), persistent=False)
        if self.has_index_keys:
            rows = args.max_seq_len // role.ratio
            self.register_buffer("index_keys", torch.zeros(b, rows, args.index_head_dim, dtype=dtype),
                                 persistent=False)
        if self.has_group:
            self.register_buffer("group_kv", torch.zeros(b, role.ratio, d), persistent=False)
            self.register_buffer("group_score", torch.full((b, role.ratio, d), float("-inf")), persistent=False)

    def reset(self) -> None:
        self.window.zero_()
        if self.has_kv:
            self.kv.zero_()
        if self.has_index_keys:
            self.index_keys.zero_()
        if self.has_group:
            self.group_kv.zero_()
            self.group_score.fill_(float("-inf"))


class ModelCache(nn.Module):
    """All layers' caches plus the n-gram id history [B, max_seq_len] (int64)."""

    def __init__(self, args: ModelArgs, plan: list[LayerRole], dtype: torch.dtype):
        super().__init__()
        self.layers = nn.ModuleList(LayerCache(args, role, dtype) for role in plan)
        self.register_buffer("ngram", torch.zeros(args.max_batch_size, args.max_seq_len, dtype=torch.long),
                             persistent=False)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.ngram.zero_()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())
