"""Every piece of inference state, in one place (spec §3.5).

`ModelCache` is owned by the model and holds, per layer, the sliding-window ring and, at kv
sources, the compressed KV, the index keys and the ratio>=2 partial-group state; plus the
per-sequence n-gram history for Engram. All are non-persistent buffers sized by
`max_batch_size` and `max_seq_len`, so they never appear in checkpoints.

Every read and write goes through `RowStore`, so the storage format is a property of the cache:
plain rows in the compute dtype, or the packed deployment formats of spec §10.5. The same narrow
interface is what save/restore and bounded replay build on.
"""
from __future__ import annotations

import torch
from torch import nn

from dsv41c import quant
from dsv41c.config import LayerRole, ModelArgs

# Packed storage: format -> (quantise to packed, dequantise, values per byte, values per scale byte)
CODECS = {
    "fp8": (quant.fp8_quant_ref, quant.fp8_dequant_ref, 1, 32),             # window KV, 528 B / 512
    "fp4_e4m3": (quant.fp4_e4m3_quant_ref, quant.fp4_e4m3_dequant_ref, 2, 16),   # compressed KV, 288 B
    "mxfp4": (quant.mxfp4_quant_ref, quant.mxfp4_dequant_ref, 2, 32),       # index keys, 68 B / 128
}
STORAGES = ("plain", "packed")


class RowStore(nn.Module):
    """Vectors [B, rows, d]: plain (`data` in the compute dtype) or packed (`codes` and `scales`,
    uint8, in one of CODECS). Packed rows read back exactly as the matching fake quantiser."""

    def __init__(self, batch: int, rows: int, dim: int, dtype: torch.dtype, fmt: str | None):
        super().__init__()
        self.fmt, self.dtype, self.rows = fmt, dtype, rows
        if fmt is None:
            self.register_buffer("data", torch.zeros(batch, rows, dim, dtype=dtype), persistent=False)
        else:
            _, _, per_byte, block = CODECS[fmt]
            self.register_buffer("codes", torch.zeros(batch, rows, dim // per_byte, dtype=torch.uint8),
                                 persistent=False)
            self.register_buffer("scales", torch.zeros(batch, rows, dim // block, dtype=torch.uint8),
                                 persistent=False)

    def write(self, rows, values: torch.Tensor) -> None:
        """Store values [B, n, d] at `rows` (a slice or an index tensor of n rows)."""
        b = values.shape[0]
        if self.fmt is None:
            self.data[:b, rows] = values
        else:
            codes, scales = CODECS[self.fmt][0](values)
            self.codes[:b, rows] = codes
            self.scales[:b, rows] = scales

    def read(self, batch: int, n: int | None = None) -> torch.Tensor:
        """Rows 0..n-1 (all rows by default) of the first `batch` sequences, [batch, n, d]."""
        if self.fmt is None:
            return self.data[:batch, :n]
        return CODECS[self.fmt][1](self.codes[:batch, :n], self.scales[:batch, :n], self.dtype)

    def reset(self) -> None:
        for buf in self.buffers():
            buf.zero_()


class LayerCache(nn.Module):
    """State of one attention layer.

    window       [B, W, d_h]        ring: position t lives in slot t mod W       (packed: FP8)
    kv           [B, L/rho, d_h]    compressed KV rows (kv sources)              (packed: FP4, E4M3/16)
    index_keys   [B, L/rho, d_I]    index keys (kv sources that are index sources) (packed: MXFP4)
    group_kv     [B, rho, d_h] fp32 partial group values (kv sources with rho >= 2)
    group_score  [B, rho, d_h] fp32 partial group scores, -inf when empty
    """

    def __init__(self, args: ModelArgs, role: LayerRole, dtype: torch.dtype, storage: str = "plain"):
        super().__init__()
        packed = storage == "packed"
        b, d = args.max_batch_size, args.head_dim
        self.window = RowStore(b, args.window_size, d, dtype, "fp8" if packed else None)
        self.kv = self.index_keys = None
        if role.is_kv_source:
            # ceil: decode writes the open group's provisional entry (Compressor.forward), also at the
            # last positions when max_seq_len is not a multiple of the ratio
            rows = -(-args.max_seq_len // role.ratio)
            self.kv = RowStore(b, rows, d, dtype, "fp4_e4m3" if packed else None)
            if role.owns_index_keys:
                self.index_keys = RowStore(b, rows, args.index_head_dim, dtype, "mxfp4" if packed else None)
        self.has_group = role.is_kv_source and role.ratio >= 2
        if self.has_group:
            self.register_buffer("group_kv", torch.zeros(b, role.ratio, d), persistent=False)
            self.register_buffer("group_score", torch.full((b, role.ratio, d), float("-inf")), persistent=False)

    def reset(self) -> None:
        for store in (self.window, self.kv, self.index_keys):
            if store is not None:
                store.reset()
        if self.has_group:
            self.group_kv.zero_()
            self.group_score.fill_(float("-inf"))


class ModelCache(nn.Module):
    """All layers' caches plus the n-gram id history [B, max_seq_len] (int64).

    storage "plain": rows in the compute dtype (fake-quantised values when kv_quant is on).
    storage "packed": the deployment formats (FP8 window, FP4 compressed KV, MXFP4 index keys);
    it implies the KV quantisation numerics.
    """

    def __init__(self, args: ModelArgs, plan: list[LayerRole], dtype: torch.dtype, storage: str = "plain"):
        super().__init__()
        if storage not in STORAGES:
            raise ValueError(f"kv storage: expected one of {STORAGES}, found {storage!r}")
        self.storage = storage
        self.layers = nn.ModuleList(LayerCache(args, role, dtype, storage) for role in plan)
        self.register_buffer("ngram", torch.zeros(args.max_batch_size, args.max_seq_len, dtype=torch.long),
                             persistent=False)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.ngram.zero_()

    def fill_synthetic(self, seed: int, vocab_size: int) -> None:
        """Random contents of each buffer's kind, as if a long context had been seen: values
        (normal), token ids (< vocab_size), packed codes and scales (bytes below 0x7F, which no
        format reads as NaN). For timing decode steps at positions whose prefill would not fit
        (benchmarks/compile.py --long-context); what those steps compute means nothing."""
        g = torch.Generator(device=self.ngram.device).manual_seed(seed)
        for name, buf in self.named_buffers():
            if buf.dtype in (torch.float32, torch.bfloat16, torch.float16):
                buf.normal_(generator=g)
            elif buf.dtype == torch.long:
                buf.random_(0, vocab_size, generator=g)
            elif buf.element_size() == 1:
                buf.view(torch.uint8).random_(0, 0x7F, generator=g)
            else:
                raise TypeError(f"fill_synthetic: no synthetic values for cache buffer {name} ({buf.dtype})")

    def nbytes(self) -> dict[str, int]:
        """Bytes actually allocated, by part: global (compressed KV + index keys), window,
        partial compressor groups, n-gram history."""
        out = {"global": 0, "window": 0, "groups": 0, "ngram": self.ngram.numel() * self.ngram.element_size()}
        for layer in self.layers:
            for part, store in (("global", layer.kv), ("global", layer.index_keys), ("window", layer.window)):
                if store is not None:
                    out[part] += sum(t.numel() * t.element_size() for t in store.buffers())
            if layer.has_group:
                out["groups"] += sum(t.numel() * t.element_size() for t in (layer.group_kv, layer.group_score))
        return out
