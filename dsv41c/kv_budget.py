"""KV memory accounting (spec §10.5, §11): what one sequence holds, per token and in total.

`kv_budget(args, context)` derives every figure from the config and the layer plan, for two
storage variants: `packed` (the V4.1 serving layouts: FP4+E4M3 compressed KV, MXFP4 index keys,
FP8 window rings) and `bf16` (the same entries unquantised, 2 bytes a value). The global state
(compressed KV and index keys of the kv sources) grows with the context and is what gets
persisted; the window rings, the ratio>=2 compressor partial groups and the n-gram tail are fixed
per sequence. For the released config: 890 B/token (720 KV + 170 index), 890 MiB at 2^20 tokens.

Pure arithmetic; runs anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from dsv41c.config import LayerRole, ModelArgs, build_layer_plan
from dsv41c.errors import InputError
from dsv41c.quant import packed_row_bytes

DEFAULT_CONTEXT = 2**20
BF16_BYTES = 2
FP32_BYTES = 4
TOKEN_ID_BYTES = 8  # int64 ids in the n-gram history


@dataclass(frozen=True)
class CacheFormat:
    """How one variant stores each cache's entries: a `packed_row_bytes` format, or None for bf16."""
    name: str
    kv: str | None          # compressed KV entry of head_dim values
    index_key: str | None   # index key of index_head_dim values
    window: str | None      # window-ring entry of head_dim values

    def entry_bytes(self, fmt: str | None, n: int) -> int:
        return n * BF16_BYTES if fmt is None else packed_row_bytes(fmt, n)


PACKED = CacheFormat("packed", kv="fp4_e4m3", index_key="mxfp4", window="fp8")
BF16 = CacheFormat("bf16", kv=None, index_key=None, window=None)


@dataclass(frozen=True)
class SourceBudget:
    """The global state one kv source stores: one entry per `ratio` tokens."""
    layer_id: int
    ratio: int
    readers: tuple[int, ...]     # layers attending over this source's compressed KV (itself included)
    kv_entry_bytes: int
    index_entry_bytes: int       # 0 when the source owns no index keys

    @property
    def owns_index_keys(self) -> bool:
        return self.index_entry_bytes > 0

    @property
    def kv_bytes_per_token(self) -> Fraction:
        return Fraction(self.kv_entry_bytes, self.ratio)

    @property
    def index_bytes_per_token(self) -> Fraction:
        return Fraction(self.index_entry_bytes, self.ratio)

    @property
    def bytes_per_token(self) -> Fraction:
        return self.kv_bytes_per_token + self.index_bytes_per_token

    def entries(self, context: int) -> int:
        # Only completed groups become entries; a partial group sits in the compressor state. (The
        # model's cache holds ceil(max_seq_len / ratio) rows: one more when max_seq_len is not a
        # multiple of the ratio, for the open group's provisional entry.)
        return context // self.ratio

    def bytes_at(self, context: int) -> int:
        return self.entries(context) * (self.kv_entry_bytes + self.index_entry_bytes)


@dataclass(frozen=True)
class CacheBudget:
    """Every cache of one sequence in one storage variant."""
    format: CacheFormat
    context: int
    sources: tuple[SourceBudget, ...]
    window_size: int
    window_entry_bytes: int
    backbone_layers: int
    dspark_stages: int
    partial_group_bytes: int     # fp32 in every variant (exactness, spec §6.4)
    ngram_tail_ids: int          # last engram_max_ngram_size - 1 ids; 0 without engram

    @property
    def ngram_tail_bytes(self) -> int:
        return self.ngram_tail_ids * TOKEN_ID_BYTES

    @property
    def kv_bytes_per_token(self) -> Fraction:
        return sum((s.kv_bytes_per_token for s in self.sources), Fraction(0))

    @property
    def index_bytes_per_token(self) -> Fraction:
        return sum((s.index_bytes_per_token for s in self.sources), Fraction(0))

    @property
    def bytes_per_token(self) -> Fraction:
        """Global (length-proportional) state per token of context."""
        return self.kv_bytes_per_token + self.index_bytes_per_token

    @property
    def global_bytes(self) -> int:
        return sum(s.bytes_at(self.context) for s in self.sources)

    @property
    def backbone_window_bytes(self) -> int:
        return self.backbone_layers * self.window_size * self.window_entry_bytes

    @property
    def dspark_window_bytes(self) -> int:
        return self.dspark_stages * self.window_size * self.window_entry_bytes

    @property
    def window_bytes(self) -> int:
        return self.backbone_window_bytes + self.dspark_window_bytes

    @property
    def fixed_bytes(self) -> int:
        """Per-sequence state independent of the context length."""
        return self.window_bytes + self.partial_group_bytes + self.ngram_tail_bytes

    @property
    def total_bytes(self) -> int:
        return self.global_bytes + self.fixed_bytes

    @property
    def persistent_bytes_per_token(self) -> Fraction:
        # Only the global state is persisted; the window rings are rebuilt by replay (spec §12).
        return self.bytes_per_token

    @property
    def persistent_bytes(self) -> int:
        return self.global_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format.name,
            "sources": [{
                "layer_id": s.layer_id, "ratio": s.ratio, "readers": list(s.readers),
                "kv_entry_bytes": s.kv_entry_bytes, "index_entry_bytes": s.index_entry_bytes,
                "kv_bytes_per_token": _number(s.kv_bytes_per_token),
                "index_bytes_per_token": _number(s.index_bytes_per_token),
                "bytes_per_token": _number(s.bytes_per_token),
                "entries": s.entries(self.context), "bytes": s.bytes_at(self.context),
            } for s in self.sources],
            "kv_bytes_per_token": _number(self.kv_bytes_per_token),
            "index_bytes_per_token": _number(self.index_bytes_per_token),
            "bytes_per_token": _number(self.bytes_per_token),
            "global_bytes": self.global_bytes,
            "window_entry_bytes": self.window_entry_bytes,
            "backbone_window_bytes": self.backbone_window_bytes,
            "dspark_window_bytes": self.dspark_window_bytes,
            "partial_group_bytes": self.partial_group_bytes,
            "ngram_tail_bytes": self.ngram_tail_bytes,
            "fixed_bytes": self.fixed_bytes,
            "total_bytes": self.total_bytes,
            "persistent_bytes_per_token": _number(self.persistent_bytes_per_token),
            "persistent_bytes": self.persistent_bytes,
        }


@dataclass(frozen=True)
class KVBudget:
    """Memory of one sequence of `context` tokens: the packed layouts, their bf16 twin, and the
    naive baseline (every backbone layer caching one head_dim bf16 vector per token)."""
    context: int
    packed: CacheBudget
    bf16: CacheBudget
    naive_bytes_per_token: int

    @property
    def sources(self) -> tuple[SourceBudget, ...]:
        return self.packed.sources

    @property
    def bytes_per_token(self) -> Fraction:
        return self.packed.bytes_per_token

    # Ratios of global bytes per token; None for a config without compressed KV.
    @property
    def bf16_ratio(self) -> float | None:
        return _ratio(self.bf16.bytes_per_token, self.packed.bytes_per_token)

    @property
    def naive_ratio(self) -> float | None:
        return _ratio(self.naive_bytes_per_token, self.packed.bytes_per_token)

    @property
    def naive_bf16_ratio(self) -> float | None:
        return _ratio(self.naive_bytes_per_token, self.bf16.bytes_per_token)

    def to_dict(self) -> dict[str, Any]:
        return {
            "context": self.context,
            "packed": self.packed.to_dict(),
            "bf16": self.bf16.to_dict(),
            "naive_bytes_per_token": self.naive_bytes_per_token,
            "ratios": {"bf16_over_packed": self.bf16_ratio, "naive_over_packed": self.naive_ratio,
                       "naive_over_bf16": self.naive_bf16_ratio},
        }


def kv_budget(args: ModelArgs, context: int = DEFAULT_CONTEXT) -> KVBudget:
    """The KV memory of one sequence holding `context` tokens (spec §11)."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise InputError(f"context: expected a token count >= 0, found {context!r}")
    plan = build_layer_plan(args)
    budgets = {fmt.name: _cache_budget(args, plan, fmt, context) for fmt in (PACKED, BF16)}
    return KVBudget(context=context, packed=budgets["packed"], bf16=budgets["bf16"],
                    naive_bytes_per_token=args.n_layers * args.head_dim * BF16_BYTES)


def _cache_budget(args: ModelArgs, plan: list[LayerRole], fmt: CacheFormat, context: int) -> CacheBudget:
    sources = tuple(
        SourceBudget(
            layer_id=role.layer_id,
            ratio=role.ratio,
            readers=tuple(r.layer_id for r in plan if r.kv_source == role.layer_id),
            kv_entry_bytes=fmt.entry_bytes(fmt.kv, args.head_dim),
            index_entry_bytes=fmt.entry_bytes(fmt.index_key, args.index_head_dim) if role.owns_index_keys else 0,
        )
        for role in plan if role.is_kv_source
    )
    # Values and scores, ratio slots each, per ratio>=2 kv source.
    partial = sum(2 * s.ratio * args.head_dim * FP32_BYTES for s in sources if s.ratio >= 2)
    ngram_tail = args.engram_max_ngram_size - 1 if args.engram_layer_ids else 0
    return CacheBudget(
        format=fmt, context=context, sources=sources,
        window_size=args.window_size, window_entry_bytes=fmt.entry_bytes(fmt.window, args.head_dim),
        backbone_layers=args.n_layers, dspark_stages=args.n_mtp_layers,
        partial_group_bytes=partial, ngram_tail_ids=ngram_tail,
    )


def _ratio(a: int | Fraction, b: int | Fraction) -> float | None:
    return float(Fraction(a) / b) if b else None


def _number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)
